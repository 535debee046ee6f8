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

from typing import ClassVar

import torch

from methods.base import Case
from methods.peers.base import PeerMethod
from methods.registry import register, register_unavailable

_MESHES: dict[int, object] = {}


def _import_error() -> str | None:
    try:
        from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
        from torch.distributed.tensor.experimental._attention import set_rotate_method  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"this torch ({torch.__version__}) has no context_parallel ({type(exc).__name__}: {exc})"
    return None


class _TorchCP(PeerMethod):
    documents_reason = ("PyTorch's context_parallel shards SDPA with its causal flag only: it takes no document "
                        "mask (packed documents or padding)")
    library: ClassVar[str] = "torch"
    impl: ClassVar[str] = f"torch {torch.__version__.split('+')[0]} context_parallel"
    rotate: ClassVar[str]

    @classmethod
    def available_here(cls) -> tuple[bool, str]:
        if not torch.cuda.is_available():
            return False, ("CUDA only: torch context_parallel has no sharding rule for the CPU SDPA kernel "
                           "(NotImplementedError for aten._scaled_dot_product_flash_attention_for_cpu)")
        return True, ""

    def layout(self, case: Case):
        from methods import layouts
        return layouts.make("zigzag" if case.causal else "contiguous", case.seq_len, case.world_size)

    def supports(self, case: Case) -> tuple[bool, str]:
        if case.device != "cuda":
            return False, ("torch context_parallel has sharding rules only for the CUDA SDPA kernels; on CPU it "
                           "raises NotImplementedError for aten._scaled_dot_product_flash_attention_for_cpu")
        if case.heads != case.kv_heads:
            return False, "torch context_parallel's SDPA path takes equal query and KV heads (no GQA)"
        return super().supports(case)

    def kernel_used(self, device, dtype, head_dim) -> str:
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
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=causal, scale=scale)
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
