"""The simulator: analytic checks of the network model, exact trace extrapolation, topologies, and
the `sim` executor end to end. (The measured check against CPU gloo runs is `make sim-check`; its
figures are in reports/recorded/sim_check_cpu.md.)"""

import itertools
from dataclasses import replace

import pytest
import yaml

import methods
from methods.base import Case
from methods.comm.counting import CommRecord
from methods.documents import Documents
from suite.sim.compute import ComputeModel
from suite.sim.engine import Flow, SimError, max_min_rates, replay
from suite.sim.ledger import Compute, HostSync, Memory, Trace, Wait
from suite.sim.topology import Topology, TopologyError, available_topologies, load_topology
from suite.sim.trace import TraceCache, trace
from tests.helpers import own_methods

GB = 1e9
ALPHA, BW = 10e-6, 100 * GB


def topo(kind="switch", **over) -> Topology:
    intra = {
        "switch": {"kind": "switch", "port_GBps": 100, "flow_GBps": 100, "latency_us": 10},
        "mesh": {"kind": "mesh", "link_GBps": 100, "latency_us": 10},
    }[kind]
    d = {
        "name": f"test_{kind}",
        "gpu": "test",
        "gpus_per_node": 8,
        "max_nodes": 4,
        "intra": {**intra, **over},
        "inter": {"nic_GBps": 25, "latency_us": 20},
        "compute": {"peak_tflops": {"float32": 1}, "efficiency": {"tokens": [1, 2], "fwd": [1, 1], "bwd": [1, 1]}},
    }
    return Topology.from_dict(d)


def p2p(per_peer: dict) -> CommRecord:
    return CommRecord(
        "p2p",
        sum(s for s, _ in per_peer.values()),
        sum(r for _, r in per_peer.values()),
        tuple(sorted(per_peer)),
        per_peer,
    )


def synthetic(ranks) -> Trace:
    case = Case(
        batch=1, seq_len=8, heads=1, kv_heads=1, head_dim=8, dtype="float32", causal=False, world_size=len(ranks)
    )
    return Trace("synthetic", {}, case, "fwd", ranks)


def no_compute(e) -> float:
    return 0.0


# -- analytic checks --------------------------------------------------------------------------------
def test_a_lone_transfer_takes_latency_plus_bytes_over_bandwidth():
    n = 64 << 20
    tr = synthetic([[p2p({1: (n, 0)}), Wait(0)], [p2p({0: (0, n)}), Wait(0)]])
    t = replay(tr, topo(), no_compute).time_s
    assert t == pytest.approx(ALPHA + n / BW, rel=1e-9)
    # the flow's own cap binds when it is below the port (NCCL P2P to one peer)
    assert replay(tr, topo(flow_GBps=40), no_compute).time_s == pytest.approx(ALPHA + n / (40 * GB), rel=1e-9)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("kind", ["all_gather", "all_to_all", "all_reduce"])
