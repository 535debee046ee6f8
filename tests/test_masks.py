"""Mask families (methods/masks.py): the slices, the block masks, the kernels' bands, every own
method, the config and the plan.

Every check compares with an independent statement: `Mask.dense` (each family's formula, not its
slices) placed document by document for the masks, float64 attention under that dense mask for the
kernels and the methods.
"""

import dataclasses
import functools
import random

import pytest
import torch

import methods
from methods import Case, kernels
from methods import documents as documents_module
from methods import masks as masks_module
from methods.documents import BAND, EMPTY, FULL, OFFSET, PARTIAL, Documents
from methods.masks import Mask, parse
from methods.masks import examples as mask_examples
from suite.check import build_problem
from suite.config import ConfigError, load_config
from tests.helpers import assert_block_matches, own_variants, plan_for, variant_id
from tests.test_varlen import _rank_outputs, _threads

# every family's parameter choices (methods/masks.py, each family's `examples` and `edge_examples`):
# token counts (odd ones), fractions, the shorthand and the keyword forms
MASKS = mask_examples(edge=True)


def _fits(mask: Mask, n: int) -> bool:
    """Whether the mask fits a document of n tokens (only a fixed prefix longer than it does not)."""
    return not (mask.family == "prefix_lm" and mask.size("prefix", n) > n)


def brute_force(docs: Documents, mask: Mask) -> torch.Tensor:
    """[B, padded, padded] bool: the family's formula inside each document, nothing across documents
    or from padding."""
    vis = torch.zeros(docs.batch, docs.padded_len, docs.padded_len, dtype=torch.bool)
    for b, ls in enumerate(docs.lengths):
        start = 0
        for n in ls:
            vis[b, start : start + n, start : start + n] = mask.dense(n)
            start += n
    return vis


# -- the slices ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text", MASKS)
def test_slices_never_overlap_and_add_up_to_the_definition(text):
    mask = parse(text)
    for n in range(1, 26):
        if not _fits(mask, n):
            with pytest.raises(ValueError, match=f"longer than a document of {n} tokens"):
                mask.slices(n)
            continue
        count = torch.zeros(n, n, dtype=torch.int64)
        i = torch.arange(n).unsqueeze(1)
        j = torch.arange(n).unsqueeze(0)
        for qa, qb, ka, kb, lo, hi in mask.slices(n):
            assert 0 <= qa < qb <= n and 0 <= ka < kb <= n, (text, n)
            inside = (i >= qa) & (i < qb) & (j >= ka) & (j < kb) & (i - j >= lo) & (i - j <= hi)
            count += inside
        assert int(count.max()) <= 1, (text, n)  # no pair in two slices
        assert torch.equal(count == 1, mask.dense(n)), (text, n)
        if mask.causal:
            assert not (mask.dense(n) & (j > i)).any(), (text, n)  # inside the causal mask


def test_every_registered_family_names_examples_of_itself():
    """The registry (methods/masks.py) is what every "every family" test runs: each family gives at
    least one example, of itself, in canonical form or not, and each parses to one distinct mask."""
    every = mask_examples(edge=True)
    assert set(mask_examples()) <= set(every) and len(set(every)) == len(every)
    for name, fam in masks_module.FAMILIES.items():
        assert fam.examples, name
        for text in fam.examples + fam.edge_examples:
            assert parse(text).family == name and parse(parse(text).name) == parse(text), text
    assert {parse(t).family for t in mask_examples()} == set(masks_module.families())
    # the causal flag is not merely safe (test_slices_...: a causal family sees no later key) but
    # needed: some example of every other family (or parameter choice) lets a query see a later key
    for name, fam in masks_module.FAMILIES.items():
        full_plan = [parse(t) for t in fam.examples + fam.edge_examples if not parse(t).causal]
        assert not full_plan or any(_sees_ahead(m) for m in full_plan), name
    with pytest.raises(ValueError, match="registered twice"):
        masks_module.family(type("Again", (masks_module.Family,), {"name": "causal"}))
    with pytest.raises(ValueError, match="do not agree"):
        masks_module.family(type("Odd", (masks_module.Family,), {"name": "odd", "params": (("w", "tokens"),)}))
    assert "odd" not in masks_module.FAMILIES


