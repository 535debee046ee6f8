"""Pieces shared by several methods: ring exchange and the Ulysses all-to-all reshuffles.

(The online-softmax merge lives in methods/kernels.py with the kernels it combines.)
"""
from __future__ import annotations

from typing import Sequence

import torch

from methods.comm.base import P2P, Comm, Work


def ring_shift(comm: Comm, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor]) -> Work:
    """Send each tensor of `sends` to rank+1 and receive the matching one of `recvs` from rank-1.

    Sends and receives are posted in the same order on every rank, so the i-th receive pairs
    with the i-th send of the previous rank (also when P = 2 and both neighbours are one rank).
    """
    p, r = comm.world_size, comm.rank
    nxt, prv = (r + 1) % p, (r - 1) % p
    ops = [P2P("send", t, nxt) for t in sends] + [P2P("recv", t, prv) for t in recvs]
    return comm.exchange(ops)


def seq_to_heads(comm: Comm, x: torch.Tensor) -> torch.Tensor:
    """All-to-all from sequence-sharded to head-sharded (DeepSpeed-Ulysses, first all-to-all).

    x: [B, S_local, H, D] holding this rank's contiguous tokens and all heads.
    Returns [B, S_local * P, H / P, D]: every token, heads [rank*H/P, (rank+1)*H/P).
    """
    p = comm.world_size
    b, s, h, d = x.shape
    send = x.reshape(b, s, p, h // p, d).permute(2, 0, 1, 3, 4).contiguous()   # [P, B, S_local, H/P, D]
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send)                                                # [P(src), B, S_local, H/P, D]
    return recv.permute(1, 0, 2, 3, 4).reshape(b, p * s, h // p, d)             # [B, S, H/P, D]


def heads_to_seq(comm: Comm, x: torch.Tensor) -> torch.Tensor:
    """Inverse of `seq_to_heads`: [B, S, H/P, D] -> [B, S/P, H, D]."""
    p = comm.world_size
    b, s, hp, d = x.shape
    send = x.reshape(b, p, s // p, hp, d).permute(1, 0, 2, 3, 4).contiguous()  # [P, B, S_local, H/P, D]
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send)                                                # [P(head group), B, S_local, H/P, D]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // p, p * hp, d)           # [B, S_local, H, D]


def lse_heads_to_seq(comm: Comm, lse: torch.Tensor) -> torch.Tensor:
    """[B, H/P, S] (all tokens, this rank's heads) -> [B, H, S/P] (this rank's tokens, all heads)."""
    p = comm.world_size
    b, hp, s = lse.shape
    send = lse.reshape(b, hp, p, s // p).permute(2, 0, 1, 3).contiguous()       # [P, B, H/P, S_local]
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send)                                                # [P(head group), B, H/P, S_local]
    return recv.permute(1, 0, 2, 3).reshape(b, p * hp, s // p)                  # [B, H, S_local]
