"""TokenRing's own schedule: who talks to whom at each step, what travels (never K/V), in which
dtypes and sizes, and that the traced schedule overlaps the results' return with kernels. Its
numerics against float64 are checked by the generic tests (test_methods, test_methods_dist,
test_varlen); packed documents at 8 ranks here."""

import random

import pytest
import torch

import methods
from methods import Case
from methods.comm import run_threads
from methods.comm.base import WrappedComm
from methods.comm.counting import CommRecord
from methods.token_ring import result_peers
from suite.sim.ledger import Compute, Wait
from suite.sim.trace import trace
from tests.helpers import counted, problem_for
from tests.test_varlen import check_documents, random_documents

B, D = 2, 8


class Recording(WrappedComm):
    """Records every batched exchange: (op, peer, shape, dtype) of each of its operations."""

    def __init__(self, inner):
        super().__init__(inner)
        self.exchanges: list[list[tuple]] = []

    def exchange(self, ops):
        self.exchanges.append([(o.op, o.peer, tuple(o.tensor.shape), o.tensor.dtype) for o in ops])
        return self.inner.exchange(ops)


def recorded(world_size, causal=True, heads=4, kv_heads=4, dtype="float32", local=12):
    """Per rank: (forward exchanges, backward exchanges) of one autograd call."""
    case = Case(B, local * world_size, heads, kv_heads, D, dtype, causal, world_size)
    m = methods.get_method("token_ring")
    prob = problem_for(case)
    lay = m.layout(case)

    def rank(comm):
        rec = Recording(comm)
        q, k, v = (lay.shard(x, comm.rank).to(case.torch_dtype).requires_grad_() for x in (prob.q, prob.k, prob.v))
        out = m.attention(q, k, v, causal=causal, comm=rec)
        n_fwd = len(rec.exchanges)
        torch.autograd.grad(out, (q, k, v), lay.shard(prob.dout, comm.rank).to(case.torch_dtype))
        return rec.exchanges[:n_fwd], rec.exchanges[n_fwd:]

    return run_threads(world_size, rank)


def peers(ops, kind):
    return sorted({peer for op, peer, *_ in ops if op == kind})


def expected_steps(rank, p):
    """(send peers, recv peers) of each exchange: the query hop to r+1 (from r-1) at steps 0..P-2,
    results to r-(t-1) (from r+(t-1)) at steps 2..P, P being the closing exchange."""
    steps = []
    for step in range(p + 1):
        send, recv = set(), set()
        if step + 1 < p:
            send.add((rank + 1) % p)
            recv.add((rank - 1) % p)
        if result_peers(rank, p, step):
            owner, helper = result_peers(rank, p, step)
            assert owner == (rank - (step - 1)) % p and helper == (rank + step - 1) % p
            send.add(owner)
            recv.add(helper)
        if send or recv:
            steps.append((sorted(send), sorted(recv)))
    return steps


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_queries_go_to_the_next_rank_and_results_straight_to_their_owner(world_size):
    for rank, (fwd, bwd) in enumerate(recorded(world_size)):
        want = expected_steps(rank, world_size)
        for exchanges in (fwd, bwd):
            assert [(peers(x, "send"), peers(x, "recv")) for x in exchanges] == want, rank
        if world_size >= 3:
            assert len(fwd) == len(bwd) == world_size + 1  # P steps plus the closing exchange


@pytest.mark.parametrize("world_size", [4, 5])
def test_one_exchange_uses_both_directions_of_a_link(world_size):
    """Step 2: queries go to r+1 while the results of step 1 come back from it (and go to r-1
    while the next queries come from it)."""
    for rank, (fwd, bwd) in enumerate(recorded(world_size)):
        for exchanges in (fwd, bwd):
            ops = exchanges[2]
            nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
            assert nxt in peers(ops, "send") and nxt in peers(ops, "recv")
            assert prev in peers(ops, "send") and prev in peers(ops, "recv")


def test_nothing_kv_shaped_ever_leaves_a_rank():
    """GQA 8/2: every message has the queries' 8 heads (Q, dO, out, dQ [B, n, 8, D]; lse, D [B, 8, n]):
    K, V, dK and dV stay home."""
    for fwd, bwd in recorded(4, heads=8, kv_heads=2):
        for op, _, shape, _ in [o for x in fwd + bwd for o in x]:
            assert (shape[2] if len(shape) == 4 else shape[1]) == 8, (op, shape)


