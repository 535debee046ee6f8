"""The Ulysses all-to-all reshuffles (sequence-sharded <-> head-sharded) that ulysses and usp share,
with their byte formulas and the KV-head replication they need.

(The online-softmax merge lives in methods/merge.py, the accumulators built on it in
methods/accumulators.py; the K/V ring loop in methods/kv_ring.py.)
"""

from __future__ import annotations

import torch

from methods.comm.base import Comm


def seq_to_heads(comm: Comm, x: torch.Tensor, rep: int = 1, contiguous: bool = True) -> torch.Tensor:
    """All-to-all from sequence-sharded to head-sharded (DeepSpeed-Ulysses, first all-to-all).

    x: [B, S_local, H, D] holding this rank's contiguous tokens and all heads; `rep` > 1 replicates
    each head that many times first (GQA with fewer KV heads than ranks: then one head per rank).
    Returns [B, S_local * P, H*rep / P, D]: every token, heads [rank*H/P, (rank+1)*H/P).

    One copy in any case: the send buffer is built sequence-major [P, S_local, B, H/P, D] straight
    from x (the replication folded into it), so what arrives is the sequence-major [S, B, H/P, D]
    the result views; with `contiguous` False the caller takes that strided view (a kernel reads it
    as it is), else it is made contiguous (a second copy only with a batch above one: the ring of
    USP sends its blocks as they are).
    """
    p = comm.world_size
    b, s, h, d = x.shape
    hp = h * rep // p
    send = torch.empty(p, s, b, hp, d, dtype=x.dtype, device=x.device)
    if rep == 1:
        send.copy_(x.view(b, s, p, hp, d).permute(2, 1, 0, 3, 4))
    else:  # h * rep == p: rank g gets head g // rep
        send.view(h, rep, s, b, d).copy_(x.permute(2, 1, 0, 3).unsqueeze(1).expand(h, rep, s, b, d))
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send)  # [P(src), S_local, B, H/P, D]
    out = recv.view(p * s, b, hp, d).transpose(0, 1)  # [B, S, H/P, D]
    return out.contiguous() if contiguous else out


