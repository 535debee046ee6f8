"""Global inputs of a trial, the float64 reference, and the pass rule (docs/DESIGN.md section 7).

Pass rule (flash-attention's test oracle, extended to P ranks): for each of out, lse, dq, dk, dv,
    max|method - ref64|  <=  2 * max|naive - ref64|  +  (4 * eps(dtype) + 4 * P * eps(acc)) * max(1, max|ref64|),
where `naive` is plain attention computed in the *same* low precision as the method (explicit
matrix products, no upcast), P is the world size, and acc is the accumulator dtype (float32, or
float64 for float64 inputs). The first term scales the tolerance with the rounding error the
dtype itself implies, instead of a hand-tuned atol. The floor keeps the bound meaningful when
the naive error happens to be tiny: a few roundings of the dtype at the output's magnitude (as
flash-attention's atol), plus one accumulator rounding per partial result a distributed method
folds in (up to one per rank: measured, correct fp32 ring-family methods at P = 4 reached 0.8-1.0
of a bound without it on dq). The P term uses the *accumulator's* eps: with bf16's, a ring that
silently dropped a whole K/V block still passed at P = 8 (tests/test_methods.py keeps that
case). For float64 inputs
the naive computation *is* the reference, so the floor alone applies, with 2 * sqrt(S) float64
roundings added (S the sequence length, the sums' length) so that it grows with the reduction as the
naive error does for the other dtypes. What bf16 checking can
catch is limited by bf16 itself: a dropped block whose weight is below the naive bf16 error (e.g.
one block of 16 at P = 16) stays invisible; float32 runs catch it.

The reference is computed in chunks of query rows, so its memory stays bounded
(chunk x S scores at a time) whatever the sequence length.

LSE at mask boundaries (`boundary_rows`, `Problem.lse_boundary_error`): the rows where a mask's
shape changes (a document's first and last rows, a window's last clipped and first full rows, a
chunk's or a block's edges, a prefix's end, the last row before tail padding) are where a method's
off-by-one hides, and a wrong row there moves the max over all rows little when the other rows'
naive error is larger. Their LSE is checked by itself, with the pass rule restricted to them:
    max|lse - ref64| over boundary rows  <=  2 * max|naive - ref64| over boundary rows
                                             + floor * max(1, max|ref64| over boundary rows),
the same floor as above (the same roundings happen on every row), `tolerance("lse_boundary", P)`.
"""

from __future__ import annotations

import hashlib
import math
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar

import torch

from methods import kernels, merge
from methods.base import torch_dtype
from methods.documents import Documents

_CHUNK_BYTES = 256 * 2**20  # score matrix budget per reference chunk


@dataclass
class Problem:
    """Global inputs of one problem and, when checked, its float64 reference (shared by every
    method and world size of the problem; `tolerance` depends on the world size)."""

    q: torch.Tensor  # [B, S, H, D] in the trial dtype
    k: torch.Tensor  # [B, S, Hkv, D]
    v: torch.Tensor  # [B, S, Hkv, Dv] (Dv = D but for MLA-like problems)
    dout: torch.Tensor  # [B, S, H, Dv]
    sinks: Optional[torch.Tensor] = None  # [H] float32 attention-sink logits, or None (no sinks)
    ref: dict[str, torch.Tensor] = field(default_factory=dict)  # out, lse, dq, dk, dv (dsink) in float64
    naive_err: dict[str, float] = field(default_factory=dict)  # max |naive same-dtype - ref|
    ref_scale: dict[str, float] = field(default_factory=dict)  # max(1, max |ref|)
    documents: Optional[Documents] = None  # the packed documents and mask the reference used
    causal: bool = True  # the causal flag the reference used
    naive_lse: Optional[torch.Tensor] = None  # [B, H, S] the naive same-dtype lse (for `lse_boundary`)
    _boundary: Optional[torch.Tensor] = None

    @property
    def boundary(self) -> torch.Tensor:
        """[B, S] bool: the rows at the mask's boundaries (`boundary_rows`), found on first use."""
        if self._boundary is None:
            b, s = self.q.shape[:2]
            self._boundary = boundary_rows(self.documents, b, s, self.causal)
        return self._boundary

    def tolerance(self, name: str, world_size: int) -> float:
        """The pass-rule bound for tensor `name` of a method running on `world_size` ranks
        ("lse_boundary": the lse on the rows at mask boundaries, module docstring)."""
        if name == "lse_boundary" and name not in self.naive_err:
            self._boundary_stats()
        floor = pass_floor(self.q.dtype, self.q.shape[1], world_size)
        return tolerance(self.naive_err[name], self.ref_scale[name], floor)

    def lse_boundary_error(self, lse: torch.Tensor) -> float:
        """max |lse - ref64| over the rows at mask boundaries (`boundary_rows`); `lse` [B, H, S] is the
        method's, unsharded, real rows only. Rows that see no key have lse -inf on both sides (a
        finite lse there is an error of inf)."""
        assert "lse" in self.ref, "built with_reference"
        return _lse_error(lse, self.ref["lse"], self.boundary)

    def _boundary_stats(self) -> None:
        assert self.naive_lse is not None, "built with_reference"
        ref = self.ref["lse"]
        self.naive_err["lse_boundary"] = _lse_error(self.naive_lse, ref, self.boundary)
        on = ref[self.boundary.unsqueeze(1).expand(ref.shape)].double()
        on = on[torch.isfinite(on)]
        self.ref_scale["lse_boundary"] = max(1.0, float(on.abs().max()) if on.numel() else 0.0)


