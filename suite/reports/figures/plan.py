"""Planning: which figures a set of stored rows calls for, and the numbers each one draws.

`plan_figures` returns one `FigureJob` per figure file, holding exactly the tidy rows it draws (no
matplotlib here). What the numbers keep to:
- a point is the median of the stored timed samples, its bar the spread of those samples
  (`INTERVAL`: percentiles 0 and 100, i.e. min to max, seaborn's errorbar=("pi", 100)); a
  simulated point is a prediction, its bar the simulator's validated error band where the row
  has one, and its figure's title and caption say predicted;
- a point whose slowest timed repeat is more than `BUSY_SPREAD` x its median is marked (the
  machine may have been busy while it was timed);
- numbers of different problem shapes are never drawn as one point: one figure per shape;
- x is the swept axis (sequence length when several were run, else world size);
- labels name the device: GPUs, or CPU ranks for CPU processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import pandas as pd

from suite import metrics as M
from suite.metrics import method_label
from suite.reports import style as S
from suite.reports.tables.captions import sim_band_caption
from suite.reports.tables.rows import (
    BUSY_SPREAD,
    SPEEDUP_INTERVAL,
    _options,
    attention_rows,
    busy,
    measured,
    percentiles,
    perplexity_rows,
    samples,
    sim_pairs,
    speedup_rows,
    throughput_pct,
)

INTERVAL = (0, 100)  # percentiles of the timed samples that a bar spans
_EPS = {"float32": 2.0**-23, "float64": 2.0**-52, "bfloat16": 2.0**-7, "float16": 2.0**-10}


@dataclass
class FigureJob:
    """One figure file: what it draws (`data`, tidy rows), how (`kind`, `params`), and where it
    goes on the page (`section`, `shape`)."""

    name: str
    kind: str
    data: pd.DataFrame
    params: dict = field(default_factory=dict)
    section: str = ""
    shape: str = ""
    caption: str = ""


# -- shared helpers ----------------------------------------------------------------------------------
def size_label(v) -> str:
    """A size in the largest binary unit it is a whole multiple of: 4096 -> 4K, 2**21 -> 2M, 1000 -> 1000."""
    v = int(v)
    if v >= 2**20 and v % 2**20 == 0:
        return f"{v // 2**20}M"
    if v >= 1024 and v % 1024 == 0:
        return f"{v // 1024}K"
    return str(v)


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in text).strip("-")


def _per_shape(df: pd.DataFrame):
    """(file-name suffix, shape, rows) per problem shape: numbers of different shapes are never
    drawn as one point."""
    for shape in sorted(df["shape"].dropna().unique()):
        yield "_" + _slug(shape), shape, df[df["shape"] == shape]


def _rate_points(m: pd.DataFrame, value: str, scale: float = 1.0) -> pd.DataFrame:
    """A rate (value proportional to 1 / time, e.g. TFLOP/s) per row at the median time, times
    `scale` (a unit), with the interval of the rate over the row's timed samples and the row's
    busy flag."""
    y, lo, hi = [], [], []
    for r in m[[value, M.TIME_MS_MEDIAN, M.TIME_MS_SAMPLES]].to_dict("records"):  # iterrows: seconds at 10k rows
        k = r[value] * scale * r[M.TIME_MS_MEDIAN]
        t_lo, t_hi = percentiles(samples(r), INTERVAL)
        y.append(r[value] * scale)
        lo.append(k / t_hi)
        hi.append(k / t_lo)
    return _with_band(m.assign(y=y, lo=lo, hi=hi, busy=busy(m)))


def _with_band(d: pd.DataFrame) -> pd.DataFrame:
    """Simulated points with an error band (`sim_error_pct`) get it as their bar: y x (1 -/+ band)."""
    if M.SIM_ERROR_PCT not in d:
        return d
    band = pd.to_numeric(d[M.SIM_ERROR_PCT], errors="coerce") / 100
    has = band.notna()
    if not has.any():
        return d
    d = d.copy()
    d.loc[has, "lo"] = d.loc[has, "y"] * (1 - band[has]).clip(lower=0)
    d.loc[has, "hi"] = d.loc[has, "y"] * (1 + band[has])
    return d


def _is_sim(part: pd.DataFrame) -> pd.Series:
    return part["executor"] == "sim"


def _titled(title: str, part: pd.DataFrame) -> str:
    """A figure's title that says predicted where its rows are simulated: "Predicted attention
    throughput ... (±12 %)" when all are (with their error band, where the rows carry one), "...
    (measured and predicted)" when some are."""
    sim = _is_sim(part)
    if not sim.any():
        return title
    if not sim.all():
        return f"{title} (measured and predicted)"
    every = pd.to_numeric(part[M.SIM_ERROR_PCT], errors="coerce") if M.SIM_ERROR_PCT in part else None
    bands = every.dropna() if every is not None else pd.Series(dtype=float)
    band = ""
    if len(bands):
        lo, hi = bands.min(), bands.max()
        band = f" (±{lo:.0f} %)" if round(lo) == round(hi) else f" (±{lo:.0f}-{hi:.0f} %)"
    if every is None or every.isna().any():  # some series of a family no published row validated
        band = f" ({M.UNVALIDATED})" if not band else band[:-1] + f"; some {M.UNVALIDATED})"
    return f"Predicted {title[0].lower()}{title[1:]}{band}"