def heads_to_seq(comm: Comm, x: torch.Tensor, rep: int = 1) -> torch.Tensor:
    """Inverse of `seq_to_heads`: [B, S, H/P, D] -> [B, S/P, H / rep, D], summing the `rep`
    replicas of each head (their gradients) in the pass that puts the heads in place.

    One copy in any case: the send buffer is sequence-major [P, S_local, B, H/P, D] as in
    `seq_to_heads`, a view of a sequence-major x (what the kernel writes for the sequence-major
    heads `seq_to_heads` hands it) or of any x with one sequence; the one pass is out of the receive
    buffer into [B, S_local, H, D] (a batch-major send buffer was a second copy when B > 1, and
    the replicas' sum a pass of its own).
    """
    p = comm.world_size
    b, s, hp, d = x.shape
    sl = s // p
    send = x.reshape(b, p, sl, hp, d).permute(1, 2, 0, 3, 4)  # [P, S_local, B, H/P, D]
    if not send.is_contiguous():
        send = send.contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send)  # [P(head group), S_local, B, H/P, D]
    out = torch.empty(b, sl, p * hp // rep, d, dtype=x.dtype, device=x.device)
    if rep == 1:
        out.view(b, sl, p, hp, d).copy_(recv.permute(2, 1, 0, 3, 4))  # [B, S_local, H, D]
    else:  # hp == 1: head group g holds a replica of head g // rep
        torch.sum(recv.view(p // rep, rep, sl, b, d), dim=1, out=out.permute(2, 1, 0, 3))
    return out


def lse_heads_to_seq(comm: Comm, lse: torch.Tensor) -> torch.Tensor:
    """[B, H/P, S] (all tokens, this rank's heads) -> [B, H, S/P] (this rank's tokens, all heads)."""
    p = comm.world_size
    b, hp, s = lse.shape
    send = lse.reshape(b, hp, p, s // p).permute(2, 0, 1, 3).contiguous()  # [P, B, H/P, S_local]
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send)  # [P(head group), B, H/P, S_local]
    return recv.permute(1, 0, 2, 3).reshape(b, p * hp, s // p)  # [B, H, S_local]


# -- Ulysses head scatter (DeepSpeed-Ulysses, and the Ulysses half of USP) ---------------------------
def kv_replication(kv_heads: int, degree: int) -> int:
    """How many times each KV head is replicated before the head scatter (1 = none).

    With fewer KV heads than Ulysses ranks (GQA), each KV head is copied degree/kv_heads times so
    that every rank gets one (verl, LoongTrain do the same); dK/dV are summed over the copies.
    """
    return 1 if kv_heads % degree == 0 else degree // kv_heads


def check_ulysses_heads(heads: int, kv_heads: int, degree: int) -> str:
    """'' if `degree` Ulysses ranks can split these heads, else the reason."""
    if heads % degree != 0:
        return f"ulysses needs heads divisible by the ulysses degree: {heads} % {degree} != 0"
    if kv_heads % degree != 0 and degree % kv_heads != 0:
        return (
            f"ulysses needs kv_heads divisible by the ulysses degree or the degree divisible by kv_heads "
            f"(KV replication): kv_heads={kv_heads}, degree={degree}"
        )
    return ""


def ulysses_bytes(case, degree: int) -> int:
    """Bytes one rank sends (and receives) in one direction of Ulysses over `degree` ranks: the
    all-to-alls of q, k, v and out (forward) or of dout, dq, dk, dv (backward). An all-to-all keeps
    1/degree of each buffer local; KV heads are replicated up to the degree when fewer. q, k, dq,
    dk have the query/key head dim, v, out, dout, dv the values' (they differ under MLA): each
    direction moves one tensor of each width per head kind."""
    e = case.torch_dtype.itemsize
    local = case.seq_len // case.world_size
    kv_sent = case.kv_heads * kv_replication(case.kv_heads, degree)
    return (degree - 1) * case.batch * local * case.kv_dims * e * (case.heads + kv_sent) // degree


def ulysses_lse_bytes(case, degree: int) -> int:
    """Bytes one rank sends (and receives) in the all-to-all that brings the lse [B, H, S] back to
    the sequence layout over `degree` Ulysses ranks (`lse_heads_to_seq`): paid when the caller
    asks for the lse, and with attention sinks, whose gradient reads every local row's lse."""
    from methods.merge import acc_dtype  # the lse is float32 (float64 for float64 inputs)

    local = case.seq_len // case.world_size
    return (degree - 1) * case.batch * local * case.heads * acc_dtype(case.torch_dtype).itemsize // degree


def head_slice(sinks: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The sinks [H] of the heads this rank holds after `seq_to_heads` over `comm`: heads
    [rank*H/P, (rank+1)*H/P)."""
    hp = sinks.shape[0] // comm.world_size
    return sinks[comm.rank * hp : (comm.rank + 1) * hp]


def ulysses_scatter_heads(comm: Comm, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, contiguous: bool = True):
    """q [B, L, H, D], k, v [B, L, Hkv, D] (this rank's tokens, all heads) -> every token of the
    group for this rank's heads: q_h [B, L*U, H/U, D], k_h, v_h [B, L*U, Hkv'/U, D], and the KV
    replication factor (Hkv' = Hkv * replication). U = comm.world_size. `contiguous`: see
    `seq_to_heads`."""
    degree = comm.world_size
    reason = check_ulysses_heads(q.shape[2], k.shape[2], degree)
    if reason:
        raise ValueError(reason)
    rep = kv_replication(k.shape[2], degree)
    return (
        seq_to_heads(comm, q, contiguous=contiguous),
        seq_to_heads(comm, k, rep, contiguous),
        seq_to_heads(comm, v, rep, contiguous),
        rep,
    )


def ulysses_gather_grads(comm: Comm, dq_h: torch.Tensor, dk_h: torch.Tensor, dv_h: torch.Tensor, rep: int):
    """Inverse of `ulysses_scatter_heads` for the gradients (summing the KV replicas' gradients)."""
    return heads_to_seq(comm, dq_h), heads_to_seq(comm, dk_h, rep), heads_to_seq(comm, dv_h, rep)
