"""Trace a method's schedule by running its real code on `meta` tensors with P virtual ranks.

Nothing is computed: tensors have shapes and dtypes but no storage, the block kernel is replaced by
one that records each call (`Compute`: which block, its mask, its FLOPs) and returns placeholders,
and the comm is a counting comm (`methods/comm/counting.py`, so bytes follow the suite's one
convention) that also records when each exchange is waited for. The result is, per rank, the
ordered events the simulator replays (suite/sim/ledger.py: `Compute`, `CommRecord` with a handle
id for exchanges, `Wait`, and `Memory`, the method's own tensor work between them). Since it is the
method's own code that runs, a trace cannot drift from the method. A peer library's code runs the
same way behind a fake torch.distributed (suite/sim/peers.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Optional

import torch

import methods
from methods import kernels
from methods.base import Case
from methods.comm import run_threads
from methods.comm.counting import CommRecord
from suite.sim.ledger import Compute, Event, Memory, Trace, TraceLedger, TracingComm, TracingKernel, _Bookkeeping


@contextlib.contextmanager
def one_torch_thread():
    """Run the block with torch's intra-op pool at one thread. Nothing the simulator runs is worth
    parallelising (meta tensors, small index arithmetic of the plans), and the pool's hand-offs cost
    more CPU than the work: the advisor's pruning took 4.0 s of CPU with torch's two threads and 0.3 s
    with one, 24 s and 2.7 s of wall time on a loaded 2-core machine. torch's setting is per process,
    so it is restored after the block."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def traced_method(method_name: str, options: Optional[dict[str, Any]] = None) -> methods.Method:
    """`method_name` as the tracer runs it: an own method as it is, a peer library's adapter made
    the simulator's (its library's own code, traced behind a fake torch.distributed with a
    flash-attn stand-in: suite/sim/peers.py). ValueError if a peer cannot be traced, with why."""
    method = methods.get_method(method_name, **dict(options or {}))
    if method.needs_processes:
        from suite.sim import peers

        peers.prepare(method)
    return method


def trace(
    method_name: str, case: Case, pass_: str = "fwd", options: Optional[dict[str, Any]] = None, timeout_s: float = 120.0
) -> Trace:
    """Run `method_name` on `case` with `case.world_size` virtual ranks on meta tensors and record
    each rank's schedule. `pass_`: "fwd" or "fwd_bwd". Raises ValueError if the method does not
    support the case (the reason)."""
    options = dict(options or {})
    probe = traced_method(method_name, options)
    ok, why = probe.supports(replace(case, device="cpu"))
    if not ok:
        raise ValueError(why)
    layout = probe.layout(case)
    dtype = case.torch_dtype
    meta: dict[str, Any] = dict(device="meta", dtype=dtype)
    q = torch.empty(case.batch, case.seq_len, case.heads, case.head_dim, **meta)
    kv = torch.empty(case.batch, case.seq_len, case.kv_heads, case.head_dim, **meta)
    # the values, and the output's gradient, have the values' head dim (MLA: narrower than q/k's)
    v = torch.empty(case.batch, case.seq_len, case.kv_heads, case.dv, **meta)
    dout = torch.empty(case.batch, case.seq_len, case.heads, case.dv, **meta)
    if probe.needs_processes:  # a peer library: its own code behind a fake torch.distributed
        from suite.sim import peers

        per_rank = peers.run_ranks(lambda: traced_method(method_name, options), case, pass_, q, kv, layout, timeout_s)
        return Trace(method_name, options, case, pass_, [e for e, _ in per_rank], [n for _, n in per_rank])

    def rank_fn(comm) -> tuple[list[Event], int]:
        ledger = TraceLedger()
        method = methods.get_method(method_name, **options)  # one per rank: its kernel is per rank
        method.kernel = TracingKernel(ledger)
        c = TracingComm(comm, ledger)
        ql, kl, vl, dl = (layout.shard(x, comm.rank) for x in (q, kv, v, dout))
        scale = kernels.with_softcap(kernels.default_scale(case.head_dim), case.softcap)
        extra: dict[str, Any] = {"docs": case.documents} if case.documents is not None else {}
        # with sinks, what `attention` runs: the fold, and the LSE it asks for (the sinks' gradient
        # reads it; Ulysses then brings it back); dsink itself is a small [B, H, S] reduction
        sinks: dict[str, Any] = {"sinks": torch.zeros(case.heads, device="meta")} if case.sinks else {}
        # what `attention` + autograd run (no LSE asked for without sinks: it can cost messages)
        with torch.no_grad(), _Bookkeeping(ledger):
            _, _, residuals = method.forward(
                ql, kl, vl, comm=c, causal=case.causal, scale=scale, return_lse=case.sinks, **extra, **sinks
            )
            ledger.flush()
            forward_end = len(ledger.events)
            if pass_ == "fwd_bwd":
                method.backward(dl, residuals, comm=c, causal=case.causal, scale=scale, **extra)
        ledger.flush()
        return ledger.events, forward_end

    per_rank = run_threads(case.world_size, rank_fn, timeout_s=timeout_s)
    return Trace(method_name, options, case, pass_, [e for e, _ in per_rank], [n for _, n in per_rank])