def _lse_error(lse: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor) -> float:
    """max |lse - ref| over `rows` ([B, S] bool) of lse/ref [B, H, S], -inf equal to -inf."""
    sel = rows.unsqueeze(1).expand(ref.shape)
    got, want = lse.double()[sel], ref.double()[sel]
    if got.numel() == 0:
        return 0.0
    both_empty = torch.isneginf(got) & torch.isneginf(want)
    diff = torch.where(both_empty, torch.zeros_like(got), (got - want).abs())
    return float(diff.nan_to_num(nan=math.inf).max())


def boundary_rows(documents: Optional[Documents], batch: int, seq_len: int, causal: bool) -> torch.Tensor:
    """[B, seq_len] bool: the query rows at the mask's boundaries, read from the mask itself (so
    every family, packed documents and their combinations are covered by one rule).

    Each row i has three numbers: how many keys it sees, its first and its last visible key. Inside
    a uniform stretch (a causal run, a full window sliding, a chunk's interior) each grows by the
    same step from row to row; where the step into row i differs from the step into row i - 1, rows
    i - 2, i - 1 and i are boundary rows: a window's last clipped row, its first full one and the
    first that slides; a chunk's last rows and the next chunk's first; a prefix's last row and the
    first after it; a block's edges; a document's first and last rows. The first and last rows of
    the sequence (the last one next to the tail padding) are always in. Rows are read in chunks,
    so memory stays at a chunk x S mask."""
    docs = documents or Documents.single(batch, seq_len)
    keys = torch.arange(seq_len)
    rows_per_chunk = max(1, 2**24 // max(1, batch * seq_len))
    count, first, last = (torch.empty(batch, seq_len, dtype=torch.int64) for _ in range(3))
    for r0 in range(0, seq_len, rows_per_chunk):
        r1 = min(seq_len, r0 + rows_per_chunk)
        vis = docs.block(torch.arange(r0, r1), keys, causal).dense()  # [B, R, S]
        count[:, r0:r1] = vis.sum(-1)
        index = keys.expand_as(vis)
        first[:, r0:r1] = torch.where(vis, index, seq_len).amin(-1)
        last[:, r0:r1] = torch.where(vis, index, -1).amax(-1)
    edge = torch.zeros(batch, seq_len, dtype=torch.bool)
    for x in (count, first, last):
        step = x[:, 1:] - x[:, :-1]  # step[i - 1]: from row i - 1 to row i
        change = step[:, 1:] != step[:, :-1]  # change[i - 2]: the step into row i differs from the one before
        edge[:, 2:] |= change
        edge[:, 1:-1] |= change
        edge[:, :-2] |= change
    starts = docs.starts[:, :seq_len]
    edge |= starts == keys  # every document's first row
    edge[:, :-1] |= starts[:, 1:] == keys[1:]  # and its last
    edge[:, 0] = edge[:, -1] = True
    return edge


def pass_floor(dtype: torch.dtype, seq_len: int, world_size: int) -> float:
    """The floor of the pass rule (module docstring), per unit of the reference's magnitude."""
    eps = torch.finfo(dtype).eps
    eps_acc = torch.finfo(merge.acc_dtype(dtype)).eps
    floor = 4 * eps + 4 * max(1, world_size) * eps_acc
    if dtype == torch.float64:
        # the naive error is 0 here (the naive computation is the reference), so nothing in the
        # bound grew with the reduction length as it does for the other dtypes; a kernel's sums
        # over S keys (or queries) round like a random walk, ~sqrt(S) roundings (the CPU flash
        # kernel measured 15-30 eps at S = 40..130, D = 80, above the fixed floor)
        floor += 2 * math.sqrt(seq_len) * eps
    return floor


def tolerance(naive_err: float, ref_scale: float, floor: float) -> float:
    """2 * max|naive - ref64| + floor * max(1, max|ref64|) (`ref_scale` is the latter)."""
    return 2.0 * naive_err + floor * ref_scale


def problem_seed(seed: int, problem_key: tuple) -> int:
    """A per-problem seed, stable across processes and Python runs (no hash randomisation)."""
    return (seed * 1_000_003 + zlib.crc32(repr(problem_key).encode())) % 2**63


INPUT_NAMES = ("q", "k", "v", "dout")
INPUT_BLOCK = 1024  # tokens per independently seeded block of an input tensor


def _block_seed(seed: int, tensor: int, b: int, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{tensor}/{b}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


class InputSource:
    """The inputs q, k, v, dout of one problem, drawn by rows: any rank draws exactly the rows it
    holds, and they equal, bit for bit, the same rows of the global tensors (`full`).

    Each tensor is a sequence of blocks of INPUT_BLOCK tokens per batch element, each block drawn
    ~N(0, 1) in float32 from its own seed (the problem's seed, the tensor, the batch element, the
    block index) and cast to the dtype: a block is the same whoever draws it, and a rank holds
    at most one block beyond its shard while drawing. Rows at positions >= seq_len (a layout's
    tail padding) are zeros, as the methods expect. The reference's tiles keep a few recent blocks
    (`rows(keep=True)`), so that drawing rows tile by tile does not redraw a block per tile."""

    _KEEP = 8

    def __init__(self, batch, seq_len, heads, kv_heads, head_dim, dtype, seed, device, head_dim_v=None):
        self.batch, self.seq_len, self.seed, self.device = batch, seq_len, seed, torch.device(device)
        self.dtype = torch_dtype(dtype)
        dv = head_dim_v or head_dim
        self.dims = {"q": (heads, head_dim), "k": (kv_heads, head_dim), "v": (kv_heads, dv), "dout": (heads, dv)}
        self._recent: dict[tuple, torch.Tensor] = {}
        self._lock = threading.Lock()  # virtual ranks (threads) share one source

    def _block(self, name: str, b: int, j: int, keep: bool) -> torch.Tensor:
        key = (name, b, j)
        with self._lock:
            hit = self._recent.get(key)
        if hit is not None:
            return hit
        h, d = self.dims[name]
        gen = torch.Generator(device=self.device).manual_seed(_block_seed(self.seed, INPUT_NAMES.index(name), b, j))
        blk = torch.randn(INPUT_BLOCK, h, d, generator=gen, device=self.device)
        if not keep:
            return blk
        with self._lock:
            if len(self._recent) >= self._KEEP:
                self._recent.pop(next(iter(self._recent)))
            self._recent[key] = blk
        return blk

    def rows(self, name: str, positions: torch.Tensor, batch: Optional[int] = None, keep: bool = False) -> torch.Tensor:
        """[B, n, h, d] in the dtype (B = 1 with `batch`: that element only): the rows of tensor
        `name` at global `positions` (any order; >= seq_len: zeros). `keep`: keep the blocks drawn
        among the recent ones (for a caller that draws the same blocks tile by tile)."""
        positions = positions.to("cpu", torch.int64)
        h, d = self.dims[name]
        elements = range(self.batch) if batch is None else [batch]
        out = torch.zeros(len(elements), len(positions), h, d, device=self.device)
        real = positions < self.seq_len
        blocks = torch.div(positions, INPUT_BLOCK, rounding_mode="floor")
        for j in torch.unique(blocks[real]).tolist():
            where = (real & (blocks == j)).nonzero().flatten()
            within = (positions[where] - j * INPUT_BLOCK).to(self.device)
            where = where.to(self.device)
            for i, b in enumerate(elements):
                out[i].index_copy_(0, where, self._block(name, b, j, keep).index_select(0, within))
        return out.to(self.dtype)

    def full(self, name: str) -> torch.Tensor:
        return self.rows(name, torch.arange(self.seq_len))

    def forget(self) -> None:
        """Drop the recent blocks (`rows(keep=True)`)."""
        with self._lock:
            self._recent.clear()


def make_inputs(
    batch: int,
    seq_len: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: str,
    seed: int,
    device: torch.device,
    head_dim_v: Optional[int] = None,
) -> tuple[torch.Tensor, ...]:
    """The global q, k, v, dout of a problem (`InputSource`; ~N(0, 1) drawn in float32, cast to
    `dtype`); v and dout have the values' head dim `head_dim_v` (None: head_dim)."""
    src = InputSource(batch, seq_len, heads, kv_heads, head_dim, dtype, seed, device, head_dim_v)
    return tuple(src.full(n) for n in INPUT_NAMES)


def make_sinks(heads: int, seq_len: int, seed: int, device: torch.device) -> torch.Tensor:
    """Attention-sink logits [heads] float32, drawn per head from `seed` (a stream of its own, so
    the inputs q, k, v, dout are those of the same problem without sinks): log(seq_len) + N(0, 1).
    The sink then weighs about as much as the keys together (scores are ~N(0, 1), so a row's
    lse is near log of its keys' count): some heads dominated by it, some barely touched. A sink
    of N(0, 1) alone would be ~1/S of the denominator at long lengths, and a sink counted once per
    rank instead of once per row could hide below the low-precision error."""
    gen = torch.Generator(device=device).manual_seed((seed + 0x5171) % 2**63)
    return math.log(max(2, seq_len)) + torch.randn(heads, generator=gen, device=device)


def _sink_attention(q, k, v, sinks, dout, *, scale: float, causal_offset, visible, cd, softcap: float = 0.0):
    """Attention with sinks for one chunk of query rows by the definition, differentiated by
    autograd in dtype `cd` (not the methods' fold and flash-style backward, which it checks): the
    sink is one more score column s_h per head in the softmax, with no value.
    Returns out [B, R, H, D], lse [B, H, R] and, with `dout`, (dq, dk, dv, dsink)."""
    with torch.enable_grad():
        q, k, v, s = (x.detach().to(cd).requires_grad_(dout is not None) for x in (q, k, v, sinks))
        b, r, h, _ = q.shape
        group = h // k.shape[2]
        kh, vh = (x.repeat_interleave(group, dim=2).transpose(1, 2) for x in (k, v))  # [B, H, S, D]
        scores = torch.matmul(q.transpose(1, 2), kh.transpose(-1, -2)) * scale  # [B, H, R, S]
        if softcap:  # the keys' scores are capped, the sink's logit is not
            scores = softcap * torch.tanh(scores / softcap)
        if visible is None and causal_offset is not None:
            rows, keys = torch.arange(r, device=q.device), torch.arange(k.shape[1], device=q.device)
            visible = (keys.view(1, -1) <= rows.view(-1, 1) + causal_offset).unsqueeze(0)  # [1, R, S]
        if visible is not None:
            scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
        column = s.view(1, h, 1, 1).expand(b, h, r, 1)
        lse = torch.logsumexp(torch.cat([scores, column], dim=-1), dim=-1)  # [B, H, R]
        out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), vh).transpose(1, 2)  # [B, R, H, D]
        if dout is None:
            return out.detach(), lse.detach(), None
        grads = torch.autograd.grad(out, (q, k, v, s), dout.to(cd))
    return out.detach(), lse.detach(), grads


