"""Every own method against float64 attention on the unsharded inputs, under ThreadComm (virtual
ranks), plus communication volume and causal balance. Real processes: test_methods_dist.py.

Pass rule (docs/DESIGN.md section 7): error <= 2 x error of naive same-dtype attention + a floor.
"""

from dataclasses import replace

import pytest
import torch

import methods
from methods import Case
from methods.comm import run_threads
from methods.documents import Documents
from methods.kernels import is_full
from methods.masks import parse as parse_mask
from tests.helpers import (
    TENSORS,
    counted,
    errors_vs_reference,
    own_methods,
    own_variants,
    problem_for,
    run_method_rank,
    seq_len_for,
    variant_id,
)

# (name, options): every own method, with each option set that changes its algorithm (the
# method's own `test_variants`)
OWN = own_variants()
IDS = [variant_id(n, o) for n, o in OWN]
WORLD_SIZES = [1, 2, 3, 4, 5, 6, 8]
HEADS = [(8, 8), (8, 2), (5, 5)]  # MHA, GQA, an odd head count


def check(name, options, case):
    m = methods.get_method(name, **options)
    ok, why = m.supports(case)
    assert ok, why
    prob = problem_for(case)
    per_rank = run_threads(case.world_size, lambda comm: run_method_rank(m, case, prob, comm))
    errs = errors_vs_reference(m, case, prob, per_rank)
    bad = {t: e for t, e in errs.items() if not e[0] <= e[1]}
    assert not bad, f"{name} {options} {case}: (error, tolerance) {bad}"


@pytest.mark.parametrize("name,options", OWN, ids=IDS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads,kv_heads", HEADS, ids=["mha", "gqa", "odd"])
def test_method_matches_float64_or_says_why_not(name, options, world_size, causal, heads, kv_heads):
    case = Case(
        2, seq_len_for(name, world_size, options, heads, kv_heads), heads, kv_heads, 8, "float32", causal, world_size
    )
    m = methods.get_method(name, **options)
    ok, why = m.supports(case)
    if not ok:
        # the only reasons a point may be refused: heads the Ulysses split cannot take, or a
        # degree/node size that does not divide the world size
        assert any(s in why for s in ("heads divisible", "kv_heads", "does not divide")), why
        return
    check(name, options, case)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6, 8])
def test_every_usp_factorisation(world_size):
    for u in [d for d in range(1, world_size + 1) if world_size % d == 0]:
        check("usp", {"ulysses_degree": u}, Case(2, 2 * world_size * 3, 24, 24, 8, "float32", True, world_size))


@pytest.mark.parametrize("world_size,per_node", [(4, 2), (6, 2), (6, 3), (8, 4)])
def test_burst_two_level_ring(world_size, per_node):
    for causal in (True, False):
        check(
            "burst", {"ranks_per_node": per_node}, Case(2, 2 * world_size * 3, 4, 2, 8, "float32", causal, world_size)
        )


