"""The float64 check of one rank's shard, computed in tiles without the global tensors
(docs/DESIGN.md section 7).

A rank holds only its shard of the inputs (`check.InputSource` draws any rows). For the rows it
holds the check needs the float64 out, lse, dq, dk, dv (and the sinks' gradient), and for the pass
rule (`check.pass_floor`, `check.tolerance`) the naive same-dtype error and the reference's
magnitude, max|ref|. They come in two steps, both by explicit products (`kernels.math_forward`,
`kernels.math_backward`, as the unsharded reference) on tiles of query rows:

1. `RowStats`, once per problem and worker process (virtual ranks of the threads executor share
   it): the float64 lse and delta = rowsum(dO * O) of every query row, the same of the naive
   same-dtype computation, the naive errors of out and lse, max|out| and max|lse|, and the
   sinks' gradient (a sum over every row). One batch element's K and V at a time, query rows in
   tiles against every key.
2. `shard`, once per problem and rank's positions (kept up to `KEEP_BYTES`): out, lse and dq of the rank's
   rows (its rows against every key, with their row statistics), dk and dv of its keys (every
   query tile against its keys, with the row statistics of 1.), float64 and naive. Their naive
   errors and magnitudes are over the rank's rows; the row's parent takes the max over ranks
   (`records.check_columns`), which is the max over the whole problem: the bound of the
   unsharded check.

Memory: the K and V of one batch element in the trial dtype, the rows' statistics
(24 bytes x B x H x S), the rank's reference rows in float64, and a tile of rows x keys scores per
KV head group (`TILE_BYTES`). Work: 1. is one forward of the whole problem in float64 and one in
the trial dtype on every worker; 2. is 1/P of a forward and backward per rank and layout. Step 1
is repeated on every rank of the process executors rather than gathered over the method's
communicator: the check stays independent of the communication it checks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

from methods import kernels, merge
from methods.documents import Documents
from suite.check import InputSource, max_abs_err, problem_inputs

TILE_BYTES = 256 * 2**20  # scores and their intermediates of one tile, per KV head group
KEEP_BYTES = 2 * 2**30  # shards' references kept for later trials (the newest always)


def _amax(x: torch.Tensor) -> float:
    """max |x| (0 for an empty tensor)."""
    return float(x.abs().max()) if x.numel() else 0.0


@dataclass
class RowStats:
    """Statistics of every query row of a problem (step 1 of the module docstring); [B, H, S]."""

    lse: torch.Tensor  # float64, the sinks folded in
    delta: torch.Tensor  # float64, rowsum(dO * O)
    naive_lse: torch.Tensor  # the naive same-dtype computation's, in its accumulator dtype
    naive_delta: torch.Tensor
    naive_err: dict[str, float] = field(default_factory=dict)  # out, lse (and dsink): over every row
    ref_max: dict[str, float] = field(default_factory=dict)
    dsink: Optional[torch.Tensor] = None  # [H] float64


@dataclass
class ShardCheck:
    """A rank's float64 reference rows (real rows in local order) and its part of the pass rule."""

    ref: dict[str, torch.Tensor]  # out, lse, (dq, dk, dv, dsink)
    naive_err: dict[str, float]  # max |naive - ref| over this rank's rows (out, lse, dsink: every row)
    ref_max: dict[str, float]  # max(1, max |ref|) over the same rows

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.ref.values())


