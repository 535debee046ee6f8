"""ring-flash-attn (zhuzilin): `rfa_ring`, `rfa_zigzag`, `rfa_stripe` (batch API) and `rfa_llama3`
(the Llama 3 style all-gather varlen path), through the library.

The library needs flash-attn's CUDA kernels: importing it imports `flash_attn` (no CPU build), so on
a CPU machine these methods are listed as unavailable with the import error. Its package also
imports its Hugging Face adapter, which imports `is_flash_attn_greater_or_equal_2_10` from
`transformers.modeling_flash_attention_utils`, a name transformers 5 no longer has there; where that
alone stops the import, the adapter gives transformers the name (`_import_library`). Inputs must be
bf16/fp16: with fp32 its dq/dk buffers alias (`.to(float32)` returns the same tensor) and the
gradients are wrong; those points are skipped with the reason. zigzag and stripe assert causal=True.
`rfa_llama3` runs one packed sequence per call (batch 1) on the contiguous layout:
cu_seqlens [0, S], or the packed documents' boundaries.

Packed documents through ring and zigzag: the library's varlen versions of them
(`ring_flash_attn_varlen_func`, `zigzag_ring_flash_attn_varlen_func`) take each rank's pieces of
every document packed end to end, with the local cu_seqlens (every document's length / W). They
split every document evenly, so every length must be divisible by the world size W (ring: rank r
holds piece r of W) or by 2W (zigzag: pieces r and 2W-1-r of 2W); other lengths are skipped with
that reason (rfa_llama3 takes any). Their layouts are the suite's document sharding
(`layouts.documents`), with P pieces per document for the ring. A batch of sequences packed alike
is one longer packed sequence to them. Stripe has no varlen function: no packed documents. The
varlen ring's backward returns dq in bf16 whatever the input dtype (upstream), so with fp16 inputs
dq is bf16-rounded (autograd casts it back to fp16).

Layouts (the library's tests): ring contiguous chunks in rank order; zigzag chunks r and 2W-1-r;
stripe tokens r, r+W, ... The LSE comes back with `return_attn_probs=True` and is checked too.

The classes are registered wherever the package is installed, importable or not: the simulator
traces the library's own code against a flash-attn stand-in (suite/sim/peers.py), so
`run.executor=sim` predicts rfa_* on a machine without flash-attn, where they cannot run
(`available_here` and `supports` say why).
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
from types import ModuleType
from typing import ClassVar

import torch

from methods import layouts
from methods.base import Case
from methods.documents import Documents
from methods.peers.base import PeerMethod, version_of
from methods.registry import register, register_unavailable

VERSION = version_of("ring-flash-attn")


_TRANSFORMERS_FA_UTILS = "transformers.modeling_flash_attention_utils"
_REMOVED_NAME = "is_flash_attn_greater_or_equal_2_10"


def _flash_attn_at_least_2_1() -> bool:
    """transformers 4's `is_flash_attn_greater_or_equal_2_10` ("2_10" is version 2.1.0): whether the
    installed flash-attn distribution is 2.1.0 or newer (False where none is installed)."""
    from packaging.version import InvalidVersion, Version  # a dependency of transformers

    installed = version_of("flash-attn")
    try:
        return installed is not None and Version(installed) >= Version("2.1.0")
    except InvalidVersion:
        return False


def _provide_removed_transformers_name() -> bool:
    """Give transformers' flash-attention utilities the name ring-flash-attn imports from them, if
    they lack it; True if it was added. transformers 4 re-exported the function there; transformers 5
    does not, and ring-flash-attn 0.1.8's package `__init__` imports its Hugging Face adapter
    (`adapters/hf_adapter.py`), which imports it, so the whole library fails to import although none
    of the functions this adapter calls uses it. An existing attribute is never replaced."""
    try:
        utils = importlib.import_module(_TRANSFORMERS_FA_UTILS)
    except Exception:  # noqa: BLE001 - no (or a broken) transformers: the library's own error stands
        return False
    if hasattr(utils, _REMOVED_NAME):
        return False
    setattr(utils, _REMOVED_NAME, _flash_attn_at_least_2_1)
    return True


def _import_library() -> ModuleType:
    """`import ring_flash_attn`; if that fails importing from transformers' flash-attention utilities
    and they lack the name above, once more with the name provided. The failed import leaves the
    library's modules that did import (its ring functions) in sys.modules; the second one runs its
    package `__init__` again over them."""
    try:
        return importlib.import_module("ring_flash_attn")
    except ImportError as exc:
        # `from transformers.modeling_flash_attention_utils import ...` names that module; checked
        # first, so that a machine without flash_attn (which fails earlier) never imports transformers
        if exc.name != _TRANSFORMERS_FA_UTILS or not _provide_removed_transformers_name():
            raise
    return importlib.import_module("ring_flash_attn")


def _import_error() -> str | None:
    try:
        _import_library()
    except Exception as exc:  # noqa: BLE001 - ImportError, or whatever its import chain raises
        return (
            f"ring-flash-attn is not importable here ({type(exc).__name__}: {str(exc)[:200]}); it imports "
            f"flash_attn (CUDA only) at import time"
        )
    return None


class _RFA(PeerMethod):
    library: ClassVar[str] = "ring-flash-attn"
    documents_reason: ClassVar[str] = (
        "ring-flash-attn has no varlen version of this function: packed documents run through rfa_llama3 "
        "(any lengths), rfa_ring or rfa_zigzag (lengths divisible by the world size, 2 x world size for zigzag)"
    )
    mask_reason: ClassVar[str] = (
        "ring-flash-attn's ring functions take only causal or full masks (a sliding window only on its "
        "llama3 path, as flash-attn's window_size, which this adapter does not pass)"
    )
    softcap_reason: ClassVar[str] = (
        "ring-flash-attn's functions take no softcap argument (its flash-attn calls pass softcap=0.0)"
    )
    head_dim_v_reason: ClassVar[str] = (
        "ring-flash-attn runs flash-attn 2's kernels, which take one head dim for q, k and v"
    )
    impl: str = f"ring-flash-attn {VERSION}"
    function: ClassVar[str]
    causal_only: ClassVar[bool] = False
    shim: ClassVar[bool] = False  # set by the test-only CPU test double (tests/plugins/rfa_cpu_shim.py)
    import_error: ClassVar[str | None] = None  # why the library does not import here (set at registration)
    traceable = True

    @classmethod
    def available_here(cls) -> tuple[bool, str]:
        return (False, cls.import_error) if cls.import_error else (True, "")

    def supports(self, case: Case) -> tuple[bool, str]:
        if not self.simulated:
            if self.import_error:
                return False, self.import_error
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

    def kernel_used(self, device, dtype, head_dim, **_variant) -> str:
        if self.simulated:
            return "flash-attn trace stand-in"
        return "suite cpu kernel (test double)" if self.shim else "ring-flash-attn flash_attn"

    def _library(self):
        return self.module or _import_library()

    def _call(self, q, k, v, causal: bool, scale: float):
        fn = getattr(self._library(), self.function)
        out, lse, _ = fn(q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=True)
        return out, lse


class _Llama3(_RFA):
    supports_documents = True  # its varlen entry takes the packed documents' cu_seqlens

    def __init__(self, kernel: str = "auto", heads_k_stride: int = 1):
        super().__init__(kernel)
        if heads_k_stride < 1:
            raise ValueError(f"{self.name}: heads_k_stride must be >= 1, got {heads_k_stride}")
        # KV heads per slice: the library all-gathers one slice's K/V while it computes the previous one
        # (its benchmark passes 4)
        self.heads_k_stride = int(heads_k_stride)

    def options(self) -> dict:
        return {**super().options(), "heads_k_stride": self.heads_k_stride}

    def supports(self, case: Case) -> tuple[bool, str]:
        if case.batch != 1:
            return False, "rfa_llama3 packs one sequence per call here: batch must be 1"
        if case.kv_heads % self.heads_k_stride:
            return False, (
                f"rfa_llama3 gathers K/V in slices of heads_k_stride={self.heads_k_stride} KV heads: "
                f"kv_heads ({case.kv_heads}) must be divisible by it"
            )
        return super().supports(case)

    def _call(self, q, k, v, causal: bool, scale: float, docs=None):
        import torch.distributed as dist

        lib = self._library()
        world, rank = dist.get_world_size(), dist.get_rank()
        total = q.shape[1] * world
        # the packed documents' boundaries; tail padding is one more document (never compared)
        lengths = list(docs.lengths[0]) + ([docs.padding] if docs.padding else []) if docs is not None else [total]
        # traced on meta tensors, the boundaries stay on the host: the library reads them (.item())
        device = "cpu" if q.device.type == "meta" else q.device
        cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device=device)
        cu_q, cu_k, max_q, max_k, local_k_slice = lib.llama3_flash_attn_prepare_cu_seqlens(
            cu, causal=causal, rank=rank, world_size=world
        )
        out, lse, _ = lib.llama3_flash_attn_varlen_func(
            q[0],
            k[0],
            v[0],
            cu_q,
            cu_k,
            max_q,
            max_k,
            heads_k_stride=self.heads_k_stride,
            local_k_slice=local_k_slice,
            softmax_scale=scale,
            causal=causal,
            return_attn_probs=True,
        )
        return out.unsqueeze(0), (lse.unsqueeze(0) if lse.dim() == 2 else lse)


class _RingVarlen(_RFA):
    """A ring whose library function has a varlen version that splits every document over the
    ranks: one document per sequence runs the batch function, packed documents the varlen one."""

    supports_documents = True
    varlen_function: ClassVar[str]
    zigzag: ClassVar[bool]  # every document in 2W pieces, r and 2W-1-r on rank r; else W pieces, r on rank r

    def documents_refusal(self, docs: Documents, world_size: int) -> str:
        """Why the varlen function cannot take these documents at this world size ("" if it can)."""
        if len(set(docs.lengths)) > 1:
            return (
                f"{self.name}: ring-flash-attn's {self.varlen_function} takes one layout for the whole batch: "
                f"every sequence must be packed alike (use batch 1)"
            )
        divisor = (2 if self.zigzag else 1) * world_size
        lengths = list(docs.lengths[0]) + ([docs.padding] if docs.padding else [])
        bad = [n for n in lengths if n % divisor]
        if not bad:
            return ""
        pieces = f"pieces r and {2 * world_size - 1}-r of {divisor}" if self.zigzag else f"piece r of {divisor}"
        return (
            f"ring-flash-attn's {self.varlen_function} needs every document's length divisible by "
            f"{'2 x ' if self.zigzag else ''}the world size ({divisor}), rank r holding {pieces} of every "
            f"document: {len(bad)} of {len(lengths)} are not (e.g. {bad[0]}; tail padding counts as one); "
            f"packed documents of any length run through rfa_llama3"
        )

    def supports(self, case: Case) -> tuple[bool, str]:
        if case.documents is not None:
            why = self.documents_refusal(case.documents, case.world_size)
            if why:
                return False, why
        return super().supports(case)

    def layout(self, case: Case) -> layouts.Layout:
        if case.documents is None:
            return super().layout(case)
        return layouts.documents(case.documents.lengths[0], case.world_size, zigzag=self.zigzag)

    def _call(self, q, k, v, causal: bool, scale: float, docs=None):
        if docs is None:
            return super()._call(q, k, v, causal, scale)
        import torch.distributed as dist

        world = dist.get_world_size()
        batch, local, heads, dim = q.shape
        # every document's piece on this rank (padding is one more document, never compared), for
        # each sequence of the batch: one packed sequence of batch * local tokens
        pieces = [n // world for n in list(docs.lengths[0]) + ([docs.padding] if docs.padding else [])] * batch
        # traced on meta tensors, the boundaries stay on the host: the library reads them (.item())
        device = "cpu" if q.device.type == "meta" else q.device
        cu = torch.tensor([0] + list(itertools.accumulate(pieces)), dtype=torch.int32, device=device)
        fn = getattr(self._library(), self.varlen_function)
        out, lse, _ = fn(
            q.reshape(batch * local, heads, dim),  # [B * S_local, H, D]
            k.reshape(batch * local, k.shape[2], dim),
            v.reshape(batch * local, v.shape[2], dim),
            cu,
            max(pieces),
            softmax_scale=scale,
            causal=causal,
            return_attn_probs=True,
        )
        if lse.dim() == 3:  # flash-attn < 2.6: [documents, H, max_seqlen], each document's rows first
            lse = torch.cat([lse[i, :, :n] for i, n in enumerate(pieces)], dim=1)
        # lse [H, B * S_local] -> [B, H, S_local]
        return out.view(batch, local, heads, dim), lse.reshape(heads, batch, local).transpose(0, 1)


class RFARing(_RingVarlen):
    name, function, layout_kind = "rfa_ring", "ring_flash_attn_func", "contiguous"
    varlen_function, zigzag = "ring_flash_attn_varlen_func", False
    description = "ring-flash-attn ring_flash_attn_func (contiguous layout; packed documents: its varlen version)"


class RFAZigzag(_RingVarlen):
    name, function, layout_kind, causal_only = "rfa_zigzag", "zigzag_ring_flash_attn_func", "zigzag", True
    varlen_function, zigzag = "zigzag_ring_flash_attn_varlen_func", True
    description = (
        "ring-flash-attn zigzag_ring_flash_attn_func (zigzag layout, causal; packed documents: its varlen version)"
    )


class RFAStripe(_RFA):
    name, function, layout_kind, causal_only = "rfa_stripe", "stripe_flash_attn_func", "stripe", True
    description = "ring-flash-attn stripe_flash_attn_func (stripe layout, causal)"


class RFALlama3(_Llama3):
    name, function, layout_kind = "rfa_llama3", "llama3_flash_attn_varlen_func", "contiguous"
    description = "ring-flash-attn llama3_flash_attn_varlen_func (all-gather K/V by head slices)"


CLASSES = (RFARing, RFAZigzag, RFAStripe, RFALlama3)


def _package_found() -> bool:
    try:
        return importlib.util.find_spec("ring_flash_attn") is not None
    except (ImportError, ValueError, AttributeError):  # e.g. sys.modules["ring_flash_attn"] = None
        return False


def register_methods(shim: bool = False) -> None:
    """Register the rfa_* methods if ring-flash-attn is installed (if it does not import, they can
    be simulated but not run: `import_error` says why), else record why not. `shim`: the test-only
    CPU test double of flash-attn is installed (rows get impl `...+cpu-kernel`)."""
    installed = VERSION is not None and _package_found()
    reason = _import_error() if installed else None
    for cls in CLASSES:
        if installed:
            cls.shim, cls.import_error = shim, reason
            cls.impl = f"ring-flash-attn {VERSION}" + ("+cpu-kernel" if shim else "")
            register(cls)
        else:
            register_unavailable(cls.name, "ring-flash-attn is not installed (pip install -e .[peers])")


register_methods()
