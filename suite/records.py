"""What a rank reports about a trial, and how the parent turns the reports into one result row.

Every workload (attention calls, model training) and every executor (worker processes, virtual
ranks, torchrun, the simulator) speaks these types: a rank's `RankReport`, the executor's
`Outcome` of a trial, and the row helpers below, so that a row is built the same way whoever
produced it. Rows are plain dicts with exactly the columns of `suite.metrics.COLUMNS`, plus those of
`suite.metrics.VARIANT_IDENTITY` (head_dim_v, softcap) on the rows of trials that set them.
"""

from __future__ import annotations

import json
import math
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from suite import metrics as M
from suite.check import tolerance
from suite.plan import RunSettings, TrialSpec
from suite.timing import group_samples, summarize


@dataclass
class Breakdown:
    """One rank's time split of a trial (run.breakdown), in ms."""

    iter_ms: float  # the iteration (median total of the split runs)
    kernel_ms: float  # of which in block kernels
    comm_wait_ms: float  # of which blocked on communication
    compute_only_ms: list[float]  # iterations with communication replaced by no-ops
    comm_only_ms: list[float]  # iterations with the block kernels replaced by no-ops


@dataclass
class RankReport:
    """What one rank saw of one trial. A rank that raised reports ok=False with the error."""

    rank: int
    ok: bool = True
    wall_s: float = 0.0
    error: str = ""  # "Type: message" when ok is False
    traceback: str = ""
    oom: bool = False  # the error was a CUDA out-of-memory
    checked: bool = False  # compared with the float64 reference
    kernel_used: str = ""
    errors: dict[str, float] = field(default_factory=dict)  # tensor -> max |method - reference|
    # the pass rule's parts over this rank's rows (suite/reference.py); `check_columns` puts the
    # bound over the whole problem together from every rank's:
    naive_err: dict[str, float] = field(default_factory=dict)  # tensor -> max |naive same-dtype - ref64|
    ref_max: dict[str, float] = field(default_factory=dict)  # tensor -> max(1, max |ref64|)
    tol_floor: Optional[float] = None  # check.pass_floor of the trial
    bytes_sent: Optional[int] = None  # None when not counted (peers talk to torch.distributed)
    bytes_recv: Optional[int] = None
    comm_ops: dict[str, int] = field(default_factory=dict)
    samples_ms: list[float] = field(default_factory=list)  # per timed iteration (or training step)
    peak_mem: Optional[int] = None
    breakdown: Optional[Breakdown] = None
    pairs: Optional[int] = None  # visible (query, key) pairs x query heads of this rank's forward kernels
    losses: list[float] = field(default_factory=list)  # model-level check: loss of every step
    val_loss: Optional[float] = None
    sim_error_pct: Optional[float] = None  # executor sim: the validated error band of the row's family
    redundant_bytes: Optional[int] = None  # K/V bytes received that no local query sees (`redundant_bytes`)
    padded_len: Optional[int] = None  # the sequence length the method ran (padded to its granule)

    @classmethod
    def failure(cls, rank: int, exc: BaseException, *, oom: bool = False) -> "RankReport":
        return cls(
            rank=rank,
            ok=False,
            oom=oom,
            error=f"{type(exc).__name__}: {exc}"[:2000],
            traceback=traceback.format_exc(limit=30)[-8000:],
        )


@dataclass
class Outcome:
    """What the executor saw of one trial: every rank's report, or why not."""

    kind: str  # "reported", "failed", "timeout"
    reports: Sequence[Optional[RankReport]]  # one per rank (None: it did not report)
    message: str = ""  # why it failed or timed out (the executor's view)
    note: str = ""  # a caveat appended to the row's reason


@dataclass(frozen=True)
class RowContext:
    """What every row of one sweep run shares."""

    settings: RunSettings
    run_id: str


def base_row(spec: TrialSpec, ctx: RowContext, started_at: str) -> dict[str, Any]:
    """The identity and run settings of a trial: the start of every row."""
    s = ctx.settings
    row = {M.KEY: spec.key, **spec.identity()}
    row.update(
        {
            M.SEED: s.seed,
            M.WARMUP: s.warmup,
            M.REPEATS: s.repeats,
            M.STARTED_AT: started_at,
            M.RUN_ID: ctx.run_id,
            M.CHECKED: False,
        }
    )
    return row


