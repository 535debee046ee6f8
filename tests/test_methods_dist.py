"""Every own method in real processes over gloo (DistComm), against float64 on the unsharded inputs.

One process group per world size runs every case (starting processes is the expensive part).
"""

import pytest

import methods
from methods import Case
from tests.helpers import local_errors, own_methods, own_variants, problem_for, run_dist, run_method_rank, seq_len_for

pytestmark = pytest.mark.slow


def _cases(world_size):
    out = []
    for name, options in own_variants():
        for causal in (True, False):
            # 24 heads split over every world size here (so every method runs); 12/4 is GQA
            for heads, kv_heads in ((24, 24), (12, 4)):
                case = Case(
                    2,
                    seq_len_for(name, world_size, options, heads, kv_heads),
                    heads,
                    kv_heads,
                    8,
                    "float32",
                    causal,
                    world_size,
                )
                if methods.get_method(name, **options).supports(case)[0]:
                    out.append((name, options, case))
    return out


def run_cases(comm, world_size):
    """On every rank: run each case; return this rank's errors against the float64 reference
    (plain floats: tensors cannot outlive the worker through a queue) and the tolerances."""
    results = []
    for name, options, case in _cases(world_size):
        m = methods.get_method(name, **options)
        prob = problem_for(case)
        res = run_method_rank(m, case, prob, comm)
        results.append(
            (local_errors(m, case, prob, comm.rank, res), {t: prob.tolerance(t, world_size) for t in prob.ref})
        )
    return results


# Eight ranks run on virtual ranks (tests/test_methods.py, the same method code); over gloo eight
# processes on two cores took a minute of the suite's budget for no path the smaller groups miss.
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_methods_over_gloo_match_float64(world_size):
    per_rank = run_dist(world_size, run_cases, world_size)
    cases = _cases(world_size)
    ran = {name for name, _, _ in cases}
    assert ran == set(own_methods())
    for i, (name, options, case) in enumerate(cases):
        tol = per_rank[0][i][1]
        worst = {t: max(r[i][0][t] for r in per_rank) for t in tol}
        bad = {t: (worst[t], tol[t]) for t in tol if not worst[t] <= tol[t]}
        assert not bad, f"{name} {options} {case}: (error, tolerance) {bad}"
