"""Packed documents and padding: the masks, the kernels, every own method, the workload axis.

Every check compares with float64 attention on the unsharded inputs under the document-causal
mask (a token sees the tokens of its own document, earlier ones when causal); padding rows are
excluded, and must not change any real row.
"""

import random

import pytest
import torch

import methods
from methods import Case, kernels, layouts
from methods.comm import run_threads
from methods.documents import EMPTY, FULL, OFFSET, PARTIAL, Documents, pack
from suite import metrics as M
from suite.check import build_problem
from suite.config import ConfigError, load_config
from suite.lengths import Distribution, LengthsError, identity, lengths_of
from tests.helpers import assert_block_matches, own_variants, plan_for, run_dist, variant_id


def random_documents(rng: random.Random, batch: int, seq_len: int, pad: int, longest: int) -> Documents:
    lengths = []
    for _ in range(batch):
        ls, total = [], 0
        while total < seq_len:
            n = min(rng.randint(1, longest), seq_len - total)
            ls.append(n)
            total += n
        lengths.append(tuple(ls))
    return Documents(tuple(lengths), seq_len + pad)


# -- the masks -------------------------------------------------------------------------------------
def _positions(rng, n, kind):
    if kind == "contiguous":
        a = rng.randint(0, n - 1)
        return torch.arange(a, rng.randint(a + 1, n))
    if kind == "stride":
        s = rng.randint(1, 4)
        return torch.arange(rng.randint(0, s - 1), n, s)
    return torch.tensor(sorted(rng.sample(range(n), rng.randint(1, n))))


def test_block_masks_count_classify_and_cut_into_pieces_exactly():
    """Against the dense mask built by brute force: visible pairs, the class (empty / full / one
    causal offset / partial), and the pieces a kernel without masks runs (they tile the mask)."""
    rng = random.Random(0)
    kinds = set()
    for _ in range(200):
        docs = random_documents(rng, rng.randint(1, 3), rng.randint(1, 40), rng.randint(0, 5), 15)
        n = docs.padded_len
        shape = rng.choice(["contiguous", "stride", "any"])
        qp, kp = _positions(rng, n, shape), _positions(rng, n, shape)
        for causal in (True, False):
            m = docs.block(qp, kp, causal)
            ids = docs.doc_ids
            brute = torch.stack(
                [
                    (ids[b, qp][:, None] == ids[b, kp][None, :])
                    & (ids[b, qp][:, None] >= 0)
                    & ((kp[None, :] <= qp[:, None]) if causal else True)
                    for b in range(docs.batch)
                ]
            )
            assert torch.equal(m.dense(), brute)
            assert m.pairs == int(brute.sum())
            kinds.add(m.kind)
            if m.kind == EMPTY:
                assert not brute.any()
            if m.kind == FULL:
                assert brute.all()
            if m.kind == OFFSET:
                i, j = torch.arange(len(qp))[:, None], torch.arange(len(kp))[None, :]
                assert torch.equal(brute, (j <= i + m.causal_offset).expand_as(brute))
            for b in range(docs.batch):
                tiled = torch.zeros(len(qp), len(kp), dtype=torch.bool)
                for rows, cols, offset, lower in m.pieces(b):
                    assert lower is None  # bands come from the masks of methods/masks.py only
                    i = torch.arange(rows.stop - rows.start)[:, None]
                    j = torch.arange(cols.stop - cols.start)[None, :]
                    piece = (j <= i + offset) if offset is not None else torch.ones(len(i), j.shape[1], dtype=bool)
                    assert not tiled[rows, cols].any()  # pieces never overlap
                    tiled[rows, cols] = piece
                assert torch.equal(tiled, brute[b])
    assert kinds == {EMPTY, FULL, OFFSET, PARTIAL}


def test_documents_validate_and_restart_positions():
    docs = Documents(((3, 2), (5,)), 7)
    assert docs.doc_ids.tolist() == [[0, 0, 0, 1, 1, -1, -1], [0, 0, 0, 0, 0, -1, -1]]
    assert (torch.arange(7) - docs.starts).tolist() == [[0, 1, 2, 0, 1, 0, 0], [0, 1, 2, 3, 4, 0, 0]]
    assert docs.padding == 2 and not docs.trivial and Documents.single(2, 5).trivial
    with pytest.raises(ValueError, match="same number of tokens"):
        Documents(((3, 2), (4,)), 5)
    with pytest.raises(ValueError, match=">= 1"):
        Documents(((3, 0, 2),), 5)
    assert pack([5, 7, 100], 20) == (5, 7, 8)
    with pytest.raises(ValueError, match="cannot fill"):
        pack([5, 7], 20)


