"""Drawing: the matplotlib figure of a `FigureJob` (`draw`), one drawer per kind of figure.

What every figure keeps to:
- series keep one colour, marker and line style everywhere (`style.palette_for`), and series
  sharing a point are dodged sideways so no marker hides another;
- a series with one point is a marker, not a line; x is the swept values at even spacing;
- panels of a row share the y axis, which starts at zero on linear scales; log axes carry at
  least two labelled ticks.
"""

from __future__ import annotations

import math
from typing import Callable

import matplotlib

matplotlib.use("Agg")  # headless: no display on CI or worker nodes
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.artist import Artist  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FixedLocator, NullLocator  # noqa: E402

from suite.reports import style as S  # noqa: E402
from suite.reports.figures.plan import FigureJob, size_label  # noqa: E402

# Panel and margin sizes (inches). The layout is computed, not searched for: matplotlib's
# constrained layout measures every label again on each save and doubles the drawing time.
PANEL_W, PANEL_H = 2.6, 2.0
SPLIT = ("attention kernels", "exposed communication", "other (merge, copies, Python)")
SPLIT_COLOURS = ("#5B7DB1", "#E3A857", "#BDBDBD")


def draw(job: FigureJob, palette: S.Palette):
    """The matplotlib figure of a job (not saved)."""
    with plt.rc_context(S.RC):
        return _DRAWERS[job.kind](job.data, palette, **job.params)


def _grid(
    rows: list,
    cols: list,
    legend_w: float,
    title: str,
    *,
    sharey="row",
    sharex=False,
    panel_w=PANEL_W,
    panel_h=PANEL_H,
    left=0.8,
    bottom=0.66,
    top=0.7,
    hspace_in=0.42,
):
    """A figure of len(rows) x len(cols) panels with margins in inches (see PANEL_W), at least as
    wide as its title."""
    nr, nc = len(rows), len(cols)
    wspace_in = 0.22 if sharey else 1.0
    width = left + nc * panel_w + (nc - 1) * wspace_in + 0.25 + legend_w
    legend_w += max(0.0, 0.3 + 0.085 * len(title) - width)  # DejaVu Sans at 11 pt: ~0.085 in per character
    width = left + nc * panel_w + (nc - 1) * wspace_in + 0.25 + legend_w
    height = bottom + nr * panel_h + (nr - 1) * hspace_in + top
    fig, axes = plt.subplots(nr, nc, figsize=(width, height), sharey=sharey, sharex=sharex, squeeze=False)
    fig.subplots_adjust(
        left=left / width,
        right=(width - 0.25 - legend_w) / width,
        bottom=bottom / height,
        top=1 - top / height,
        wspace=wspace_in / panel_w,
        hspace=hspace_in / panel_h,
    )
    return fig, axes


def _legend_width(labels: list[str], title: str = "method") -> float:
    """Width (inches) of a legend of `labels` at the legend font size: marker, gap and text."""
    longest = max([len(s) for s in labels] + [len(title)])
    return 0.5 + 0.074 * longest  # DejaVu Sans at 9 pt: about 0.074 in per character on average


BUSY_LABEL = "busy? (see caption)"  # the legend entry of the red rings (`_mark_busy`)


def _any_busy(data: pd.DataFrame) -> bool:
    return "busy" in data and bool(data["busy"].fillna(False).astype(bool).any())


def _legend(fig, palette: S.Palette, series: list[str], *, marker=True, title="method", top=None, busy=False):
    handles: list[Artist] = []
    for s in series:
        st = palette.style(s)
        if marker:
            handles.append(Line2D([], [], color=st.colour, marker=st.marker, linestyle=st.linestyle, label=s))
        else:
            handles.append(Patch(facecolor=st.colour, label=s))
    if busy:  # the red rings get an entry: a mark the legend does not name reads as a data series
        handles.append(
            Line2D(
                [],
                [],
                linestyle="none",
                marker="o",
                markersize=9,
                markerfacecolor="none",
                markeredgecolor=BUSY_COLOUR,
                markeredgewidth=1.4,
                label=BUSY_LABEL,
            )
        )
    _legend_right(fig, handles, title, top=top, handlelength=2.2)


def _legend_right(fig, handles: list, title: str, *, top=None, **kw) -> None:
    """A figure legend right of the axes, its top at the axes' top (or `top`)."""
    fig.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(fig.subplotpars.right + 0.01, top or fig.subplotpars.top),
        title=title,
        alignment="left",
        **kw,
    )


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
        return [size_label(v) for v in values]
    if values and min(values) >= 1000:
        return [f"{v / 1000:.3g}K" for v in values]
    return [str(v) for v in values]


