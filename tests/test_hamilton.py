"""Arc-disjoint directed Hamiltonian cycles of K_n* (methods/hamilton.py)."""

from __future__ import annotations

import itertools

import pytest

from methods import hamilton
from methods.hamilton import hamiltonian_cycles, is_full, predecessors, successors, verify_cycles

NS = range(2, 65)


def expected_full(n: int) -> bool:
    return n == 2 or n % 2 == 1 or (n % 4 == 0 and n >= 8)


def arcs(cycle) -> list[tuple[int, int]]:
    return list(zip(cycle, [*cycle[1:], cycle[0]]))


@pytest.mark.parametrize("n", NS)
def test_cycles_verify_and_count(n):
    cycles = hamiltonian_cycles(n)
    verify_cycles(cycles, n)
    # Independent of verify_cycles: each cycle is a permutation, and arcs are never repeated.
    assert all(sorted(c) == list(range(n)) for c in cycles)
    used = [a for c in cycles for a in arcs(c)]
    assert len(used) == len(set(used))
    assert all(a != b for a, b in used)
    assert len(cycles) == (n - 1 if expected_full(n) else n - 2)
    assert is_full(n) == expected_full(n)


@pytest.mark.parametrize("n", NS)
def test_successors_and_predecessors_are_inverse(n):
    cycles = hamiltonian_cycles(n)
    succ, pred = successors(cycles), predecessors(cycles)
    assert len(succ) == len(pred) == len(cycles)
    for c, cycle in enumerate(cycles):
        assert sorted(succ[c]) == list(range(n))  # a permutation of the ranks
        for r in range(n):
            assert succ[c][r] != r
            assert pred[c][succ[c][r]] == r
            assert succ[c][pred[c][r]] == r
        # Following succ from any rank walks the whole cycle (one n-cycle, not several shorter).
        r, seen = cycle[0], []
        for _ in range(n):
            seen.append(r)
            r = succ[c][r]
        assert seen == list(cycle) and r == cycle[0]


@pytest.mark.parametrize("n", [n for n in NS if expected_full(n)] + [128])
def test_full_decomposition_uses_every_link_once_per_round(n):
    cycles = hamiltonian_cycles(n)
    assert len(cycles) == n - 1 and is_full(n)
    count = {(a, b): 0 for a in range(n) for b in range(n) if a != b}
    for cycle in cycles:
        for arc in arcs(cycle):
            count[arc] += 1
    assert set(count.values()) == {1}
    # Per round: each rank sends to every other rank once and receives from every other rank once.
    succ, pred = successors(cycles), predecessors(cycles)
    for r in range(n):
        others = sorted(set(range(n)) - {r})
        assert sorted(s[r] for s in succ) == others
        assert sorted(p[r] for p in pred) == others


@pytest.mark.parametrize("n", [4, 6, 10, 14, 18, 62])
def test_fallback_leaves_a_perfect_matching_unused(n):
    cycles = hamiltonian_cycles(n)
    used = {a for c in cycles for a in arcs(c)}
    unused = {(a, b) for a in range(n) for b in range(n) if a != b} - used
    assert len(unused) == n
    # Both orientations of n/2 vertex-disjoint edges: the matching of the even Walecki variant.
    assert all((b, a) in unused for a, b in unused)
    assert sorted(a for a, _ in unused) == list(range(n))


def test_deterministic_and_fresh_lists():
    first = hamiltonian_cycles(12)
    first[0].reverse()
    first.append([0])
    again = hamiltonian_cycles(12)
    assert again != first
    assert again == hamiltonian_cycles(12)
    verify_cycles(again, 12)


def test_small_cases_are_what_the_docstring_says():
    assert hamiltonian_cycles(2) == [[0, 1]]
    assert sorted(map(sorted, map(arcs, hamiltonian_cycles(3)))) == [sorted(arcs([0, 1, 2])), sorted(arcs([0, 2, 1]))]


