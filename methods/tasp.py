"""TASP, topology-aware sequence parallelism (Wang et al., 2025; arXiv 2509.26541).

Ring Attention sends every K/V block along one Hamiltonian cycle of the ranks, so on an
all-to-all fabric (NVSwitch, MI300X full mesh) it uses P of the P(P-1) directed links per round.
TASP decomposes the complete directed graph of the P ranks into k arc-disjoint directed
Hamiltonian cycles (methods/hamilton.py: k = P-1 for a full decomposition; k = P-2 for P = 4, 6
and P = 2 mod 4 >= 10, our documented fallback), splits each rank's K/V into k units, and moves
unit j along cycle j. Each round a rank sends one unit to each of its k successors and receives
one from each predecessor: with a full decomposition every ordered pair of ranks carries one
unit per round, all links busy. Bytes per round equal Ring Attention's; they are spread over k
links instead of one. Every unit visits every rank once in P-1 rounds.

Layout (zigzag-TASP, the paper's causal layout, used for both masks here: non-causal attention
is layout-invariant and one layout keeps positions simple): the sequence is cut into 2P blocks;
rank r holds blocks r ("front") and 2P-1-r ("back"), each cut into k sub-chunks of c tokens.
Unit j = (front sub-chunk j, back sub-chunk j), 2c tokens. Local tokens are in increasing order.
Needs seq_len % (2*P*k) == 0.

Causal masks: step 0 is the local causal block. At step s >= 1 the unit on cycle j came from
origin o, s hops before this rank on cycle j. If o < r its front half precedes all our tokens and
its back half follows them: all local queries see exactly the unit's front half. If o > r all
of it lies between our front and back blocks: our back-half queries see the whole unit. All
"o < r" units go into one kernel call and all "o > r" units into another. Either way a unit costs
2kc^2 query-key pairs (2kc queries x c keys, or kc queries x 2c keys), so every step costs 2k^2c^2
on every rank (balanced), in at most two calls.

Backward (the published code is forward-only): the units circulate along their cycles again, and
each unit's dK/dV accumulator (fp32) follows it one round behind; after the last step one hop to
the cycle successor brings it to the unit's owner (ring attention's scheme, per cycle).

Communication per rank (L = S/P = 2kc tokens, e input bytes, a = 4 accumulator bytes, 8 for
float64):
    forward:  sent = received = (P-1) * 2*B*L*Hkv*D*e, as k messages of 2*B*(L/k)*Hkv*D*e per round,
              one to each cycle successor (with k = P-1: one to every other rank)
    backward: sent = received = (P-1) * 2*B*L*Hkv*D*e + P * 2*B*L*Hkv*D*a
Multi-node: the same single complete graph over all ranks (one batched exchange per round).
Memory beyond inputs and outputs: the units held and being received (two K/V blocks), plus the
concatenated units of one kernel call.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from methods import kernels, layouts
from methods.base import Case, Method
from methods.comm.base import P2P, Comm
from methods.hamilton import hamiltonian_cycles, predecessors, successors
from methods.kv_ring import ALL, kv_ring_bytes
from methods.registry import register


@lru_cache(maxsize=None)
def cycle_tables(world_size: int) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """(succ[c][r], pred[c][r]) for the Hamiltonian cycles of `world_size` ranks (one trivial
    cycle for a single rank)."""
    if world_size == 1:
        return ((0,),), ((0,),)
    cycles = hamiltonian_cycles(world_size)
    return (tuple(map(tuple, successors(cycles))), tuple(map(tuple, predecessors(cycles))))


def num_cycles(world_size: int) -> int:
    return len(cycle_tables(world_size)[0])


def origin(pred: tuple[int, ...], rank: int, steps: int) -> int:
    """The rank `steps` hops before `rank` on a cycle (whose unit this rank holds at that step)."""
    for _ in range(steps):
        rank = pred[rank]
    return rank


class _Units:
    """Row indices of the k units inside a rank's local tokens [front k*c | back k*c]."""

    def __init__(self, local_len: int, k: int, device):
        self.k, self.c = k, local_len // (2 * k)
        c = self.c
        cpu_rows = [torch.cat([torch.arange(j * c, (j + 1) * c), torch.arange(k * c + j * c, k * c + (j + 1) * c)])
                    for j in range(k)]
        self.cpu_rows = cpu_rows          # for the packed documents' masks (host-side positions)
        self.rows = [r.to(device) for r in cpu_rows]

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Local [B, L, ...] -> k units [B, 2c, ...] (contiguous copies, ready to send)."""
        return [x.index_select(1, r) for r in self.rows]

    def join(self, units: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of split."""
        b, _, *rest = units[0].shape
        out = units[0].new_empty(b, self.k * 2 * self.c, *rest)
        for r, u in zip(self.rows, units):
            out.index_copy_(1, r, u)
        return out


