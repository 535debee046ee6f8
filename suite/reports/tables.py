"""Paper-style tables from result rows (pandas in, pandas out; rendering in `render`).

Every table keys its rows by *series*: the method, its non-default options, and, when the rows
come from more than one executor (dist, threads, sim) or machine, the executor and hardware too,
so a measured and a simulated number never share a row or a column unlabelled. Simulated rows
always say `[sim:<topology>]` and virtual-rank rows `[threads]`, even alone in a report.
"""
from __future__ import annotations

import json
import math

import pandas as pd

from suite import metrics as M
from suite.metrics import method_label

# Columns that, with the series, identify a comparable point (everything but the method).
POINT = ["hardware", "executor", "world_size", "batch", "seq_len", "heads", "kv_heads", "head_dim", "dtype",
         "causal", "pass"]
PROBLEM = ["batch", "seq_len", "heads", "kv_heads", "head_dim", "dtype", "causal", "pass"]

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
    many_exec = df["executor"].nunique(dropna=True) > 1
    many_hw = df["hardware"].nunique(dropna=True) > 1
    df["series"] = df.apply(lambda r: series_label(r, many_exec, many_hw), axis=1)
    return df


def measured(df: pd.DataFrame) -> pd.DataFrame:
    """Rows with a time: status ok (checked or not) or incorrect (still a measured time)."""
    return df[df[M.STATUS].isin([M.OK, M.INCORRECT]) & df[M.TIME_MS_MEDIAN].notna()]


def _fmt_err(v) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1e}"


# ---------------------------------------------------------------------------------------------------
def correctness_matrix(df: pd.DataFrame) -> pd.DataFrame:
    """Series x world size (rows) by problem (columns): status and the largest error of the row."""
    if df.empty:
        return pd.DataFrame()
    err_cols = list(M.ERR.values())

    def cell(r) -> str:
        status = r[M.STATUS]
        errs = [r[c] for c in err_cols if r.get(c) is not None and not pd.isna(r[c])]
        worst = max(errs) if errs else None
        if status == M.OK:
            return f"ok {_fmt_err(worst)}".strip() if r.get(M.CHECKED) else "ok (unchecked)"
        if status == M.INCORRECT:
            return f"INCORRECT {_fmt_err(worst)}"
        return status.upper() if status in (M.FAILED, M.TIMEOUT) else status
    t = df.assign(cell=df.apply(cell, axis=1))
    t["P"] = t["world_size"]
    out = t.pivot_table(index=["series", "P"], columns="config", values="cell", aggfunc="first")
    out.columns.name = None
    return out.fillna("")


def throughput(df: pd.DataFrame) -> pd.DataFrame:
    """One row per measured point: time, TFLOP/s per GPU, tokens/s and percent of ideal.

    Ideal (ring-flash-attn's README convention: "theoretic flash_attn / P"): the single-device
    `reference` time of the same problem on the same hardware and executor, divided by the world
    size. Empty when no reference row exists for the problem.
    """
    m = measured(df)
    if m.empty:
        return pd.DataFrame()
    ref = m[(m["method"] == "reference") & (m["world_size"] == 1)]
    ref = ref.groupby(["hardware", "executor"] + PROBLEM, dropna=False)[M.TIME_MS_MEDIAN].median()
    key = list(zip(*(m[c] for c in ["hardware", "executor"] + PROBLEM)))
    ref_ms = pd.Series([ref.get(k) for k in key], index=m.index, dtype="float64")
    out = pd.DataFrame({
        "series": m["series"], "shape": m["shape"], "P": m["world_size"], "mask": m["mask"], "pass": m["pass"],
        "seq_len": m["seq_len"], "time_ms": m[M.TIME_MS_MEDIAN],
        "tflops_per_gpu": m[M.TFLOPS_PER_GPU], "tokens_per_s": m[M.TOKENS_PER_S],
        "pct_of_ideal": 100 * (ref_ms / m["world_size"]) / m[M.TIME_MS_MEDIAN],
    })
    return out.sort_values(["shape", "mask", "pass", "P", "seq_len", "series"]).reset_index(drop=True)


def throughput_pivot(df: pd.DataFrame) -> pd.DataFrame:
    """The ring-flash-attn README layout: series (rows) by sequence length (columns),
    "TFLOP/s per GPU (percent of ideal)" per cell, one block per world size, mask and pass."""
    t = throughput(df)
    if t.empty:
        return t
    t["cell"] = [f"{tf:.3g}" + ("" if pd.isna(p) else f" ({p:.0f}%)") for tf, p in zip(t["tflops_per_gpu"],
                                                                                          t["pct_of_ideal"])]
    out = t.pivot_table(index=["shape", "P", "mask", "pass", "series"], columns="seq_len", values="cell",
                        aggfunc="first")
    out.columns = [f"S={c}" for c in out.columns]
    return out.fillna("")


