"""DeepSpeed-Ulysses (Jacobs et al., 2023; arXiv 2309.14509): all-to-all from sequence to heads.

Rank r holds tokens [r*S/P, (r+1)*S/P) with all heads. One all-to-all per tensor (q, k, v)
scatters heads and gathers the sequence, so each rank holds every token for H/P query heads; a
single local attention (any kernel, causal on the aligned full sequence) runs unchanged; one
all-to-all brings the output back to S/P tokens x all heads. The backward mirrors it: dout goes
to heads, the local kernel backward runs, dq, dk, dv go back to the sequence layout.

Head constraints: heads % P == 0. KV heads: kv_heads % P == 0, or, with GQA and fewer KV heads
than ranks, P % kv_heads == 0: each KV head is then replicated P/kv_heads times before the
all-to-all (one KV head per rank) and dK/dV are summed over the replicas (methods/ulysses_a2a.py).
Let Hkv' = max(kv_heads, P) be the KV heads sent.

Communication per rank (L = S/P, e = bytes per element; all-to-all keeps 1/P of each buffer
local, so (P-1)/P of it leaves the rank):
    forward:  sent = received = (P-1)/P * B*L*(D+Dv)*e * (H + Hkv')        (q, out; k, v)
              (+ (P-1)/P * B*L*H*4 for the lse, only when the caller asks for it or passes sinks)
    backward: sent = received = (P-1)/P * B*L*(D+Dv)*e * (H + Hkv')        (dout, dq; dk, dv)
(D + Dv = 2*D but under MLA: q, k, dq, dk have the query/key head dim, v, out, dout, dv the values'.)

Memory beyond inputs and outputs: q, k, v, out in the head layout (full sequence, H/P heads),
saved for the backward.
"""

from __future__ import annotations

from typing import Optional

import torch

from methods import kernels, merge
from methods.base import Case, Method, unseen_kv_bytes
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


@register
class Ulysses(Method):
    name = "ulysses"
    description = "DeepSpeed-Ulysses: all-to-all sequence<->heads around one local attention"
    layout_kind = "contiguous"
    supports_sinks = True  # folded once per row in the head layout, with its heads' slice of the sinks

    def degrees(self, case: Case) -> tuple[int, int]:
        return case.world_size, 1

    def expected_bytes(self, case: Case, pass_: str) -> tuple[int, int]:
        n = ulysses_bytes(case, case.world_size) * (2 if pass_ == "fwd_bwd" else 1)
        if case.sinks:  # the sink's gradient reads every local row's lse: it comes back too
            n += ulysses_lse_bytes(case, case.world_size)
        return n, n

    def redundant_kv_bytes(self, case: Case, rank: int) -> Optional[int]:
        """The all-to-all brings every other rank's tokens of this rank's KV heads, and its queries
        are the whole sequence: only keys nobody sees (padding) are received for nothing."""
        p = case.world_size
        heads = case.kv_heads * kv_replication(case.kv_heads, p) // p
        lay, everything = self.layout(case), torch.arange(case.seq_len)
        return sum(unseen_kv_bytes(case, everything, lay.positions(r), heads) for r in range(p) if r != rank)

    def supports(self, case: Case) -> tuple[bool, str]:
        reason = check_ulysses_heads(case.heads, case.kv_heads, case.world_size)
        return (False, reason) if reason else super().supports(case)

    def forward(self, q, k, v, *, comm, causal, scale, return_lse, docs=None, sinks=None):
        offset = 0 if causal else None
        # after the all-to-all every rank holds the whole sequence in order: one block, all positions
        mask = docs.block(torch.arange(docs.padded_len), torch.arange(docs.padded_len), causal) if docs else None
        if comm.world_size == 1:
            out, lse = kernels.block_forward(q, k, v, scale=scale, causal_offset=offset, kernel=self.kernel, mask=mask)
            if sinks is not None:
                out, lse = merge.fold_sink(out, lse, sinks)
            return out, lse, (q, k, v, out, lse, 1, mask)
        # [B, S, H/P, D], sequence-major views: the one local kernel reads them as they are
        q_h, k_h, v_h, rep = ulysses_scatter_heads(comm, q, k, v, contiguous=False)
        out_h, lse_h = kernels.block_forward(
            q_h, k_h, v_h, scale=scale, causal_offset=offset, kernel=self.kernel, mask=mask
        )  # [B, S, H/P, D], [B, H/P, S]
        if sinks is not None:  # every row of this rank's heads is final here: their slice of the sinks
            out_h, lse_h = merge.fold_sink(out_h, lse_h, head_slice(sinks, comm))
        out = heads_to_seq(comm, out_h)  # [B, L, H, D]
        lse_seq = lse_heads_to_seq(comm, lse_h) if return_lse else None  # [B, H, L]
        return out, lse_seq, (q_h, k_h, v_h, out_h, lse_h, rep, mask)

    def backward(self, dout, residuals, *, comm, causal, scale, docs=None):
        q_h, k_h, v_h, out_h, lse_h, rep, mask = residuals
        offset = 0 if causal else None
        if comm.world_size == 1:
            return kernels.block_backward(
                dout, q_h, k_h, v_h, out_h, lse_h, scale=scale, causal_offset=offset, kernel=self.kernel, mask=mask
            )
        dout_h = seq_to_heads(comm, dout, contiguous=False)
        dq_h, dk_h, dv_h = kernels.block_backward(
            dout_h, q_h, k_h, v_h, out_h, lse_h, scale=scale, causal_offset=offset, kernel=self.kernel, mask=mask
        )
        return ulysses_gather_grads(comm, dq_h, dk_h, dv_h, rep)
