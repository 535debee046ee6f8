"""Paper-style tables from result rows: flat pandas frames with a column spec (header, unit, number
kind) and a caption drawn from the sweep; `render` writes them as Markdown, LaTeX and HTML, CSV
keeps every column at full precision.

Every table keys its rows by *series*: the method, its non-default options, and, when the rows
come from more than one executor (dist, threads, sim) or machine, the executor and hardware too,
so a measured and a simulated number never share a row or a column unlabelled. Simulated rows
always say `[sim:<topology>]` and virtual-rank rows `[threads]`, even alone in a report.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pandas as pd

from suite import metrics as M
from suite.metrics import method_label
from suite.reports.style import flop_unit, is_cpu, rank_word

# The problem's columns, in one list: a comparable point is the problem (less its mask) on a
# machine and world size (everything but the method); `PROBLEM` adds the mask.
_SHAPE = ["batch", "seq_len", "heads", "kv_heads", "head_dim", "head_dim_v", "softcap", "sinks", "dtype", "causal"]
_SHAPE += ["pass", "workload"] + [c for c in M.VARIANT_IDENTITY if c not in _SHAPE]  # axes added since
POINT = ["hardware", "executor", "world_size", *_SHAPE]
PROBLEM = [*_SHAPE, "mask_name"]

_OPTION_LABELS = {"ulysses_degree": "U", "ranks_per_node": "per-node"}


def series_label(row: pd.Series, many_executors: bool, many_hardware: bool) -> str:
    label = str(row["method"])
    opts = _options(row.get("options"))
    shown = {k: v for k, v in opts.items() if v not in (None, 0, "auto")}
    if shown:
        label += "(" + ",".join(f"{_OPTION_LABELS.get(k, k)}={v}" for k, v in sorted(shown.items())) + ")"
    if row["executor"] == "sim":  # a prediction always says so, and on which topology model
        return label + f" [sim:{row['topology']}]"
    if many_executors or row["executor"] == "threads":  # virtual-rank timings are never hardware figures
        label += f" [{row['executor']}]"
    if many_hardware:
        label += f" @{row['hardware']}"
    return label


def _options(text) -> dict:
    if not isinstance(text, str) or not text:
        return {}
    try:
        return json.loads(text)
    except ValueError:
        return {}


def with_series(df: pd.DataFrame) -> pd.DataFrame:
    """Add the `series` column (see the module docstring)."""
    df = df.copy()
    if df.empty:
        df["series"] = []
        return df
    # the perplexity check's single-device baseline (executor local) is no second kind of timing
    many_exec = df.loc[df["executor"] != "local", "executor"].nunique(dropna=True) > 1
    many_hw = df["hardware"].nunique(dropna=True) > 1
    # rows as dicts: apply(axis=1) builds a Series per row (seconds at 10,000 rows)
    df["series"] = [series_label(r, many_exec, many_hw) for r in df.to_dict("records")]
    return df


def measured(df: pd.DataFrame) -> pd.DataFrame:
    """Rows with a time: status ok (checked or not) or incorrect (still a measured time)."""
    return df[df[M.STATUS].isin([M.OK, M.INCORRECT]) & df[M.TIME_MS_MEDIAN].notna()]


TRAIN = "train"  # the pass of model-level (perplexity) rows

# A measured row whose slowest timed repeat took more than this times its median is flagged: one
# repeat that slow says something else ran on the machine, not that the method is that variable.
# The same threshold as the sweep's console summary (metrics.NOISY_SPREAD).
BUSY_SPREAD = M.NOISY_SPREAD
BUSY_NOTE = (
    f"* slowest timed repeat over {BUSY_SPREAD:g}x the median: the machine may have been busy while this "
    "trial was timed; rerun it before trusting it"
)
# Percentiles of the per-sample speedups (every baseline sample over every method sample) a speedup's
# interval spans: the middle half, which says how stable the ratio is; min/max over max/min would
# span the two worst outliers (0.3-8x for a speedup of 1.2).
SPEEDUP_INTERVAL = (25, 75)


def busy(rows: pd.DataFrame) -> pd.Series:
    """Measured (not simulated) rows whose max time exceeds BUSY_SPREAD x their median."""
    if rows.empty or M.TIME_MS_MAX not in rows:
        return pd.Series(False, index=rows.index, dtype=bool)
    t_max = pd.to_numeric(rows[M.TIME_MS_MAX], errors="coerce")
    med = pd.to_numeric(rows[M.TIME_MS_MEDIAN], errors="coerce")
    return ((rows["executor"] != "sim") & (t_max > BUSY_SPREAD * med)).fillna(False).astype(bool)


def samples(row) -> np.ndarray:
    """A row's timed samples (ms); its median alone where none were stored (simulated rows)."""
    s = row.get(M.TIME_MS_SAMPLES)
    if isinstance(s, str):
        s = json.loads(s)
    if s is None or len(s) == 0:
        s = [row[M.TIME_MS_MEDIAN]]
    return np.asarray(s, dtype=float)


