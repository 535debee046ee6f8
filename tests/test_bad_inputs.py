"""Bad input from a newcomer or a fault run: each is refused before anything starts with one line
naming the key or option (exit 2, no traceback), and no credential of a tracking URI reaches a
file or the console, whichever way the URI was given."""

import json
import textwrap

import pytest

from suite.cli import main

SWEEP = """
name: bad
sweep: {methods: [ring], world_size: [2], seq_len: [64], heads: [2], kv_heads: [2], head_dim: [8],
        causal: [true], passes: [fwd], workload: [docs]}
run: {executor: threads, device: cpu, warmup: 0, repeats: 1}
tracking: {mlflow: false}
documents:
  docs: {distribution: lognormal, median: 16, sigma: 1}
"""

PLUGIN_ERRORS = {
    "raises": "raise RuntimeError('plugin broke')\n",
    "syntax": "def broken(:\n",
    "duplicate": "from methods.registry import register\nfrom methods.ring import Ring\n\n"
    "@register\nclass Again(Ring):\n    name = 'ring'\n",
}


def _setup(tmp_path, monkeypatch):
    """A sweep config, a histogram with a NaN weight beside it, a plain file, a folder of rows
    with a missing or a mistyped column, and plugin modules that fail."""
    (tmp_path / "sweep.yaml").write_text(SWEEP + f"results: {{root: {tmp_path / 'results'}}}\n")
    (tmp_path / "nan.yaml").write_text("bins:\n  - [1, 10, .nan]\n  - [11, 20, 1]\n")
    (tmp_path / "afile").write_text("")
    row = {"key": "k1", "method": "ring", "world_size": 2, "batch": 1, "seq_len": 64, "heads": 2, "kv_heads": 2}
    row.update(head_dim=8, dtype="float32", causal=True, status="ok", time_ms_median=1.0, executor="threads")
    row["pass"] = "fwd"
    for name, change in (("missing", {"method": None}), ("typed", {"seq_len": "abc"})):
        run = tmp_path / "rows" / name / "20260101-000000"
        run.mkdir(parents=True)
        bad = {k: v for k, v in {**row, **change}.items() if v is not None}
        (run / "trials.jsonl").write_text(json.dumps(bad) + "\n")
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    for name, text in PLUGIN_ERRORS.items():
        (plugins / f"bad_plugin_{name}.py").write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(plugins))
    monkeypatch.chdir(tmp_path)


RUN = ["run", "sweep.yaml"]
BIG_AXES = ("seq_len", "heads", "kv_heads", "head_dim", "batch")
ADVISE = ["advise", "--model", "llama3_8b", "--topology", "h100_sxm", "--no-mlflow", "--results-root", "results"]


@pytest.mark.parametrize(
    "argv,key",
    [
        # item 12: the config
        (RUN + ["documents.docs.distribution=histogram", "documents.docs.file=nan.yaml"], "documents.docs.file"),
        (RUN + ["run.seed=-1"], "run.seed"),
        (RUN + ["run.repeats=100000000000"], "run.repeats"),
        (RUN + ["run.warmup=100000000000"], "run.warmup"),
        (RUN + ["sweep.seq_len=[100000000000000000000]"], "sweep.seq_len"),
        (RUN + ["sweep.world_size=[256]"], "sweep.world_size"),
        (RUN + ["sweep.head_dim_v=[0]"], "sweep.head_dim_v"),
        (RUN + ["sweep.softcap=[-1.0]"], "sweep.softcap"),
        # issue 38: a method named twice, a plan too large to enumerate (1e10 points, counted)
        (RUN + ["sweep.methods=[ring,ring]"], "sweep.methods"),
        (
            RUN + ["--dry-run"] + [f"sweep.{a}=[{','.join(map(str, range(8, 108)))}]" for a in BIG_AXES],
            "10,000,000,000",
        ),
        (RUN + ["sweep.seq_len=[64,128]", "sweep.heads=[2,4]", "run.max_trials=3"], "run.max_trials=3"),
        # item 13: reports, relog, advise, plugins
        (["report", "rows/missing", "--no-mlflow", "--out", "rep"], "'method'"),
        (["report", "rows/typed", "--no-mlflow", "--out", "rep"], "'seq_len'"),
        (["report", "rows/typed", "--no-mlflow", "--out", "afile"], "--out"),
        (["relog", "rows"], "not a results folder"),
        (ADVISE + ["--seq-len", str(2**62)], "--seq-len"),
        (ADVISE + ["--seq-len", "4096", "--emit-config", "afile/top.yaml"], "--emit-config"),
        (ADVISE + ["--seq-len", "4096", "--out", "afile/advice"], "--out"),
        (RUN + ["run.plugins=[bad_plugin_raises]"], "run.plugins"),
        (RUN + ["run.plugins=[bad_plugin_syntax]"], "run.plugins"),
        (RUN + ["run.plugins=[bad_plugin_duplicate]"], "run.plugins"),
    ],
)
def test_bad_input_is_one_line_exit_2_before_anything_runs(argv, key, tmp_path, monkeypatch, capsys):
    _setup(tmp_path, monkeypatch)
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert key in lines[0] and "Traceback" not in err
    assert not (tmp_path / "results").exists()  # no trial started (nor a simulated one)
    assert not (tmp_path / "rep").exists()