# ---------------------------------------------------------------------------------------------
# Trace once per schedule shape
# ---------------------------------------------------------------------------------------------
def template_seq_len(method_name: str, case: Case, options: Optional[dict[str, Any]] = None) -> Optional[int]:
    """The shortest sequence s0 whose schedule has the shape of `case`'s, or None: s0 is a multiple
    of 4P (every layout's chunking, with chunks of at least two tokens: a size-1 dimension changes
    which copies torch makes) that divides `case.seq_len`, with 2 * s0 <= seq_len, and the method
    supports it (e.g. TASP needs multiples of 2P(P-1)). See `extrapolate`."""
    probe = traced_method(method_name, options)
    unit = 4 * case.world_size
    for mult in range(1, 129):
        s0 = unit * mult
        if 2 * s0 > case.seq_len:
            break
        if case.seq_len % s0 == 0 and probe.supports(replace(case, seq_len=s0, device="cpu"))[0]:
            return s0
    return None


TEMPLATE_BATCHES = (2, 4)  # not 1: a batch of one makes some copies no-ops (batch-1 points get their own)


def extrapolate(traces: dict[tuple[int, int], Trace], batch: int, seq_len: int) -> Trace:
    """The trace at `batch` x `seq_len` from four traces of the same schedule at two batches and two
    sequence lengths, keyed (batch, seq_len). Every token count and mask offset of a schedule is an
    affine function of the sequence length at a fixed chunking (a stripe's diagonal offset stays -1,
    a block's length grows), and every byte count a bilinear function of batch and length (index
    tensors grow with the length alone), so each number is extrapolated from the four traces. The
    tests check the result against direct traces, event for event."""
    (b1, s1), (b2, s2) = min(traces), max(traces)
    if b1 == b2:  # traced at the point's own batch (batch 1): extrapolate in the length alone
        if batch != b1:
            raise ValueError(f"traces at batch {b1} extrapolate only to batch {b1}, not {batch}")
        b2 = b1 + 1
        traces = {**traces, (b2, s1): traces[(b1, s1)], (b2, s2): traces[(b1, s2)]}  # no batch dependence
    t11, t12, t21, t22 = traces[(b1, s1)], traces[(b1, s2)], traces[(b2, s1)], traces[(b2, s2)]
    name = t11.method

    def exact(num: int, den: int, what) -> int:
        if num % den:
            raise ValueError(f"schedule of {name} is not affine in batch and length ({what})")
        return num // den

    def lin(x: int, y: int) -> int:  # affine in the length
        return x + exact((y - x) * (seq_len - s1), s2 - s1, (x, y))

    def bil(v11: int, v12: int, v21: int, v22: int) -> int:  # bilinear in batch and length
        db, ds = batch - b1, seq_len - s1
        return (
            v11
            + exact((v21 - v11) * db, b2 - b1, (v11, v21))
            + exact((v12 - v11) * ds, s2 - s1, (v11, v12))
            + exact((v22 - v21 - v12 + v11) * db * ds, (b2 - b1) * (s2 - s1), (v11, v12, v21, v22))
        )

    def one(e: Event, f: Event, g: Event, h: Event) -> Event:
        if not type(e) is type(f) is type(g) is type(h):
            raise ValueError(f"traces of {name} at different sizes differ in structure")
        # f, g, h are of e's type (checked above)
        if isinstance(e, Compute):
            assert isinstance(f, Compute)
            if (e.causal_offset is None) != (f.causal_offset is None):
                raise ValueError(f"traces of {name} at different sizes differ in structure (a causal offset)")
            off = None if e.causal_offset is None or f.causal_offset is None else lin(e.causal_offset, f.causal_offset)
            return replace(e, batch=batch, sq=lin(e.sq, f.sq), sk=lin(e.sk, f.sk), causal_offset=off)
        if isinstance(e, CommRecord):
            assert isinstance(f, CommRecord) and isinstance(g, CommRecord) and isinstance(h, CommRecord)
            if any(x.kind != e.kind or x.peers != e.peers or x.per_peer.keys() != e.per_peer.keys() for x in (f, g, h)):
                raise ValueError(f"traces of {name} at different sizes talk to different peers")

            def side(p: int, i: int) -> int:
                return bil(e.per_peer[p][i], f.per_peer[p][i], g.per_peer[p][i], h.per_peer[p][i])

            per_peer = {p: (side(p, 0), side(p, 1)) for p in e.per_peer}
            return CommRecord(
                e.kind,
                bil(e.bytes_sent, f.bytes_sent, g.bytes_sent, h.bytes_sent),
                bil(e.bytes_recv, f.bytes_recv, g.bytes_recv, h.bytes_recv),
                e.peers,
                per_peer,
            )
        if isinstance(e, Memory):
            assert isinstance(f, Memory) and isinstance(g, Memory) and isinstance(h, Memory)
            if not e.ops == f.ops == g.ops == h.ops:
                raise ValueError(f"traces of {name} at different sizes do different tensor work")
            return Memory(bil(e.bytes, f.bytes, g.bytes, h.bytes), e.ops)
        if not e == f == g == h:
            raise ValueError(f"traces of {name} at different sizes wait differently")
        return e

    if (
        not [len(r) for r in t11.ranks]
        == [len(r) for r in t12.ranks]
        == [len(r) for r in t21.ranks]
        == [len(r) for r in t22.ranks]
    ):
        raise ValueError(f"traces of {name} at different sizes differ in structure")
    return Trace(
        name,
        t11.options,
        replace(t11.case, batch=batch, seq_len=seq_len),
        t11.pass_,
        [[one(*evs) for evs in zip(*ranks)] for ranks in zip(t11.ranks, t12.ranks, t21.ranks, t22.ranks)],
        t11.forward_end,
    )


