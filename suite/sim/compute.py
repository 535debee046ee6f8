"""Compute time of one traced block (`Compute` event) on a topology's GPU.

Two sources, per topology (`compute:` section of its YAML):

- a measured table (`table: file.yaml`, written by `python -m suite calibrate` on the real device):
  a block found in it takes its measured time; any other block takes its FLOPs at the achieved
  rate interpolated (in log FLOPs) between measured blocks of the same op, mask class, head dim
  and dtype;
- otherwise a tile model of the flash-attention kernel generation the topology names (`kernel:`
  fa2, fa3 or cudnn), built so that no block can beat the hardware:

  * a call is a grid of work units (programs), as flash-attention schedules it: one per (batch,
    head, query tile row) in the forward, one per (batch, head, key tile column) in the backward;
    a unit walks the tiles (tile shape per generation, op and head dim) that hold at least one
    visible (query, key) pair: a causal block counts only the tiles on or below its diagonal;
  * a unit costs `unit` (loading its own tile, writing its result) + `tile` per fully visible
    tile + `tile x (1 + diag)` per partially visible (masked) tile, the diagonal's and ragged
    edges' tiles;
  * units run on the GPU's SMs in the order the kernel hands them out (`DISPATCH`): FA2 (and
    PyTorch's copy of it) launches a grid whose CTAs the GPU gives, in grid order, to the SM that
    frees first (`dispatch_in_order`): a causal forward's units grow along each head's query rows,
    so the last head's longest rows start last and finish alone, a tail that grows as batch x heads
    shrinks (4 heads of 8K causal rows take as long as the full block on an H100). FA3 hands a
    causal call's longest units out first: wave k (the next S units) starts when the work before
    it, spread over the S SMs, is done, and lasts its longest unit (`makespan`), ceil(N / S) waves
    for N equal units. A split of one FA2 call can recover part of that call's tail (each block
    has a shorter one), never more: the blocks together never beat the call dispatched longest
    first (tests/test_sim_compute.py);
  * plus one launch per call; a block of packed documents that our code runs piece by piece (one
    call per document piece, `Compute.pieces`) costs its pieces' calls, and a varlen call of a peer
    library (`Compute.varlen`: one launch whose grid holds every document's units) its documents'
    units dispatched together.

  `tile`, `unit` and `diag` are derived, once per GPU, generation, op and head dim, from the
  generation's published single-GPU throughput on flash-attention's benchmark grid (the figures in
  the topology file, with their sources): `tile` and `unit` by least squares on the full-mask
  figures (the long-length plateau sets the tile, the short lengths the unit cost), `diag` on the
  causal ones. A tile never runs above the GPU's peak.

Blocks that see no key cost nothing (the methods skip the kernel for them). The methods' own
tensor work between blocks (`Memory` events) costs `op_us` per operation plus its bytes at
`mem_GBps`: measured by calibrate (the table's `memory` section) or the topology's figures.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Optional

import numpy as np
import yaml

from suite.metrics import suite_command
from suite.sim.ledger import Compute, Memory
from suite.sim.topology import Topology, TopologyError

GENERATIONS = ("fa2", "fa3", "cudnn", "torch_flash")  # torch_flash: PyTorch's own CUDA flash attention
# How each generation hands its work units to the SMs (a generation's `dispatch:` in a topology overrides it):
# - grid: one CTA per unit, launched as a grid whose fastest index is the query tile row (forward) or key
#   tile column (backward), then batch, then head (flash-attention 2: flash_fwd_launch_template.h
#   `dim3 grid(num_m_block, params.b, params.h)` with `m_block = blockIdx.x`; flash_bwd_launch_template.h
#   `dim3 grid_n(num_n_block, params.b, params.h)` [P]); PyTorch vendors the same templates [P]. The GPU
#   hands CTAs out in that order to the SM that frees first, so a causal forward's longest rows go last;
# - longest_first: FA3's persistent tile scheduler takes a causal call's longest query tiles first
#   (hopper/tile_scheduler.hpp, the LPT order for causal [P]); cuDNN's order is unpublished [assumed].
DISPATCH = {"fa2": "grid", "torch_flash": "grid", "fa3": "longest_first", "cudnn": "longest_first"}
BENCH_TOKENS = 16384  # flash-attention's benchmark grid: batch x sequence length = 16K tokens,
BENCH_HIDDEN = 2048  # and heads x head dim = 2048 (benchmarks/benchmark_flash_attention.py)


def mask_class(e: Compute) -> str:
    if e.pairs == 0:
        return "empty"
    return "full" if e.pairs == e.sq * e.sk else "masked"


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear interpolation, clamped to the end values."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    j = bisect.bisect_right(xs, x)
    t = (x - xs[j - 1]) / (xs[j] - xs[j - 1])
    return ys[j - 1] + t * (ys[j] - ys[j - 1])


# -- tiles and work units ---------------------------------------------------------------------------
def unit_tiles(op: str, sq: int, sk: int, causal_offset: Optional[int], tile: tuple[int, int]):
    """(full, masked) tile counts of each work unit of one (batch, head), in grid order: query tile
    rows for the forward, key tile columns for the backward. Query i sees key j iff
    j <= i + causal_offset (every key when None). A tile is full when every pair in it is visible
    and it is not cut by the block's edge; a tile with some visible pair and some not is masked."""
    tm, tn = tile
    c = sk if causal_offset is None else causal_offset  # None: every key visible to every query
    kfull = sk // tn  # key tiles not cut by the block's edge
    if op == "fwd":
        r = np.arange(-(-sq // tm), dtype=np.int64)
        first_q, last_q = r * tm, np.minimum((r + 1) * tm, sq) - 1
        last_k = np.minimum(last_q + c, sk - 1)  # the last key any query of the row sees
        n = np.where(last_k >= 0, last_k // tn + 1, 0)
        full = np.clip(np.minimum(kfull, (first_q + c + 1) // tn), 0, n)
        return full, n - full
    j = np.arange(-(-sk // tn), dtype=np.int64)
    rows = -(-sq // tm)
    first_k, last_k = j * tn, np.minimum((j + 1) * tn, sk) - 1
    # the first row tile whose last query sees the column's first key, and whose first query sees its last
    first_row = np.clip(np.where(first_k - c <= 0, 0, (first_k - c) // tm), 0, rows)
    n = np.where(first_k - c <= sq - 1, rows - first_row, 0)
    full_from = np.clip(-(-(last_k - c) // tm), first_row, rows)
    full = np.where(j < kfull, rows - full_from, 0)
    full = np.clip(full, 0, n)
    return full, n - full


def band_tiles(op: str, sq: int, sk: int, off: Optional[int], lower: int, tile: tuple[int, int]):
    """(full, masked) tile counts of each work unit of a band block, query i seeing key j iff
    lower <= j - i <= off (off None: up to the block's edge): the tiles the band meets, full when every
    pair in them is visible and the block's edge does not cut them (as `unit_tiles` counts them)."""
    tm, tn = tile
    top = sk - 1 if off is None else min(off, sk - 1)
    kfull = sk // tn
    if op == "fwd":
        r = np.arange(-(-sq // tm), dtype=np.int64)
        i0, i1 = r * tm, np.minimum((r + 1) * tm, sq) - 1
        j0, j1 = np.maximum(0, i0 + lower), np.minimum(sk - 1, i1 + top)
        meets = j1 >= j0
        n = np.where(meets, j1 // tn - j0 // tn + 1, 0)
        # key tiles wholly inside: from ceil((i1 + lower) / tn) to (i0 + top + 1) // tn - 1, uncut
        first = np.maximum(-(-(i1 + lower) // tn), j0 // tn)
        last = np.minimum(np.minimum((i0 + top + 1) // tn - 1, kfull - 1), j1 // tn)
        full = np.where(meets, np.clip(last - first + 1, 0, n), 0)
        return full, n - full
    t = np.arange(-(-sk // tn), dtype=np.int64)
    k0, k1 = t * tn, np.minimum((t + 1) * tn, sk) - 1
    r0, r1 = np.maximum(0, k0 - top), np.minimum(sq - 1, k1 - lower)  # the query rows the column meets
    meets = r1 >= r0
    n = np.where(meets, r1 // tm - r0 // tm + 1, 0)
    # row tiles wholly inside: rows from k1 - top to k0 - lower, in an uncut column
    first = np.maximum(-(-(k1 - top) // tm), r0 // tm)
    rows = -(-sq // tm)
    last = np.where(k0 - lower >= sq - 1, rows - 1, (k0 - lower + 1) // tm - 1)  # the last row tile may be cut
    last = np.minimum(last, r1 // tm)
    full = np.where(meets & (t < kfull), np.clip(last - first + 1, 0, n), 0)
    return full, n - full


def makespan(values: np.ndarray, counts: np.ndarray, repeat: int, sms: int) -> float:
    """Time of the work units `repeat` x [values[0] x counts[0], values[1] x counts[1], ...] in that
    dispatch order on `sms` SMs: wave k (units k*S .. k*S + S - 1) starts when the work of the
    units before it, spread over the SMs, is done, and lasts its longest unit."""
    per = int(counts.sum())
    n = per * repeat
    if n == 0:
        return 0.0
    cum_n = np.concatenate(([0], np.cumsum(counts)))  # units before each group within one repeat
    cum_w = np.concatenate(([0.0], np.cumsum(values * counts)))
    w_rep, vmax = float(cum_w[-1]), float(values.max())

    def before(i: int) -> float:  # work of the first i units
        rep, pos = divmod(i, per)
        g = int(np.searchsorted(cum_n, pos, side="right")) - 1
        return rep * w_rep + float(cum_w[g]) + (pos - int(cum_n[g])) * float(values[g])

    def longest(a: int, b: int) -> float:  # longest unit among units a .. b - 1
        if b - a >= per:
            return vmax
        ga = int(np.searchsorted(cum_n, a % per, side="right")) - 1
        gb = int(np.searchsorted(cum_n, (b - 1) % per, side="right")) - 1
        if (a // per) == ((b - 1) // per):
            return float(values[ga : gb + 1].max())
        return max(float(values[ga:].max()), float(values[: gb + 1].max()))

    best = 0.0
    for k in range(-(-n // sms) - 1, -1, -1):  # the last waves decide; stop once no earlier one can
        start = before(k * sms) / sms
        if start + vmax <= best:
            break
        best = max(best, start + longest(k * sms, min((k + 1) * sms, n)))
    return best


def dispatch_in_order(values: np.ndarray, repeat: int, sms: int, span: int = 64) -> float:
    """Time of the work units `repeat` x values (one (batch, head)'s units, in grid order) when the
    GPU hands each unit, in grid order, to the SM that frees first (a CUDA grid's block scheduler;
    flash-attention 2's launch order). A causal forward's units grow along a head's query rows, so
    the last head's longest rows start last and run alone: the tail that leaves a short grid's SMs
    idle (4 heads of 8K causal rows take as long as the full block on an H100,
    reports/recorded/h100_torch_flash.blocks.yaml). Exact greedy list scheduling over the last
    `span` x `sms` units (whole repeats), the work before them spread evenly over the SMs: within
    0.3 % of the exact schedule of every unit (tests/test_sim_compute.py)."""
    per = len(values)
    if per == 0 or repeat == 0:
        return 0.0
    if float(np.ptp(values)) == 0.0:  # equal units: whole waves in any order
        return makespan(np.asarray(values[:1], dtype=float), np.array([per]), repeat, sms)
    vals = [float(v) for v in values]
    k = repeat if per * repeat <= 2 * span * sms else min(repeat, -(-span * sms // per))
    start = (repeat - k) * sum(vals) / sms
    free = [start] * sms
    put = heapq.heapreplace
    for _ in range(k):
        for t in vals:
            put(free, free[0] + t)
    return max(free)


@dataclass(frozen=True)
class TileCost:
    """One generation's kernel for one op, head dim and mask kind: its tile and the derived costs."""

    tile: tuple[int, int]  # (query rows, key columns)
    tile_s: float  # one fully visible tile on one SM
    unit_s: float  # a work unit's fixed cost
    diag: float  # a masked tile costs tile_s x (1 + diag)
    order: str = "longest_first"  # how the kernel hands its units to the SMs: DISPATCH

    def call(self, op: str, units: int, sq: int, sk: int, causal_offset: Optional[int], sms: int) -> float:
        """Time of one call of `units` (batch x heads) copies of the block's unit pattern, launch excluded."""
        full, masked = unit_tiles(op, sq, sk, causal_offset, self.tile)
        return self.run(self.unit_times(full, masked), full + masked, units, sms)

    def unit_times(self, full: np.ndarray, masked: np.ndarray) -> np.ndarray:
        """Each work unit's time from its full and masked tiles."""
        return self.unit_s + self.tile_s * (full + masked * (1.0 + self.diag))

    def run(self, t: np.ndarray, tiles: np.ndarray, units: int, sms: int) -> float:
        """Time of `units` copies of the unit times `t` (grid order) on the SMs, in this kernel's order."""
        t = t[tiles > 0]  # units that see no key exit at once
        if t.size == 0:
            return 0.0
        if self.order == "grid":
            return dispatch_in_order(t, units, sms)
        vals, cnts = np.unique(t, return_counts=True)
        return makespan(vals[::-1], cnts[::-1] * units, 1, sms)


# -- deriving the costs from published throughput ----------------------------------------------------
def _bench_time(cost: TileCost, op: str, d: int, tokens: int, causal: bool, sms: int) -> float:
    batch, heads = BENCH_TOKENS // tokens, BENCH_HIDDEN // d
    return cost.call(op, batch * heads, tokens, tokens, 0 if causal else None, sms)


def _bench_measured(op: str, d: int, tokens: int, causal: bool, tflops: float) -> float:
    """Seconds of one benchmark call from its published TFLOP/s (flash-attention's FLOP convention:
    4 b s^2 h d, halved when causal, backward 2.5x)."""
    batch, heads = BENCH_TOKENS // tokens, BENCH_HIDDEN // d
    flops = 4.0 * batch * tokens * tokens * heads * d * (0.5 if causal else 1.0) * (2.5 if op == "bwd" else 1.0)
    return flops / (tflops * 1e12)


@lru_cache(maxsize=None)
def derive(
    op: str,
    d: int,
    tile: tuple[int, int],
    causal_tile: tuple[int, int],
    tokens: tuple[int, ...],
    full: tuple[Optional[float], ...],
    causal: tuple[Optional[float], ...],
    diag_default: float,
    sms: int,
    peak_tflops: float,
    order: str = "longest_first",
) -> tuple[TileCost, TileCost]:
    """(full-mask cost, causal cost) of one generation, op and head dim from its published figures,
    its units dispatched in `order` (the full-mask figures do not depend on it: equal units).
    `tile_s` and `unit_s`: least squares on the relative error of the full-mask figures (the model
    is linear in both); `diag`: golden-section search on the causal figures (or `diag_default`
    when none are published). The tile's rate is capped at the GPU's peak."""
    pts = [(s, v) for s, v in zip(tokens, full) if v]
    if not pts:
        raise TopologyError(f"no full-mask figures for {op} head dim {d}")
    rows_a, rows_b = [], []
    for s, v in pts:
        meas = _bench_measured(op, d, s, False, v)
        # with unit_s = 1, tile_s = 0 the call time counts the waves; with (0, 1) the waves x tiles
        waves = _bench_time(TileCost(tile, 0.0, 1.0, 0.0), op, d, s, False, sms)
        tiles = _bench_time(TileCost(tile, 1.0, 0.0, 0.0), op, d, s, False, sms)
        rows_a.append([waves / meas, tiles / meas])
        rows_b.append(1.0)
    (unit_s, tile_s), *_ = np.linalg.lstsq(np.array(rows_a), np.array(rows_b), rcond=None)
    if unit_s < 0:  # no per-unit cost visible in the figures
        unit_s = 0.0
        a = np.array(rows_a)[:, 1]
        tile_s = float(a.sum() / (a * a).sum())
    floor = 4.0 * tile[0] * tile[1] * d * (2.5 if op == "bwd" else 1.0) * sms / (peak_tflops * 1e12)
    tile_s = max(float(tile_s), floor)  # never faster than the tensor cores' peak
    base = TileCost(tile, tile_s, float(unit_s), 0.0, order)
    # the causal tile (FA3 picks a squarer one) costs in proportion to its area
    ctile_s = tile_s * causal_tile[0] * causal_tile[1] / (tile[0] * tile[1])
    cpts = [(s, v) for s, v in zip(tokens, causal) if v]

    def loss(diag: float) -> float:
        cost = TileCost(causal_tile, ctile_s, float(unit_s), diag, order)
        return sum(
            (_bench_time(cost, op, d, s, True, sms) / _bench_measured(op, d, s, True, v) - 1.0) ** 2 for s, v in cpts
        )

    diag = diag_default
    if cpts:
        lo, hi = 0.0, 4.0
        g = (math.sqrt(5) - 1) / 2
        for _ in range(40):
            m1, m2 = hi - g * (hi - lo), lo + g * (hi - lo)
            if loss(m1) <= loss(m2):
                hi = m2
            else:
                lo = m1
        diag = (lo + hi) / 2
    return base, TileCost(causal_tile, ctile_s, float(unit_s), diag, order)


class ComputeModel:
    def __init__(self, topology: Topology):
        self.topology = topology
        c = topology.compute
        self.launch_s = float(c.get("launch_us", 0.0)) * 1e-6
        self.peak = {k: float(v) * 1e12 for k, v in (c.get("peak_tflops") or {}).items()}
        self.table: dict[Compute, float] = {}
        self.rates: dict[tuple, tuple[list[float], list[float]]] = {}
        self.mem_Bps = float(c.get("mem_GBps", 0.0)) * 1e9
        self.op_s = float(c.get("op_us", 0.0)) * 1e-6
        self.kernel = str(c.get("kernel", "fa2"))
        self.sms = int(c.get("sms", 0))
        self._times: dict[Compute, float] = {}
        if c.get("table"):
            path = Path(c["table"])
            if not path.is_absolute() and topology.source is not None:
                path = topology.source.parent / path
            self._load_table(path)
            self.source = f"measured table {path.name}"
            return
        gens = c.get("kernels") or {}
        if not self.peak or not self.sms or self.kernel not in gens:
            raise TopologyError(
                f"topology {topology.name}: compute needs peak_tflops, sms, kernel and that kernel's figures "
                f"under kernels (tile model), or a table"
            )
        if self.kernel not in GENERATIONS:
            raise TopologyError(f"topology {topology.name}: compute.kernel must be one of {', '.join(GENERATIONS)}")
        self.gen = gens[self.kernel]
        self.order = str(self.gen.get("dispatch", DISPATCH[self.kernel]))
        if self.order not in ("grid", "longest_first"):
            raise TopologyError(
                f"topology {topology.name}: kernels.{self.kernel}.dispatch must be grid or longest_first, "
                f"got {self.order!r}"
            )
        self.source = f"tile model {self.kernel} {topology.gpu}"

    def _load_table(self, path: Path) -> None:
        if not path.is_file():
            raise TopologyError(
                f"topology {self.topology.name}: compute table {path} not found "
                f"(write it with `{suite_command()} calibrate`)"
            )
        data = yaml.safe_load(path.read_text()) or {}
        mem = data.get("memory") or {}
        if mem:
            self.mem_Bps, self.op_s = float(mem["GBps"]) * 1e9, float(mem["op_us"]) * 1e-6
        by_class: dict[tuple, list[tuple[float, float]]] = {}
        for b in data.get("blocks", []):
            e = Compute.from_row(b)
            self.table[e] = float(b["seconds"])
            if e.pairs:
                by_class.setdefault((e.op, mask_class(e), e.width, e.dtype), []).append(
                    (math.log(e.flops), e.flops / float(b["seconds"]))
                )
        for k, pts in by_class.items():
            pts.sort()
            self.rates[k] = ([p[0] for p in pts], [p[1] for p in pts])

    def supports(self, dtype: str, head_dim: int) -> tuple[bool, str]:
        if self.table:
            if any(k[2:] == (head_dim, dtype) for k in self.rates):
                return True, ""
            return False, f"the compute table of {self.topology.name} has no {dtype} blocks of head dim {head_dim}"
        if dtype not in self.peak:
            return False, f"topology {self.topology.name} gives no {dtype} rate for {self.topology.gpu}"
        return True, ""

    # -- the tile model --------------------------------------------------------------------------------
    def _entry(self, op: str, head_dim: int) -> tuple[int, dict]:
        """The published figures of `op` at the listed head dim nearest `head_dim`."""
        figs = {int(k): v for k, v in (self.gen.get(op) or {}).items()}
        if not figs:
            raise TopologyError(f"topology {self.topology.name}: kernels.{self.kernel} has no {op} figures")
        near = min(figs, key=lambda k: (abs(math.log(k / head_dim)), -k))
        return near, figs[near]

    def _diag_donor(self, op: str, head_dim: int) -> float:
        """A masked tile's extra cost where `op` at this head dim has no causal figures: derived from
        the nearest head dim of the same op that has them, else of the forward, else the
        generation's `diag` [assumed]."""
        for o in (op, "fwd"):
            figs = {int(k): v for k, v in (self.gen.get(o) or {}).items() if v.get("causal")}
            if figs:
                near = min(figs, key=lambda k: (abs(math.log(k / head_dim)), -k))
                return self._derived(o, near, figs[near], 0.0)[1].diag
        return float(self.gen.get("diag", 0.0))

    def _derived(self, op: str, d: int, f: dict, diag_default: float) -> tuple[TileCost, TileCost]:
        tokens = tuple(int(t) for t in (f.get("tokens") or self.gen["tokens"]))
        tile = (int(f["tile"][0]), int(f["tile"][1]))
        causal_tile = (int(f.get("causal_tile", tile)[0]), int(f.get("causal_tile", tile)[1]))
        pad = (None,) * len(tokens)
        return derive(
            op,
            d,
            tile,
            causal_tile,
            tokens,
            (tuple(f["full"]) + pad)[: len(tokens)],
            (tuple(f.get("causal") or ()) + pad)[: len(tokens)],
            diag_default,
            self.sms,
            max(self.peak.values()),
            self.order,
        )

    def costs(self, op: str, head_dim: int) -> tuple[TileCost, TileCost]:
        """(full-mask, causal) tile costs of this topology's kernel for `op` at `head_dim`. A head dim
        without figures takes the nearest listed one's, its tile time scaled by the head dims' ratio
        (a tile's FLOPs are proportional to it) [assumed]."""
        near, f = self._entry(op, head_dim)
        diag_default = 0.0 if f.get("causal") else self._diag_donor(op, head_dim)
        full, causal = self._derived(op, near, f, diag_default)
        if near != head_dim:
            k = head_dim / near
            full = replace(full, tile_s=full.tile_s * k)
            causal = replace(causal, tile_s=causal.tile_s * k)
        return full, causal

    def _call(
        self,
        op: str,
        batch: int,
        heads: int,
        head_dim: int,
        sq: int,
        sk: int,
        off: Optional[int],
        lower: Optional[int] = None,
    ) -> float:
        full, causal = self.costs(op, head_dim)
        if lower is not None:  # a band: the tiles it meets
            return self._band_call(op, batch * heads, head_dim, sq, sk, off, lower)
        cost = full if off is None or off >= sk - 1 else causal
        t = cost.call(op, batch * heads, sq, sk, off, self.sms)
        return self.launch_s + t if t > 0 else 0.0

    def _band_call(self, op: str, bh: int, head_dim: int, sq: int, sk: int, off: Optional[int], lower: int) -> float:
        """A band block (lower <= j - i <= off, a sliding window): a windowed kernel (flash-attn's window
        skips the tiles outside it) walks, in each work unit, only the tiles the band meets: those
        wholly inside the band are full, the two diagonals' tiles masked (`band_tiles`); units are
        costed and dispatched as a causal call's are, so a band as wide as the block costs the causal
        block."""
        _, causal = self.costs(op, head_dim)
        full, masked = band_tiles(op, sq, sk, off, lower, causal.tile)
        t = causal.run(causal.unit_times(full, masked), full + masked, bh, self.sms)
        return self.launch_s + t if t > 0 else 0.0

    def _varlen_call(self, e: Compute) -> float:
        """One varlen launch (flash-attn's varlen kernels): its grid holds every document's work units,
        document after document within each head, dispatched together, plus one launch. A causal
        call takes the causal kernel's costs for every document."""
        assert e.pieces is not None
        full, causal = self.costs(e.op, e.width)
        masked = any(off is not None and off < sk - 1 for (_, sk, off, _), _ in e.pieces)
        cost = causal if masked else full
        times, tiles = [], []
        for (sq, sk, off, lower), n in e.pieces:
            if lower is not None:
                f, m = band_tiles(e.op, sq, sk, off, lower, cost.tile)
            else:
                f, m = unit_tiles(e.op, sq, sk, off, cost.tile)
            times += [cost.unit_times(f, m)] * n
            tiles += [f + m] * n
        t = cost.run(np.concatenate(times), np.concatenate(tiles), e.batch * e.heads, self.sms)
        return self.launch_s + t if t > 0 else 0.0

    def _tile_time(self, e: Compute) -> float:
        if e.pieces is not None and e.varlen:
            return self._varlen_call(e)
        if e.pieces is not None:  # packed documents our code runs piece by piece: one call each
            return sum(
                n * self._call(e.op, 1, e.heads, e.width, sq, sk, off, lower) for (sq, sk, off, lower), n in e.pieces
            )
        if e.doc_pairs is not None and e.causal_offset is None and e.pairs < e.sq * e.sk:
            # a partly visible block whose pieces the event does not carry: its visible pairs bound its
            # tiles from below (as if packed into whole tiles, spread evenly over the block's rows, one call)
            _, causal = self.costs(e.op, e.width)
            tm, tn = causal.tile
            rows = -(-e.sq // tm) if e.op == "fwd" else -(-e.sk // tn)
            unit = causal.unit_s + e.pairs / (tm * tn) / rows * causal.tile_s
            return self.launch_s + makespan(np.array([unit]), np.array([rows]), e.batch * e.heads, self.sms)
        return self._call(e.op, e.batch, e.heads, e.width, e.sq, e.sk, e.causal_offset)

    def time(self, e: Compute | Memory) -> float:
        if isinstance(e, Memory):
            return e.ops * self.op_s + (e.bytes / self.mem_Bps if self.mem_Bps else 0.0)
        if e.pairs == 0:
            return 0.0
        if self.table:
            hit = self.table.get(e)
            if hit is not None:
                return hit
            cls = (e.op, mask_class(e), e.width, e.dtype)
            if cls not in self.rates:
                raise TopologyError(
                    f"compute table of {self.topology.name} has no {cls} blocks near {e}; calibrate with this sweep"
                )
            xs, ys = self.rates[cls]
            return e.flops / _interp(xs, ys, math.log(e.flops))
        t = self._times.get(e)
        if t is None:
            t = self._times[e] = self._tile_time(e)
        return t
