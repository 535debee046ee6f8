"""Tables of the suite's two checks beyond one attention call: the model-level (perplexity) check,
and the simulator's predictions beside measured times of the same trials.
"""

from __future__ import annotations

import math

import pandas as pd

from suite import metrics as M
from suite.metrics import method_label
from suite.reports.style import rank_word
from suite.reports.tables.cells import Col, Table, _source
from suite.reports.tables.rows import _options, perplexity_rows, sim_pairs


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
