"""Trace a method's schedule by running its real code on `meta` tensors with P virtual ranks.

Nothing is computed: tensors have shapes and dtypes but no storage, the block kernel is replaced by
one that records each call (`Compute`: which block, its mask, its FLOPs) and returns placeholders,
and the comm is a counting comm (`methods/comm/counting.py`, so bytes follow the suite's one
convention) that also records when each exchange is waited for. The result is, per rank, the
ordered events the simulator replays: `Compute`, `CommRecord` (with a handle id for exchanges)
and `Wait`. Since it is the method's own code that runs, a trace cannot drift from the method.

FLOPs per block follow flash-attention's convention on the *visible* (query, key) pairs of the
block: forward 4 * B * H * D * pairs, backward 2.5x that.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

import methods
from methods import kernels
from methods.base import Case, dtype_name
from methods.comm import CommLedger, CountingComm, run_threads
from methods.comm.base import Work
from methods.comm.counting import CommRecord


@dataclass(frozen=True)
class Compute:
    """One block-kernel call."""

    op: str                      # "fwd" or "bwd"
    batch: int
    sq: int
    sk: int
    heads: int
    kv_heads: int
    head_dim: int
    causal_offset: Optional[int]
    dtype: str
    pairs: int                   # visible (query, key) pairs of one head of one batch element
    flops: float


@dataclass(frozen=True)
class Wait:
    """The rank blocks until exchange `handle` (the index of its CommRecord event) completes."""

    handle: int


Event = Union[Compute, CommRecord, Wait]


def visible_pairs(sq: int, sk: int, causal_offset: Optional[int]) -> int:
    """(i, j) pairs with j <= i + causal_offset (all sq * sk pairs when None)."""
    if causal_offset is None:
        return sq * sk
    c = causal_offset
    i1 = min(max(-c, 0), sq)              # first query that sees a key
    i2 = min(max(sk - c - 1, i1), sq)     # first query that sees every key
    partial = (i2 - i1) * (c + 1) + (i1 + i2 - 1) * (i2 - i1) // 2
    return partial + (sq - i2) * sk


class _Tap(list):
    """The ledger's record list that also appends every record to the event list."""

    def __init__(self, events: list):
        super().__init__()
        self._events = events

    def append(self, record: CommRecord) -> None:
        super().append(record)
        self._events.append(record)


class TraceLedger(CommLedger):
    """A comm ledger (bytes, per peer) plus the ordered events of one rank."""

    def __init__(self):
        super().__init__()
        self.events: list[Event] = []
        self.records = _Tap(self.events)


class _TracedWork:
    def __init__(self, work: Work, ledger: TraceLedger, handle: int):
        self._work, self._ledger, self._handle = work, ledger, handle

    def wait(self) -> None:
        self._work.wait()
        self._ledger.events.append(Wait(self._handle))


class TracingComm(CountingComm):
    """A counting comm whose exchanges return handles that record their wait."""

    ledger: TraceLedger

    def exchange(self, ops):
        work = super().exchange(ops)
        return _TracedWork(work, self.ledger, len(self.ledger.events) - 1)


class TracingKernel(kernels.TimedKernel):
    """A kernel choice that records every block call and computes nothing (placeholders)."""

    def __init__(self, ledger: TraceLedger):
        super().__init__(kernels.NOOP)
        self._ledger = ledger

    @contextlib.contextmanager
    def measure(self, device: torch.device, *, op: str, q: torch.Tensor, k: torch.Tensor,
                causal_offset: Optional[int]):
        b, sq, h, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        pairs = visible_pairs(sq, sk, causal_offset)
        flops = 4.0 * b * h * d * pairs * (2.5 if op == "bwd" else 1.0)
        self._ledger.events.append(Compute(op, b, sq, sk, h, hkv, d, causal_offset,
                                           dtype_name(q.dtype), pairs, flops))
        yield


