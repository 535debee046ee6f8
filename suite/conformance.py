"""Mutation conformance: proof that the float64 check catches each class of bug (docs/conformance.md).

A mutant is one small, deliberate break of a method or of the machinery the methods share (the
K/V ring's loop, the online-softmax merge, the block kernels, the layouts, the document masks),
made the way such a bug is made in real code: dropping the ring's last step, merging one block
without rescaling the accumulator, folding an attention sink once per rank, a window one key too
wide, query heads grouped onto the wrong KV heads, and so on (`MUTANTS`). `apply` patches the real
functions for the duration of a `with` block (module or class attributes, restored afterwards);
no source file is edited and nothing touches the check.

`run_conformance` runs, for every mutant, the trials of a small grid chosen so that its bug is
exercised (a window mask for the window mutant, sinks for the sink one, GQA for the grouping,
world sizes of 3 or 4, forward+backward for the gradient ones), through the threads executor and
the attention workload, i.e. exactly the path and the pass rule of a sweep's trial
(`records.check_columns`). Each trial first runs unmutated (the baseline, which must pass: else a
"catch" would mean nothing), then under each of its mutants. A mutant is caught when one of its
trials fails a check column (err_out, err_lse, err_dq, err_dk, err_dv, err_dsink) or fails to run
(a crash, which the table names as such). The float64 reference of a trial is computed during
its baseline run and kept by the executor's problem cache; while a mutant is applied computing
it is refused (`_reference_sealed`), so a mutant never reaches the reference it is judged by.

`python -m suite conformance` prints the table; every mutant must be caught.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from suite import metrics as M
from suite.plan import RunSettings, TrialSpec, single_node_trial

SETTINGS = RunSettings(warmup=1, repeats=1, check=True, check_max_seq_len=1 << 20, seed=0, breakdown=False)
TRIAL_TIMEOUT_S = 60.0


# ---------------------------------------------------------------------------------------------
# Patching: real functions replaced for the duration of a `with` block
# ---------------------------------------------------------------------------------------------
class Patches:
    """Attribute replacements on modules and classes, undone in reverse order."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        if name not in vars(owner):
            raise AttributeError(f"{owner!r} has no attribute {name!r} of its own to patch")
        self._undo.append((owner, name, vars(owner)[name]))
        setattr(owner, name, value)

    @property
    def targets(self) -> list[tuple[Any, str]]:
        return [(owner, name) for owner, name, _ in self._undo]

    def undo(self) -> None:
        while self._undo:
            owner, name, old = self._undo.pop()
            setattr(owner, name, old)


@dataclass(frozen=True)
class Point:
    """One trial of a mutant's grid (float32, B=2, head_dim 8; the sequence a few granules long)."""

    method: str
    world_size: int
    causal: bool = True  # the plain mask's flag; a `mask` family brings its own (Mask.causal)
    heads: int = 4
    kv_heads: int = 2
    pass_: str = "fwd_bwd"
    kernel: str = "auto"
    options: tuple[tuple[str, Any], ...] = ()
    mask: str = ""  # a mask family's name (methods/masks.py); "": plain, by `causal`
    sinks: bool = False
    softcap: float = 0.0
    documents: tuple[int, ...] = ()  # packed document lengths (every batch element alike); (): none
    seq_len: int = 0  # 0: three granules of the method's layout
    batch: int = 2

    def spec(self) -> TrialSpec:
        import methods
        from methods.base import Case
        from methods.masks import parse, plain

        options = dict(self.options)
        m = methods.get_method(self.method, kernel=self.kernel, **options)
        mask = parse(self.mask) if self.mask else plain(self.causal)  # a family decides its own flag
        case = Case(self.batch, 0, self.heads, self.kv_heads, 8, "float32", mask.causal, self.world_size)
        seq_len = self.seq_len or 3 * m.granule(case)
        case = Case(
            self.batch, seq_len, self.heads, self.kv_heads, 8, "float32", mask.causal, self.world_size,
            sinks=self.sinks, softcap=float(self.softcap),
        )  # fmt: skip
        return single_node_trial(
            self.method,
            m,
            case,
            pass_=self.pass_,
            kernel=self.kernel,
            options=options,
            executor="threads",
            hardware="cpu:conformance",
            workload=_documents_identity(self.documents, seq_len, self.batch),
            mask=mask.name,
        )


