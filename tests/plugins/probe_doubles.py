"""Test-only methods for the option-flip and repeat checks (suite/flips.py, suite/repeats.py).

Each is ring attention with one planted fault:
- `drops_softcap`: takes the soft cap and drops it on the way (its block calls get the plain scale),
  as a library that passes softcap=0; the flips must fail it ("option softcap dropped").
- `noisy_once`: on call NOISY_CALL of a trial, rank 0 adds seeded noise of about 1e-7 to its
  output (below the float64 check's bound): the repeats must report out not bitwise identical,
  with the spread it added (recorded in NOISE, by rank).
- `broken_once`: on call BROKEN_CALL, rank 1 scales its output by 1.5: that repeat must fail
  the check and be named.
"""

import torch

from methods.registry import register
from methods.ring import Ring

NOISY_CALL, BROKEN_CALL = 5, 7
NOISE: dict[int, float] = {}  # rank -> max |noisy out - out| of the noisy call


@register
class DropsSoftcap(Ring):
    name, description = "drops_softcap", "test only: ring that drops the logit soft cap"
    test_double = True

    def forward(self, q, k, v, *, comm, causal, scale, return_lse, docs=None, sinks=None):
        extra = {"docs": docs} if docs is not None else {}
        if sinks is not None:
            extra["sinks"] = sinks
        return super().forward(q, k, v, comm=comm, causal=causal, scale=float(scale), return_lse=return_lse, **extra)

    def backward(self, dout, residuals, *, comm, causal, scale, docs=None):
        extra = {"docs": docs} if docs is not None else {}
        return super().backward(dout, residuals, comm=comm, causal=causal, scale=float(scale), **extra)


class _OnceRing(Ring):
    test_double = True
    calls = 0

    def forward(self, q, k, v, *, comm, causal, scale, return_lse, docs=None, sinks=None):
        extra = {"docs": docs} if docs is not None else {}
        if sinks is not None:
            extra["sinks"] = sinks
        out, lse, residuals = super().forward(
            q, k, v, comm=comm, causal=causal, scale=scale, return_lse=return_lse, **extra
        )
        call, self.calls = self.calls, self.calls + 1  # one instance per rank and trial
        return self.tamper(out, comm.rank, call), lse, residuals

    def tamper(self, out: torch.Tensor, rank: int, call: int) -> torch.Tensor:
        return out


@register
class NoisyOnce(_OnceRing):
    name, description = "noisy_once", "test only: ring whose rank 0 adds 1e-7 noise to one call's output"

    def tamper(self, out, rank, call):
        if rank != 0 or call != NOISY_CALL:
            return out
        gen = torch.Generator().manual_seed(1234)
        noisy = out + 1e-7 * torch.randn(out.shape, generator=gen, dtype=torch.float32).to(out.dtype)
        NOISE[rank] = float((noisy.double() - out.double()).abs().max())
        return noisy


@register
class BrokenOnce(_OnceRing):
    name, description = "broken_once", "test only: ring whose rank 1 scales one call's output by 1.5"

    def tamper(self, out, rank, call):
        return out * 1.5 if rank == 1 and call == BROKEN_CALL else out
