"""Memory: no method keeps more blocks in flight as the world grows (all-gather excepted).

At a fixed local length, the peak memory a rank's own tensors take during forward and
forward+backward (suite.memtrack, which sees every allocation on CPU) must be the same at 8 and 16
ranks for every method that circulates blocks, and must grow for all-gather K/V, which
materialises the whole sequence. Virtual ranks (ThreadComm) complete a send only when the peer
has taken it, as a real transport does, so no rank runs ahead piling up messages.
"""
import pytest
import torch

import methods
from methods import Case
from methods.comm import run_threads
from suite.memtrack import TensorMemoryTracker
from tests.helpers import problem_for

B, H, HKV, D = 1, 16, 16, 4

# (method, options, (smaller, larger) world size, local tokens): pairs that keep each method's
# structure (USP with a fixed Ulysses degree; TASP at sizes with full decompositions, 4 and 8
# cycles, and a local length both divide)
CASES = [("ring", {}, (8, 16), 24), ("zigzag_ring", {}, (8, 16), 24), ("stripe_ring", {}, (8, 16), 24),
         ("ulysses", {}, (8, 16), 24), ("usp", {"ulysses_degree": 2}, (8, 16), 24),
         ("allgather_kv", {}, (8, 16), 24), ("burst", {}, (8, 16), 24),
         ("burst", {"ranks_per_node": 2}, (8, 16), 24), ("tasp", {}, (5, 9), 48)]


def peaks(name, options, world_size, local):
    """Per-rank max of (forward, forward+backward) peak bytes, in units of one local K/V block."""
    case = Case(B, local * world_size, H, HKV, D, "float32", True, world_size)
    m = methods.get_method(name, **options)
    ok, why = m.supports(case)
    assert ok, why
    prob = problem_for(case)
    lay = m.layout(case)

    def rank(comm):
        q, k, v, do = (lay.shard(x, comm.rank) for x in (prob.q, prob.k, prob.v, prob.dout))
        with torch.no_grad(), TensorMemoryTracker() as fwd:
            m.attention(q, k, v, causal=True, comm=comm)
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        with TensorMemoryTracker() as both:
            torch.autograd.grad(m.attention(qg, kg, vg, causal=True, comm=comm), (qg, kg, vg), do)
        return fwd.peak_bytes, both.peak_bytes
    kv_block = 2 * B * local * HKV * D * 4
    per_rank = run_threads(world_size, rank)
    return max(f for f, _ in per_rank) / kv_block, max(b for _, b in per_rank) / kv_block


@pytest.mark.slow
@pytest.mark.parametrize("name,options,sizes,local", CASES,
                         ids=[n + "".join(f"-{k}={v}" for k, v in o.items()) for n, o, _, _ in CASES])
def test_peak_memory_does_not_grow_with_world_size(name, options, sizes, local):
    (f1, b1), (f2, b2) = (peaks(name, options, p, local) for p in sizes)
    if name == "allgather_kv":
        assert f2 > 1.8 * f1 and b2 > 1.8 * b1  # the whole sequence's K/V, by design
    else:
        assert f2 <= f1 * 1.05 and b2 <= b1 * 1.05, ((f1, b1), (f2, b2))
        # and it is a handful of blocks: the blocks in flight, accumulators, temporaries
        assert f2 < 10 and b2 < 16, (f2, b2)
