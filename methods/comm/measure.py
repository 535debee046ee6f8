"""Comms for measuring a method's time split (never for results).

- `NullComm`: every operation completes at once and moves nothing (receive buffers are zeroed,
  collectives copy the local input). A method run with it takes its compute-only time.
- `TimingComm`: forwards to a real comm and adds up the time this rank is held up by
  communication: inside its calls, including waits for asynchronous ones (transfers hidden behind
  compute cost nothing here). On CPU that is wall time. On CUDA, NCCL calls and waits return to
  the host at once and instead make the compute stream wait, so CUDA events recorded on the current
  stream around each call and wait measure the stream's stall (found in review: host time read 0).
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from methods.comm.base import P2P, Comm, DoneWork, Work, WrappedComm, validate_partition


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
    """Forwards to `inner`; `seconds` is the time spent inside its calls and waits (see above)."""

    def __init__(self, inner: Comm, device: torch.device | None = None, _shared: dict | None = None):
        super().__init__(inner)
        self.device = device if device is not None else torch.device("cpu")
        # shared with sub-comms: CPU seconds and CUDA event pairs
        self._acc = _shared if _shared is not None else {"seconds": 0.0, "events": []}

    @property
    def seconds(self) -> float:
        events = self._acc["events"]
        if events:
            torch.cuda.synchronize(self.device)
        return self._acc["seconds"] + sum(a.elapsed_time(b) for a, b in events) / 1e3

    def timing(self):
        return _Timer(self._acc, self.device)

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
        return TimingComm(self.inner.split(groups), self.device, self._acc)


class _Timer:
    def __init__(self, acc: dict, device: torch.device):
        self._acc, self._cuda = acc, device.type == "cuda"

    def __enter__(self):
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._acc["events"].append((self._start, end))
        else:
            self._acc["seconds"] += time.perf_counter() - self._t0
        return False
