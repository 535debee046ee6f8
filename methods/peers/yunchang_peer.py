"""yunchang (USP): `LongContextAttention` (Ulysses x ring) and pure Ulysses, through the library.

Registered as `yunchang_usp` (options `ring_impl`: basic | zigzag | strip, `ulysses_degree`:
0 = auto) and `yunchang_ulysses` (ring degree 1). yunchang builds its own process groups with
`set_seq_parallel_pg` (Ulysses groups are contiguous runs of `ulysses_degree` ranks, global rank
= ring rank x U + Ulysses rank); they are created once per degree pair and process.

Layouts, matched to yunchang's own `EXTRACT_FUNC_DICT` (a test compares them on real groups):
- basic: contiguous chunks in global rank order;
- zigzag: the suite's `usp` layout (ring rank r's chunks r and 2R-1-r of 2R, cut into U pieces);
- strip: ring rank r's stripe (tokens r, r+R, r+2R, ...), cut into U pieces.

Kernels (`attn_type`): flash-attn (`fa`) when it is importable and the device is CUDA; otherwise
`torch_math`, the only yunchang kernel with a CPU path. yunchang's torch_math returns a *zero LSE*,
so its ring merge averages the blocks instead of weighting them by their softmax mass: every ring
degree > 1 gives wrong attention, and the suite records those points `incorrect` with the error.
Its torch backends have no backward (yunchang raises), so `fwd_bwd` is skipped with that reason.

`kernel_shim: true` replaces yunchang's torch_math block kernel with the suite's CPU kernel (real
LSE) for the duration of each call, so that yunchang's process groups, all-to-alls and ring run
on CPU against a correct kernel. Such rows carry impl `yunchang <version>+cpu-kernel`: they test
the adapter's plumbing and yunchang's communication logic, not yunchang's kernels.

Simulated (`simulate()`, suite/sim/peers.py), yunchang runs its flash-attn path (`fa`, with its
backward) as on a GPU: the simulator puts a trace stand-in behind yunchang's flash-attn calls, and
each virtual rank creates its own groups (not cached: they belong to one trace).
"""

from __future__ import annotations

import contextlib
import threading
from typing import ClassVar, Optional

import torch

from methods import kernels, layouts
from methods.base import Case, dtype_name
from methods.peers.base import PeerMethod, dist_world_size, version_of
from methods.registry import register, register_unavailable

RING_IMPLS = ("basic", "zigzag", "strip")
VERSION = version_of("yunchang")
_GROUPS: dict[tuple[int, int], tuple] = {}  # (U, R) -> (ulysses group, ring group) of this process
# yunchang keeps its groups in a process-wide singleton that LongContextAttention reads when it is
# built: virtual ranks (threads of one process) set it and build their layer in turn
_SINGLETON_LOCK = threading.Lock()


def _import_error() -> Optional[str]:
    try:
        import yunchang  # noqa: F401
        from yunchang.kernels import AttnType  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason, not a crash
        return f"yunchang is not importable here ({type(exc).__name__}: {exc}); pip install -e .[peers]"
    return None


def _set_groups(ud: int, rd: int) -> None:
    """Make yunchang's global process-group singleton hold the (U, R) groups (created once)."""
    import torch.distributed as dist
    from yunchang.globals import PROCESS_GROUP, set_seq_parallel_pg

    if (ud, rd) not in _GROUPS:
        set_seq_parallel_pg(ud, rd, dist.get_rank(), dist.get_world_size())
        _GROUPS[(ud, rd)] = (PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG)
    PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = _GROUPS[(ud, rd)]


def _layer(ud: int, rd: int, ring_impl: str, attn_type: str, cached: bool):
    """yunchang's LongContextAttention over this rank's (U, R) groups: the process's cached ones,
    or (`cached=False`, a simulated virtual rank) groups created for this call, with yunchang's
    singleton put back afterwards."""
    import torch.distributed as dist
    from yunchang import LongContextAttention
    from yunchang.globals import PROCESS_GROUP, set_seq_parallel_pg
    from yunchang.kernels import AttnType

    with _SINGLETON_LOCK:
        if cached:
            _set_groups(ud, rd)
            return LongContextAttention(ring_impl_type=ring_impl, attn_type=AttnType(attn_type))
        saved = PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG
        try:
            set_seq_parallel_pg(ud, rd, dist.get_rank(), dist.get_world_size())
            return LongContextAttention(ring_impl_type=ring_impl, attn_type=AttnType(attn_type))
        finally:
            PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = saved


