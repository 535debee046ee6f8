"""`python -m suite advise`: which method and degrees for a model's attention, a cluster and a length mix.

question (model shape, topology x nodes, length, length mix, memory budget, pass)
-> candidates: every own method of the registry x the values of its options that shape the
   configuration (Ulysses degree, ranks per node of a two-level ring, sharding of packed documents)
-> pruned before anything is traced: what the method refuses for the case (degrees vs world size
   and heads, layout granules), no backward, a memory estimate over the budget (suite/sim/memory.py)
-> the survivors run as one ordinary simulated sweep (the runner with executor=sim: rows stored under
   results/, logged to MLflow, schedules traced once per shape by the trace cache)
-> ranked by predicted time, with percent of ideal (single-device time / P on the same compute
   model), memory per GPU, and the main cost read from the row's time split.

Candidates come from `methods.available()`, so a newly registered method is weighed without a change
here; only option *names* are known here (OPTION_VALUES), never method names.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import re
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

import methods
from methods.base import Case, Method, option_names
from methods.common import check_ulysses_heads
from methods.documents import Documents
from methods.masks import Mask, plain
from methods.masks import parse as parse_mask
from suite import metrics as M
from suite.bundled import DOCUMENTS, MODELS
from suite.config import PASSES, DocumentsConfig, SuiteConfig
from suite.config.schema import MAX_SEQ_LEN
from suite.lengths import Distribution, LengthsError, histogram_path
from suite.sim.compute import ComputeModel
from suite.sim.memory import MemoryEstimate, estimate
from suite.sim.record import Compute, masked_compute
from suite.sim.topology import Topology, TopologyError, available_topologies, load_topology

GB = 1e9
# a cost is "the main cost" once it takes this share of the predicted time; below it for every
# cost, the configuration is compute-bound
MAIN_COST_SHARE = 0.15


class AdviceError(ValueError):
    """Bad input, reported before anything is traced; names the command-line option."""

    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")
        self.option = option


# -- the question ------------------------------------------------------------------------------
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


# -- candidates ---------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# The values of each option that changes the configuration (not a kernel knob), by option name:
# any method that takes the option is weighed with each value. Options not named here keep the
# method's default.
OPTION_VALUES: dict[str, Callable[[Question], list[Any]]] = {
    "ulysses_degree": lambda q: q.ulysses_degrees or _divisors(q.world_size),
    "ranks_per_node": lambda q: [0] + ([q.topology.gpus_per_node] if q.nodes > 1 else []),
    "sharding": lambda q: ["sequence"] + (["documents"] if q.workload is not None else []),
    # dispatch's exchange in one stage (no overlap) or cut in 2 or 4 overlapped with the kernels
    "stages": lambda q: [1, 2, 4],
    # dispatch's chunks: 4 per rank (0, automatic), and 8 per rank where they fit (a finer balance,
    # smaller kernels)
    "chunk": lambda q: [0] + ([q.seq_len // (8 * q.world_size)] if q.seq_len % (8 * q.world_size) == 0 else []),
}


def _ranks_per_node_words(q: Question, value: int) -> str:
    # a ring route splits in two levels only when ranks span nodes (methods/kv_ring.py: make_route)
    return f"two-level ring, {value} ranks per node" if 0 < value < q.world_size else "one flat ring"


# Plain words for option values whose raw form says little to a reader ("ranks_per_node=0"), by option
# name as OPTION_VALUES; other options are shown as name=value.
OPTION_WORDS: dict[str, Callable[[Question, Any], str]] = {"ranks_per_node": _ranks_per_node_words}


def plain_name(q: Question, method: str, options: dict[str, Any]) -> str:
    """A configuration's name for people: `burst (one flat ring)`, `usp(ulysses_degree=4)`."""
    worded = [OPTION_WORDS[k](q, v) for k, v in options.items() if k in OPTION_WORDS]
    name = M.method_label(method, {k: v for k, v in options.items() if k not in OPTION_WORDS})
    return f"{name} ({', '.join(worded)})" if worded else name


@dataclass
class Candidate:
    method: str
    options: dict[str, Any]
    name: str = ""  # for people (plain_name); `label` is the identity's label
    ulysses_degree: int = 0
    ring_degree: int = 0
    layout: str = ""
    ranks_per_node: int = 0
    memory: Optional[MemoryEstimate] = None
    memory_bytes: int = 0
    pruned: str = ""  # why it was not simulated ("" = simulated)
    row: dict = field(default_factory=dict)
    """The row it is ranked by: the simulated row of its one mask, or with a per-layer pattern the
    model's total over its layers (`total_row`)."""
    rows: dict[str, dict] = field(default_factory=dict)  # per layer mask (canonical name): its simulated row
    same: list["Candidate"] = field(default_factory=list)
    """Other configurations that run this very schedule (`merge_same_schedules`): listed with it."""

    @property
    def label(self) -> str:
        return M.method_label(self.method, self.options)

    @property
    def title(self) -> str:
        """Its name, and the names of the configurations that are the same schedule: `a = b`."""
        return " = ".join([self.name or self.label] + [c.name or c.label for c in self.same])

    @property
    def options_json(self) -> str:
        return json.dumps(self.options, sort_keys=True)


