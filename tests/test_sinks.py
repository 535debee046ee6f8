"""Attention sinks (gpt-oss): every own method against float64 attention with a sink logit per
query head, on the unsharded inputs, under virtual ranks (ThreadComm).

The sink joins every query row's softmax denominator once: lse_i = log(sum_j e^x_ij + e^s_h).
Under sequence parallelism a row's partial results are merged from several ranks or ring steps,
so the sink must be folded once, after the last merge (methods/merge.py `fold_sink`), not into
every partial. The reference (suite/check.py) differentiates the definition by autograd in
float64, including dsink; a rank's dsink is its own rows' share, and the shares sum to it.
"""

from __future__ import annotations

import pytest
import torch

import methods
from methods import Case, merge
from methods.comm import run_threads
from methods.documents import Documents
from methods.masks import parse as parse_mask
from suite.check import build_problem
from tests.helpers import own_variants, variant_id

OWN = own_variants()
IDS = [variant_id(n, o) for n, o in OWN]
TENSORS = ("out", "lse", "dq", "dk", "dv")


def _heads(world_size: int) -> tuple[int, int]:
    """GQA with heads the Ulysses split takes at this world size (6 heads: not a power of two)."""
    return (6, 3) if world_size == 3 else (6, 2)


def sink_problem(batch, seq_len, heads, kv_heads, causal, *extra, dtype="float32", reference=True, **kw):
    """The inputs (and, with `reference`, the float64 reference) of a head-dim-8 problem with sinks."""
    cpu = torch.device("cpu")
    return build_problem(
        batch, seq_len, heads, kv_heads, 8, dtype, causal, *extra, seed=0, device=cpu, with_reference=reference,
        sinks=True, **kw,
    )  # fmt: skip


def _case(method, world_size, causal, seq_len, lengths=None, mask=None, batch=2, dv=None, cap=0.0):
    """The case `method` runs (padded to its granule with documents when any) and the true
    documents of the reference (None: plain). dv, cap: a value head dim and a soft cap."""
    heads, kv_heads = _heads(world_size)
    true_docs = Documents(lengths, seq_len, mask) if lengths is not None else None
    variant = dict(sinks=True, head_dim_v=dv, softcap=cap)
    case = Case(batch, seq_len, heads, kv_heads, 8, "float32", causal, world_size, documents=true_docs, **variant)
    padded = method.padded_len(case)
    if true_docs is not None:
        case = Case(
            batch,
            padded,
            heads,
            kv_heads,
            8,
            "float32",
            causal,
            world_size,
            documents=Documents(lengths, padded, mask),
            **variant,
        )
    return case, true_docs


def _run(method, case, prob, comm):
    """This rank's out, lse, dq, dk, dv and its share of dsink, through autograd."""
    lay, pad = method.layout(case), case.seq_len - prob.q.shape[1]

    def padded(x):
        return torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1) if pad else x

    q, k, v = (lay.shard(padded(x), comm.rank).requires_grad_() for x in (prob.q, prob.k, prob.v))
    sinks = prob.sinks.clone().requires_grad_()
    cap = {"softcap": case.softcap} if case.softcap else {}
    out, lse = method.attention(
        q, k, v, causal=case.causal, comm=comm, return_lse=True, docs=case.documents, sinks=sinks, **cap
    )
    grads = torch.autograd.grad(out, (q, k, v, sinks), lay.shard(padded(prob.dout), comm.rank))
    return (out.detach(), lse) + grads


def errors(method, case, prob, seq_len):
    """{tensor: (max error against float64, tolerance)} for out, lse, dq, dk, dv and dsink (the
    ranks' shares summed)."""
    per_rank = run_threads(case.world_size, lambda comm: _run(method, case, prob, comm))
    lay = method.layout(case)
    out = {}
    for i, t in enumerate(TENSORS):
        dim = 2 if t == "lse" else 1
        got = lay.unshard([r[i] for r in per_rank], dim=dim).narrow(dim, 0, seq_len)
        out[t] = (float((got.double() - prob.ref[t].double()).abs().max()), prob.tolerance(t, case.world_size))
    dsink = sum(r[5].double() for r in per_rank)
    out["dsink"] = (float((dsink - prob.ref["dsink"]).abs().max()), prob.tolerance("dsink", case.world_size))
    return out


