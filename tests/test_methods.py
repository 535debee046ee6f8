"""Own methods against float64 attention on the unsharded inputs, under ThreadComm (virtual ranks).

Pass rule (DESIGN.md 7): error <= 2 x error of naive same-dtype attention + 2 eps floor.
"""
import pytest
import torch

import methods
from methods import Case
from methods.comm import CommLedger, CountingComm, run_threads
from tests.helpers import TENSORS, errors_vs_reference, problem_for, run_method_rank

HEADS = [(5, 5), (6, 2), (4, 1)]  # odd MHA, GQA, MQA


def assert_matches_reference(name, case, **options):
    m = methods.get_method(name, **options)
    ok, why = m.supports(case)
    assert ok, why
    prob = problem_for(case)
    per_rank = run_threads(case.world_size, lambda comm: run_method_rank(m, case, prob, comm))
    errs = errors_vs_reference(m, case, prob, per_rank)
    bad = {t: e for t, e in errs.items() if not e[0] <= e[1]}
    assert not bad, f"{name} {case}: (error, tolerance) {bad}"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_ring_matches_float64(world_size, causal, heads, kv_heads):
    # seq 60 is not a power of two; 60/4 = 15 tokens per rank
    assert_matches_reference("ring", Case(2, 60, heads, kv_heads, 16, "float32", causal, world_size))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,kv_heads", [(12, 12), (12, 6), (12, 3), (8, 2), (5, 5)])
def test_ulysses_matches_float64_or_says_why_not(world_size, causal, heads, kv_heads):
    case = Case(2, 60, heads, kv_heads, 16, "float32", causal, world_size)
    ok, why = methods.get_method("ulysses").supports(case)
    if heads % world_size:
        assert not ok and "heads divisible by world_size" in why
        return
    if kv_heads % world_size and world_size % kv_heads:
        assert not ok and "kv_heads" in why
        return
    assert_matches_reference("ulysses", case)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_float64_and_is_single_device(causal):
    assert_matches_reference("reference", Case(3, 37, 5, 5, 16, "float32", causal, 1))
    ok, why = methods.get_method("reference").supports(Case(1, 8, 2, 2, 8, "float32", causal, 2))
    assert not ok and "world_size 1" in why


@pytest.mark.parametrize("name,world_size,dtype", [("ring", 4, "bfloat16"), ("ring", 3, "float16"),
                                                   ("ulysses", 2, "bfloat16"), ("ulysses", 4, "float16")])
def test_low_precision_within_the_pass_rule(name, world_size, dtype):
    assert_matches_reference(name, Case(2, 96, 8, 2, 32, dtype, True, world_size))


def test_float64_inputs_stay_float64_exact():
    assert_matches_reference("ring", Case(1, 24, 4, 2, 8, "float64", True, 3))


@pytest.mark.parametrize("kernel", ["math", "cpu_flash"])
def test_every_cpu_kernel_gives_the_same_answer(kernel):
    assert_matches_reference("ring", Case(2, 40, 4, 2, 16, "float32", True, 4), kernel=kernel)


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


# -- communication volume: counted bytes equal each method's documented formula ----------------------
def counted_fwd_bwd(name, case):
    m = methods.get_method(name)
    prob = problem_for(case)
    lay = m.layout(case)

    def fn(comm):
        led = CommLedger()
        c = CountingComm(comm, led)
        q, k, v = (lay.shard(x, comm.rank).requires_grad_() for x in (prob.q, prob.k, prob.v))
        out = m.attention(q, k, v, causal=case.causal, comm=c)
        fwd = (led.bytes_sent, led.bytes_recv)
        torch.autograd.grad(out, (q, k, v), lay.shard(prob.dout, comm.rank))
        return fwd, (led.bytes_sent - fwd[0], led.bytes_recv - fwd[1])
    return run_threads(case.world_size, fn)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ring_bytes_equal_the_docstring_formula(world_size, dtype):
    case = Case(2, 24, 4, 2, 8, dtype, True, world_size)
    b, l, hkv, d, p = 2, 24 // world_size, 2, 8, world_size
    e = torch.finfo(getattr(torch, dtype)).bits // 8
    a = 4  # fp32 dK/dV accumulators travel
    fwd = (p - 1) * 2 * b * l * hkv * d * e
    bwd = (p - 1) * 2 * b * l * hkv * d * e + (p * 2 * b * l * hkv * d * a if p > 1 else 0)
    for got_fwd, got_bwd in counted_fwd_bwd("ring", case):
        assert got_fwd == (fwd, fwd) and got_bwd == (bwd, bwd)


@pytest.mark.parametrize("world_size,kv_heads", [(2, 4), (4, 4), (4, 2), (4, 1)])
def test_ulysses_bytes_equal_the_docstring_formula(world_size, kv_heads):
    case = Case(2, 24, 8, kv_heads, 8, "float32", False, world_size)
    b, l, h, d, p, e = 2, 24 // world_size, 8, 8, world_size, 4
    hkv_sent = max(kv_heads, p)
    each = (p - 1) * b * l * d * e * (2 * h + 2 * hkv_sent) // p
    for got_fwd, got_bwd in counted_fwd_bwd("ulysses", case):
        assert got_fwd == (each, each) and got_bwd == (each, each)


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
    with pytest.raises(ValueError, match="divisible"):
        ring.layout(Case(1, 10, 4, 4, 8, "float32", True, 4))
    ok, why = ring.supports(Case(1, 10, 4, 4, 8, "float32", True, 4))
    assert not ok and "divisible by 4" in why
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
    assert {"reference", "ring", "ulysses"} <= set(methods.available())


@pytest.mark.parametrize("name,world_size", [("ring", 3), ("ulysses", 2)])
def test_direct_forward_backward_equals_autograd(name, world_size):
    """attention_fwd_bwd (no autograd engine; virtual ranks on one GPU) computes what autograd does."""
    case = Case(2, 48, 4, 2, 8, "float32", True, world_size)
    m = methods.get_method(name)
    prob = problem_for(case)
    lay = m.layout(case)

    def both(comm):
        r = comm.rank
        q, k, v, do = (lay.shard(x, r) for x in (prob.q, prob.k, prob.v, prob.dout))
        direct = m.attention_fwd_bwd(q, k, v, do, causal=True, comm=comm)
        via_autograd = run_method_rank(m, case, prob, comm)
        return direct, via_autograd
    for direct, via in run_threads(world_size, both):
        for got, t in zip(direct, TENSORS):
            assert torch.equal(got, via[t]), t