def candidate_methods() -> list[str]:
    """The registry's own sequence-parallel methods (the group `own`: multi-rank, no test doubles),
    whose schedules the simulator can trace."""
    return [m for m in methods.group_members("own") if not methods.method_class(m).needs_processes]


def enumerate_candidates(q: Question) -> list[Candidate]:
    import itertools

    out = []
    for name in candidate_methods():
        opts = [o for o in option_names(methods.method_class(name)) if o in OPTION_VALUES]
        for combo in itertools.product(*(OPTION_VALUES[o](q) for o in opts)):
            options = dict(zip(opts, combo))
            out.append(Candidate(name, options, plain_name(q, name, options)))
    return out


def _run_case(q: Question, method: Method, mask: Optional[Mask] = None) -> Case:
    """The case the method runs (as `TrialSpec.run_case`): padded to its granule, with the documents
    and the mask."""
    case = q.case(mask)
    docs = q.documents(mask)
    if docs is not None:
        case = replace(case, documents=docs)
    padded = method.padded_len(case)
    if docs is None and padded == q.seq_len:
        return case
    lengths = docs.lengths if docs is not None else tuple((q.seq_len,) for _ in range(q.batch))
    return replace(case, seq_len=padded, documents=Documents(lengths, padded, docs.mask if docs else None))


def prune(q: Question, candidates: list[Candidate]) -> list[Candidate]:
    """Fill each candidate's degrees, layout and memory, and mark the ones that cannot run (or do
    not fit the budget) with the reason. Nothing is traced here. Returns the candidates kept."""
    from suite.sim.trace import one_torch_thread

    with one_torch_thread():  # the plans' index arithmetic is small: torch's pool costs more than it saves
        return _prune(q, candidates)


