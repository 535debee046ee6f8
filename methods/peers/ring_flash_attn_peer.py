"""ring-flash-attn (zhuzilin): `rfa_ring`, `rfa_zigzag`, `rfa_stripe` (batch API) and `rfa_llama3`
(the Llama 3 style all-gather varlen path), through the library.

The library needs flash-attn's CUDA kernels: importing it imports `flash_attn` (no CPU build) and
`transformers` helpers that transformers 5.x removed, so on a CPU machine these methods are listed
as unavailable with the import error. Inputs must be bf16/fp16: with fp32 its dq/dk buffers alias
(`.to(float32)` returns the same tensor) and the gradients are wrong; those points are skipped
with the reason. zigzag and stripe assert causal=True. `rfa_llama3` runs one packed sequence per
call (batch 1) on the contiguous layout: cu_seqlens [0, S], or the packed documents' boundaries
(the library's varlen path; the other functions' varlen versions need every document divisible by
the world size, so packed workloads of any length are skipped for them with that reason).

Layouts (the library's tests): ring contiguous chunks in rank order; zigzag chunks r and 2W-1-r;
stripe tokens r, r+W, ... The LSE comes back with `return_attn_probs=True` and is checked too.
"""

from __future__ import annotations

import itertools
from typing import ClassVar

import torch

from methods.base import Case
from methods.peers.base import PeerMethod, version_of
from methods.registry import register, register_unavailable

VERSION = version_of("ring-flash-attn")


def _import_error() -> str | None:
    try:
        import ring_flash_attn  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or whatever its import chain raises
        return (
            f"ring-flash-attn is not importable here ({type(exc).__name__}: {str(exc)[:200]}); it imports "
            f"flash_attn (CUDA only) and transformers<5 helpers at import time"
        )
    return None


class _RFA(PeerMethod):
    library: ClassVar[str] = "ring-flash-attn"
    documents_reason: ClassVar[str] = (
        "ring-flash-attn's ring/zigzag varlen functions need every document's length divisible by the world size "
        "(2 x world size for zigzag), each rank holding a slice of every document, and stripe has no varlen "
        "function: packed documents of any length run through rfa_llama3"
    )
    impl: str = f"ring-flash-attn {VERSION}"
    function: ClassVar[str]
    causal_only: ClassVar[bool] = False
    shim: ClassVar[bool] = False  # set by the test-only CPU test double (tests/plugins/rfa_cpu_shim.py)

    def supports(self, case: Case) -> tuple[bool, str]:
        if case.device != "cuda" and not self.shim:
            return False, "ring-flash-attn runs flash-attn CUDA kernels only"
        if case.dtype not in ("bfloat16", "float16"):
            return False, (
                "ring-flash-attn needs bf16/fp16: with fp32 its dq/dk buffers alias the reused block "
                "buffers and the gradients are wrong (upstream quirk)"
            )
        if self.causal_only and not case.causal:
            return False, f"ring-flash-attn's {self.function} asserts causal=True"
        return super().supports(case)

    def kernel_used(self, device, dtype, head_dim) -> str:
        return "suite cpu kernel (test double)" if self.shim else "ring-flash-attn flash_attn"

    def _call(self, q, k, v, causal: bool, scale: float):
        import ring_flash_attn

        fn = getattr(ring_flash_attn, self.function)
        out, lse, _ = fn(q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=True)
        return out, lse


class _Llama3(_RFA):
    supports_documents = True  # its varlen entry takes the packed documents' cu_seqlens

    def supports(self, case: Case) -> tuple[bool, str]:
        if case.batch != 1:
            return False, "rfa_llama3 packs one sequence per call here: batch must be 1"
        return super().supports(case)

    def _call(self, q, k, v, causal: bool, scale: float, docs=None):
        import torch.distributed as dist
        from ring_flash_attn import llama3_flash_attn_prepare_cu_seqlens, llama3_flash_attn_varlen_func

        world, rank = dist.get_world_size(), dist.get_rank()
        total = q.shape[1] * world
        # the packed documents' boundaries; tail padding is one more document (never compared)
        lengths = list(docs.lengths[0]) + ([docs.padding] if docs.padding else []) if docs is not None else [total]
        cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device=q.device)
        cu_q, cu_k, max_q, max_k, local_k_slice = llama3_flash_attn_prepare_cu_seqlens(
            cu, causal=causal, rank=rank, world_size=world
        )
        out, lse, _ = llama3_flash_attn_varlen_func(
            q[0],
            k[0],
            v[0],
            cu_q,
            cu_k,
            max_q,
            max_k,
            heads_k_stride=1,
            local_k_slice=local_k_slice,
            softmax_scale=scale,
            causal=causal,
            return_attn_probs=True,
        )
        return out.unsqueeze(0), (lse.unsqueeze(0) if lse.dim() == 2 else lse)


class RFARing(_RFA):
    name, function, layout_kind = "rfa_ring", "ring_flash_attn_func", "contiguous"
    description = "ring-flash-attn ring_flash_attn_func (contiguous layout)"


class RFAZigzag(_RFA):
    name, function, layout_kind, causal_only = "rfa_zigzag", "zigzag_ring_flash_attn_func", "zigzag", True
    description = "ring-flash-attn zigzag_ring_flash_attn_func (zigzag layout, causal)"


class RFAStripe(_RFA):
    name, function, layout_kind, causal_only = "rfa_stripe", "stripe_flash_attn_func", "stripe", True
    description = "ring-flash-attn stripe_flash_attn_func (stripe layout, causal)"


class RFALlama3(_Llama3):
    name, function, layout_kind = "rfa_llama3", "llama3_flash_attn_varlen_func", "contiguous"
    description = "ring-flash-attn llama3_flash_attn_varlen_func (all-gather K/V by head slices)"


CLASSES = (RFARing, RFAZigzag, RFAStripe, RFALlama3)


def register_methods(shim: bool = False) -> None:
    """Register the rfa_* methods if ring-flash-attn imports, else record why not. `shim`: the
    test-only CPU test double of flash-attn is installed (rows get impl `...+cpu-kernel`)."""
    reason = _import_error()
    for cls in CLASSES:
        if reason is None:
            cls.shim = shim
            cls.impl = f"ring-flash-attn {VERSION}" + ("+cpu-kernel" if shim else "")
            register(cls)
        else:
            register_unavailable(cls.name, reason)


register_methods()
