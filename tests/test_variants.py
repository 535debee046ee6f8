"""Attention variants every own method must compute exactly: a value head dim other than the
query/key one (MLA: DeepSeek-V3's q/k 192, v 128; here 12 and 8) and logit soft-capping (Gemma 2:
scores cap * tanh(s / cap) before the softmax). Each is checked against float64 on the unsharded
inputs: out, lse, dq, dk, dv, under causal and full masks, GQA, packed documents and a window."""

from dataclasses import replace

import pytest
import torch

import methods
from methods import Case, kernels
from methods.comm import run_threads
from methods.documents import Documents
from methods.masks import parse as parse_mask
from suite.check import Problem, make_inputs, max_abs_err, reference_attention
from tests.helpers import TENSORS, errors_vs_reference, own_variants, seq_len_for, variant_id

OWN = [(n, o) for n, o in own_variants() if n != "reference"]
IDS = [variant_id(n, o) for n, o in OWN]
D, DV = 12, 8  # a small MLA-like pair: q/k head dim 12, v head dim 8


def problem(case: Case, q_gain: float = 1.0) -> Problem:
    """The inputs of `case` (v and dout of width `case.dv`) and their float64 reference with the
    case's documents and soft cap; `q_gain` scales q so that scores reach the cap."""
    q, k, v, dout = make_inputs(
        case.batch, case.seq_len, case.heads, case.kv_heads, case.head_dim, case.dtype, 7, torch.device("cpu"), case.dv
    )
    q = q * q_gain
    prob = Problem(q, k, v, dout)
    common = dict(causal=case.causal, scale=kernels.default_scale(case.head_dim), documents=case.documents)
    prob.ref = reference_attention(q, k, v, dout, upcast=True, softcap=case.softcap, **common)
    naive = reference_attention(q, k, v, dout, upcast=False, softcap=case.softcap, **common)
    for name, ref in prob.ref.items():
        prob.naive_err[name] = max_abs_err(naive[name], ref)
        prob.ref_scale[name] = max(1.0, float(ref.abs().max()))
    return prob


def run_case(name: str, options: dict, case: Case, q_gain: float = 1.0) -> None:
    m = methods.get_method(name, **options)
    ok, why = m.supports(case)
    if not ok:  # heads the Ulysses split cannot take, a degree that does not divide: the only refusals
        assert any(s in why for s in ("heads", "does not divide")), why
        return
    prob = problem(case, q_gain)

    def rank(comm):
        lay = m.layout(case)
        q, k, v = (lay.shard(x, comm.rank).requires_grad_() for x in (prob.q, prob.k, prob.v))
        out, lse = m.attention(
            q, k, v, causal=case.causal, comm=comm, return_lse=True, docs=case.documents, softcap=case.softcap
        )
        assert out.shape[-1] == case.dv  # the output has the values' head dim
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), lay.shard(prob.dout, comm.rank))
        return {"out": out.detach(), "lse": lse, "dq": dq, "dk": dk, "dv": dv}

    errs = errors_vs_reference(m, case, prob, run_threads(case.world_size, rank))
    bad = {t: e for t, e in errs.items() if not e[0] <= e[1]}
    assert not bad, f"{name} {options} {case}: (error, tolerance) {bad}"


def mla_case(name, options, world_size, causal, heads=4, kv_heads=2, **kw) -> Case:
    seq_len = seq_len_for(name, world_size, options, heads, kv_heads)
    return Case(2, seq_len, heads, kv_heads, D, "float32", causal, world_size, head_dim_v=DV, **kw)


@pytest.mark.parametrize("name,options", OWN, ids=IDS)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_value_head_dim_other_than_the_query_one(name, options, world_size, causal):
    run_case(name, options, mla_case(name, options, world_size, causal))


def test_reference_takes_a_value_head_dim_and_a_cap():
    run_case("reference", {}, Case(1, 13, 4, 2, D, "float32", True, 1, head_dim_v=DV, softcap=5.0), q_gain=4.0)


