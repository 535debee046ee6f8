"""Ring Attention (Liu, Zaharia, Abbeel, 2023; arXiv 2310.01889) with a contiguous layout.

Rank r holds tokens [r*S/P, (r+1)*S/P) of q, k and v; K/V blocks travel around the ring r -> r+1
(methods/kv_ring.py has the loop, the double buffering and the dK/dV accumulator ring).

Causal mask on global positions: the block of src == r is the diagonal (aligned causal), blocks of
src < r are fully visible, blocks of src > r are fully masked and skipped, though still passed on.
So causal ranks do unequal work (rank P-1 computes P blocks, rank 0 one); zigzag_ring and
stripe_ring fix that.

Communication per rank (L = S/P, e bytes per input element, a = 4 bytes per fp32 accumulator
element, 8 for float64 inputs):
    forward:  sent = received = (P-1) * 2*B*L*Hkv*D*e
    backward: sent = received = (P-1) * 2*B*L*Hkv*D*e + 2 * 2*B*L*Hkv*D*e + (P-2) * 2*B*L*Hkv*D*a
              (the dK/dV accumulators' first and last hops in the input dtype; methods/kv_ring.py)
(none at P = 1). Memory: see methods/kv_ring.py (two K/V blocks in flight).
"""

from __future__ import annotations

from methods.kv_ring import ALL, Block, KVRingMethod, Plan, full_plan
from methods.registry import register


def ring_plan(causal: bool, rank: int) -> Plan:
    """Blocks of the contiguous layout: diagonal causal, earlier ranks full, later ranks skipped."""
    if not causal:
        return full_plan

    def plan(src: int) -> list[Block]:
        if src == rank:
            return [Block(ALL, ALL, 0)]
        return [Block(ALL, ALL, None)] if src < rank else []

    return plan


@register
class Ring(KVRingMethod):
    name = "ring"
    description = "Ring Attention: K/V blocks around a ring, online softmax, contiguous layout"
    layout_kind = "contiguous"

    def plan(self, causal: bool, rank: int, local_len: int) -> Plan:
        return ring_plan(causal, rank)
