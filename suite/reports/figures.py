"""Paper-style figures (matplotlib; PNG for the page, PDF with TrueType fonts for papers).

A report's figures are planned first (`plan_figures`: one `FigureJob` per file, holding exactly
the numbers it draws), then drawn (`draw`) and written (`render_figures`: in parallel worker
processes, and skipped when the same numbers were drawn by the same code before).

What every figure keeps to:
- a point is the median of the stored timed samples, its bar the spread of those samples
  (`INTERVAL`: percentiles 0 and 100, i.e. min to max, seaborn's errorbar=("pi", 100));
- series keep one colour, marker and line style everywhere (`style.palette_for`), and series
  sharing a point are dodged sideways so no marker hides another;
- a series with one point is a marker, not a line; x is the swept values at even spacing;
- panels of a row share the y axis, which starts at zero on linear scales; log axes carry at
  least two labelled ticks;
- labels name the device: GPUs, or CPU ranks for CPU processes.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import matplotlib
import matplotlib.text

matplotlib.use("Agg")  # headless: no display on CI or worker nodes
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FixedLocator, NullLocator  # noqa: E402

from suite import metrics as M  # noqa: E402
from suite.metrics import method_label  # noqa: E402
from suite.reports import style as S  # noqa: E402
from suite.reports.tables import (_options, attention_rows, measured, perplexity_rows, sim_pairs,  # noqa: E402
                                  speedup_rows)

INTERVAL = (0, 100)  # percentiles of the timed samples that a bar spans
_EPS = {"float32": 2.0**-23, "float64": 2.0**-52, "bfloat16": 2.0**-7, "float16": 2.0**-10}
# Panel and margin sizes (inches). The layout is computed, not searched for: matplotlib's
# constrained layout measures every label again on each save and doubles the drawing time.
PANEL_W, PANEL_H = 2.6, 2.0
SPLIT = ("attention kernels", "exposed communication", "other (merge, copies, Python)")
SPLIT_COLOURS = ("#5B7DB1", "#E3A857", "#BDBDBD")


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

    def key(self, palette: S.Palette) -> str:
        """Content hash: the numbers, the parameters, the series' styles and the drawing code."""
        h = hashlib.sha256()
        h.update(_CODE_VERSION.encode())
        h.update(json.dumps([self.name, self.kind, self.params], sort_keys=True, default=str).encode())
        series = sorted(set(self.data["series"])) if "series" in self.data else []
        h.update(json.dumps([[s, palette.styles.get(s).__dict__ if s in palette.styles else None]
                             for s in series], sort_keys=True).encode())
        h.update(self.data.to_json(orient="split", double_precision=15).encode())
        return h.hexdigest()


def _code_version() -> str:
    h = hashlib.sha256(matplotlib.__version__.encode())
    for mod in (__file__, S.__file__):
        h.update(Path(mod).read_bytes())
    return h.hexdigest()


_CODE_VERSION = _code_version()


# -- shared helpers ----------------------------------------------------------------------------------
def _short(v) -> str:
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


def _samples(row) -> np.ndarray:
    s = row.get(M.TIME_MS_SAMPLES)
    if isinstance(s, str):
        s = json.loads(s)
    if s is None or len(s) == 0:
        s = [row[M.TIME_MS_MEDIAN]]
    return np.asarray(s, dtype=float)


