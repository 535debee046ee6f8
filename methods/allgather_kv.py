"""All-gather K/V (Llama 3, section 3.3.2; Megatron/TE `cp_comm_type="all_gather"`).

Rank r holds the zigzag chunks r and 2P-1-r (c = S/(2P) tokens each) of q, k and v. The forward
all-gathers K and V (one collective each: the full sequence's K/V, cheap under GQA), puts them
in global order, and computes attention for its local queries directly: with the causal mask
the front chunk (global positions [rc, (r+1)c)) needs keys [0, (r+1)c) and the back chunk keys
[0, (2P-r)c), each one kernel call with the diagonal at the block's end (bottom-right aligned),
so no merge is needed and every rank does the same work (zigzag). Without a mask, one call
against all keys. The gather is not overlapped with compute (Llama 3 accepts the exposed latency
for simplicity and arbitrary masks).

The backward gathers K/V again (rather than keeping the full sequence's K/V alive between
forward and backward), computes dK/dV of the *whole* sequence for its own queries in fp32, and
reduce-scatters them so each rank gets the sum for its own tokens.

Communication per rank (L = S/P = 2c, e bytes per input element, a = 4 bytes per fp32 element,
8 for float64 inputs):
    forward:  sent = received = 2 * (P-1) * B*L*Hkv*D*e                   (all-gather K, V)
    backward: sent = received = 2 * (P-1) * B*L*Hkv*D*e + 2 * (P-1) * B*L*Hkv*D*a
                                              (all-gather K, V; reduce-scatter fp32 dK, dV)
Memory beyond inputs and outputs: the full sequence's K and V (2*B*S*Hkv*D*e), and in the
backward the full fp32 dK and dV: the one method here that does not stay within two K/V blocks.
"""
from __future__ import annotations

import torch

from methods import kernels, layouts
from methods.base import Case, DocumentSharding, Method, element_bytes
from methods.comm.base import Comm
from methods.registry import register


