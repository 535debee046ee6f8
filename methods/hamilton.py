"""Arc-disjoint directed Hamiltonian cycles of the complete directed graph K_n* (used by TASP).

K_n* has vertices 0..n-1 (the ranks) and one arc a -> b for every ordered pair a != b, n(n-1)
arcs in all. TASP (methods/tasp.py) splits each rank's K/V into k units and moves unit j along
cycle j: each round every rank sends one chunk per cycle to its successor on that cycle and
receives one from its predecessor. The cycles must be arc-disjoint so that no link carries two
chunks in one round. A full decomposition has k = n-1 cycles covering every arc exactly once:
then every ordered pair of ranks carries exactly one chunk per round, each rank sends one message
to and receives one from every other rank, and all n(n-1) links are busy.

What hamiltonian_cycles(n) returns (every result is checked by verify_cycles before it is
returned):

    n = 2                     one cycle [0, 1]                                 n-1 cycles, full
    n odd, n >= 3             Walecki's construction, both orientations        n-1 cycles, full
    n % 4 == 0, n >= 8        zigzag rows on Z_{n-2} plus two extra vertices   n-1 cycles, full
                              (_full_mod4 below; our research notes)
    n % 4 == 2, or n = 4      even-n Walecki variant, both orientations        n-2 cycles

The fallback for the other even n (4, 6, 10, 14, 18, ...) decomposes the undirected K_n into
(n-2)/2 Hamiltonian cycles plus a perfect matching and uses each cycle in both orientations; the
n arcs of the matching stay unused. That is optimal for n = 4 (at most 2 arc-disjoint directed
Hamiltonian cycles exist) and n = 6 (at most 4): K_4* and K_6* have no full decomposition
(tests/test_hamilton.py checks both by exhaustive search). For n = 2 (mod 4), n >= 10 it is one
cycle short of full: a full decomposition exists there (Tillson's theorem) but we do not
construct it.

References:
    Walecki's construction of Hamiltonian decompositions of K_n, n odd: E. Lucas,
        Recreations mathematiques, vol. 2, Gauthier-Villars, Paris, 1892.
    T. W. Tillson, A Hamiltonian decomposition of K*_2m, 2m >= 8, J. Combin. Theory Ser. B 29
        (1980) 68-74: with the odd case (Walecki), K_n* has a decomposition into n-1 directed
        Hamiltonian cycles for every n >= 2 except n = 4 and n = 6.

Standard library only (no torch), so the tables can be built and tested anywhere.
"""

from __future__ import annotations

import operator
from functools import lru_cache
from typing import Sequence

Cycles = Sequence[Sequence[int]]


def hamiltonian_cycles(n: int) -> list[list[int]]:
    """Arc-disjoint directed Hamiltonian cycles of K_n*; each a visiting order (arc c[j] -> c[j+1], last -> first).

    Returns n-1 cycles where is_full(n), else n-2 (see the module docstring). Deterministic; a
    fresh list of lists on every call, so callers may modify it.
    """
    return [list(c) for c in _cycles(n)]


def is_full(n: int) -> bool:
    """Whether hamiltonian_cycles(n) covers all n(n-1) arcs (n-1 cycles)."""
    # The cycles are verified arc-disjoint, so n-1 of them (n arcs each) cover every arc.
    return len(_cycles(n)) == n - 1


def verify_cycles(cycles: Cycles, n: int) -> None:
    """Raise ValueError with a precise message unless every cycle visits each of 0..n-1 exactly
    once and no directed arc is used twice.

    Returns None when the cycles are valid.
    """
    if n < 2:
        raise ValueError(f"directed Hamiltonian cycles need n >= 2 vertices, got n={n}")
    owner: dict[tuple[int, int], int] = {}  # arc -> index of the first cycle that uses it
    for idx, cycle in enumerate(cycles):
        _check_cycle(cycle, n, idx)
        for a, b in zip(cycle, [*cycle[1:], cycle[0]]):
            if (a, b) in owner:
                raise ValueError(f"arc {a}->{b} is used twice: by cycle {owner[(a, b)]} and cycle {idx}")
            owner[(a, b)] = idx


def successors(cycles: Cycles) -> list[list[int]]:
    """succ[c][r]: the rank after r on cycle c (each cycle must visit 0..len-1 once each)."""
    return _neighbours(cycles, after=True)


def predecessors(cycles: Cycles) -> list[list[int]]:
    """pred[c][r]: the rank before r on cycle c (each cycle must visit 0..len-1 once each)."""
    return _neighbours(cycles, after=False)


def _neighbours(cycles: Cycles, *, after: bool) -> list[list[int]]:
    table = []
    for idx, cycle in enumerate(cycles):
        _check_cycle(cycle, len(cycle), idx)
        nxt = [0] * len(cycle)
        for a, b in zip(cycle, [*cycle[1:], cycle[0]]):
            if after:
                nxt[a] = b
            else:
                nxt[b] = a
        table.append(nxt)
    return table


# --- construction --------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _cycles(n: int) -> tuple[tuple[int, ...], ...]:
    """The verified cycles for n, as tuples (immutable, so the cache cannot be corrupted)."""
    try:
        n = operator.index(n)  # accept numpy and other integer types, reject floats
    except TypeError:
        raise ValueError(f"hamiltonian_cycles needs an integer n >= 2, got {n!r}") from None
    if n < 2:
        raise ValueError(f"hamiltonian_cycles needs an integer n >= 2, got {n!r}")
    if n == 2:
        cycles = [[0, 1]]
    elif n % 2 == 1:
        cycles = _walecki_odd(n)
    elif n % 4 == 0 and n >= 8:
        try:
            cycles = _full_mod4(n)
            verify_cycles(cycles, n)
        except ValueError:
            # The construction is verified for every n % 4 == 0 we test (8..64 in the tests,
            # more offline), but it is not proven here: should it ever fail, give the valid
            # n-2 cycles rather than invalid ones or an error that would stop TASP.
            cycles = _walecki_even(n)
    else:
        cycles = _walecki_even(n)
    verify_cycles(cycles, n)
    return tuple(tuple(c) for c in cycles)


