"""MLflow as a derived view of the results store (suite/tracking.py): runs that open on the
answer, reconciling with the store, the fresh-database race, credentials never recorded."""

import json
import os
import subprocess
import sys
import textwrap
import time
import warnings
from datetime import datetime
from pathlib import Path

import pytest

from suite import metrics as M
from suite.config import load_config
from suite.results import ResultsStore
from suite.runner import run_sweep

ROOT = Path(__file__).resolve().parents[1]

SWEEP = """
name: trk
sweep: {methods: [ring, usp], world_size: [2], seq_len: [32], heads: [4], kv_heads: [2], head_dim: [8],
        causal: [true, false], passes: [fwd]}
method_options: {}
run: {executor: threads, warmup: 1, repeats: 3}
tracking: {mlflow: false}
"""


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A small stored sweep (threads executor, no MLflow): 4 trials, usp with an option axis."""
    tmp = tmp_path_factory.mktemp("trk")
    cfg_path = tmp / "trk.yaml"
    cfg_path.write_text(
        SWEEP.replace("method_options: {}\n", "").replace(
            "passes: [fwd]}", "passes: [fwd],\n        method_options: {usp: {ulysses_degree: [2]}}}"
        )
    )
    cfg, text = load_config(cfg_path, [f"results.root={tmp / 'results'}"])
    res = run_sweep(cfg, text, progress=False, out=open(os.devnull, "w"))
    assert len(res.records) == 4
    return res.run_dir


def _client(db):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{db}")


def _runs(client, name="trk"):
    exp = client.get_experiment_by_name(name)
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return exp, parents, children


def test_runs_open_on_the_answer(stored, tmp_path):
    from suite.tracking import relog

    db = tmp_path / "m.db"
    tracker = relog(stored, uri=f"sqlite:///{db}")
    assert tracker.enabled, tracker.disabled_reason
    client = _client(db)
    exp, parents, children = _runs(client)
    records = {r[M.KEY]: r for r in ResultsStore.open(stored).iter_records()}
    assert len(parents) == 1 and len(children) == 4
    assert parents[0].info.end_time == max(c.info.end_time for c in children)  # relog: the sweep's end, not now
    # the experiment opens on the machine-learning runs table, and the link says so
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"
    assert (
        f"#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning&viewStateShareKey=trials" in tracker.link
    )
    from suite.tracking import run_link

    # a run page opens in the training view too (without workflowType MLflow 3 shows its GenAI pages)
    assert run_link(f"sqlite:///{db}", exp.experiment_id, "abc", "http://h:1") == (
        f"http://h:1/#/experiments/{exp.experiment_id}/runs/abc?workflowType=machine_learning"
    )
    view = json.loads(exp.tags["mlflow.sharedViewState.trials"])  # the saved view the link opens
    # no filter in the search box; ordered by a metric, MLflow shows the trials as flat rows
    assert "searchFilter" not in view and view["orderByKey"].startswith("metrics.")
    # the columns the view selects are tags every trial carries (the numbers written to be read)
    shown = {c[len("tags.`") : -1] for c in view["selectedColumns"] if c.startswith("tags.")}
    assert {"time ms", "err out", "peak memory", "run folder"} <= shown
    # the rate's tag names no GPU: the rows here ran on CPU processes (issue 39)
    assert "TFLOP/s per rank" in shown and not any("GPU" in c for c in shown)
    assert parents[0].data.tags["run folder"] == f"{stored.parent.name}/{stored.name}"
    assert len({c.info.run_name for c in children}) == 4
    for child in children:
        rec = records[child.data.tags[M.KEY]]
        # the run's Duration is the trial's: it starts at the trial's start and lasts its wall time
        start = int(datetime.fromisoformat(rec[M.STARTED_AT]).timestamp() * 1000)
        assert child.info.start_time == start
        assert child.info.end_time - child.info.start_time == round(rec[M.DURATION_S] * 1000)
        assert child.info.status == "FINISHED"
        # the trial hash is a tag (it finds the run again), not a param to compare runs by
        assert "key" not in child.data.params
        # summary metrics under their own names; the samples are a separate step series
        assert child.data.metrics[M.TIME_MS_MEDIAN] == rec[M.TIME_MS_MEDIAN] and "time_ms" not in child.data.metrics
        # which run folder it comes from (an experiment holds every run of its sweep), and its numbers as text
        # the runs table shows whole (a metric column cuts 4.28e-07 to "4.28336514..."); the metrics stay exact
        assert child.data.tags["run folder"] == f"{stored.parent.name}/{stored.name}"
        assert (
            child.data.tags["err out"] == f"{rec[M.ERR['out']]:.1e}"
            and child.data.metrics[M.ERR["out"]] == rec[M.ERR["out"]]
        )
        assert float(child.data.tags["time ms"]) == pytest.approx(rec[M.TIME_MS_MEDIAN], rel=5e-3)
        history = client.get_metric_history(child.info.run_id, "samples/time_ms")
        assert [h.value for h in sorted(history, key=lambda h: h.step)] == rec[M.TIME_MS_SAMPLES]
        if rec["method"] == "usp":
            assert child.data.params["option.ulysses_degree"] == "2" and "options" not in child.data.params
        assert child.data.params["causal"] in ("true", "false")
    parent = parents[0]
    assert parent.data.params["sweep.methods"] == "ring,usp" and parent.data.params["run.repeats"] == "3"
    assert parent.data.params["sweep.method_options.usp.ulysses_degree"] == "2"
    arts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert "trials_table.json" in arts
    table = json.loads(
        Path(client.download_artifacts(parent.info.run_id, "trials_table.json", str(tmp_path))).read_text()
    )
    assert sorted(row[table["columns"].index("key")] for row in table["data"]) == sorted(records)
    # a report read back from MLflow gets the rows, not the tags that only show them
    from suite.reports.load import load_mlflow
    from suite.tracking import RUN_FOLDER, SHOWN

    frame = load_mlflow("trk", f"sqlite:///{db}").frame
    assert len(frame) == 4 and not (set(SHOWN) | {RUN_FOLDER}) & set(frame.columns)


def test_relog_updates_the_existing_parent_and_logging_twice_adds_nothing(stored, tmp_path):
    from suite.tracking import relog

    db = tmp_path / "m.db"
    first = relog(stored, uri=f"sqlite:///{db}")
    client = _client(db)
    _, _, children = _runs(client)
    lengths = {c.info.run_id: len(client.get_metric_history(c.info.run_id, "samples/time_ms")) for c in children}
    second = relog(stored, uri=f"sqlite:///{db}")
    assert second.parent_run_id == first.parent_run_id and second.counts["logged"] == 0
    _, parents, again = _runs(client)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert {c.info.run_id for c in again} == set(lengths)
    for c in again:
        assert len(client.get_metric_history(c.info.run_id, "samples/time_ms")) == lengths[c.info.run_id]
    table = json.loads(
        Path(client.download_artifacts(first.parent_run_id, "trials_table.json", str(tmp_path))).read_text()
    )
    assert len(table["data"]) == 4  # replaced, not appended to


def test_reconcile_logs_missing_completes_half_logged_removes_duplicates_and_kills_stale(stored, tmp_path):
    from suite.tracking import relog

    db = tmp_path / "m.db"
    first = relog(stored, uri=f"sqlite:///{db}")
    client = _client(db)
    exp, parents, children = _runs(client)
    missing, half, dup_of = children[0], children[1], children[2]
    client.delete_run(missing.info.run_id)  # never logged
    client.update_run(half.info.run_id, status="RUNNING")  # killed while logging
    old = children[3]  # logged by a suite before the display tags: relog adds them
    client.delete_tag(old.info.run_id, "err out")
    client.delete_tag(old.info.run_id, "run folder")
    dup = client.create_run(
        exp.experiment_id,
        run_name="dup",
        tags={  # logged twice
            "mlflow.parentRunId": first.parent_run_id,
            M.KEY: dup_of.data.tags[M.KEY],
        },
    )
    stale = client.create_run(
        exp.experiment_id,
        run_name="stale",
        tags={  # a trial that never finished
            "mlflow.parentRunId": first.parent_run_id,
            M.KEY: "0" * 16,
        },
    )
    client.update_run(first.parent_run_id, status="RUNNING")
    tracker = relog(stored, uri=f"sqlite:///{db}")
    assert tracker.counts == {"logged": 1, "completed": 1, "deleted": 1, "killed": 1, "retagged": 1}
    _, parents, children = _runs(client)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    live = [c for c in children if c.data.tags[M.KEY] != "0" * 16]
    keys = {r[M.KEY] for r in ResultsStore.open(stored).iter_records()}
    assert sorted(c.data.tags[M.KEY] for c in live) == sorted(keys)
    assert all(c.info.status == "FINISHED" for c in live)
    assert client.get_run(stale.info.run_id).info.status == "KILLED"
    assert {k: client.get_run(old.info.run_id).data.tags[k] for k in ("err out", "run folder")} == {
        k: old.data.tags[k] for k in ("err out", "run folder")
    }
    assert client.get_run(dup.info.run_id).info.lifecycle_stage == "deleted"


@pytest.mark.slow
def test_three_processes_creating_a_fresh_database_at_once(tmp_path):
    """Each opens (migrates) the same new sqlite store and creates the experiment; without the lock
    beside the database one of them fails or the schema is broken. MLflow's start-up log lines
    (Alembic's INFO) are not printed."""
    db = tmp_path / "fresh" / "mlflow.db"
    code = textwrap.dedent(f"""
        import time, sys
        from suite.tracking import open_client
        time.sleep(max(0.0, {time.time() + 8.0} - time.time()))  # start together, after the imports
        client, exp = open_client("sqlite:///{db}", "race", None)
        run = client.create_run(exp)
        print(exp, run.info.run_id)
    """)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "INFO" not in err and "alembic" not in err.lower(), err
    assert len({out.split()[0] for out, _ in outs}) == 1  # one experiment
    client = _client(db)
    assert len(client.search_runs([client.get_experiment_by_name("race").experiment_id])) == 3


def test_redact_uri_and_environment_allowlist(monkeypatch):
    from suite.env import fingerprint, redact_uri

    assert (
        redact_uri("https://alice:s3cret@mlflow.example.org:5000/p?token=abc")
        == "https://***@mlflow.example.org:5000/***"  # a token may travel in the path too
    )
    assert redact_uri("postgresql://u:pw@db/mlflow") == "postgresql://***@db/***"
    assert redact_uri("sqlite:////tmp/x/mlflow.db") == "sqlite:////tmp/x/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://alice:s3cret@mlflow.example.org")
    monkeypatch.setenv("TORCH_HUB_TOKEN", "hunter2")
    monkeypatch.setenv("CUDA_SECRET_PATH", "/secret")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    env = fingerprint("cpu")
    text = json.dumps(env)
    assert "s3cret" not in text and "hunter2" not in text and "/secret" not in text
    assert env["env_vars"]["OMP_NUM_THREADS"] == "3"
    assert env["env_vars"]["MLFLOW_TRACKING_URI"] == "https://***@mlflow.example.org"


