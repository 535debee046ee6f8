"""TASP's own tensor work under the causal mask, as the tracer sees it (the simulator of docs/DESIGN.md section 10
replays these traces, so a copy hidden from it would be a speed-up the hardware never sees)."""

import pytest

from methods.base import Case
from methods.tasp import num_cycles, piece_calls
from suite.sim.ledger import Memory
from suite.sim.trace import trace


@pytest.mark.parametrize("world_size", [3, 4, 8])
def test_causal_forward_copies_nothing_but_the_split_of_its_units(world_size):
    """Per rank: the split of K and V into their units (one copy each), then one fused merge per
    kernel call (the first also starting the accumulators from the own block) and nothing else (no
    gather of a call's keys, for any batch); where no call of the last step covers every query
    row, one more pass casts the output. The count must not depend on the batch."""
    p, k = world_size, num_cycles(world_size)
    c = 2
    for batch in (1, 3):
        case = Case(
            batch=batch,
            seq_len=2 * p * k * c,
            heads=4,
            kv_heads=2,
            head_dim=8,
            dtype="bfloat16",
            causal=True,
            world_size=p,
        )
        tr = trace("tasp", case, "fwd")
        for rank, events in enumerate(tr.ranks):
            calls = [piece_calls(p, True, rank, step, c) for step in range(1, p)]
            rows = [slice(None)] + [r for step_calls in calls for r, _ in step_calls]  # every block, in order
            # the own block waits for the next: one pass starts the accumulators from both where that
            # one covers every query row (else a cast, then its merge); one op per later block; a last
            # block that does not cover every row leaves one cast of the output
            start_cast = rows[1] != slice(None) or len(rows) == 2
            want = 2 + (len(rows) - 1) + start_cast + (rows[-1] != slice(None))
            assert sum(e.ops for e in events if isinstance(e, Memory)) == want, (batch, rank)