def check(name, options, world_size, causal, seq_len, lengths=None, mask=None, batch=2, dv=None, cap=0.0) -> str:
    """Every tensor within the pass rule; '' or the method's reason to refuse the case."""
    m = methods.get_method(name, **options)
    case, true_docs = _case(m, world_size, causal, seq_len, lengths, mask, batch, dv, cap)
    ok, why = m.supports(case)
    if not ok:
        return why
    extra = ("docs",) if true_docs is not None else ()
    prob = sink_problem(
        case.batch, seq_len, case.heads, case.kv_heads, causal, *extra, documents=true_docs, head_dim_v=dv, softcap=cap
    )
    bad = {t: e for t, e in errors(m, case, prob, seq_len).items() if not e[0] <= e[1]}
    assert not bad, f"{name} {options} P={world_size} causal={causal}: (error, tolerance) {bad}"
    return ""


@pytest.mark.parametrize("name,options", OWN, ids=IDS)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_every_method_matches_float64_with_sinks(name, options, world_size, causal):
    """Odd lengths (3 granules; 5 x world size + 1 where the method pads to its granule itself is
    the documents test's), GQA, batch 2: out, lse, dq, dk, dv and dsink."""
    m = methods.get_method(name, **options)
    granule = m.granule(Case(1, 0, *_heads(world_size), 8, "float32", causal, world_size))
    why = check(name, options, world_size, causal, 3 * granule)
    assert "sink" not in why, why  # a method may refuse sizes it cannot split, never the sinks


@pytest.mark.parametrize("name,options", OWN, ids=IDS)
def test_sinks_a_value_head_dim_and_a_soft_cap_together(name, options):
    """The three variants of issue 27 at once (gpt-oss's sinks on DeepSeek's head dims, capped):
    the sink is folded after the capped scores' last merge and never capped itself."""
    world_size = 4 if options.get("ulysses_degree") == 2 or options.get("ranks_per_node") == 2 else 3
    m = methods.get_method(name, **options)
    granule = m.granule(Case(1, 0, *_heads(world_size), 8, "float32", True, world_size))
    assert check(name, options, world_size, True, 3 * granule, dv=5, cap=2.0) == ""


@pytest.mark.parametrize("name,options", OWN, ids=IDS)
def test_every_method_matches_float64_with_sinks_on_packed_documents(name, options):
    """Packed documents of unequal lengths, a length no granule divides (padding), P = 3, causal;
    batch 1 (sharding by documents packs one sequence)."""
    why = check(name, options, 3, True, 26, lengths=((9, 4, 13),), batch=1)
    assert "sink" not in why, why


@pytest.mark.parametrize("name,options", OWN, ids=IDS)
def test_every_method_matches_float64_with_sinks_under_a_sliding_window(name, options):
    """A window of 5 tokens, where a ring may stop early (rows see few keys: the sink weighs more)."""
    mask = parse_mask("sliding_window:5")
    why = check(name, options, 2, True, 24, lengths=((24,),), mask=mask, batch=1)
    assert "sink" not in why, why


class SinkPerRank(methods.method_class("allgather_kv")):
    """A planted fault: each rank folds the sink into its partial result over its own keys before
    the partials of every rank are merged, so the sink counts once per rank (P e^s_h in the
    denominator). All-gather K/V computes every row on its own rank; here the row's keys are cut
    into the P ranks' blocks, each block folded with the sink, then merged."""

    name = "sink_per_rank"
    test_double = True

    def forward(self, q, k, v, *, comm, causal, scale, return_lse, docs=None, sinks=None):
        out, lse, res = super().forward(q, k, v, comm=comm, causal=causal, scale=scale, return_lse=True, docs=docs)
        if sinks is None:
            return out, lse, res
        # the same rows, as if computed from P disjoint key blocks each holding the sink: merging
        # P results that each carry e^s_h gives log(e^lse + P e^s_h)
        p = comm.world_size
        wrong_lse = torch.logaddexp(lse, sinks.detach().view(1, -1, 1) + torch.log(torch.tensor(float(p))))
        wrong = (out.float() * torch.exp(lse - wrong_lse).transpose(1, 2).unsqueeze(-1)).to(out.dtype)
        return wrong, wrong_lse, (*res[:3], wrong, wrong_lse, *res[5:])


