"""The simulator traces the peer libraries' own code (suite/sim/peers.py): ring-flash-attn's and
yunchang's functions on meta tensors with virtual ranks behind a fake torch.distributed. Their
traced messages and kernel calls equal those of a real gloo run of the same code (through the CPU
test double of flash-attn), rank for rank and in order."""

import importlib.util
import sys
import threading

import pytest
import torch

import methods
from methods.base import Case
from methods.comm import CountingComm, run_threads
from methods.comm.counting import CommRecord
from methods.documents import Documents
from methods.kernels import visible_pairs
from suite.sim import fake_dist
from suite.sim.ledger import Compute, HostSync, Memory, Wait
from suite.sim.trace import TraceCache, trace
from tests.helpers import run_dist

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("ring_flash_attn") is None, reason="ring-flash-attn is not installed"),
    pytest.mark.skipif("yunchang_usp" not in methods.available(), reason="yunchang is not installed"),
]

RFA = ("rfa_ring", "rfa_zigzag", "rfa_stripe", "rfa_llama3")
# (method, options) per world size; yunchang's degrees must divide the world size and the heads
PEERS = {
    2: [(m, {}) for m in RFA]
    + [("yunchang_ulysses", {}), ("yunchang_usp", {"ulysses_degree": 1, "ring_impl": "basic"})],
    4: [(m, {}) for m in RFA]
    + [
        ("yunchang_usp", {"ulysses_degree": 2, "ring_impl": "zigzag"}),
        ("yunchang_usp", {"ulysses_degree": 2, "ring_impl": "strip"}),
        ("yunchang_usp", {"ulysses_degree": 1, "ring_impl": "basic"}),
    ],
}

# packed documents: the varlen paths (every length divisible by 2P at P = 2 and 4, as ring and zigzag need)
DOCUMENTS = (8, 40, 16)
PACKED = ("rfa_ring", "rfa_zigzag", "rfa_llama3")


def _case(world_size: int, causal: bool = True, **kw) -> Case:
    shape = dict(batch=1, seq_len=64, heads=4, kv_heads=2, head_dim=16, dtype="bfloat16")
    return Case(**{**shape, **kw}, causal=causal, world_size=world_size)


def _message(e: CommRecord) -> tuple:
    return (e.kind, tuple(sorted(e.per_peer.items()))) if e.kind == "p2p" else (e.kind, e.bytes_sent, e.bytes_recv)


def _packed_case(world_size: int) -> Case:
    return _case(world_size, documents=Documents((DOCUMENTS,), sum(DOCUMENTS)))


def _block(e: Compute) -> tuple:
    block = (e.op, e.batch, e.sq, e.sk, e.heads, e.kv_heads, e.causal_offset)
    return block if e.doc_pairs is None else block + (e.doc_pairs,)


