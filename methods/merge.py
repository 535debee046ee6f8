"""The online-softmax merge: partial attention results over disjoint keys combined into one.

A block's result for a query row is its output o, softmax-normalised over the block's keys, and its
log-sum-exp l. Two results (o_a, l_a), (o_b, l_b) of the same rows over disjoint keys combine into
the attention over the union of the keys:

    l = log(e^l_a + e^l_b)
    o = o_a e^(l_a - l) + o_b e^(l_b - l) = o_a (1 - w) + o_b w,   w = e^(l_b - l) = sigmoid(l_b - l_a)

(0, -inf) is the empty result (a row that sees no key) and the merge's identity. A row empty on
both sides gives w = sigmoid(-inf - -inf) = NaN: w is set to 0 there, so the row stays (0, -inf).
Accumulators are fp32 (float64 for float64 inputs): out [B, S, H, D], lse [B, H, S] (`acc_dtype`).
The backward's per-row term D = rowsum(dO * O) [B, H, S] is here too (`softmax_delta`).

The eager functions just below are the merge; the public functions follow them. Further down, the
fused operators (docs/DESIGN.md section 6): each is a registered torch.library operator (the
simulator's tracer sees one op with its real bytes) that runs one torch.compile'd pass where
that pays and the eager function otherwise; where nothing needs the operator, the public
functions call the eager function directly (`_direct`).
"""

from __future__ import annotations

