"""sharding=area: equal chunks dealt to the ranks by their visible area under the mask
(methods/layouts.py `area`, methods/base.py DocumentSharding), exact for every mask family and
better balanced than zigzag where the mask makes zigzag uneven."""

import pytest
import torch

import methods
from methods import Case, layouts
from methods.base import chunk_areas
from methods.comm import run_threads
from methods.documents import Documents
from methods.masks import examples, parse
from suite.check import build_problem

FAMILIES = examples()  # every mask family (methods/masks.py)


def test_chunks_go_largest_first_to_the_least_loaded_rank_with_room():
    held = layouts.assign_chunks([10, 1, 7, 3, 9, 2], 2)
    # 10 -> r0; 9 -> r1; 7 -> r1 (9 < 10); 3 -> r0 (10 < 16); 2 -> r0 (13 < 16), now full; 1 -> r1
    assert held == [[0, 3, 5], [1, 2, 4]]
    assert sorted(c for h in held for c in h) == list(range(6)) and {len(h) for h in held} == {3}
    lay = layouts.area(12, 2, [10, 1, 7, 3, 9, 2])
    assert lay.positions(0).tolist() == [0, 1, 6, 7, 10, 11] and lay.positions(1).tolist() == [2, 3, 4, 5, 8, 9]
    with pytest.raises(ValueError, match="chunks"):
        layouts.area(12, 4, [1, 2, 3, 4, 5, 6])


def test_padding_option_and_keys():
    m = methods.get_method("zigzag_ring", sharding="area")
    case = Case(1, 50, 4, 2, 8, "float32", True, 3)
    assert m.padded_len(case) == 60  # 4 chunks per rank
    assert m.options()["area_chunk"] == 0 and "area_chunk" not in methods.get_method("zigzag_ring").options()
    m5 = methods.get_method("allgather_kv", sharding="area", area_chunk=5)
    assert m5.padded_len(case) == 60 and m5.padded_len(Case(1, 61, 4, 2, 8, "float32", True, 3)) == 75
    with pytest.raises(ValueError, match="area_chunk"):
        methods.get_method("zigzag_ring", area_chunk=4)
    with pytest.raises(ValueError, match="sharding"):
        methods.get_method("zigzag_ring", sharding="areas")


def _check(name, world_size, seq_len, lengths, mask, causal, options):
    """Every rank's out, lse and gradients against float64 attention on the unsharded inputs."""
    m = methods.get_method(name, sharding="area", **options)
    b = len(lengths)
    case = Case(b, seq_len, 4, 2, 8, "float32", causal, world_size, documents=Documents(lengths, seq_len, mask))
    padded = m.padded_len(case)
    docs = Documents(lengths, padded, mask)
    case = Case(b, padded, 4, 2, 8, "float32", causal, world_size, documents=docs)
    assert m.supports(case)[0]
    prob = build_problem(
        b,
        seq_len,
        4,
        2,
        8,
        "float32",
        causal,
        "area",
        seed=1,
        device=torch.device("cpu"),
        with_reference=True,
        documents=Documents(lengths, seq_len, mask),
    )
    lay, pad = m.layout(case), padded - seq_len
    assert lay.kind == "area" and len({lay.local_len(r) for r in range(world_size)}) == 1

    def pad_(x):
        return torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1) if pad else x

    def rank(comm):
        q, k, v = (lay.shard(pad_(x), comm.rank).requires_grad_() for x in (prob.q, prob.k, prob.v))
        out, lse = m.attention(q, k, v, causal=causal, comm=comm, return_lse=True, docs=docs)
        grads = torch.autograd.grad(out, (q, k, v), lay.shard(pad_(prob.dout), comm.rank))
        return (out.detach(), lse) + grads

    per_rank = run_threads(world_size, rank)
    for i, t in enumerate(("out", "lse", "dq", "dk", "dv")):
        dim = 2 if t == "lse" else 1
        got = lay.unshard([r[i] for r in per_rank], dim=dim).narrow(dim, 0, seq_len)
        err = float((got.double() - prob.ref[t].double()).abs().max())
        assert err <= prob.tolerance(t, world_size), (name, world_size, mask, t, err)


