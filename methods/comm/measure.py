"""Comms for measuring a method's time split (never for results).

- `NullComm`: every operation completes at once and moves nothing (receive buffers are zeroed,
  collectives copy the local input). A method run with it takes its compute-only time.
- `TimingComm`: forwards to a real comm and adds up the time this rank is held up by
  communication: inside its calls, including waits for asynchronous ones (transfers hidden behind
  compute cost nothing here). On CPU that is wall time. On CUDA, NCCL calls and waits return to
  the host at once and instead make the compute stream wait, so CUDA events recorded on the current
  stream around each call and wait measure the stream's stall (host time would read about 0).
"""

from __future__ import annotations

from typing import Sequence

import torch

from methods.comm.base import P2P, Comm, DoneWork, Work, WrappedComm, validate_partition
from methods.stopwatch import Stopwatch


class NullComm:
    """A `Comm` of `world_size` ranks that communicates nothing."""

    def __init__(self, rank: int, world_size: int):
        self._rank, self._world_size = rank, world_size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def exchange(self, ops: Sequence[P2P]) -> DoneWork:
        for op in ops:
            if op.op == "recv":
                op.tensor.zero_()  # defined values (no denormal garbage to slow the compute down)
        return DoneWork()

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        output.copy_(input)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        for chunk in output.chunk(self._world_size, dim=0):
            chunk.copy_(input)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        output.copy_(input.chunk(self._world_size, dim=0)[self._rank])

    def all_reduce(self, tensor: torch.Tensor) -> None:
        pass

    def barrier(self) -> None:
        pass

    def split(self, groups: Sequence[Sequence[int]]) -> "NullComm":
        partition = validate_partition(groups, self._world_size)
        mine = next(g for g in partition if self._rank in g)
        return NullComm(mine.index(self._rank), len(mine))


class _TimedWork:
    def __init__(self, inner: Work, owner: "TimingComm"):
        self._inner, self._owner = inner, owner

    def wait(self) -> None:
        with self._owner.timing():
            self._inner.wait()


class TimingComm(WrappedComm):
    """Forwards to `inner`; `seconds` is the time spent inside its calls and waits (see above),
    measured with the suite's one timer (methods/stopwatch.py); sub-comms share it."""

    def __init__(self, inner: Comm, device: torch.device | None = None, _watch: Stopwatch | None = None):
        super().__init__(inner)
        self.device = device if device is not None else torch.device("cpu")
        self._watch = _watch if _watch is not None else Stopwatch(self.device)

    @property
    def seconds(self) -> float:
        return self._watch.seconds

    def timing(self):
        return self._watch.region()

    def exchange(self, ops: Sequence[P2P]) -> Work:
        with self.timing():
            return _TimedWork(self.inner.exchange(ops), self)

    def all_to_all(self, output, input) -> None:
        with self.timing():
            self.inner.all_to_all(output, input)

    def all_gather(self, output, input) -> None:
        with self.timing():
            self.inner.all_gather(output, input)

    def reduce_scatter(self, output, input) -> None:
        with self.timing():
            self.inner.reduce_scatter(output, input)

    def all_reduce(self, tensor) -> None:
        with self.timing():
            self.inner.all_reduce(tensor)

    def split(self, groups: Sequence[Sequence[int]]) -> "TimingComm":
        return TimingComm(self.inner.split(groups), self.device, self._watch)