def _prune(q: Question, candidates: list[Candidate]) -> list[Candidate]:
    kept = []
    layer_masks = [m for m, _ in q.layer_masks()]
    for c in candidates:
        try:
            m = methods.get_method(c.method, **c.options)
            cases = [_run_case(q, m, mask) for mask in layer_masks]
            case = cases[0]
            c.ulysses_degree, c.ring_degree = m.degrees(case)
        except (TypeError, ValueError) as exc:
            c.pruned = str(exc)
            continue
        c.layout = "documents" if c.options.get("sharding") == "documents" else m.layout_kind
        c.ranks_per_node = c.options.get("ranks_per_node") or q.ranks_per_node
        ok, why = True, ""
        for mask, mcase in zip(layer_masks, cases):  # every layer's mask must run
            ok, why = m.supports(replace(mcase, device="cpu"))
            if not ok:
                why = f"{why} ({mask.short})" if len(layer_masks) > 1 else why
                break
        if ok and c.ulysses_degree > 1:  # the heads must split over the Ulysses degree, whatever the method
            why = check_ulysses_heads(q.model.heads, q.model.kv_heads, c.ulysses_degree)
            ok = not why
        if ok and q.ulysses_degrees and c.ulysses_degree > 1 and c.ulysses_degree not in q.ulysses_degrees:
            ok, why = False, f"Ulysses degree {c.ulysses_degree} not among --ulysses-degree {q.ulysses_degrees}"
        if ok and q.pass_ != "fwd":
            why = m.forward_only_reason(case) or ""
            ok = not why
        if not ok:
            c.pruned = why
            continue
        c.memory = estimate(m, case, q.pass_)
        c.memory_bytes = c.memory.inputs + c.memory.working
        if q.pass_ == "fwd_bwd" and q.model.layers > 1:
            # what every other layer keeps for its backward: its attention tensors, or with
            # activation recomputation only its input hidden states [B, L, hidden]
            hidden = q.model.hidden or q.model.heads * (q.model.head_dim_v or q.model.head_dim)
            per_layer = (
                q.batch * (case.seq_len // q.world_size) * hidden * case.torch_dtype.itemsize
                if q.recompute
                else c.memory.saved
            )
            c.memory_bytes += (q.model.layers - 1) * per_layer
        if q.memory_gb is not None and c.memory_bytes > q.memory_gb * GB:
            c.pruned = f"needs ~{c.memory_bytes / GB:.1f} GB per GPU, over --memory-gb {q.memory_gb:g}"
            continue
        kept.append(c)
    return kept


# -- the simulated sweep ------------------------------------------------------------------------
def sweep_name(q: Question) -> str:
    model = re.sub(r"[^A-Za-z0-9_.-]", "-", q.model.name)
    mask = "" if q.mask is None or q.mask.plain else "_" + re.sub(r"[^A-Za-z0-9_.-]", "-", q.mask.short)
    return f"advise_{model}{mask}_{q.topology.name}_{q.world_size}gpu"


def build_config(
    q: Question,
    kept: list[Candidate],
    *,
    executor: str = "sim",
    name: Optional[str] = None,
    results_root: str = "results",
    mlflow: bool = True,
) -> SuiteConfig:
    """One sweep holding exactly the candidates `kept`: each method's option values are axes, and
    every combination of them that is not a kept candidate is excluded (never planned)."""
    from suite.config import option_points, validate

    cfg = SuiteConfig(name=name or sweep_name(q))
    cfg.description = (
        f"suite advise: {q.model.name} ({q.model.heads}/{q.model.kv_heads}/{q.model.dims}) on "
        f"{q.world_size} x {q.topology.gpu}, {q.seq_len} tokens"
    )
    names = list(dict.fromkeys(c.method for c in kept))
    s = cfg.sweep
    s.methods, s.world_size, s.batch, s.seq_len = names, [q.world_size], [q.batch], [q.seq_len]
    s.heads, s.kv_heads, s.head_dim = [q.model.heads], [q.model.kv_heads], [q.model.head_dim]
    s.head_dim_v = [q.model.head_dim_v]
    s.dtype, s.causal, s.passes = [q.dtype], [q.causal], [q.pass_]
    if q.masks_named:  # the mask axis: each distinct layer mask once
        s.mask = [m.name for m, _ in q.layer_masks()]
    s.method_options, s.exclude = {}, []
    for m in names:
        mine = [c.options for c in kept if c.method == m]
        keys = sorted({k for o in mine for k in o})
        if not keys:
            continue
        s.method_options[m] = {k: sorted({o[k] for o in mine}, key=str) for k in keys}
        for point in option_points(s.method_options[m]):
            if point not in mine:
                s.exclude.append({"method": m, **point})
    if q.workload is not None:
        w = q.workload
        cfg.documents = {
            w.name: DocumentsConfig(distribution=w.distribution, **{k: v for k, v in w.settings.items() if k != "bins"})
        }
        s.workload = [w.name]
    cfg.run.executor = executor
    cfg.run.seed = q.seed
    cfg.sim.topology = [q.topology_arg]
    cfg.results.root = results_root
    cfg.tracking.mlflow = mlflow
    validate(cfg)
    return cfg


def _schedule_numbers(c: Candidate) -> tuple:
    """What two configurations of one schedule predict alike: degrees, memory, time, its compute-only
    and comm-only parts, bytes and collective calls."""
    r = c.row
    return (
        c.ulysses_degree,
        c.ring_degree,
        c.memory_bytes,
        r.get(M.TIME_MS_MEDIAN),
        r.get(M.COMPUTE_ONLY_MS),
        r.get(M.COMM_ONLY_MS),
        r.get(M.BYTES_SENT),
        r.get(M.BYTES_RECV),
        str(r.get(M.COMM_OPS)),
    )


def _token_map(q: Question, c: Candidate) -> str:
    """A digest of which tokens each rank holds (the method's layout of the run case, every layer mask)."""
    m = methods.get_method(c.method, **c.options)
    digest = hashlib.sha256()
    for mask, _ in q.layer_masks():
        layout = m.layout(_run_case(q, m, mask))
        for rank in range(q.world_size):
            digest.update(layout.positions(rank).numpy().tobytes())
            digest.update(b"|")
    return digest.hexdigest()


def merge_same_schedules(q: Question, ranked: list[Candidate]) -> list[Candidate]:
    """One entry per schedule. Some configurations are one schedule under two names: USP at Ulysses
    degree 1 is the zigzag ring (no all-to-all, the same zigzag pairs) and at degree P it is Ulysses
    (one ring step) - methods/usp.py. They are found, not listed: two configurations are the same
    when they place every token on the same rank and their simulated traces (which run the methods'
    own code) agree on time, its compute and communication parts, bytes, collective calls and
    memory. The entry kept is the one with the fewest options; the others go to its `same`."""
    groups: dict[tuple, list[list[Candidate]]] = {}
    entries: list[list[Candidate]] = []
    maps: dict[int, str] = {}  # id(candidate) -> its token map, built once and only when numbers agree

    def token_map(c: Candidate) -> str:
        if id(c) not in maps:
            maps[id(c)] = _token_map(q, c)
        return maps[id(c)]

    for c in ranked:
        c.same = []
        alike = groups.setdefault(_schedule_numbers(c), [])
        for entry in alike:
            if token_map(entry[0]) == token_map(c):
                entry.append(c)
                break
        else:
            alike.append([c])
            entries.append(alike[-1])
    out = []
    for entry in entries:
        first = min(entry, key=lambda c: len(c.options))  # ties keep the registry's order
        first.same = [c for c in entry if c is not first]
        out.append(first)
    return out


def ideal_ms(q: Question, mask: Optional[Mask] = None) -> float:
    """The problem on one device of the topology's compute model, divided by the GPUs (the
    percent-of-ideal convention of the reports: single-device time / P; on a host whose ranks share
    its cores, divided by the cores' worth of ranks instead). `mask`: one layer's mask (default: the
    question's only one; with a per-layer pattern, `model_ideal_ms` adds the layers)."""
    import torch

    if mask is None:
        mask = q.layer_masks()[0][0]
    compute = ComputeModel(q.topology)
    causal = mask.causal
    docs = q.documents(mask)
    causal_offset = 0 if causal else None
    t = 0.0
    for op in ("fwd",) + (("bwd",) if q.pass_ == "fwd_bwd" else ()):
        if docs is not None and docs.mask is not None:
            # the whole sequence as one block under the mask, as the single-device reference runs it:
            # its visible pairs and the pieces (slices, documents) a flash kernel calls
            pos = torch.arange(q.seq_len)
            block = docs.block(pos, pos, causal)
            h, kv, d = q.model.heads, q.model.kv_heads, q.model.head_dim
            e = masked_compute(op, q.batch, q.seq_len, q.seq_len, h, kv, d, q.dtype, block, q.model.head_dim_v)
            t += compute.time(e)
            continue
        doc_pairs = pieces = None
        if docs is not None:
            doc_pairs = sum(n * (n + 1) // 2 if causal else n * n for seq in docs.lengths for n in seq)
            # one kernel call per document, as the single-device reference runs a packed block
            count = Counter((n, n, causal_offset, None) for seq in docs.lengths for n in seq)
            pieces = tuple(sorted(count.items(), key=lambda x: x[0][0]))
        t += compute.time(
            Compute(
                op,
                q.batch,
                q.seq_len,
                q.seq_len,
                q.model.heads,
                q.model.kv_heads,
                q.model.head_dim,
                causal_offset,
                q.dtype,
                doc_pairs,
                pieces,
                q.model.head_dim_v,
            )
        )
    # ranks that share a host's cores (a calibrated CPU host) cannot compute more than the cores do
    cores = q.topology.compute.get("shared_cores")
    return t * 1e3 / (min(q.world_size, float(cores)) if cores else q.world_size)


def model_ideal_ms(q: Question) -> float:
    """Ideal for the answer's unit: one call of the question's mask, or with a per-layer pattern the
    sum over the model's layers (each distinct mask's ideal x its layer count)."""
    if not q.per_layer:
        return ideal_ms(q)
    return sum(n * ideal_ms(q, m) for m, n in q.layer_masks())


def total_row(rows: dict[str, dict], counts: dict[str, int]) -> dict:
    """A candidate's row for a per-layer model: its times added over the layers (each mask's row x its
    layer count), compute-only likewise; imbalance the ratio that loses the same compute-only time
    (sum of compute-only / sum of compute-only / imbalance); the error band the widest of the rows'."""
    rs = [(rows[name], n) for name, n in counts.items()]
    out = dict(rs[0][0])
    out[M.TIME_MS_MEDIAN] = sum(n * r[M.TIME_MS_MEDIAN] for r, n in rs)
    comps = [(r.get(M.COMPUTE_ONLY_MS), r.get(M.IMBALANCE) or 1.0, n) for r, n in rs]
    known = [(c, imb, n) for c, imb, n in comps if c is not None]
    if len(known) == len(comps):
        comp = sum(n * c for c, _, n in known)
        out[M.COMPUTE_ONLY_MS] = comp
        balanced = sum(n * c / imb for c, imb, n in known)
        out[M.IMBALANCE] = comp / balanced if balanced else 1.0
    bands = [r.get(M.SIM_ERROR_PCT) for r, _ in rs]
    out[M.SIM_ERROR_PCT] = None if any(b is None for b in bands) else max(float(b) for b in bands if b is not None)
    out["mask"] = "+".join(counts)
    return out


def main_cost(row: dict, ideal: Optional[float] = None) -> str:
    """What the predicted time is mostly spent on beyond useful compute, from a row's time split:
    exposed communication = time - compute-only time; imbalance = the compute-only time lost to the
    busiest rank (compute-only x (1 - mean/max visible pairs)); compute overhead = the balanced
    compute-only time above `ideal` (smaller blocks run below the kernel's best rate, and the
    method's own merges and copies). "compute-bound" when none takes MAIN_COST_SHARE of the time."""
    t = row.get(M.TIME_MS_MEDIAN) or 0.0
    comp = row.get(M.COMPUTE_ONLY_MS)
    if not t or comp is None:
        return "-"
    imb = row.get(M.IMBALANCE) or 1.0
    costs = {
        "exposed communication": max(0.0, t - comp) / t,
        "imbalance": comp * (1.0 - 1.0 / imb) / t if imb > 0 else 0.0,
        "compute overhead": max(0.0, comp / max(imb, 1.0) - ideal) / t if ideal else 0.0,
    }
    name, share = max(costs.items(), key=lambda kv: kv[1])
    if share < MAIN_COST_SHARE:
        return f"compute-bound ({100 * (1 - costs['exposed communication']):.0f}% compute)"
    return f"{name} ({100 * share:.0f}%)"


@dataclass
class Advice:
    question: Question
    ranked: list[Candidate]
    pruned: list[Candidate]
    failed: list[Candidate]
    ideal_ms: float
    run_dir: Optional[Path] = None

    def table(self, top: Optional[int] = None) -> list[dict[str, Any]]:
        q = self.question
        rows = []
        for i, c in enumerate(self.ranked[:top] if top else self.ranked, 1):
            t = c.row[M.TIME_MS_MEDIAN]
            row = {
                "rank": i,
                "method": c.title,
                "mask": _mask_label(q),
                "degrees": f"{c.ulysses_degree}x{c.ring_degree}",
                "layout": c.layout,
                "ranks/node": c.ranks_per_node,
                "predicted ms": _ms(t),
                "± %": M.UNVALIDATED if _band(c) is None else _band(c),
                "% of ideal": round(100 * self.ideal_ms / t, 1),
                "memory GB/GPU": float(f"{c.memory_bytes / GB:.3g}"),
                "main cost": main_cost(c.row, self.ideal_ms),
            }
            if q.per_layer:  # the model total, and what each layer mask takes per layer
                row["per layer ms"] = "; ".join(
                    f"{parse_mask(name).short} {_ms(c.rows[name][M.TIME_MS_MEDIAN])} x{n}"
                    for name, n in q.model.pattern
                )
            rows.append(row)
        return rows


def _ms(t: float) -> float:
    return round(t, 1) if t >= 100 else float(f"{t:.4g}")


def _mask_label(q: Question) -> str:
    """The mask the answer is for: --mask, the model's per-layer pattern, or causal/full."""
    if q.per_layer:
        return " + ".join(f"{n}x {parse_mask(name).short}" for name, n in q.model.pattern)
    return q.layer_masks()[0][0].short


def _band(c: Candidate) -> Optional[float]:
    """A candidate's error band (percent of its predicted time; None without a validated record)."""
    b = c.row.get(M.SIM_ERROR_PCT)
    return None if b is None else round(float(b), 1)


def within_bands(t1: float, b1: Optional[float], t2: float, b2: Optional[float]) -> bool:
    """Whether two predicted times lie within each other's band: each inside the other's t x (1 +- b)."""
    if b1 is None or b2 is None:
        return False
    gap = abs(t1 - t2)
    return gap <= t1 * b1 / 100 and gap <= t2 * b2 / 100


def tied_with_best(advice: Advice) -> list[Candidate]:
    """The ranked configurations tied with the first (itself included): their predicted times lie
    within each other's error band, so the simulator cannot order them; [] when none is tied."""
    if not advice.ranked:
        return []
    best = advice.ranked[0]
    tb, bb = best.row[M.TIME_MS_MEDIAN], _band(best)
    tied = [c for c in advice.ranked[1:] if within_bands(tb, bb, c.row[M.TIME_MS_MEDIAN], _band(c))]
    return [best] + tied if tied else []


def tie_line(advice: Advice) -> str:
    """One line saying which configurations are tied ("" when none is); `next_step` says how to
    separate them."""
    tied = tied_with_best(advice)
    if not tied:
        return ""
    ranks = [i for i, c in enumerate(advice.ranked, 1) if c in tied]
    bands = sorted({b for c in tied if (b := _band(c)) is not None})  # all of them: a tie needs both bands
    band = f"±{bands[0]:g} %" if len(bands) == 1 else f"±{bands[0]:g}-{bands[-1]:g} %"
    return (
        f"Tied: ranks {', '.join(map(str, ranks))} ({', '.join(c.title for c in tied)}) lie within each other's "
        f"error band ({band}, the simulator's validated error, `{M.suite_command()} validate`), so the simulator "
        f"cannot order them: measure them on your hardware (next step below)."
    )


def _band_text(c: Candidate) -> str:
    b = _band(c)
    return f" ±{b:g} %" if b is not None else f" ({M.UNVALIDATED}: no published row of its kind was validated)"


def advice_sentence(advice: Advice) -> str:
    """The answer in one sentence: the configuration to use, why, and how sure the simulator is."""
    if not advice.ranked:
        return "Advice: none; no configuration could be simulated (see 'Simulated but not ranked' below)."
    best = advice.ranked[0]
    t = best.row[M.TIME_MS_MEDIAN]
    text = (
        f"Advice: use {best.title} (Ulysses {best.ulysses_degree} x ring {best.ring_degree}), predicted "
        f"{_ms(t)} ms{_band_text(best)}, {100 * advice.ideal_ms / t:.1f} % of ideal, "
        f"{main_cost(best.row, advice.ideal_ms)}"
    )
    tied = tied_with_best(advice)
    if tied:
        return (
            text + f"; {len(tied) - 1} more configuration(s) lie within its error band, so measure the top "
            f"{len(tied)} on your hardware before choosing."
        )
    if len(advice.ranked) == 1:
        return text + "; it is the only configuration that runs this question."
    second = advice.ranked[1]
    gap = 100 * (second.row[M.TIME_MS_MEDIAN] / t - 1)
    if _band(best) is None or _band(second) is None:
        return (
            text + f"; {gap:.1f} % faster than the next, {second.title}, with no validated band to say it holds "
            f"({M.UNVALIDATED})."
        )
    return text + f"; {gap:.1f} % faster than the next, {second.title}, beyond both error bands."


def evidence_line(advice: Advice) -> str:
    """What backs the answer: a prediction, no run of these configurations on the GPUs it names (the
    header says "simulated"; a reader skimming for the answer must not take it for a measurement)."""
    q = advice.question
    return (
        f"No multi-GPU run backs this answer: it is the simulator's prediction for {q.world_size} x "
        f"{q.topology.gpu}, checked only against published tables (`{M.suite_command()} validate`); "
        "measure the top configurations on your hardware before relying on it (the next step below)."
    )


def measure_count(advice: Advice) -> int:
    """How many of the top configurations are worth measuring: the ones tied with the first, else 3."""
    return len(tied_with_best(advice)) or min(3, len(advice.ranked))


def next_step(advice: Advice, command: str, emitted: Optional[str] = None) -> str:
    """The command that measures the top configurations on real hardware. `command`: this advise
    command (without --top and --emit-config); `emitted`: the sweep file --emit-config wrote."""
    if not advice.ranked:
        return ""
    if emitted:
        measured = f"results/{sweep_name(advice.question)}_measured"
        return (
            f"Next: measure them on your hardware: `{M.suite_command()} run {emitted}`, then compare: "
            f"`{command} --compare {measured}`."
        )
    n = measure_count(advice)
    return (
        f"Next: measure the top {n} on your hardware: `{command} --top {n} --emit-config measure.yaml`, "
        f"then `{M.suite_command()} run measure.yaml`."
    )


def counts_line(advice: Advice, top: Optional[int]) -> str:
    """What the table does not show, counted: hidden ranks beyond --top, configurations merged as
    the same schedule, pruned and failed ones."""
    n = len(advice.ranked)
    shown = min(top, n) if top else n
    parts = [f"{shown} of {n} ranked configuration(s) shown" + (f" (--top {n} shows all)" if shown < n else "")]
    merged = sum(len(c.same) for c in advice.ranked)
    if merged:
        parts.append(f"{merged} more are the same schedule as one listed (named with it: a = b)")
    if advice.pruned:
        parts.append(f"{len(advice.pruned)} pruned before tracing")
    if advice.failed:
        parts.append(f"{len(advice.failed)} simulated but not ranked")
    return "; ".join(parts) + "."


def advise(
    q: Question, *, results_root: str = "results", mlflow: bool = True, progress: bool = False, out=None
) -> Advice:
    """Prune, simulate the survivors as one sweep (executor=sim), rank them."""
    import io

    from suite.runner import run_sweep

    candidates = enumerate_candidates(q)
    kept = prune(q, candidates)
    pruned = [c for c in candidates if c.pruned]
    if not kept:
        if q.memory_gb is not None and any("--memory-gb" in c.pruned for c in pruned):
            least = min((c for c in pruned if c.memory_bytes), key=lambda c: c.memory_bytes)
            raise AdviceError(
                "--memory-gb",
                f"nothing fits {q.memory_gb:g} GB per GPU: the smallest configuration, "
                f"{least.title}, needs ~{least.memory_bytes / GB:.1f} GB",
            )
        raise AdviceError(
            "--model",
            "no method can run this question: " + "; ".join(sorted({f"{c.title}: {c.pruned}" for c in pruned})[:5]),
        )
    cfg = build_config(q, kept, results_root=results_root, mlflow=mlflow)
    from omegaconf import OmegaConf

    yaml_text = OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True)
    if progress:  # what the wait is for, before the sweep's bar (stderr: stdout keeps the answer)
        masks = len(q.layer_masks())
        print(
            f"advise: {len(candidates)} configurations, {len(pruned)} pruned before tracing; simulating "
            f"{len(kept)}{f' x {masks} layer masks' if masks > 1 else ''} on {q.topology.name} "
            "(one trace per schedule shape, then three replays each)",
            file=sys.stderr,
            flush=True,
        )
    result = run_sweep(cfg, yaml_text, out=out or io.StringIO(), progress=progress)
    assert result is not None  # not a dry run, and the sim executor's one rank leads
    by_key = {(c.method, c.options_json): c for c in kept}
    counts = {m.name: n for m, n in q.layer_masks()}
    for r in result.records:
        c = by_key.get((r["method"], r["options"]))
        if c is not None:
            c.rows[r.get("mask") or next(iter(counts))] = r
    for c in kept:
        bad = [r for r in c.rows.values() if r.get("status") != M.OK]
        if bad or set(c.rows) != set(counts):
            c.row = (
                bad[0]
                if bad
                else {"status": "missing", "reason": f"no row for masks {sorted(set(counts) - set(c.rows))}"}
            )
        elif q.per_layer:
            c.row = total_row(c.rows, counts)
        else:
            c.row = next(iter(c.rows.values()))
    ranked = sorted((c for c in kept if c.row.get("status") == M.OK), key=lambda c: c.row[M.TIME_MS_MEDIAN])
    ranked = merge_same_schedules(q, ranked)
    failed = [c for c in kept if c.row.get("status") != M.OK]
    return Advice(q, ranked, pruned, failed, model_ideal_ms(q), result.run_dir)


# -- output ---------------------------------------------------------------------------------------
def render(advice: Advice, top: Optional[int] = None, fmt: str = "simple") -> str:
    """The ranked table; numeric columns right-aligned (in Markdown too: `fmt="pipe"` writes `---:`)."""
    from tabulate import tabulate

    rows = advice.table(top)
    if not rows:
        return ""
    headers = list(rows[0])
    numeric = [
        all(r[h] is None or (isinstance(r[h], (int, float)) and not isinstance(r[h], bool)) for r in rows)
        for h in headers
    ]
    return tabulate(
        [list(r.values()) for r in rows],
        headers=headers,
        tablefmt=fmt,
        disable_numparse=True,
        colalign=["right" if n else "left" for n in numeric],
    )


def header(advice: Advice) -> str:
    q = advice.question
    mix = f"packed documents ({q.workload.name})" if q.workload is not None else "uniform sequences"
    return (
        f"{q.model.name} attention (heads {q.model.heads}, kv_heads {q.model.kv_heads}, head_dim "
        f"{q.model.head_dim}{f', head_dim_v {q.model.head_dim_v}' if q.model.head_dim_v else ''}, "
        f"{q.model.layers} layers) on {q.world_size} x {q.topology.gpu} "
        f"({q.nodes} node(s), topology {q.topology.name}), {q.seq_len} tokens x batch {q.batch}, {mix}, "
        f"{q.dtype}, mask {_mask_label(q)}, {q.pass_}. Simulated (executor=sim), not measured. "
        + (
            f"Predicted ms: the model's attention over all {q.model.layers} layers (each distinct layer mask "
            f"simulated once, its time x its layer count); ideal likewise. "
            if q.per_layer
            else ""
        )
        + "Memory: one attention call's peak plus what the other layers keep for backward "
        f"({'their inputs only: activation recomputation' if q.recompute else 'no recomputation'}); "
        "ideal: the whole problem as one kernel call on one GPU of the same compute model / P; "
        f"± %: the simulator's validated error for the configuration's family (`{M.suite_command()} validate`); "
        f"{M.UNVALIDATED}: no published row of its family (hardware kind, method family, kernel- or comm-bound) "
        "was validated, so no band is given."
    )


def write_outputs(advice: Advice, out_dir: Path, top: Optional[int] = None, next_line: str = "") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = advice.table(top)
    md = out_dir / "advice.md"
    text = ["# suite advise\n", advice_sentence(advice), "", header(advice), "", render(advice, top, "pipe"), ""]
    text += [counts_line(advice, top), ""]
    tie = tie_line(advice)
    if tie:
        text += [tie, ""]
    if next_line:
        text += [next_line, ""]
    text += pruned_lines(advice)
    md.write_text("\n".join(text) + "\n")
    cs = out_dir / "advice.csv"
    with cs.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["rank"])
        w.writeheader()
        w.writerows(rows)
    return [md, cs]


