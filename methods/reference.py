"""`reference`: attention of the whole sequence on one device, with the same block kernel.

The single-device baseline that every sequence-parallel method is compared with (its time at
world_size 1 is the "ideal" rate a method's percent-of-ideal is measured against). Runs at
world_size 1 only.

Communication: none. Memory: q, k, v, out and lse of the whole sequence.
"""

from __future__ import annotations

import torch

from methods import kernels, merge
from methods.base import Case, Method
from methods.registry import register


@register
class Reference(Method):
    name = "reference"
    description = "single-device attention (the baseline), world_size 1 only"
    layout_kind = "contiguous"
    supports_sinks = True  # folds the sinks once per row (merge.fold_sink) after its last merge
    single_device = True

    def expected_bytes(self, case: Case, pass_: str) -> tuple[int, int]:
        return 0, 0

    def degrees(self, case: Case) -> tuple[int, int]:
        return 1, 1

    def supports(self, case: Case) -> tuple[bool, str]:
        if case.world_size != 1:
            return False, (
                f"reference is the single-device baseline and runs at world_size 1 only (got {case.world_size})"
            )
        return super().supports(case)

    def forward(self, q, k, v, *, comm, causal, scale, return_lse, docs=None, sinks=None):
        if comm.world_size != 1:
            raise ValueError(f"reference runs on one rank; this comm has {comm.world_size}")
        mask = docs.block(torch.arange(docs.padded_len), torch.arange(docs.padded_len), causal) if docs else None
        out, lse = kernels.block_forward(
            q, k, v, scale=scale, causal_offset=0 if causal else None, kernel=self.kernel, mask=mask
        )
        if sinks is not None:
            out, lse = merge.fold_sink(out, lse, sinks)
        return out, lse, (q, k, v, out, lse, mask)

    def backward(self, dout, residuals, *, comm, causal, scale, docs=None):
        q, k, v, out, lse, mask = residuals
        return kernels.block_backward(
            dout, q, k, v, out, lse, scale=scale, causal_offset=0 if causal else None, kernel=self.kernel, mask=mask
        )