import threading
from typing import Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of LSE and of accumulators for inputs of `dtype`: float32, or float64 for float64
    inputs (so that float64 runs are exact to float64 rounding)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def empty_accumulators(q: torch.Tensor, head_dim_v: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh (out, lse) accumulators for queries q [B, S, H, D]: zeros float32 [B, S, H, Dv] and
    -inf float32 [B, H, S]. The output has the values' head dim `head_dim_v` (None: D), which
    differs from the queries' under MLA."""
    b, s, h, d = q.shape
    d = head_dim_v or d
    dt = acc_dtype(q.dtype)
    return (
        torch.zeros(b, s, h, d, dtype=dt, device=q.device),
        torch.full((b, h, s), float("-inf"), dtype=dt, device=q.device),
    )


# ---------------------------------------------------------------------------------------------
# The merge, eager (exact, in place, no temporaries of accumulator size)
# ---------------------------------------------------------------------------------------------
def _eager_weight(lse: torch.Tensor, block_lse: torch.Tensor) -> torch.Tensor:
    """The block's weight w = sigmoid(block_lse - lse) [B, S, H, 1], 0 where both sides are empty;
    the accumulator's is 1 - w. Updates `lse` to new_lse in place.

    Five small ops of lse size where the exp form takes about ten: at small CPU shapes each small
    op costs its dispatch, and the exp form's ops took longer than the passes over the accumulator.
    Laid out [B, S, H]: the passes over the accumulator would walk a transposed view of [B, H, S]
    with strided loads."""
    b, h, s = lse.shape
    w = torch.empty(b, s, h, dtype=lse.dtype, device=lse.device)
    torch.sigmoid(torch.sub(block_lse, lse).transpose(1, 2), out=w)
    w.nan_to_num_(nan=0.0)
    torch.logaddexp(lse, block_lse, out=lse)
    return w.unsqueeze(-1)


def _fold(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """a (1 - w) + b w, into a (`in_place`) or a fresh tensor of the promoted dtype. One `lerp` pass
    where a, b and w share a dtype; lerp takes only one, and casting a lower-precision b would be an
    accumulator-sized temporary, so otherwise a mul (bf16 x fp32 computes in fp32) and an addcmul_."""
    if a.dtype == b.dtype == w.dtype:
        return a.lerp_(b, w) if in_place else torch.lerp(a, b, w)
    return (a.mul_(1 - w) if in_place else torch.mul(a, 1 - w)).addcmul_(b, w)


def _merge_eager(out, lse, block_out, block_lse) -> None:
    _fold(out, block_out, _eager_weight(lse, block_lse), in_place=True)


def _merge_final_eager(out, lse, block_out, block_lse, dtype):
    # the one fresh fp32 buffer of the eager path: the operator reads the accumulator without
    # writing it (what the fused kernel does), and its result may not alias an input
    return _fold(out, block_out, _eager_weight(lse, block_lse)).to(dtype)


def _merge_start_eager(out_a, lse_a, out_b, lse_b, reuse_lse: bool = False):
    # fresh: the operator's inputs stay as they are and its results may not alias them; a direct
    # caller that hands over the block results lets lse_a become the accumulator (no copy)
    lse = lse_a if reuse_lse else lse_a.clone()
    return _fold(out_a, out_b, _eager_weight(lse, lse_b)), lse


def _sum_start_eager(a, b):
    # fresh: a stays as it is, laid out like a (a travelling accumulator stays contiguous)
    acc = acc_dtype(a.dtype)
    if a.dtype == acc == b.dtype:
        return torch.add(a, b, out=torch.empty_like(a))  # one pass
    # lower-precision gradients: an add would compute in their dtype, so cast first, then add in fp32
    return a.to(acc, copy=True).add_(b)


def _delta_eager(dout, out):
    acc = acc_dtype(dout.dtype)
    return (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()  # [B, H, S]


# ---------------------------------------------------------------------------------------------
# Public functions: the eager merge called directly, or its operator
# ---------------------------------------------------------------------------------------------
def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's partial attention into running accumulators, in place (online softmax).

    Args:
        out: [B, S, H, D] float32 accumulator (normalised output so far); may be a view.
        lse: [B, H, S] float32 accumulator (-inf where nothing was seen yet); may be a view.
        block_out: [B, S, H, D] any float dtype; block_lse: [B, H, S] float32.

    new_lse = log(e^lse + e^block_lse); out = out * e^(lse - new_lse) + block_out * e^(block_lse - new_lse).
    Stable for -inf on either side: a row with nothing seen on both sides stays (0, -inf) instead of
    becoming NaN (the plain sigmoid form, which ring-flash-attn uses, gives NaN there; the eager
    path here uses that form with the NaN set to 0). One fused pass.
    """
    if _direct(out):
        _merge_eager(out, lse, block_out, block_lse)
        return
    torch.ops.sp_attention.merge_(out, lse, block_out, block_lse)


def merge_final(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The last merge with the cast to the output dtype fused in: returns the merged output [B, S, H, D]
    in `dtype` (a new tensor) and updates `lse` in place; the accumulator `out` is only read. Saves
    a pass over the fp32 accumulator."""
    if _direct(out):
        return _merge_final_eager(out, lse, block_out, block_lse, dtype)
    return torch.ops.sp_attention.merge_final(out, lse, block_out, block_lse, dtype)


def merge_start(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulators (out fp32, lse) holding the merge of two blocks' results over every row: one
    pass (fused where compiled) instead of casting the first into an accumulator and merging the
    second into it. The block results are the caller's to give away (lse_a may be reused)."""
    if _direct(out_a):
        return _merge_start_eager(out_a, lse_a, out_b, lse_b, reuse_lse=True)
    return torch.ops.sp_attention.merge_start(out_a, lse_a, out_b, lse_b)


def sum_start(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b, two gradients of every row in the input dtype, as a fresh accumulator (fp32; float64
    for float64), summed in the accumulator dtype: one pass where compiled (the eager fallback
    casts, then adds)."""
    if _direct(a):
        return _sum_start_eager(a, b)
    return torch.ops.sp_attention.sum_start(a, b)


def softmax_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dout * out) [B, H, S] in fp32 (float64 for float64) from dout, out [B, S, H, D]:
    the backward's per-row term, one fused pass (reads both once) where compiled."""
    if _direct(out):
        return _delta_eager(dout, out)
    return torch.ops.sp_attention.softmax_delta(dout, out)


# ---------------------------------------------------------------------------------------------
# Attention sinks (gpt-oss): one logit per query head in every row's denominator
# ---------------------------------------------------------------------------------------------
def fold_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold each head's sink logit into final rows: (out', lse') with lse' = log(e^lse + e^s_h)
    and out' = out e^(lse - lse'). The sink is a key with logit s_h and no value, so it is the
    merge above with an empty block output; it must happen exactly once per row, after the row's
    last merge (folded into every rank's or every ring step's partial, it would count once per
    partial: the denominator gains P e^s_h).

    Args:
        out: [B, S, H, D] final output of the rows (any float dtype); lse: [B, H, S] its lse.
        sinks: [H] the sink logits of these heads (a head-sharded method passes its heads' slice).
    Returns:
        out' in out's dtype and lse' in lse's dtype. A row that sees no key gets lse' = s_h and
        out' = 0 (a row with a -inf sink too stays (0, -inf)).
    """
    s = sinks.detach().to(lse.dtype).view(1, -1, 1)  # [1, H, 1]
    new_lse = torch.logaddexp(lse, s)
    # e^(lse - lse') in (0, 1]; NaN only where both are -inf (an empty row, a -inf sink): keep 0
    scale = torch.exp(lse - new_lse).nan_to_num_(nan=0.0).transpose(1, 2).unsqueeze(-1)  # [B, S, H, 1]
    return (out.to(lse.dtype) * scale).to(out.dtype), new_lse


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d s_h over the given rows, [H], from the FOLDED out' and lse': the sink's softmax
    weight is p_i = e^(s_h - lse'_i) and its value is zero, so (as for any logit)
    ds = p (0 - rowsum(dout * out')), summed over batch and rows. A sequence-parallel rank gives
    its own rows' share; the shares add up over ranks.

    Computed and returned in the inputs' precision, lse's dtype (float32; float64 for float64
    inputs), or the sinks' dtype where that is wider: float32 sink logits with float64 inputs get
    a float64 share, so that shares summed over ranks round once, not once per rank (each share
    rounded to float32 put the float64 check's dsink off by a few float32 roundings). Through
    autograd a leaf's gradient takes the leaf's dtype: pass float64 sinks to keep it."""
    s = sinks.detach().to(lse.dtype).view(1, -1, 1)
    weight = torch.exp(s - lse).nan_to_num_(nan=0.0)  # [B, H, S]; lse' >= s, so <= 1
    delta = _delta_eager(dout, out).to(lse.dtype)  # [B, H, S]
    return -(weight * delta).sum(dim=(0, 2)).to(torch.promote_types(lse.dtype, sinks.dtype))


# ---------------------------------------------------------------------------------------------
# Fused operators: one pass per merge
# ---------------------------------------------------------------------------------------------
# The merge reads the accumulator and the block result once and writes the accumulator once. As
# chains of separate torch ops it made a method's own tensor work larger than its kernels' traffic
# (each op a full pass over the fp32 accumulator, plus temporaries of its size). It is one
# registered operator, so the simulator's tracer sees one op with its real bytes (its fake
# implementation runs on meta tensors), and on a device it runs as one fused kernel compiled by
# torch.compile (Inductor: Triton on CUDA, C++ on CPU) or, where compiling is unavailable, fails,
# or does not pay (small CPU shapes), as the exact eager fallback above (in place, no temporaries
# of accumulator size).

# Accumulator elements from which compiling the merge pays on CPU: below it Inductor's kernel is
# no faster than the eager ops, and a first compile is slow on a busy CPU (measured:
# reports/recorded/fused_merges.md). On CUDA the fused kernel pays from small sizes.
COMPILE_MIN_NUMEL = {"cpu": 1 << 21, "cuda": 1 << 14}


def _merge_weights(lse: torch.Tensor, block_lse: torch.Tensor):
    """(new_lse [B, H, S], w_old, w_new [B, S, H, 1]): e^(lse - new_lse) and e^(block_lse - new_lse),
    0 (not NaN) for rows where both sides are empty (-inf). The compiled merges' weights (Inductor
    fuses them into the one loop over the accumulator)."""
    new_lse = torch.logaddexp(lse, block_lse)
    ref = torch.where(torch.isfinite(new_lse), new_lse, 0.0)
    w_old = torch.exp(lse - ref).transpose(1, 2)  # [B, S, H]
    w_new = torch.exp(block_lse - ref).transpose(1, 2)
    return new_lse, w_old.unsqueeze(-1), w_new.unsqueeze(-1)


def _merge_fused(out, lse, block_out, block_lse) -> None:
    # written as one expression so that Inductor emits one loop over the accumulator
    new_lse, w_old, w_new = _merge_weights(lse, block_lse)
    out.copy_(out * w_old + block_out.to(out.dtype) * w_new)
    lse.copy_(new_lse)


def _merge_final_fused(out, lse, block_out, block_lse, dtype):
    new_lse, w_old, w_new = _merge_weights(lse, block_lse)
    lse.copy_(new_lse)
    return (out * w_old + block_out.to(out.dtype) * w_new).to(dtype)


def _merge_start_fused(out_a, lse_a, out_b, lse_b):
    new_lse, w_a, w_b = _merge_weights(lse_a, lse_b)
    dt = acc_dtype(out_a.dtype)
    return out_a.to(dt) * w_a + out_b.to(dt) * w_b, new_lse


class _Compiled:
    """A function compiled by torch.compile on first use, or None where it cannot be (no
    compiler, no Triton, a compile error: the caller falls back to eager for good). Calls hold
    a lock: virtual ranks run as threads, and Dynamo's compilation is not meant to be entered by
    several threads at once."""

    def __init__(self, fn):
        self._fn, self._compiled, self._broken = fn, None, set()
        self._lock = threading.Lock()

    def __call__(self, device_type: str, *args):
        if device_type in self._broken:
            return NotImplemented
        with self._lock:
            try:
                if self._compiled is None:
                    self._compiled = torch.compile(self._fn, dynamic=True)
                return self._compiled(*args)
            except Exception:  # no C++ compiler, no Triton, an Inductor limitation: the eager path is exact
                self._broken.add(device_type)
                return NotImplemented


_MERGE_COMPILED = _Compiled(_merge_fused)
_MERGE_FINAL_COMPILED = _Compiled(_merge_final_fused)
_MERGE_START_COMPILED = _Compiled(_merge_start_fused)
_SUM_START_COMPILED = _Compiled(_sum_start_eager)
_DELTA_COMPILED = _Compiled(_delta_eager)


def _use_compiled(out: torch.Tensor) -> bool:
    limit = COMPILE_MIN_NUMEL.get(out.device.type)
    return limit is not None and out.numel() >= limit


def _compiled_or_eager(compiled: _Compiled, eager, like: torch.Tensor, *args):
    """The compiled function's result where compiling pays for `like`'s size and works, else the
    exact eager one's (the body of every fused operator here that returns its result)."""
    if _use_compiled(like):
        result = compiled(like.device.type, *args)
        if result is not NotImplemented:
            return result
    return eager(*args)


def _direct(out: torch.Tensor) -> bool:
    """Whether to call the eager merge (or delta) directly instead of through its operator. The
    operator's dispatch is a fixed CPU cost per call, a large share of a small merge. Only where
    the eager path would run anyway and nothing needs to see the operator: no dispatch mode (the
    simulator's tracer, fake tensors), no compilation, no autograd (methods merge inside their
    autograd.Function's forward, where grad is off)."""
    return (
        not torch.is_grad_enabled()
        and not _use_compiled(out)
        and _get_current_dispatch_mode() is None
        and not torch.compiler.is_compiling()
    )


@torch.library.custom_op("sp_attention::merge_", mutates_args=("out", "lse"))
def _merge_op(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    if _use_compiled(out) and _MERGE_COMPILED(out.device.type, out, lse, block_out, block_lse) is not NotImplemented:
        return
    _merge_eager(out, lse, block_out, block_lse)


@_merge_op.register_fake
def _merge_op_fake(out, lse, block_out, block_lse) -> None:
    return None


@torch.library.custom_op("sp_attention::merge_final", mutates_args=("lse",))
def _merge_final_op(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    return _compiled_or_eager(_MERGE_FINAL_COMPILED, _merge_final_eager, out, out, lse, block_out, block_lse, dtype)


@_merge_final_op.register_fake
def _merge_final_op_fake(out, lse, block_out, block_lse, dtype):
    return torch.empty(out.shape, dtype=dtype, device=out.device)


@torch.library.custom_op("sp_attention::merge_start", mutates_args=())
def _merge_start_op(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _compiled_or_eager(_MERGE_START_COMPILED, _merge_start_eager, out_a, out_a, lse_a, out_b, lse_b)


@_merge_start_op.register_fake
def _merge_start_op_fake(out_a, lse_a, out_b, lse_b):
    return (
        torch.empty(out_a.shape, dtype=acc_dtype(out_a.dtype), device=out_a.device),
        torch.empty(lse_a.shape, dtype=lse_a.dtype, device=lse_a.device),
    )


@torch.library.custom_op("sp_attention::sum_start", mutates_args=())
def _sum_start_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _compiled_or_eager(_SUM_START_COMPILED, _sum_start_eager, a, a, b)


@_sum_start_op.register_fake
def _sum_start_op_fake(a, b):
    return torch.empty(a.shape, dtype=acc_dtype(a.dtype), device=a.device)


@torch.library.custom_op("sp_attention::softmax_delta", mutates_args=())
def _delta_op(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return _compiled_or_eager(_DELTA_COMPILED, _delta_eager, out, dout, out)


@_delta_op.register_fake
def _delta_op_fake(dout, out):
    b, s, h, _ = out.shape
    return torch.empty(b, h, s, dtype=acc_dtype(out.dtype), device=out.device)
