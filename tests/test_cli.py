import re
import subprocess
import sys
from pathlib import Path

import pytest

from suite.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_list_runs_without_a_gpu_and_says_what_is_unavailable(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("reference", "ring", "ulysses", "cpu_flash", "flash_attn", "threads"):
        assert name in out
    import torch

    if not torch.cuda.is_available():
        assert "no CUDA device" in out
        flash_line = next(line for line in out.splitlines() if line.startswith("flash_attn"))
        assert " no " in flash_line


@pytest.mark.parametrize("cmd", [[], ["run"], ["list"], ["ui"], ["relog"], ["advise"]])
def test_help_for_every_command(cmd):
    out = subprocess.run([sys.executable, "-m", "suite", *cmd, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "usage: python -m suite" in out.stdout


def test_every_subcommand_has_a_parser_and_a_handler():
    """The parser is built from a table of subcommands (suite/cli.py SUBCOMMANDS) and main runs each
    through another (HANDLERS): a command added to one must be in the other, or it parses and then
    fails with a KeyError."""
    from suite.cli import HANDLERS, _parser

    sub = next(a for a in _parser()._actions if a.dest == "command")
    assert list(sub.choices) == list(HANDLERS)


def test_config_error_starts_nothing(write_config, tmp_path, capsys):
    path = write_config("name: bad\nsweep:\n  methods: [ring, nosuchmethod]\n")
    assert main(["run", str(path)]) == 2
    assert "unknown method 'nosuchmethod'" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()


def test_dry_run_prints_the_plan_with_skip_reasons(write_config, tmp_path, capsys):
    path = write_config("name: plan\nsweep: {methods: [ulysses], world_size: [3], heads: [4], seq_len: [48]}\n")
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "4 planned trials" in out and "skip: ulysses needs heads divisible by the ulysses degree" in out
    assert not (tmp_path / "results").exists()


def _is_trial_line(line: str) -> bool:
    """A planned trial's line: its key (16 hex digits), the trial, then run or skip (and, with
    --verbose, its predicted memory and time)."""
    return bool(re.match(r"  [0-9a-f]{16}  ", line)) and (" run" in line or " skip: " in line)


def test_a_long_dry_run_lists_its_first_trials_then_counts_by_method_and_reason(
    write_config, tmp_path, capsys, monkeypatch
):
    import suite.runner

    monkeypatch.setattr(suite.runner, "PLAN_LINES", 3)
    path = write_config(
        "name: plan\nsweep: {methods: [ring, ulysses], world_size: [3], heads: [4], kv_heads: [4], seq_len: [48]}\n"
    )
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    trials = [line for line in out.splitlines() if _is_trial_line(line)]
    assert len(trials) == 3 and "... 5 more (--dry-run --verbose lists every trial)" in out
    assert "summary: 8 trials, 4 run here, 4 skipped here" in out
    counts = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith(("ring ", "ulysses "))}
    assert counts == {"ring": ["4", "0", "4"], "ulysses": ["0", "4", "4"]}  # run, skip, trials
    reason = next(
        line for line in out.splitlines() if "divisible by the ulysses degree" in line and "skip:" not in line
    )
    assert reason.split()[0] == "4"
    assert main(["run", str(path), "--dry-run", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert len([line for line in out.splitlines() if _is_trial_line(line)]) == 8
    assert "more (--dry-run" not in out and "summary: 8 trials" in out
    assert main(["run", str(path), "--verbose"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--verbose only applies to --dry-run" in err
    assert not (tmp_path / "results").exists()


def test_resume_without_an_earlier_run_is_a_clear_error(write_config, capsys):
    path = write_config("name: fresh\n")
    assert main(["run", str(path), "--resume"]) == 2
    assert "no earlier run of 'fresh'" in capsys.readouterr().err


def test_overrides_before_or_after_options(write_config, tmp_path, capsys):
    path = write_config("name: order\nsweep: {methods: [ring], world_size: [2], seq_len: [48]}\n")
    assert main(["run", str(path), "--dry-run", "sweep.world_size=[3]", "sweep.methods=[ulysses]"]) == 0
    out = capsys.readouterr().out
    assert "ulysses P=3" in out and "ring" not in out
    with pytest.raises(SystemExit):
        main(["run", str(path), "--dry-run", "--bogus"])


# A stand-in for MLflow's server: prints what uvicorn prints (access lines, a deprecation warning),
# answers one request and exits; or exits at once without listening.
FAKE_SERVER = """
import http.server, sys
print("INFO:     Uvicorn running (fake)", flush=True)
print("DeprecationWarning: fake", file=sys.stderr, flush=True)
if {fail}:
    sys.exit(3)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # logs an access line on stderr, as a server does
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"OK")
http.server.HTTPServer(("127.0.0.1", {port}), Health).handle_request()
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("verbose", [False, True])
def test_ui_prints_its_link_once_the_server_answers_and_keeps_its_console_quiet(tmp_path, monkeypatch, capfd, verbose):
    import suite.cli

    port = _free_port()
    monkeypatch.setattr(suite.cli, "_UI_POLL_S", 0.05)
    monkeypatch.setattr(
        suite.cli, "_ui_command", lambda uri, args: [sys.executable, "-c", FAKE_SERVER.format(fail=False, port=port)]
    )
    argv = ["ui", "--results-root", str(tmp_path), "--port", str(port)] + (["--verbose"] if verbose else [])
    assert main(argv) == 0
    out, err = capfd.readouterr()
    ours = [line for line in out.splitlines() if "MLflow UI" in line]
    assert ours[0].startswith(f"starting the MLflow UI on http://127.0.0.1:{port}") and "ready" not in ours[0]
    assert ours[1].startswith(f"MLflow UI ready on http://127.0.0.1:{port}")
    noise = ("Uvicorn running", "DeprecationWarning", "GET /health")
    # the server's console reaches this one only with --verbose
    assert all((n in out + err) == verbose for n in noise), (out, err)


def test_ui_whose_server_stops_before_answering_prints_no_link_but_its_last_lines(tmp_path, monkeypatch, capfd):
    import suite.cli

    port = _free_port()
    monkeypatch.setattr(suite.cli, "_UI_POLL_S", 0.05)
    monkeypatch.setattr(
        suite.cli, "_ui_command", lambda uri, args: [sys.executable, "-c", FAKE_SERVER.format(fail=True, port=port)]
    )
    assert main(["ui", "--results-root", str(tmp_path), "--port", str(port)]) == 3
    out, err = capfd.readouterr()
    assert "ready" not in out
    assert "error: the MLflow server stopped (exit code 3) before it answered" in err
    assert "Uvicorn running" in err and "DeprecationWarning" in err  # what it said, shown once it failed


def test_relog_of_a_folder_that_is_no_run_is_one_line(tmp_path, capsys):
    assert main(["relog", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"error: {tmp_path / 'nothing'} is not a results folder (no trials.jsonl)"
    assert "Traceback" not in err


def test_messages_name_the_command_the_user_invoked(monkeypatch, capsys):
    """Installed as a package the command is `sp-suite`: help and suggested commands say so, not
    `python -m suite` (issue 39); `python -m suite` users keep theirs."""
    from suite import metrics as M

    monkeypatch.setattr(sys, "argv", ["/env/bin/sp-suite", "--help"])
    assert M.suite_command() == "sp-suite"
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: sp-suite") and "sp-suite run configs/quickstart.yaml" in out
    assert "python -m suite" not in out
    monkeypatch.setattr(sys, "argv", ["/repo/suite/__main__.py"])
    assert M.suite_command() == "python -m suite"


def test_advise_help_lists_every_model_it_knows(capsys):
    """`--model` help names each model of configs/models, read from the folder (it listed 5 of 11)."""
    with pytest.raises(SystemExit):
        main(["advise", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    models = sorted(p.stem for p in (ROOT / "configs" / "models").glob("*.yaml"))
    assert len(models) >= 11 and all(m in out for m in models), [m for m in models if m not in out]
