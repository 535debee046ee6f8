"""The one timer: adds up the time of code regions on a device.

On CPU a region's time is wall time (perf_counter). On CUDA, kernels and NCCL calls return to the
host before the device has done the work, so host time would measure only the launch; a region
instead records a pair of CUDA events on the current stream, and `seconds` synchronises and sums
their elapsed times (the stream's time, stalls included). Every measurement of the suite goes
through this class: an iteration's time, the time in block kernels, the time blocked on
communication.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch


class Stopwatch:
    """with watch.region(device): ...; watch.seconds is the total of every region so far."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.calls = 0
        self._cpu_s = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        self.calls += 1
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._cpu_s += time.perf_counter() - t0

    @property
    def seconds(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()
        return self._cpu_s + sum(s.elapsed_time(e) for s, e in self._events) / 1e3
