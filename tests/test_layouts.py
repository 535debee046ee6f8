import pytest
import torch

from methods import layouts


@pytest.mark.parametrize("kind", layouts.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_union_is_a_permutation_and_unshard_inverts_shard(kind, world_size):
    seq_len = 2 * world_size * 7  # odd chunk length; fits every layout
    lay = layouts.make(kind, seq_len, world_size)
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


@pytest.mark.parametrize("kind,seq_len,world_size,need", [
    ("contiguous", 10, 4, "divisible by 4"), ("zigzag", 12, 4, "divisible by 8"), ("stripe", 7, 2, "divisible by 2")])
def test_bad_sizes_name_the_constraint(kind, seq_len, world_size, need):
    with pytest.raises(ValueError, match=need):
        layouts.make(kind, seq_len, world_size)


def test_unknown_layout():
    with pytest.raises(ValueError, match="choose one of"):
        layouts.make("spiral", 8, 2)