AREA_METHODS = ["zigzag_ring", "allgather_kv"]


@pytest.mark.parametrize("name", AREA_METHODS)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_area_sharding_is_exact_for_every_family(name, world_size):
    """Packed documents of uneven lengths (and padding: 7P + 5 tokens), every family, P = 2, 3, 4:
    a third of the families per world size, so every (method, family) pair runs at one P."""
    seq_len = 7 * world_size + 5
    first = seq_len // 3
    lengths = ((first, seq_len - first), (seq_len,))
    for text in FAMILIES[(AREA_METHODS.index(name) + world_size) % 3 :: 3]:
        mask = parse(text)
        _check(name, world_size, seq_len, lengths, None if mask.plain else mask, mask.causal, {})
    _check(name, world_size, seq_len, lengths, parse("global_window:2,3"), False, {"area_chunk": 3})


def _imbalance(lay, docs, causal):
    work = [docs.visible_pairs(lay.positions(r), torch.arange(lay.seq_len), causal) for r in range(lay.world_size)]
    return max(work) / (sum(work) / len(work))


@pytest.mark.parametrize("text", ["shared_question:question=32,answers=4", "block_causal:80"])
def test_area_balances_what_zigzag_leaves_uneven(text):
    """One 192-token sequence at P = 4 under a mask that zigzag's causal balancing does not fit:
    the most visible area any rank holds, over the mean, is far nearer 1 by area."""
    mask = parse(text)
    docs = Documents(((192,),), 192, mask)
    zig = layouts.zigzag(192, 4)
    by_area = methods.get_method("zigzag_ring", sharding="area", area_chunk=8)
    lay = by_area.layout(Case(1, 192, 4, 2, 8, "float32", mask.causal, 4, documents=docs))
    z, a = _imbalance(zig, docs, mask.causal), _imbalance(lay, docs, mask.causal)
    assert a < z - 0.05 and a < 1.06, (z, a)  # zigzag 1.22 and 1.11, by area 1.04 and 1.05
    assert sum(chunk_areas(docs, mask.causal, 24)) == docs.visible_pairs(
        torch.arange(192), torch.arange(192), mask.causal
    )


def test_a_layout_that_follows_the_mask_is_refused_where_layers_mask_differently():
    """The perplexity check's per-layer masks (and a Hugging Face model's window and global layers)
    share one layout: area sharding, whose layout follows the mask, is refused there, not run
    with the wrong positions."""
    from suite.workloads.perplexity import check_one_layout

    case = Case(2, 64, 4, 2, 8, "float32", True, 2)
    window = Documents.single(2, 64, mask=parse("sliding_window:4"))
    for name, options in [("zigzag_ring", {}), ("allgather_kv", {"sharding": "documents"})]:
        m = methods.get_method(name, **options)
        check_one_layout(m, case, m.layout(case), [None, window])  # one layout for every mask
    m = methods.get_method("zigzag_ring", sharding="area")
    with pytest.raises(ValueError, match="follows the mask"):
        check_one_layout(m, case, m.layout(case), [None, window])


def test_hf_models_with_window_and_global_layers_refuse_area_sharding():
    pytest.importorskip("transformers", reason="the Hugging Face path needs transformers (extra hf)")
    from suite.perplexity.hf import gathered_logits
    from tests.test_perplexity import tiny_qwen2_with_a_window

    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="follows the mask"):
        gathered_logits(tiny_qwen2_with_a_window(4), ids, methods.get_method("zigzag_ring", sharding="area"), 2)


def test_the_rotation_runs_every_family_with_every_method():
    for name in AREA_METHODS:
        covered = [t for p in (2, 3, 4) for t in FAMILIES[(AREA_METHODS.index(name) + p) % 3 :: 3]]
        assert sorted(covered) == sorted(FAMILIES)