def _shim_forward(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=True,
    window_size=(-1, -1),
    softcap=None,
    alibi_slopes=None,
    return_softmax=False,
    op_type="math",
):
    """yunchang's block-kernel signature on the suite's CPU kernel: (out, lse [B, H, S] float32).
    flash-attn's causal convention for unequal blocks is bottom-right aligned."""
    if dropout_p:
        raise ValueError("kernel shim: no dropout")
    offset = (k.shape[1] - q.shape[1]) if causal else None
    scale = kernels.with_softcap(softmax_scale, softcap or 0.0)  # yunchang passes its softcap through
    return kernels.block_forward(q, k, v, scale=scale, causal_offset=offset, kernel="auto")


@contextlib.contextmanager
def _kernel_shim():
    import yunchang.kernels as yk

    original = yk.pytorch_attn_forward  # select_flash_attn_impl looks this name up at call time
    yk.pytorch_attn_forward = _shim_forward
    try:
        yield
    finally:
        yk.pytorch_attn_forward = original


class _YunchangBase(PeerMethod):
    documents_reason = (
        "yunchang's LongContextAttention has no varlen path: its ring varlen functions are not "
        "reachable from the USP layer, so packed documents (and padding) cannot be expressed"
    )
    mask_reason = (
        "yunchang's LongContextAttention takes only causal or full masks: its window_size goes to every "
        "ring step's flash-attn call in that block's local coordinates, which is not a window over the "
        "sequence, and it takes no other mask"
    )
    library: ClassVar[str] = "yunchang"
    impl: str = f"yunchang {VERSION}"
    softcap_reason: ClassVar[str] = (
        "yunchang's torch attention types drop the softcap argument (pytorch_attn_forward ignores it); "
        "its flash-attn type passes it (CUDA with flash-attn)"
    )
    head_dim_v_reason: ClassVar[str] = (
        "yunchang runs flash-attn 2's kernels (or SDPA's flash op), which take one head dim for q, k and v"
    )

    def takes_softcap(self, case: Case) -> bool:
        """LongContextAttention hands `softcap` to its ring functions and on to flash-attn; the kernel
        shim computes it with the suite's kernels."""
        return self.kernel_shim or self.attn_type(torch.device(case.device)) == "fa"

    traceable = True

    def __init__(
        self, kernel: str = "auto", ulysses_degree: int = 0, ring_impl: str = "basic", kernel_shim: bool = False
    ):
        super().__init__(kernel)
        if ring_impl not in RING_IMPLS:
            raise ValueError(
                f"{self.name}: ring_impl must be one of {RING_IMPLS} (yunchang's name is 'strip'), got {ring_impl!r}"
            )
        if ulysses_degree < 0:
            raise ValueError(f"{self.name}: ulysses_degree must be >= 0 (0 = auto), got {ulysses_degree}")
        self.ulysses_degree, self.ring_impl, self.kernel_shim = ulysses_degree, ring_impl, bool(kernel_shim)
        if self.kernel_shim:
            self.impl = f"yunchang {VERSION}+cpu-kernel"

    def degrees(self, case: Case) -> tuple[int, int]:
        ud = self.ulysses_degree or _auto_degree(case)
        if case.world_size % ud:
            raise ValueError(f"{self.name}: ulysses_degree {ud} must divide world_size {case.world_size}")
        return ud, case.world_size // ud

    def layout(self, case: Case) -> layouts.Layout:
        ud, rd = self.degrees(case)
        if self.ring_impl == "basic":
            return layouts.contiguous(case.seq_len, case.world_size)
        if self.ring_impl == "zigzag":
            return layouts.usp(case.seq_len, case.world_size, ud)
        return strip_layout(case.seq_len, ud, rd)

    def attn_type(self, device: torch.device) -> str:
        from yunchang.kernels import HAS_FLASH_ATTN

        if self.kernel_shim:
            return "torch_math"
        if self.simulated:  # the GPU path, whose kernels the simulator stands in for
            return "fa"
        return "fa" if device.type == "cuda" and HAS_FLASH_ATTN else "torch_math"

    def supports(self, case: Case) -> tuple[bool, str]:
        try:
            ud, rd = self.degrees(case)
        except ValueError as exc:
            return False, str(exc)
        if case.heads % ud or case.kv_heads % ud:
            return False, (
                f"yunchang scatters heads over the Ulysses degree {ud}: heads ({case.heads}) and kv_heads "
                f"({case.kv_heads}) must be divisible by it"
            )
        if self.ring_impl != "basic" and not case.causal:
            return False, f"yunchang's {self.ring_impl} ring asserts causal=True"
        kv_local, q_local = case.kv_heads // ud, case.heads // ud
        if (
            self.attn_type(torch.device(case.device)) == "torch_math"
            and not self.kernel_shim
            and kv_local not in (1, q_local)
        ):
            return False, (
                f"yunchang's torch_math kernel has no GQA: after the Ulysses all-to-all each rank holds "
                f"{q_local} query heads and {kv_local} KV heads (torch SDPA broadcasts only 1)"
            )
        if self.kernel_shim and (case.device != "cpu" or self.simulated):
            return False, "kernel_shim substitutes the suite's CPU kernel: CPU only, and not simulated"
        return super().supports(case)

    def forward_only_reason(self, case: Case) -> Optional[str]:
        if self.attn_type(torch.device(case.device)) != "fa":
            return (
                "yunchang's torch attention types have no backward (it raises 'Not implemented backward for "
                "PyTorch attention types'); needs flash-attn on CUDA"
            )
        return None

    def kernel_used(self, device: torch.device, dtype: torch.dtype, head_dim: int, softcap: float = 0.0, **_) -> str:
        if self.simulated:
            return "yunchang fa: flash-attn trace stand-in"
        if self.kernel_shim:
            return "suite " + kernels.resolve_kernel("auto", device, dtype, head_dim, softcap=softcap) + " (shim)"
        return "yunchang " + self.attn_type(device)

    def options(self) -> dict:
        return {
            "kernel": self.kernel,
            "ulysses_degree": self.ulysses_degree,
            "ring_impl": self.ring_impl,
            "kernel_shim": self.kernel_shim,
        }

    def _call(self, q, k, v, causal: bool, scale: float, softcap: float = 0.0):
        world = dist_world_size()
        case = Case(
            batch=q.shape[0],
            seq_len=q.shape[1] * world,
            heads=q.shape[2],
            kv_heads=k.shape[2],
            head_dim=q.shape[3],
            dtype=dtype_name(q.dtype),
            causal=causal,
            world_size=world,
            device=q.device.type,
        )
        ud, rd = self.degrees(case)
        attn = _layer(ud, rd, self.ring_impl, self.attn_type(q.device), cached=not self.simulated)
        with _kernel_shim() if self.kernel_shim else contextlib.nullcontext():
            out = attn(q, k, v, softmax_scale=scale, causal=causal, **({"softcap": softcap} if softcap else {}))
        return out, None


