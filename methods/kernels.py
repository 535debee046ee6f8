"""Local attention on one block, with its log-sum-exp, and the online-softmax merge.

Every method computes attention block by block through `block_forward` / `block_backward`, and
combines partial results with `merge_`; this module is the only place that knows the kernels.

Conventions (docs/DESIGN.md sections 4 and 6):
- q: [B, Sq, H, D], k and v: [B, Sk, Hkv, D] with H % Hkv == 0 (GQA: query head h uses KV head
  h // (H // Hkv)). out: [B, Sq, H, D] in q's dtype. lse: [B, H, Sq] float32, natural log.
  (float64 inputs keep a float64 lse so that float64 runs are exact.)
- Masks are given as `causal_offset`: None means every query sees every key; an integer c means
  query i sees key j iff j <= i + c. c = 0 is the aligned diagonal block (top-left), c = -1 the
  strictly-lower block of striped attention, c = Sk - Sq the bottom-right alignment.
- A query row that sees no key has lse = -inf and output 0 (the CPU flash op returns lse = 0 for
  such rows; we repair it, or merging would weight an empty block as if it held softmax mass).
- The backward takes the *global* (fully merged) out and lse: with them, per-block dq sum to the
  full dq and per-block dk, dv are exact (block-local out/lse would give wrong gradients).

Backends:
- "math": explicit matrix products in float32 (float64 for float64 inputs); the reference path.
- "cpu_flash": aten._scaled_dot_product_flash_attention_for_cpu and its backward.
- "flash_attn": flash-attn 2 on CUDA (fp16/bf16), when importable; see methods/_flash_attn.py.
"auto" picks flash_attn on CUDA when possible, cpu_flash on CPU, math otherwise.
"""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Optional, Union

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from methods.documents import EMPTY, FULL, PARTIAL, BlockMask
from methods.timing import Stopwatch

KERNELS = ("math", "cpu_flash", "flash_attn")
KERNEL_CHOICES = ("auto",) + KERNELS
# Measurement only (never a config choice): blocks return zeros at once, so a run with it times
# a method's communication and bookkeeping without its attention ("comm-only" runs).
NOOP = "noop"

_CPU_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class TimedKernel:
    """A kernel choice that also measures the time this rank spends in block kernels.

    Pass it wherever a kernel name goes (a method's `kernel`); it dispatches to `name` and adds up
    the time of every block_forward / block_backward call with the suite's one timer
    (methods/timing.py: wall time on CPU, CUDA events on GPU; read `seconds` after the work is
    done). Used for the time split of a trial.
    """

    def __init__(self, name: str = "auto"):
        self.name = name
        self._watch: Optional[Stopwatch] = None

    @contextlib.contextmanager
    def measure(self, device: torch.device, **block):
        """Time one block call. `block` describes it (op, q, k, causal_offset) for subclasses that
        record what runs (the simulator's tracer); timing ignores it."""
        if self._watch is None:
            self._watch = Stopwatch(device)
        with self._watch.region():
            yield

    @property
    def calls(self) -> int:
        return self._watch.calls if self._watch is not None else 0

    @property
    def seconds(self) -> float:
        return self._watch.seconds if self._watch is not None else 0.0


def visible_pairs(sq: int, sk: int, causal_offset: Optional[int]) -> int:
    """(i, j) pairs with j <= i + causal_offset (all sq * sk pairs when None)."""
    if causal_offset is None:
        return sq * sk
    c = causal_offset
    i1 = min(max(-c, 0), sq)              # first query that sees a key
    i2 = min(max(sk - c - 1, i1), sq)     # first query that sees every key
    partial = (i2 - i1) * (c + 1) + (i1 + i2 - 1) * (i2 - i1) // 2
    return partial + (sq - i2) * sk


class PairCountingKernel(TimedKernel):
    """A kernel choice that counts the (query, key) pairs its forward block calls compute, times
    the query heads, summed over the batch: a rank's share of the attention work (packed
    documents' masks counted exactly, by methods/documents.py)."""

    def __init__(self, name: str = "auto"):
        super().__init__(name)
        self.pairs = 0

    @contextlib.contextmanager
    def measure(self, device: torch.device, *, op: str, q: torch.Tensor, k: torch.Tensor,
                causal_offset: Optional[int], mask: Optional[BlockMask] = None):
        if op == "fwd":
            per_head = mask.pairs if mask is not None else q.shape[0] * visible_pairs(q.shape[1], k.shape[1],
                                                                                      causal_offset)
            self.pairs += per_head * q.shape[2]
        yield


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of LSE and of accumulators for inputs of `dtype`: float32, or float64 for float64
    inputs (so that float64 runs are exact to float64 rounding)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# Availability and selection
# ---------------------------------------------------------------------------------------------
def kernel_status(name: str) -> tuple[bool, str]:
    """Whether kernel backend `name` can run on this machine, and why not."""
    if name == "math":
        return True, "pure torch matrix products (any device, any dtype)"
    if name == "cpu_flash":
        return True, "aten._scaled_dot_product_flash_attention_for_cpu (CPU tensors)"
    if name == "flash_attn":
        from methods import _flash_attn
        return _flash_attn.status()
    raise ValueError(f"unknown kernel {name!r}; choose one of {KERNEL_CHOICES}")


