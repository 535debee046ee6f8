"""Tables of what a method spends besides compute: bytes and communication calls with the time split
(CCR, overlap, overhead), and peak memory per rank.
"""

from __future__ import annotations

import pandas as pd

from suite import metrics as M
from suite.reports.style import rank_word
from suite.reports.tables.cells import Col, Table, _p_header, _shape_cols, _source
from suite.reports.tables.rows import _options, measured, point_columns


def _ops(text) -> str:
    """'{"all_to_all": 4, "p2p": 7}' -> 'all-to-all 4, p2p 7'."""
    ops = _options(text)
    return ", ".join(f"{k.replace('_', '-')} {v}" for k, v in sorted(ops.items())) if ops else ""


def communication(df: pd.DataFrame) -> Table:
    """Bytes per rank, operations, and the time split (CCR, overlap, overhead) per measured point."""
    m = measured(df)
    title = "Communication and time split"
    if m.empty:
        return Table("communication", title, pd.DataFrame(), {})
    data = pd.DataFrame(
        {
            **point_columns(m),
            "MiB_sent_per_rank": m[M.BYTES_SENT] / 2**20,
            "MiB_recv_per_rank": m[M.BYTES_RECV] / 2**20,
            "ops": m[M.COMM_OPS].map(_ops),
            "executor": m["executor"],
        }
    )
    for col in (M.KERNEL_MS, M.COMM_WAIT_MS, M.COMPUTE_ONLY_MS, M.COMM_ONLY_MS, M.CCR, M.OVERLAP_EFF, M.OVERHEAD_RATIO):
        data[col] = m[col]
    data = data.sort_values(["shape", "mask", "pass", "P", "seq_len", "series"]).reset_index(drop=True)
    sim_rows = data.pop("executor").astype(str).eq("sim")
    word = rank_word(df)
    cols = {
        **_shape_cols(_p_header(df)),
        "seq_len": Col("S (tokens)", "int", const="S = {}"),
        "series": Col("Method", "text"),
        "MiB_sent_per_rank": Col(f"Sent per {word} (MiB)"),
        "MiB_recv_per_rank": Col(f"Received per {word} (MiB)"),
        "ops": Col("Operations", "text"),
        M.KERNEL_MS: Col("Kernels (ms)"),
        M.COMM_WAIT_MS: Col("Comm. wait (ms)"),
        M.COMPUTE_ONLY_MS: Col("Compute only (ms)"),
        M.COMM_ONLY_MS: Col("Comm. only (ms)"),
        M.CCR: Col("CCR"),
        M.OVERLAP_EFF: Col("Overlap eff."),
        M.OVERHEAD_RATIO: Col("Overhead ratio"),
    }
    # columns a run did not record (no breakdown, peers' uncounted operations) are left out
    cols = {k: v for k, v in cols.items() if v.const or data[k].replace("", None).notna().any()}
    what = (
        "Bytes one iteration moves per rank and its communication calls; time in kernels and blocked in "
        "communication (one instrumented iteration; overhead ratio = its total / (kernels + waits)); CCR = "
        "compute-only / comm-only time; overlap efficiency = (compute-only + comm-only - total) / "
        "min(compute-only, comm-only), 1 = the shorter part fully hidden, 0 = none hidden"
    )
    eff = pd.to_numeric(data[M.OVERLAP_EFF], errors="coerce")
    outside = (eff < 0) | (eff > 1)
    if (outside & sim_rows).any():
        what += (
            "; a predicted row leaves [0, 1] where the simulated iteration pays what its parts run apart do not "
            "(kernels slowed while communication runs beside them, stream synchronisations)"
        )
    if (outside & ~sim_rows).any():  # say why a reader sees -1.39, rather than let it pass as a measurement
        what += (
            "; its three times are medians of different runs (compute-only, comm-only, the timed repeats), so "
            "it leaves [0, 1] where the full iteration took longer than its parts run apart (below 0: "
            "contention or noise, no overlap to read) or less"
        )
    return Table("communication", title, data, cols, what=what, section="communication", source=_source(df))


def memory(df: pd.DataFrame) -> Table:
    m = measured(df).dropna(subset=[M.PEAK_MEM]) if not df.empty else df
    title = "Peak memory per rank"
    if m.empty:
        return Table("memory_peak_MiB", title, pd.DataFrame(), {})
    t = m.assign(P=m["world_size"], peak_MiB=m[M.PEAK_MEM] / 2**20)
    out = t.pivot_table(
        index=["shape", "P", "mask", "pass", "seq_len"], columns="series", values="peak_MiB", aggfunc="max"
    )
    series = list(out.columns)
    out = out.reset_index()
    out.columns.name = None
    cols = {**_shape_cols(_p_header(df)), "seq_len": Col("S (tokens)", "int", const="S = {}")}
    cols.update({s: Col(s) for s in series})
    what = f"Peak memory one iteration allocates per {rank_word(df)} beyond what was alive before it (MiB)"
    return Table("memory_peak_MiB", title, out, cols, what=what, section="memory", source=_source(df))
