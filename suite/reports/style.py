"""One look for every figure of a report: the palette, markers and line styles of its series, the
device words of its labels (GPU or CPU rank), and the matplotlib settings camera-ready checks ask for.

The palette is derived from the report's own rows (no list of method names lives here):
single-device baselines (methods that only ever ran on one rank) in greys, every other method a
colour derived from its name, so that a method keeps its colour in every report whatever other
methods it has (`method_colour`: the first colour not yet taken in an order of the fixed sequence
seeded by the name; two methods whose names pick the same colour first keep it apart by the
alphabet, so only then does a colour depend on the other methods present). The fixed sequence is
chosen so that any two colours differ clearly (CIE L*a*b* distance >= 25 for the first 12, > 15
for all, checked by a test). Variants of a method (options, executors, machines) are shades of
its colour; the executor is also the line style. Build the palette once per report and hand it to
every figure, so a series looks the same everywhere.
"""

from __future__ import annotations

import colorsys
import hashlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AbstractSet, Any

import pandas as pd

if TYPE_CHECKING:  # matplotlib is imported where figures are drawn, not here
    from matplotlib.typing import LineStyleType, RcKeyType

# Colour sequence (Okabe-Ito first, then further hues), ordered so that any prefix stays distinct.
COLOURS = (
    "#0072B2",
    "#E69F00",
    "#009E73",
    "#CC79A7",
    "#D55E00",
    "#56B4E9",
    "#6A3D9A",
    "#9A9A00",
    "#8C564B",
    "#B2182B",
    "#17BECF",
    "#1B5E20",
    "#E7298A",
    "#1F2D86",
    "#9E9AC8",
    "#D2B48C",
)
GREYS = ("#000000", "#6E6E6E", "#A0A0A0")
# Filled markers only: an open marker and a filled one in the same legend read as two styles of one series.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h", "<", ">", "p", "d", "H", "8")
LINESTYLES: dict[str, LineStyleType] = {"dist": "-", "local": "-", "threads": ":", "sim": "--"}

# matplotlib settings of every figure. Type 42 (TrueType) fonts in PDF and PS: camera-ready checks
# (IEEE PDF eXpress, ACM) reject the Type 3 bitmap-like fonts matplotlib embeds by default.
RC: dict[RcKeyType, Any] = {
    "pdf.fonttype": 42,
    "ps.fonttype": 42,
    "svg.fonttype": "none",
    "font.family": "DejaVu Sans",
    "font.size": 10.0,
    "axes.titlesize": 10.0,
    "axes.labelsize": 10.0,
    "xtick.labelsize": 9.0,
    "ytick.labelsize": 9.0,
    "legend.fontsize": 9.0,
    "legend.title_fontsize": 9.0,
    "figure.titlesize": 11.0,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.35,
    "grid.linewidth": 0.6,
    "axes.axisbelow": True,
    "lines.linewidth": 1.3,
    "lines.markersize": 5.0,
    "errorbar.capsize": 2.0,
    "legend.frameon": False,
    "savefig.dpi": 150,
    "pdf.compression": 6,
    "path.simplify": True,
    # titles at a fixed height: the default (None) measures every axis' tick labels on each draw to
    # lift titles over top ticks these figures do not have, a tenth of the drawing time
    "axes.titley": 1.0,
    "axes.titlepad": 5.0,
}
DPI = 150  # PNG resolution; the HTML page shows figures at their size in inches x 96 CSS pixels


@dataclass(frozen=True)
class Style:
    """How one series is drawn."""

    colour: str
    marker: str
    linestyle: LineStyleType


@dataclass
class Palette:
    """Styles of every series of a report, and the order legends list them in."""

    methods: list[str]  # method order (single-device baselines first)
    order: list[str]  # series order: by method, then by label
    styles: dict[str, Style] = field(default_factory=dict)
    method_colours: dict[str, str] = field(default_factory=dict)

    def style(self, series: str) -> Style:
        return self.styles[series]

    def sort(self, series) -> list[str]:
        """`series` in legend order (unknown ones last, by name)."""
        rank = {s: i for i, s in enumerate(self.order)}
        return sorted(set(series), key=lambda s: (rank.get(s, len(rank)), s))


def palette_for(df: pd.DataFrame) -> Palette:
    """The palette of a report from all its rows (columns `method`, `series`, `executor`, `world_size`)."""
    if df.empty:
        return Palette([], [])
    first = df.drop_duplicates("series")
    single = set(df.groupby("method")["world_size"].max().loc[lambda s: s <= 1].index)
    methods = sorted(df["method"].dropna().unique(), key=lambda m: (m not in single, m))
    colours, n_single = {}, 0
    for m in methods:
        if m in single:
            colours[m] = GREYS[n_single % len(GREYS)]
            n_single += 1
        else:
            colours[m] = method_colour(m, set(colours.values()))
    markers = {m: MARKERS[i % len(MARKERS)] for i, m in enumerate(methods)}
    order, styles = [], {}
    executor = dict(zip(first["series"], first["executor"]))
    for m in methods:
        variants = sorted(first.loc[first["method"] == m, "series"])
        for s, shade in zip(variants, shades(colours[m], len(variants))):
            styles[s] = Style(shade, markers[m], LINESTYLES.get(executor.get(s) or "", "-"))
            order.append(s)
    return Palette(methods, order, styles, colours)


