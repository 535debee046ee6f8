"""Side-by-side CPU measurement of the methods' own overhead in two trees (before / after a change).

The overhead ratio (iteration / (kernels + time blocked in communication), mean over ranks;
`run.breakdown`) of configs/overhead_cpu.yaml's world-size-4 trials, measured in both trees
alternately (rounds A B B A A B ..., so that a drift of the machine's load hits both alike), each
tree running its own code (`python -m suite run` with that tree as working directory puts it first
on sys.path; checked before the first round). Per (method, mask, pass) and tree: the median over
rounds of the trial's ratio and of its iteration time, and the range over rounds; "lower"
counts the trials whose after-range lies wholly below the before-range. Per method, round by
round: after / before of the same round (geometric mean over the method's trials), its median and
range over rounds, and in how many rounds it is below 1. `--json` also keeps every round's rows.

    .venv/bin/python benchmarks/overhead_ab.py                          # eff2561 vs this tree, 4 rounds
    .venv/bin/python benchmarks/overhead_ab.py --quick --methods ring   # 2 rounds, few repeats
    .venv/bin/python benchmarks/overhead_ab.py --before-rev HEAD~3 --json out.json

A benchmark, not a test: on a machine with fewer cores than 4 ranks the ranks time-share cores,
and other work on the machine moves every number; read the ranges.

`--cpu-time` adds a diagnostic that the machine's load moves far less (it is not the target's
measure): the same trials on 4 rank threads in one process (the threads comm, one intra-op thread
each), every region timed in the thread's own CPU time (time.thread_time) instead of wall time, so
a rank that is descheduled or blocked costs nothing; per (method, mask, pass) the CPU ms a rank's
iteration spends outside kernels and communication calls (median over iterations, mean over
ranks), i.e. the code's own bookkeeping.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parents[1]
KEYS = ["method", "causal", "pass"]


def ensure_tree(rev: str, where: Path) -> Path:
    """A detached worktree of `rev` at `where` (made if missing)."""
    if not (where / "suite").is_dir():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), rev],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return where


def check_imports(tree: Path) -> None:
    """The child process run in `tree` must import that tree's code, not this one's."""
    out = subprocess.run(
        [sys.executable, "-c", "import suite, methods; print(suite.__file__, methods.__file__)"],
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for path in out:
        if not Path(path).resolve().is_relative_to(tree.resolve()):
            raise SystemExit(f"{tree}: imports {path}, not its own code")


def world_size_4_config(tree: Path, methods, out: Path) -> Path:
    """The tree's configs/overhead_cpu.yaml reduced to its world-size-4 trials of `methods` (default:
    all but the single-device reference), written to `out`."""
    cfg = yaml.safe_load((tree / "configs" / "overhead_cpu.yaml").read_text())
    sweep = cfg["sweep"]
    sweep["methods"] = [m for m in (methods or sweep["methods"]) if m != "reference"]
    sweep["world_size"] = [4]
    sweep.pop("exclude", None)  # they only pair the reference with world size 1
    sweep["method_options"] = {m: o for m, o in sweep.get("method_options", {}).items() if m in sweep["methods"]}
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def run_once(tree: Path, out_root: Path, args) -> pd.DataFrame:
    """One run of the overhead sweep in `tree`: its world-size-4 rows."""
    out_root.mkdir(parents=True)
    config = world_size_4_config(tree, args.methods, out_root / "overhead_ab.yaml")
    cmd = [
        sys.executable,
        "-m",
        "suite",
        "run",
        str(config),
        "--no-progress",
        "run.breakdown=true",
        f"run.repeats={args.repeats}",
        f"run.warmup={args.warmup}",
        "tracking.mlflow=false",
        f"results.root={out_root}",
    ]
    env = {**os.environ, "MLFLOW_TRACKING_URI": ""}
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for f in out_root.glob("*/*/trials.jsonl") for line in f.read_text().splitlines()]
    df = pd.DataFrame(rows)
    df = df[(df["world_size"] == 4) & (df["status"] == "ok")].copy()
    # The trial records the ratio as a mean over ranks of iteration / (kernels + wait), not the
    # breakdown's iteration time itself; (ratio - 1) * (kernels + wait), both means over ranks, is
    # the absolute overhead in ms (exact when the ranks' split is equal). time_ms_median is the
    # separately timed iteration (max over ranks), kept for scale.
    df["overhead_ms"] = (df["overhead_ratio"] - 1) * (df["kernel_ms"] + df["comm_wait_ms"])
    return df[KEYS + ["overhead_ratio", "overhead_ms", "time_ms_median", "kernel_ms", "comm_wait_ms"]]


# Run as `python -c` in a tree (its own code first on sys.path); prints one JSON line per trial.
# Stopwatch reads its module's `time` (methods/stopwatch.py; methods/timing.py in older trees): a
# stand-in whose perf_counter is thread_time makes the timed kernel and the timing comm count this
# thread's CPU time.
CPU_TIME_PROBE = r"""
import json, statistics, sys, threading, time, types, torch
try:
    import methods.stopwatch as stopwatch
