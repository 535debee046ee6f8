"""The harness's own cost per trial at the main sweep's scale (no attention is computed).

A synthetic sweep of N trials on the simulator (`run.executor: sim`, one topology, ring and ulysses
over many lengths: the simulator traces each schedule shape once and extrapolates, so a trial costs
it little) is planned (`--dry-run`), run, resumed (every trial already recorded), scanned (the
store's rows read back) and loaded by the report's reader. Each phase is timed in a fresh
interpreter; harness ms per trial = (phase time - the simulator's own time in its `run`) / N, in
wall time and in CPU time (the latter also without the interpreter's start and the suite's import).

    .venv/bin/python benchmarks/harness_scale.py --trials 10000
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sweep_yaml(trials: int) -> str:
    """A sim sweep of about `trials` trials: 2 methods x 2 world sizes x 2 masks x 2 passes x lengths."""
    lengths = [4096 + 64 * i for i in range(max(1, -(-trials // 16)))]
    return (
        "name: harness_scale\n"
        "sweep:\n"
        "  methods: [ring, ulysses]\n"
        "  world_size: [4, 8]\n"
        "  batch: [1]\n"
        f"  seq_len: {json.dumps(lengths)}\n"
        "  heads: [32]\n"
        "  kv_heads: [32]\n"
        "  head_dim: [128]\n"
        "  dtype: [bfloat16]\n"
        "  causal: [true, false]\n"
        "  passes: [fwd, fwd_bwd]\n"
        "run:\n"
        "  executor: sim\n"
        "sim:\n"
        "  topology: [h100_sxm]\n"
        "tracking:\n"
        "  mlflow: false\n"
    )


# The sweep runs with the simulator's `run` timed: what it spends predicting a trial is the trial
# itself (as a measured trial's kernels are), the rest of the wall time is the harness.
TIMED_SWEEP = """
import sys, time
import suite.executors.sim as E
spent, cpu = [0.0], [0.0]
original = E.SimExecutor.run
def run(self, spec):
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        return original(self, spec)
    finally:
        spent[0] += time.perf_counter() - t0
        cpu[0] += time.process_time() - c0
E.SimExecutor.run = run
from suite.cli import main
rc = main(sys.argv[1:])
print(f"EXECUTOR_S {spent[0]} {cpu[0]}")
sys.exit(rc)
"""


def timed(cmd: list[str], cwd: Path) -> tuple[float, float, str]:
    """(wall s, CPU s of the child: user + system, stdout). On a shared machine the CPU time is the
    steadier measure; the wall time also holds waits (fsync, other jobs)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), res.stdout


def executor_s(stdout: str) -> tuple[float, float]:
    wall, cpu = stdout.rsplit("EXECUTOR_S ", 1)[1].split()[:2]
    return float(wall), float(cpu)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10000)
    ap.add_argument("--repo", default=str(ROOT), help="the checkout to measure (its .venv runs it)")
    args = ap.parse_args()
    repo = Path(args.repo).resolve()
    py = str(repo / ".venv" / "bin" / "python")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg = tmp / "harness_scale.yaml"
        cfg.write_text(sweep_yaml(args.trials))
        root = f"results.root={tmp / 'results'}"
        args_ = ["run", str(cfg), root, "--no-progress"]
        run = [py, "-m", "suite", *args_]
        phases, own = {}, {}
        phases["dry run"] = timed(run + ["--dry-run"], repo)[:2]
        *phases["sweep"], stdout = timed([py, "-c", TIMED_SWEEP, *args_], repo)
        own["sweep"] = executor_s(stdout)
        run_dir = next((tmp / "results" / "harness_scale").iterdir())
        n = sum(1 for _ in (run_dir / "trials.jsonl").open())
        phases["resume (all recorded)"] = timed(run + ["--resume"], repo)[:2]
        scan = (
            "from suite.results import ResultsStore; import sys; "
            f"s = ResultsStore.open({str(run_dir)!r}); print(len(s.records()), len(s.completed_keys()))"
        )
        phases["store scan"] = timed([py, "-c", scan], repo)[:2]
        load = (
            "from pathlib import Path; from suite.reports import load; "
            f"print(len(load.load_runs([Path({str(run_dir)!r})]).frame))"
        )
        phases["report load"] = timed([py, "-c", load], repo)[:2]
        base = timed([py, "-c", "import suite.runner, suite.cli"], repo)[:2]
    print(
        f"{repo}: {n} trials; the simulator's own time in the sweep {own['sweep'][0]:.1f}s wall, "
        f"{own['sweep'][1]:.1f}s CPU; interpreter + suite import {base[0]:.2f}s wall, {base[1]:.2f}s CPU"
    )
    print(
        "| phase | wall s | CPU s | harness wall ms per trial | harness CPU ms per trial, without start-up |\n"
        "|---|---:|---:|---:|---:|"
    )
    for name, (wall, cpu) in phases.items():
        own_wall, own_cpu = own.get(name, (0.0, 0.0))
        print(
            f"| {name} | {wall:.2f} | {cpu:.2f} | {1000 * (wall - own_wall) / n:.3f} | "
            f"{1000 * max(0.0, cpu - own_cpu - base[1]) / n:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
