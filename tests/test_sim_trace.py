"""The simulator's tracer: a method's own code on meta tensors records the schedule it executes.
Its byte counts equal those of a real gloo run, and across ranks it computes every visible
(query, key) pair exactly once."""

import itertools
from dataclasses import replace

import pytest
import torch

import methods
from methods.base import Case
from methods.comm import CommLedger, CountingComm
from methods.comm.counting import CommRecord
from methods.kernels import visible_pairs
from suite.sim.ledger import Compute, Trace, Wait
from suite.sim.trace import extrapolate, trace
from tests.helpers import own_methods, run_dist

# every own method from the registry (its default options): a new method is traced and checked too
OWN = own_methods()


def test_visible_pairs_matches_counting_them():
    for sq, sk, c in itertools.product([1, 3, 8], [1, 4, 8], [None, -9, -3, -1, 0, 1, 2, 5, 20]):
        brute = sum(1 for i in range(sq) for j in range(sk) if c is None or j <= i + c)
        assert visible_pairs(sq, sk, c) == brute, (sq, sk, c)


@pytest.mark.parametrize("name", OWN)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_visible_pair_is_computed_exactly_once(name, world_size):
    """Summed over ranks, forward blocks cover S(S+1)/2 (causal) or S^2 (full) pairs per head, and
    backward blocks the same: no block missing, none twice."""
    for causal in (True, False):
        case = Case(
            batch=2, seq_len=48, heads=6, kv_heads=2, head_dim=8, dtype="float32", causal=causal, world_size=world_size
        )
        ok, why = methods.get_method(name).supports(case)
        if not ok:
            continue
        tr = trace(name, case, "fwd_bwd")
        pairs = 48 * 49 // 2 if causal else 48 * 48
        assert tr.flops(op="fwd") == 4 * 2 * 6 * 8 * pairs
        assert tr.flops(op="bwd") == 2.5 * 4 * 2 * 6 * 8 * pairs


def test_events_are_ordered_with_waits_after_their_exchange():
    case = Case(batch=1, seq_len=64, heads=2, kv_heads=2, head_dim=8, dtype="bfloat16", causal=True, world_size=4)
    tr = trace("ring", case, "fwd")
    events = tr.ranks[1]
    kinds = [type(e) for e in events]
    assert kinds.count(Compute) == 2 and kinds.count(CommRecord) == 3  # causal ring: rank 1 needs 2 of 4 blocks
    for i, e in enumerate(events):
        if isinstance(e, Wait):
            assert e.handle < i and isinstance(events[e.handle], CommRecord) and events[e.handle].kind == "p2p"
    assert all(c.dtype == "bfloat16" for c in tr.compute(1))
    # a million tokens is as cheap to trace as 64: nothing is computed or allocated
    big = Case(
        batch=1, seq_len=1 << 20, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16", causal=True, world_size=8
    )
    assert trace("ring", big, "fwd").bytes_sent(0) == 7 * 2 * (1 << 17) * 8 * 128 * 2


def test_unsupported_cases_and_peers_say_why():
    with pytest.raises(ValueError, match="divisible"):
        trace(
            "zigzag_ring",
            Case(batch=1, seq_len=30, heads=2, kv_heads=2, head_dim=8, dtype="float32", causal=True, world_size=4),
        )


CASES = [(name, causal, pass_) for name in OWN for causal in (True, False) for pass_ in ("fwd", "fwd_bwd")]