def reference_attention(
    q,
    k,
    v,
    dout: Optional[torch.Tensor],
    *,
    causal: bool,
    scale: float,
    upcast: bool = True,
    documents: Optional[Documents] = None,
    sinks: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
) -> dict[str, torch.Tensor]:
    """Attention (and its gradients if `dout` is given) by explicit products, in query-row chunks.

    With `upcast` the inputs are converted to float64 first (the reference); without, the
    computation runs in the inputs' dtype (the "naive same-dtype" implementation). `documents`:
    packed documents (a token sees its own document only), as a dense mask per chunk. `sinks`:
    [H] attention-sink logits, computed by their definition (`_sink_attention`). `softcap`:
    logit soft cap (0: none), scores cap * tanh(s / cap) before the mask (never the sinks').
    Returns out [B,S,H,Dv], lse [B,H,S] and, with dout, dq, dk, dv (and dsink [H] with sinks).
    """
    if sinks is not None:
        return _reference_with_sinks(
            q, k, v, dout, sinks, causal=causal, scale=scale, upcast=upcast, documents=documents, softcap=softcap
        )
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
        dout = dout.double() if dout is not None else None
    b, s, h, _ = q.shape
    rows = max(1, min(s, _CHUNK_BYTES // max(1, b * h * s * 8)))
    acc = merge.acc_dtype(q.dtype)
    out = torch.empty(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)  # [B, S, H, Dv]
    lse = torch.empty(b, h, s, dtype=acc, device=q.device)

    def visible(c0: int):
        if documents is None:
            return None
        return documents.block(torch.arange(c0, min(s, c0 + rows)), torch.arange(s), causal).dense(q.device)

    for c0 in range(0, s, rows):
        # Rows c0.. see keys j <= c0 + i: a block with causal_offset c0.
        o, l = kernels.math_forward(
            q[:, c0 : c0 + rows],
            k,
            v,
            scale=scale,
            causal_offset=c0 if causal else None,
            upcast=upcast,
            visible=visible(c0),
            softcap=softcap,
        )
        out[:, c0 : c0 + rows], lse[:, :, c0 : c0 + rows] = o, l
    result = {"out": out, "lse": lse}
    if dout is None:
        return result
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for c0 in range(0, s, rows):
        sl = slice(c0, c0 + rows)
        gq, gk, gv = kernels.math_backward(
            dout[:, sl],
            q[:, sl],
            k,
            v,
            out[:, sl],
            lse[:, :, sl],
            scale=scale,
            causal_offset=c0 if causal else None,
            upcast=upcast,
            visible=visible(c0),
            softcap=softcap,
        )
        dq[:, sl] = gq
        dk += gk
        dv += gv
    result.update(dq=dq, dk=dk.to(k.dtype), dv=dv.to(v.dtype))
    return result


def _reference_with_sinks(
    q, k, v, dout, sinks, *, causal, scale, upcast, documents, softcap: float = 0.0
) -> dict[str, torch.Tensor]:
    """`reference_attention` with sinks, in query-row chunks (as there); each chunk's gradients of
    k, v and the sinks add up, since every row's softmax is its own."""
    cd = torch.float64 if upcast else q.dtype  # the reference, or the naive same-dtype computation
    acc = torch.float64 if upcast else merge.acc_dtype(q.dtype)  # the reference's chunks add up in float64
    b, s, h, _ = q.shape
    rows = max(1, min(s, _CHUNK_BYTES // max(1, 4 * b * h * s * 8)))  # scores, probs and their grads
    outs, lses, dqs = [], [], []
    dk, dv = torch.zeros(k.shape, dtype=acc, device=q.device), torch.zeros(v.shape, dtype=acc, device=q.device)
    dsink = torch.zeros(h, dtype=acc, device=q.device)
    for c0 in range(0, s, rows):
        sl = slice(c0, c0 + rows)
        visible = None
        if documents is not None:
            visible = documents.block(torch.arange(c0, min(s, c0 + rows)), torch.arange(s), causal).dense(q.device)
        o, l, grads = _sink_attention(
            q[:, sl],
            k,
            v,
            sinks,
            None if dout is None else dout[:, sl],
            scale=scale,
            causal_offset=c0 if causal else None,
            visible=visible,
            cd=cd,
            softcap=softcap,
        )
        outs.append(o.to(q.dtype if not upcast else torch.float64))
        lses.append(l.to(acc if not upcast else torch.float64))
        if grads is not None:
            dqs.append(grads[0])
            dk += grads[1]
            dv += grads[2]
            dsink += grads[3]
    result = {"out": torch.cat(outs, dim=1), "lse": torch.cat(lses, dim=2)}
    if dout is not None:
        out_dtype = torch.float64 if upcast else q.dtype
        result.update(
            dq=torch.cat(dqs, dim=1).to(out_dtype),
            dk=dk.to(out_dtype),
            dv=dv.to(out_dtype),
            dsink=dsink.to(torch.float64 if upcast else sinks.dtype),
        )
    return result


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64 (0 for empty tensors)."""
    if a.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max())


def problem_inputs(
    batch, seq_len, heads, kv_heads, head_dim, dtype, causal, *extra, seed: int, device, sinks: bool, head_dim_v
) -> tuple[InputSource, Optional[torch.Tensor]]:
    """The inputs (by rows) and the sink logits (or None) of the problem with this key: its seed is
    `problem_seed` of the whole key, so every trial and rank of one problem draws the same numbers."""
    key = (batch, seq_len, heads, kv_heads, head_dim, dtype, causal) + tuple(extra)
    pseed = problem_seed(seed, key)
    source = InputSource(batch, seq_len, heads, kv_heads, head_dim, dtype, pseed, device, head_dim_v)
    return source, make_sinks(heads, seq_len, pseed, device) if sinks else None


def build_problem(
    batch,
    seq_len,
    heads,
    kv_heads,
    head_dim,
    dtype,
    causal,
    *extra,
    seed: int,
    device: torch.device,
    with_reference: bool,
    documents: Optional[Documents] = None,
    sinks: bool = False,
    head_dim_v: Optional[int] = None,
    softcap: float = 0.0,
) -> Problem:
    """Inputs of one problem and, with `with_reference`, the float64 reference of out, lse and the
    gradients (computed once; forward-only trials of the same problem use part of it). `documents`
    (no padding: the true length) packs the sequences; `extra` is the rest of the problem key.
    `sinks`: draw attention-sink logits per head (`make_sinks`) and check with them.
    `head_dim_v`: the values' head dim (None: head_dim); `softcap`: the logit soft cap (0: none).
    A trial's problem key (`TrialSpec.problem_key`) names them in `extra` only when set, so other
    problems keep the inputs they always had."""
    key = (batch, seq_len, heads, kv_heads, head_dim, dtype, causal) + tuple(extra)
    source, sink_logits = problem_inputs(*key, seed=seed, device=device, sinks=sinks, head_dim_v=head_dim_v)
    q, k, v, dout = (source.full(n) for n in INPUT_NAMES)
    prob = Problem(q, k, v, dout, sink_logits)
    if with_reference:
        scale = kernels.default_scale(head_dim)
        common = dict(causal=causal, scale=scale, documents=documents, sinks=prob.sinks, softcap=softcap)
        prob.ref = reference_attention(q, k, v, dout, upcast=True, **common)
        naive = reference_attention(q, k, v, dout, upcast=False, **common)
        for name, ref in prob.ref.items():
            prob.naive_err[name] = max_abs_err(naive[name], ref)
            prob.ref_scale[name] = max(1.0, float(ref.abs().max()))
        # the boundary rows and their part of the pass rule are found when first asked for
        prob.documents, prob.causal, prob.naive_lse = documents, bool(causal), naive["lse"]
    return prob


_P = TypeVar("_P")


class ProblemCache:
    """Keeps the most recent problem (inputs + reference) per worker; thread-safe, so virtual
    ranks share one. Trials are ordered so that consecutive ones share problems. A workload keeps
    what its `build` returns (a `Problem`, or its own bundle of inputs and reference)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._key = None
        self._problem: Any = None  # what `build` returned for `_key`

    def get(self, key: tuple, build: Callable[[], _P]) -> _P:
        with self._lock:
            if self._key != key:
                self._problem = None  # free the old one before building the next
                self._problem = build()
                self._key = key
            return self._problem