def test_a_sink_counted_once_per_rank_fails_the_check():
    """The check sees a sink counted on every rank's partial instead of once per row: at P = 1 the
    planted method is right (one rank, one count), at P = 3 out, lse and dsink exceed the bound."""
    m = SinkPerRank()
    for world_size, wrong in ((1, False), (3, True)):
        case, _ = _case(m, world_size, True, 6 * world_size)
        prob = sink_problem(2, case.seq_len, 6, case.kv_heads, True)
        errs = errors(m, case, prob, case.seq_len)
        if not wrong:
            assert all(e <= tol for e, tol in errs.values()), errs
        else:
            for t in ("out", "lse", "dsink"):
                assert errs[t][0] > 10 * errs[t][1], (t, errs[t])


def test_a_huge_sink_silences_the_row_and_a_tiny_one_is_plain_attention():
    """s_h = +30 takes nearly all of every row's softmax: out ~ 0 and lse ~ 30; s_h = -30 leaves
    plain attention (out, lse and gradients as without sinks), on a ring of 3 ranks."""
    m = methods.get_method("ring")
    case = Case(1, 12, 4, 2, 8, "float32", True, 3)
    prob = build_problem(1, 12, 4, 2, 8, "float32", True, seed=0, device=torch.device("cpu"), with_reference=True)
    lay = m.layout(case)

    def rank(comm, sink):
        q, k, v = (lay.shard(x, comm.rank).requires_grad_() for x in (prob.q, prob.k, prob.v))
        sinks = torch.full((4,), sink).requires_grad_()
        out, lse = m.attention(q, k, v, causal=True, comm=comm, return_lse=True, sinks=sinks)
        grads = torch.autograd.grad(out, (q, k, v), lay.shard(prob.dout, comm.rank))
        return [out.detach(), lse, *grads]

    def whole(sink):
        per_rank = run_threads(3, lambda comm: rank(comm, sink))
        return [lay.unshard([r[i] for r in per_rank], dim=2 if i == 1 else 1) for i in range(5)]

    big, small = whole(30.0), whole(-30.0)
    assert float(big[0].abs().max()) < 1e-9
    assert float((big[1] - 30).abs().max()) < 1e-6
    for got, t in zip(small, TENSORS):
        assert float((got.double() - prob.ref[t]).abs().max()) <= prob.tolerance(t, 3), t


def test_fold_sink_is_a_merge_with_an_empty_value_block():
    """fold_sink equals merging a one-key block whose logit is s_h and whose value is zero, and keeps
    a row that sees nothing with a -inf sink as (0, -inf)."""
    out = torch.randn(2, 5, 3, 4, dtype=torch.float64)
    lse = torch.randn(2, 3, 5, dtype=torch.float64)
    lse[0, 2, 0] = float("-inf")  # row 0 of head 2 sees no key, and head 2's sink is -inf
    out[0, 0, 2] = 0
    sinks = torch.tensor([0.5, -1.0, float("-inf")], dtype=torch.float64)
    got_out, got_lse = merge.fold_sink(out, lse, sinks)
    acc_out, acc_lse = out.clone(), lse.clone()
    merge.merge_(acc_out, acc_lse, torch.zeros_like(out), sinks.view(1, 3, 1).expand(2, 3, 5).clone())
    assert torch.allclose(got_out, acc_out) and torch.allclose(got_lse, acc_lse)
    assert float(got_out[0, 0, 2].abs().max()) == 0 and float(got_lse[0, 2, 0]) == float("-inf")


def test_peers_and_unknowing_methods_refuse_sinks_with_the_reason():
    """A method that does not declare sinks refuses the case (a recorded skip), never ignores the sink."""

    class NoSinks(methods.method_class("ring")):
        supports_sinks = False

    case = Case(1, 12, 4, 4, 8, "float32", True, 2, sinks=True)
    ok, why = NoSinks().supports(case)
    assert not ok and "attention-sink" in why
    for name in methods.available():
        cls = methods.method_class(name)
        if cls.impl != "own" and not cls.supports_sinks:
            assert "has no attention-sink argument" in cls.sinks_reason, name
    with pytest.raises(ValueError, match=r"sinks must be \[heads\]"):
        methods.get_method("ring").attention(
            *(torch.zeros(1, 6, 4, 8) for _ in range(3)), causal=True, comm=None, sinks=torch.zeros(3)
        )


