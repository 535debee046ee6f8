"""The prepared GPU check (issue 36): the one command a lent one-GPU machine runs first, in one call of
at most 8 minutes, writing what it saw where the device tool brings files back.

    python3 benchmarks/gpu_check.py --out "$OUT"             # on the GPU machine (make gpu-check-device)
    SUITE_GPU_CHECK_DEVICE=cpu python benchmarks/gpu_check.py --out results/gpu_check_dry   # CPU dry run

docs/gpu_and_clusters.md gives the exact device-tool call (command, carry, timeout). The script needs
nothing but Python's standard library itself; each part runs in a child process that imports the suite.
It installs the wheels carried in `.whl/` (the GPU image lacks hydra-core, omegaconf and antlr4) into a
temporary folder put first on the children's PYTHONPATH, names the device, then runs the parts, each
with its own time limit: a part cut at its limit is recorded as a timeout with the rows it stored (the
sweeps store each trial as it ends), and the next part runs. The correctness parts run side by side
(`--jobs`, on the one GPU: their timings are not what they check), then the timed parts one at a time:

  variants   tests/test_gpu.py: sinks, soft cap, MLA head dims, GQA; every own method at P = 1, 2, 4, 8
  masks      tests/test_gpu.py: every mask family x uniform and packed documents, every own method, P = 4
  emulation  tests/test_gpu.py: every own method at P = 2, 4, 8, MHA and GQA, causal and full
  kernels    tests/test_gpu.py: the fused CUDA kernels block by block, MLA head dims, soft cap (CUDA only)
  peers      tests/test_gpu.py: world size 1 over NCCL (gloo on CPU), every method and importable peer
  calibrate  tests/test_gpu.py: `suite calibrate`, the kernel table of configs/gpu_kernels.yaml (timed)
  sweep      `suite run configs/h100_headline.yaml` at one short length, every own method emulated at
             P = 8 (threads): the command line, the store and the summary end to end (timed)

Every virtual-rank check is against float64 (suite/check.py's rule). Under --out, at most 8 files (the
device tool brings back 8), rewritten after every part so that a cut call keeps what was done:
summary.md (one screen: the device, each part's result, counts and seconds, the worst error over its
tolerance per method, what failed), rows.jsonl (every stored row, with its part), parts.json,
device.json, kernels.md and calibration.blocks.yaml (the kernel table), log.txt (every part's output).
Exit status 0 when every part that ran passed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
TESTS = "tests/test_gpu.py"
CHECKED = ("out", "lse", "dq", "dk", "dv", "dsink")  # suite.metrics.CHECKED_TENSORS (this file imports no suite)
GOOD_STATUSES = ("ok", "skipped")


@dataclass(frozen=True)
class Part:
    name: str
    what: str
    tests: tuple[str, ...] = ()  # test functions of tests/test_gpu.py; none: `sweep`'s own command
    timed: bool = False  # runs alone, after the correctness parts
    limit_s: dict = field(default_factory=dict)  # seconds by device: "cuda", "cpu"


PARTS = (
    Part(
        "variants",
        "sinks, soft cap, MLA, GQA; own methods, P 1/2/4/8, vs float64",
        ("test_single_gpu_emulation_checks_the_variants_at_one_to_eight_ranks",),
        limit_s={"cuda": 150, "cpu": 1500},
    ),
    Part(
        "masks",
        "7 mask families x uniform/docs; own methods, P 4, vs float64",
        ("test_single_gpu_emulation_checks_every_mask_family",),
        limit_s={"cuda": 150, "cpu": 1500},
    ),
    Part(
        "emulation",
        "own methods, P 2/4/8, MHA/GQA, causal/full, vs float64",
        ("test_single_gpu_emulation_checks_every_own_method_in_bf16",),
        limit_s={"cuda": 150, "cpu": 1500},
    ),
    Part(
        "kernels",
        "fused CUDA kernels by block, MLA dims, soft cap, vs float64",
        (
            "test_torch_flash_blocks_match_float64",
            "test_mla_head_dims_and_softcap_on_the_gpu_kernels_match_float64",
        ),
        limit_s={"cuda": 60, "cpu": 120},
    ),
    Part(
        "peers",
        "world size 1 over NCCL: every method and importable peer",
        ("test_world_size_one_over_nccl_runs_every_method_and_peer",),
        limit_s={"cuda": 75, "cpu": 1200},
    ),
    Part(
        "calibrate",
        "`suite calibrate`: kernel table of gpu_kernels.yaml",
        ("test_calibrate_writes_the_kernel_table_of_the_main_shapes",),
        timed=True,
        limit_s={"cuda": 110, "cpu": 600},
    ),
    Part(
        "sweep",
        "`suite run` h100_headline, short, own methods at P 8 (threads)",
        timed=True,
        limit_s={"cuda": 70, "cpu": 600},
    ),
)
# The whole run's limit: the device tool's call is at most 8 minutes (480 s) with --timeout 480; the
# parts end by this, leaving time to write the files.
TOTAL_S = {"cuda": 440, "cpu": 3600}
JOBS = {"cuda": 3, "cpu": 3}


def sweep_command(device: str, results: Path) -> list[str]:
    """`suite run` on configs/h100_headline.yaml, cut to a few trials: every own method emulated at
    P = 8 on the one device (threads), one short length, causal, forward+backward, checked."""
    small = device != "cuda"
    return [
        sys.executable,
        "-m",
        "suite",
        "run",
        "configs/h100_headline.yaml",
        "name=gpu_check_headline",
        "run.executor=threads",
        f"run.device={device}",
        "run.warmup=1",
        "run.repeats=3",
        "sweep.methods=[own]",
        "sweep.world_size=[8]",
        f"sweep.seq_len=[{1008 if small else 8064}]",
        *(["sweep.heads=[8]", "sweep.kv_heads=[2]", "sweep.head_dim=[32]"] if small else []),
        "sweep.causal=[true]",
        "sweep.passes=[fwd_bwd]",
        "sweep.exclude=[]",
        "sweep.method_options={}",
        "tracking.mlflow=false",
        f"results.root={results}",
        "--no-progress",
    ]


DEVICE_PROBE = r"""
import importlib.util, json, os, platform, sys
info = {"python": platform.python_version(), "executable": sys.executable}
try:
    import torch