@pytest.mark.parametrize("name,options", OWN, ids=IDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_within_the_pass_rule(name, options, dtype):
    check(name, options, Case(2, seq_len_for(name, 4, options, 8, 2, factor=12), 8, 2, 32, dtype, True, 4))


def test_reference_is_single_device():
    check("reference", {}, Case(3, 37, 5, 5, 16, "float32", True, 1))
    ok, why = methods.get_method("reference").supports(Case(1, 8, 2, 2, 8, "float32", True, 2))
    assert not ok and "world_size 1" in why


def test_float64_inputs_stay_float64_exact():
    check("ring", {}, Case(1, 24, 4, 2, 8, "float64", True, 3))
    check("burst", {}, Case(1, 24, 4, 2, 8, "float64", True, 3))


@pytest.mark.parametrize("kernel", ["math", "cpu_flash"])
def test_every_cpu_kernel_gives_the_same_answer(kernel):
    for name in ("ring", "stripe_ring", "burst", "tasp"):
        check(name, {"kernel": kernel}, Case(2, seq_len_for(name, 4, {}, 4, 2), 4, 2, 16, "float32", True, 4))


def test_edge_cases_agree_with_usp():
    """USP with ulysses_degree = P is Ulysses and with 1 it is zigzag_ring: same outputs."""
    case = Case(2, 48, 8, 8, 8, "float32", True, 4)
    prob = problem_for(case)

    def outputs(name, **opts):
        m = methods.get_method(name, **opts)
        per_rank = run_threads(4, lambda c: run_method_rank(m, case, prob, c))
        return {t: m.layout(case).unshard([r[t] for r in per_rank], dim=2 if t == "lse" else 1) for t in TENSORS}

    pairs = [
        (outputs("usp", ulysses_degree=4), outputs("ulysses")),
        (outputs("usp", ulysses_degree=1), outputs("zigzag_ring")),
    ]
    for a, b in pairs:
        for t in TENSORS:
            torch.testing.assert_close(a[t], b[t], rtol=0, atol=2e-6)


def test_the_check_catches_a_wrong_method():
    """A ring that drops the causal mask on its diagonal block must fail the pass rule."""

    class NoDiagonalMask(methods.method_class("ring")):
        def forward(self, q, k, v, *, comm, causal, scale, return_lse):
            return super().forward(q, k, v, comm=comm, causal=False, scale=scale, return_lse=return_lse)

    case = Case(1, 32, 4, 4, 8, "float32", True, 2)
    prob = problem_for(case)
    m = NoDiagonalMask()
    errs = errors_vs_reference(m, case, prob, run_threads(2, lambda c: run_method_rank(m, case, prob, c)))
    assert errs["out"][0] > 100 * errs["out"][1]


@pytest.mark.parametrize("name,world_size", [("ring", 3), ("ulysses", 2), ("burst", 4), ("tasp", 3)])
def test_direct_forward_backward_equals_autograd(name, world_size):
    """attention_fwd_bwd (no autograd engine; virtual ranks on one GPU) computes what autograd does."""
    case = Case(2, seq_len_for(name, world_size, {}, 4, 2), 4, 2, 8, "float32", True, world_size)
    m = methods.get_method(name)
    prob = problem_for(case)
    lay = m.layout(case)

    def both(comm):
        r = comm.rank
        q, k, v, do = (lay.shard(x, r) for x in (prob.q, prob.k, prob.v, prob.dout))
        return m.attention_fwd_bwd(q, k, v, do, causal=True, comm=comm), run_method_rank(m, case, prob, comm)

    for direct, via in run_threads(world_size, both):
        for got, t in zip(direct, TENSORS):
            assert torch.equal(got, via[t]), t


# -- communication volume: counted bytes equal each method's documented formula ----------------------


B, D = 2, 8


@pytest.mark.parametrize("name,options", OWN, ids=IDS)
# Two element sizes (2 and 8 bytes) pin every term of a formula that scales with the input dtype; the
# float32 LSE and accumulators are in both. World sizes: one, even, odd, prime and the largest.
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2), (12, 3)], ids=["mha", "gqa", "gqa3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_counted_bytes_equal_the_declared_formula(name, options, world_size, heads, kv_heads, dtype):
    """Every rank's counted bytes, forward and backward, equal the method's `expected_rank_bytes`
    for that rank (its documented communication formula, as code), and `expected_bytes` is the
    most any rank sends and receives."""
    case = Case(B, seq_len_for(name, world_size, options, heads, kv_heads), heads, kv_heads, D, dtype, True, world_size)
    m = methods.get_method(name, **options)
    if not m.supports(case)[0]:
        return  # heads or degrees this method cannot split (test_method_matches_float64 checks the reasons)
    for pass_ in ("fwd", "fwd_bwd"):
        want = [m.expected_rank_bytes(case, pass_, r) for r in range(world_size)]
        assert all(w is not None for w in want), f"{name} declares no communication formula"
        assert m.expected_bytes(case, pass_) == (max(s for s, _ in want), max(r for _, r in want)), (name, pass_)
    for rank, (got_fwd, got_bwd, _) in enumerate(counted(name, case, **options)):
        fwd_want, both_want = m.expected_rank_bytes(case, "fwd", rank), m.expected_rank_bytes(case, "fwd_bwd", rank)
        assert got_fwd == fwd_want, (name, options, rank, "forward", got_fwd, fwd_want)
        both = (got_fwd[0] + got_bwd[0], got_fwd[1] + got_bwd[1])
        assert both == both_want, (name, options, rank, "forward + backward", both, both_want)


@pytest.mark.parametrize("name,options", OWN, ids=IDS)
@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
@pytest.mark.parametrize("mask", ["sliding_window:3", "chunked:3", "global_window:globals=2,window=2"])
def test_counted_bytes_equal_the_declared_formula_under_a_mask(name, options, world_size, mask):
    """Under a mask family (a window, chunks: rings may stop early, chunks of 3 tokens after one
    step on the contiguous and zigzag layouts of 3 granules) every rank's counted bytes still equal
    `expected_rank_bytes`, which reads the mask from the case's documents."""
    family = parse_mask(mask)
    seq_len = seq_len_for(name, world_size, options, 4, 2)
    case = Case(1, seq_len, 4, 2, D, "bfloat16", family.causal, world_size)
    case = replace(case, documents=Documents.single(1, seq_len, mask=family))
    m = methods.get_method(name, **options)
    if not m.supports(case)[0]:
        return
    for rank, (got_fwd, got_bwd, _) in enumerate(counted(name, case, **options)):
        fwd_want, both_want = m.expected_rank_bytes(case, "fwd", rank), m.expected_rank_bytes(case, "fwd_bwd", rank)
        assert got_fwd == fwd_want, (name, options, rank, "forward", got_fwd, fwd_want)
        both = (got_fwd[0] + got_bwd[0], got_fwd[1] + got_bwd[1])
        assert both == both_want, (name, options, rank, "forward + backward", both, both_want)


@pytest.mark.parametrize("name,options", OWN, ids=IDS)
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_counted_bytes_follow_a_value_head_dim_other_than_the_query_one(name, options, world_size, causal):
    """MLA-like head dims (q/k 12, v 8; DeepSeek-V3's 192 and 128): K, Q, dQ, dK travel at the
    query/key width and V, out, dO, dV at the values', and every rank's counted bytes still equal
    its `expected_rank_bytes`, which differ from those of equal head dims (the test bites)."""
    case = Case(1, seq_len_for(name, world_size, options, 4, 2), 4, 2, 12, "bfloat16", causal, world_size)
    case = replace(case, head_dim_v=8)
    m = methods.get_method(name, **options)
    if not m.supports(case)[0]:
        return
    same = replace(case, head_dim_v=None)
    assert m.expected_bytes(case, "fwd_bwd") != m.expected_bytes(same, "fwd_bwd") or world_size == 1
    for rank, (got_fwd, got_bwd, _) in enumerate(counted(name, case, **options)):
        fwd_want, both_want = m.expected_rank_bytes(case, "fwd", rank), m.expected_rank_bytes(case, "fwd_bwd", rank)
        assert got_fwd == fwd_want, (name, options, rank, "forward", got_fwd, fwd_want)
        both = (got_fwd[0] + got_bwd[0], got_fwd[1] + got_bwd[1])
        assert both == both_want, (name, options, rank, "forward + backward", both, both_want)


def test_the_byte_formulas_are_not_vacuous():
    """The formulas the generic test checks move what the algorithms must: the ring family's K/V
    on P-1 hops, Ulysses' (P-1)/P of q, k, v, out, and nothing at one rank."""
    case = Case(2, 48, 8, 2, 8, "float32", True, 4)
    kv = 2 * 2 * 12 * 2 * 8 * 4
    assert methods.get_method("ring").expected_bytes(case, "fwd") == (3 * kv, 3 * kv)
    assert methods.get_method("ring").expected_bytes(case, "fwd_bwd")[0] == 3 * kv + 3 * kv + 4 * kv
    uly = 3 * 2 * 12 * 8 * 4 * (2 * 8 + 2 * 4) // 4  # 2 KV heads replicated to one per rank
    assert methods.get_method("ulysses").expected_bytes(case, "fwd") == (uly, uly)
    one = Case(2, 48, 8, 2, 8, "float32", True, 1)
    assert all(methods.get_method(n).expected_bytes(one, "fwd_bwd") == (0, 0) for n in own_methods())


def test_burst_two_level_ring_crosses_nodes_once_per_cycle():
    """8 ranks as 2 nodes x 4: of the 7 forward hops a rank receives, only 1 crosses nodes."""
    case = Case(B, 48, 4, 2, D, "float32", False, 8)
    for rank, (_, _, records) in enumerate(counted("burst", case, ranks_per_node=4)):
        peers = [peer for rec in records for peer in rec.per_peer if rec.per_peer[peer][1] > 0]
        assert len(peers) == 7
        assert sum(peer // 4 != rank // 4 for peer in peers) == 1


@pytest.mark.parametrize("world_size", [3, 5, 8])
def test_tasp_spreads_each_round_over_every_link(world_size):
    """With a full decomposition each forward round sends one equal unit to every other rank."""
    from methods.tasp import num_cycles

    p = world_size
    k = num_cycles(p)
    assert k == p - 1
    case = Case(B, seq_len_for("tasp", p), 8, 2, D, "float32", False, p)
    unit = 2 * B * (case.seq_len // p // k) * 2 * D * 4  # K and V of one unit
    for rank, (_, _, records) in enumerate(counted("tasp", case)):
        assert len(records) == p - 1  # one batched exchange per round
        for rec in records:
            assert set(rec.per_peer) == set(range(p)) - {rank}
            assert all(sent == recv == unit for sent, recv in rec.per_peer.values())


# -- causal balance ------------------------------------------------------------------------------------
def visible_pairs(q_len: int, k_len: int, offset) -> int:
    if is_full(q_len, k_len, offset):
        return q_len * k_len
    return sum(max(0, min(k_len, i + offset + 1)) for i in range(q_len))


def _rows(sl: slice, n: int) -> int:
    return len(range(*sl.indices(n)))


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_zigzag_and_burst_do_equal_causal_work_per_step(world_size):
    from methods.burst import query_ring_plan
    from methods.zigzag_ring import zigzag_plan

    l = 2 * 5
    for make in (zigzag_plan, query_ring_plan):
        for step in range(world_size):
            work = set()
            for rank in range(world_size):
                blocks = make(True, rank, l)((rank - step) % world_size)
                work.add(sum(visible_pairs(_rows(b.q_rows, l), _rows(b.k_rows, l), b.causal_offset) for b in blocks))
            assert len(work) == 1, (make.__name__, step, work)


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6, 8])
def test_zigzag_tasp_does_equal_causal_work_per_step(world_size):
    from methods.tasp import num_cycles, step_calls

    k, c = num_cycles(world_size), 3
    for step in range(1, world_size):
        work = {
            sum(
                _rows(rows, 2 * k * c) * sum(_rows(sl, 2 * c) for _, sl in parts)
                for rows, parts in step_calls(True, rank, world_size, step, c)
            )
            for rank in range(world_size)
        }
        assert work == {2 * k * k * c * c}, (step, work)  # k units of 2kc^2 pairs each


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6, 7, 8, 9, 12])
def test_tasp_calls_read_their_keys_as_one_run_of_pieces(world_size):
    """Every kernel call of a causal step reads its keys from consecutive pieces of the held buffer
    (no gather), each unit sits in two distinct pieces, and the pieces a call reads are exactly its
    units' parts."""
    from methods.tasp import num_cycles, piece_calls, placement, step_calls

    k, c = num_cycles(world_size), 3
    for rank in range(world_size):
        for step in range(1, world_size):
            pos = placement(world_size, True, rank, step)
            assert sorted(i for both in pos for i in both) == list(range(2 * k))
            for (rows, parts), (rows2, run) in zip(
                sorted(step_calls(True, rank, world_size, step, c), key=lambda call: call[0] == slice(None)),
                piece_calls(world_size, True, rank, step, c),
            ):
                want = [i for j, sl in parts for i in (pos[j][:1] if sl == slice(0, c) else pos[j])]
                assert rows == rows2 and want == list(range(run.start, run.stop)), (rank, step)