except ImportError:  # a tree from before its rename (methods/timing.py)
    import methods.timing as stopwatch
from methods import kernels
from methods.comm.measure import TimingComm
from methods.comm.threads import ThreadWorld
from methods.registry import get_method
stopwatch.time = types.SimpleNamespace(perf_counter=time.thread_time)
torch.set_num_threads(1)
cfg = json.loads(sys.argv[1])
p, s = 4, cfg["seq_len"]
g = torch.Generator().manual_seed(0)
x = [torch.randn(cfg["batch"], s, cfg["heads"], cfg["head_dim"], generator=g) for _ in range(4)]
for name in cfg["methods"]:
    for causal in (True, False):
        for pass_ in ("fwd", "fwd_bwd"):
            world, rest = ThreadWorld(p), {}
            def rank(r):
                m = get_method(name, **cfg["options"].get(name, {}))
                comm, base = world.comm(r), m.kernel
                q, k, v, do = (t[:, r * s // p:(r + 1) * s // p].contiguous() for t in x)
                def step(c):
                    if pass_ == "fwd":
                        with torch.no_grad():
                            m.attention(q, k, v, causal=causal, comm=c)
                    else:
                        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
                        torch.autograd.grad(m.attention(qg, kg, vg, causal=causal, comm=c), (qg, kg, vg), do)
                for _ in range(cfg["warmup"]):
                    step(comm)
                own = []
                for _ in range(cfg["repeats"]):
                    timed, tcomm = kernels.TimedKernel(base), TimingComm(comm)
                    m.kernel = timed
                    comm.barrier()
                    t0 = time.thread_time()
                    step(tcomm)
                    own.append(time.thread_time() - t0 - timed.seconds - tcomm.seconds)
                m.kernel = base
                rest[r] = statistics.median(own) * 1e3
            threads = [threading.Thread(target=rank, args=(r,)) for r in range(p)]
            for t in threads: t.start()
            for t in threads: t.join()
            print(json.dumps({"method": name, "causal": causal, "pass": pass_,
                              "own_cpu_ms": sum(rest.values()) / p}), flush=True)
"""


def cpu_time_once(tree: Path, args) -> pd.DataFrame:
    """The CPU-time diagnostic (see the module's docstring) run once in `tree`."""
    cfg = yaml.safe_load((tree / "configs" / "overhead_cpu.yaml").read_text())["sweep"]
    methods = [m for m in (args.methods or cfg["methods"]) if m != "reference"]
    probe = {
        "methods": methods,
        "options": cfg.get("method_options", {}),
        "seq_len": cfg["seq_len"][0],
        "batch": cfg["batch"][0],
        "heads": cfg["heads"][0],
        "head_dim": cfg["head_dim"][0],
        "warmup": args.warmup,
        "repeats": args.repeats,
    }
    out = subprocess.run(
        [sys.executable, "-c", CPU_TIME_PROBE, json.dumps(probe)],
        cwd=tree,
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    ).stdout
    return pd.DataFrame([json.loads(line) for line in out.splitlines() if line.startswith("{")])


def summarize(frames: dict[str, list[pd.DataFrame]]) -> pd.DataFrame:
    rows = []
    before = pd.concat(frames["before"]).groupby(KEYS)
    after = pd.concat(frames["after"]).groupby(KEYS)
    for key, b in before:
        a = after.get_group(key)
        row = dict(zip(KEYS, key))
        for name, d in (("before", b), ("after", a)):
            for col in ("overhead_ratio", "overhead_ms", "time_ms_median", "own_cpu_ms"):
                if col not in d:
                    continue
                v = list(d[col])
                row[f"{col}_{name}"] = statistics.median(v)
                row[f"{col}_{name}_min"], row[f"{col}_{name}_max"] = min(v), max(v)
        if "overhead_ratio_before" in row:
            row["ratio_lower"] = row["overhead_ratio_after"] < row["overhead_ratio_before"]
            row["ratio_lower_beyond_range"] = row["overhead_ratio_after_max"] < row["overhead_ratio_before_min"]
            row["overhead_ms_lower_beyond_range"] = row["overhead_ms_after_max"] < row["overhead_ms_before_min"]
        if "own_cpu_ms_before" in row:
            row["own_cpu_ms_lower_beyond_range"] = row["own_cpu_ms_after_max"] < row["own_cpu_ms_before_min"]
        rows.append(row)
    return pd.DataFrame(rows)


def markdown(df: pd.DataFrame) -> str:
    lines = [
        "| method | mask | pass | overhead ratio before | after | overhead ms before | after "
        "| iteration ms before | after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(r, col, name, fmt):
        return f"{r[f'{col}_{name}']:{fmt}} ({r[f'{col}_{name}_min']:{fmt}}-{r[f'{col}_{name}_max']:{fmt}})"

    for _, r in df.sort_values(KEYS).iterrows():
        lines.append(
            f"| {r['method']} | {'causal' if r['causal'] else 'full'} | {r['pass']} | "
            f"{cell(r, 'overhead_ratio', 'before', '.3f')} | {cell(r, 'overhead_ratio', 'after', '.3f')} | "
            f"{cell(r, 'overhead_ms', 'before', '.2f')} | {cell(r, 'overhead_ms', 'after', '.2f')} | "
            f"{cell(r, 'time_ms_median', 'before', '.1f')} | {cell(r, 'time_ms_median', 'after', '.1f')} |"
        )
    n = len(df)
    lines.append("")
    lines.append(
        f"overhead ratio lower after (medians over rounds): {int(df['ratio_lower'].sum())} of {n}; "
        f"lower with the ranges apart: {int(df['ratio_lower_beyond_range'].sum())} of {n}; "
        f"overhead ms lower with the ranges apart: {int(df['overhead_ms_lower_beyond_range'].sum())} of {n}"
    )
    return "\n".join(lines)


def by_method(frames: dict[str, list[pd.DataFrame]], col: str) -> pd.DataFrame:
    """Per method and round: the geometric mean over the method's trials (mask x pass) of `col`,
    after / before of the same round (the two trees ran back to back, so a drift of the machine's
    load between rounds hits both); then per method the median over rounds of that quotient, its
    range, and in how many rounds it is below 1."""
    rows = []
    for i, (b, a) in enumerate(zip(frames["before"], frames["after"])):
        m = b.merge(a, on=KEYS, suffixes=("_before", "_after"))
        m["q"] = m[f"{col}_after"] / m[f"{col}_before"]
        for method, g in m.groupby("method"):
            rows.append({"method": method, "round": i, "quotient": float(g["q"].prod() ** (1 / len(g)))})
    df = pd.DataFrame(rows)
    out = []
    for method, g in df.groupby("method"):
        q = list(g["quotient"])
        out.append(
            {
                "method": method,
                "median": statistics.median(q),
                "min": min(q),
                "max": max(q),
                "rounds_lower": sum(x < 1 for x in q),
                "rounds": len(q),
            }
        )
    return pd.DataFrame(out)


def method_markdown(df: pd.DataFrame, what: str) -> str:
    lines = [
        f"| method | {what} after / before (geometric mean over its trials; median over rounds, range) "
        "| rounds lower |",
        "|---|---|---|",
    ]
    for _, r in df.sort_values("method").iterrows():
        lines.append(
            f"| {r['method']} | {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}) "
            f"| {int(r['rounds_lower'])} of {int(r['rounds'])} |"
        )
    return "\n".join(lines)


def cpu_markdown(df: pd.DataFrame) -> str:
    lines = ["| method | mask | pass | own CPU ms before | after |", "|---|---|---|---|---|"]
    for _, r in df.sort_values(KEYS).iterrows():
        cells = [
            f"{r[f'own_cpu_ms_{n}']:.2f} ({r[f'own_cpu_ms_{n}_min']:.2f}-{r[f'own_cpu_ms_{n}_max']:.2f})"
            for n in ("before", "after")
        ]
        mask = "causal" if r["causal"] else "full"
        lines.append(f"| {r['method']} | {mask} | {r['pass']} | {cells[0]} | {cells[1]} |")
    lower = int((df["own_cpu_ms_after"] < df["own_cpu_ms_before"]).sum())
    lines += [
        "",
        f"own CPU ms lower after (medians over rounds): {lower} of {len(df)}; "
        f"lower with the ranges apart: {int(df['own_cpu_ms_lower_beyond_range'].sum())} of {len(df)}",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before-rev", default="eff2561", help="the 'before' commit (default: eff2561)")
    ap.add_argument("--before-dir", type=Path, help="its worktree (default: ../<repo>-before-<rev>)")
    ap.add_argument("--after-dir", type=Path, default=ROOT, help="the 'after' tree (default: this one)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--methods", nargs="*", help="default: every method of the config")
    ap.add_argument("--quick", action="store_true", help="2 rounds, 5 repeats, 2 warm-up")
    ap.add_argument("--json", type=Path, help="also write the summary rows here")
    ap.add_argument("--cpu-time", action="store_true", help="also the CPU-time diagnostic, alternating likewise")
    ap.add_argument("--cpu-time-only", action="store_true", help="only the CPU-time diagnostic")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.repeats, args.warmup = 2, 5, 2
    before = ensure_tree(args.before_rev, args.before_dir or ROOT.parent / f"{ROOT.name}-before-{args.before_rev}")
    trees = {"before": before, "after": args.after_dir}
    for tree in trees.values():
        check_imports(tree)
    frames: dict[str, list[pd.DataFrame]] = {"before": [], "after": []}
    cpu: dict[str, list[pd.DataFrame]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="overhead_ab_") as scratch:
        for i in range(args.rounds):
            order = ("before", "after") if i % 2 == 0 else ("after", "before")  # A B B A ...
            for name in order:
                if not args.cpu_time_only:
                    frames[name].append(run_once(trees[name], Path(scratch) / f"{name}{i}", args))
                if args.cpu_time or args.cpu_time_only:
                    cpu[name].append(cpu_time_once(trees[name], args))
                print(f"round {i + 1}/{args.rounds}: {name} done", file=sys.stderr)
    print(
        f"# before = {args.before_rev} ({before}), after = {args.after_dir}; {args.rounds} rounds, "
        f"run.repeats={args.repeats}, run.warmup={args.warmup}; medians over rounds (range)"
    )
    out = {}
    # the ratio's excess over 1 is the overhead; its quotient is what the target asks to be below 1
    for kind, got, table, col, what, title in (
        ("wall", frames, markdown, "overhead_ratio", "overhead ratio", ""),
        (
            "cpu_time",
            cpu,
            cpu_markdown,
            "own_cpu_ms",
            "own CPU ms",
            "\n## CPU-time diagnostic (thread CPU time outside kernels and communication, per rank)\n",
        ),
    ):
        if not got["before"]:
            continue
        summary, per_method = summarize(got), by_method(got, col)
        if title:
            print(title)
        print(table(summary))
        print("\nPer method, round by round:\n")
        print(method_markdown(per_method, what))
        out[kind], out[f"{kind}_by_method"] = summary.to_dict(orient="records"), per_method.to_dict(orient="records")
    # every round's rows, so that a later reading can pair or pool them differently
    out["rounds"] = {
        kind: {name: [f.to_dict(orient="records") for f in fs] for name, fs in d.items()}
        for kind, d in (("wall", frames), ("cpu_time", cpu))
        if d["before"]
    }
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=lambda x: x.item() if hasattr(x, "item") else float(x)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
