"""What a caption says of the rows beside their numbers: simulated rows' error bands, why CPU rows
have no percent of ideal, rows timed on a busy machine.
"""

from __future__ import annotations

import pandas as pd

from suite import metrics as M
from suite.reports.style import is_cpu
from suite.reports.tables.rows import BUSY_SPREAD, measured

BUSY_NOTE = (
    f"* slowest timed repeat over {BUSY_SPREAD:g}x the median: the machine may have been busy while this "
    "trial was timed; rerun it before trusting it"
)


SIM_BAND_NOTE = (
    "± (simulated rows): predicted, with the simulator's validated error for the row's family "
    "(mean |error| against published tables, `python -m suite validate`); unvalidated: no published row "
    "of the row's family (hardware kind, method family, kernel- or comm-bound) was validated, so no band is given"
)


def sim_band_caption(rows: pd.DataFrame) -> str:
    """ "simulated series are predicted (±12 %: ...)" for rows with an error band, else ""."""
    if rows.empty or M.SIM_ERROR_PCT not in rows:
        return ""
    every = pd.to_numeric(rows[M.SIM_ERROR_PCT], errors="coerce")
    if "executor" in rows:
        every = every[rows["executor"] == "sim"]
    bands = every.dropna()
    unvalidated = (
        f"{M.UNVALIDATED}: no published row of their family was validated, so they carry no band"
        if every.isna().any()
        else ""
    )
    if bands.empty:
        return f"simulated series are predicted ({unvalidated})" if unvalidated else ""
    lo, hi = bands.min(), bands.max()
    span = f"±{lo:.0f} %" if round(lo) == round(hi) else f"±{lo:.0f}-{hi:.0f} %"
    return (
        f"simulated series are predicted ({span}: the simulator's validated error for their family, "
        "`python -m suite validate`" + (f"; some {unvalidated}" if unvalidated else "") + ")"
    )


def sim_note(rows: pd.DataFrame) -> str:
    """What a table's simulated rows are ("" without any): predictions with their band, where the
    rows carry one; never timed repeats."""
    sim = rows[rows["executor"] == "sim"] if not rows.empty else rows
    if sim.empty:
        return ""
    if M.SIM_ERROR_PCT in sim:  # a band, or "unvalidated" where the row's family has none
        return SIM_BAND_NOTE
    return "simulated rows (executor sim) are the simulator's predictions, not timed repeats"


# Why CPU rows show no percent of ideal. On CPU the P ranks are processes sharing one machine's cores,
# memory bandwidth and caches, not P devices, so single-device time / P bounds nothing: the quick
# start showed up to 190 % of it (issue 39), a number a reader takes for a bug. The ideal means something only
# where each rank is its own device (GPU rows, measured or predicted).
CPU_IDEAL_NOTE = (
    "no percent of ideal on CPU rows: their P ranks are processes sharing one machine's cores and caches, "
    "not P devices, so single-device time / P is no bound there (such rows measure over 100 %)"
)


def cpu_ideal_note(df: pd.DataFrame) -> str:
    """CPU_IDEAL_NOTE where a measured row ran on CPU, "" otherwise."""
    m = measured(df) if not df.empty else df
    return CPU_IDEAL_NOTE if not m.empty and m["hardware"].map(is_cpu).any() else ""