@pytest.mark.parametrize("name,options", OWN, ids=IDS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_counted_bytes_with_sinks_equal_the_declared_formula(name, options, world_size):
    """With sinks, every rank's counted bytes (forward, and forward + backward with dsink) equal
    `expected_rank_bytes` of the case with `sinks`: nothing moves for the sinks' gradient (a
    rank's share), and Ulysses' lse comes back to the sequence layout (declared)."""
    from methods.comm import CommLedger, CountingComm

    m = methods.get_method(name, **options)
    heads, kv_heads = _heads(world_size)
    seq_len = 3 * m.granule(Case(1, 0, heads, kv_heads, 8, "bfloat16", True, world_size))
    case = Case(2, seq_len, heads, kv_heads, 8, "bfloat16", True, world_size, sinks=True)
    if not m.supports(case)[0]:
        return
    prob = sink_problem(2, seq_len, heads, kv_heads, True, dtype="bfloat16", reference=False)
    lay = m.layout(case)

    def rank(comm):
        led = CommLedger()
        c = CountingComm(comm, led)
        q, k, v = (lay.shard(x, comm.rank).requires_grad_() for x in (prob.q, prob.k, prob.v))
        sinks = prob.sinks.clone().requires_grad_()
        out = m.attention(q, k, v, causal=True, comm=c, sinks=sinks)
        fwd = (led.bytes_sent, led.bytes_recv)
        torch.autograd.grad(out, (q, k, v, sinks), lay.shard(prob.dout, comm.rank))
        return fwd, (led.bytes_sent, led.bytes_recv)

    for r, (fwd, both) in enumerate(run_threads(world_size, rank)):
        assert fwd == m.expected_rank_bytes(case, "fwd", r), (name, r, fwd)
        assert both == m.expected_rank_bytes(case, "fwd_bwd", r), (name, r, both)


# -- the perplexity check with sinks ---------------------------------------------------------------------
def _perplexity_runs():
    """A model with sinks: its single-device baseline, the same model without sinks, and a
    function training it with a method on virtual ranks (optionally with the planted bug)."""
    import functools

    from methods import layouts
    from suite.perplexity.data import load_corpus
    from suite.perplexity.model import ModelConfig, sdpa_attend
    from suite.perplexity.train import TrainConfig, train_and_evaluate
    from suite.workloads.perplexity import _sink_per_rank

    corpus = load_corpus("stdlib", max_bytes=200_000)
    model = ModelConfig(heads=4, kv_heads=2, head_dim=8, layers=2, sinks=True)
    tc = TrainConfig(steps=4, batch=2, seq_len=36, lr=3e-3, warmup_steps=1, eval_batches=1)
    single = layouts.contiguous(tc.seq_len, 1)
    baseline = train_and_evaluate(model, tc, corpus, layout=single, comm=None, make_attend=lambda c: sdpa_attend)
    plain = train_and_evaluate(
        ModelConfig(heads=4, kv_heads=2, head_dim=8, layers=2),
        tc,
        corpus,
        layout=single,
        comm=None,
        make_attend=lambda c: sdpa_attend,
    )

    def train(name, world_size, planted=False):
        m = methods.get_method(name)
        layout = m.layout(Case(tc.batch, tc.seq_len, 4, 2, 8, "float32", True, world_size, sinks=True))

        def attend(c):
            a = functools.partial(m.attention, causal=True, comm=c)
            return functools.partial(_sink_per_rank, a, world_size) if planted else a

        return run_threads(
            world_size, lambda comm: train_and_evaluate(model, tc, corpus, layout=layout, comm=comm, make_attend=attend)
        )[0]

    return baseline, plain, train


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_training_with_sinks_matches_the_single_device_baseline_and_catches_a_sink_per_rank():
    """The model with learned sinks (the baseline: the softmax written out with a sink column)
    trains the same with a ring of 3 and with Ulysses at 2 (every step's loss, the perplexity);
    the sinks change the model (another loss than without them); and counting the sink once per
    rank moves the loss far beyond the check's tolerance."""
    baseline, plain, train = _perplexity_runs()
    assert _rel(plain.losses, baseline.losses) > 1e-3
    for name, world_size in (("ring", 3), ("ulysses", 2)):
        got = train(name, world_size)
        assert _rel(got.losses, baseline.losses) < 1e-5, name
        assert abs(got.perplexity / baseline.perplexity - 1) < 1e-5, name
    wrong = train("ring", 3, planted=True)
    assert _rel(wrong.losses, baseline.losses) > 1e-3 or abs(wrong.perplexity / baseline.perplexity - 1) > 1e-2


@pytest.mark.parametrize("name,world_size", [("ring", 3), ("ulysses", 2), ("usp", 2)])
def test_direct_forward_backward_gives_what_autograd_gives_with_sinks(name, world_size):
    """attention_fwd_bwd (virtual ranks on one GPU) returns out, lse, dq, dk, dv and this rank's
    dsink share exactly as attention and autograd do."""
    m = methods.get_method(name)
    heads, kv_heads = _heads(world_size)
    case = Case(
        2,
        3 * m.granule(Case(1, 0, heads, kv_heads, 8, "float32", True, world_size)),
        heads,
        kv_heads,
        8,
        "float32",
        True,
        world_size,
        sinks=True,
    )
    prob = sink_problem(2, case.seq_len, heads, kv_heads, True, reference=False)
    lay = m.layout(case)

    def both(comm):
        q, k, v, do = (lay.shard(x, comm.rank) for x in (prob.q, prob.k, prob.v, prob.dout))
        direct = m.attention_fwd_bwd(q, k, v, do, causal=True, comm=comm, sinks=prob.sinks)
        return direct, _run(m, case, prob, comm)

    for direct, via in run_threads(world_size, both):
        for got, want in zip(direct, via):
            assert torch.equal(got, want)


# float64 inputs: the sink gradient in float64. Shares rounded to float32 (the sink logits' dtype)
# put the summed dsink off by several float32 roundings, where the check allows about one.
FLOAT64_EXACT = 1e-12  # a dsink computed in float64 errs by a few float64 roundings (~1e-15 here)


@pytest.mark.parametrize("name,options", OWN, ids=IDS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_float64_inputs_get_a_float64_sink_gradient(name, options, world_size):
    """37 tokens (padded to the method's granule), float64, causal and full: the direct
    forward-backward (virtual ranks on one GPU) given float32 sink logits, and autograd given a
    float64 leaf, each return a float64 share; the shares summed as the check sums them hold the
    check's tolerance and float64's precision."""
    m = methods.get_method(name, **options)
    heads, kv_heads = _heads(world_size)
    seq_len = 37
    for causal in (True, False):
        case = Case(2, seq_len, heads, kv_heads, 8, "float64", causal, world_size, sinks=True)
        padded = m.padded_len(case)
        docs = Documents(((seq_len,), (seq_len,)), padded)
        case = Case(2, padded, heads, kv_heads, 8, "float64", causal, world_size, documents=docs, sinks=True)
        ok, why = m.supports(case)
        if not ok:
            assert "heads" in why or "does not divide" in why, why
            continue
        prob = sink_problem(2, seq_len, heads, kv_heads, causal, dtype="float64")
        lay = m.layout(case)

        def rank(comm):
            q, k, v, do = (
                lay.shard(torch.nn.functional.pad(x, (0, 0, 0, 0, 0, padded - seq_len)), comm.rank)
                for x in (prob.q, prob.k, prob.v, prob.dout)
            )
            direct = m.attention_fwd_bwd(q, k, v, do, causal=causal, comm=comm, docs=docs, sinks=prob.sinks)[5]
            leaves = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), prob.sinks.double().requires_grad_())
            out = m.attention(*leaves[:3], causal=causal, comm=comm, docs=docs, sinks=leaves[3])
            return direct, torch.autograd.grad(out, leaves, do)[3]

        shares = run_threads(world_size, rank)
        tol = prob.tolerance("dsink", world_size)
        for i, path in enumerate(("attention_fwd_bwd", "attention")):
            total = sum(r[i] for r in shares)  # in the shares' dtype, as the check's all-reduce sums them
            err = float((total.double() - prob.ref["dsink"]).abs().max())
            assert err <= tol and err < FLOAT64_EXACT, (name, options, world_size, causal, path, err, tol)
            assert total.dtype == torch.float64


