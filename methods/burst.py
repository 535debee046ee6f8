"""BurstAttention (Sun et al., 2024; arXiv 2403.09347): a K/V ring forward, a query-ring backward.

Forward (GAO): the K/V ring with online softmax and double-buffered transfers, as in
methods/kv_ring.py, over the zigzag layout for causal balance (the paper's code does the same).

Backward (the paper's Algorithm 2): K, V, dK and dV stay where they are; the *queries* travel.
Each rank first computes D = rowsum(dO * O) for its own rows, then circulates the packet
(Q, dO, D, lse) of each query block around the ring. At every step a rank recomputes the scores
of the visiting queries against its own K/V with the global lse, adds to its own dK/dV, and adds
to the visiting block's partial dQ, which travels one step behind its packet (so that transfer
overlaps the next step's compute) and takes one extra hop home at the end. Shipping D instead of
O needs a kernel backward that accepts D: see kernels.out_with_delta.

Zigzag masks in the backward, for visiting queries of `src` and this rank's keys (r):
src == r: local causal block; src < r: src's back-chunk queries see all our keys (its front chunk
sees none); src > r: all visiting queries see our front chunk (none of our back chunk).

Local masks (a window, chunks): both rings stop once no rank has a visible pair left
(kv_ring.useful_steps; the dQ accumulators then go home directly), so the formulas below hold with
P replaced by each ring's steps; the two-level ring always makes all P steps.

Topology: with `ranks_per_node` set and ranks spanning nodes, both rings run as the two-level
ring of the paper's code (methods/kv_ring.TwoLevelRoute): intra-node ring steps, with the
inter-node hop sent at the start of each cycle and hidden behind it.

Communication per rank (L = S/P local tokens, e input bytes, a = 4 accumulator bytes, 8 for
float64; the dQ accumulator travels in fp32 between its first and last hops: BurstAttention's
released code ships it in the input dtype on every hop, which rounds the partial sums of dQ to bf16
at every hop; here only the first hop, which carries the owner's own block gradient as the kernel
produced it, and the hop home, whose sum the owner returns in that dtype, carry the input dtype,
`accumulators.follow_add`):
    forward:  sent = received = (P-1) * B*L*Hkv*(D+Dv)*e                     (K, V)
    backward: sent = received = (P-1) * (B*L*H*(D+Dv)*e + 2*B*H*L*a)        (Q, dO; D, lse)
                                + 2 * B*L*H*D*e + (P-2) * B*L*H*D*a          (dQ, P hops; P >= 2)
(Dv: the values' head dim, D but under MLA; dO has the output's, which is the values'.)
With GQA the query packet carries H heads where a K/V ring carries Hkv: for H/Hkv > 4/3 this
backward moves more bytes than the K/V + dK/dV ring (a property of the algorithm, not a bug).
Memory beyond inputs and outputs: two packets in flight, two dQ accumulators, fp32 dK/dV.
"""

from __future__ import annotations

from typing import Optional

from methods import accumulators, kernels, merge
from methods.base import Case, Method, element_bytes, unseen_kv_bytes
from methods.documents import BlockMasks
from methods.kv_ring import Plan, circulate, follow_bytes, kv_ring_forward, make_route, ring_src, useful_steps
from methods.registry import register
from methods.zigzag_ring import zigzag_plan


def query_ring_plan(causal: bool, rank: int, local_len: int) -> Plan:
    """Blocks (rows of the visiting queries of `src`, rows of this rank's keys): the zigzag plan
    with the two ranks' roles exchanged (zigzag_plan(causal, q_owner)(k_owner) is exactly
    "q_owner's queries against k_owner's keys")."""
    return lambda src: zigzag_plan(causal, src, local_len)(rank)


