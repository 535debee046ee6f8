"""The advisor's question: a model's attention shape, a topology, a length (mix), a budget, a pass;
validated so that every bad input raises AdviceError naming its command-line option."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import yaml

from methods.base import Case
from methods.documents import Documents
from methods.masks import Mask, plain
from methods.masks import parse as parse_mask
from methods.ulysses_a2a import check_ulysses_heads
from suite import metrics as M
from suite.bundled import DOCUMENTS, MODELS
from suite.config import PASSES
from suite.config.schema import MAX_SEQ_LEN
from suite.lengths import Distribution, LengthsError, histogram_path
from suite.sim.compute import ComputeModel
from suite.sim.topology import Topology, TopologyError, available_topologies, load_topology

GB = 1e9


class AdviceError(ValueError):
    """Bad input, reported before anything is traced; names the command-line option."""

    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")
        self.option = option


@dataclass(frozen=True)
class ModelShape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    layers: int = 1
    hidden: int = 0
    source: str = ""
    pattern: tuple[tuple[str, int], ...] = ()
    """The attention mask of each layer, as (canonical mask name, how many layers) in order of first
    use (methods/masks.py); () when every layer has the question's mask (--mask, or causal)."""
    head_dim_v: Optional[int] = None
    """The values' head dim when it is not `head_dim` (MLA: DeepSeek-V3's q/k 192, v 128); None:
    equal. K and V then move different bytes, and the kernels run the wider dim."""

    @property
    def dims(self) -> str:
        """head_dim, or head_dim/head_dim_v when they differ (q/k then v)."""
        return f"{self.head_dim}/{self.head_dim_v}" if self.head_dim_v else f"{self.head_dim}"


def layer_pattern(d: dict, layers: int, where: str) -> tuple[tuple[str, int], ...]:
    """A model file's per-layer masks: `attention_pattern: [sliding_window:128, causal]`, a list
    repeated over the `layers` in order (the last repetition cut), or `attention_layers:
    {sliding_window:1024: 52, causal: 10}`, explicit counts adding up to `layers`."""
    pat, counts = d.get("attention_pattern"), d.get("attention_layers")
    if pat is None and counts is None:
        return ()
    if pat is not None and counts is not None:
        raise AdviceError("--model", f"{where}: give attention_pattern or attention_layers, not both")
    try:
        if pat is not None:
            if not isinstance(pat, list) or not pat:
                raise ValueError("attention_pattern must be a non-empty list of masks")
            names = [parse_mask(str(m)).name for m in pat]
            tally = Counter(names[i % len(names)] for i in range(layers))
            order = list(dict.fromkeys(names))
        else:
            if not isinstance(counts, dict) or not counts:
                raise ValueError("attention_layers must map masks to layer counts")
            tally, order = Counter(), []
            for m, n in counts.items():
                name = parse_mask(str(m)).name
                if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                    raise ValueError(f"attention_layers[{m}]: a layer count >= 1, got {n!r}")
                tally[name] += n
                order.append(name)
            if sum(tally.values()) != layers:
                raise ValueError(f"attention_layers count {sum(tally.values())} layers, the model has {layers}")
    except ValueError as exc:
        raise AdviceError("--model", f"{where}: {exc}") from None
    return tuple((name, tally[name]) for name in dict.fromkeys(order) if tally[name])


def available_models() -> list[str]:
    return sorted(p.stem for p in MODELS.glob("*.yaml"))


def load_model(text: str) -> ModelShape:
    """A model by name (configs/models/<name>.yaml), a YAML file, or heads/kv_heads/head_dim."""
    m = re.fullmatch(r"(\d+)/(\d+)/(\d+)", text.strip())
    if m:
        h, kv, d = (int(x) for x in m.groups())
        shape = ModelShape(text, h, kv, d)
    else:
        path = Path(text) if text.endswith((".yaml", ".yml")) else MODELS / f"{text}.yaml"
        if not path.is_file():
            raise AdviceError(
                "--model",
                f"unknown model {text!r}: choose one of {available_models()} or give "
                f"heads/kv_heads/head_dim (e.g. 32/8/128)",
            )
        spec = yaml.safe_load(path.read_text()) or {}
        try:
            shape = ModelShape(
                str(spec.get("name", path.stem)),
                int(spec["heads"]),
                int(spec["kv_heads"]),
                int(spec["head_dim"]),
                int(spec.get("layers", 1)),
                int(spec.get("hidden", 0)),
                str(spec.get("source", "")),
            )
            hdv = spec.get("head_dim_v")  # absent or null: equal to head_dim
            hdv = None if hdv is None or int(hdv) == shape.head_dim else int(hdv)
        except (KeyError, TypeError, ValueError) as exc:
            raise AdviceError("--model", f"{path}: needs integer heads, kv_heads, head_dim ({exc})") from None
        shape = replace(shape, pattern=layer_pattern(spec, max(shape.layers, 1), str(path)), head_dim_v=hdv)
    if min(shape.heads, shape.kv_heads, shape.head_dim, shape.layers, shape.head_dim_v or 1) < 1:
        raise AdviceError("--model", f"heads, kv_heads, head_dim, head_dim_v and layers must be >= 1 in {text!r}")
    if shape.heads % shape.kv_heads:
        raise AdviceError("--model", f"heads ({shape.heads}) must be a multiple of kv_heads ({shape.kv_heads})")
    return shape