def _rate_points(m: pd.DataFrame, value: str) -> pd.DataFrame:
    """A rate (value proportional to 1 / time, e.g. TFLOP/s) per row at the median time, with the
    interval of the rate over the row's timed samples."""
    y, lo, hi = [], [], []
    for _, r in m.iterrows():
        k = r[value] * r[M.TIME_MS_MEDIAN]
        t_lo, t_hi = np.percentile(_samples(r), INTERVAL)
        y.append(r[value])
        lo.append(k / t_hi)
        hi.append(k / t_lo)
    return m.assign(y=y, lo=lo, hi=hi)


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
    e.g. the same sweep run twice, are pooled by the median)."""
    keep = ["series", "row", "col", x] + [c for c in cols if c in d]
    out = d[keep].rename(columns={x: "x"}).groupby(["series", "row", "col", "x"], as_index=False).median()
    return out.sort_values(["row", "col", "x", "series"]).reset_index(drop=True)


def _interval_note(d: pd.DataFrame) -> str:
    reps = d[M.REPEATS].dropna().unique() if M.REPEATS in d else []
    n = f"{int(reps[0])} " if len(reps) == 1 else ""
    return (f"Points are medians of the {n}timed repeats, bars span their minimum to maximum; series sharing a "
            "value are shifted sideways")


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
        else:
            notes.append(_WHY_NOT[kind])
    return jobs, notes


def _plan_throughput(df, _baseline) -> list[FigureJob]:
    jobs = []
    m = measured(df)
    for slug, shape, part in _per_shape(m):
        x = _x_axis(part)
        d, rows, cols, _ = _facet(_rate_points(part, M.TFLOPS_PER_GPU), x)
        word = S.rank_word(part)
        jobs.append(FigureJob(
            f"throughput{slug}", "points", _tidy(d, x),
            dict(rows=rows, cols=cols, xlabel=_x_label(part, x), ylabel=f"TFLOP/s per {word}",
                 title=f"Attention throughput per {word}, {shape}" + _fixed_s(part, x), auto_log=True),
            section="throughput", shape=shape,
            caption="FLOP count of the flash-attention convention / time / P. " + _interval_note(part)))
    return jobs


def _fixed_s(part: pd.DataFrame, x: str) -> str:
    return f", S = {_short(part['seq_len'].iloc[0])}" if x != "seq_len" else ""


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
        jobs.append(FigureJob(
            f"scaling{slug}", "points", _tidy(d, "world_size"),
            dict(rows=rows, cols=cols, xlabel=S.ranks_label(part), ylabel="tokens per second",
                 title=f"Scaling with {S.rank_word(part, True)}, {shape}, S = {_short(s)}", auto_log=True),
            section="scaling", shape=shape,
            caption=f"Tokens per second against the number of {S.rank_word(part, True)} at the longest sequence. "
                    + _interval_note(part)))
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
        d, rows, cols, _ = _facet(part.rename(columns={"speedup": "y", "speedup_lo": "lo", "speedup_hi": "hi"}), x)
        jobs.append(FigureJob(
            f"speedup{slug}", "bars", _tidy(d, x),
            dict(rows=rows, cols=cols, xlabel=_x_label(part, x), ylabel=f"speedup over {baseline} (x)",
                 title=f"Speedup over {baseline}, {shape}" + _fixed_s(part, x), ref=1.0),
            section="speedup", shape=shape,
            caption=f"{baseline} median time / method median time, same hardware, executor and problem; bars span "
                    f"{baseline} min / method max to {baseline} max / method min over the timed repeats. Rows that "
                    "failed the float64 check have no bar."))
    return jobs


def _plan_time_split(df, _baseline) -> list[FigureJob]:
    m_all = measured(df).dropna(subset=[M.KERNEL_MS, M.COMM_WAIT_MS])
    jobs = []
    for slug, shape, m in _per_shape(m_all):
        p = m["world_size"].max()
        m = m[m["world_size"] == p]
        s = m["seq_len"].max()
        m = m[m["seq_len"] == s]
        d = m.assign(row=m["pass"].astype(str), col=m["mask"].astype(str), x=0,
                     kernels=m[M.KERNEL_MS], comm=m[M.COMM_WAIT_MS],
                     other=(m[M.TIME_MS_MEDIAN] - m[M.KERNEL_MS] - m[M.COMM_WAIT_MS]).clip(lower=0))
        tidy = d[["series", "row", "col", "kernels", "comm", "other"]].groupby(["series", "row", "col"],
                                                                              as_index=False).median()
        jobs.append(FigureJob(
            f"time_split{slug}", "split", tidy,
            dict(rows=sorted(tidy["row"].unique(), key=_row_key), cols=sorted(tidy["col"].unique()),
                 xlabel="time per iteration (ms)",
                 title=f"Time split, P = {p}, S = {_short(s)}, {shape}"),
            section="communication", shape=shape,
            caption="Median iteration split into time in attention kernels, time blocked in communication (exposed), "
                    f"and the rest, at the largest world size ({p}) and sequence length ({s}); means over ranks."))
    return jobs


def _plan_bytes(df, _baseline) -> list[FigureJob]:
    m = measured(df)
    m = m[m["world_size"] > 1].assign(y=lambda d: d[M.BYTES_SENT] / 2**20)
    m = m[m["y"] > 0]
    return _plan_plain(m, "bytes", "communication", "MiB sent per {word}", "Communication volume per {word}",
                       "Bytes one iteration sends per {word} (counted, not estimated).")


def _plan_memory(df, _baseline) -> list[FigureJob]:
    m = measured(df).dropna(subset=[M.PEAK_MEM])
    m = m.assign(y=m[M.PEAK_MEM] / 2**20)
    return _plan_plain(m, "memory", "memory", "peak memory per {word} (MiB)", "Peak memory per {word}",
                       "Memory one iteration allocates per {word} beyond what was alive before it (max over ranks).")


def _plan_plain(m, name, section, ylabel, title, caption) -> list[FigureJob]:
    """A deterministic per-row value `y` (no samples) against the swept axis, per shape."""
    jobs = []
    for slug, shape, part in _per_shape(m):
        x = _x_axis(part)
        d, rows, cols, _ = _facet(_merge_equal_masks(part), x)
        word = S.rank_word(part)
        jobs.append(FigureJob(
            f"{name}{slug}", "points", _tidy(d, x, ("y",)),
            dict(rows=rows, cols=cols, xlabel=_x_label(part, x), ylabel=ylabel.format(word=word),
                 title=title.format(word=word) + f", {shape}" + _fixed_s(part, x), auto_log=True),
            section=section, shape=shape, caption=caption.format(word=word)))
    return jobs


def _merge_equal_masks(part: pd.DataFrame) -> pd.DataFrame:
    """One panel for both masks where every point has the same value under each (bytes sent do
    not depend on the mask for most methods): two identical panels only repeat each other."""
    masks = sorted(part["mask"].unique())
    if len(masks) < 2:
        return part
    wide = part.pivot_table(index=["series", "world_size", "seq_len", "pass"], columns="mask", values="y",
                            aggfunc="median")
    if not wide.notna().all(axis=None) or not (wide.nunique(axis=1) == 1).all():
        return part
    return part[part["mask"] == masks[0]].assign(mask=" = ".join(masks))


def _plan_sim(df, _baseline) -> list[FigureJob]:
    pair = sim_pairs(df)
    if pair.empty:
        return []
    lo, hi = [], []
    for _, r in pair.iterrows():
        t = _samples({M.TIME_MS_SAMPLES: r[f"{M.TIME_MS_SAMPLES}_dist"],
                      M.TIME_MS_MEDIAN: r[f"{M.TIME_MS_MEDIAN}_dist"]})
        a, b = np.percentile(t, INTERVAL)
        lo.append(a)
        hi.append(b)
    labels = [method_label(m, _options(o)) for m, o in zip(pair["method"], pair["options"])]
    data = pd.DataFrame({"series": pair["series_dist"], "method": pair["method"], "label": labels,
                         "x": pair[f"{M.TIME_MS_MEDIAN}_dist"], "lo": lo, "hi": hi,
                         "y": pair[f"{M.TIME_MS_MEDIAN}_sim"]}).sort_values(["series", "x"]).reset_index(drop=True)
    return [FigureJob("sim_vs_measured", "scatter", data,
                      dict(xlabel="measured time (ms, executor dist)", ylabel="simulated time (ms, executor sim)",
                           title="Simulated vs measured"),
                      section="sim", caption="Each trial's simulated time against its measured median (bars: min to "
                                             "max of the timed repeats); the dashed line is a perfect prediction.")]


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
        jobs.append(FigureJob(
            f"loss_curves{slug}", "loss", data,
            dict(title=f"Model-level check, {shape}, S = {_short(s)}", eps=_EPS.get(str(part["dtype"].iloc[0])),
                 dtype=str(part["dtype"].iloc[0])),
            section="perplexity", shape=shape,
            caption="Training loss per step with each method over the single-device baseline (left), and the largest "
                    "relative difference to the baseline so far (right, log scale; the dotted line is the dtype's "
                    "machine epsilon)."))
    return jobs


def _plan_balance(df, _baseline) -> list[FigureJob]:
    """Compute imbalance (pairs max/mean) and throughput per method across length mixes, per
    world size: what packing documents of long-tailed lengths does to each layout's balance."""
    m = measured(df).dropna(subset=[M.IMBALANCE])
    m = m[m["world_size"] > 1]   # one rank is balanced by definition
    if m.empty or m["mix"].nunique() < 2:
        return []
    jobs = []
    for slug, shape, part in _per_shape(m):
        s = part["seq_len"].max()
        causal = bool(part["causal"].any())  # the document-causal mask is where balance is at stake
        part = part[(part["seq_len"] == s) & (part["pass"] == sorted(part["pass"].unique())[0])
                    & (part["causal"] == causal)]
        word = S.rank_word(part)
        col = "P = " + part["world_size"].astype(str)
        base = part.assign(col=col)
        imb = base.assign(row="imbalance (pairs max/mean)", y=base[M.IMBALANCE], lo=base[M.IMBALANCE],
                          hi=base[M.IMBALANCE])
        rate = _rate_points(base, M.TFLOPS_PER_GPU).assign(row=f"TFLOP/s per {word}")
        d = pd.concat([imb, rate])
        d["x"] = d["mix"]
        cols = ["P = " + str(p) for p in sorted(part["world_size"].unique())]
        p_pass = part["pass"].iloc[0]
        jobs.append(FigureJob(
            f"balance{slug}", "points", _tidy(d, "x"),
            dict(rows=["imbalance (pairs max/mean)", f"TFLOP/s per {word}"], cols=cols, xlabel="length mix",
                 ylabel="", title=f"Load balance and throughput by length mix, {shape}, S = {_short(s)}, "
                                  f"{'causal' if causal else 'full'}, {p_pass}",
                 x_order=["uniform"] + sorted(x for x in d["mix"].unique() if x != "uniform"), lines=False),
            section="balance", shape=shape,
            caption="Top: visible (query, key) pairs of the busiest rank's kernels over the mean rank's (1 = "
                    "balanced). Bottom: throughput (FLOPs of the exact document-causal pairs / time / P). "
                    "uniform: one document per sequence; docs:<name>: documents drawn from that distribution, packed. "
                    + _interval_note(part)))
    return jobs