except Exception as e:
    print(json.dumps({**info, "error": f"torch does not import: {e}"})); raise SystemExit(0)
info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(name=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                sms=p.multi_processor_count, gpus=torch.cuda.device_count())
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        pass
else:
    info.update(name=platform.processor() or platform.machine(), cores=os.cpu_count())
def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except Exception:  # a broken package, or an import hook that refuses it
        return False
info["packages"] = {m: found(m) for m in
                    ("hydra", "omegaconf", "mlflow", "psutil", "tqdm", "tabulate", "pandas", "pyarrow",
                     "flash_attn", "yunchang", "ring_flash_attn")}
try:
    from methods import kernels
    info["kernels"] = {k: list(kernels.kernel_status(k)) for k in kernels.KERNELS}
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info["kernel_auto"] = kernels.resolve_kernel("auto", dev, torch.bfloat16, 128)
except Exception as e:
    info["kernels_error"] = f"{type(e).__name__}: {e}"
print(json.dumps(info))
"""


@dataclass
class Result:
    name: str
    what: str
    status: str = "not run"  # passed, failed, timeout (cut at its limit), stopped (from outside), not run
    seconds: float = 0.0
    limit_s: float = 0.0
    rc: Optional[int] = None
    tests: dict = field(default_factory=dict)  # passed, failed, skipped
    rows: dict = field(default_factory=dict)  # by status
    problems: list = field(default_factory=list)


# -- running the parts ---------------------------------------------------------------------------------------
class Running:
    def __init__(self, part: Part, proc: subprocess.Popen, log, limit_s: float, work: Path):
        self.part, self.proc, self.log, self.limit_s, self.work = part, proc, log, limit_s, work
        self.start = time.monotonic()


def _kill(proc: subprocess.Popen) -> None:
    """End a part and every process it started (its own session): TERM, then KILL after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _child_setup() -> None:
    """In a part's process before it runs: its own session (it and what it starts end together), and
    a SIGKILL when this script dies (killed at the device tool's timeout, say), so no part runs on
    into the next call."""
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the parts end at their limits or with the session


