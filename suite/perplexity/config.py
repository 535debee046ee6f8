"""The perplexity check's section of a sweep config (`perplexity:`; kind: perplexity), with the
rules its values must meet. suite/config/ merges it into the sweep schema and turns each problem
into a ConfigError naming the key."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

# The model's and the training loop's own defaults (one source for both).
from suite.perplexity.data import SOURCES
from suite.perplexity.model import ModelConfig as _Model
from suite.perplexity.train import PLANTED_BUGS
from suite.perplexity.train import TrainConfig as _Train


@dataclass
class DataConfig:
    """The text a perplexity check trains on, as byte tokens (suite/perplexity/data.py)."""

    source: str = "stdlib"
    """stdlib: the Python standard library's source (no download); file: `path`; hf: `hf_dataset`
    (needs the `datasets` package)."""
    path: Optional[str] = None
    hf_dataset: Optional[str] = None
    hf_split: str = "train"
    hf_text_field: str = "text"
    max_bytes: int = 2_000_000
    """Bytes of text used (train + validation)."""
    val_fraction: float = 0.1
    """The corpus's tail kept for validation."""


@dataclass
class PerplexityConfig:
    """kind: perplexity. A small LLaMA-style model (RMSNorm, RoPE, SwiGLU, GQA) trained with each
    method and with a single-device baseline from the same seed (run.seed). The sweep axes give its
    attention shape (heads, kv_heads, head_dim; model width = heads x head_dim), the training batch
    (batch, seq_len), dtype, methods and world sizes; sweep.causal must be [true] and sweep.passes
    is not used."""

    layers: int = _Model.layers
    layer_masks: list[str] = field(default_factory=lambda: ["causal"])
    """The attention mask of each layer, a pattern repeated over the layers (layer l takes entry
    l mod its length): mask names as in sweep.mask or names of the `masks:` section, e.g.
    [sliding_window:32, causal] (local and global layers alternating). Every layer masks inside each
    packed document. A causal LM allows only masks within causal (causal, sliding_window, chunked,
    shared_question) and prefix_lm (whose prefix labels are then left out of the loss)."""
    mlp_hidden: int = _Model.mlp_hidden
    """SwiGLU hidden size; 0 = LLaMA's 8/3 x width rounded up to a multiple of 32."""
    rope_theta: float = _Model.rope_theta
    sinks: bool = _Model.sinks
    """Attention sinks (gpt-oss): one learned logit per query head in every row's softmax
    denominator, in every layer. Methods without sinks (peer libraries) are skipped with the reason."""
    steps: int = _Train.steps
    lr: float = _Train.lr
    warmup_steps: int = _Train.warmup_steps
    weight_decay: float = _Train.weight_decay
    grad_clip: float = _Train.grad_clip
    eval_batches: int = _Train.eval_batches
    """Validation batches (of sweep.batch x seq_len tokens) for the final perplexity."""
    loss_rtol: float = 1e-4
    """A method passes when every step's loss is within this relative difference of the baseline's..."""
    ppl_rtol: float = 1e-3
    """...and its final perplexity within this one."""
    planted_bug: str = "none"
    """Self-test of the check: none, local_positions, local_label_shift, no_grad_sync,
    cross_document_attention (packed documents only) or sink_per_rank (with sinks only) breaks the
    sequence-parallel model on purpose; every method should then be recorded incorrect."""
    data: DataConfig = field(default_factory=DataConfig)


def mask_problems(texts: Sequence[str], named: Optional[Mapping[str, Mapping[str, Any]]]) -> Iterator[tuple[str, str]]:
    """The per-layer masks a causal language model cannot train with: ones that let a token see a
    later token it is asked to predict (symmetric windows, full, block_causal, global_window)."""
    from methods.masks import FAMILIES, parse

    # the registry's families that lie inside the causal mask with their example parameters
    inside = [name for name, f in FAMILIES.items() if any(parse(e).causal for e in f.examples)]

    if not texts:
        yield "perplexity.layer_masks", "give at least one mask (the default is [causal])"
    for i, text in enumerate(texts):
        key = f"perplexity.layer_masks[{i}]"
        try:
            m = parse(text, named)
        except ValueError as exc:
            yield key, str(exc)
            continue
        if m.causal or m.family == "prefix_lm":  # prefix_lm: its prefix labels leave the loss
            continue
        hint = (
            "a full (bidirectional) layer; a causal LM's global layer is `causal`"
            if m.family == "full"
            else f"{m.short} lets a token see later tokens, among them the one it predicts"
        )
        yield (
            key,
            f"{text!r} does not fit a causal language model: {hint}. Use a family inside the causal mask "
            f"({', '.join(inside)}), or prefix_lm (its prefix labels are left out of the loss)",
        )


def problems(
    p: PerplexityConfig,
    causal: list[bool],
    mask: Sequence[str] = (),
    named: Optional[Mapping[str, Mapping[str, Any]]] = None,
) -> Iterator[tuple[str, str]]:
    """Each value of `p` (and the sweep's `causal` and `mask` axes) the check cannot run with, as
    (key, what is wrong and what to set)."""
    if list(causal) != [True]:
        yield (
            "sweep.causal",
            (f"a perplexity check trains a causal language model: set sweep.causal: [true] (got {causal})"),
        )
    if list(mask) not in ([], ["causal"]):
        yield (
            "sweep.mask",
            f"a perplexity check takes its masks per layer: set perplexity.layer_masks (e.g. "
            f"[sliding_window:32, causal]) and leave sweep.mask out (got {list(mask)})",
        )
    yield from mask_problems(list(p.layer_masks), named)
    for k in ("layers", "steps", "eval_batches"):
        if getattr(p, k) < 1:
            yield f"perplexity.{k}", "must be >= 1"
    if p.data.max_bytes < 1:
        yield "perplexity.data.max_bytes", "must be >= 1"
    for k in ("mlp_hidden", "warmup_steps", "weight_decay", "grad_clip"):
        if getattr(p, k) < 0:
            yield f"perplexity.{k}", "must be >= 0"
    for k in ("lr", "rope_theta", "loss_rtol", "ppl_rtol"):
        if not getattr(p, k) > 0:
            yield f"perplexity.{k}", "must be > 0"
    for key, value, allowed in (
        ("perplexity.planted_bug", p.planted_bug, tuple(PLANTED_BUGS)),
        ("perplexity.data.source", p.data.source, SOURCES),
    ):
        if value not in allowed:
            yield key, f"{value!r} is not allowed; choose one of {list(allowed)}"
    if not 0 < p.data.val_fraction < 1:
        yield "perplexity.data.val_fraction", "must be between 0 and 1"
    if p.data.source == "file" and not (p.data.path and Path(p.data.path).is_file()):
        yield "perplexity.data.path", f"data.source is file: give an existing text file (got {p.data.path!r})"
    if p.data.source == "hf" and not p.data.hf_dataset:
        yield "perplexity.data.hf_dataset", "data.source is hf: name a dataset"