class TraceCache:
    """Traces for many sweep points from four small traces per schedule shape (method, options,
    world size, mask, pass, heads, head dim, dtype): a 200-point sweep costs a few dozen traces."""

    def __init__(self, timeout_s: float = 120.0):
        # how long one trace's virtual ranks may run before it counts as a hang: the sweep's
        # run.timeout_s (a schedule of 16 ranks x 128 chunks takes minutes on 2 cores)
        self.timeout_s = float(timeout_s)
        self._templates: dict[tuple, dict[tuple[int, int], Trace]] = {}
        # cases traced as they are (packed documents, padding, document sharding): the same case is
        # asked for once per topology of a sweep, and a trace does not depend on the topology
        self._direct: dict[tuple, Trace] = {}
        self.traced = 0

    def _trace_directly(self, method_name: str, case: Case, pass_: str, options: dict[str, Any]) -> Trace:
        key = (method_name, case, pass_, tuple(sorted(options.items())))
        if key not in self._direct:
            self.traced += 1
            self._direct[key] = trace(method_name, case, pass_, options, self.timeout_s)
        return self._direct[key]

    def get(self, method_name: str, case: Case, pass_: str, options: Optional[dict[str, Any]] = None) -> Trace:
        options = dict(options or {})
        s0 = template_seq_len(method_name, case, options)
        # packed documents (or padding) give every length its own masks: trace the case itself
        if s0 is None or case.documents is not None:  # (or too short to have a smaller template)
            return self._trace_directly(method_name, case, pass_, options)
        # the shape key: s0 itself is in it (a different chunking is a different schedule)
        batches = (1,) if case.batch == 1 else TEMPLATE_BATCHES
        # one fwd_bwd trace serves both passes (the forward pass is its first part), unless the
        # method has no backward for this case
        traced_pass = "fwd" if traced_method(method_name, options).forward_only_reason(case) else "fwd_bwd"
        if pass_ == "fwd_bwd" and traced_pass == "fwd":
            raise ValueError(f"{method_name} has no backward for this case")
        key = (
            method_name,
            traced_pass,
            tuple(sorted(options.items())),
            case.world_size,
            case.causal,
            case.heads,
            case.kv_heads,
            case.head_dim,
            case.dtype,
            s0,
            batches,
            case.sinks,
        )
        if key not in self._templates:
            self._templates[key] = {
                (b, s): trace(method_name, replace(case, batch=b, seq_len=s), traced_pass, options, self.timeout_s)
                for b in batches
                for s in (s0, 2 * s0)
            }
            self.traced += len(self._templates[key])
        if any(
            e.doc_pairs is not None
            for t in self._templates[key].values()
            for r in t.ranks
            for e in r
            if isinstance(e, Compute)
        ):
            # a method that masks by documents even without packed ones (sharding by documents):
            # its block masks do not scale with the length; trace the case itself
            return self._trace_directly(method_name, case, pass_, options)
        full = extrapolate(self._templates[key], case.batch, case.seq_len)
        return full if pass_ == "fwd_bwd" else full.forward_part()