def _categorical_x(ax, xs: list, *, last_row: bool, xlabel: str):
    """The swept values at even spacing (every panel of a figure has the same ones, so only the
    bottom row labels them)."""
    labels = tick_labels(xs)
    ax.set_xticks(range(len(xs)), labels)
    if sum(len(str(t)) for t in labels) > 40:  # long names (mask families): slanted, so they never overlap
        ax.tick_params(axis="x", labelrotation=35)
        for t in ax.get_xticklabels():
            t.set_horizontalalignment("right")
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


def _points(data, palette, *, rows, cols, xlabel, ylabel, title, auto_log=False, ref=None, x_order=None, lines=True):
    """Medians with intervals against a swept axis; `x_order` for named (categorical) x values, whose
    points are not joined by lines when `lines` is False."""
    series = palette.sort(data["series"])
    xs = [x for x in x_order if x in set(data["x"])] if x_order else sorted(data["x"].unique())
    pos = {x: i for i, x in enumerate(xs)}
    off = _offsets(series, 0.6)
    legend_w = _legend_width(series + ([BUSY_LABEL] if _any_busy(data) else []))
    fig, axes = _grid(rows, cols, legend_w, title)
    positive = data["y"][data["y"] > 0]
    logy = bool(auto_log and len(positive) and positive.max() / positive.min() > 30)
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
                    ax.errorbar(
                        x,
                        pts["y"],
                        yerr=[pts["y"] - pts["lo"], pts["hi"] - pts["y"]],
                        fmt="none",
                        ecolor=st.colour,
                        elinewidth=1.0,
                        capsize=2.0,
                        zorder=2,
                    )
                ax.plot(
                    x,
                    pts["y"],
                    color=st.colour,
                    marker=st.marker,
                    markersize=5,
                    linestyle=st.linestyle if len(pts) > 1 and lines else "none",
                    markeredgecolor="white",
                    markeredgewidth=0.5,
                    zorder=3,
                )
                _mark_busy(ax, pts, x, pts["y"])
            _categorical_x(ax, xs, last_row=i == len(rows) - 1, xlabel=xlabel)
            ax.set_title(f"{r}, {c}" if r != c else r)
            if j == 0:  # a figure that chose a log axis says so: beside a linear one, it reads alike
                ax.set_ylabel(f"{ylabel} (log scale)" if logy else ylabel)
        _row_y(axes[i], data[data["row"] == r], logy, ref)
    _room_for_slanted(fig, xs)
    _title(fig, title, fig.get_figheight())
    _legend(fig, palette, series, busy=_any_busy(data))
    return fig


BUSY_COLOUR = "#D62728"


def _mark_busy(ax, pts: pd.DataFrame, x: list, y) -> None:
    """A red ring at the points whose timing was flagged busy (plan: `busy`, said in the caption)."""
    if "busy" not in pts:
        return
    flag = pts["busy"].fillna(False).astype(bool).to_numpy()
    if flag.any():
        ax.plot(
            np.asarray(x)[flag],
            np.asarray(y, dtype=float)[flag],
            linestyle="none",
            marker="o",
            markersize=11,
            markerfacecolor="none",
            markeredgecolor=BUSY_COLOUR,
            markeredgewidth=1.4,
            zorder=4,
        )


def _room_for_slanted(fig, xs: list) -> None:
    """A taller figure, the panels kept their size, where `_categorical_x` slanted long labels."""
    labels = [str(t) for t in tick_labels(xs)]
    if sum(map(len, labels)) <= 40:
        return
    h = fig.get_figheight()
    extra = 0.065 * max(map(len, labels)) * 0.6  # inches the slanted labels reach below the axis
    p = fig.subplotpars
    top_in, bottom_in = (1 - p.top) * h, p.bottom * h + extra
    fig.set_figheight(h + extra)
    fig.subplots_adjust(top=1 - top_in / (h + extra), bottom=bottom_in / (h + extra))


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
    ticks = [
        m * 10.0**e for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 2) for m in (1, 2, 5)
    ]
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
    fig, axes = _grid(rows, cols, _legend_width(series + ([BUSY_LABEL] if _any_busy(data) else [])), title)
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
                _mark_busy(ax, pts, x, pts["hi"].where(pts["hi"] > pts["y"], pts["y"]))
                if (pts["hi"] - pts["lo"]).abs().max() > 0:  # a single sample (simulated) has no spread
                    ax.errorbar(
                        x,
                        pts["y"],
                        yerr=[pts["y"] - pts["lo"], pts["hi"] - pts["y"]],
                        fmt="none",
                        ecolor="#333333",
                        elinewidth=0.8,
                        capsize=1.5,
                        zorder=3,
                    )
            ax.axhline(ref, ls="--", c="grey", lw=1, zorder=1)
            _categorical_x(ax, xs, last_row=i == len(rows) - 1, xlabel=xlabel)
            ax.set_title(f"{r}, {c}")
            if j == 0:
                ax.set_ylabel(ylabel)
        _row_y(axes[i], data[data["row"] == r], False, ref)
    _title(fig, title, fig.get_figheight())
    _legend(fig, palette, series, marker=False, busy=_any_busy(data))
    return fig


