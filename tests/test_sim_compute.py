"""The simulator's kernel model (suite/sim/compute.py): a block's time from its tiles, built so that
no prediction can beat the hardware. Each test checks one property the model must have."""

import itertools
from dataclasses import replace

import numpy as np
import pytest

import methods
from methods.base import Case
from methods.documents import Documents
from methods.kernels import visible_pairs
from suite.sim.compute import ComputeModel, _bench_measured, _bench_time, dispatch_in_order, makespan, unit_tiles
from suite.sim.engine import replay
from suite.sim.ledger import Compute
from suite.sim.topology import available_topologies, load_topology
from suite.sim.trace import TraceCache, trace


def models():
    """A compute model per shipped topology, and per kernel generation of those that list several."""
    out = []
    for name in available_topologies():
        topo = load_topology(name)
        for gen in topo.compute.get("kernels") or {}:
            out.append((f"{name}-{gen}", ComputeModel(replace(topo, compute={**topo.compute, "kernel": gen}))))
    return out


MODELS = models()
MASKS = {"full": lambda s: None, "causal": lambda s: 0, "offset": lambda s: s // 3}


def block(op, batch, heads, head_dim, sq, sk, offset):
    return Compute(op, batch, sq, sk, heads, heads, head_dim, offset, "bfloat16")


def test_tile_counts_match_the_mask_tile_by_tile():
    """Each work unit's full and masked tiles (query rows forward, key columns backward) equal a
    count over the dense mask: full = every pair visible and not cut by the block's edge."""
    for op, sq, sk, c, (tm, tn) in itertools.product(
        ("fwd", "bwd"), (1, 5, 100, 200), (1, 7, 130), (None, 0, -3, 5, 40, -70, 150), ((16, 32), (64, 64))
    ):
        vis = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk if c is None else c)
        rows, cols = -(-sq // tm), -(-sk // tn)
        seen = np.array(
            [[vis[r * tm : (r + 1) * tm, k * tn : (k + 1) * tn].any() for k in range(cols)] for r in range(rows)]
        )
        full = np.array(
            [
                [vis[r * tm : (r + 1) * tm, k * tn : (k + 1) * tn].all() and (k + 1) * tn <= sk for k in range(cols)]
                for r in range(rows)
            ]
        )
        axis = 1 if op == "fwd" else 0
        f, m = unit_tiles(op, sq, sk, c, (tm, tn))
        assert (f == full.sum(axis)).all() and (m == (seen & ~full).sum(axis)).all(), (op, sq, sk, c, tm, tn)


def test_equal_units_take_whole_waves_and_longest_first_fills_the_last():
    one = np.array([2.0])
    assert makespan(one, np.array([132]), 1, 132) == 2.0
    assert makespan(one, np.array([133]), 1, 132) == 4.0  # one unit more: a second wave
    assert makespan(one, np.array([264]), 1, 132) == 4.0
    # 132 long units then one short one: the short one waits for the first SM to free up
    assert makespan(np.array([5.0, 1.0]), np.array([132, 1]), 1, 132) == 6.0


def test_dispatch_in_grid_order_is_greedy_list_scheduling():
    """FA2's CTAs go, in grid order, to the SM that frees first: exact greedy list scheduling on
    small grids, and on large ones (only the last units simulated, the work before them spread
    evenly) within 0.3 % of it. A causal forward's rows grow along a head, so the last head's
    longest rows start last: a tail that longest-first dispatch (FA3) does not have."""
    import heapq

    def greedy(values, repeat, sms):
        free = [0.0] * sms
        for _ in range(repeat):
            for t in values:
                heapq.heapreplace(free, free[0] + t)
        return max(free)

    for per, repeat, sms in itertools.product((7, 64, 256, 1024), (1, 5, 32, 128), (108, 132)):
        for values in (np.arange(1, per + 1) * 1e-6, np.arange(per, 0, -1) * 1e-6):
            exact = greedy(list(values), repeat, sms)
            assert dispatch_in_order(values, repeat, sms) == pytest.approx(exact, rel=3e-3), (per, repeat, sms)
    # units of 1..4 time units, one head: four SMs take them at once, the longest ends last
    assert dispatch_in_order(np.array([1.0, 2.0, 3.0, 4.0]), 1, 4) == 4.0
    # two heads of rows 1..4 on 4 SMs: the second head's rows go to the SMs as they free (at 1, 2, 2,
    # 3), and its row of 4 starts last, at 3; longest first the same units take 5.5 (waves of 4)
    assert dispatch_in_order(np.array([1.0, 2.0, 3.0, 4.0]), 2, 4) == 7.0
    assert makespan(np.array([4.0, 3.0, 2.0, 1.0]), np.full(4, 2), 1, 4) == 5.5
    # equal units: whole waves in any order
    assert dispatch_in_order(np.full(10, 2.0), 27, 132) == 6.0


def _work(cm: ComputeModel, e: Compute) -> float:
    """A plain block's work: its units' times summed and spread over the SMs, plus its launch (what it
    would take if no SM ever idled)."""
    full, causal = cm.costs(e.op, e.head_dim)
    cost = full if e.causal_offset is None or e.causal_offset >= e.sk - 1 else causal
    f, m = unit_tiles(e.op, e.sq, e.sk, e.causal_offset, cost.tile)
    t = cost.unit_times(f, m)[(f + m) > 0]
    return cm.launch_s + float(t.sum()) * e.batch * e.heads / cm.sms if t.size else 0.0


@pytest.mark.parametrize("label,cm", MODELS, ids=[m[0] for m in MODELS])
def test_splitting_a_call_into_blocks_never_beats_its_work(label, cm):
    """Property 1: the P blocks of one call (by queries, by keys, or both, as ring schedules cut it)
    never take less than the call's work (its units spread over the SMs with none idle: splitting
    adds launches, partial waves and cut tiles, never less work), for every mask class and
    P = 2..16. A kernel that hands out its longest units first (FA3, cuDNN) is never beaten by its
    blocks at all. FA2's grid order gives a causal call a tail, its longest rows starting last, which
    its blocks share out (each has a shorter one): they may take less than the call itself, by at
    most that tail (here under 10 %, at 1000 tokens; tests/test_sim.py and the tests below hold
    every own method at or under 100 % of ideal all the same)."""
    grid = cm.order == "grid"
    for op, (b, h, d), s, mask in itertools.product(
        ("fwd", "bwd"), ((1, 32, 128), (2, 5, 64)), (1000, 8064, 131072), MASKS
    ):
        c = MASKS[mask](s)
        call = block(op, b, h, d, s, s, c)
        one, work = cm.time(call), _work(cm, call)
        assert work <= one * (1 + 1e-12)
        for p in range(2, 17):
            cuts = [(i * s // p, (i + 1) * s // p) for i in range(p)]
            for split in ("q", "k", "qk"):
                qs = cuts if "q" in split else [(0, s)]
                ks = cuts if "k" in split else [(0, s)]
                total = sum(
                    cm.time(block(op, b, h, d, qb - qa, kb - ka, None if c is None else c + qa - ka))
                    for (qa, qb), (ka, kb) in itertools.product(qs, ks)
                )
                where = (label, op, b, h, d, s, mask, p, split, total / one)
                assert total >= work * (1 - 1e-12), where
                assert total >= one * (1 - 1e-12) or (grid and total >= 0.9 * one), where


@pytest.mark.parametrize("label,cm", MODELS, ids=[m[0] for m in MODELS])
def test_causal_efficiency_approaches_full_mask_efficiency_with_length(label, cm):
    """Property 2: the causal call's rate over the full call's tends to 1 with the length (at a
    length where the full call's last wave is short the causal one, filling its waves longest
    first, can edge past it)."""
    for op in ("fwd", "bwd"):
        ratios = []
        for s in (4096, 65536, 1 << 20):
            full, causal = block(op, 1, 32, 128, s, s, None), block(op, 1, 32, 128, s, s, 0)
            ratios.append((causal.flops / cm.time(causal)) / (full.flops / cm.time(full)))
        gaps = [abs(1 - r) for r in ratios]
        assert gaps[0] > gaps[2] and gaps[2] < 0.02 and max(ratios) < 1.01, (label, op, ratios)


def test_a_packed_block_costs_its_documents_tiles():
    """Property 3: a block of packed documents that our code runs piece by piece (one flash call per
    document piece) costs those calls, not the tiles of its whole size; the tracer records the
    pieces, and they hold exactly the block's visible pairs."""
    cm = ComputeModel(load_topology("h100_sxm"))
    docs = Documents(((1024,) * 8, (4096, 2048, 2048)), 8192)
    case = Case(batch=2, seq_len=8192, heads=8, kv_heads=8, head_dim=128, dtype="bfloat16", causal=True, world_size=2)
    case = replace(case, documents=docs)
    tr = trace("zigzag_ring", case, "fwd")
    packed = [e for r in range(2) for e in tr.compute(r) if e.pieces is not None]
    assert packed
    for e in packed:
        assert sum(n * visible_pairs(sq, sk, off) for (sq, sk, off, _), n in e.pieces) == e.doc_pairs
        calls = sum(n * cm.time(block("fwd", 1, e.heads, e.head_dim, sq, sk, off)) for (sq, sk, off, _), n in e.pieces)
        assert cm.time(e) == pytest.approx(calls)
    # eight documents of 1K in one 8K causal sequence: an eighth of the whole causal call's pairs, in eight
    # short calls (256 units each on 132 SMs, each with its launch and causal tail): more than an eighth of
    # its time, well under a third
    pieces = (((1024, 1024, 0, None), 8),)
    e = Compute("fwd", 1, 8192, 8192, 32, 8, 128, None, "bfloat16", doc_pairs=8 * 1024 * 1025 // 2, pieces=pieces)
    whole = cm.time(block("fwd", 1, 32, 128, 8192, 8192, 0))
    assert 1 / 8 < cm.time(e) / whole < 0.3
    # the same documents in one varlen call (a peer library's: one launch, every document's units in one
    # grid) cost less than eight calls and more than the pairs at the whole call's rate
    one_call = replace(e, varlen=True)
    assert whole / 8 < cm.time(one_call) < cm.time(e)
    # without its pieces, the visible pairs bound the tiles from below
    bare = replace(e, pieces=None)
    assert cm.time(bare) <= cm.time(e) and cm.time(bare) > whole * e.pairs / (8192 * 8193 / 2) * 0.9


@pytest.mark.parametrize("label,cm", MODELS, ids=[m[0] for m in MODELS])
def test_head_dim_changes_the_rate(label, cm):
    """Property 4a: at head dim 64 a block does half the FLOPs of head dim 128 in more than half the time."""
    for op, mask in itertools.product(("fwd", "bwd"), MASKS):
        s = 16384
        t64 = cm.time(block(op, 1, 32, 64, s, s, MASKS[mask](s)))
        t128 = cm.time(block(op, 1, 32, 128, s, s, MASKS[mask](s)))
        assert 0.5 < t64 / t128 < 1.0, (label, op, mask, t64 / t128)


def test_the_kernel_generation_changes_the_rate():
    """Property 4b: on H100, FA3 and cuDNN blocks are faster than FA2's, as their published figures."""
    topo = load_topology("h100_sxm")
    gen = {g: ComputeModel(replace(topo, compute={**topo.compute, "kernel": g})) for g in ("fa2", "fa3", "cudnn")}
    for op, s in itertools.product(("fwd", "bwd"), (4096, 65536)):
        for mask in MASKS:
            e = block(op, 1, 32, 128, s, s, MASKS[mask](s))
            assert gen["fa3"].time(e) < 0.8 * gen["fa2"].time(e), (op, s, mask)
            assert gen["cudnn"].time(e) < 0.8 * gen["fa2"].time(e), (op, s, mask)


@pytest.mark.parametrize("label,cm", MODELS, ids=[m[0] for m in MODELS])
def test_no_block_runs_above_the_gpus_peak(label, cm):
    """Property 5."""
    peak = cm.peak["bfloat16"]
    for op, (b, h, d), s, mask in itertools.product(
        ("fwd", "bwd"), ((1, 32, 128), (8, 32, 64), (1, 4, 256), (1, 2, 32)), (64, 1000, 16384, 1 << 20), MASKS
    ):
        e = block(op, b, h, d, s, s, MASKS[mask](s))
        assert e.flops / cm.time(e) < peak, (label, e)


def test_the_derived_costs_reproduce_the_published_figures():
    """The tile, unit and masked-tile costs are derived from the topology's kernel figures; they give
    back the full-mask figures within 6 % and the causal ones within 20 % (the causal tail of FA2's
    grid-order dispatch is not modelled, see suite/sim/compute.py, nor what holds FA3's causal calls
    below its full-mask rate at 16K)."""
    for label, cm in MODELS:
        for op, figs in ((o, cm.gen.get(o) or {}) for o in ("fwd", "bwd")):
            for d, f in figs.items():
                full, causal = cm.costs(op, int(d))
                for kind, cost, bound in (("full", full, 0.06), ("causal", causal, 0.2)):
                    for s, v in zip(f.get("tokens") or cm.gen["tokens"], f.get(kind) or []):
                        if v:
                            t = _bench_time(cost, op, int(d), s, kind == "causal", cm.sms)
                            err = _bench_measured(op, int(d), s, kind == "causal", v) / t - 1
                            assert abs(err) < bound, (label, op, d, kind, s, err)


# -- the own methods against ideal on every topology ----------------------------------------------------
LENGTHS = (8064, 64512, 1032192)  # 8K to 1M tokens; multiples of 4P and of TASP's 2P(P-1) at P = 4


def test_no_method_beats_ideal_on_any_topology():
    """No own method, at any length on any shipped topology, is predicted above 100 % of ideal (the
    single-device reference's predicted time of the whole problem / P) or faster than P times
    one GPU. Communication costs only add time, so this holds for any link and overlap model. Also
    with 4 heads, where FA2's grid-order dispatch gives the single-device causal call its longest
    tail (a short grid), which the methods' smaller blocks could share out."""
    cache = TraceCache()
    p = 4
    worst = (0.0, None)
    shapes = [((32, 8), n) for n in LENGTHS] + [((4, 1), n) for n in LENGTHS[:2]]
    for name in available_topologies():
        topo = load_topology(name)
        cm = ComputeModel(topo)
        for causal, ((heads, kv_heads), seq_len), pass_ in itertools.product((True, False), shapes, ("fwd", "fwd_bwd")):
            case = Case(
                batch=1,
                seq_len=seq_len,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=128,
                dtype="bfloat16",
                causal=causal,
                world_size=p,
            )
            ref = replay(cache.get("reference", replace(case, world_size=1), pass_), topo, cm.time).time_s
            for m in methods.group_members("own"):
                try:
                    tr = cache.get(m, case, pass_)
                except ValueError:  # the method does not support this case
                    continue
                t = replay(tr, topo, cm.time, comm=False).time_s  # compute alone: the least any link allows
                pct = 100 * (ref / p) / t
                worst = max(worst, (pct, (name, m, causal, heads, seq_len, pass_)))
                assert pct <= 100.0, (name, m, causal, heads, seq_len, pass_, pct)
    print("closest to ideal:", worst)
    assert worst[0] > 50  # the check sees methods near ideal, not only slow ones


# -- masks other than the plain ones ----------------------------------------------------------------------
def test_band_tiles_match_the_mask_tile_by_tile():
    """A band block's full and masked tiles per work unit (`band_tiles`) equal a dense count over its
    mask; a band as wide as the block has a causal block's tiles."""
    import torch

    from suite.sim.compute import band_tiles

    for op, sq, sk, off, lower, tile in itertools.product(
        ("fwd", "bwd"), (100, 256), (100, 300), (None, 0, 37), (-1, -50, -260, 5), ((32, 16), (64, 64))
    ):
        if off is not None and lower > off:
            continue
        tm, tn = tile
        d = torch.arange(sk)[None, :] - torch.arange(sq)[:, None]
        vis = (d >= lower) & (d <= (sk - 1 if off is None else off))
        rows, cols = -(-sq // tm), -(-sk // tn)
        full, seen = np.zeros((rows, cols), bool), np.zeros((rows, cols), bool)
        for r, c in itertools.product(range(rows), range(cols)):
            t = vis[r * tm : (r + 1) * tm, c * tn : (c + 1) * tn]
            seen[r, c], full[r, c] = bool(t.any()), bool(t.all()) and (c + 1) * tn <= sk
        axis = 1 if op == "fwd" else 0
        want = (full.sum(axis), seen.sum(axis) - full.sum(axis))
        got = band_tiles(op, sq, sk, off, lower, tile)
        assert all(np.array_equal(g, w) for g, w in zip(got, want)), (op, sq, sk, off, lower, tile, got, want)
    for op in ("fwd", "bwd"):
        got, want = band_tiles(op, 512, 512, 0, -511, (128, 64)), unit_tiles(op, 512, 512, 0, (128, 64))
        assert all(np.array_equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_a_band_costs_between_its_pairs_and_the_causal_block_and_grows_with_the_window(op):
    """A band block (a causal sliding window of w keys, `_band_call`: a windowed kernel walks only the
    tiles the band meets) takes at least its visible pairs at the full-mask block's rate per pair and
    at most the causal block it lies in, and takes longer as the window widens."""
    from methods.documents import _band_pairs

    cm = ComputeModel(load_topology("h100_sxm"))
    sq = sk = 8192
    full = cm.time(block(op, 1, 32, 128, sq, sk, None))
    causal = cm.time(block(op, 1, 32, 128, sq, sk, 0))
    times = []
    for w in (64, 256, 1024, 4096, 8192):
        pairs = _band_pairs(sq, sk, 0, -(w - 1))
        e = Compute(op, 1, sq, sk, 32, 32, 128, None, "bfloat16", doc_pairs=pairs, pieces=(((sq, sk, 0, -(w - 1)), 1),))
        t = cm.time(e)
        assert full * pairs / (sq * sk) <= t <= causal, (op, w, t, full, causal)
        times.append(t)
    assert times == sorted(times) and len(set(times)) == len(times), times


@pytest.mark.parametrize("mask", ["sliding_window:0.0625", "shared_question:question=0.125,answers=4"])
def test_no_method_beats_ideal_under_a_mask(mask):
    """As test_no_method_beats_ideal_on_any_topology, under a windowed and a shared-question mask: ideal
    is the single-device reference of the same mask (its whole-sequence block, the pieces a flash kernel
    calls) / P, and no own method's compute alone comes above 100 % of it."""
    from methods.masks import parse

    m = parse(mask)
    topo = load_topology("h100_sxm")
    cm = ComputeModel(topo)
    cache = TraceCache()
    p, seq_len = 4, 32256  # a multiple of 4P and of TASP's 2P(P-1) at P = 4
    docs = Documents.single(1, seq_len, mask=m)
    case = Case(1, seq_len, 16, 4, 128, "bfloat16", True, p, documents=docs)
    ref = replay(cache.get("reference", replace(case, world_size=1), "fwd_bwd"), topo, cm.time).time_s
    seen = []
    for name in methods.group_members("own"):
        try:
            tr = cache.get(name, case, "fwd_bwd")
        except ValueError:  # the method does not support this case
            continue
        t = replay(tr, topo, cm.time, comm=False).time_s
        pct = 100 * (ref / p) / t
        seen.append((pct, name))
        assert pct <= 100.0, (mask, name, pct)
    assert len(seen) >= 6 and max(seen)[0] > 50, seen


def test_the_h100_tile_model_against_kernel_times_measured_on_an_h100():
    """reports/recorded/h100_torch_flash.blocks.yaml: 108 block shapes of the main sweep timed by
    `suite calibrate` on one H100 (PyTorch's FA2, reports/recorded/gpu_h100.md). The h100_sxm tile
    model, built from published FA2 figures and fitted to none of these, holds the error it had when
    recorded on the large blocks (both sides >= 8064; mean |error| 10.2 % with longest-first
    dispatch, 8.7 % in FA2's grid order), and no block beats the measured kernel by more than the
    recorded worst (the model is optimistic: per-call costs, and two CTAs sharing an SM)."""
    import statistics
    from pathlib import Path

    import yaml

    table = yaml.safe_load((Path(__file__).parents[1] / "reports/recorded/h100_torch_flash.blocks.yaml").read_text())
    assert table["device"].startswith("NVIDIA H100") and table["kernel"] == "torch_flash"
    cm = ComputeModel(load_topology("h100_sxm"))
    large = []
    for b in table["blocks"]:
        e = Compute.from_row(b)
        error = cm.time(e) / b["seconds"] - 1.0
        assert -0.95 < error < 0.05, (b, error)  # never slower than the real kernel, never absurdly fast
        if min(b["sq"], b["sk"]) >= 8064:
            large.append(error)
    assert len(large) == 26
    assert statistics.mean(abs(x) for x in large) <= 0.09, statistics.mean(abs(x) for x in large)
    assert max(abs(x) for x in large) <= 0.40


def test_fa2s_causal_tail_on_a_short_grid_as_measured_on_an_h100():
    """A causal forward of 4 heads (batch 1) is a short grid: on one H100, PyTorch's FA2 took 0.97 of
    the full block's time at 8064 tokens, 0.63 at 32256 and 0.55 at 129024
    (reports/recorded/h100_torch_flash.blocks.yaml), far from the half a causal mask saves, because
    the last head's longest rows start last. Dispatched in grid order the model comes closer to each
    ratio than handed out longest first, and never above it (its tail is a lower bound: one CTA per
    SM)."""
    from pathlib import Path

    import yaml

    table = yaml.safe_load((Path(__file__).parents[1] / "reports/recorded/h100_torch_flash.blocks.yaml").read_text())
    secs = {
        (b["sq"], b["causal_offset"]): b["seconds"] for b in table["blocks"] if b["op"] == "fwd" and b["heads"] == 4
    }
    cm = ComputeModel(load_topology("h100_sxm:torch_flash"))
    lpt = _longest_first(cm)
    for s in (8064, 32256, 129024):
        measured = secs[(s, 0)] / secs[(s, None)]
        ratio = {
            m: m.time(block("fwd", 1, 4, 128, s, s, 0)) / m.time(block("fwd", 1, 4, 128, s, s, None)) for m in (cm, lpt)
        }
        assert ratio[lpt] < ratio[cm] <= measured, (s, measured, ratio)
    assert ratio[cm] > 0.5  # still the tail at 129024: 4 x 1008 units on 132 SMs


def _longest_first(cm: ComputeModel) -> ComputeModel:
    """The same kernel with its units handed out longest first (no dispatch tail)."""
    topo = cm.topology
    gens = {**topo.compute["kernels"], cm.kernel: {**cm.gen, "dispatch": "longest_first"}}
    return ComputeModel(replace(topo, compute={**topo.compute, "kernel": cm.kernel, "kernels": gens}))


def test_a_kernel_generation_is_chosen_by_name_and_the_measured_one_fits_its_own_kernel():
    """`h100_sxm:torch_flash` is h100_sxm with its block kernel swapped for PyTorch's CUDA flash
    attention, whose figures were measured on flash-attention's grid (reports/recorded/h100_kernel_grid.md).
    On the 26 large blocks `suite calibrate` timed in another call (h100_torch_flash.blocks.yaml),
    fitted to none of them, it is closer than the published-FA2 model (recorded: 6.9 % vs 10.2 % with
    longest-first dispatch; 5.2 % vs 8.7 % in FA2's grid order)."""
    import statistics
    from pathlib import Path

    import yaml

    from suite.sim.topology import TopologyError

    topo = load_topology("h100_sxm:torch_flash")
    assert topo.name == "h100_sxm:torch_flash" and topo.compute["kernel"] == "torch_flash"
    with pytest.raises(TopologyError, match="lists no kernel 'fa9'.*choose one of"):
        load_topology("h100_sxm:fa9")
    table = yaml.safe_load((Path(__file__).parents[1] / "reports/recorded/h100_torch_flash.blocks.yaml").read_text())
    large = [b for b in table["blocks"] if min(b["sq"], b["sk"]) >= 8064]
    err = {}
    for name in ("h100_sxm", "h100_sxm:torch_flash"):
        cm = ComputeModel(load_topology(name))
        err[name] = statistics.mean(abs(cm.time(Compute.from_row(b)) / b["seconds"] - 1.0) for b in large)
    assert err["h100_sxm:torch_flash"] <= 0.055 and err["h100_sxm:torch_flash"] < err["h100_sxm"] - 0.02, err
