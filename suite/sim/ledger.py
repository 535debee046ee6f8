"""What a trace is made of, and the pieces that record it while a method's code runs (trace.py
drives them; suite/sim/peers.py reuses them for the peer libraries).

Nothing is computed: tensors have shapes and dtypes but no storage, the block kernel is replaced by
one that records each call (`Compute`: which block, its mask, its FLOPs) and returns placeholders,
and the comm is a counting comm (`methods/comm/counting.py`, so bytes follow the suite's one
convention) that also records when each exchange is waited for. The result is, per rank, the
ordered events the simulator replays: `Compute`, `CommRecord` (with a handle id for exchanges),
`Wait`, `Memory` (the method's own tensor work between them, seen by a thread-local dispatch
mode) and `HostSync` (an op that makes the host wait for the device). Since it is the method's
own code that runs, a trace cannot drift from the method.

FLOPs per block follow flash-attention's convention on the *visible* (query, key) pairs of the
block: forward 4 * B * H * D * pairs, backward 2.5x that.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from methods import kernels
from methods.base import Case, dtype_name
from methods.comm import CommLedger, CountingComm
from methods.comm.base import Work
from methods.comm.counting import CommRecord
from methods.documents import BAND, PARTIAL
from methods.kernels import visible_pairs


@dataclass(frozen=True)
class Compute:
    """One block-kernel call (also the key of a measured block time)."""

    op: str  # "fwd" or "bwd"
    batch: int
    sq: int
    sk: int
    heads: int
    kv_heads: int
    head_dim: int
    causal_offset: Optional[int]
    dtype: str
    doc_pairs: Optional[int] = None  # packed documents: the block's visible pairs, summed over the batch
    # a partly visible block of packed documents, which a flash kernel runs as one call per document
    # piece (methods/kernels.py forward_by_pieces): each piece shape (sq, sk, causal offset) of one
    # batch element, with how many times it occurs over the batch; what its tiles are counted from
    pieces: Optional[tuple[tuple[tuple[int, int, Optional[int], Optional[int]], int], ...]] = None
    head_dim_v: Optional[int] = None  # the values' head dim, None: head_dim (MLA differs)
    # the pieces are the documents of one varlen call (flash-attn's varlen kernels: one launch whose grid
    # holds every document's work units, in document order), not one call each
    varlen: bool = False

    @classmethod
    def from_row(cls, row: dict) -> "Compute":
        """The block of one row of a measured kernel table (`suite calibrate`)."""
        return cls(
            *(row[f] for f in ("op", "batch", "sq", "sk", "heads", "kv_heads", "head_dim", "causal_offset", "dtype"))
        )

    @property
    def pairs(self) -> float:
        """Visible (query, key) pairs of one head of one batch element (the batch's mean with documents)."""
        if self.doc_pairs is not None:
            return self.doc_pairs / self.batch
        return visible_pairs(self.sq, self.sk, self.causal_offset)

    @property
    def width(self) -> int:
        """The head dim the kernel runs at: the wider of the query/key and value head dims (the
        fused kernels take one head dim and run unequal ones padded, methods/kernels.py)."""
        return max(self.head_dim, self.head_dim_v or self.head_dim)

    @property
    def flops(self) -> float:
        """QK^T at the query/key head dim, PV at the values' (4 * D per pair when they are equal)."""
        dims = self.head_dim + (self.head_dim_v or self.head_dim)
        return 2.0 * self.batch * self.heads * dims * self.pairs * (2.5 if self.op == "bwd" else 1.0)


@dataclass(frozen=True)
class Wait:
    """The rank blocks until exchange `handle` (the index of its CommRecord event) completes."""

    handle: int


@dataclass(frozen=True)
class Memory:
    """The method's own tensor work between two recorded events (online-softmax merges, copies,
    concatenations, layout changes): `ops` aten operations touching `bytes` bytes (inputs read plus
    outputs written; views and bare allocations are free)."""

    bytes: int
    ops: int


@dataclass(frozen=True)
class HostSync:
    """The code made the host wait for the device: an op that brings a host tensor to the device's data
    (indexing device tensors with a CPU index or boolean mask, as ring-flash-attn's varlen zigzag
    does), which the real run's stream must drain for. In the trace the device's data lives on meta
    and the host's on CPU, so it is an op over both. A read-back of a value the real run keeps on the
    device (`.item()` of a cu_seqlens) is not seen: in the trace that value is a host tensor."""


Event = Union[Compute, CommRecord, Wait, Memory, HostSync]


class _Tap(list):
    """The ledger's record list that also appends every record to the event list."""

    def __init__(self, ledger: "TraceLedger"):
        super().__init__()
        self._ledger = ledger

    def append(self, record: CommRecord) -> None:
        super().append(record)
        self._ledger.add(record)


class TraceLedger(CommLedger):
    """A comm ledger (bytes, per peer) plus the ordered events of one rank. Tensor work seen between
    two events is folded into one `Memory` event placed before the next one."""

    def __init__(self):
        super().__init__()
        self.events: list[Event] = []
        self.records = _Tap(self)
        self.paused = 0  # > 0 inside kernels and communication: their tensor work is not bookkeeping
        self._bytes = self._ops = 0

    def add(self, event: Event) -> None:
        self.flush()
        self.events.append(event)

    def flush(self) -> None:
        if self._ops:
            self.events.append(Memory(self._bytes, self._ops))
            self._bytes = self._ops = 0

    def tensor_op(self, nbytes: int) -> None:
        if not self.paused:
            self._bytes += nbytes
            self._ops += 1

    def host_sync(self) -> None:
        if not self.paused:
            self.add(HostSync())

    @contextlib.contextmanager
    def pause(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


_FREE = {
    "aten.empty.memory_format",
    "aten.empty_like.default",
    "aten.empty_strided.default",
    "aten.new_empty.default",
    "aten.new_empty_strided.default",
    "aten.lift_fresh.default",
}  # allocations: no memory traffic
# in-place ops that overwrite their first argument without reading it: charged its write only (the
# generic rule charges every argument as read and the output as written)
_OVERWRITE = {
    "aten.copy_.default",
    "aten.fill_.Scalar",
    "aten.fill_.Tensor",
    "aten.zero_.default",
    "aten.index_copy_.default",
}
# in-place ops that write only the places their index names, from `values`, without reading the rest
# of the destination: charged the indices and values read and as many bytes written as values holds
# (the generic rule charged the whole destination as read and written, three passes for one)
_SCATTER = {"aten.index_put_.default", "aten._index_put_impl_.default"}


def _tensor_bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    return 0


def _written_bytes(func, args, kwargs, out) -> int:
    """Bytes of arguments an op writes in place without returning them (a fused operator such as
    the online-softmax merge, `mutates_args`); aten's in-place ops return what they write, which
    is already counted as their output."""
    returned = {id(t) for t in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(t, torch.Tensor)}
    n = 0
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        x = args[i] if i < len(args) else kwargs.get(a.name)
        if isinstance(x, torch.Tensor) and id(x) not in returned:
            n += _tensor_bytes(x)
    return n


def _out_argument_bytes(func, args, kwargs) -> int:
    """Bytes of an `out=` variant's output arguments: written, not read (they are also what the op
    returns, so the generic rule would charge them as read and as written)."""
    n = 0
    for i, a in enumerate(func._schema.arguments):
        if a.is_out:
            n += _tensor_bytes(args[i] if i < len(args) else kwargs.get(a.name))
    return n


def _any_tensor(x, pred) -> bool:
    """Whether any tensor in `x` (nested lists, tuples, dicts) satisfies `pred`."""
    if isinstance(x, torch.Tensor):
        return pred(x)
    if isinstance(x, (list, tuple)):
        return any(_any_tensor(y, pred) for y in x)
    if isinstance(x, dict):
        return any(_any_tensor(y, pred) for y in x.values())
    return False


def _on_meta(x) -> bool:
    return _any_tensor(x, lambda t: t.device.type == "meta")


def _on_host(x) -> bool:
    """A host (CPU) tensor with elements of its own (a 0-dim one is passed to a device kernel as a
    scalar, no copy)."""
    return _any_tensor(x, lambda t: t.device.type == "cpu" and t.dim() > 0)


class _Bookkeeping(TorchDispatchMode):
    """Sees every aten op of the rank's thread (dispatch modes are thread-local) and charges the
    non-view ones to the ledger."""

    def __init__(self, ledger: TraceLedger):
        super().__init__()
        self._ledger = ledger

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # the traced data lives on meta; real (CPU) tensors are the host's index arithmetic (packed
        # documents' masks, positions), not device work; an op over both moves host data to the device
        # (or back) and synchronizes the host with the device
        if _on_meta([args, kwargs]) and _on_host([args, kwargs]):
            self._ledger.host_sync()
        if not func.is_view and str(func) not in _FREE and _on_meta([args, kwargs, out]):
            nbytes = (
                _tensor_bytes(list(args))
                + _tensor_bytes(list((kwargs or {}).values()))
                + _tensor_bytes(out)
                + _written_bytes(func, args, kwargs or {}, out)
            )
            if str(func) in _OVERWRITE:
                nbytes -= _tensor_bytes(args[0])
            elif str(func) in _SCATTER and not (args[3] if len(args) > 3 else (kwargs or {}).get("accumulate")):
                nbytes = _tensor_bytes(list(args[1])) + 2 * _tensor_bytes(args[2])
            nbytes -= _out_argument_bytes(func, args, kwargs or {})
            self._ledger.tensor_op(nbytes)
        return out


class _TracedWork:
    def __init__(self, work: Work, ledger: TraceLedger, handle: int):
        self._work, self._ledger, self._handle = work, ledger, handle

    def wait(self) -> None:
        with self._ledger.pause():
            self._work.wait()
        self._ledger.add(Wait(self._handle))


class TracingComm(CountingComm):
    """A counting comm whose exchanges return handles that record their wait; the tensor work of
    communication itself is not the method's bookkeeping."""

    ledger: TraceLedger

    def exchange(self, ops):
        with self.ledger.pause():
            work = super().exchange(ops)
        return _TracedWork(work, self.ledger, len(self.ledger.events) - 1)

    def all_to_all(self, output, input):
        with self.ledger.pause():
            super().all_to_all(output, input)

    def all_gather(self, output, input):
        with self.ledger.pause():
            super().all_gather(output, input)

    def reduce_scatter(self, output, input):
        with self.ledger.pause():
            super().reduce_scatter(output, input)

    def all_reduce(self, tensor):
        with self.ledger.pause():
            super().all_reduce(tensor)

    def split(self, groups):
        with self.ledger.pause():
            return super().split(groups)

    def barrier(self):
        with self.ledger.pause():
            super().barrier()


def masked_compute(
    op: str,
    b: int,
    sq: int,
    sk: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: str,
    mask,
    head_dim_v: Optional[int] = None,
) -> Compute:
    """The `Compute` event of a block under a block mask (methods/documents.py BlockMask): its visible
    pairs, and for a partly visible or banded block the pieces a flash kernel runs it as (one call
    per document piece and slice; a band is a windowed call). Never builds the dense mask."""
    plain = None if mask.kind in ("full", "partial", "band") else (mask.causal_offset if mask.kind == "offset" else -sq)
    pieces = None
    if mask.kind in (PARTIAL, BAND):
        count = Counter(
            (r.stop - r.start, c.stop - c.start, off, low) for i in range(b) for r, c, off, low in mask.pieces(i)
        )
        pieces = tuple(sorted(count.items(), key=lambda x: tuple(-(1 << 62) if v is None else v for v in x[0])))
    return Compute(
        op,
        b,
        sq,
        sk,
        heads,
        kv_heads,
        head_dim,
        plain,
        dtype,
        doc_pairs=mask.pairs,
        pieces=pieces,
        head_dim_v=head_dim_v,
    )


class TracingKernel(kernels.TimedKernel):
    """A kernel choice that records every block call and computes nothing (placeholders)."""

    def __init__(self, ledger: TraceLedger):
        super().__init__(kernels.NOOP)
        self._ledger = ledger

    @contextlib.contextmanager
    def measure(
        self,
        device: torch.device,
        *,
        op: str,
        q: torch.Tensor,
        k: torch.Tensor,
        causal_offset: Optional[int],
        mask=None,
        v: Optional[torch.Tensor] = None,
    ):
        b, sq, h, d = q.shape
        dv = None if v is None or v.shape[-1] == d else v.shape[-1]  # MLA: the values' head dim
        if mask is not None:  # packed documents or a mask family: the mask's own pairs and pieces
            e = masked_compute(op, b, sq, k.shape[1], h, k.shape[2], d, dtype_name(q.dtype), mask, dv)
        else:
            e = Compute(op, b, sq, k.shape[1], h, k.shape[2], d, causal_offset, dtype_name(q.dtype), head_dim_v=dv)
        with self.block(e):
            yield

    @contextlib.contextmanager
    def block(self, e: Compute):
        """Record block `e`; the tensor work inside is the kernel's, not the method's."""
        self._ledger.add(e)
        with self._ledger.pause():
            yield


@dataclass
class Trace:
    """Per-rank ordered events of one method on one case and pass."""

    method: str
    options: dict
    case: Case
    pass_: str
    ranks: list[list[Event]] = field(default_factory=list)
    forward_end: Optional[list[int]] = None  # fwd_bwd traces: per rank, where the backward's events start

    def forward_part(self) -> "Trace":
        """The forward pass alone of a fwd_bwd trace: the same code runs first in both passes."""
        if self.pass_ == "fwd":
            return self
        if self.forward_end is None:
            raise ValueError(f"forward_part: this {self.pass_!r} trace does not record where its forward ends")
        return Trace(
            self.method,
            self.options,
            self.case,
            "fwd",
            [r[:n] for r, n in zip(self.ranks, self.forward_end)],
            list(self.forward_end),
        )

    def comm(self, rank: int) -> list[CommRecord]:
        return [e for e in self.ranks[rank] if isinstance(e, CommRecord)]

    def ledger(self, rank: int) -> CommLedger:
        """One rank's communication as a byte-counting comm would have recorded it."""
        return CommLedger(self.comm(rank))

    def compute(self, rank: int) -> list[Compute]:
        return [e for e in self.ranks[rank] if isinstance(e, Compute)]

    def bytes_sent(self, rank: int) -> int:
        return self.ledger(rank).bytes_sent

    def bytes_recv(self, rank: int) -> int:
        return self.ledger(rank).bytes_recv

    def flops(self, rank: Optional[int] = None, op: Optional[str] = None) -> float:
        ranks = range(len(self.ranks)) if rank is None else [rank]
        return sum(c.flops for r in ranks for c in self.compute(r) if op is None or c.op == op)
