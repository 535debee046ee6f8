"""Tracing a peer library as it is written: its own functions on meta tensors with virtual ranks.

The adapter's `attention` (methods/peers/) runs on each virtual rank exactly as under executor
dist, forward and (for fwd_bwd) the library's own autograd backward, with three substitutions:

- torch.distributed is the fake of suite/sim/fake_dist.py: the library's process groups,
  point-to-point batches, waits and collectives go to the rank's recording comm, so its messages
  (bytes per peer) and waits are the library's own, counted by the suite's convention;
- flash-attn is the trace stand-in of suite/sim/flash_attn_stub.py: each block-kernel call is a
  `Compute` with the shapes and causal alignment the library asked for;
- everything else the library does between kernels (ring-flash-attn's out/LSE merge, its
  dtype casts, yunchang's all-to-all reshapes) is seen by the tracer's dispatch mode as `Memory`,
  and an op that makes the host wait for the device (ring-flash-attn's varlen zigzag indexing with
  CPU boolean masks) as a `HostSync`.

ring-flash-attn imports flash-attn when it is imported, so the simulator loads its own copy of the
installed package (under another module name, against the stand-in): the machine's
`ring_flash_attn`, real or absent, is left as it is. yunchang imports without flash-attn and looks
its kernels up at call time, so its flash-attn calls are pointed at the stand-in for the length of
one trace. torch's context_parallel is not traced (`PeerMethod.trace_reason`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import threading
import types
from typing import Any, Iterator

import torch

from methods.base import Case
from methods.comm import run_threads
from methods.peers.base import PeerMethod
from suite.sim import fake_dist, flash_attn_stub
from suite.sim.ledger import Event, TraceLedger, TracingComm, TracingKernel, _Bookkeeping

_RFA_COPY = "suite_sim_ring_flash_attn"  # the module name of the simulator's copy of ring-flash-attn


_LOADING = threading.Lock()


def ring_flash_attn_module() -> types.ModuleType:
    """The simulator's copy of ring-flash-attn (loaded once; see `_load_ring_flash_attn`)."""
    with _LOADING:
        return _load_ring_flash_attn()


@functools.cache
def _load_ring_flash_attn() -> types.ModuleType:
    """The installed ring-flash-attn package loaded a second time, under its own name, with
    `flash_attn` resolving to the trace stand-in while it imports (its modules bind the kernels
    then) and its Hugging Face adapters left out (they import transformers helpers that
    transformers 5 removed, and no traced function uses them)."""
    try:
        spec = importlib.util.find_spec("ring_flash_attn")
    except (ImportError, ValueError, AttributeError):
        spec = None
    if spec is None or spec.origin is None:
        raise ValueError("ring-flash-attn is not installed (pip install -e .[peers])")
    own = importlib.util.spec_from_file_location(
        _RFA_COPY, spec.origin, submodule_search_locations=[os.path.dirname(spec.origin)]
    )
    assert own is not None and own.loader is not None
    module = importlib.util.module_from_spec(own)
    adapters = types.ModuleType(f"{_RFA_COPY}.adapters")
    adapters.substitute_hf_flash_attn = adapters.update_ring_flash_attn_params = None  # type: ignore[attr-defined]
    stand_in = flash_attn_stub.modules()
    saved = {name: sys.modules.get(name) for name in stand_in}
    sys.modules.update(stand_in)
    sys.modules[f"{_RFA_COPY}.adapters"] = adapters
    sys.modules[_RFA_COPY] = module
    try:
        own.loader.exec_module(module)
    except BaseException:
        for name in [n for n in sys.modules if n == _RFA_COPY or n.startswith(_RFA_COPY + ".")]:
            del sys.modules[name]
        raise
    finally:  # the machine's flash_attn (or its absence) is what every other import sees
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    return module


def prepare(method) -> PeerMethod:
    """Make a peer adapter the simulator's (ValueError with the reason if it cannot be traced)."""
    if not isinstance(method, PeerMethod) or not method.traceable:
        raise ValueError(
            f"{method.name} calls torch.distributed itself and cannot be traced: "
            f"{getattr(method, 'trace_reason', '') or 'no tracing path for its library'}"
        )
    if method.library == "ring-flash-attn":
        return method.simulate(ring_flash_attn_module())
    return method.simulate()


@contextlib.contextmanager
def _yunchang_kernels() -> Iterator[None]:
    """yunchang's flash-attn wrappers (`yunchang.kernels.attention`) calling the stand-in: they
    read flash-attn's version and kernels from their module when called."""
    import yunchang.kernels.attention as wrappers

    stand_in = flash_attn_stub.modules()
    interface = stand_in["flash_attn.flash_attn_interface"]
    patches: dict[str, Any] = {
        "HAS_FLASH_ATTN": True,
        "flash_attn": stand_in["flash_attn"],
        "_flash_attn_forward": interface._flash_attn_forward,
        "_flash_attn_backward": interface._flash_attn_backward,
    }
    missing = object()
    saved = {name: getattr(wrappers, name, missing) for name in patches}
    for name, value in patches.items():
        setattr(wrappers, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(wrappers, name)
            else:
                setattr(wrappers, name, value)


def _library_patches(method: PeerMethod):
    return _yunchang_kernels() if method.library == "yunchang" else contextlib.nullcontext()


def run_ranks(
    build, case: Case, pass_: str, q: torch.Tensor, kv: torch.Tensor, layout, timeout_s: float
) -> list[tuple[list[Event], int]]:
    """Each virtual rank's events (and where its backward starts) for one call of a peer adapter
    built by `build()` (one instance per rank, made the simulator's), as the attention workload
    calls it: forward, then for fwd_bwd the library's autograd backward of the output."""
    world = fake_dist.FakeWorld(case.world_size, timeout_s)
    extra = {"docs": case.documents} if case.documents is not None else {}
    backward = pass_ == "fwd_bwd"

    def rank_fn(comm) -> tuple[list[Event], int]:
        ledger = TraceLedger()
        method = build()
        c = TracingComm(comm, ledger)
        ql, kl, vl = (layout.shard(x, comm.rank).requires_grad_(backward) for x in (q, kv, kv))
        dl = layout.shard(q, comm.rank)
        with (
            fake_dist.virtual_rank(world, c),
            flash_attn_stub.recording(TracingKernel(ledger)),
            torch.set_grad_enabled(backward),
            _Bookkeeping(ledger),
        ):
            out = method.attention(ql, kl, vl, causal=case.causal, comm=c, **extra)
            ledger.flush()
            forward_end = len(ledger.events)
            if backward:
                torch.autograd.grad(out, (ql, kl, vl), dl)
        ledger.flush()
        return ledger.events, forward_end

    with fake_dist.installed(), _library_patches(build()):
        return run_threads(case.world_size, rank_fn, timeout_s=timeout_s)