@register
class Burst(Method):
    name = "burst"
    description = "BurstAttention: K/V ring forward, query ring backward (K, V, dK, dV stay), zigzag layout"
    layout_kind = "zigzag"
    supports_sinks = True  # folds the sinks once per row (merge.fold_sink) after its last merge

    def __init__(self, kernel: str = "auto", ranks_per_node: int = 0):
        super().__init__(kernel)
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 0:
            raise ValueError(f"burst: ranks_per_node must be an integer >= 0 (0 = one ring), got {ranks_per_node!r}")
        self.ranks_per_node = ranks_per_node

    test_variants = ({}, {"ranks_per_node": 2})

    def options(self):
        return {**super().options(), "ranks_per_node": self.ranks_per_node}

    def expected_bytes(self, case: Case, pass_: str) -> tuple[int, int]:
        l = case.seq_len // case.world_size
        masks = self.case_masks(case)
        fwd, bwd = self._steps(masks, case.causal, case.world_size, l)
        e, a = element_bytes(case)
        b, h, d = case.batch, case.heads, case.head_dim
        n = (fwd - 1) * b * l * case.kv_heads * case.kv_dims * e  # forward: K, V
        if pass_ == "fwd_bwd":
            n += (bwd - 1) * (b * l * h * (d + case.dv) * e + 2 * b * h * l * a)  # Q, dO; D, lse
            n += follow_bytes(b * l * h * d, bwd, e, a)  # the dQ accumulator
        return n, n

    def _steps(self, masks: Optional[BlockMasks], causal: bool, p: int, local_len: int) -> tuple[int, int]:
        """Steps of the forward's K/V ring and of the backward's query ring (`useful_steps`: fewer
        under a mask family). The two-level ring always makes all P steps: its inter-node hop
        leaves at the start of a cycle, before the steps it serves."""
        if 0 < self.ranks_per_node < p:
            return p, p
        src = ring_src(p)
        fwd = useful_steps(p, src, lambda r: zigzag_plan(causal, r, local_len), masks)
        bwd = useful_steps(p, src, lambda r: query_ring_plan(causal, r, local_len), masks, queries_travel=True)
        return fwd, bwd

    def redundant_kv_bytes(self, case: Case, rank: int) -> Optional[int]:
        """The forward's K/V ring: keys of the received blocks no local query sees."""
        l = case.seq_len // case.world_size
        masks = self.case_masks(case)
        fwd, _ = self._steps(masks, case.causal, case.world_size, l)
        pos, src = self.layout(case).positions, ring_src(case.world_size)
        return sum(unseen_kv_bytes(case, pos(rank), pos(src(rank, t))) for t in range(1, fwd))

    def supports(self, case: Case) -> tuple[bool, str]:
        if self.ranks_per_node and case.world_size % self.ranks_per_node != 0 and self.ranks_per_node < case.world_size:
            return False, f"burst: ranks_per_node {self.ranks_per_node} does not divide world_size {case.world_size}"
        return super().supports(case)

    def forward(self, q, k, v, *, comm, causal, scale, return_lse, docs=None, sinks=None):
        route = make_route(comm, self.ranks_per_node)
        masks = self.block_masks(q, k, comm, causal, docs)
        out, lse = kv_ring_forward(
            q,
            k,
            v,
            comm=comm,
            plan=zigzag_plan(causal, comm.rank, q.shape[1]),
            scale=scale,
            kernel=self.kernel,
            route=route,
            masks=masks,
            steps=self._steps(masks, causal, comm.world_size, q.shape[1])[0],
        )
        if sinks is not None:  # once per row, after the last merge (docs/DESIGN.md section 4)
            out, lse = merge.fold_sink(out, lse, sinks)
        return out, lse, (q, k, v, out, lse, masks)

    def backward(self, dout, residuals, *, comm, causal, scale, docs=None):
        q, k, v, out, lse, masks = residuals
        p = self._steps(masks, causal, comm.world_size, q.shape[1])[1]
        route = make_route(comm, self.ranks_per_node)
        plan = query_ring_plan(causal, comm.rank, q.shape[1])
        delta = merge.softmax_delta(dout, out)  # D: [B, H, L]
        packet = [q, dout, delta, lse]  # the visiting query block (own, at step 0)
        dk, dv = accumulators.GradAccumulator(k), accumulators.GradAccumulator(v)  # this rank's keys' gradients

        def compute(step, block):
            q_vis, dout_vis, delta_vis, lse_vis = block
            pending = []  # partial dQ of the visiting block, added once its accumulator has arrived
            src = route.src(step)
            blocks = plan(src)
            for i, blk in enumerate(blocks):  # the visiting queries are src's rows; the keys are this rank's
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
                    mask=masks(src, blk.q_rows, comm.rank, blk.k_rows) if masks else None,
                )
                last = step == p - 1 and i == len(blocks) - 1
                dk.add(blk.k_rows, bdk, last)
                dv.add(blk.k_rows, bdv, last)
                pending.append((blk.q_rows, bdq))
            return pending

        def add(step, dq_acc, pending):  # first hop and the hop home in the input dtype, fp32 between
            return [accumulators.follow_add(None if dq_acc is None else dq_acc[0], pending, q, last_hop=step == p - 1)]

        def follow(step, dq_acc):  # a ring cut short sends each dQ straight home after its last step
            if step == p - 1 and p < comm.world_size:
                return route.start_home(step, dq_acc)
            return route.start_follow(step, dq_acc)

        dq = circulate(p, packet, move=route.start_move, compute=compute, add=add, follow=follow)[0]
        return dq, dk.finish(), dv.finish()
