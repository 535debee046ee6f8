"""The harness at the main sweep's scale: linear cost, one writer per run folder, a damaged store,
limits checked before anything starts. Sweeps here run on the simulator (no processes)."""

import json
import os
import warnings

import pytest

from suite import metrics as M
from suite import results
from suite.cli import main
from suite.env import busy_note
from suite.records import check_columns
from suite.results import ResultsStore

SIM = """
name: {name}
sweep: {{methods: [ring, ulysses], world_size: [2], seq_len: [64, 128], heads: [4], kv_heads: [4], head_dim: [16],
        dtype: [bfloat16], causal: [true], passes: [fwd]}}
run: {{executor: sim}}
sim: {{topology: [h100_sxm]}}
tracking: {{mlflow: false}}
"""


def _sweep(write_config, tmp_path, name="small", *args):
    path = write_config(SIM.format(name=name), name=f"{name}.yaml")
    rc = main(["run", str(path), "--no-progress", *args])
    runs = sorted((tmp_path / "results" / name).glob("*")) if (tmp_path / "results" / name).exists() else []
    return rc, path, runs


# -- linear cost ------------------------------------------------------------------------------------
def test_every_trial_key_is_hashed_and_its_method_built_once_per_sweep(write_config, tmp_path, monkeypatch):
    """The plan, the resume filter and the post-sweep bookkeeping all ask for keys: a key computed
    on every ask made the post-sweep step quadratic in the sweep (an hour at 6,608 trials). The
    parent builds a trial's method once, to ask `supports`: the row takes the padded length from
    the ranks' reports (`RankReport.padded_len`) instead of building it again."""
    import hashlib
    import types

    from suite.plan import TrialSpec

    calls, built = [], []
    counting = types.SimpleNamespace(sha256=lambda data: calls.append(1) or hashlib.sha256(data))
    monkeypatch.setattr("suite.plan.hashlib", counting)
    build = TrialSpec.build_method
    monkeypatch.setattr(TrialSpec, "build_method", lambda spec: built.append(spec.label()) or build(spec))
    rc, _, runs = _sweep(write_config, tmp_path)
    assert rc == 0 and len(runs) == 1
    assert len(calls) == 4  # 4 trials, each hashed once
    assert len(built) == 4 and len(set(built)) == 4  # and each built once
    assert [r[M.PADDED_TOKENS] for r in ResultsStore.open(runs[0]).records()] == [0] * 4


def test_planning_checks_layout_sizes_without_building_positions(monkeypatch):
    """`supports` at a million tokens must not build position tensors (planning asks thousands of
    times); the positions are still built, and right, when asked for."""
    import torch

    import methods
    from methods import layouts
    from methods.base import Case

    case = Case(
        batch=1,
        seq_len=1 << 20,
        heads=8,
        kv_heads=8,
        head_dim=64,
        dtype="bfloat16",
        causal=True,
        world_size=8,
        device="cpu",
    )

    def no_arange(*a, **k):
        raise AssertionError("planning built a position tensor")

    real_arange = torch.arange
    monkeypatch.setattr(torch, "arange", no_arange)
    for name in ("ring", "zigzag_ring", "ulysses", "usp", "stripe_ring"):
        if name in methods.available():
            assert methods.get_method(name).supports(case) == (True, ""), name
    bad = Case(**{**case.__dict__, "seq_len": (1 << 20) + 8})
    assert not methods.get_method("zigzag_ring").supports(bad)[0]  # sizes are still checked
    monkeypatch.setattr(torch, "arange", real_arange)
    lay = layouts.make("zigzag", 12, 3)
    assert lay.positions(0).tolist() == [0, 1, 10, 11] and lay.local_len(2) == 4


