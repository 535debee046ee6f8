"""A trace-only stand-in for flash-attn's kernel interface: the block kernels a peer library calls
(`flash_attn.flash_attn_interface._flash_attn_forward`, `_flash_attn_backward` and their varlen
versions, flash-attn 2.7's names and keywords) record one `Compute` per call on the calling virtual
rank and return placeholders on the inputs' (meta) device. Nothing is computed.

The simulator gives it to ring-flash-attn in place of flash-attn (suite/sim/peers.py loads the
library's own code against it) and to yunchang's flash-attn path, so `run.executor=sim` predicts
those libraries as they are written, with or without flash-attn installed. The interface itself
(flash-attn's names, keywords and conventions) is methods/peers/flash_attn_stand_in.py, which the
numerical CPU test double of it (tests/plugins/rfa_cpu_shim.py) shares.
"""

from __future__ import annotations

import contextlib
import threading
import types
from typing import Optional

import torch

from methods.base import dtype_name
from methods.kernels import visible_pairs
from methods.peers import flash_attn_stand_in as stand_in
from methods.peers.flash_attn_stand_in import causal_offset
from suite.sim.ledger import Compute, TracingKernel

VERSION = "2.7.4+suite-trace-stand-in"  # the interface it stands for: flash-attn 2.7's private one
_local = threading.local()  # .kernel: the TracingKernel of a virtual-rank thread


@contextlib.contextmanager
def recording(kernel: TracingKernel):
    """Record this thread's kernel calls on `kernel` while the block runs."""
    _local.kernel = kernel
    try:
        yield
    finally:
        _local.kernel = None


def _record(e: Compute):
    kernel = getattr(_local, "kernel", None)
    if kernel is None:
        raise RuntimeError("flash-attn trace stand-in called outside a trace: it computes nothing")
    return kernel.block(e)


def _dense(op: str, q: torch.Tensor, k: torch.Tensor, causal: bool) -> Compute:
    b, sq, h, d = q.shape
    return Compute(op, b, sq, k.shape[1], h, k.shape[2], d, causal_offset(sq, k.shape[1], causal), dtype_name(q.dtype))


def _varlen(op: str, q, k, cu_seqlens_q, cu_seqlens_k, causal: bool) -> Compute:
    """One packed call: a plain block when it holds one sequence, else its documents' pairs and,
    in document order, the documents' blocks (one launch: `Compute.varlen`)."""
    cq, ck = [int(x) for x in cu_seqlens_q.tolist()], [int(x) for x in cu_seqlens_k.tolist()]
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q has {len(cq) - 1} sequences and cu_seqlens_k {len(ck) - 1}")
    segments = [(b - a, d - c) for a, b, c, d in zip(cq, cq[1:], ck, ck[1:])]
    total_q, h, dim = q.shape
    total_k, kv_heads = k.shape[0], k.shape[1]
    if len(segments) == 1:
        sq, sk = segments[0]
        return Compute(op, 1, sq, sk, h, kv_heads, dim, causal_offset(sq, sk, causal), dtype_name(q.dtype))
    pairs = sum(visible_pairs(sq, sk, causal_offset(sq, sk, causal)) for sq, sk in segments)
    pieces: list[tuple[tuple[int, int, Optional[int], None], int]] = []
    for sq, sk in segments:  # in document order, runs of equal documents merged
        piece = (sq, sk, causal_offset(sq, sk, causal), None)
        if pieces and pieces[-1][0] == piece:
            pieces[-1] = (piece, pieces[-1][1] + 1)
        else:
            pieces.append((piece, 1))
    return Compute(
        op,
        1,
        total_q,
        total_k,
        h,
        kv_heads,
        dim,
        None,
        dtype_name(q.dtype),
        doc_pairs=pairs,
        pieces=tuple(pieces),
        varlen=True,
    )


def _forward(q, k, v, scale, causal):
    with _record(_dense("fwd", q, k, causal)):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    return out, lse


def _backward(dout, q, k, v, out, lse, dq, dk, dv, scale, causal) -> None:
    with _record(_dense("bwd", q, k, causal)):
        pass  # dq, dk, dv are written in place: placeholders already


def _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal):
    with _record(_varlen("fwd", q, k, cu_seqlens_q, cu_seqlens_k, causal)):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    return out, lse


def _varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, scale, causal) -> None:
    with _record(_varlen("bwd", q, k, cu_seqlens_q, cu_seqlens_k, causal)):
        pass


def modules() -> dict[str, types.ModuleType]:
    """`flash_attn` and `flash_attn.flash_attn_interface` as modules holding the stand-in, for a
    library that imports them by name."""
    return stand_in.modules(stand_in.BlockKernels(_forward, _backward, _varlen_forward, _varlen_backward), VERSION)
