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
    out = app("config=quickstart", "sweep.bogus=1", cwd=tmp_path)
    assert out.returncode != 0 and "sweep.bogus" in out.stdout + out.stderr


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
    assert len(runs) == 2
    lengths = sorted({json.loads(line)["seq_len"] for run in runs for line in (run / "trials.jsonl").open()})
    assert lengths == [32, 48]
    for run in runs:
        rows = [json.loads(line) for line in (run / "trials.jsonl").open()]
        assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
    assert len(list((tmp_path / "multirun" / ".submitit").glob("*/*_log.out"))) == 2


def test_only_sweep_files_are_config_options():
    """Topologies, model shapes and length distributions beside the sweeps are pieces, not options."""
    from suite.hydra_app import sweep_files

    names = sweep_files()
    assert "quickstart" in names and "paper/usp_grid" in names
    assert not [n for n in names if n.split("/")[0] in ("models", "topologies", "documents")], names
