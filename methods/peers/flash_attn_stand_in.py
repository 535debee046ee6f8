"""flash-attn 2.7's private kernel interface, for stand-ins: the four block kernels that peer libraries
call (`flash_attn.flash_attn_interface._flash_attn_forward`, `_flash_attn_backward` and their varlen
versions) with flash-attn's names and keywords, over kernels given as plain functions, and the
`flash_attn` modules that hold them for a library that imports them by name.

Two stand-ins use it: the simulator's trace-only one (suite/sim/flash_attn_stub.py: each call
recorded, nothing computed) and the tests' CPU double (tests/plugins/rfa_cpu_shim.py: the suite's CPU
kernel), so both answer exactly the interface ring-flash-attn and yunchang are written against.

flash-attn's conventions: q, k, v [B, S, H, D] (varlen: [total, H, D] with cu_seqlens), a causal
mask aligned bottom-right (query i sees key j <= i + Sk - Sq), LSE [B, H, Sq] fp32 (varlen
[H, total_q]); backward writes dq, dk, dv into the buffers it is given and returns nothing useful.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class BlockKernels:
    """What a stand-in runs behind the interface (`scale`: the softmax scale; `causal`: flash-attn's
    bottom-right causal mask):
    - forward(q, k, v, scale, causal) -> (out [B, Sq, H, D], lse [B, H, Sq] fp32)
    - backward(dout, q, k, v, out, lse, dq, dk, dv, scale, causal): writes dq, dk, dv
    - varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal) -> (out [total_q, H, D],
      lse [H, total_q] fp32)
    - varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, scale, causal):
      writes dq, dk, dv"""

    forward: Callable[..., tuple[Any, Any]]
    backward: Callable[..., None]
    varlen_forward: Callable[..., tuple[Any, Any]]
    varlen_backward: Callable[..., None]


def causal_offset(sq: int, sk: int, causal: bool) -> Optional[int]:
    """The suite's `causal_offset` of a flash-attn call: causal aligned bottom-right, else none."""
    return (sk - sq) if causal else None


def segments(cu_seqlens) -> list[tuple[int, int]]:
    """(start, end) of each sequence of a packed (varlen) call."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    return list(zip(cu[:-1], cu[1:]))


def _plain(dropout_p, left, right, softcap, alibi_slopes) -> None:
    """The stand-ins run plain softmax attention blocks; anything else would be wrong (the CPU
    double) or mispredicted (the simulator), so it is refused rather than ignored."""
    if dropout_p or (left, right) != (-1, -1) or softcap or alibi_slopes is not None:
        raise NotImplementedError("the flash-attn stand-in models no dropout, window, softcap or ALiBi")


def modules(kernels: BlockKernels, version: str) -> dict[str, types.ModuleType]:
    """`flash_attn` (its `__version__` = `version`) and `flash_attn.flash_attn_interface`, holding
    flash-attn 2.7's four block kernels over `kernels`: to put into `sys.modules`."""

    def _flash_attn_forward(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        return_softmax=False,
    ):
        _plain(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
        out, lse = kernels.forward(q, k, v, softmax_scale, causal)
        return out, lse, None, None

    def _flash_attn_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
    ):
        _plain(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
        kernels.backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)
        return None

    def _flash_attn_varlen_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        return_softmax=False,
        block_table=None,
    ):
        _plain(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
        out, lse = kernels.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
        return out, lse, None, None

    def _flash_attn_varlen_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
    ):
        _plain(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
        kernels.varlen_backward(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal
        )
        return None

    interface = types.ModuleType("flash_attn.flash_attn_interface")
    for fn in (_flash_attn_forward, _flash_attn_backward, _flash_attn_varlen_forward, _flash_attn_varlen_backward):
        setattr(interface, fn.__name__, fn)
    package = types.ModuleType("flash_attn")
    package.__path__ = []  # a package, so that the submodule import resolves
    setattr(package, "__version__", version)  # a ModuleType declares no __version__
    setattr(package, "flash_attn_interface", interface)
    return {"flash_attn": package, "flash_attn.flash_attn_interface": interface}
