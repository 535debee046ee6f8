"""End-to-end sweeps through the real harness: processes over gloo, results store, MLflow,
and every failure behaviour of docs/DESIGN.md section 11."""

import json
import os
import signal
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import pytest

from suite import metrics as M
from suite.config import load_config
from suite.results import ResultsStore
from suite.runner import run_sweep

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def sweep(path, *overrides, resume=None):
    cfg, text = load_config(path, list(overrides))
    return run_sweep(cfg, text, resume=resume, progress=False, out=open(os.devnull, "w"))


def test_multiprocess_sweep_is_checked_recorded_and_logged_to_mlflow(write_config, tmp_path):
    db = tmp_path / "mlflow.db"
    path = write_config(f"""
    name: e2e
    sweep:
      methods: [reference, ring, ulysses]
      world_size: [1, 2, 3]
      batch: [2]
      seq_len: [48]
      heads: [4]
      kv_heads: [4, 2]
      head_dim: [8]
      causal: [true, false]
      passes: [fwd, fwd_bwd]
      exclude: [{{method: reference, world_size: [2, 3]}}]
    run: {{warmup: 1, repeats: 3, timeout_s: 60}}
    tracking: {{uri: "sqlite:///{db}"}}
    """)
    res = sweep(path)
    recs = res.records
    assert len(recs) == 56 and len({r["key"] for r in recs}) == 56  # 3x3x2x2x2 - 16
    by = {(r["method"], r["world_size"], r["kv_heads"], r["causal"], r["pass"]): r for r in recs}
    for r in recs:
        assert r["executor"] == "dist" and r["hardware"].startswith("cpu:")
        if r["method"] == "ulysses" and r["world_size"] == 3:  # 4 heads over 3 ranks
            assert r[M.STATUS] == M.SKIPPED and "heads divisible by the ulysses degree" in r[M.REASON]
            continue
        assert r[M.STATUS] == M.OK, r
        assert r[M.CHECKED] and r[M.ERR["out"]] <= r[M.TOL["out"]] and r[M.ERR["lse"]] is not None
        assert (r[M.ERR["dq"]] is not None) == (r["pass"] == "fwd_bwd")
        assert len(r[M.TIME_MS_SAMPLES]) == 3
        assert r[M.PEAK_MEM] > 0 and r[M.KERNEL_MS] > 0 and r[M.OVERHEAD_RATIO] >= 1.0 - 1e-9
        assert r[M.TIME_MS_MIN] <= r[M.TIME_MS_MEDIAN] <= r[M.TIME_MS_MAX] and r[M.TFLOPS_PER_GPU] > 0
        assert (r[M.BYTES_SENT] > 0) == (r["world_size"] > 1)
    # ring at P=2: K and V of 24 tokens, 2 KV heads, D 8, fp32, batch 2 -> 2*2*24*2*8*4 bytes forward
    assert by[("ring", 2, 2, True, "fwd")][M.BYTES_SENT] == 2 * 2 * 24 * 2 * 8 * 4
    # the store: resolved config, environment, JSON lines and parquet with the same rows
    run_dir = res.run_dir
    assert (run_dir / "config.yaml").exists() and json.loads((run_dir / "environment.json").read_text())["torch"]
    import pandas as pd

    assert len(pd.read_parquet(run_dir / "trials.parquet")) == 56
    # MLflow: one parent run, one nested child per trial, identity in params, numbers in metrics
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name("e2e")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(parents) == 1 and len(children) == 56
    assert parents[0].info.status == "FINISHED"
    ok_child = next(c for c in children if c.data.params["method"] == "ring" and c.data.tags["status"] == "ok")
    assert {"time_ms_median", "err_out", "bytes_sent_per_rank"} <= set(ok_child.data.metrics)
    assert len(client.get_metric_history(ok_child.info.run_id, "samples/time_ms")) == 3
    assert "time_ms" not in ok_child.data.metrics  # the samples are a series apart from the summary metrics
    arts = {a.path for a in client.list_artifacts(parents[0].info.run_id, "results")}
    assert {"results/trials.jsonl", "results/config.yaml"} <= arts
    # a report from the results folder is attached to the sweep's parent run; and the MLflow
    # experiment alone can be read back into a report with the same rows
    from suite.reports import build_report

    rep = build_report([str(run_dir)], out=tmp_path / "rep")
    assert rep.logged_to == [parents[0].info.run_id]
    assert [a.path for a in client.list_artifacts(parents[0].info.run_id, "report")] == [
        "report/figures",
        "report/report.html",
    ]
    assert len(client.list_artifacts(parents[0].info.run_id, "report/figures")) == len(
        [f for f in rep.figures if f.endswith(".png")]
    )
    from_mlflow = build_report(
        None, out=tmp_path / "rep2", mlflow_experiment="e2e", mlflow_uri=f"sqlite:///{db}", log_to_mlflow=False
    )
    assert from_mlflow.rows == 56 and (tmp_path / "rep2" / "tables" / "speedup_over_ring.csv").exists()