def test_stripe_work_differs_by_at_most_one_diagonal():
    from methods.stripe_ring import stripe_plan

    p, l = 4, 9
    for step in range(p):
        work = [
            sum(visible_pairs(l, l, b.causal_offset) for b in stripe_plan(True, r)((r - step) % p)) for r in range(p)
        ]
        assert max(work) - min(work) <= l


# -- bad input: a clear error naming the constraint, never a wrong answer or a hang --------------------
def test_bad_inputs_raise_clear_errors():
    ring = methods.get_method("ring")

    def call(q, k, v):
        return run_threads(1, lambda c: ring.attention(q, k, v, causal=True, comm=c), timeout_s=5)

    x = torch.randn(1, 8, 4, 8)
    with pytest.raises(ValueError, match="same tokens"):
        call(x, x[:, :6], x[:, :6])
    with pytest.raises(ValueError, match="share a dtype"):
        call(x, x.double(), x.double())
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        call(x, x[:, :, :3], x[:, :, :3])
    with pytest.raises(ValueError, match=r"\[batch, seq, heads, head_dim\]"):
        call(x[0], x[0], x[0])
    for name, case, need in [
        ("ring", Case(1, 10, 4, 4, 8, "float32", True, 4), "divisible by 4"),
        ("zigzag_ring", Case(1, 12, 4, 4, 8, "float32", True, 4), "divisible by 8"),
        ("tasp", Case(1, 24, 4, 4, 8, "float32", True, 4), "divisible by 2 x world_size x cycles"),
        ("usp", Case(1, 16, 4, 4, 8, "float32", True, 4), "ulysses_degree 3 does not divide"),
        ("ulysses", Case(1, 16, 6, 6, 8, "float32", True, 4), "heads divisible"),
    ]:
        m = methods.get_method(name, **({"ulysses_degree": 3} if name == "usp" else {}))
        ok, why = m.supports(case)
        assert not ok and need in why, (name, why)
    ok, why = ring.supports(Case(1, 8, 4, 4, 8, "float32", True, 2, device="cuda"))
    assert torch.cuda.is_available() or (not ok and "CUDA" in why)


