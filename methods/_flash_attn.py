"""flash-attn 2 as a block kernel (CUDA, fp16/bf16). The one place that touches its internals.

We need the forward's log-sum-exp and a backward that takes a given (global) out and lse, which
only flash-attn's private `_flash_attn_forward` / `_flash_attn_backward` offer. Their signatures
changed across 2.x (window_size tuple -> window_size_left/right in 2.7; forward returns 8 values
before 2.7 and 4 after), so arguments are passed by name after inspecting the signature.

Mask mapping: flash-attn's causal flag is bottom-right aligned (query i sees key j iff
j <= i + Sk - Sq). Our causal_offset c maps to: c == Sk - Sq -> causal; c > Sk - Sq -> a window
with right edge c - (Sk - Sq); c < Sk - Sq with Sq == Sk -> the shift trick (q[d:] against
k[:-d] with d = -c; the first d rows see nothing), which is how striped attention runs on flash.

Head dims: flash-attn 2 takes one head dim for q, k and v; methods/kernels.py pads the narrower
of V and Q/K with zero columns before calling here (exact), so a value head dim other than the
query/key one (MLA) runs. Logit soft-capping: the `softcap` argument (flash-attn >= 2.6), which
caps the scaled scores, softcap * tanh(scale * q.k / softcap), as Gemma 2 does; a scale that
carries a cap (`kernels.ScoreScale`) passes it, and a flash-attn without the argument refuses
the case (`takes_softcap`).
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any, Optional

import torch


@lru_cache(maxsize=1)
def _load():
    """(forward, backward, forward parameter names, backward parameter names, version) or an error string."""
    try:
        import flash_attn
        from flash_attn import flash_attn_interface as fai
    except Exception as exc:  # ImportError, or a broken CUDA build raising at import
        return f"flash_attn not importable ({type(exc).__name__}: {exc})"
    fwd, bwd = getattr(fai, "_flash_attn_forward", None), getattr(fai, "_flash_attn_backward", None)
    if fwd is None or bwd is None:
        return f"flash_attn {flash_attn.__version__} lacks _flash_attn_forward/_flash_attn_backward"
    return fwd, bwd, _parameter_names(fwd), _parameter_names(bwd), flash_attn.__version__


def _parameter_names(fn) -> set:
    """Names of fn's parameters. Since flash-attn 2.7 these functions are torch.library.custom_op
    objects whose own signature is (*args, **kwargs); the wrapped function (`_init_fn`) has the real
    one (filtering kwargs by the outer signature would drop every argument)."""
    inner = getattr(fn, "_init_fn", fn)
    params = inspect.signature(inner).parameters
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
        raise RuntimeError(f"cannot read the parameters of flash-attn's {getattr(fn, '__name__', fn)}")
    return set(params)


def status() -> tuple[bool, str]:
    try:
        loaded = _load()
    except RuntimeError as exc:
        return False, str(exc)
    if isinstance(loaded, str):
        return False, loaded
    if not torch.cuda.is_available():
        return False, f"flash_attn {loaded[4]} importable but no CUDA device"
    return True, f"flash_attn {loaded[4]} (CUDA, fp16/bf16, head_dim a multiple of 8 up to 256)"


def takes_softcap() -> bool:
    """Whether this flash-attn's forward and backward take the `softcap` argument."""
    try:
        loaded = _load()
    except RuntimeError:
        return False
    return not isinstance(loaded, str) and "softcap" in loaded[2] and "softcap" in loaded[3]


def _softcap(scale: float) -> float:
    return getattr(scale, "softcap", 0.0)


def head_dim_ok(head_dim: int) -> bool:
    return head_dim % 8 == 0 and head_dim <= 256


def version() -> Optional[str]:
    loaded = _load()
    return None if isinstance(loaded, str) else loaded[4]


def _window_kwargs(names: set, causal: bool, left: int, right: int) -> dict:
    kw: dict[str, Any] = {"causal": causal}
    if "window_size_left" in names:
        kw.update(window_size_left=left, window_size_right=right)
    elif "window_size" in names:
        kw["window_size"] = (left, right)
    return kw