def test_float64_sweeps_check_dsink_at_float64_precision(write_config, tmp_path):
    """Through the threads executor (autograd on CPU): every own method's err_dsink at float64 is
    a float64 error, within the tolerance (float32 sink logits made the gradient's leaf float32)."""
    from suite import metrics as M
    from suite.config import load_config
    from suite.runner import run_sweep

    path = write_config(f"""
    name: sinks64
    sweep: {{methods: [own], world_size: [2, 3], batch: [2], seq_len: [37], heads: [6], kv_heads: [3],
             head_dim: [16], dtype: [float64], causal: [true, false], passes: [fwd_bwd], sinks: [true]}}
    run: {{executor: threads, warmup: 0, repeats: 1}}
    tracking: {{mlflow: false}}
    results: {{root: {tmp_path}}}
    """)
    cfg, text = load_config(path)
    rows = run_sweep(cfg, text, progress=False, out=open("/dev/null", "w")).records
    checked = [r for r in rows if r[M.STATUS] != M.SKIPPED]
    assert len(checked) >= 30 and all(r[M.STATUS] == M.OK for r in checked), [
        (r["method"], r["world_size"], r[M.REASON]) for r in checked if r[M.STATUS] != M.OK
    ]
    assert max(r[M.ERR["dsink"]] for r in checked) < FLOAT64_EXACT


