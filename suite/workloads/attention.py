"""The attention workload (kind: attention): one sequence-parallel attention call per trial.

Per rank: build the method, shard the global inputs by its layout, check out/lse (and dq/dk/dv)
against the float64 reference, run one iteration through a byte-counting comm, warm up, then time
`repeats` iterations, then split one iteration's time (kernels, blocked on communication, the
rest). The parent's row takes the worst rank for errors, times and bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from methods import kernels, merge
from methods.comm import CommLedger, CountingComm, NullComm, TimingComm
from methods.comm.base import Comm
from methods.stopwatch import Stopwatch
from suite import metrics as M
from suite.check import INPUT_NAMES, max_abs_err, pass_floor
from suite.memtrack import TensorMemoryTracker
from suite.plan import TrialSpec
from suite.records import (
    Breakdown,
    Outcome,
    RankReport,
    RowContext,
    balance_columns,
    begin_row,
    breakdown_columns,
    check_columns,
    comm_columns,
    finish,
    redundant_bytes,
    timing_columns,
)
from suite.reference import build_sharded_problem
from suite.timing import time_iterations
from suite.workloads.base import RankContext, Workload


class AttentionWorkload(Workload):
    kind = "attention"

    def run_rank(self, spec: TrialSpec, ctx: RankContext) -> RankReport:
        comm, device, settings = ctx.comm, ctx.device, ctx.settings
        method = spec.build_method()
        case = spec.run_case(method)  # padded to the method's granule, with any documents
        docs = case.documents
        layout = method.layout(case)
        checked = settings.check and spec.seq_len <= settings.check_max_seq_len
        true_docs = spec.documents()  # the true length's documents and mask (None: plain, unpacked)
        problem = spec.problem_key()
        prob = ctx.cache.get(
            (problem, checked, settings.seed, str(device)),
            lambda: build_sharded_problem(
                *problem.args,
                seed=settings.seed,
                device=device,
                with_reference=checked,
                documents=true_docs,
                sinks=spec.sinks,
                head_dim_v=spec.head_dim_v,
                softcap=spec.softcap,
            ),
        )
        rank = comm.rank
        positions = layout.positions(rank)  # padding (>= seq_len) comes as zeros
        q, k, v, dout = (prob.source.rows(name, positions) for name in INPUT_NAMES)
        expected = None
        if checked:
            assert prob.reference is not None  # built with_reference=checked
            expected = prob.reference.shard(positions, grads=spec.pass_ == "fwd_bwd")
        ctx.prepared()
        real = positions < spec.seq_len  # this rank's rows that are not padding
        used = method.kernel_used(device, q.dtype, spec.head_dim, head_dim_v=spec.head_dim_v, softcap=spec.softcap)
        report = RankReport(rank=rank, checked=checked, kernel_used=used, padded_len=case.seq_len)
        # the sink logits are drawn in float32; as a float64 leaf for float64 inputs their gradient
        # keeps the precision the methods compute it in (a leaf's gradient takes the leaf's dtype,
        # and float32 shares summed over ranks put dsink off by several float32 roundings)
        sinks = None if prob.sinks is None else prob.sinks.to(merge.acc_dtype(q.dtype))

        # 1. Correctness against float64 attention on the unsharded inputs (padding rows excluded),
        #    this rank's rows of it computed in tiles (suite/reference.py); the row's parent puts
        #    the pass rule's bound together from every rank's part.
        if expected is not None:
            report.tol_floor = pass_floor(q.dtype, spec.seq_len, spec.world_size)
            report.naive_err, report.ref_max = expected.naive_err, expected.ref_max
            for name, tensor in _outputs(method, spec, q, k, v, dout, comm, ctx.autograd, docs, sinks).items():
                if tensor is None:  # a peer library that does not return the LSE
                    continue
                ref = expected.ref[name]
                if name == "dsink":  # [H]: every rank's share summed, the same on every rank
                    report.errors[name] = max_abs_err(tensor, ref)
                    continue
                dim = 2 if name == "lse" else 1
                report.errors[name] = max_abs_err(tensor.index_select(dim, _where(real, tensor)), ref)

        # 2. One iteration through a counting comm and a pair-counting kernel: bytes per rank, and
        #    the (query, key) pairs this rank's kernels compute (it is also the first warm-up).
        step = _make_step(method, spec, q, k, v, dout, ctx.autograd, docs, sinks)
        ledger = CommLedger()
        kernel = method.kernel
        assert isinstance(kernel, str)  # the configured name: nothing wraps it between trials
        method.kernel = pairs = kernels.PairCountingKernel(kernel)
        try:
            step(CountingComm(comm, ledger))
        finally:
            method.kernel = kernel
        report.pairs = pairs.pairs if not method.needs_processes else None
        report.redundant_bytes = redundant_bytes(method, case, rank)
        if not method.needs_processes:  # a peer library talks to torch.distributed itself: nothing was counted
            report.bytes_sent, report.bytes_recv = ledger.bytes_sent, ledger.bytes_recv
            report.comm_ops = dict(sorted(ledger.counts().items()))

        # 3. Warm-up, then timed repeats. Peak memory: what an iteration allocates beyond what was
        #    alive before it (CUDA allocator statistics over the timed iterations; on CPU one untimed
        #    iteration under a tracker that sees every tensor allocation).
        for _ in range(max(0, settings.warmup - 1)):
            step(comm)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        report.samples_ms = time_iterations(lambda: step(comm), comm=comm, repeats=settings.repeats, device=device)
        if device.type == "cuda":
            report.peak_mem = torch.cuda.max_memory_allocated(device) - base
        else:
            with TensorMemoryTracker() as tracker:
                step(comm)
            report.peak_mem = tracker.peak_bytes

        # 4. Where the time goes (after timing, so it cannot disturb the timed samples).
        if settings.breakdown and not method.needs_processes:  # the split needs the suite's comm and kernels
            report.breakdown = _breakdown(method, step, comm, device, settings.repeats)
        return report

    def row(self, spec: TrialSpec, outcome: Outcome, ctx: RowContext, started_at: str, wall_s: float) -> dict[str, Any]:
        """One result row from the ranks' reports (max over ranks for errors, times and bytes)."""
        row, reports = begin_row(spec, outcome, ctx, started_at, wall_s)
        if reports is None:
            return row
        checks, bad = check_columns(reports)
        row.update(checks)
        row.update(timing_columns([r.samples_ms for r in reports]))
        med = row[M.TIME_MS_MEDIAN]
        docs = spec.documents()
        if docs is None:  # padding (if any) excluded: the convention on the true length
            flops = M.attention_flops(
                spec.batch, spec.seq_len, spec.heads, spec.head_dim, spec.causal, spec.pass_, spec.head_dim_v
            )
        else:  # packed documents or a mask family: their exact visible pairs
            everything = torch.arange(spec.seq_len)
            pairs = docs.visible_pairs(everything, everything, spec.causal)
            flops = M.pairs_flops(pairs, spec.heads, spec.head_dim, spec.pass_, spec.head_dim_v)
        # the padding as the ranks ran it: the parent built the method once already, to ask `supports`
        padded = reports[0].padded_len
        row.update(balance_columns(spec, reports, padded or spec.run_case(spec.build_method()).seq_len))
        row.update(breakdown_columns(reports, med))
        row.update(comm_columns(reports))
        peaks = [r.peak_mem for r in reports]
        row.update(
            {
                M.KERNEL_USED: reports[0].kernel_used,
                M.TFLOPS_PER_GPU: M.tflops_per_gpu(flops, med / 1e3, spec.world_size),
                M.TOKENS_PER_S: M.tokens_per_s(spec.batch, spec.seq_len, med / 1e3),
                M.PEAK_MEM: max(p for p in peaks if p is not None) if None not in peaks else None,
                M.SIM_ERROR_PCT: reports[0].sim_error_pct,
                M.STATUS: M.INCORRECT if bad else M.OK,
                M.REASON: "; ".join(bad),
            }
        )
        row[M.SIM_BAND] = M.sim_band_label(row)  # a simulated row: its band, or "unvalidated"
        return finish(row, outcome)


