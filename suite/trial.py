"""One trial: what each rank does (`run_trial`) and how the parent turns the ranks' reports into
one result row (`make_record`).

Per rank: build the method, shard the global inputs by its layout, check out/lse (and dq/dk/dv)
against the float64 reference, run one iteration through a byte-counting comm, warm up, then
time `repeats` iterations. Every rank reports; only the parent writes anything.
"""
from __future__ import annotations

import json
import math
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from methods import kernels
from methods.comm import CommLedger, CountingComm, NullComm, TimingComm
from methods.comm.base import Comm
from suite import metrics as M
from suite.check import ProblemCache, build_problem, max_abs_err
from suite.memtrack import TensorMemoryTracker
from suite.plan import TrialSpec
from suite.timing import group_samples, summarize, time_iterations


@dataclass(frozen=True)
class RunSettings:
    """What a rank needs to run trials (picklable; sent to workers once)."""

    warmup: int
    repeats: int
    check: bool
    check_max_seq_len: int
    seed: int
    breakdown: bool = True


# ---------------------------------------------------------------------------------------------
# On each rank
# ---------------------------------------------------------------------------------------------
def run_trial(spec: TrialSpec, settings: RunSettings, comm: Comm, device: torch.device,
              cache: ProblemCache, *, autograd: bool = True,
              on_prepared: Optional[Callable[[], None]] = None) -> dict[str, Any]:
    """Run `spec` on this rank. Never raises: errors come back as {"ok": False, "error": ...}.

    `autograd=False` computes gradients by calling the method's backward directly
    (`Method.attention_fwd_bwd`): virtual ranks on one GPU need it (see there). `on_prepared` is
    called once the inputs and the float64 reference exist, so that the executor can start the
    trial's time limit there (building a large reference is not the method's time).
    """
    t0 = time.perf_counter()
    try:
        report = _run(spec, settings, comm, device, cache, autograd, on_prepared)
        report["ok"] = True
    except Exception as exc:  # noqa: BLE001 - every failure becomes a recorded row
        oom = device.type == "cuda" and isinstance(exc, torch.cuda.OutOfMemoryError)
        report = {"ok": False, "oom": oom, "error": f"{type(exc).__name__}: {exc}"[:2000],
                  "traceback": traceback.format_exc(limit=30)[-8000:]}
        if oom:
            torch.cuda.empty_cache()
    report["rank"] = comm.rank
    report["wall_s"] = time.perf_counter() - t0
    return report


def _run(spec: TrialSpec, settings: RunSettings, comm: Comm, device: torch.device,
         cache: ProblemCache, autograd: bool, on_prepared: Optional[Callable[[], None]]) -> dict[str, Any]:
    if comm.world_size != spec.world_size:
        raise RuntimeError(f"trial needs world_size {spec.world_size}, comm has {comm.world_size}")
    if spec.pass_ == "train":  # kind: perplexity
        from suite.perplexity.trial import run_train
        return run_train(spec, comm, device, autograd=autograd, on_prepared=on_prepared)
    method = spec.build_method()
    layout = method.layout(spec.case())
    checked = settings.check and spec.seq_len <= settings.check_max_seq_len
    prob = cache.get((spec.problem_key(), checked, settings.seed, str(device)), lambda: build_problem(
        *spec.problem_key(), seed=settings.seed, device=device, with_reference=checked))
    if on_prepared is not None:
        on_prepared()
    rank = comm.rank
    q, k, v, dout = (layout.shard(x, rank) for x in (prob.q, prob.k, prob.v, prob.dout))
    report: dict[str, Any] = {"checked": checked, "errors": {}, "tol": {},
                              "kernel_used": method.kernel_used(device, q.dtype, spec.head_dim)}

    # 1. Correctness against float64 attention on the unsharded inputs.
    if checked:
        if spec.pass_ == "fwd":
            with torch.no_grad():
                out, lse = method.attention(q, k, v, causal=spec.causal, comm=comm, return_lse=True)
            got = {"out": out, "lse": lse}
        elif autograd:
            qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
            out, lse = method.attention(qg, kg, vg, causal=spec.causal, comm=comm, return_lse=True)
            got = {"out": out.detach(), "lse": lse}
            got.update(zip(("dq", "dk", "dv"), torch.autograd.grad(out, (qg, kg, vg), dout)))
        else:
            got = dict(zip(("out", "lse", "dq", "dk", "dv"),
                           method.attention_fwd_bwd(q, k, v, dout, causal=spec.causal, comm=comm)))
        for name, tensor in got.items():
            if tensor is None:  # a peer library that does not return the LSE
                continue
            ref = layout.shard(prob.ref[name], rank, dim=2 if name == "lse" else 1)
            report["errors"][name] = max_abs_err(tensor, ref)
            report["tol"][name] = prob.tolerance(name, spec.world_size)
        del got

    # 2. One iteration through a counting comm: bytes per rank (it is also the first warm-up).
    step = _make_step(method, spec, q, k, v, dout, autograd)
    ledger = CommLedger()
    step(CountingComm(comm, ledger))
    if method.needs_processes:  # a peer library talks to torch.distributed itself: nothing was counted
        report["bytes_sent"] = report["bytes_recv"] = None
        report["comm_ops"] = {}
    else:
        report["bytes_sent"], report["bytes_recv"] = ledger.bytes_sent, ledger.bytes_recv
        report["comm_ops"] = dict(sorted(ledger.counts().items()))

    # 3. Warm-up, then timed repeats. Peak memory: what an iteration allocates beyond what was
    #    alive before it (CUDA allocator statistics over the timed iterations; on CPU one untimed
    #    iteration under a tracker that sees every tensor allocation).
    for _ in range(max(0, settings.warmup - 1)):
        step(comm)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    report["samples_ms"] = time_iterations(lambda: step(comm), comm=comm, repeats=settings.repeats, device=device)
    if device.type == "cuda":
        report["peak_mem"] = torch.cuda.max_memory_allocated(device) - base
    else:
        with TensorMemoryTracker() as tracker:
            step(comm)
        report["peak_mem"] = tracker.peak_bytes

    # 4. Where the time goes (after timing, so it cannot disturb the timed samples).
    if settings.breakdown and not method.needs_processes:  # the split needs the suite's comm and kernels
        report.update(_breakdown(method, step, comm, device, settings.repeats))
    return report