def _auto_degree(case: Case) -> int:
    """The largest Ulysses degree dividing the world size and both head counts (USP's advice:
    Ulysses inside the fast domain, ring across)."""
    for ud in range(min(case.world_size, 8), 0, -1):
        if case.world_size % ud == 0 and case.heads % ud == 0 and case.kv_heads % ud == 0:
            return ud
    return 1


def strip_layout(seq_len: int, ud: int, rd: int) -> layouts.Layout:
    """yunchang's stripe_extract_local: ring rank r's stripe (r, r+R, ...), cut into U pieces;
    global rank r*U + u holds piece u."""
    if seq_len % (rd * ud):
        raise ValueError(f"strip layout needs seq_len divisible by ring x ulysses degree ({rd} x {ud}); got {seq_len}")
    parts = []
    for r in range(rd):
        stripe = torch.arange(r, seq_len, rd)
        parts += list(stripe.chunk(ud))
    return layouts.Layout("yunchang-strip", seq_len, rd * ud, tuple(p.contiguous() for p in parts))


_REASON = _import_error()
if _REASON is None:

    @register
    class YunchangUSP(_YunchangBase):
        name = "yunchang_usp"
        description = "yunchang LongContextAttention: Ulysses all-to-all x ring (basic, zigzag, strip)"

    @register
    class YunchangUlysses(_YunchangBase):
        name = "yunchang_ulysses"
        description = "yunchang LongContextAttention with ring degree 1 (pure Ulysses)"

        def __init__(self, kernel: str = "auto", kernel_shim: bool = False):
            super().__init__(kernel, ulysses_degree=0, ring_impl="basic", kernel_shim=kernel_shim)

        def degrees(self, case: Case) -> tuple[int, int]:
            return case.world_size, 1

        def options(self) -> dict:
            return {"kernel": self.kernel, "kernel_shim": self.kernel_shim}
else:
    register_unavailable("yunchang_usp", _REASON)
    register_unavailable("yunchang_ulysses", _REASON)