def _documents_identity(lengths: tuple[int, ...], seq_len: int, batch: int) -> str:
    """The `workload` column of packed documents of fixed lengths ("" for none), as a sweep's."""
    if not lengths:
        return ""
    from suite.lengths import Distribution, identity

    dist = Distribution.of("conformance", "fixed", {"min": 1, "max": 0, "lengths": list(lengths)})
    return identity(dist, seq_len, batch, 0)


@dataclass(frozen=True)
class Mutant:
    """A seeded bug: what it breaks, the trials that exercise it, and the patch that makes it."""

    name: str
    bug_class: str
    target: str  # the code it breaks: a method's, or the shared machinery's (module)
    description: str
    points: tuple[Point, ...]
    patch: Callable[[Patches, TrialSpec], None]

    @contextlib.contextmanager
    def apply(self, spec: TrialSpec) -> Iterator[Patches]:
        patches = Patches()
        try:
            self.patch(patches, spec)
            yield patches
        finally:
            patches.undo()


MUTANTS: list[Mutant] = []


def mutant(name: str, bug_class: str, target: str, points: tuple[Point, ...]):
    """Register the decorated patch function as a mutant (its docstring is the description)."""

    def register(fn: Callable[[Patches, TrialSpec], None]) -> Callable[[Patches, TrialSpec], None]:
        if any(m.name == name for m in MUTANTS):
            raise ValueError(f"mutant {name!r} registered twice")
        description = " ".join((fn.__doc__ or "").split())
        MUTANTS.append(Mutant(name, bug_class, target, description, points, fn))
        return fn

    return register


def mutant_names() -> list[str]:
    return [m.name for m in MUTANTS]


# ---------------------------------------------------------------------------------------------
# The mutants
# ---------------------------------------------------------------------------------------------
def _is_timed(kernel: Any) -> bool:
    """A kernel that times or counts (the workload's pair count, the breakdown): its call re-enters
    `block_forward`/`block_backward` with the inner kernel's name, where a kernel mutant applies, once."""
    from methods.kernels import TimedKernel

    return isinstance(kernel, TimedKernel)


@mutant(
    "ring_last_step_dropped",
    "missing block",
    "kv_ring.circulate",
    (Point("ring", 4, causal=False), Point("zigzag_ring", 3)),
)
def _ring_last_step_dropped(p: Patches, spec: TrialSpec) -> None:
    """The K/V ring's forward loop computes steps 0..P-2 only: the block that arrives last is passed
    on but never attended (an off-by-one in the step loop)."""
    from methods import kv_ring

    real = kv_ring.circulate

    def circulate(steps, block, *, move, compute, follow=None, add=None):
        if follow is None:  # the forward: no accumulator travels
            inner = compute

            def compute(step, blk):  # noqa: F811 - the mutated step
                return None if step == steps - 1 else inner(step, blk)

        return real(steps, block, move=move, compute=compute, follow=follow, add=add)

    p.set(kv_ring, "circulate", circulate)


@mutant(
    "merge_without_rescale",
    "online softmax",
    "accumulators.OutputAccumulator",
    (Point("ring", 4, causal=False), Point("tasp", 4, causal=False)),
)
def _merge_without_rescale(p: Patches, spec: TrialSpec) -> None:
    """One online-softmax merge per call adds the block's weighted output to the accumulator without
    rescaling what it held by e^(lse_old - lse_new) (the lse itself is updated right)."""
    from methods import accumulators

    real = accumulators.OutputAccumulator.add

    def add(self, rows, block_out, block_lse, last):
        if self.acc is not None and not getattr(self, "_mutated", False):
            self._mutated = True
            out, lse = self.acc
            new_lse = torch.logaddexp(lse[:, :, rows], block_lse)
            w = torch.exp(block_lse - new_lse).nan_to_num_(nan=0.0).transpose(1, 2).unsqueeze(-1)
            out[:, rows] += w * block_out.to(out.dtype)  # the old part keeps its old weight: no rescale
            lse[:, :, rows] = new_lse
            if last and rows == slice(None):
                self.result = (out.to(self.q.dtype), lse)
            return
        real(self, rows, block_out, block_lse, last)

    p.set(accumulators.OutputAccumulator, "add", add)