_PLANNERS: dict[str, Callable] = {
    "throughput": _plan_throughput, "speedup": _plan_speedup, "scaling": _plan_scaling, "bytes": _plan_bytes,
    "time_split": _plan_time_split, "memory": _plan_memory, "sim_vs_measured": _plan_sim,
    "loss_curves": _plan_loss, "balance": _plan_balance,
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
}


# -- drawing -----------------------------------------------------------------------------------------
def draw(job: FigureJob, palette: S.Palette):
    """The matplotlib figure of a job (not saved)."""
    with plt.rc_context(S.RC):
        return _DRAWERS[job.kind](job.data, palette, **job.params)


def _grid(rows: list, cols: list, legend_w: float, title: str, *, sharey="row", sharex=False, panel_w=PANEL_W,
          panel_h=PANEL_H, left=0.8, bottom=0.66, top=0.7, hspace_in=0.42):
    """A figure of len(rows) x len(cols) panels with margins in inches (see PANEL_W), at least as
    wide as its title."""
    nr, nc = len(rows), len(cols)
    wspace_in = 0.22 if sharey else 1.0
    width = left + nc * panel_w + (nc - 1) * wspace_in + 0.25 + legend_w
    legend_w += max(0.0, 0.3 + 0.085 * len(title) - width)  # DejaVu Sans at 11 pt: ~0.085 in per character
    width = left + nc * panel_w + (nc - 1) * wspace_in + 0.25 + legend_w
    height = bottom + nr * panel_h + (nr - 1) * hspace_in + top
    fig, axes = plt.subplots(nr, nc, figsize=(width, height), sharey=sharey, sharex=sharex, squeeze=False)
    fig.subplots_adjust(left=left / width, right=(width - 0.25 - legend_w) / width, bottom=bottom / height,
                        top=1 - top / height, wspace=wspace_in / panel_w, hspace=hspace_in / panel_h)
    return fig, axes


