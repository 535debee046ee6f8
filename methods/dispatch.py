"""Dispatch: mask-aware, area-balanced sharding with targeted K/V exchange (MagiAttention, DCP).

A ring passes every K/V block to every rank, whether its queries need it or not; all-gather K/V
gathers the whole sequence. Under a mask that keeps few pairs (packed documents, a sliding window,
block-causal) most of those bytes are keys no query of the receiving rank attends. Dispatch plans
the problem from the mask once (cached per problem, never timed) and moves only what is needed.

The plan (`DispatchPlan`), from the mask alone, so every rank computes the same one:
1. Sharding: the padded sequence in equal chunks of `chunk` tokens (0: 4 per rank), dealt largest
   visible area first to the rank with the least area so far among those with room
   (`layouts.assign_chunks`, the area layout): equal tokens per rank, and the largest per-rank
   visible area (the pairs its queries keep under the mask) close to the mean, for any mask.
2. Communication: for every rank r and every chunk held by another rank, the keys of that chunk
   that some query of r sees (`Documents.seen_keys`, in any batch element). Only those keys' K
   and V go to r: no chunk that r does not attend travels, and of a chunk it attends only the keys
   it sees (a window's edge chunk sends its window part). The K/V a rank receives is the keys its
   queries see, so `redundant_kv_bytes` is 0 (with batch elements packed differently, a key seen in
   one element and not in another counts as unseen in that one: the union is sent).
3. Stages: the (sender, chunk) pieces a rank receives, ordered by sender distance (o - r) mod P
   and chunk, are cut into `stages` runs of about equal keys; one message per (stage, sender,
   receiver) carries K then V in one flat buffer, each half contiguous [B, n, Hkv, D] and
   [B, n, Hkv, Dv] (a value head dim other than the keys', MLA's, travels as it is: no padding on
   the wire); each half is one index_select straight into it, no other copy.

Forward on rank r: post stage 0's exchange, compute the local block (r's queries against its own
keys, under the mask) while it arrives; then for each stage s: wait for it, post stage s+1's
exchange, compute one kernel call per received message (the local queries from the first to the
last local chunk that sees the message's keys, against those keys, with their block mask), merged
by online softmax (`OutputAccumulator`).

Backward: the same K/V exchange again (the remote K/V are not kept between passes), one block
backward per message; each message's dK/dV partial goes back to its sender in the input dtype (one
kernel's result: fp32 would add no information), written into the message's own buffer, posted
right after the stage's kernels; the owner sums its local gradient and every partial in fp32
(float64 for float64 inputs) and casts once.

Communication per rank r (n_out: keys r sends over all messages, n_in: keys it receives; u =
B*Hkv*D elements per key, e bytes per input element):
    forward:  sent = 2*n_out*u*e,              received = 2*n_in*u*e
    backward: sent = 2*(n_out + n_in)*u*e,     received = 2*(n_in + n_out)*u*e
              (K/V again; the dK/dV partials back to their owners)
With no mask every rank sees every key: n_in = n_out = (P-1)*L, all-gather's forward bytes in
point-to-point messages, and the backward sends partials in the input dtype where all-gather
reduce-scatters fp32. Under the causal mask n_in is the keys before r's last chunk that r does not
hold; under packed documents, only the documents r's chunks touch.

Limits: the layout follows the mask, so a model whose layers mask differently (a window layer
and a global one) cannot share one sharding of its tokens (the perplexity workload and the HF path
refuse it, `check_one_layout`). The area deal ignores locality: under a sliding window, chunks of
equal area go round the ranks and each chunk's window lies on another rank, so a contiguous ring
that stops early moves fewer bytes (reports/recorded/dispatch_compare.md).

Memory beyond inputs and outputs: the received K/V of two stages at most in the forward (the
stage being computed and the next one arriving), in the backward also the dK/dV partials in
flight (in the receive buffers themselves) and the fp32 dK/dV sums. Without a mask a stage holds
(P-1)*L/stages keys: like all-gather, memory grows with the world size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from methods import accumulators, kernels, layouts, merge
from methods.base import (
    AREA_CHUNKS_PER_RANK,
    Case,
    Method,
    cached_once,
    chunk_areas,
    element_bytes,
    unseen_kv_bytes,
)
from methods.comm.base import P2P, Comm, DoneWork, Work
from methods.documents import EMPTY, BlockMask, Documents
from methods.registry import register

ALL = slice(None)
MAX_STAGES = 4


@dataclass(frozen=True, eq=False)
class Message:
    """K/V of `rows` (the sender's local rows, increasing) sent from rank `src` to rank `dst` at
    stage `stage`; `positions` are their global positions (increasing)."""

    stage: int
    src: int
    dst: int
    rows: torch.Tensor  # LongTensor [n], CPU
    positions: torch.Tensor  # LongTensor [n], CPU
    q_rows: slice  # the receiver's local rows from its first to its last chunk that sees these keys

    @property
    def keys(self) -> int:
        return int(self.rows.numel())


@dataclass(eq=False)
class DispatchPlan:
    """Which rank holds which chunks, and which keys travel where and when (module docstring)."""

    docs: Documents
    causal: bool
    layout: layouts.Layout
    stages: int
    messages: tuple[Message, ...]
    areas: tuple[int, ...]  # visible pairs of each rank's queries (summed over the batch)
    _masks: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def received(self, rank: int, stage: int) -> list[Message]:
        return [m for m in self.messages if m.dst == rank and m.stage == stage]

    def sent(self, rank: int, stage: int) -> list[Message]:
        return [m for m in self.messages if m.src == rank and m.stage == stage]

    def keys_out_in(self, rank: int) -> tuple[int, int]:
        """(keys rank `rank` sends, keys it receives) over all messages."""
        out = sum(m.keys for m in self.messages if m.src == rank)
        return out, sum(m.keys for m in self.messages if m.dst == rank)

    @property
    def balance(self) -> float:
        """Largest per-rank visible area over the mean (1.0: perfectly balanced)."""
        mean = sum(self.areas) / len(self.areas)
        return max(self.areas) / mean if mean else 1.0

    def local_mask(self, rank: int) -> BlockMask:
        """The mask of rank's queries against its own keys."""
        key = ("local", rank)
        if key not in self._masks:
            pos = self.layout.positions(rank)
            self._masks[key] = self.docs.block(pos, pos, self.causal)
        return self._masks[key]

    def mask(self, msg: Message) -> BlockMask:
        """The mask of the receiver's queries `msg.q_rows` against a message's keys (never empty, by
        the plan)."""
        key = id(msg)
        if key not in self._masks:
            self._masks[key] = self.docs.block(self.layout.positions(msg.dst)[msg.q_rows], msg.positions, self.causal)
        return self._masks[key]


@cached_once(maxsize=16)
def area_layout(docs: Documents, causal: bool, world_size: int, chunks: int) -> layouts.Layout:
    """Step 1 of the plan: `chunks` equal chunks dealt by visible area (`layouts.area`)."""
    return layouts.area(docs.padded_len, world_size, chunk_areas(docs, causal, chunks))


@cached_once(maxsize=16)
def build_plan(docs: Documents, causal: bool, world_size: int, chunks: int, stages: int) -> DispatchPlan:
    """The dispatch plan of `docs` under the causal flag on `world_size` ranks, `chunks` chunks in
    all, exchanged in `stages` stages (cached: forward, backward and the byte formula ask again)."""
    p = world_size
    lay = area_layout(docs, causal, p, chunks)
    size = docs.padded_len // chunks
    pos = [lay.positions(r) for r in range(p)]
    local_chunks = lay.local_len(0) // size
    messages: list[Message] = []
    for r in range(p):
        pieces = []  # (distance, local chunk of the sender, sender, sender's rows)
        for o in range(p):
            if o == r:
                continue
            seen = docs.seen_keys(pos[r], pos[o], causal)
            for i in range(local_chunks):
                rows = torch.nonzero(seen[i * size : (i + 1) * size]).flatten() + i * size
                if rows.numel():
                    pieces.append(((o - r) % p, i, o, rows))
        pieces.sort(key=lambda t: (t[0], t[1]))
        total = sum(int(t[3].numel()) for t in pieces)
        grouped: dict[tuple[int, int], list[torch.Tensor]] = {}
        before = 0
        for _, _, o, rows in pieces:
            # a piece goes to the stage its first key falls in when the keys are cut into equal runs
            stage = min(stages - 1, stages * before // total)
            before += int(rows.numel())
            grouped.setdefault((stage, o), []).append(rows)
        for (stage, o), parts in sorted(grouped.items(), key=lambda kv: (kv[0][0], (kv[0][1] - r) % p)):
            rows = torch.cat(parts)
            # only the receiver's chunks that see these keys compute with them (a narrower kernel call,
            # and a merge over those rows only, not over every local row)
            seeing = [
                i
                for i in range(local_chunks)
                if docs.block(pos[r][i * size : (i + 1) * size], pos[o][rows], causal).pairs
            ]
            q_rows = slice(seeing[0] * size, (seeing[-1] + 1) * size)
            messages.append(Message(stage, o, r, rows, pos[o][rows], q_rows))
    keys = torch.arange(docs.padded_len)
    areas = tuple(docs.visible_pairs(pos[r], keys, causal) for r in range(p))
    return DispatchPlan(docs, causal, lay, stages, tuple(messages), areas)


def kv_buffer(like: torch.Tensor, keys: int, d: int, dv: int) -> torch.Tensor:
    """One message's flat buffer: the K rows of `keys` keys, then their V rows."""
    b, _, h, _ = like.shape
    return like.new_empty(b * keys * h * (d + dv))


def split_kv(buf: torch.Tensor, k: torch.Tensor, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K [B, n, Hkv, D] and V [B, n, Hkv, Dv] of a flat message buffer of `keys` keys (k: a rank's
    K, for B, Hkv and D): two contiguous views."""
    b, _, h, d = k.shape
    n_k = b * keys * h * d
    return buf[:n_k].view(b, keys, h, d), buf[n_k:].view(b, keys, h, -1)


class _Exchange:
    """Starts one stage's K/V messages of rank `rank`: its sends (the rows of k, then those of v, in
    one flat buffer: one message whatever the value head dim, each half contiguous) and its receives
    (into fresh buffers of that size)."""

    def __init__(self, comm: Comm, plan: DispatchPlan, k: torch.Tensor, v: torch.Tensor):
        self.comm, self.plan, self.k, self.v = comm, plan, k, v

    def start(self, stage: int):
        """Post stage `stage`; returns finish() giving [(message, flat buffer)] received."""
        comm, plan, k, v = self.comm, self.plan, self.k, self.v
        d, dv = k.shape[-1], v.shape[-1]
        ops = []
        for msg in plan.sent(comm.rank, stage):
            buf = kv_buffer(k, msg.keys, d, dv)
            rows = msg.rows.to(k.device)
            bk, bv = split_kv(buf, k, msg.keys)
            torch.index_select(k, 1, rows, out=bk)
            torch.index_select(v, 1, rows, out=bv)
            ops.append(P2P("send", buf, msg.dst))
        arrived = [(msg, kv_buffer(k, msg.keys, d, dv)) for msg in plan.received(comm.rank, stage)]
        ops += [P2P("recv", buf, msg.src) for msg, buf in arrived]
        work = comm.exchange(ops) if ops else DoneWork()

        def finish():
            work.wait()
            return arrived

        return finish


@register
class Dispatch(Method):
    name = "dispatch"
    description = "mask-aware area-balanced chunks, K/V sent only to the ranks that attend them (MagiAttention/DCP)"
    layout_kind = "area"
    gathers_whole_sequence = True  # without a mask every rank receives every key (module docstring)
    test_variants = ({}, {"stages": 1}, {"stages": 3}, {"chunk": 2}, {"chunk": 3, "stages": 4})
    supports_sinks = True  # folds the sinks once per row (merge.fold_sink) after its last merge

    def __init__(self, kernel: str = "auto", chunk: int = 0, stages: int = 2):
        super().__init__(kernel)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"{self.name}: chunk must be a number of tokens >= 1 (0: {AREA_CHUNKS_PER_RANK} per rank)")
        if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= MAX_STAGES:
            raise ValueError(f"{self.name}: stages must be an integer from 1 to {MAX_STAGES}, got {stages!r}")
        self.chunk, self.stages = chunk, stages

    def options(self):
        return {**super().options(), "chunk": self.chunk, "stages": self.stages}

    # -- what the method declares ---------------------------------------------------------------
    def granule(self, case: Case) -> int:
        return case.world_size * (self.chunk or AREA_CHUNKS_PER_RANK)

    def _chunks(self, seq_len: int, world_size: int) -> int:
        if self.chunk:
            if seq_len % (world_size * self.chunk):
                raise ValueError(
                    f"{self.name}: seq_len {seq_len} must be a multiple of world_size x chunk "
                    f"({world_size} x {self.chunk}), so that every rank holds as many chunks"
                )
            return seq_len // self.chunk
        if seq_len % (world_size * AREA_CHUNKS_PER_RANK):
            raise ValueError(
                f"{self.name}: seq_len {seq_len} must be a multiple of {AREA_CHUNKS_PER_RANK} x world_size "
                f"({world_size}) for the automatic chunk size; set chunk or pad"
            )
        return world_size * AREA_CHUNKS_PER_RANK

    def plan(self, docs: Documents, causal: bool, world_size: int) -> DispatchPlan:
        return build_plan(docs, bool(causal), world_size, self._chunks(docs.padded_len, world_size), self.stages)

    def case_plan(self, case: Case) -> DispatchPlan:
        docs = case.documents or Documents.single(case.batch, case.seq_len)
        return self.plan(docs, case.causal, case.world_size)

    def layout(self, case: Case) -> layouts.Layout:
        # sizes now, positions when first asked for: planning asks every trial whether its layout
        # fits and never uses the positions (layouts.Layout)
        chunks = self._chunks(case.seq_len, case.world_size)
        docs = case.documents or Documents.single(case.batch, case.seq_len)
        p, causal = case.world_size, bool(case.causal)

        def build() -> layouts.Positions:
            lay = area_layout(docs, causal, p, chunks)
            return tuple(lay.positions(r) for r in range(p))

        return layouts.Layout("area", case.seq_len, p, build)

    def expected_rank_bytes(self, case: Case, pass_: str, rank: int) -> tuple[int, int]:
        keys_out, keys_in = self.case_plan(case).keys_out_in(rank)
        e, _ = element_bytes(case)
        # K and V of one key, over the batch (V at the value head dim)
        per_key = case.batch * case.kv_heads * (case.head_dim + (case.head_dim_v or case.head_dim)) * e
        if pass_ == "fwd_bwd":
            return (2 * keys_out + keys_in) * per_key, (2 * keys_in + keys_out) * per_key
        return keys_out * per_key, keys_in * per_key

    def expected_bytes(self, case: Case, pass_: str) -> tuple[int, int]:
        per_rank = [self.expected_rank_bytes(case, pass_, r) for r in range(case.world_size)]
        return max(s for s, _ in per_rank), max(r for _, r in per_rank)

    def redundant_kv_bytes(self, case: Case, rank: int) -> int:
        """K/V bytes of received keys that no local query sees: 0 for one batch element (the plan
        sends only seen keys), the keys seen in another batch element only otherwise."""
        plan = self.case_plan(case)
        mine = plan.layout.positions(rank)
        return sum(unseen_kv_bytes(case, mine, m.positions) for m in plan.messages if m.dst == rank)

    # -- the algorithm ------------------------------------------------------------------------------
    def _plan_of(self, q: torch.Tensor, comm: Comm, causal: bool, docs: Optional[Documents]) -> DispatchPlan:
        docs = docs or Documents.single(q.shape[0], q.shape[1] * comm.world_size)
        return self.plan(docs, causal, comm.world_size)

    def forward(self, q, k, v, *, comm, causal, scale, return_lse, docs=None, sinks=None):
        plan = self._plan_of(q, comm, causal, docs)
        rank = comm.rank
        local = plan.local_mask(rank)
        calls = (local.kind != EMPTY) + sum(len(plan.received(rank, s)) for s in range(plan.stages))
        acc = accumulators.OutputAccumulator(q, v.shape[-1])  # out has the values' head dim
        done = 0
        exchange = _Exchange(comm, plan, k, v)
        finish = exchange.start(0)  # stage 0 arrives while the local block computes
        if local.kind != EMPTY:
            block_out, block_lse = kernels.block_forward(
                q, k, v, scale=scale, causal_offset=None, kernel=self.kernel, mask=local
            )
            done += 1
            acc.add(ALL, block_out, block_lse, last=done == calls)
        for stage in range(plan.stages):
            arrived, finish = finish(), None
            if stage + 1 < plan.stages:
                finish = exchange.start(stage + 1)  # posted before this stage's kernels
            for msg, buf in arrived:
                rows = msg.q_rows
                bk, bv = split_kv(buf, k, msg.keys)
                block_out, block_lse = kernels.block_forward(
                    q[:, rows], bk, bv, scale=scale, causal_offset=None, kernel=self.kernel, mask=plan.mask(msg)
                )
                done += 1
                acc.add(rows, block_out, block_lse, last=done == calls)
            del arrived
        out, lse = acc.finish()
        if sinks is not None:  # once per row, after the last merge (docs/DESIGN.md section 4)
            out, lse = merge.fold_sink(out, lse, sinks)
        return out, lse, (q, k, v, out, lse, docs)

    def backward(self, dout, residuals, *, comm, causal, scale, docs=None):
        q, k, v, out, lse, docs = residuals
        plan = self._plan_of(q, comm, causal, docs)
        rank = comm.rank
        local = plan.local_mask(rank)
        calls = (local.kind != EMPTY) + sum(len(plan.received(rank, s)) for s in range(plan.stages))
        accd = merge.acc_dtype(k.dtype)
        dq = accumulators.GradAccumulator(q)
        done = 0
        exchange = _Exchange(comm, plan, k, v)
        finish = exchange.start(0)
        if local.kind != EMPTY:
            bdq, bdk, bdv = kernels.block_backward(
                dout, q, k, v, out, lse, scale=scale, causal_offset=None, kernel=self.kernel, mask=local
            )
            done += 1
            dq.add(ALL, bdq, last=done == calls)
            dk, dv = bdk.to(accd), bdv.to(accd)
        else:
            dk = torch.zeros(k.shape, dtype=accd, device=k.device)
            dv = torch.zeros(v.shape, dtype=accd, device=v.device)
        # (work, [(message, buffer)]) of the dK/dV partials coming home
        returns: list[tuple[Work, list[tuple[Message, torch.Tensor]]]] = []
        home = 0  # how many of `returns` have been waited for and added

        def add_home(until: int) -> int:
            for work, partials in returns[home:until]:
                work.wait()
                for msg, buf in partials:
                    rows = msg.rows.to(k.device)
                    pk, pv = split_kv(buf, k, msg.keys)
                    dk.index_add_(1, rows, pk.to(accd))
                    dv.index_add_(1, rows, pv.to(accd))
            return max(home, until)

        for stage in range(plan.stages):
            # messages between two ranks are waited for in the order they were posted (a virtual
            # rank matches them at wait, NCCL at post: one order serves both): the partials of
            # stage s-2 were posted before stage s's K/V (kv0, kv1, dkv0, kv2, dkv1, ...)
            home = add_home(stage - 1)
            arrived, finish = finish(), None
            if stage + 1 < plan.stages:
                finish = exchange.start(stage + 1)
            ops = []
            for msg, buf in arrived:
                rows = msg.q_rows
                bk, bv = split_kv(buf, k, msg.keys)
                bdq, bdk, bdv = kernels.block_backward(
                    dout[:, rows], q[:, rows], bk, bv, out[:, rows], lse[:, :, rows], scale=scale,
                    causal_offset=None, kernel=self.kernel, mask=plan.mask(msg),
                )  # fmt: skip
                done += 1
                dq.add(rows, bdq, last=done == calls)
                # the K/V just used are not needed again: the buffer carries the partial home
                bk.copy_(bdk)
                bv.copy_(bdv)
                ops.append(P2P("send", buf, msg.src))
            partials = [(msg, kv_buffer(k, msg.keys, k.shape[-1], v.shape[-1])) for msg in plan.sent(rank, stage)]
            ops += [P2P("recv", buf, msg.dst) for msg, buf in partials]
            returns.append((comm.exchange(ops) if ops else DoneWork(), partials))
            del arrived
        add_home(len(returns))
        return dq.finish(), dk.to(k.dtype), dv.to(v.dtype)
