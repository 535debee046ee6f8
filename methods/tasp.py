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
Without a mask (and without packed documents) the units are instead k contiguous chunks of the
local K/V: any grouping of keys is valid there, and this one makes the units views (`_Units`).
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
    forward:  sent = received = (P-1) * B*L*Hkv*(D+Dv)*e, k units of B*(L/k)*Hkv*(D+Dv)*e per round, one
              to each cycle successor (with k = P-1: one to every other rank); a zigzag unit goes as
              two messages (its halves), a flat one as one
    backward: sent = received = (P-1) * B*L*Hkv*(D+Dv)*e + P * B*L*Hkv*(D+Dv)*a   (causal, or documents)
              without a mask as the K/V ring (methods/kv_ring.py): the accumulators' first hop and
              hop home carry the input dtype, 2 * B*L*Hkv*(D+Dv)*e + (P-2) * B*L*Hkv*(D+Dv)*a
              (D + Dv: the key's and the value's head dims, 2*D but under MLA)
Multi-node: the same single complete graph over all ranks (one batched exchange per round).
Memory beyond inputs and outputs: the units held and being received (two K/V buffers, allocated
once and reused). Own tensor work: no copies of keys at any step. Without a mask a step's k
units are one [B, L] tensor (the local K/V are the first step's units); under the causal mask a
unit is two sequence-major pieces placed each step so that each kernel call's keys are one run
of pieces (`placement`), a view for any batch, and its dK/dV are added back in one op; the split
of the own K/V into pieces and the join of dK/dV are one copy each.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

from methods import accumulators, kernels, layouts, merge
from methods.base import Case, Method, unseen_kv_bytes
from methods.comm.base import P2P, Comm
from methods.hamilton import hamiltonian_cycles, predecessors, successors
from methods.kv_ring import ALL, DoubleBuffer, circulate, kv_ring_bytes
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
    """The k units of a rank's local tokens, held as one buffer of pieces [pieces, rows, ...], each
    piece contiguous for any batch, so it is sent as it is.

    Two layouts:
    - flat (no mask, no documents): unit j is the j-th contiguous chunk of the local tensor
      flattened to [B*L, ...], one piece. Without a mask any grouping of the keys is valid (over the
      P steps every query of sequence b meets every key of sequence b once, whoever holds it; the
      online softmax is order-free), and a step's k units together are exactly a [B, L, ...]
      tensor: the local K/V are the first step's units (views), a step's keys are the whole held
      buffer (one kernel call, a view, any batch), and dK/dV are added back in one op.
    - zigzag (causal, or packed documents): unit j = (front sub-chunk j, back sub-chunk j), the
      zigzag-TASP split, as two pieces [c, B, ...] (sequence-major, as MindSpeed holds them, so a
      piece is one run for any batch) in a buffer [2k, c, B, ...]. Where each piece sits is chosen
      per step (`placement`) so that each kernel call's keys are one run of pieces: the front
      halves of the units from earlier ranks, then the whole units from later ranks, then the
      back halves of the earlier ones (read by no call this step). A call's keys are then a strided
      view [B, n*c, ...] (flash-attn takes any batch and row stride) and its dK/dV are added back
      in one op; split and join (own tokens <-> pieces) are one copy each.
    """

    def __init__(self, q: torch.Tensor, world_size: int, rank: int, causal: bool, flat: bool):
        self.batch, self.local_len = q.shape[0], q.shape[1]
        self.world_size, self.rank, self.causal, self.flat = world_size, rank, causal, flat
        self.k = k = num_cycles(world_size)
        self.c = c = self.local_len // (2 * k)
        self.cpu_rows = [
            torch.cat([torch.arange(j * c, (j + 1) * c), torch.arange(k * c + j * c, k * c + (j + 1) * c)])
            for j in range(k)
        ]  # for the packed documents' masks (host-side positions)

    def pieces(self, step: int) -> tuple[tuple[int, ...], ...]:
        """For each cycle j, the pieces holding its unit at `step` (the owner's layout after the last)."""
        if self.flat:
            return tuple((j,) for j in range(self.k))
        return placement(self.world_size, self.causal, self.rank, step)

    def _zigzag_view(self, x: torch.Tensor) -> torch.Tensor:
        """Local [B, L, ...] as [k, 2, c, B, ...] (unit, half, row, batch): a view."""
        b, _, *rest = x.shape
        return x.view(b, 2, self.k, self.c, *rest).permute(2, 1, 3, 0, *range(4, 4 + len(rest)))

    def split(self, x: torch.Tensor, dtype=None) -> torch.Tensor:
        """Local [B, L, ...] -> the own units' pieces in `dtype` (default x's): flat, a view of x (a
        cast copy when the dtype differs); zigzag, one copy."""
        b, _, *rest = x.shape
        dtype = dtype or x.dtype
        if self.flat:
            units = x.reshape(self.k, -1, *rest)
            return units if units.dtype == dtype else units.to(dtype)
        buf = torch.empty(self.k, 2, self.c, b, *rest, dtype=dtype, device=x.device)
        buf.copy_(self._zigzag_view(x))
        return buf.view(2 * self.k, self.c, b, *rest)

    def join(self, buf: torch.Tensor, dtype) -> torch.Tensor:
        """Inverse of split (the owner's layout), cast to `dtype`: one pass."""
        if self.flat:
            return buf.reshape(self.batch, self.local_len, *buf.shape[2:]).to(dtype)
        _, _, b, *rest = buf.shape
        out = torch.empty(b, self.local_len, *rest, dtype=dtype, device=buf.device)
        self._zigzag_view(out).copy_(buf.view(self.k, 2, self.c, b, *rest))
        return out

    def keys(self, buf: torch.Tensor, pieces: slice) -> torch.Tensor:
        """The keys held in a run of pieces as one sequence [B, n, ...]: a view."""
        if self.flat:  # a call always reads every unit of the step
            return buf.view(self.batch, self.local_len, *buf.shape[2:])
        part = buf[pieces]  # [n, c, B, ...], contiguous
        n, c, b, *rest = part.shape
        return part.view(n * c, b, *rest).transpose(0, 1)

    def add_keys_grad_(self, acc: torch.Tensor, pieces: slice, grad: torch.Tensor) -> None:
        """acc[pieces] += grad, the gradient [B, n, ...] of `keys(acc-shaped, pieces)`: one op."""
        if self.flat:
            acc.view(self.batch, self.local_len, *acc.shape[2:]).add_(grad)
            return
        part = acc[pieces]  # [n, c, B, ...]
        n, c, b, *rest = part.shape
        part.add_(grad.view(b, n, c, *rest).permute(1, 2, 0, *range(3, 3 + len(rest))))


def _exchange(comm: Comm, succ, pred, sends: list[torch.Tensor], send_pieces, recvs: list[torch.Tensor], recv_pieces):
    """For every cycle j, send the unit of cycle j of each buffer in `sends` (e.g. K and V; the
    pieces send_pieces[j]) to the successor on cycle j, and receive the next ones from the
    predecessor into `recvs` (pieces recv_pieces[j]); finish() returns `recvs`.

    The cycles are arc-disjoint, so each pair of ranks carries the units of exactly one cycle, and
    the messages of a pair pair up in list order (tensor by tensor, piece by piece).
    """
    r = comm.rank
    ops = [P2P("send", buf[i], succ[j][r]) for j in range(len(succ)) for buf in sends for i in send_pieces[j]]
    ops += [P2P("recv", buf[i], pred[j][r]) for j in range(len(pred)) for buf in recvs for i in recv_pieces[j]]
    work = comm.exchange(ops)

    def finish() -> list[torch.Tensor]:
        work.wait()
        return recvs

    return finish


@lru_cache(maxsize=None)
def _origins(world_size: int, rank: int, step: int) -> tuple[int, ...]:
    """The origin of the unit held on each cycle at `step`."""
    return tuple(origin(pred, rank, step) for pred in cycle_tables(world_size)[1])


@lru_cache(maxsize=None)
def step_calls(causal: bool, rank: int, world_size: int, step: int, c: int):
    """Kernel calls of step s >= 1, each (query rows, ((unit j, rows of the unit), ...)), no mask
    inside a call (step 0, the local causal block, is not included)."""
    k = num_cycles(world_size)
    if step == 0:
        return ()
    if not causal:
        return ((slice(None), tuple((j, slice(None)) for j in range(k))),)
    origins = _origins(world_size, rank, step)
    before = [j for j in range(k) if origins[j] < rank]
    after = [j for j in range(k) if origins[j] > rank]
    calls = []
    if before:  # every local query sees the front halves of units that came from earlier ranks
        calls.append((slice(None), tuple((j, slice(0, c)) for j in before)))
    if after:  # our back-half queries see the whole units that came from later ranks
        calls.append((slice(k * c, 2 * k * c), tuple((j, slice(None)) for j in after)))
    return tuple(calls)


@lru_cache(maxsize=None)
def placement(world_size: int, causal: bool, rank: int, step: int) -> tuple[tuple[int, int], ...]:
    """For each cycle j, the (front, back) pieces of the zigzag buffer [2k, c, B, ...] holding the
    unit of cycle j at `step`. Own units (step 0, and the owner's layout after the last step) and
    unmasked steps: whole units in cycle order. Causal steps: the front halves of the units from
    earlier ranks (pieces 0..nb-1, one call), the whole units from later ranks (next 2*na pieces,
    the other call), the back halves of the earlier ones last."""
    k = num_cycles(world_size)
    if not causal or step == 0 or step >= world_size:
        return tuple((2 * j, 2 * j + 1) for j in range(k))
    origins = _origins(world_size, rank, step)
    before = [j for j in range(k) if origins[j] < rank]
    after = [j for j in range(k) if origins[j] > rank]
    nb, na = len(before), len(after)
    pos: dict[int, tuple[int, int]] = {}
    for i, j in enumerate(before):
        pos[j] = (i, nb + 2 * na + i)
    for i, j in enumerate(after):
        pos[j] = (nb + 2 * i, nb + 2 * i + 1)
    return tuple(pos[j] for j in range(k))


def _run(pieces: list[int]) -> slice:
    """The pieces of one call as a slice (they are consecutive by construction of `placement`)."""
    lo, hi = min(pieces), max(pieces) + 1
    assert sorted(pieces) == list(range(lo, hi)) and pieces == sorted(pieces), pieces
    return slice(lo, hi)


@lru_cache(maxsize=None)
def piece_calls(world_size: int, causal: bool, rank: int, step: int, c: int) -> tuple[tuple[slice, slice], ...]:
    """Step s >= 1's kernel calls as (query rows, run of pieces of the zigzag buffer), the call over
    every query row last (it can end the forward with the fused final merge)."""
    pos = placement(world_size, causal, rank, step)
    calls = []
    for rows, parts in step_calls(causal, rank, world_size, step, c):
        pieces = [i for j, sl in parts for i in (pos[j][:1] if sl == slice(0, c) else pos[j])]
        calls.append((rows, _run(pieces)))
    return tuple(sorted(calls, key=lambda call: call[0] == ALL))


@register
class TASP(Method):
    name = "tasp"
    description = "TASP: K/V units on arc-disjoint Hamiltonian cycles (all links busy), zigzag-TASP layout"
    layout_kind = "zigzag"
    supports_sinks = True  # folds the sinks once per row (merge.fold_sink) after its last merge
    # At 6 ranks the fallback decomposition (k = P-2 = 4 units of a quarter block) holds another
    # share of a block in flight than the full decompositions (k = P-1) from 7 ranks on, so a peak
    # compared with 6 ranks measures the decomposition, not growth (1.05x from 6 to 12; 1.01x from 7).
    memory_steady_from = 7

    def granule(self, case: Case) -> int:
        return 2 * case.world_size * num_cycles(case.world_size)

    def redundant_kv_bytes(self, case: Case, rank: int) -> Optional[int]:
        """Every unit of every other rank visits this rank (the rounds always run to the end, no
        early stop here): the keys of them its queries do not see."""
        pos = self.layout(case).positions
        return sum(unseen_kv_bytes(case, pos(rank), pos(o)) for o in range(case.world_size) if o != rank)

    def expected_bytes(self, case: Case, pass_: str) -> tuple[int, int]:
        # the ring's bytes, spread over k links per round. The units' accumulators travel as the K/V
        # ring's (first hop and hop home in the input dtype) where the units are views (no mask, no
        # documents); under the zigzag split they travel in fp32 on every hop (the own units' split
        # and the join home are copies anyway, which the cast rides)
        return kv_ring_bytes(case, pass_, input_dtype_ends=not case.causal and case.documents is None)

    def layout(self, case: Case) -> layouts.Layout:
        k = num_cycles(case.world_size)
        if case.seq_len % (2 * case.world_size * k) != 0:
            raise ValueError(
                f"tasp layout needs seq_len divisible by 2 x world_size x cycles = "
                f"{2 * case.world_size * k} ({k} cycles at world_size {case.world_size}); "
                f"got seq_len={case.seq_len}"
            )
        return layouts.zigzag(case.seq_len, case.world_size)

    def _calls(self, masks, causal, r, step, units: _Units):
        """Step s >= 1's kernel calls as (query rows, run of pieces, documents' mask or None), the
        call over every query row last. With packed documents one call per unit (units come from
        different ranks, so their keys are not in one increasing order), each with its mask."""
        p = units.world_size
        if masks is None:
            if units.flat:
                return [(ALL, slice(0, units.k), None)]
            return [(rows, pieces, None) for rows, pieces in piece_calls(p, causal, r, step, units.c)]
        pos, pred = units.pieces(step), cycle_tables(p)[1]
        calls = []
        for rows, parts in step_calls(causal, r, p, step, units.c):
            for j, sl in parts:
                pieces = _run(list(pos[j][:1] if sl == slice(0, units.c) else pos[j]))
                calls.append((rows, pieces, masks(r, rows, origin(pred[j], r, step), units.cpu_rows[j][sl])))
        return sorted(calls, key=lambda call: call[0] == ALL)

    def forward(self, q, k, v, *, comm, causal, scale, return_lse, docs=None, sinks=None):
        p, r = comm.world_size, comm.rank
        succ, pred = cycle_tables(p)
        masks = self.block_masks(q, k, comm, causal, docs)
        units = _Units(q, p, r, causal, flat=not causal and masks is None)
        buffers = DoubleBuffer()
        acc = accumulators.OutputAccumulator(q, v.shape[-1])

        def move(step, block):  # units move on while this step computes (double buffering)
            return _exchange(comm, succ, pred, block, units.pieces(step), buffers(step, block), units.pieces(step + 1))

        def compute(step, block):
            held_k, held_v = block
            if step == 0:  # our own tokens: one aligned causal block
                block_out, block_lse = kernels.block_forward(
                    q,
                    k,
                    v,
                    scale=scale,
                    causal_offset=0 if causal else None,
                    kernel=self.kernel,
                    mask=masks(r, ALL, r, ALL) if masks else None,
                )
                acc.add(ALL, block_out, block_lse, last=p == 1)
                return
            calls = self._calls(masks, causal, r, step, units)
            for i, (rows, pieces, mask) in enumerate(calls):
                block_out, block_lse = kernels.block_forward(
                    q[:, rows],
                    units.keys(held_k, pieces),
                    units.keys(held_v, pieces),
                    scale=scale,
                    causal_offset=None,
                    kernel=self.kernel,
                    mask=mask,
                )
                acc.add(rows, block_out, block_lse, last=step == p - 1 and i == len(calls) - 1)

        circulate(p, [units.split(k), units.split(v)], move=move, compute=compute)
        out, lse = acc.finish()
        if sinks is not None:  # once per row, after the last merge (docs/DESIGN.md section 4)
            out, lse = merge.fold_sink(out, lse, sinks)
        return out, lse, (q, k, v, out, lse, masks)

    def backward(self, dout, residuals, *, comm, causal, scale, docs=None):
        q, k, v, out, lse, masks = residuals
        p, r = comm.world_size, comm.rank
        succ, pred = cycle_tables(p)
        units = _Units(q, p, r, causal, flat=not causal and masks is None)
        acc = merge.acc_dtype(q.dtype)
        kv_buffers, acc_buffers = DoubleBuffer(), DoubleBuffer()
        dq = accumulators.GradAccumulator(q)

        def exchange(buffers):  # the units (or their accumulators) of `step` go on along their cycles
            return lambda step, block: _exchange(
                comm, succ, pred, block, units.pieces(step), buffers(step, block), units.pieces(step + 1)
            )

        def compute(step, block):
            held_k, held_v = block
            if step == 0:
                gq, gk, gv = kernels.block_backward(
                    dout,
                    q,
                    k,
                    v,
                    out,
                    lse,
                    scale=scale,
                    causal_offset=0 if causal else None,
                    kernel=self.kernel,
                    mask=masks(r, ALL, r, ALL) if masks else None,
                )
                dq.add(ALL, gq, last=p == 1)
                return [(None, gk, gv)]
            calls = self._calls(masks, causal, r, step, units)
            pending = []  # contributions, added once the units' accumulators have arrived
            for i, (rows, pieces, mask) in enumerate(calls):
                gq, gk, gv = kernels.block_backward(
                    dout[:, rows],
                    q[:, rows],
                    units.keys(held_k, pieces),
                    units.keys(held_v, pieces),
                    out[:, rows],
                    lse[:, :, rows],
                    scale=scale,
                    causal_offset=None,
                    kernel=self.kernel,
                    mask=mask,
                )
                dq.add(rows, gq, last=step == p - 1 and i == len(calls) - 1)
                pending.append((pieces, gk, gv))
            return pending

        def add(step, dkv, pending):
            if units.flat and p > 1:  # a step's units are one [B, L] tensor: the K/V ring's accumulation,
                # first hop and hop home in the input dtype (accumulators.follow_add)
                whole = slice(0, units.k)
                return [
                    units.split(
                        accumulators.follow_add(
                            None if dkv is None else units.keys(dkv[i], whole),
                            [(ALL, c[i + 1]) for c in pending],
                            like,
                            last_hop=step == p - 1,
                        )
                    )
                    for i, like in enumerate((k, v))
                ]
            if dkv is None:  # own units' accumulators, from our own block's dK/dV
                ((_, gk, gv),) = pending
                return [gk, gv] if p == 1 else [units.split(gk, acc), units.split(gv, acc)]
            for pieces, gk, gv in pending:
                units.add_keys_grad_(dkv[0], pieces, gk)
                units.add_keys_grad_(dkv[1], pieces, gv)
            return dkv

        # accumulators follow their units one round behind; after the last step the hop reaches each owner
        dk_acc, dv_acc = circulate(
            p,
            [units.split(k), units.split(v)],
            move=exchange(kv_buffers),
            compute=compute,
            add=add,
            follow=exchange(acc_buffers),
        )
        if p == 1:
            return dq.finish(), dk_acc, dv_acc
        return dq.finish(), units.join(dk_acc, k.dtype), units.join(dv_acc, v.dtype)