def part_command(part: Part, device: str, work: Path, limit_s: float) -> list[str]:
    if not part.tests:
        return sweep_command(device, work / "results")
    ids = [f"{TESTS}::{t}" for t in part.tests]
    # pytest-timeout's per-test limit (pyproject: 300 s) yields to the part's own, which this script keeps
    return [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=-ra",
        "-o",
        f"timeout={int(limit_s) + 60}",
        f"--junitxml={work / 'junit.xml'}",
        *ids,
    ]


def start_part(part: Part, device: str, work_root: Path, env: dict, limit_s: float, echo) -> Running:
    work = work_root / part.name
    work.mkdir(parents=True, exist_ok=True)
    log = open(work / "log.txt", "w")
    cmd = part_command(part, device, work, limit_s)
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    child_env = dict(env, SUITE_GPU_CHECK_OUT=str(work))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_child_setup)
    echo(f"start {part.name} (limit {limit_s:.0f} s)")
    return Running(part, proc, log, limit_s, work)


def read_rows(work: Path) -> list[dict]:
    """Every row the part's sweeps stored (results/<sweep>/<time>/trials.jsonl), damaged lines skipped."""
    rows = []
    for path in sorted(work.glob("results/*/*/trials.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a kill
    return rows


def read_junit(path: Path) -> tuple[dict, list[str]]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    problems: list[str] = []
    if not path.exists():  # cut before pytest wrote it
        return {}, problems
    try:
        cases = list(ET.parse(path).iter("testcase"))
    except ET.ParseError as e:  # written when the part was cut
        return {}, [f"its pytest report is unreadable ({e})"]
    for case in cases:
        name = case.get("name", "?")
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            counts["failed"] += 1
            text = (bad.get("message") or bad.text or "").strip().splitlines()
            problems.append(f"{name}: {' '.join(text[:3])[:400]}")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            problems.append(f"{name}: skipped: {(case.find('skipped').get('message') or '')[:200]}")
        else:
            counts["passed"] += 1
    return counts, problems


def finish_part(run: Running, result: Result, timed_out: bool, stopped: bool = False) -> list[dict]:
    run.log.close()
    result.seconds = time.monotonic() - run.start
    result.rc = run.proc.returncode
    rows = read_rows(run.work)
    for r in rows:
        r["part"] = run.part.name
    result.rows = {}
    for r in rows:
        result.rows[r.get("status", "?")] = result.rows.get(r.get("status", "?"), 0) + 1
    bad = [r for r in rows if r.get("status") not in GOOD_STATUSES]
    if run.part.tests:
        result.tests, result.problems = read_junit(run.work / "junit.xml")
    result.problems += [
        f"row {r.get('method')} P={r.get('world_size')} mask={r.get('mask') or ''} {r.get('status')}: "
        f"{str(r.get('reason', ''))[:200]}"
        for r in bad[:8]
    ]
    if stopped:
        result.status = "stopped"
        result.problems.insert(0, f"stopped from outside after {result.seconds:.0f} s; {len(rows)} rows stored by then")
    elif timed_out:
        result.status = "timeout"
        result.problems.insert(0, f"cut at its limit of {run.limit_s:.0f} s; {len(rows)} rows stored by then")
    elif result.rc == 0 and not bad and not result.tests.get("failed") and (rows or run.part.tests):
        result.status = "passed"
    else:
        result.status = "failed"
        if not rows and not run.part.tests:
            result.problems.append("the sweep stored no rows")
        if result.rc not in (0, 1):
            tail = (run.work / "log.txt").read_text(errors="replace").strip().splitlines()[-3:]
            result.problems.append(f"exit status {result.rc}: {' | '.join(tail)[:400]}")
    return rows


# -- the summary ---------------------------------------------------------------------------------------------
def worst_ratios(rows: list[dict]) -> list[tuple[str, float, str, str, int]]:
    """Per method: (method, worst error / tolerance over its checked rows, the tensor, the part, rows)."""
    worst: dict[str, list] = {}
    for r in rows:
        if not r.get("checked") or r.get("status") not in ("ok", "incorrect"):
            continue
        entry = worst.setdefault(r["method"], [0.0, "", "", 0])
        entry[3] += 1
        for t in CHECKED:
            err, tol = r.get(f"err_{t}"), r.get(f"tol_{t}")
            if isinstance(err, (int, float)) and isinstance(tol, (int, float)) and tol > 0 and err / tol > entry[0]:
                entry[:3] = [err / tol, t, r.get("part", "")]
    return sorted(((m, *v) for m, v in worst.items()), key=lambda x: -x[1])


def describe_device(info: dict) -> str:
    if "error" in info:
        return f"device unknown: {info['error']}"
    if info.get("cuda_available"):
        head = f"{info.get('name')} (sm {info.get('capability')}, {info.get('memory_gib')} GiB, {info.get('sms')} SMs)"
    else:
        head = f"CPU {info.get('name')} ({info.get('cores')} cores): a dry run, no GPU"
    return (
        f"{head}; torch {info.get('torch')}, CUDA {info.get('cuda')}, NCCL {info.get('nccl', '-')}, "
        f"Python {info.get('python')}"
    )


def summary_text(info: dict, smi: str, results: list[Result], rows: list[dict], meta: dict) -> str:
    passed = results and all(r.status == "passed" for r in results) and not meta.get("fatal")
    verdict = "PASS" if passed else "FAIL"
    if meta.get("running"):
        verdict = f"RUNNING ({meta['running']})"
    pk = info.get("packages", {})
    missing = sorted(m for m, ok in pk.items() if not ok)
    lines = [
        f"# GPU check ({meta['device']}): {verdict}",
        "",
        f"- device: {describe_device(info)}",
        *([f"- nvidia-smi: {smi}"] if smi else []),
        f"- kernel `auto`: {info.get('kernel_auto', info.get('kernels_error', '?'))}; "
        f"flash_attn: {'yes' if (info.get('kernels', {}).get('flash_attn') or [False])[0] else 'no'}; "
        f"not importable: {', '.join(missing) or 'none'}",
        f"- wheels: {meta['wheels']}",
        f"- {meta['started']}; {meta['elapsed_s']:.0f} s of the {meta['total_s']:.0f} s limit; "
        f"correctness parts {meta['jobs']} at a time",
        "",
        "| part | what | result | tests pass/fail/skip | rows ok/bad/skip | s | limit s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        t = r.tests
        tests = f"{t.get('passed', 0)}/{t.get('failed', 0)}/{t.get('skipped', 0)}" if t else "-"
        ok, skip = r.rows.get("ok", 0), r.rows.get("skipped", 0)
        bad = sum(r.rows.values()) - ok - skip
        lines.append(
            f"| {r.name} | {r.what} | {r.status} | {tests} | {ok}/{bad}/{skip} | {r.seconds:.0f} | {r.limit_s:.0f} |"
        )
    worst = worst_ratios(rows)
    if worst:
        lines += ["", "Worst error / tolerance per method over its checked rows (above 1 fails):", ""]
        lines += ["| method | worst | tensor | part | rows |", "|---|---|---|---|---|"]
        lines += [f"| {m} | {v:.3f} | {t} | {p} | {n} |" for m, v, t, p, n in worst]
    problems = [f"- {meta['fatal']}"] if meta.get("fatal") else []
    problems += [f"- {r.name}: {p}" for r in results for p in r.problems if not p.startswith(("test_", "row"))]
    problems += [f"- {r.name}: {p}" for r in results for p in r.problems if p.startswith(("test_", "row"))]
    if problems:
        lines += ["", "Problems and skips (more in log.txt):", ""] + problems[:20]
        if len(problems) > 20:
            lines.append(f"- ... {len(problems) - 20} more")
    return "\n".join(lines) + "\n"


# -- driver --------------------------------------------------------------------------------------------------
def install_wheels(wheels: Optional[Path], site: Path) -> tuple[str, bool]:
    found = sorted(wheels.glob("*.whl")) if wheels and wheels.is_dir() else []
    if not found:
        return f"none carried ({wheels or 'no folder'}); the suite's imports come from the environment", True
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    cmd += ["--no-cache-dir", "--upgrade", "--target", str(site), *map(str, found)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    names = ", ".join(p.name.split("-")[0] + " " + p.name.split("-")[1] for p in found)
    if res.returncode:
        return f"pip install of {names} failed: {(res.stderr or res.stdout).strip()[-300:]}", False
    return f"{len(found)} installed into a temporary folder: {names}", True


def nvidia_smi() -> str:
    if not shutil.which("nvidia-smi"):
        return ""
    fields = "name,driver_version,memory.total,clocks.max.sm,power.limit"
    try:
        res = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
        return res.stdout.strip().replace("\n", "; ")
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi failed: {e}"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "results/gpu_check_run", help="folder for the files")
    ap.add_argument(
        "--device",
        default=os.environ.get("SUITE_GPU_CHECK_DEVICE", "cuda"),
        choices=["cuda", "cpu"],
        help="cuda (default), or cpu: the dry run",
    )
    ap.add_argument("--parts", default=",".join(p.name for p in PARTS), help="comma-separated, in this order")
    ap.add_argument("--total", type=float, default=None, help="seconds for the whole run (cuda 440, cpu 3600)")
    ap.add_argument("--limit", action="append", default=[], metavar="PART=S", help="one part's limit, seconds")
    ap.add_argument("--jobs", type=int, default=None, help="correctness parts at a time (cuda 3, cpu 1)")
    ap.add_argument("--wheels", default=".whl", help="folder of carried wheels ('' for none)")
    args = ap.parse_args(argv)

    t0 = time.monotonic()
    for sig in (signal.SIGTERM, signal.SIGHUP):  # stopped from outside: end the parts, write the files
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    device = args.device
    total = args.total or TOTAL_S[device]
    jobs = args.jobs or JOBS[device]
    wanted = [p.strip() for p in args.parts.split(",") if p.strip()]
    known = {p.name: p for p in PARTS}
    unknown = [p for p in wanted if p not in known]
    if unknown:
        ap.error(f"--parts: unknown {unknown}; choose from {list(known)}")
    limits = {}
    for item in args.limit:
        name, _, secs = item.partition("=")
        if name not in known or not secs.replace(".", "", 1).isdigit():
            ap.error(f"--limit takes PART=SECONDS with PART one of {list(known)}, got {item!r}")
        limits[name] = float(secs)
    parts = [known[p] for p in wanted]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work = tmp / "work"

    def echo(msg: str) -> None:
        print(f"[{time.monotonic() - t0:5.0f} s] {msg}", flush=True)

    wheels_note, wheels_ok = install_wheels(Path(args.wheels) if args.wheels else None, tmp / "site")
    echo(f"wheels: {wheels_note}")
    env = dict(os.environ, PYTHONUNBUFFERED="1", SUITE_GPU_CHECK_DEVICE=device)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tmp / "site")] * wheels_ok + [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    )
    probe = subprocess.run(
        [sys.executable, "-c", DEVICE_PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    try:
        info = json.loads(probe.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        info = {"error": f"the device probe failed: {(probe.stderr or probe.stdout).strip()[-400:]}"}
    smi = nvidia_smi()
    info["nvidia_smi"] = smi
    (out / "device.json").write_text(json.dumps(info, indent=1) + "\n")
    echo(f"device: {describe_device(info)}")
    fatal = ""
    if device == "cuda" and not info.get("cuda_available"):
        fatal = "no CUDA device seen (device.json): the GPU tests skip; --device cpu is the dry run"
        echo(fatal)

    results = {p.name: Result(p.name, p.what) for p in parts}
    all_rows: list[dict] = []
    meta = {
        "device": device,
        "wheels": wheels_note,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "total_s": total,
        "jobs": jobs,
        "fatal": fatal,
    }

    def write_files(running: str = "") -> None:
        meta.update(elapsed_s=time.monotonic() - t0, running=running)
        ordered = [results[p.name] for p in parts]
        (out / "summary.md").write_text(summary_text(info, smi, ordered, all_rows, meta))
        (out / "parts.json").write_text(json.dumps([asdict(r) for r in ordered], indent=1) + "\n")
        with open(out / "rows.jsonl", "w") as f:
            for r in all_rows:
                f.write(json.dumps(r) + "\n")
        with open(out / "log.txt", "w") as f:
            for p in parts:
                log = work / p.name / "log.txt"
                if log.exists():
                    f.write(f"===== {p.name} =====\n{log.read_text(errors='replace')}\n")
        cal = work / "calibrate"
        for src, dst in (
            (cal / "kernels.md", "kernels.md"),
            (cal / "calibration" / "gpu.blocks.yaml", "calibration.blocks.yaml"),
        ):
            if src.exists():
                shutil.copyfile(src, out / dst)

    write_files("starting")
    queue = [p for p in parts if not p.timed] + [p for p in parts if p.timed]
    running: list[Running] = []
    try:
        while queue or running:
            # a timed part starts only when nothing else runs; correctness parts fill `jobs` slots
            while queue and ((not queue[0].timed and len(running) < jobs) or (queue[0].timed and not running)):
                part = queue.pop(0)
                left = total - (time.monotonic() - t0) - 5
                limit = min(limits.get(part.name, part.limit_s[device]), left)
                results[part.name].limit_s = max(limit, 0)
                if left < 5:
                    results[part.name].problems.append(f"no time left ({left:.0f} s of the {total:.0f} s limit)")
                    echo(f"skip {part.name}: no time left")
                    continue
                running.append(start_part(part, device, work, env, limit, echo))
                write_files(", ".join(r.part.name for r in running))
            time.sleep(0.5)
            for run in list(running):
                over = time.monotonic() - run.start > run.limit_s
                if run.proc.poll() is None and not over:
                    continue
                if over and run.proc.poll() is None:
                    _kill(run.proc)
                running.remove(run)
                res = results[run.part.name]
                all_rows.extend(finish_part(run, res, timed_out=over and run.proc.returncode != 0))
                echo(f"{run.part.name}: {res.status} in {res.seconds:.0f} s, rows {res.rows}, tests {res.tests}")
                write_files(", ".join(r.part.name for r in running))
    finally:
        for run in running:  # interrupted: end what still runs, keep what it stored
            _kill(run.proc)
            all_rows.extend(finish_part(run, results[run.part.name], timed_out=False, stopped=True))
        write_files()
        shutil.rmtree(tmp, ignore_errors=True)
    text = (out / "summary.md").read_text()
    print("\n" + text, flush=True)
    return 0 if text.startswith(f"# GPU check ({device}): PASS") else 1


if __name__ == "__main__":
    sys.exit(main())