def _extra(spec: TrialSpec, docs, sinks=None, scale=None) -> dict[str, Any]:
    """Keyword arguments of a method's attention call beyond the plain ones, only when set: peer
    adapters take neither documents, sinks nor a cap (they refuse such trials in `supports`).
    `scale`: a softmax scale other than 1/sqrt(head_dim) (the option-flip probe's, suite/flips.py)."""
    extra: dict[str, Any] = {"docs": docs} if docs is not None else {}
    if scale is not None:
        extra["softmax_scale"] = scale
    if spec.softcap:
        extra["softcap"] = spec.softcap
    if sinks is not None:
        extra["sinks"] = sinks
    return extra


def _where(real: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return real.nonzero().flatten().to(like.device)


def _outputs(
    method, spec: TrialSpec, q, k, v, dout, comm: Comm, autograd: bool, docs, sinks=None, scale=None
) -> dict[str, Any]:
    """out, lse (and dq, dk, dv for fwd_bwd, and dsink with sinks) of one call on this rank's shards
    (`scale`: the softmax scale, None: 1/sqrt(head_dim)).

    dsink: a rank's gradient of the sinks is its own rows' share (methods/base.py `attention`);
    the check sums the shares over the ranks here, outside the counted and timed calls, so the
    methods' byte formulas stay those of one attention call."""
    extra = _extra(spec, docs, sinks, scale)
    if spec.pass_ == "fwd":
        with torch.no_grad():
            out, lse = method.attention(q, k, v, causal=spec.causal, comm=comm, return_lse=True, **extra)
        return {"out": out, "lse": lse}
    names = ("out", "lse", "dq", "dk", "dv", "dsink")
    if not autograd:
        got = dict(zip(names, method.attention_fwd_bwd(q, k, v, dout, causal=spec.causal, comm=comm, **extra)))
    else:
        qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
        leaves: tuple[torch.Tensor, ...] = (qg, kg, vg)
        if sinks is not None:
            extra["sinks"] = sinks.detach().clone().requires_grad_()
            leaves += (extra["sinks"],)
        out, lse = method.attention(qg, kg, vg, causal=spec.causal, comm=comm, return_lse=True, **extra)
        got = {"out": out.detach(), "lse": lse}
        got.update(zip(names[2:], torch.autograd.grad(out, leaves, dout)))
    if "dsink" in got:
        comm.all_reduce(got["dsink"])
    return got


def _breakdown(method, step, comm: Comm, device: torch.device, repeats: int) -> Breakdown:
    """Time split of one rank:

    - `repeats` iterations with a timed kernel and a timing comm: time in block kernels, time
      blocked in communication, and the iteration's total (the rest is the method's own
      bookkeeping); the iteration with the median total is reported;
    - compute-only: `repeats` iterations with communication replaced by a no-op comm;
    - comm-only: `repeats` iterations with the block kernels replaced by no-ops.
    """
    kernel = method.kernel
    split = []  # (total, kernel, comm wait) seconds per iteration
    try:
        for _ in range(repeats):
            timed, tcomm = kernels.TimedKernel(kernel), TimingComm(comm, device)
            method.kernel = timed
            comm.barrier()
            watch = Stopwatch(device)
            with watch.region():
                step(tcomm)
            split.append((watch.seconds, timed.seconds, tcomm.seconds))
        total_s, kernel_s, wait_s = sorted(split)[len(split) // 2]
        method.kernel = kernel
        null = NullComm(comm.rank, comm.world_size)
        compute_only = time_iterations(lambda: step(null), comm=comm, repeats=repeats, device=device)
        method.kernel = kernels.NOOP
        comm_only = time_iterations(lambda: step(comm), comm=comm, repeats=repeats, device=device)
    finally:
        method.kernel = kernel
    return Breakdown(
        iter_ms=total_s * 1e3,
        kernel_ms=kernel_s * 1e3,
        comm_wait_ms=wait_s * 1e3,
        compute_only_ms=compute_only,
        comm_only_ms=comm_only,
    )


def _make_step(method, spec: TrialSpec, q, k, v, dout, autograd: bool, docs, sinks=None):
    """The timed unit: forward without an autograd graph, or forward + backward (with the sinks'
    gradient when there are sinks)."""
    extra = _extra(spec, docs, sinks)
    if spec.pass_ == "fwd":

        def forward_step(c: Comm) -> None:
            with torch.no_grad():
                method.attention(q, k, v, causal=spec.causal, comm=c, **extra)

        return forward_step
    if not autograd:

        def fused_step(c: Comm) -> None:
            method.attention_fwd_bwd(q, k, v, dout, causal=spec.causal, comm=c, **extra)

        return fused_step
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    leaves: tuple[torch.Tensor, ...] = (qg, kg, vg)
    if sinks is not None:
        extra["sinks"] = sinks.detach().clone().requires_grad_()
        leaves += (extra["sinks"],)

    def step(c: Comm) -> None:
        out = method.attention(qg, kg, vg, causal=spec.causal, comm=c, **extra)
        torch.autograd.grad(out, leaves, dout)

    return step
