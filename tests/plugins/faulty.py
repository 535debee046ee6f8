"""Test-only methods loaded through `run.plugins` to exercise the harness's failure paths.

- `faulty`: ring attention, except that chosen ranks raise, hang or die in the forward pass
  (the other ranks then block in the ring exchange, as they would with a real bug).
- `wrong`: ring attention that forgets the causal mask on the diagonal block: it runs, and the
  float64 check must record it as incorrect.
- `slow`: ring attention that sleeps before every call (to kill a sweep mid-way).
"""
import os
import time

from methods.registry import register
from methods.ring import Ring


@register
class Faulty(Ring):
    name = "faulty"
    description = "test only: ring that fails, hangs or dies on chosen ranks"

    def __init__(self, kernel: str = "auto", fail_ranks: tuple = (), hang_ranks: tuple = (),
                 die_ranks: tuple = ()):
        super().__init__(kernel)
        self.fail_ranks, self.hang_ranks, self.die_ranks = set(fail_ranks), set(hang_ranks), set(die_ranks)

    def forward(self, q, k, v, *, comm, causal, scale, return_lse):
        if comm.rank in self.fail_ranks:
            raise RuntimeError(f"injected failure on rank {comm.rank}")
        if comm.rank in self.hang_ranks:
            time.sleep(3600)
        if comm.rank in self.die_ranks:
            os._exit(17)
        return super().forward(q, k, v, comm=comm, causal=causal, scale=scale, return_lse=return_lse)


@register
class Wrong(Ring):
    name = "wrong"
    description = "test only: ring without the causal mask on the diagonal block"

    def forward(self, q, k, v, *, comm, causal, scale, return_lse):
        return super().forward(q, k, v, comm=comm, causal=False, scale=scale, return_lse=return_lse)


@register
class Slow(Ring):
    name = "slow"
    description = "test only: ring that sleeps 0.3 s per call"

    def forward(self, q, k, v, *, comm, causal, scale, return_lse):
        time.sleep(0.3)
        return super().forward(q, k, v, comm=comm, causal=causal, scale=scale, return_lse=return_lse)
