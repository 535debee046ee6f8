"""The method interface (docs/DESIGN.md section 4) and the one autograd wrapper every method shares.

A method is a class with two plain functions, `forward` and `backward`, written against the
`Comm` protocol; `Method.attention` wraps them in `SPAttention` (a single autograd.Function for
all methods), so no method writes its own autograd code. Tensors are BSHD at every public
boundary: q [B, S_local, H, D], k [B, S_local, Hkv, D], v [B, S_local, Hkv, Dv] (Dv = D but for
MLA-like models); lse [B, H, S_local] float32.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional

import torch

from methods import kernels, layouts, merge
from methods.comm.base import Comm
from methods.documents import BlockMasks, Documents

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The DTYPES key of a torch dtype ("bfloat16" for torch.bfloat16)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Case:
    """One attention problem as a method sees it: global shapes, mask, world size, device."""

    batch: int
    seq_len: int  # global number of tokens
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str  # a key of DTYPES
    causal: bool
    world_size: int
    device: str = "cpu"  # "cpu" or "cuda"
    documents: Optional[Documents] = None
    """Packed documents (their lengths and the padded length, which is then `seq_len`), or None:
    one document per sequence, no padding (methods/documents.py)."""
    sinks: bool = False
    """Attention sinks (gpt-oss): one learned logit per query head joins every row's softmax
    denominator (`Method.attention`'s `sinks`); a method without them refuses the case."""
    head_dim_v: Optional[int] = None
    """The values' head dim (and the output's), None: equal to `head_dim`. MLA (DeepSeek-V3) has
    q/k head dim 192 and v head dim 128: K and V then cost different bytes on every link."""
    softcap: float = 0.0
    """Logit soft cap (Gemma 2): scores become softcap * tanh(s / softcap) before the softmax; 0: off."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def dv(self) -> int:
        """The values' head dim (`head_dim_v`, or `head_dim` when None)."""
        return self.head_dim_v or self.head_dim

    @property
    def kv_dims(self) -> int:
        """Head dims of one key plus its value (2 * head_dim when they are equal): the width a
        byte formula multiplies where it moves K and V together."""
        return self.head_dim + self.dv


class Method:
    """Base class of every sequence-parallel attention method (own or peer adapter).

    Subclasses set `name`, `description` and `layout_kind`, and implement `forward` and
    `backward`. Options (e.g. `kernel`, `ulysses_degree`) are keyword arguments of `__init__`.
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    layout_kind: ClassVar[str] = "contiguous"
    impl: str = "own"  # "own", or the library and version of a peer (an instance may refine it)
    needs_processes: ClassVar[bool] = False  # peers calling torch.distributed themselves
    single_device: ClassVar[bool] = False  # the single-device baseline (world size 1 only)
    test_double: ClassVar[bool] = False
    """True for methods that exist to test the harness (a planted fault): they run only where named,
    never as a member of a method group (methods.registry.GROUPS)."""
    gathers_whole_sequence: ClassVar[bool] = False
    """True when a rank materialises the whole sequence's K/V, so its memory grows with the world
    size at a fixed local length (all-gather K/V, by design); every other method keeps a fixed
    number of blocks in flight, which a test checks."""
    memory_steady_from: ClassVar[int] = 0
    """The world size from which the blocks a rank holds at once, and their sizes, no longer change
    as the world grows (0: from the sizes the memory test uses). Where blocks differ in size by
    rank pair (token_ring's results: all rows or half of them, by the causal plan), the largest
    combination first meets on one rank at some world size; below it the peak is smaller, which is
    not growth."""
    supports_documents: ClassVar[bool] = True
    """Computes the document-causal mask of packed documents and padding exactly (the `docs`
    argument of `attention`); peer libraries without a varlen path say False, and why in
    `documents_reason` (the library's own limitation)."""
    documents_reason: ClassVar[str] = ""
    supports_sinks: ClassVar[bool] = False
    """Takes attention sinks (the `sinks` argument of `attention`): folds each query head's sink
    logit into every row once, where the row's out and lse are final (`merge.fold_sink`). False
    by default, so a method that does not know the argument refuses sink cases instead of
    ignoring the sink; `sinks_reason` says why (a peer library's missing argument)."""
    sinks_reason: ClassVar[str] = ""
    test_variants: ClassVar[tuple[dict[str, Any], ...]] = ({},)
    """Option sets that change the algorithm (not only a knob): the generic tests check each one
    against float64 and against `expected_bytes` (e.g. burst with and without its two-level ring)."""

    def __init__(self, kernel: str = "auto"):
        if kernel not in kernels.KERNEL_CHOICES:
            raise ValueError(f"{self.name}: unknown kernel {kernel!r}; choose one of {kernels.KERNEL_CHOICES}")
        # a name; the suite swaps in a TimedKernel wrapping one while it measures or traces a trial
        self.kernel: kernels.KernelChoice = kernel

    # -- what the harness asks ----------------------------------------------------------------
    @classmethod
    def available_here(cls) -> tuple[bool, str]:
        """Whether this method can run on this machine at all (e.g. its library imports), and why not."""
        return True, ""

    def degrees(self, case: Case) -> tuple[int, int]:
        """(ulysses_degree, ring_degree) of this method for `case` (their product is the world size)."""
        return 1, case.world_size

    def layout(self, case: Case) -> layouts.Layout:
        """Which global positions each rank holds (raises ValueError if the sizes do not fit)."""
        return layouts.make(self.layout_kind, case.seq_len, case.world_size)

    def granule(self, case: Case) -> int:
        """Global sequence lengths this method's layout takes at `case.world_size` (and its heads)
        are the multiples of this."""
        return layouts.granule(self.layout_kind, case.world_size)

    def padded_len(self, case: Case) -> int:
        """`case.seq_len` rounded up to the granule: the tail beyond it is padding, which attends
        nothing and which nothing attends (so any length runs)."""
        g = self.granule(case)
        return -(-case.seq_len // g) * g

    def expected_bytes(self, case: Case, pass_: str) -> Optional[tuple[int, int]]:
        """(sent, received) bytes of one rank in one call: forward only (`pass_` "fwd") or forward
        and backward ("fwd_bwd"). This is the method's communication formula as code; a generic
        test checks it against what the counting comm records. None: not declared (peer
        libraries, which talk to torch.distributed themselves). When ranks move different amounts
        (`expected_rank_bytes`), the most any rank sends and the most any rank receives."""
        return None

    def expected_rank_bytes(self, case: Case, pass_: str, rank: int) -> Optional[tuple[int, int]]:
        """(sent, received) bytes of rank `rank` in one call, as `expected_bytes`. Methods whose
        ranks all move the same bytes need not override it (the default); one whose ranks differ
        (token_ring: results carry only the rows a rank computed, which the causal mask makes
        uneven) gives each rank's exact formula, and the generic test checks every rank."""
        return self.expected_bytes(case, pass_)

    def redundant_kv_bytes(self, case: Case, rank: int) -> Optional[int]:
        """K/V bytes rank `rank` receives in one forward that none of its queries attends (keys,
        and their values, of received blocks that no local query sees under the case's mask;
        MagiAttention's measure of wasted communication), from the layout alone. None: not
        declared."""
        return None

    def supports(self, case: Case) -> tuple[bool, str]:
        """Whether this method can run `case`, and if not, why (recorded as the skip reason)."""
        if case.heads % case.kv_heads != 0:
            return False, f"heads ({case.heads}) must be a multiple of kv_heads ({case.kv_heads})"
        if case.documents is not None and not self.supports_documents:
            return False, self.documents_reason or f"{self.name} has no path for packed documents (varlen) or padding"
        if case.sinks and not self.supports_sinks:
            return False, self.sinks_reason or f"{self.name} has no attention-sink argument"
        try:
            self.layout(case)
        except ValueError as exc:
            return False, str(exc)
        if case.device == "cuda" and not torch.cuda.is_available():
            return False, "needs CUDA, which is not available here"
        try:
            kernels.resolve_kernel(
                self._kernel_name(),
                torch.device(case.device),
                case.torch_dtype,
                case.head_dim,
                head_dim_v=case.dv,
                softcap=case.softcap,
            )
        except ValueError as exc:
            return False, str(exc)
        return True, ""

    def forward_only_reason(self, case: Case) -> Optional[str]:
        """Why this method cannot run a backward pass for `case` (forward+backward trials are then
        skipped with it), or None."""
        return None

    def kernel_used(
        self,
        device: torch.device,
        dtype: torch.dtype,
        head_dim: int,
        *,
        head_dim_v: Optional[int] = None,
        softcap: float = 0.0,
    ) -> str:
        """The local attention kernel this method runs with (recorded with each trial)."""
        return kernels.resolve_kernel(
            self._kernel_name(), device, dtype, head_dim, head_dim_v=head_dim_v, softcap=softcap
        )

    def _kernel_name(self) -> str:
        """The configured kernel name, also while a TimedKernel wraps it."""
        return self.kernel.name if isinstance(self.kernel, kernels.TimedKernel) else self.kernel

    # -- the algorithm: plain functions, written by each method ----------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        comm: Comm,
        causal: bool,
        scale: float,
        return_lse: bool,
        docs: Optional[Documents] = None,
        sinks: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], tuple]:
        """Local shards in, local output out. `docs`: packed documents (or None), whose
        document-causal mask and padding the method computes exactly. `sinks`: [H] sink logits
        (passed only to methods with `supports_sinks`), folded once into each row where its out
        and lse are final (`merge.fold_sink`), before they are kept for the backward: the
        backward then runs unchanged on the folded out and lse, which makes dq, dk, dv exact.
        `scale` may be a `kernels.ScoreScale` carrying a logit soft cap: a method hands it to its
        block calls as it is (the cap applies to scores, never to a sink's logit).

        Returns (out [B, S_local, H, Dv] in q.dtype, lse [B, H, S_local] float32 or None when
        `return_lse` is False and producing it would cost extra communication, residuals: the
        tensors, and plain values such as ints, that `backward` needs).
        """
        raise NotImplementedError

    def backward(
        self,
        dout: torch.Tensor,
        residuals: tuple,
        *,
        comm: Comm,
        causal: bool,
        scale: float,
        docs: Optional[Documents] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients (dq, dk, dv) of the local shards, in the inputs' dtypes."""
        raise NotImplementedError

    def block_masks(
        self, q: torch.Tensor, k: torch.Tensor, comm: Comm, causal: bool, docs: Optional[Documents]
    ) -> Optional[BlockMasks]:
        """The document masks of this call's blocks on this method's layout (None without documents)."""
        if docs is None:
            return None
        case = Case(
            batch=q.shape[0],
            seq_len=docs.padded_len,
            heads=q.shape[2],
            kv_heads=k.shape[2],
            head_dim=q.shape[3],
            dtype=dtype_name(q.dtype),
            causal=causal,
            world_size=comm.world_size,
            documents=docs,
        )
        return self.case_masks(case)

    def case_masks(self, case: Case) -> Optional[BlockMasks]:
        """The block masks of `case` on this method's layout (None without documents), kept per case:
        a block's mask is classified once per problem, not again in every timed call (the masks of
        every rank's blocks are what a ring's early stop asks, `kv_ring.useful_steps`)."""
        if case.documents is None:
            return None
        cache: dict[Case, BlockMasks] = self.__dict__.setdefault("_case_masks", {})
        if case not in cache:
            if len(cache) >= 8:  # a sweep's problems come one after another: keep the latest few
                cache.clear()
            cache[case] = BlockMasks(case.documents, self.layout(case).positions, case.causal)
        return cache[case]

    # -- the public, differentiable entry point ------------------------------------------------
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
        docs: Optional[Documents] = None,
        sinks: Optional[torch.Tensor] = None,
        softcap: float = 0.0,
    ):
        """Sequence-parallel attention on local shards (differentiable).

        Args:
            q: [B, S_local, H, D]; k: [B, S_local, Hkv, D]; v: [B, S_local, Hkv, Dv]; this rank's
                tokens in the method's layout.
            causal: causal mask on *global* positions.
            comm: the group of ranks sharing the sequence.
            softmax_scale: defaults to 1/sqrt(D).
            return_lse: also return lse [B, H, S_local] float32 (not differentiable).
            docs: packed documents (methods/documents.py): a token sees only tokens of its own
                document; padding (positions from docs.seq_len to docs.padded_len) sees nothing
                and is seen by nothing. None: one document per sequence.
            sinks: attention sinks (gpt-oss), [H] float32, the same on every rank, differentiable:
                head h's logit s_h joins every row's softmax denominator without a value,
                lse_i = log(sum_j e^x_ij + e^s_h). Its gradient on this rank is this rank's rows'
                share; the shares sum to the whole gradient over the group's ranks, like any
                weight the ranks share (a training loop all-reduces it with the others), so the
                call moves no bytes for it. The share is computed in the inputs' precision
                (`merge.sink_grad`) and autograd hands it back in the sinks' dtype: float64
                sinks with float64 inputs keep it in float64.
            softcap: logit soft cap (Gemma 2; 0: none): scores become softcap * tanh(s / softcap).
        Returns:
            out [B, S_local, H, Dv] in q.dtype, or (out, lse) with `return_lse`.
        """
        check_local_inputs(q, k, v)
        check_sinks(sinks, q, self)
        check_mask(docs, causal)
        # Views of a fused projection (qkv.unbind) are fine to pass: communication needs contiguous
        # buffers, so every method sees contiguous inputs (a no-op when they already are).
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        scale = kernels.default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
        scale = kernels.with_softcap(scale, softcap)
        out, lse = SPAttention.apply(q, k, v, sinks, self, comm, bool(causal), scale, bool(return_lse), docs)
        return (out, lse) if return_lse else out

    def attention_fwd_bwd(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dout: torch.Tensor,
        *,
        causal: bool,
        comm: Comm,
        softmax_scale: Optional[float] = None,
        docs: Optional[Documents] = None,
        sinks: Optional[torch.Tensor] = None,
        softcap: float = 0.0,
    ):
        """Forward and backward by direct calls, without the autograd engine.

        Same computation as `attention` followed by autograd; needed for virtual ranks as threads on
        one GPU, where autograd runs every CUDA backward on one per-device thread, so a rank waiting
        for another rank's message inside its backward would block that rank's backward forever.

        Returns (out, lse, dq, dk, dv) with the shapes of `attention` (lse [B, H, S_local] float32),
        and dsink [H] (this rank's share, as in `attention`, in the inputs' precision or the sinks'
        dtype, the wider: float64 for float64 inputs) after them when `sinks` is given.
        """
        check_local_inputs(q, k, v)
        check_sinks(sinks, q, self)
        check_mask(docs, causal)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        scale = kernels.default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
        scale = kernels.with_softcap(scale, softcap)
        extra = _extra(docs, sinks)
        with torch.no_grad():
            out, lse, residuals = self.forward(
                q, k, v, comm=comm, causal=bool(causal), scale=scale, return_lse=True, **extra
            )
            extra.pop("sinks", None)
            dq, dk, dv = self.backward(
                dout.contiguous(), residuals, comm=comm, causal=bool(causal), scale=scale, **extra
            )
            if sinks is not None:
                if lse is None:  # asked for above; a method must return it when asked
                    raise RuntimeError(f"{self.name}: forward returned no lse though return_lse was True")
                return out, lse, dq, dk, dv, merge.sink_grad(dout, out, lse, sinks)
        return out, lse, dq, dk, dv

    def options(self) -> dict[str, Any]:
        """The options this method was built with (recorded with each trial)."""
        return {"kernel": self.kernel}


def check_local_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Early, clear errors for inputs no method can take (never a wrong answer or a hang)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, seq, heads, head_dim]; got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share a device; got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k and v must have the same shape but for the head dim; got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"q and k must hold the same tokens (self-attention); got local lengths {q.shape[1]} and {k.shape[1]}"
        )
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head_dim")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"heads ({q.shape[2]}) must be a multiple of kv_heads ({k.shape[2]})")


