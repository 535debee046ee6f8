"""The table model: a column's spec (header, number kind) and a table (flat rows at full precision,
its caption); the cells as text, which every renderer (Markdown, LaTeX, HTML) writes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import pandas as pd

from suite.reports.style import rank_word


@dataclass(frozen=True)
class Col:
    """How one column is shown. kind: text | int | num (3 significant digits) | sci (errors, 2
    significant digits in e-notation) | pct | ratio (2 decimals) | precise (as many digits as the
    smallest difference between the column's values needs; columns of one `group` share them)."""

    header: str
    kind: str = "num"
    const: str = ""  # part of a point's identity: a column with one value in every row is
    group: str = ""  # left out of the shown table and named in the caption with this format


@dataclass
class Table:
    name: str  # file stem
    title: str
    data: pd.DataFrame  # flat rows, machine column names, full precision (written as the CSV)
    cols: dict[str, Col]  # shown columns, in order
    what: str = ""  # what a cell holds, for the caption
    section: str = ""  # where the HTML page puts it
    html: bool = True  # shown on the HTML page (else in the files only)
    source: str = ""  # the sweeps, machines and executors the rows come from
    fixed: list[str] = field(default_factory=list)  # what every row shares, known when built
    constants: list[str] = field(default_factory=list)  # ... and found by `shown`
    _formatted: Optional[tuple] = field(default=None, repr=False, compare=False)  # `formatted`'s, for this data

    @property
    def empty(self) -> bool:
        return self.data.empty

    def shown(self) -> tuple[pd.DataFrame, dict[str, Col]]:
        """The columns to print: identity columns with one value everywhere go to the caption."""
        cols, self.constants = {}, []
        for name, col in self.cols.items():
            values = self.data[name].dropna().unique() if name in self.data else []
            if col.const and len(values) == 1 and len(self.data) > 1:
                self.constants.append(col.const.format(values[0]))
                continue
            cols[name] = col
        return self.data[[c for c in cols if c in self.data]], cols

    def caption(self) -> str:
        self.shown()
        parts = [f"{self.title}."]
        if self.what:
            parts.append(self.what.rstrip(".") + ".")
        if self.fixed + self.constants:
            parts.append("All rows: " + ", ".join(self.fixed + self.constants) + ".")
        if self.source:
            parts.append(self.source.rstrip(".") + ".")
        return " ".join(parts)


def _source(df: pd.DataFrame) -> str:
    """ "Sweep quickstart; cpu:Intel(R) Xeon(R) Processor; executor dist"."""
    sweeps = ", ".join(dict.fromkeys(df["sweep"].dropna())) if "sweep" in df else ""
    hw = ", ".join(dict.fromkeys(df["hardware"].dropna().astype(str)))
    ex = ", ".join(dict.fromkeys(df["executor"].dropna().astype(str)))
    parts = [
        f"Sweep{'s' if ',' in sweeps else ''} {sweeps}" if sweeps else "",
        hw,
        f"executor{'s' if ',' in ex else ''} {ex}" if ex else "",
    ]
    return "; ".join(p for p in parts if p)


def _shape_cols(kind_p: str) -> dict[str, Col]:
    return {
        "shape": Col("Shape", "text", const="{}"),
        "P": Col(kind_p, "int", const="P = {}"),
        "mask": Col("Mask", "text", const="{} mask"),
        "pass": Col("Pass", "text", const="pass {}"),
    }


def _p_header(df: pd.DataFrame) -> str:
    return {"GPU": "GPUs", "CPU rank": "CPU ranks"}.get(rank_word(df), "Ranks")


def _clean_exp(text: str) -> str:
    """'1.20e+05' -> '1.20e5', '9.5e-07' -> '9.5e-7' (siunitx and readers parse both)."""
    mant, _, exp = text.partition("e")
    return f"{mant}e{int(exp)}" if exp else mant


def _sig(v: float, digits: int = 3) -> str:
    """`digits` significant digits in plain notation between 1e-3 and 1e6, e-notation outside."""
    if v == 0:
        return "0"
    if not math.isfinite(v):
        return str(v)
    mag = math.floor(math.log10(abs(v)))
    if -3 <= mag < 6:
        return f"{v:.{max(0, digits - 1 - mag)}f}"
    return _clean_exp(f"{v:.{digits - 1}e}")


def _sci(v: float) -> str:
    if v == 0:
        return "0"
    return _clean_exp(f"{v:.1e}") if v is not None and math.isfinite(v) else str(v)


def precise_digits(values) -> int:
    """Significant digits that tell the closest two distinct values apart (one digit beyond the
    first that differs), between 4 and 10."""
    vals = sorted({float(v) for v in values if v is not None and isinstance(v, (int, float)) and math.isfinite(v)})
    rel = [abs(b - a) / max(abs(a), abs(b)) for a, b in zip(vals, vals[1:]) if max(abs(a), abs(b)) > 0]
    if not rel:
        return 6
    return int(min(10, max(4, math.ceil(-math.log10(min(rel))) + 1)))


def format_column(values: pd.Series, col: Col, digits: int | None = None) -> list[str]:
    """Cells of one column as text (numbers by the column's kind; strings as they are)."""
    out = []
    if col.kind == "precise" and not digits:
        digits = precise_digits(values)  # once per column: per cell it was quadratic in the rows
    for v in values:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            out.append("")
        elif isinstance(v, str) or col.kind in ("text", "textnum"):
            out.append(str(v))
        elif isinstance(v, bool):
            out.append(str(v))
        elif col.kind == "int":
            out.append(str(int(v)))
        elif col.kind == "sci":
            out.append(_sci(float(v)))
        elif col.kind == "pct":
            out.append(f"{v:.0f}")
        elif col.kind == "ratio":
            out.append(f"{v:.2f}")
        elif col.kind == "precise":
            assert digits is not None  # set above for a precise column
            out.append(_sig(float(v), digits))
        else:
            out.append(_sig(float(v)))
    return out


def formatted(table: Table) -> tuple[pd.DataFrame, dict[str, Col]]:
    """The shown columns of `table` as text, ready for any renderer (formatted once per table: the
    Markdown, LaTeX and HTML renderers each ask)."""
    cached = table._formatted
    if cached is not None and cached[0] is table.data:
        return cached[1], cached[2]
    data, cols = table.shown()
    groups: dict[str, int] = {}
    for name, col in cols.items():
        if col.kind == "precise" and col.group:
            vals = [v for n, c in cols.items() if c.group == col.group for v in data[n]]
            groups[col.group] = precise_digits(vals)
    text = pd.DataFrame(
        {name: format_column(data[name], col, groups.get(col.group)) for name, col in cols.items()}, index=data.index
    )
    table._formatted = (table.data, text, cols)
    return text, cols