def test_registry_errors_list_the_valid_choices():
    with pytest.raises(KeyError, match="registered methods: .*ring"):
        methods.get_method("rnig")
    with pytest.raises(TypeError, match="no option"):
        methods.get_method("ring", ulysses_degree=2)
    with pytest.raises(ValueError, match="already registered"):

        @methods.register
        class Dup(methods.Method):
            name = "ring"

    assert {"reference", "ring", "zigzag_ring", "ulysses", "usp", "burst", "tasp"} <= set(methods.available())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_check_catches_a_dropped_block_in_low_precision(dtype):
    """The last rank silently skips the block of rank 0: with a floor scaled by bf16's eps this
    passed at P = 8, so the pass rule's P term uses the accumulator's eps."""
    from methods.kv_ring import kv_ring_forward
    from methods.ring import ring_plan

    class DropsABlock(methods.method_class("ring")):
        def forward(self, q, k, v, *, comm, causal, scale, return_lse):
            base = ring_plan(causal, comm.rank)
            drop = comm.rank == comm.world_size - 1

            def plan(src):
                return [] if drop and src == 0 else base(src)

            out, lse = kv_ring_forward(q, k, v, comm=comm, plan=plan, scale=scale, kernel=self.kernel)
            return out, lse, (q, k, v, out, lse, None)

    case = Case(2, 8 * 48, 8, 8, 32, dtype, False, 8)
    prob = problem_for(case)
    m = DropsABlock()
    errs = errors_vs_reference(m, case, prob, run_threads(8, lambda c: run_method_rank(m, case, prob, c)))
    assert errs["out"][0] > errs["out"][1], errs["out"]