def _busy_note(d: pd.DataFrame) -> str:
    flags = d["busy"].fillna(False).astype(bool) if "busy" in d else busy(d)
    if not flags.any():
        return ""
    return (
        f" Points circled in red had a slowest timed repeat over {BUSY_SPREAD:g}x their median: the machine may "
        "have been busy while they were timed; rerun them before trusting them."
    )


def _facet(d: pd.DataFrame, x: str) -> tuple[pd.DataFrame, list, list, str]:
    """Rows and columns of panels: pass (and mask) by mask (or world size, when x is the sequence
    length and several world sizes were run). Adds `row`/`col` label columns."""
    if x == "seq_len" and d["world_size"].nunique() > 1:
        row = d["mask"] + ", " + d["pass"]
        col = "P = " + d["world_size"].astype(str)
        cols = ["P = " + str(p) for p in sorted(d["world_size"].unique())]
    else:
        row, col = d["pass"].astype(str), d["mask"].astype(str)
        cols = sorted(col.unique())
    d = d.assign(row=row, col=col)
    return d, sorted(d["row"].unique(), key=_row_key), cols, x


def _row_key(label: str):
    return tuple(0 if p in ("causal", "fwd") else 1 for p in label.split(", ")), label


def _x_axis(d: pd.DataFrame) -> str:
    """The swept axis a figure draws against: sequence length when several were run, else world size."""
    return "seq_len" if d["seq_len"].nunique() > 1 else "world_size"


def _x_label(d: pd.DataFrame, x: str) -> str:
    return "sequence length (tokens)" if x == "seq_len" else S.ranks_label(d)


def _tidy(d: pd.DataFrame, x: str, cols=("y", "lo", "hi")) -> pd.DataFrame:
    """Only what a figure draws, one row per series and point (rows of one series at one point,
    e.g. the same sweep run twice, are pooled by the median; a point is busy if any of them is)."""
    keep = ["series", "row", "col", x] + [c for c in cols if c in d]
    out = d[keep].rename(columns={x: "x"}).groupby(["series", "row", "col", "x"], as_index=False).median()
    if "busy" in d and d["busy"].fillna(False).astype(bool).any():
        flag = d.assign(busy=d["busy"].fillna(False).astype(bool))[["series", "row", "col", x, "busy"]]
        flag = flag.rename(columns={x: "x"}).groupby(["series", "row", "col", "x"], as_index=False)["busy"].max()
        out = out.merge(flag, on=["series", "row", "col", "x"], how="left")
    return out.sort_values(["row", "col", "x", "series"]).reset_index(drop=True)


def _interval_note(d: pd.DataFrame) -> str:
    """What a point and its bar are: medians of the timed repeats for measured rows; predictions
    (with their error band, where the rows carry one) for simulated rows, which have no repeats."""
    sim = _is_sim(d)
    meas = d[~sim]
    notes = []
    if not meas.empty:
        reps = meas[M.REPEATS].dropna().unique() if M.REPEATS in meas else []
        n = f"{int(reps[0])} " if len(reps) == 1 else ""
        who = "Measured points" if sim.any() else "Points"
        notes.append(f"{who} are medians of the {n}timed repeats, bars span their minimum to maximum.")
    if sim.any():
        band = sim_band_caption(d[sim])
        if band:
            notes.append(
                f"Simulated points are {band.removeprefix('simulated series are ')}; their bars span that band."
            )
        else:
            notes.append("Simulated points are the simulator's predictions (one value per trial, no repeats).")
    notes.append("Series sharing a value are shifted sideways.")
    return " ".join(notes) + _busy_note(d)