def pruned_lines(advice: Advice) -> list[str]:
    lines = []
    if advice.pruned:
        lines.append(f"Pruned before tracing ({len(advice.pruned)}):")
        lines += [f"- {c.title}: {c.pruned}" for c in advice.pruned]
    if advice.failed:
        lines.append(f"Simulated but not ranked ({len(advice.failed)}):")
        lines += [f"- {c.title}: {c.row.get('status')}: {c.row.get('reason')}" for c in advice.failed]
    return lines


def emit_config(advice: Advice, path: Path, top: int) -> Path:
    """A sweep YAML that measures the advised top `top` configurations (executor dist)."""
    from omegaconf import OmegaConf

    q = advice.question
    cfg = build_config(q, advice.ranked[:top], executor="dist", name=sweep_name(q) + "_measured")
    cfg.description = f"measure the top {top} of `suite advise` ({cfg.description})"
    d = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    assert isinstance(d, dict)  # a structured config is a mapping
    keep = {"name": d["name"], "description": d["description"], "sweep": d["sweep"], "run": {"executor": "dist"}}
    if d.get("documents"):
        keep["documents"] = {
            k: {kk: vv for kk, vv in v.items() if vv not in (None, [], 0, 0.0) or kk == "min"}
            for k, v in d["documents"].items()
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"# Written by `{M.suite_command()} advise`: the top {top} configurations, measured.\n"
        + yaml.safe_dump(keep, sort_keys=False)
    )
    return path


