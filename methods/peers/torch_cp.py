"""PyTorch native context parallel (`torch.distributed.tensor.experimental.context_parallel`):
`torch_cp_allgather` and `torch_cp_alltoall` (its two K/V rotation methods).

Inside `context_parallel(mesh)`, torch's SDPA on local shards is replaced by a ring over the
mesh; with a causal mask torch expects its load-balanced (head-tail) layout, which is the
suite's zigzag layout. torch's CP has sharding rules only for the CUDA SDPA kernels (flash,
memory-efficient, cuDNN): on CPU, SDPA dispatches to `_scaled_dot_product_flash_attention_for_cpu`
and torch raises NotImplementedError ("does not have a sharding strategy registered", seen with
torch 2.13 over gloo), so these methods are skipped on CPU with that reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from methods.base import Case
from methods.peers.base import PeerMethod
from methods.registry import register, register_unavailable

if TYPE_CHECKING:  # imported where a mesh is built, as the import is not free
    from torch.distributed.device_mesh import DeviceMesh

_MESHES: dict[int, DeviceMesh] = {}


def _import_error() -> str | None:
    """Why this torch cannot give context_parallel, or None. Read from torch's source tree: importing
    torch.distributed.tensor (DTensor, sympy) took a fifth of every `suite` command's start-up,
    planning included, on machines (CPU ones) where these methods never run. The import itself
    happens where they run (`_call`), and `available_here` checks it on CUDA machines."""
    import os

    root = os.path.join(os.path.dirname(torch.__file__), "distributed", "tensor", "experimental")
    try:
        with open(os.path.join(root, "__init__.py"), encoding="utf-8") as f:
            ok = "context_parallel" in f.read()
    except OSError:
        ok = False
    has_attention = any(os.path.exists(os.path.join(root, n)) for n in ("_attention.py", "_attention"))
    if not (ok and has_attention):
        return f"this torch ({torch.__version__}) has no context_parallel (torch.distributed.tensor.experimental)"
    return None


_IMPORTED: list = []  # the real import's error message ("" when it worked), once per process


def _real_import_error() -> str:
    if not _IMPORTED:
        try:
            from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
            from torch.distributed.tensor.experimental._attention import set_rotate_method  # noqa: F401

            _IMPORTED.append("")
        except Exception as exc:  # noqa: BLE001
            _IMPORTED.append(f"this torch ({torch.__version__}) has no context_parallel ({type(exc).__name__}: {exc})")
    return _IMPORTED[0]


class _TorchCP(PeerMethod):
    documents_reason = (
        "PyTorch's context_parallel shards SDPA with its causal flag only: it takes no document "
        "mask (packed documents or padding)"
    )
    mask_reason = "PyTorch's context_parallel shards SDPA with its causal flag only: it takes no attention mask"
    library: ClassVar[str] = "torch"
    impl: str = f"torch {torch.__version__.split('+')[0]} context_parallel"
    softcap_reason: ClassVar[str] = (
        "torch context_parallel shards F.scaled_dot_product_attention, which has no logit soft-capping argument"
    )
    head_dim_v_reason: ClassVar[str] = (
        "SDPA's flash backend refuses a value head dim other than the query/key one, and this adapter "
        "does not pin the efficient or cuDNN backends that take it under context_parallel"
    )
    trace_reason: ClassVar[str] = (
        "torch context_parallel rewrites SDPA through DTensor dispatch and functional collectives on a "
        "DeviceMesh, with sharding rules for the CUDA SDPA kernels only; the simulator's fake process "
        "group provides plain torch.distributed calls, so its schedule is not traced"
    )
    rotate: ClassVar[str]

    @classmethod
    def available_here(cls) -> tuple[bool, str]:
        if not torch.cuda.is_available():
            return False, (
                "CUDA only: torch context_parallel has no sharding rule for the CPU SDPA kernel "
                "(NotImplementedError for aten._scaled_dot_product_flash_attention_for_cpu)"
            )
        why = _real_import_error()
        return (False, why) if why else (True, "")

    def layout(self, case: Case):
        from methods import layouts

        return layouts.make("zigzag" if case.causal else "contiguous", case.seq_len, case.world_size)

    def supports(self, case: Case) -> tuple[bool, str]:
        if case.device != "cuda":
            return False, (
                "torch context_parallel has sharding rules only for the CUDA SDPA kernels; on CPU it "
                "raises NotImplementedError for aten._scaled_dot_product_flash_attention_for_cpu"
            )
        if case.heads != case.kv_heads:
            return False, "torch context_parallel's SDPA path takes equal query and KV heads (no GQA)"
        ok, why = super().supports(case)  # first: no CUDA here ends it without importing DTensor
        if ok and (why := _real_import_error()):
            return False, why
        return ok, why

    def kernel_used(self, device, dtype, head_dim, **_variant) -> str:
        return "torch sdpa (cuda)"

    def _call(self, q, k, v, causal: bool, scale: float):
        import torch.distributed as dist
        import torch.nn.functional as F
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        world = dist.get_world_size()
        if world not in _MESHES:
            _MESHES[world] = init_device_mesh(q.device.type, (world,))
        set_rotate_method(self.rotate)
        with context_parallel(_MESHES[world]):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=scale
            )
        return out.transpose(1, 2).contiguous(), None


_REASON = _import_error()
if _REASON is None:

    @register
    class TorchCPAllGather(_TorchCP):
        name, rotate = "torch_cp_allgather", "allgather"
        description = "PyTorch native context parallel, K/V all-gather rotation"

    @register
    class TorchCPAllToAll(_TorchCP):
        name, rotate = "torch_cp_alltoall", "alltoall"
        description = "PyTorch native context parallel, K/V all-to-all rotation"
else:
    register_unavailable("torch_cp_allgather", _REASON)
    register_unavailable("torch_cp_alltoall", _REASON)