# -- planning ----------------------------------------------------------------------------------------
def plan_figures(df: pd.DataFrame, baseline: Optional[str]) -> tuple[list[FigureJob], list[str]]:
    """Every figure the rows allow, and a note for each kind that could not be drawn although the
    runs have rows of its kind (a model-level run is not told it lacks attention figures)."""
    att = attention_rows(df)
    jobs, notes = [], []
    for kind, fn in _PLANNERS.items():
        made = fn(df if kind == "loss_curves" else att, baseline)
        if made:
            jobs += made
        elif kind == "loss_curves":
            if not perplexity_rows(df).empty:
                notes.append(_WHY_NOT[kind])
        elif att.empty or (kind == "speedup" and not baseline):
            continue
        elif kind == "sim_vs_measured":
            if (att["executor"] == "sim").any():
                notes.append(_WHY_NOT[kind])
        elif kind == "scaling":
            if measured(att)["world_size"].nunique() < 2:
                notes.append(_WHY_NOT[kind])
        elif kind == "balance":  # drawn where several length mixes ran; nothing to say otherwise
            if att["mix"].nunique() > 1:
                notes.append(_WHY_NOT[kind])
        elif kind == "masks":  # drawn where mask families ran; nothing to say otherwise
            if (att["mask_name"] != "").any():
                notes.append(_WHY_NOT[kind])
        else:
            notes.append(_WHY_NOT[kind])
    return jobs, notes


def _plan_throughput(df, _baseline) -> list[FigureJob]:
    jobs = []
    m = measured(df)
    for slug, shape, part in _per_shape(m):
        x = _x_axis(part)
        unit = S.flop_unit(part)
        d, rows, cols, _ = _facet(_rate_points(part, M.TFLOPS_PER_GPU, unit.scale), x)
        word = S.rank_word(part)
        jobs.append(
            FigureJob(
                f"throughput{slug}",
                "points",
                _tidy(d, x),
                dict(
                    rows=rows,
                    cols=cols,
                    xlabel=_x_label(part, x),
                    ylabel=f"{unit.label} per {word}",
                    title=_titled(f"Attention throughput per {word}, {shape}" + _fixed_s(part, x), part),
                    auto_log=True,
                ),
                section="throughput",
                shape=shape,
                caption="FLOP count of the flash-attention convention / time / P. " + _interval_note(part),
            )
        )
    return jobs


def _fixed_s(part: pd.DataFrame, x: str) -> str:
    return f", S = {size_label(part['seq_len'].iloc[0])}" if x != "seq_len" else ""


def _plan_scaling(df, _baseline) -> list[FigureJob]:
    """Tokens per second against world size at the longest sequence: only when the throughput
    figure is drawn against sequence length (else it already is this figure)."""
    jobs = []
    for slug, shape, part in _per_shape(measured(df)):
        if part["world_size"].nunique() < 2 or _x_axis(part) != "seq_len":
            continue
        s = part["seq_len"].max()
        part = part[part["seq_len"] == s]
        d, rows, cols, _ = _facet(_rate_points(part, M.TOKENS_PER_S), "world_size")
        jobs.append(
            FigureJob(
                f"scaling{slug}",
                "points",
                _tidy(d, "world_size"),
                dict(
                    rows=rows,
                    cols=cols,
                    xlabel=S.ranks_label(part),
                    ylabel="tokens per second",
                    title=_titled(f"Scaling with {S.rank_word(part, True)}, {shape}, S = {size_label(s)}", part),
                    auto_log=True,
                ),
                section="scaling",
                shape=shape,
                caption=f"Tokens per second against the number of {S.rank_word(part, True)} at the longest sequence. "
                + _interval_note(part),
            )
        )
    return jobs