@mutant(
    "sink_once_per_rank",
    "attention sinks",
    "merge.fold_sink",
    (Point("ring", 3, sinks=True), Point("ulysses", 4, heads=4, kv_heads=4, sinks=True, pass_="fwd")),
)
def _sink_once_per_rank(p: Patches, spec: TrialSpec) -> None:
    """The sink's e^s_h joins every row's denominator once per rank (P times) instead of once, as
    when it is folded into each rank's or ring step's partial result rather than after the last
    merge."""
    from methods import merge

    real, ranks = merge.fold_sink, spec.world_size

    def fold_sink(out, lse, sinks):
        for _ in range(ranks):
            out, lse = real(out, lse, sinks)
        return out, lse

    p.set(merge, "fold_sink", fold_sink)


@mutant(
    "window_off_by_one",
    "mask family",
    "kernels (band blocks)",
    (Point("ring", 4, mask="sliding_window:5", seq_len=24),),
)
def _window_off_by_one(p: Patches, spec: TrialSpec) -> None:
    """A sliding-window block's lower edge is one key too far back (j >= i - w instead of
    j > i - w): every row sees w + 1 keys."""
    from methods import kernels
    from methods.documents import BAND

    fwd, bwd = kernels.block_forward, kernels.block_backward

    def widened(q, kw):
        mask = kw.get("mask")
        if mask is not None and mask.kind == BAND and not _is_timed(kw.get("kernel")):
            kw = dict(kw, mask=None, causal_offset=kernels._plain_offset(mask, q.shape[1]), lower=mask.lower - 1)
        return kw

    p.set(kernels, "block_forward", lambda q, k, v, **kw: fwd(q, k, v, **widened(q, kw)))
    p.set(kernels, "block_backward", lambda do, q, k, v, o, l, **kw: bwd(do, q, k, v, o, l, **widened(q, kw)))