def _legend_width(labels: list[str], title: str = "method") -> float:
    """Width (inches) of a legend of `labels` at the legend font size: marker, gap and text."""
    longest = max([len(s) for s in labels] + [len(title)])
    return 0.5 + 0.074 * longest  # DejaVu Sans at 9 pt: about 0.074 in per character on average


def _legend(fig, palette: S.Palette, series: list[str], *, marker=True, title="method", top=None):
    handles = []
    for s in series:
        st = palette.style(s)
        if marker:
            handles.append(Line2D([], [], color=st.colour, marker=st.marker, linestyle=st.linestyle, label=s))
        else:
            handles.append(Patch(facecolor=st.colour, label=s))
    right = fig.subplotpars.right
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(right + 0.01, top or fig.subplotpars.top),
               title=title, alignment="left", handlelength=2.2)


def _title(fig, text: str, height_in: float):
    fig.suptitle(text, x=0.02, y=1 - 0.12 / height_in, ha="left", va="top", fontsize=S.RC["figure.titlesize"])


def tick_labels(values) -> list[str]:
    """Labels of swept sizes, in one unit per axis: 512K when every value is a multiple of 1024,
    8.06K / 129K (thousands) when every value is at least 1000, the plain numbers otherwise; names
    (length mixes) as they are."""
    if any(isinstance(v, str) for v in values):
        return [str(v) for v in values]
    values = [int(v) for v in values]
    if values and all(v % 1024 == 0 for v in values) and min(values) >= 1024:
        return [_short(v) for v in values]
    if values and min(values) >= 1000:
        return [f"{v / 1000:.3g}K" for v in values]
    return [str(v) for v in values]