def _breakdown(method, step, comm: Comm, device: torch.device, repeats: int) -> dict[str, Any]:
    """Time split of one rank (DESIGN.md 7):

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
            if device.type == "cuda":  # start the clock once the barrier has really completed
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            step(tcomm)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            split.append((time.perf_counter() - t0, timed.seconds, tcomm.seconds))
        total_s, kernel_s, wait_s = sorted(split)[len(split) // 2]
        method.kernel = kernel
        null = NullComm(comm.rank, comm.world_size)
        compute_only = time_iterations(lambda: step(null), comm=comm, repeats=repeats, device=device)
        method.kernel = kernels.NOOP
        comm_only = time_iterations(lambda: step(comm), comm=comm, repeats=repeats, device=device)
    finally:
        method.kernel = kernel
    return {"iter_ms": total_s * 1e3, "kernel_ms": kernel_s * 1e3, "comm_wait_ms": wait_s * 1e3,
            "compute_only_ms": compute_only, "comm_only_ms": comm_only}


def _make_step(method, spec: TrialSpec, q, k, v, dout, autograd: bool):
    """The timed unit: forward without an autograd graph, or forward + backward."""
    if spec.pass_ == "fwd":
        def step(c: Comm) -> None:
            with torch.no_grad():
                method.attention(q, k, v, causal=spec.causal, comm=c)
        return step
    if not autograd:
        def step(c: Comm) -> None:
            method.attention_fwd_bwd(q, k, v, dout, causal=spec.causal, comm=c)
        return step
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))

    def step(c: Comm) -> None:
        out = method.attention(qg, kg, vg, causal=spec.causal, comm=c)
        torch.autograd.grad(out, (qg, kg, vg), dout)
    return step


# ---------------------------------------------------------------------------------------------
# In the parent
# ---------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What the executor saw of one trial: every rank's report, or why not."""

    kind: str                                  # "reported", "failed", "timeout"
    reports: list[Optional[dict]]
    message: str = ""


def _base_record(spec: TrialSpec, settings: RunSettings, run_id: str, started_at: str) -> dict[str, Any]:
    rec = {M.KEY: spec.key, **spec.identity()}
    rec.update({M.SEED: settings.seed, M.WARMUP: settings.warmup, M.REPEATS: settings.repeats,
                M.STARTED_AT: started_at, M.RUN_ID: run_id, M.CHECKED: False})
    return rec


def skipped_record(spec: TrialSpec, reason: str, settings: RunSettings, run_id: str, started_at: str) -> dict:
    rec = _base_record(spec, settings, run_id, started_at)
    rec.update({M.STATUS: M.SKIPPED, M.REASON: reason})
    return _complete(rec)


