"""The compact table printed at the end of a sweep (method x size: status, time, TFLOP/s, bytes)."""
from __future__ import annotations

import json

from tabulate import tabulate

from suite import metrics as M


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def summary_table(records: list[dict]) -> str:
    if not records:
        return "(no trials)"
    order = sorted(records, key=lambda r: (r["method"], r["world_size"], r["seq_len"], r["batch"], r["heads"],
                                           r["kv_heads"], r["head_dim"], r["dtype"], not r["causal"], r["pass"]))
    rows = []
    for r in order:
        status = r[M.STATUS] if r[M.STATUS] != M.OK or r.get(M.CHECKED) else "ok (unchecked)"
        opts = json.loads(r.get("options") or "{}")
        name = r["method"] + ("(" + ",".join(f"{k}={v}" for k, v in sorted(opts.items())) + ")" if opts else "")
        rows.append([
            name, r["world_size"], r["seq_len"], r["batch"], f"{r['heads']}/{r['kv_heads']}", r["head_dim"],
            r["dtype"], "causal" if r["causal"] else "full", r["pass"], status,
            _fmt(r.get(M.TIME_MS_MEDIAN), ".3f"), _fmt(r.get(M.TFLOPS_PER_GPU), ".4f"),
            _fmt(None if r.get(M.BYTES_SENT) is None else r[M.BYTES_SENT] / 2**20, ".2f"),
            _short_reason(r),
        ])
    headers = ["method", "P", "seq", "B", "H/Hkv", "D", "dtype", "mask", "pass", "status", "ms (median)",
               "TFLOP/s/rank", "MiB sent/rank", "note"]
    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)


def _short_reason(r: dict) -> str:
    reason = r.get(M.REASON) or ""
    return reason if len(reason) <= 60 else reason[:57] + "..."
