"""Test-only methods, loaded through `run.plugins`, that exercise the harness's failure paths.

Each is ring attention with one fault planted on rank 1 (the other ranks then block in the ring
exchange, as they would with a real bug):
- `faulty`: raises in the forward pass.
- `hanging`: sleeps for an hour in the forward pass.
- `dying`: the worker process exits abruptly (as on a segfault or an OOM kill).
- `wrong`: no fault in control flow; it forgets the causal mask, so the float64 check must flag it.
- `slow`: sleeps 0.3 s per call on every rank (to kill a sweep mid-way).
- `sleepy`: sleeps 6 s per call on every rank, outside any communication (a limit of a second or two
  must fire although every rank would finish).
- `deadlocked`: rank 1 takes a lock it already holds (a deadlock no timeout of a wait can end).
"""

import os
import threading
import time

from methods.registry import register
from methods.ring import Ring


class _FaultyRing(Ring):
    test_double = True  # never a member of `own`: a sweep runs it only where it names it

    def fault(self, rank: int) -> None:
        """Called on every rank before the forward pass."""

    def forward(self, q, k, v, *, comm, causal, scale, return_lse):
        self.fault(comm.rank)
        return super().forward(q, k, v, comm=comm, causal=causal, scale=scale, return_lse=return_lse)


@register
class Faulty(_FaultyRing):
    name, description = "faulty", "test only: ring that raises on rank 1"

    def fault(self, rank):
        if rank == 1:
            raise RuntimeError("injected failure on rank 1")


@register
class Hanging(_FaultyRing):
    name, description = "hanging", "test only: ring that hangs on rank 1"

    def fault(self, rank):
        if rank == 1:
            time.sleep(3600)


@register
class Dying(_FaultyRing):
    name, description = "dying", "test only: ring whose rank 1 process exits abruptly"

    def fault(self, rank):
        if rank == 1:
            os._exit(17)


@register
class Slow(_FaultyRing):
    name, description = "slow", "test only: ring that sleeps 0.3 s per call"

    def fault(self, rank):
        time.sleep(0.3)


@register
class Sleepy(_FaultyRing):
    name, description = "sleepy", "test only: ring that sleeps 6 s per call on every rank"

    def fault(self, rank):
        time.sleep(6.0)


@register
class Deadlocked(_FaultyRing):
    name, description = "deadlocked", "test only: ring whose rank 1 takes a lock it holds"

    def fault(self, rank):
        if rank == 1:
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()


@register
class Wrong(Ring):
    test_double = True
    name, description = "wrong", "test only: ring without the causal mask"

    def forward(self, q, k, v, *, comm, causal, scale, return_lse):
        return super().forward(q, k, v, comm=comm, causal=False, scale=scale, return_lse=return_lse)
