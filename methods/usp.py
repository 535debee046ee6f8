"""USP, Unified Sequence Parallelism (Fang & Zhao, 2024; arXiv 2405.07719): Ulysses x Ring.

The P ranks form a 2D mesh of ulysses_degree U x ring_degree R = P. As in the USP paper and
yunchang, Ulysses groups are on the fast axis: global rank g = ring_rank * U + ulysses_rank, so
a Ulysses group is U consecutive ranks (on one node's fast links) and a ring group takes every
U-th rank. Algorithm 1 of the paper: all-to-all q, k, v inside the Ulysses group (scatter heads,
gather the group's tokens), run load-balanced ring attention over the ring group on H/U heads,
all-to-all the output back.

Layout (Algorithm 2): the sequence is cut into 2R chunks; ring rank r's pair is chunks r and
2R-1-r (zigzag), and Ulysses rank u holds piece u of U equal pieces of that pair. After the
Ulysses all-to-all every rank of the group holds the whole pair in order, so the ring inside is
exactly zigzag_ring over R ranks (balanced causal work); without a mask, the plain ring.
Edge cases: U = P is Ulysses (one ring step), U = 1 is zigzag_ring (no all-to-all).

Constraints: U divides P; heads % U == 0; kv_heads % U == 0 or U % kv_heads == 0 (KV
replication, as in Ulysses); seq_len divisible by 2R and by P. `ulysses_degree=None` picks the
largest U <= 8 (one node's fast domain) that the heads allow.

Communication per rank (L = S/P, e bytes per element, a accumulator bytes (4, 8 for float64),
Hkv' = max(kv_heads, U) the KV heads sent, Hkv'/U of them per rank in the ring):
    forward:  (U-1)/U * B*L*(D+Dv)*e * (H + Hkv')              Ulysses all-to-alls (q, k, v, out)
              + (R-1) * B*(U*L)*(Hkv'/U)*(D+Dv)*e                ring: K, V
    backward: (U-1)/U * B*L*(D+Dv)*e * (H + Hkv')              (dout, dq, dk, dv)
              + (R-1) * B*(U*L)*(Hkv'/U)*(D+Dv)*e + R * B*(U*L)*(Hkv'/U)*(D+Dv)*a
(D + Dv: the key's and the value's head dims, 2*D but under MLA.)
sent and received alike (lse all-to-all only when the caller asks for it or passes sinks, as in Ulysses).
"""

from __future__ import annotations

from typing import Optional

import torch

from methods import layouts, merge
from methods.base import Case, Method, unseen_kv_bytes
from methods.comm.base import Comm
from methods.documents import BlockMasks
from methods.kv_ring import kv_ring_backward, kv_ring_bytes, kv_ring_forward, ring_src, useful_steps
from methods.registry import register
from methods.ulysses_a2a import (
    check_ulysses_heads,
    head_slice,
    heads_to_seq,
    kv_replication,
    lse_heads_to_seq,
    seq_to_heads,
    ulysses_bytes,
    ulysses_gather_grads,
    ulysses_lse_bytes,
    ulysses_scatter_heads,
)
from methods.zigzag_ring import zigzag_plan

MAX_AUTO_ULYSSES = 8


def auto_ulysses_degree(world_size: int, heads: int, kv_heads: int) -> int:
    """The largest Ulysses degree <= 8 that divides world_size and that the heads allow."""
    return max(
        d
        for d in range(1, min(world_size, MAX_AUTO_ULYSSES) + 1)
        if world_size % d == 0 and not check_ulysses_heads(heads, kv_heads, d)
    )


def mesh_groups(world_size: int, ulysses_degree: int) -> tuple[list[list[int]], list[list[int]]]:
    """(Ulysses groups, ring groups) with Ulysses on the fast axis: g = ring_rank * U + ulysses_rank."""
    u, r = ulysses_degree, world_size // ulysses_degree
    return (
        [[ring * u + x for x in range(u)] for ring in range(r)],
        [[ring * u + x for ring in range(r)] for x in range(u)],
    )