# -- checking the advice against measurements ------------------------------------------------------
def ranks_of(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties get mean ranks)."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError("spearman needs two equally long lists of at least 2 values")
    rx, ry = ranks_of(x), ranks_of(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else float("nan")


def compare(advice: Advice, measured_dir: Path) -> tuple[str, dict[str, Any]]:
    """Predicted vs measured order of the configurations both hold: a table, whether the measured
    best is in the advised top 3, and the Spearman correlation of predicted and measured times."""
    from tabulate import tabulate

    from suite.results import ResultsStore

    store = (
        ResultsStore.latest(str(measured_dir.parent), measured_dir.name)
        if not (measured_dir / "trials.jsonl").is_file()
        else ResultsStore.open(measured_dir)
    )
    if store is None:
        raise AdviceError("--compare", f"no results under {measured_dir}")
    measured = {(r["method"], r["options"]): r for r in store.records() if r["status"] == M.OK}
    # a configuration measured under another name of its schedule (c.same) counts as measured
    pairs = [
        (c, next(measured[(a.method, a.options_json)] for a in [c, *c.same] if (a.method, a.options_json) in measured))
        for c in advice.ranked
        if any((a.method, a.options_json) in measured for a in [c, *c.same])
    ]
    if len(pairs) < 2:
        raise AdviceError("--compare", f"{measured_dir} holds {len(pairs)} of the advised configurations; need 2+")
    pred = [c.row[M.TIME_MS_MEDIAN] for c, _ in pairs]
    meas = [r[M.TIME_MS_MEDIAN] for _, r in pairs]
    mrank = ranks_of(meas)
    adv_rank = {id(c): i for i, c in enumerate(advice.ranked, 1)}
    rows = [
        [adv_rank[id(c)], int(mr) if mr == int(mr) else mr, c.title, f"{p:.3f}", f"{m:.3f}"]
        for (c, _), p, m, mr in zip(pairs, pred, meas, mrank)
    ]
    best = min(pairs, key=lambda cr: cr[1][M.TIME_MS_MEDIAN])[0]
    rho = spearman(pred, meas)
    facts = {
        "n": len(pairs),
        "measured_best": best.title,
        "best_advised_rank": adv_rank[id(best)],
        "best_in_top3": adv_rank[id(best)] <= 3,
        "spearman": rho,
        "run_dir": str(store.run_dir),
    }
    text = tabulate(
        rows,
        headers=["advised rank", "measured rank", "configuration", "predicted ms", "measured ms"],
        disable_numparse=True,
    )
    text += (
        f"\nmeasured best: {best.title}, advised rank {adv_rank[id(best)]} "
        f"({'in' if facts['best_in_top3'] else 'NOT in'} the advised top 3); Spearman rank correlation "
        f"predicted vs measured over {len(pairs)} configurations: {rho:+.3f} (measured: {store.run_dir})"
    )
    return text, facts


# -- command line -----------------------------------------------------------------------------------
def _check_writable(option: str, path: Path, *, folder: bool) -> None:
    """Raise AdviceError when `path` (a folder to create, or a file to write) cannot be made: it or
    one of its parents is a file (or a folder where a file is asked for)."""
    if folder and path.exists() and not path.is_dir():
        raise AdviceError(option, f"{path} is a file; name a folder")
    if not folder and path.is_dir():
        raise AdviceError(option, f"{path} is a folder; name a YAML file to write")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise AdviceError(option, f"{parent} is a file, so nothing can be written under it: {path}")
            break


def command_line(args) -> str:
    """This advise command as typed (the options that differ from their defaults), without --top,
    --emit-config, --out and --compare: the start of the next command to run."""
    import shlex

    parts = [f"{M.suite_command()} advise", "--model", args.model, "--topology", args.topology]
    for flag, value, default in (
        ("--nodes", args.nodes, None),
        ("--gpus", args.gpus, None),
        ("--seq-len", args.seq_len, None),
        ("--workload", args.workload, None),
        ("--batch", args.batch, 1),
        ("--memory-gb", args.memory_gb, None),
        ("--pass", args.pass_, "fwd_bwd"),
        ("--dtype", args.dtype, "auto"),
        ("--mask", getattr(args, "mask", None), None),
        ("--results-root", args.results_root, "results"),
    ):
        if value != default:
            parts += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    for u in args.ulysses_degree or []:
        parts += ["--ulysses-degree", str(u)]
    parts += [flag for flag, on in (("--recompute", args.recompute), ("--no-causal", args.no_causal)) if on]
    return " ".join(parts[:1] + [shlex.quote(p) for p in parts[1:]])


def run_command(args) -> int:
    import time

    t0 = time.perf_counter()
    try:
        if args.top < 1:
            raise AdviceError("--top", f"must be >= 1, got {args.top}")
        q = make_question(
            model=args.model,
            topology=args.topology,
            nodes=args.nodes,
            gpus=args.gpus,
            seq_len=args.seq_len,
            workload=args.workload,
            memory_gb=args.memory_gb,
            pass_=args.pass_,
            dtype=args.dtype,
            causal=not args.no_causal,
            batch=args.batch,
            ulysses_degree=args.ulysses_degree,
            recompute=args.recompute,
            mask=getattr(args, "mask", None),
        )
        if args.compare and not Path(args.compare).exists():
            raise AdviceError("--compare", f"no such folder: {args.compare}")
        # where the outputs go, checked before the simulation rather than failing after it
        _check_writable("--out", Path(args.out or f"reports/{sweep_name(q)}_{q.seq_len}"), folder=True)
        if args.emit_config:
            _check_writable("--emit-config", Path(args.emit_config), folder=False)
        advice = advise(
            q,
            results_root=args.results_root,
            mlflow=not args.no_mlflow,
            progress=not getattr(args, "no_progress", False),
        )
    except AdviceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    emitted = None
    if args.emit_config:
        emitted = str(emit_config(advice, Path(args.emit_config), args.top))
    step = next_step(advice, command_line(args), emitted)
    print(advice_sentence(advice))
    if not args.compare:  # with --compare, the measured order is printed below
        print(evidence_line(advice))
    print(header(advice))
    print(render(advice, args.top))
    print(counts_line(advice, args.top))
    tie = tie_line(advice)
    if tie:
        print(tie)
    for line in pruned_lines(advice):
        print(line)
    files = write_outputs(advice, Path(args.out or f"reports/{sweep_name(q)}_{q.seq_len}"), args.top, step)
    print(
        f"{len(advice.ranked)} configurations ranked, {len(advice.pruned)} pruned, in "
        f"{time.perf_counter() - t0:.1f}s; rows in {advice.run_dir}; tables {', '.join(map(str, files))}"
    )
    if emitted:
        print(f"sweep measuring the top {args.top}: {emitted}")
    print(step)
    if args.compare:
        try:
            text, _ = compare(advice, Path(args.compare))
        except AdviceError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(text)
    return 0