def test_failures_hangs_deaths_and_wrong_answers_are_recorded_and_the_sweep_goes_on(write_config):
    path = write_config("""
    name: faults
    sweep:
      methods: [faulty, hanging, dying, wrong, ring]
      world_size: [2]
      seq_len: [32]
      heads: [2]
      kv_heads: [2]
      head_dim: [8]
      causal: [true]
      passes: [fwd]
    run: {warmup: 1, repeats: 2, timeout_s: 8, fail_grace_s: 2, breakdown: false, plugins: [tests.plugins.faulty]}
    tracking: {mlflow: false}
    """)
    res = sweep(path)
    status = {r["method"]: r for r in res.records}
    assert status["faulty"][M.STATUS] == M.FAILED
    assert "rank 1: RuntimeError: injected failure on rank 1" in status["faulty"][M.REASON]
    assert "injected failure" in status["faulty"][M.ERROR_TRACE]
    assert status["hanging"][M.STATUS] == M.TIMEOUT and "run.timeout_s" in status["hanging"][M.REASON]
    assert status["dying"][M.STATUS] == M.FAILED and "exited with code 17" in status["dying"][M.REASON]
    assert status["wrong"][M.STATUS] == M.INCORRECT and "out: error" in status["wrong"][M.REASON]
    assert status["ring"][M.STATUS] == M.OK  # a fresh group after all that
    # the row's duration covers the 8 s limit the hang ran into (a lower bound: load only adds to it)
    assert status["hanging"][M.DURATION_S] >= 8


def test_killed_sweep_resumes_without_rerunning_or_losing_trials(write_config, tmp_path):
    path = write_config("""
    name: killme
    sweep:
      methods: [slow]
      world_size: [2]
      seq_len: [16, 32, 48]
      heads: [2]
      kv_heads: [2]
      head_dim: [8]
      causal: [true, false]
      passes: [fwd, fwd_bwd]
    run: {warmup: 1, repeats: 1, breakdown: false, plugins: [tests.plugins.faulty]}
    """)
    proc = subprocess.Popen(
        [sys.executable, "-m", "suite", "run", str(path), "--no-progress"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    trials = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = list((tmp_path / "results" / "killme").glob("*/trials.jsonl"))
        if found and found[0].read_text().count("\n") >= 3:
            trials = found[0]
            break
        time.sleep(0.2)
    assert trials is not None, "the sweep never recorded 3 trials"
    import psutil

    workers = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGKILL)  # a crash, not a polite stop
    proc.wait(timeout=30)
    before = trials.read_text().splitlines(keepends=True)
    before = [line for line in before if line.endswith("\n")]
    assert 3 <= len(before) < 12
    _, alive = psutil.wait_procs(workers, timeout=15)  # workers notice the parent is gone
    assert not alive, f"orphaned workers: {alive}"
    res = sweep(path, resume="latest")
    assert res.run_dir == trials.parent
    after = trials.read_text().splitlines(keepends=True)
    assert after[: len(before)] == before  # finished trials untouched, not rerun
    keys = [json.loads(line)["key"] for line in after]
    assert len(keys) == 12 and len(set(keys)) == 12
    assert all(json.loads(line)[M.STATUS] == M.OK for line in after)
    # MLflow, behind the store when the parent died, is reconciled by the resume: the same parent
    # run, one finished child per stored row
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("killme").experiment_id], max_results=100)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert [p.info.status for p in parents] == ["FINISHED"]
    assert sorted(c.data.tags[M.KEY] for c in children) == sorted(keys)
    assert {c.info.status for c in children} == {"FINISHED"}