@pytest.mark.parametrize("name,options", OWN, ids=IDS)
def test_value_head_dim_with_packed_documents(name, options):
    case = mla_case(name, options, 2, True)
    docs = Documents(((case.seq_len // 3, case.seq_len - case.seq_len // 3),) * 2, case.seq_len)
    run_case(name, options, replace(case, documents=docs))


@pytest.mark.parametrize("name,options", OWN, ids=IDS)
def test_value_head_dim_and_cap_under_a_sliding_window(name, options):
    case = mla_case(name, options, 3, True, softcap=5.0)
    window = parse_mask("sliding_window:5")
    run_case(name, options, replace(case, documents=Documents.single(2, case.seq_len, mask=window)), q_gain=4.0)


@pytest.mark.parametrize("name,options", OWN, ids=IDS)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_softcap(name, options, world_size, causal):
    """Cap 5 with q scaled by 4 (scores of a few units): the cap changes every row's softmax."""
    case = replace(mla_case(name, options, world_size, causal, softcap=5.0), head_dim_v=None)
    run_case(name, options, case, q_gain=4.0)


def test_the_cap_matters_at_these_scales():
    """The softcap tests are not vacuous: capped and uncapped outputs differ far beyond tolerance."""
    case = Case(1, 24, 4, 2, D, "float64", True, 1, softcap=5.0)
    prob = problem(case, q_gain=4.0)
    plain = reference_attention(prob.q, prob.k, prob.v, None, causal=True, scale=kernels.default_scale(D))
    assert max_abs_err(plain["out"], prob.ref["out"]) > 0.05


@pytest.mark.parametrize("offset", [None, 0, 3, -2])
@pytest.mark.parametrize("dv", [D, DV])
def test_math_kernel_softcap_backward_is_autograd_of_its_forward(offset, dv):
    """The math kernel's soft-capped backward (the chain rule through cap * tanh(s / cap)) equals
    torch.autograd of the capped forward written out, in float64, with a causal offset and GQA."""
    g = torch.Generator().manual_seed(3)
    q = (4 * torch.randn(2, 7, 4, D, generator=g, dtype=torch.float64)).requires_grad_()
    k = torch.randn(2, 9, 2, D, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(2, 9, 2, dv, generator=g, dtype=torch.float64).requires_grad_()
    cap, scale = 5.0, kernels.default_scale(D)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, dim=2)) * scale
    s = cap * torch.tanh(s / cap)
    if offset is not None:
        hidden = torch.arange(9)[None, :] > torch.arange(7)[:, None] + offset
        s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # rows that see no key: 0
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(2, dim=2))
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad(out, (q, k, v), dout)
    capped = kernels.ScoreScale(scale, cap)
    got_out, got_lse = kernels.block_forward(q.detach(), k.detach(), v.detach(), scale=capped, causal_offset=offset)
    got = kernels.block_backward(
        dout, q.detach(), k.detach(), v.detach(), got_out, got_lse, scale=capped, causal_offset=offset
    )
    assert torch.allclose(got_out, out.detach(), atol=1e-12)
    seen = torch.isfinite(lse)
    assert torch.allclose(got_lse[seen], lse.detach()[seen], atol=1e-12)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.allclose(a, b, atol=1e-11), name


def test_kernels_without_a_cap_refuse_it_and_auto_picks_math():
    cpu = torch.device("cpu")
    assert kernels.resolve_kernel("auto", cpu, torch.float32, 12, softcap=5.0) == "math"
    assert kernels.resolve_kernel("auto", cpu, torch.float32, 12) == "cpu_flash"
    with pytest.raises(ValueError, match="cpu_flash.*soft-cap"):
        kernels.resolve_kernel("cpu_flash", cpu, torch.float32, 12, softcap=5.0)
    case = Case(1, 12, 2, 2, D, "float32", True, 2, softcap=5.0)
    ok, why = methods.get_method("ring", kernel="cpu_flash").supports(case)
    assert not ok and "no soft-capping argument" in why
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        kernels.ScoreScale(0.5, -1.0)


@pytest.mark.parametrize("kernel", ["math", "cpu_flash"])
def test_cpu_kernels_take_a_narrower_or_wider_value_head(kernel):
    """cpu_flash's op takes one head dim: the kernel layer pads with zero columns (exact)."""
    g = torch.Generator().manual_seed(5)
    for dv in (DV, 16):
        q, k = (torch.randn(1, 6, 2, D, generator=g, dtype=torch.float64) for _ in range(2))
        v = torch.randn(1, 6, 2, dv, generator=g, dtype=torch.float64)
        dout = torch.randn(1, 6, 2, dv, generator=g, dtype=torch.float64)
        ref = reference_attention(q, k, v, dout, causal=True, scale=0.3)
        out, lse = kernels.block_forward(q, k, v, scale=0.3, causal_offset=0, kernel=kernel)
        grads = kernels.block_backward(dout, q, k, v, out, lse, scale=0.3, causal_offset=0, kernel=kernel)
        assert out.shape == (1, 6, 2, dv)
        for name, got in zip(TENSORS, (out, lse, *grads)):
            assert max_abs_err(got, ref[name]) < 1e-12, (kernel, dv, name)


def test_local_inputs_may_differ_in_the_value_head_dim_only():
    ring = methods.get_method("ring")
    q, k = torch.randn(1, 4, 2, D), torch.randn(1, 4, 2, D)

    def call(v):
        return run_threads(1, lambda comm: ring.attention(q, k, v, causal=True, comm=comm))[0]

    assert call(torch.randn(1, 4, 2, DV)).shape == (1, 4, 2, DV)
    with pytest.raises(ValueError, match="but for the head dim"):
        call(torch.randn(1, 4, 1, DV))


def test_flops_count_qk_at_the_query_dim_and_pv_at_the_value_dim():
    from suite import metrics as M

    plain = M.attention_flops(1, 100, 4, 12, False, "fwd")
    assert plain == 4.0 * 100 * 100 * 4 * 12  # flash-attention's convention, unchanged
    assert M.attention_flops(1, 100, 4, 12, False, "fwd", head_dim_v=8) == 2.0 * 100 * 100 * 4 * (12 + 8)
    assert M.pairs_flops(10, 4, 12, "fwd", head_dim_v=8) == 2.0 * 10 * 4 * (12 + 8)


def test_a_sweep_plans_variants_and_keeps_the_plain_points_keys():
    """head_dim_v null (or equal to head_dim) and softcap 0 are the plain point: same key and same
    row columns as a sweep without the axes; the others carry head_dim_v and softcap in their identity."""
    from suite.config import load_config
    from tests.helpers import plan_for

    base = ["sweep.methods=[ring]", "sweep.method_options={}", "sweep.exclude=[]", "sweep.world_size=[2]"]
    base += ["sweep.passes=[fwd]", "sweep.sinks=[false]"]
    plain = plan_for(load_config("configs/variants_cpu.yaml", base + ["~sweep.head_dim_v", "~sweep.softcap"])[0])
    both = plan_for(load_config("configs/variants_cpu.yaml", base + ["sweep.head_dim_v=[null,192,128]"])[0])
    keys = {s.key for s in plain}
    assert len(both) == 4 * len(plain)  # (null = 192, 128) x (cap 0, 5): 192 is the plain point
    assert {s.key for s in both if s.head_dim_v is None and not s.softcap} == keys
    mla = [s for s in both if s.head_dim_v == 128 and s.softcap == 5.0]
    assert mla and all(s.identity()["head_dim_v"] == 128 and s.identity()["softcap"] == 5.0 for s in mla)
    assert all("head_dim_v" not in s.identity() and "softcap" not in s.identity() for s in plain)
    assert "D=192/128 cap=5" in mla[0].label()


def test_a_model_with_a_narrower_value_head_trains_like_the_single_device_baseline():
    """The perplexity model with head_dim_v (its wv and wo projections at the values' dim, as MLA's):
    a ring of 3 and Ulysses at 2 give every step's loss and the perplexity of the single-device
    baseline (torch's SDPA) within the check's tolerance, and the narrower values are another model."""
    import functools

    import methods
    from methods import layouts
    from methods.comm import run_threads
    from suite.perplexity.data import load_corpus
    from suite.perplexity.model import ModelConfig, sdpa_attend
    from suite.perplexity.train import TrainConfig, train_and_evaluate

    corpus = load_corpus("stdlib", max_bytes=200_000)
    tc = TrainConfig(steps=4, batch=2, seq_len=36, lr=3e-3, warmup_steps=1, eval_batches=1)
    single = layouts.contiguous(tc.seq_len, 1)

    def baseline(model):
        return train_and_evaluate(model, tc, corpus, layout=single, comm=None, make_attend=lambda c: sdpa_attend)

    mla = ModelConfig(heads=4, kv_heads=2, head_dim=12, layers=2, head_dim_v=8)
    want, plain = baseline(mla), baseline(ModelConfig(heads=4, kv_heads=2, head_dim=12, layers=2))
    assert want.losses != plain.losses
    for name, world_size in (("ring", 3), ("ulysses", 2)):
        m = methods.get_method(name)
        layout = m.layout(Case(tc.batch, tc.seq_len, 4, 2, 12, "float32", True, world_size, head_dim_v=8))

        def attend(c, m=m):
            return functools.partial(m.attention, causal=True, comm=c)

        got = run_threads(
            world_size, lambda comm: train_and_evaluate(mla, tc, corpus, layout=layout, comm=comm, make_attend=attend)
        )[0]
        assert max(abs(a - b) / abs(b) for a, b in zip(got.losses, want.losses)) < 1e-4, (name, got.losses)
        assert abs(got.perplexity / want.perplexity - 1) < 1e-3, name


@pytest.mark.parametrize("name,options", OWN, ids=IDS)
@pytest.mark.parametrize("world_size,tokens", [(4, 2), (7, 9)])
def test_value_head_dim_where_a_rank_holds_only_padding(name, options, world_size, tokens):
    """A sequence of a few tokens padded to the method's granule: some rank holds only padding,
    computes no block, and must still return an output of the values' head dim (dispatch's empty
    accumulator once took the queries' and failed the backward). Compared on the true tokens."""
    m = methods.get_method(name, **options)
    true = Case(2, tokens, 4, 2, D, "float32", True, world_size, head_dim_v=DV)
    padded = m.padded_len(true)
    case = replace(true, seq_len=padded, documents=Documents(((tokens,), (tokens,)), padded))
    ok, why = m.supports(case)
    if not ok:
        assert any(s in why for s in ("heads", "does not divide")), why
        return
    prob = problem(replace(true, documents=Documents(((tokens,), (tokens,)), tokens)))

    def rank(comm):
        lay = m.layout(case)

        def shard(x):  # [B, tokens, H, d] -> this rank's rows of [B, padded, H, d], the tail zeros
            return lay.shard(torch.nn.functional.pad(x, (0, 0, 0, 0, 0, padded - tokens)), comm.rank)

        q, k, v = (shard(x).requires_grad_() for x in (prob.q, prob.k, prob.v))
        out, lse = m.attention(q, k, v, causal=True, comm=comm, return_lse=True, docs=case.documents)
        assert out.shape[-1] == DV
        return (out.detach(), lse) + torch.autograd.grad(out, (q, k, v), shard(prob.dout))

    per_rank = run_threads(world_size, rank)
    lay = m.layout(case)
    for i, t in enumerate(TENSORS):
        dim = 2 if t == "lse" else 1
        got = lay.unshard([r[i] for r in per_rank], dim=dim).narrow(dim, 0, tokens)
        err, tol = max_abs_err(got, prob.ref[t]), prob.tolerance(t, world_size)
        assert err <= tol, (name, options, t, err, tol)