def _sees_ahead(mask: Mask) -> bool:
    """Whether a query sees a later key in some document of 1 to 25 tokens."""
    return any(bool(mask.dense(n).triu(1).any()) for n in range(1, 26) if _fits(mask, n))


def test_dense_definitions_spot_checks():
    """The formulas themselves, on hand-written cases."""
    assert parse("sliding_window:2").dense(4).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    assert parse("chunked:2").dense(3).int().tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    assert parse("prefix_lm:2").dense(3).int().tolist() == [[1, 1, 0], [1, 1, 0], [1, 1, 1]]
    assert parse("block_causal:2").dense(3).int().tolist() == [[1, 1, 0], [1, 1, 0], [1, 1, 1]]
    # question of 2, answers [2, 4) and [4, 5): an answer sees the question and itself, not the other
    sq = parse("shared_question:question=2,answers=2").dense(5).int().tolist()
    assert sq == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 1]]
    gw = parse("global_window:globals=1,window=2").dense(4).int().tolist()
    assert gw == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 1, 1]]
    assert parse("sliding_window:0.5").size("window", 7) == 4  # a fraction rounds up


@pytest.mark.parametrize(
    "text,key,n,tokens",
    [
        ("prefix_lm:0.28", "prefix", 25, 7),  # 0.28 * 25 is 7.000000000000001 in floating point
        ("sliding_window:0.07", "window", 100, 7),
        ("chunked:0.14", "chunk", 50, 7),
        ("block_causal:0.55", "block", 100, 55),
        ("prefix_lm:0.281", "prefix", 25, 8),  # 7.025: rounds up
        ("global_window:globals=0.1,window=0.3", "globals", 30, 3),
    ],
)
def test_a_fraction_of_a_document_is_the_ceiling_of_the_exact_product(text, key, n, tokens):
    mask = parse(text)
    assert mask.size(key, n) == tokens
    if mask.family == "prefix_lm":  # the slices use it: row 0 sees exactly the prefix
        assert int(mask.dense(n)[0].sum()) == tokens


