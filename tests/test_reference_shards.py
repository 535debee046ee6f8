"""Each rank draws only its shard of the inputs, and checks it against a float64 reference computed
in tiles for its rows alone (suite/check.py InputSource, suite/reference.py).

Proved here against the unsharded path (the global tensors and `reference_attention`, which the
independent oracle found exact): every layout's shard is bit for bit the slice of the global
tensors, packed documents and tail padding included; the tiled reference of every rank equals the
unsharded reference's rows for every mask family, GQA, sinks, a soft cap, a value head dim and
odd sizes; and the pass rule's bound, assembled from the ranks' parts, is the unsharded bound."""

from __future__ import annotations

import pytest
import torch

import methods
from methods.base import Case
from methods.documents import Documents
from methods.masks import examples, parse
from suite import check, reference
from suite.check import INPUT_NAMES, InputSource, build_problem, pass_floor, tolerance
from suite.reference import ProblemReference

CPU = torch.device("cpu")


def _source(b, s, h, hkv, d, dtype="float32", dv=None, seed=7):
    return InputSource(b, s, h, hkv, d, dtype, seed, CPU, dv)


@pytest.mark.parametrize("block", [1024, 5])
def test_rows_are_the_global_tensors_rows_in_any_order_and_padding_is_zero(monkeypatch, block):
    monkeypatch.setattr(check, "INPUT_BLOCK", block)
    src = _source(2, 23, 4, 2, 8, "bfloat16", dv=6)
    full = {n: src.full(n) for n in INPUT_NAMES}
    assert full["v"].shape == (2, 23, 2, 6) and full["q"].dtype == torch.bfloat16
    pos = torch.tensor([22, 0, 7, 30, 5, 6, 24])  # any order; 30 and 24 are tail padding
    fresh = _source(2, 23, 4, 2, 8, "bfloat16", dv=6)  # another rank: draws only these rows
    for n in INPUT_NAMES:
        got = fresh.rows(n, pos)
        real = pos < 23
        assert torch.equal(got[:, real], full[n][:, pos[real]]), n
        assert not got[:, ~real].any()
        assert torch.equal(fresh.rows(n, pos, batch=1), got[1:2])
    # the seed and the tensor decide the numbers: other seeds and tensors differ
    assert not torch.equal(_source(2, 23, 4, 2, 8, seed=8).full("q"), _source(2, 23, 4, 2, 8).full("q"))
    assert not torch.equal(full["q"][:, :, :2].float(), full["k"].float())


LAYOUT_CASES = [
    ("ring", {}, 4, None, None),
    ("zigzag_ring", {}, 4, None, None),
    ("stripe_ring", {}, 3, None, None),
    ("usp", {"ulysses_degree": 2}, 4, None, None),
    ("allgather_kv", {}, 2, ((9, 20), (29,)), "causal"),
    ("dispatch", {}, 4, ((9, 20), (17, 12)), "sliding_window:4"),
    ("zigzag_ring", {}, 3, ((7, 6, 16), (29,)), "prefix_lm:0.5"),
]


@pytest.mark.parametrize("name,options,p,lengths,mask", LAYOUT_CASES)
def test_every_layouts_shards_are_the_global_slices(name, options, p, lengths, mask):
    """A rank's drawn rows equal its layout's shard of the global tensors today's check would build
    (padding included), for contiguous, zigzag, stripe, USP and document-following layouts."""
    seq = 29
    m = methods.get_method(name, **options)
    spec_mask = parse(mask) if mask else None
    causal = True if mask is None else spec_mask.causal
    docs = Documents(lengths, seq, spec_mask) if lengths else None
    case = Case(2, seq, 4, 2, 8, "float32", causal, p, documents=docs)
    padded = m.padded_len(case)
    if padded != seq or docs is not None:
        case = Case(
            2,
            padded,
            4,
            2,
            8,
            "float32",
            causal,
            p,
            documents=Documents(lengths or ((seq,), (seq,)), padded, spec_mask),
        )
    layout = m.layout(case)
    src = _source(2, seq, 4, 2, 8)
    full = {n: src.full(n) for n in INPUT_NAMES}
    for r in range(p):
        pos = layout.positions(r)
        for n in INPUT_NAMES:
            pad = torch.zeros(2, padded - seq, *full[n].shape[2:])
            want = layout.shard(torch.cat([full[n], pad], dim=1), r)
            assert torch.equal(src.rows(n, pos), want), (name, r, n)


