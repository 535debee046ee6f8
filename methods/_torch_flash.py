"""PyTorch's own fused CUDA attention as a block kernel ("torch_flash"): the kernel a GPU without
flash-attn installed runs. The one place that touches its private ops.

`aten._scaled_dot_product_flash_attention` (the flash-attention 2 code PyTorch ships) returns the
log-sum-exp beside the output, and `aten._scaled_dot_product_flash_attention_backward` takes a given
out and lse, which is what a ring needs (the *global* out and lse of each query row). Inputs are
[B, H, S, D] views of our [B, S, H, D] tensors (no copy); the kernel takes GQA as it is (query heads
a multiple of KV heads).

Mask mapping: the op's causal flag is that of the kernel it wraps, and PyTorch's public API refuses it
for Sq != Sk, so we use it only on square blocks, where top-left and bottom-right agree. Any causal
offset c (query i sees key j iff j <= i + c) is cut into at most three such calls (`pieces`): the
first d = max(0, -c) rows see nothing; below them, keys left of the diagonal form a full block, the
diagonal a square causal block, and rows past the diagonal's last key a full block. The pieces of a
row are merged by online softmax (forward) and their gradients added (backward, each with the global
out and lse). A band or a dense mask is not this op's: methods/kernels.py runs those blocks by
document piece, and a band piece on the math kernel.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

from methods.merge import acc_dtype, empty_accumulators, merge_

_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward")


def status() -> tuple[bool, str]:
    missing = [op for op in _OPS if not hasattr(torch.ops.aten, op)]
    if missing:
        return False, f"torch {torch.__version__} lacks aten.{missing[0]}"
    if not torch.cuda.is_available():
        return False, "PyTorch's CUDA flash attention needs a CUDA device"
    return True, f"aten._scaled_dot_product_flash_attention of torch {torch.__version__} (CUDA, fp16/bf16)"


def _ops():
    """(forward op, backward op); a function so that CPU tests can stand in for the CUDA ops."""
    return (
        torch.ops.aten._scaled_dot_product_flash_attention,
        torch.ops.aten._scaled_dot_product_flash_attention_backward,
    )


def pieces(sq: int, sk: int, causal_offset: Optional[int]) -> list[tuple[slice, slice, bool]]:
    """(rows, cols, causal) calls whose visible pairs are exactly the block's, none overlapping: each
    full or a square causal diagonal. Empty for a block no row of which sees a key."""
    if causal_offset is None or causal_offset >= sk - 1:
        return [(slice(0, sq), slice(0, sk), False)]
    d = max(0, -causal_offset)  # rows above d see nothing
    if d >= sq:
        return []
    c = causal_offset + d  # row d + i sees keys j <= i + c, 0 <= c < sk - 1
    m = min(sq - d, sk - c)  # the diagonal's side
    out = [(slice(d, sq), slice(0, c), False)] if c > 0 else []
    out.append((slice(d, d + m), slice(c, c + m), True))
    if sq - d > m:  # rows below the diagonal's last key see every key up to it
        out.append((slice(d + m, sq), slice(c, c + m), False))
    return out


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] -> the op's [B, H, S, D], a view (the op needs only a unit last stride)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x.transpose(1, 2)


@lru_cache(maxsize=None)
def _unused_rng_state(device: torch.device) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, device=device)


def _forward_call(q, k, v, scale: float, causal: bool):
    ret = _ops()[0](_bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, False, scale=scale)
    return ret[0].transpose(1, 2), ret[1].to(acc_dtype(q.dtype))


def _backward_call(dout, q, k, v, out, lse, scale: float, causal: bool):
    # No dropout: the random-state tensors are unused (one per device, not an allocation per call in
    # the timed region); undefined cumulative lengths select the dense (not varlen) kernel.
    unused = _unused_rng_state(q.device)
    grads = _ops()[1](
        _bhsd(dout),
        _bhsd(q),
        _bhsd(k),
        _bhsd(v),
        _bhsd(out),
        lse.to(acc_dtype(q.dtype)).contiguous(),
        None,
        None,
        q.shape[1],
        k.shape[1],
        0.0,
        causal,
        unused,
        unused,
        scale=scale,
    )
    return tuple(g.transpose(1, 2) for g in grads)


def forward(q, k, v, *, scale: float, causal_offset: Optional[int]):
    b, sq, h, _ = q.shape
    calls = pieces(sq, k.shape[1], causal_offset)
    if calls and calls[0][:2] == (slice(0, sq), slice(0, k.shape[1])):  # one call covers the block: no merge
        return _forward_call(q, k, v, scale, calls[0][2])
    out, lse = empty_accumulators(q, v.shape[-1])
    for rows, cols, causal in calls:
        piece_out, piece_lse = _forward_call(q[:, rows], k[:, cols], v[:, cols], scale, causal)
        merge_(out[:, rows], lse[:, :, rows], piece_out, piece_lse)
    return out.to(q.dtype), lse


def backward(dout, q, k, v, out, lse, *, scale: float, causal_offset: Optional[int]):
    sq, sk = q.shape[1], k.shape[1]
    calls = pieces(sq, sk, causal_offset)
    if calls and calls[0][:2] == (slice(0, sq), slice(0, sk)):
        return _backward_call(dout, q, k, v, out, lse, scale, calls[0][2])
    acc = acc_dtype(q.dtype)
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
    for rows, cols, causal in calls:
        gq, gk, gv = _backward_call(
            dout[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows], lse[:, :, rows], scale, causal
        )
        dq[:, rows] += gq
        dk[:, cols] += gk
        dv[:, cols] += gv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
