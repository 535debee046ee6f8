"""Ring Attention (Liu, Zaharia, Abbeel, 2023; arXiv 2310.01889) with a contiguous layout.

Rank r holds tokens [r*S/P, (r+1)*S/P) of q, k and v. K/V blocks travel around the ring r -> r+1.

Forward, P steps: at step s rank r holds the K/V block of rank src = (r - s) mod P. It starts
sending that block on to r+1 (receiving the next from r-1) *before* computing with it, so the
transfer overlaps the block's attention (double buffering), then folds the block's (out, lse)
into fp32 accumulators with the online-softmax merge. Causal mask on global positions: src == r is
the diagonal block (aligned causal), src < r is fully visible, src > r is fully masked and
skipped, still passed on (so causal ranks do unequal work: rank P-1 computes P blocks, rank 0 one;
the zigzag layout fixes that).

Backward, P steps, the same K/V ring again; each block's dK/dV accumulator travels *with* it: at
step s rank r receives from r-1 the partial dK/dV of the block it now holds (sent one step earlier,
so that transfer overlaps this step's compute), adds its own contribution and sends it on. After
the last step the accumulator has visited every rank and one more hop brings it to its owner.
Each block backward uses the global out and lse saved by the forward (exact per-block gradients).
dQ and the dK/dV accumulators are fp32 (float64 for float64 inputs), and dK/dV travel in that
dtype (as ring-flash-attn does), trading bytes for accuracy.

Communication per rank (L = S/P local tokens, e = bytes per element of the inputs, a = bytes of
the accumulator dtype: 4, or 8 for float64):
    forward:  sent = received = (P-1) * 2 * B*L*Hkv*D * e
    backward: sent = received = (P-1) * 2 * B*L*Hkv*D * e  +  P * 2 * B*L*Hkv*D * a
(no communication at P = 1).

Memory beyond inputs and outputs: two K/V blocks in flight (current and next), the fp32 out/lse
accumulators; backward adds the fp32 dQ and two dK/dV accumulators (the one being sent and the
one being received).
"""
from __future__ import annotations

from typing import Optional

import torch

from methods import kernels
from methods.base import Method
from methods.common import ring_shift
from methods.registry import register


def block_mask(causal: bool, rank: int, src: int) -> tuple[bool, Optional[int]]:
    """(compute this block?, causal_offset) for queries of `rank` against keys of `src` (contiguous)."""
    if not causal:
        return True, None
    if src == rank:
        return True, 0       # diagonal block: aligned causal
    return src < rank, None  # earlier tokens fully visible; later ones fully masked


@register
class Ring(Method):
    name = "ring"
    description = "Ring Attention: K/V blocks around a ring, online softmax, contiguous layout"
    layout_kind = "contiguous"

    def forward(self, q, k, v, *, comm, causal, scale, return_lse):
        p, r = comm.world_size, comm.rank
        out = lse = None
        cur_k, cur_v = k, v
        for step in range(p):
            if step + 1 < p:
                next_k, next_v = torch.empty_like(k), torch.empty_like(v)
                work = ring_shift(comm, [cur_k, cur_v], [next_k, next_v])
            src = (r - step) % p
            compute, offset = block_mask(causal, r, src)
            if compute:
                block_out, block_lse = kernels.block_forward(q, cur_k, cur_v, scale=scale,
                                                             causal_offset=offset, kernel=self.kernel)
                if out is None:  # first block initialises the accumulators (no -inf arithmetic)
                    out, lse = block_out.to(kernels.acc_dtype(q.dtype)), block_lse.clone()
                else:
                    kernels.merge_(out, lse, block_out, block_lse)
            if step + 1 < p:
                work.wait()
                cur_k, cur_v = next_k, next_v
        out = out.to(q.dtype)
        return out, lse, (q, k, v, out, lse)

    def backward(self, dout, residuals, *, comm, causal, scale):
        q, k, v, out, lse = residuals
        p, r = comm.world_size, comm.rank
        acc = kernels.acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        cur_k, cur_v = k, v
        dkv_work = None
        for step in range(p):
            if step + 1 < p:
                next_k, next_v = torch.empty_like(k), torch.empty_like(v)
                kv_work = ring_shift(comm, [cur_k, cur_v], [next_k, next_v])
            src = (r - step) % p
            compute, offset = block_mask(causal, r, src)
            if compute:
                bdq, bdk, bdv = kernels.block_backward(dout, q, cur_k, cur_v, out, lse, scale=scale,
                                                       causal_offset=offset, kernel=self.kernel)
                dq += bdq
            # The partial dK/dV of the block we hold arrives from r-1 (it was sent last step).
            if step == 0:
                dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)
                dv_acc = torch.zeros(v.shape, dtype=acc, device=v.device)
            else:
                dkv_work.wait()
                dk_acc, dv_acc = recv_dk, recv_dv
            if compute:
                dk_acc += bdk
                dv_acc += bdv
            if p > 1:
                recv_dk, recv_dv = torch.empty_like(dk_acc), torch.empty_like(dv_acc)
                dkv_work = ring_shift(comm, [dk_acc, dv_acc], [recv_dk, recv_dv])
            if step + 1 < p:
                kv_work.wait()
                cur_k, cur_v = next_k, next_v
        if p > 1:
            dkv_work.wait()  # the last hop brings our own block's accumulator home
            dk_acc, dv_acc = recv_dk, recv_dv
        return dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)
