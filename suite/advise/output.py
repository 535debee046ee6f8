"""What the advisor prints and writes: the answer in one sentence, the ranked table, its header, the
counts of what it hides, the next step, advice.md/advice.csv and the sweep that measures the top."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Optional

import yaml

from suite import metrics as M
from suite.advise.candidates import Candidate
from suite.advise.ranking import Advice, _band, _mask_label, _ms, build_config, main_cost, sweep_name, tied_with_best


def tie_line(advice: Advice) -> str:
    """One line saying which configurations are tied ("" when none is); `next_step` says how to
    separate them."""
    tied = tied_with_best(advice)
    if not tied:
        return ""
    ranks = [i for i, c in enumerate(advice.ranked, 1) if c in tied]
    bands = sorted({b for c in tied if (b := _band(c)) is not None})  # all of them: a tie needs both bands
    band = f"±{bands[0]:g} %" if len(bands) == 1 else f"±{bands[0]:g}-{bands[-1]:g} %"
    return (
        f"Tied: ranks {', '.join(map(str, ranks))} ({', '.join(c.title for c in tied)}) lie within each other's "
        f"error band ({band}, the simulator's validated error, `{M.suite_command()} validate`), so the simulator "
        f"cannot order them: measure them on your hardware (next step below)."
    )


def _band_text(c: Candidate) -> str:
    b = _band(c)
    return f" ±{b:g} %" if b is not None else f" ({M.UNVALIDATED}: no published row of its kind was validated)"


def advice_sentence(advice: Advice) -> str:
    """The answer in one sentence: the configuration to use, why, and how sure the simulator is."""
    if not advice.ranked:
        return "Advice: none; no configuration could be simulated (see 'Simulated but not ranked' below)."
    best = advice.ranked[0]
    t = best.row[M.TIME_MS_MEDIAN]
    text = (
        f"Advice: use {best.title} (Ulysses {best.ulysses_degree} x ring {best.ring_degree}), predicted "
        f"{_ms(t)} ms{_band_text(best)}, {100 * advice.ideal_ms / t:.1f} % of ideal, "
        f"{main_cost(best.row, advice.ideal_ms)}"
    )
    tied = tied_with_best(advice)
    if tied:
        return (
            text + f"; {len(tied) - 1} more configuration(s) lie within its error band, so measure the top "
            f"{len(tied)} on your hardware before choosing."
        )
    if len(advice.ranked) == 1:
        return text + "; it is the only configuration that runs this question."
    second = advice.ranked[1]
    gap = 100 * (second.row[M.TIME_MS_MEDIAN] / t - 1)
    if _band(best) is None or _band(second) is None:
        return (
            text + f"; {gap:.1f} % faster than the next, {second.title}, with no validated band to say it holds "
            f"({M.UNVALIDATED})."
        )
    return text + f"; {gap:.1f} % faster than the next, {second.title}, beyond both error bands."


def evidence_line(advice: Advice) -> str:
    """What backs the answer: a prediction, no run of these configurations on the GPUs it names (the
    header says "simulated"; a reader skimming for the answer must not take it for a measurement)."""
    q = advice.question
    return (
        f"No multi-GPU run backs this answer: it is the simulator's prediction for {q.world_size} x "
        f"{q.topology.gpu}, checked only against published tables (`{M.suite_command()} validate`); "
        "measure the top configurations on your hardware before relying on it (the next step below)."
    )


def measure_count(advice: Advice) -> int:
    """How many of the top configurations are worth measuring: the ones tied with the first, else 3."""
    return len(tied_with_best(advice)) or min(3, len(advice.ranked))


def next_step(advice: Advice, command: str, emitted: Optional[str] = None) -> str:
    """The command that measures the top configurations on real hardware. `command`: this advise
    command (without --top and --emit-config); `emitted`: the sweep file --emit-config wrote."""
    if not advice.ranked:
        return ""
    if emitted:
        measured = f"results/{sweep_name(advice.question)}_measured"
        return (
            f"Next: measure them on your hardware: `{M.suite_command()} run {emitted}`, then compare: "
            f"`{command} --compare {measured}`."
        )
    n = measure_count(advice)
    return (
        f"Next: measure the top {n} on your hardware: `{command} --top {n} --emit-config measure.yaml`, "
        f"then `{M.suite_command()} run measure.yaml`."
    )


def counts_line(advice: Advice, top: Optional[int]) -> str:
    """What the table does not show, counted: hidden ranks beyond --top, configurations merged as
    the same schedule, pruned and failed ones."""
    n = len(advice.ranked)
    shown = min(top, n) if top else n
    parts = [f"{shown} of {n} ranked configuration(s) shown" + (f" (--top {n} shows all)" if shown < n else "")]
    merged = sum(len(c.same) for c in advice.ranked)
    if merged:
        parts.append(f"{merged} more are the same schedule as one listed (named with it: a = b)")
    if advice.pruned:
        parts.append(f"{len(advice.pruned)} pruned before tracing")
    if advice.failed:
        parts.append(f"{len(advice.failed)} simulated but not ranked")
    return "; ".join(parts) + "."


def render(advice: Advice, top: Optional[int] = None, fmt: str = "simple") -> str:
    """The ranked table; numeric columns right-aligned (in Markdown too: `fmt="pipe"` writes `---:`).
    The band column stays numeric where a row has no band: its word (M.UNVALIDATED) stands in for
    the number, right-aligned with the others."""
    from tabulate import tabulate

    rows = advice.table(top)
    if not rows:
        return ""
    headers = list(rows[0])

    def number(v) -> bool:
        return v is None or v == M.UNVALIDATED or (isinstance(v, (int, float)) and not isinstance(v, bool))

    numeric = [all(number(r[h]) for r in rows) for h in headers]
    return tabulate(
        [list(r.values()) for r in rows],
        headers=headers,
        tablefmt=fmt,
        disable_numparse=True,
        colalign=["right" if n else "left" for n in numeric],
    )


def header(advice: Advice) -> str:
    q = advice.question
    mix = f"packed documents ({q.workload.name})" if q.workload is not None else "uniform sequences"
    return (
        f"{q.model.name} attention (heads {q.model.heads}, kv_heads {q.model.kv_heads}, head_dim "
        f"{q.model.head_dim}{f', head_dim_v {q.model.head_dim_v}' if q.model.head_dim_v else ''}, "
        f"{q.model.layers} layers) on {q.world_size} x {q.topology.gpu} "
        f"({q.nodes} node(s), topology {q.topology.name}), {q.seq_len} tokens x batch {q.batch}, {mix}, "
        f"{q.dtype}, mask {_mask_label(q)}, {q.pass_}. Simulated (executor=sim), not measured. "
        + (
            f"Predicted ms: the model's attention over all {q.model.layers} layers (each distinct layer mask "
            f"simulated once, its time x its layer count); ideal likewise. "
            if q.per_layer
            else ""
        )
        + "Memory: one attention call's peak plus what the other layers keep for backward "
        f"({'their inputs only: activation recomputation' if q.recompute else 'no recomputation'}); "
        "ideal: the whole problem as one kernel call on one GPU of the same compute model / P; "
        f"± %: the simulator's validated error for the configuration's family (`{M.suite_command()} validate`); "
        f"{M.UNVALIDATED}: no published row of its family (hardware kind, method family, kernel- or comm-bound) "
        "was validated, so no band is given."
    )


def write_outputs(advice: Advice, out_dir: Path, top: Optional[int] = None, next_line: str = "") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = advice.table(top)
    md = out_dir / "advice.md"
    text = ["# suite advise\n", advice_sentence(advice), "", header(advice), "", render(advice, top, "pipe"), ""]
    text += [counts_line(advice, top), ""]
    tie = tie_line(advice)
    if tie:
        text += [tie, ""]
    if next_line:
        text += [next_line, ""]
    text += pruned_lines(advice)
    md.write_text("\n".join(text) + "\n")
    cs = out_dir / "advice.csv"
    with cs.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["rank"])
        w.writeheader()
        w.writerows(rows)
    return [md, cs]


def pruned_lines(advice: Advice) -> list[str]:
    lines = []
    if advice.pruned:
        lines.append(f"Pruned before tracing ({len(advice.pruned)}):")
        lines += [f"- {c.title}: {c.pruned}" for c in advice.pruned]
    if advice.failed:
        lines.append(f"Simulated but not ranked ({len(advice.failed)}):")
        lines += [f"- {c.title}: {c.row.get('status')}: {c.row.get('reason')}" for c in advice.failed]
    return lines


def emit_config(advice: Advice, path: Path, top: int) -> Path:
    """A sweep YAML that measures the advised top `top` configurations (executor dist)."""
    from omegaconf import OmegaConf

    q = advice.question
    cfg = build_config(q, advice.ranked[:top], executor="dist", name=sweep_name(q) + "_measured")
    cfg.description = f"measure the top {top} of `suite advise` ({cfg.description})"
    d = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    assert isinstance(d, dict)  # a structured config is a mapping
    keep = {"name": d["name"], "description": d["description"], "sweep": d["sweep"], "run": {"executor": "dist"}}
    if d.get("documents"):
        keep["documents"] = {
            k: {kk: vv for kk, vv in v.items() if vv not in (None, [], 0, 0.0) or kk == "min"}
            for k, v in d["documents"].items()
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"# Written by `{M.suite_command()} advise`: the top {top} configurations, measured.\n"
        + yaml.safe_dump(keep, sort_keys=False)
    )
    return path