def resolve_kernel(name: str, device: torch.device, dtype: torch.dtype, head_dim: Optional[int] = None) -> str:
    """Turn a configured kernel name ("auto" or a backend) into the backend used for tensors on
    `device` of `dtype` (and `head_dim`, when known). Raises ValueError naming the constraint when
    the choice cannot run."""
    if name not in KERNEL_CHOICES:
        raise ValueError(f"unknown kernel {name!r}; choose one of {KERNEL_CHOICES}")
    from methods import _flash_attn
    flash_head_ok = head_dim is None or _flash_attn.head_dim_ok(head_dim)
    if name == "auto":
        if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flash_head_ok \
                and kernel_status("flash_attn")[0]:
            return "flash_attn"
        if device.type == "cpu":
            return "cpu_flash"
        return "math"
    if name == "cpu_flash" and device.type != "cpu":
        raise ValueError("kernel 'cpu_flash' runs on CPU tensors only")
    if name == "flash_attn":
        ok, why = kernel_status("flash_attn")
        if not ok:
            raise ValueError(f"kernel 'flash_attn' unavailable: {why}")
        if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
            raise ValueError("kernel 'flash_attn' needs CUDA tensors in float16 or bfloat16")
        if not flash_head_ok:
            raise ValueError(f"kernel 'flash_attn' needs head_dim a multiple of 8 up to 256, got {head_dim}")
    return name


# ---------------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------------
def _visible(sq: int, sk: int, causal_offset: int, device) -> torch.Tensor:
    """Bool [Sq, Sk]: True where query i may see key j (j <= i + causal_offset)."""
    i = torch.arange(sq, device=device).unsqueeze(1)
    j = torch.arange(sk, device=device).unsqueeze(0)
    return j <= i + causal_offset


def is_full(sq: int, sk: int, causal_offset: Optional[int]) -> bool:
    """True if the mask hides nothing (every query sees every key)."""
    return causal_offset is None or causal_offset >= sk - 1