# -- the sweep axis ---------------------------------------------------------------------------------------
SINK_BASE = """
name: t
sweep:
  methods: [ring]
  world_size: [2]
  seq_len: [16]
  heads: [2]
  kv_heads: [2]
  head_dim: [8]
  causal: [true]
  passes: [fwd]
run: {executor: threads}
"""


def test_the_sinks_axis_plans_new_trials_and_keeps_the_old_keys(write_config):
    """sweep.sinks [false, true] plans each point twice; the sinks-off trials have the keys the
    same sweep had before the axis, and rows name the sinks in their identity."""
    from suite.config import load_config
    from tests.helpers import plan_for

    before, _ = load_config(write_config(SINK_BASE))
    both, _ = load_config(
        write_config(SINK_BASE.replace("  passes: [fwd]\n", "  passes: [fwd]\n  sinks: [false, true]\n"))
    )
    old, new = plan_for(before, "cpu:test"), plan_for(both, "cpu:test")
    assert len(old) == 1 and len(new) == 2
    plain = [t for t in new if not t.sinks]
    with_sinks = [t for t in new if t.sinks]
    assert [t.key for t in plain] == [t.key for t in old]
    assert with_sinks[0].key != old[0].key and with_sinks[0].identity()["sinks"] is True
    assert with_sinks[0].problem_key() != plain[0].problem_key() and "sinks" in with_sinks[0].label()
    assert with_sinks[0].run_case(with_sinks[0].build_method()).sinks


def test_bad_sinks_values_are_refused_naming_the_key(write_config):
    from suite.config import ConfigError, load_config

    for bad in ("[maybe]", "[true, true]", "[]"):
        body = SINK_BASE.replace("  passes: [fwd]\n", f"  passes: [fwd]\n  sinks: {bad}\n")
        with pytest.raises(ConfigError, match="sweep.sinks"):
            load_config(write_config(body))


def test_a_peer_trial_with_sinks_is_a_recorded_skip_with_the_library_reason(write_config, tmp_path):
    """Through the runner's check (the parent decides before any rank runs): every peer adapter
    registered here refuses a sink trial, naming its library, and takes the same trial without
    sinks; every own method takes it."""
    from methods.peers.base import PeerMethod
    from suite.config import load_config
    from suite.executors import make_executor
    from suite.runner import check_supported
    from suite.workloads import make_workload
    from tests.helpers import plan_for

    peers = [n for n in methods.available() if issubclass(methods.method_class(n), PeerMethod)]
    body = SINK_BASE.replace("methods: [ring]", f"methods: [{', '.join(peers + ['ring'])}]")
    body = body.replace("  passes: [fwd]\n", "  passes: [fwd]\n  sinks: [false, true]\n").replace("threads", "dist")
    cfg, _ = load_config(write_config(body))
    executor, workload = make_executor(cfg, dry_run=True), make_workload(cfg.kind, cfg)
    answers = {
        (spec.method, spec.sinks): check_supported(spec, executor, workload) for spec in plan_for(cfg, "cpu:test")
    }
    assert answers["ring", True][0] and answers["ring", False][0]
    for name in peers:
        lib = methods.method_class(name).library
        plain, with_sinks = answers[name, False], answers[name, True]
        assert not with_sinks[0] and "attention-sink" not in plain[1], name
        # a library that cannot run here at all keeps that reason; one that can is refused for the sinks
        assert with_sinks[1] == (f"library {lib} has no attention-sink argument" if plain[0] else plain[1]), name
    for name, options in OWN:
        assert methods.get_method(name, **options).supports_sinks, name