def skipped_row(spec: TrialSpec, reason: str, ctx: RowContext, started_at: str) -> dict[str, Any]:
    row = base_row(spec, ctx, started_at)
    row.update({M.STATUS: M.SKIPPED, M.REASON: reason})
    return complete(row)


def begin_row(
    spec: TrialSpec, outcome: Outcome, ctx: RowContext, started_at: str, wall_s: float
) -> tuple[dict[str, Any], Optional[list[RankReport]]]:
    """(the row so far, every rank's report) of a trial every rank reported, or (the finished row
    of a failed or timed-out trial, None)."""
    row = base_row(spec, ctx, started_at)
    row[M.DURATION_S] = wall_s
    reports = [r for r in outcome.reports if r is not None]
    failed = [r for r in reports if not r.ok]
    if outcome.kind == "timeout" and not failed:
        row.update({M.STATUS: M.TIMEOUT, M.REASON: outcome.message})
        return finish(row, outcome), None
    if failed or outcome.kind == "failed" or not reports:
        msgs = [f"rank {r.rank}: {'out of memory: ' if r.oom else ''}{r.error}" for r in failed]
        if outcome.message:
            msgs.append(outcome.message)
        row.update(
            {
                M.STATUS: M.FAILED,
                M.REASON: "; ".join(msgs)[:4000] or "no rank reported",
                M.ERROR_TRACE: failed[0].traceback if failed else None,
            }
        )
        return finish(row, outcome), None
    return row, reports


def finish(row: dict[str, Any], outcome: Outcome) -> dict[str, Any]:
    """The complete row, with the executor's caveat (if any) after the reason."""
    if outcome.note and row.get(M.STATUS) != M.FAILED:
        row[M.REASON] = f"{row.get(M.REASON) or ''} [{outcome.note}]".strip()
    return complete(row)


def check_columns(reports: list[RankReport]) -> tuple[dict[str, Any], list[str]]:
    """Errors (max over ranks) and tolerances of the float64 check, and what exceeded its bound."""
    first = reports[0]
    cols: dict[str, Any] = {M.CHECKED: first.checked}
    bad = []
    for name in first.errors:
        err = worst(r.errors[name] for r in reports)
        assert first.tol_floor is not None, "a checked rank reports the pass rule's parts"
        naive = max(r.naive_err[name] for r in reports)  # the bound over the whole problem
        tol = tolerance(naive, max(r.ref_max[name] for r in reports), first.tol_floor)
        cols[M.ERR[name]], cols[M.TOL[name]] = err, tol
        if not err <= tol:  # also catches NaN
            bad.append(f"{name}: error {err:.3g} > tolerance {tol:.3g}")
    return cols, bad


def timing_columns(samples_ms_per_rank: list[list[float]]) -> dict[str, Any]:
    """Per-iteration time of the group (the slowest rank of each iteration) and its summary."""
    samples = group_samples(samples_ms_per_rank)
    med, lo, hi = summarize(samples)
    return {M.TIME_MS_SAMPLES: samples, M.TIME_MS_MEDIAN: med, M.TIME_MS_MIN: lo, M.TIME_MS_MAX: hi}


def comm_columns(reports: list[RankReport]) -> dict[str, Any]:
    """Bytes one call (or step) moves, max over ranks, and its operations by kind."""
    first = reports[0]
    return {
        # every rank counts its bytes or none does (the same comm): the max over those that do
        M.BYTES_SENT: None
        if first.bytes_sent is None
        else max(r.bytes_sent for r in reports if r.bytes_sent is not None),
        M.BYTES_RECV: None
        if first.bytes_recv is None
        else max(r.bytes_recv for r in reports if r.bytes_recv is not None),
        M.COMM_OPS: json.dumps(first.comm_ops, sort_keys=True),
    }