def is_empty(sq: int, sk: int, causal_offset: Optional[int]) -> bool:
    """True if no query sees any key (the block can be skipped)."""
    return causal_offset is not None and (sq - 1) + causal_offset < 0


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, S, H, D] by repeating each KV head H/Hkv times (GQA)."""
    group = heads // x.shape[2]
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def _sum_kv_groups(dx: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, S, H, D] -> [B, S, Hkv, D]: the gradient of `_repeat_kv`."""
    b, s, h, d = dx.shape
    if h == kv_heads:
        return dx
    return dx.view(b, s, kv_heads, h // kv_heads, d).sum(dim=3)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [batch, seq, heads, head_dim]")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head_dim")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"heads ({q.shape[2]}) must be a multiple of kv_heads ({k.shape[2]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")


# ---------------------------------------------------------------------------------------------
# Math backend (also the float64 reference)
# ---------------------------------------------------------------------------------------------
def _compute_dtype(dtype: torch.dtype, upcast: bool) -> torch.dtype:
    if not upcast:
        return dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def _math_scores(q, k, scale, causal_offset, cd, visible=None):
    """Scaled scores [B, H, Sq, Sk] in dtype `cd`, masked with -inf (by `causal_offset`, or by a
    [B, Sq, Sk] bool `visible` mask of packed documents)."""
    qh = q.to(cd).transpose(1, 2)                                   # [B, H, Sq, D]
    kh = _repeat_kv(k, q.shape[2]).to(cd).transpose(1, 2)           # [B, H, Sk, D]
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale              # [B, H, Sq, Sk]
    if visible is not None:
        s = s.masked_fill(~visible.unsqueeze(1), float("-inf"))
    elif not is_full(q.shape[1], k.shape[1], causal_offset):
        s = s.masked_fill(~_visible(q.shape[1], k.shape[1], causal_offset, q.device), float("-inf"))
    return s


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(s - lse) with rows of lse = -inf giving 0 instead of NaN."""
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(s - safe.unsqueeze(-1))


def math_forward(q, k, v, *, scale, causal_offset, upcast=True, visible=None):
    """Attention by explicit products. With `upcast`, computes in float32 (float64 for float64
    inputs); without, in the input dtype (the "naive same-dtype" implementation of the pass rule).
    Returns out [B, Sq, H, D] in q.dtype and lse [B, H, Sq] float32 (float64 for float64)."""
    cd = _compute_dtype(q.dtype, upcast)
    s = _math_scores(q, k, scale, causal_offset, cd, visible)
    lse = torch.logsumexp(s, dim=-1)                                # [B, H, Sq]; -inf if no key
    p = _probs(s, lse)
    vh = _repeat_kv(v, q.shape[2]).to(cd).transpose(1, 2)           # [B, H, Sk, D]
    out = torch.matmul(p, vh).transpose(1, 2)                       # [B, Sq, H, D]
    return out.to(q.dtype), lse.to(acc_dtype(q.dtype))


def math_backward(dout, q, k, v, out, lse, *, scale, causal_offset, upcast=True, delta=None, visible=None):
    """Gradients of attention for one block given the global out and lse (FlashAttention-2's
    backward: dS = P * (dP - rowsum(dO * O))); `delta` [B, H, Sq] may replace `out`."""
    cd = _compute_dtype(q.dtype, upcast)
    h, hkv = q.shape[2], k.shape[2]
    s = _math_scores(q, k, scale, causal_offset, cd, visible)
    p = _probs(s, lse.to(cd))                                       # [B, H, Sq, Sk]
    do = dout.to(cd).transpose(1, 2)                                # [B, H, Sq, D]
    vh = _repeat_kv(v, h).to(cd).transpose(1, 2)                    # [B, H, Sk, D]
    qh = q.to(cd).transpose(1, 2)
    kh = _repeat_kv(k, h).to(cd).transpose(1, 2)
    if delta is None:
        delta = (do * out.to(cd).transpose(1, 2)).sum(-1, keepdim=True)  # [B, H, Sq, 1]
    else:
        delta = delta.to(cd).unsqueeze(-1)
    dv = torch.matmul(p.transpose(-1, -2), do)                      # [B, H, Sk, D]
    dp = torch.matmul(do, vh.transpose(-1, -2))                     # [B, H, Sq, Sk]
    ds = p * (dp - delta)
    dq = torch.matmul(ds, kh) * scale                               # [B, H, Sq, D]
    dk = torch.matmul(ds.transpose(-1, -2), qh) * scale             # [B, H, Sk, D]
    dq = dq.transpose(1, 2)
    dk = _sum_kv_groups(dk.transpose(1, 2), hkv)
    dv = _sum_kv_groups(dv.transpose(1, 2), hkv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------------------------------------
# CPU flash backend
# ---------------------------------------------------------------------------------------------
def _cpu_mask(sq, sk, causal_offset, dtype, device):
    """(is_causal, additive float mask or None) for the CPU op, whose causal flag is top-left."""
    if is_full(sq, sk, causal_offset):
        return False, None
    if causal_offset == 0:
        return True, None
    mask = torch.zeros(sq, sk, dtype=dtype, device=device)
    mask.masked_fill_(~_visible(sq, sk, causal_offset, device), float("-inf"))
    return False, mask


def _shift(sq: int, sk: int, causal_offset: Optional[int]) -> int:
    """Rows to drop for the shift trick, or 0: a strictly-lower block (c < 0, Sq == Sk) is the aligned
    causal block of q[-c:] against k[:c] (rows i < -c see nothing). It avoids an Sq x Sk mask."""
    if causal_offset is not None and causal_offset < 0 and sq == sk and -causal_offset < sq:
        return -causal_offset
    return 0


def _cpu_forward(q, k, v, *, scale, causal_offset):
    sq, sk = q.shape[1], k.shape[1]
    d = _shift(sq, sk, causal_offset)
    if d:
        out_s, lse_s = _cpu_forward(q[:, d:], k[:, :sk - d], v[:, :sk - d], scale=scale, causal_offset=0)
        out = torch.zeros_like(q)
        out[:, d:] = out_s
        lse = torch.full((q.shape[0], q.shape[2], sq), float("-inf"), dtype=lse_s.dtype, device=q.device)
        lse[..., d:] = lse_s
        return out, lse
    is_causal, mask = _cpu_mask(sq, sk, causal_offset, q.dtype, q.device)
    out, lse = _CPU_FWD(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, is_causal,
                        attn_mask=mask, scale=scale)
    out = out.transpose(1, 2)                                       # [B, Sq, H, D]
    if causal_offset is not None and causal_offset < 0:
        # Rows i < -offset see no key: the op reports lse 0 there; the truth is -inf.
        lse = lse.clone()
        lse[..., : min(sq, -causal_offset)] = float("-inf")
    return out, lse.to(acc_dtype(q.dtype))


def _cpu_backward(dout, q, k, v, out, lse, *, scale, causal_offset):
    sq, sk = q.shape[1], k.shape[1]
    d = _shift(sq, sk, causal_offset)
    if d:
        gq, gk, gv = _cpu_backward(dout[:, d:], q[:, d:], k[:, :sk - d], v[:, :sk - d], out[:, d:], lse[..., d:],
                                   scale=scale, causal_offset=0)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dq[:, d:], dk[:, :sk - d], dv[:, :sk - d] = gq, gk, gv
        return dq, dk, dv
    is_causal, mask = _cpu_mask(sq, sk, causal_offset, q.dtype, q.device)
    # A row that sees no key (lse = -inf) would give exp(-inf - -inf) = NaN inside the op;
    # lse = +inf makes its probabilities exactly 0, which is the true gradient (none).
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    dq, dk, dv = _CPU_BWD(dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                          out.transpose(1, 2), lse.to(acc_dtype(q.dtype)), 0.0, is_causal, attn_mask=mask, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# Public block API
# ---------------------------------------------------------------------------------------------
KernelChoice = Union[str, TimedKernel]


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                  causal_offset: Optional[int], kernel: KernelChoice = "auto",
                  mask: Optional[BlockMask] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block of queries against one block of keys.

    Args:
        q: [B, Sq, H, D]; k, v: [B, Sk, Hkv, D]; same dtype and device.
        scale: softmax scale (usually 1/sqrt(D)).
        causal_offset: None (full) or c (query i sees key j iff j <= i + c).
        kernel: backend name, "auto", or a TimedKernel wrapping one.
        mask: the block's mask of packed documents (methods/documents.py), which then replaces
            `causal_offset`: a block it leaves empty is skipped, a fully visible one runs unmasked, one
            document with a plain causal offset takes that path, and a partly visible one runs with a
            dense mask (math, cpu_flash) or piece by piece (flash_attn).
    Returns:
        out [B, Sq, H, D] in q.dtype, lse [B, H, Sq] float32 (float64 for float64 inputs; -inf
        where a row sees no key); lse contiguous, out contiguous or laid out as a dense q.
    """
    _check_shapes(q, k, v)
    if isinstance(kernel, TimedKernel):
        with kernel.measure(q.device, op="fwd", q=q, k=k, causal_offset=causal_offset, mask=mask):
            return block_forward(q, k, v, scale=scale, causal_offset=causal_offset, kernel=kernel.name, mask=mask)
    sq, sk = q.shape[1], k.shape[1]
    if kernel == NOOP:
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], sq, dtype=acc_dtype(q.dtype), device=q.device)
    if mask is not None:
        if mask.kind == PARTIAL:
            return _partial_forward(q, k, v, scale=scale, mask=mask, kernel=kernel)
        causal_offset = _plain_offset(mask, sq)
    if is_empty(sq, sk, causal_offset):
        return (torch.zeros_like(q),
                torch.full((q.shape[0], q.shape[2], sq), float("-inf"), dtype=acc_dtype(q.dtype), device=q.device))
    backend = resolve_kernel(kernel, q.device, q.dtype, q.shape[-1])
    if backend == "cpu_flash":
        out, lse = _cpu_forward(q, k, v, scale=scale, causal_offset=causal_offset)
    elif backend == "flash_attn":
        from methods import _flash_attn
        out, lse = _flash_attn.forward(q, k, v, scale=scale, causal_offset=causal_offset)
    else:
        out, lse = math_forward(q, k, v, scale=scale, causal_offset=causal_offset)
    # Contiguous results (the CPU op's lse is strided, math's out a transposed view): methods
    # send them as they are, and communication needs contiguous buffers. An output laid out
    # exactly as a dense q (a kernel that allocates it like q) keeps that layout: Ulysses gives
    # sequence-major views of its receive buffer and sends the output back from that layout as it
    # is, where a copy to batch-major here would be one more pass over it when B > 1.
    if not (out.stride() == q.stride() and _dense(q)):
        out = out.contiguous()
    return out, lse.contiguous()