def check_sinks(sinks: Optional[torch.Tensor], q: torch.Tensor, method: Method) -> None:
    """Early, clear errors for a sinks argument no method can take, or a method that has none."""
    if sinks is None:
        return
    if not method.supports_sinks:
        raise ValueError(method.sinks_reason or f"{method.name} has no attention-sink argument")
    if sinks.shape != (q.shape[2],):
        raise ValueError(f"sinks must be [heads] = [{q.shape[2]}], one logit per query head; got {tuple(sinks.shape)}")
    if sinks.device != q.device or not sinks.is_floating_point():
        raise ValueError(
            f"sinks must be floating point on q's device ({q.device}); got {sinks.dtype} on {sinks.device}"
        )


def check_mask(docs: Optional[Documents], causal: bool) -> None:
    """Refuse a causal flag that contradicts the documents' mask, before any rank computes.

    The flag picks a method's plan: causal=True skips the blocks above the diagonal (the ring's
    later steps, zigzag's and TokenRing's halves), then the mask refines the blocks that run. A
    mask that lets a query see a later key (full, a symmetric window, prefix-LM, block-causal,
    global tokens) under causal=True would lose those pairs and return wrong numbers silently.
    Deriving the flag from the mask instead would answer a question the caller did not ask
    whichever of the two they meant, so the call is refused and says what to pass. causal=False
    with a family inside the causal mask is exact (the full plan, refined block by block) and
    allowed. A plain mask given to `Documents` is kept as None, so it is checked by the family
    it was given as (`Documents.plain_family`)."""
    if docs is None:
        return
    if docs.mask is not None:
        if causal and not docs.mask.causal:
            raise ValueError(
                f"causal=True contradicts the documents' mask {docs.mask.name}, which lets a query see later "
                "keys: pass causal=False (the mask alone decides which pairs attend; causal=True is only "
                "for the families within the causal mask)"
            )
    elif docs.plain_family is not None and (docs.plain_family == "causal") != bool(causal):
        want = docs.plain_family == "causal"
        raise ValueError(
            f"causal={bool(causal)} contradicts the documents' mask {docs.plain_family}: pass causal={want}, "
            "or documents without a mask (the flag alone then chooses causal or full)"
        )


