"""dispatch (methods/dispatch.py): its plan sends a rank only the keys its queries see, balances the
visible area, and moves fewer bytes than the methods that circulate or gather every block where
the mask keeps few pairs. Exactness against float64 for every family, GQA, odd sizes and world
sizes is the generic tests' (tests/test_methods.py, tests/test_masks.py: dispatch is an own
method with its stages and chunk variants)."""

import pytest
import torch

import methods
from methods import Case
from methods.dispatch import build_plan
from methods.documents import Documents
from methods.masks import examples, parse

FAMILIES = examples()  # every mask family (methods/masks.py)


def _case(mask_text: str, world_size: int, lengths=((48,),), batch_alike: bool = True) -> Case:
    family = parse(mask_text)
    seq_len = sum(lengths[0])
    docs = Documents(tuple(lengths), seq_len, None if family.plain else family)
    return Case(len(lengths), seq_len, 4, 2, 8, "bfloat16", family.causal, world_size, documents=docs)


@pytest.mark.parametrize("text", FAMILIES)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_a_rank_receives_exactly_the_keys_its_queries_see(text, world_size):
    """No redundant K/V (no received key goes unseen) and nothing missing (every key a rank's
    queries see is local or received), on one sequence and on packed documents."""
    for lengths in (((48,),), ((5, 17, 9, 3, 14),)):
        case = _case(text, world_size, lengths)
        m = methods.get_method("dispatch")
        plan = m.case_plan(case)
        keys = torch.arange(case.seq_len)
        for r in range(world_size):
            assert m.redundant_kv_bytes(case, r) == 0
            mine = plan.layout.positions(r)
            seen = set(keys[case.documents.seen_keys(mine, keys, case.causal)].tolist())
            have = set(mine.tolist()) | {int(p) for msg in plan.messages if msg.dst == r for p in msg.positions}
            assert seen <= have
            assert {int(p) for msg in plan.messages if msg.dst == r for p in msg.positions} <= seen


def test_the_plan_is_equal_tokens_balanced_area_and_staged_in_order():
    case = _case("block_causal:4", 4, ((64,),))
    plan = methods.get_method("dispatch", stages=3).case_plan(case)
    assert {plan.layout.local_len(r) for r in range(4)} == {16}
    assert sum(plan.areas) == case.documents.visible_pairs(torch.arange(64), torch.arange(64), True)
    contiguous = [case.documents.visible_pairs(p, torch.arange(64), True) for p in torch.arange(64).chunk(4)]
    assert plan.balance <= max(contiguous) / (sum(contiguous) / 4)
    for msg in plan.messages:
        assert 0 <= msg.stage < 3 and msg.src != msg.dst
        assert bool((msg.positions[1:] > msg.positions[:-1]).all())  # keys increase: one kernel call each
    # the stages cut one set of messages: the bytes do not depend on them
    one = methods.get_method("dispatch", stages=1)
    assert one.expected_bytes(case, "fwd_bwd") == methods.get_method("dispatch", stages=3).expected_bytes(
        case, "fwd_bwd"
    )


def test_dispatch_moves_fewer_bytes_than_ring_and_gather_on_packed_documents():
    lengths = ((9, 30, 4, 21, 12, 7, 13),)  # 96 tokens, documents of at most a third of the sequence
    docs = Documents(lengths, 96)
    case = Case(1, 96, 8, 2, 8, "bfloat16", True, 4, documents=docs)
    mine = methods.get_method("dispatch").expected_bytes(case, "fwd_bwd")
    for other in ("ring", "zigzag_ring", "allgather_kv"):
        theirs = methods.get_method(other).expected_bytes(case, "fwd_bwd")
        assert mine[0] < theirs[0] and mine[1] < theirs[1], (other, mine, theirs)
    # without a mask every rank needs every key: all-gather's forward bytes, point to point
    full = Case(1, 96, 8, 2, 8, "bfloat16", False, 4)
    assert methods.get_method("dispatch").expected_bytes(full, "fwd") == methods.get_method(
        "allgather_kv"
    ).expected_bytes(full, "fwd")


def test_bad_options_and_sizes_are_refused_clearly():
    for bad in ({"stages": 0}, {"stages": 5}, {"stages": 2.0}, {"chunk": -1}, {"chunk": True}):
        with pytest.raises(ValueError, match="stages|chunk"):
            methods.get_method("dispatch", **bad)
    m = methods.get_method("dispatch", chunk=5)
    ok, why = m.supports(Case(1, 48, 4, 2, 8, "float32", True, 4))
    assert not ok and "world_size x chunk" in why
    assert m.padded_len(Case(1, 48, 4, 2, 8, "float32", True, 4)) == 60
    ok, why = methods.get_method("dispatch").supports(Case(1, 50, 4, 2, 8, "float32", True, 4))
    assert not ok and "multiple of 4 x world_size" in why


def test_the_plan_is_built_once_per_problem():
    case = _case("sliding_window:5", 3)
    m = methods.get_method("dispatch")
    assert m.case_plan(case) is m.case_plan(case)
    build_plan.cache_clear()
    assert m.case_plan(case) is not None
