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

from methods.kv_ring import ALL, Block, KVRingMethod, Plan, full_plan
from methods.registry import register


def stripe_plan(causal: bool, rank: int) -> Plan:
    if not causal:
        return full_plan

    def plan(src: int) -> list[Block]:
        return [Block(ALL, ALL, 0 if src <= rank else -1)]

    return plan


@register
class StripeRing(KVRingMethod):
    name = "stripe_ring"
    description = "Striped Attention: ring attention over a striped layout (token i on rank i mod P)"
    layout_kind = "stripe"

    def plan(self, causal: bool, rank: int, local_len: int) -> Plan:
        return stripe_plan(causal, rank)