def _zigzag(p: int) -> list[int]:
    """[0, 1, -1, 2, -2, ...] mod p, p terms.

    Its consecutive differences are +1, -2, +3, -4, ..., +-(p-1). For even p these are all
    non-zero residues mod p, once each, so the p translates (zigzag + i) are arc-disjoint
    directed Hamiltonian paths of K_p*; as undirected paths, translates i and i + p/2 coincide
    (one is the other reversed) and i = 0..p/2-1 decompose the undirected K_p.
    """
    terms = [0]
    for t in range(1, p):
        terms.append((t + 1) // 2 if t % 2 else -(t // 2))
    return [x % p for x in terms]


def _walecki_odd(n: int) -> list[list[int]]:
    """n-1 directed cycles for odd n >= 3: Walecki's (n-1)/2 undirected cycles, both orientations.

    Vertex n-1 sits at the centre, 0..n-2 on a circle; undirected cycle i is the centre followed
    by the zigzag path translated by i. Each zigzag path uses one chord of every length, and the
    translates i = 0..(n-3)/2 use each chord once; the centre's edges go to the path ends i and
    i + (n-1)/2, which are all distinct.
    """
    m, centre = n - 1, n - 1
    forward = [[centre] + [(i + z) % m for z in _zigzag(m)] for i in range(m // 2)]
    return forward + [[c[0], *reversed(c[1:])] for c in forward]


def _walecki_even(n: int) -> list[list[int]]:
    """n-2 directed cycles for even n >= 4: (n-2)/2 undirected cycles, both orientations.

    Vertices Z_p (p = n-2) on a circle, A = n-2 at the centre, B = n-1 outside. Undirected cycle i
    (i = 0..p/2-1) is Walecki's cycle on Z_p + {A} (A, then the zigzag path translated by i) with
    B inserted into the path's edge of length p/2 (a diameter). The p/2 translated diameters are
    vertex-disjoint and cover Z_p, so B's edges are distinct, and the removed diameters plus the
    edge A-B are the perfect matching left unused.
    """
    p, a, b = n - 2, n - 2, n - 1
    cut = p // 2  # zigzag edge j joins terms j and j+1 and has length j+1; length p/2 is j = p/2-1
    forward = []
    for i in range(p // 2):
        path = [(i + z) % p for z in _zigzag(p)]
        forward.append([a] + path[:cut] + [b] + path[cut:])
    return forward + [[c[0], *reversed(c[1:])] for c in forward]


def _full_mod4(n: int) -> list[list[int]]:
    """n-1 directed cycles for n % 4 == 0, n >= 8 (a full decomposition; from our research notes).

    p = n-2, extra vertices A = n-2 and B = n-1. Row i = [A] + (zigzag + i mod p): the p rows
    are arc-disjoint directed Hamiltonian paths of Z_p + {A} (the translates share no Z_p arc,
    and A's arcs go to i, distinct per row). Closing each row into a cycle on n-1 vertices
    (last -> A) and rotating it left by a shift depending on i decides which arc to cut; cycle
    i = B followed by the rotated row. The shifts are chosen so that the n-2 cut arcs chain into
    one Hamiltonian path starting at A, which with B in front is the last cycle. (Left rotation,
    row[s:] + row[:s]; rotating right fails already for n = 8.)
    """
    p, a, b = n - 2, n - 2, n - 1
    k = n // 4 - 1
    special = {0: 1, k + 1: 4 * k + 2, 2 * k + 2: 3, 3 * k + 2: 4 * k}
    zigzag = _zigzag(p)
    cycles = []
    cut_arcs: dict[int, int] = {}  # tail -> head of the arc each rotation removed
    for i in range(p):
        row = [a] + [(i + z) % p for z in zigzag]
        s = special.get(i, 2 * k) % len(row)
        rotated = row[s:] + row[:s]
        if rotated[-1] in cut_arcs:
            raise ValueError(f"n={n}: row {i} cuts an arc out of {rotated[-1]}, as an earlier row did")
        cut_arcs[rotated[-1]] = rotated[0]
        cycles.append([b] + rotated)
    chain = [a]
    while len(chain) < n - 1:
        if chain[-1] not in cut_arcs:
            raise ValueError(f"n={n}: the cut arcs do not chain from A into a Hamiltonian path")
        chain.append(cut_arcs.pop(chain[-1]))
    cycles.append([b] + chain)
    return cycles


def _check_cycle(cycle: Sequence[int], n: int, idx: int) -> None:
    """Raise ValueError unless `cycle` (number idx) visits each of 0..n-1 exactly once."""
    seen = set()
    for v in cycle:
        if not isinstance(v, int) or not 0 <= v < n:
            raise ValueError(f"cycle {idx} has vertex {v!r} outside 0..{n - 1}")
        if v in seen:
            raise ValueError(f"cycle {idx} visits vertex {v} more than once")
        seen.add(v)
    missing = [v for v in range(n) if v not in seen]
    if missing:
        raise ValueError(f"cycle {idx} misses vertices {missing} (it must visit all of 0..{n - 1})")
