"""The perplexity workload (kind: perplexity): the model-level check of a method.

A trial trains the small model (suite/perplexity/model.py) with one method on
its world size (every rank runs `PerplexityWorkload.run_rank`), and the parent compares the per-step losses and the
final perplexity with a baseline trained on one device from the same seed with torch's SDPA (none
of the suite's attention code). The baseline is computed once per workload in the parent, stored
as its own row (method `baseline`, executor `local`), and read back on `--resume`.

`perplexity.layer_masks` gives each layer its mask (a pattern repeated over the layers): the method
is called per layer with the packed documents carrying that layer's mask, and the baseline gives
SDPA the same layer's dense mask.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
import traceback
from datetime import datetime, timezone
from typing import Any, Callable, Optional, Sequence

import torch

from methods import layouts
from methods.base import torch_dtype
from methods.comm.base import Comm
from methods.documents import Documents
from methods.masks import Mask
from methods.masks import parse as parse_mask
from suite import metrics as M
from suite.perplexity.data import Corpus, load_corpus
from suite.perplexity.model import Attend, ModelConfig, sdpa_attend
from suite.perplexity.train import TrainConfig, prefix_loss_skip, train_and_evaluate
from suite.plan import TrialSpec
from suite.records import Outcome, RankReport, RowContext, base_row, begin_row, complete, finish, timing_columns
from suite.workloads.base import RankContext, Workload, documents_identity

TRAIN = "train"  # the `pass` of a perplexity trial
BASELINE = "baseline"  # the method name of the single-device baseline row
LOCAL = "local"  # its executor: the parent process, one device


# ---------------------------------------------------------------------------------------------
# The workload: everything about the model, data and training that identifies a trial
# ---------------------------------------------------------------------------------------------
def workload_json(cfg) -> str:
    """Canonical JSON of the config's perplexity section plus the corpus's name and SHA-256 (the
    per-layer masks only when some layer is not plain causal: earlier trials keep their keys)."""
    p = cfg.perplexity
    data = dataclasses.asdict(p.data)
    corpus = _corpus(json.dumps(data, sort_keys=True))
    model = {"layers": p.layers, "mlp_hidden": p.mlp_hidden, "rope_theta": p.rope_theta}
    if p.sinks:  # only when on: earlier trials keep their keys
        model["sinks"] = True
    train = {
        k: getattr(p, k)
        for k in ("steps", "lr", "warmup_steps", "weight_decay", "grad_clip", "eval_batches", "planted_bug")
    }
    train["seed"] = cfg.run.seed
    data.update(name=corpus.name, sha256=corpus.sha256)
    ident: dict[str, Any] = {"model": model, "train": train, "data": data}
    masks = [parse_mask(text, cfg.masks).name for text in p.layer_masks]
    if any(m != "causal" for m in masks):
        ident["layer_masks"] = masks
    return json.dumps(ident, sort_keys=True, separators=(",", ":"))


def layer_masks(spec: TrialSpec, layers: int) -> list[Mask]:
    """Each layer's mask: the pattern of the trial's workload repeated over the layers."""
    pattern = json.loads(spec.workload).get("layer_masks") or ["causal"]
    return [parse_mask(pattern[i % len(pattern)]) for i in range(layers)]


def layer_documents(docs: Optional[Documents], mask: Mask, batch: int, seq_len: int) -> Optional[Documents]:
    """The documents a layer of mask `mask` attends with: `docs` (packed documents and padding, or
    None) carrying the mask; `docs` itself for the plain causal mask."""
    if mask.plain:
        return docs
    if docs is None:
        return Documents.single(batch, seq_len, mask=mask)
    return Documents(docs.lengths, docs.padded_len, mask)


def check_one_layout(method, case, layout: layouts.Layout, per_layer: Sequence[Optional[Documents]]) -> None:
    """Raise ValueError when a layer's documents (its mask) would give `method` another layout than
    the one the tokens are sharded with (a layout that follows the mask, sharding=area): one model
    needs one layout for all its layers."""
    for d in per_layer:
        if d is case.documents:
            continue
        other = method.layout(dataclasses.replace(case, documents=d))
        if any(not torch.equal(other.positions(r), layout.positions(r)) for r in range(case.world_size)):
            raise ValueError(
                f"{method.name} {method.options()}: its layout follows the mask, so the layers of "
                f"perplexity.layer_masks would need different layouts; use one mask for every layer "
                f"or a sharding that does not depend on the mask"
            )


def _loss_skip(spec: TrialSpec, masks: Sequence[Mask]):
    return prefix_loss_skip(spec.document_lengths(), spec.batch, spec.seq_len, masks)


@functools.lru_cache(maxsize=4)
def _corpus(data_json: str) -> Corpus:
    d = json.loads(data_json)
    return load_corpus(
        d["source"],
        path=d["path"],
        hf_dataset=d["hf_dataset"],
        hf_split=d["hf_split"],
        hf_text_field=d["hf_text_field"],
        max_bytes=d["max_bytes"],
        val_fraction=d["val_fraction"],
    )


def _configs(spec: TrialSpec) -> tuple[ModelConfig, TrainConfig, Corpus]:
    w = json.loads(spec.workload)
    data = {k: v for k, v in w["data"].items() if k not in ("name", "sha256")}
    corpus = _corpus(json.dumps(data, sort_keys=True))
    if corpus.sha256 != w["data"]["sha256"]:
        raise RuntimeError(
            f"this process reads a different corpus ({corpus.name}, sha256 {corpus.sha256[:12]}) "
            f"than the one planned (sha256 {w['data']['sha256'][:12]}): every rank must see "
            f"the same data (same Python version for the stdlib corpus)"
        )
    model = ModelConfig(
        heads=spec.heads, kv_heads=spec.kv_heads, head_dim=spec.head_dim, head_dim_v=spec.head_dim_v, **w["model"]
    )
    train = TrainConfig(batch=spec.batch, seq_len=spec.seq_len, **w["train"])
    return model, train, corpus


class PerplexityWorkload(Workload):
    kind = "perplexity"
    needs_autograd = True

    def __init__(self, cfg=None):
        super().__init__(cfg)
        self._baselines: Optional[Baselines] = None

    def passes(self, cfg) -> list[str]:
        return [TRAIN]

    def identity(self, cfg, *, workload: str, batch: int, seq_len: int) -> str:
        ident = json.loads(workload_json(cfg))
        packed = documents_identity(cfg, workload, batch, seq_len)
        if packed:  # documents packed into the training windows: positions restart per document
            ident.update(json.loads(packed))
        return json.dumps(ident, sort_keys=True, separators=(",", ":"))

    def supports(self, spec: TrialSpec, method) -> tuple[bool, str]:
        """A model with attention sinks needs a method that takes them (peer libraries do not)."""
        if json.loads(spec.workload)["model"].get("sinks") and not method.supports_sinks:
            return False, method.sinks_reason or f"{method.name} has no attention-sink argument"
        return True, ""

    def start(self, store, tracker, ctx: RowContext, say: Callable[[str], None] = print) -> None:
        self._baselines = Baselines(store, tracker, ctx, say)

    def before(self, spec: TrialSpec) -> None:
        assert self._baselines is not None, "start() first"
        self._baselines.get(spec)  # trained once per workload, before the first trial that needs it

    def added_rows(self) -> list[dict[str, Any]]:
        return list(self._baselines.created) if self._baselines is not None else []

    def run_rank(self, spec: TrialSpec, ctx: RankContext) -> RankReport:
        """Train and evaluate with `spec`'s method on this rank (raises on error; the caller records it)."""
        if not ctx.autograd:
            raise RuntimeError(
                "training needs autograd across ranks, which virtual ranks on one GPU cannot use "
                "(autograd runs a device's backward on one thread); use run.executor=dist"
            )
        model_cfg, train_cfg, corpus = _configs(spec)
        method = spec.build_method()
        case = spec.run_case(method)  # padded to the method's granule, with any packed documents
        layout = method.layout(case)
        docs = case.documents
        ctx.prepared()

        # the planted bug: the method is not told the documents (it attends across them)
        told = docs if train_cfg.planted_bug != "cross_document_attention" or docs is None or docs.padding else None

        masks = layer_masks(spec, model_cfg.layers)
        per_layer = [layer_documents(told, m, case.batch, case.seq_len) for m in masks]
        check_one_layout(method, case, layout, [layer_documents(docs, m, case.batch, case.seq_len) for m in masks])

        def attend(c: Optional[Comm]) -> list[Attend]:
            assert c is not None  # a trial runs on its ranks' comm
            out: list[Attend] = []
            for m, d in zip(masks, per_layer):
                extra: dict[str, Any] = {"docs": d} if d is not None else {}
                out.append(functools.partial(method.attention, causal=m.causal, comm=c, **extra))
            if train_cfg.planted_bug == "sink_per_rank" and model_cfg.sinks:
                out = [functools.partial(_sink_per_rank, a, c.world_size) for a in out]
            return out

        result = train_and_evaluate(
            model_cfg,
            train_cfg,
            corpus,
            layout=layout,
            comm=ctx.comm,
            make_attend=attend,
            dtype=torch_dtype(spec.dtype),
            device=ctx.device,
            docs=docs,
            loss_skip=_loss_skip(spec, masks),
        )
        return RankReport(
            rank=ctx.comm.rank,
            checked=True,
            kernel_used=method.kernel_used(ctx.device, torch_dtype(spec.dtype), spec.head_dim),
            losses=result.losses,
            val_loss=result.val_loss,
            samples_ms=result.step_ms,
            bytes_sent=result.attn_bytes_sent,
            bytes_recv=result.attn_bytes_recv,
        )

    def row(self, spec: TrialSpec, outcome: Outcome, ctx: RowContext, started_at: str, wall_s: float) -> dict[str, Any]:
        """One result row: ok when every step's loss and the final perplexity match the baseline."""
        assert self._baselines is not None and self.cfg is not None, "the parent's workload, started"
        baseline = self._baselines.get(spec)
        p = self.cfg.perplexity
        row, reports = begin_row(spec, outcome, ctx, started_at, wall_s)
        if reports is None:
            return row
        first = reports[0]
        assert first.val_loss is not None  # every perplexity rank reports its validation loss
        row.update(
            _result_columns(spec, [r.samples_ms for r in reports], first.losses, first.val_loss, ctx.settings.warmup)
        )
        row.update(
            {
                M.CHECKED: True,
                M.KERNEL_USED: first.kernel_used,  # bytes of one training step's attention
                M.BYTES_SENT: max((r.bytes_sent for r in reports if r.bytes_sent is not None), default=None),
                M.BYTES_RECV: max((r.bytes_recv for r in reports if r.bytes_recv is not None), default=None),
            }
        )
        if baseline[M.STATUS] != M.OK:
            row.update(
                {
                    M.STATUS: M.FAILED,
                    M.CHECKED: False,
                    M.REASON: f"no verdict: the single-device baseline failed: {baseline[M.REASON]}"[:4000],
                }
            )
            return finish(row, outcome)
        base_losses, base_ppl = baseline[M.LOSS_CURVE], baseline[M.PPL]
        worst, worst_step = 0.0, 0
        for r in reports:  # every rank logs the same global loss; check them all anyway
            for i, (a, b) in enumerate(zip(r.losses, base_losses)):
                d = abs(a - b) / abs(b) if not math.isnan(a) else math.nan
                if math.isnan(d) or d > worst:
                    worst, worst_step = d, i
                    if math.isnan(d):
                        break
        ppl_rel = row[M.PPL] / base_ppl - 1.0
        bad = []
        if not worst <= p.loss_rtol:
            bad.append(
                f"training loss differs from the single-device baseline by {worst:.3g} (relative) at step "
                f"{worst_step}; tolerance {p.loss_rtol:g}"
            )
        if not abs(ppl_rel) <= p.ppl_rtol:
            bad.append(
                f"perplexity {row[M.PPL]:.4f} vs baseline {base_ppl:.4f} ({ppl_rel:+.3g} relative); "
                f"tolerance {p.ppl_rtol:g}"
            )
        row.update(
            {
                M.PPL_BASELINE: base_ppl,
                M.PPL_REL_DIFF: ppl_rel,
                M.LOSS_MAX_REL_DIFF: worst,
                M.STATUS: M.INCORRECT if bad else M.OK,
                M.REASON: "; ".join(bad),
            }
        )
        return finish(row, outcome)