def _exchange(comm: Comm, succ, pred, *unit_lists: list[torch.Tensor]):
    """For every cycle j, send the j-th unit of each list (e.g. its K and its V) to the successor on
    cycle j and receive the next ones from the predecessor; finish() returns the received lists.

    The cycles are arc-disjoint, so each pair of ranks carries the units of exactly one cycle and
    the messages of a pair pair up in list order.
    """
    r = comm.rank
    received = [[torch.empty_like(u) for u in units] for units in unit_lists]
    ops = [P2P("send", units[j], succ[j][r]) for j in range(len(succ)) for units in unit_lists]
    ops += [P2P("recv", units[j], pred[j][r]) for j in range(len(pred)) for units in received]
    work = comm.exchange(ops)

    def finish() -> list[list[torch.Tensor]]:
        work.wait()
        return received
    return finish


def step_calls(causal: bool, rank: int, pred, step: int, k: int, c: int):
    """Kernel calls of step s >= 1, each [(query rows, [(unit j, rows of the unit)])], no mask
    inside a call (step 0, the local causal block, is not included)."""
    if step == 0:
        return []
    if not causal:
        return [(slice(None), [(j, slice(None)) for j in range(k)])]
    before = [j for j in range(k) if origin(pred[j], rank, step) < rank]
    after = [j for j in range(k) if origin(pred[j], rank, step) > rank]
    calls = []
    if before:  # every local query sees the front halves of units that came from earlier ranks
        calls.append((slice(None), [(j, slice(0, c)) for j in before]))
    if after:   # our back-half queries see the whole units that came from later ranks
        calls.append((slice(k * c, 2 * k * c), [(j, slice(None)) for j in after]))
    return calls


def _gather_calls(causal, rank, pred, step, units: _Units, held_k, held_v):
    """The step's kernel calls with their keys and values concatenated:
    [(query rows, k [B, n, Hkv, D], v, [(unit j, unit rows, n_j)])]."""
    out = []
    for rows, parts in step_calls(causal, rank, pred, step, units.k, units.c):
        kk = torch.cat([held_k[j][:, sl] for j, sl in parts], dim=1)
        vv = torch.cat([held_v[j][:, sl] for j, sl in parts], dim=1)
        out.append((rows, kk, vv, [(j, sl, held_k[j][:, sl].shape[1]) for j, sl in parts]))
    return out