def _counted_in_gloo(comm, cases):
    """Each case run for real (random inputs, autograd) through a counting comm on this rank."""
    out = []
    for name, causal, pass_ in cases:
        case = Case(
            batch=2,
            seq_len=48,
            heads=4,
            kv_heads=2,
            head_dim=8,
            dtype="float32",
            causal=causal,
            world_size=comm.world_size,
        )
        method = methods.get_method(name)
        if not method.supports(case)[0]:
            out.append(None)
            continue
        layout = method.layout(case)
        g = torch.Generator().manual_seed(0)
        q, dout = (torch.randn(2, 48, 4, 8, generator=g) for _ in range(2))
        k, v = (torch.randn(2, 48, 2, 8, generator=g) for _ in range(2))
        ql, kl, vl, dl = (layout.shard(x, comm.rank) for x in (q, k, v, dout))
        ledger = CommLedger()
        counting = CountingComm(comm, ledger)
        if pass_ == "fwd":
            with torch.no_grad():
                method.attention(ql, kl, vl, causal=causal, comm=counting)
        else:
            ql, kl, vl = (x.requires_grad_() for x in (ql, kl, vl))
            torch.autograd.grad(method.attention(ql, kl, vl, causal=causal, comm=counting), (ql, kl, vl), dl)
        out.append([(r.kind, r.bytes_sent, r.bytes_recv, r.per_peer) for r in ledger.records])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_trace_bytes_equal_a_real_gloo_run(world_size):
    per_rank = run_dist(world_size, _counted_in_gloo, CASES)
    for i, (name, causal, pass_) in enumerate(CASES):
        if per_rank[0][i] is None:
            continue
        case = Case(
            batch=2, seq_len=48, heads=4, kv_heads=2, head_dim=8, dtype="float32", causal=causal, world_size=world_size
        )
        tr = trace(name, case, pass_)
        for rank in range(world_size):
            traced = [(r.kind, r.bytes_sent, r.bytes_recv, r.per_peer) for r in tr.comm(rank)]
            assert traced == per_rank[rank][i], (name, causal, pass_, rank)


@pytest.mark.parametrize("name", ["ring", "zigzag_ring", "burst", "tasp"])
@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_unmasked_ring_forward_does_one_tensor_op_per_step(name, world_size):
    """The forward's own tensor work is the fused merge, one per step: on the K/V ring the first two
    blocks start the accumulators in one pass (P - 1 ops in all; at P = 2 the second block is the
    last, which starts from the first's cast); the last merge writes the output in the input dtype. TASP's units are
    views of its K/V and a step's keys a view of its units, with any batch."""
    from suite.sim.ledger import Memory

    want = world_size if world_size == 2 else world_size - 1
    for batch in (1, 2):
        case = Case(
            batch=batch,
            seq_len=16 * world_size * (world_size - 1),
            heads=4,
            kv_heads=2,
            head_dim=8,
            dtype="bfloat16",
            causal=False,
            world_size=world_size,
        )
        tr = trace(name, case, "fwd")
        for events in tr.ranks:
            assert sum(e.ops for e in events if isinstance(e, Memory)) == want, (name, batch)


def test_allocations_are_not_tensor_work():
    """Allocating a buffer (empty, empty_like, new_empty, ...) moves no bytes; a copy into it does,
    and is charged its read and its write."""
    from suite.sim.ledger import TraceLedger, _Bookkeeping

    x = torch.empty(4, 8, device="meta", dtype=torch.float32)
    ledger = TraceLedger()
    with _Bookkeeping(ledger):
        bufs = [
            torch.empty(4, 8, device="meta"),
            torch.empty_like(x),
            x.new_empty(4, 8),
            x.new_empty_strided((4, 8), (8, 1)),
            torch.empty_strided((4, 8), (8, 1), device="meta"),
        ]
    ledger.flush()
    assert ledger.events == []
    nbytes = x.numel() * x.element_size()
    with _Bookkeeping(ledger):
        bufs[2].copy_(x)  # reads x, writes the buffer (its old contents are not read)
    ledger.flush()
    assert (ledger.events[-1].ops, ledger.events[-1].bytes) == (1, 2 * nbytes)
    with _Bookkeeping(ledger):
        bufs[2].zero_()  # writes only
    ledger.flush()
    assert (ledger.events[-1].ops, ledger.events[-1].bytes) == (1, nbytes)
    with _Bookkeeping(ledger):
        bufs[2].add_(x)  # reads both, writes one
    ledger.flush()
    assert (ledger.events[-1].ops, ledger.events[-1].bytes) == (1, 3 * nbytes)
    with _Bookkeeping(ledger):
        torch.add(x, x, out=bufs[3])  # an out= variant: reads two, writes its out argument
    ledger.flush()
    assert (ledger.events[-1].ops, ledger.events[-1].bytes) == (1, 3 * nbytes)


