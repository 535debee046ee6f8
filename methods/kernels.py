"""Local attention on one block, with its log-sum-exp.

Every method computes attention block by block through `block_forward` / `block_backward` (and
combines the partial results with the online-softmax merge of methods/merge.py); this module is
the only place that knows the kernels.

Conventions (docs/DESIGN.md sections 4 and 6):
- q: [B, Sq, H, D], k: [B, Sk, Hkv, D], v: [B, Sk, Hkv, Dv] with H % Hkv == 0 (GQA: query head h
  uses KV head h // (H // Hkv)); Dv may differ from D (MLA: DeepSeek-V3's q/k head dim 192, v 128).
  out: [B, Sq, H, Dv] in q's dtype. lse: [B, H, Sq] float32, natural log.
  (float64 inputs keep a float64 lse so that float64 runs are exact.)
- Masks are given as `causal_offset`: None means every query sees every key; an integer c means
  query i sees key j iff j <= i + c. c = 0 is the aligned diagonal block (top-left), c = -1 the
  strictly-lower block of striped attention, c = Sk - Sq the bottom-right alignment.
- A query row that sees no key has lse = -inf and output 0 (the CPU flash op returns lse = 0 for
  such rows; we repair it, or merging would weight an empty block as if it held softmax mass).
- Logit soft-capping (Gemma 2) rides on the softmax scale: a `ScoreScale` is a float that also
  carries `softcap`, so every method, which already hands its scale to every block call, caps
  without knowing it. Scores become cap * tanh(scale * q.k / cap) before the mask and the softmax.
- The backward takes the *global* (fully merged) out and lse: with them, per-block dq sum to the
  full dq and per-block dk, dv are exact (block-local out/lse would give wrong gradients).

Backends:
- "math": explicit matrix products in float32 (float64 for float64 inputs); the reference path.
- "cpu_flash": aten._scaled_dot_product_flash_attention_for_cpu and its backward.
  Both run a large block in tiles of query rows, each against only the keys its rows see, where
  they would otherwise build [Sq, Sk] scores or masks (`Tiling`; docs/DESIGN.md section 6).
- "flash_attn": flash-attn 2 on CUDA (fp16/bf16), when importable; see methods/_flash_attn.py.
- "torch_flash": PyTorch's own CUDA flash attention (fp16/bf16), its private ops that return and
  take the lse; see methods/_torch_flash.py. A band (sliding-window) block runs on math.
"auto" picks flash_attn on CUDA when possible, else torch_flash on CUDA, cpu_flash on CPU, math
otherwise; with a soft cap, only the kernels that compute it (math, flash_attn when its functions
take `softcap`), since the others (cpu_flash, torch_flash) have no such argument.

Dv != D: the CPU op, PyTorch's CUDA flash op and flash-attn 2 all refuse a value head dim other
than the query/key head dim ("v must have shape (batch_size, seqlen_k, num_heads_k, head_size_og)").
For them the block is run with the narrower of V and Q/K padded with zero columns to the wider:
zero value columns give zero output columns, zero query/key columns add nothing to a score, so
slicing the result (and dv, or dq and dk) back is exact. It costs the padded width's work.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch

from methods.documents import BAND, EMPTY, FULL, PARTIAL, BlockMask
from methods.merge import acc_dtype, empty_accumulators, merge_
from methods.stopwatch import Stopwatch

KERNELS = ("math", "cpu_flash", "flash_attn", "torch_flash")
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
    (methods/stopwatch.py: wall time on CPU, CUDA events on GPU; read `seconds` after the work is
    done). Used for the time split of a trial.
    """

    def __init__(self, name: str = "auto"):
        self.name = name
        self._watch: Optional[Stopwatch] = None

    @contextlib.contextmanager
    def measure(
        self,
        device: torch.device,
        *,
        op: str,
        q: torch.Tensor,
        k: torch.Tensor,
        causal_offset: Optional[int],
        mask: Optional[BlockMask] = None,
        v: Optional[torch.Tensor] = None,
    ) -> Iterator[None]:
        """Time one block call. The block call is described (op "fwd" or "bwd", q, k, v, causal_offset,
        mask) for subclasses that record what runs (the simulator's tracer); timing ignores it."""
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
    i1 = min(max(-c, 0), sq)  # first query that sees a key
    i2 = min(max(sk - c - 1, i1), sq)  # first query that sees every key
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
    def measure(
        self,
        device: torch.device,
        *,
        op: str,
        q: torch.Tensor,
        k: torch.Tensor,
        causal_offset: Optional[int],
        mask: Optional[BlockMask] = None,
        v: Optional[torch.Tensor] = None,
    ) -> Iterator[None]:
        if op == "fwd":
            per_head = (
                mask.pairs if mask is not None else q.shape[0] * visible_pairs(q.shape[1], k.shape[1], causal_offset)
            )
            self.pairs += per_head * q.shape[2]
        yield


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


class ScoreScale(float):
    """The softmax scale of a problem with logit soft-capping (Gemma 2): scores become
    softcap * tanh(scale * q.k / softcap) before the mask and the softmax.

    A float, so that every method hands it on unchanged where it hands on its scale (to each block
    call, through rings and all-to-alls), and arithmetic on it gives a plain float. `softcap` 0
    (no capping) is a plain float's: `softcap_of(scale)`."""

    softcap: float

    def __new__(cls, scale: float, softcap: float = 0.0):
        if softcap < 0:
            raise ValueError(f"softcap must be >= 0 (0: no capping), got {softcap}")
        obj = super().__new__(cls, scale)
        obj.softcap = float(softcap)
        return obj

    def __repr__(self) -> str:
        return f"ScoreScale({float(self)!r}, softcap={self.softcap!r})"


def softcap_of(scale: float) -> float:
    """The logit soft cap a scale carries (0: none)."""
    return getattr(scale, "softcap", 0.0)


def with_softcap(scale: float, softcap: float) -> float:
    """`scale`, carrying `softcap` when it is not 0 (a plain float otherwise)."""
    return ScoreScale(scale, softcap) if softcap else float(scale)


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
    if name == "torch_flash":
        from methods import _torch_flash

        return _torch_flash.status()
    raise ValueError(f"unknown kernel {name!r}; choose one of {KERNEL_CHOICES}")