def test_collectives_take_their_textbook_alpha_beta_time(p, kind):
    """Ring all-gather / pairwise all-to-all: (p-1) alpha + (p-1)/p n beta with n the gathered (resp. sent)
    buffer; all-reduce: 2(p-1) alpha + 2 (p-1)/p n beta (Thakur, Rabenseifner & Gropp 2005)."""
    n = 48 << 20
    sent = {"all_gather": n // p * (p - 1), "all_to_all": n * (p - 1) // p, "all_reduce": 2 * n * (p - 1) // p}[kind]
    rec = CommRecord(kind, sent, sent, tuple(range(p)))
    t = replay(synthetic([[rec] for _ in range(p)]), topo(), no_compute).time_s
    k = 2 if kind == "all_reduce" else 1
    assert t == pytest.approx(k * (p - 1) * ALPHA + k * (p - 1) / p * n / BW, rel=1e-6)


def test_flows_out_of_one_port_share_it_but_a_mesh_gives_each_its_link():
    p, m = 8, 16 << 20
    fan_out = [[p2p({q: (m, 0) for q in range(1, p)}), Wait(0)]] + [[p2p({0: (0, m)}), Wait(0)] for _ in range(1, p)]
    switch = replay(synthetic(fan_out), topo(), no_compute).time_s
    mesh = replay(synthetic(fan_out), topo("mesh"), no_compute).time_s
    assert switch == pytest.approx(ALPHA + (p - 1) * m / BW, rel=1e-9)  # each flow gets 1/(P-1) of the port
    assert mesh == pytest.approx(ALPHA + m / BW, rel=1e-9)  # each flow has a link of its own


def test_max_min_fairness_gives_capped_flows_their_cap_and_splits_the_rest():
    caps = {"r": 10.0, "s": 4.0}
    a, b = Flow(("r",), 2.0, 1, lambda: None), Flow(("r",), 99, 1, lambda: None)
    c = Flow(("r", "s"), 99, 1, lambda: None)
    max_min_rates([a, b, c], caps)
    assert (a.rate, c.rate, b.rate) == pytest.approx((2.0, 4.0, 4.0))  # a capped, c by s, b gets the rest of r


def test_tasp_rounds_use_every_mesh_link_while_ring_uses_one():
    """On a full mesh TASP's rounds send to P-1 peers at once and ring to one; with the same bytes its
    communication takes ~1/(P-1) of ring's there, while on a switch (one port) the two are alike."""
    case = Case(
        batch=1, seq_len=112 * 1024, heads=8, kv_heads=8, head_dim=64, dtype="bfloat16", causal=False, world_size=8
    )
    tasp, ring = trace("tasp", case, "fwd"), trace("ring", case, "fwd")

    def send_peers(t):
        return max(sum(1 for s, _ in e.per_peer.values() if s) for e in t.comm(0))

    assert send_peers(tasp) == 7 and send_peers(ring) == 1
    assert tasp.bytes_sent(0) == ring.bytes_sent(0)
    comm_only = {
        name: {
            k: replay(t, topo(k, **({"flow_GBps": 100} if k == "switch" else {})), no_compute, compute=False).time_s
            for k in ("mesh", "switch")
        }
        for name, t in (("tasp", tasp), ("ring", ring))
    }
    assert comm_only["ring"]["mesh"] / comm_only["tasp"]["mesh"] > 4
    assert comm_only["ring"]["switch"] / comm_only["tasp"]["switch"] == pytest.approx(1, rel=0.25)


def test_inter_node_hops_run_at_nic_speed():
    n = 32 << 20
    tr = synthetic([[p2p({9: (n, 0)}), Wait(0)]] + [[] for _ in range(8)] + [[p2p({0: (0, n)}), Wait(0)]])
    assert replay(tr, topo(), no_compute).time_s == pytest.approx(20e-6 + n / (25 * GB), rel=1e-9)


def test_overlap_hides_communication_behind_compute():
    """A rank that posts its exchange, computes, then waits takes max(compute, comm) + latency-free
    nothing more; with comm=False/compute=False the two parts alone."""
    n, secs = 100 << 20, 2e-3
    blk = Compute("fwd", 1, 8, 8, 1, 1, 8, None, "float32")
    ranks = [[p2p({1: (n, n)}), blk, Wait(0)], [p2p({0: (n, n)}), blk, Wait(0)]]
    t = topo()
    full = replay(synthetic(ranks), t, lambda e: secs).time_s
    comm = ALPHA + n / BW
    assert full == pytest.approx(max(secs, comm), rel=1e-9)
    assert replay(synthetic(ranks), t, lambda e: secs, comm=False).time_s == pytest.approx(secs)
    assert replay(synthetic(ranks), t, lambda e: secs, compute=False).time_s == pytest.approx(comm)


def test_a_collective_waited_for_later_runs_beside_the_compute():
    """A collective is blocking where it is called, unless a later Wait names its event (posted with
    async_op=True, as ring-flash-attn's llama3 all-gathers the next heads' K/V): then the rank
    computes while it runs and waits only for what is left."""
    p, n, secs = 4, 48 << 20, 2e-3
    sent = n // p * (p - 1)
    gather = CommRecord("all_gather", sent, sent, tuple(range(p)))
    blk = Compute("fwd", 1, 8, 8, 1, 1, 8, None, "float32")
    comm = (p - 1) * ALPHA + (p - 1) / p * n / BW
    blocking = replay(synthetic([[gather, blk] for _ in range(p)]), topo(), lambda e: secs).time_s
    posted = replay(synthetic([[gather, blk, Wait(0)] for _ in range(p)]), topo(), lambda e: secs).time_s
    assert blocking == pytest.approx(comm + secs, rel=1e-9)
    assert posted == pytest.approx(max(comm, secs), rel=1e-9)
    # the wait finds what is left when the compute is short
    short = replay(synthetic([[gather, blk, Wait(0)] for _ in range(p)]), topo(), lambda e: secs / 10).time_s
    assert short == pytest.approx(comm, rel=1e-9)
    # compute alone: the collective is free either way
    alone = replay(synthetic([[gather, blk, Wait(0)] for _ in range(p)]), topo(), lambda e: secs, comm=False)
    assert alone.time_s == pytest.approx(secs)


def test_a_host_synchronization_idles_the_device_and_is_not_communication():
    """A HostSync (the code made the host wait for the device) costs the topology's host_sync_us of
    idle device time: in the full and compute-only replays, not in the comm-only one, and never
    counted as time blocked on communication."""
    blk = Compute("fwd", 1, 8, 8, 1, 1, 8, None, "float32")
    t = replace(topo(), compute={**topo().compute, "host_sync_us": 30})
    ranks = [[blk, HostSync(), HostSync(), blk]]
    r = replay(synthetic(ranks), t, lambda e: 1e-3)
    assert r.time_s == pytest.approx(2e-3 + 60e-6) and r.blocked_s == [0.0] and r.kernel_s[0] == pytest.approx(2e-3)
    assert replay(synthetic(ranks), t, lambda e: 1e-3, comm=False).time_s == pytest.approx(2e-3 + 60e-6)
    assert replay(synthetic(ranks), t, lambda e: 1e-3, compute=False).time_s == 0.0
    assert replay(synthetic(ranks), topo(), lambda e: 1e-3).time_s == pytest.approx(2e-3)  # default: free


def ring_steps(p: int, steps: int, n: int, ops: int) -> list:
    """A ring's per-rank program: each step posts its exchange with both neighbours, runs its block,
    `ops` aten ops of merging, and waits for the exchange."""
    blk = Compute("fwd", 1, 8, 8, 1, 1, 8, None, "float32")
    ranks = []
    for r in range(p):
        ev: list = []
        for _ in range(steps):
            ev += [p2p({(r + 1) % p: (n, 0), (r - 1) % p: (0, n)}), blk, Memory(0, ops), Wait(len(ev))]
        ranks.append(ev)
    return ranks


HOST = {"kernel_us": 40, "op_us": 10, "comm_us": 20, "wait_us": 5}  # 40 + 10 ops + 2 x 20 + 5 = 185 us a step


def test_a_host_slower_than_its_device_sets_the_pace():
    """Each step's host work (one kernel call, ten ops, a send and a receive, a wait: 185 us) is longer
    than the device's (a 50 us block, the ops free on the device): the device waits for its host, and
    the iteration takes the host's time: its last event, the last wait, is issued when all the
    device's work is long done."""
    p, steps = 4, 5
    t = replace(topo(), host=HOST)
    ranks = ring_steps(p, steps, 1 << 10, 10)
    r = replay(synthetic(ranks), t, lambda e: 50e-6 if isinstance(e, Compute) else 0.0)
    step = 40e-6 + 10 * 10e-6 + 2 * 20e-6 + 5e-6
    assert r.time_s == pytest.approx(steps * step, rel=1e-9)
    assert r.blocked_s == [pytest.approx(0.0, abs=ALPHA + 1e-6)] * p  # waiting for the host is not communication
    free = replay(synthetic(ranks), topo(), lambda e: 50e-6 if isinstance(e, Compute) else 0.0)
    assert free.time_s < steps * (50e-6 + ALPHA + 2e-6)  # without a host section the device's time alone
    # the comm-only replay leaves the host out (it is the communication's time alone)
    comm = replay(synthetic(ranks), t, lambda e: 50e-6, compute=False).time_s
    assert comm == pytest.approx(replay(synthetic(ranks), topo(), lambda e: 50e-6, compute=False).time_s)


def test_a_host_faster_than_its_device_costs_nothing_in_a_loop():
    """With 2 ms blocks the host runs ahead and every step's host work hides behind the device's; in a
    loop of iterations (no synchronisation between them) even the first block's issue is hidden, since
    the host issued it while the device ran the previous iteration. So the time is the device's."""
    p, steps, secs = 4, 5, 2e-3
    t = replace(topo(), host=HOST)
    ranks = ring_steps(p, steps, 1 << 10, 10)
    hosted = replay(synthetic(ranks), t, lambda e: secs if isinstance(e, Compute) else 0.0).time_s
    free = replay(synthetic(ranks), topo(), lambda e: secs if isinstance(e, Compute) else 0.0).time_s
    assert hosted == pytest.approx(free, rel=1e-9)


def test_a_host_synchronization_holds_the_host_until_the_device_drains():
    """After a HostSync the host has to issue the next kernel anew: its call cost is paid on the
    device's critical path (the host cannot have run ahead past the sync). Without the sync the
    second call is issued while the first block runs, and the first while the previous iteration ran."""
    blk = Compute("fwd", 1, 8, 8, 1, 1, 8, None, "float32")
    t = replace(topo(), host=HOST)
    assert replay(synthetic([[blk, HostSync(), blk]]), t, lambda e: 1e-3).time_s == pytest.approx(2e-3 + 40e-6)
    assert replay(synthetic([[blk, blk]]), t, lambda e: 1e-3).time_s == pytest.approx(2e-3)


# A host that issues slower than its device runs sets the loop's pace: it issues the next iteration
# while the device finishes this one, so the device's work after the last issue is hidden (found in
# review: the replay had added it, predicting a faster kernel up to twice as slow, and a compute-only
# replay above the full one).
def test_a_host_bound_loop_runs_at_its_hosts_pace():
    """One 12 us kernel call per iteration: a block of 11.9 us is host-bound, a loop of them runs one
    call per 12 us; a longer block never takes less time than a shorter one."""
    blk = Compute("fwd", 1, 8, 8, 1, 1, 8, None, "float32")
    t = replace(topo(), host={"kernel_us": 12})
    short = replay(synthetic([[blk]]), t, lambda e: 11.9e-6).time_s
    longer = replay(synthetic([[blk]]), t, lambda e: 12.1e-6).time_s
    assert short <= longer
    assert short == pytest.approx(12e-6, rel=1e-9)


def test_a_compute_only_replay_never_takes_longer_than_the_full_one():
    """Free communication cannot slow an iteration down (ring, P=2, 960 tokens on h100_sxm: the host
    issues rank 1's iteration in 61.5 us, the device computes it in 56.8 us, the full iteration takes
    62.6 us; the compute-only replay came out at 91.8 us, an overlap efficiency of 2.1)."""
    topology = load_topology("h100_sxm")
    cm = ComputeModel(topology)
    case = Case(1, 960, 32, 8, 128, "bfloat16", True, 2)
    tr = trace("ring", case, "fwd")
    full = replay(tr, topology, cm.time).time_s
    assert replay(tr, topology, cm.time, comm=False).time_s <= full * (1 + 1e-9)


def test_host_costs_are_checked_by_name():
    d = yaml.safe_load(load_topology("h100_sxm").source.read_text())
    with pytest.raises(TopologyError, match="host.launch_us is not a host cost; the keys are kernel_us"):
        Topology.from_dict({**d, "host": {"launch_us": 3}})
    with pytest.raises(TopologyError, match="host.op_us must be a number of microseconds >= 0"):
        Topology.from_dict({**d, "host": {"op_us": -1}})


def test_own_methods_never_make_the_host_wait_for_the_device():
    """No own method indexes device data with a host tensor or reads a device value back (a HostSync
    in its trace), with plain or packed documents, causal or full: their index tensors are built on
    the device. ring-flash-attn's varlen zigzag does (its CPU boolean masks), and its trace shows it."""
    docs = Documents(((96, 32, 64, 48, 16),), 256)
    for name in own_methods():
        for causal, d in itertools.product((True, False), (None, docs)):
            case = Case(
                batch=1, seq_len=256, heads=4, kv_heads=2, head_dim=16, dtype="bfloat16", causal=causal, world_size=4
            )
            try:
                tr = trace(name, replace(case, documents=d), "fwd_bwd")
            except ValueError:  # the method does not take this case
                continue
            assert not any(isinstance(e, HostSync) for r in tr.ranks for e in r), (name, causal, d is not None)


def test_unmatched_messages_are_reported_not_hung():
    tr = synthetic([[p2p({1: (100, 0)}), Wait(0)], []])
    with pytest.raises(SimError, match="never finished"):
        replay(tr, topo(), no_compute)


# -- traces once per schedule shape ------------------------------------------------------------------
@pytest.mark.parametrize("name", own_methods())
def test_extrapolated_traces_equal_direct_traces(name):
    """Blocks, messages, waits and the method's own tensor work (Memory events) alike, at batch 1 (its
    own templates: a batch of one skips some copies) and at batch 3."""
    cache = TraceCache()
    for p, causal, batch in itertools.product([3, 4], [True, False], [1, 3]):
        case = Case(
            batch=batch,
            seq_len=4 * p * (p - 1) * 6,
            heads=12,
            kv_heads=4 if p == 4 else 12,
            head_dim=8,
            dtype="bfloat16",
            causal=causal,
            world_size=p,
        )
        if not methods.get_method(name).supports(case)[0]:
            continue
        got = cache.get(name, case, "fwd_bwd").ranks
        assert got == trace(name, case, "fwd_bwd").ranks, (name, p, causal, batch)
        assert any(isinstance(e, Memory) for r in got for e in r)
        # the forward pass is served from the same templates: the first part of the fwd_bwd trace
        assert cache.get(name, case, "fwd").ranks == trace(name, case, "fwd").ranks, (name, p, causal, batch)


# -- topologies and compute ----------------------------------------------------------------------------
def test_shipped_topologies_load_and_name_their_sources():
    names = available_topologies()
    assert {"h100_sxm", "h800_sxm", "a100_sxm", "a800_sxm", "mi300x", "a100_pcie"} <= set(names)
    for n in names:
        t = load_topology(n)
        ComputeModel(t)
        text = t.source.read_text()
        assert "#" in text and ("nccl" in text or "ROCm" in text)  # numbers carry their sources


def test_bad_topologies_name_the_key():
    d = yaml.safe_load(load_topology("mi300x").source.read_text())
    del d["intra"]["link_GBps"]
    with pytest.raises(TopologyError, match="intra.link_GBps is missing"):
        Topology.from_dict(d)
    with pytest.raises(TopologyError, match="unknown topology 'nope'.*h100_sxm"):
        load_topology("nope")


def test_the_tile_model_counts_visible_tiles_and_skips_empty_blocks():
    cm = ComputeModel(load_topology("h100_sxm"))
    full = Compute("fwd", 1, 4096, 4096, 32, 8, 128, None, "bfloat16")
    diag = Compute("fwd", 1, 4096, 4096, 32, 8, 128, 0, "bfloat16")
    assert (full.pairs, full.flops) == (4096 * 4096, 4.0 * 32 * 128 * 4096 * 4096)
    assert (diag.pairs, diag.flops) == (4096 * 4097 // 2, full.flops * 4097 / 8192)
    assert Compute("bwd", 1, 4096, 4096, 32, 8, 128, None, "bfloat16").flops == 2.5 * full.flops
    # FA2's forward tile at head dim 128 is 128 x 64: 32 x 64 tiles, of which a causal block walks
    # the 32 x 33 on or below its diagonal (2 per row masked); at least half the full block's time, and
    # more with FA2's grid order (the last head's longest rows start last) than handed out longest first
    fa3 = ComputeModel(load_topology("h100_sxm:fa3"))
    assert 0.5 < fa3.time(diag) / fa3.time(full) < cm.time(diag) / cm.time(full) < 0.65
    assert full.flops / cm.time(full) < 0.4 * 989e12  # near FA2's published 368 TFLOP/s at 4K
    assert cm.time(Compute("fwd", 1, 8, 8, 1, 1, 8, -9, "bfloat16")) == 0.0
    assert not cm.supports("float64", 128)[0]


def test_a_measured_table_is_used_exactly_and_interpolated_by_rate(tmp_path):
    blocks = [
        {
            "op": "fwd",
            "batch": 1,
            "sq": s,
            "sk": s,
            "heads": 2,
            "kv_heads": 2,
            "head_dim": 8,
            "causal_offset": None,
            "dtype": "float32",
            "pairs": s * s,
            "flops": 64.0 * s * s,
            "seconds": sec,
        }
        for s, sec in ((16, 1e-3), (64, 4e-3))
    ]
    (tmp_path / "t.blocks.yaml").write_text(yaml.safe_dump({"blocks": blocks}))
    d = yaml.safe_load(load_topology("h100_sxm").source.read_text())
    d["compute"] = {"table": "t.blocks.yaml"}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(d))
    cm = ComputeModel(load_topology(str(tmp_path / "t.yaml")))
    assert cm.time(Compute("fwd", 1, 16, 16, 2, 2, 8, None, "float32")) == 1e-3
    mid = Compute("fwd", 1, 32, 32, 2, 2, 8, None, "float32")
    assert mid.flops == 64.0 * 1024
    r16, r64 = 64.0 * 256 / 1e-3, 64.0 * 4096 / 4e-3  # achieved rates; 32x32 lies half-way in log FLOPs
    assert mid.flops / cm.time(mid) == pytest.approx((r16 + r64) / 2, rel=1e-9)


# -- the sim executor in a sweep -------------------------------------------------------------------------
def test_a_simulated_sweep_records_labelled_rows(tmp_path):
    from suite.config import ConfigError, load_config
    from suite.runner import run_sweep
    from suite.sim.trace import trace as direct

    cfg_path = tmp_path / "s.yaml"
    cfg_path.write_text(
        yaml.safe_dump(
            {
                "name": "simtest",
                "run": {"executor": "sim"},
                "sim": {"topology": ["mi300x", "h100_sxm"]},
                "tracking": {"mlflow": False},
                "results": {"root": str(tmp_path / "results")},
                "sweep": {
                    "methods": ["ring", "tasp", "rfa_ring"],
                    "world_size": [8, 16],
                    "seq_len": [8064 * 4],
                    "heads": [32],
                    "kv_heads": [8],
                    "head_dim": [128],
                    "dtype": ["bfloat16", "float64"],
                    "causal": [True],
                    "passes": ["fwd"],
                    # TASP at 16 ranks is the slowest trace of all; 8 ranks show what it shows
                    "exclude": [{"method": "tasp", "world_size": 16}],
                },
            }
        )
    )
    cfg, text = load_config(cfg_path)
    res = run_sweep(cfg, text, progress=False)
    rows = {(r["method"], r["topology"], r["world_size"], r["dtype"]): r for r in res.records}
    assert all(r["executor"] == "sim" for r in rows.values())
    ok = rows[("tasp", "mi300x", 8, "bfloat16")]
    assert ok["status"] == "ok" and not ok["checked"] and ok["hardware"].startswith("MI300X") and ok["nodes"] == 1
    case = Case(
        batch=1, seq_len=8064 * 4, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16", causal=True, world_size=8
    )
    traced = direct("tasp", case, "fwd")
    assert ok["bytes_sent_per_rank"] == max(traced.bytes_sent(r) for r in range(8))
    assert rows[("ring", "h100_sxm", 16, "bfloat16")]["nodes"] == 2
    assert rows[("ring", "mi300x", 8, "bfloat16")]["time_ms_median"] > ok["time_ms_median"]
    rfa = rows[("rfa_ring", "h100_sxm", 8, "bfloat16")]
    if "rfa_ring" in methods.available():  # ring-flash-attn installed: its own code traced
        assert rfa["status"] == "ok" and rfa["impl"].startswith("ring-flash-attn ") and not rfa["checked"]
        assert "trace stand-in" in rfa["kernel_used"]
        assert rfa["bytes_sent_per_rank"] == max(direct("rfa_ring", case, "fwd").bytes_sent(r) for r in range(8))
    else:
        assert "not installed" in rfa["reason"]
    assert "no float64 rate" in rows[("ring", "h100_sxm", 8, "float64")]["reason"]
    # 2P(P-1) = 112 does not divide 8000: TASP runs padded to 8064 instead of being skipped
    padded_rows = run_sweep(
        *load_config(
            cfg_path,
            [
                "sweep.methods=[tasp]",
                "sweep.world_size=[8]",
                "sweep.seq_len=[8000]",
                "sweep.dtype=[bfloat16]",
                "sim.topology=[h100_sxm]",
                "sweep.exclude=[]",
                "name=padded",
            ],
        ),
        progress=False,
    ).records
    assert [(r["status"], r["padded_tokens"]) for r in padded_rows] == [("ok", 8064 - 8000)]
    with pytest.raises(ConfigError, match="sim.topology: unknown topology 'nope'"):
        load_config(cfg_path, ["sim.topology=[nope]"])
    same_name = load_topology("h100_sxm").source
    with pytest.raises(ConfigError, match="topology names must differ"):
        load_config(cfg_path, [f"sim.topology=[h100_sxm,{same_name}]"])


# -- calibrate ---------------------------------------------------------------------------------------------
def test_calibrate_times_exactly_the_blocks_the_sweep_traces(tmp_path):
    import torch

    from suite.calibrate import fit_alpha_beta, sweep_blocks, time_block
    from suite.config import load_config

    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(
        yaml.safe_dump(
            {
                "name": "cal",
                "sweep": {
                    "methods": ["ring", "ulysses", "reference"],
                    "world_size": [1, 2],
                    "seq_len": [32],
                    "heads": [2],
                    "kv_heads": [2],
                    "head_dim": [8],
                    "causal": [True],
                    "passes": ["fwd"],
                },
            }
        )
    )
    cfg, _ = load_config(cfg_path)
    blocks = sweep_blocks(cfg)
    case = Case(batch=1, seq_len=32, heads=2, kv_heads=2, head_dim=8, dtype="float32", causal=True, world_size=2)
    expect = {
        (e.sq, e.sk, e.causal_offset)
        for name in ("ring", "ulysses")
        for r in trace(name, case).ranks
        for e in r
        if isinstance(e, Compute) and e.pairs
    }
    assert {(e.sq, e.sk, e.causal_offset) for e in blocks} == expect  # no reference (P=1), no empty blocks
    assert all(time_block(e, torch.device("cpu"), "auto", 1) > 0 for e in blocks)
    alpha, beta = 50e-6, 3e9
    sizes = [4, 1 << 16, 1 << 20, 1 << 22, 1 << 24]
    fit = fit_alpha_beta({n: alpha + n / beta for n in sizes})
    assert fit[0] == pytest.approx(alpha, rel=1e-3) and fit[1] == pytest.approx(beta, rel=1e-3)


def test_a_sweep_traces_once_per_schedule_shape_not_per_point(tmp_path, monkeypatch):
    """The simulator's speed comes from tracing each schedule shape a few times (two small lengths,
    and two batches where the batch is not one) and extrapolating every point from those traces.
    Counted, not timed: a shared CI machine's clock says nothing reliable."""
    import suite.sim.trace as sim_trace
    from suite.config import load_config
    from suite.runner import run_sweep

    traced = []
    real_trace = sim_trace.trace

    def counting(method_name, case, pass_, options=None, timeout_s=120.0):
        traced.append((method_name, case.batch, case.seq_len))
        return real_trace(method_name, case, pass_, options, timeout_s)

    monkeypatch.setattr(sim_trace, "trace", counting)
    cfg_path = tmp_path / "speed.yaml"
    cfg_path.write_text(
        yaml.safe_dump(
            {
                "name": "speed",
                "run": {"executor": "sim"},
                "sim": {"topology": ["h100_sxm"]},
                "tracking": {"mlflow": False},
                "results": {"root": str(tmp_path / "results")},
                "sweep": {
                    "methods": ["ring", "usp"],
                    "world_size": [8],
                    "batch": [1, 4],
                    "seq_len": [64512, 129024, 258048, 516096, 1032192],
                    "heads": [32],
                    "kv_heads": [8],
                    "head_dim": [128],
                    "dtype": ["bfloat16"],
                    "causal": [True, False],
                    "passes": ["fwd", "fwd_bwd"],
                },
            }
        )
    )
    cfg, text = load_config(cfg_path)
    res = run_sweep(cfg, text, progress=False)
    assert len(res.records) == 80 and all(r["status"] == "ok" for r in res.records)
    # per method and mask: 2 lengths at batch 1, 2 lengths x 2 batches for batch 4; both passes
    # from one forward+backward trace; no trace at a point's own (long) length
    assert len(traced) <= 2 * 2 * (2 + 4), len(traced)
    assert max(s for _, _, s in traced) < 64512