def make_record(spec: TrialSpec, outcome: Outcome, settings: RunSettings, run_id: str, started_at: str,
                wall_s: float) -> dict[str, Any]:
    """One result row from the ranks' reports (max over ranks for errors, times and bytes)."""
    rec, reports = begin_record(spec, outcome, settings, run_id, started_at, wall_s)
    if reports is None:
        return rec
    first = reports[0]
    rec[M.CHECKED] = first["checked"]
    rec[M.KERNEL_USED] = first["kernel_used"]
    bad = []
    for name in first["errors"]:
        err = _worst(r["errors"][name] for r in reports)
        tol = first["tol"][name]
        rec[M.ERR[name]], rec[M.TOL[name]] = err, tol
        if not err <= tol:  # also catches NaN
            bad.append(f"{name}: error {err:.3g} > tolerance {tol:.3g}")
    samples = group_samples([r["samples_ms"] for r in reports])
    med, lo, hi = summarize(samples)
    flops = M.attention_flops(spec.batch, spec.seq_len, spec.heads, spec.head_dim, spec.causal, spec.pass_)
    if "kernel_ms" in first:
        rec.update(_breakdown_columns(reports, med))
    rec.update({
        M.TIME_MS_SAMPLES: samples, M.TIME_MS_MEDIAN: med, M.TIME_MS_MIN: lo, M.TIME_MS_MAX: hi,
        M.TFLOPS_PER_GPU: M.tflops_per_gpu(flops, med / 1e3, spec.world_size),
        M.TOKENS_PER_S: M.tokens_per_s(spec.batch, spec.seq_len, med / 1e3),
        M.BYTES_SENT: None if first["bytes_sent"] is None else max(r["bytes_sent"] for r in reports),
        M.BYTES_RECV: None if first["bytes_recv"] is None else max(r["bytes_recv"] for r in reports),
        M.COMM_OPS: json.dumps(first["comm_ops"], sort_keys=True),
        M.PEAK_MEM: max(r["peak_mem"] for r in reports) if first["peak_mem"] is not None else None,
        M.STATUS: M.INCORRECT if bad else M.OK,
        M.REASON: "; ".join(bad) if bad else "",
    })
    return _complete(rec)


def begin_record(spec: TrialSpec, outcome: Outcome, settings: RunSettings, run_id: str, started_at: str,
                 wall_s: float) -> tuple[dict[str, Any], Optional[list[dict]]]:
    """(the row so far, every rank's report), or (the finished row of a failed or timed-out
    trial, None)."""
    rec = _base_record(spec, settings, run_id, started_at)
    rec[M.DURATION_S] = wall_s
    failed = _failure(rec, outcome)
    if failed is not None:
        return failed, None
    return rec, [r for r in outcome.reports if r is not None]


def _failure(rec: dict[str, Any], outcome: Outcome) -> Optional[dict[str, Any]]:
    """The row of a trial that timed out or failed on any rank, or None if every rank reported."""
    reports = [r for r in outcome.reports if r is not None]
    failed = [r for r in reports if not r.get("ok")]
    if outcome.kind == "timeout" and not failed:
        rec.update({M.STATUS: M.TIMEOUT, M.REASON: outcome.message})
        return _complete(rec)
    if failed or outcome.kind == "failed" or not reports:
        msgs = [f"rank {r['rank']}: {'out of memory: ' if r.get('oom') else ''}{r['error']}" for r in failed]
        if outcome.message:
            msgs.append(outcome.message)
        rec.update({M.STATUS: M.FAILED, M.REASON: "; ".join(msgs)[:4000] or "no rank reported",
                    M.ERROR_TRACE: failed[0]["traceback"] if failed else None})
        return _complete(rec)
    return None


def _breakdown_columns(reports: list[dict], total_ms: float) -> dict[str, Any]:
    """Kernel, exposed-communication and bookkeeping split (mean over ranks), compute-only and
    comm-only times (per-iteration max over ranks, median), CCR and overlap efficiency."""
    p = len(reports)
    kernel = sum(r["kernel_ms"] for r in reports) / p
    wait = sum(r["comm_wait_ms"] for r in reports) / p
    ratio = sum(r["iter_ms"] / (r["kernel_ms"] + r["comm_wait_ms"]) for r in reports
                if r["kernel_ms"] + r["comm_wait_ms"] > 0) / p
    compute = summarize(group_samples([r["compute_only_ms"] for r in reports]))[0]
    comm = summarize(group_samples([r["comm_only_ms"] for r in reports]))[0]
    has_comm = any(r["comm_wait_ms"] > 0 for r in reports) and comm > 0
    return {M.KERNEL_MS: kernel, M.COMM_WAIT_MS: wait, M.OVERHEAD_RATIO: ratio,
            M.COMPUTE_ONLY_MS: compute, M.COMM_ONLY_MS: comm if has_comm else None,
            M.CCR: compute / comm if has_comm else None,
            M.OVERLAP_EFF: (compute + comm - total_ms) / min(compute, comm) if has_comm else None}


def _worst(errors) -> float:
    """Max over ranks that propagates NaN (Python's max() silently drops a NaN after a number)."""
    errors = list(errors)
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


def _complete(rec: dict[str, Any]) -> dict[str, Any]:
    """Every row has every column (None where not applicable), in the documented order."""
    return {c: rec.get(c) for c in M.COLUMNS}
