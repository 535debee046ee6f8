"""Traced tensor work of every own method: the bytes and aten ops a rank spends outside its
attention kernels and its communication (online-softmax merges, copies, casts, concatenations).

The simulator's tracer (suite.sim.trace) runs each method's real code on meta tensors with P
virtual ranks; its `Memory` events are summed per rank and the worst rank is reported. One
command gives the before/after table of a change:

    .venv/bin/python benchmarks/tensor_work.py                    # B=1, S=8064, 32/32 heads, D=128, bfloat16, P=8
    .venv/bin/python benchmarks/tensor_work.py --seq-len 4032 --world-size 4 --json out.json

Passes: "full fwd" (no mask, forward) and "causal fwd_bwd" (causal, forward + backward), and the
forward part of the latter; "ops/step" is the forward's ops divided by the world size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import methods  # noqa: E402
from methods.base import Case  # noqa: E402
from suite.advise import candidate_methods  # noqa: E402
from suite.sim.ledger import Memory
from suite.sim.trace import trace  # noqa: E402


def worst_rank(tr) -> tuple[int, int]:
    """(ops, bytes) of the rank with the most tensor-work bytes."""
    per_rank = [
        (sum(e.ops for e in r if isinstance(e, Memory)), sum(e.bytes for e in r if isinstance(e, Memory)))
        for r in tr.ranks
    ]
    return max(per_rank, key=lambda x: (x[1], x[0]))


def measure(name: str, case: Case, pass_: str) -> dict:
    tr = trace(name, case, pass_)
    ops, nbytes = worst_rank(tr)
    row = {"method": name, "causal": case.causal, "pass": pass_, "ops": ops, "bytes": nbytes}
    if pass_ == "fwd_bwd":
        f_ops, f_bytes = worst_rank(tr.forward_part())
        row.update(fwd_ops=f_ops, fwd_bytes=f_bytes)
    else:
        f_ops = ops
    row["fwd_ops_per_step"] = f_ops / case.world_size
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=8064)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--methods", nargs="*", help="default: every own method")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    rows = []
    for name in args.methods or candidate_methods():
        for causal, pass_ in ((False, "fwd"), (True, "fwd_bwd")):
            case = Case(
                args.batch, args.seq_len, args.heads, args.kv_heads, args.head_dim, args.dtype, causal, args.world_size
            )
            ok, why = methods.get_method(name).supports(case)
            if not ok:
                print(f"# {name} {pass_}: skipped ({why})")
                continue
            rows.append(measure(name, case, pass_))
    print(
        f"# B={args.batch} S={args.seq_len} H={args.heads}/{args.kv_heads} D={args.head_dim} "
        f"{args.dtype} P={args.world_size}; worst rank"
    )
    print("| method | pass | tensor-work ops | tensor-work bytes | fwd ops / step | fwd bytes |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        label = "causal fwd_bwd" if r["pass"] == "fwd_bwd" else "full fwd"
        fwd_bytes = r.get("fwd_bytes", r["bytes"])
        print(
            f"| {r['method']} | {label} | {r['ops']} | {r['bytes'] / 1e9:.3f} GB | "
            f"{r['fwd_ops_per_step']:.2f} | {fwd_bytes / 1e9:.3f} GB |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