def _extra(docs: Optional[Documents], sinks: Optional[torch.Tensor]) -> dict:
    """The optional arguments of a method's forward, only those given: peer adapters and older
    methods take neither (they refuse such trials in `supports`)."""
    extra: dict = {"docs": docs} if docs is not None else {}
    if sinks is not None:
        extra["sinks"] = sinks
    return extra


class SPAttention(torch.autograd.Function):
    """The shared autograd wrapper: forward and backward are the method's own distributed code."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        sinks: Optional[torch.Tensor],
        method: Method,
        comm: Comm,
        causal: bool,
        scale: float,
        return_lse: bool,
        docs: Optional[Documents],
    ):
        # documents and sinks only when given: peer adapters take neither (they refuse such trials)
        ctx.extra = {"docs": docs} if docs is not None else {}
        # with sinks the lse of every local row is needed for the sink's gradient
        out, lse, residuals = method.forward(
            q,
            k,
            v,
            comm=comm,
            causal=causal,
            scale=scale,
            return_lse=return_lse or sinks is not None,
            **_extra(docs, sinks),
        )
        ctx.method, ctx.comm, ctx.causal, ctx.scale = method, comm, causal, scale
        # Tensors go through save_for_backward (version checks); other residuals (ints) ride on ctx.
        ctx.is_tensor = [isinstance(x, torch.Tensor) for x in residuals]
        ctx.others = [x for x in residuals if not isinstance(x, torch.Tensor)]
        # the sink's gradient reads the folded out and lse of the local rows (most methods keep
        # these very tensors among their residuals: no extra memory)
        sink_tensors = [sinks, out, lse] if sinks is not None else []
        ctx.sinks = sinks is not None
        ctx.save_for_backward(*[x for x in residuals if isinstance(x, torch.Tensor)], *sink_tensors)
        if lse is None:
            lse = out.new_empty(0, dtype=merge.acc_dtype(q.dtype))
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        saved = ctx.saved_tensors
        if ctx.sinks:
            saved, (sinks, out, lse) = saved[:-3], saved[-3:]
        tensors, others = iter(saved), iter(ctx.others)
        residuals = tuple(next(tensors) if t else next(others) for t in ctx.is_tensor)
        dq, dk, dv = ctx.method.backward(
            dout.contiguous(), residuals, comm=ctx.comm, causal=ctx.causal, scale=ctx.scale, **ctx.extra
        )
        dsink = merge.sink_grad(dout, out, lse, sinks) if ctx.sinks and ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsink, None, None, None, None, None, None


SHARDINGS = ("sequence", "documents", "area")
AREA_CHUNKS_PER_RANK = 4  # area sharding's chunks per rank when `area_chunk` is 0


# DocumentSharding is mixed into Method subclasses, before Method in their bases; to the type checker
# it is a Method (it uses the name and super().padded_len), at run time a plain mixin.
if TYPE_CHECKING:
    _MethodMixin = Method
else:
    _MethodMixin = object


class DocumentSharding(_MethodMixin):
    """The `sharding` option of a zigzag method: "sequence" zigzags the whole packed sequence (2P
    chunks); "documents" cuts every document into 2P chunks (Megatron/TE's THD load balancing,
    `layouts.documents`), which balances each document's causal work by itself; "area" cuts the
    padded sequence into equal chunks of `area_chunk` tokens (0: 4 per rank) and deals them to the
    ranks by their visible area under the mask (`layouts.area`): equal tokens, balanced work for
    any mask family. Positions then follow the documents or the areas, so the method computes every
    block with the documents' masks (the sequence layout's causal shortcuts do not hold)."""

    sharding: str = "sequence"
    area_chunk: int = 0

    # The set-up every zigzag method with this option shares: its options (the method's own and the
    # sharding's), and its layout (the zigzag, or by documents or area).
    def __init__(self, kernel: str = "auto", sharding: str = "sequence", area_chunk: int = 0):
        super().__init__(kernel)
        self._init_sharding(sharding, area_chunk)

    def options(self) -> dict[str, Any]:
        return {**super().options(), **self.sharding_options()}

    def layout(self, case: Case) -> layouts.Layout:
        return self.document_layout(case) if self.masks_every_block else super().layout(case)

    def _init_sharding(self, sharding: str, area_chunk: int = 0) -> None:
        if sharding not in SHARDINGS:
            raise ValueError(f"{self.name}: sharding must be one of {list(SHARDINGS)}, got {sharding!r}")
        if isinstance(area_chunk, bool) or not isinstance(area_chunk, int) or area_chunk < 0:
            raise ValueError(f"{self.name}: area_chunk must be a number of tokens >= 1 (0: automatic)")
        if area_chunk and sharding != "area":
            raise ValueError(f"{self.name}: area_chunk applies to sharding=area only")
        self.sharding, self.area_chunk = sharding, area_chunk

    def sharding_options(self) -> dict:
        """The options that name the sharding (area_chunk only where it applies: trial keys of the
        other shardings stay as they were)."""
        out: dict = {"sharding": self.sharding}
        if self.sharding == "area":
            out["area_chunk"] = self.area_chunk
        return out

    @property
    def by_documents(self) -> bool:
        return self.sharding == "documents"

    @property
    def masks_every_block(self) -> bool:
        """Positions other than the zigzag's (by documents or by area): every block is masked."""
        return self.sharding != "sequence"

    def _area_granule(self, world_size: int) -> int:
        return world_size * (self.area_chunk or AREA_CHUNKS_PER_RANK)

    def document_layout(self, case: Case) -> layouts.Layout:
        if self.sharding == "area":
            docs = case.documents or Documents.single(case.batch, case.seq_len)
            chunks = case.seq_len // self.area_chunk if self.area_chunk else case.world_size * AREA_CHUNKS_PER_RANK
            return _area_layout(docs, bool(case.causal), case.world_size, chunks)
        if case.documents is None:
            return layouts.documents([case.seq_len], case.world_size)
        if len(set(case.documents.lengths)) > 1:
            raise ValueError(
                f"{self.name}: sharding=documents needs every sequence of the batch packed alike "
                f"(THD format packs the batch into one sequence: use batch 1)"
            )
        return layouts.documents(case.documents.lengths[0], case.world_size)

    def padded_len(self, case: Case) -> int:
        if self.sharding == "area":
            g = self._area_granule(case.world_size)
            return -(-case.seq_len // g) * g
        if self.by_documents:
            try:
                return self.document_layout(case).seq_len
            except ValueError:  # a batch packed unalike: `supports` gives the reason
                return case.seq_len
        return super().padded_len(case)

    def documents_for(self, q: torch.Tensor, comm: Comm, docs: Optional[Documents]) -> Optional[Documents]:
        """The documents to mask with: by-document and by-area sharding always mask (one document
        per sequence when none are packed), since their positions are not the zigzag's."""
        if docs is None and self.masks_every_block:
            return Documents.single(q.shape[0], q.shape[1] * comm.world_size)
        return docs


def cached_once(maxsize: Optional[int]):
    """`functools.lru_cache` whose value concurrent callers compute once: the ranks of a trace or of a
    threads run are threads that ask for the same plan at the same moment, and a bare lru_cache lets
    each of them build it (a dispatch plan 8 times over on 8 ranks). The first caller builds it while
    the others wait for it; different keys wait for each other too (the lock is per function), which
    costs nothing where each key is built once."""

    def wrap(fn):
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        lock = threading.RLock()

        @functools.wraps(fn)
        def once(*args):
            with lock:
                return cached(*args)

        once.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        once.cache_info = cached.cache_info  # type: ignore[attr-defined]
        return once

    return wrap


def chunk_areas(docs: Documents, causal: bool, chunks: int) -> list[int]:
    """The visible area (query-key pairs, summed over the batch) of each of `chunks` equal chunks of
    `docs`'s padded sequence: its queries against every key, counted from the mask's slices."""
    size = docs.padded_len // chunks
    keys = torch.arange(docs.padded_len)
    return [docs.block(torch.arange(c * size, (c + 1) * size), keys, causal).pairs for c in range(chunks)]


@cached_once(maxsize=64)
def _area_layout(docs: Documents, causal: bool, world_size: int, chunks: int) -> layouts.Layout:
    """The area layout of `docs` (cached: every attention call's block masks ask for it again)."""
    return layouts.area(docs.padded_len, world_size, chunk_areas(docs, causal, chunks))


def unseen_kv_bytes(case: Case, q_pos: torch.Tensor, k_pos: torch.Tensor, kv_heads: Optional[int] = None) -> int:
    """Bytes of K and V at global positions `k_pos` that no query at `q_pos` sees under `case`'s
    mask (documents, padding, mask family, causal flag), over the batch; `kv_heads` defaults to
    the case's (a rank holding some heads only gives its own)."""
    docs = case.documents or Documents.single(case.batch, case.seq_len)
    unseen = docs.unseen_keys(q_pos, k_pos, case.causal)
    return unseen * (kv_heads or case.kv_heads) * case.kv_dims * case.torch_dtype.itemsize


def element_bytes(case: Case) -> tuple[int, int]:
    """(bytes per input element, bytes per accumulator element) of `case`: accumulators (dK/dV
    rings, dQ, LSE) are float32, or float64 for float64 inputs."""
    return case.torch_dtype.itemsize, merge.acc_dtype(case.torch_dtype).itemsize


def option_names(cls: type[Method]) -> list[str]:
    """Keyword options accepted by a method class (for error messages)."""
    return list(_option_names(cls.__init__))


@functools.lru_cache(maxsize=None)
def _option_names(init: Callable[..., None]) -> tuple[str, ...]:
    # once per class (keyed by its __init__): the signature was read for every method built, a quarter of
    # planning the main sweep
    import inspect

    return tuple(p for p in inspect.signature(init).parameters if p != "self")


def case_from_dict(d: dict) -> Case:
    return Case(**{f.name: d[f.name] for f in fields(Case) if f.name in d})
