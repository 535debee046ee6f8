"""Accumulators of a rank's partial results: the online-softmax output of its queries and the sums of
its block gradients, each started, added to in place and finished in as few passes as possible.

- `OutputAccumulator`: (out, lse) of a rank's queries over the blocks it computes, merged by online
  softmax (methods/merge.py).
- `GradAccumulator`: a gradient (dQ, or dK/dV kept at home) summed over blocks in fp32 (float64 for
  float64 inputs), returned in the input dtype.
- `follow_add`: the accumulator of a circulating block (dK/dV on the K/V ring, BurstAttention's dQ)
  after one rank's contributions, in the dtype its next hop carries.
- `start_accumulators`, `accumulate_`, `accumulate_final`: the steps these are made of.
"""

from __future__ import annotations

from typing import Optional

import torch

from methods.merge import acc_dtype, empty_accumulators, merge_, merge_final, merge_start, sum_start


def start_accumulators(block_out: torch.Tensor, block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulators (out, lse) holding the first block's result: its output cast to the accumulator
    dtype (one pass) and its lse as it is (block results are fresh tensors)."""
    return block_out.to(acc_dtype(block_out.dtype)), block_lse


def accumulate_(acc: Optional[torch.Tensor], rows: slice, block: torch.Tensor) -> torch.Tensor:
    """acc[:, rows] += block, in place, in the accumulator dtype (fp32; float64 for float64 inputs):
    one pass. With acc None the first block starts the accumulator: a cast copy of it when it covers
    every row (`rows` is slice(None)), else zeros plus the block. Returns the accumulator."""
    if acc is None:
        if rows == slice(None):  # contiguous: accumulators travel (a kernel's gradient may be a transposed view)
            if block.dtype == acc_dtype(block.dtype) and block.is_contiguous():
                return block
            # one pass for the cast and the layout (to() then contiguous() copied a transposed bf16 view twice)
            return torch.empty(block.shape, dtype=acc_dtype(block.dtype), device=block.device).copy_(block)
        raise ValueError("accumulate_: the first block must cover every row (or start from zeros)")
    acc[:, rows].add_(block)
    return acc


def accumulate_final(acc: Optional[torch.Tensor], block: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(acc + block) in `dtype`, the sum and the cast in one pass (the last step of a gradient
    accumulation over every row); acc None: the block alone."""
    if acc is None:
        return block.to(dtype)
    return torch.add(acc, block, out=torch.empty(acc.shape, dtype=dtype, device=acc.device))


class OutputAccumulator:
    """The online-softmax result of a rank's queries q [B, L, H, D] over the blocks it computes
    (outputs [B, L, H, Dv]: `head_dim_v`, the values' head dim, None for D).

    The first block covering every row is held as the kernel returned it (input dtype) until the
    next one: two blocks start the fp32 accumulators in one pass (`merge_start`), a block that
    turns out to be the only one is the result as it is, and the last block over every row
    writes the output in q's dtype (`merge_final`)."""

    def __init__(self, q: torch.Tensor, head_dim_v: Optional[int] = None):
        self.q, self.head_dim_v = q, head_dim_v
        self.first: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (out, lse) as the kernel returned them
        self.acc: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (out fp32, lse)
        self.result: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (out in q's dtype, lse)

    def add(self, rows: slice, block_out: torch.Tensor, block_lse: torch.Tensor, last: bool) -> None:
        """Fold one block's (out [B, n, H, D], lse [B, H, n]) of query `rows`; `last`: no block follows."""
        if self.acc is None and self.first is None and rows == slice(None):
            if last:
                self.result = (block_out, block_lse)
            else:
                self.first = (block_out, block_lse)
            return
        if self.first is not None:
            (first_out, first_lse), self.first = self.first, None
            if rows == slice(None) and not last:
                self.acc = merge_start(first_out, first_lse, block_out, block_lse)
                return
            self.acc = start_accumulators(first_out, first_lse)
        if self.acc is None:
            self.acc = empty_accumulators(self.q, self.head_dim_v)
        out, lse = self.acc
        if last and rows == slice(None):
            self.result = (merge_final(out, lse, block_out, block_lse, self.q.dtype), lse)
        else:
            merge_(out[:, rows], lse[:, :, rows], block_out, block_lse)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out in q's dtype, lse)."""
        if self.result is not None:
            return self.result
        if self.first is not None:
            return self.first
        if self.acc is None:  # no block at all: no query saw a key
            self.acc = empty_accumulators(self.q, self.head_dim_v)
        out, lse = self.acc
        return out.to(self.q.dtype), lse


class GradAccumulator:
    """The sum of a rank's block gradients of one tensor shaped like `like` (e.g. dQ), in fp32
    (float64 for float64), returned in like's dtype: the first block over every row is held in the
    input dtype until the next (two blocks start the accumulator in one pass, `sum_start`), and the
    last block over every row writes the sum in the input dtype (`accumulate_final`)."""

    def __init__(self, like: torch.Tensor):
        self.like = like
        self.first: Optional[torch.Tensor] = None
        self.acc: Optional[torch.Tensor] = None
        self.result: Optional[torch.Tensor] = None

    def add(self, rows: slice, block: torch.Tensor, last: bool) -> None:
        if self.acc is None and self.first is None and rows == slice(None):
            if last:
                self.result = block
            else:
                self.first = block
            return
        if self.first is not None:
            first, self.first = self.first, None
            if rows == slice(None) and last:
                self.result = accumulate_final(first, block, self.like.dtype)
                return
            if rows == slice(None):
                self.acc = sum_start(first, block)
                return
            self.acc = accumulate_(None, slice(None), first)
        if self.acc is None:
            self.acc = torch.zeros(self.like.shape, dtype=acc_dtype(self.like.dtype), device=self.like.device)
        if last and rows == slice(None):
            self.result = accumulate_final(self.acc, block, self.like.dtype)
        else:
            accumulate_(self.acc, rows, block)

    def finish(self) -> torch.Tensor:
        if self.result is not None:
            return self.result
        if self.first is not None:
            return self.first
        if self.acc is None:  # no block at all
            return torch.zeros_like(self.like)
        return self.acc.to(self.like.dtype)


def follow_add(
    acc: Optional[torch.Tensor], contributions: list[tuple[slice, torch.Tensor]], like: torch.Tensor, *, last_hop: bool
) -> torch.Tensor:
    """The accumulator of a circulating block (dK/dV on the K/V ring, BurstAttention's dQ) after this
    rank's `contributions` [(rows, gradient)], ready for its next hop.

    It travels in the input dtype on its first hop (the owner's own gradient as the kernel produced
    it: fp32 would add no information) and on its last hop home (the owner returns the input dtype),
    in fp32 (float64 for float64) in between, so every rank sends the same bytes. acc None: the
    owner's own block, whose contributions start it (its next hop is its first, or with one rank
    the only one); `last_hop`: its next hop brings it home."""
    dtype, accd = like.dtype, acc_dtype(like.dtype)
    items = list(contributions)
    own = acc is None
    if acc is None:
        if len(items) == 1 and items[0][0] == slice(None):
            return items[0][1].contiguous()  # as the kernel produced it
        acc = torch.zeros(like.shape, dtype=accd, device=like.device)
    elif acc.dtype != accd:  # arrived from its first hop, in the input dtype
        if last_hop and len(items) == 1 and items[0][0] == slice(None):
            return accumulate_final(acc, items[0][1], dtype)
        if last_hop and not items:
            return acc
        if items and items[0][0] == slice(None):
            acc = sum_start(acc, items.pop(0)[1])
        else:
            acc = acc.to(accd)
    for i, (rows, grad) in enumerate(items):
        if last_hop and i == len(items) - 1 and rows == slice(None):
            return accumulate_final(acc, grad, dtype)
        acc = accumulate_(acc, rows, grad)
    # the owner's own block in several blocks (no plan here has that): they cover disjoint rows,
    # each in the input dtype, so the cast for the first hop is exact
    return acc.to(dtype) if (own or last_hop) and acc.dtype != dtype else acc