def breakdown_columns(reports: list[RankReport], total_ms: float) -> dict[str, Any]:
    """Kernel, exposed-communication and bookkeeping split (mean over ranks), compute-only and
    comm-only times (per-iteration max over ranks, median), CCR and overlap efficiency."""
    parts = [r.breakdown for r in reports if r.breakdown is not None]
    if len(parts) < len(reports):
        return {}
    p = len(parts)
    kernel = sum(b.kernel_ms for b in parts) / p
    wait = sum(b.comm_wait_ms for b in parts) / p
    ratio = sum(b.iter_ms / (b.kernel_ms + b.comm_wait_ms) for b in parts if b.kernel_ms + b.comm_wait_ms > 0) / p
    compute = summarize(group_samples([b.compute_only_ms for b in parts]))[0]
    comm = summarize(group_samples([b.comm_only_ms for b in parts]))[0]
    has_comm = any(b.comm_wait_ms > 0 for b in parts) and comm > 0
    return {
        M.KERNEL_MS: kernel,
        M.COMM_WAIT_MS: wait,
        M.OVERHEAD_RATIO: ratio,
        M.COMPUTE_ONLY_MS: compute,
        M.COMM_ONLY_MS: comm if has_comm else None,
        M.CCR: compute / comm if has_comm else None,
        M.OVERLAP_EFF: (compute + comm - total_ms) / min(compute, comm) if has_comm else None,
    }


def redundant_bytes(method, case, rank: int) -> Optional[int]:
    """K/V bytes rank `rank` of `method` receives in one forward of `case` that none of its queries
    attends (`Method.redundant_kv_bytes`), for rows with a mask family or packed documents (more
    than one document in a sequence: causal_document, the commonest real workload, where a ring
    moves most of its K/V to ranks that never read it); None for the plain masks, one document
    per sequence with or without padding (their rows stay as they were recorded), and for methods
    that do not declare it."""
    docs = case.documents
    if docs is None or (docs.mask is None and all(len(ls) == 1 for ls in docs.lengths)):
        return None
    return method.redundant_kv_bytes(case, rank)


def balance_columns(spec: TrialSpec, reports: list[RankReport], padded_len: int) -> dict[str, Any]:
    """Padding, the packed documents, and how evenly the ranks' kernels share the work: visible
    pairs per rank (max, mean, max/mean) and the spread of the measured kernel time."""
    lengths = spec.document_lengths()
    cols: dict[str, Any] = {
        M.PADDED_TOKENS: padded_len - spec.seq_len,
        M.PADDING_FRACTION: (padded_len - spec.seq_len) / padded_len,
        M.DOC_LENGTHS: [list(ls) for ls in lengths] if lengths is not None else None,
        M.DOCS_PER_SEQ: (sum(map(len, lengths)) / len(lengths)) if lengths is not None else 1.0,
    }
    pairs = [r.pairs for r in reports if r.pairs is not None]
    if pairs and len(pairs) == len(reports):
        mean = sum(pairs) / len(pairs)
        cols.update(
            {
                M.PAIRS_MAX: max(pairs),
                M.PAIRS_MEAN: mean,
                M.IMBALANCE: max(pairs) / mean if mean else None,
                M.AREA_GINI: M.gini(pairs),
            }
        )
    redundant = [r.redundant_bytes for r in reports if r.redundant_bytes is not None]
    if redundant and len(redundant) == len(reports):
        cols[M.REDUNDANT_BYTES] = max(redundant)
    kernel = [r.breakdown.kernel_ms for r in reports if r.breakdown is not None]
    if len(kernel) == len(reports) and kernel and sum(kernel) > 0:
        cols[M.KERNEL_SPREAD] = max(kernel) / (sum(kernel) / len(kernel))
    return cols


def worst(errors: Iterable[float]) -> float:
    """Max over ranks that propagates NaN (Python's max() silently drops a NaN after a number)."""
    errors = list(errors)
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


def complete(row: dict[str, Any]) -> dict[str, Any]:
    """Every row has every column (None where not applicable), in the documented order; a variant's
    identity (a value head dim, a soft cap) only where the trial set it, so that other rows keep
    exactly the columns they always had."""
    out = {c: row.get(c) for c in M.COLUMNS}
    out.update({c: row[c] for c in M.VARIANT_IDENTITY if row.get(c) is not None})
    return out