@pytest.mark.parametrize(
    "override", ["documents.docs.sigma=1000", "documents.docs.distribution=powerlaw documents.docs.alpha=1.0000001"]
)
def test_lengths_past_any_float_are_drawn_and_cut_to_the_sequence(override, tmp_path, monkeypatch, capsys):
    """A lognormal sigma that overflows and a power-law tail barely normalisable draw infinite
    lengths; they are capped, and packing cuts them to the sequence."""
    from suite.config import load_config
    from suite.lengths import Distribution

    _setup(tmp_path, monkeypatch)
    cfg, _ = load_config("sweep.yaml", override.split())
    import dataclasses

    dist = Distribution.from_config("docs", dataclasses.asdict(cfg.documents["docs"]))
    for seq in dist.draw(64, 3, 0):
        assert sum(seq) == 64 and all(n >= 1 for n in seq)


def test_a_relative_histogram_path_is_read_beside_the_config(tmp_path, monkeypatch):
    from suite.config import load_config

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "sweep.yaml").write_text(
        SWEEP.replace("lognormal, median: 16, sigma: 1", "histogram, file: h.yaml")
    )
    (tmp_path / "cfg" / "h.yaml").write_text("bins:\n  - [4, 8, 1]\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # no h.yaml here
    cfg, _ = load_config("../cfg/sweep.yaml")
    assert cfg.documents["docs"].file == str(tmp_path / "cfg" / "h.yaml")


SECRETS = ("SECRETUSER", "SECRETPASS", "SECRETPATH", "SECRETQUERY")
URI = "http://SECRETUSER:SECRETPASS@127.0.0.1:9/SECRETPATH/mlflow?token=SECRETQUERY"


@pytest.mark.parametrize("way", ["config file", "override", "environment", "relog --uri"])
def test_no_credential_of_the_tracking_uri_is_written_or_printed(way, tmp_path, monkeypatch, capsys):
    """Port 9 refuses the connection: MLflow fails at once (no retries) and says so, with the URL
    in its message; the sweep still writes its folder."""
    _setup(tmp_path, monkeypatch)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    text = (tmp_path / "sweep.yaml").read_text().replace("mlflow: false", "mlflow: true")
    if way == "config file":
        text = text.replace("mlflow: true}", f"mlflow: true, uri: '{URI}'}}")
    (tmp_path / "sweep.yaml").write_text(text)
    argv = RUN + ["sweep.workload=[uniform]", "--no-progress"]
    if way == "override":
        argv.append(f"tracking.uri='{URI}'")
    if way == "environment":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", URI)
    with pytest.warns(RuntimeWarning) as warned:  # MLflow disabled, said in a warning
        assert main(argv) == 0
        if way == "relog --uri":
            (run_dir,) = (tmp_path / "results" / "bad").iterdir()
            assert main(["relog", str(run_dir), "--uri", URI]) == 1
    out = capsys.readouterr()
    console = out.out + out.err + "".join(str(w.message) for w in warned)
    assert "MLflow" in console and "127.0.0.1" in console  # the failure is said, the host shown
    files = [p for p in (tmp_path / "results").rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in files)
    for secret in SECRETS:
        assert secret not in console
        for p in files:
            assert secret.encode() not in p.read_bytes(), p


def test_redact_uri_keeps_local_stores_and_hides_every_secret_piece():
    from suite.env import redact_text, redact_uri

    assert redact_uri("sqlite:////tmp/x/mlflow.db") == "sqlite:////tmp/x/mlflow.db"
    assert redact_uri("file:///tmp/mlruns") == "file:///tmp/mlruns"
    assert redact_uri("http://host:5000") == "http://host:5000"
    assert redact_uri(URI) == "http://***@127.0.0.1:9/***"
    said = redact_text(f"url: /SECRETPATH/mlflow?token=SECRETQUERY/api failed for {URI}", URI)
    assert not any(s in said for s in SECRETS) and "127.0.0.1:9" in said


@pytest.mark.parametrize("fault", ["read-only folder", "trials.jsonl a folder"])
@pytest.mark.parametrize("how", ["named", "latest"])
def test_resume_of_a_folder_that_cannot_be_written_is_one_line_exit_2(fault, how, tmp_path, monkeypatch, capsys):
    """Tests run as root here, where chmod does not stop a write: the read-only mount is the
    error the OS gives there (EROFS) on opening the folder's lock."""
    import errno
    import os

    _setup(tmp_path, monkeypatch)
    run_dir = tmp_path / "results" / "bad" / "20260101-000000"
    run_dir.mkdir(parents=True)
    from suite.config import load_config

    (run_dir / "config.yaml").write_text(load_config("sweep.yaml")[1])  # this sweep's folder
    if fault == "trials.jsonl a folder":
        (run_dir / "trials.jsonl").mkdir()
    else:
        (run_dir / "trials.jsonl").write_text("")
        real_open = os.open

        def read_only(path, *args, **kwargs):
            if str(path).startswith(str(run_dir)):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", read_only)
    before = sorted(p.name for p in run_dir.iterdir())
    assert main(RUN + ["--resume", str(run_dir) if how == "named" else "latest"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert str(run_dir) in err and ("Read-only" in err or "not a file" in err), err
    assert sorted(p.name for p in run_dir.iterdir()) == before


def test_no_credential_reaches_the_console_with_the_server_reachable(tmp_path, monkeypatch, capsys):
    """MLflow prints "View run NAME at: URI" as each run ends, with the URI as the client was given
    it: user and password in full. They reach the server as basic auth, and never the console."""
    import base64

    from tests.helpers import FakeMlflowServer

    _setup(tmp_path, monkeypatch)
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(name, "")  # restored (unset) after the test: the client sets the last two
        monkeypatch.delenv(name)
    monkeypatch.setenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "false")
    server = FakeMlflowServer()
    try:
        uri = f"http://SECRETUSER:SECRETPASS@127.0.0.1:{server.port}/SECRETPATH"
        text = (tmp_path / "sweep.yaml").read_text().replace("mlflow: false", f"mlflow: true, uri: '{uri}'")
        (tmp_path / "sweep.yaml").write_text(text)
        assert main(RUN + ["sweep.workload=[uniform]", "--no-progress"]) == 0
        (run_dir,) = (tmp_path / "results" / "bad").iterdir()
        assert main(["relog", str(run_dir), "--uri", uri]) == 0
    finally:
        server.close()
    out = capsys.readouterr()
    console = out.out + out.err
    assert f"127.0.0.1:{server.port}" in console and "/runs/create" in {
        p.split("mlflow")[-1] for p, _ in server.requests
    }
    auth = "Basic " + base64.b64encode(b"SECRETUSER:SECRETPASS").decode()
    assert server.requests and all(a == auth for _, a in server.requests)  # the credentials still work
    for secret in ("SECRETUSER", "SECRETPASS", "SECRETPATH"):
        assert secret not in console, console


def test_threads_executor_keeps_its_limits_and_outlives_a_rank_that_exits(tmp_path, monkeypatch, capsys):
    """run.executor=threads: a rank that deadlocks, one that sleeps past run.timeout_s outside any
    communication, and one that calls os._exit each get a row (timeout, timeout, failed), and the
    sweep goes on to the trial after them."""
    from suite import metrics as M
    from suite.results import ResultsStore

    _setup(tmp_path, monkeypatch)
    argv = RUN + [
        "sweep.methods=[ring,dying,deadlocked,sleepy,ulysses]",  # ring first: it warms up what the others reuse
        "sweep.workload=[uniform]",
        "run.plugins=[tests.plugins.faulty]",
        "run.timeout_s=2",
        "run.breakdown=false",
        "run.fail_grace_s=1",
        "--no-progress",
    ]
    assert main(argv) == 0
    (run_dir,) = (tmp_path / "results" / "bad").iterdir()
    rows = {r["method"]: r for r in ResultsStore(run_dir).records()}
    assert rows["dying"][M.STATUS] == M.FAILED and "os._exit(17)" in rows["dying"][M.REASON]
    for name in ("deadlocked", "sleepy"):
        assert rows[name][M.STATUS] == M.TIMEOUT, rows[name]
        assert "within 2s (run.timeout_s)" in rows[name][M.REASON]
    assert "[1] could not be stopped" in rows["deadlocked"][M.REASON]
    assert rows["ring"][M.STATUS] == rows["ulysses"][M.STATUS] == M.OK


def test_worker_processes_leave_ctrl_c_to_the_parent():
    """Ctrl-C at a terminal reaches every process of the group: workers start with SIGINT ignored
    (inherited through exec), so only the parent answers it, in one line."""
    import signal
    import subprocess
    import sys

    from suite.executors.local import sigint_ignored

    probe = [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"]
    # a test process started in the background (CI, `&`) inherits SIGINT ignored: start from Python's own handler
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with sigint_ignored():
            assert subprocess.run(probe, capture_output=True, text=True).stdout.strip() == "True"
        assert subprocess.run(probe, capture_output=True, text=True).stdout.strip() == "False"
    finally:
        signal.signal(signal.SIGINT, inherited)


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_is_one_line_exit_130_rows_kept(tmp_path):
    """SIGINT to the whole group while the dist workers start (each printed ~50 lines of
    KeyboardInterrupt traceback before) and again once a row is written."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    config = tmp_path / "cc.yaml"
    config.write_text(
        SWEEP.replace("methods: [ring]", "methods: [slow]")
        .replace("seq_len: [64]", "seq_len: [64, 128, 256, 512]")
        .replace("executor: threads", "executor: dist, plugins: [tests.plugins.faulty], breakdown: false")
        .replace("workload: [docs]", "workload: [uniform]")
        + f"results: {{root: {tmp_path / 'results'}}}\n"
    )
    root = Path(__file__).resolve().parents[1]
    for when in ("start-up", "after a row"):
        proc = subprocess.Popen(
            [sys.executable, "-m", "suite", "run", str(config), "--no-progress"],
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            # as from a terminal: a background test run (CI, `&`) would pass SIGINT on ignored
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        t0 = time.monotonic()
        while time.monotonic() - t0 < 240:
            rows = list((tmp_path / "results").glob("bad/*/trials.jsonl"))
            if when == "start-up" and rows:  # the folder exists: the workers are being spawned
                time.sleep(1.0)
                break
            if when == "after a row" and any(p.read_text().count("\n") for p in rows):
                break
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err
        assert err.strip().splitlines() == [
            "interrupted (SIGINT): every finished trial is saved; continue with --resume"
        ], err
        kept = sum(p.read_text().count("\n") for p in (tmp_path / "results").glob("bad/*/trials.jsonl"))
        assert when == "start-up" or kept >= 1


def test_report_skips_a_malformed_row_and_keeps_the_rest_of_its_folder(tmp_path, monkeypatch, capsys):
    """One row without a column (or with text for a number) cost the whole run folder before."""
    from pathlib import Path

    _setup(tmp_path, monkeypatch)
    golden = Path(__file__).parent / "data" / "golden" / "quickstart.jsonl"
    rows = [json.loads(line) for line in golden.read_text().splitlines()[:3]]  # rows a sweep wrote
    rows.append(dict(rows[0], key="bad1", seq_len="abc"))
    rows.append({k: v for k, v in dict(rows[1], key="bad2").items() if k != "method"})
    run = tmp_path / "rows" / "mixed" / "20260101-000000"
    run.mkdir(parents=True)
    (run / "trials.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(run), "--no-mlflow", "--out", "rep"]) == 0
    out = capsys.readouterr().out
    assert "report of 3 trial rows" in out
    assert "2 of 5 row(s) skipped, not trial rows (first: row bad1: column 'seq_len' is 'abc'" in out
