"""Test-only plugin (`run.plugins`): a CPU test double of flash-attn's private kernel interface, so
that ring-flash-attn (which imports flash_attn and transformers<5 helpers at import time) can run
its own ring, zigzag, stripe and llama3 logic on CPU over gloo.

It puts fake `flash_attn.flash_attn_interface` and `ring_flash_attn.adapters` modules into
`sys.modules` (flash-attn 2.7's keyword names; outputs (out, lse, None, None); backward writes
dq/dk/dv into the given buffers) with the suite's CPU kernel behind them, then registers the rfa_*
methods in shim mode: their rows say impl `ring-flash-attn <version>+cpu-kernel`. This tests the
adapters and ring-flash-attn's communication and merging, never its (CUDA) kernels. It replaces
modules process-wide, which is why it is a test plugin and not a user option.
"""

import sys
import types

import torch

from methods import kernels


def _offset(sq: int, sk: int, causal: bool):
    return (sk - sq) if causal else None  # flash-attn: causal aligned bottom-right


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
    out, lse = kernels.block_forward(
        q, k, v, scale=softmax_scale, causal_offset=_offset(q.shape[1], k.shape[1], causal)
    )
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
    gq, gk, gv = kernels.block_backward(
        dout.contiguous(),
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        out.contiguous(),
        softmax_lse.float().contiguous(),
        scale=softmax_scale,
        causal_offset=_offset(q.shape[1], k.shape[1], causal),
    )
    dq.copy_(gq), dk.copy_(gk), dv.copy_(gv)
    return None


def _segments(cu):
    cu = cu.tolist()
    return list(zip(cu[:-1], cu[1:]))


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
    outs, lses = [], []
    for (qa, qb), (ka, kb) in zip(_segments(cu_seqlens_q), _segments(cu_seqlens_k)):
        o, l = kernels.block_forward(
            q[None, qa:qb],
            k[None, ka:kb],
            v[None, ka:kb],
            scale=softmax_scale,
            causal_offset=_offset(qb - qa, kb - ka, causal),
        )
        outs.append(o[0]), lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, dim=-1), None, None  # lse [H, total_q]


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
    dq.zero_(), dk.zero_(), dv.zero_()
    for (qa, qb), (ka, kb) in zip(_segments(cu_seqlens_q), _segments(cu_seqlens_k)):
        gq, gk, gv = kernels.block_backward(
            dout[None, qa:qb].contiguous(),
            q[None, qa:qb].contiguous(),
            k[None, ka:kb].contiguous(),
            v[None, ka:kb].contiguous(),
            out[None, qa:qb].contiguous(),
            softmax_lse[None, :, qa:qb].float().contiguous(),
            scale=softmax_scale,
            causal_offset=_offset(qb - qa, kb - ka, causal),
        )
        dq[qa:qb] += gq[0]
        dk[ka:kb] += gk[0]
        dv[ka:kb] += gv[0]
    return None


def install() -> None:
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    for fn in (_flash_attn_forward, _flash_attn_backward, _flash_attn_varlen_forward, _flash_attn_varlen_backward):
        setattr(interface, fn.__name__, fn)
    package = types.ModuleType("flash_attn")
    package.__path__ = []
    package.flash_attn_interface = interface
    package.__version__ = "0.0.0+suite-cpu-test-double"
    adapters = types.ModuleType("ring_flash_attn.adapters")
    adapters.substitute_hf_flash_attn = adapters.update_ring_flash_attn_params = None
    sys.modules.setdefault("flash_attn", package)
    sys.modules.setdefault("flash_attn.flash_attn_interface", interface)
    sys.modules["ring_flash_attn.adapters"] = adapters
    sys.modules["ring_flash_attn.adapters.hf_adapter"] = adapters


install()
from methods.peers import ring_flash_attn_peer  # noqa: E402

ring_flash_attn_peer.register_methods(shim=True)
