"""Memory: no method keeps more blocks in flight as the world grows (all-gather excepted).

At a fixed local length, the peak memory a rank's own tensors take during forward and
forward+backward (suite.memtrack, which sees every allocation on CPU) must be the same at 6 and 12
ranks for every method that circulates blocks, and must grow for a method that materialises the
whole sequence (`gathers_whole_sequence`: all-gather K/V). 6 and 12 ranks keep each method's
structure (two-level rings of 2-rank nodes with more than two nodes, USP's fixed Ulysses degree with
an inner ring longer than two); at 4 ranks those rings have two members
and hold fewer blocks, which would hide growth. 12 heads divide both sizes for Ulysses. A method
whose blocks reach their largest sizes together only from more ranks says from how many
(`memory_steady_from`: token_ring from 7; tasp from 7, its first full Hamiltonian decomposition),
and is compared from there. Virtual ranks (ThreadComm)
complete a send only when the peer has taken it, as a real transport does, so no rank runs ahead
piling up messages; the copies it makes of messages are not the rank's tensors (`OwnTensorsOnly`).
"""

import math

import pytest
from torch.utils._python_dispatch import _disable_current_modes

import methods
from methods import Case
from methods.comm.base import WrappedComm
from tests.helpers import own_variants, peak_bytes, seq_len_for, variant_id

B, H, HKV, D = 1, 12, 12, 4

SIZES = (6, 12)


def sizes_for(name: str) -> tuple[int, int]:
    """SIZES, the smaller raised to the world size from which the method's blocks keep their sizes
    (its `memory_steady_from`: below it a smaller peak is not a sign of growth)."""
    small = max(SIZES[0], methods.method_class(name).memory_steady_from)
    assert small < SIZES[1], f"{name}: memory_steady_from {small} leaves no larger size to compare with"
    return small, SIZES[1]


def local_tokens(name: str, options: dict) -> int:
    """A local length the method's layout takes at both world sizes."""
    per_rank = [seq_len_for(name, p, options, H, HKV, factor=1) // p for p in sizes_for(name)]
    return math.lcm(*per_rank)


class OwnTensorsOnly(WrappedComm):
    """A rank's comm whose transport copies the tracker does not see. ThreadComm sends a copy of
    each message (a real transport sends from the method's buffer, which the method keeps until the
    wait), and that copy lives until the peer thread takes it: counted, it made a rank's peak depend
    on how far the other threads had got, not on what the method holds."""

    def _untracked(self, fn, *args):
        with _disable_current_modes():
            return fn(*args)

    def exchange(self, ops):
        return self._untracked(self.inner.exchange, ops)

    def all_to_all(self, output, input):
        self._untracked(self.inner.all_to_all, output, input)

    def all_gather(self, output, input):
        self._untracked(self.inner.all_gather, output, input)

    def reduce_scatter(self, output, input):
        self._untracked(self.inner.reduce_scatter, output, input)

    def all_reduce(self, tensor):
        self._untracked(self.inner.all_reduce, tensor)

    def split(self, groups):
        return OwnTensorsOnly(self.inner.split(groups))


def peaks(name, options, world_size, local):
    """Per-rank max of (forward, forward+backward) peak bytes, in units of one local K/V block."""
    case = Case(B, local * world_size, H, HKV, D, "float32", True, world_size)
    m = methods.get_method(name, **options)
    ok, why = m.supports(case)
    assert ok, why
    kv_block = 2 * B * local * HKV * D * 4
    per_rank = peak_bytes(m, case, wrap=OwnTensorsOnly)
    return max(f for f, _ in per_rank) / kv_block, max(b for _, b in per_rank) / kv_block


# dispatch's variants (stages, chunk) change how many received keys are in flight, not that a rank
# holds the keys its queries see, which grows with the world by design (the property checked for it);
# its default stands for them: each variant's peak measurement takes 30-45 s on 2 cores
MEMORY_VARIANTS = [(n, o) for n, o in own_variants() if not (n == "dispatch" and o)]


@pytest.mark.slow
@pytest.mark.parametrize("name,options", MEMORY_VARIANTS, ids=[variant_id(n, o) for n, o in MEMORY_VARIANTS])
def test_peak_memory_does_not_grow_with_world_size(name, options):
    local = local_tokens(name, options)
    m = methods.get_method(name, **options)
    sizes = sizes_for(name)
    (u1, r1), (u2, r2) = (m.degrees(Case(B, local * p, H, HKV, D, "float32", True, p)) for p in sizes)
    if (u1 == 1) != (u2 == 1) or (r1 == 1) != (r2 == 1) or (u1 != u2 and r1 != 1):
        pytest.skip(
            f"the automatic degrees ({u1}x{r1} -> {u2}x{r2}) change the algorithm between the sizes; "
            f"a fixed-degree variant is checked"
        )
    (f1, b1), (f2, b2) = (peaks(name, options, p, local) for p in sizes)
    if methods.method_class(name).gathers_whole_sequence:
        # the whole sequence's K/V (all-gather), or the keys a rank's queries see (dispatch: under the
        # causal mask most of the sequence for the ranks holding late chunks), by design; in the backward
        # the fixed part (fp32 dQ, dK, dV, the saved output) dilutes the growth
        assert f2 > 1.8 * f1 and b2 > 1.5 * b1, ((f1, b1), (f2, b2))
    else:
        assert f2 <= f1 * 1.05 and b2 <= b1 * 1.05, ((f1, b1), (f2, b2))
        # and it is a handful of blocks: the blocks in flight, accumulators, temporaries
        assert f2 < 10 and b2 < 16, (f2, b2)