def softcap_reason(name: str) -> str:
    """Why backend `name` cannot soft-cap logits, or "" when it can."""
    if name == "math":
        return ""
    if name == "flash_attn":
        from methods import _flash_attn

        return "" if _flash_attn.takes_softcap() else "this flash-attn's functions take no softcap argument"
    if name == "cpu_flash":
        return "aten._scaled_dot_product_flash_attention_for_cpu has no soft-capping argument"
    if name == "torch_flash":
        return "aten._scaled_dot_product_flash_attention has no soft-capping argument"
    return ""


def resolve_kernel(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: Optional[int] = None,
    *,
    head_dim_v: Optional[int] = None,
    softcap: float = 0.0,
) -> str:
    """Turn a configured kernel name ("auto" or a backend) into the backend used for tensors on
    `device` of `dtype` (and `head_dim`, `head_dim_v` (None: head_dim) when known, and the logit
    soft cap, 0 for none). Raises ValueError naming the constraint when the choice cannot run.
    Unequal head dims run padded to the wider (this module's docstring), so the flash kernels' head
    dim rule applies to the wider."""
    if name not in KERNEL_CHOICES:
        raise ValueError(f"unknown kernel {name!r}; choose one of {KERNEL_CHOICES}")
    from methods import _flash_attn

    if head_dim is not None and head_dim_v is not None:
        head_dim = max(head_dim, head_dim_v)
    flash_head_ok = head_dim is None or _flash_attn.head_dim_ok(head_dim)
    if name == "auto":
        if (
            device.type == "cuda"
            and dtype in (torch.float16, torch.bfloat16)
            and flash_head_ok
            and kernel_status("flash_attn")[0]
            and not (softcap and softcap_reason("flash_attn"))
        ):
            return "flash_attn"
        if (
            device.type == "cuda"
            and dtype in (torch.float16, torch.bfloat16)
            and flash_head_ok  # the same rule: PyTorch's flash is flash-attn 2's code
            and kernel_status("torch_flash")[0]
            and not softcap
        ):
            return "torch_flash"
        if device.type == "cpu" and not softcap:
            return "cpu_flash"
        return "math"
    if name == "cpu_flash" and device.type != "cpu":
        raise ValueError("kernel 'cpu_flash' runs on CPU tensors only")
    if name in ("flash_attn", "torch_flash"):
        ok, why = kernel_status(name)
        if not ok:
            raise ValueError(f"kernel {name!r} unavailable: {why}")
        if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"kernel {name!r} needs CUDA tensors in float16 or bfloat16")
        if head_dim is not None and not _flash_attn.head_dim_ok(head_dim):
            raise ValueError(f"kernel {name!r} needs head_dim a multiple of 8 up to 256, got {head_dim}")
    if softcap and softcap_reason(name):
        raise ValueError(
            f"kernel {name!r} cannot soft-cap logits (softcap {softcap}): {softcap_reason(name)}; "
            "use kernel auto or math"
        )
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
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v shapes differ in more than the head dim: {tuple(k.shape)} vs {tuple(v.shape)}")
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


