"""The K/V ring shared by Ring Attention, zigzag ring, striped ring and USP's inner ring.

These methods differ only in *which* (query rows, key rows) of the K/V block a rank holds at a
step it must compute, and with which causal mask. Each method gives a `plan(src)`: for the K/V
block that came from ring rank `src`, the list of `Block`s to compute (empty to skip the step).
The loop, the double buffering, the merge and the dK/dV accumulator ring live here, once.

Forward, P steps: at step s rank r holds the K/V block of src = (r - s) mod P. It starts passing
that block to r+1 (receiving the next from r-1) *before* computing with it, so the transfer
overlaps the block's attention; block results are folded into fp32 accumulators (online softmax).
(A `Route` generalises "r+1": the two-level ring for ranks spanning nodes is one.)

Backward, P steps over the same ring: each block's dK/dV accumulator travels *with* it. At step
s rank r computes its contribution to the block it holds, then adds it to the accumulator of that
block, which arrives from r-1 (sent one step earlier, so that transfer overlapped this step's
compute), and sends the sum on. After the last step one more hop brings each accumulator home.
Block backwards use the global out and lse saved by the forward, so block gradients are exact.
dQ and the dK/dV accumulators are fp32 (float64 for float64 inputs). An accumulator makes its
first hop in the input dtype (it holds only the owner's gradient, which the kernel produced in
that dtype: fp32 would add no information) and its last hop home in the input dtype too (the
owner returns that dtype; the cast is fused into the last addition), fp32 in between
(`accumulators.follow_add`): exactly the sums of an all-fp32 accumulator, fewer bytes.

Early stop (local masks): under a mask family (a sliding window, chunks) a rank's queries see
only the blocks of a few ranks before it, yet the full ring passes every block to every rank. Every
rank computes from the layout the last step at which *any* rank holds a block with a visible pair
(`useful_steps`: the block masks of all ranks, so all ranks agree without a message) and the ring
circulates only N <= P steps: a window of w tokens at local length L needs about w / L + 1. In the
backward the dK/dV accumulators follow their blocks for those N steps and then go home in one
direct message (`Route.start_home`) instead of travelling on round the ring. Without a mask family
(no documents, or packed documents with the plain causal or full mask) N = P: nothing changes.

Communication per rank and call (L local tokens, e bytes per input element, a bytes per
accumulator element: 4, or 8 for float64; N steps, P unless the ring stops early; D + Dv, the key's
and the value's head dims, is 2*D but under MLA):
    forward:  (N-1) * B*L*Hkv*(D+Dv)*e            (K and V, N-1 hops)
    backward: (N-1) * B*L*Hkv*(D+Dv)*e + 2 * B*L*Hkv*(D+Dv)*e + (N-2) * B*L*Hkv*(D+Dv)*a
              (K, V again; dK, dV accumulators, N hops: the first and the last in the input dtype)
sent and received alike (N >= 2; nothing at N = 1). Memory beyond inputs and outputs: two K/V blocks in flight, the fp32
out/lse accumulators; backward: the fp32 dQ and two dK/dV accumulators.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from methods import accumulators, kernels, merge
from methods.base import Case, Method, element_bytes, unseen_kv_bytes
from methods.comm.base import P2P, Comm
from methods.documents import EMPTY, BlockMasks

ALL = slice(None)


# ---------------------------------------------------------------------------------------------
# Routes: where the circulating block is at each step
# ---------------------------------------------------------------------------------------------
class Route:
    """How a circulating block (K/V, or BurstAttention's query packet) visits every rank.

    P steps; at step t this rank holds the block owned by `src(t)`. `start_move(t, tensors)`
    begins passing the block held at step t on and returns `finish()`, which returns the block
    for step t+1. `start_follow(t, tensors)` sends accumulators (e.g. dK/dV) of the block held at
    step t to the rank that holds it at step t+1, and returns `finish()` giving the accumulators
    of the block held at t+1; after the last step it delivers each accumulator to the block's
    owner (one extra hop). Every rank calls the same sequence of steps. A route receives into its
    own buffers, allocated once per circulating set and reused (`DoubleBuffer`), so one route
    serves one call.
    """

    def __init__(self, comm: Comm):
        self.comm = comm
        self.p, self.rank = comm.world_size, comm.rank
        self._moved, self._followed = DoubleBuffer(), DoubleBuffer()

    def src(self, step: int) -> int:
        return self.src_of(self.rank, step)

    def src_of(self, rank: int, step: int) -> int:
        """Whose block rank `rank` holds at `step` (every rank knows every rank's schedule)."""
        raise NotImplementedError

    def next_holder(self, step: int) -> int:
        """Who holds, at step+1, the block this rank holds at `step` (the owner after the last)."""
        raise NotImplementedError

    def prev_holder(self, step: int) -> int:
        """Who held, at step-1, the block this rank holds at `step`."""
        raise NotImplementedError

    def start_move(self, step: int, tensors: Sequence[torch.Tensor]):
        return self._swap(tensors, self.next_holder(step), self.prev_holder(step + 1), into=self._moved(step, tensors))

    def start_follow(self, step: int, tensors: Sequence[torch.Tensor]):
        return self._swap(
            tensors, self.next_holder(step), self.prev_holder(step + 1), into=self._followed(step, tensors)
        )

    def start_home(self, step: int, tensors: Sequence[torch.Tensor]):
        """Send the accumulators of the block held at `step` straight to its owner, and receive
        those of this rank's own block from whoever holds it at `step`: the hop home of a
        circulation cut short (`useful_steps`), one message over the remaining distance."""
        holder = next(r for r in range(self.p) if self.src_of(r, step) == self.rank)
        return self._swap(tensors, self.src(step), holder, into=self._followed(step, tensors))

    def _swap(self, tensors, to: int, frm: int, comm: Optional[Comm] = None, into=None):
        """Send `tensors` to `to`, receive same-shaped ones from `frm` (ranks of `comm`, default the
        route's comm) into `into` (fresh buffers if None); return finish()."""
        comm = comm or self.comm
        recv = list(into) if into is not None else [torch.empty_like(t) for t in tensors]
        work = comm.exchange([P2P("send", t, to) for t in tensors] + [P2P("recv", t, frm) for t in recv])

        def finish() -> list[torch.Tensor]:
            work.wait()
            return recv

        return finish


class RingRoute(Route):
    """The plain ring: the block held at step t came from rank - t; blocks move to rank + 1."""

    def src_of(self, rank: int, step: int) -> int:
        return (rank - step) % self.p

    def next_holder(self, step: int) -> int:
        return (self.rank + 1) % self.p

    def prev_holder(self, step: int) -> int:
        return (self.rank - 1) % self.p


class TwoLevelRoute(Route):
    """The topology-aware two-level ring (BurstAttention's code, LoongTrain's double ring).

    Ranks are `nodes` x `per_node` (global rank = node * per_node + local). Step t is position
    i = t % per_node of cycle k = t // per_node; the rank holds the block of (node - k, local - t).
    Within a cycle blocks move on the intra-node ring (local + 1). At the start of a cycle the
    block just received is also sent to the same local rank of the next node, so that inter-node
    transfer runs behind per_node - 1 intra-node steps and every GPU uses its own NIC; at the end
    of the cycle it replaces the intra-node hop. Bytes equal the plain ring's (P - 1 hops in all),
    but only nodes - 1 of them cross nodes, each hidden behind a cycle of compute.
    Accumulators follow the block's visiting order: local + 1 within a cycle, then (node + 1,
    local + 1) into the next cycle.

    Intra-node and inter-node hops use their own sub-communicators (ranks of one node; ranks with
    the same local index): on NCCL one communicator runs its operations in order on one stream, so
    sharing one would make every intra-node step wait for the inter-node transfer.
    """

    def __init__(self, comm: Comm, per_node: int):
        super().__init__(comm)
        if per_node < 1 or self.p % per_node != 0:
            raise ValueError(f"two-level ring needs ranks_per_node dividing world_size: {per_node} vs {self.p}")
        self.per_node, self.nodes = per_node, self.p // per_node
        self.node, self.local = divmod(self.rank, per_node)
        self._inter: Optional[Callable[[], list[torch.Tensor]]] = None
        # collective: every rank builds the same route (cached by split)
        self.intra_comm = comm.split([[n * per_node + i for i in range(per_node)] for n in range(self.nodes)])
        self.inter_comm = comm.split([[n * per_node + i for n in range(self.nodes)] for i in range(per_node)])

    def _g(self, node: int, local: int) -> int:
        return (node % self.nodes) * self.per_node + local % self.per_node

    def src_of(self, rank: int, step: int) -> int:
        node, local = divmod(rank, self.per_node)
        return self._g(node - step // self.per_node, local - step)

    def next_holder(self, step: int) -> int:
        if step % self.per_node < self.per_node - 1:
            return self._g(self.node, self.local + 1)
        return self._g(self.node + 1, self.local + 1)

    def prev_holder(self, step: int) -> int:
        if step % self.per_node > 0:
            return self._g(self.node, self.local - 1)
        return self._g(self.node - 1, self.local - 1)

    def start_move(self, step: int, tensors: Sequence[torch.Tensor]):
        # fresh receive buffers, not the route's two: the inter-node block is received a whole cycle before it is used,
        # while the intra-node ones come and go, so two alternating buffers do not cover it
        i, k = step % self.per_node, step // self.per_node
        if i == 0 and k < self.nodes - 1:
            # the cycle's block goes on to the next node now, behind this cycle's intra steps
            # (inter_comm ranks are node indices)
            self._inter = self._swap(
                tensors, (self.node + 1) % self.nodes, (self.node - 1) % self.nodes, self.inter_comm
            )
        if i < self.per_node - 1:  # intra_comm ranks are local indices
            return self._swap(
                tensors, (self.local + 1) % self.per_node, (self.local - 1) % self.per_node, self.intra_comm
            )
        inter, self._inter = self._inter, None
        return inter


def make_route(comm: Comm, ranks_per_node: int = 0) -> Route:
    """A plain ring, or the two-level ring when ranks span several nodes of `ranks_per_node`."""
    if 0 < ranks_per_node < comm.world_size:
        return TwoLevelRoute(comm, ranks_per_node)
    return RingRoute(comm)


class DoubleBuffer:
    """Receive buffers of a circulating block (or accumulator), allocated once and reused: what
    arrives at step t lands in set t % 2, while the set being sent is the other one (or the
    caller's own tensors at step 0). Every exchange is waited for before the next one starts, so a
    set is free again when its turn comes."""

    def __init__(self) -> None:
        self._sets: dict[tuple, list[torch.Tensor]] = {}

    def __call__(self, step: int, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # keyed by shape and dtype too: an accumulator's first and last hops carry the input dtype,
        # the others fp32 (accumulators.follow_add)
        key = (step % 2, *((tuple(t.shape), t.dtype) for t in like))
        if key not in self._sets:
            self._sets[key] = [torch.empty_like(t) for t in like]
        return self._sets[key]


@dataclass(frozen=True)
class Block:
    """Compute local queries q[:, q_rows] against keys k[:, k_rows] of the held K/V block."""

    q_rows: slice
    k_rows: slice
    causal_offset: Optional[int]  # None: full; c: query i sees key j iff j <= i + c (within the slices)


Plan = Callable[[int], list[Block]]


def full_plan(src: int) -> list[Block]:
    """No mask: every query sees the whole block, at every step."""
    return [Block(ALL, ALL, None)]


def useful_steps(
    p: int,
    src_of: Callable[[int, int], int],
    plan_of: Callable[[int], Plan],
    masks: Optional[BlockMasks],
    queries_travel: bool = False,
) -> int:
    """How many steps a circulation of `p` steps needs: one past the last step at which some rank
    holds a block with a visible pair (`src_of(rank, step)`: whose block; `plan_of(rank)`: the
    blocks that rank computes of it, refined by `masks`). Every rank computes the same number from
    the layout alone, so they agree without a message. Only a mask family (methods/masks.py) cuts
    the ring short: without one (no documents, or packed documents with the plain mask) it is
    always `p`, so the plain schedule and bytes never change. `queries_travel`: the circulating
    block holds queries (BurstAttention's backward): a plan's block is the visiting queries' rows
    against this rank's keys."""
    if masks is None or masks.docs.mask is None or p <= 1:
        return p
    last = 0
    for rank in range(p):
        plan = plan_of(rank)
        for step in range(p - 1, last, -1):
            src = src_of(rank, step)
            qr, kr = (src, rank) if queries_travel else (rank, src)
            if any(masks(qr, b.q_rows, kr, b.k_rows).kind != EMPTY for b in plan(src)):
                last = step
                break
        if last == p - 1:
            break
    return last + 1


def circulate(
    steps: int,
    block: list[torch.Tensor],
    *,
    move: Callable,
    compute: Callable,
    follow: Optional[Callable] = None,
    add: Optional[Callable] = None,
):
    """The loop every circulating method runs, written once (kv_ring, burst, tasp).

    At step t this rank holds `block` (at step 0 its own: K/V, or BurstAttention's query packet).
    `move(step, block)` starts passing it on (and receiving the next) *before* the step computes,
    so that the transfer overlaps the step's kernels, and returns finish() giving the block of
    step + 1. `compute(step, block)` runs the step's kernels and returns this rank's contributions
    to the held block's accumulator (e.g. its dK/dV); with `follow`, the accumulator travels one
    step behind its block: `add(step, acc, pending)` adds them to the accumulator that arrived from
    the block's previous holder (acc None at step 0: this rank's own block starts it) and returns
    it, and `follow(step, acc)` sends it to the block's next holder, returning finish(); after the
    last step that hop brings every accumulator home. Returns the own block's accumulator (None
    without `follow`).
    """
    if (follow is None) != (add is None):
        raise ValueError("circulate: follow and add go together")
    acc = None
    finish_acc: Optional[Callable] = None  # set by each step's follow, for the next step (or home)
    for step in range(steps):
        if step + 1 < steps:
            finish_block = move(step, block)
        pending = compute(step, block)
        if follow is not None and add is not None:
            acc = add(step, None if finish_acc is None else finish_acc(), pending)
            pending = finish_acc = None
            if steps > 1:
                finish_acc = follow(step, acc)
        if step + 1 < steps:
            # drop the finished exchange, which holds the block just sent: it is freed now, not
            # when the next step's exchange replaces it (after that step's buffers exist)
            block, finish_block = finish_block(), None
    if finish_acc is not None:
        acc = finish_acc()  # the last hop brings our own block's accumulator home
    return acc


def kv_ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    comm: Comm,
    plan: Plan,
    scale: float,
    kernel: kernels.KernelChoice,
    route: Optional[Route] = None,
    masks: Optional[BlockMasks] = None,
    steps: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of local q [B, L, H, D] against the K/V [B, L, Hkv, D] of every ring rank.

    Returns out [B, L, H, D] in q.dtype and lse [B, H, L] (fp32; float64 for float64 inputs).
    `route` defaults to the plain ring over `comm`. `masks`: packed documents' masks by ranks of
    `comm` (they refine the plan's causal blocks, which stay a superset of what is visible).
    `steps`: how many steps to circulate (`useful_steps`; default all P): blocks beyond them have
    no visible pair on any rank.
    """
    route = route or RingRoute(comm)
    p = steps or comm.world_size
    acc = accumulators.OutputAccumulator(q, v.shape[-1])

    def compute(step, block):
        cur_k, cur_v = block
        src = route.src(step)
        blocks = plan(src)
        for i, blk in enumerate(blocks):
            block_out, block_lse = kernels.block_forward(
                q[:, blk.q_rows],
                cur_k[:, blk.k_rows],
                cur_v[:, blk.k_rows],
                scale=scale,
                causal_offset=blk.causal_offset,
                kernel=kernel,
                mask=masks(comm.rank, blk.q_rows, src, blk.k_rows) if masks else None,
            )
            acc.add(blk.q_rows, block_out, block_lse, last=step == p - 1 and i == len(blocks) - 1)

    circulate(p, [k, v], move=route.start_move, compute=compute)
    return acc.finish()


def kv_ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    comm: Comm,
    plan: Plan,
    scale: float,
    kernel: kernels.KernelChoice,
    route: Optional[Route] = None,
    masks: Optional[BlockMasks] = None,
    steps: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `kv_ring_forward` (same plan, route and steps), given the forward's global out
    and lse. The dK/dV accumulator of each K/V block follows it around the ring (`circulate`); a
    circulation cut short (`steps` < P) sends each accumulator home directly after its last step."""
    route = route or RingRoute(comm)
    p = steps or comm.world_size
    dq = accumulators.GradAccumulator(q)

    def compute(step, block):
        cur_k, cur_v = block
        pending = []  # this rank's dK/dV contributions, added once the accumulator has arrived
        src = route.src(step)
        blocks = plan(src)
        for i, blk in enumerate(blocks):
            bdq, bdk, bdv = kernels.block_backward(
                dout[:, blk.q_rows],
                q[:, blk.q_rows],
                cur_k[:, blk.k_rows],
                cur_v[:, blk.k_rows],
                out[:, blk.q_rows],
                lse[:, :, blk.q_rows],
                scale=scale,
                causal_offset=blk.causal_offset,
                kernel=kernel,
                mask=masks(comm.rank, blk.q_rows, src, blk.k_rows) if masks else None,
            )
            dq.add(blk.q_rows, bdq, last=step == p - 1 and i == len(blocks) - 1)
            pending.append((blk.k_rows, bdk, bdv))
        return pending

    def add(step, dkv, pending):  # first hop and the hop home in the input dtype, fp32 between
        last = step == p - 1
        return [
            accumulators.follow_add(
                None if dkv is None else dkv[0], [(rows, g) for rows, g, _ in pending], k, last_hop=last
            ),
            accumulators.follow_add(
                None if dkv is None else dkv[1], [(rows, g) for rows, _, g in pending], v, last_hop=last
            ),
        ]

    def follow(step, dkv):
        if step == p - 1 and p < comm.world_size:
            return route.start_home(step, dkv)
        return route.start_follow(step, dkv)

    dk, dv = circulate(p, [k, v], move=route.start_move, compute=compute, add=add, follow=follow)
    return dq.finish(), dk, dv


def kv_ring_bytes(
    case: Case,
    pass_: str,
    ring_size: Optional[int] = None,
    kv_heads: Optional[int] = None,
    local_len: Optional[int] = None,
    input_dtype_ends: bool = True,
    steps: Optional[int] = None,
) -> tuple[int, int]:
    """Bytes one rank sends (and receives) on the K/V ring (the formula of this module's docstring):
    K, V on P-1 hops; the backward again, plus the dK/dV accumulators on P hops. `ring_size`,
    `kv_heads` and `local_len` default to the case's world size, KV heads and S/P (USP's inner
    ring differs). `input_dtype_ends`: the accumulators' first and last hops carry the input dtype
    (`accumulators.follow_add`); TASP's carry fp32 on every hop. `steps`: a circulation cut short
    (`useful_steps`): K/V on steps-1 hops, the accumulators on `steps` (the last one straight home)."""
    p = steps or ring_size or case.world_size
    hkv = kv_heads or case.kv_heads
    l = local_len or case.seq_len // case.world_size
    e, a = element_bytes(case)
    kv = case.batch * l * hkv * case.kv_dims  # K and V (their head dims differ under MLA)
    n = (p - 1) * kv * e
    if pass_ == "fwd_bwd":
        n += (p - 1) * kv * e  # K, V again
        n += follow_bytes(kv, p, e, a) if input_dtype_ends else (p * kv * a if p > 1 else 0)  # dK, dV
    return n, n


def follow_bytes(elements: int, p: int, e: int, a: int) -> int:
    """Bytes one rank sends (and receives) for accumulators of `elements` that follow their block
    round a ring of `p` (`circulate` with `accumulators.follow_add`): P hops, the first and the last in
    the input dtype (e bytes), the others in the accumulator dtype (a bytes); none with one rank."""
    return 2 * elements * e + (p - 2) * elements * a if p > 1 else 0


def ring_src(p: int) -> Callable[[int, int], int]:
    """`src_of` of the plain ring of `p` ranks (`RingRoute`): rank r holds at step t the block of r - t."""
    return lambda rank, step: (rank - step) % p


class KVRingMethod(Method):
    """A method that is a block plan on the K/V ring (ring, zigzag_ring, stripe_ring): forward and
    backward are the ring engine's; subclasses give `plan`. Under a mask family the ring stops
    once no rank has a visible pair left (`useful_steps`)."""

    supports_sinks = True  # folds the sinks once per row (merge.fold_sink) after its last merge

    def plan(self, causal: bool, rank: int, local_len: int) -> Plan:
        """Which blocks of the K/V arriving from each source rank this rank computes."""
        raise NotImplementedError

    def ring_steps(self, masks: Optional[BlockMasks], causal: bool, p: int, local_len: int) -> int:
        return useful_steps(p, ring_src(p), lambda r: self.plan(causal, r, local_len), masks)

    def case_steps(self, case: Case) -> int:
        """The steps the ring circulates for `case` (as `forward` finds them)."""
        p = case.world_size
        return self.ring_steps(self.case_masks(case), case.causal, p, case.seq_len // p)

    def expected_bytes(self, case: Case, pass_: str) -> tuple[int, int]:
        return kv_ring_bytes(case, pass_, steps=self.case_steps(case))

    def redundant_kv_bytes(self, case: Case, rank: int) -> Optional[int]:
        """K/V bytes of the blocks this rank received (those of the first `case_steps` - 1 sources
        after its own) at keys none of its queries sees."""
        p = case.world_size
        pos = self.layout(case).positions
        src = ring_src(p)
        return sum(unseen_kv_bytes(case, pos(rank), pos(src(rank, t))) for t in range(1, self.case_steps(case)))

    def forward(self, q, k, v, *, comm, causal, scale, return_lse, docs=None, sinks=None):
        plan = self.plan(causal, comm.rank, q.shape[1])
        masks = self.block_masks(q, k, comm, causal, docs)
        steps = self.ring_steps(masks, causal, comm.world_size, q.shape[1])
        out, lse = kv_ring_forward(
            q, k, v, comm=comm, plan=plan, scale=scale, kernel=self.kernel, masks=masks, steps=steps
        )
        if sinks is not None:  # once per row, after the last merge (docs/DESIGN.md section 4)
            out, lse = merge.fold_sink(out, lse, sinks)
        return out, lse, (q, k, v, out, lse, masks)

    def backward(self, dout, residuals, *, comm, causal, scale, docs=None):
        q, k, v, out, lse, masks = residuals
        return kv_ring_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            comm=comm,
            plan=self.plan(causal, comm.rank, q.shape[1]),
            scale=scale,
            kernel=self.kernel,
            masks=masks,
            steps=self.ring_steps(masks, causal, comm.world_size, q.shape[1]),
        )
