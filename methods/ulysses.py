"""DeepSpeed-Ulysses (Jacobs et al., 2023; arXiv 2309.14509): all-to-all from sequence to heads.

Rank r holds tokens [r*S/P, (r+1)*S/P) with all heads. One all-to-all per tensor (q, k, v)
scatters heads and gathers the sequence, so each rank holds every token for H/P query heads; a
single local attention (any kernel, causal on the aligned full sequence) runs unchanged; one
all-to-all brings the output back to S/P tokens x all heads. The backward mirrors it: dout goes
to heads, the local kernel backward runs, dq, dk, dv go back to the sequence layout.

Head constraints: heads % P == 0. KV heads: kv_heads % P == 0, or, with GQA and fewer KV heads
than ranks, P % kv_heads == 0: each KV head is then replicated P/kv_heads times before the
all-to-all (one KV head per rank; verl and LoongTrain do the same), and dK/dV are summed over the
replicas. Let Hkv' = max(kv_heads, P) be the KV heads sent.

Communication per rank (L = S/P, e = bytes per element; all-to-all keeps 1/P of each buffer
local, so (P-1)/P of it leaves the rank):
    forward:  sent = received = (P-1)/P * B*L*D*e * (2*H + 2*Hkv')        (q, out; k, v)
              (+ (P-1)/P * B*L*H*4 for the lse, only when the caller asks for it)
    backward: sent = received = (P-1)/P * B*L*D*e * (2*H + 2*Hkv')        (dout, dq; dk, dv)

Memory beyond inputs and outputs: q, k, v, out in the head layout (full sequence, H/P heads),
saved for the backward.
"""
from __future__ import annotations

from methods import kernels
from methods.base import Case, Method
from methods.common import heads_to_seq, lse_heads_to_seq, seq_to_heads
from methods.registry import register


def kv_replication(kv_heads: int, world_size: int) -> int:
    """How many times each KV head is replicated before the all-to-all (1 = none)."""
    return 1 if kv_heads % world_size == 0 else world_size // kv_heads


@register
class Ulysses(Method):
    name = "ulysses"
    description = "DeepSpeed-Ulysses: all-to-all sequence<->heads around one local attention"
    layout_kind = "contiguous"

    def degrees(self, world_size: int) -> tuple[int, int]:
        return world_size, 1

    def supports(self, case: Case) -> tuple[bool, str]:
        p = case.world_size
        if case.heads % p != 0:
            return False, f"ulysses needs heads divisible by world_size: {case.heads} % {p} != 0"
        if case.kv_heads % p != 0 and p % case.kv_heads != 0:
            return False, (f"ulysses needs kv_heads divisible by world_size or world_size divisible by "
                           f"kv_heads (KV replication): kv_heads={case.kv_heads}, world_size={p}")
        return super().supports(case)

    def forward(self, q, k, v, *, comm, causal, scale, return_lse):
        p = comm.world_size
        offset = 0 if causal else None
        if p == 1:
            out, lse = kernels.block_forward(q, k, v, scale=scale, causal_offset=offset, kernel=self.kernel)
            return out, lse, (q, k, v, out, lse)
        check_heads(q.shape[2], k.shape[2], p)
        rep = kv_replication(k.shape[2], p)
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)  # [B, L, P, D]
        q_h, k_h, v_h = seq_to_heads(comm, q), seq_to_heads(comm, k), seq_to_heads(comm, v)  # [B, S, H/P, D]
        out_h, lse_h = kernels.block_forward(q_h, k_h, v_h, scale=scale, causal_offset=offset,
                                             kernel=self.kernel)             # [B, S, H/P, D], [B, H/P, S]
        out = heads_to_seq(comm, out_h)                                      # [B, L, H, D]
        lse = lse_heads_to_seq(comm, lse_h) if return_lse else None          # [B, H, L]
        return out, lse, (q_h, k_h, v_h, out_h, lse_h, rep)

    def backward(self, dout, residuals, *, comm, causal, scale):
        q_h, k_h, v_h, out_h, lse_h, *rest = residuals
        p = comm.world_size
        offset = 0 if causal else None
        if p == 1:
            return kernels.block_backward(dout, q_h, k_h, v_h, out_h, lse_h, scale=scale,
                                          causal_offset=offset, kernel=self.kernel)
        dout_h = seq_to_heads(comm, dout)
        dq_h, dk_h, dv_h = kernels.block_backward(dout_h, q_h, k_h, v_h, out_h, lse_h, scale=scale,
                                                  causal_offset=offset, kernel=self.kernel)
        dq, dk, dv = heads_to_seq(comm, dq_h), heads_to_seq(comm, dk_h), heads_to_seq(comm, dv_h)
        rep = rest[0]
        if rep > 1:  # sum the gradients of each KV head's replicas
            b, l, h_sent, d = dk.shape
            dk = dk.view(b, l, h_sent // rep, rep, d).sum(dim=3)
            dv = dv.view(b, l, h_sent // rep, rep, d).sum(dim=3)
        return dq, dk, dv


def check_heads(heads: int, kv_heads: int, world_size: int) -> None:
    if heads % world_size != 0:
        raise ValueError(f"ulysses needs heads divisible by world_size: {heads} % {world_size} != 0")
    if kv_heads % world_size != 0 and world_size % kv_heads != 0:
        raise ValueError(f"ulysses needs kv_heads % world_size == 0 or world_size % kv_heads == 0; "
                         f"got kv_heads={kv_heads}, world_size={world_size}")