@pytest.mark.parametrize("n", [1, 0, -3])
def test_n_below_two_raises(n):
    with pytest.raises(ValueError, match="n >= 2"):
        hamiltonian_cycles(n)
    with pytest.raises(ValueError, match="n >= 2"):
        is_full(n)
    with pytest.raises(ValueError, match="n >= 2"):
        verify_cycles([], n)


def test_non_integer_n_raises():
    with pytest.raises(ValueError):
        hamiltonian_cycles(4.0)


def test_verify_rejects_missing_vertex():
    with pytest.raises(ValueError, match=r"cycle 1 misses vertices \[3\]"):
        verify_cycles([[0, 1, 2, 3], [0, 2, 1]], 4)


def test_verify_rejects_repeated_vertex():
    with pytest.raises(ValueError, match="cycle 0 visits vertex 2 more than once"):
        verify_cycles([[0, 2, 1, 2]], 4)


def test_verify_rejects_out_of_range_vertex():
    with pytest.raises(ValueError, match="cycle 0 has vertex 4 outside 0..3"):
        verify_cycles([[0, 1, 2, 3, 4]], 4)


def test_verify_rejects_shared_arc():
    # Both cycles use 0->1.
    with pytest.raises(ValueError, match="arc 0->1 is used twice: by cycle 0 and cycle 1"):
        verify_cycles([[0, 1, 2, 3, 4], [0, 1, 3, 2, 4]], 5)
    # The closing arc (last -> first) counts too: 4->0 in both.
    with pytest.raises(ValueError, match="arc 4->0 is used twice"):
        verify_cycles([[0, 1, 2, 3, 4], [0, 3, 2, 1, 4]], 5)


def test_verify_accepts_a_valid_set():
    verify_cycles([[0, 1, 2], [0, 2, 1]], 3)


def test_successors_reject_a_non_permutation():
    with pytest.raises(ValueError, match="visits vertex 1 more than once"):
        successors([[0, 1, 1]])


def test_mod4_construction_fails_over_to_the_verified_fallback(monkeypatch):
    """Should the n % 4 == 0 construction ever produce invalid cycles, n-2 valid ones come back."""
    hamilton._cycles.cache_clear()
    monkeypatch.setattr(hamilton, "_full_mod4", lambda n: [list(range(n))] * 2)
    try:
        cycles = hamiltonian_cycles(8)
        verify_cycles(cycles, 8)
        assert len(cycles) == 6 and not is_full(8)
    finally:
        hamilton._cycles.cache_clear()


# --- optimality of the fallback for n = 4 and n = 6 --------------------------------------------


def full_decomposition_exists(n: int) -> bool:
    """Exhaustive search: can K_n* be split into n-1 arc-disjoint directed Hamiltonian cycles?

    n-1 cycles of n arcs each are all n(n-1) arcs, so this is an exact cover: branch on the
    lowest uncovered arc, trying every directed Hamiltonian cycle through it that avoids the arcs
    already covered.
    """
    bit = {(a, b): 1 << (a * n + b) for a in range(n) for b in range(n) if a != b}
    full = sum(bit.values())
    # Every directed Hamiltonian cycle exactly once: start at 0, then a permutation of the rest.
    masks = [sum(bit[arc] for arc in arcs((0, *perm))) for perm in itertools.permutations(range(1, n))]
    through = {arc: [m for m in masks if m & b] for arc, b in bit.items()}
    order = sorted(bit, key=bit.get)

    def search(covered: int) -> bool:
        if covered == full:
            return True
        arc = next(a for a in order if not covered & bit[a])
        return any(search(covered | m) for m in through[arc] if not covered & m)

    return search(0)


@pytest.mark.parametrize("n", [3, 5])
def test_exhaustive_search_finds_decompositions_that_exist(n):
    # Control for the two negative results below: the search does find full decompositions.
    assert full_decomposition_exists(n)


@pytest.mark.parametrize("n", [4, 6])
def test_fallback_is_optimal_for_4_and_6(n):
    # n-1 arc-disjoint directed Hamiltonian cycles would be a full decomposition; none exists,
    # so the fallback's n-2 cycles are the maximum.
    assert not full_decomposition_exists(n)
    assert len(hamiltonian_cycles(n)) == n - 2