def _gather_global(comm: Comm, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """All ranks' x [B, L, Hkv, D] -> the global sequence [B, S, Hkv, D] (global order)."""
    p = comm.world_size
    b, l, h, d = x.shape
    gathered = torch.empty(p, b, l, h, d, dtype=x.dtype, device=x.device)
    comm.all_gather(gathered, x.unsqueeze(0))                              # [P, B, L, Hkv, D]
    full = torch.empty(b, p * l, h, d, dtype=x.dtype, device=x.device)
    full[:, order] = gathered.permute(1, 0, 2, 3, 4).reshape(b, p * l, h, d)  # rank-major -> global
    return full


def _reduce_scatter_global(comm: Comm, full: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Sum over ranks of full [B, S, Hkv, D] (global order), this rank's tokens [B, L, Hkv, D]."""
    p = comm.world_size
    b, s, h, d = full.shape
    rank_major = full[:, order].reshape(b, p, s // p, h, d).permute(1, 0, 2, 3, 4).contiguous()
    out = torch.empty(1, b, s // p, h, d, dtype=full.dtype, device=full.device)
    comm.reduce_scatter(out, rank_major)
    return out[0]


def _blocks(causal: bool, rank: int, p: int, local_len: int):
    """(local query rows, number of global keys, causal_offset) per kernel call."""
    if not causal:
        return [(slice(None), p * local_len, None)]
    c = local_len // 2
    front_end, back_end = (rank + 1) * c, (2 * p - rank) * c
    # query i of a chunk starting at global g sees keys j <= g + i: offset g = keys - c (bottom-right)
    return [(slice(0, c), front_end, front_end - c), (slice(c, 2 * c), back_end, back_end - c)]


@register
class AllGatherKV(DocumentSharding, Method):
    name = "allgather_kv"
    description = "all-gather K/V, then local attention (Llama 3 / Megatron all_gather), zigzag layout"
    layout_kind = "zigzag"
    gathers_whole_sequence = True
    test_variants = ({}, {"sharding": "documents"})

    def __init__(self, kernel: str = "auto", sharding: str = "sequence"):
        super().__init__(kernel)
        self._init_sharding(sharding)

    def options(self):
        return {**super().options(), "sharding": self.sharding}

    def layout(self, case: Case) -> layouts.Layout:
        return self.document_layout(case) if self.by_documents else super().layout(case)


    def _calls(self, causal: bool, comm: Comm, local_len: int, masks):
        """(local query rows, number of global keys, causal offset) per kernel call: the zigzag's
        two bottom-right-aligned calls, or by documents one call against every key (masked)."""
        if masks is not None and self.by_documents:
            return [(slice(None), comm.world_size * local_len, None)]
        return _blocks(causal, comm.rank, comm.world_size, local_len)

    def expected_bytes(self, case: Case, pass_: str) -> tuple[int, int]:
        p, l = case.world_size, case.seq_len // case.world_size
        e, a = element_bytes(case)
        kv = 2 * case.batch * l * case.kv_heads * case.head_dim
        n = (p - 1) * kv * e                              # all-gather K, V
        if pass_ == "fwd_bwd":
            n += (p - 1) * kv * e + (p - 1) * kv * a      # again; reduce-scatter the fp32 dK, dV
        return n, n

    def _order(self, comm: Comm, local_len: int, masks) -> torch.Tensor:
        """Global positions of the gathered tokens, rank by rank (to put them in global order)."""
        if masks is not None:
            return torch.cat([masks.positions(r) for r in range(comm.world_size)])
        lay = layouts.zigzag(comm.world_size * local_len, comm.world_size)
        return torch.cat([lay.positions(r) for r in range(comm.world_size)])

    def _mask(self, masks, comm: Comm, rows, keys: int):
        """The documents' mask of local rows against the gathered keys [0, keys) in global order."""
        if masks is None:
            return None
        return masks.docs.block(masks.positions(comm.rank)[rows], torch.arange(keys), masks.causal)

    def forward(self, q, k, v, *, comm, causal, scale, return_lse, docs=None):
        masks = self.block_masks(q, k, comm, causal, self.documents_for(q, comm, docs))
        order = self._order(comm, q.shape[1], masks).to(q.device)
        k_full, v_full = _gather_global(comm, k, order), _gather_global(comm, v, order)
        outs, lses = [], []
        for rows, keys, offset in self._calls(causal, comm, q.shape[1], masks):
            o, l = kernels.block_forward(q[:, rows], k_full[:, :keys], v_full[:, :keys], scale=scale,
                                         causal_offset=offset, kernel=self.kernel,
                                         mask=self._mask(masks, comm, rows, keys))
            outs.append(o)
            lses.append(l)
        out, lse = torch.cat(outs, dim=1), torch.cat(lses, dim=2)
        return out, lse, (q, k, v, out, lse, masks)

    def backward(self, dout, residuals, *, comm, causal, scale, docs=None):
        q, k, v, out, lse, masks = residuals
        order = self._order(comm, q.shape[1], masks).to(q.device)
        k_full, v_full = _gather_global(comm, k, order), _gather_global(comm, v, order)
        acc = kernels.acc_dtype(q.dtype)
        dq = torch.empty_like(q)
        dk_full = torch.zeros(k_full.shape, dtype=acc, device=q.device)
        dv_full = torch.zeros(v_full.shape, dtype=acc, device=q.device)
        for rows, keys, offset in self._calls(causal, comm, q.shape[1], masks):
            bdq, bdk, bdv = kernels.block_backward(dout[:, rows], q[:, rows], k_full[:, :keys], v_full[:, :keys],
                                                   out[:, rows], lse[:, :, rows], scale=scale,
                                                   causal_offset=offset, kernel=self.kernel,
                                                   mask=self._mask(masks, comm, rows, keys))
            dq[:, rows] = bdq
            # add_ on the slice, not `+=` on an indexed tensor: Python's augmented assignment would
            # write the sum back through __setitem__, a second full pass over the slice
            dk_full[:, :keys].add_(bdk)
            dv_full[:, :keys].add_(bdv)
        dk = _reduce_scatter_global(comm, dk_full, order)
        dv = _reduce_scatter_global(comm, dv_full, order)
        return dq, dk.to(k.dtype), dv.to(v.dtype)
