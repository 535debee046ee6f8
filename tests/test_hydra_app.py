"""`python -m suite.hydra_app`: a real Hydra application over the same schema as `suite run`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "sweep.methods=[ring,ulysses]",
    "sweep.world_size=2",
    "sweep.kv_heads=4",
    "sweep.causal=true",
    "sweep.passes=fwd",
    "sweep.batch=1",
    "sweep.heads=4",
    "sweep.head_dim=8",
    "run.executor=threads",
    "run.warmup=1",
    "run.repeats=1",
    "tracking.mlflow=false",
]


def app(*args, cwd=ROOT, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "suite.hydra_app", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def test_cfg_job_composes_a_sweep_file_with_scalar_add_and_remove_overrides(tmp_path):
    out = app(
        "config=quickstart",
        "sweep.seq_len=512",
        "+sweep.method_options.usp.ulysses_degree=2",
        "~run.timeout_s",
        "perplexity.lr=0.01",
        "--cfg",
        "job",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["name"] == "quickstart" and cfg["sweep"]["seq_len"] == 512
    assert cfg["sweep"]["method_options"] == {"usp": {"ulysses_degree": 2}}
    assert "timeout_s" not in cfg["run"] and cfg["perplexity"]["lr"] == 0.01


def test_config_errors_name_the_key(tmp_path):
    out = app("config=quickstart", "run.repeats=many", "cli.dry_run=true", cwd=tmp_path)
    assert out.returncode == 2 and "config error: config=quickstart: run.repeats:" in out.stderr
    # a key Hydra cannot place is refused by Hydra itself, before the app runs: the same exit code
    out = app("config=quickstart", "sweep.bogus=1", cwd=tmp_path)
    assert out.returncode == 2 and "sweep.bogus" in out.stdout + out.stderr
    out = app("config=no_such_sweep", cwd=tmp_path)
    assert out.returncode == 2 and "no_such_sweep" in out.stdout + out.stderr


@pytest.mark.slow
def test_multirun_over_axes_through_the_submitit_local_launcher(tmp_path):
    """`-m` makes one sweep per value; hydra-submitit-launcher's local launcher runs each as a job
    (the same code path as submitit_slurm on a cluster)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    out = app(
        "-m",
        "hydra/launcher=submitit_local",
        "config=quickstart",
        "sweep.seq_len=32,48",
        *TINY,
        f"results.root={tmp_path / 'results'}",
        f"hydra.sweep.dir={tmp_path / 'multirun'}",
        "cli.progress=false",
        cwd=tmp_path,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    runs = sorted((tmp_path / "results" / "quickstart").iterdir())
    assert len(runs) == 2  # two jobs of one multirun: two run folders
    lengths = sorted({json.loads(line)["seq_len"] for run in runs for line in (run / "trials.jsonl").open()})
    assert lengths == [32, 48]
    for run in runs:
        rows = [json.loads(line) for line in (run / "trials.jsonl").open()]
        assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
    assert len(list((tmp_path / "multirun" / ".submitit").glob("*/*_log.out"))) == 2
    # each job's summary is in its own output folder and on the console, naming its run folder
    for job, length in ((0, 32), (1, 48)):
        summary = (tmp_path / "multirun" / str(job) / "summary.txt").read_text()
        assert f"sweep.seq_len={length}" in summary.splitlines()[0] and summary.endswith("exit code 0\n")
        assert "2 trials: 2 ok" in summary and summary in out.stdout.replace(f"== job {job}: ", "")
    named = {str(run) for run in runs if f"results in {run}" in out.stdout}
    assert len(named) == 2
    assert "warning: hydra/launcher=submitit_local starts 2 jobs of this multirun at once" in out.stderr


def test_the_multirun_callback_warns_of_jobs_sharing_cores_and_prints_each_summary(tmp_path, capsys):
    from omegaconf import OmegaConf

    from suite.hydra_app import BASIC_LAUNCHER, LOCAL_LAUNCHER, JobSummaries, multirun_jobs

    assert multirun_jobs(["config=quickstart", "sweep.seq_len=32,48", "run.seed=range(3)", "run.repeats=2"]) == 6
    assert multirun_jobs(["config=quickstart,perplexity"]) == 2 and multirun_jobs(["run.seed=1"]) == 1

    def config(launcher, *task):
        return OmegaConf.create(
            {
                "hydra": {
                    "launcher": {"_target_": launcher},
                    "overrides": {"task": list(task)},
                    "sweep": {"dir": str(tmp_path)},
                }
            }
        )

    for launcher, task, warned in (
        (LOCAL_LAUNCHER, ["sweep.seq_len=32,48"], True),
        (LOCAL_LAUNCHER, ["sweep.seq_len=32"], False),  # one job shares nothing
        (BASIC_LAUNCHER, ["sweep.seq_len=32,48"], False),  # one after another
    ):
        JobSummaries().on_multirun_start(config(launcher, *task))
        err = capsys.readouterr().err
        assert ("starts 2 jobs of this multirun at once" in err) == warned and err.count("\n") == int(warned)

    callback = JobSummaries()
    callback.on_multirun_start(config(LOCAL_LAUNCHER))
    capsys.readouterr()
    for job in (1, 0, 10):
        (tmp_path / str(job)).mkdir()
        (tmp_path / str(job) / "summary.txt").write_text(f"sweep.seq_len={job}\nthe table of job {job}\nexit code 0\n")
    callback.on_multirun_end(config(LOCAL_LAUNCHER))
    out = capsys.readouterr().out
    assert out.index("the table of job 0") < out.index("the table of job 1") < out.index("the table of job 10")
    callback.on_multirun_end(config(BASIC_LAUNCHER))  # the console already showed the tables
    out = capsys.readouterr().out
    assert "the table" not in out and f"job 10: exit code 0; summary in {tmp_path / '10' / 'summary.txt'}" in out


def test_only_sweep_files_are_config_options():
    """Topologies, model shapes and length distributions beside the sweeps are pieces, not options."""
    from suite.hydra_app import sweep_files

    names = sweep_files()
    assert "quickstart" in names and "paper/usp_grid" in names
    assert not [n for n in names if n.split("/")[0] in ("models", "topologies", "documents")], names
