"""TokenRing (Wang, Liu, Li, Jiang, 2024; arXiv 2412.20501): queries travel the ring one way while
the partial outputs computed for them return the other way, so both directions of each link work.

K and V never leave their rank. Forward, P steps and one closing exchange: at step t rank r holds
the queries of src = (r - t) mod P and computes them against its own K/V. Each step starts one
batched exchange, posted *before* the step's compute so that it overlaps it:
- the query hop: the held queries go on to r + 1 while the next ones arrive from r - 1 (the
  queries are double-buffered);
- the results of step t - 1 (block out in the input dtype, block lse in fp32) go straight back to
  their owner r - (t - 1), and the results computed for our own queries arrive from r + (t - 1).
At step 2 the results go to r - 1 while the queries go to r + 1: one link, both directions. Step 0
is the rank's own block, which starts its fp32 accumulators; every arriving result is folded in
with the shared online-softmax merge (merge.merge_). After the last step a closing exchange
delivers the last results. On a full mesh or a switch every result travels one hop.

Backward, the mirror (BurstAttention's query-ring backward with dQ sent home at once): the packet
(Q, dO, D = rowsum(dO * O), lse) of each query block hops to r + 1 every step; a rank computes
the visiting queries' block backward against its own K/V with their *global* lse and D (the
kernels' `delta=` path), keeps dK/dV at home in fp32, and sends the partial dQ, in the input dtype,
straight to the queries' owner in the next step's exchange; the owner sums them in fp32.

Zigzag layout (chunks r and 2P-1-r) for causal balance; the blocks are those of the query ring
(burst.query_ring_plan): src == r the local causal block; r < src: all of src's queries see our
front chunk; r > src: only src's back-chunk queries see our keys. Results carry only the rows a
rank computed, so under the causal mask ranks send different byte counts.

Communication of rank r (L = S/P local tokens, e input bytes, a = 4 accumulator bytes, 8 for
float64; R_sent(r), R_recv(r) result rows: causal L*(P-1-r) + L/2*r sent and L*r + L/2*(P-1-r)
received, without a mask L*(P-1) both):
    forward:  sent = (P-1) * B*L*H*D*e  +  R_sent(r) * B*H*(Dv*e + a)      (Q; out, lse)
              received likewise with R_recv(r)
    backward: (P-1) * B*L*H*((D+Dv)*e + 2*a)  +  R_sent(r) * B*H*D*e      (Q, dO; D, lse; dQ)
              received likewise with R_recv(r)
Rank 0 sends the most results, rank P-1 receives the most. Memory beyond inputs and outputs: two
query blocks (packets) in flight, one step's results out and one step's in, fp32 accumulators.
"""

from __future__ import annotations

from typing import Optional

import torch

from methods import accumulators, kernels, merge
from methods.base import Case, Method, element_bytes
from methods.burst import query_ring_plan
from methods.comm.base import P2P, Comm, DoneWork
from methods.kv_ring import DoubleBuffer, Plan
from methods.registry import register


def _rows(rows: slice, local_len: int) -> int:
    return len(range(*rows.indices(local_len)))


def result_peers(rank: int, world_size: int, step: int) -> Optional[tuple[int, int]]:
    """(owner the results sent in step `step`'s exchange go to, rank they arrive from), or None when
    that exchange carries no results (steps 0 and 1: step 0's results are the rank's own)."""
    if step < 2 or step > world_size:
        return None
    return (rank - (step - 1)) % world_size, (rank + step - 1) % world_size


class _Results:
    """The partial results a rank computed at one step for another rank's queries (one entry per
    block: its query rows and its tensors), or the receive buffers of the same messages.

    Loops over blocks live in this class and in the method's step functions, so that no loop
    variable of the step loop keeps a block alive into the next step's kernels (one more block in
    flight per rank)."""

    def __init__(self, blocks: Optional[list[tuple[slice, list[torch.Tensor]]]] = None):
        self.blocks = blocks or []

    def sends(self, owner: int) -> list[P2P]:
        return [P2P("send", t, owner) for _, tensors in self.blocks for t in tensors]

    def recvs(self, helper: int) -> list[P2P]:
        return [P2P("recv", t, helper) for _, tensors in self.blocks for t in tensors]

    def fold_into(self, acc, last: bool) -> None:
        """Fold the blocks into the owner's accumulator (an accumulators.OutputAccumulator of (out, lse),
        or an accumulators.GradAccumulator of dQ); `last`: no results follow these."""
        for i, (rows, tensors) in enumerate(self.blocks):
            acc.add(rows, *tensors, last=last and i == len(self.blocks) - 1)


