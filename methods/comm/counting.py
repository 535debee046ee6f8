"""Byte counting around any `Comm`.

Convention (used by every method's documented formula): a rank's bytes *sent* are the payload
bytes that leave it for other ranks, its bytes *received* those that arrive from other ranks.
Self-copies are not counted, and the algorithm a backend uses underneath (e.g. NCCL's ring
all-gather relaying chunks) is not counted either: the numbers are the logical traffic the method
asks for, the quantity the papers' communication formulas describe.

- exchange: each send counts its tensor's bytes to that peer, each receive its buffer's bytes.
- all_to_all (equal splits, P ranks): sent = input bytes * (P-1)/P, received = output bytes * (P-1)/P.
- all_gather: sent = input bytes * (P-1) (each peer needs our chunk), received = output bytes * (P-1)/P.
- reduce_scatter: sent = input bytes * (P-1)/P (every other rank's chunk of our input),
  received = output bytes * (P-1) (every other rank's contribution to our chunk).
- all_reduce: counted as a reduce-scatter + all-gather: sent = received = 2 * bytes * (P-1)/P.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import torch

from methods.comm.base import P2P, Comm, Work, WrappedComm


@dataclass
class CommRecord:
    """One recorded operation: its kind, the bytes it moved for this rank, and its peers.

    For point-to-point exchanges `per_peer` maps each peer to (bytes sent to it, bytes received
    from it): the per-link view (e.g. TASP spreads one round over many links, ring uses one).
    """

    kind: str
    bytes_sent: int
    bytes_recv: int
    peers: tuple[int, ...] = ()
    per_peer: dict[int, tuple[int, int]] = field(default_factory=dict)


@dataclass
class CommLedger:
    """All operations recorded on one rank (shared by a comm and its sub-comms)."""

    records: list[CommRecord] = field(default_factory=list)

    @property
    def bytes_sent(self) -> int:
        return sum(r.bytes_sent for r in self.records)

    @property
    def bytes_recv(self) -> int:
        return sum(r.bytes_recv for r in self.records)

    def counts(self) -> Counter:
        """Number of operations per kind."""
        return Counter(r.kind for r in self.records)

    def clear(self) -> None:
        self.records.clear()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CountingComm(WrappedComm):
    """A `Comm` that forwards to `inner` and appends one `CommRecord` per operation to `ledger`.

    Peers are recorded in the numbering of the comm the method used (sub-comm local ranks for a
    sub-comm); `group_ranks` maps them back to the ranks of the outermost comm for reports.
    """

    def __init__(self, inner: Comm, ledger: CommLedger | None = None, group_ranks: Sequence[int] | None = None):
        super().__init__(inner)
        self.ledger = ledger if ledger is not None else CommLedger()
        self._group_ranks = tuple(group_ranks) if group_ranks is not None else tuple(range(inner.world_size))

    def _outer(self, peer: int) -> int:
        return self._group_ranks[peer]

    def exchange(self, ops: Sequence[P2P]) -> Work:
        per_peer: dict[int, tuple[int, int]] = {}
        for o in ops:
            peer = self._outer(o.peer)
            s, r = per_peer.get(peer, (0, 0))
            n = _nbytes(o.tensor)
            per_peer[peer] = (s + n, r) if o.op == "send" else (s, r + n)
        sent = sum(s for s, _ in per_peer.values())
        recv = sum(r for _, r in per_peer.values())
        self.ledger.records.append(CommRecord("p2p", sent, recv, tuple(sorted(per_peer)), per_peer))
        return self.inner.exchange(ops)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        p = self.world_size
        self.ledger.records.append(
            CommRecord("all_to_all", _nbytes(input) * (p - 1) // p, _nbytes(output) * (p - 1) // p, self._group_ranks)
        )
        self.inner.all_to_all(output, input)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        p = self.world_size
        self.ledger.records.append(
            CommRecord("all_gather", _nbytes(input) * (p - 1), _nbytes(output) * (p - 1) // p, self._group_ranks)
        )
        self.inner.all_gather(output, input)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        p = self.world_size
        self.ledger.records.append(
            CommRecord("reduce_scatter", _nbytes(input) * (p - 1) // p, _nbytes(output) * (p - 1), self._group_ranks)
        )
        self.inner.reduce_scatter(output, input)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        p = self.world_size
        moved = 2 * _nbytes(tensor) * (p - 1) // p
        self.ledger.records.append(CommRecord("all_reduce", moved, moved, self._group_ranks))
        self.inner.all_reduce(tensor)

    def split(self, groups: Sequence[Sequence[int]]) -> "CountingComm":
        sub = self.inner.split(groups)
        mine = next(g for g in groups if self.rank in g)
        return type(self)(sub, self.ledger, [self._group_ranks[r] for r in mine])  # subclasses stay themselves