def speedup(df: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """TASP's evaluation layout: speedup over `baseline` (baseline time / series time) for every
    series, per world size, mask, pass and sequence length (rows). Same hardware, executor and
    problem only; empty cells where the baseline has no row."""
    m = measured(df)
    m = m[m[M.STATUS] == M.OK]  # a wrong answer has no speed worth comparing
    if m.empty or baseline not in set(m["method"]):
        return pd.DataFrame()
    base = m[m["method"] == baseline].groupby(POINT, dropna=False)[M.TIME_MS_MEDIAN].median()
    key = list(zip(*(m[c] for c in POINT)))
    base_ms = pd.Series([base.get(k) for k in key], index=m.index, dtype="float64")
    t = m.assign(speedup=base_ms / m[M.TIME_MS_MEDIAN], P=m["world_size"])
    out = t.pivot_table(index=["shape", "P", "mask", "pass", "seq_len"], columns="series", values="speedup",
                        aggfunc="median")
    out.columns.name = None
    return out


def communication(df: pd.DataFrame) -> pd.DataFrame:
    """Bytes per rank, operations, and the time split (CCR, overlap, overhead) per measured point."""
    m = measured(df)
    if m.empty:
        return pd.DataFrame()
    cols = {"series": m["series"], "shape": m["shape"], "P": m["world_size"], "mask": m["mask"], "pass": m["pass"],
            "seq_len": m["seq_len"], "MiB_sent_per_rank": m[M.BYTES_SENT] / 2**20,
            "MiB_recv_per_rank": m[M.BYTES_RECV] / 2**20, "ops": m[M.COMM_OPS]}
    for col in (M.KERNEL_MS, M.COMM_WAIT_MS, M.OVERHEAD_RATIO, M.COMPUTE_ONLY_MS, M.COMM_ONLY_MS, M.CCR,
                M.OVERLAP_EFF):
        cols[col] = m[col]
    return pd.DataFrame(cols).sort_values(["shape", "mask", "pass", "P", "seq_len", "series"]).reset_index(drop=True)


def memory(df: pd.DataFrame) -> pd.DataFrame:
    m = measured(df)
    if m.empty:
        return pd.DataFrame()
    t = m.assign(P=m["world_size"], peak_MiB=m[M.PEAK_MEM] / 2**20)
    out = t.pivot_table(index=["shape", "P", "mask", "pass", "seq_len"], columns="series", values="peak_MiB",
                        aggfunc="max")
    out.columns.name = None
    return out


def problems(df: pd.DataFrame) -> pd.DataFrame:
    """Every row that is not a clean ok: skipped, failed, timeout, incorrect, with its reason."""
    if df.empty:
        return pd.DataFrame()
    bad = df[df[M.STATUS] != M.OK]
    return pd.DataFrame({"series": bad["series"], "P": bad["world_size"], "config": bad["config"],
                         "status": bad[M.STATUS], "reason": bad[M.REASON].fillna("")}).reset_index(drop=True)


def status_counts(df: pd.DataFrame) -> pd.DataFrame:
    if df.empty:
        return pd.DataFrame()
    out = df.pivot_table(index="series", columns=M.STATUS, values="key", aggfunc="count", fill_value=0)
    out.columns.name = None
    return out


TRAIN = "train"  # the pass of model-level (perplexity) rows


def attention_rows(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["pass"] != TRAIN] if not df.empty else df


def perplexity_rows(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["pass"] == TRAIN] if not df.empty else df


def perplexity(df: pd.DataFrame) -> pd.DataFrame:
    """Model-level check: final validation perplexity per method against the single-device baseline,
    the largest per-step relative loss difference, and the time per training step."""
    t = perplexity_rows(df)
    if t.empty:
        return pd.DataFrame()
    out = pd.DataFrame({
        "shape": t["shape"], "S": t["seq_len"], "series": t["series"], "P": t["world_size"], "status": t[M.STATUS],
        "perplexity": t[M.PPL], "baseline perplexity": t[M.PPL_BASELINE],
        "perplexity rel. diff": t[M.PPL_REL_DIFF], "max loss rel. diff": t[M.LOSS_MAX_REL_DIFF],
        "final train loss": t[M.LOSS_CURVE].map(lambda c: float(c[-1]) if c is not None and len(c) else math.nan),
        "ms per step": t[M.TIME_MS_MEDIAN], "MiB sent per step": t[M.BYTES_SENT] / 2**20,
        "_order": t["method"] != "baseline",  # the baseline first
    })
    out = out.sort_values(["shape", "S", "_order", "P", "series"]).drop(columns="_order")
    return out.reset_index(drop=True)


SIM_PAIR = ["method", "options", "world_size", "batch", "seq_len", "heads", "kv_heads", "head_dim", "dtype", "causal",
            "pass"]


def sim_pairs(df: pd.DataFrame) -> pd.DataFrame:
    """Measured (executor dist) rows joined with the simulator's rows of the same trial, columns
    suffixed _dist and _sim; empty unless both exist."""
    m = measured(df)
    if m.empty or not {"sim", "dist"} <= set(m["executor"]):
        return pd.DataFrame()
    return m[m["executor"] == "dist"].merge(m[m["executor"] == "sim"], on=SIM_PAIR, suffixes=("_dist", "_sim"))


def sim_vs_measured(df: pd.DataFrame) -> pd.DataFrame:
    """Each measured (executor dist) time beside the simulator's prediction of the same trial, with
    the relative error (predicted / measured - 1) and the topology it was predicted on."""
    pair = sim_pairs(df)
    if pair.empty:
        return pd.DataFrame()
    out = pd.DataFrame({
        "method": [method_label(r["method"], _options(r["options"])) for _, r in pair.iterrows()],
        "P": pair["world_size"], "S": pair["seq_len"], "B": pair["batch"],
        "mask": pair["causal"].map({True: "causal", False: "full"}), "pass": pair["pass"],
        "measured on": pair["hardware_dist"], "predicted on": pair["topology_sim"],
        "measured ms": pair[f"{M.TIME_MS_MEDIAN}_dist"], "predicted ms": pair[f"{M.TIME_MS_MEDIAN}_sim"],
    })
    out["error %"] = 100 * (out["predicted ms"] / out["measured ms"] - 1)
    return out.sort_values(["P", "method", "mask", "pass"]).reset_index(drop=True)


def build_tables(df: pd.DataFrame, baseline: str) -> dict[str, pd.DataFrame]:
    """All tables of a report, by file stem (empty ones are left out by the writer). Attention
    tables use the attention rows; the perplexity table the model-level rows."""
    att = attention_rows(df)
    return {
        "status_counts": status_counts(df),
        "correctness": correctness_matrix(att),
        "throughput": throughput(att),
        "throughput_by_seq_len": throughput_pivot(att),
        f"speedup_over_{baseline}": speedup(att, baseline),
        "communication": communication(att),
        "memory_peak_MiB": memory(att),
        "perplexity": perplexity(df),
        "sim_vs_measured": sim_vs_measured(att),
        "skips_and_failures": problems(df),
    }


def write_tables(tables: dict[str, pd.DataFrame], out_dir, caption_prefix: str = "") -> dict[str, dict[str, str]]:
    """Write each table as Markdown, LaTeX (booktabs) and CSV; return {name: {fmt: path}}."""
    from pathlib import Path
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, dict[str, str]] = {}
    for name, table in tables.items():
        if table is None or table.empty:
            continue
        shown = _display(table)
        paths = {"csv": out_dir / f"{name}.csv", "md": out_dir / f"{name}.md", "tex": out_dir / f"{name}.tex"}
        table.to_csv(paths["csv"])
        paths["md"].write_text(shown.to_markdown(disable_numparse=True) + "\n")
        styler = shown.style.format(escape="latex").format_index(escape="latex", axis=0) \
            .format_index(escape="latex", axis=1)
        paths["tex"].write_text(styler.to_latex(hrules=True, caption=f"{caption_prefix}{name.replace('_', ' ')}",
                                                label=f"tab:{name}", position_float="centering"))
        written[name] = {k: str(v) for k, v in paths.items()}
    return written


def _display(table: pd.DataFrame) -> pd.DataFrame:
    """Numbers rounded for reading (CSV keeps full precision)."""
    def fmt(v, digits: int = 3):
        if isinstance(v, float):
            if math.isnan(v):
                return ""
            return f"{v:.{digits}g}" if abs(v) < 1e4 else f"{v:.{max(digits, 4)}g}"
        return v
    if table.empty:
        return table
    return table.apply(lambda col: col.map(lambda v: fmt(v, 7 if col.name in _PRECISE else 3)))


# Columns whose values are compared to each other to many digits (perplexity against its baseline).
_PRECISE = {"perplexity", "baseline perplexity", "final train loss"}