def attention_rows(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["pass"] != TRAIN] if not df.empty else df


def perplexity_rows(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["pass"] == TRAIN] if not df.empty else df


# -- the table model ---------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------
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


def throughput_rows(df: pd.DataFrame) -> pd.DataFrame:
    """One row per measured point: time (median, min, max), rate per rank, tokens/s and percent of
    ideal. Ideal (ring-flash-attn's README convention: "theoretic flash_attn / P"): the
    single-device `reference` time of the same problem on the same hardware and executor, divided
    by the world size; empty when no reference row exists for the problem."""
    m = measured(df)
    if m.empty:
        return pd.DataFrame()
    out = pd.DataFrame(
        {
            "series": m["series"],
            "shape": m["shape"],
            "P": m["world_size"],
            "mask": m["mask"],
            "pass": m["pass"],
            "seq_len": m["seq_len"],
            "time_ms": m[M.TIME_MS_MEDIAN],
            "time_ms_min": m[M.TIME_MS_MIN],
            "time_ms_max": m[M.TIME_MS_MAX],
            # numeric: a row with a time but no rate (None, an object column) is NaN, not a TypeError later
            "tflops_per_gpu": pd.to_numeric(m[M.TFLOPS_PER_GPU], errors="coerce"),
            "tokens_per_s": pd.to_numeric(m[M.TOKENS_PER_S], errors="coerce"),
            "pct_of_ideal": throughput_pct(df),
            "sim_error_pct": pd.to_numeric(m[M.SIM_ERROR_PCT], errors="coerce"),
            "busy": busy(m),
            "executor": m["executor"],
        }
    )
    return out.sort_values(["shape", "mask", "pass", "P", "seq_len", "series"]).reset_index(drop=True)


def sim_note(rows: pd.DataFrame) -> str:
    """What a table's simulated rows are ("" without any): predictions with their band, where the
    rows carry one; never timed repeats."""
    sim = rows[rows["executor"] == "sim"] if not rows.empty else rows
    if sim.empty:
        return ""
    if M.SIM_ERROR_PCT in sim:  # a band, or "unvalidated" where the row's family has none
        return SIM_BAND_NOTE
    return "simulated rows (executor sim) are the simulator's predictions, not timed repeats"


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