@pytest.mark.parametrize("kernel", ["math", "cpu_flash", "pieces"])
def test_masked_kernels_match_float64(kernel):
    """The dense-mask paths and the piece-by-piece path (what flash-attn runs), forward and
    backward, with rows that see nothing (lse -inf, output 0, no gradient)."""
    rng = random.Random(1)
    torch.manual_seed(0)
    for _ in range(25):
        docs = random_documents(rng, 2, rng.randint(4, 30), rng.randint(0, 4), 12)
        n = docs.padded_len
        qp, kp = _positions(rng, n, "contiguous"), _positions(rng, n, "contiguous")
        m = docs.block(qp, kp, causal=rng.random() < 0.7)
        q, do = torch.randn(2, len(qp), 4, 8), torch.randn(2, len(qp), 4, 8)
        k, v = torch.randn(2, len(kp), 2, 8), torch.randn(2, len(kp), 2, 8)
        vis = m.dense()
        ro, rl = kernels.math_forward(*(x.double() for x in (q, k, v)), scale=0.3, causal_offset=None, visible=vis)
        ref = kernels.math_backward(
            *(x.double() for x in (do, q, k, v)), ro, rl, scale=0.3, causal_offset=None, visible=vis
        )
        if kernel == "pieces":
            o, lse = kernels.forward_by_pieces(q, k, v, scale=0.3, mask=m, kernel="cpu_flash")
            grads = kernels.backward_by_pieces(do, q, k, v, o, lse, scale=0.3, mask=m, kernel="cpu_flash")
        else:
            o, lse = kernels.block_forward(q, k, v, scale=0.3, causal_offset=0, kernel=kernel, mask=m)
            grads = kernels.block_backward(do, q, k, v, o, lse, scale=0.3, causal_offset=0, kernel=kernel, mask=m)
        assert_block_matches(o, lse, grads, ro, rl, ref)


# -- every own method ----------------------------------------------------------------------------------
def _documents_case(
    name, options, world_size, seq_len, docs_lengths, causal, heads=6, kv_heads=3, batch=None, mask=None
):
    m = methods.get_method(name, **options)
    b = len(docs_lengths)
    case = Case(
        b, seq_len, heads, kv_heads, 8, "float32", causal, world_size, documents=Documents(docs_lengths, seq_len, mask)
    )
    padded = m.padded_len(case)
    docs = Documents(docs_lengths, padded, mask)
    return m, Case(b, padded, heads, kv_heads, 8, "float32", causal, world_size, documents=docs)


def _threads(world_size, fn, *args):
    return run_threads(world_size, lambda comm: fn(comm, *args))


def check_documents(
    name, options, world_size, seq_len, lengths, causal, comm_runner=_threads, mask=None, heads=6, kv_heads=3
):
    """Every rank's out, lse and gradients of `name` on packed documents (`mask`: a mask family
    inside each, methods/masks.py) equal float64 attention; '' or the method's reason to refuse."""
    m, case = _documents_case(
        name, options, world_size, seq_len, lengths, causal, mask=mask, heads=heads, kv_heads=kv_heads
    )
    ok, why = m.supports(case)
    if not ok:
        return why
    prob = build_problem(
        case.batch,
        seq_len,
        case.heads,
        case.kv_heads,
        case.head_dim,
        "float32",
        causal,
        "docs",
        seed=0,
        device=torch.device("cpu"),
        with_reference=True,
        documents=Documents(lengths, seq_len, mask),
    )
    per_rank = comm_runner(world_size, _rank_outputs, m.name, options, case, prob)
    lay = m.layout(case)
    for i, t in enumerate(("out", "lse", "dq", "dk", "dv")):
        dim = 2 if t == "lse" else 1
        got = lay.unshard([r[i] for r in per_rank], dim=dim).narrow(dim, 0, seq_len)
        err = float((got.double() - prob.ref[t].double()).abs().max())
        tol = prob.tolerance(t, world_size)
        assert err <= tol, (name, options, world_size, causal, t, err, tol)
    return ""