# -- the real run: the same library code over gloo, its torch.distributed calls and kernels counted --------
def _count_real_calls(calls: list, blocks: list):
    """Wrap this process's torch.distributed functions and the suite's CPU kernels (behind the
    flash-attn test double) so that each call is recorded as the tracer records it."""
    import torch.distributed as dist

    from methods import kernels

    def nbytes(t):
        return t.numel() * t.element_size()

    real = {n: getattr(dist, n) for n in ("batch_isend_irecv", "all_to_all_single", "all_gather_into_tensor")}
    real["reduce_scatter_tensor"] = dist.reduce_scatter_tensor

    def batch_isend_irecv(ops):
        # yunchang's ring of one rank passes dK/dV to itself: NCCL copies locally, gloo cannot, so
        # do what NCCL does (and the counting convention: no bytes to oneself)
        me = dist.get_rank()
        to_self = [o for o in ops if o.peer == me]
        for send, recv in zip([o for o in to_self if o.op is dist.isend], [o for o in to_self if o.op is dist.irecv]):
            recv.tensor.copy_(send.tensor)
        ops = [o for o in ops if o.peer != me]
        if not ops:
            return []
        per_peer = {}
        for o in ops:
            s, r = per_peer.get(o.peer, (0, 0))
            per_peer[o.peer] = (s + nbytes(o.tensor), r) if o.op is dist.isend else (s, r + nbytes(o.tensor))
        calls.append(("p2p", tuple(sorted(per_peer.items()))))
        return real["batch_isend_irecv"](ops)

    def all_to_all_single(output, input, *args, group=None, **kw):
        p = dist.get_world_size(group)
        calls.append(("all_to_all", nbytes(input) * (p - 1) // p, nbytes(output) * (p - 1) // p))
        return real["all_to_all_single"](output, input, *args, group=group, **kw)

    def all_gather_into_tensor(output, input, group=None, async_op=False):
        p = dist.get_world_size(group)
        calls.append(("all_gather", nbytes(input) * (p - 1), nbytes(output) * (p - 1) // p))
        return real["all_gather_into_tensor"](output, input, group=group, async_op=async_op)

    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        p = dist.get_world_size(group)
        calls.append(("reduce_scatter", nbytes(input) * (p - 1) // p, nbytes(output) * (p - 1)))
        return real["reduce_scatter_tensor"](output, input, op, group=group, async_op=async_op)

    for fn in (batch_isend_irecv, all_to_all_single, all_gather_into_tensor, reduce_scatter_tensor):
        setattr(dist, fn.__name__, fn)
    block_forward, block_backward = kernels.block_forward, kernels.block_backward

    def counted_forward(q, k, v, *, scale, causal_offset=None, **kw):
        blocks.append(("fwd", q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], causal_offset))
        return block_forward(q, k, v, scale=scale, causal_offset=causal_offset, **kw)

    def counted_backward(dout, q, k, v, out, lse, *, scale, causal_offset=None, **kw):
        blocks.append(("bwd", q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], causal_offset))
        return block_backward(dout, q, k, v, out, lse, scale=scale, causal_offset=causal_offset, **kw)

    kernels.block_forward, kernels.block_backward = counted_forward, counted_backward
    # a varlen call is one kernel block of several documents: one record with its visible pairs,
    # not the test double's per-document blocks (one document: the plain block)
    inside_varlen = threading.local()

    def counted_varlen(fn, op):
        def counted(**kw):
            q, k, causal = kw["q"], kw["k"], kw["causal"]
            cq, ck = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
            segments = [(b - a, d - c) for a, b, c, d in zip(cq, cq[1:], ck, ck[1:])]
            offsets = [sk - sq if causal else None for sq, sk in segments]
            if len(segments) == 1:
                blocks.append((op, 1, *segments[0], q.shape[1], k.shape[1], offsets[0]))
            else:
                pairs = sum(kernels.visible_pairs(sq, sk, c) for (sq, sk), c in zip(segments, offsets))
                blocks.append((op, 1, q.shape[0], k.shape[0], q.shape[1], k.shape[1], None, pairs))
            inside_varlen.active = True
            try:
                return fn(**kw)
            finally:
                inside_varlen.active = False

        return counted

    def per_block(counted, real_fn):
        return lambda *a, **kw: (real_fn if getattr(inside_varlen, "active", False) else counted)(*a, **kw)

    kernels.block_forward = per_block(counted_forward, block_forward)
    kernels.block_backward = per_block(counted_backward, block_backward)
    # ring-flash-attn bound the test double's varlen kernels by name when it was imported
    for name, module in list(sys.modules.items()):
        if name.startswith("ring_flash_attn."):
            for fn_name, op in (("_flash_attn_varlen_forward", "fwd"), ("_flash_attn_varlen_backward", "bwd")):
                if hasattr(module, fn_name):
                    setattr(module, fn_name, counted_varlen(getattr(module, fn_name), op))


def _real_runs(comm, cases):
    """On gloo: each (method, options, case) forward + backward through the library's own code,
    with the CPU test double of flash-attn (ring-flash-attn, and yunchang's flash-attn path);
    per case this rank's (messages, kernel blocks, messages of the forward)."""
    import tests.plugins.rfa_cpu_shim  # noqa: F401  (installs the test double and registers rfa_*, shim mode)

    calls, blocks = [], []
    _count_real_calls(calls, blocks)
    # yunchang's flash-attn path (`fa`, with a backward) on the test double's CPU kernels
    import yunchang.kernels.attention as wrappers

    wrappers.HAS_FLASH_ATTN, wrappers.flash_attn = True, sys.modules["flash_attn"]
    sys.modules["flash_attn"].__version__ = "2.7.4"
    interface = sys.modules["flash_attn.flash_attn_interface"]  # the test double's (shim.install)
    wrappers._flash_attn_forward, wrappers._flash_attn_backward = (
        interface._flash_attn_forward,
        interface._flash_attn_backward,
    )
    out = []
    for name, options, case in cases:
        method = methods.get_method(name, **options)
        if name.startswith("yunchang"):
            method.attn_type = lambda device: "fa"
        layout = method.layout(case)
        g = torch.Generator().manual_seed(0)
        q, k, v, dout = (
            torch.randn(case.batch, case.seq_len, h, case.head_dim, generator=g, dtype=torch.bfloat16)
            for h in (case.heads, case.kv_heads, case.kv_heads, case.heads)
        )
        ql, kl, vl = (layout.shard(x, comm.rank).requires_grad_() for x in (q, k, v))
        calls.clear(), blocks.clear()
        extra = {"docs": case.documents} if case.documents is not None else {}
        o = method.attention(ql, kl, vl, causal=case.causal, comm=comm, **extra)
        forward = list(calls)
        torch.autograd.grad(o, (ql, kl, vl), layout.shard(dout, comm.rank))
        out.append((list(calls), list(blocks), forward))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_traced_peers_send_what_their_real_gloo_run_sends(world_size):
    """Rank for rank and in order: every message (bytes per peer) and collective (bytes by the
    counting convention) and every kernel block (shape, heads, causal alignment; a varlen call of
    packed documents: its visible pairs) of the library's code run for real over gloo equals its
    trace on meta tensors, forward and backward, packed documents included (ring, zigzag and llama3
    through the library's varlen functions)."""
    cases = [(name, opts, _case(world_size)) for name, opts in PEERS[world_size]]
    cases += [(name, {}, _packed_case(world_size)) for name in PACKED]
    real = run_dist(world_size, _real_runs, cases)
    for i, (name, opts, case) in enumerate(cases):
        tr = trace(name, case, "fwd_bwd", opts)
        fwd = tr.forward_part()
        for r in range(world_size):
            calls, blocks, forward = real[r][i]
            assert [_message(e) for e in tr.comm(r)] == calls, (name, opts, r)
            assert [_message(e) for e in fwd.comm(r)] == forward, (name, opts, r)
            assert [_block(e) for e in tr.compute(r)] == blocks, (name, opts, r)


# -- the libraries' known patterns ------------------------------------------------------------------------
def test_ring_flash_attn_passes_kv_around_the_ring_p_minus_1_times_per_forward():
    p = 4
    case = _case(p, causal=False)
    kv_bytes = 2 * case.batch * (case.seq_len // p) * case.kv_heads * case.head_dim * 2  # K and V, bf16
    tr = trace("rfa_ring", case, "fwd_bwd")
    fwd = tr.forward_part()
    for r in range(p):
        msgs = fwd.comm(r)
        assert len(msgs) == p - 1 and all(
            m.per_peer == {(r + 1) % p: (kv_bytes, 0), (r - 1) % p: (0, kv_bytes)} for m in msgs
        )
        assert len(fwd.compute(r)) == p  # full mask: every block
        # backward: K/V again P-1 times, dK/dV (fp32 accumulators) P times, the last one home
        assert tr.bytes_sent(r) - fwd.bytes_sent(r) == (p - 1) * kv_bytes + p * 2 * kv_bytes
        waits = [e for e in fwd.ranks[r] if isinstance(e, Wait)]
        assert len(waits) == p - 1  # ring-flash-attn waits on every request of a step: one Wait each


def test_zigzag_blocks_have_the_shapes_its_layout_implies():
    """zigzag: rank r holds chunks r and 2P-1-r of 2P; step 0 is its causal diagonal; a block from a
    rank before it is every query against the first half of the keys, from a rank after it the
    second half of the queries against every key (both unmasked)."""
    p, s = 4, 64
    half = s // (2 * p)
    tr = trace("rfa_zigzag", _case(p, seq_len=s), "fwd_bwd")
    for r in range(p):
        # step t holds the K/V of rank (r - t) mod P
        want = [(2 * half, 2 * half, 0)] + [
            (2 * half, half, None) if t <= r else (half, 2 * half, None) for t in range(1, p)
        ]
        for op in ("fwd", "bwd"):
            assert [(c.sq, c.sk, c.causal_offset) for c in tr.compute(r) if c.op == op] == want, (r, op)


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_visible_pair_is_computed_exactly_once(world_size):
    for name, opts in PEERS[world_size]:
        for causal in (True, False):
            case = _case(world_size, causal=causal)
            if not _traceable(name, opts, case):  # zigzag and stripe rings are causal only
                continue
            tr = trace(name, case, "fwd_bwd", opts)
            pairs = 64 * 65 // 2 if causal else 64 * 64
            assert tr.flops(op="fwd") == 4 * 4 * 16 * pairs, (name, opts, causal)
            assert tr.flops(op="bwd") == 2.5 * 4 * 4 * 16 * pairs, (name, opts, causal)


@pytest.mark.parametrize("world_size", [2, 4])
def test_packed_documents_are_computed_pair_for_pair(world_size):
    """ring and zigzag through the library's varlen functions (each rank holding its pieces of every
    document): their blocks hold exactly the documents' causal pairs, forward and backward."""
    case = _packed_case(world_size)
    pairs = sum(n * (n + 1) // 2 for n in DOCUMENTS)
    for name in PACKED:
        tr = trace(name, case, "fwd_bwd")
        assert tr.flops(op="fwd") == 4 * 4 * 16 * pairs, name
        assert tr.flops(op="bwd") == 2.5 * 4 * 4 * 16 * pairs, name


def test_a_varlen_call_carries_its_documents_in_order():
    """A varlen call of several documents is one launch: its event lists the documents' blocks in
    document order (their pairs are the call's), so the simulator dispatches every document's units
    in one grid, as flash-attn's varlen kernel does."""
    case = _packed_case(4)
    for name in PACKED:
        calls = [e for r in range(4) for e in trace(name, case, "fwd_bwd").compute(r) if e.doc_pairs is not None]
        assert calls, name
        for e in calls:
            assert e.varlen and e.pieces is not None, (name, e)
            assert sum(n * sq for (sq, _, _, _), n in e.pieces) == e.sq, (name, e)
            assert sum(n * visible_pairs(sq, sk, off) for (sq, sk, off, _), n in e.pieces) == e.doc_pairs, (name, e)


def test_llama3_gathers_the_next_heads_while_it_computes_the_current_ones():
    """ring-flash-attn's llama3 posts the all-gather of the next heads' K/V (async_op=True) and waits
    for it after the current heads' kernel: every all-gather's event is named by a later Wait, with a
    kernel between them after the first pair, so the simulator runs the gather beside that kernel."""
    case = _case(4, seq_len=128, heads=8, kv_heads=4)
    for r, events in enumerate(trace("rfa_llama3", case, "fwd").ranks):
        gathers = [i for i, e in enumerate(events) if isinstance(e, CommRecord) and e.kind == "all_gather"]
        waits = {e.handle: i for i, e in enumerate(events) if isinstance(e, Wait)}
        assert gathers and set(gathers) <= set(waits), r
        overlapped = [g for g in gathers if any(isinstance(e, Compute) for e in events[g : waits[g]])]
        assert len(overlapped) == len(gathers) - 2, (r, gathers, waits)  # all but the first K and V


def test_llama3_gathers_as_many_kv_heads_at_a_time_as_its_stride():
    """`heads_k_stride` (the benchmark's 4) is passed to the library: with 4 KV heads, a stride of 2
    gathers K and V twice per forward instead of four times, each gather twice the bytes; a stride
    that does not divide the KV heads is refused before anything runs."""
    case = _case(4, seq_len=128, heads=8, kv_heads=4)
    gathers = {}
    for stride in (1, 2):
        fwd = trace("rfa_llama3", case, "fwd", {"heads_k_stride": stride})
        gathers[stride] = [e.bytes_sent for e in fwd.comm(0) if e.kind == "all_gather"]
    assert len(gathers[1]) == 2 * 4 and len(gathers[2]) == 2 * 2
    assert gathers[2][0] == 2 * gathers[1][0]
    from suite.sim.trace import traced_method

    ok, why = traced_method("rfa_llama3", {"heads_k_stride": 3}).supports(case)
    assert not ok and "heads_k_stride=3" in why
    with pytest.raises(ValueError, match="heads_k_stride must be >= 1"):
        methods.get_method("rfa_llama3", heads_k_stride=0)


def test_ring_flash_attns_varlen_zigzag_makes_the_host_wait_and_its_ring_does_not():
    """ring-flash-attn's varlen zigzag indexes its device tensors with CPU boolean masks (get_half_index)
    once documents are packed: each such op makes the host wait for the device (a HostSync in the
    trace); its varlen ring and llama3 do not, nor does the zigzag with one document per sequence."""
    for name in PACKED:
        n = {
            packed: sum(isinstance(e, HostSync) for r in trace(name, c, "fwd_bwd").ranks for e in r)
            for packed, c in ((True, _packed_case(4)), (False, _case(4)))
        }
        assert n[False] == 0, name
        assert (n[True] > 0) == (name == "rfa_zigzag"), (name, n)


def _traceable(name, opts, case) -> bool:
    from suite.sim.trace import traced_method

    return traced_method(name, opts).supports(case)[0]


def test_ring_flash_attn_merges_are_traced_as_it_writes_them():
    """Its out/LSE update (sigmoid, logsigmoid, several passes over the fp32 accumulator) is the
    library's tensor work between kernels: more bytes than the suite's fused merge."""
    case = _case(4, causal=False, seq_len=256, heads=8, kv_heads=8, head_dim=64)
    theirs = trace("rfa_ring", case, "fwd")
    ours = trace("ring", case, "fwd")
    mem = [sum(e.bytes for e in t.ranks[0] if isinstance(e, Memory)) for t in (theirs, ours)]
    assert mem[0] > 2 * mem[1]


def test_a_forward_trace_is_the_forward_part_of_a_fwd_bwd_trace():
    for name, opts in PEERS[4]:
        case = _case(4)
        assert trace(name, case, "fwd", opts).ranks == trace(name, case, "fwd_bwd", opts).forward_part().ranks


def test_peer_traces_extrapolate_event_for_event():
    cache = TraceCache()
    for name, opts in [("rfa_zigzag", {}), ("rfa_llama3", {}), ("yunchang_usp", {"ulysses_degree": 2})]:
        case = _case(4, seq_len=192, batch=1 if name == "rfa_llama3" else 3)
        assert cache.get(name, case, "fwd_bwd", opts).ranks == trace(name, case, "fwd_bwd", opts).ranks, name


def test_tracing_leaves_the_machines_libraries_alone():
    trace("rfa_ring", _case(2), "fwd_bwd")
    trace("yunchang_usp", _case(2), "fwd_bwd", {"ulysses_degree": 2})
    if importlib.util.find_spec("flash_attn") is None:
        assert sys.modules.get("flash_attn") is None and "rfa_ring" in methods.available()
        assert not methods.method_class("rfa_ring").available_here()[0]
    import torch.distributed as dist
    import yunchang.kernels.attention as wrappers

    assert dist.batch_isend_irecv is fake_dist._REAL["batch_isend_irecv"] and not dist.is_initialized()
    assert wrappers.HAS_FLASH_ATTN == (importlib.util.find_spec("flash_attn") is not None)


# -- failing clearly -------------------------------------------------------------------------------------
def test_a_wrong_rank_count_fails_clearly():
    with pytest.raises(ValueError, match="must divide world_size 4"):
        trace("yunchang_usp", _case(4), "fwd", {"ulysses_degree": 3})
    world = fake_dist.FakeWorld(2, timeout_s=10)

    def outside(comm):
        import torch.distributed as dist

        with fake_dist.virtual_rank(world, CountingComm(comm)):
            dist.new_group([0, 2])

    with fake_dist.installed(), pytest.raises(ValueError, match="within the trace's 2 virtual ranks"):
        run_threads(2, outside, timeout_s=10)

    def disagree(comm):
        import torch.distributed as dist

        with fake_dist.virtual_rank(fake_world, CountingComm(comm)):
            dist.new_group([0, 1] if comm.rank == 0 else [0, 2])

    fake_world = fake_dist.FakeWorld(3, timeout_s=10)
    with fake_dist.installed(), pytest.raises(ValueError, match="every rank must create the same groups"):
        run_threads(3, disagree, timeout_s=10)
    with pytest.raises(ValueError, match="a comm of 2 ranks in a fake world of 3"):
        run_threads(2, lambda comm: fake_dist.virtual_rank(fake_world, comm).__enter__(), timeout_s=10)


def test_torch_context_parallel_is_not_traced_and_says_why():
    if "torch_cp_allgather" not in methods.available():
        pytest.skip(methods.unavailable().get("torch_cp_allgather", "no torch_cp adapter"))
    with pytest.raises(ValueError, match="DTensor"):
        trace("torch_cp_allgather", _case(2), "fwd")