# ---------------------------------------------------------------------------------------------
# The single-device baseline (in the parent)
# ---------------------------------------------------------------------------------------------
def _sink_per_rank(attend, world_size: int, q, k, v, sinks):
    """The planted bug sink_per_rank: the method sees the sink as if every rank's partial had
    been folded with it before the merge, log(P e^s) = s + log P (one per row is right)."""
    return attend(q, k, v, sinks=sinks + math.log(world_size))


def baseline_spec(spec: TrialSpec) -> TrialSpec:
    """The baseline's identity: the trial's problem and workload on one device, torch SDPA."""
    return dataclasses.replace(
        spec,
        method=BASELINE,
        impl=f"torch {torch.__version__.split('+')[0]} sdpa",
        executor=LOCAL,
        world_size=1,
        nodes=1,
        ulysses_degree=1,
        ring_degree=1,
        kernel="sdpa",
        options="{}",
    )


def run_baseline(bspec: TrialSpec, ctx: RowContext) -> dict[str, Any]:
    """Train the baseline in this process and return its result row (status ok or failed)."""
    started = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
    row = base_row(bspec, ctx, started)
    t0 = time.perf_counter()
    try:
        model_cfg, train_cfg, corpus = _configs(bspec)
        lengths = bspec.document_lengths()
        docs = Documents(lengths, bspec.seq_len) if lengths is not None else None
        masks = layer_masks(bspec, model_cfg.layers)
        everything = torch.arange(bspec.seq_len)
        attends = []
        for m in masks:  # each layer's mask inside the documents, dense, for torch's SDPA
            d = layer_documents(docs, m, bspec.batch, bspec.seq_len)
            if d is None:
                attends.append(sdpa_attend)
                continue
            dense = d.block(everything, everything, causal=m.causal).dense(torch.device(bspec.device))
            attends.append(functools.partial(sdpa_attend, mask=dense))
        result = train_and_evaluate(
            model_cfg,
            train_cfg,
            corpus,
            layout=layouts.contiguous(bspec.seq_len, 1),
            comm=None,
            make_attend=lambda c: attends,
            dtype=torch_dtype(bspec.dtype),
            device=torch.device(bspec.device),
            docs=docs,
            loss_skip=_loss_skip(bspec, masks),
        )
    except Exception as exc:  # noqa: BLE001 - recorded; the method trials then say why they have no verdict
        row.update(
            {
                M.STATUS: M.FAILED,
                M.REASON: f"{type(exc).__name__}: {exc}"[:2000],
                M.ERROR_TRACE: traceback.format_exc(limit=30)[-8000:],
                M.DURATION_S: time.perf_counter() - t0,
            }
        )
        return complete(row)
    row.update(_result_columns(bspec, [result.step_ms], result.losses, result.val_loss, ctx.settings.warmup))
    row.update(
        {
            M.STATUS: M.OK,
            M.REASON: "",
            M.CHECKED: True,
            M.KERNEL_USED: "sdpa",
            M.PPL_BASELINE: result.perplexity,
            M.DURATION_S: time.perf_counter() - t0,
        }
    )
    return complete(row)


