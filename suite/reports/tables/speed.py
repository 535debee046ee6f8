"""Tables of speed: throughput per point, throughput by sequence length (ring-flash-attn's layout),
speedup over a baseline (TASP's layout).
"""

from __future__ import annotations

import pandas as pd

from suite import metrics as M
from suite.reports.style import flop_unit, rank_word
from suite.reports.tables.captions import BUSY_NOTE, cpu_ideal_note, sim_band_caption, sim_note
from suite.reports.tables.cells import Col, Table, _p_header, _shape_cols, _sig, _source
from suite.reports.tables.rows import speedup_rows, throughput_rows


def throughput(df: pd.DataFrame) -> Table:
    data = throughput_rows(df)
    word, unit = rank_word(df), flop_unit(df)
    if not data.empty and unit.column != "tflops_per_gpu":  # the CSV names the unit it holds
        data.insert(data.columns.get_loc("tflops_per_gpu"), unit.column, data["tflops_per_gpu"] * unit.scale)
        data = data.drop(columns=["tflops_per_gpu"])
    cols = {
        **_shape_cols(_p_header(df)),
        "seq_len": Col("S (tokens)", "int", const="S = {}"),
        "series": Col("Method", "text"),
        "time_ms": Col("Time (ms)"),
        "time_ms_min": Col("Min (ms)"),
        "time_ms_max": Col("Max (ms)"),
        unit.column: Col(f"{unit.label} per {word}"),
        "tokens_per_s": Col("Tokens/s"),
        "pct_of_ideal": Col("% of ideal", "pct"),
    }
    what = (
        f"Median, min and max time of one iteration over the timed repeats; {unit.label} per {word} at the "
        "median (flash-attention FLOP convention); ideal = single-device reference time / P"
    )
    if not data.empty and data["pct_of_ideal"].isna().all():  # no row with a meaningful ideal (CPU only)
        data = data.drop(columns=["pct_of_ideal"])
        del cols["pct_of_ideal"]
    if cpu_ideal_note(df):
        what += "; " + cpu_ideal_note(df)
    sim = data["executor"] == "sim" if not data.empty else pd.Series(dtype=bool)
    if not data.empty and sim.any():
        # a simulated row's band, or "unvalidated" where no published row of its family was validated
        # (no band is borrowed from another family); measured rows have none
        data["sim_error_pct"] = [
            (f"{e:.1f}" if pd.notna(e) else M.UNVALIDATED) if is_sim else ""
            for e, is_sim in zip(data["sim_error_pct"], sim)
        ]
        cols["sim_error_pct"] = Col("± (%)", "textnum")
    else:
        data = data.drop(columns=["sim_error_pct"], errors="ignore")
    if sim_note(data):
        what += "; " + sim_note(data)
    if not data.empty and data["busy"].any():  # a marker column only where a row is flagged
        data["note"] = ["busy?" if b else "" for b in data["busy"]]
        cols["note"] = Col("Note", "text")
        what += f"; busy?: {BUSY_NOTE.removeprefix('* ')}"
    data = data.drop(columns=["busy", "executor"], errors="ignore")
    return Table(
        "throughput", "Throughput", data, cols, what=what, section="throughput", html=False, source=_source(df)
    )


def throughput_pivot(df: pd.DataFrame) -> Table:
    """The ring-flash-attn README layout: series (rows) by sequence length (columns),
    "TFLOP/s per rank (percent of ideal)" per cell, one block per world size, mask and pass."""
    t = throughput_rows(df)
    word, unit = rank_word(df), flop_unit(df)
    title = "Throughput by sequence length"
    if not t.empty:  # a row without a rate has no cell (its time is in "throughput")
        t = t[t["tflops_per_gpu"].notna()]
    if t.empty:
        return Table("throughput_by_seq_len", title, t, {})
    t["cell"] = [
        _sig(tf * unit.scale)
        + ("" if pd.isna(p) else f" ({p:.0f}%)")
        + ("" if pd.isna(e) else f" ±{e:.0f}%")
        + (f" {M.UNVALIDATED}" if x == "sim" and pd.isna(e) else "")
        + (" *" if b else "")
        for tf, p, e, b, x in zip(t["tflops_per_gpu"], t["pct_of_ideal"], t["sim_error_pct"], t["busy"], t["executor"])
    ]
    out = t.pivot_table(
        index=["shape", "P", "mask", "pass", "series"], columns="seq_len", values="cell", aggfunc="first"
    )
    out.columns = [f"S={c}" for c in out.columns]
    out = out.reset_index()
    cols = {**_shape_cols(_p_header(df)), "series": Col("Method", "text")}
    cols.update({c: Col(c, "textnum") for c in out.columns if c.startswith("S=")})
    what = (
        f"{unit.label} per {word} at the median time (percent of ideal: single-device reference time / P); "
        "columns are sequence lengths in tokens"
    )
    if cpu_ideal_note(df):
        what += "; " + cpu_ideal_note(df)
    if sim_note(t):
        what += "; " + sim_note(t)
    if t["busy"].any():
        what += "; " + BUSY_NOTE
    return Table(
        "throughput_by_seq_len", title, out.fillna(""), cols, what=what, section="throughput", source=_source(df)
    )


def speedup(df: pd.DataFrame, baseline: str) -> Table:
    """TASP's evaluation layout: speedup over `baseline` for every other series, per world size,
    mask, pass and sequence length (rows). Failed-check rows get none; empty cells where the
    baseline has no row."""
    name, title = f"speedup_over_{baseline}", f"Speedup over {baseline}"
    sp = speedup_rows(df, baseline)
    sp = sp[sp["method"] != baseline] if not sp.empty else sp  # the baseline is 1 by definition
    if sp.empty:
        return Table(name, title, pd.DataFrame(), {})
    out = sp.pivot_table(
        index=["shape", "P", "mask", "pass", "seq_len"], columns="series", values="speedup", aggfunc="median"
    )
    series = list(out.columns)
    out = out.reset_index()
    out.columns.name = None
    cols = {**_shape_cols(_p_header(df)), "seq_len": Col("S (tokens)", "int", const="S = {}")}
    cols.update({s: Col(s, "ratio") for s in series})
    what = (
        f"{baseline} median time / method median time, same hardware, executor and problem ({baseline} = 1); "
        "rows that failed the float64 check have none"
    )
    band = sim_band_caption(sp)
    if band:
        what += "; " + band
    return Table(name, title, out, cols, what=what, section="speedup", source=_source(df))