def _plan_speedup(df, baseline) -> list[FigureJob]:
    if not baseline:
        return []
    sp = speedup_rows(df, baseline)
    if sp.empty:
        return []
    sp = sp[sp["method"] != baseline]
    jobs = []
    for slug, shape, part in _per_shape(sp):
        x = _x_axis(part if part["seq_len"].nunique() > 1 else measured(df)[measured(df)["shape"] == shape])
        d, rows, cols, _ = _facet(
            _with_band(part.rename(columns={"speedup": "y", "speedup_lo": "lo", "speedup_hi": "hi"})), x
        )
        jobs.append(
            FigureJob(
                f"speedup{slug}",
                "bars",
                _tidy(d.assign(busy=busy(d)), x),
                dict(
                    rows=rows,
                    cols=cols,
                    xlabel=_x_label(part, x),
                    ylabel=f"speedup over {baseline} (x)",
                    title=_titled(f"Speedup over {baseline}, {shape}" + _fixed_s(part, x), part),
                    ref=1.0,
                ),
                section="speedup",
                shape=shape,
                caption=f"{baseline} median time / method median time, same hardware, executor and problem. "
                + _speedup_note(part, baseline)
                + " Rows that failed the float64 check have no bar."
                + _busy_note(part),
            )
        )
    return jobs


def _speedup_note(part: pd.DataFrame, baseline: str) -> str:
    lo, hi = SPEEDUP_INTERVAL
    notes = []
    if not _is_sim(part).all():
        notes.append(
            f"Whiskers span the {lo}th to {hi}th percentile of the speedups of every {baseline} timed "
            "repeat over every timed repeat of the method (the middle half of the possible ratios)."
        )
    if _is_sim(part).any():
        band = sim_band_caption(part[_is_sim(part)])
        notes.append(
            f"Simulated bars are {band.removeprefix('simulated series are ')}; their whiskers span that band."
            if band
            else "Simulated bars are the simulator's predictions (no repeats, no interval)."
        )
    return " ".join(notes)


def _plan_time_split(df, _baseline) -> list[FigureJob]:
    m_all = measured(df).dropna(subset=[M.KERNEL_MS, M.COMM_WAIT_MS])
    jobs = []
    for slug, shape, m in _per_shape(m_all):
        p = m["world_size"].max()
        m = m[m["world_size"] == p]
        s = m["seq_len"].max()
        m = m[m["seq_len"] == s]
        # the rest of the same instrumented iteration: its total is overhead_ratio x (kernels + waits)
        # (docs/DESIGN.md section 7); the median timed repeat is another iteration, and subtracting
        # one iteration's parts from another's total gave tens of ms of "other" to a ratio of 1.05
        ratio = pd.to_numeric(m[M.OVERHEAD_RATIO], errors="coerce")
        parts = m[M.KERNEL_MS] + m[M.COMM_WAIT_MS]
        d = m.assign(
            row=m["pass"].astype(str),
            col=m["mask"].astype(str),
            x=0,
            kernels=m[M.KERNEL_MS],
            comm=m[M.COMM_WAIT_MS],
            other=((ratio - 1) * parts).clip(lower=0).fillna(0.0),
        )
        tidy = (
            d[["series", "row", "col", "kernels", "comm", "other"]]
            .groupby(["series", "row", "col"], as_index=False)
            .median()
        )
        jobs.append(
            FigureJob(
                f"time_split{slug}",
                "split",
                tidy,
                dict(
                    rows=sorted(tidy["row"].unique(), key=_row_key),
                    cols=sorted(tidy["col"].unique()),
                    xlabel="time per iteration (ms)",
                    # "P = 4 CPU ranks" where the ranks were CPU processes, as the throughput title says
                    title=_titled(
                        f"Time split, P = {p}{' ' + S.rank_word(m, plural=True) if S.rank_word(m) != 'GPU' else ''}, "
                        f"S = {size_label(s)}, {shape}",
                        m,
                    ),
                ),
                section="communication",
                shape=shape,
                caption=(
                    "The simulator's predicted iteration (its replay of the traced schedule, nothing timed) split "
                    "into time in attention kernels, time a rank waits on communication (exposed), and the rest "
                    f"(its own tensor work), at the largest world size ({p}) and sequence length ({s}); means over "
                    "ranks."
                    if _is_sim(m).all()
                    else "One instrumented iteration (timers around every kernel and communication wait; of those "
                    "run after the timed repeats, the one with the median total) split into time in attention "
                    "kernels, time blocked in communication (exposed), and the rest of that same iteration "
                    f"((overhead ratio - 1) x (kernels + waits)), at the largest world size ({p}) and sequence "
                    f"length ({s}); means over ranks. Its total can differ from the median timed repeat, which ran "
                    "without the timers."
                    + (" Simulated series are the simulator's predictions of that split." if _is_sim(m).any() else "")
                ),
            )
        )
    return jobs


