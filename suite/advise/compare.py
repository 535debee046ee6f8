"""Checking the advice against measurements: predicted vs measured order, Spearman's rank correlation."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from suite import metrics as M
from suite.advise.question import AdviceError
from suite.advise.ranking import Advice


def ranks_of(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties get mean ranks)."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError("spearman needs two equally long lists of at least 2 values")
    rx, ry = ranks_of(x), ranks_of(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else float("nan")


def compare(advice: Advice, measured_dir: Path) -> tuple[str, dict[str, Any]]:
    """Predicted vs measured order of the configurations both hold: a table, whether the measured
    best is in the advised top 3, and the Spearman correlation of predicted and measured times."""
    from tabulate import tabulate

    from suite.results import ResultsStore

    store = (
        ResultsStore.latest(str(measured_dir.parent), measured_dir.name)
        if not (measured_dir / "trials.jsonl").is_file()
        else ResultsStore.open(measured_dir)
    )
    if store is None:
        raise AdviceError("--compare", f"no results under {measured_dir}")
    measured = {(r["method"], r["options"]): r for r in store.records() if r["status"] == M.OK}
    # a configuration measured under another name of its schedule (c.same) counts as measured
    pairs = [
        (c, next(measured[(a.method, a.options_json)] for a in [c, *c.same] if (a.method, a.options_json) in measured))
        for c in advice.ranked
        if any((a.method, a.options_json) in measured for a in [c, *c.same])
    ]
    if len(pairs) < 2:
        raise AdviceError("--compare", f"{measured_dir} holds {len(pairs)} of the advised configurations; need 2+")
    pred = [c.row[M.TIME_MS_MEDIAN] for c, _ in pairs]
    meas = [r[M.TIME_MS_MEDIAN] for _, r in pairs]
    mrank = ranks_of(meas)
    adv_rank = {id(c): i for i, c in enumerate(advice.ranked, 1)}
    rows = [
        [adv_rank[id(c)], int(mr) if mr == int(mr) else mr, c.title, f"{p:.3f}", f"{m:.3f}"]
        for (c, _), p, m, mr in zip(pairs, pred, meas, mrank)
    ]
    best = min(pairs, key=lambda cr: cr[1][M.TIME_MS_MEDIAN])[0]
    rho = spearman(pred, meas)
    facts = {
        "n": len(pairs),
        "measured_best": best.title,
        "best_advised_rank": adv_rank[id(best)],
        "best_in_top3": adv_rank[id(best)] <= 3,
        "spearman": rho,
        "run_dir": str(store.run_dir),
    }
    text = tabulate(
        rows,
        headers=["advised rank", "measured rank", "configuration", "predicted ms", "measured ms"],
        disable_numparse=True,
    )
    text += (
        f"\nmeasured best: {best.title}, advised rank {adv_rank[id(best)]} "
        f"({'in' if facts['best_in_top3'] else 'NOT in'} the advised top 3); Spearman rank correlation "
        f"predicted vs measured over {len(pairs)} configurations: {rho:+.3f} (measured: {store.run_dir})"
    )
    return text, facts