def load_workload(text: Optional[str]) -> Optional[Distribution]:
    """A document-length distribution: a histogram in configs/documents/ (by name) or a YAML file of
    bins, or `lognormal:median=M,sigma=S` / `powerlaw:alpha=A,min=N,max=N` (suite/lengths.py)."""
    if not text or text == "uniform":
        return None
    kind, _, params = text.partition(":")
    try:
        if kind in ("lognormal", "powerlaw", "fixed"):
            settings: dict[str, Any] = {"distribution": kind}
            for item in filter(None, params.split(",")):
                k, _, v = item.partition("=")
                settings[k.strip()] = [int(x) for x in v.split("+")] if k.strip() == "lengths" else float(v)
            for k in ("min", "max"):
                if k in settings:
                    settings[k] = int(settings[k])
            return Distribution.from_config(kind, settings)
        path = histogram_path(text)  # a file, or a histogram of configs/documents/ by name
        if not path.is_file():
            choices = sorted(p.stem for p in DOCUMENTS.glob("*.yaml"))
            raise AdviceError(
                "--workload",
                f"unknown length distribution {text!r}: choose uniform, one of {choices}, "
                f"a histogram YAML file, or lognormal:median=M,sigma=S",
            )
        return Distribution.from_config(path.stem, {"distribution": "histogram", "file": str(path)})
    except (LengthsError, ValueError) as exc:
        if isinstance(exc, AdviceError):
            raise
        raise AdviceError("--workload", str(exc)) from None


@dataclass
class Question:
    model: ModelShape
    topology: Topology
    topology_arg: str  # the name or file, as the sweep's sim.topology takes it
    world_size: int
    seq_len: int
    batch: int = 1
    workload: Optional[Distribution] = None
    memory_gb: Optional[float] = None
    pass_: str = "fwd_bwd"
    dtype: str = "bfloat16"
    causal: bool = True
    ulysses_degrees: Optional[list[int]] = None  # restrict the Ulysses degrees weighed
    seed: int = 0
    recompute: bool = False  # activation recomputation: other layers keep only their inputs
    mask: Optional[Mask] = None  # --mask: every layer's mask (None: the model's pattern, else causal/full)

    def layer_masks(self) -> list[tuple[Mask, int]]:
        """Each distinct attention mask of the model's layers with how many layers have it: --mask for
        all of them, else the model file's pattern, else the plain mask of `causal`."""
        if self.mask is not None:
            return [(self.mask, self.model.layers)]
        if self.model.pattern:
            return [(parse_mask(name), n) for name, n in self.model.pattern]
        return [(plain(self.causal), self.model.layers)]

    @property
    def per_layer(self) -> bool:
        """Whether the answer is the model's total over its layers (a per-layer pattern), not one call."""
        return self.mask is None and bool(self.model.pattern)

    @property
    def masks_named(self) -> bool:
        """Whether the sweep names its masks (sweep.mask) rather than the plain causal flag."""
        return self.mask is not None or bool(self.model.pattern)

    @property
    def nodes(self) -> int:
        return self.topology.nodes_for(self.world_size)

    @property
    def ranks_per_node(self) -> int:
        return min(self.world_size, self.topology.gpus_per_node)

    def case(self, mask: Optional[Mask] = None) -> Case:
        return Case(
            batch=self.batch,
            seq_len=self.seq_len,
            heads=self.model.heads,
            kv_heads=self.model.kv_heads,
            head_dim=self.model.head_dim,
            dtype=self.dtype,
            causal=self.causal if mask is None else mask.causal,
            world_size=self.world_size,
            head_dim_v=self.model.head_dim_v,
        )

    def lengths(self) -> Optional[tuple[tuple[int, ...], ...]]:
        """The packed documents' lengths per sequence (None: one document per sequence)."""
        if self.workload is None:
            return None
        return self.workload.draw(self.seq_len, self.batch, self.seed)

    def documents(self, mask: Optional[Mask] = None) -> Optional[Documents]:
        """The documents and the mask inside each (None: one plain-masked document per sequence)."""
        lengths = self.lengths()
        if lengths is None and (mask is None or mask.plain):
            return None
        return Documents(lengths or tuple((self.seq_len,) for _ in range(self.batch)), self.seq_len, mask)


