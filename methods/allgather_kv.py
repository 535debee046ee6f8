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
    forward:  sent = received = (P-1) * B*L*Hkv*(D+Dv)*e                   (all-gather K, V)
    backward: sent = received = (P-1) * B*L*Hkv*(D+Dv)*e + (P-1) * B*L*Hkv*(D+Dv)*a
                                              (all-gather K, V; reduce-scatter fp32 dK, dV)
Memory beyond inputs and outputs: the full sequence's K and V (2*B*S*Hkv*D*e), and in the
backward the full fp32 dK and dV: the one method here that does not stay within two K/V blocks.
"""

from __future__ import annotations

from typing import Optional

import torch

from methods import kernels, layouts, merge
from methods.base import Case, DocumentSharding, Method, element_bytes, unseen_kv_bytes
from methods.comm.base import Comm
from methods.registry import register


def _gather_global(comm: Comm, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """All ranks' x [B, L, Hkv, D] -> the global sequence [B, S, Hkv, D] in the order `order` [P, L]
    gives (rank r's token i goes to position order[r, i]; packed documents: any permutation)."""
    p = comm.world_size
    b, l, h, d = x.shape
    gathered = torch.empty(p, b, l, h, d, dtype=x.dtype, device=x.device)
    comm.all_gather(gathered, x.unsqueeze(0))  # [P, B, L, Hkv, D]
    full = torch.empty(b, p * l, h, d, dtype=x.dtype, device=x.device)
    # one indexed pass for any batch, reading the rank-major tokens through a permuted view
    # (reshaping that view to [B, S, ...] first copied it whenever B > 1)
    full[:, order] = gathered.permute(1, 0, 2, 3, 4)  # [B, P, L, Hkv, D] -> global
    return full


def _reduce_scatter_global(comm: Comm, full: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Sum over ranks of full [B, S, Hkv, D] (global order), this rank's tokens [B, L, Hkv, D].
    where: (rank, token) [S] each, which rank's which token every global position is."""
    p = comm.world_size
    b, s, h, d = full.shape
    rank_major = torch.empty(p, b, s // p, h, d, dtype=full.dtype, device=full.device)
    # one indexed pass into the collective's rank-major buffer (indexing then .contiguous() made
    # two when B > 1), reading the global order through a transposed view
    rank_major[where[0], :, where[1]] = full.transpose(0, 1)  # [S, B, Hkv, D] -> [P, B, L, Hkv, D]
    out = torch.empty(1, b, s // p, h, d, dtype=full.dtype, device=full.device)
    comm.reduce_scatter(out, rank_major)
    return out[0]


def _start_full(block: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A gradient accumulator [B, S, Hkv, D] in the accumulator dtype holding the first call's
    gradient block [B, keys, Hkv, D] (its first keys): one cast pass for the block and zeros only
    for the keys it does not cover (zeros for all, then adding it, wrote S twice)."""
    acc = merge.acc_dtype(block.dtype)
    b, keys, h, d = block.shape
    if keys == seq_len:
        return block.to(acc)
    full = torch.empty(b, seq_len, h, d, dtype=acc, device=block.device)
    full[:, :keys].copy_(block)
    full[:, keys:].zero_()
    return full


class _Zigzag:
    """The gathered K/V of the zigzag layout held sequence-major, so that no step copies more than
    the layout needs: every rank's tokens as [L, B, ...] pieces (a local transpose, a view with a
    batch of one), gathered rank-major [P, 2, c, B, ...] with one all-gather.

    Without a mask the order of keys is free: the keys are the gathered buffer itself (a strided
    view [B, S, ...], which flash-attn takes as it is). With the causal mask the two calls need
    global order, which interleaves front chunks (chunk r = rank r's front) with back chunks in
    reverse (chunk 2P-1-r = rank r's back): one copy into [2P, c, B, ...]. dK/dV are accumulated in
    fp32 directly in the rank-major layout the reduce-scatter sends (each call's gradient added
    through strided views, the reversed back chunks one op each), so nothing is reordered or
    copied before the reduce-scatter, and the result is cast once."""

    def __init__(self, comm: Comm, causal: bool, x: torch.Tensor):
        self.comm, self.causal = comm, causal
        self.p, (self.b, self.l) = comm.world_size, x.shape[:2]
        self.c = self.l // 2
        # back chunks of global index P..2P-1 belong to ranks P-1..0
        self.reverse = torch.arange(self.p - 1, -1, -1, device=x.device)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x [B, L, ...] -> keys [B, S, ...] (a view): rank-major without a mask, in global
        order with the causal mask."""
        p, b, l, c = self.p, self.b, self.l, self.c
        rest = x.shape[2:]
        gathered = torch.empty(p, l, b, *rest, dtype=x.dtype, device=x.device)
        self.comm.all_gather(gathered, x.transpose(0, 1).contiguous().unsqueeze(0))
        if self.causal:
            pieces = gathered.view(p, 2, c, b, *rest)
            full = torch.empty(2, p, c, b, *rest, dtype=x.dtype, device=x.device)
            full[0].copy_(pieces[:, 0])  # fronts: chunk r = rank r
            full[1].index_copy_(0, self.reverse, pieces[:, 1])  # backs: chunk 2P-1-r = rank r
            gathered = full
        return gathered.view(p * l, b, *rest).transpose(0, 1)

    def add_grad_(self, acc: torch.Tensor, grad: torch.Tensor, start: bool) -> None:
        """acc [P, 2, c, B, ...] (rank-major, sequence-major) += grad [B, n, ...], the gradient of the
        first n keys of `gather`; `start`: the first call, whose keys cover every key another call
        reads, writes instead of adding (and zeroes what it does not cover)."""
        p, b, c = self.p, self.b, self.c
        rest = grad.shape[2:]
        if not self.causal:  # the keys are rank-major: the gradient is in acc's order already
            flat = acc.view(p * self.l, b, *rest)
            if start:
                flat.copy_(grad.transpose(0, 1))
            else:
                flat.add_(grad.transpose(0, 1))
            return
        chunks = grad.shape[1] // c
        g = grad.view(b, chunks, c, *rest).permute(1, 2, 0, *range(3, 3 + len(rest)))  # [chunks, c, B, ...]
        fronts = min(chunks, p)
        if start:
            acc[:fronts, 0].copy_(g[:fronts])
            acc[fronts:, 0].zero_()
            acc[: 2 * p - chunks, 1].zero_()
        else:
            acc[:fronts, 0].add_(g[:fronts])
        # back chunks, global index P.. = ranks P-1, P-2, ...: one op each (a reversed run is no
        # strided view, and indexed copies need one dtype where the gradient is bf16 and acc fp32)
        for chunk in range(p, chunks):
            (acc[2 * p - 1 - chunk, 1].copy_ if start else acc[2 * p - 1 - chunk, 1].add_)(g[chunk])

    def reduce_scatter(self, acc: torch.Tensor, dtype) -> torch.Tensor:
        """The sum over ranks of acc, this rank's share [B, L, ...] in `dtype` (one cast)."""
        out = torch.empty(1, *acc.shape[1:], dtype=acc.dtype, device=acc.device)
        self.comm.reduce_scatter(out, acc)
        rest = acc.shape[4:]
        return out[0].view(self.l, self.b, *rest).transpose(0, 1).to(dtype, memory_format=torch.contiguous_format)


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
    supports_sinks = True  # folds the sinks once per row (merge.fold_sink) after its last merge
    gathers_whole_sequence = True
    test_variants = ({}, {"sharding": "documents"})

    def _calls(self, causal: bool, comm: Comm, local_len: int, masks):
        """(local query rows, number of global keys, causal offset) per kernel call: the zigzag's
        two bottom-right-aligned calls, or by documents one call against every key (masked)."""
        if masks is not None and self.masks_every_block:
            return [(slice(None), comm.world_size * local_len, None)]
        return _blocks(causal, comm.rank, comm.world_size, local_len)

    def expected_bytes(self, case: Case, pass_: str) -> tuple[int, int]:
        p, l = case.world_size, case.seq_len // case.world_size
        e, a = element_bytes(case)
        kv = case.batch * l * case.kv_heads * case.kv_dims  # K and V (MLA: unequal head dims)
        n = (p - 1) * kv * e  # all-gather K, V
        if pass_ == "fwd_bwd":
            n += (p - 1) * kv * e + (p - 1) * kv * a  # again; reduce-scatter the fp32 dK, dV
        return n, n

    def redundant_kv_bytes(self, case: Case, rank: int) -> Optional[int]:
        """The gather brings every other rank's K/V: the keys of it this rank's queries do not see."""
        pos = self.layout(case).positions
        return sum(unseen_kv_bytes(case, pos(rank), pos(r)) for r in range(case.world_size) if r != rank)

    def _order(self, comm: Comm, local_len: int, masks) -> torch.Tensor:
        """Global positions of the gathered tokens [P, L], rank by rank (to put them in global
        order); host index arithmetic, on the CPU."""
        if masks is not None:
            return torch.stack([masks.positions(r) for r in range(comm.world_size)])
        lay = layouts.zigzag(comm.world_size * local_len, comm.world_size)
        return torch.stack([lay.positions(r) for r in range(comm.world_size)])

    @staticmethod
    def _where(order: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse of `order` [P, L]: (rank, token) [S] each of every global position, on `device`."""
        flat = torch.argsort(order.flatten())  # [S] global -> rank-major
        l = order.shape[1]
        return (flat // l).to(device), (flat % l).to(device)

    def _mask(self, masks, comm: Comm, rows, keys: int):
        """The documents' mask of local rows against the gathered keys [0, keys) in global order."""
        if masks is None:
            return None
        return masks.docs.block(masks.positions(comm.rank)[rows], torch.arange(keys), masks.causal)

    def forward(self, q, k, v, *, comm, causal, scale, return_lse, docs=None, sinks=None):
        masks = self.block_masks(q, k, comm, causal, self.documents_for(q, comm, docs))
        k_full, v_full, _ = self._gather(comm, causal, masks, q, k, v)
        outs, lses = [], []
        for rows, keys, offset in self._calls(causal, comm, q.shape[1], masks):
            o, l = kernels.block_forward(
                q[:, rows],
                k_full[:, :keys],
                v_full[:, :keys],
                scale=scale,
                causal_offset=offset,
                kernel=self.kernel,
                mask=self._mask(masks, comm, rows, keys),
            )
            outs.append(o)
            lses.append(l)
        out, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs, dim=1), torch.cat(lses, dim=2))
        if sinks is not None:  # once per row, after the last merge (docs/DESIGN.md section 4)
            out, lse = merge.fold_sink(out, lse, sinks)
        return out, lse, (q, k, v, out, lse, masks)

    def _gather(self, comm, causal, masks, q, k, v):
        """(K, V) of the whole sequence [B, S, Hkv, D] in the order the calls read them, and the
        zigzag layout that put them there (None with packed documents: positions order them)."""
        if masks is None:
            zz = _Zigzag(comm, causal, k)
            return zz.gather(k), zz.gather(v), zz
        order = self._order(comm, q.shape[1], masks).to(q.device)
        return _gather_global(comm, k, order), _gather_global(comm, v, order), None

    def backward(self, dout, residuals, *, comm, causal, scale, docs=None):
        q, k, v, out, lse, masks = residuals
        k_full, v_full, zz = self._gather(comm, causal, masks, q, k, v)
        acc = merge.acc_dtype(q.dtype)
        dk_acc: Optional[torch.Tensor]
        dv_acc: Optional[torch.Tensor]
        if zz is not None:  # rank-major fp32 accumulators, the reduce-scatter's input as they are
            shape = (comm.world_size, 2, zz.c, k.shape[0], k.shape[2])  # then each tensor's head dim
            dk_acc = torch.empty(*shape, k.shape[3], dtype=acc, device=q.device)
            dv_acc = torch.empty(*shape, v.shape[3], dtype=acc, device=q.device)
        else:  # packed documents: the first call's gradients start the accumulators
            dk_acc = dv_acc = None
        calls = sorted(self._calls(causal, comm, q.shape[1], masks), key=lambda call: -call[1])
        dq: Optional[torch.Tensor] = torch.empty_like(q) if len(calls) > 1 else None  # one call: its dq is the result
        # the call over the most keys first: it covers every key another call reads, so it starts
        # the accumulators
        for i, (rows, keys, offset) in enumerate(calls):
            bdq, bdk, bdv = kernels.block_backward(
                dout[:, rows],
                q[:, rows],
                k_full[:, :keys],
                v_full[:, :keys],
                out[:, rows],
                lse[:, :, rows],
                scale=scale,
                causal_offset=offset,
                kernel=self.kernel,
                mask=self._mask(masks, comm, rows, keys),
            )
            if len(calls) == 1:
                dq = bdq
            else:
                assert dq is not None
                dq[:, rows] = bdq
            if zz is not None:
                assert dk_acc is not None and dv_acc is not None
                zz.add_grad_(dk_acc, bdk, start=i == 0)
                zz.add_grad_(dv_acc, bdv, start=i == 0)
            elif i == 0:
                dk_acc, dv_acc = _start_full(bdk, k_full.shape[1]), _start_full(bdv, v_full.shape[1])
            else:
                # add_ on the slice, not `+=` on an indexed tensor: Python's augmented assignment would
                # write the sum back through __setitem__, a second full pass over the slice
                assert dk_acc is not None and dv_acc is not None
                dk_acc[:, :keys].add_(bdk)
                dv_acc[:, :keys].add_(bdv)
        assert dk_acc is not None and dv_acc is not None  # set above, or by the first call
        if zz is not None:
            return dq, zz.reduce_scatter(dk_acc, k.dtype), zz.reduce_scatter(dv_acc, v.dtype)
        where = self._where(self._order(comm, q.shape[1], masks), q.device)
        dk = _reduce_scatter_global(comm, dk_acc, where)
        dv = _reduce_scatter_global(comm, dv_acc, where)
        return dq, dk.to(k.dtype), dv.to(v.dtype)
