"""Tables of what ran and how it ended: trials per status, errors against float64 attention, and
every skip and failure with its reason.
"""

from __future__ import annotations

import re

import pandas as pd

from suite import metrics as M
from suite.reports.tables.cells import Col, Table, _p_header, _sci, _source


def status_counts(df: pd.DataFrame) -> Table:
    """Trials per status, per sweep and series (a combined report never mixes two sweeps' counts)."""
    if df.empty:
        return Table("status_counts", "Trials per status", pd.DataFrame(), {})
    counts = df.pivot_table(index=["sweep", "series"], columns=M.STATUS, values="key", aggfunc="count", fill_value=0)
    statuses = [s for s in M.STATUSES if s in counts.columns]
    counts = counts[statuses]
    counts["total"] = counts.sum(axis=1)
    data = counts.reset_index()
    data.columns.name = None
    cols = {"sweep": Col("Sweep", "text", const="sweep {}"), "series": Col("Method", "text")}
    cols.update({s: Col(s, "int") for s in statuses + ["total"]})
    return Table(
        "status_counts",
        "Trials per status",
        data,
        cols,
        what="Trials of each method per sweep, by status",
        section="runs",
        source=_source(df),
    )


def _problem_parts(df: pd.DataFrame) -> pd.DataFrame:
    parts = pd.DataFrame(
        {
            "B": "B=" + df["batch"].astype(str),
            "H": "H=" + df["heads"].astype(str) + "/" + df["kv_heads"].astype(str),
            "D": "D="
            + df["head_dim"].astype(str)
            + [f"/{v}" if v != d else "" for d, v in zip(df["head_dim"], df["head_dim_v"])],  # MLA: D/Dv
            "dtype": df["dtype"].astype(str),
            "S": "S=" + df["seq_len"].astype(str),
            "mask": df["mask"],
            "pass": df["pass"].astype(str),
        },
        index=df.index,
    )
    # attention sinks only where some row has them: reports of sweeps without keep their columns
    if "sinks" in df and (df["sinks"] == True).any():  # noqa: E712 (a column of True, False and None)
        parts["sinks"] = df["sinks"].map(lambda on: "sinks" if on is True else "no sinks")
    return parts


def correctness_matrix(df: pd.DataFrame) -> Table:
    """Series x world size (rows) by problem (columns): the largest max-abs error of the row's
    checked tensors for a clean ok, the status otherwise."""
    name, title = "correctness", "Correctness against float64 attention"
    if df.empty:
        return Table(name, title, pd.DataFrame(), {})
    err_cols = list(M.ERR.values())

    def cell(r):
        errs = [r[c] for c in err_cols if r.get(c) is not None and not pd.isna(r[c])]
        worst = max(errs) if errs else None
        status = r[M.STATUS]
        if status == M.OK:
            return worst if r.get(M.CHECKED) and worst is not None else "unchecked"
        if status == M.INCORRECT:
            return "INCORRECT" + (f" {_sci(worst)}" if worst is not None else "")
        return status.upper() if status in (M.FAILED, M.TIMEOUT) else status

    parts = _problem_parts(df)
    varying = [c for c in parts.columns if parts[c].nunique() > 1]
    fixed = [parts[c].iloc[0] for c in parts.columns if c not in varying]
    problem = parts[varying].agg(" ".join, axis=1) if varying else pd.Series("all", index=df.index)
    t = df.assign(cell=[cell(r) for r in df.to_dict("records")], problem=problem, P=df["world_size"])
    out = t.pivot_table(index=["series", "P"], columns="problem", values="cell", aggfunc="first")
    problems = sorted(out.columns, key=lambda c: _natural(c))
    out = out[problems].reset_index()
    out.columns.name = None
    cols = {"series": Col("Method", "text"), "P": Col(_p_header(df), "int")}
    cols.update({p: Col(p, "sci") for p in problems})
    tensors = "out, LSE, dQ, dK, dV and dsink (with sinks)" if "sinks" in parts else "out, LSE, dQ, dK and dV"
    what = (
        f"Largest max-abs error of {tensors} against float64 attention on the unsharded inputs "
        "(status in words where not a checked ok)"
    )
    return Table(
        name,
        title,
        out.astype(object).where(out.notna(), None),
        cols,
        what=what,
        section="correctness",
        source=_source(df),
        fixed=[" ".join(fixed)] if fixed else [],
    )


def _natural(text: str) -> list:
    """Sort key that orders S=512 before S=1024."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def problems(df: pd.DataFrame) -> Table:
    """Every row that is not a clean ok: skipped, failed, timeout, incorrect, with its reason."""
    title = "Skips and failures"
    bad = df[df[M.STATUS] != M.OK] if not df.empty else df
    if bad.empty:
        return Table("skips_and_failures", title, pd.DataFrame(), {})
    data = pd.DataFrame(
        {
            "series": bad["series"],
            "P": bad["world_size"],
            "config": bad["config"],
            "status": bad[M.STATUS],
            "reason": bad[M.REASON].fillna(""),
        }
    ).reset_index(drop=True)
    cols = {
        "series": Col("Method", "text"),
        "P": Col(_p_header(df), "int"),
        "config": Col("Problem", "text"),
        "status": Col("Status", "text"),
        "reason": Col("Reason", "text"),
    }
    return Table(
        "skips_and_failures",
        title,
        data,
        cols,
        what="Every trial that is not a clean ok, with its reason",
        section="problems",
        source=_source(df),
    )