def _plan_bytes(df, _baseline) -> list[FigureJob]:
    m = measured(df)
    m = m[m["world_size"] > 1].assign(y=lambda d: d[M.BYTES_SENT] / 2**20)
    m = m[m["y"] > 0]
    return _plan_plain(
        m,
        "bytes",
        "communication",
        "MiB sent per {word}",
        "Communication volume per {word}",
        "Bytes one iteration sends per {word} (counted, not estimated).",
    )


def _plan_memory(df, _baseline) -> list[FigureJob]:
    m = measured(df).dropna(subset=[M.PEAK_MEM])
    m = m.assign(y=m[M.PEAK_MEM] / 2**20)
    return _plan_plain(
        m,
        "memory",
        "memory",
        "peak memory per {word} (MiB)",
        "Peak memory per {word}",
        "Memory one iteration allocates per {word} beyond what was alive before it (max over ranks).",
    )


def _plan_plain(m, name, section, ylabel, title, caption) -> list[FigureJob]:
    """A deterministic per-row value `y` (no samples) against the swept axis, per shape."""
    jobs = []
    for slug, shape, part in _per_shape(m):
        x = _x_axis(part)
        d, rows, cols, _ = _facet(_merge_equal_masks(part), x)
        word = S.rank_word(part)
        jobs.append(
            FigureJob(
                f"{name}{slug}",
                "points",
                _tidy(d, x, ("y",)),
                dict(
                    rows=rows,
                    cols=cols,
                    xlabel=_x_label(part, x),
                    ylabel=ylabel.format(word=word),
                    title=_titled(title.format(word=word) + f", {shape}" + _fixed_s(part, x), part),
                    auto_log=True,
                ),
                section=section,
                shape=shape,
                caption=caption.format(word=word),
            )
        )
    return jobs


def _merge_equal_masks(part: pd.DataFrame) -> pd.DataFrame:
    """One panel for both masks where every point has the same value under each (bytes sent do
    not depend on the mask for most methods): two identical panels only repeat each other."""
    masks = sorted(part["mask"].unique())
    if len(masks) < 2:
        return part
    wide = part.pivot_table(
        index=["series", "world_size", "seq_len", "pass"], columns="mask", values="y", aggfunc="median"
    )
    if not wide.notna().all(axis=None) or not (wide.nunique(axis=1) == 1).all():
        return part
    return part[part["mask"] == masks[0]].assign(mask=" = ".join(masks))


def _plan_sim(df, _baseline) -> list[FigureJob]:
    pair = sim_pairs(df)
    if pair.empty:
        return []
    lo, hi = [], []
    for _, r in pair.iterrows():
        t = samples(
            {M.TIME_MS_SAMPLES: r[f"{M.TIME_MS_SAMPLES}_dist"], M.TIME_MS_MEDIAN: r[f"{M.TIME_MS_MEDIAN}_dist"]}
        )
        a, b = np.percentile(t, INTERVAL)
        lo.append(a)
        hi.append(b)
    labels = [method_label(m, _options(o)) for m, o in zip(pair["method"], pair["options"])]
    data = (
        pd.DataFrame(
            {
                "series": pair["series_dist"],
                "method": pair["method"],
                "label": labels,
                "x": pair[f"{M.TIME_MS_MEDIAN}_dist"],
                "lo": lo,
                "hi": hi,
                "y": pair[f"{M.TIME_MS_MEDIAN}_sim"],
            }
        )
        .sort_values(["series", "x"])
        .reset_index(drop=True)
    )
    return [
        FigureJob(
            "sim_vs_measured",
            "scatter",
            data,
            dict(
                xlabel="measured time (ms, executor dist)",
                ylabel="simulated time (ms, executor sim)",
                title="Simulated vs measured",
            ),
            section="sim",
            caption="Each trial's simulated time against its measured median (bars: min to "
            "max of the timed repeats); the dashed line is a perfect prediction.",
        )
    ]


