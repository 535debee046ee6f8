"""The `Comm` protocol: the only way our own methods communicate.

Methods never call `torch.distributed` directly. They talk to a `Comm`, which has three
implementations (docs/DESIGN.md section 5):

- `DistComm` (methods/comm/dist.py): torch.distributed, gloo on CPU, NCCL on CUDA. The only executor
  whose timings are reported as real performance.
- `ThreadComm` (methods/comm/threads.py): P virtual ranks as threads of one process.
- `CountingComm` (methods/comm/counting.py): wraps either and records bytes per operation.

Ranks and peers are always *local to the comm* (0..world_size-1); the implementation maps them to
whatever global numbering its backend uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, Sequence, runtime_checkable

import torch


class CommError(RuntimeError):
    """A communication operation failed or timed out (peer crashed, hang, misuse)."""


class CommAborted(CommError):
    """This rank was woken because another rank of its group failed (a consequence, not a cause)."""


@dataclass(frozen=True)
class P2P:
    """One operation of a batched point-to-point exchange.

    `op="send"` sends `tensor` to `peer`; `op="recv"` receives into `tensor` from `peer`. The
    tensor must stay untouched (send) or unread (recv) until the exchange's `wait()` returns.
    """

    op: Literal["send", "recv"]
    tensor: torch.Tensor
    peer: int


@runtime_checkable
class Work(Protocol):
    """Handle of an asynchronous operation."""

    def wait(self) -> None: ...


class DoneWork:
    """A `Work` that is already complete (e.g. an exchange with nothing to do)."""

    def wait(self) -> None:
        return None


@runtime_checkable
class Comm(Protocol):
    """What a sequence-parallel method may do with its group of ranks.

    All collective operations must be called by every rank of the comm, in the same order.
    Tensors passed to collectives must be contiguous.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def exchange(self, ops: Sequence[P2P]) -> Work:
        """Start a batch of sends and receives (batch_isend_irecv); `wait()` completes all of them."""
        ...

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Equal-split all-to-all along dim 0: chunk j of `input` goes to rank j, and chunk i of
        `output` comes from rank i. `output` and `input` have the same shape and dtype."""
        ...

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Gather along dim 0: chunk i of `output` (of world_size equal chunks) is rank i's `input`."""
        ...

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Sum over ranks, then scatter along dim 0: `output` is chunk `rank` (of world_size equal
        chunks) of the elementwise sum of every rank's `input`."""
        ...

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over ranks, in place (same result bit for bit on every rank)."""
        ...

    def barrier(self) -> None: ...

    def split(self, groups: Sequence[Sequence[int]]) -> "Comm":
        """Partition the ranks into sub-groups and return the comm of the group holding this rank.

        Collective: every rank passes the same partition (a list of disjoint lists of ranks of
        this comm covering all of them). Sub-comms are created once and cached, so calling
        `split` inside a method's forward is cheap after the first call.
        """
        ...


class WrappedComm:
    """Base of the comms that wrap another (counting, timing, tracing): `rank`, `world_size` and
    `barrier` are the inner comm's; subclasses wrap the operations they observe."""

    def __init__(self, inner: Comm):
        self.inner = inner

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def barrier(self) -> None:
        self.inner.barrier()


def validate_partition(groups: Sequence[Sequence[int]], world_size: int) -> tuple[tuple[int, ...], ...]:
    """Check that `groups` partitions range(world_size); return it as a hashable tuple."""
    flat = sorted(r for g in groups for r in g)
    if flat != list(range(world_size)):
        raise ValueError(f"split() needs a partition of ranks 0..{world_size - 1}; got {[list(g) for g in groups]}")
    return tuple(tuple(int(r) for r in g) for g in groups)


def check_contiguous(*tensors: torch.Tensor) -> None:
    """Collectives need contiguous tensors (gloo raises otherwise; we raise for every backend)."""
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("communication buffers must be contiguous; call .contiguous() first")