def _categorical_x(ax, xs: list, *, last_row: bool, xlabel: str):
    """The swept values at even spacing (every panel of a figure has the same ones, so only the
    bottom row labels them)."""
    ax.set_xticks(range(len(xs)), tick_labels(xs))
    ax.set_xlim(-0.6, len(xs) - 0.4)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.grid(False, axis="x")
    if last_row:
        ax.set_xlabel(xlabel)
    else:
        ax.tick_params(axis="x", labelbottom=False)


def _offsets(series: list[str], width: float) -> dict[str, float]:
    """Sideways shift of each series (in category units) so that equal values stay visible."""
    n = len(series)
    step = min(0.12, width / max(n, 1))
    return {s: (i - (n - 1) / 2) * step for i, s in enumerate(series)}


def _points(data, palette, *, rows, cols, xlabel, ylabel, title, auto_log=False, ref=None, x_order=None,
            lines=True):
    """Medians with intervals against a swept axis; `x_order` for named (categorical) x values, whose
    points are not joined by lines when `lines` is False."""
    series = palette.sort(data["series"])
    xs = [x for x in x_order if x in set(data["x"])] if x_order else sorted(data["x"].unique())
    pos = {x: i for i, x in enumerate(xs)}
    off = _offsets(series, 0.6)
    legend_w = _legend_width(series)
    fig, axes = _grid(rows, cols, legend_w, title)
    positive = data["y"][data["y"] > 0]
    logy = auto_log and len(positive) and positive.max() / positive.min() > 30
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            ax = axes[i][j]
            panel = data[(data["row"] == r) & (data["col"] == c)]
            for s in series:
                pts = panel[panel["series"] == s].sort_values("x")
                if pts.empty:
                    continue
                st = palette.style(s)
                x = [pos[v] + off[s] for v in pts["x"]]
                if "lo" in pts and (pts["hi"] - pts["lo"]).abs().max() > 0:
                    ax.errorbar(x, pts["y"], yerr=[pts["y"] - pts["lo"], pts["hi"] - pts["y"]], fmt="none",
                                ecolor=st.colour, elinewidth=1.0, capsize=2.0, zorder=2)
                ax.plot(x, pts["y"], color=st.colour, marker=st.marker, markersize=5,
                        linestyle=st.linestyle if len(pts) > 1 and lines else "none", markeredgecolor="white",
                        markeredgewidth=0.5, zorder=3)
            _categorical_x(ax, xs, last_row=i == len(rows) - 1, xlabel=xlabel)
            ax.set_title(f"{r}, {c}" if r != c else r)
            if j == 0:
                ax.set_ylabel(ylabel)
        _row_y(axes[i], data[data["row"] == r], logy, ref)
    _title(fig, title, fig.get_figheight())
    _legend(fig, palette, series)
    return fig


def _row_y(axes_row, d: pd.DataFrame, log: bool, ref=None):
    """One y range for a row of panels: from zero on linear axes, readable ticks on log axes."""
    cols = [c for c in ("y", "lo", "hi") if c in d]
    vals = d[cols].to_numpy(dtype=float).ravel()
    vals = vals[np.isfinite(vals)]
    if ref is not None:
        vals = np.append(vals, ref)
    ax = axes_row[0]
    if log:
        vals = vals[vals > 0]
        if len(vals):
            _readable_log(ax, vals.min(), vals.max(), "y")
        return
    top = vals.max() if len(vals) else 1.0
    ax.set_ylim(0, top * 1.08 if top > 0 else 1.0)


