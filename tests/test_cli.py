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
    trials = [line for line in out.splitlines() if line.endswith(" run") or " skip: " in line]
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
    assert len([line for line in out.splitlines() if line.endswith(" run") or " skip: " in line]) == 8
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
