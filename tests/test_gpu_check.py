"""The prepared GPU check, benchmarks/gpu_check.py (the one command a lent GPU machine runs first): its
plumbing on CPU, cheaply (a part cut at its limit is recorded, the device is named, the files are
written), its summary's arithmetic, and, when asked for (SUITE_GPU_CHECK_DRY_RUN=1), the whole dry run."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _run(out: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), SUITE_GPU_CHECK_DEVICE="cpu")
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--wheels", "", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_part_cut_at_its_limit_and_one_stopped_from_outside_are_recorded(tmp_path):
    """peers is cut at its 1 s limit; the sweep, which starts next, is stopped by SIGTERM (the device
    tool's kill at its timeout): the files are written, the device named, and no part runs on."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), SUITE_GPU_CHECK_DEVICE="cpu")
    cmd = [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--wheels", "", "--parts", "peers,sweep"]
    proc = subprocess.Popen(
        [*cmd, "--limit", "peers=1"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "start sweep" in line:
            break
    time.sleep(0.5)
    proc.terminate()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, "".join(seen) + out
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["device.json", "log.txt", "parts.json", "rows.jsonl", "summary.md"], files
    peers, sweep = json.loads((tmp_path / "parts.json").read_text())
    assert peers["status"] == "timeout" and peers["limit_s"] == 1 and 1 <= peers["seconds"] < 30
    assert peers["tests"] == {}  # killed before pytest wrote its report
    assert sweep["status"] == "stopped" and sweep["seconds"] < 30
    device = json.loads((tmp_path / "device.json").read_text())
    assert device["torch"] == torch.__version__ and device["cuda_available"] is False
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# GPU check (cpu): FAIL")
    assert f"torch {torch.__version__}" in summary and "a dry run, no GPU" in summary
    assert "| peers |" in summary and "| timeout |" in summary and "cut at its limit of 1 s" in summary
    assert "- sweep: stopped from outside" in summary
    log = (tmp_path / "log.txt").read_text()
    assert "tests/test_gpu.py::test_world_size_one_over_nccl" in log and "-m suite run configs/h100_headline" in log
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path) not in ps  # no part left running (each part's own folder is under the script's)


def test_the_summary_gives_each_methods_worst_error_over_tolerance(tmp_path):
    gc = _module()
    rows = [
        {
            "method": "ring",
            "status": "ok",
            "checked": True,
            "err_out": 0.01,
            "tol_out": 0.1,
            "err_dq": 0.04,
            "tol_dq": 0.1,
            "part": "masks",
        },
        {
            "method": "ring",
            "status": "ok",
            "checked": True,
            "err_dk": 0.3,
            "tol_dk": 0.5,
            "err_dsink": None,
            "tol_dsink": None,
            "part": "variants",
        },
        {
            "method": "ulysses",
            "status": "incorrect",
            "checked": True,
            "err_dv": 0.3,
            "tol_dv": 0.2,
            "part": "masks",
            "world_size": 4,
            "reason": "dv over its tolerance",
        },
        {"method": "usp", "status": "skipped", "checked": False, "err_out": 9.0, "tol_out": 1.0},
    ]
    worst = gc.worst_ratios(rows)
    assert [(m, round(v, 6), t, p, n) for m, v, t, p, n in worst] == [
        ("ulysses", 1.5, "dv", "masks", 1),
        ("ring", 0.6, "dk", "variants", 2),
    ]
    # rows stored trial by trial, the last one cut by a kill, are read back without it
    run = tmp_path / "results" / "gpu_masks" / "20260101-000000"
    run.mkdir(parents=True)
    (run / "trials.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]) + '{"method": "ri')
    assert gc.read_rows(tmp_path) == rows[:3]
    res = gc.Result(
        "masks",
        "mask families",
        status="failed",
        seconds=12,
        limit_s=150,
        rc=1,
        tests={"passed": 0, "failed": 1, "skipped": 0},
        rows={"ok": 1, "incorrect": 1},
        problems=["row ulysses P=4 mask= incorrect: dv over its tolerance"],
    )
    meta = {"device": "cuda", "wheels": "3 installed", "started": "now", "elapsed_s": 20, "total_s": 440, "jobs": 3}
    info = {"cuda_available": True, "name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "kernel_auto": "torch_flash"}
    text = gc.summary_text(info, "NVIDIA H100 80GB HBM3, 580.159.04", [res], rows, meta)
    assert text.startswith("# GPU check (cuda): FAIL")
    assert "| masks | mask families | failed | 0/1/0 | 1/1/0 | 12 | 150 |" in text
    assert "| ulysses | 1.500 | dv | masks | 1 |" in text and "| ring | 0.600 | dk | variants | 2 |" in text
    assert "- masks: row ulysses P=4" in text and "NVIDIA H100 80GB HBM3 (sm" in text
    assert len(text.splitlines()) < 40  # one screen
    res.status, res.problems = "passed", []
    assert gc.summary_text(info, "", [res], rows[:2], meta).startswith("# GPU check (cuda): PASS")
    # asked for CUDA where there is none, every GPU test skips: that is no pass
    meta["fatal"] = "no CUDA device seen"
    text = gc.summary_text(info, "", [res], rows[:2], meta)
    assert text.startswith("# GPU check (cuda): FAIL") and "- no CUDA device seen" in text


def test_bad_arguments_name_the_choices(tmp_path, capsys):
    gc = _module()
    with pytest.raises(SystemExit):
        gc.main(["--out", str(tmp_path), "--parts", "nope"])
    assert "--parts: unknown ['nope']; choose from ['variants'," in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gc.main(["--out", str(tmp_path), "--limit", "peers=soon"])
    assert "--limit takes PART=SECONDS" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before anything ran


@pytest.mark.slow
@pytest.mark.timeout(3800)  # the script's own CPU limit is 3600 s
@pytest.mark.skipif(
    not os.environ.get("SUITE_GPU_CHECK_DRY_RUN"),
    reason="the whole CPU dry run takes about 7 minutes on 2 cores: SUITE_GPU_CHECK_DRY_RUN=1 (make gpu-check-dry)",
)
def test_the_whole_dry_run_passes_on_cpu(tmp_path):
    res = _run(tmp_path, timeout=3700)
    summary = (tmp_path / "summary.md").read_text()
    assert res.returncode == 0 and summary.startswith("# GPU check (cpu): PASS"), summary
    parts = json.loads((tmp_path / "parts.json").read_text())
    assert {p["name"] for p in parts} == {p.name for p in _module().PARTS}
    assert (tmp_path / "kernels.md").exists() and (tmp_path / "calibration.blocks.yaml").exists()
    assert len(list(tmp_path.iterdir())) <= 8  # what the device tool brings back
