"""Zigzag ring attention: the K/V ring with a load-balanced layout for causal masks.

The sequence is cut into 2P chunks of c = S/(2P) tokens; rank r holds chunks r and 2P-1-r
("front" and "back"), so every rank holds one early and one late chunk (ring-flash-attn's zigzag,
Megatron/TE's load balancing, PyTorch's head-tail; ring-flash-attn issue #2). Local tokens are in
increasing global order, so with the causal mask (global positions) at each step:
- src == r: the local diagonal pair, aligned causal (q and k in the same increasing order);
- src < r:  src's front chunk precedes both of ours, its back chunk follows both: every local query
            sees exactly the front half of the block (no mask);
- src > r:  src's chunks both lie after our front and before our back chunk: our back-half queries
            see the whole block (no mask), our front-half queries see none of it.
Every step after the first costs 2c^2 on every rank: balanced, with no per-element masks.
Without a mask it is the plain ring over this layout.

Communication: exactly the ring's (methods/ring.py), with L = S/P = 2c.
"""

from __future__ import annotations

from methods.base import DocumentSharding
from methods.kv_ring import ALL, Block, KVRingMethod, Plan, full_plan
from methods.registry import register


def zigzag_plan(causal: bool, rank: int, local_len: int) -> Plan:
    """Blocks for the zigzag layout: local rows [0, c) are the front chunk, [c, 2c) the back."""
    if not causal:
        return full_plan
    half = local_len // 2
    front, back = slice(0, half), slice(half, local_len)

    def plan(src: int) -> list[Block]:
        if src == rank:
            return [Block(ALL, ALL, 0)]
        if src < rank:
            return [Block(ALL, front, None)]
        return [Block(back, ALL, None)]

    return plan


@register
class ZigzagRing(DocumentSharding, KVRingMethod):
    name = "zigzag_ring"
    description = "ring attention over the zigzag layout (chunks r and 2P-1-r): balanced causal work"
    layout_kind = "zigzag"
    test_variants = ({}, {"sharding": "documents"})

    def plan(self, causal: bool, rank: int, local_len: int) -> Plan:
        # by documents or area, every block runs with the documents' mask (which holds the causal part)
        return full_plan if self.masks_every_block else zigzag_plan(causal, rank, local_len)

    def forward(self, q, k, v, *, comm, causal, scale, return_lse, docs=None, sinks=None):
        return super().forward(
            q,
            k,
            v,
            comm=comm,
            causal=causal,
            scale=scale,
            return_lse=return_lse,
            docs=self.documents_for(q, comm, docs),
            sinks=sinks,
        )

    def backward(self, dout, residuals, *, comm, causal, scale, docs=None):
        return super().backward(dout, residuals, comm=comm, causal=causal, scale=scale)