class ProblemReference:
    """The check of one problem on one worker: the row statistics (built once, under a lock) and
    the most recent shard's reference."""

    def __init__(
        self,
        source: InputSource,
        *,
        causal: bool,
        scale: float,
        documents: Optional[Documents] = None,
        sinks: Optional[torch.Tensor] = None,
        softcap: float = 0.0,
    ):
        self.src, self.causal, self.scale, self.docs = source, causal, scale, documents
        self.sinks, self.softcap = sinks, softcap
        self.dev, self.S, self.B = source.device, source.seq_len, source.batch
        self.H, self.Hkv = source.dims["q"][0], source.dims["k"][0]
        self.group = self.H // self.Hkv
        self.cd = source.dtype  # the naive computation's dtype
        self.acc = merge.acc_dtype(self.cd)
        self._lock = threading.Lock()
        self._stats: Optional[RowStats] = None
        self._shards: dict[tuple[bytes, bool], ShardCheck] = {}  # by (positions, grads), oldest first

    # -- helpers ----------------------------------------------------------------------------------
    def _tile(self, keys: int) -> int:
        """Query rows per tile against `keys` keys: ~6 float64 [group, rows, keys] tensors alive."""
        return max(1, min(self.S, TILE_BYTES // max(1, 6 * 8 * self.group * keys)))

    def _visible(self, qp: torch.Tensor, kp: torch.Tensor, b: int) -> Optional[torch.Tensor]:
        """[1, nq, nk] bool for queries at `qp` and keys at `kp` (both increasing) of element b."""
        if self.docs is not None:
            return self.docs.block(qp, kp, self.causal).dense(self.dev)[b : b + 1]
        if self.causal:
            return (kp.view(1, -1) <= qp.view(-1, 1)).unsqueeze(0).to(self.dev)
        return None

    def _heads(self, g: int) -> slice:
        return slice(g * self.group, (g + 1) * self.group)

    def _kv_heads(self, k: torch.Tensor, v: torch.Tensor):
        """Per KV head g: its query heads, its keys and values, and those cast to float64 once
        (every row tile of the head then uses them)."""
        for g in range(self.Hkv):
            kg, vg = k[:, :, g : g + 1], v[:, :, g : g + 1]
            yield g, self._heads(g), kg, vg, kg.double(), vg.double()

    def _forward(self, q, k, v, vis, upcast: bool, hs: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """out [1, n, group, Dv] and lse [1, group, n] of query rows `q` of one KV head against
        keys `k`, `v` (query heads `hs`), with the sinks folded in: float64 (`upcast`) or naive (the
        trial dtype)."""
        if upcast:
            q, k, v = q.double(), k.double(), v.double()
        out, lse = kernels.math_forward(
            q, k, v, scale=self.scale, causal_offset=None, upcast=upcast, visible=vis, softcap=self.softcap
        )
        if self.sinks is None:
            return out, lse
        cd = torch.float64 if upcast else self.cd
        s = self.sinks[hs].to(cd).view(1, -1, 1)
        total = torch.logaddexp(lse.to(cd), s)  # the sink: one more score column, with no value
        out = out * torch.exp(lse.to(cd) - total).transpose(1, 2).unsqueeze(-1).to(out.dtype)
        return out, total.to(lse.dtype)

    def _backward(self, dout, q, k, v, lse, delta, vis, upcast: bool):
        if upcast:
            dout, q, k, v = dout.double(), q.double(), k.double(), v.double()
        return kernels.math_backward(
            dout,
            q,
            k,
            v,
            None,
            lse,
            scale=self.scale,
            causal_offset=None,
            upcast=upcast,
            delta=delta,
            visible=vis,
            softcap=self.softcap,
        )

    # -- step 1: every row's statistics -----------------------------------------------------------
    def stats(self) -> RowStats:
        with self._lock:
            if self._stats is None:
                self._stats = self._row_stats()
            return self._stats

    def _row_stats(self) -> RowStats:
        B, H, S, dev = self.B, self.H, self.S, self.dev
        lse = torch.empty(B, H, S, dtype=torch.float64, device=dev)
        delta = torch.empty_like(lse)
        naive_lse = torch.empty(B, H, S, dtype=self.acc, device=dev)  # float32 (float64 for float64 inputs)
        naive_delta = torch.empty_like(naive_lse)
        err = {"out": 0.0, "lse": 0.0}
        top = {"out": 0.0, "lse": 0.0}
        dsink = torch.zeros(H, dtype=torch.float64, device=dev)
        naive_dsink = torch.zeros(H, dtype=self.acc, device=dev)
        keys = torch.arange(S)
        tq = self._tile(S)
        for b in range(B):
            k, v = self.src.rows("k", keys, b), self.src.rows("v", keys, b)
            for _, hs, kg, vg, kg64, vg64 in self._kv_heads(k, v):
                for r0 in range(0, S, tq):
                    rows = torch.arange(r0, min(S, r0 + tq))
                    q, do = self.src.rows("q", rows, b, keep=True), self.src.rows("dout", rows, b, keep=True)
                    vis = self._visible(rows, keys, b)
                    qg, dog = q[:, :, hs], do[:, :, hs]
                    o, l = self._forward(qg, kg64, vg64, vis, upcast=True, hs=hs)
                    on, ln = self._forward(qg, kg, vg, vis, upcast=False, hs=hs)
                    d = (dog.double() * o).sum(-1).transpose(1, 2)  # [1, group, n]
                    dn = (dog * on).sum(-1).transpose(1, 2)  # in the trial dtype
                    lse[b, hs, r0 : r0 + len(rows)], delta[b, hs, r0 : r0 + len(rows)] = l[0], d[0]
                    naive_lse[b, hs, r0 : r0 + len(rows)] = ln[0].to(self.acc)
                    naive_delta[b, hs, r0 : r0 + len(rows)] = dn[0].to(self.acc)
                    err["out"] = max(err["out"], max_abs_err(on, o))
                    err["lse"] = max(err["lse"], max_abs_err(ln, l))
                    top["out"], top["lse"] = max(top["out"], _amax(o)), max(top["lse"], _amax(l))
                    if self.sinks is not None:  # d(sink) = -sum over rows of p_sink * delta
                        s = self.sinks[hs].view(1, -1, 1)
                        dsink[hs] -= (torch.exp(s.double() - l) * d).sum(dim=(0, 2))
                        p = torch.exp(s.to(self.cd) - ln.to(self.cd))
                        # per row in the trial dtype, summed in the accumulator's: no tile size in it
                        naive_dsink[hs] -= (p * dn).to(self.acc).sum(dim=(0, 2))
        self.src.forget()
        stats = RowStats(lse, delta, naive_lse, naive_delta, err, top)
        if self.sinks is not None:
            stats.dsink = dsink
            stats.naive_err["dsink"] = max_abs_err(naive_dsink, dsink)
            stats.ref_max["dsink"] = _amax(dsink)
        return stats

    # -- step 2: one rank's rows ------------------------------------------------------------------
    def shard(self, positions: torch.Tensor, grads: bool) -> ShardCheck:
        """The reference of the real rows among `positions` (a rank's, in local order; >= S:
        padding, left out) and this rank's part of the pass rule; `grads`: dq, dk, dv too."""
        positions = positions.to("cpu", torch.int64)
        key = positions.numpy().tobytes()
        with self._lock:
            for g in (True, grads):
                if (key, g) in self._shards:
                    return self._shards[(key, g)]
        check = self._shard(positions[positions < self.S], grads)
        with self._lock:
            self._shards[(key, grads)] = check
            while len(self._shards) > 1 and sum(c.nbytes for c in self._shards.values()) > KEEP_BYTES:
                self._shards.pop(next(iter(self._shards)))
        return check

    def _shard(self, own: torch.Tensor, grads: bool) -> ShardCheck:
        st = self.stats()
        B, H, S, dev, n = self.B, self.H, self.S, self.dev, len(own)
        sp, order = own.sort()  # the masks want increasing positions; results go back to `own`'s order
        back = torch.argsort(order).to(dev)
        spd = sp.to(dev)
        dv_dim = self.src.dims["v"][1]
        out = torch.empty(B, n, H, dv_dim, dtype=torch.float64, device=dev)
        lse = st.lse.index_select(2, spd)
        ref = {"out": out, "lse": lse}
        err: dict[str, float] = {"out": st.naive_err["out"], "lse": st.naive_err["lse"]}
        top: dict[str, float] = {"out": st.ref_max["out"], "lse": st.ref_max["lse"]}
        keys = torch.arange(S)
        if grads:
            dq = torch.empty(B, n, H, self.src.dims["q"][1], dtype=torch.float64, device=dev)
            dk = torch.zeros(B, n, self.Hkv, self.src.dims["k"][1], dtype=torch.float64, device=dev)
            dvv = torch.zeros(B, n, self.Hkv, dv_dim, dtype=torch.float64, device=dev)
            ndq, ndk, ndv = (
                torch.empty_like(dq),
                torch.zeros_like(dk, dtype=self.acc),
                torch.zeros_like(dvv, dtype=self.acc),
            )
        tq = self._tile(S)
        for b in range(B):
            k, v = self.src.rows("k", keys, b), self.src.rows("v", keys, b)
            # this rank's rows against every key: out, and with grads dq (float64 and naive)
            for _, hs, kg, vg, kg64, vg64 in self._kv_heads(k, v):
                for r0 in range(0, n, tq):
                    rows = sp[r0 : r0 + tq]
                    sl = slice(r0, r0 + len(rows))
                    qg = self.src.rows("q", rows, b, keep=True)[:, :, hs]
                    vis = self._visible(rows, keys, b)
                    o, _ = self._forward(qg, kg64, vg64, vis, upcast=True, hs=hs)
                    out[b, sl, hs] = o[0]
                    if grads:
                        do = self.src.rows("dout", rows, b, keep=True)
                        idx = spd[sl]
                        l, d = st.lse[b : b + 1, hs].index_select(2, idx), st.delta[b : b + 1, hs].index_select(2, idx)
                        gq, _, _ = self._backward(do[:, :, hs], qg, kg64, vg64, l, d, vis, upcast=True)
                        nl = st.naive_lse[b : b + 1, hs].index_select(2, idx)
                        nd = st.naive_delta[b : b + 1, hs].index_select(2, idx)
                        nq, _, _ = self._backward(do[:, :, hs], qg, kg, vg, nl, nd, vis, upcast=False)
                        dq[b, sl, hs], ndq[b, sl, hs] = gq[0], nq[0]
            if not grads or n == 0:
                continue
            # every query tile against this rank's keys: dk, dv (float64, and naive summed in acc)
            ko, vo = self.src.rows("k", sp, b), self.src.rows("v", sp, b)
            tk = self._tile(max(1, n))
            for g, hs, kg, vg, kg64, vg64 in self._kv_heads(ko, vo):
                for r0 in range(0, S, tk):
                    rows = torch.arange(r0, min(S, r0 + tk))
                    q, do = self.src.rows("q", rows, b, keep=True), self.src.rows("dout", rows, b, keep=True)
                    vis = self._visible(rows, sp, b)
                    sl = slice(r0, r0 + len(rows))
                    qg, dog = q[:, :, hs], do[:, :, hs]
                    l, d = st.lse[b : b + 1, hs, sl], st.delta[b : b + 1, hs, sl]
                    _, gk, gv = self._backward(dog, qg, kg64, vg64, l, d, vis, upcast=True)
                    nl, nd = st.naive_lse[b : b + 1, hs, sl], st.naive_delta[b : b + 1, hs, sl]
                    _, nk, nv = self._backward(dog, qg, kg, vg, nl, nd, vis, upcast=False)
                    dk[b, :, g : g + 1] += gk[0]
                    dvv[b, :, g : g + 1] += gv[0]
                    ndk[b, :, g : g + 1] += nk[0]
                    ndv[b, :, g : g + 1] += nv[0]
        self.src.forget()
        if grads:
            ref.update(dq=dq, dk=dk, dv=dvv)
            for name, r, nv_ in (("dq", dq, ndq), ("dk", dk, ndk.to(self.cd)), ("dv", dvv, ndv.to(self.cd))):
                err[name], top[name] = max_abs_err(nv_, r), _amax(r)
            if st.dsink is not None:
                ref["dsink"] = st.dsink
                err["dsink"], top["dsink"] = st.naive_err["dsink"], st.ref_max["dsink"]
        ref = {
            name: (t if name == "dsink" else t.index_select(2 if name == "lse" else 1, back)) for name, t in ref.items()
        }
        return ShardCheck(ref, err, {k: max(1.0, v) for k, v in top.items()})


@dataclass
class ShardedProblem:
    """What every rank of one problem shares on a worker: the inputs by rows, the sinks, and (when
    checked) the reference with its row statistics already computed."""

    source: InputSource
    sinks: Optional[torch.Tensor]
    reference: Optional[ProblemReference]


def build_sharded_problem(
    *key,
    seed: int,
    device: torch.device,
    with_reference: bool,
    documents: Optional[Documents] = None,
    sinks: bool = False,
    head_dim_v: Optional[int] = None,
    softcap: float = 0.0,
) -> ShardedProblem:
    """`check.build_problem`'s problem (the same key, arguments, inputs, sinks and seed), held by
    rows: nothing of the global size is built; with `with_reference`, the row statistics are
    computed now (the trial's preparation), each rank's shard when it asks (`ProblemReference.shard`)."""
    source, sink_logits = problem_inputs(*key, seed=seed, device=device, sinks=sinks, head_dim_v=head_dim_v)
    ref = None
    if with_reference:
        causal, head_dim = key[6], key[4]
        ref = ProblemReference(
            source,
            causal=causal,
            scale=kernels.default_scale(head_dim),
            documents=documents,
            sinks=sink_logits,
            softcap=softcap,
        )
        ref.stats()
    return ShardedProblem(source, sink_logits, ref)