def _plan_loss(df, _baseline) -> list[FigureJob]:
    t = perplexity_rows(df)
    t = t[t[M.LOSS_CURVE].map(lambda c: c is not None and len(c) > 0)] if not t.empty else t
    if t.empty:
        return []
    jobs = []
    groups = list(t.groupby(["shape", "seq_len", "workload"], dropna=False))
    for (shape, s, _workload), part in groups:
        base = part[part["method"] == "baseline"]
        base_curve = list(base[M.LOSS_CURVE].iloc[0]) if not base.empty else None
        rows = []
        for _, r in part.iterrows():
            worst = 0.0
            for step, loss in enumerate(r[M.LOSS_CURVE], start=1):
                diff = math.nan
                if base_curve is not None and step <= len(base_curve) and r["method"] != "baseline":
                    # running max: exact zeros (equal bits) have no place on a log axis
                    worst = max(worst, abs(loss - base_curve[step - 1]) / abs(base_curve[step - 1]))
                    diff = worst if worst > 0 else math.nan
                rows.append((r["series"], int(r["world_size"]), r["method"] == "baseline", step, float(loss), diff))
        data = pd.DataFrame(rows, columns=["series", "P", "baseline", "step", "loss", "diff"])
        slug = "_" + _slug(f"{shape}-S{s}") if len(groups) > 1 else ""
        jobs.append(
            FigureJob(
                f"loss_curves{slug}",
                "loss",
                data,
                dict(
                    title=f"Model-level check, {shape}, S = {size_label(s)}",
                    eps=_EPS.get(str(part["dtype"].iloc[0])),
                    dtype=str(part["dtype"].iloc[0]),
                ),
                section="perplexity",
                shape=shape,
                caption="Training loss per step with each method over the single-device baseline (left), and the "
                "largest relative difference to the baseline so far (right, log scale; the dotted line is the dtype's "
                "machine epsilon).",
            )
        )
    return jobs


def _plan_balance(df, _baseline) -> list[FigureJob]:
    """Compute imbalance (pairs max/mean) and throughput per method across length mixes, per
    world size: what packing documents of long-tailed lengths does to each layout's balance."""
    m = measured(df).dropna(subset=[M.IMBALANCE])
    m = m[(m["world_size"] > 1) & (m["mask_name"] == "")]  # one rank is balanced by definition; plain masks

    if m.empty or m["mix"].nunique() < 2:
        return []
    jobs = []
    for slug, shape, part in _per_shape(m):
        s = part["seq_len"].max()
        causal = bool(part["causal"].any())  # the document-causal mask is where balance is at stake
        part = part[
            (part["seq_len"] == s) & (part["pass"] == sorted(part["pass"].unique())[0]) & (part["causal"] == causal)
        ]
        word = S.rank_word(part)
        col = "P = " + part["world_size"].astype(str)
        base = part.assign(col=col)
        imb = base.assign(
            row="imbalance (pairs max/mean)", y=base[M.IMBALANCE], lo=base[M.IMBALANCE], hi=base[M.IMBALANCE]
        )
        unit = S.flop_unit(part)
        rate = _rate_points(base, M.TFLOPS_PER_GPU, unit.scale).assign(row=f"{unit.label} per {word}")
        d = pd.concat([imb, rate])
        d["x"] = d["mix"]
        cols = ["P = " + str(p) for p in sorted(part["world_size"].unique())]
        p_pass = part["pass"].iloc[0]
        jobs.append(
            FigureJob(
                f"balance{slug}",
                "points",
                _tidy(d, "x"),
                dict(
                    rows=["imbalance (pairs max/mean)", f"{unit.label} per {word}"],
                    cols=cols,
                    xlabel="length mix",
                    ylabel="",
                    title=_titled(
                        f"Load balance and throughput by length mix, {shape}, S = "
                        f"{size_label(s)}, {'causal' if causal else 'full'}, {p_pass}",
                        part,
                    ),
                    x_order=["uniform"] + sorted(x for x in d["mix"].unique() if x != "uniform"),
                    lines=False,
                ),
                section="balance",
                shape=shape,
                caption="Top: visible (query, key) pairs of the busiest rank's kernels over the mean rank's (1 = "
                "balanced). Bottom: throughput (FLOPs of the exact document-causal pairs / time / P). "
                "uniform: one document per sequence; docs:<name>: documents drawn from that distribution, packed. "
                + _interval_note(part),
            )
        )
    return jobs