def _mask_plan(sq: int, sk: int, causal_offset: Optional[int]):
    """(rows to skip at the top d, causal flag, window right edge) for flash-attn."""
    if causal_offset is None or causal_offset >= sk - 1:
        return 0, False, -1
    shift = sk - sq
    if causal_offset == shift:
        return 0, True, -1
    if causal_offset > shift:
        return 0, False, causal_offset - shift
    if sq != sk:
        raise NotImplementedError(f"flash_attn kernel: causal_offset {causal_offset} with Sq={sq} != Sk={sk}")
    return -causal_offset, True, -1


def _band_plan(sq: int, sk: int, causal_offset: Optional[int], lower: int) -> tuple[int, int]:
    """flash-attn's (left, right) window for the band lower <= j - i <= causal_offset: its window is
    bottom-right aligned, query i seeing keys i + Sk - Sq - left .. i + Sk - Sq + right."""
    shift = sk - sq
    left = shift - lower
    right = -1 if causal_offset is None else causal_offset - shift
    if left < 0 or (causal_offset is not None and right < 0):
        raise NotImplementedError(
            f"flash_attn kernel: band {lower}..{causal_offset} with Sq={sq}, Sk={sk} is no window it takes"
        )
    return left, right


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    """x, copied only if its last dimension is strided: flash-attn's kernels take any batch, row
    and head stride (its own wrappers copy under the same rule), so a strided view of keys (TASP's
    sequence-major units, a row slice) reaches the kernel without a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def forward(q, k, v, *, scale: float, causal_offset: Optional[int], lower: Optional[int] = None):
    fwd, _, fnames, _, _ = _load()
    b, sq, h, _ = q.shape
    if lower is None:
        d, causal, right = _mask_plan(sq, k.shape[1], causal_offset)
        left = -1
    else:
        d, causal, (left, right) = 0, False, _band_plan(sq, k.shape[1], causal_offset, lower)
    qs, ks, vs = q[:, d:], k[:, : k.shape[1] - d], v[:, : v.shape[1] - d]
    kwargs = dict(
        dropout_p=0.0, softmax_scale=float(scale), softcap=_softcap(scale), alibi_slopes=None, return_softmax=False
    )
    kwargs.update(_window_kwargs(fnames, causal, left, right))
    accepted = {k_: v_ for k_, v_ in kwargs.items() if k_ in fnames}
    ret = fwd(_unit_stride(qs), _unit_stride(ks), _unit_stride(vs), **accepted)
    out_s, lse_s = (ret[0], ret[1]) if len(ret) == 4 else (ret[0], ret[5])
    # A row that sees no key: our convention is lse = -inf (flash-attn may report +inf).
    lse_s = torch.where(torch.isposinf(lse_s), torch.full_like(lse_s, float("-inf")), lse_s.float())
    if d == 0:
        return out_s, lse_s
    out = torch.zeros_like(q)
    out[:, d:] = out_s
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
    lse[..., d:] = lse_s
    return out, lse


def backward(dout, q, k, v, out, lse, *, scale: float, causal_offset: Optional[int], lower: Optional[int] = None):
    _, bwd, _, bnames, _ = _load()
    sq, sk = q.shape[1], k.shape[1]
    if lower is None:
        d, causal, right = _mask_plan(sq, sk, causal_offset)
        left = -1
    else:
        d, causal, (left, right) = 0, False, _band_plan(sq, sk, causal_offset, lower)
    qs, ks, vs = _unit_stride(q[:, d:]), _unit_stride(k[:, : sk - d]), _unit_stride(v[:, : sk - d])
    dq_s, dk_s, dv_s = torch.empty_like(qs), torch.empty_like(ks), torch.empty_like(vs)
    kwargs = dict(
        dropout_p=0.0,
        softmax_scale=float(scale),
        softcap=_softcap(scale),
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
    )
    kwargs.update(_window_kwargs(bnames, causal, left, right))
    bwd(
        _unit_stride(dout[:, d:]),
        qs,
        ks,
        vs,
        _unit_stride(out[:, d:]),
        lse[..., d:].contiguous(),
        dq_s,
        dk_s,
        dv_s,
        **{k_: v_ for k_, v_ in kwargs.items() if k_ in bnames},
    )
    if d == 0:
        return dq_s, dk_s, dv_s
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dq[:, d:], dk[:, : sk - d], dv[:, : sk - d] = dq_s, dk_s, dv_s
    return dq, dk, dv
