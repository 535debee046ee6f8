"""The advisor's simulated sweep and its ranking: the kept candidates as one sweep (executor=sim),
ranked by predicted time, configurations of one schedule merged, percent of ideal, the main cost
and the ties within the simulator's error bands."""

from __future__ import annotations

import hashlib
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import methods
from methods.masks import Mask
from methods.masks import parse as parse_mask
from suite import metrics as M
from suite.advise.candidates import Candidate, _run_case, enumerate_candidates, prune
from suite.advise.question import GB, AdviceError, Question
from suite.config import DocumentsConfig, SuiteConfig
from suite.sim.compute import ComputeModel
from suite.sim.ledger import Compute, masked_compute

# a cost is "the main cost" once it takes this share of the predicted time; below it for every
# cost, the configuration is compute-bound
MAIN_COST_SHARE = 0.15


def sweep_name(q: Question) -> str:
    model = re.sub(r"[^A-Za-z0-9_.-]", "-", q.model.name)
    mask = "" if q.mask is None or q.mask.plain else "_" + re.sub(r"[^A-Za-z0-9_.-]", "-", q.mask.short)
    return f"advise_{model}{mask}_{q.topology.name}_{q.world_size}gpu"


def build_config(
    q: Question,
    kept: list[Candidate],
    *,
    executor: str = "sim",
    name: Optional[str] = None,
    results_root: str = "results",
    mlflow: bool = True,
) -> SuiteConfig:
    """One sweep holding exactly the candidates `kept`: each method's option values are axes, and
    every combination of them that is not a kept candidate is excluded (never planned)."""
    from suite.config import option_points, validate

    cfg = SuiteConfig(name=name or sweep_name(q))
    cfg.description = (
        f"suite advise: {q.model.name} ({q.model.heads}/{q.model.kv_heads}/{q.model.dims}) on "
        f"{q.world_size} x {q.topology.gpu}, {q.seq_len} tokens"
    )
    names = list(dict.fromkeys(c.method for c in kept))
    s = cfg.sweep
    s.methods, s.world_size, s.batch, s.seq_len = names, [q.world_size], [q.batch], [q.seq_len]
    s.heads, s.kv_heads, s.head_dim = [q.model.heads], [q.model.kv_heads], [q.model.head_dim]
    s.head_dim_v = [q.model.head_dim_v]
    s.dtype, s.causal, s.passes = [q.dtype], [q.causal], [q.pass_]
    if q.masks_named:  # the mask axis: each distinct layer mask once
        s.mask = [m.name for m, _ in q.layer_masks()]
    s.method_options, s.exclude = {}, []
    for m in names:
        mine = [c.options for c in kept if c.method == m]
        keys = sorted({k for o in mine for k in o})
        if not keys:
            continue
        s.method_options[m] = {k: sorted({o[k] for o in mine}, key=str) for k in keys}
        for point in option_points(s.method_options[m]):
            if point not in mine:
                s.exclude.append({"method": m, **point})
    if q.workload is not None:
        w = q.workload
        cfg.documents = {
            w.name: DocumentsConfig(distribution=w.distribution, **{k: v for k, v in w.settings.items() if k != "bins"})
        }
        s.workload = [w.name]
    cfg.run.executor = executor
    cfg.run.seed = q.seed
    cfg.sim.topology = [q.topology_arg]
    cfg.results.root = results_root
    cfg.tracking.mlflow = mlflow
    validate(cfg)
    return cfg


def _schedule_numbers(c: Candidate) -> tuple:
    """What two configurations of one schedule predict alike: degrees, memory, time, its compute-only
    and comm-only parts, bytes and collective calls."""
    r = c.row
    return (
        c.ulysses_degree,
        c.ring_degree,
        c.memory_bytes,
        r.get(M.TIME_MS_MEDIAN),
        r.get(M.COMPUTE_ONLY_MS),
        r.get(M.COMM_ONLY_MS),
        r.get(M.BYTES_SENT),
        r.get(M.BYTES_RECV),
        str(r.get(M.COMM_OPS)),
    )