@dataclass
class Trace:
    """Per-rank ordered events of one method on one case and pass."""

    method: str
    options: dict
    case: Case
    pass_: str
    ranks: list[list[Event]] = field(default_factory=list)

    def comm(self, rank: int) -> list[CommRecord]:
        return [e for e in self.ranks[rank] if isinstance(e, CommRecord)]

    def compute(self, rank: int) -> list[Compute]:
        return [e for e in self.ranks[rank] if isinstance(e, Compute)]

    def bytes_sent(self, rank: int) -> int:
        return sum(e.bytes_sent for e in self.comm(rank))

    def bytes_recv(self, rank: int) -> int:
        return sum(e.bytes_recv for e in self.comm(rank))

    def flops(self, rank: Optional[int] = None, op: Optional[str] = None) -> float:
        ranks = range(len(self.ranks)) if rank is None else [rank]
        return sum(c.flops for r in ranks for c in self.compute(r) if op is None or c.op == op)


def trace(method_name: str, case: Case, pass_: str = "fwd", options: Optional[dict[str, Any]] = None,
          timeout_s: float = 120.0) -> Trace:
    """Run `method_name` on `case` with `case.world_size` virtual ranks on meta tensors and record
    each rank's schedule. `pass_`: "fwd" or "fwd_bwd". Raises ValueError if the method does not
    support the case (the reason)."""
    options = dict(options or {})
    probe = methods.get_method(method_name, **options)
    if probe.needs_processes:
        raise ValueError(f"{method_name} calls torch.distributed itself; its schedule cannot be traced")
    ok, why = probe.supports(Case(**{**case.__dict__, "device": "cpu"}))
    if not ok:
        raise ValueError(why)
    layout = probe.layout(case)
    dtype = case.torch_dtype
    meta = dict(device="meta", dtype=dtype)
    q = torch.empty(case.batch, case.seq_len, case.heads, case.head_dim, **meta)
    kv = torch.empty(case.batch, case.seq_len, case.kv_heads, case.head_dim, **meta)

    def rank_fn(comm) -> list[Event]:
        ledger = TraceLedger()
        method = methods.get_method(method_name, **options)  # one per rank: its kernel is per rank
        method.kernel = TracingKernel(ledger)
        c = TracingComm(comm, ledger)
        ql, kl, vl, dl = (layout.shard(x, comm.rank) for x in (q, kv, kv, q))
        scale = kernels.default_scale(case.head_dim)
        with torch.no_grad():  # what `attention` + autograd run (no LSE asked for: it can cost messages)
            _, _, residuals = method.forward(ql, kl, vl, comm=c, causal=case.causal, scale=scale, return_lse=False)
            if pass_ == "fwd_bwd":
                method.backward(dl, residuals, comm=c, causal=case.causal, scale=scale)
        return ledger.events

    return Trace(method_name, options, case, pass_, run_threads(case.world_size, rank_fn, timeout_s=timeout_s))


# ---------------------------------------------------------------------------------------------
# Trace once per schedule shape
# ---------------------------------------------------------------------------------------------
def template_seq_len(method_name: str, case: Case, options: Optional[dict[str, Any]] = None) -> Optional[int]:
    """The shortest sequence s0 whose schedule has the shape of `case`'s, or None: s0 is a multiple
    of 2P (every layout's chunking) that divides `case.seq_len`, with 2 * s0 <= seq_len, and the method
    supports it (e.g. TASP needs multiples of 2P(P-1)). See `extrapolate`."""
    probe = methods.get_method(method_name, **dict(options or {}))
    unit = 2 * case.world_size
    for mult in range(1, 257):
        s0 = unit * mult
        if 2 * s0 > case.seq_len:
            break
        if case.seq_len % s0 == 0 and probe.supports(Case(**{**case.__dict__, "seq_len": s0, "device": "cpu"}))[0]:
            return s0
    return None