@register
class TokenRing(Method):
    name = "token_ring"
    description = (
        "TokenRing: queries around the ring one way, partial outputs straight back to their owners "
        "(K/V stay home), zigzag layout"
    )
    layout_kind = "zigzag"
    supports_sinks = True  # folds the sinks once per row (merge.fold_sink) after its last merge
    # A rank holds its largest blocks at once (all-row results going out, coming in and being
    # computed while the queries hop) at step t only if src(t-1) and src(t) are later ranks and
    # the helper an earlier one, with t <= P-2: 3 <= r <= P-4, so from P = 7 on.
    memory_steady_from = 7

    def plan(self, causal: bool, rank: int, local_len: int) -> Plan:
        """Blocks (rows of the visiting queries of `src`, rows of this rank's keys) this rank computes."""
        return query_ring_plan(causal, rank, local_len)

    # -- bytes ------------------------------------------------------------------------------------
    def expected_rank_bytes(self, case: Case, pass_: str, rank: int) -> tuple[int, int]:
        p, l = case.world_size, case.seq_len // case.world_size
        if p == 1:
            return 0, 0
        e, a = element_bytes(case)
        b, h, d = case.batch, case.heads, case.head_dim
        if case.causal:  # a rank computes all L rows of a later rank's queries, the back L/2 of an earlier's
            rows_sent = l * (p - 1 - rank) + l // 2 * rank
            rows_recv = l * rank + l // 2 * (p - 1 - rank)
        else:
            rows_sent = rows_recv = l * (p - 1)
        hops = (p - 1) * b * l * h * d * e  # Q
        dv = case.dv  # results (out) and dO have the values' head dim
        sent, recv = hops + rows_sent * b * h * (dv * e + a), hops + rows_recv * b * h * (dv * e + a)  # out, lse
        if pass_ == "fwd_bwd":
            hops = (p - 1) * b * l * h * ((d + dv) * e + 2 * a)  # Q, dO; D, lse
            sent += hops + rows_sent * b * h * d * e  # partial dQ
            recv += hops + rows_recv * b * h * d * e
        return sent, recv

    def redundant_kv_bytes(self, case: Case, rank: int) -> Optional[int]:
        """K and V never leave their rank (queries and results travel): no K/V byte is received."""
        return 0

    def expected_bytes(self, case: Case, pass_: str) -> tuple[int, int]:
        per_rank = [self.expected_rank_bytes(case, pass_, r) for r in range(case.world_size)]
        return max(s for s, _ in per_rank), max(r for _, r in per_rank)

    # -- the algorithm ----------------------------------------------------------------------------
    def _incoming(self, causal: bool, rank: int, helper: int, local_len: int, buffers) -> _Results:
        """Receive buffers for what `helper` computed for this rank's queries: one entry per block
        of its plan, `buffers(n)` for a block of n query rows."""
        res = _Results()
        for blk in self.plan(causal, helper, local_len)(rank):
            res.blocks.append((blk.q_rows, buffers(_rows(blk.q_rows, local_len))))
        return res

    def _forward_blocks(self, q_vis, k, v, *, src: int, rank: int, plan: Plan, masks, scale) -> _Results:
        """The visiting queries of `src` (q_vis [B, L, H, D]) against this rank's K/V: block out
        [B, n, H, D] in the input dtype and block lse [B, H, n] fp32 for each block's n query rows."""
        blocks = []
        for blk in plan(src):
            block_out, block_lse = kernels.block_forward(
                q_vis[:, blk.q_rows],
                k[:, blk.k_rows],
                v[:, blk.k_rows],
                scale=scale,
                causal_offset=blk.causal_offset,
                kernel=self.kernel,
                mask=masks(src, blk.q_rows, rank, blk.k_rows) if masks else None,
            )
            blocks.append((blk.q_rows, [block_out, block_lse]))
        return _Results(blocks)

    def forward(self, q, k, v, *, comm: Comm, causal, scale, return_lse, docs=None, sinks=None):
        p, rank, l = comm.world_size, comm.rank, q.shape[1]
        b, _, h, d = q.shape
        acc = merge.acc_dtype(q.dtype)
        plan = self.plan(causal, rank, l)
        masks = self.block_masks(q, k, comm, causal, docs)

        dv = v.shape[-1]  # the outputs' head dim (MLA: the values' differs from the queries')

        def result_buffers(n: int) -> list[torch.Tensor]:  # block out [B, n, H, Dv], block lse [B, H, n]
            return [q.new_empty(b, n, h, dv), torch.empty(b, h, n, dtype=acc, device=q.device)]

        result = accumulators.OutputAccumulator(q, dv)  # our queries' results, own and returned
        cur_q, done = q, _Results()  # done: results of the previous step
        q_buffers = DoubleBuffer()
        for step in range(p + 1):
            ops, next_q, incoming = [], None, _Results()
            if step + 1 < p:  # the query hop, double-buffered
                (next_q,) = q_buffers(step, [q])
                ops += [P2P("send", cur_q, (rank + 1) % p), P2P("recv", next_q, (rank - 1) % p)]
            peers = result_peers(rank, p, step)  # none at steps 0, 1: step 0's were our own
            if peers:
                owner, helper = peers
                incoming = self._incoming(causal, rank, helper, l, result_buffers)
                ops += done.sends(owner) + incoming.recvs(helper)
            work = comm.exchange(ops) if ops else DoneWork()
            if step < p:
                computed = self._forward_blocks(
                    cur_q, k, v, src=(rank - step) % p, rank=rank, plan=plan, masks=masks, scale=scale
                )
                if step == 0:  # our own queries
                    computed.fold_into(result, last=p == 1)
                else:
                    done = computed
            work.wait()
            incoming.fold_into(result, last=step == p)  # the last: the cast fused into their merge
            if next_q is not None:
                cur_q = next_q
        out, lse = result.finish()
        if sinks is not None:  # once per row, after the last merge (docs/DESIGN.md section 4)
            out, lse = merge.fold_sink(out, lse, sinks)
        return out, lse, (q, k, v, out, lse, masks)

    def _backward_blocks(
        self, packet, k, v, dk, dv, *, src: int, rank: int, plan: Plan, masks, scale, last: bool
    ) -> _Results:
        """The block backwards of the visiting packet of `src` (Q, dO, D, lse of its queries) against
        this rank's K/V, with their global lse and D: dK/dV added to this rank's accumulators `dk`,
        `dv` (accumulators.GradAccumulator; `last`: the last step); returns the partial dQ [B, n, H, D]
        (input dtype) of each block's n query rows."""
        q_vis, dout_vis, delta_vis, lse_vis = packet
        blocks = []
        blks = plan(src)
        for i, blk in enumerate(blks):
            bdq, bdk, bdv = kernels.block_backward(
                dout_vis[:, blk.q_rows],
                q_vis[:, blk.q_rows],
                k[:, blk.k_rows],
                v[:, blk.k_rows],
                None,
                lse_vis[:, :, blk.q_rows],
                delta=delta_vis[:, :, blk.q_rows],
                scale=scale,
                causal_offset=blk.causal_offset,
                kernel=self.kernel,
                mask=masks(src, blk.q_rows, rank, blk.k_rows) if masks else None,
            )
            dk.add(blk.k_rows, bdk, last=last and i == len(blks) - 1)
            dv.add(blk.k_rows, bdv, last=last and i == len(blks) - 1)
            blocks.append((blk.q_rows, [bdq.contiguous()]))
        return _Results(blocks)

    def backward(self, dout, residuals, *, comm: Comm, causal, scale, docs=None):
        q, k, v, out, lse, masks = residuals
        p, rank, l = comm.world_size, comm.rank, q.shape[1]
        b, _, h, d = q.shape
        plan = self.plan(causal, rank, l)
        delta = merge.softmax_delta(dout, out)  # D: [B, H, L]

        def dq_buffers(n: int) -> list[torch.Tensor]:  # partial dQ [B, n, H, D], input dtype
            return [q.new_empty(b, n, h, d)]

        dq, dk, dv = accumulators.GradAccumulator(q), accumulators.GradAccumulator(k), accumulators.GradAccumulator(v)
        packet, done = [q, dout, delta, lse], _Results()  # the visiting query block (own at step 0)
        packet_buffers = DoubleBuffer()
        for step in range(p + 1):
            ops, next_packet, incoming = [], None, _Results()
            if step + 1 < p:
                next_packet = packet_buffers(step, packet)
                ops += [P2P("send", t, (rank + 1) % p) for t in packet]
                ops += [P2P("recv", t, (rank - 1) % p) for t in next_packet]
            peers = result_peers(rank, p, step)
            if peers:  # the partial dQ of the previous step, home
                owner, helper = peers
                incoming = self._incoming(causal, rank, helper, l, dq_buffers)
                ops += done.sends(owner) + incoming.recvs(helper)
            work = comm.exchange(ops) if ops else DoneWork()
            if step < p:
                computed = self._backward_blocks(
                    packet,
                    k,
                    v,
                    dk,
                    dv,
                    src=(rank - step) % p,
                    rank=rank,
                    plan=plan,
                    masks=masks,
                    scale=scale,
                    last=step == p - 1,
                )
                if step == 0:
                    computed.fold_into(dq, last=p == 1)
                else:
                    done = computed
            work.wait()
            incoming.fold_into(dq, last=step == p)  # the last: the cast fused into their sum
            if next_packet is not None:
                packet = next_packet
        return dq.finish(), dk.finish(), dv.finish()