def _plan_masks(df, _baseline) -> list[FigureJob]:
    """Per method across mask families (methods/masks.py): percent of ideal, the K/V a rank received
    that none of its queries attends, and the busiest rank's visible area over the mean, per world
    size, at the longest length and the first pass of each shape and length mix."""
    m = measured(df)
    m = m[m["world_size"] > 1]
    if m.empty or not (m["mask_name"] != "").any() or m["family"].nunique() < 2:
        return []
    m = m.assign(pct=throughput_pct(df).reindex(m.index))
    jobs = []
    for slug, shape, part in _per_shape(m):
        for mix in sorted(part["mix"].unique()):
            one = part[part["mix"] == mix]
            s = one["seq_len"].max()
            p_pass = sorted(one["pass"].unique())[0]
            one = one[(one["seq_len"] == s) & (one["pass"] == p_pass)]
            base = one.assign(col="P = " + one["world_size"].astype(str), x=one["family"])
            rows = []
            for label, values in (
                ("% of ideal", base["pct"]),
                ("redundant K/V (MiB per rank)", pd.to_numeric(base[M.REDUNDANT_BYTES], errors="coerce") / 2**20),
                ("area max/mean", pd.to_numeric(base[M.IMBALANCE], errors="coerce")),
            ):
                if values.notna().any():
                    rows.append(base.assign(row=label, y=values, lo=values, hi=values))
            if not rows:
                continue
            d = pd.concat(rows).dropna(subset=["y"])
            names = [r["row"].iloc[0] for r in rows]
            cols = ["P = " + str(p) for p in sorted(one["world_size"].unique())]
            tag = "" if mix == "uniform" else f", {mix}"
            sim = (one["executor"] == "sim").any()
            jobs.append(
                FigureJob(
                    f"masks{slug}{'' if mix == 'uniform' else '_' + mix.replace(':', '_')}",
                    "points",
                    _tidy(d, "x"),
                    dict(
                        rows=names,
                        cols=cols,
                        xlabel="mask",
                        ylabel="",
                        title=_titled(f"Mask families, {shape}, S = {size_label(s)}{tag}, {p_pass}", one),
                        x_order=sorted(d["x"].unique()),
                        lines=False,
                    ),
                    section="balance",
                    shape=shape,
                    caption="Per method and mask family: percent of ideal (the single-device time of the same mask / P "
                    "over the method's time), K/V bytes a rank received that none of its queries attends, and "
                    "the busiest rank's visible (query, key) pairs over the mean rank's (1 = balanced)."
                    + (" Simulated rows (executor sim) are predictions, not measurements." if sim else ""),
                )
            )
    return jobs


_PLANNERS: dict[str, Callable] = {
    "throughput": _plan_throughput,
    "speedup": _plan_speedup,
    "scaling": _plan_scaling,
    "bytes": _plan_bytes,
    "time_split": _plan_time_split,
    "memory": _plan_memory,
    "sim_vs_measured": _plan_sim,
    "loss_curves": _plan_loss,
    "balance": _plan_balance,
    "masks": _plan_masks,
}
_WHY_NOT = {
    "throughput": "throughput: no measured rows",
    "speedup": "speedup: the baseline method has no measured row at the same points",
    "time_split": "time split: the runs have no breakdown columns (run.breakdown was off)",
    "bytes": "communication volume: no multi-rank rows with counted bytes",
    "scaling": "scaling: one world size only",
    "memory": "memory: no peak memory recorded",
    "sim_vs_measured": "simulated vs measured: needs rows of both executors dist and sim for the same trials",
    "loss_curves": "loss curves: the model-level rows have no loss curves",
    "balance": "load balance by length mix: no measured rows with the balance columns",
    "masks": "mask families: fewer than two families with multi-rank rows",
}