@register
class TASP(Method):
    name = "tasp"
    description = "TASP: K/V units on arc-disjoint Hamiltonian cycles (all links busy), zigzag-TASP layout"
    layout_kind = "zigzag"

    def granule(self, case: Case) -> int:
        return 2 * case.world_size * num_cycles(case.world_size)

    def expected_bytes(self, case: Case, pass_: str) -> tuple[int, int]:
        return kv_ring_bytes(case, pass_)  # the ring's bytes, spread over k links per round

    def layout(self, case: Case) -> layouts.Layout:
        k = num_cycles(case.world_size)
        if case.seq_len % (2 * case.world_size * k) != 0:
            raise ValueError(f"tasp layout needs seq_len divisible by 2 x world_size x cycles = "
                             f"{2 * case.world_size * k} ({k} cycles at world_size {case.world_size}); "
                             f"got seq_len={case.seq_len}")
        return layouts.zigzag(case.seq_len, case.world_size)

    def _unit_calls(self, masks, causal, r, pred, step, units: _Units):
        """With packed documents, one call per unit (units come from different ranks, so their
        keys are not in one increasing order): [(query rows, unit j, unit rows, mask)]."""
        calls = []
        for rows, parts in step_calls(causal, r, pred, step, units.k, units.c):
            for j, sl in parts:
                o = origin(pred[j], r, step)
                calls.append((rows, j, sl, masks(r, rows, o, units.cpu_rows[j][sl])))
        return calls

    def forward(self, q, k, v, *, comm, causal, scale, return_lse, docs=None):
        p, r = comm.world_size, comm.rank
        succ, pred = cycle_tables(p)
        units = _Units(q.shape[1], len(succ), q.device)
        held_k, held_v = units.split(k), units.split(v)
        masks = self.block_masks(q, k, comm, causal, docs)
        out = lse = None
        for step in range(p):
            if step + 1 < p:  # units move on while this step computes (double buffering)
                finish = _exchange(comm, succ, pred, held_k, held_v)
            if step == 0:  # our own tokens: one aligned causal block
                out, lse = kernels.block_forward(q, k, v, scale=scale, causal_offset=0 if causal else None,
                                                 kernel=self.kernel, mask=masks(r, ALL, r, ALL) if masks else None)
                out, lse = out.to(kernels.acc_dtype(q.dtype)), lse.clone()
            elif masks is not None:
                for rows, j, sl, mask in self._unit_calls(masks, causal, r, pred, step, units):
                    bo, bl = kernels.block_forward(q[:, rows], held_k[j][:, sl], held_v[j][:, sl], scale=scale,
                                                   causal_offset=None, kernel=self.kernel, mask=mask)
                    kernels.merge_(out[:, rows], lse[:, :, rows], bo, bl)
            for rows, kk, vv, _ in ([] if masks is not None else
                                    _gather_calls(causal, r, pred, step, units, held_k, held_v)):
                bo, bl = kernels.block_forward(q[:, rows], kk, vv, scale=scale, causal_offset=None, kernel=self.kernel)
                kernels.merge_(out[:, rows], lse[:, :, rows], bo, bl)
            if step + 1 < p:
                held_k, held_v = finish()
        out = out.to(q.dtype)
        return out, lse, (q, k, v, out, lse, masks)

    def backward(self, dout, residuals, *, comm, causal, scale, docs=None):
        q, k, v, out, lse, masks = residuals
        p, r = comm.world_size, comm.rank
        succ, pred = cycle_tables(p)
        units = _Units(q.shape[1], len(succ), q.device)
        acc = kernels.acc_dtype(q.dtype)
        held_k, held_v = units.split(k), units.split(v)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        finish_acc = None
        for step in range(p):
            if step + 1 < p:
                finish_kv = _exchange(comm, succ, pred, held_k, held_v)
            if step == 0:
                gq, gk, gv = kernels.block_backward(dout, q, k, v, out, lse, scale=scale,
                                                    causal_offset=0 if causal else None, kernel=self.kernel,
                                                    mask=masks(r, ALL, r, ALL) if masks else None)
                dq += gq
                dk_acc, dv_acc = units.split(gk.to(acc)), units.split(gv.to(acc))  # own units' accumulators
            else:
                pending = []  # contributions, added once the units' accumulators have arrived
                for rows, j, sl, mask in (self._unit_calls(masks, causal, r, pred, step, units) if masks else []):
                    gq, gk, gv = kernels.block_backward(dout[:, rows], q[:, rows], held_k[j][:, sl], held_v[j][:, sl],
                                                        out[:, rows], lse[:, :, rows], scale=scale, causal_offset=None,
                                                        kernel=self.kernel, mask=mask)
                    dq[:, rows] += gq
                    pending.append(([(j, sl, gk.shape[1])], gk, gv))
                for rows, kk, vv, parts in ([] if masks is not None else
                                            _gather_calls(causal, r, pred, step, units, held_k, held_v)):
                    gq, gk, gv = kernels.block_backward(dout[:, rows], q[:, rows], kk, vv, out[:, rows],
                                                        lse[:, :, rows], scale=scale, causal_offset=None,
                                                        kernel=self.kernel)
                    dq[:, rows] += gq
                    pending.append((parts, gk, gv))
                dk_acc, dv_acc = finish_acc()  # accumulators of the units we hold, from their last holders
                for parts, gk, gv in pending:
                    start = 0
                    for j, sl, n in parts:  # split the concatenated dK/dV back into the units
                        dk_acc[j][:, sl] += gk[:, start:start + n]
                        dv_acc[j][:, sl] += gv[:, start:start + n]
                        start += n
            if p > 1:  # accumulators follow their units one round behind; after the last step the
                finish_acc = _exchange(comm, succ, pred, dk_acc, dv_acc)  # hop reaches each owner
            if step + 1 < p:
                held_k, held_v = finish_kv()
        if p > 1:
            dk_acc, dv_acc = finish_acc()
        return dq.to(q.dtype), units.join(dk_acc).to(k.dtype), units.join(dv_acc).to(v.dtype)