def _nice_ticks(lo: float, hi: float) -> list[float]:
    """1-2-5 ticks from the largest one at or below `lo` to the smallest one at or above `hi`: the
    axis ends on labelled ticks, so it always shows at least two labels."""
    ticks = [m * 10.0**e for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 2)
             for m in (1, 2, 5)]
    start = max(t for t in ticks if t <= lo * (1 + 1e-9))
    end = min(t for t in ticks if t >= hi * (1 - 1e-9))
    inside = [t for t in ticks if start <= t <= end]
    return inside if len(inside) >= 2 else [start, next(t for t in ticks if t > start)]


def _readable_log(ax, lo: float, hi: float, axis: str):
    """Log axis over [lo, hi] with plain 1-2-5 labels (no '2x10^0'), ending on labelled ticks."""
    ticks = _nice_ticks(lo, hi)
    shown = ticks
    if len(ticks) > 7:  # long axes: label the decades (and the ends) only
        shown = [t for t in ticks if f"{t:.0e}".startswith("1")]
        shown = sorted({ticks[0], *shown, ticks[-1]})
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
    pad = (ticks[-1] / ticks[0]) ** 0.02
    (ax.set_ylim if axis == "y" else ax.set_xlim)(ticks[0] / pad, ticks[-1] * pad)
    target = ax.yaxis if axis == "y" else ax.xaxis
    target.set_major_locator(FixedLocator(shown))
    target.set_minor_locator(NullLocator())
    (ax.set_yticks if axis == "y" else ax.set_xticks)(shown, [_num(t) for t in shown])


def _num(v: float) -> str:
    """Short tick label: 0.002, 0.5, 20, 5K, 2M."""
    if v >= 1e6:
        return f"{v / 1e6:g}M"
    if v >= 1e4:
        return f"{v / 1e3:g}K"
    return f"{v:g}"


def _bars(data, palette, *, rows, cols, xlabel, ylabel, title, ref=1.0):
    series = palette.sort(data["series"])
    xs = sorted(data["x"].unique())
    pos = {x: i for i, x in enumerate(xs)}
    width = min(0.8 / max(len(series), 1), 0.35)
    off = {s: (k - (len(series) - 1) / 2) * width for k, s in enumerate(series)}
    fig, axes = _grid(rows, cols, _legend_width(series), title)
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            ax = axes[i][j]
            panel = data[(data["row"] == r) & (data["col"] == c)]
            for s in series:
                pts = panel[panel["series"] == s]
                if pts.empty:
                    continue
                st = palette.style(s)
                x = [pos[v] + off[s] for v in pts["x"]]
                ax.bar(x, pts["y"], width=width * 0.92, color=st.colour, zorder=2)
                if (pts["hi"] - pts["lo"]).abs().max() > 0:  # a single sample (simulated) has no spread
                    ax.errorbar(x, pts["y"], yerr=[pts["y"] - pts["lo"], pts["hi"] - pts["y"]], fmt="none",
                                ecolor="#333333", elinewidth=0.8, capsize=1.5, zorder=3)
            ax.axhline(ref, ls="--", c="grey", lw=1, zorder=1)
            _categorical_x(ax, xs, last_row=i == len(rows) - 1, xlabel=xlabel)
            ax.set_title(f"{r}, {c}")
            if j == 0:
                ax.set_ylabel(ylabel)
        _row_y(axes[i], data[data["row"] == r], False, ref)
    _title(fig, title, fig.get_figheight())
    _legend(fig, palette, series, marker=False)
    return fig


def _split(data, palette, *, rows, cols, xlabel, title):
    series = palette.sort(data["series"])
    longest = max(len(s) for s in series)
    left = 0.3 + 0.074 * longest
    fig, axes = _grid(rows, cols, _legend_width(list(SPLIT), "time in"), title, sharey=True, sharex="row",
                      panel_h=max(1.2, 0.26 * len(series) + 0.5), left=left, hspace_in=0.7)
    ypos = {s: k for k, s in enumerate(series)}
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            ax = axes[i][j]
            panel = data[(data["row"] == r) & (data["col"] == c)].set_index("series")
            y = [ypos[s] for s in panel.index]
            start = np.zeros(len(panel))
            for part, colour in zip(("kernels", "comm", "other"), SPLIT_COLOURS):
                ax.barh(y, panel[part], left=start, color=colour, height=0.7, zorder=2)
                start = start + panel[part].to_numpy()
            ax.set_yticks(range(len(series)), series)
            ax.set_ylim(len(series) - 0.5, -0.5)
            ax.grid(False, axis="y")
            ax.set_title(f"{r}, {c}")
            if i == len(rows) - 1:
                ax.set_xlabel(xlabel)
        row_total = data[data["row"] == r][["kernels", "comm", "other"]].sum(axis=1).max()
        axes[i][0].set_xlim(0, row_total * 1.05)
    _title(fig, title, fig.get_figheight())
    handles = [Patch(facecolor=c, label=lab) for lab, c in zip(SPLIT, SPLIT_COLOURS)]
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(fig.subplotpars.right + 0.01, fig.subplotpars.top),
               title="time in", alignment="left")
    return fig