def _dense(x: torch.Tensor) -> bool:
    """Whether x's elements fill its storage span with no gap or overlap (some order of its dims
    is contiguous)."""
    if x.is_contiguous():   # the common case, asked on every block call (inside the timed kernel region)
        return True
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride()), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def out_with_delta(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """An `out` [B, S, H, D] whose rowsum(dout * out) equals `delta` [B, H, S].

    Flash backward kernels take the output only to compute D = rowsum(dO * O); a method that ships
    D instead of O (BurstAttention) passes this stand-in: out = dO * D / |dO|^2 per row (0 where
    dO is 0, where D is 0 too). Built in fp32 (float64 for float64); in bf16 its rounding perturbs D by at most 2^-9
    relative (all terms of the rowsum share a sign), no more than rounding O itself does.
    """
    dt = acc_dtype(dout.dtype)
    d = dout.to(dt)
    norm = (d * d).sum(-1)                                            # [B, S, H]
    ratio = torch.where(norm > 0, delta.to(dt).transpose(1, 2) / norm.clamp_min(1e-30), torch.zeros_like(norm))
    return (d * ratio.unsqueeze(-1)).to(dout.dtype)


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: Optional[torch.Tensor], lse: torch.Tensor, *, scale: float, causal_offset: Optional[int],
                   kernel: KernelChoice = "auto", delta: Optional[torch.Tensor] = None,
                   mask: Optional[BlockMask] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block (see `block_forward`).

    Args:
        dout, out: [B, Sq, H, D], the *global* output rows of these queries and their gradient.
        lse: [B, H, Sq] float32, the *global* log-sum-exp of these queries.
        delta: [B, H, Sq] float32, rowsum(dout * out) of the global output, instead of `out`
            (pass exactly one of the two).
        mask: the block's mask of packed documents, as in `block_forward`.
    Returns:
        dq [B, Sq, H, D], dk and dv [B, Sk, Hkv, D], in the input dtype: this block's contribution.
    """
    _check_shapes(q, k, v)
    if (out is None) == (delta is None):
        raise ValueError("block_backward needs exactly one of out and delta")
    if isinstance(kernel, TimedKernel):
        with kernel.measure(q.device, op="bwd", q=q, k=k, causal_offset=causal_offset, mask=mask):
            return block_backward(dout, q, k, v, out, lse, scale=scale, causal_offset=causal_offset,
                                  kernel=kernel.name, delta=delta, mask=mask)
    sq, sk = q.shape[1], k.shape[1]
    if mask is not None and kernel != NOOP:
        if mask.kind == PARTIAL:
            return _partial_backward(dout, q, k, v, out, lse, scale=scale, mask=mask, kernel=kernel, delta=delta)
        causal_offset = _plain_offset(mask, sq)
    if is_empty(sq, sk, causal_offset) or kernel == NOOP:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    backend = resolve_kernel(kernel, q.device, q.dtype, q.shape[-1])
    if backend == "math":
        return math_backward(dout, q, k, v, out, lse, scale=scale, causal_offset=causal_offset, delta=delta)
    if out is None:
        out = out_with_delta(dout, delta)
    if backend == "cpu_flash":
        return _cpu_backward(dout, q, k, v, out, lse, scale=scale, causal_offset=causal_offset)
    if backend == "flash_attn":
        from methods import _flash_attn
        return _flash_attn.backward(dout, q, k, v, out, lse, scale=scale, causal_offset=causal_offset)
    raise AssertionError(f"unhandled kernel {backend}")


# ---------------------------------------------------------------------------------------------
# The online-softmax merge: one fused pass per block
# ---------------------------------------------------------------------------------------------
# The merge reads the accumulator and the block result once and writes the accumulator once. As
# chains of separate torch ops it made a method's own tensor work larger than its kernels' traffic
# (each op a full pass over the fp32 accumulator, plus temporaries of its size). It is one
# registered operator, so the simulator's tracer sees one op with its real bytes (its fake
# implementation runs on meta tensors), and on a device it runs as one fused kernel compiled by
# torch.compile (Inductor: Triton on CUDA, C++ on CPU) or, where compiling is unavailable, fails,
# or does not pay (small CPU shapes), as the exact eager fallback below (in place, no temporaries
# of accumulator size).

# Accumulator elements from which compiling the merge pays on CPU: below it Inductor's kernel is
# no faster than the eager ops (measured: equal at 131k elements, 3x faster at 4M), and a first
# compile costs tens of seconds on a busy CPU. On CUDA the fused kernel pays from small sizes.
COMPILE_MIN_NUMEL = {"cpu": 1 << 21, "cuda": 1 << 14}


def _merge_weights(lse: torch.Tensor, block_lse: torch.Tensor):
    """(new_lse [B, H, S], w_old, w_new [B, S, H, 1]): e^(lse - new_lse) and e^(block_lse - new_lse),
    0 (not NaN) for rows where both sides are empty (-inf). The compiled merges' weights (Inductor
    fuses them into the one loop over the accumulator)."""
    new_lse = torch.logaddexp(lse, block_lse)
    ref = torch.where(torch.isfinite(new_lse), new_lse, 0.0)
    w_old = torch.exp(lse - ref).transpose(1, 2)      # [B, S, H]
    w_new = torch.exp(block_lse - ref).transpose(1, 2)
    return new_lse, w_old.unsqueeze(-1), w_new.unsqueeze(-1)


def _eager_weight(lse: torch.Tensor, block_lse: torch.Tensor) -> torch.Tensor:
    """The eager merges' weight of the block, w = e^(block_lse - new_lse) = sigmoid(block_lse - lse),
    [B, S, H, 1]; the accumulator's is 1 - w, since the two sum to 1. Updates `lse` to new_lse in place.

    Five small ops of lse size where the exp form takes about ten (on CPU at the overhead config's
    shard each costs a few us of dispatch: the exp form's took longer than the passes over the
    accumulator, about 46 vs 23 us, and these take 17 us beside the lerp's 15). w is
    0 where both sides are empty (-inf - -inf is NaN), so such a row stays as it is; it is laid out
    [B, S, H] because the ops over the accumulator walk a transposed view with strided loads."""
    b, h, s = lse.shape
    w = torch.empty(b, s, h, dtype=lse.dtype, device=lse.device)
    torch.sigmoid(torch.sub(block_lse, lse).transpose(1, 2), out=w)
    w.nan_to_num_(nan=0.0)
    torch.logaddexp(lse, block_lse, out=lse)
    return w.unsqueeze(-1)


def _fold(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """a (1 - w) + b w, the eager merges' pass over the accumulator: into a (`in_place`) or a fresh
    tensor of the promoted dtype. One `lerp` pass where a, b and w share a dtype; lerp takes only
    one, and casting a lower-precision b would be an accumulator-sized temporary, so otherwise a
    mul (bf16 x fp32 computes in fp32) and an addcmul_: two passes."""
    if a.dtype == b.dtype == w.dtype:
        return a.lerp_(b, w) if in_place else torch.lerp(a, b, w)
    return (a.mul_(1 - w) if in_place else torch.mul(a, 1 - w)).addcmul_(b, w)


def _merge_eager(out, lse, block_out, block_lse) -> None:
    _fold(out, block_out, _eager_weight(lse, block_lse), in_place=True)


def _merge_final_eager(out, lse, block_out, block_lse, dtype):
    # the one fresh fp32 buffer of the eager path: the operator reads the accumulator without
    # writing it (what the fused kernel does), and its result may not alias an input
    return _fold(out, block_out, _eager_weight(lse, block_lse)).to(dtype)


def _merge_fused(out, lse, block_out, block_lse) -> None:
    # written as one expression so that Inductor emits one loop over the accumulator
    new_lse, w_old, w_new = _merge_weights(lse, block_lse)
    out.copy_(out * w_old + block_out.to(out.dtype) * w_new)
    lse.copy_(new_lse)


def _merge_final_fused(out, lse, block_out, block_lse, dtype):
    new_lse, w_old, w_new = _merge_weights(lse, block_lse)
    lse.copy_(new_lse)
    return (out * w_old + block_out.to(out.dtype) * w_new).to(dtype)


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


@torch.library.custom_op("sp_attention::merge_", mutates_args=("out", "lse"))
def _merge_op(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    if _use_compiled(out) and _MERGE_COMPILED(out.device.type, out, lse, block_out, block_lse) is not NotImplemented:
        return
    _merge_eager(out, lse, block_out, block_lse)


@_merge_op.register_fake
def _merge_op_fake(out, lse, block_out, block_lse) -> None:
    return None


@torch.library.custom_op("sp_attention::merge_final", mutates_args=("lse",))
def _merge_final_op(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    return _compiled_or_eager(_MERGE_FINAL_COMPILED, _merge_final_eager, out, out, lse, block_out, block_lse, dtype)


@_merge_final_op.register_fake
def _merge_final_op_fake(out, lse, block_out, block_lse, dtype):
    return torch.empty(out.shape, dtype=dtype, device=out.device)


def _merge_start_eager(out_a, lse_a, out_b, lse_b, reuse_lse: bool = False):
    # fresh: the operator's inputs stay as they are and its results may not alias them; a direct
    # caller that hands over the block results lets lse_a become the accumulator (no copy)
    lse = lse_a if reuse_lse else lse_a.clone()
    return _fold(out_a, out_b, _eager_weight(lse, lse_b)), lse


def _merge_start_fused(out_a, lse_a, out_b, lse_b):
    new_lse, w_a, w_b = _merge_weights(lse_a, lse_b)
    dt = acc_dtype(out_a.dtype)
    return out_a.to(dt) * w_a + out_b.to(dt) * w_b, new_lse


_MERGE_START_COMPILED = _Compiled(_merge_start_fused)


@torch.library.custom_op("sp_attention::merge_start", mutates_args=())
def _merge_start_op(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _compiled_or_eager(_MERGE_START_COMPILED, _merge_start_eager, out_a, out_a, lse_a, out_b, lse_b)


@_merge_start_op.register_fake
def _merge_start_op_fake(out_a, lse_a, out_b, lse_b):
    return (torch.empty(out_a.shape, dtype=acc_dtype(out_a.dtype), device=out_a.device),
            torch.empty(lse_a.shape, dtype=lse_a.dtype, device=lse_a.device))


def _sum_start_eager(a, b):
    # fresh: a stays as it is, laid out like a (a travelling accumulator stays contiguous)
    acc = acc_dtype(a.dtype)
    if a.dtype == acc == b.dtype:
        return torch.add(a, b, out=torch.empty_like(a))   # one pass
    # lower-precision gradients: an add would compute in their dtype, so cast first, then add in fp32
    return a.to(acc, copy=True).add_(b)


_SUM_START_COMPILED = _Compiled(_sum_start_eager)


@torch.library.custom_op("sp_attention::sum_start", mutates_args=())
def _sum_start_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _compiled_or_eager(_SUM_START_COMPILED, _sum_start_eager, a, a, b)


@_sum_start_op.register_fake
def _sum_start_op_fake(a, b):
    return torch.empty(a.shape, dtype=acc_dtype(a.dtype), device=a.device)


def _delta_eager(dout, out):
    acc = acc_dtype(dout.dtype)
    return (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()   # [B, H, S]


_DELTA_COMPILED = _Compiled(_delta_eager)


@torch.library.custom_op("sp_attention::softmax_delta", mutates_args=())
def _delta_op(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return _compiled_or_eager(_DELTA_COMPILED, _delta_eager, out, dout, out)


@_delta_op.register_fake
def _delta_op_fake(dout, out):
    b, s, h, _ = out.shape
    return torch.empty(b, h, s, dtype=acc_dtype(out.dtype), device=out.device)


def _direct(out: torch.Tensor) -> bool:
    """Whether to call the eager merge (or delta) directly instead of through its operator. The
    operator's dispatch costs about 40 us of CPU per call (measured at [1, 256, 8, 64]: merge 120
    -> 77 us), half of a small merge. Only where the eager path would run anyway and nothing needs
    to see the operator: no dispatch mode (the simulator's tracer, fake tensors), no compilation,
    no autograd (methods merge inside their autograd.Function's forward, where grad is off)."""
    return (not torch.is_grad_enabled() and not _use_compiled(out) and _get_current_dispatch_mode() is None
            and not torch.compiler.is_compiling())


def softmax_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dout * out) [B, H, S] in fp32 (float64 for float64) from dout, out [B, S, H, D]:
    the backward's per-row term, one fused pass (reads both once) where compiled."""
    if _direct(out):
        return _delta_eager(dout, out)
    return torch.ops.sp_attention.softmax_delta(dout, out)


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


def merge_final(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """The last merge with the cast to the output dtype fused in: returns the merged output [B, S, H, D]
    in `dtype` (a new tensor) and updates `lse` in place; the accumulator `out` is only read. Saves
    a pass over the fp32 accumulator."""
    if _direct(out):
        return _merge_final_eager(out, lse, block_out, block_lse, dtype)
    return torch.ops.sp_attention.merge_final(out, lse, block_out, block_lse, dtype)


def start_accumulators(block_out: torch.Tensor, block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulators (out, lse) holding the first block's result: its output cast to the accumulator
    dtype (one pass) and its lse as it is (block results are fresh tensors)."""
    return block_out.to(acc_dtype(block_out.dtype)), block_lse


def accumulate_(acc: Optional[torch.Tensor], rows: slice, block: torch.Tensor) -> torch.Tensor:
    """acc[:, rows] += block, in place, in the accumulator dtype (fp32; float64 for float64 inputs):
    one pass. With acc None the first block starts the accumulator: a cast copy of it when it covers
    every row (`rows` is slice(None)), else zeros plus the block. Returns the accumulator."""
    if acc is None:
        if rows == slice(None):  # contiguous: accumulators travel (a kernel's gradient may be a transposed view)
            if block.dtype == acc_dtype(block.dtype) and block.is_contiguous():
                return block
            # one pass for the cast and the layout (to() then contiguous() copied a transposed bf16 view twice)
            return torch.empty(block.shape, dtype=acc_dtype(block.dtype), device=block.device).copy_(block)
        raise ValueError("accumulate_: the first block must cover every row (or start from zeros)")
    acc[:, rows].add_(block)
    return acc


def accumulate_final(acc: Optional[torch.Tensor], block: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(acc + block) in `dtype`, the sum and the cast in one pass (the last step of a gradient
    accumulation over every row); acc None: the block alone."""
    if acc is None:
        return block.to(dtype)
    return torch.add(acc, block, out=torch.empty(acc.shape, dtype=dtype, device=acc.device))


def merge_start(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


class OutputAccumulator:
    """The online-softmax result of a rank's queries q [B, L, H, D] over the blocks it computes.

    The first block covering every row is held as the kernel returned it (input dtype) until the
    next one: two blocks start the fp32 accumulators in one pass (`merge_start`), a block that
    turns out to be the only one is the result as it is, and the last block over every row
    writes the output in q's dtype (`merge_final`)."""

    def __init__(self, q: torch.Tensor):
        self.q = q
        self.first: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.out: Optional[torch.Tensor] = None
        self.lse: Optional[torch.Tensor] = None
        self.result: Optional[torch.Tensor] = None

    def add(self, rows: slice, block_out: torch.Tensor, block_lse: torch.Tensor, last: bool) -> None:
        """Fold one block's (out [B, n, H, D], lse [B, H, n]) of query `rows`; `last`: no block follows."""
        if self.out is None and self.first is None and rows == slice(None):
            if last:
                self.result, self.lse = block_out, block_lse
            else:
                self.first = (block_out, block_lse)
            return
        if self.first is not None:
            (first_out, first_lse), self.first = self.first, None
            if rows == slice(None) and not last:
                self.out, self.lse = merge_start(first_out, first_lse, block_out, block_lse)
                return
            self.out, self.lse = start_accumulators(first_out, first_lse)
        if self.out is None:
            self.out, self.lse = empty_accumulators(self.q)
        if last and rows == slice(None):
            self.result = merge_final(self.out, self.lse, block_out, block_lse, self.q.dtype)
        else:
            merge_(self.out[:, rows], self.lse[:, :, rows], block_out, block_lse)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out in q's dtype, lse)."""
        if self.result is not None:
            return self.result, self.lse
        if self.first is not None:
            return self.first
        if self.out is None:  # no block at all: no query saw a key
            self.out, self.lse = empty_accumulators(self.q)
        return self.out.to(self.q.dtype), self.lse


class GradAccumulator:
    """The sum of a rank's block gradients of one tensor shaped like `like` (e.g. dQ), in fp32
    (float64 for float64), returned in like's dtype: the first block over every row is held in the
    input dtype until the next (two blocks start the accumulator in one pass, `sum_start`), and the
    last block over every row writes the sum in the input dtype (`accumulate_final`)."""

    def __init__(self, like: torch.Tensor):
        self.like = like
        self.first: Optional[torch.Tensor] = None
        self.acc: Optional[torch.Tensor] = None
        self.result: Optional[torch.Tensor] = None

    def add(self, rows: slice, block: torch.Tensor, last: bool) -> None:
        if self.acc is None and self.first is None and rows == slice(None):
            if last:
                self.result = block
            else:
                self.first = block
            return
        if self.first is not None:
            first, self.first = self.first, None
            if rows == slice(None) and last:
                self.result = accumulate_final(first, block, self.like.dtype)
                return
            if rows == slice(None):
                self.acc = sum_start(first, block)
                return
            self.acc = accumulate_(None, slice(None), first)
        if self.acc is None:
            self.acc = torch.zeros(self.like.shape, dtype=acc_dtype(self.like.dtype), device=self.like.device)
        if last and rows == slice(None):
            self.result = accumulate_final(self.acc, block, self.like.dtype)
        else:
            accumulate_(self.acc, rows, block)

    def finish(self) -> torch.Tensor:
        if self.result is not None:
            return self.result
        if self.first is not None:
            return self.first
        if self.acc is None:  # no block at all
            return torch.zeros_like(self.like)
        return self.acc.to(self.like.dtype)


def follow_add(acc: Optional[torch.Tensor], contributions: list[tuple[slice, torch.Tensor]], like: torch.Tensor, *,
               last_hop: bool) -> torch.Tensor:
    """The accumulator of a circulating block (dK/dV on the K/V ring, BurstAttention's dQ) after this
    rank's `contributions` [(rows, gradient)], ready for its next hop.

    It travels in the input dtype on its first hop (the owner's own gradient as the kernel produced
    it: fp32 would add no information) and on its last hop home (the owner returns the input dtype),
    in fp32 (float64 for float64) in between, so every rank sends the same bytes. acc None: the
    owner's own block, whose contributions start it (its next hop is its first, or with one rank
    the only one); `last_hop`: its next hop brings it home."""
    dtype, accd = like.dtype, acc_dtype(like.dtype)
    items = list(contributions)
    own = acc is None
    if own:
        if len(items) == 1 and items[0][0] == slice(None):
            return items[0][1].contiguous()   # as the kernel produced it
        acc = torch.zeros(like.shape, dtype=accd, device=like.device)
    elif acc.dtype != accd:                   # arrived from its first hop, in the input dtype
        if last_hop and len(items) == 1 and items[0][0] == slice(None):
            return accumulate_final(acc, items[0][1], dtype)
        if last_hop and not items:
            return acc
        if items and items[0][0] == slice(None):
            acc = sum_start(acc, items.pop(0)[1])
        else:
            acc = acc.to(accd)
    for i, (rows, grad) in enumerate(items):
        if last_hop and i == len(items) - 1 and rows == slice(None):
            return accumulate_final(acc, grad, dtype)
        acc = accumulate_(acc, rows, grad)
    # the owner's own block in several blocks (no plan here has that): they cover disjoint rows,
    # each in the input dtype, so the cast for the first hop is exact
    return acc.to(dtype) if (own or last_hop) and acc.dtype != dtype else acc


def empty_accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh (out, lse) accumulators for queries q [B, S, H, D]: zeros float32 and -inf float32."""
    b, s, h, d = q.shape
    dt = acc_dtype(q.dtype)
    return (torch.zeros(b, s, h, d, dtype=dt, device=q.device),
            torch.full((b, h, s), float("-inf"), dtype=dt, device=q.device))


# ---------------------------------------------------------------------------------------------
# Packed documents: blocks that a document boundary or padding cuts (methods/documents.py)
# ---------------------------------------------------------------------------------------------
def _plain_offset(mask: BlockMask, sq: int) -> Optional[int]:
    """The causal offset that expresses an empty, full or single-offset block mask."""
    if mask.kind == EMPTY:
        return -sq          # no query row reaches a key: is_empty holds
    if mask.kind == FULL:
        return None
    return mask.causal_offset


def _partial_forward(q, k, v, *, scale: float, mask: BlockMask, kernel: str):
    backend = resolve_kernel(kernel, q.device, q.dtype, q.shape[-1])
    if backend == "flash_attn":  # it takes no dense mask: one call per document piece
        return forward_by_pieces(q, k, v, scale=scale, mask=mask, kernel=backend)
    visible = mask.dense(q.device)                                   # [B, Sq, Sk]
    if backend == "cpu_flash":
        out, lse = _CPU_FWD(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, False,
                            attn_mask=_additive(visible, q.dtype), scale=scale)
        out, lse = out.transpose(1, 2), lse.to(acc_dtype(q.dtype))
        # rows that see no key: the op reports out 0 and lse 0; the truth is lse -inf
        seen = visible.any(-1)                                       # [B, Sq]
        lse = torch.where(seen.unsqueeze(1), lse, torch.full_like(lse, float("-inf")))
        out = torch.where(seen[:, :, None, None], out, torch.zeros_like(out))
    else:
        out, lse = math_forward(q, k, v, scale=scale, causal_offset=None, visible=visible)
    return out.contiguous(), lse.contiguous()


def _partial_backward(dout, q, k, v, out, lse, *, scale: float, mask: BlockMask, kernel: str, delta):
    backend = resolve_kernel(kernel, q.device, q.dtype, q.shape[-1])
    if backend == "flash_attn":
        return backward_by_pieces(dout, q, k, v, out, lse, scale=scale, mask=mask, kernel=backend, delta=delta)
    visible = mask.dense(q.device)
    if backend == "math":
        return math_backward(dout, q, k, v, out, lse, scale=scale, causal_offset=None, delta=delta, visible=visible)
    if out is None:
        out = out_with_delta(dout, delta)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)  # rows that see nothing
    dq, dk, dv = _CPU_BWD(dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                          out.transpose(1, 2), lse.to(acc_dtype(q.dtype)), 0.0, False,
                          attn_mask=_additive(visible, q.dtype), scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, Sq, Sk] additive mask (0 or -inf) from a [B, Sq, Sk] bool mask."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, float("-inf")).unsqueeze(1)


def forward_by_pieces(q, k, v, *, scale: float, mask: BlockMask, kernel: str):
    """A partly visible block as one kernel call per document piece (`BlockMask.pieces`: each a
    plain causal offset or full), the pieces of a query row merged by online softmax. The path of
    kernels without dense masks (flash_attn); exact on any kernel."""
    out, lse = empty_accumulators(q)
    for b in range(q.shape[0]):
        one = slice(b, b + 1)
        for rows, cols, offset in mask.pieces(b):
            piece_out, piece_lse = block_forward(q[one, rows], k[one, cols], v[one, cols], scale=scale,
                                                 causal_offset=offset, kernel=kernel)
            merge_(out[one, rows], lse[one, :, rows], piece_out, piece_lse)
    return out.to(q.dtype), lse


def backward_by_pieces(dout, q, k, v, out, lse, *, scale: float, mask: BlockMask, kernel: str, delta=None):
    """Gradients of `forward_by_pieces`: each piece's backward with the block's global out and lse."""
    acc = acc_dtype(q.dtype)
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
    for b in range(q.shape[0]):
        one = slice(b, b + 1)
        for rows, cols, offset in mask.pieces(b):
            gq, gk, gv = block_backward(
                dout[one, rows], q[one, rows], k[one, cols], v[one, cols],
                None if out is None else out[one, rows], lse[one, :, rows], scale=scale, causal_offset=offset,
                kernel=kernel, delta=None if delta is None else delta[one, :, rows])
            dq[one, rows] += gq
            dk[one, cols] += gk
            dv[one, cols] += gv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