def test_fractions_round_the_decimal_they_are_written_as():
    """Every fraction of up to three decimals on every length to 400: ceil(k * n / 1000) in
    integers, never a token more where k * n is a multiple of 1000."""
    for k in range(1, 1000):
        mask = parse(f"sliding_window:{k / 1000!r}")
        for n in range(1, 401):
            assert mask.size("window", n) == max(1, -(-k * n // 1000)), (k, n)


# -- the block masks -----------------------------------------------------------------------------
def _positions(rng, n, kind):
    """Increasing positions in [0, n): a contiguous run, every s-th, an arbitrary set, or a short
    run near the diagonal (where a window's band binds)."""
    if kind == "contiguous":
        a = rng.randint(0, n - 1)
        return torch.arange(a, rng.randint(a + 1, n))
    if kind == "stride":
        s = rng.randint(1, 4)
        return torch.arange(rng.randint(0, min(s, n) - 1), n, s)
    if kind == "short":
        a = rng.randint(max(0, n - 12), n - 1) if rng.random() < 0.3 else rng.randint(0, n - 1)
        return torch.arange(a, min(n, a + rng.randint(1, 6)))
    return torch.tensor(sorted(rng.sample(range(n), rng.randint(1, n))))


def _random_documents(rng, mask):
    for _ in range(100):
        batch, seq_len, pad = rng.randint(1, 3), rng.randint(1, 40), rng.choice([0, rng.randint(1, 5)])
        lengths = []
        for _ in range(batch):
            ls, total = [], 0
            while total < seq_len:
                n = min(rng.randint(1, 15), seq_len - total)
                ls.append(n)
                total += n
            lengths.append(tuple(ls))
        if rng.random() < 0.4:  # often one document per sequence: whole blocks inside one slice
            lengths = [(seq_len,)] * batch
        if all(_fits(mask, n) for ls in lengths for n in ls):
            return Documents(tuple(lengths), seq_len + pad, mask)
        with pytest.raises(ValueError, match="longer than a document"):
            Documents(tuple(lengths), seq_len + pad, mask)
    raise AssertionError("no documents fit")


def _assert_key_bounds_and_tiles(rng: random.Random, m, brute: torch.Tensor) -> None:
    """`key_bounds` is the hull, over the batch, of the key rows each query row sees (first >= last
    for a row that sees none), and a tile of `dense` is that tile of the whole mask."""
    sq, sk = brute.shape[1:]
    seen = brute.any(0)  # [Sq, Sk]
    j = torch.arange(sk).expand(sq, sk)
    first, last = m.key_bounds
    rows = seen.any(1)
    assert torch.equal(first[rows], torch.where(seen, j, sk).min(1).values[rows])
    assert torch.equal(last[rows], torch.where(seen, j + 1, 0).max(1).values[rows])
    assert bool((first[~rows] >= last[~rows]).all())
    r0, c0 = rng.randrange(sq), rng.randrange(sk)
    r1, c1 = rng.randint(r0, sq), rng.randint(c0, sk)
    assert torch.equal(m.dense(rows=slice(r0, r1), cols=slice(c0, c1)), brute[:, r0:r1, c0:c1])


@pytest.mark.parametrize("text", MASKS)
def test_block_masks_count_classify_and_cut_into_pieces_exactly(text):
    """Against the brute-force mask: visible pairs, dense() (whole and a tile of it), each query
    row's key bounds, the class (empty / full / one offset / one band / partial), and the pieces
    (they tile the mask exactly), for contiguous, strided and arbitrary position sets in packed,
    padded sequences."""
    mask = parse(text)
    rng = random.Random(text)
    kinds = set()
    for trial in range(40):
        docs = _random_documents(rng, mask)
        causal = mask.causal
        brute_all = brute_force(docs, mask)
        shape = ("contiguous", "stride", "any", "short")[trial % 4]
        qp, kp = _positions(rng, docs.padded_len, shape), _positions(rng, docs.padded_len, shape)
        if shape == "short":  # keys around the queries
            n = docs.padded_len
            kp = torch.arange(max(0, int(qp[0]) - rng.randint(0, 6)), min(n, int(qp[-1]) + 1 + rng.randint(0, 3)))
        m = docs.block(qp, kp, causal)
        brute = brute_all[:, qp][:, :, kp]
        assert torch.equal(m.dense(), brute), (text, docs, qp, kp)
        _assert_key_bounds_and_tiles(rng, m, brute)
        assert m.pairs == int(brute.sum())
        kinds.add(m.kind)
        i, j = torch.arange(len(qp))[:, None], torch.arange(len(kp))[None, :]
        if m.kind == EMPTY:
            assert not brute.any()
        elif m.kind == FULL:
            assert brute.all()
        elif m.kind == OFFSET:
            assert m.lower is None
            assert torch.equal(brute, (j - i <= m.causal_offset).expand_as(brute))
        elif m.kind == BAND:
            assert m.lower is not None
            band = j - i >= m.lower
            if m.causal_offset is not None:
                band &= j - i <= m.causal_offset
            assert torch.equal(brute, band.expand_as(brute)), (text, qp, kp, m.causal_offset, m.lower)
        else:
            assert m.kind == PARTIAL
        for b in range(docs.batch):
            tiled = torch.zeros(len(qp), len(kp), dtype=torch.bool)
            for rows, cols, offset, lower in m.pieces(b):
                pi = torch.arange(rows.stop - rows.start)[:, None]
                pj = torch.arange(cols.stop - cols.start)[None, :]
                piece = torch.ones(len(pi), pj.shape[1], dtype=torch.bool)
                if offset is not None:
                    piece &= pj - pi <= offset
                if lower is not None:
                    piece &= pj - pi >= lower
                assert not (tiled[rows, cols] & piece).any()  # pieces never overlap
                tiled[rows, cols] |= piece
            assert torch.equal(tiled, brute[b]), (text, b, qp, kp)
    assert EMPTY in kinds or mask.family == "full"
    if mask.family == "sliding_window" and mask.param("window") != 1:
        assert BAND in kinds, kinds  # a window's diagonal blocks take the band path


def test_a_window_on_one_document_is_a_band_with_both_edges():
    docs = Documents.single(1, 20, mask=parse("sliding_window:4"))
    m = docs.block(torch.arange(8, 12), torch.arange(4, 12), causal=True)
    # row i (position 8 + i) sees positions 5 + i .. 8 + i: rows j = i + 1 .. i + 4
    assert (m.kind, m.lower, m.causal_offset) == (BAND, 1, 4)
    strided = docs.block(torch.arange(1, 20, 2), torch.arange(1, 20, 2), causal=True)
    # every other position: row i sees rows i - 1 and i (2 (i - j) < 4)
    assert (strided.kind, strided.lower, strided.causal_offset) == (BAND, -1, 0)


# -- the kernels -----------------------------------------------------------------------------------
def _reference(do, q, k, v, vis, scale):
    d = [x.double() for x in (do, q, k, v)]
    ro, rl = kernels.math_forward(*d[1:], scale=scale, causal_offset=None, visible=vis)
    return ro, rl, kernels.math_backward(*d, ro, rl, scale=scale, causal_offset=None, visible=vis)


@pytest.mark.parametrize("kernel", ["math", "cpu_flash"])
def test_band_kernels_match_float64(kernel):
    """block_forward / block_backward with a BAND block mask, and with `lower=` and an offset given
    directly (rows that see nothing included), against float64 attention under the dense mask."""
    rng = random.Random(3)
    torch.manual_seed(0)
    bands = 0
    for text in ("sliding_window:4", "sliding_window:window=3,symmetric=true", "global_window:globals=2,window=3"):
        docs = Documents.single(2, 30, padded_len=32, mask=parse(text))
        for _ in range(30):
            qa, ka, stride = rng.randint(0, 20), rng.randint(0, 20), rng.choice([1, 1, 2])
            qp = torch.arange(qa, min(32, qa + rng.randint(1, 10) * stride), stride)
            kp = torch.arange(ka, min(32, ka + rng.randint(1, 10) * stride), stride)
            m = docs.block(qp, kp, docs.mask.causal)
            if m.kind != BAND:
                continue
            bands += 1
            q, do = torch.randn(2, len(qp), 4, 8), torch.randn(2, len(qp), 4, 8)
            k, v = torch.randn(2, len(kp), 2, 8), torch.randn(2, len(kp), 2, 8)
            ro, rl, ref = _reference(do, q, k, v, brute_force(docs, docs.mask)[:, qp][:, :, kp], 0.3)
            o, lse = kernels.block_forward(q, k, v, scale=0.3, causal_offset=0, kernel=kernel, mask=m)
            grads = kernels.block_backward(do, q, k, v, o, lse, scale=0.3, causal_offset=0, kernel=kernel, mask=m)
            assert_block_matches(o, lse, grads, ro, rl, ref)
    assert bands >= 10
    for sq, sk, offset, lower in [(6, 9, 3, 1), (5, 5, None, -2), (7, 4, 0, -3), (4, 8, 2, 2), (6, 3, 5, -1)]:
        q, do = torch.randn(1, sq, 4, 8), torch.randn(1, sq, 4, 8)
        k, v = torch.randn(1, sk, 4, 8), torch.randn(1, sk, 4, 8)
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        vis = (j - i >= lower) & ((j - i <= offset) if offset is not None else True)
        ro, rl, ref = _reference(do, q, k, v, vis.expand(1, sq, sk), 0.5)
        o, lse = kernels.block_forward(q, k, v, scale=0.5, causal_offset=offset, lower=lower, kernel=kernel)
        grads = kernels.block_backward(do, q, k, v, o, lse, scale=0.5, causal_offset=offset, lower=lower, kernel=kernel)
        assert_block_matches(o, lse, grads, ro, rl, ref)


# -- every own method ----------------------------------------------------------------------------
# one choice or two per family (its `examples`): sizes that matter at S = 7P + 5 and in documents
# of a few tokens; fractions where a packed document could be shorter than a fixed size would need
METHOD_MASKS = mask_examples()
VARIANTS = own_variants()
WORLD_SIZES = (2, 3, 4)


def _masks_at(variant_index: int, world_size: int) -> list[str]:
    """A rotating third of the families per world size: every (method, family) pair at one P (a
    different one for neighbouring variants), every P with a third of the families."""
    shift = (variant_index + world_size) % len(WORLD_SIZES)
    return [m for n, m in enumerate(METHOD_MASKS) if n % len(WORLD_SIZES) == shift]


def test_the_rotation_covers_every_method_family_pair_and_world_size():
    for v in range(len(VARIANTS)):
        covered = [m for p in WORLD_SIZES for m in _masks_at(v, p)]
        assert sorted(covered) == sorted(METHOD_MASKS)
        assert all(_masks_at(v, p) for p in WORLD_SIZES)


def check_mask(
    name, options, world_size, seq_len, lengths, mask: Mask, comm_runner=_threads, flag: bool | None = None
) -> str:
    """Run `name` on packed documents `lengths` under `mask` and compare out, lse, dq, dk, dv with
    float64 within the problem's tolerance (tests/test_varlen.py's check_documents, with a mask).
    `flag`: the causal flag the method is called with (None: the mask's own, `Mask.causal`).
    Returns the method's refusal ("" when it ran)."""
    heads, kv_heads = (6, 3) if world_size == 3 else (8, 4)  # GQA, heads divisible by P
    causal = mask.causal
    flag = causal if flag is None else flag
    m = methods.get_method(name, **options)
    batch = len(lengths)
    true_docs = Documents(lengths, seq_len, mask)
    case = Case(batch, seq_len, heads, kv_heads, 8, "float32", flag, world_size, documents=true_docs)
    padded = m.padded_len(case)
    case = Case(
        batch, padded, heads, kv_heads, 8, "float32", flag, world_size, documents=Documents(lengths, padded, mask)
    )
    ok, why = m.supports(case)
    if not ok:
        return why
    prob = build_problem(
        batch,
        seq_len,
        heads,
        kv_heads,
        8,
        "float32",
        causal,
        "masks",
        seed=0,
        device=torch.device("cpu"),
        with_reference=True,
        documents=true_docs,
    )
    # the reference's mask is the family's formula (build_problem masks through the slices)
    everything = torch.arange(seq_len)
    assert torch.equal(true_docs.block(everything, everything, causal).dense(), brute_force(true_docs, mask))
    per_rank = comm_runner(world_size, _rank_outputs, m.name, options, case, prob)
    lay = m.layout(case)
    for i, t in enumerate(("out", "lse", "dq", "dk", "dv")):
        dim = 2 if t == "lse" else 1
        got = lay.unshard([r[i] for r in per_rank], dim=dim).narrow(dim, 0, seq_len)
        err = float((got.double() - prob.ref[t].double()).abs().max())
        tol = prob.tolerance(t, world_size)
        assert err <= tol, (name, options, world_size, mask.name, lengths, t, err, tol)
        if t == "lse":  # the rows at the mask's boundaries, by themselves (suite/check.py)
            err, tol = prob.lse_boundary_error(got), prob.tolerance("lse_boundary", world_size)
            assert err <= tol, (name, options, world_size, mask.name, lengths, "lse at boundaries", err, tol)
    return ""


def _packed(rng, seq_len):
    ls, total = [], 0
    while total < seq_len:
        n = min(rng.randint(2, seq_len // 2 + 1), seq_len - total)
        ls.append(n)
        total += n
    return (tuple(ls),)


@pytest.mark.parametrize("name,options", VARIANTS, ids=[variant_id(n, o) for n, o in VARIANTS])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_method_computes_every_family_exactly(name, options, world_size):
    """S = 7P + 5 (no layout's granule divides it: padded), GQA; packed documents (batch 1: document
    sharding needs one packing) and one document per sequence (batch 2), forward and backward."""
    index = VARIANTS.index((name, options))
    seq_len = 7 * world_size + 5
    rng = random.Random(f"{name}{world_size}")
    for text in _masks_at(index, world_size):
        mask = parse(text)
        for lengths in (_packed(rng, seq_len), ((seq_len,), (seq_len,))):
            why = check_mask(name, options, world_size, seq_len, lengths, mask)
            if why:  # only a node size (burst) or the Ulysses split of the heads
                assert any(s in why for s in ("heads divisible", "kv_heads", "does not divide")), why


def test_a_ring_that_ignores_the_mask_on_received_blocks_is_caught(monkeypatch):
    """Planted bug: blocks whose keys come from another rank get the documents without the mask (a
    plain causal mask instead of the window): the float64 check must fail."""
    real = documents_module.BlockMasks.__call__

    def ignore_remote_window(self, q_rank, q_rows, k_rank, k_rows):
        if q_rank == k_rank:
            return real(self, q_rank, q_rows, k_rank, k_rows)
        plain = dataclasses.replace(self.docs, mask=None)
        return plain.block(self.positions(q_rank)[q_rows], self.positions(k_rank)[k_rows], self.causal)

    seq_len, window = 25, parse("sliding_window:5")
    assert check_mask("ring", {}, 2, seq_len, ((seq_len,),), window) == ""  # exact before the bug
    monkeypatch.setattr(documents_module.BlockMasks, "__call__", ignore_remote_window)
    with pytest.raises(AssertionError, match="sliding_window"):
        check_mask("ring", {}, 2, seq_len, ((seq_len,),), window)


# -- the config ------------------------------------------------------------------------------------
MASK_BASE = """
name: t
sweep:
  methods: [ring]
  world_size: [2]
  seq_len: [16]
  heads: [2]
  head_dim: [8]
  passes: [fwd]
"""


@pytest.mark.parametrize(
    "extra,expected",
    [
        ("  mask: ['sliding_window:0']\n", "sweep.mask[0]: mask sliding_window: window must be >= 1 token, got 0"),
        ("  mask: [causal, 'chunked:-1']\n", "sweep.mask[1]: mask chunked: chunk must be >= 1 token, got -1"),
        ("  mask: ['block_causal:0']\n", "sweep.mask[0]: mask block_causal: block must be >= 1 token"),
        ("  mask: ['prefix_lm:1.5']\n", "sweep.mask[0]: mask prefix_lm: prefix 1.5 is neither a token count"),
        ("  mask: [banded]\n", "sweep.mask[0]: unknown mask 'banded': the family must be one of"),
        ("  mask: ['chunked:size=4']\n", "sweep.mask[0]: mask chunked: unknown parameter 'size'"),
        ("  mask: ['prefix_lm:20']\n", "sweep.mask[0]: mask prefix_lm:prefix=20: prefix 20 is longer than a document"),
        ("  mask: [shared_question]\n", "sweep.mask[0]: mask shared_question: parameter 'question' is missing"),
        ("  mask: [w]\nmasks:\n  w: {window: 4}\n", "masks.w: masks.w: needs a `family`"),
        ("  mask: [w]\nmasks:\n  w: {family: sliding_window, width: 4}\n", "masks.w: mask sliding_window: unknown"),
        ("  mask: [causal, causal]\n", "sweep.mask: lists a mask twice"),
        (
            "  mask: ['sliding_window:4', 'sliding_window:window=4']\n",
            "sweep.mask[1]: 'sliding_window:window=4' is the mask 'sliding_window:4' names already",
        ),
        (
            "  mask: [w, 'sliding_window:4']\nmasks:\n  w: {family: sliding_window, window: 4}\n",
            "sweep.mask[1]: 'sliding_window:4' is the mask 'w' names already",
        ),
    ],
)
def test_bad_masks_are_refused_naming_the_key(write_config, extra, expected):
    with pytest.raises(ConfigError) as err:
        load_config(write_config(MASK_BASE + extra))
    assert expected in str(err.value)
    assert "(sweep.seq_len 16)" in str(err.value) or "longer than" not in expected


def test_a_fixed_prefix_longer_than_a_packed_document_is_refused_when_it_is_drawn():
    with pytest.raises(ValueError, match="prefix 20 is longer than a document of 7 tokens"):
        Documents(((7, 9),), 16, parse("prefix_lm:20"))


# -- planning ------------------------------------------------------------------------------------
def test_plain_masks_plan_the_trials_the_causal_axis_planned(write_config):
    by_causal, _ = load_config(write_config(MASK_BASE + "  causal: [true, false]\n"))
    by_mask, _ = load_config(write_config(MASK_BASE + "  mask: [causal, full]\n"))
    old, new = plan_for(by_causal, "cpu:test"), plan_for(by_mask, "cpu:test")
    assert len(old) == 2
    assert sorted(t.key for t in old) == sorted(t.key for t in new)
    assert sorted((t.causal, t.mask) for t in new) == [(False, "full"), (True, "causal")]


def test_a_family_trial_carries_its_canonical_name(write_config):
    extra = "  mask: [win, 'chunked:4']\nmasks:\n  win: {family: sliding_window, window: 0.25}\n"
    cfg, _ = load_config(write_config(MASK_BASE + extra))
    trials = sorted(plan_for(cfg, "cpu:test"), key=lambda t: t.mask)
    assert [t.mask for t in trials] == ["chunked:chunk=4", "sliding_window:symmetric=false,window=0.25"]
    assert all(t.causal for t in trials)
    assert "chunked(4)" in trials[0].label() and "sliding_window(0.25)" in trials[1].label()
    assert trials[1].identity()["mask"] == "sliding_window:symmetric=false,window=0.25"
    docs = trials[1].documents()
    assert docs.mask == parse("sliding_window:0.25") and docs.lengths == ((16,),)
    assert len({t.key for t in trials}) == 2
    sym, _ = load_config(write_config(MASK_BASE + "  mask: ['sliding_window:window=3,symmetric=true']\n"))
    (trial,) = plan_for(sym, "cpu:test")
    assert not trial.causal  # a symmetric window sees later keys: the full plan, refined by the blocks


def test_a_trial_carries_its_mask_object_and_its_flag_is_the_masks(write_config):
    """The spec parses its mask once and hands the object on; its `causal` column is the mask's own
    flag (Mask.causal), and a spec that says otherwise is refused where it is made."""
    extra = "  mask: ['prefix_lm:0.25', 'chunked:4', full]\n"
    cfg, _ = load_config(write_config(MASK_BASE.replace("[ring]", "[ring, zigzag_ring]") + extra))
    trials = plan_for(cfg, "cpu:test")
    by_mask = {t.mask: t for t in trials}
    assert by_mask["prefix_lm:prefix=0.25"].causal is False and by_mask["chunked:chunk=4"].causal is True
    for t in trials:
        assert t.mask_obj is t.mask_obj and t.mask_obj == parse(t.mask) and t.causal == t.mask_obj.causal
        with pytest.raises(ValueError, match=f"causal={not t.causal} contradicts mask"):
            dataclasses.replace(t, causal=not t.causal)
    legacy = dataclasses.replace(by_mask["full"], mask="")  # planned before masks: the plain mask of its flag
    assert legacy.mask_obj == parse("full") and legacy.mask_spec is None and legacy.key == by_mask["full"].key


def test_problem_keys_are_named_and_seed_as_the_positional_tuple_did(write_config):
    """Trials of one problem (other method, other pass) share a key; a named field tells problems
    apart; `args` is the positional form the inputs' seed hashes, unchanged."""
    base = MASK_BASE.replace("[ring]", "[ring, zigzag_ring]").replace("[fwd]", "[fwd, fwd_bwd]")
    cfg, _ = load_config(write_config(base + "  mask: ['chunked:4', causal]\n"))
    trials = plan_for(cfg, "cpu:test")
    keys = {t.problem_key() for t in trials}
    assert len(trials) == 8 and len(keys) == 2
    chunked = next(k for k in keys if k.mask)
    plain = next(k for k in keys if not k.mask)
    assert chunked.mask == "chunked:chunk=4" and chunked.causal and chunked.sinks is False and chunked.heads == 2
    assert chunked.args == (1, 16, 2, 8, 8, "float32", True, "chunked:chunk=4")
    assert plain.args == (1, 16, 2, 8, 8, "float32", True) and dataclasses.replace(plain, mask="x") != plain
    capped = dataclasses.replace(plain, softcap=2.0, sinks=True, head_dim_v=4)
    assert capped.args == plain.args + (("head_dim_v", 4), ("softcap", 2.0), "sinks")


def test_a_long_sequence_is_counted_in_closed_form():
    """Pairs of a window on a 1M-token sequence (far beyond what a dense mask could check)."""
    docs = Documents.single(1, 1 << 20, mask=parse("sliding_window:4096"))
    m = docs.block(torch.arange(1 << 19, (1 << 19) + 4096), torch.arange(0, 1 << 20), causal=True)
    assert m.pairs == 4096 * 4096 and m.kind == BAND


# -- the peers -------------------------------------------------------------------------------------
def test_peer_libraries_refuse_mask_families_with_their_limitation(monkeypatch):
    """No peer adapter passes a mask family to its library: a family trial is a recorded skip with
    the library's reason (never a run with the plain mask), plain masks still run."""
    from methods.peers import ring_flash_attn_peer

    for cls in ring_flash_attn_peer.CLASSES:  # past the missing flash-attn: the CPU test double's mode
        monkeypatch.setattr(cls, "shim", True)
        monkeypatch.setattr(cls, "import_error", "")
    window = parse("sliding_window:4")
    expected = {
        "rfa_ring": "ring-flash-attn's ring functions take only causal or full masks",
        "rfa_llama3": "a sliding window only on its llama3 path",
        "yunchang_usp": "yunchang's LongContextAttention takes only causal or full masks",
    }
    for name, reason in expected.items():
        m = methods.get_method(name, **({"kernel_shim": True} if name.startswith("yunchang") else {}))
        plain = Case(1, 16, 4, 4, 8, "bfloat16", True, 2)
        assert m.supports(plain)[0], m.supports(plain)
        ok, why = m.supports(dataclasses.replace(plain, documents=Documents.single(1, 16, mask=window)))
        assert not ok and reason in why and "sliding_window(4)" in why, why
    cp = methods.method_class("torch_cp_allgather") if "torch_cp_allgather" in methods.available() else None
    if cp is not None:
        assert "no attention mask" in cp.mask_reason


# -- a causal flag against the mask ----------------------------------------------------------------
CONTRADICTIONS = [
    ("full", True),  # a plain mask given to Documents is stored as None: checked by the family given
    ("causal", False),
    ("prefix_lm:0.25", True),
    ("sliding_window:window=4,symmetric=true", True),
    ("block_causal:3", True),
    ("global_window:globals=2,window=3", True),
]


@pytest.mark.parametrize("name", methods.available())
def test_a_causal_flag_that_contradicts_the_mask_is_refused(name):
    """causal=True once let the causal plan of ring, zigzag_ring, allgather_kv, token_ring, burst
    and tasp skip the pairs a mask with later keys keeps: wrong numbers, silently. Every method's
    attention and attention_fwd_bwd refuse it before any rank computes, naming the mask, the flag
    and what to pass."""
    from methods.comm import run_threads
    from methods.peers.base import PeerMethod

    m = methods.get_method(name)
    q, k, v = (torch.randn(1, 12, 2, 8) for _ in range(3))
    calls = [m.attention]
    if not isinstance(m, PeerMethod):  # a peer runs its library's autograd: no direct forward-backward
        calls.append(functools.partial(m.attention_fwd_bwd, dout=q))
    for text, flag in CONTRADICTIONS:
        docs = Documents(((12,),), 12, parse(text))
        family = parse(text).family
        for call in calls:
            with pytest.raises(ValueError, match=rf"causal={flag} contradicts .*{family}.*pass causal={not flag}"):
                run_threads(1, lambda comm: call(q, k, v, causal=flag, comm=comm, docs=docs))


@pytest.mark.parametrize("name,options", VARIANTS, ids=[variant_id(n, o) for n, o in VARIANTS])
def test_causal_false_with_a_family_inside_the_causal_mask_stays_exact(name, options):
    """The other way round is no contradiction: the full plan is a superset, refined block by
    block, so it is allowed and exact (only slower)."""
    for text in ("sliding_window:5", "chunked:0.3"):
        why = check_mask(name, options, 3, 26, ((26,), (26,)), parse(text), flag=False)
        assert not why or any(s in why for s in ("heads divisible", "kv_heads", "does not divide")), why
