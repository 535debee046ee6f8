"""Packed documents: which (query, key) pairs attend when a sequence holds several documents.

Long-context training packs documents of many lengths into each sequence, and a token attends only
to tokens of its own document (earlier ones, with the causal mask): the document-causal mask that
flash-attn's varlen functions express with cu_seqlens. A sequence whose length a layout cannot
divide is padded at its tail with tokens that attend nothing and that nothing attends.

`Documents` holds, for each batch element, its document lengths (they add up to the true sequence
length) and the padded length the layout needs. A block of attention between queries at global
positions qp (increasing) and keys at kp (increasing) has

    visible(b, i, j) = doc_b(qp[i]) == doc_b(kp[j]) != padding  and  (not causal or kp[j] <= qp[i]).

`Documents.block` classifies a block without materialising that [B, Sq, Sk] mask unless it must:
no visible pair (skip the block), every pair visible (run it unmasked), one document with a plain
causal offset (the kernels' fast path), or partly visible (a dense mask on CPU, one call per
document piece on CUDA). Its visible-pair count (the FLOPs the block really needs) comes from
searches over the sorted (document, position) keys, so it is cheap at any length.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterator, Optional, Sequence

import torch

from methods.masks import INF, Mask

PAD = -1  # the document id of padding tokens
EMPTY, FULL, OFFSET, BAND, PARTIAL = "empty", "full", "offset", "band", "partial"


@dataclass(frozen=True)
class Documents:
    """Document lengths per batch element, and the padded sequence length."""

    lengths: tuple[tuple[int, ...], ...]  # per batch element: document lengths in order (sum = seq_len)
    padded_len: int  # the layout's length: seq_len plus tail padding
    mask: Optional[Mask] = None
    """The mask inside each document (methods/masks.py), or None: the plain mask, causal or full
    by the `causal` flag the blocks are asked with. A plain family given here is stored as None."""
    plain_family: Optional[str] = field(default=None, init=False, compare=False, repr=False)
    """"full" or "causal" when that plain mask was given (then stored as None), so that an
    attention call can refuse a causal flag that contradicts it (`methods.base.check_mask`); not
    part of equality or hashing, and not kept by copies made from the fields."""

    def __post_init__(self):
        if self.mask is not None and self.mask.plain:
            object.__setattr__(self, "plain_family", self.mask.family)
            object.__setattr__(self, "mask", None)
        if not self.lengths:
            raise ValueError("documents: at least one batch element")
        totals = {sum(ls) for ls in self.lengths}
        if len(totals) != 1:
            raise ValueError(f"documents: every batch element must hold the same number of tokens, got {totals}")
        if any(n < 1 for ls in self.lengths for n in ls):
            raise ValueError("documents: lengths must be >= 1")
        if self.padded_len < self.seq_len:
            raise ValueError(f"documents: padded length {self.padded_len} < sequence length {self.seq_len}")
        if self.mask is not None:
            for n in sorted({n for ls in self.lengths for n in ls}):
                self.mask.slices(n)  # raises when the mask does not fit a document (a prefix too long)

    @classmethod
    def single(
        cls, batch: int, seq_len: int, padded_len: Optional[int] = None, mask: Optional[Mask] = None
    ) -> "Documents":
        """One document per sequence (uniform workload), padded to `padded_len`."""
        return cls(tuple((seq_len,) for _ in range(batch)), padded_len or seq_len, mask)

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def seq_len(self) -> int:
        return sum(self.lengths[0])

    @property
    def padding(self) -> int:
        return self.padded_len - self.seq_len

    @property
    def trivial(self) -> bool:
        """One document per sequence, no padding and a plain mask: the mask is the plain (causal or
        full) one."""
        return self.mask is None and self.padding == 0 and all(len(ls) == 1 for ls in self.lengths)

    def digest(self) -> str:
        """A short stable hash of the lengths (part of a trial's identity)."""
        blob = json.dumps([list(ls) for ls in self.lengths], separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @cached_property
    def doc_ids(self) -> torch.Tensor:
        """[B, padded_len] int64: each position's document index, PAD (-1) for padding."""
        ids = torch.full((self.batch, self.padded_len), PAD, dtype=torch.int64)
        for b, ls in enumerate(self.lengths):
            ids[b, : self.seq_len] = torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls))
        return ids

    @cached_property
    def starts(self) -> torch.Tensor:
        """[B, padded_len] int64: the position where each token's document starts (its own position
        for padding): RoPE positions restart there (position - start)."""
        st = torch.arange(self.padded_len).repeat(self.batch, 1)
        for b, ls in enumerate(self.lengths):
            offsets = torch.tensor([0] + list(ls[:-1])).cumsum(0)
            st[b, : self.seq_len] = torch.repeat_interleave(offsets, torch.tensor(ls))
        return st

    @cached_property
    def slice_table(self) -> list[torch.Tensor]:
        """Per batch element, [m, 6] int64 rows (qa, qb, ka, kb, lo, hi): the mask's slices at global
        positions (methods/masks.py), document after document. Only with a mask."""
        assert self.mask is not None
        tables = []
        for ls in self.lengths:
            rows, start = [], 0
            per_len: dict[int, list] = {}
            for n in ls:
                if n not in per_len:
                    per_len[n] = self.mask.slices(n)
                rows += [
                    (qa + start, qb + start, ka + start, kb + start, lo, hi) for qa, qb, ka, kb, lo, hi in per_len[n]
                ]
                start += n
            tables.append(torch.tensor(rows, dtype=torch.int64).reshape(-1, 6))
        return tables

    def real(self, positions: torch.Tensor) -> torch.Tensor:
        """Bool mask of the given global positions that are real tokens (not padding)."""
        return positions < self.seq_len

    # -- blocks ---------------------------------------------------------------------------------
    def block(self, q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> "BlockMask":
        """The mask of queries at global positions `q_pos` against keys at `k_pos` (both increasing)."""
        return BlockMask(self, q_pos.to("cpu", torch.int64), k_pos.to("cpu", torch.int64), causal)

    def visible_pairs(self, q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> int:
        return self.block(q_pos, k_pos, causal).pairs

    def unseen_keys(self, q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> int:
        """How many keys at `k_pos` (both increasing) no query at `q_pos` sees, summed over the
        batch: what a rank holding those queries received for nothing when it received those keys.
        Searches over sorted positions, one per (slice or document, key), as the pair count."""
        q_pos, k_pos = q_pos.to("cpu", torch.int64), k_pos.to("cpu", torch.int64)
        if len(k_pos) == 0:
            return 0
        if len(q_pos) == 0:
            return self.batch * len(k_pos)
        return sum(len(k_pos) - int(self._seen(b, q_pos, k_pos, causal).sum()) for b in range(self.batch))

    def seen_keys(self, q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> torch.Tensor:
        """[Sk] bool: the keys at `k_pos` (both increasing) that some query at `q_pos` sees in some
        batch element: what a rank holding those queries must receive, and no more."""
        q_pos, k_pos = q_pos.to("cpu", torch.int64), k_pos.to("cpu", torch.int64)
        seen = torch.zeros(len(k_pos), dtype=torch.bool)
        if len(k_pos) == 0 or len(q_pos) == 0:
            return seen
        for b in range(self.batch):
            seen |= self._seen(b, q_pos, k_pos, causal)
        return seen

    def _seen(self, b: int, q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> torch.Tensor:
        """[Sk] bool: the keys of batch element b that some query sees."""
        if self.mask is not None:
            t = self.slice_table[b]
            seen = torch.zeros(len(k_pos), dtype=torch.bool)
            if t.shape[0] == 0:
                return seen
            qa, qb, ka, kb, lo, hi = (c.contiguous() for c in t.unbind(1))
            first = torch.searchsorted(k_pos, ka)
            count = torch.searchsorted(k_pos, kb) - first
            total = int(count.sum())
            if total == 0:
                return seen
            sid = torch.repeat_interleave(torch.arange(t.shape[0]), count)
            ki = torch.arange(total) - (torch.cumsum(count, 0) - count)[sid] + first[sid]
            kp = k_pos[ki]
            # query i sees key j iff lo <= i - j <= hi, inside the slice's query rows
            q_from = torch.maximum(qa[sid], kp + lo[sid])
            q_to = torch.minimum(qb[sid], kp + hi[sid] + 1)  # exclusive
            hits = torch.searchsorted(q_pos, q_to) - torch.searchsorted(q_pos, q_from)
            seen[ki[hits > 0]] = True
            return seen
        ids = self.doc_ids[b]
        n = self.padded_len + 1
        qd, kd = ids[q_pos], ids[k_pos]
        qkey = torch.where(qd == PAD, self.padded_len, qd) * n + q_pos  # increasing along the queries
        start = kd * n + (k_pos if causal else 0)
        n_seen = torch.searchsorted(qkey, (kd + 1) * n) - torch.searchsorted(qkey, start)
        return (kd != PAD) & (n_seen > 0)


@dataclass
class BlockMask:
    """The document mask of one block, classified (see the module docstring)."""

    docs: Documents
    q_pos: torch.Tensor  # [Sq] global positions of the block's queries, increasing
    k_pos: torch.Tensor  # [Sk]
    causal: bool
    kind: str = field(init=False)
    causal_offset: Optional[int] = field(init=False, default=None)  # kind OFFSET: query i sees key j iff j <= i + c
    lower: Optional[int] = field(init=False, default=None)  # kind BAND: also j >= i + lower
    per_batch_pairs: list[int] = field(init=False)

    def __post_init__(self):
        self.per_batch_pairs = [self._pairs(b) for b in range(self.docs.batch)]
        sq, sk = len(self.q_pos), len(self.k_pos)
        if self.pairs == 0:
            self.kind = EMPTY
        elif all(p == sq * sk for p in self.per_batch_pairs):
            self.kind = FULL
        else:
            self.kind = PARTIAL
            if self.docs.mask is not None:
                band = self._single_slice_band()
                if band is not None:
                    self.causal_offset, self.lower = band
                    self.kind = OFFSET if self.lower is None else BAND
                return
            offset = self._single_document_offset()
            if offset is not None:
                self.kind, self.causal_offset = OFFSET, offset

    @property
    def pairs(self) -> int:
        """Visible (query, key) pairs, summed over the batch."""
        return sum(self.per_batch_pairs)

    # -- counting -------------------------------------------------------------------------------
    def _pairs(self, b: int) -> int:
        """Visible pairs of batch element b: for each query, the keys of its document (at or
        before it, when causal), found by binary search on sorted (document, position) keys."""
        if self.docs.mask is not None:
            return _slice_pairs(self._slices(b), self.q_pos, self.k_pos)
        ids = self.docs.doc_ids[b]
        n = self.docs.padded_len + 1
        last_doc = self.docs.padded_len  # padding sorts after every document (it is at the tail)
        qd, kd = ids[self.q_pos], ids[self.k_pos]
        kkey = torch.where(kd == PAD, last_doc, kd) * n + self.k_pos  # increasing along the keys
        first = torch.searchsorted(kkey, qd * n)
        if self.causal:
            last = torch.searchsorted(kkey, qd * n + self.q_pos, right=True)
        else:
            last = torch.searchsorted(kkey, (qd + 1) * n)
        return int(torch.where(qd != PAD, last - first, torch.zeros_like(first)).sum())

    def _single_document_offset(self) -> Optional[int]:
        """The causal offset c when every query and key is of one and the same document in every
        batch element and the positions are affine with one stride (then visible iff j <= i + c)."""
        if not self.causal:
            return None
        ids = self.docs.doc_ids
        for b in range(self.docs.batch):
            qd, kd = ids[b, self.q_pos], ids[b, self.k_pos]
            d = qd[0]
            if d == PAD or not bool((qd == d).all()) or not bool((kd == d).all()):
                return None
        return _affine_offset(self.q_pos, self.k_pos)

    # -- masks other than the plain ones: slices (methods/masks.py) ------------------------------
    def _slices(self, b: int) -> torch.Tensor:
        """Batch element b's slices that meet this block's bounding box."""
        t = self.docs.slice_table[b]
        if len(self.q_pos) == 0 or len(self.k_pos) == 0:
            return t[:0]
        q0, q1, k0, k1 = int(self.q_pos[0]), int(self.q_pos[-1]), int(self.k_pos[0]), int(self.k_pos[-1])
        hit = (t[:, 0] <= q1) & (t[:, 1] > q0) & (t[:, 2] <= k1) & (t[:, 3] > k0)
        return t[hit]

    def _single_slice_band(self) -> Optional[tuple[Optional[int], Optional[int]]]:
        """(causal offset, lower) in row indices when, in every batch element, the whole block lies
        inside one slice and both sides are evenly spaced with one stride, with the same band in
        every batch element: query row i then sees key row j iff lower <= j - i <= offset (None:
        that side never binds). None when the block needs a dense mask."""
        q0, q1, k0, k1 = int(self.q_pos[0]), int(self.q_pos[-1]), int(self.k_pos[0]), int(self.k_pos[-1])
        bands = set()
        for b in range(self.docs.batch):
            t = self._slices(b)
            inside = (t[:, 0] <= q0) & (t[:, 1] > q1) & (t[:, 2] <= k0) & (t[:, 3] > k1)
            if int(inside.sum()) != 1:
                return None
            row = t[inside][0]
            bands.add((int(row[4]), int(row[5])))
        if len(bands) != 1:
            return None
        lo, hi = bands.pop()
        return _index_band(self.q_pos, self.k_pos, lo, hi)

    # -- what the kernels run -------------------------------------------------------------------
    def dense(self, device=None, rows: slice = slice(None), cols: slice = slice(None)) -> torch.Tensor:
        """[B, Sq, Sk] bool: the visible pairs (for the kernels that take a mask); with `rows` and
        `cols` (slices of query and key rows), only that tile of it: [B, rows, cols]."""
        q_pos, k_pos = self.q_pos[rows], self.k_pos[cols]
        if self.docs.mask is not None:
            vis = torch.zeros(self.docs.batch, len(q_pos), len(k_pos), dtype=torch.bool)
            for b in range(self.docs.batch):
                for qa, qb, ka, kb, lo, hi in self._slices(b).tolist():
                    r0, r1 = _rows_in(q_pos, qa, qb)
                    c0, c1 = _rows_in(k_pos, ka, kb)
                    d = q_pos[r0:r1].unsqueeze(1) - k_pos[c0:c1].unsqueeze(0)
                    vis[b, r0:r1, c0:c1] |= (d >= lo) & (d <= hi)
            return vis.to(device) if device is not None else vis
        ids = self.docs.doc_ids
        qd, kd = ids[:, q_pos], ids[:, k_pos]  # [B, rows], [B, cols]
        vis = (qd.unsqueeze(2) == kd.unsqueeze(1)) & (qd != PAD).unsqueeze(2)
        if self.causal:
            vis &= k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
        return vis.to(device) if device is not None else vis

    @cached_property
    def key_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([Sq], [Sq]) int64: for each query row, the first key row it sees and one past the last,
        in any batch element (the hull over the batch; first >= last where the row sees no key).
        Between them a row may still skip keys (another document's, a question's gap); outside
        them it sees none: what a kernel that cuts the block into query tiles may leave out. From
        searches over sorted positions, without the [B, Sq, Sk] mask."""
        sq, sk = len(self.q_pos), len(self.k_pos)
        first = torch.full((sq,), sk, dtype=torch.int64)
        last = torch.zeros(sq, dtype=torch.int64)
        for b in range(self.docs.batch):
            f, e = self._key_bounds(b)
            seen = f < e
            first = torch.where(seen, torch.minimum(first, f), first)
            last = torch.where(seen, torch.maximum(last, e), last)
        return first, last

    def _key_bounds(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch element b's ([Sq], [Sq]) first and one-past-last key rows of each query row."""
        sq, sk = len(self.q_pos), len(self.k_pos)
        if self.docs.mask is not None:
            first = torch.full((sq,), sk, dtype=torch.int64)
            last = torch.zeros(sq, dtype=torch.int64)
            qi, c0, c1 = _slice_rows(self._slices(b), self.q_pos, self.k_pos)
            hit = c1 > c0
            first.scatter_reduce_(0, qi[hit], c0[hit], "amin")
            last.scatter_reduce_(0, qi[hit], c1[hit], "amax")
            return first, last
        # the keys of a query's document are one run of key rows (sorted by (document, position))
        ids = self.docs.doc_ids[b]
        n = self.docs.padded_len + 1
        qd, kd = ids[self.q_pos], ids[self.k_pos]
        kkey = torch.where(kd == PAD, self.docs.padded_len, kd) * n + self.k_pos
        first = torch.searchsorted(kkey, qd * n)
        if self.causal:
            last = torch.searchsorted(kkey, qd * n + self.q_pos, right=True)
        else:
            last = torch.searchsorted(kkey, (qd + 1) * n)
        return first, torch.where(qd != PAD, last, first)

    def pieces(self, b: int) -> Iterator[tuple[slice, slice, Optional[int], Optional[int]]]:
        """Batch element b's visible part as (query rows, key rows, causal offset, lower) pieces:
        query row i of a piece sees key row j iff lower <= j - i <= offset (None: that side never
        binds); one per document (per slice of the mask) and per run of evenly spaced positions on
        each side, so that a kernel that takes only a causal offset and a window (flash-attn)
        computes the block exactly, piece by piece."""
        if self.docs.mask is not None:
            yield from self._slice_pieces(b)
            return
        for rows, cols, offset in self._document_pieces(b):
            yield rows, cols, offset, None

    def _slice_pieces(self, b: int) -> Iterator[tuple[slice, slice, Optional[int], Optional[int]]]:
        for qa, qb, ka, kb, lo, hi in self._slices(b).tolist():
            qrows, krows = _rows_in(self.q_pos, qa, qb), _rows_in(self.k_pos, ka, kb)
            if qrows[0] == qrows[1] or krows[0] == krows[1]:
                continue
            for ra, rb in _affine_runs(self.q_pos, qrows):
                for ca, cb in _affine_runs(self.k_pos, krows):
                    q_run, k_run = self.q_pos[ra:rb], self.k_pos[ca:cb]
                    band = _index_band(q_run, k_run, lo, hi)
                    if band is not None:
                        offset, lower = band
                        if _band_pairs(rb - ra, cb - ca, offset, lower):
                            yield slice(ra, rb), slice(ca, cb), offset, lower
                        continue
                    # sides of different strides: one piece per query row, whose visible keys are
                    # one contiguous run of key rows
                    first = torch.searchsorted(k_run, q_run - hi)
                    last = torch.searchsorted(k_run, q_run - lo, right=True)
                    for i, (f, e) in enumerate(zip(first.tolist(), last.tolist())):
                        if e > f:
                            yield slice(ra + i, ra + i + 1), slice(ca + f, ca + e), None, None

    def _document_pieces(self, b: int) -> Iterator[tuple[slice, slice, Optional[int]]]:
        ids = self.docs.doc_ids[b]
        qd, kd = ids[self.q_pos], ids[self.k_pos]
        for d in torch.unique(qd).tolist():
            if d == PAD:
                continue
            qrows, krows = _range_of(qd, d), _range_of(kd, d)
            if qrows is None or krows is None:  # qrows never is: d is one of qd's documents
                continue
            for qa, qb in _affine_runs(self.q_pos, qrows):
                for ka, kb in _affine_runs(self.k_pos, krows):
                    q_run, k_run = self.q_pos[qa:qb], self.k_pos[ka:kb]
                    if not self.causal or int(k_run[-1]) <= int(q_run[0]):
                        yield slice(qa, qb), slice(ka, kb), None  # every pair visible
                        continue
                    if int(k_run[0]) > int(q_run[-1]):
                        continue  # no key precedes any query
                    offset = _affine_offset(q_run, k_run)
                    if offset is not None:
                        yield slice(qa, qb), slice(ka, kb), offset
                        continue
                    # sides of different strides: one piece per query row, whose visible keys are
                    # a prefix of the run
                    seen = torch.searchsorted(k_run, q_run, right=True)
                    for i, n in enumerate(seen.tolist()):
                        if n:
                            yield slice(qa + i, qa + i + 1), slice(ka, kb), n - 1


def _rows_in(pos: torch.Tensor, a: int, b: int) -> tuple[int, int]:
    """[r0, r1) of the rows whose (increasing) positions lie in [a, b)."""
    return int(torch.searchsorted(pos, a)), int(torch.searchsorted(pos, b))


def _slice_pairs(t: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> int:
    """Visible pairs of queries at q_pos against keys at k_pos under slices t ([m, 6])."""
    _, c0, c1 = _slice_rows(t, q_pos, k_pos)
    return int((c1 - c0).clamp_min(0).sum())


def _slice_rows(
    t: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every (slice of t ([m, 6]), query of its rows): the query row and the key rows [c0, c1)
    of the slice's keys inside its band (c1 <= c0: none), by binary search (a band's keys at
    increasing positions are one run of rows). Three [n] int64 tensors."""
    none = torch.zeros(0, dtype=torch.int64)
    if t.shape[0] == 0:
        return none, none, none
    qa, qb, ka, kb, lo, hi = (c.contiguous() for c in t.unbind(1))
    first = torch.searchsorted(q_pos, qa)
    count = torch.searchsorted(q_pos, qb) - first
    total = int(count.sum())
    if total == 0:
        return none, none, none
    sid = torch.repeat_interleave(torch.arange(t.shape[0]), count)
    start = torch.cumsum(count, 0) - count
    qi = torch.arange(total) - start[sid] + first[sid]
    qp = q_pos[qi]
    k_from = torch.maximum(ka[sid], qp - hi[sid])
    k_to = torch.minimum(kb[sid], qp - lo[sid] + 1)  # exclusive
    return qi, torch.searchsorted(k_pos, k_from), torch.searchsorted(k_pos, k_to)


def _index_band(
    q_pos: torch.Tensor, k_pos: torch.Tensor, lo: int, hi: int
) -> Optional[tuple[Optional[int], Optional[int]]]:
    """(offset, lower) with (lo <= q_pos[i] - k_pos[j] <= hi) == (lower <= j - i <= offset) for all
    rows, when both sides are evenly spaced with one stride (None otherwise); a side that never
    binds on these sizes is None."""
    s = _common_stride(q_pos, k_pos)
    if s is None:
        return None
    sq, sk = len(q_pos), len(k_pos)
    base = int(q_pos[0]) - int(k_pos[0])
    # q0 + s*i - (k0 + s*j) <= hi  <=>  j - i >= (base - hi) / s ;  >= lo  <=>  j - i <= (base - lo) / s
    offset = None if lo <= -INF // 2 else (base - lo) // s
    lower = None if hi >= INF // 2 else -((hi - base) // s)
    if offset is not None and offset >= sk - 1:
        offset = None
    if lower is not None and lower <= -(sq - 1):
        lower = None
    return offset, lower


def _band_pairs(sq: int, sk: int, offset: Optional[int], lower: Optional[int]) -> int:
    """Pairs (i, j), 0 <= i < sq, 0 <= j < sk, with lower <= j - i <= offset."""
    i = torch.arange(sq)
    top = torch.full_like(i, sk - 1) if offset is None else torch.clamp(i + offset, max=sk - 1)
    bottom = torch.zeros_like(i) if lower is None else torch.clamp(i + lower, min=0)
    return int((top - bottom + 1).clamp_min(0).sum())


def _range_of(ids: torch.Tensor, d: int) -> Optional[tuple[int, int]]:
    """[a, b) of the rows holding document d (contiguous: ids are nondecreasing except padding)."""
    hit = (ids == d).nonzero().flatten()
    if hit.numel() == 0:
        return None
    return int(hit[0]), int(hit[-1]) + 1


def _affine_runs(pos: torch.Tensor, rows: tuple[int, int]) -> Iterator[tuple[int, int]]:
    """Maximal runs [a, b) of rows whose positions are evenly spaced."""
    start, end = rows
    steps = (pos[start + 1 : end] - pos[start : end - 1]).tolist()  # one tensor op, then plain ints
    a = start
    while a < end:
        b = a + 1
        if b < end:
            step = steps[a - start]
            while b + 1 < end and steps[b - start] == step:
                b += 1
            b += 1
        yield a, b
        a = b


def _common_stride(q_pos: torch.Tensor, k_pos: torch.Tensor) -> Optional[int]:
    """The one stride of two evenly spaced position runs (1 when both are single), or None when a
    side is not evenly spaced or the sides' strides differ."""
    strides = {int(p[1] - p[0]) for p in (q_pos, k_pos) if len(p) > 1}
    for p in (q_pos, k_pos):
        if len(p) > 2 and not bool(((p[1:] - p[:-1]) == (p[1] - p[0])).all()):
            return None
    if len(strides) > 1:
        return None
    return strides.pop() if strides else 1


def _affine_offset(q_pos: torch.Tensor, k_pos: torch.Tensor) -> Optional[int]:
    """c with (k_pos[j] <= q_pos[i]) == (j <= i + c) for all i, j, when both sides are evenly spaced
    with one stride; None otherwise."""
    s = _common_stride(q_pos, k_pos)
    if s is None:
        return None
    # k0 + s*j <= q0 + s*i  <=>  j <= i + floor((q0 - k0) / s)
    return (int(q_pos[0]) - int(k_pos[0])) // s


def pack(lengths: Sequence[int], seq_len: int) -> tuple[int, ...]:
    """Documents laid end to end into `seq_len` tokens, the last one cut to fit."""
    out, total = [], 0
    for n in lengths:
        if total >= seq_len:
            break
        n = min(int(n), seq_len - total)
        out.append(n)
        total += n
    if total < seq_len:
        raise ValueError(f"documents of {total} tokens in all cannot fill a sequence of {seq_len}")
    return tuple(out)


class BlockMasks:
    """The document masks of one attention call's blocks.

    `positions(r)` gives the global positions of rank r's local rows (of the comm the blocks are
    computed on), so a block of rank q_rank's rows `q_rows` against rank k_rank's rows `k_rows`
    has its mask; forward and backward compute the same blocks, so masks are kept.
    """

    def __init__(self, docs: Documents, positions, causal: bool):
        self.docs, self.causal = docs, causal
        self._positions = positions
        self._pos: dict[int, torch.Tensor] = {}
        self._masks: dict[tuple, BlockMask] = {}

    def positions(self, rank: int) -> torch.Tensor:
        if rank not in self._pos:
            self._pos[rank] = self._positions(rank).to("cpu", torch.int64)
        return self._pos[rank]

    def __call__(self, q_rank: int, q_rows, k_rank: int, k_rows) -> BlockMask:
        key = (q_rank, _key(q_rows), k_rank, _key(k_rows))
        if key not in self._masks:
            self._masks[key] = self.docs.block(
                self.positions(q_rank)[q_rows], self.positions(k_rank)[k_rows], self.causal
            )
        return self._masks[key]


def _key(rows) -> tuple:
    if isinstance(rows, slice):
        return ("slice", rows.start, rows.stop, rows.step)
    return ("rows", tuple(torch.as_tensor(rows).tolist()))