def test_messages_keep_the_input_dtype_and_fp32_statistics():
    """bf16: queries, dO, block outputs and partial dQ travel in bf16; lse and D in fp32."""
    seen = set()
    for fwd, bwd in recorded(4, dtype="bfloat16"):
        for _, _, shape, dtype in [o for x in fwd + bwd for o in x]:
            assert dtype == (torch.bfloat16 if len(shape) == 4 else torch.float32), (shape, dtype)
            seen.add(dtype)
    assert seen == {torch.bfloat16, torch.float32}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_results_carry_only_the_rows_computed(causal):
    """Causal zigzag: a rank computes all L rows of a later rank's queries (against its front chunk)
    and the back L/2 rows of an earlier rank's; results carry exactly those rows, no padding."""
    p, local = 4, 12
    for rank, (fwd, bwd) in enumerate(recorded(p, causal=causal, local=local)):
        steps = [s for s in range(p + 1) if s + 1 < p or result_peers(rank, p, s)]
        for exchanges in (fwd, bwd):
            sizes = []
            for step, ops in zip(steps, exchanges):
                if not result_peers(rank, p, step):
                    continue
                owner = result_peers(rank, p, step)[0]
                # the owner is never r+1 while the queries hop (only at the closing exchange)
                rows = {
                    shape[1] if len(shape) == 4 else shape[2]
                    for op, peer, shape, _ in ops
                    if op == "send" and peer == owner
                }
                want = local if not causal or rank < owner else local // 2
                assert rows == {want}, (rank, step, owner, rows)
                sizes.append(want)
            assert len(sizes) == p - 1  # one result message set per other rank


def test_ranks_send_different_bytes_and_the_totals_balance():
    m = methods.get_method("token_ring")
    for pass_ in ("fwd", "fwd_bwd"):
        causal = Case(B, 48, 4, 2, D, "bfloat16", True, 4)
        per_rank = [m.expected_rank_bytes(causal, pass_, r) for r in range(4)]
        sent, recv = [s for s, _ in per_rank], [r for _, r in per_rank]
        assert sent == sorted(sent, reverse=True) and sent[0] > sent[-1]  # rank 0 computes the most rows
        assert recv == sorted(recv) and recv[-1] > recv[0]  # rank P-1 receives the most
        assert sum(sent) == sum(recv)  # every message has a receiver
        assert m.expected_bytes(causal, pass_) == (sent[0], recv[-1])
        full = Case(B, 48, 4, 2, D, "bfloat16", False, 4)
        assert len({m.expected_rank_bytes(full, pass_, r) for r in range(4)}) == 1


def test_counted_bytes_of_each_rank_equal_its_formula_at_odd_world_size():
    """The generic byte test, here at P = 7 with 5 heads (odd everything)."""
    case = Case(1, 14 * 7, 5, 5, D, "float32", True, 7)
    m = methods.get_method("token_ring")
    for r, (fwd, bwd, _) in enumerate(counted("token_ring", case)):
        assert fwd == m.expected_rank_bytes(case, "fwd", r)
        assert (fwd[0] + bwd[0], fwd[1] + bwd[1]) == m.expected_rank_bytes(case, "fwd_bwd", r)


@pytest.mark.parametrize("world_size", [4, 5])
def test_traced_results_return_while_kernels_run(world_size):
    """In the simulator's trace, every exchange that carries results (steps 2..P-1) is posted before
    a block kernel and waited for after it, forward and backward: the return overlaps compute."""
    case = Case(2, 8 * world_size, 4, 4, D, "bfloat16", True, world_size)
    tr = trace("token_ring", case, "fwd_bwd")
    for rank, events in enumerate(tr.ranks):
        posted = [i for i, e in enumerate(events) if isinstance(e, CommRecord) and e.kind == "p2p"]
        assert len(posted) == 2 * (world_size + 1)
        waits = {}  # each exchange's first wait
        for i, e in enumerate(events):
            if isinstance(e, Wait):
                waits.setdefault(e.handle, i)
        for half in (posted[: world_size + 1], posted[world_size + 1 :]):
            for step in range(2, world_size):  # results go out with a step's queries; the last has none
                i = half[step]
                owner = result_peers(rank, world_size, step)[0]
                assert events[i].per_peer[owner][0] > 0
                assert any(isinstance(e, Compute) for e in events[i + 1 : waits[i]]), (rank, step)


def test_packed_documents_at_eight_ranks():
    """Any length (8 x 7 + 5), random documents, causal and full, batch 2: against float64."""
    rng = random.Random(8)
    seq_len = 8 * 7 + 5
    docs = random_documents(rng, 2, seq_len, 0, seq_len // 2 + 1)
    for causal in (True, False):
        assert check_documents("token_ring", {}, 8, seq_len, docs.lengths, causal) == ""


def test_it_is_registered_with_the_zigzag_layout_and_no_options():
    cls = methods.method_class("token_ring")
    assert cls.layout_kind == "zigzag" and cls.test_variants == ({},)
    with pytest.raises(TypeError, match="no option"):
        methods.get_method("token_ring", ranks_per_node=2)