def test_usp_at_ring_degree_one_takes_any_length_ulysses_takes():
    import methods
    from methods.base import Case

    case = Case(
        batch=1, seq_len=777, heads=6, kv_heads=3, head_dim=8, dtype="float64", causal=True, world_size=3, device="cpu"
    )
    assert methods.get_method("ulysses").supports(case) == (True, "")
    usp = methods.get_method("usp", ulysses_degree=3)
    assert usp.degrees(case) == (3, 1) and usp.supports(case) == (True, "") and usp.padded_len(case) == 777
    import torch

    from methods.comm.threads import run_threads
    from suite.check import ProblemCache
    from suite.plan import RunSettings, TrialSpec
    from suite.trial import run_trial

    spec = TrialSpec(
        method="usp",
        impl="own",
        executor="threads",
        hardware="cpu",
        topology="",
        world_size=3,
        nodes=1,
        ulysses_degree=3,
        ring_degree=1,
        batch=1,
        seq_len=777,
        heads=6,
        kv_heads=3,
        head_dim=8,
        dtype="float64",
        causal=True,
        pass_="fwd_bwd",
        kernel="math",
        options='{"ulysses_degree": 3}',
    )
    settings = RunSettings(warmup=0, repeats=1, check=True, check_max_seq_len=1 << 20, seed=0, breakdown=False)
    cache = ProblemCache()
    reports = run_threads(3, lambda comm: run_trial(spec, settings, comm, torch.device("cpu"), cache))
    assert all(rep.ok and len(rep.errors) == 5 for rep in reports), reports
    cols, bad = check_columns(reports)  # checked against float64 on the unsharded input
    assert not bad and all(cols[f"err_{n}"] <= cols[f"tol_{n}"] for n in reports[0].errors), cols


# -- one writer per folder --------------------------------------------------------------------------
def test_a_second_writer_is_refused_naming_the_holder(write_config, tmp_path, capsys):
    rc, path, runs = _sweep(write_config, tmp_path)
    holder = ResultsStore(runs[0]).lock()  # a sweep still writing the folder
    try:
        with pytest.raises(results.StoreLocked, match=f"pid {os.getpid()}"):
            ResultsStore(runs[0]).lock()
        assert main(["run", str(path), "--resume", "--no-progress"]) == 2
        assert f"being written by another sweep (pid {os.getpid()})" in capsys.readouterr().err
    finally:
        holder.unlock()
    assert main(["run", str(path), "--resume", "--no-progress"]) == 0  # the lock ends with its holder