@register
class USP(Method):
    name = "usp"
    description = "USP: Ulysses all-to-all inside groups x zigzag ring across them (ulysses_degree option)"
    layout_kind = "usp"
    supports_sinks = True  # folds the sinks once per row (merge.fold_sink) after its last merge

    def __init__(self, kernel: str = "auto", ulysses_degree: Optional[int] = None):
        super().__init__(kernel)
        if ulysses_degree is not None and (
            isinstance(ulysses_degree, bool) or not isinstance(ulysses_degree, int) or ulysses_degree < 1
        ):
            raise ValueError(
                f"usp: ulysses_degree must be an integer >= 1 (or null for automatic), got {ulysses_degree!r}"
            )
        self.ulysses_degree = ulysses_degree

    def options(self):
        return {**super().options(), "ulysses_degree": self.ulysses_degree}

    def _degree(self, world_size: int, heads: int, kv_heads: int) -> int:
        if self.ulysses_degree is not None:
            return self.ulysses_degree
        return auto_ulysses_degree(world_size, heads, kv_heads)

    def degrees(self, case: Case) -> tuple[int, int]:
        u = self._degree(case.world_size, case.heads, case.kv_heads)
        return u, case.world_size // u

    test_variants = ({}, {"ulysses_degree": 2})

    def layout(self, case: Case) -> layouts.Layout:
        u, _ = self.degrees(case)
        return layouts.usp(case.seq_len, case.world_size, u)

    def granule(self, case: Case) -> int:
        return layouts.granule("usp", case.world_size, ulysses_degree=self.degrees(case)[0])

    def expected_bytes(self, case: Case, pass_: str) -> tuple[int, int]:
        u, r = self.degrees(case)
        a2a = ulysses_bytes(case, u) * (2 if pass_ == "fwd_bwd" else 1)
        kv_sent = case.kv_heads * kv_replication(case.kv_heads, u)
        # the inner zigzag ring: R ranks holding U local lengths of Hkv'/U heads each
        ring, _ = kv_ring_bytes(
            case,
            pass_,
            ring_size=r,
            kv_heads=kv_sent // u,
            local_len=u * (case.seq_len // case.world_size),
            steps=self._case_steps(case),
        )
        if case.sinks:  # the sink's gradient reads every local row's lse: it comes back too
            a2a += ulysses_lse_bytes(case, u)
        return a2a + ring, a2a + ring

    @staticmethod
    def _ring_masks(docs, causal: bool, ring_size: int) -> Optional[BlockMasks]:
        """The inner ring's block masks: ring rank r holds the zigzag pair r of R ranks (Algorithm
        2's layout); one ring rank, plain Ulysses, its whole sequence in order."""
        if docs is None:
            return None
        ring_layout = layouts.zigzag if ring_size > 1 else layouts.contiguous
        return BlockMasks(docs, ring_layout(docs.padded_len, ring_size).positions, causal)

    @staticmethod
    def _ring_steps(masks: Optional[BlockMasks], causal: bool, ring_size: int, local_len: int) -> int:
        """How far the inner ring circulates (all R steps unless a mask family ends it early)."""
        return useful_steps(ring_size, ring_src(ring_size), lambda r: zigzag_plan(causal, r, local_len), masks)

    def _case_steps(self, case: Case) -> int:
        u, r = self.degrees(case)
        masks = self._ring_masks(case.documents, case.causal, r)
        return self._ring_steps(masks, case.causal, r, u * (case.seq_len // case.world_size))

    def redundant_kv_bytes(self, case: Case, rank: int) -> Optional[int]:
        """Keys no local query sees, of what the all-to-all brings (the group's other pieces, for
        this rank's heads, whose queries are the whole zigzag pair) and of the inner ring's blocks."""
        u, r = self.degrees(case)
        heads = case.kv_heads * kv_replication(case.kv_heads, u) // u
        lay = self.layout(case)
        pair = lambda rr: torch.cat([lay.positions(rr * u + i) for i in range(u)])  # noqa: E731
        ring_rank = rank // u
        mine = pair(ring_rank)
        n = sum(
            unseen_kv_bytes(case, mine, lay.positions(ring_rank * u + i), heads)
            for i in range(u)
            if ring_rank * u + i != rank
        )
        src = ring_src(r)
        return n + sum(
            unseen_kv_bytes(case, mine, pair(src(ring_rank, t)), heads) for t in range(1, self._case_steps(case))
        )

    def supports(self, case: Case) -> tuple[bool, str]:
        u = self._degree(case.world_size, case.heads, case.kv_heads)
        if case.world_size % u != 0:
            return False, f"usp: ulysses_degree {u} does not divide world_size {case.world_size}"
        reason = check_ulysses_heads(case.heads, case.kv_heads, u)
        return (False, reason) if reason else super().supports(case)

    def _comms(self, comm: Comm, u: int) -> tuple[Comm, Comm]:
        if comm.world_size % u != 0:
            raise ValueError(f"usp: ulysses_degree {u} does not divide world_size {comm.world_size}")
        ulysses_groups, ring_groups = mesh_groups(comm.world_size, u)
        return comm.split(ulysses_groups), comm.split(ring_groups)

    def forward(self, q, k, v, *, comm, causal, scale, return_lse, docs=None, sinks=None):
        u = self._degree(comm.world_size, q.shape[2], k.shape[2])
        uly, ring = self._comms(comm, u)
        rep = 1
        if u > 1:
            # [B, U*L, H/U, D]: the pair, as sequence-major views (kernels read them as they are);
            # the ring sends K/V as they are and collectives take contiguous buffers, so they are
            # made contiguous for a ring of several ranks (a copy only with a batch above one)
            q, k, v, rep = ulysses_scatter_heads(uly, q, k, v, contiguous=False)
            if ring.world_size > 1:
                k, v = k.contiguous(), v.contiguous()
        plan = zigzag_plan(causal, ring.rank, q.shape[1])
        masks = self._ring_masks(docs, causal, ring.world_size)
        steps = self._ring_steps(masks, causal, ring.world_size, q.shape[1])
        out_h, lse_h = kv_ring_forward(
            q, k, v, comm=ring, plan=plan, scale=scale, kernel=self.kernel, masks=masks, steps=steps
        )
        if sinks is not None:  # rows final after the ring; this rank holds its Ulysses group's heads
            out_h, lse_h = merge.fold_sink(out_h, lse_h, head_slice(sinks, uly) if u > 1 else sinks)
        if u == 1:
            return out_h, lse_h, (q, k, v, out_h, lse_h, u, rep, masks)
        out = heads_to_seq(uly, out_h)  # [B, L, H, D]
        lse = lse_heads_to_seq(uly, lse_h) if return_lse else None
        return out, lse, (q, k, v, out_h, lse_h, u, rep, masks)

    def backward(self, dout, residuals, *, comm, causal, scale, docs=None):
        q_h, k_h, v_h, out_h, lse_h, u, rep, masks = residuals
        uly, ring = self._comms(comm, u)
        if u > 1:
            dout = seq_to_heads(uly, dout, contiguous=False)  # read by the kernels only, never sent
        grads = kv_ring_backward(
            dout,
            q_h,
            k_h,
            v_h,
            out_h,
            lse_h,
            comm=ring,
            plan=zigzag_plan(causal, ring.rank, q_h.shape[1]),
            scale=scale,
            kernel=self.kernel,
            masks=masks,
            steps=self._ring_steps(masks, causal, ring.world_size, q_h.shape[1]),
        )
        return ulysses_gather_grads(uly, *grads, rep) if u > 1 else grads