def _token_map(q: Question, c: Candidate) -> str:
    """A digest of which tokens each rank holds (the method's layout of the run case, every layer mask)."""
    m = methods.get_method(c.method, **c.options)
    digest = hashlib.sha256()
    for mask, _ in q.layer_masks():
        layout = m.layout(_run_case(q, m, mask))
        for rank in range(q.world_size):
            digest.update(layout.positions(rank).numpy().tobytes())
            digest.update(b"|")
    return digest.hexdigest()


def merge_same_schedules(q: Question, ranked: list[Candidate]) -> list[Candidate]:
    """One entry per schedule. Some configurations are one schedule under two names: USP at Ulysses
    degree 1 is the zigzag ring (no all-to-all, the same zigzag pairs) and at degree P it is Ulysses
    (one ring step) - methods/usp.py. They are found, not listed: two configurations are the same
    when they place every token on the same rank and their simulated traces (which run the methods'
    own code) agree on time, its compute and communication parts, bytes, collective calls and
    memory. The entry kept is the one with the fewest options; the others go to its `same`."""
    groups: dict[tuple, list[list[Candidate]]] = {}
    entries: list[list[Candidate]] = []
    maps: dict[int, str] = {}  # id(candidate) -> its token map, built once and only when numbers agree

    def token_map(c: Candidate) -> str:
        if id(c) not in maps:
            maps[id(c)] = _token_map(q, c)
        return maps[id(c)]

    for c in ranked:
        c.same = []
        alike = groups.setdefault(_schedule_numbers(c), [])
        for entry in alike:
            if token_map(entry[0]) == token_map(c):
                entry.append(c)
                break
        else:
            alike.append([c])
            entries.append(alike[-1])
    out = []
    for entry in entries:
        first = min(entry, key=lambda c: len(c.options))  # ties keep the registry's order
        first.same = [c for c in entry if c is not first]
        out.append(first)
    return out


