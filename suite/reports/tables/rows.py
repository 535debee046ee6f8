"""Which rows a report's tables and figures read, and what they derive from them: the *series*
each row belongs to, the measured rows, the attention and model-level rows, timed samples,
throughput and percent of ideal, speedups with their intervals, simulated/measured pairs.

Every table keys its rows by *series*: the method, its non-default options, and, when the rows
come from more than one executor (dist, threads, sim) or machine, the executor and hardware too,
so a measured and a simulated number never share a row or a column unlabelled. Simulated rows
always say `[sim:<topology>]` and virtual-rank rows `[threads]`, even alone in a report.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd

from suite import metrics as M
from suite.reports.style import is_cpu

# The problem's columns, in one list: a comparable point is the problem (less its mask) on a
# machine and world size (everything but the method); `PROBLEM` adds the mask.
_SHAPE = ["batch", "seq_len", "heads", "kv_heads", "head_dim", "head_dim_v", "softcap", "sinks", "dtype", "causal"]
_SHAPE += ["pass", "workload"] + [c for c in M.VARIANT_IDENTITY if c not in _SHAPE]  # axes added since


POINT = ["hardware", "executor", "world_size", *_SHAPE]


PROBLEM = [*_SHAPE, "mask_name"]


_OPTION_LABELS = {"ulysses_degree": "U", "ranks_per_node": "per-node"}


def point_columns(m: pd.DataFrame) -> dict[str, pd.Series]:
    """The columns that name a measured point in a table, in their order: the series (method), the
    problem's shape, P, the mask, the pass and the length."""
    return {
        "series": m["series"],
        "shape": m["shape"],
        "P": m["world_size"],
        "mask": m["mask"],
        "pass": m["pass"],
        "seq_len": m["seq_len"],
    }


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
            **point_columns(m),
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


SIM_PAIR = ["method", "options", "world_size", *PROBLEM]  # one trial, measured and simulated


def sim_pairs(df: pd.DataFrame) -> pd.DataFrame:
    """Measured (executor dist) rows joined with the simulator's rows of the same trial, columns
    suffixed _dist and _sim; empty unless both exist."""
    m = measured(df)
    if m.empty or not {"sim", "dist"} <= set(m["executor"]):
        return pd.DataFrame()
    return m[m["executor"] == "dist"].merge(m[m["executor"] == "sim"], on=SIM_PAIR, suffixes=("_dist", "_sim"))