def extrapolate(a: Trace, b: Trace, batch: int, seq_len: int) -> Trace:
    """The trace at `batch` x `seq_len` from traces `a` and `b` of the same schedule at batch 1 and
    two sequence lengths. Every token count, mask offset and byte count of a schedule is an affine
    function of the sequence length at a fixed chunking (a stripe's diagonal offset stays -1, a
    block's length grows), so each is extrapolated from the two traces; bytes and FLOPs then scale
    with the batch. The tests check the result against direct traces, event for event."""
    s_a, s_b = a.case.seq_len, b.case.seq_len
    if a.case.batch != 1 or b.case.batch != 1 or s_a == s_b:
        raise ValueError("extrapolate needs two traces at batch 1 and different sequence lengths")

    def lin(x: int, y: int) -> int:
        num = (y - x) * (seq_len - s_a)
        if num % (s_b - s_a):
            raise ValueError(f"schedule is not affine in the sequence length ({x} at {s_a}, {y} at {s_b})")
        return x + num // (s_b - s_a)

    def one(e: Event, f: Event) -> Event:
        if type(e) is not type(f):
            raise ValueError(f"traces of {a.method} at {s_a} and {s_b} tokens differ in structure")
        if isinstance(e, Compute):
            sq, sk = lin(e.sq, f.sq), lin(e.sk, f.sk)
            off = None if e.causal_offset is None else lin(e.causal_offset, f.causal_offset)
            pairs = visible_pairs(sq, sk, off)
            return Compute(e.op, batch, sq, sk, e.heads, e.kv_heads, e.head_dim, off, e.dtype, pairs,
                           4.0 * batch * e.heads * e.head_dim * pairs * (2.5 if e.op == "bwd" else 1.0))
        if isinstance(e, CommRecord):
            if e.kind != f.kind or e.peers != f.peers or e.per_peer.keys() != f.per_peer.keys():
                raise ValueError(f"traces of {a.method} at {s_a} and {s_b} tokens talk to different peers")
            return CommRecord(e.kind, batch * lin(e.bytes_sent, f.bytes_sent), batch * lin(e.bytes_recv, f.bytes_recv),
                              e.peers, {p: (batch * lin(s, f.per_peer[p][0]), batch * lin(r, f.per_peer[p][1]))
                                        for p, (s, r) in e.per_peer.items()})
        if e != f:
            raise ValueError(f"traces of {a.method} at {s_a} and {s_b} tokens wait differently")
        return e

    if [len(r) for r in a.ranks] != [len(r) for r in b.ranks]:
        raise ValueError(f"traces of {a.method} at {s_a} and {s_b} tokens differ in structure")
    case = Case(**{**a.case.__dict__, "batch": batch, "seq_len": seq_len})
    return Trace(a.method, a.options, case, a.pass_,
                 [[one(e, f) for e, f in zip(ra, rb)] for ra, rb in zip(a.ranks, b.ranks)])


class TraceCache:
    """Traces for many sweep points from two small traces per schedule shape (method, options,
    world size, mask, pass, heads, head dim, dtype): a 200-point sweep costs a few dozen traces."""

    def __init__(self):
        self._templates: dict[tuple, tuple[Trace, Trace]] = {}
        self.traced = 0

    def get(self, method_name: str, case: Case, pass_: str, options: Optional[dict[str, Any]] = None) -> Trace:
        options = dict(options or {})
        s0 = template_seq_len(method_name, case, options)
        if s0 is None:  # too short to have a smaller template: trace it as it is
            self.traced += 1
            return trace(method_name, case, pass_, options)
        # the shape key: s0 itself is in it (a different chunking is a different schedule)
        key = (method_name, tuple(sorted(options.items())), case.world_size, case.causal, pass_, case.heads,
               case.kv_heads, case.head_dim, case.dtype, s0)
        if key not in self._templates:
            small = [Case(**{**case.__dict__, "batch": 1, "seq_len": s}) for s in (s0, 2 * s0)]
            self._templates[key] = tuple(trace(method_name, c, pass_, options) for c in small)  # type: ignore
            self.traced += 2
        a, b = self._templates[key]
        return extrapolate(a, b, case.batch, case.seq_len)