def ideal_ms(q: Question, mask: Optional[Mask] = None) -> float:
    """The problem on one device of the topology's compute model, divided by the GPUs (the
    percent-of-ideal convention of the reports: single-device time / P; on a host whose ranks share
    its cores, divided by the cores' worth of ranks instead). `mask`: one layer's mask (default: the
    question's only one; with a per-layer pattern, `model_ideal_ms` adds the layers)."""
    import torch

    if mask is None:
        mask = q.layer_masks()[0][0]
    compute = ComputeModel(q.topology)
    causal = mask.causal
    docs = q.documents(mask)
    causal_offset = 0 if causal else None
    t = 0.0
    for op in ("fwd",) + (("bwd",) if q.pass_ == "fwd_bwd" else ()):
        if docs is not None and docs.mask is not None:
            # the whole sequence as one block under the mask, as the single-device reference runs it:
            # its visible pairs and the pieces (slices, documents) a flash kernel calls
            pos = torch.arange(q.seq_len)
            block = docs.block(pos, pos, causal)
            h, kv, d = q.model.heads, q.model.kv_heads, q.model.head_dim
            e = masked_compute(op, q.batch, q.seq_len, q.seq_len, h, kv, d, q.dtype, block, q.model.head_dim_v)
            t += compute.time(e)
            continue
        doc_pairs = pieces = None
        if docs is not None:
            doc_pairs = sum(n * (n + 1) // 2 if causal else n * n for seq in docs.lengths for n in seq)
            # one kernel call per document, as the single-device reference runs a packed block
            count = Counter((n, n, causal_offset, None) for seq in docs.lengths for n in seq)
            pieces = tuple(sorted(count.items(), key=lambda x: x[0][0]))
        t += compute.time(
            Compute(
                op,
                q.batch,
                q.seq_len,
                q.seq_len,
                q.model.heads,
                q.model.kv_heads,
                q.model.head_dim,
                causal_offset,
                q.dtype,
                doc_pairs,
                pieces,
                q.model.head_dim_v,
            )
        )
    # ranks that share a host's cores (a calibrated CPU host) cannot compute more than the cores do
    cores = q.topology.compute.get("shared_cores")
    return t * 1e3 / (min(q.world_size, float(cores)) if cores else q.world_size)


def model_ideal_ms(q: Question) -> float:
    """Ideal for the answer's unit: one call of the question's mask, or with a per-layer pattern the
    sum over the model's layers (each distinct mask's ideal x its layer count)."""
    if not q.per_layer:
        return ideal_ms(q)
    return sum(n * ideal_ms(q, m) for m, n in q.layer_masks())


def total_row(rows: dict[str, dict], counts: dict[str, int]) -> dict:
    """A candidate's row for a per-layer model: its times added over the layers (each mask's row x its
    layer count), compute-only likewise; imbalance the ratio that loses the same compute-only time
    (sum of compute-only / sum of compute-only / imbalance); the error band the widest of the rows'."""
    rs = [(rows[name], n) for name, n in counts.items()]
    out = dict(rs[0][0])
    out[M.TIME_MS_MEDIAN] = sum(n * r[M.TIME_MS_MEDIAN] for r, n in rs)
    comps = [(r.get(M.COMPUTE_ONLY_MS), r.get(M.IMBALANCE) or 1.0, n) for r, n in rs]
    known = [(c, imb, n) for c, imb, n in comps if c is not None]
    if len(known) == len(comps):
        comp = sum(n * c for c, _, n in known)
        out[M.COMPUTE_ONLY_MS] = comp
        balanced = sum(n * c / imb for c, imb, n in known)
        out[M.IMBALANCE] = comp / balanced if balanced else 1.0
    bands = [r.get(M.SIM_ERROR_PCT) for r, _ in rs]
    out[M.SIM_ERROR_PCT] = None if any(b is None for b in bands) else max(float(b) for b in bands if b is not None)
    out["mask"] = "+".join(counts)
    return out


def main_cost(row: dict, ideal: Optional[float] = None) -> str:
    """What the predicted time is mostly spent on beyond useful compute, from a row's time split:
    exposed communication = time - compute-only time; imbalance = the compute-only time lost to the
    busiest rank (compute-only x (1 - mean/max visible pairs)); compute overhead = the balanced
    compute-only time above `ideal` (smaller blocks run below the kernel's best rate, and the
    method's own merges and copies). "compute-bound" when none takes MAIN_COST_SHARE of the time."""
    t = row.get(M.TIME_MS_MEDIAN) or 0.0
    comp = row.get(M.COMPUTE_ONLY_MS)
    if not t or comp is None:
        return "-"
    imb = row.get(M.IMBALANCE) or 1.0
    costs = {
        "exposed communication": max(0.0, t - comp) / t,
        "imbalance": comp * (1.0 - 1.0 / imb) / t if imb > 0 else 0.0,
        "compute overhead": max(0.0, comp / max(imb, 1.0) - ideal) / t if ideal else 0.0,
    }
    name, share = max(costs.items(), key=lambda kv: kv[1])
    if share < MAIN_COST_SHARE:
        return f"compute-bound ({100 * (1 - costs['exposed communication']):.0f}% compute)"
    return f"{name} ({100 * share:.0f}%)"


@dataclass
class Advice:
    question: Question
    ranked: list[Candidate]
    pruned: list[Candidate]
    failed: list[Candidate]
    ideal_ms: float
    run_dir: Optional[Path] = None

    def table(self, top: Optional[int] = None) -> list[dict[str, Any]]:
        q = self.question
        rows = []
        for i, c in enumerate(self.ranked[:top] if top else self.ranked, 1):
            t = c.row[M.TIME_MS_MEDIAN]
            row = {
                "rank": i,
                "method": c.title,
                "mask": _mask_label(q),
                "degrees": f"{c.ulysses_degree}x{c.ring_degree}",
                "layout": c.layout,
                "ranks/node": c.ranks_per_node,
                "predicted ms": _ms(t),
                "± %": M.UNVALIDATED if _band(c) is None else _band(c),
                "% of ideal": round(100 * self.ideal_ms / t, 1),
                "memory GB/GPU": float(f"{c.memory_bytes / GB:.3g}"),
                "main cost": main_cost(c.row, self.ideal_ms),
            }
            if q.per_layer:  # the model total, and what each layer mask takes per layer
                row["per layer ms"] = "; ".join(
                    f"{parse_mask(name).short} {_ms(c.rows[name][M.TIME_MS_MEDIAN])} x{n}"
                    for name, n in q.model.pattern
                )
            rows.append(row)
        return rows


def _ms(t: float) -> float:
    return round(t, 1) if t >= 100 else float(f"{t:.4g}")


def _mask_label(q: Question) -> str:
    """The mask the answer is for: --mask, the model's per-layer pattern, or causal/full."""
    if q.per_layer:
        return " + ".join(f"{n}x {parse_mask(name).short}" for name, n in q.model.pattern)
    return q.layer_masks()[0][0].short


def _band(c: Candidate) -> Optional[float]:
    """A candidate's error band (percent of its predicted time; None without a validated record)."""
    b = c.row.get(M.SIM_ERROR_PCT)
    return None if b is None else round(float(b), 1)


def within_bands(t1: float, b1: Optional[float], t2: float, b2: Optional[float]) -> bool:
    """Whether two predicted times lie within each other's band: each inside the other's t x (1 +- b)."""
    if b1 is None or b2 is None:
        return False
    gap = abs(t1 - t2)
    return gap <= t1 * b1 / 100 and gap <= t2 * b2 / 100


def tied_with_best(advice: Advice) -> list[Candidate]:
    """The ranked configurations tied with the first (itself included): their predicted times lie
    within each other's error band, so the simulator cannot order them; [] when none is tied."""
    if not advice.ranked:
        return []
    best = advice.ranked[0]
    tb, bb = best.row[M.TIME_MS_MEDIAN], _band(best)
    tied = [c for c in advice.ranked[1:] if within_bands(tb, bb, c.row[M.TIME_MS_MEDIAN], _band(c))]
    return [best] + tied if tied else []


def advise(
    q: Question, *, results_root: str = "results", mlflow: bool = True, progress: bool = False, out=None
) -> Advice:
    """Prune, simulate the survivors as one sweep (executor=sim), rank them."""
    import io

    from suite.runner import run_sweep

    candidates = enumerate_candidates(q)
    kept = prune(q, candidates)
    pruned = [c for c in candidates if c.pruned]
    if not kept:
        if q.memory_gb is not None and any("--memory-gb" in c.pruned for c in pruned):
            least = min((c for c in pruned if c.memory_bytes), key=lambda c: c.memory_bytes)
            raise AdviceError(
                "--memory-gb",
                f"nothing fits {q.memory_gb:g} GB per GPU: the smallest configuration, "
                f"{least.title}, needs ~{least.memory_bytes / GB:.1f} GB",
            )
        raise AdviceError(
            "--model",
            "no method can run this question: " + "; ".join(sorted({f"{c.title}: {c.pruned}" for c in pruned})[:5]),
        )
    cfg = build_config(q, kept, results_root=results_root, mlflow=mlflow)
    from omegaconf import OmegaConf

    yaml_text = OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True)
    if progress:  # what the wait is for, before the sweep's bar (stderr: stdout keeps the answer)
        masks = len(q.layer_masks())
        print(
            f"advise: {len(candidates)} configurations, {len(pruned)} pruned before tracing; simulating "
            f"{len(kept)}{f' x {masks} layer masks' if masks > 1 else ''} on {q.topology.name} "
            "(one trace per schedule shape, then three replays each)",
            file=sys.stderr,
            flush=True,
        )
    result = run_sweep(cfg, yaml_text, out=out or io.StringIO(), progress=progress)
    assert result is not None  # not a dry run, and the sim executor's one rank leads
    by_key = {(c.method, c.options_json): c for c in kept}
    counts = {m.name: n for m, n in q.layer_masks()}
    for r in result.records:
        c = by_key.get((r["method"], r["options"]))
        if c is not None:
            c.rows[r.get("mask") or next(iter(counts))] = r
    for c in kept:
        bad = [r for r in c.rows.values() if r.get("status") != M.OK]
        if bad or set(c.rows) != set(counts):
            c.row = (
                bad[0]
                if bad
                else {"status": "missing", "reason": f"no row for masks {sorted(set(counts) - set(c.rows))}"}
            )
        elif q.per_layer:
            c.row = total_row(c.rows, counts)
        else:
            c.row = next(iter(c.rows.values()))
    ranked = sorted((c for c in kept if c.row.get("status") == M.OK), key=lambda c: c.row[M.TIME_MS_MEDIAN])
    ranked = merge_same_schedules(q, ranked)
    failed = [c for c in kept if c.row.get("status") != M.OK]
    return Advice(q, ranked, pruned, failed, model_ideal_ms(q), result.run_dir)