def test_ulysses_copies_each_tensor_once_per_direction():
    """One copy of q, k, v into the all-to-all's send buffer (the GQA replication read through the
    copy), the received heads used as views, and one copy of the output back into place, for any
    batch; the backward the same for dout, dq, dk, dv (the replicas' sum fused into the last).
    (USP shares these reshuffles; its inner ring adds its own accumulator work.)"""
    from suite.sim.ledger import Memory

    for batch in (1, 2):
        for kv_heads in (4, 2):  # 2 KV heads on 4 ranks: each replicated twice
            case = Case(
                batch=batch,
                seq_len=48,
                heads=4,
                kv_heads=kv_heads,
                head_dim=8,
                dtype="bfloat16",
                causal=True,
                world_size=4,
            )
            tr = trace("ulysses", case, "fwd_bwd")
            fwd = tr.forward_part()
            for rank, events in enumerate(tr.ranks):
                f_ops = sum(e.ops for e in fwd.ranks[rank] if isinstance(e, Memory))
                ops = sum(e.ops for e in events if isinstance(e, Memory))
                assert (f_ops, ops - f_ops) == (4, 4), (batch, kv_heads, rank)


def test_index_put_is_charged_what_it_moves():
    """A scatter (x[idx] = values) reads its indices and values and writes as many bytes: the rest
    of the destination is neither read nor written."""
    from suite.sim.ledger import TraceLedger, _Bookkeeping

    dest = torch.empty(10, 8, device="meta", dtype=torch.float32)
    values = torch.empty(4, 8, device="meta", dtype=torch.float32)
    idx = torch.empty(4, device="meta", dtype=torch.int64)
    ledger = TraceLedger()
    with _Bookkeeping(ledger):
        dest[idx] = values
    ledger.flush()
    assert (ledger.events[-1].ops, ledger.events[-1].bytes) == (1, 4 * 8 + 2 * 4 * 8 * 4)


def test_allgather_kv_by_documents_puts_kv_in_order_in_one_pass():
    """Sharded by documents, the gathered K and V go into global order in one indexed pass each
    (the index's transfer to the device the third op), for any batch."""
    from suite.sim.ledger import Memory

    for batch in (1, 2):
        case = Case(
            batch=batch, seq_len=48, heads=4, kv_heads=2, head_dim=8, dtype="bfloat16", causal=False, world_size=3
        )
        kv = 2 * batch * case.seq_len * case.kv_heads * case.head_dim * 2  # K and V, bf16
        for events in trace("allgather_kv", case, "fwd", {"sharding": "documents"}).ranks:
            work = [e for e in events if isinstance(e, Memory)]
            assert sum(e.ops for e in work) == 3, batch
            # + the int64 index: its transfer (read and written) and one read by each pass
            assert sum(e.bytes for e in work) == 2 * kv + 4 * case.seq_len * 8, batch


def test_forward_part_of_a_backward_trace_without_its_forward_end_says_so():
    case = Case(batch=1, seq_len=64, heads=2, kv_heads=2, head_dim=8, dtype="bfloat16", causal=True, world_size=4)
    assert len(trace("ring", case, "fwd_bwd").forward_part().ranks) == 4  # a traced one knows where it ends
    forward = Trace("ring", {}, case, "fwd", [[] for _ in range(4)])  # built without forward_end
    assert forward.forward_part() is forward  # a forward trace is its own forward part
    bare = Trace("ring", {}, case, "fwd_bwd", [[] for _ in range(4)])
    with pytest.raises(ValueError, match="'fwd_bwd' trace does not record where its forward ends"):
        bare.forward_part()


def test_extrapolating_blocks_causal_at_one_length_and_full_at_another_says_they_differ():
    # a schedule whose block is causal at one length and unmasked at the other is not one schedule
    case = Case(batch=1, seq_len=64, heads=2, kv_heads=2, head_dim=8, dtype="bfloat16", causal=True, world_size=1)

    def one_block(seq_len: int, offset) -> Trace:
        block = Compute("fwd", 1, seq_len, seq_len, 2, 2, 8, offset, "bfloat16")
        return Trace("x", {}, replace(case, seq_len=seq_len), "fwd", [[block]])

    same = {(1, 64): one_block(64, 0), (1, 128): one_block(128, 0)}
    assert extrapolate(same, 1, 256).ranks[0][0].sq == 256  # the consistent pair extrapolates
    mixed = {(1, 64): one_block(64, 0), (1, 128): one_block(128, None)}
    with pytest.raises(ValueError, match="differ in structure"):
        extrapolate(mixed, 1, 256)