def speedup_rows(df: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """Speedup over `baseline` per measured ok row (baseline median time / series median time, same
    hardware, executor and problem), with an interval from the timed samples: the SPEEDUP_INTERVAL
    percentiles of every baseline sample over every sample of the row (the two runs are not
    paired, so every pair is a possible ratio)."""
    m = measured(df)
    m = m[m[M.STATUS] == M.OK]  # a wrong answer has no speed worth comparing
    if m.empty or baseline not in set(m["method"]):
        return pd.DataFrame()

    def point(r) -> tuple:  # NaN is not equal to itself: a missing value keys as None
        return tuple(None if _missing(r[c]) else r[c] for c in POINT)

    base_ms: dict[tuple, list] = {}
    base_samples: dict[tuple, list] = {}
    rows = m[[*POINT, "method", M.TIME_MS_MEDIAN, M.TIME_MS_SAMPLES]].to_dict("records")  # iterrows: 17 s at 10k rows
    for r in rows:
        if r["method"] == baseline:
            base_ms.setdefault(point(r), []).append(r[M.TIME_MS_MEDIAN])
            base_samples.setdefault(point(r), []).append(samples(r))
    speed, lo, hi = [], [], []
    for r in rows:
        k = point(r)
        if k not in base_ms:
            speed.append(math.nan)
            lo.append(math.nan)
            hi.append(math.nan)
            continue
        ratios = np.divide.outer(np.concatenate(base_samples[k]), samples(r)).ravel()
        q_lo, q_hi = percentiles(ratios, SPEEDUP_INTERVAL)
        speed.append(float(np.median(base_ms[k])) / r[M.TIME_MS_MEDIAN])
        lo.append(q_lo)
        hi.append(q_hi)
    out = m.assign(speedup=speed, speedup_lo=lo, speedup_hi=hi, P=m["world_size"])
    return out.dropna(subset=["speedup"])


def _missing(v) -> bool:
    return pd.api.types.is_scalar(v) and bool(pd.isna(v))


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
            "series": m["series"],
            "shape": m["shape"],
            "P": m["world_size"],
            "mask": m["mask"],
            "pass": m["pass"],
            "seq_len": m["seq_len"],
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


def perplexity(df: pd.DataFrame) -> Table:
    """Model-level check: final validation perplexity per method against the single-device baseline,
    the largest per-step relative loss difference, and the time per training step."""
    t = perplexity_rows(df)
    title = "Model-level check"
    if t.empty:
        return Table("perplexity", title, pd.DataFrame(), {})
    data = pd.DataFrame(
        {
            "shape": t["shape"],
            "S": t["seq_len"],
            "series": t["series"],
            "P": t["world_size"],
            "status": t[M.STATUS],
            "perplexity": t[M.PPL],
            "baseline perplexity": t[M.PPL_BASELINE],
            "perplexity rel. diff": t[M.PPL_REL_DIFF],
            "max loss rel. diff": t[M.LOSS_MAX_REL_DIFF],
            "final train loss": t[M.LOSS_CURVE].map(lambda c: float(c[-1]) if c is not None and len(c) else math.nan),
            "ms per step": t[M.TIME_MS_MEDIAN],
            "MiB sent per step": t[M.BYTES_SENT] / 2**20,
            "_order": t["method"] != "baseline",  # the baseline first
        }
    )
    data = data.sort_values(["shape", "S", "_order", "P", "series"]).drop(columns="_order").reset_index(drop=True)
    word = rank_word(t[t["world_size"] > 1]) if (t["world_size"] > 1).any() else "rank"
    cols = {
        "shape": Col("Shape", "text", const="{}"),
        "S": Col("S (tokens)", "int", const="S = {}"),
        "series": Col("Method", "text"),
        "P": Col("P", "int"),
        "status": Col("Status", "text"),
        "perplexity": Col("Perplexity", "precise", group="ppl"),
        "baseline perplexity": Col("Baseline perplexity", "precise", group="ppl"),
        "perplexity rel. diff": Col("Perplexity rel. diff.", "sci"),
        "max loss rel. diff": Col("Max loss rel. diff.", "sci"),
        "final train loss": Col("Final train loss", "precise"),
        "ms per step": Col("Time per step (ms)"),
        "MiB sent per step": Col(f"Sent per {word} per step (MiB)"),
    }
    what = (
        "Validation perplexity after training with each method against the same model trained on one device; "
        "rel. diff. = perplexity / baseline - 1; max loss rel. diff. = largest per-step |loss - baseline| / "
        "baseline. Digits are shown down to the smallest difference between methods"
    )
    return Table("perplexity", title, data, cols, what=what, section="perplexity", source=_source(t))


SIM_PAIR = ["method", "options", "world_size", *PROBLEM]  # one trial, measured and simulated


def sim_pairs(df: pd.DataFrame) -> pd.DataFrame:
    """Measured (executor dist) rows joined with the simulator's rows of the same trial, columns
    suffixed _dist and _sim; empty unless both exist."""
    m = measured(df)
    if m.empty or not {"sim", "dist"} <= set(m["executor"]):
        return pd.DataFrame()
    return m[m["executor"] == "dist"].merge(m[m["executor"] == "sim"], on=SIM_PAIR, suffixes=("_dist", "_sim"))


def sim_vs_measured(df: pd.DataFrame) -> Table:
    """Each measured (executor dist) time beside the simulator's prediction of the same trial, with
    the relative error (predicted / measured - 1) and the topology it was predicted on."""
    pair = sim_pairs(df)
    title = "Simulated vs measured"
    if pair.empty:
        return Table("sim_vs_measured", title, pd.DataFrame(), {})
    data = pd.DataFrame(
        {
            "method": [method_label(r["method"], _options(r["options"])) for _, r in pair.iterrows()],
            "P": pair["world_size"],
            "S": pair["seq_len"],
            "B": pair["batch"],
            "mask": pair["mask_dist"],
            "pass": pair["pass"],
            "measured on": pair["hardware_dist"],
            "predicted on": pair["topology_sim"],
            "measured ms": pair[f"{M.TIME_MS_MEDIAN}_dist"],
            "predicted ms": pair[f"{M.TIME_MS_MEDIAN}_sim"],
        }
    )
    data["error %"] = 100 * (data["predicted ms"] / data["measured ms"] - 1)
    data = data.sort_values(["P", "method", "mask", "pass"]).reset_index(drop=True)
    cols = {
        "method": Col("Method", "text"),
        "P": Col("P", "int", const="P = {}"),
        "S": Col("S (tokens)", "int", const="S = {}"),
        "B": Col("B", "int", const="B = {}"),
        "mask": Col("Mask", "text", const="{} mask"),
        "pass": Col("Pass", "text", const="pass {}"),
        "measured on": Col("Measured on", "text", const="measured on {}"),
        "predicted on": Col("Predicted on", "text", const="predicted on {}"),
        "measured ms": Col("Measured (ms)"),
        "predicted ms": Col("Predicted (ms)"),
        "error %": Col("Error (%)", "pct"),
    }
    what = "Median measured time (executor dist) beside the simulator's prediction of the same trial"
    return Table("sim_vs_measured", title, data, cols, what=what, section="sim", source=_source(df))


def balance(df: pd.DataFrame) -> Table:
    """Load balance per point: the visible (query, key) pairs the busiest rank's kernels compute
    over the mean rank's, the measured kernel-time spread, padding and documents per sequence."""
    m = measured(df).dropna(subset=[M.IMBALANCE]) if not df.empty else df
    title = "Load balance"
    if m.empty or (m[M.IMBALANCE] == 1).all():
        return Table("balance", title, pd.DataFrame(), {})
    data = pd.DataFrame(
        {
            "series": m["series"],
            "shape": m["shape"],
            "P": m["world_size"],
            "mask": m["mask"],
            "pass": m["pass"],
            "seq_len": m["seq_len"],
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


def _nan_none(key) -> tuple:
    key = key if isinstance(key, tuple) else (key,)
    return tuple(None if isinstance(v, float) and math.isnan(v) else v for v in key)


def percentiles(values, qs) -> list[float]:
    """np.percentile's default (linear) percentiles of a few values, without its per-call overhead
    (about 0.2 ms: seconds over the 10,000 rows of a large report)."""
    a = sorted(float(v) for v in values)
    n, out = len(a), []
    for q in qs:
        pos = q / 100 * (n - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, n - 1)
        out.append(a[lo] + (a[hi] - a[lo]) * (pos - lo))
    return out


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


def throughput_pct(df: pd.DataFrame) -> pd.Series:
    """Percent of ideal of every measured row, indexed like `measured(df)`; NaN on CPU rows
    (CPU_IDEAL_NOTE) and where no reference row of the problem exists."""
    m = measured(df)
    ref = m[(m["method"] == "reference") & (m["world_size"] == 1)]
    ref = ref.groupby(["hardware", "executor"] + PROBLEM, dropna=False)[M.TIME_MS_MEDIAN].median()
    # a dict, not Series.get per row (about 0.3 ms each: seconds at 10,000 rows); NaN keys as None,
    # since NaN is not equal to itself
    lookup = {_nan_none(k): v for k, v in ref.items()}
    key = zip(*(m[c] for c in ["hardware", "executor"] + PROBLEM))
    ref_ms = pd.Series([lookup.get(_nan_none(k)) for k in key], index=m.index, dtype="float64")
    pct = 100 * (ref_ms / m["world_size"]) / m[M.TIME_MS_MEDIAN]
    return pct.mask(m["hardware"].map(is_cpu).astype(bool))


def build_tables(df: pd.DataFrame, baseline: str) -> dict[str, Table]:
    """All tables of a report, by file stem (empty ones are left out by the writer). Attention
    tables use the attention rows; the perplexity table the model-level rows."""
    att = attention_rows(df)
    tables = [
        status_counts(df),
        correctness_matrix(att),
        throughput(att),
        throughput_pivot(att),
        speedup(att, baseline),
        communication(att),
        balance(att),
        packed_vs_uniform(att),
        mask_families(att),
        memory(att),
        perplexity(df),
        sim_vs_measured(att),
        problems(df),
    ]
    return {t.name: t for t in tables}


# -- numbers -----------------------------------------------------------------------------------------
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
