"""The compact table printed at the end of a sweep (method x size: status, time, TFLOP/s, bytes)."""

from __future__ import annotations

import json

from tabulate import tabulate

from suite import metrics as M
from suite.metrics import method_label


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def summary_table(records: list[dict]) -> str:
    if not records:
        return "(no trials)"
    train = [r for r in records if r["pass"] == "train"]
    attention = [r for r in records if r["pass"] != "train"]
    text = "\n\n".join(t for t in (_attention_table(attention), _perplexity_table(train)) if t)
    noisy = [r for r in attention if _noisy(r)]
    if noisy:
        text += (
            f"\n{len(noisy)} trial(s) marked '!' have a slowest repeat over {M.NOISY_SPREAD:g}x their median "
            f"(max/med): their timings are noisy (a busy machine? see the load line below); rerun them on "
            f"an idle machine, with more run.repeats"
        )
    return text


def _measured_spread(r: dict) -> float | None:
    """max/median of a measured row; None for simulated rows (one predicted value, no repeats)."""
    return None if r["executor"] == "sim" else M.time_spread(r)


def _spread(r: dict) -> str:
    """The max/median column, marked '!' over the threshold."""
    spread = _measured_spread(r)
    return "" if spread is None else f"{spread:.2f}" + (" !" if spread > M.NOISY_SPREAD else "")


def _noisy(r: dict) -> bool:
    spread = _measured_spread(r)
    return spread is not None and spread > M.NOISY_SPREAD


def _perplexity_table(records: list[dict]) -> str:
    """Model-level rows: final perplexity against the single-device baseline."""
    if not records:
        return ""
    order = sorted(
        records,
        key=lambda r: (
            r["method"] != "baseline",
            r["seq_len"],
            r["batch"],
            r["heads"],
            r["kv_heads"],
            r["head_dim"],
            r["dtype"],
            r["world_size"],
            r["method"],
        ),
    )
    rows = []
    for r in order:
        rows.append(
            [
                _name(r),
                r["executor"],
                r["world_size"],
                r["seq_len"],
                r["batch"],
                f"{r['heads']}/{r['kv_heads']}",
                r["head_dim"],
                r["dtype"],
                r[M.STATUS],
                _fmt(r.get(M.PPL), ".6f"),
                _fmt(r.get(M.PPL_REL_DIFF), "+.2e"),
                _fmt(r.get(M.LOSS_MAX_REL_DIFF), ".2e"),
                _fmt(r.get(M.TIME_MS_MEDIAN), ".1f"),
                _short_reason(r),
            ]
        )
    headers = [
        "method",
        "executor",
        "P",
        "seq",
        "B",
        "H/Hkv",
        "D",
        "dtype",
        "status",
        "perplexity",
        "vs baseline",
        "max loss diff",
        "ms/step",
        "note",
    ]
    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)


def _dims(r: dict) -> str:
    """The head dim column: D, or D/Dv where the values' head dim differs (MLA)."""
    return f"{r['head_dim']}/{r['head_dim_v']}" if r.get("head_dim_v") else f"{r['head_dim']}"


def _mask(r: dict) -> str:
    """The mask column, with the variants the row sets (a logit soft cap: "causal cap=5")."""
    return M.mask_label(r.get("mask"), r["causal"]) + M.variant_labels(r)


def _attention_table(records: list[dict]) -> str:
    if not records:
        return ""
    order = sorted(
        records,
        key=lambda r: (
            r["method"],
            r["topology"],
            r["world_size"],
            r["seq_len"],
            r["batch"],
            r["heads"],
            r["kv_heads"],
            r["head_dim"],
            M.variant_sort_key(r),
            r["dtype"],
            not r["causal"],
            str(r.get("mask") or ""),
            r["pass"],
        ),
    )
    sim = any(r["executor"] == "sim" for r in records)  # simulated rows name their topology
    rows = []
    for r in order:
        status = r[M.STATUS] if r[M.STATUS] != M.OK or r.get(M.CHECKED) else "ok (unchecked)"
        if r["executor"] == "sim" and r[M.STATUS] == M.OK:
            status = "simulated"
        rows.append(
            [_name(r)]
            + ([f"{r['executor']}:{r['topology']}"] if sim else [])
            + [
                r["world_size"],
                r["seq_len"],
                r["batch"],
                f"{r['heads']}/{r['kv_heads']}",
                _dims(r),
                r["dtype"],
                _mask(r),
                r["pass"],
                status,
                _fmt(r.get(M.TIME_MS_MEDIAN), ".3f"),
                _spread(r),
                _fmt(r.get(M.TFLOPS_PER_GPU), ".4f"),
                _fmt(None if r.get(M.BYTES_SENT) is None else r[M.BYTES_SENT] / 2**20, ".2f"),
                _short_reason(r),
            ]
        )
    headers = (
        ["method"]
        + (["executor"] if sim else [])
        + [
            "P",
            "seq",
            "B",
            "H/Hkv",
            "D",
            "dtype",
            "mask",
            "pass",
            "status",
            "ms (median)",
            "max/med",
            "TFLOP/s/rank",
            "MiB sent/rank",
            "note",
        ]
    )
    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)


def _name(r: dict) -> str:
    return method_label(r["method"], json.loads(r.get("options") or "{}"))


def _short_reason(r: dict) -> str:
    reason = r.get(M.REASON) or ""
    return reason if len(reason) <= 60 else reason[:57] + "..."