def method_colour(name: str, taken: AbstractSet[str] = frozenset()) -> str:
    """The colour of method `name`: the first of COLOURS, in an order seeded by the name, that is not
    in `taken` (the colours of the report's methods before it in the alphabet). A stable hash
    (blake2b, not Python's per-process `hash`), so the colour is the same in every run and report."""

    def weight(c: str) -> bytes:
        return hashlib.blake2b(f"{name}|{c}".encode(), digest_size=8).digest()

    for c in sorted(COLOURS, key=weight):
        if c not in taken:
            return c
    k = 0  # more methods than fixed colours: generated hues, the first free one
    while colour(len(COLOURS) + k) in taken:
        k += 1
    return colour(len(COLOURS) + k)


def colour(i: int) -> str:
    """The i-th method colour; past the fixed sequence, evenly spaced hues at two lightnesses."""
    if i < len(COLOURS):
        return COLOURS[i]
    j = i - len(COLOURS)
    hue = (j * 0.618033988749895) % 1.0  # golden-ratio steps never repeat a hue
    r, g, b = colorsys.hls_to_rgb(hue, 0.35 if j % 2 else 0.55, 0.75)
    return _hex((r, g, b))


def shades(hex_colour: str, n: int) -> list[str]:
    """n shades of one colour: the colour itself first, then lighter and darker ones in turn."""
    rgb = _rgb(hex_colour)
    steps = [0.0, 0.45, -0.35, 0.7, -0.55, 0.25, -0.2, 0.85]
    out = []
    for k in range(n):
        t = steps[k] if k < len(steps) else (k / n if k % 2 else -k / (2 * n))
        out.append(_hex(tuple(c * (1 + t) if t < 0 else c + (1 - c) * t for c in rgb)))
    return out


def delta_e(a: str, b: str) -> float:
    """CIE76 colour difference of two hex colours (about 2.3 is just noticeable)."""
    return math.dist(_lab(a), _lab(b))


def _rgb(h: str) -> tuple[float, float, float]:
    r, g, b = (int(h[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return r, g, b


def _hex(rgb) -> str:
    return "#" + "".join(f"{round(min(max(c, 0.0), 1.0) * 255):02X}" for c in rgb)


def _lab(h: str) -> tuple[float, float, float]:
    def linear(c):
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = map(linear, _rgb(h))
    x = (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047
    y = 0.2126 * r + 0.7152 * g + 0.0722 * b
    z = (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883

    def f(t):
        return t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


# -- device words ------------------------------------------------------------------------------------
def is_cpu(hardware) -> bool:
    return isinstance(hardware, str) and hardware.startswith("cpu")


def rank_word(df: pd.DataFrame, plural: bool = False) -> str:
    """ "GPU" when every row ran (or was predicted) on GPUs, "CPU rank" when every row ran on CPU
    processes, "rank" for a mix; so a CPU run never reads as GPU performance."""
    hw = df["hardware"].dropna().unique() if "hardware" in df else []
    cpu = [is_cpu(h) for h in hw]
    word = "CPU rank" if cpu and all(cpu) else "GPU" if cpu and not any(cpu) else "rank"
    return word + ("s" if plural else "")


def ranks_label(df: pd.DataFrame) -> str:
    """Axis label of the world size."""
    word = rank_word(df, plural=True)
    return {"GPUs": "GPUs (P)", "CPU ranks": "ranks (P CPU processes)"}.get(word, "ranks (P)")


@dataclass(frozen=True)
class FlopUnit:
    """The unit of attention throughput for a set of rows: TFLOP/s for GPUs (and mixes), GFLOP/s
    where every row ran on CPU processes (a CPU rank reaches tens of GFLOP/s: in TFLOP/s its ticks
    read 0.0175). Stored rows hold TFLOP/s (`tflops_per_gpu`); `scale` converts them."""

    label: str  # "TFLOP/s" or "GFLOP/s"
    scale: float  # shown value = stored TFLOP/s x scale
    column: str  # the column name of the shown value in a table's CSV


def flop_unit(df: pd.DataFrame) -> FlopUnit:
    """The one place that chooses the throughput unit, from the rows' hardware (as `rank_word`)."""
    if rank_word(df) == "CPU rank":
        return FlopUnit("GFLOP/s", 1e3, "gflops_per_rank")
    return FlopUnit("TFLOP/s", 1.0, "tflops_per_gpu")