def _compare(b, s, h, hkv, d, dtype, causal, mask=None, lengths=None, sinks=False, softcap=0.0, dv=None, parts=None):
    """Every rank's tiled reference against the unsharded one; returns the largest relative error."""
    docs = None
    if mask is not None or lengths is not None:
        docs = Documents(lengths or tuple((s,) for _ in range(b)), s, parse(mask) if mask else None)
    key = ("t",)
    glob = build_problem(
        b,
        s,
        h,
        hkv,
        d,
        dtype,
        causal,
        *key,
        seed=3,
        device=CPU,
        with_reference=True,
        documents=docs,
        sinks=sinks,
        head_dim_v=dv,
        softcap=softcap,
    )
    seed = check.problem_seed(3, (b, s, h, hkv, d, dtype, causal) + key)
    src = InputSource(b, s, h, hkv, d, dtype, seed, CPU, dv)
    assert torch.equal(src.full("q"), glob.q)
    ref = ProblemReference(
        src, causal=causal, scale=methods.kernels.default_scale(d), documents=docs, sinks=glob.sinks, softcap=softcap
    )
    parts = parts or [torch.arange(s)]
    worst = 0.0
    naive: dict[str, float] = {}
    top: dict[str, float] = {}
    for pos in parts:
        sc = ref.shard(pos, grads=True)
        real = pos[pos < s]
        for name, t in sc.ref.items():
            want = glob.ref[name]
            if name != "dsink":
                want = want.index_select(2 if name == "lse" else 1, real)
            scale = max(1.0, float(glob.ref[name].abs().max()))
            worst = max(worst, float((t - want.double()).abs().max()) / scale if t.numel() else 0.0)
            naive[name] = max(naive.get(name, 0.0), sc.naive_err[name])
            top[name] = max(top.get(name, 0.0), sc.ref_max[name])
    assert set(naive) == set(glob.ref)
    floor = pass_floor(glob.q.dtype, s, len(parts))
    for name in glob.ref:  # the bound from the ranks' parts is the unsharded bound
        assert top[name] == pytest.approx(glob.ref_scale[name], rel=1e-12), name
        if name == "dsink":  # the unsharded naive sums the sinks' shares in the trial dtype per chunk of
            continue  # rows (its bound moves with the chunk); the tiled one in float32 per row
        assert tolerance(naive[name], top[name], floor) == pytest.approx(glob.tolerance(name, len(parts)), rel=0.35), (
            name
        )
    return worst


def _zigzag(s, p):
    c = -(-s // (2 * p))
    return [
        torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * p - 1 - r) * c, (2 * p - r) * c)])
        for r in range(p)
    ]


@pytest.mark.parametrize("mask", examples())  # every mask family (methods/masks.py)
def test_tiled_reference_equals_the_unsharded_one_for_every_mask_family(mask, monkeypatch):
    monkeypatch.setattr(reference, "TILE_BYTES", 3000)  # several tiles of rows and keys
    causal = parse(mask).causal
    family = None if parse(mask).plain else mask
    worst = _compare(2, 37, 4, 2, 8, "float32", causal, mask=family, parts=_zigzag(37, 3))
    assert worst < 1e-12, worst


@pytest.mark.parametrize(
    "kw",
    [
        dict(sinks=True),
        dict(softcap=3.0),
        dict(dv=5),
        dict(lengths=((10, 17, 6), (33,))),
        dict(sinks=True, dv=12, lengths=((20, 13), (1, 32))),
    ],
    ids=["sinks", "softcap", "head_dim_v", "documents", "sinks_documents_dv"],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiled_reference_with_the_variants(kw, dtype, monkeypatch):
    monkeypatch.setattr(reference, "TILE_BYTES", 5000)
    parts = [
        torch.arange(0, 33, 4),
        torch.tensor([1, 2, 3, 40, 41]),
        torch.tensor([i for i in range(33) if i % 4 and i > 3]),
    ]
    worst = _compare(2, 33, 6, 2, 8, dtype, True, parts=parts, **kw)
    assert worst < 1e-12, worst


def test_a_rank_of_padding_only_and_float64_inputs(monkeypatch):
    monkeypatch.setattr(reference, "TILE_BYTES", 4000)
    parts = [torch.arange(0, 9), torch.arange(9, 30), torch.arange(30, 40)]  # the last: tail padding only
    worst = _compare(1, 30, 2, 1, 4, "float64", True, parts=parts)
    assert worst < 1e-12, worst


def test_the_shard_reference_is_kept_for_the_next_trial_of_the_layout():
    src = _source(1, 16, 2, 2, 4)
    ref = ProblemReference(src, causal=True, scale=0.5)
    pos = torch.arange(8)
    a = ref.shard(pos, grads=True)
    assert ref.shard(pos, grads=False) is a and ref.shard(pos.clone(), grads=True) is a
    assert ref.shard(torch.arange(8, 16), grads=False) is not a