def make_question(
    *,
    model: str,
    topology: str,
    nodes: Optional[int] = None,
    gpus: Optional[int] = None,
    seq_len: Optional[int] = None,
    workload: Optional[str] = None,
    memory_gb: Optional[float] = None,
    pass_: str = "fwd_bwd",
    dtype: str = "auto",
    causal: bool = True,
    batch: int = 1,
    ulysses_degree: Optional[list[int]] = None,
    recompute: bool = False,
    mask: Optional[str] = None,
) -> Question:
    """Validate a question; every problem raises AdviceError naming the option."""
    shape = load_model(model)
    try:
        topo = load_topology(topology)
    except TopologyError as exc:
        raise AdviceError(
            "--topology",
            f"unknown or unusable topology {topology!r}: choose one of "
            f"{available_topologies()} or a topology YAML file "
            f"(e.g. from `{M.suite_command()} calibrate`) ({exc})",
        ) from None
    if nodes is not None and not 1 <= nodes <= topo.max_nodes:
        raise AdviceError(
            "--nodes", f"must be between 1 and {topo.max_nodes} (the most nodes {topo.name} has), got {nodes}"
        )
    if gpus is None:
        gpus = (nodes or 1) * topo.gpus_per_node
    if gpus < 2:
        raise AdviceError("--gpus", f"sequence parallelism needs at least 2 GPUs, got {gpus}")
    if nodes is not None and topo.nodes_for(gpus) != nodes:
        raise AdviceError(
            "--gpus",
            f"{gpus} GPUs on {topo.name} ({topo.gpus_per_node} per node) fill "
            f"{topo.nodes_for(gpus)} node(s), not --nodes {nodes}",
        )
    ok, why = topo.fits(gpus)
    if not ok:
        raise AdviceError("--gpus", why)
    if seq_len is None:
        seq_len = 131072
    if not 1 <= seq_len <= MAX_SEQ_LEN:
        raise AdviceError(
            "--seq-len",
            f"must be a positive number of tokens, at most {MAX_SEQ_LEN} (2**31 - 1, as sweep.seq_len: the simulator's "
            f"arrays grow with the length), got {seq_len}",
        )
    if batch < 1:
        raise AdviceError("--batch", f"must be >= 1, got {batch}")
    if memory_gb is not None and not memory_gb > 0:
        raise AdviceError("--memory-gb", f"must be > 0, got {memory_gb}")
    if pass_ not in PASSES:
        raise AdviceError("--pass", f"{pass_!r} is not one of {list(PASSES)}")
    compute = ComputeModel(topo)
    width = max(shape.head_dim, shape.head_dim_v or 0)  # the kernels run unequal head dims padded to the wider
    if dtype == "auto":
        dtype = next((d for d in ("bfloat16", "float16", "float32") if compute.supports(d, width)[0]), "bfloat16")
    ok, why = compute.supports(dtype, width)
    if not ok:
        raise AdviceError("--dtype", why)
    for u in ulysses_degree or []:
        if u < 1 or gpus % u:
            raise AdviceError("--ulysses-degree", f"{u} does not divide the {gpus} GPUs")
        reason = check_ulysses_heads(shape.heads, shape.kv_heads, u)
        if reason:
            raise AdviceError("--ulysses-degree", f"{u} cannot split the heads of {shape.name}: {reason}")
    dist = load_workload(workload)
    mask_spec = None
    if mask:
        try:
            mask_spec = parse_mask(mask)
        except ValueError as exc:
            raise AdviceError("--mask", str(exc)) from None
        causal = mask_spec.causal
    q = Question(
        shape,
        topo,
        topology,
        gpus,
        seq_len,
        batch,
        dist,
        memory_gb,
        pass_,
        dtype,
        causal,
        list(ulysses_degree) if ulysses_degree else None,
        recompute=recompute,
        mask=mask_spec,
    )
    if dist is not None:
        try:
            q.lengths()
        except LengthsError as exc:
            raise AdviceError("--workload", str(exc)) from None
    for m, _ in q.layer_masks():
        try:
            q.documents(m)
        except ValueError as exc:  # the mask does not fit a document (a prefix longer than it)
            raise AdviceError("--mask" if q.mask is not None else "--model", str(exc)) from None
    return q
