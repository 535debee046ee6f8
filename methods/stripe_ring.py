"""Striped Attention (Brandon et al., 2023; arXiv 2311.09431): the K/V ring over a striped layout.

Rank r holds positions r, r+P, r+2P, ... Local query i is global r + iP and key j of src's block is
global src + jP, so with the causal mask query i sees key j iff src + jP <= r + iP, i.e.
- src <= r: j <= i     (causal_offset 0, the usual lower triangle including the diagonal);
- src > r:  j <= i - 1 (causal_offset -1, strictly lower: row 0 sees nothing of that block).
Every step costs about half a block on every rank (c(c+1)/2 or c(c-1)/2 pairs): balanced within
c pairs per step. Without a mask it is the plain ring over this layout.

Communication: exactly the ring's (methods/ring.py), with L = S/P.
"""
from __future__ import annotations

from methods.base import Method
from methods.kv_ring import ALL, Block, Plan, full_plan, kv_ring_backward, kv_ring_forward
from methods.registry import register


def stripe_plan(causal: bool, rank: int) -> Plan:
    if not causal:
        return full_plan

    def plan(src: int) -> list[Block]:
        return [Block(ALL, ALL, 0 if src <= rank else -1)]
    return plan


@register
class StripeRing(Method):
    name = "stripe_ring"
    description = "Striped Attention: ring attention over a striped layout (token i on rank i mod P)"
    layout_kind = "stripe"

    def forward(self, q, k, v, *, comm, causal, scale, return_lse):
        out, lse = kv_ring_forward(q, k, v, comm=comm, plan=stripe_plan(causal, comm.rank), scale=scale,
                                   kernel=self.kernel)
        return out, lse, (q, k, v, out, lse)

    def backward(self, dout, residuals, *, comm, causal, scale):
        q, k, v, out, lse = residuals
        return kv_ring_backward(dout, q, k, v, out, lse, comm=comm, plan=stripe_plan(causal, comm.rank),
                                scale=scale, kernel=self.kernel)