def _split(data, palette, *, rows, cols, xlabel, title):
    series = palette.sort(data["series"])
    longest = max(len(s) for s in series)
    left = 0.3 + 0.074 * longest
    fig, axes = _grid(
        rows,
        cols,
        _legend_width(list(SPLIT), "time in"),
        title,
        sharey=True,
        sharex="row",
        panel_h=max(1.2, 0.26 * len(series) + 0.5),
        left=left,
        hspace_in=0.7,
    )
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
    _legend_right(fig, handles, "time in")
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
        ax.errorbar(
            pts["x"],
            pts["y"],
            xerr=[pts["x"] - pts["lo"], pts["hi"] - pts["x"]],
            fmt="none",
            ecolor=colour,
            elinewidth=0.8,
            capsize=1.5,
            alpha=0.8,
            zorder=2,
        )
        ax.plot(
            pts["x"],
            pts["y"],
            linestyle="none",
            marker=st.marker,
            color=colour,
            markeredgecolor="white",
            markeredgewidth=0.5,
            zorder=3,
        )
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
    _legend_right(fig, handles, "method")
    return fig


def _loss(data, palette, *, title, eps=None, dtype=""):
    series = palette.sort(data["series"])
    labels = {s: f"{s} P={int(data.loc[data['series'] == s, 'P'].iloc[0])}" for s in series}
    legend_w = _legend_width(list(labels.values()))
    fig, axes = _grid(["loss"], ["loss", "diff"], legend_w, title, sharey=False, panel_w=3.0, panel_h=2.3, left=0.75)
    ax_l, ax_d = axes[0]
    handles = []
    every = max(1, int(data["step"].max()) // 8)
    for k, s in enumerate(series):
        pts = data[data["series"] == s]
        st = palette.style(s)
        if pts["baseline"].iloc[0]:
            (h,) = ax_l.plot(pts["step"], pts["loss"], color="black", lw=2.6, alpha=0.3, label=labels[s], zorder=1)
            handles.append(h)
            continue
        ax_l.plot(pts["step"], pts["loss"], color=st.colour, lw=1.0, linestyle=st.linestyle, zorder=2)
        # markers of different series at different steps: curves that coincide still show every marker
        ax_d.plot(
            pts["step"],
            pts["diff"],
            color=st.colour,
            marker=st.marker,
            markevery=(k % every, every),
            ms=4,
            lw=1.0,
            linestyle=st.linestyle,
            zorder=2,
        )
        handles.append(Line2D([], [], color=st.colour, marker=st.marker, linestyle=st.linestyle, label=labels[s]))
    diffs = data["diff"].to_numpy(dtype=float)
    diffs = diffs[np.isfinite(diffs) & (diffs > 0)]
    if len(diffs):
        lo, hi = diffs.min(), diffs.max()
        if eps is not None:
            ax_d.axhline(eps, ls=":", color="grey", lw=1)
            ax_d.annotate(
                f"{dtype} machine epsilon",
                (0.02, eps),
                xycoords=("axes fraction", "data"),
                xytext=(0, 3),
                textcoords="offset points",
                fontsize=7,
                color="grey",
            )
            lo, hi = min(lo, eps), max(hi, eps)
        _readable_log(ax_d, lo, hi, "y")
    ax_l.set(xlabel="training step", ylabel="training loss (nats per byte)", title="training loss")
    ax_d.set(
        xlabel="training step",
        ylabel="max so far of |loss - baseline| / baseline",
        title="difference to the single-device baseline",
    )
    _title(fig, title, fig.get_figheight())
    _legend_right(fig, handles, "method")
    return fig


_DRAWERS: dict[str, Callable] = {"points": _points, "bars": _bars, "split": _split, "scatter": _scatter, "loss": _loss}
