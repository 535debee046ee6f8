"""Memory per GPU of one sequence-parallel attention call, estimated from what a method declares.

The advisor (suite/advise/candidates.py) prunes configurations that cannot fit a memory budget before it
traces anything, so this estimate uses only the method's declarations (docs/DESIGN.md section 4):
its Ulysses x ring degrees, its KV replication and whether it gathers the whole sequence. It
counts whole tensors, per rank, in bytes (L = local tokens, e = bytes per input element, a = per
accumulator element):

- inputs: the local q [B, L, H, D], k and v [B, L, Hkv, D] (and dout for forward+backward);
- forward working set: out and its fp32 accumulator, the LSE, one block result being merged;
  Ulysses (degree > 1): the head-scattered q, k, v (KV heads replicated up to the degree) and a
  send buffer of the largest of them; a ring (degree > 1): the block held and the next one
  arriving (double buffering), each as large as what one ring step sends by the method's own
  byte formula (`expected_bytes`: K/V for a K/V ring, queries and results where those travel);
  a method that gathers the whole sequence: the whole K/V and the all-gather's receive buffer;
- backward adds dq, dk, dv, their fp32 accumulators, and, on a ring, two of what one backward
  step sends (K/V with dK/dV accumulators, or query packets), or the whole sequence's dK/dV for a
  gathering method;
- saved per layer (forward+backward of a model): what each attention layer keeps for its backward
  (q, k, v, out, LSE, and the head-scattered copies under Ulysses).

tests/test_advise.py checks the working set against the peak that suite.memtrack measures for
every own method at a small shape (virtual ranks as threads), within a stated factor. Kernel
workspaces that never become tensors (flash-attention's tiles) are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from methods.base import Case, Method, element_bytes
from methods.ulysses_a2a import kv_replication, ulysses_bytes


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank of one attention call."""

    inputs: int  # q, k, v shards (and dout) the caller holds before the call
    working: int  # what the call itself allocates at its peak, beyond its inputs
    saved: int  # kept per layer for the backward pass (0 for forward only)

    def total(self, layers: int = 1) -> int:
        """Peak of one layer's call, plus what the other `layers - 1` layers keep for backward."""
        return self.inputs + self.working + max(0, layers - 1) * self.saved


def estimate(method: Method, case: Case, pass_: str) -> MemoryEstimate:
    """Estimated memory per rank of `method` on `case` (its `seq_len` already padded to the
    method's granule) for one call of `pass_` ("fwd" or "fwd_bwd")."""
    e, a = element_bytes(case)
    p = case.world_size
    local = case.seq_len // p
    u, r = method.degrees(case)
    rep = kv_replication(case.kv_heads, u) if u > 1 else 1
    tokens = case.batch * local
    q = tokens * case.heads * case.head_dim * e
    o = tokens * case.heads * case.dv * e  # out and dout: the values' head dim (MLA: not q's)
    kv = tokens * case.kv_heads * case.kv_dims * e // 2  # one of k, v (their mean, when their dims differ)
    lse = case.batch * case.heads * local * 4
    q_acc, o_acc, kv_acc = q // e * a, o // e * a, kv // e * a
    fwd = bwd = 0
    bwd_inputs = o if pass_ == "fwd_bwd" else 0  # dout
    fwd += o + o_acc + lse + o_acc  # out, its accumulator, LSE, one block's result
    scattered = 0
    if u > 1:
        scattered = q + 2 * kv * rep  # every token of the group for this rank's heads
        fwd += scattered + max(q, kv * rep)  # ... and the all-to-all's send buffer
    fwd_step, bwd_step = _ring_step_bytes(method, case, pass_, u, r, kv * rep, kv_acc * rep)
    if method.gathers_whole_sequence:
        fwd += 2 * 2 * kv * p  # whole K/V and the all-gather's buffer
    elif r > 1:
        fwd += 2 * fwd_step  # the block held and the next one arriving
    if pass_ == "fwd_bwd":
        bwd += q + 2 * kv + q_acc + 2 * kv_acc * rep  # dq, dk, dv and their fp32 accumulators
        if u > 1:
            bwd += scattered  # head-scattered dout, dq, dk, dv
        if method.gathers_whole_sequence:
            bwd += 2 * kv_acc * p  # the whole sequence's dK/dV
        elif r > 1:
            bwd += 2 * bwd_step  # what circulates: K/V and dK/dV, or query packets
    saved = 0
    if pass_ == "fwd_bwd":
        saved = q + 2 * kv + o + lse + scattered + (o if u > 1 else 0)
    return MemoryEstimate(inputs=q + 2 * kv + bwd_inputs, working=fwd + bwd, saved=saved)


def _ring_step_bytes(method: Method, case: Case, pass_: str, u: int, r: int, kv: int, kv_acc: int) -> tuple[int, int]:
    """(forward, backward) bytes one ring step moves per rank: the size of the block in flight.

    Read from the method's own communication formula (`expected_bytes`, less the Ulysses
    all-to-alls): the forward sends its circulating block r-1 times, the backward r times (one
    more hop brings accumulators home). So a method that circulates queries and partial results
    instead of K/V (BurstAttention's backward, TokenRing) is sized by what it really sends.
    Without a formula: a K/V block, and K/V with its dK/dV accumulators in the backward."""
    default = (2 * kv, 2 * kv + 2 * kv_acc)
    if r <= 1:
        return default
    try:
        fwd_b = method.expected_bytes(case, "fwd")
        both_b = method.expected_bytes(case, "fwd_bwd") if pass_ == "fwd_bwd" else None
    except (NotImplementedError, ValueError):
        return default
    if fwd_b is None:
        return default
    a2a = ulysses_bytes(case, u) if u > 1 else 0
    fwd_step = max(0, fwd_b[0] - a2a) // (r - 1)
    bwd_step = default[1] if both_b is None else max(0, both_b[0] - fwd_b[0] - a2a) // r
    return fwd_step, bwd_step