def _math_scores(q, k, scale, causal_offset, cd, visible=None, softcap=0.0):
    """Scaled scores [B, H, Sq, Sk] in dtype `cd`, soft-capped when `softcap` > 0 (cap * tanh(s /
    cap)), masked with -inf (by `causal_offset`, or by a [B, Sq, Sk] bool `visible` mask of packed
    documents)."""
    qh = q.to(cd).transpose(1, 2)  # [B, H, Sq, D]
    kh = _repeat_kv(k, q.shape[2]).to(cd).transpose(1, 2)  # [B, H, Sk, D]
    # in place on the one [B, H, Sq, Sk] tensor (the same values as out-of-place ops, one copy)
    s = torch.matmul(qh, kh.transpose(-1, -2)).mul_(float(scale))  # [B, H, Sq, Sk]
    if softcap:
        s.div_(softcap).tanh_().mul_(softcap)
    if visible is not None:
        s.masked_fill_(~visible.unsqueeze(1), float("-inf"))
    elif not is_full(q.shape[1], k.shape[1], causal_offset):
        s.masked_fill_(~_visible(q.shape[1], k.shape[1], causal_offset, q.device), float("-inf"))
    return s


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(s - lse) with rows of lse = -inf giving 0 instead of NaN, written over `s` (its caller
    is done with the scores)."""
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return s.sub_(safe.unsqueeze(-1)).exp_()


def math_forward(q, k, v, *, scale, causal_offset, upcast=True, visible=None, softcap=None):
    """Attention by explicit products. With `upcast`, computes in float32 (float64 for float64
    inputs); without, in the input dtype (the "naive same-dtype" implementation of the pass rule).
    `softcap`: the logit soft cap (None: the one `scale` carries, `softcap_of`).
    Returns out [B, Sq, H, Dv] in q.dtype and lse [B, H, Sq] float32 (float64 for float64)."""
    cd = _compute_dtype(q.dtype, upcast)
    cap = softcap_of(scale) if softcap is None else softcap
    s = _math_scores(q, k, scale, causal_offset, cd, visible, cap)
    lse = torch.logsumexp(s, dim=-1)  # [B, H, Sq]; -inf if no key
    p = _probs(s, lse)
    vh = _repeat_kv(v, q.shape[2]).to(cd).transpose(1, 2)  # [B, H, Sk, Dv]
    out = torch.matmul(p, vh).transpose(1, 2)  # [B, Sq, H, Dv]
    return out.to(q.dtype), lse.to(acc_dtype(q.dtype))


def math_backward(
    dout, q, k, v, out, lse, *, scale, causal_offset, upcast=True, delta=None, visible=None, softcap=None
):
    """Gradients of attention for one block given the global out and lse (FlashAttention-2's
    backward: dS = P * (dP - rowsum(dO * O))); `delta` [B, H, Sq] may replace `out`. With a soft
    cap (as in `math_forward`), dS is taken through the cap by the chain rule: d(cap * tanh(x /
    cap))/dx = 1 - tanh(x / cap)^2 = 1 - (capped / cap)^2."""
    dq, dk, dv = _math_grads(
        dout,
        q,
        k,
        v,
        out,
        lse,
        scale=scale,
        causal_offset=causal_offset,
        upcast=upcast,
        delta=delta,
        visible=visible,
        softcap=softcap,
    )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _math_grads(dout, q, k, v, out, lse, *, scale, causal_offset, upcast, delta, visible, softcap):
    """`math_backward`'s gradients in its compute dtype (float32, float64 for float64): the tiled
    backward adds up the dk, dv of its tiles before the one cast to the input dtype."""
    cd = _compute_dtype(q.dtype, upcast)
    cap = softcap_of(scale) if softcap is None else softcap
    h, hkv = q.shape[2], k.shape[2]
    s = _math_scores(q, k, scale, causal_offset, cd, visible, cap)
    factor = None
    if cap:
        # the cap's chain-rule factor 1 - (s / cap)^2; masked scores are -inf (their p, hence dS,
        # is 0): their factor is set to 0, not -inf
        factor = (s / cap).square_().neg_().add_(1).masked_fill_(~torch.isfinite(s), 0.0)
    p = _probs(s, lse.to(cd))  # [B, H, Sq, Sk], over the scores
    del s
    do = dout.to(cd).transpose(1, 2)  # [B, H, Sq, Dv]
    vh = _repeat_kv(v, h).to(cd).transpose(1, 2)  # [B, H, Sk, Dv]
    qh = q.to(cd).transpose(1, 2)
    kh = _repeat_kv(k, h).to(cd).transpose(1, 2)
    if delta is None:
        delta = (do * out.to(cd).transpose(1, 2)).sum(-1, keepdim=True)  # [B, H, Sq, 1]
    else:
        delta = delta.to(cd).unsqueeze(-1)
    dv = torch.matmul(p.transpose(-1, -2), do)  # [B, H, Sk, D]
    ds = torch.matmul(do, vh.transpose(-1, -2)).sub_(delta).mul_(p)  # dS = P * (dP - delta), over dP
    del p
    if factor is not None:
        ds.mul_(factor)
        del factor
    dq = torch.matmul(ds, kh) * float(scale)  # [B, H, Sq, D]
    dk = torch.matmul(ds.transpose(-1, -2), qh) * float(scale)  # [B, H, Sk, D]
    return dq.transpose(1, 2), _sum_kv_groups(dk.transpose(1, 2), hkv), _sum_kv_groups(dv.transpose(1, 2), hkv)


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
        out_s, lse_s = _cpu_forward(q[:, d:], k[:, : sk - d], v[:, : sk - d], scale=scale, causal_offset=0)
        out = torch.zeros_like(q)
        out[:, d:] = out_s
        lse = torch.full((q.shape[0], q.shape[2], sq), float("-inf"), dtype=lse_s.dtype, device=q.device)
        lse[..., d:] = lse_s
        return out, lse
    is_causal, mask = _cpu_mask(sq, sk, causal_offset, q.dtype, q.device)
    out, lse = _CPU_FWD(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, is_causal, attn_mask=mask, scale=scale
    )
    out = out.transpose(1, 2)  # [B, Sq, H, D]
    if causal_offset is not None and causal_offset < 0:
        # Rows i < -offset see no key: the op reports lse 0 there; the truth is -inf.
        lse = lse.clone()
        lse[..., : min(sq, -causal_offset)] = float("-inf")
    return out, lse.to(acc_dtype(q.dtype))


def _cpu_backward(dout, q, k, v, out, lse, *, scale, causal_offset):
    sq, sk = q.shape[1], k.shape[1]
    d = _shift(sq, sk, causal_offset)
    if d:
        gq, gk, gv = _cpu_backward(
            dout[:, d:],
            q[:, d:],
            k[:, : sk - d],
            v[:, : sk - d],
            out[:, d:],
            lse[..., d:],
            scale=scale,
            causal_offset=0,
        )
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dq[:, d:], dk[:, : sk - d], dv[:, : sk - d] = gq, gk, gv
        return dq, dk, dv
    is_causal, mask = _cpu_mask(sq, sk, causal_offset, q.dtype, q.device)
    # A row that sees no key (lse = -inf) would give exp(-inf - -inf) = NaN inside the op;
    # lse = +inf makes its probabilities exactly 0, which is the true gradient (none).
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    dq, dk, dv = _CPU_BWD(
        dout.transpose(1, 2),
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        out.transpose(1, 2),
        lse.to(acc_dtype(q.dtype)),
        0.0,
        is_causal,
        attn_mask=mask,
        scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# Query tiles: the memory of a CPU block follows a tile of rows and the keys it sees
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tiling:
    """How the math kernel, and cpu_flash where it needs a mask, cut a block into tiles of query rows.

    A tile holds at most `rows` query rows, and fewer where the keys its rows see are so many that
    one [B, H, rows, keys] score tensor would pass `elements` (never fewer than one row). A tile
    computes only the key rows its queries can see (a band's, a causal offset's, a document's), so
    its scores, probabilities and mask are [B, H, tile rows, those keys] and a sliding window's work
    and memory follow the band. A block whose whole [B, H, Sq, Sk] scores fit `elements` is one call,
    exactly the untiled kernel (the same products, the same bits)."""

    rows: int = 128
    elements: int = 1 << 23  # 32 MiB of float32 scores per tile


CPU_TILING = Tiling()


class _RowKeys:
    """Which keys the query rows of a block see: for a row range, the hull of their key rows, and
    a tile's mask as (causal offset, None) or (None, a [B, rows, keys] bool mask)."""

    def key_range(self, r0: int, r1: int) -> tuple[int, int]:
        raise NotImplementedError

    def whole(self, device) -> tuple[Optional[int], Optional[torch.Tensor]]:
        """The untiled block's mask, as the kernels built it before they were tiled."""
        raise NotImplementedError

    def tile(self, r0: int, r1: int, c0: int, c1: int, device) -> tuple[Optional[int], Optional[torch.Tensor]]:
        raise NotImplementedError

    def masked(self, r0: int, r1: int, c0: int, c1: int) -> bool:
        """Whether the tile's keys are masked at all (the math kernel then builds a bool mask)."""
        return True


class _BandKeys(_RowKeys):
    """lower <= j - i <= offset (None: that side open): a causal offset, a window's band, or all."""

    def __init__(self, batch: int, sq: int, sk: int, offset: Optional[int], lower: Optional[int]):
        self.batch, self.sq, self.sk, self.offset, self.lower = batch, sq, sk, offset, lower

    def key_range(self, r0: int, r1: int) -> tuple[int, int]:
        c0 = 0 if self.lower is None else min(max(r0 + self.lower, 0), self.sk)
        c1 = self.sk if self.offset is None else min(max(r1 + self.offset, 0), self.sk)  # row r1 - 1's last + 1
        return c0, max(c0, c1)

    def whole(self, device):
        if self.lower is None:
            return self.offset, None
        return None, band_visible(self.sq, self.sk, self.offset, self.lower, device).expand(self.batch, -1, -1)

    def _tile_band(self, r0, r1, c0, c1) -> tuple[Optional[int], Optional[int]]:
        # tile row i' = i - r0, key row j' = j - c0: j - i = j' - i' + (c0 - r0)
        rows, keys = r1 - r0, c1 - c0
        offset = None if self.offset is None or self.offset + r0 - c0 >= keys - 1 else self.offset + r0 - c0
        lower = None if self.lower is None or self.lower + r0 - c0 <= -(rows - 1) else self.lower + r0 - c0
        return offset, lower

    def tile(self, r0, r1, c0, c1, device):
        offset, lower = self._tile_band(r0, r1, c0, c1)
        if lower is None:
            return offset, None
        return None, band_visible(r1 - r0, c1 - c0, offset, lower, device).expand(self.batch, -1, -1)

    def masked(self, r0: int, r1: int, c0: int, c1: int) -> bool:
        offset, lower = self._tile_band(r0, r1, c0, c1)
        return lower is not None or not is_full(r1 - r0, c1 - c0, offset)


class _MaskKeys(_RowKeys):
    """A partly visible block of packed documents (or a mask family): its rows' key bounds
    (`BlockMask.key_bounds`) and its dense mask, tile by tile."""

    def __init__(self, mask: BlockMask):
        self.mask = mask

    def key_range(self, r0: int, r1: int) -> tuple[int, int]:
        first, last = self.mask.key_bounds
        f, e = first[r0:r1], last[r0:r1]
        seen = f < e
        if not bool(seen.any()):
            return 0, 0
        return int(f[seen].min()), int(e[seen].max())

    def whole(self, device):
        return None, self.mask.dense(device)

    def tile(self, r0, r1, c0, c1, device):
        return None, self.mask.dense(device, slice(r0, r1), slice(c0, c1))


def _tiles(keys: _RowKeys, batch: int, heads: int, sq: int, sk: int, tiling: Tiling):
    """The tiles (r0, r1, c0, c1) of a block: query rows [r0, r1) against key rows [c0, c1) (c0 ==
    c1: the rows see no key), or None where the whole block is one call (`Tiling`)."""
    per_key = batch * heads  # score elements per (query row, key row)
    if per_key * sq * sk <= tiling.elements:
        return None
    tiles = []
    r0 = 0
    while r0 < sq:
        n = min(tiling.rows, sq - r0)
        c0, c1 = keys.key_range(r0, r0 + n)
        while n > 1 and per_key * n * (c1 - c0) > tiling.elements:
            n = max(1, min(n // 2, tiling.elements // (per_key * (c1 - c0))))
            c0, c1 = keys.key_range(r0, r0 + n)
        tiles.append((r0, r0 + n, c0, c1))
        r0 += n
    return tiles


def _tiled_forward(q, k, v, *, scale: float, keys: _RowKeys, backend: str):
    """`block_forward` of a block whose visible keys `keys` states, tile by tile (`Tiling`). Every
    query row's keys lie in its tile's key range, so a tile's rows are final: no merge."""
    b, sq, h, _ = q.shape
    tiles = _tiles(keys, b, h, sq, k.shape[1], CPU_TILING)
    if tiles is None:
        offset, visible = keys.whole(q.device)
        return _tile_forward(q, k, v, scale=scale, offset=offset, visible=visible, backend=backend)
    out = q.new_zeros(b, sq, h, v.shape[-1])  # [B, Sq, H, Dv]; rows that see no key stay 0
    lse = torch.full((b, h, sq), float("-inf"), dtype=acc_dtype(q.dtype), device=q.device)
    for r0, r1, c0, c1 in tiles:
        if c0 == c1:
            continue
        offset, visible = keys.tile(r0, r1, c0, c1, q.device)
        out[:, r0:r1], lse[..., r0:r1] = _tile_forward(
            q[:, r0:r1], k[:, c0:c1], v[:, c0:c1], scale=scale, offset=offset, visible=visible, backend=backend
        )
    return out, lse


def _tile_forward(q, k, v, *, scale: float, offset: Optional[int], visible: Optional[torch.Tensor], backend: str):
    if visible is not None:
        return _dense_forward(q, k, v, scale=scale, visible=visible, backend=backend)
    if is_empty(q.shape[1], k.shape[1], offset):
        return _zero_out(q, v), torch.full(
            (q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc_dtype(q.dtype), device=q.device
        )
    if backend == "cpu_flash":
        return _cpu_forward(q, k, v, scale=scale, causal_offset=offset)
    return math_forward(q, k, v, scale=scale, causal_offset=offset)


def _tiled_backward(dout, q, k, v, out, lse, *, scale: float, keys: _RowKeys, backend: str, delta):
    """`block_backward` tile by tile, as `_tiled_forward`: dq rows are final per tile, dk and dv
    add up over the tiles that see their keys (in float32, float64 for float64), cast once."""
    b, sq, h, _ = q.shape
    tiles = _tiles(keys, b, h, sq, k.shape[1], CPU_TILING)
    if tiles is None:
        offset, visible = keys.whole(q.device)
        grads = _tile_backward(
            dout, q, k, v, out, lse, scale=scale, offset=offset, visible=visible, backend=backend, delta=delta
        )
        return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))
    acc = acc_dtype(q.dtype)
    dq = torch.zeros_like(q)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for r0, r1, c0, c1 in tiles:
        if c0 == c1:
            continue
        offset, visible = keys.tile(r0, r1, c0, c1, q.device)
        rows = slice(r0, r1)
        gq, gk, gv = _tile_backward(
            dout[:, rows],
            q[:, rows],
            k[:, c0:c1],
            v[:, c0:c1],
            None if out is None else out[:, rows],
            lse[..., rows].contiguous(),
            scale=scale,
            offset=offset,
            visible=visible,
            backend=backend,
            delta=None if delta is None else delta[..., rows].contiguous(),
        )
        dq[:, rows] = gq
        dk[:, c0:c1] += gk
        dv[:, c0:c1] += gv
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _tile_backward(dout, q, k, v, out, lse, *, scale, offset, visible, backend: str, delta):
    """One tile's (dq, dk, dv): cpu_flash's in the input dtype, math's in its compute dtype."""
    if visible is not None:
        if backend == "cpu_flash":
            return _dense_backward(dout, q, k, v, out, lse, scale=scale, visible=visible, backend=backend, delta=delta)
        return _math_grads(
            dout,
            q,
            k,
            v,
            out,
            lse,
            scale=scale,
            causal_offset=None,
            upcast=True,
            delta=delta,
            visible=visible,
            softcap=None,
        )
    if is_empty(q.shape[1], k.shape[1], offset):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if backend == "cpu_flash":
        if out is None:
            out = out_with_delta(dout, delta)
        return _cpu_backward(dout, q, k, v, out, lse, scale=scale, causal_offset=offset)
    return _math_grads(
        dout,
        q,
        k,
        v,
        out,
        lse,
        scale=scale,
        causal_offset=offset,
        upcast=True,
        delta=delta,
        visible=None,
        softcap=None,
    )


def cpu_block_working_set(
    batch: int,
    sq: int,
    sk: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    head_dim_v: Optional[int] = None,
    *,
    dtype: torch.dtype = torch.float32,
    op: str = "fwd",
    causal_offset: Optional[int] = None,
    lower: Optional[int] = None,
    mask: Optional[BlockMask] = None,
    kernel: str = "math",
    softcap: bool = False,
) -> int:
    """Bytes of the tensors one CPU block call allocates at its peak, beyond its inputs: what a
    per-trial memory prediction adds for a rank's largest block (the ring steps of a method run
    one block at a time). It follows the kernels' own tile plan (`Tiling`, `CPU_TILING`):

        outputs + max over tiles of the tile's temporaries

    - outputs: forward out [B, Sq, H, Dv] in the input dtype (e bytes) and lse [B, H, Sq] (a bytes:
      4, 8 for float64), twice for one-call math (its result is copied to a contiguous layout);
      backward dq [B, Sq, H, D] (e) and dk, dv [B, Sk, Hkv, D or Dv] (a, and e more for their cast).
    - a tile of r query rows that sees c key rows (the block's whole Sq x Sk where it is one call),
      n = B * H * r * c score elements of a bytes and m = B * r * c mask elements:
      math: n (forward: the scores, masked, capped and turned into probabilities in place) or 2 n
      (backward: the probabilities, and dP turned into dS in place; 3 n with a soft cap, whose
      chain-rule factor is one more) times a, 2 m bytes of bool mask, and the tile's q, k, v (and
      dout) in head-major float copies, twice (GQA repeat, matmul layout);
      cpu_flash with a mask (a band, documents, an offset other than 0): its bool mask and additive
      mask, (2 + e) m bytes, twice in the backward, and the op's results for the tile.
    - cpu_flash without a mask (full, causal offset 0, the strictly-lower shift) is the fused
      flash op: its results only (its per-thread tiles never become tensors).
    - cpu_flash with Dv != D runs padded to the wider head dim: the padded inputs and the padded
      results come on top.

    `op` is "fwd" or "bwd"; `causal_offset`, `lower` and `mask` (a `BlockMask`, which replaces
    them as in `block_forward`) say which keys each query sees; `kernel` is the resolved backend,
    "math" or "cpu_flash"; `softcap` whether the scores are soft-capped. Checked against the peak
    that suite.memtrack tracks in tests/test_kernels.py. Intermediate tensors that live inside one
    op are not counted."""
    if op not in ("fwd", "bwd") or kernel not in ("math", "cpu_flash"):
        raise ValueError(f"op must be 'fwd' or 'bwd' and kernel 'math' or 'cpu_flash', got {op!r}, {kernel!r}")
    dv = head_dim if head_dim_v is None else head_dim_v
    e, a = dtype.itemsize, acc_dtype(dtype).itemsize
    keys: _RowKeys = _BandKeys(batch, sq, sk, causal_offset, lower)
    if mask is not None:
        if mask.kind == PARTIAL:
            keys = _MaskKeys(mask)
        else:
            offset = _plain_offset(mask, sq)
            keys = _BandKeys(batch, sq, sk, offset, mask.lower if mask.kind == BAND else None)

    def results(d: int, d_v: int) -> int:
        if op == "fwd":
            return batch * sq * heads * d_v * e + batch * heads * sq * a
        return batch * sq * heads * d * e + batch * sk * kv_heads * (d + d_v) * (a + e)

    outputs = results(head_dim, dv)
    if kernel == "cpu_flash" and dv != head_dim:  # run padded to the wider head dim (module docstring)
        head_dim = dv = max(head_dim, dv)
        inputs = batch * sq * heads * (1 if op == "fwd" else 3) + 2 * batch * sk * kv_heads  # q (dout, out), k, v
        outputs += inputs * dv * e + results(dv, dv)
    fused = isinstance(keys, _BandKeys) and keys.lower is None and not _cpu_needs_mask(sq, sk, keys.offset)
    if kernel == "cpu_flash" and fused:
        return outputs + (batch * heads * sq * a if op == "fwd" else 0)  # the op's strided lse, made contiguous
    tiles = _tiles(keys, batch, heads, sq, sk, CPU_TILING)
    if tiles is None:
        tiles = [(0, sq, 0, sk)]
        if kernel == "math" and op == "fwd":
            outputs += batch * sq * heads * dv * e + batch * heads * sq * a
    worst = 0
    for r0, r1, c0, c1 in tiles:
        r, c = r1 - r0, c1 - c0
        if c == 0:
            continue
        n, m = batch * heads * r * c, batch * r * c
        rows = batch * r * heads * (head_dim + 2 * dv)  # q, out (or dout and out) of the tile's rows
        cols = batch * c * heads * (head_dim + dv)  # k, v of its keys, GQA-repeated
        if kernel == "math":
            copies = 0 if e == a and heads == kv_heads else 2 * (rows + cols) * a  # none: views of the inputs
            masks = 2 * m if keys.masked(r0, r1, c0, c1) else 0
            tile = (1 if op == "fwd" else 3 if softcap else 2) * n * a + masks + copies
        else:
            tile = (1 if op == "fwd" else 2) * (2 + e) * m + rows * e + (cols * e if op == "bwd" else 0)
        worst = max(worst, tile)
    return outputs + worst


def _cpu_needs_mask(sq: int, sk: int, causal_offset: Optional[int]) -> bool:
    """Whether the CPU flash op needs an [Sq, Sk] additive mask for this offset (`_cpu_mask`): not
    full, not the aligned causal block, not the strictly-lower block of the shift trick."""
    return not is_full(sq, sk, causal_offset) and causal_offset != 0 and not _shift(sq, sk, causal_offset)


# ---------------------------------------------------------------------------------------------
# Public block API
# ---------------------------------------------------------------------------------------------
KernelChoice = Union[str, TimedKernel]


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal_offset: Optional[int],
    kernel: KernelChoice = "auto",
    mask: Optional[BlockMask] = None,
    lower: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block of queries against one block of keys.

    Args:
        q: [B, Sq, H, D]; k: [B, Sk, Hkv, D]; v: [B, Sk, Hkv, Dv]; same dtype and device.
        scale: softmax scale (usually 1/sqrt(D)); a `ScoreScale` also soft-caps the scores.
        causal_offset: None (full) or c (query i sees key j iff j <= i + c).
        kernel: backend name, "auto", or a TimedKernel wrapping one.
        mask: the block's mask of packed documents (methods/documents.py), which then replaces
            `causal_offset`: a block it leaves empty is skipped, a fully visible one runs unmasked, one
            document with a plain causal offset takes that path, and a partly visible one runs with a
            dense mask (math, cpu_flash) or piece by piece (flash_attn).
        lower: a band's lower edge: query i also needs key j >= i + lower (a sliding window; None:
            no lower edge). A block mask of kind BAND sets it (with `causal_offset`).
    Returns:
        out [B, Sq, H, D] in q.dtype, lse [B, H, Sq] float32 (float64 for float64 inputs; -inf
        where a row sees no key); lse contiguous, out contiguous or laid out as a dense q.
    """
    _check_shapes(q, k, v)
    if isinstance(kernel, TimedKernel):
        with kernel.measure(q.device, op="fwd", q=q, k=k, v=v, causal_offset=causal_offset, mask=mask):
            return block_forward(
                q, k, v, scale=scale, causal_offset=causal_offset, kernel=kernel.name, mask=mask, lower=lower
            )
    sq, sk = q.shape[1], k.shape[1]
    if kernel == NOOP:
        return _zero_out(q, v), torch.zeros(q.shape[0], q.shape[2], sq, dtype=acc_dtype(q.dtype), device=q.device)
    if v.shape[-1] != q.shape[-1]:
        backend = resolve_kernel(
            kernel, q.device, q.dtype, q.shape[-1], head_dim_v=v.shape[-1], softcap=softcap_of(scale)
        )
        if backend != "math":  # the fused kernels take one head dim: pad to the wider (module docstring)
            w = max(q.shape[-1], v.shape[-1])
            out, lse = block_forward(
                _pad(q, w),
                _pad(k, w),
                _pad(v, w),
                scale=scale,
                causal_offset=causal_offset,
                kernel=backend,
                mask=mask,
                lower=lower,
            )
            return out[..., : v.shape[-1]].contiguous(), lse
    if mask is not None:
        if mask.kind == PARTIAL:
            return _partial_forward(q, k, v, scale=scale, mask=mask, kernel=kernel)
        causal_offset = _plain_offset(mask, sq)
        lower = mask.lower if mask.kind == BAND else None
    if lower is not None and not is_empty(sq, sk, causal_offset):
        return _band_forward(q, k, v, scale=scale, causal_offset=causal_offset, lower=lower, kernel=kernel)
    if is_empty(sq, sk, causal_offset):
        return (
            _zero_out(q, v),
            torch.full((q.shape[0], q.shape[2], sq), float("-inf"), dtype=acc_dtype(q.dtype), device=q.device),
        )
    backend = resolve_kernel(kernel, q.device, q.dtype, q.shape[-1], head_dim_v=v.shape[-1], softcap=softcap_of(scale))
    if backend == "flash_attn":
        from methods import _flash_attn

        out, lse = _flash_attn.forward(q, k, v, scale=scale, causal_offset=causal_offset)
    elif backend == "torch_flash":
        from methods import _torch_flash

        out, lse = _torch_flash.forward(q, k, v, scale=scale, causal_offset=causal_offset)
    elif backend == "cpu_flash" and not _cpu_needs_mask(sq, sk, causal_offset):
        out, lse = _cpu_forward(q, k, v, scale=scale, causal_offset=causal_offset)
    else:  # math, and cpu_flash where it needs a mask: tile by tile (`Tiling`)
        keys = _BandKeys(q.shape[0], sq, sk, causal_offset, None)
        out, lse = _tiled_forward(q, k, v, scale=scale, keys=keys, backend=backend)
    # Contiguous results (the CPU op's lse is strided, math's out a transposed view): methods
    # send them as they are, and communication needs contiguous buffers. An output laid out
    # exactly as a dense q (a kernel that allocates it like q) keeps that layout: Ulysses gives
    # sequence-major views of its receive buffer and sends the output back from that layout as it
    # is, where a copy to batch-major here would be one more pass over it when B > 1.
    if not (out.stride() == q.stride() and _dense(q)):
        out = out.contiguous()
    return out, lse.contiguous()


def _zero_out(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A zero output [B, Sq, H, Dv] for queries `q` and values `v`: laid out as q where the head
    dims agree (a dense q's layout is what methods send on as it is, `block_forward`)."""
    if v.shape[-1] == q.shape[-1]:
        return torch.zeros_like(q)
    return q.new_zeros(*q.shape[:3], v.shape[-1])


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [..., d] with zero columns appended up to `width` (x itself when d == width)."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _dense(x: torch.Tensor) -> bool:
    """Whether x's elements fill its storage span with no gap or overlap (some order of its dims
    is contiguous)."""
    if x.is_contiguous():  # the common case, asked on every block call (inside the timed kernel region)
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
    norm = (d * d).sum(-1)  # [B, S, H]
    ratio = torch.where(norm > 0, delta.to(dt).transpose(1, 2) / norm.clamp_min(1e-30), torch.zeros_like(norm))
    return (d * ratio.unsqueeze(-1)).to(dout.dtype)


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: Optional[torch.Tensor],
    lse: torch.Tensor,
    *,
    scale: float,
    causal_offset: Optional[int],
    kernel: KernelChoice = "auto",
    delta: Optional[torch.Tensor] = None,
    mask: Optional[BlockMask] = None,
    lower: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
        with kernel.measure(q.device, op="bwd", q=q, k=k, v=v, causal_offset=causal_offset, mask=mask):
            return block_backward(
                dout,
                q,
                k,
                v,
                out,
                lse,
                scale=scale,
                causal_offset=causal_offset,
                kernel=kernel.name,
                delta=delta,
                mask=mask,
                lower=lower,
            )
    sq, sk = q.shape[1], k.shape[1]
    if v.shape[-1] != q.shape[-1] and kernel != NOOP:
        backend = resolve_kernel(
            kernel, q.device, q.dtype, q.shape[-1], head_dim_v=v.shape[-1], softcap=softcap_of(scale)
        )
        if backend != "math":  # padded to the wider head dim, as in block_forward
            d, dv, w = q.shape[-1], v.shape[-1], max(q.shape[-1], v.shape[-1])
            gq, gk, gv = block_backward(
                _pad(dout, w),
                _pad(q, w),
                _pad(k, w),
                _pad(v, w),
                None if out is None else _pad(out, w),
                lse,
                scale=scale,
                causal_offset=causal_offset,
                kernel=backend,
                delta=delta,
                mask=mask,
                lower=lower,
            )
            return gq[..., :d].contiguous(), gk[..., :d].contiguous(), gv[..., :dv].contiguous()
    if mask is not None and kernel != NOOP:
        if mask.kind == PARTIAL:
            return _partial_backward(dout, q, k, v, out, lse, scale=scale, mask=mask, kernel=kernel, delta=delta)
        causal_offset = _plain_offset(mask, sq)
        lower = mask.lower if mask.kind == BAND else None
    if lower is not None and kernel != NOOP and not is_empty(sq, sk, causal_offset):
        return _band_backward(
            dout, q, k, v, out, lse, scale=scale, causal_offset=causal_offset, lower=lower, kernel=kernel, delta=delta
        )
    if is_empty(sq, sk, causal_offset) or kernel == NOOP:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    backend = resolve_kernel(kernel, q.device, q.dtype, q.shape[-1], head_dim_v=v.shape[-1], softcap=softcap_of(scale))
    if backend == "math" or (backend == "cpu_flash" and _cpu_needs_mask(sq, sk, causal_offset)):
        keys = _BandKeys(q.shape[0], sq, sk, causal_offset, None)
        return _tiled_backward(dout, q, k, v, out, lse, scale=scale, keys=keys, backend=backend, delta=delta)
    if delta is not None:  # exactly one of out and delta: the kernels below take out
        out = out_with_delta(dout, delta)
    if backend == "cpu_flash":
        return _cpu_backward(dout, q, k, v, out, lse, scale=scale, causal_offset=causal_offset)
    if backend == "flash_attn":
        from methods import _flash_attn

        return _flash_attn.backward(dout, q, k, v, out, lse, scale=scale, causal_offset=causal_offset)
    if backend == "torch_flash":
        from methods import _torch_flash

        return _torch_flash.backward(dout, q, k, v, out, lse, scale=scale, causal_offset=causal_offset)
    raise AssertionError(f"unhandled kernel {backend}")


# ---------------------------------------------------------------------------------------------
# Packed documents: blocks that a document boundary or padding cuts (methods/documents.py)
# ---------------------------------------------------------------------------------------------
def _plain_offset(mask: BlockMask, sq: int) -> Optional[int]:
    """The causal offset that expresses an empty, full or single-offset block mask."""
    if mask.kind == EMPTY:
        return -sq  # no query row reaches a key: is_empty holds
    if mask.kind == FULL:
        return None
    return mask.causal_offset


def _partial_forward(q, k, v, *, scale: float, mask: BlockMask, kernel: str):
    backend = resolve_kernel(kernel, q.device, q.dtype, q.shape[-1], head_dim_v=v.shape[-1], softcap=softcap_of(scale))
    if backend in ("flash_attn", "torch_flash"):  # they take no dense mask: one call per document piece
        return forward_by_pieces(q, k, v, scale=scale, mask=mask, kernel=backend)
    return _tiled_forward(q, k, v, scale=scale, keys=_MaskKeys(mask), backend=backend)


def band_visible(sq: int, sk: int, causal_offset: Optional[int], lower: Optional[int], device=None) -> torch.Tensor:
    """[Sq, Sk] bool: lower <= j - i <= causal_offset (None: that side open)."""
    d = torch.arange(sk, device=device).unsqueeze(0) - torch.arange(sq, device=device).unsqueeze(1)
    vis = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal_offset is not None:
        vis &= d <= causal_offset
    if lower is not None:
        vis &= d >= lower
    return vis


def _band_forward(q, k, v, *, scale: float, causal_offset: Optional[int], lower: int, kernel: str):
    """A band block (a sliding window's): flash-attn's window where it maps, else a dense mask."""
    backend = resolve_kernel(kernel, q.device, q.dtype, q.shape[-1], head_dim_v=v.shape[-1], softcap=softcap_of(scale))
    sq, sk = q.shape[1], k.shape[1]
    if backend == "flash_attn":
        from methods import _flash_attn

        try:
            return _flash_attn.forward(q, k, v, scale=scale, causal_offset=causal_offset, lower=lower)
        except NotImplementedError:  # a band flash-attn's window cannot say: the math kernel
            backend = "math"
    keys = _BandKeys(q.shape[0], sq, sk, causal_offset, lower)
    return _tiled_forward(q, k, v, scale=scale, keys=keys, backend=backend)


def _band_backward(dout, q, k, v, out, lse, *, scale: float, causal_offset, lower: int, kernel: str, delta):
    backend = resolve_kernel(kernel, q.device, q.dtype, q.shape[-1], head_dim_v=v.shape[-1], softcap=softcap_of(scale))
    sq, sk = q.shape[1], k.shape[1]
    if backend == "flash_attn":
        from methods import _flash_attn

        try:
            o = out if out is not None else out_with_delta(dout, delta)
            return _flash_attn.backward(dout, q, k, v, o, lse, scale=scale, causal_offset=causal_offset, lower=lower)
        except NotImplementedError:  # as in _band_forward
            backend = "math"
    keys = _BandKeys(q.shape[0], sq, sk, causal_offset, lower)
    return _tiled_backward(dout, q, k, v, out, lse, scale=scale, keys=keys, backend=backend, delta=delta)


def _dense_forward(q, k, v, *, scale: float, visible: torch.Tensor, backend: str):
    """A block under a [B, Sq, Sk] bool mask: cpu_flash, else math (torch_flash takes no dense mask)."""
    if backend == "cpu_flash":
        out, lse = _CPU_FWD(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            0.0,
            False,
            attn_mask=_additive(visible, q.dtype),
            scale=scale,
        )
        out, lse = out.transpose(1, 2), lse.to(acc_dtype(q.dtype))
        # rows that see no key: the op reports out 0 and lse 0; the truth is lse -inf
        seen = visible.any(-1)  # [B, Sq]
        lse = torch.where(seen.unsqueeze(1), lse, torch.full_like(lse, float("-inf")))
        out = torch.where(seen[:, :, None, None], out, torch.zeros_like(out))
    else:
        out, lse = math_forward(q, k, v, scale=scale, causal_offset=None, visible=visible)
    return out.contiguous(), lse.contiguous()


def _partial_backward(dout, q, k, v, out, lse, *, scale: float, mask: BlockMask, kernel: str, delta):
    backend = resolve_kernel(kernel, q.device, q.dtype, q.shape[-1], head_dim_v=v.shape[-1], softcap=softcap_of(scale))
    if backend in ("flash_attn", "torch_flash"):
        return backward_by_pieces(dout, q, k, v, out, lse, scale=scale, mask=mask, kernel=backend, delta=delta)
    return _tiled_backward(dout, q, k, v, out, lse, scale=scale, keys=_MaskKeys(mask), backend=backend, delta=delta)


def _dense_backward(dout, q, k, v, out, lse, *, scale: float, visible: torch.Tensor, backend: str, delta):
    if backend != "cpu_flash":  # math, and torch_flash (no dense masks)
        return math_backward(dout, q, k, v, out, lse, scale=scale, causal_offset=None, delta=delta, visible=visible)
    if out is None:
        out = out_with_delta(dout, delta)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)  # rows that see nothing
    dq, dk, dv = _CPU_BWD(
        dout.transpose(1, 2),
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        out.transpose(1, 2),
        lse.to(acc_dtype(q.dtype)),
        0.0,
        False,
        attn_mask=_additive(visible, q.dtype),
        scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, Sq, Sk] additive mask (0 or -inf) from a [B, Sq, Sk] bool mask."""
    return (
        torch.zeros(visible.shape, dtype=dtype, device=visible.device)
        .masked_fill_(~visible, float("-inf"))
        .unsqueeze(1)
    )


def forward_by_pieces(q, k, v, *, scale: float, mask: BlockMask, kernel: str):
    """A partly visible block as one kernel call per document piece (`BlockMask.pieces`: each a
    plain causal offset or full), the pieces of a query row merged by online softmax. The path of
    kernels without dense masks (flash_attn); exact on any kernel."""
    out, lse = empty_accumulators(q, v.shape[-1])
    for b in range(q.shape[0]):
        one = slice(b, b + 1)
        for rows, cols, offset, lower in mask.pieces(b):
            piece_out, piece_lse = block_forward(
                q[one, rows], k[one, cols], v[one, cols], scale=scale, causal_offset=offset, kernel=kernel, lower=lower
            )
            merge_(out[one, rows], lse[one, :, rows], piece_out, piece_lse)
    return out.to(q.dtype), lse


def backward_by_pieces(dout, q, k, v, out, lse, *, scale: float, mask: BlockMask, kernel: str, delta=None):
    """Gradients of `forward_by_pieces`: each piece's backward with the block's global out and lse."""
    acc = acc_dtype(q.dtype)
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
    for b in range(q.shape[0]):
        one = slice(b, b + 1)
        for rows, cols, offset, lower in mask.pieces(b):
            gq, gk, gv = block_backward(
                dout[one, rows],
                q[one, rows],
                k[one, cols],
                v[one, cols],
                None if out is None else out[one, rows],
                lse[one, :, rows],
                scale=scale,
                causal_offset=offset,
                kernel=kernel,
                delta=None if delta is None else delta[one, :, rows],
                lower=lower,
            )
            dq[one, rows] += gq
            dk[one, cols] += gk
            dv[one, cols] += gv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