def _rank_outputs(comm, name, options, case, prob):
    m = methods.get_method(name, **options)
    lay, pad = m.layout(case), case.seq_len - prob.q.shape[1]

    def padded(x):
        return torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1) if pad else x

    q, k, v = (lay.shard(padded(x), comm.rank).requires_grad_() for x in (prob.q, prob.k, prob.v))
    out, lse = m.attention(q, k, v, causal=case.causal, comm=comm, return_lse=True, docs=case.documents)
    grads = torch.autograd.grad(out, (q, k, v), lay.shard(padded(prob.dout), comm.rank))
    return (out.detach(), lse) + grads


@pytest.mark.parametrize("name,options", own_variants(), ids=[variant_id(n, o) for n, o in own_variants()])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_method_computes_packed_documents_exactly(name, options, world_size):
    """Any length (7 x world size + 5: no layout's granule divides it), documents of random
    lengths, batch 1 (document sharding needs one packed sequence) and 2, causal and full, GQA."""
    rng = random.Random(world_size)
    seq_len = 7 * world_size + 5
    for batch in (1, 2):
        docs = random_documents(rng, batch, seq_len, 0, seq_len // 2 + 1)
        for causal in (True, False):
            why = check_documents(name, options, world_size, seq_len, docs.lengths, causal)
            if why:  # only the Ulysses split of the heads, a node size or document sharding of a mixed batch
                assert any(s in why for s in ("heads divisible", "kv_heads", "does not divide", "packed alike")), why


def _gloo_cases(world_size):
    rng = random.Random(7)
    seq_len = 5 * world_size + 3
    lengths = random_documents(rng, 1, seq_len, 0, 9).lengths
    cases = []
    for name, options in own_variants():
        m, case = _documents_case(name, options, world_size, seq_len, lengths, True, heads=8, kv_heads=4)
        if m.supports(case)[0]:
            prob = build_problem(
                1,
                seq_len,
                case.heads,
                case.kv_heads,
                8,
                "float32",
                True,
                "docs",
                seed=0,
                device=torch.device("cpu"),
                with_reference=True,
                documents=Documents(lengths, seq_len),
            )
            cases.append((name, options, case, prob))
    return cases


def _gloo_rank(comm, world_size):
    """This rank's max error per tensor for every case, on its real rows (plain floats: tensors
    cannot outlive the worker process through a queue)."""
    errors = []
    for name, options, case, prob in _gloo_cases(world_size):
        outs = _rank_outputs(comm, name, options, case, prob)
        lay = methods.get_method(name, **options).layout(case)
        real = (lay.positions(comm.rank) < prob.q.shape[1]).nonzero().flatten()
        pad = case.seq_len - prob.q.shape[1]
        errs = {}
        for got, t in zip(outs, ("out", "lse", "dq", "dk", "dv")):
            dim = 2 if t == "lse" else 1
            ref = prob.ref[t]
            if pad:
                shape = list(ref.shape)
                shape[dim] = pad
                ref = torch.cat([ref, ref.new_zeros(shape)], dim=dim)
            want = lay.shard(ref, comm.rank, dim=dim).index_select(dim, real)
            errs[t] = float((got.index_select(dim, real).double() - want.double()).abs().max())
        errors.append(errs)
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_packed_documents_over_gloo(world_size):
    """Real processes (one group for every method): packed documents of an odd length."""
    cases = _gloo_cases(world_size)
    assert [(n, o) for n, o, *_ in cases] == own_variants()
    per_rank = run_dist(world_size, _gloo_rank, world_size)
    for i, (name, options, case, prob) in enumerate(cases):
        for t in ("out", "lse", "dq", "dk", "dv"):
            err = max(r[i][t] for r in per_rank)
            assert err <= prob.tolerance(t, world_size), (name, options, t, err)


def test_document_sharding_cuts_every_document_into_2p_chunks():
    lay = layouts.documents([5, 17, 3, 40], 3)
    everything = torch.cat([lay.positions(r) for r in range(3)])
    assert torch.equal(everything.sort().values, torch.arange(lay.seq_len))  # a permutation
    assert len({lay.local_len(r) for r in range(3)}) == 1  # equal local lengths
    for r in range(3):  # each rank holds chunks r and 5-r of the 40-token document: 2 x 6 or 7 tokens
        doc = lay.positions(r)[(lay.positions(r) >= 25) & (lay.positions(r) < 65)]
        assert 12 <= doc.numel() <= 14
    # one document of a length 2P divides: exactly the zigzag layout
    assert all(
        torch.equal(layouts.documents([24], 3).positions(r), layouts.zigzag(24, 3).positions(r)) for r in range(3)
    )


def test_contiguous_document_sharding_gives_rank_r_piece_r_of_every_document():
    """ring-flash-attn's varlen ring layout: every document in P pieces, piece r on rank r."""
    lay = layouts.documents([8, 20, 4], 4, zigzag=False)
    assert lay.seq_len == 32 and len({lay.local_len(r) for r in range(4)}) == 1
    for r in range(4):
        want = [2 * r, 2 * r + 1] + [8 + 5 * r + i for i in range(5)] + [28 + r]
        assert lay.positions(r).tolist() == want
    odd = layouts.documents([5, 17, 3], 3, zigzag=False)  # uneven pieces: a permutation, padded at the tail
    everything = torch.cat([odd.positions(r) for r in range(3)])
    assert torch.equal(everything.sort().values, torch.arange(odd.seq_len))
    # one document of a length P divides: exactly the contiguous layout
    assert all(
        torch.equal(layouts.documents([24], 3, zigzag=False).positions(r), layouts.contiguous(24, 3).positions(r))
        for r in range(3)
    )


def test_document_sharding_balances_a_long_tailed_mix_better_than_zigzag():
    """The visible pairs each rank's queries own, for one long-tailed draw at P = 8: sharding by
    documents evens them out, zigzagging the whole packed sequence does not."""
    dist = Distribution.from_config("pl", {"distribution": "powerlaw", "alpha": 1.6, "min": 32, "max": 16384})
    (lengths,) = dist.draw(16384, 1, 0)
    imbalance = {}
    for kind in ("contiguous", "zigzag", "documents"):
        lay = layouts.documents(lengths, 8) if kind == "documents" else layouts.make(kind, 16384, 8)
        docs = Documents((lengths,), lay.seq_len)
        work = [docs.visible_pairs(lay.positions(r), torch.arange(lay.seq_len), True) for r in range(8)]
        imbalance[kind] = max(work) / (sum(work) / 8)
    assert imbalance["documents"] < imbalance["zigzag"] < imbalance["contiguous"], imbalance
    assert imbalance["documents"] < 1.05


# -- the workload axis -----------------------------------------------------------------------------------
def test_distributions_draw_reproducibly_and_fill_every_sequence():
    cfgs = {
        "fixed": {"distribution": "fixed", "lengths": [300, 50, 900]},
        "lognormal": {"distribution": "lognormal", "median": 64, "sigma": 1.2},
        "powerlaw": {"distribution": "powerlaw", "alpha": 1.8, "min": 16, "max": 600},
        "histogram": {"distribution": "histogram", "file": "configs/documents/stdlib_files.yaml"},
    }
    for name, cfg in cfgs.items():
        dist = Distribution.from_config(name, cfg)
        drawn = dist.draw(1000, 3, 0)
        assert all(sum(ls) == 1000 and min(ls) >= 1 for ls in drawn)
        assert drawn == dist.draw(1000, 3, 0) and (name == "fixed" or drawn != dist.draw(1000, 3, 1))
        if name == "powerlaw":
            assert max(max(ls) for ls in drawn) <= 600
        ident = identity(dist, 1000, 3, 0)
        assert lengths_of(ident, 1000, 3) == drawn  # what a rank redraws from the trial's identity


@pytest.mark.parametrize(
    "documents,match",
    [
        (
            "{d: {distribution: histogram, file: configs/documents/none.yaml}}",
            "documents.d.file: histogram file not found",
        ),
        ("{d: {distribution: histogram, file: README.md}}", "documents.d.file: .* does not parse"),
        ("{d: {distribution: fixed, lengths: [10, -3]}}", "documents.d.lengths: needs a list of lengths >= 1"),
        ("{d: {distribution: fixed, lengths: [10, 20]}}", "documents.d.lengths: 30 tokens in all cannot fill"),
        ("{d: {distribution: lognormal, median: 0, sigma: 1}}", "documents.d.median"),
        ("{d: {distribution: powerlaw, alpha: 0.5}}", "documents.d.alpha: must be > 1"),
        ("{d: {distribution: zipf}}", "documents.d.distribution"),
        ("{}", "sweep.workload: unknown workload 'd'"),
    ],
)
def test_bad_distributions_are_refused_before_the_sweep_naming_the_key(write_config, documents, match):
    path = write_config(f"""
    name: bad
    sweep: {{methods: [ring], world_size: [2], seq_len: [64], workload: [uniform, d]}}
    documents: {documents}
    """)
    with pytest.raises((ConfigError, LengthsError), match=match):
        load_config(path)


def test_packed_trials_carry_the_documents_in_their_identity(write_config):
    path = write_config("""
    name: packed
    sweep: {methods: [ring, zigzag_ring], world_size: [2], seq_len: [96], heads: [4], kv_heads: [2],
            causal: [true], passes: [fwd], workload: [uniform, short]}
    documents: {short: {distribution: lognormal, median: 16, sigma: 1.0}}
    """)
    cfg, _ = load_config(path)
    plan = plan_for(cfg, "cpu:test")
    uniform = [s for s in plan if not s.workload]
    packed = [s for s in plan if s.workload]
    assert len(uniform) == len(packed) == 2 and len({s.key for s in plan}) == 4
    assert all('"digest"' in s.workload and s.document_lengths() for s in packed)
    cfg2, _ = load_config(path, ["run.seed=1"])  # other documents, other trials
    assert {s.key for s in plan_for(cfg2, "cpu:test") if s.workload}.isdisjoint({s.key for s in packed})
    assert {s.key for s in plan_for(cfg2, "cpu:test") if not s.workload} == {s.key for s in uniform}


def test_a_packed_sweep_records_exact_rows_with_balance_columns(write_config, tmp_path):
    from suite.runner import run_sweep

    path = write_config(f"""
    name: varlen_small
    sweep: {{methods: [reference, ring, zigzag_ring, stripe_ring, tasp], world_size: [1, 3], batch: [1],
             seq_len: [100], heads: [4], kv_heads: [2], head_dim: [8], causal: [true], passes: [fwd, fwd_bwd],
             workload: [uniform, docs],
             method_options: {{zigzag_ring: {{sharding: [sequence, documents]}}}},
             exclude: [{{method: reference, world_size: 3}}, {{world_size: 1, method: [ring, zigzag_ring,
                        stripe_ring, tasp]}}]}}
    documents: {{docs: {{distribution: lognormal, median: 12, sigma: 1.0}}}}
    run: {{executor: threads, warmup: 0, repeats: 1}}
    tracking: {{mlflow: false}}
    results: {{root: {tmp_path}}}
    """)
    cfg, text = load_config(path)
    rows = run_sweep(cfg, text, progress=False, out=open("/dev/null", "w")).records
    assert len(rows) == 2 * 2 * 6 and all(r[M.STATUS] == M.OK for r in rows), [r[M.REASON] for r in rows]
    by = {(r["method"], r["options"], bool(r["workload"]), r["pass"]): r for r in rows}
    ring_packed = by[("ring", "{}", True, "fwd")]
    assert ring_packed[M.DOCS_PER_SEQ] > 3 and ring_packed[M.DOC_LENGTHS] and ring_packed[M.PADDED_TOKENS] == 2
    assert ring_packed[M.IMBALANCE] > 1 and ring_packed[M.PAIRS_MAX] >= ring_packed[M.PAIRS_MEAN]
    # one sequence of a document-causal mask: FLOPs count its exact pairs, fewer than the causal half
    uniform = by[("ring", "{}", False, "fwd")]
    flops_per_token = {r["key"]: r[M.TFLOPS_PER_GPU] / r[M.TOKENS_PER_S] for r in (ring_packed, uniform)}
    assert flops_per_token[ring_packed["key"]] < flops_per_token[uniform["key"]]
    # tasp pads 100 tokens to 12 x 9 = 108 at P = 3; the padding is recorded, not checked
    assert by[("tasp", "{}", False, "fwd")][M.PADDED_TOKENS] == 8
