"""Markdown tables of a simulate_dispatch run (configs/simulate_dispatch.yaml): for each world size and
mask, every own method's bytes per rank, max/mean visible area and predicted time, all simulated.

    .venv/bin/python benchmarks/dispatch_compare.py results/simulate_dispatch/<run> [<run> ...]

Reads only the stored rows (trials.jsonl). Every time is the simulator's prediction with the row's
validated error band (`sim_error_pct`); bytes and areas are counted from the traced schedule.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

MASKS = {
    "causal": "causal",
    "sliding_window:symmetric=false,window=0.0625": "sliding window (S/16)",
    "block_causal:block=0.0625": "block-causal (blocks of S/16)",
}


def label(row: dict) -> str:
    mask = row.get("mask") or ("causal" if row["causal"] else "full")
    name = MASKS.get(mask, mask)
    return f"packed {name} documents (at most S/4)" if row.get("workload") else name


def method_name(row: dict) -> str:
    opts = json.loads(row.get("options") or "{}")
    shown = {k: v for k, v in opts.items() if k != "kernel"}
    return row["method"] + (f"({', '.join(f'{k}={v}' for k, v in sorted(shown.items()))})" if shown else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "runs",
        type=Path,
        nargs="+",
        help="results folders of configs/simulate_dispatch.yaml (a later one's methods win)",
    )
    args = ap.parse_args()
    # a later run replaces every row of the methods it holds (one method rerun after a change)
    rows: list[dict] = []
    for run in args.runs:
        mine = [json.loads(line) for line in (run / "trials.jsonl").read_text().splitlines() if line.strip()]
        rerun = {r["method"] for r in mine}
        rows = [r for r in rows if r["method"] not in rerun] + mine
    groups: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["world_size"], label(r))].append(r)
    for (p, mask), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        ok = [r for r in rs if r["status"] in ("ok", "simulated") and r.get("time_ms_median") is not None]
        print(f"\n### P = {p}, {mask} (S = {rs[0]['seq_len']}), simulated\n")
        print("| method | MiB sent per rank | MiB received per rank | max/mean area | predicted ms (simulated) |")
        print("|---|---:|---:|---:|---:|")
        for r in sorted(ok, key=lambda r: r["time_ms_median"]):
            area = f"{r['imbalance']:.2f}" if r.get("imbalance") is not None else "—"
            band = f" ± {r['sim_error_pct']:.1f} %" if r.get("sim_error_pct") is not None else ""
            print(
                f"| {method_name(r)} | {r['bytes_sent_per_rank'] / 2**20:.0f} | {r['bytes_recv_per_rank'] / 2**20:.0f} "
                f"| {area} | {r['time_ms_median']:.1f}{band} |"
            )
        for r in rs:
            if r not in ok:
                print(f"| {method_name(r)} | {r['status']}: {r.get('reason') or ''} | | | |")
        best_other = [r for r in ok if r["method"] != "dispatch"]
        mine = [r for r in ok if r["method"] == "dispatch"]
        if mine and best_other:
            # the default (automatic chunk, 4 per rank) speaks for dispatch; its variants are in the table
            d = next((r for r in mine if json.loads(r["options"] or "{}").get("chunk", 0) == 0), mine[0])
            least_bytes = min(best_other, key=lambda r: r["bytes_sent_per_rank"])
            fastest = min(best_other, key=lambda r: r["time_ms_median"])
            print(
                f"\n{method_name(d)} vs the best other: bytes sent {d['bytes_sent_per_rank'] / 2**20:.0f} MiB vs "
                f"{least_bytes['bytes_sent_per_rank'] / 2**20:.0f} ({method_name(least_bytes)}); predicted "
                f"{d['time_ms_median']:.1f} ms vs {fastest['time_ms_median']:.1f} ({method_name(fastest)}), "
                f"ratio {d['time_ms_median'] / fastest['time_ms_median']:.2f}"
            )
            zz = [r for r in ok if r["method"] == "zigzag_ring"]
            if zz:
                print(
                    f"{method_name(d)} / zigzag_ring predicted time: "
                    f"{d['time_ms_median'] / zz[0]['time_ms_median']:.2f}"
                )


if __name__ == "__main__":
    main()