def test_threads_executor_and_unreachable_mlflow(write_config):
    path = write_config("""
    name: threads
    sweep: {methods: [ring, ulysses], world_size: [1, 4], seq_len: [32], heads: [4], kv_heads: [2],
            head_dim: [8], causal: [true], passes: [fwd_bwd]}
    run: {executor: threads, warmup: 1, repeats: 2}
    tracking: {uri: "http://127.0.0.1:9"}
    """)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = sweep(path)
    assert any("MLflow disabled" in str(w.message) for w in caught)
    assert res.mlflow_disabled and len(res.records) == 4
    assert all(r[M.STATUS] == M.OK and r["executor"] == "threads" for r in res.records)
    assert ResultsStore.open(res.run_dir).completed_keys() == {r["key"] for r in res.records}


def test_external_launcher_torchrun(write_config, tmp_path):
    path = write_config("""
    name: ext
    sweep: {methods: [ring, ulysses], world_size: [1, 2], seq_len: [32], heads: [2], kv_heads: [2],
            head_dim: [8], causal: [true], passes: [fwd]}
    run: {warmup: 1, repeats: 2, timeout_s: 60}
    tracking: {mlflow: false}
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "suite",
            "run",
            str(path),
            "--no-progress",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    recs = ResultsStore.latest(tmp_path / "results", "ext").records()
    assert len(recs) == 4
    for r in recs:
        if r["world_size"] == 2:
            assert r[M.STATUS] == M.OK and r["executor"] == "dist" and r[M.BYTES_SENT] > 0
        else:
            assert r[M.STATUS] == M.SKIPPED and "own launch" in r[M.REASON]


def test_a_slow_reference_times_out_on_its_own_limit(write_config):
    """The float64 reference has its own limit (run.prepare_timeout_s), named in the reason."""
    path = write_config("""
    name: prep
    sweep: {methods: [ring], world_size: [2], seq_len: [128], heads: [2], kv_heads: [2], head_dim: [16],
            causal: [true], passes: [fwd]}
    run: {warmup: 0, repeats: 1, breakdown: false, timeout_s: 10, prepare_timeout_s: 1,
          plugins: [tests.plugins.slow_reference]}
    tracking: {mlflow: false}
    """)
    res = sweep(path)  # preparing takes 12 s (the plugin), over its 1 s limit
    assert res.records[0][M.STATUS] == M.TIMEOUT and "run.prepare_timeout_s" in res.records[0][M.REASON]


class _ScriptedResults:
    """A worker group's result queue on a fake clock: each message arrives `delay` fake seconds
    after the previous one; `get` waits (advancing the clock) at most its timeout, as a queue does."""

    def __init__(self, clock: list, script: list):
        self.clock, self.script = clock, list(script)

    def get(self, timeout: float):
        import queue

        timeout = max(timeout, 0.001)  # a real wait takes some time, even with a timeout of 0
        if not self.script:
            self.clock[0] += timeout
            raise queue.Empty
        delay, message = self.script[0]
        if delay > timeout:
            self.clock[0] += timeout
            self.script[0] = (delay - timeout, message)
            raise queue.Empty
        self.clock[0] += delay
        self.script.pop(0)
        return message


def _group_run(monkeypatch, script, *, timeout_s, prepare_timeout_s):
    """LocalGroup.run over two ranks with scripted messages on a fake clock (no processes, no waiting)."""
    import queue

    from suite.executors import local

    clock = [1000.0]
    monkeypatch.setattr(local, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    group = local.LocalGroup.__new__(local.LocalGroup)  # no worker processes
    group.world_size, group._procs = 2, []
    group._tasks = [queue.Queue(), queue.Queue()]
    group._results = _ScriptedResults(clock, script)
    spec = types.SimpleNamespace(key="k")
    return group.run(spec, timeout_s=timeout_s, grace_s=1.0, prepare_timeout_s=prepare_timeout_s)


def _script(prepare_s: float, trial_s: float) -> list:
    ok = types.SimpleNamespace(ok=True)
    return [
        (prepare_s, ("prepared", 0, "k", None)),
        (0.0, ("prepared", 1, "k", None)),
        (trial_s, ("report", 0, "k", ok)),
        (0.0, ("report", 1, "k", ok)),
    ]


def test_the_trial_limit_starts_once_every_rank_has_prepared(monkeypatch):
    """run.timeout_s counts from the moment every rank has its inputs and float64 reference: a
    12 s preparation and a 9 s trial pass a 10 s trial limit; an 11 s trial does not; a 12 s
    preparation fails a 1 s preparation limit. On a fake clock: no wall time is asserted."""
    outcome, healthy = _group_run(monkeypatch, _script(12.0, 9.0), timeout_s=10.0, prepare_timeout_s=300.0)
    assert outcome.kind == "reported" and healthy
    outcome, healthy = _group_run(monkeypatch, _script(12.0, 11.0), timeout_s=10.0, prepare_timeout_s=300.0)
    assert outcome.kind == "timeout" and "run.timeout_s" in outcome.message and not healthy
    outcome, healthy = _group_run(monkeypatch, _script(12.0, 1.0), timeout_s=10.0, prepare_timeout_s=1.0)
    assert outcome.kind == "timeout" and "run.prepare_timeout_s" in outcome.message and not healthy


def test_a_rank_reports_prepared_after_its_inputs_and_before_the_method_runs(monkeypatch):
    """The executors start the trial's limit at `on_prepared`: each rank calls it once, after the
    inputs and reference are built and before the method's first call."""
    import threading

    import torch

    import methods
    import suite.workloads.attention as attention
    from methods.comm import run_threads
    from suite.check import ProblemCache
    from suite.plan import RunSettings
    from suite.trial import run_trial
    from tests.test_trial import spec as trial_spec

    events: list[tuple[str, int]] = []
    build, ring = attention.build_sharded_problem, type(methods.get_method("ring"))
    forward = ring.forward

    def built(*args, **kwargs):
        problem = build(*args, **kwargs)
        events.append(("built", threading.get_ident()))
        return problem

    def counted_forward(self, *args, **kwargs):
        events.append(("method", threading.get_ident()))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(attention, "build_sharded_problem", built)
    monkeypatch.setattr(ring, "forward", counted_forward)
    settings = RunSettings(warmup=1, repeats=1, check=True, check_max_seq_len=1 << 20, seed=0, breakdown=False)
    reports = run_threads(
        2,
        lambda c: run_trial(
            trial_spec(pass_="fwd"),
            settings,
            c,
            torch.device("cpu"),
            ProblemCache(),
            on_prepared=lambda: events.append(("prepared", threading.get_ident())),
        ),
    )
    assert all(r.ok for r in reports), [r.traceback for r in reports]
    for thread in {t for _, t in events}:
        mine = [e for e, t in events if t == thread]
        assert mine.count("prepared") == 1 and mine.count("built") == 1 and "method" in mine
        assert mine.index("built") < mine.index("prepared") < mine.index("method")


def test_external_launcher_stops_every_rank_when_rank0_cannot_plan(write_config):
    path = write_config("""
    name: ext_nothing_to_resume
    sweep: {methods: [ring], world_size: [2], seq_len: [32], heads: [2], kv_heads: [2], head_dim: [8]}
    tracking: {mlflow: false}
    """)
    out = subprocess.run(  # the timeout ends a hang (ranks waiting for rank 0); it is not a speed limit
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "suite",
            "run",
            str(path),
            "--resume",
            "--no-progress",
        ],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode != 0  # torchrun returns once every rank has ended
    assert "no earlier run of 'ext_nothing_to_resume'" in out.stderr