class Baselines:
    """Baseline rows by key: computed on first use, appended to the store and MLflow, and reused
    (also from an earlier run's rows on --resume)."""

    def __init__(self, store, tracker, ctx: RowContext, say: Callable[[str], None] = print):
        self._store, self._tracker, self._ctx, self._say = store, tracker, ctx, say
        self._rows = {r[M.KEY]: r for r in store.iter_records() if r["method"] == BASELINE and r[M.STATUS] == M.OK}
        self.created: list[dict] = []

    def get(self, spec: TrialSpec) -> dict[str, Any]:
        bspec = baseline_spec(spec)
        if bspec.key not in self._rows:
            # training it takes as long as a trial or longer, before the bar moves: say so
            self._say(f"training the single-device baseline ({bspec.label()}) ...")
            row = run_baseline(bspec, self._ctx)
            self._say(
                f"baseline {row[M.STATUS]} in {row.get(M.DURATION_S) or 0.0:.1f}s"
                + (
                    f": perplexity {row[M.PPL]:.4f}"
                    if row.get(M.PPL) is not None
                    else f": {str(row.get(M.REASON))[:200]}"
                )
            )
            self._store.append(row)
            self._tracker.log_trial(row)
            self.created.append(row)
            self._rows[bspec.key] = row
        return self._rows[bspec.key]


def _result_columns(
    spec: TrialSpec, step_ms_per_rank: list[list[float]], losses: list[float], val_loss: float, warmup: int
) -> dict[str, Any]:
    """Timing (per training step, the first `warmup` steps left out when there are more) and losses."""
    n = len(step_ms_per_rank[0])
    skip = warmup if n > warmup else 0
    cols = timing_columns([steps[skip:] for steps in step_ms_per_rank])
    cols.update(
        {
            M.TOKENS_PER_S: M.tokens_per_s(spec.batch, spec.seq_len, cols[M.TIME_MS_MEDIAN] / 1e3),
            M.LOSS_CURVE: list(losses),
            M.VAL_LOSS: val_loss,
            M.PPL: math.exp(val_loss) if not math.isnan(val_loss) else math.nan,
        }
    )
    return cols