def test_views_of_a_fused_projection_are_accepted():
    """q, k, v as views of one qkv tensor (not contiguous) work for every method."""
    for name, options in OWN:
        case = Case(2, seq_len_for(name, 4, options, 4, 4), 4, 4, 8, "float32", True, 4)
        m = methods.get_method(name, **options)
        prob = problem_for(case)
        lay = m.layout(case)

        def fn(comm):
            qkv = torch.stack([lay.shard(x, comm.rank) for x in (prob.q, prob.k, prob.v)], dim=2)
            q, k, v = qkv.unbind(2)
            assert not q.is_contiguous()
            return m.attention(q, k, v, causal=True, comm=comm)

        run_threads(4, fn)


def test_a_method_resolves_the_kernel_name_a_timed_kernel_wraps():
    # the suite swaps a TimedKernel in while it measures; supports and kernel_used read its name
    from methods.kernels import TimedKernel

    method = methods.get_method("ring", kernel="math")
    case = Case(batch=1, seq_len=16, heads=2, kv_heads=2, head_dim=8, dtype="float32", causal=True, world_size=2)
    method.kernel = TimedKernel("math")
    assert method.supports(case) == (True, "")
    assert method.kernel_used(torch.device("cpu"), torch.float32, 8) == "math"
    method.kernel = TimedKernel("cpu_flash")
    assert method.kernel_used(torch.device("cpu"), torch.float32, 8) == "cpu_flash"
