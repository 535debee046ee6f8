"""Side-by-side CPU measurement of the methods' own overhead in two trees (before / after a change).

The overhead ratio (iteration / (kernels + time blocked in communication), mean over ranks;
`run.breakdown`) of configs/overhead_cpu.yaml's world-size-4 trials, measured in both trees
alternately (rounds A B B A A B ..., so that a drift of the machine's load hits both alike), each
tree running its own code (`python -m suite run` with that tree as working directory puts it first
on sys.path; checked before the first round). Per (method, mask, pass) and tree: the median over
rounds of the trial's ratio and of its iteration time, and the range over rounds; "lower"
counts the trials whose after-range lies wholly below the before-range.

    .venv/bin/python benchmarks/overhead_ab.py                          # eff2561 vs this tree, 4 rounds
    .venv/bin/python benchmarks/overhead_ab.py --quick --methods ring   # 2 rounds, few repeats
    .venv/bin/python benchmarks/overhead_ab.py --before-rev HEAD~3 --json out.json

A benchmark, not a test: on a machine with fewer cores than 4 ranks the ranks time-share cores,
and other work on the machine moves every number; read the ranges.
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
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), rev], check=True,
                       stdout=subprocess.DEVNULL)
    return where


def check_imports(tree: Path) -> None:
    """The child process run in `tree` must import that tree's code, not this one's."""
    out = subprocess.run([sys.executable, "-c", "import suite, methods; print(suite.__file__, methods.__file__)"],
                         cwd=tree, capture_output=True, text=True, check=True).stdout.split()
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
    sweep.pop("exclude", None)   # they only pair the reference with world size 1
    sweep["method_options"] = {m: o for m, o in sweep.get("method_options", {}).items() if m in sweep["methods"]}
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def run_once(tree: Path, out_root: Path, args) -> pd.DataFrame:
    """One run of the overhead sweep in `tree`: its world-size-4 rows."""
    out_root.mkdir(parents=True)
    config = world_size_4_config(tree, args.methods, out_root / "overhead_ab.yaml")
    cmd = [sys.executable, "-m", "suite", "run", str(config), "--no-progress",
           "run.breakdown=true", f"run.repeats={args.repeats}", f"run.warmup={args.warmup}",
           "tracking.mlflow=false", f"results.root={out_root}"]
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


def summarize(frames: dict[str, list[pd.DataFrame]]) -> pd.DataFrame:
    rows = []
    before = pd.concat(frames["before"]).groupby(KEYS)
    after = pd.concat(frames["after"]).groupby(KEYS)
    for key, b in before:
        a = after.get_group(key)
        row = dict(zip(KEYS, key))
        for name, d in (("before", b), ("after", a)):
            for col in ("overhead_ratio", "overhead_ms", "time_ms_median"):
                v = list(d[col])
                row[f"{col}_{name}"] = statistics.median(v)
                row[f"{col}_{name}_min"], row[f"{col}_{name}_max"] = min(v), max(v)
        row["ratio_lower"] = row["overhead_ratio_after"] < row["overhead_ratio_before"]
        row["ratio_lower_beyond_range"] = row["overhead_ratio_after_max"] < row["overhead_ratio_before_min"]
        row["overhead_ms_lower_beyond_range"] = row["overhead_ms_after_max"] < row["overhead_ms_before_min"]
        rows.append(row)
    return pd.DataFrame(rows)


def markdown(df: pd.DataFrame) -> str:
    lines = ["| method | mask | pass | overhead ratio before | after | overhead ms before | after "
             "| iteration ms before | after |",
             "|---|---|---|---|---|---|---|---|---|"]

    def cell(r, col, name, fmt):
        return (f"{r[f'{col}_{name}']:{fmt}} ({r[f'{col}_{name}_min']:{fmt}}-{r[f'{col}_{name}_max']:{fmt}})")
    for _, r in df.sort_values(KEYS).iterrows():
        lines.append(f"| {r['method']} | {'causal' if r['causal'] else 'full'} | {r['pass']} | "
                     f"{cell(r, 'overhead_ratio', 'before', '.3f')} | {cell(r, 'overhead_ratio', 'after', '.3f')} | "
                     f"{cell(r, 'overhead_ms', 'before', '.2f')} | {cell(r, 'overhead_ms', 'after', '.2f')} | "
                     f"{cell(r, 'time_ms_median', 'before', '.1f')} | {cell(r, 'time_ms_median', 'after', '.1f')} |")
    n = len(df)
    lines.append("")
    lines.append(f"overhead ratio lower after (medians over rounds): {int(df['ratio_lower'].sum())} of {n}; "
                 f"lower with the ranges apart: {int(df['ratio_lower_beyond_range'].sum())} of {n}; "
                 f"overhead ms lower with the ranges apart: {int(df['overhead_ms_lower_beyond_range'].sum())} of {n}")
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
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.repeats, args.warmup = 2, 5, 2
    before = ensure_tree(args.before_rev, args.before_dir or ROOT.parent / f"{ROOT.name}-before-{args.before_rev}")
    trees = {"before": before, "after": args.after_dir}
    for tree in trees.values():
        check_imports(tree)
    frames: dict[str, list[pd.DataFrame]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="overhead_ab_") as scratch:
        for i in range(args.rounds):
            order = ("before", "after") if i % 2 == 0 else ("after", "before")   # A B B A ...
            for name in order:
                out = Path(scratch) / f"{name}{i}"
                frames[name].append(run_once(trees[name], out, args))
                print(f"round {i + 1}/{args.rounds}: {name} done", file=sys.stderr)
    summary = summarize(frames)
    print(f"# before = {args.before_rev} ({before}), after = {args.after_dir}; {args.rounds} rounds, "
          f"run.repeats={args.repeats}, run.warmup={args.warmup}; medians over rounds (range)")
    print(markdown(summary))
    if args.json:
        args.json.write_text(summary.to_json(orient="records", indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