def _scatter(data, palette, *, xlabel, ylabel, title):
    """One point per trial, in its method's colour and marker (a point is a pair of series, the
    measured one and its prediction, so it takes the method's own colour rather than a shade)."""
    labels = list(dict.fromkeys(data.sort_values(["method", "label"])["label"]))
    method_of = dict(zip(data["label"], data["method"]))
    order = {m: i for i, m in enumerate(palette.methods)}
    labels.sort(key=lambda lab: (order.get(method_of[lab], len(order)), lab))
    fig, axes = _grid(["all"], ["all"], _legend_width(labels), title, sharey=False, panel_w=3.2, panel_h=3.2)
    ax = axes[0][0]
    handles = []
    for lab in labels:
        pts = data[data["label"] == lab]
        st = palette.style(pts["series"].iloc[0])
        colour = palette.method_colours.get(method_of[lab], st.colour)
        ax.errorbar(pts["x"], pts["y"], xerr=[pts["x"] - pts["lo"], pts["hi"] - pts["x"]], fmt="none",
                    ecolor=colour, elinewidth=0.8, capsize=1.5, alpha=0.8, zorder=2)
        ax.plot(pts["x"], pts["y"], linestyle="none", marker=st.marker, color=colour, markeredgecolor="white",
                markeredgewidth=0.5, zorder=3)
        handles.append(Line2D([], [], color=colour, marker=st.marker, linestyle="none", label=lab))
    vals = data[["x", "y", "lo", "hi"]].to_numpy(dtype=float).ravel()
    vals = vals[np.isfinite(vals) & (vals > 0)]
    lo, hi = vals.min(), vals.max()
    _readable_log(ax, lo, hi, "x")
    _readable_log(ax, lo, hi, "y")
    a, b = ax.get_xlim()
    ax.plot([a, b], [a, b], ls="--", c="grey", lw=1, zorder=1)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    _title(fig, title, fig.get_figheight())
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(fig.subplotpars.right + 0.01, fig.subplotpars.top),
               title="method", alignment="left")
    return fig


def _loss(data, palette, *, title, eps=None, dtype=""):
    series = palette.sort(data["series"])
    labels = {s: f"{s} P={int(data.loc[data['series'] == s, 'P'].iloc[0])}" for s in series}
    legend_w = _legend_width(list(labels.values()))
    fig, axes = _grid(["loss"], ["loss", "diff"], legend_w, title, sharey=False, panel_w=3.0, panel_h=2.3,
                      left=0.75)
    ax_l, ax_d = axes[0]
    handles = []
    every = max(1, int(data["step"].max()) // 8)
    for k, s in enumerate(series):
        pts = data[data["series"] == s]
        st = palette.style(s)
        if pts["baseline"].iloc[0]:
            h, = ax_l.plot(pts["step"], pts["loss"], color="black", lw=2.6, alpha=0.3, label=labels[s], zorder=1)
            handles.append(h)
            continue
        ax_l.plot(pts["step"], pts["loss"], color=st.colour, lw=1.0, linestyle=st.linestyle, zorder=2)
        # markers of different series at different steps: curves that coincide still show every marker
        ax_d.plot(pts["step"], pts["diff"], color=st.colour, marker=st.marker, markevery=(k % every, every),
                  ms=4, lw=1.0, linestyle=st.linestyle, zorder=2)
        handles.append(Line2D([], [], color=st.colour, marker=st.marker, linestyle=st.linestyle, label=labels[s]))
    diffs = data["diff"].to_numpy(dtype=float)
    diffs = diffs[np.isfinite(diffs) & (diffs > 0)]
    if len(diffs):
        lo, hi = diffs.min(), diffs.max()
        if eps is not None:
            ax_d.axhline(eps, ls=":", color="grey", lw=1)
            ax_d.annotate(f"{dtype} machine epsilon", (0.02, eps), xycoords=("axes fraction", "data"),
                          xytext=(0, 3), textcoords="offset points", fontsize=7, color="grey")
            lo, hi = min(lo, eps), max(hi, eps)
        _readable_log(ax_d, lo, hi, "y")
    ax_l.set(xlabel="training step", ylabel="training loss (nats per byte)", title="training loss")
    ax_d.set(xlabel="training step", ylabel="max so far of |loss - baseline| / baseline",
             title="difference to the single-device baseline")
    _title(fig, title, fig.get_figheight())
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(fig.subplotpars.right + 0.01, fig.subplotpars.top),
               title="method", alignment="left")
    return fig


