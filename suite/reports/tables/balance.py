"""Tables of load balance (the HTML page's balance section): the ranks' visible pairs and kernel
times, packed documents against uniform sequences, and mask families.
"""

from __future__ import annotations

import pandas as pd

from suite import metrics as M
from suite.reports.style import rank_word
from suite.reports.tables.captions import cpu_ideal_note
from suite.reports.tables.cells import Col, Table, _p_header, _shape_cols, _source
from suite.reports.tables.rows import measured, point_columns, throughput_pct, throughput_rows


def balance(df: pd.DataFrame) -> Table:
    """Load balance per point: the visible (query, key) pairs the busiest rank's kernels compute
    over the mean rank's, the measured kernel-time spread, padding and documents per sequence."""
    m = measured(df).dropna(subset=[M.IMBALANCE]) if not df.empty else df
    title = "Load balance"
    if m.empty or (m[M.IMBALANCE] == 1).all():
        return Table("balance", title, pd.DataFrame(), {})
    data = pd.DataFrame(
        {
            **point_columns(m),
            "imbalance": m[M.IMBALANCE],
            "kernel_spread": m[M.KERNEL_SPREAD],
            "padding_pct": 100 * m[M.PADDING_FRACTION],
            "docs": m[M.DOCS_PER_SEQ],
        }
    )
    data = data.sort_values(["shape", "mask", "pass", "P", "seq_len", "series"]).reset_index(drop=True)
    word = rank_word(df)
    cols = {
        **_shape_cols(_p_header(df)),
        "seq_len": Col("S (tokens)", "int", const="S = {}"),
        "series": Col("Method", "text"),
        "imbalance": Col("Pairs max/mean", "ratio"),
        "kernel_spread": Col("Kernel time max/mean", "ratio"),
        "padding_pct": Col("Padding (%)", "pct"),
        "docs": Col("Documents per sequence"),
    }
    cols = {k: v for k, v in cols.items() if v.const or data[k].notna().any()}
    what = (
        f"Visible (query, key) pairs x heads the busiest {word}'s attention kernels compute over the mean "
        f"{word}'s (1 = balanced; document-causal masks counted exactly), the measured time in kernels of the "
        f"slowest {word} over the mean, tail padding added for the layout, and packed documents per sequence"
    )
    return Table("balance", title, data, cols, what=what, section="balance", source=_source(df))


def packed_vs_uniform(df: pd.DataFrame) -> Table:
    """Percent of ideal per method and length mix at equal tokens (rows: method, P, S; columns:
    uniform and each packed distribution): what packing long-tailed documents costs each method."""
    t = throughput_rows(df)
    title = "Percent of ideal: packed documents vs uniform sequences"
    if t.empty or "mask" not in t or not t["mask"].str.contains(", docs:").any():
        return Table("packed_vs_uniform", title, pd.DataFrame(), {})
    parts = t["mask"].str.split(", docs:", n=1, expand=True)
    t = t.assign(mask=parts[0], mix=("docs:" + parts[1]).fillna("uniform") if 1 in parts else "uniform")
    out = t.pivot_table(
        index=["shape", "P", "mask", "pass", "seq_len", "series"],
        columns="mix",
        values="pct_of_ideal",
        aggfunc="median",
    )
    out = out.dropna(how="all")  # CPU rows: no percent of ideal (cpu_ideal_note)
    if out.empty:
        return Table("packed_vs_uniform", title, pd.DataFrame(), {})
    mixes = ["uniform"] + sorted(c for c in out.columns if c != "uniform")
    out = out.reindex(columns=[c for c in mixes if c in out.columns]).reset_index()
    out.columns.name = None
    cols = {
        **_shape_cols(_p_header(df)),
        "seq_len": Col("S (tokens)", "int", const="S = {}"),
        "series": Col("Method", "text"),
    }
    cols.update({c: Col(c, "pct") for c in mixes if c in out.columns})
    what = (
        "Single-device reference time of the same problem and length mix / P over the method's median time; "
        "columns are length mixes (uniform: one document per sequence; docs: packed documents of that "
        "distribution, document-causal mask)"
    )
    return Table("packed_vs_uniform", title, out, cols, what=what, section="balance", source=_source(df))


def mask_families(df: pd.DataFrame) -> Table:
    """Per method and mask family (methods/masks.py): percent of ideal, the K/V bytes a rank received
    that none of its queries attends, and the balance of the ranks' visible area (max / mean, Gini):
    which method is right and fast for the masks a model trains with."""
    m = measured(df)
    title = "Mask families: throughput, redundant communication and balance"
    if m.empty or not (m["mask_name"] != "").any():
        return Table("mask_families", title, pd.DataFrame(), {})
    data = pd.DataFrame(
        {
            "series": m["series"],
            "shape": m["shape"],
            "P": m["world_size"],
            "pass": m["pass"],
            "seq_len": m["seq_len"],
            "mask": m["family"],
            "mix": m["mix"],
            "pct_of_ideal": throughput_pct(df),
            "redundant_mib": pd.to_numeric(m[M.REDUNDANT_BYTES], errors="coerce") / 2**20,
            "imbalance": pd.to_numeric(m[M.IMBALANCE], errors="coerce"),
            "gini": pd.to_numeric(m[M.AREA_GINI], errors="coerce"),
            "sim_error_pct": pd.to_numeric(m[M.SIM_ERROR_PCT], errors="coerce"),
        }
    )
    data = data[data["P"] > 1].sort_values(["shape", "pass", "P", "seq_len", "mix", "mask", "series"])
    data = data.reset_index(drop=True)
    cols = {
        **_shape_cols(_p_header(df)),
        "seq_len": Col("S (tokens)", "int", const="S = {}"),
        "mix": Col("Length mix", "text"),
        "series": Col("Method", "text"),
        "pct_of_ideal": Col("% of ideal", "pct"),
        "redundant_mib": Col("Redundant K/V (MiB per rank)"),
        "imbalance": Col("Area max/mean", "ratio"),
        "gini": Col("Area Gini", "ratio"),
    }
    cols = {k: v for k, v in cols.items() if v.const or data[k].notna().any()}
    what = (
        "Percent of ideal (the single-device reference time of the same problem and mask / P over the "
        "method's median time); K/V bytes a rank received that none of its queries attends (max over ranks); "
        "the ranks' visible (query, key) pairs: busiest over mean, and their Gini coefficient (0 = equal). "
        "Simulated rows carry their error band in the throughput table"
    )
    if cpu_ideal_note(df):
        what += "; " + cpu_ideal_note(df)
    return Table("mask_families", title, data, cols, what=what, section="balance", source=_source(df))
