"""Test-only plugin (`run.plugins`): a CPU test double of flash-attn's private kernel interface, so
that ring-flash-attn (which imports flash_attn and transformers<5 helpers at import time) can run
its own ring, zigzag, stripe and llama3 logic on CPU over gloo.

It puts fake `flash_attn.flash_attn_interface` and `ring_flash_attn.adapters` modules into
`sys.modules` (flash-attn 2.7's interface as methods/peers/flash_attn_stand_in.py writes it, shared with
the simulator's stand-in) with the suite's CPU kernel behind them, then registers the rfa_*
methods in shim mode: their rows say impl `ring-flash-attn <version>+cpu-kernel`. This tests the
adapters and ring-flash-attn's communication and merging, never its (CUDA) kernels. It replaces
modules process-wide, which is why it is a test plugin and not a user option.
"""

import sys
import types

import torch

from methods import kernels
from methods.peers import flash_attn_stand_in as stand_in
from methods.peers.flash_attn_stand_in import causal_offset, segments


def _forward(q, k, v, scale, causal):
    return kernels.block_forward(q, k, v, scale=scale, causal_offset=causal_offset(q.shape[1], k.shape[1], causal))


def _backward(dout, q, k, v, out, lse, dq, dk, dv, scale, causal) -> None:
    gq, gk, gv = kernels.block_backward(
        dout.contiguous(),
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        out.contiguous(),
        lse.float().contiguous(),
        scale=scale,
        causal_offset=causal_offset(q.shape[1], k.shape[1], causal),
    )
    dq.copy_(gq), dk.copy_(gk), dv.copy_(gv)


def _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal):
    outs, lses = [], []
    for (qa, qb), (ka, kb) in zip(segments(cu_seqlens_q), segments(cu_seqlens_k)):
        o, l = kernels.block_forward(
            q[None, qa:qb],
            k[None, ka:kb],
            v[None, ka:kb],
            scale=scale,
            causal_offset=causal_offset(qb - qa, kb - ka, causal),
        )
        outs.append(o[0]), lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)  # lse [H, total_q]


def _varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, scale, causal) -> None:
    dq.zero_(), dk.zero_(), dv.zero_()
    for (qa, qb), (ka, kb) in zip(segments(cu_seqlens_q), segments(cu_seqlens_k)):
        gq, gk, gv = kernels.block_backward(
            dout[None, qa:qb].contiguous(),
            q[None, qa:qb].contiguous(),
            k[None, ka:kb].contiguous(),
            v[None, ka:kb].contiguous(),
            out[None, qa:qb].contiguous(),
            lse[None, :, qa:qb].float().contiguous(),
            scale=scale,
            causal_offset=causal_offset(qb - qa, kb - ka, causal),
        )
        dq[qa:qb] += gq[0]
        dk[ka:kb] += gk[0]
        dv[ka:kb] += gv[0]


def install() -> None:
    fake = stand_in.modules(
        stand_in.BlockKernels(_forward, _backward, _varlen_forward, _varlen_backward), "0.0.0+suite-cpu-test-double"
    )
    adapters = types.ModuleType("ring_flash_attn.adapters")
    adapters.substitute_hf_flash_attn = adapters.update_ring_flash_attn_params = None
    for name, module in fake.items():  # a real flash-attn, where one is installed, stays
        sys.modules.setdefault(name, module)
    sys.modules["ring_flash_attn.adapters"] = adapters
    sys.modules["ring_flash_attn.adapters.hf_adapter"] = adapters


install()
from methods.peers import ring_flash_attn_peer  # noqa: E402

ring_flash_attn_peer.register_methods(shim=True)
