import pytest
import torch

from methods import layouts


def layouts_for(world_size: int, seq_len: int):
    out = [layouts.make(kind, seq_len, world_size) for kind in ("contiguous", "zigzag", "stripe")]
    out += [layouts.usp(seq_len, world_size, u) for u in range(1, world_size + 1) if world_size % u == 0]
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6, 8])
def test_union_is_a_permutation_and_unshard_inverts_shard(world_size):
    seq_len = 2 * world_size * 7  # odd chunk length; fits every layout
    for lay in layouts_for(world_size, seq_len):
        _check_layout(lay, world_size, seq_len)


def _check_layout(lay, world_size, seq_len):
    allpos = torch.cat([lay.positions(r) for r in range(world_size)])
    assert sorted(allpos.tolist()) == list(range(seq_len))
    x = torch.randn(3, seq_len, 5, 4)
    parts = [lay.shard(x, r) for r in range(world_size)]
    assert all(p.is_contiguous() for p in parts)
    assert torch.equal(lay.unshard(parts), x)
    # positions() are the global positions of the shard's tokens
    for r in range(world_size):
        assert torch.equal(parts[r], x[:, lay.positions(r)])


def test_layout_positions_match_their_definitions():
    assert layouts.contiguous(12, 3).positions(1).tolist() == [4, 5, 6, 7]
    assert layouts.zigzag(12, 3).positions(0).tolist() == [0, 1, 10, 11]
    assert layouts.zigzag(12, 3).positions(2).tolist() == [4, 5, 6, 7]
    assert layouts.stripe(12, 3).positions(1).tolist() == [1, 4, 7, 10]


def test_usp_layout_is_zigzag_pairs_cut_into_ulysses_pieces():
    # P = 4 as ulysses 2 x ring 2: ring rank r's pair is chunks r and 3-r of 4 (12 tokens each)
    lay = layouts.usp(48, 4, 2)
    assert lay.positions(0).tolist() == list(range(0, 12))  # ring 0, ulysses 0: chunk 0
    assert lay.positions(1).tolist() == list(range(36, 48))  # ring 0, ulysses 1: chunk 3
    assert lay.positions(2).tolist() == list(range(12, 24))  # ring 1, ulysses 0: chunk 1
    assert lay.positions(3).tolist() == list(range(24, 36))  # ring 1, ulysses 1: chunk 2
    # the edge cases are Ulysses' and the zigzag ring's layouts
    for p in (2, 4, 6):
        assert all(
            torch.equal(layouts.usp(12 * p, p, p).positions(r), layouts.contiguous(12 * p, p).positions(r))
            for r in range(p)
        )
        assert all(
            torch.equal(layouts.usp(12 * p, p, 1).positions(r), layouts.zigzag(12 * p, p).positions(r))
            for r in range(p)
        )
    with pytest.raises(ValueError, match="dividing world_size"):
        layouts.usp(48, 4, 3)


def test_shard_along_another_dim():
    lay = layouts.zigzag(8, 2)
    lse = torch.randn(2, 3, 8)
    assert torch.equal(lay.unshard([lay.shard(lse, r, dim=2) for r in range(2)], dim=2), lse)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_zigzag_balances_causal_work_and_contiguous_does_not(world_size):
    s = 16 * world_size
    zz = [layouts.zigzag(s, world_size).causal_work(r) for r in range(world_size)]
    assert len(set(zz)) == 1
    cont = [layouts.contiguous(s, world_size).causal_work(r) for r in range(world_size)]
    assert cont[-1] > cont[0] * (2 * world_size - 2)  # last rank does ~(2P-1)x the first


@pytest.mark.parametrize(
    "kind,seq_len,world_size,need",
    [("contiguous", 10, 4, "divisible by 4"), ("zigzag", 12, 4, "divisible by 8"), ("stripe", 7, 2, "divisible by 2")],
)
def test_bad_sizes_name_the_constraint(kind, seq_len, world_size, need):
    with pytest.raises(ValueError, match=need):
        layouts.make(kind, seq_len, world_size)


def test_unknown_layout():
    with pytest.raises(ValueError, match="choose one of"):
        layouts.make("spiral", 8, 2)