@mutant(
    "gqa_heads_interleaved",
    "GQA grouping",
    "kernels._repeat_kv",
    (Point("ring", 3, heads=6, kv_heads=2, kernel="math"),),
)
def _gqa_heads_interleaved(p: Patches, spec: TrialSpec) -> None:
    """Query head h uses KV head h mod Hkv (tiled) instead of h // (H/Hkv) (grouped); dK/dV sum the
    same wrong groups back."""
    from methods import kernels

    def repeat_kv(x, heads):
        group = heads // x.shape[2]
        return x if group == 1 else x.repeat(1, 1, group, 1)

    def sum_kv_groups(dx, kv_heads):
        b, s, h, d = dx.shape
        return dx if h == kv_heads else dx.reshape(b, s, h // kv_heads, kv_heads, d).sum(dim=2)

    p.set(kernels, "_repeat_kv", repeat_kv)
    p.set(kernels, "_sum_kv_groups", sum_kv_groups)


@mutant(
    "ulysses_kv_replicas_misplaced",
    "GQA grouping",
    "ulysses_a2a.seq_to_heads",
    (Point("ulysses", 4, heads=4, kv_heads=2), Point("usp", 4, heads=4, kv_heads=2, options=(("ulysses_degree", 4),))),
)
def _ulysses_kv_replicas_misplaced(p: Patches, spec: TrialSpec) -> None:
    """Ulysses with fewer KV heads than ranks: each KV head is replicated before the all-to-all,
    but the replicas are laid out tiled (rank g gets KV head g mod Hkv) instead of grouped (g //
    rep), so query heads meet another group's keys."""
    from methods import ulysses_a2a

    real = ulysses_a2a.seq_to_heads

    def seq_to_heads(comm, x, rep=1, contiguous=True):
        if rep == 1:
            return real(comm, x, rep, contiguous)
        tiled = x.repeat(1, 1, rep, 1)  # [B, L, Hkv*rep, D], head g = KV head g mod Hkv
        return real(comm, tiled, 1, contiguous)

    p.set(ulysses_a2a, "seq_to_heads", seq_to_heads)


@mutant(
    "dkv_contribution_dropped",
    "gradient reduction",
    "kv_ring.circulate (add; and burst's)",
    (Point("ring", 3), Point("burst", 3)),
)
def _dkv_contribution_dropped(p: Patches, spec: TrialSpec) -> None:
    """At step 1 the visiting rank's gradient is not added to the travelling accumulator of the
    block it holds (dK/dV on the K/V ring, Burst's dQ): the accumulator is passed on as it arrived,
    one rank's contribution missing from the reduction."""
    from methods import burst, kv_ring

    real = kv_ring.circulate

    def circulate(steps, block, *, move, compute, follow=None, add=None):
        if add is not None:
            inner = add

            def add(step, acc, pending):  # noqa: F811 - the mutated reduction
                return inner(step, acc, [] if step == 1 and acc is not None else pending)

        return real(steps, block, move=move, compute=compute, follow=follow, add=add)

    for module in (kv_ring, burst):
        p.set(module, "circulate", circulate)


@mutant(
    "zigzag_chunks_swapped",
    "layout",
    "zigzag_ring.zigzag_plan (and burst's, usp's)",
    (Point("zigzag_ring", 3), Point("usp", 4, heads=4, kv_heads=2, options=(("ulysses_degree", 2),))),
)
def _zigzag_chunks_swapped(p: Patches, spec: TrialSpec) -> None:
    """The zigzag plan reads a rank's two chunks in the wrong order (its local rows as back chunk
    then front chunk, as when the halves of q are unpacked swapped): under the causal mask the
    wrong half of each block is computed."""
    from methods import burst, usp, zigzag_ring
    from methods.kv_ring import Block

    real = zigzag_ring.zigzag_plan

    def zigzag_plan(causal, rank, local_len):
        plan, half = real(causal, rank, local_len), local_len // 2
        halves = {(0, half): slice(half, local_len), (half, local_len): slice(0, half)}  # front <-> back

        def swap(rows: slice) -> slice:
            return halves.get((rows.start, rows.stop), rows)

        return lambda src: [Block(swap(b.q_rows), swap(b.k_rows), b.causal_offset) for b in plan(src)]

    for module in (zigzag_ring, burst, usp):
        p.set(module, "zigzag_plan", zigzag_plan)


@mutant(
    "stale_kv_buffer",
    "buffer reuse",
    "kv_ring.Route.start_move",
    (Point("ring", 4, causal=False), Point("usp", 4, heads=4, kv_heads=2, options=(("ulysses_degree", 1),))),
)
def _stale_kv_buffer(p: Patches, spec: TrialSpec) -> None:
    """At step 2 the ring computes with the K/V block it already used at step 1 (the receive buffer
    of the previous step reused, as when a wait is missed or the two buffers are swapped)."""
    from methods.kv_ring import Route

    real = Route.start_move

    def start_move(self, step, tensors):
        finish = real(self, step, tensors)
        if step != 1:
            return finish

        def stale():
            finish()  # the new block did arrive, into the buffer nobody reads
            return list(tensors)

        return stale

    p.set(Route, "start_move", start_move)


@mutant(
    "softcap_dropped",
    "score transform",
    "kernels.with_softcap",
    (Point("ring", 3, softcap=1.5), Point("ulysses", 4, heads=4, kv_heads=4, softcap=1.5)),
)
def _softcap_dropped(p: Patches, spec: TrialSpec) -> None:
    """The logit soft cap is lost on its way to the block kernels: scores run uncapped."""
    from methods import kernels

    p.set(kernels, "with_softcap", lambda scale, softcap: float(scale))


@mutant(
    "scale_applied_twice",
    "score transform",
    "kernels.with_softcap",
    (Point("ulysses", 4, heads=4, kv_heads=4), Point("token_ring", 3)),
)
def _scale_applied_twice(p: Patches, spec: TrialSpec) -> None:
    """The softmax scale is applied twice (queries pre-scaled, then scaled again by the kernel):
    scores are q.k scale^2."""
    from methods import kernels

    real = kernels.with_softcap
    p.set(kernels, "with_softcap", lambda scale, softcap: real(float(scale) * float(scale), softcap))


@mutant(
    "dq_rounded_to_bf16",
    "precision",
    "kv_ring.kv_ring_backward",
    (Point("ring", 3),),
)
def _dq_rounded_to_bf16(p: Patches, spec: TrialSpec) -> None:
    """dQ is rounded through bfloat16 in a float32 run (an accumulator or a message in the wrong
    dtype): about 3 significant digits lost."""
    from methods import kv_ring

    real = kv_ring.kv_ring_backward

    def kv_ring_backward(*args, **kw):
        dq, dk, dv = real(*args, **kw)
        return dq.to(torch.bfloat16).to(dq.dtype), dk, dv

    p.set(kv_ring, "kv_ring_backward", kv_ring_backward)


@mutant(
    "padding_sees_keys",
    "padding",
    "documents.BlockMasks",
    (Point("ring", 4, causal=False, seq_len=30), Point("zigzag_ring", 3, causal=False, seq_len=28)),
)
def _padding_sees_keys(p: Patches, spec: TrialSpec) -> None:
    """The tail padding is treated as part of the last document: real queries attend the padded
    (zero) keys and the padding's rows attend real keys."""
    from methods.documents import BlockMasks, Documents

    real = BlockMasks.__init__

    def init(self, docs, positions, causal):
        if docs.padding:
            pad = docs.padding
            lengths = tuple(ls[:-1] + (ls[-1] + pad,) for ls in docs.lengths)
            docs = Documents(lengths, docs.padded_len, docs.mask)
        real(self, docs, positions, causal)

    p.set(BlockMasks, "__init__", init)


@mutant(
    "causal_diagonal_strict",
    "causal mask",
    "ring.ring_plan",
    (Point("ring", 3),),
)
def _causal_diagonal_strict(p: Patches, spec: TrialSpec) -> None:
    """The ring's diagonal block uses a strict causal mask (j < i): no token sees itself."""
    from methods import ring
    from methods.kv_ring import Block

    real = ring.ring_plan

    def ring_plan(causal, rank):
        plan = real(causal, rank)
        return lambda src: [Block(b.q_rows, b.k_rows, -1) if b.causal_offset == 0 else b for b in plan(src)]

    p.set(ring, "ring_plan", ring_plan)


@mutant(
    "stripe_sees_a_future_key",
    "causal mask",
    "stripe_ring.stripe_plan",
    (Point("stripe_ring", 3),),
)
def _stripe_sees_a_future_key(p: Patches, spec: TrialSpec) -> None:
    """The striped ring's blocks from later ranks use the non-strict offset (j <= i instead of
    j <= i - 1): query r + iP sees key src + iP, a later token, on every such block."""
    from methods import stripe_ring
    from methods.kv_ring import ALL, Block

    real = stripe_ring.stripe_plan

    def stripe_plan(causal, rank):
        return real(causal, rank) if not causal else (lambda src: [Block(ALL, ALL, 0)])

    p.set(stripe_ring, "stripe_plan", stripe_plan)


@mutant(
    "lse_in_base_2",
    "LSE convention",
    "kernels.block_forward",
    (Point("ulysses", 4, heads=4, kv_heads=4), Point("allgather_kv", 3), Point("dispatch", 3)),
)
def _lse_in_base_2(p: Patches, spec: TrialSpec) -> None:
    """The block kernel returns its log-sum-exp in base 2 (as Triton kernels keep it internally)
    and everything after it reads it as natural: merges, the backward and the returned LSE."""
    from methods import kernels

    real = kernels.block_forward

    def block_forward(q, k, v, **kw):
        out, lse = real(q, k, v, **kw)
        return out, lse if _is_timed(kw.get("kernel")) else lse * (1.0 / math.log(2.0))

    p.set(kernels, "block_forward", block_forward)


@mutant(
    "backward_with_block_lse",
    "backward",
    "kernels.block_backward",
    (Point("ring", 3, causal=False), Point("tasp", 4, causal=False)),
)
def _backward_with_block_lse(p: Patches, spec: TrialSpec) -> None:
    """A block's backward uses the block's own out and lse (recomputed locally) instead of the
    rows' global out and lse saved by the forward: each block's probabilities are normalised over
    that block alone."""
    from methods import kernels

    real_fwd, real = kernels.block_forward, kernels.block_backward

    def block_backward(dout, q, k, v, out, lse, **kw):
        if _is_timed(kw.get("kernel")):
            return real(dout, q, k, v, out, lse, **kw)
        fkw = {n: kw[n] for n in ("scale", "causal_offset", "kernel", "mask", "lower") if n in kw}
        block_out, block_lse = real_fwd(q, k, v, **fkw)
        kw = dict(kw, delta=None)
        return real(dout, q, k, v, block_out, block_lse, **kw)

    p.set(kernels, "block_backward", block_backward)


@mutant(
    "document_boundary_ignored_one_step",
    "packed documents",
    "kv_ring (block masks)",
    (Point("ring", 3, documents=(5, 9, 4, 7, 11)),),
)
def _document_boundary_ignored_one_step(p: Patches, spec: TrialSpec) -> None:
    """At the ring step that brings the previous rank's K/V, the block runs with the plan's plain
    causal mask instead of the documents' mask: queries see the tail of the document before theirs."""
    from methods import kv_ring

    def skip_one(masks):
        if masks is None:
            return None
        world = spec.world_size

        def masked(q_rank, q_rows, k_rank, k_rows):
            return None if k_rank == (q_rank - 1) % world else masks(q_rank, q_rows, k_rank, k_rows)

        return masked

    fwd, bwd = kv_ring.kv_ring_forward, kv_ring.kv_ring_backward
    p.set(kv_ring, "kv_ring_forward", lambda *a, masks=None, **kw: fwd(*a, masks=skip_one(masks), **kw))
    p.set(kv_ring, "kv_ring_backward", lambda *a, masks=None, **kw: bwd(*a, masks=skip_one(masks), **kw))


@mutant(
    "allgather_back_chunks_unreversed",
    "layout",
    "allgather_kv._Zigzag",
    (Point("allgather_kv", 3),),
)
def _allgather_back_chunks_unreversed(p: Patches, spec: TrialSpec) -> None:
    """After the all-gather the back chunks are put in rank order, forgetting that the zigzag layout
    gives rank r chunk 2P-1-r: the causal calls read the late keys in the wrong order."""
    from methods import allgather_kv

    cls = allgather_kv._Zigzag
    real = cls.__init__

    def init(self, comm, causal, x):
        real(self, comm, causal, x)
        self.reverse = torch.arange(self.p, device=x.device)

    p.set(cls, "__init__", init)


@mutant(
    "accumulator_hop_home_dropped",
    "gradient reduction",
    "kv_ring.circulate (and burst's, tasp's)",
    (Point("ring", 3), Point("burst", 3), Point("tasp", 4)),
)
def _accumulator_hop_home_dropped(p: Patches, spec: TrialSpec) -> None:
    """After the last step the travelling accumulators' hop home is waited for but its result
    unused: each rank keeps the gradient of the block it held last instead of its own."""
    from methods import burst, kv_ring, tasp

    real = kv_ring.circulate

    def circulate(steps, block, *, move, compute, follow=None, add=None):
        if follow is None:
            return real(steps, block, move=move, compute=compute)
        kept = []

        def follow_keep(step, acc):
            if step == steps - 1:
                kept.append(acc)
            return follow(step, acc)

        home = real(steps, block, move=move, compute=compute, follow=follow_keep, add=add)
        return kept[0] if kept else home

    for module in (kv_ring, burst, tasp):
        p.set(module, "circulate", circulate)


@mutant(
    "token_ring_results_misrouted",
    "routing",
    "token_ring.result_peers",
    (Point("token_ring", 4, causal=False),),
)
def _token_ring_results_misrouted(p: Patches, spec: TrialSpec) -> None:
    """TokenRing's partial results of the middle steps go one rank too far back (to rank - t
    instead of rank - (t - 1), received from rank + t): ranks fold other ranks' queries' results
    into their own, and some results never reach their owner."""
    from methods import token_ring

    real = token_ring.result_peers

    def result_peers(rank, world_size, step):
        if not 2 <= step < world_size:
            return real(rank, world_size, step)
        return (rank - step) % world_size, (rank + step) % world_size

    p.set(token_ring, "result_peers", result_peers)


# ---------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------
@dataclass
class Verdict:
    """What the check said of one trial: the columns that failed, or the crash."""

    label: str
    failed: list[str] = field(default_factory=list)  # check columns over their bound (err_out, ...)
    crash: str = ""  # "Type: message" when the trial did not run to its check
    ratio: float = 0.0  # the largest error / tolerance of the trial's checked tensors (> 1: failed)

    @property
    def caught(self) -> bool:
        return bool(self.failed or self.crash)

    def caught_by(self) -> list[str]:
        return list(self.failed) + ([f"crash ({self.crash.split(':')[0]})"] if self.crash else [])


@dataclass
class MutantResult:
    mutant: Mutant
    trials: list[Verdict]

    @property
    def caught(self) -> bool:
        return any(t.caught for t in self.trials)

    def caught_by(self) -> list[str]:
        """The check columns that failed in any trial (in the columns' order), then any crash."""
        found = {c for t in self.trials for c in t.caught_by()}
        columns = [c for c in M.ERR.values() if c in found]
        return columns + sorted(found - set(columns))

    @property
    def ratio(self) -> float:
        """How far the clearest catch went past its bound: the largest error / tolerance of a trial."""
        return max((t.ratio for t in self.trials), default=0.0)

    def row(self) -> dict[str, Any]:
        return {
            "mutant": self.mutant.name,
            "bug_class": self.mutant.bug_class,
            "target": self.mutant.target,
            "trials": len(self.trials),
            "caught_by": self.caught_by(),
            "status": "caught" if self.caught else "MISSED",
            "err_over_tol": self.ratio,
            "per_trial": {t.label: {"caught_by": t.caught_by(), "err_over_tol": t.ratio} for t in self.trials},
            "description": self.mutant.description,
        }


@dataclass
class Conformance:
    results: list[MutantResult]
    baseline: list[Verdict]  # one per distinct trial: must all pass
    seconds: float

    @property
    def caught(self) -> int:
        return sum(r.caught for r in self.results)

    @property
    def baseline_ok(self) -> bool:
        return not any(v.caught for v in self.baseline)

    @property
    def ok(self) -> bool:
        return self.baseline_ok and self.caught == len(self.results) and bool(self.results)


def verdict(spec: TrialSpec, outcome) -> Verdict:
    """The check's verdict on one executed trial (`records.check_columns`, the sweep's pass rule)."""
    from suite.records import check_columns

    v = Verdict(spec.label())
    if outcome.kind != "reported":
        reports = outcome.reports or []
        v.crash = (reports[0].error if reports and reports[0] and reports[0].error else outcome.message) or outcome.kind
        return v
    cols, _ = check_columns(outcome.reports)
    for name, column in M.ERR.items():
        if column not in cols:
            continue
        err, tol = cols[column], cols[M.TOL[name]]
        if not err <= tol:  # NaN fails too
            v.failed.append(column)
        v.ratio = max(v.ratio, err / tol if tol > 0 else math.inf) if not math.isnan(err) else math.inf
    if not cols.get(M.CHECKED):
        v.crash = "unchecked: the trial was not compared with the float64 reference"
    return v


def select(names: Optional[list[str]] = None, method_names: Optional[list[str]] = None) -> list[Mutant]:
    """The mutants named (all by default), each keeping the points of the methods named (all by
    default); a mutant left without points is dropped. Unknown names raise, listing the known."""
    chosen = list(MUTANTS)
    if names:
        unknown = [n for n in names if n not in mutant_names()]
        if unknown:
            raise ValueError(f"unknown mutant(s) {unknown}; choose from {mutant_names()}")
        chosen = [m for m in MUTANTS if m.name in names]
    if method_names:
        import methods

        unknown = [n for n in method_names if n not in methods.available()]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; choose from {methods.available()}")
        chosen = [
            Mutant(m.name, m.bug_class, m.target, m.description, pts, m.patch)
            for m in chosen
            if (pts := tuple(pt for pt in m.points if pt.method in method_names))
        ]
    return chosen


@contextlib.contextmanager
def _reference_sealed(m: Mutant) -> Iterator[list[str]]:
    """While a mutant is applied the float64 reference must not be computed: it comes from the
    trial's unmutated run, kept by the executor's problem cache (same problem, same positions), so
    no mutant can reach the code that judges it. A computation attempted here fails the trial and
    is reported (the yielded list is not empty), and the runner stops: a mutant that changes the
    positions a trial checks, or the problem, is a mistake in the mutant."""
    from suite.reference import ProblemReference

    reached: list[str] = []
    seal = Patches()

    def sealed(name: str):
        def refuse(self, *args, **kw):
            reached.append(name)
            raise RuntimeError(f"conformance: {m.name} reached ProblemReference.{name}")

        return refuse

    for name in ("_row_stats", "_shard"):
        seal.set(ProblemReference, name, sealed(name))
    try:
        yield reached
    finally:
        seal.undo()


def run_conformance(
    mutants: Optional[list[Mutant]] = None, say: Callable[[str], None] = lambda line: None
) -> Conformance:
    """Run every mutant's trials (each distinct trial once unmutated first) on virtual ranks."""
    from suite.executors.threads import ThreadExecutor

    mutants = list(MUTANTS) if mutants is None else mutants
    t0 = time.perf_counter()
    specs: dict[Point, TrialSpec] = {}
    for m in mutants:
        for pt in m.points:
            specs.setdefault(pt, pt.spec())
    by_mutant: dict[str, list[Verdict]] = {m.name: [] for m in mutants}
    baseline = []
    # One executor, so that its problem cache keeps each trial's float64 reference from the
    # baseline run to the mutated runs that follow it.
    executor = ThreadExecutor(
        device="cpu",
        run=SETTINGS,
        timeout_s=TRIAL_TIMEOUT_S,
        prepare_timeout_s=TRIAL_TIMEOUT_S,
        hardware="cpu:conformance",
    )
    try:
        for pt, spec in specs.items():
            base = verdict(spec, executor.run(spec))
            baseline.append(base)
            say(f"baseline {spec.label()}: {'FAILS ' + ', '.join(base.caught_by()) if base.caught else 'passes'}")
            for m in mutants:
                if pt not in m.points:
                    continue
                with m.apply(spec), _reference_sealed(m) as reached:
                    v = verdict(spec, executor.run(spec))
                if reached:
                    raise RuntimeError(
                        f"mutant {m.name} made {spec.label()} compute its float64 reference: the reference "
                        "must come from the unmutated run (a mutant may not change what the check is given)"
                    )
                by_mutant[m.name].append(v)
                say(f"  {m.name}: {', '.join(v.caught_by()) or 'not caught'}")
    finally:
        executor.close()
    results = [MutantResult(m, by_mutant[m.name]) for m in mutants]
    return Conformance(results, baseline, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# The table and the command
# ---------------------------------------------------------------------------------------------
HEADER = ("mutant", "bug class", "target", "trials", "caught by", "err/tol", "status")


def table_rows(report: Conformance) -> list[tuple[str, ...]]:
    return [
        (
            r.mutant.name,
            r.mutant.bug_class,
            r.mutant.target,
            str(len(r.trials)),
            ", ".join(r.caught_by()) or "-",
            f"{r.ratio:.3g}",
            "caught" if r.caught else "MISSED",
        )
        for r in report.results
    ]


def summary_line(report: Conformance) -> str:
    n = len(report.results)
    pct = 100.0 * report.caught / n if n else 0.0
    base = "baseline clean" if report.baseline_ok else "BASELINE FAILS"
    worst = max((v.ratio for v in report.baseline), default=0.0)
    return (
        f"caught {report.caught}/{n} ({pct:.0f} %); {base} ({len(report.baseline)} trials, largest "
        f"err/tol {worst:.3g}); {report.seconds:.1f} s"
    )


def format_text(report: Conformance) -> str:
    rows = [HEADER] + table_rows(report)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    bad = [v for v in report.baseline if v.caught]
    lines += [f"baseline FAILS: {v.label}: {', '.join(v.caught_by())}" for v in bad]
    return "\n".join(lines + [summary_line(report)])


def format_markdown(report: Conformance) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(report)]
    return "\n".join(lines + ["", summary_line(report), ""])


def write(report: Conformance, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    md, jl = out / "conformance.md", out / "conformance.jsonl"
    md.write_text(format_markdown(report))
    with jl.open("w") as f:
        for r in report.results:
            f.write(json.dumps(r.row(), sort_keys=True) + "\n")
        for v in report.baseline:
            row = {"baseline": v.label, "caught_by": v.caught_by(), "err_over_tol": v.ratio}
            f.write(json.dumps(row, sort_keys=True) + "\n")
    return [md, jl]


def run_command(args: argparse.Namespace) -> int:
    """`python -m suite conformance`: 0 when every mutant is caught and the baseline is clean."""
    if args.list:
        for m in MUTANTS:
            print(f"{m.name} [{m.bug_class}; {m.target}]: {m.description}")
        return 0
    split = lambda text: [w.strip() for w in text.split(",") if w.strip()]  # noqa: E731
    try:
        chosen = select(split(args.mutants), split(args.methods))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not chosen:
        print("error: no mutant has a trial of the methods named", file=sys.stderr)
        return 2
    report = run_conformance(
        chosen, say=(lambda line: print(line, flush=True)) if args.verbose else (lambda line: None)
    )
    print(format_text(report))
    if args.out:
        for path in write(report, Path(args.out)):
            print(f"wrote {path}")
    return 0 if report.ok else 1