def test_resume_refuses_changed_result_settings_unless_forced(write_config, tmp_path, capsys):
    rc, path, runs = _sweep(write_config, tmp_path)
    capsys.readouterr()
    assert main(["run", str(path), "--resume", str(runs[0]), "run.repeats=3", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run.repeats: 10 recorded, 3 now" in err and "--force" in err
    assert main(["run", str(path), "--resume", str(runs[0]), "name=other", "--no-progress"]) == 2
    assert "name: 'small' recorded, 'other' now" in capsys.readouterr().err
    assert not (runs[0] / "resumes.jsonl").exists()
    assert main(["run", str(path), "--resume", str(runs[0]), "--force", "run.seed=5", "--no-progress"]) == 0
    entry = json.loads((runs[0] / "resumes.jsonl").read_text())
    assert entry["changed"] == {"run.seed": {"recorded": 0, "now": 5}}


def test_resume_of_a_folder_with_other_sweep_axes_is_refused_or_forced_and_recorded(write_config, tmp_path, capsys):
    """A folder run with fewer axis values (one job of a multirun) is no place for the other trials:
    its config.yaml would contradict its rows."""
    rc, path, runs = _sweep(write_config, tmp_path, "small", "sweep.methods=[ring]", "sweep.seq_len=[64]")
    assert rc == 0 and len(ResultsStore(runs[0]).records()) == 1
    capsys.readouterr()
    assert main(["run", str(path), "--resume", str(runs[0]), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --resume: ")
    assert "sweep.methods: ['ring'] recorded, ['ring', 'ulysses'] now" in err
    assert "sweep.seq_len: [64] recorded, [64, 128] now" in err
    assert "start a new run (no --resume)" in err and "--force" in err and "resumes.jsonl" in err
    assert len(ResultsStore(runs[0]).records()) == 1 and not (runs[0] / "resumes.jsonl").exists()
    # settings that never change a row (where it is logged, how long a trial may take) may change
    assert main(["run", str(path), "--resume", str(runs[0]), "--force", "--no-progress"]) == 0
    assert len(ResultsStore(runs[0]).records()) == 4
    entry = json.loads((runs[0] / "resumes.jsonl").read_text())
    assert set(entry["changed"]) == {"sweep.methods", "sweep.seq_len"}
    assert entry["changed"]["sweep.methods"] == {"recorded": ["ring"], "now": ["ring", "ulysses"]}


def test_resume_of_a_folder_ignores_settings_that_never_change_rows(write_config, tmp_path, capsys):
    rc, path, runs = _sweep(write_config, tmp_path, "small", "sweep.seq_len=[64]")
    more = ["run.timeout_s=99", "description=again", "tracking.experiment=elsewhere"]
    assert main(["run", str(path), "--resume", str(runs[0]), "sweep.seq_len=[64]", *more, "--no-progress"]) == 0
    assert not (runs[0] / "resumes.jsonl").exists()


def test_resume_without_a_folder_takes_the_newest_folder_whose_config_matches(write_config, tmp_path, capsys):
    """The newest folder of the name is a one-trial job of a multirun: not this sweep's."""
    rc, path, runs = _sweep(write_config, tmp_path)
    ResultsStore(runs[0]).trials_path.write_text("")  # the full sweep, interrupted before any trial
    _sweep(write_config, tmp_path, "small", "sweep.methods=[ring]", "sweep.seq_len=[64]")
    newest = next(p for p in (tmp_path / "results" / "small").iterdir() if p != runs[0])
    assert ResultsStore.latest(tmp_path / "results", "small").run_dir == newest
    assert len(ResultsStore(newest).records()) == 1
    capsys.readouterr()
    assert main(["run", str(path), "--resume", "--no-progress"]) == 0
    assert str(runs[0]) in capsys.readouterr().out
    assert len(ResultsStore(runs[0]).records()) == 4 and len(ResultsStore(newest).records()) == 1
    assert not list((tmp_path / "results" / "small").glob("*/resumes.jsonl"))


def test_resume_without_a_folder_refuses_when_none_matches_naming_the_candidates(write_config, tmp_path, capsys):
    rc, path, runs = _sweep(write_config, tmp_path, "small", "sweep.methods=[ring]")
    capsys.readouterr()
    for args in (["--resume"], ["--resume", "--force"]):  # --force mixes settings only in a folder named
        assert main(["run", str(path), *args, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "no run folder of 'small'" in err and str(runs[0]) in err
        assert "sweep.methods: ['ring'] recorded, ['ring', 'ulysses'] now" in err
        assert "Start a new run (no --resume)" in err and "--resume RUN_DIR --force" in err
    assert len(ResultsStore(runs[0]).records()) == 2 and not (runs[0] / "resumes.jsonl").exists()
    assert len(list((tmp_path / "results" / "small").iterdir())) == 1  # nothing new either


def test_environment_json_records_the_machine_load_at_each_start_and_end(write_config, tmp_path, capsys, monkeypatch):
    """Load averages and CPU clock at the start and end of a sweep and of each resume; the console
    says the machine was busy when the start's 1-minute load reaches half the cores."""
    cores = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (4.0 * cores, 2.0, 1.0))
    rc, path, runs = _sweep(write_config, tmp_path)
    out = capsys.readouterr().out
    assert rc == 0 and f"machine load (1-minute average) {4.0 * cores:g} at the start" in out
    assert "BUSY" not in out and "a simulated sweep" in out  # this sweep predicts: nothing the load disturbs
    load = json.loads((runs[0] / "environment.json").read_text())["load"]
    assert [s["at"] for s in load] == ["start", "end"]
    assert all(s["loadavg"] == [4.0 * cores, 2.0, 1.0] and s["cpu_count"] == cores for s in load)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # an idle machine: no flag
    assert main(["run", str(path), "--resume", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "machine load (1-minute average) 0 at the start, 0 at the end" in out and "BUSY" not in out
    load = json.loads((runs[0] / "environment.json").read_text())["load"]
    assert [s["at"] for s in load] == ["start", "end", "start", "end"] and load[2]["loadavg"] == [0.0, 0.0, 0.0]
    # a measured sweep on that busy machine is flagged, on the same samples
    busy = [{**s, "loadavg": [4.0 * cores, 2.0, 1.0]} for s in load[:2]]
    assert "BUSY" in busy_note(busy) and "BUSY" not in busy_note(busy, measured=False)
    assert "BUSY" not in busy_note(load[2:])


def test_report_keeps_the_latest_row_of_a_key_and_says_so(write_config, tmp_path):
    from pathlib import Path

    from suite.reports.load import load_runs

    rc, path, runs = _sweep(write_config, tmp_path)
    lines = (runs[0] / "trials.jsonl").read_text().splitlines()
    again = dict(json.loads(lines[0]), reason="the later row")
    with open(runs[0] / "trials.jsonl", "a") as f:
        f.write(json.dumps(again) + "\n")
    data = load_runs([Path(runs[0])])
    assert len(data.frame) == 4 and len(set(data.frame["key"])) == 4
    assert (data.frame.set_index("key").loc[again["key"], "reason"]) == "the later row"
    assert any("1 row(s) of keys recorded twice were dropped" in n for n in data.notes)


# -- a damaged store --------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [b"garbage\n", b"\x00\x00\x00\n", b"\xff\xfe{\n", b"{}\n", b"[1, 2]\n"])
def test_a_damaged_line_is_skipped_with_file_and_line_and_the_sweep_goes_on(write_config, tmp_path, bad, capsys):
    rc, path, runs = _sweep(write_config, tmp_path)
    trials = runs[0] / "trials.jsonl"
    lines = trials.read_bytes().splitlines(keepends=True)
    trials.write_bytes(b"".join(lines[:2]) + bad + b"".join(lines[3:]))  # row 3 replaced by damage
    with pytest.warns(RuntimeWarning, match=f"{trials}:3: "):
        rows = ResultsStore(runs[0]).records()
    assert len(rows) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert main(["run", str(path), "--resume", "--no-progress"]) == 0  # the lost trial runs again
        assert "damaged line(s)" in capsys.readouterr().out
        rows = ResultsStore(runs[0]).records()
    assert len(rows) == 4 and rows[-1][M.KEY] == json.loads(lines[2])[M.KEY]


def test_a_report_over_many_sweeps_skips_an_unreadable_one(write_config, tmp_path):
    from suite.reports.load import load_runs

    _sweep(write_config, tmp_path, "first")
    _, _, runs = _sweep(write_config, tmp_path, "second")
    (runs[0] / "environment.json").write_bytes(b"\xff not json")
    data = load_runs(sorted((tmp_path / "results").glob("*/*")))
    assert len(data.frame) == 4 and set(data.frame["sweep"]) == {"first"}
    assert any("second" in n and "skipped, it cannot be read" in n for n in data.notes)


# -- limits checked before start --------------------------------------------------------------------
QUICK = (
    "name: {name}\nsweep: {{methods: [ring], world_size: [2], seq_len: [32], heads: [2], kv_heads: [2], "
    "head_dim: [8], causal: [true], passes: [fwd]}}\nrun: {{device: cpu}}\ntracking: {{mlflow: false}}\n"
)


@pytest.mark.parametrize(
    "override, words",
    [
        ("sweep.world_size=[1024]", ["sweep.world_size", "run.max_ranks_per_core"]),
        ("run.timeout_s=inf", ["run.timeout_s", "finite"]),
        ("run.startup_timeout_s=nan", ["run.startup_timeout_s", "finite"]),
        ("name=" + "n" * 101, ["name", "at most 100"]),
        ("sweep.exclude=[{method: ring}]", ["sweep.exclude", "every trial"]),
    ],
)
def test_limits_are_one_line_errors_before_anything_starts(write_config, tmp_path, capsys, override, words):
    path = write_config(QUICK.format(name="limits"))
    assert main(["run", str(path), override, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "results").exists()


def test_oversubscribing_is_an_explicit_choice(write_config, monkeypatch):
    import suite.executors.local as local
    from suite.config import ConfigError, load_config
    from suite.executors import make_executor

    monkeypatch.setattr(local, "available_cores", lambda: 2)
    cfg, _ = load_config(write_config(QUICK.format(name="over")), ["sweep.world_size=[8]"])
    with pytest.raises(ConfigError, match="8.*2 cores x run.max_ranks_per_core 2 = 4 ranks"):
        make_executor(cfg)
    cfg, _ = load_config(write_config(QUICK.format(name="over")), ["sweep.world_size=[8]", "run.max_ranks_per_core=4"])
    make_executor(cfg).close()


def test_a_yaml_alias_bomb_is_refused_before_it_is_expanded(tmp_path):
    from suite.config import ConfigError, load_config

    levels = ["a0: &a0 [x, x, x, x, x, x, x, x]"]
    for i in range(1, 7):  # 8^7 nodes once expanded, from a few hundred bytes
        levels.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 8) + "]")
    path = tmp_path / "bomb.yaml"
    path.write_text("name: bomb\n" + "\n".join(levels) + "\n")
    with pytest.raises(ConfigError, match="expands to [0-9]+ nodes through its aliases"):
        load_config(path)


def test_an_unwritable_results_root_and_a_full_disk_are_one_line_errors(write_config, tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    path = write_config(SIM.format(name="disk"))
    assert main(["run", str(path), f"results.root={blocker}", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cannot create the run folder" in err and "results.root" in err and "Traceback" not in err

    import errno

    import suite.results as results_module

    real_write, writes = os.write, []

    def full_disk(fd, data):  # the third row: half of it is written, then the disk is full
        writes.append(1)
        if len(writes) == 3:
            real_write(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(results_module.os, "write", full_disk)
    assert main(["run", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and "every earlier row is complete" in err and "--resume" in err
    run_dir = next((tmp_path / "results" / "disk").iterdir())
    data = (run_dir / "trials.jsonl").read_bytes()
    assert data.count(b"\n") == 2 and data.endswith(b"\n")  # the partial line was cut back
    monkeypatch.setattr(results_module.os, "write", real_write)
    assert main(["run", str(path), "--resume", "--no-progress"]) == 0
    assert len(ResultsStore(run_dir).records()) == 4


def test_cuda_without_a_gpu_is_one_line(write_config, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    path = write_config(QUICK.format(name="nocuda"))
    assert main(["run", str(path), "run.device=cuda", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "Traceback" not in err


# -- workers and the rendezvous ---------------------------------------------------------------------
PARENT_DIES_IN_STARTUP = """
import sys, time
from suite.executors import local
from suite.executors.worker import WorkerSettings
from suite.plan import RunSettings

def hold(self, timeout_s):  # the parent is killed while its workers connect
    print(" ".join(str(p.pid) for p in self._procs), flush=True)
    time.sleep(3600)
local.LocalGroup._wait_ready = hold
run = RunSettings(warmup=0, repeats=1, check=False, check_max_seq_len=1, seed=0)
local.LocalGroup(WorkerSettings(world_size=2, device="cpu", backend="gloo", threads=1, plugins=(),
                                comm_timeout_s=600, run=run), startup_timeout_s=600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc (Linux)")
def test_workers_exit_when_the_parent_dies_during_start_up():
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT_DIES_IN_STARTUP], cwd=root, stdout=subprocess.PIPE, text=True
    )
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2
    os.kill(parent.pid, signal.SIGKILL)  # workers are spawned, importing or connecting
    parent.wait()
    deadline = time.monotonic() + 60  # generous for a loaded machine; before, they waited 10 minutes
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"workers {left} outlived their parent"


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc/net (Linux)")
def test_the_rendezvous_store_listens_on_loopback_only():
    from suite.executors import local
    from suite.executors.worker import WorkerSettings
    from suite.plan import RunSettings

    group = object.__new__(local.LocalGroup)  # only the store: no workers
    seen = {}

    class Stop(Exception):
        pass

    def no_workers(*a, **k):
        raise Stop

    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    orig = ctx.Process
    try:
        ctx.Process = no_workers  # type: ignore[method-assign]
        run = RunSettings(warmup=0, repeats=1, check=False, check_max_seq_len=1, seed=0)
        with pytest.raises(Stop):
            local.LocalGroup.__init__(
                group,
                WorkerSettings(
                    world_size=2, device="cpu", backend="gloo", threads=1, plugins=(), comm_timeout_s=5, run=run
                ),
                5,
            )
    finally:
        ctx.Process = orig  # type: ignore[method-assign]
    port = group._store.port
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            for line in open(table).read().splitlines()[1:]:
                f = line.split()
                if f[1].endswith(f":{port:04X}") and f[3] == "0A":  # 0A: LISTEN
                    seen[table] = f[1].split(":")[0]
    group._listener.close() if hasattr(group, "_listener") else None
    assert seen == {"/proc/net/tcp": "0100007F"}, seen  # 127.0.0.1, and no [::] or 0.0.0.0 listener


# -- checks -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("seq_len", [40, 130])
def test_float64_tolerance_grows_with_the_reduction_length(seq_len):
    """The CPU flash kernel in float64 rounds 15-30 eps at these lengths (D = 80): correct, and
    recorded `incorrect` by a fixed 8-eps floor. A real error (one key dropped) still fails."""
    import torch

    import methods
    from methods.comm.threads import run_threads
    from suite.check import ProblemCache, build_problem
    from suite.plan import RunSettings, TrialSpec
    from suite.trial import run_trial

    spec = TrialSpec(
        method="reference",
        impl="own",
        executor="threads",
        hardware="cpu",
        topology="",
        world_size=1,
        nodes=1,
        ulysses_degree=1,
        ring_degree=1,
        batch=3,
        seq_len=seq_len,
        heads=12,
        kv_heads=3,
        head_dim=80,
        dtype="float64",
        causal=False,
        pass_="fwd_bwd",
        kernel="cpu_flash",
    )
    settings = RunSettings(warmup=0, repeats=1, check=True, check_max_seq_len=1 << 20, seed=0, breakdown=False)
    if not methods.kernels.kernel_status("cpu_flash")[0]:
        pytest.skip("no CPU flash kernel in this torch")
    (report,) = run_threads(1, lambda comm: run_trial(spec, settings, comm, torch.device("cpu"), ProblemCache()))
    assert report.ok, report.error
    cols, bad = check_columns([report])
    assert len(report.errors) == 5 and not bad, cols
    problem = build_problem(*spec.problem_key().args, seed=0, device=torch.device("cpu"), with_reference=True)
    out = problem.ref["out"].clone()
    out[:, -1] += 1e-12  # an error far below any real bug, far above the float64 roundings
    assert float((out - problem.ref["out"]).abs().max()) > problem.tolerance("out", 1)


def test_the_environment_fingerprint_records_an_allowlist_not_prefixes(monkeypatch):
    from suite.env import fingerprint

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("TORCH_HUB_TOKEN", "secret-token")
    monkeypatch.setenv("CUDA_SECRET_KEY", "secret-key")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://user:password@mlflow.example/")
    recorded = fingerprint("cpu")["env_vars"]
    assert recorded["OMP_NUM_THREADS"] == "3" and recorded["NCCL_ALGO"] == "Ring"
    assert "secret" not in json.dumps(recorded) and "password" not in json.dumps(recorded)


def test_the_report_command_says_what_reading_dropped(write_config, tmp_path, capsys):
    rc, path, runs = _sweep(write_config, tmp_path)
    with open(runs[0] / "trials.jsonl", "ab") as f:
        f.write(b"\x00garbage\n")
    capsys.readouterr()
    assert main(["report", str(runs[0]), "--out", str(tmp_path / "rep"), "--no-mlflow"]) == 0
    out = capsys.readouterr().out
    assert f"read: {runs[0] / 'trials.jsonl'}:5: not a JSON row" in out and "report of 4 trial rows" in out