_DRAWERS: dict[str, Callable] = {"points": _points, "bars": _bars, "split": _split, "scatter": _scatter,
                                 "loss": _loss}


# -- writing -----------------------------------------------------------------------------------------
_JOBS: list = []  # (job, palette, out_dir) of the current render, read by forked workers by index


def _write(i: int) -> list[str]:
    job, palette, out = _JOBS[i]
    fig = draw(job, palette)
    paths = []
    with plt.rc_context(S.RC):
        for ext in ("png", "pdf"):
            if ext == "pdf":
                # no ligatures ("fl" in "float32"): matplotlib embeds ligature glyphs as a second
                # subset of the font, and subsetting DejaVu Sans is most of a PDF's writing time
                for text in fig.findobj(matplotlib.text.Text):
                    text.set_fontfeatures(["-liga"])
            path = out / f"{job.name}.{ext}"
            tmp = path.with_name(f".{path.name}.tmp")
            fig.savefig(tmp, format=ext, dpi=S.DPI if ext == "png" else None,
                        metadata={"Creator": "sp-attention-suite report"} if ext == "pdf" else None)
            tmp.replace(path)
            paths.append(str(path))
    plt.close(fig)
    (out / f".{job.name}.key").write_text(job.key(palette))
    return paths


def render_figures(jobs: list[FigureJob], palette: S.Palette, out_dir, *, workers: Optional[int] = None,
                   progress: Optional[Callable[[int, int], None]] = None,
                   cache: bool = True) -> tuple[dict[str, list[str]], int]:
    """Write every job's PNG and PDF under `out_dir`; returns ({job name: paths}, figures drawn).
    A job whose key (numbers, styles, code) matches the one stored beside its files is not drawn
    again. The rest are drawn in forked worker processes, one figure per task."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done: dict[str, list[str]] = {}
    todo = []
    for job in jobs:
        files = [out / f"{job.name}.png", out / f"{job.name}.pdf"]
        key_file = out / f".{job.name}.key"
        if cache and all(f.exists() for f in files) and key_file.exists() and key_file.read_text() == job.key(palette):
            done[job.name] = [str(f) for f in files]
        else:
            todo.append(job)
    total = len(jobs)
    if progress:
        progress(len(done), total)
    global _JOBS
    _JOBS = [(job, palette, out) for job in todo]
    n = workers if workers is not None else min(len(todo), _cpus())
    try:
        if n > 1 and "fork" in mp.get_all_start_methods():
            _warm_up()
            with ProcessPoolExecutor(n, mp_context=mp.get_context("fork")) as pool:
                futures = {pool.submit(_write, i): job.name for i, job in enumerate(todo)}
                for fut in as_completed(futures):
                    done[futures[fut]] = fut.result()
                    if progress:
                        progress(len(done), total)
        else:
            for i, job in enumerate(todo):
                done[job.name] = _write(i)
                if progress:
                    progress(len(done), total)
    finally:
        _JOBS = []
    return {job.name: done[job.name] for job in jobs}, len(todo)


def _warm_up() -> None:
    """Load fonts and both backends once in the parent, so forked workers inherit them instead of
    each paying for them on its first figure."""
    import io

    with plt.rc_context(S.RC):
        fig = plt.figure(figsize=(1, 1))
        fig.text(0.5, 0.5, "0.5 x")
        for fmt in ("png", "pdf"):
            fig.savefig(io.BytesIO(), format=fmt)
        plt.close(fig)


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