def test_credentials_never_reach_the_console_or_files(write_config, capsys):
    path = write_config("""
    name: creds
    sweep: {methods: [ring], world_size: [2], seq_len: [32], heads: [2], kv_heads: [2], head_dim: [8],
            causal: [true], passes: [fwd]}
    run: {executor: threads, warmup: 1, repeats: 1}
    tracking: {uri: "http://alice:s3cret@127.0.0.1:9"}
    """)
    cfg, text = load_config(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = run_sweep(cfg, text, progress=False)
    out = capsys.readouterr()
    assert res.mlflow_disabled and "s3cret" not in res.mlflow_disabled
    assert "s3cret" not in out.out + out.err and not any("s3cret" in str(w.message) for w in caught)
    for f in res.run_dir.iterdir():
        if f.suffix in (".json", ".jsonl"):
            assert "s3cret" not in f.read_text(), f


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out.update(kids)
            todo.extend(kids)
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads the process tree from /proc (Linux)")
def test_ui_stops_its_whole_server_on_sigterm(tmp_path):
    import signal
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "suite", "ui", "--results-root", str(tmp_path), "--port", str(port), "--workers", "2"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline, up = time.monotonic() + 150, False
        while time.monotonic() < deadline and proc.poll() is None and not up:
            try:
                up = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200
            except OSError:
                time.sleep(1)
        assert up, proc.stdout.read() if proc.poll() is not None else "server did not answer"
        server = _descendants(proc.pid)
        assert len(server) >= 2  # the MLflow CLI and its server/workers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(p) for p in server):
            time.sleep(0.2)
        assert not [p for p in server if _alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_sigterm_ends_the_sweep_like_ctrl_c_and_its_parent_run_killed(write_config, tmp_path):
    import signal

    db = tmp_path / "m.db"
    path = write_config(f"""
    name: term
    sweep: {{methods: [ring, hanging], world_size: [2], seq_len: [32], heads: [2], kv_heads: [2], head_dim: [8],
            causal: [true], passes: [fwd]}}
    run: {{warmup: 1, repeats: 2, timeout_s: 600, breakdown: false, plugins: [tests.plugins.faulty]}}
    results: {{root: "{tmp_path / "results"}"}}
    tracking: {{uri: "sqlite:///{db}"}}
    """)
    proc = subprocess.Popen(
        [sys.executable, "-m", "suite", "run", str(path), "--no-progress"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            lines = list((tmp_path / "results" / "term").glob("*/trials.jsonl"))
            if lines and lines[0].read_text().count("\n") >= 1 and list(lines[0].parent.glob("mlflow.json")):
                break
            time.sleep(0.5)
        time.sleep(2.0)  # the hanging trial is in flight
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "interrupted (SIGTERM)" in err
    _, parents, children = _runs(_client(db), "term")
    assert [p.info.status for p in parents] == ["KILLED"]
    assert [c.data.params["method"] for c in children] == ["ring"]


def test_a_harness_error_ends_the_parent_run_failed(write_config, tmp_path, monkeypatch):
    import errno

    db = tmp_path / "m.db"
    path = write_config(f"""
    name: full
    sweep: {{methods: [ring], world_size: [2], seq_len: [32], heads: [2], kv_heads: [2], head_dim: [8],
            causal: [true], passes: [fwd]}}
    run: {{executor: threads, warmup: 1, repeats: 1}}
    results: {{root: "{tmp_path / "results"}"}}
    tracking: {{uri: "sqlite:///{db}"}}
    """)

    def disk_full(self, record):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ResultsStore, "append", disk_full)
    cfg, text = load_config(path)
    with pytest.raises(OSError):
        run_sweep(cfg, text, progress=False, out=open(os.devnull, "w"))
    _, parents, _ = _runs(_client(db), "full")
    assert [p.info.status for p in parents] == ["FAILED"]


def test_progress_bar_names_the_running_trial(write_config, capsys):
    path = write_config("""
    name: bar
    sweep: {methods: [ring, ulysses], world_size: [2], seq_len: [32], heads: [2], kv_heads: [2], head_dim: [8],
            causal: [true], passes: [fwd]}
    run: {executor: threads, warmup: 1, repeats: 1}
    tracking: {mlflow: false}
    """)
    cfg, text = load_config(path)
    res = run_sweep(cfg, text, progress=True, out=open(os.devnull, "w"))
    frames = [f.strip() for f in capsys.readouterr().err.replace("\n", "\r").split("\r") if f.strip()]
    first = next(r for r in res.records)
    label = next(f for f in frames if f.startswith(first["method"]))
    # the first trial's name is on the bar while nothing has finished yet (0 of 2)
    assert any(f.startswith(label.split(":")[0]) and " 0/2 " in f for f in frames), frames


def test_numbers_shown_as_tags_keep_their_exponent_and_units():
    from suite.tracking import shown

    assert shown(4.28336514e-07, "err") == "4.3e-07"
    assert shown(0.0, "err") == "0.0e+00"
    assert shown(12.3456789, "sig3") == "12.3" and shown(123456.0, "sig3") == "1.23e+05"
    assert shown(-0.0123, "signed") == "-1.2e-02" and shown(0.0123, "signed") == "+1.2e-02"
    assert shown(512, "bytes") == "512 B"
    assert shown(3 * 1024**2 / 2, "bytes") == "1.5 MiB"
    assert shown(80 * 1024**3, "bytes") == "80 GiB"
    assert shown(5 * 1024**5, "bytes") == "5.12e+03 TiB"


def _flaky_log_batch(monkeypatch, fail_calls):
    """MlflowClient.log_batch raising sqlite's "disk I/O error" (as a CI run saw) on the calls
    numbered in `fail_calls` (1-based), and no wait between retries."""
    import sqlite3

    from mlflow.tracking import MlflowClient

    from suite import tracking

    real, calls = MlflowClient.log_batch, [0]

    def log_batch(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] in fail_calls:
            raise RuntimeError("(sqlite3.OperationalError) disk I/O error") from sqlite3.OperationalError(
                "disk I/O error"
            )
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", log_batch)
    monkeypatch.setattr(tracking, "RETRY_DELAYS_S", (0.0, 0.0, 0.0, 0.0))
    return calls


def _log_sweep(stored, db):
    """Log the stored rows as a sweep does: start, one log_trial per row, finish."""
    from suite.tracking import MlflowTracker

    store = ResultsStore.open(stored)
    tracker = MlflowTracker(f"sqlite:///{db}", "trk", stored.parent)
    tracker.start(store, sweep="trk", params={"name": "trk"}, environment={})
    for record in store.iter_records():
        tracker.log_trial(record)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker.finish(store)
    return tracker, store, caught


def test_a_transient_database_error_is_retried_and_no_row_is_lost(stored, tmp_path, monkeypatch):
    calls = _flaky_log_batch(monkeypatch, fail_calls={3, 4})  # the 2nd child's first write, twice
    tracker, store, caught = _log_sweep(stored, tmp_path / "m.db")
    assert calls[0] > 4 and tracker.retries == 2 and tracker.enabled and tracker.caught_up is None
    assert not [w for w in caught if "MLflow" in str(w.message)]
    _, parents, children = _runs(_client(tmp_path / "m.db"))
    keys = sorted(r[M.KEY] for r in store.iter_records())
    assert len(parents) == 1 and sorted(c.data.tags[M.KEY] for c in children) == keys  # each row once
    assert all(c.info.status == "FINISHED" for c in children)


def test_an_error_that_persists_mid_sweep_is_caught_up_at_the_end(stored, tmp_path, monkeypatch):
    # every attempt at the 2nd child's write fails: tracking stops, the sweep goes on, and the end of
    # the sweep reconciles, so the rows after it still reach MLflow
    _flaky_log_batch(monkeypatch, fail_calls=set(range(3, 8)))
    tracker, store, caught = _log_sweep(stored, tmp_path / "m.db")
    assert tracker.enabled and tracker.disabled_reason is None and "disk I/O error" in tracker.caught_up
    assert any("MLflow disabled" in str(w.message) for w in caught)
    _, parents, children = _runs(_client(tmp_path / "m.db"))
    keys = sorted(r[M.KEY] for r in store.iter_records())
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert sorted(c.data.tags[M.KEY] for c in children) == keys
    assert all(c.info.status == "FINISHED" for c in children)


def test_a_wrong_request_is_not_retried():
    from suite.tracking import transient

    assert transient(RuntimeError("x")) is False and transient(ValueError("Invalid metric name")) is False
    assert transient(OSError("disk I/O error")) and transient(RuntimeError("database is locked"))


# Creates a fresh sqlite store and is killed (SIGKILL, as a killed sweep is) right after the Nth
# batch migration made its `_alembic_tmp_<table>` copy: the file is left half-migrated, as a sweep
# killed during MLflow's database creation leaves it.
_KILLED_CREATION = """
import os, signal, sys
from sqlalchemy import event
from sqlalchemy.engine import Engine

made = []

@event.listens_for(Engine, "after_cursor_execute")
def _kill(conn, cursor, statement, *args):
    if statement.lstrip().upper().startswith("CREATE TABLE _ALEMBIC_TMP_"):
        made.append(statement)
        if len(made) == 3:
            os.kill(os.getpid(), signal.SIGKILL)

from mlflow.tracking import MlflowClient

MlflowClient(tracking_uri="sqlite:///" + sys.argv[1]).search_experiments(max_results=1)
"""


def _half_created(db: Path) -> None:
    db.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-c", _KILLED_CREATION, str(db)], cwd=ROOT, capture_output=True, timeout=240)
    assert proc.returncode == -9 and db.exists(), proc.stderr.decode()[-2000:]


@pytest.mark.slow
def test_a_half_created_database_is_moved_aside_and_rebuilt_from_the_store(stored, tmp_path):
    """A sweep killed while MLflow created its database leaves it half-migrated: every later open
    fails ("table ... already exists"). relog (and --resume, which starts the same way) moves the
    file aside, kept, creates a fresh one and logs every stored row to it, and says so in one line."""
    db = tmp_path / "results" / "mlflow.db"
    _half_created(db)
    from suite.tracking import _forget_engines

    with pytest.raises(Exception, match="already exists"):  # broken for MLflow itself
        _client(db).search_experiments()
    _forget_engines(f"sqlite:///{db}")  # this process's MLflow would go on reading the moved file
    proc = subprocess.run(
        [sys.executable, "-m", "suite", "relog", str(stored), "--uri", f"sqlite:///{db}"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "half-created" in line]
    aside = [p.name for p in db.parent.iterdir() if p.name.startswith("mlflow.db.broken-")]
    assert len(aside) == 1  # the broken file is kept beside the fresh one, never deleted
    assert said == [
        f"MLflow: results/mlflow.db was half-created ({said[0].split('(', 1)[1].split(')')[0]}); "
        f"moved to results/{aside[0]}; rebuilt from the results store"
    ]
    assert "already exists" in said[0]
    _, parents, children = _runs(_client(db))
    keys = sorted(r[M.KEY] for r in ResultsStore.open(stored).iter_records())
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert sorted(c.data.tags[M.KEY] for c in children) == keys
    assert all(c.info.status == "FINISHED" for c in children)


def test_only_a_recognisably_broken_store_is_moved_aside(tmp_path):
    """A locked database, a passing I/O error, a server and a healthy store are never moved aside."""
    from suite.tracking import broken_store, open_client

    db = tmp_path / "ok.db"
    open_client(f"sqlite:///{db}", "fine", None)
    healthy = f"sqlite:///{db}"
    assert broken_store(healthy, RuntimeError("table runs already exists")) is None  # at its last revision
    assert broken_store(healthy, RuntimeError("database is locked")) is None
    assert broken_store("http://127.0.0.1:9", RuntimeError("table runs already exists")) is None
    assert broken_store(f"sqlite:///{tmp_path / 'absent.db'}", RuntimeError("already exists")) is None
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not sqlite at all" * 100)
    assert broken_store(f"sqlite:///{junk}", RuntimeError("file is not a database")) == "file is not a database"
    assert broken_store(f"sqlite:///{junk}", RuntimeError("disk I/O error")) is None
