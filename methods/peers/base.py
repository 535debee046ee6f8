"""What every peer adapter shares: the library's own autograd instead of our forward/backward
split, and no byte counting or time breakdown (the library talks to torch.distributed itself).

The simulator traces a peer as it is written (suite/sim/peers.py): it calls `simulate()` on an
instance, then runs the adapter's `attention` on meta tensors with virtual ranks behind a fake
torch.distributed, the library's flash-attn kernels replaced by trace stand-ins."""

from __future__ import annotations

import dataclasses
import importlib.metadata
from types import ModuleType
from typing import ClassVar, Optional

import torch

from methods import kernels
from methods.base import Case, Method, check_local_inputs, check_mask
from methods.comm.base import Comm


def version_of(dist_name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


class PeerMethod(Method):
    """A library's sequence-parallel attention behind the suite's interface.

    Subclasses implement `_call(q, k, v, causal, scale) -> (out, lse or None)` on this rank's shards
    (differentiable through the library's autograd functions) and set `layout`. They run only under
    executor dist (`needs_processes`): the library creates its own process groups over the trial's
    worker group. `impl` names the library and version (and `+cpu-kernel` in kernel-shim mode).
    """

    needs_processes: ClassVar[bool] = True
    library: ClassVar[str] = ""
    supports_documents: ClassVar[bool] = False  # a library with a varlen path says True and takes `docs`
    mask_reason: ClassVar[str] = ""
    """Why the library cannot compute a mask family other than causal and full (methods/masks.py):
    no peer adapter passes one, so a trial of such a family is refused with this reason rather than
    run with the plain mask."""
    softcap_reason: ClassVar[str] = ""
    """Why the library cannot soft-cap logits (Gemma 2), the skip reason of a trial with a cap; a
    library that can says so in `takes_softcap` and its `_call` takes `softcap`."""
    head_dim_v_reason: ClassVar[str] = ""
    """Why the library cannot take a value head dim other than the query/key one (MLA)."""
    traceable: ClassVar[bool] = False
    """The simulator can trace the library's own code (through `simulate`); else `trace_reason` says why not."""
    trace_reason: ClassVar[str] = ""
    simulated: bool = False  # set by `simulate`
    module: Optional[ModuleType] = None
    """The library's top module to call when it is not the installed import (the simulator's copy,
    loaded against its flash-attn stand-in)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # no wrapped library takes a sink logit (gpt-oss's attention sinks): a sink trial is a
        # recorded skip with this reason, never the library's answer without the sink
        if cls.library and not cls.supports_sinks and "sinks_reason" not in cls.__dict__:
            cls.sinks_reason = f"library {cls.library} has no attention-sink argument"

    def simulate(self, module: Optional[ModuleType] = None) -> "PeerMethod":
        """Make this instance the simulator's: it will run on meta tensors with virtual ranks behind
        a fake torch.distributed (suite/sim/fake_dist.py), calling `module` (default: the installed
        library) with trace stand-ins for its kernels. `supports` and `forward_only_reason` then
        answer for the GPU the library would run on (flash-attn there), not for this machine."""
        if not self.traceable:
            raise ValueError(f"{self.name}: {self.trace_reason or 'the simulator cannot trace this library'}")
        self.simulated, self.module = True, module
        return self

    def takes_softcap(self, case: Case) -> bool:
        """Whether this adapter passes a logit soft cap to the library for `case` (which computes it)."""
        return False

    def supports(self, case: Case) -> tuple[bool, str]:
        if case.documents is not None and case.documents.mask is not None:
            return False, self.mask_refusal(case.documents.mask)
        if case.head_dim_v not in (None, case.head_dim):
            why = self.head_dim_v_reason or "the library takes one head dim for q, k and v"
            return False, f"{self.name}: {why} (head_dim {case.head_dim}, head_dim_v {case.head_dim_v})"
        if case.softcap and not self.takes_softcap(case):
            return False, f"{self.name}: {self.softcap_reason or 'the library takes no logit soft cap'}"
        # a simulated method runs here, on meta tensors: the generic checks are this machine's
        return super().supports(dataclasses.replace(case, device="cpu") if self.simulated else case)

    def mask_refusal(self, mask) -> str:
        return f"{self.name}: {self.mask_reason or 'the library takes only the causal or full mask'} ({mask.short})"

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        comm: Comm,
        softmax_scale: Optional[float] = None,
        return_lse: bool = False,
        docs=None,
        sinks=None,
        softcap: float = 0.0,
    ):
        check_local_inputs(q, k, v)
        check_mask(docs, causal)
        world = dist_world_size()
        if comm.world_size != world:
            raise RuntimeError(
                f"{self.name} runs over the whole torch.distributed group "
                f"({world} ranks); this comm has {comm.world_size}"
            )
        if sinks is not None:
            raise ValueError(self.sinks_reason or f"{self.name} has no attention-sink argument")
        if docs is not None and docs.mask is not None:
            raise ValueError(self.mask_refusal(docs.mask))
        if docs is not None and not self.supports_documents:
            raise ValueError(self.documents_reason or f"{self.name} takes no packed documents")
        scale = kernels.default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
        extra: dict = {"docs": docs} if docs is not None else {}
        if softcap:  # only adapters whose `takes_softcap` holds are given a trial with a cap
            extra["softcap"] = float(softcap)
        out, lse = self._call(q.contiguous(), k.contiguous(), v.contiguous(), bool(causal), scale, **extra)
        return (out, lse) if return_lse else out

    def attention_fwd_bwd(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} runs the library's own autograd; it cannot run as virtual ranks")

    def _call(self, q, k, v, causal: bool, scale: float):
        raise NotImplementedError


def dist_world_size() -> int:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("peer adapters need an initialised torch.distributed group (run.executor=dist)")
    return dist.get_world_size()
