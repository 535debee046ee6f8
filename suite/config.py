"""Sweep configuration: Hydra YAML -> validated dataclasses (docs/DESIGN.md section 3).

A config file is composed with Hydra's Compose API (so `defaults:` lists in YAML work), merged
into the `SuiteConfig` schema below, then command-line overrides in Hydra syntax are applied
(`run.repeats=3`, `sweep.seq_len=[512,1024]`, or the sweep form `sweep.seq_len=512,1024`).
Every problem (unknown key, wrong type, bad value, unknown method) raises `ConfigError` naming
the key and what is allowed, before anything starts. `methods/` never sees any of this.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

PASSES = ("fwd", "fwd_bwd")
KINDS = ("attention", "perplexity")
EXECUTORS = ("dist", "threads", "sim")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")
# Sweep axes as they appear in trial identities (and in exclude rules).
AXES = ("method", "topology", "world_size", "batch", "seq_len", "heads", "kv_heads", "head_dim", "dtype",
        "causal", "pass", "ulysses_degree", "ring_degree", "workload")


class ConfigError(ValueError):
    """A configuration problem, reported before anything runs."""


MAX_NAME = 100              # a sweep name is a folder name and an MLflow experiment name
MAX_TIMEOUT_S = 7 * 86400   # a week: longer waits are a typo (and inf overflows the waits)


@dataclass
class SweepConfig:
    """The sweep axes: every list is one axis; trials are their cartesian product minus excludes."""

    methods: list[str] = field(default_factory=lambda: ["reference", "ring", "ulysses"])
    """Registered method names (`python -m suite list`)."""
    world_size: list[int] = field(default_factory=lambda: [1, 2, 4])
    """Number of ranks sharing one sequence."""
    batch: list[int] = field(default_factory=lambda: [1])
    seq_len: list[int] = field(default_factory=lambda: [1024])
    """Global sequence length (tokens over all ranks)."""
    heads: list[int] = field(default_factory=lambda: [8])
    kv_heads: list[int] = field(default_factory=lambda: [8])
    """KV heads; fewer than `heads` is GQA (heads must be a multiple)."""
    head_dim: list[int] = field(default_factory=lambda: [64])
    dtype: list[str] = field(default_factory=lambda: ["float32"])
    causal: list[bool] = field(default_factory=lambda: [True, False])
    passes: list[str] = field(default_factory=lambda: ["fwd", "fwd_bwd"])
    """fwd (forward only, no autograd graph) and/or fwd_bwd (forward + backward)."""
    workload: list[str] = field(default_factory=lambda: ["uniform"])
    """Length mixes: `uniform` (one document per sequence) and/or names of `documents:` entries
    (documents drawn from that distribution with run.seed, packed into each sequence, the last cut;
    the mask is document-causal: a token sees its own document only)."""
    exclude: list[dict[str, Any]] = field(default_factory=list)
    """Rules removing trials: each maps axis names (see AXES) or method option names to a value or a
    list of values; a trial matching every entry of a rule is not planned.
    E.g. {method: reference, world_size: [2, 4]} or {method: burst, ranks_per_node: 2, world_size: 2}."""
    method_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per-method constructor options, e.g. {usp: {ulysses_degree: 2}}; a list of values is an axis
    of that method's trials, e.g. {usp: {ulysses_degree: [1, 2, 4]}} (the USP degree grid)."""


@dataclass
class RunConfig:
    """How trials run."""

    executor: str = "dist"
    """dist: real worker processes over torch.distributed (the only executor whose timings are
    performance); threads: virtual ranks in one process (numerics only); sim: the simulator predicts
    each trial on every topology of `sim.topology` (nothing runs; rows say executor=sim)."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl on cuda, gloo on cpu), gloo or nccl."""
    kernel: str = "auto"
    """Local attention kernel: auto, math, cpu_flash, flash_attn."""
    warmup: int = 2
    """Untimed iterations before timing (the first also counts communication bytes)."""
    repeats: int = 10
    """Timed iterations; every sample is kept."""
    check: bool = True
    """Compare out, lse (and dq, dk, dv for fwd_bwd) with float64 attention on the unsharded inputs."""
    breakdown: bool = True
    """After timing: one iteration split into kernel / exposed-communication / bookkeeping time, and
    `repeats` compute-only and comm-only iterations (CCR, overlap efficiency)."""
    check_max_seq_len: int = 65536
    """Above this global length the float64 reference is not computed (the row says checked=false)."""
    seed: int = 0
    timeout_s: float = 300.0
    """Per-trial limit; a trial over it is recorded as timeout and its worker group replaced."""
    prepare_timeout_s: float = 1800.0
    """Limit for building a trial's inputs and float64 reference (executor dist); run.timeout_s
    starts once every rank has them, so a slow reference is never counted against the method."""
    startup_timeout_s: float = 180.0
    """Limit for starting a worker group (process spawn + rendezvous)."""
    fail_grace_s: float = 10.0
    """After one rank fails, how long to wait for the others to report before replacing the group."""
    threads_per_rank: int = 0
    """CPU threads per worker; 0 = available cores / world_size (at least 1)."""
    max_ranks_per_core: float = 2.0
    """Local CPU runs (executor dist on cpu): world sizes above this many ranks per available core are
    refused before start (P = 16 on 2 cores times nothing but contention); raise it to oversubscribe."""
    hardware: str = "auto"
    """Hardware label recorded with each trial; auto = detected (GPU name or CPU model)."""
    plugins: list[str] = field(default_factory=list)
    """Python modules imported in the parent and every worker to register extra methods."""


@dataclass
class ResultsConfig:
    root: str = "results"
    """Results go to <root>/<name>/<timestamp>/ (trials.jsonl, trials.parquet, config, environment)."""


@dataclass
class TrackingConfig:
    mlflow: bool = True
    """Log the sweep to MLflow (parent run) with one nested run per trial."""
    uri: Optional[str] = None
    """Tracking URI; default: $MLFLOW_TRACKING_URI, else sqlite:///<results.root>/mlflow.db."""
    experiment: Optional[str] = None
    """Experiment name; default: the sweep name."""


# The model's and the training loop's own defaults (one source for both).
from suite.perplexity.model import ModelConfig as _Model  # noqa: E402
from suite.perplexity.train import TrainConfig as _Train  # noqa: E402


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
    mlp_hidden: int = _Model.mlp_hidden
    """SwiGLU hidden size; 0 = LLaMA's 8/3 x width rounded up to a multiple of 32."""
    rope_theta: float = _Model.rope_theta
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
    """Self-test of the check: none, local_positions, local_label_shift, no_grad_sync or
    cross_document_attention (packed documents only) breaks the
    sequence-parallel model on purpose; every method should then be recorded incorrect."""
    data: DataConfig = field(default_factory=DataConfig)


@dataclass
class DocumentsConfig:
    """A document-length distribution for packed workloads (suite/lengths.py)."""

    distribution: str = MISSING
    """fixed (`lengths`, used once in order), lognormal (`median`, `sigma`), powerlaw (`alpha` > 1
    between `min` and `max`) or histogram (`file`: YAML with bins: [[low, high, weight], ...])."""
    lengths: list[int] = field(default_factory=list)
    median: float = 0.0
    sigma: float = 0.0
    alpha: float = 0.0
    min: int = 1
    """Every drawn length is clipped to [min, max]."""
    max: int = 0
    """0: no cap."""
    file: Optional[str] = None


@dataclass
class SimConfig:
    """run.executor: sim (suite/sim): each method's own schedule, traced on meta tensors, replayed on
    a topology model. Nothing is measured; rows carry executor=sim and the topology."""

    topology: list[str] = field(default_factory=lambda: ["h100_sxm"])
    """Topologies (an axis): names in configs/topologies/ or paths to topology YAML files (e.g. one
    written by `python -m suite calibrate`). World sizes beyond one node use as many nodes as needed."""


@dataclass
class SuiteConfig:
    name: str = MISSING
    """Sweep name (letters, digits, - and _): the results folder and MLflow experiment."""
    description: str = ""
    kind: str = "attention"
    """attention: time and check attention calls; perplexity: train the small model with each
    method and compare its losses and perplexity with the single-device baseline."""
    sweep: SweepConfig = field(default_factory=SweepConfig)
    run: RunConfig = field(default_factory=RunConfig)
    perplexity: PerplexityConfig = field(default_factory=PerplexityConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    documents: dict[str, DocumentsConfig] = field(default_factory=dict)
    """Named document-length distributions, used by sweep.workload."""
    results: ResultsConfig = field(default_factory=ResultsConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[SuiteConfig, str]:
    """Compose `path` with Hydra, validate it and apply `overrides`.

    Returns the typed config and its resolved YAML text (saved with the run).
    """
    raw = _compose(Path(path))
    cfg = _merge_schema(raw, str(path))
    for text in overrides:
        _apply_override(cfg, text)
    return _finish(cfg, str(path))


def config_from_node(node: DictConfig | dict, source: str = "") -> tuple[SuiteConfig, str]:
    """A config composed elsewhere (the Hydra application, suite/hydra_app.py), validated as
    load_config validates a file: the same schema, the same errors naming the key."""
    raw = node if isinstance(node, DictConfig) else OmegaConf.create(node)
    if "hydra" in raw:
        raw = OmegaConf.masked_copy(raw, [k for k in raw if k != "hydra"])
    return _finish(_merge_schema(raw, source), source)


def _merge_schema(raw: DictConfig, source: str) -> DictConfig:
    schema = OmegaConf.structured(SuiteConfig)
    _lists_from_scalars(raw, SuiteConfig)
    try:
        return OmegaConf.merge(schema, raw)
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc, source=source)) from None


def _finish(cfg: DictConfig, source: str) -> tuple[SuiteConfig, str]:
    try:
        obj: SuiteConfig = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc, source=source)) from None
    validate(obj)
    return obj, OmegaConf.to_yaml(OmegaConf.structured(obj), resolve=True)


# YAML aliases repeat a node without copying it, so a few hundred bytes can stand for billions of
# nodes once loaded (the "billion laughs"); a config is refused, before anything constructs it, when
# its expanded size passes these.
MAX_YAML_NODES = 200_000
MAX_YAML_ALIASES = 1_000


def check_yaml_size(text: str, source: str) -> None:
    """Raise ConfigError when the YAML `text` would expand to more than MAX_YAML_NODES nodes or uses
    more than MAX_YAML_ALIASES aliases. Counts on the composed node graph (aliases are shared nodes
    there, so nothing is expanded), memoised per node."""
    import yaml

    aliases = text.count("*")  # an upper bound on alias uses; the exact count comes from the events
    if aliases > MAX_YAML_ALIASES:
        try:
            aliases = sum(isinstance(e, yaml.AliasEvent) for e in yaml.parse(text, Loader=yaml.SafeLoader))
        except yaml.YAMLError:
            return  # the real loader reports the syntax error with its position
        if aliases > MAX_YAML_ALIASES:
            raise ConfigError(f"{source}: {aliases} YAML aliases (at most {MAX_YAML_ALIASES}); write the values out")
    try:
        roots = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError:
        return
    sizes: dict[int, int] = {}

    def size(node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        sizes[id(node)] = 1  # a cycle counts once (and cannot recurse forever)
        n = 1
        if isinstance(node, yaml.SequenceNode):
            n += sum(size(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            n += sum(size(k) + size(v) for k, v in node.value)
        sizes[id(node)] = n
        return n
    total = sum(size(root) for root in roots if root is not None)
    if total > MAX_YAML_NODES:
        raise ConfigError(f"{source}: the YAML expands to {total} nodes through its aliases (at most "
                          f"{MAX_YAML_NODES}); write the values out instead of repeating aliases")


def _list_field(schema: type, name: str) -> bool:
    """Whether `schema`'s field `name` is a list (an axis): its default is a list."""
    hit = {f.name: f for f in fields(schema)}.get(name)
    if hit is None:
        return False
    default = hit.default_factory() if hit.default_factory is not dataclasses.MISSING else hit.default
    return isinstance(default, list)


def _lists_from_scalars(node: DictConfig, schema: type) -> None:
    """A single value where the schema has a list (an axis) is a list of that one value:
    `sweep.seq_len=512` means `sweep.seq_len=[512]` (Hydra's overrides and YAML both allow it)."""
    for f in fields(schema):
        if f.name not in node:
            continue
        value = node._get_node(f.name)
        if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            if isinstance(value, DictConfig):
                _lists_from_scalars(value, f.default_factory)
        elif _list_field(schema, f.name) and not OmegaConf.is_list(value) and value is not None \
                and not OmegaConf.is_missing(node, f.name) and node[f.name] is not None:
            node[f.name] = [node[f.name]]


def _compose(path: Path) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: could not read the config: {exc}") from None
    check_yaml_size(text, str(path))
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    try:
        with initialize_config_dir(config_dir=str(path.resolve().parent), version_base="1.3"):
            cfg = compose(config_name=path.stem)
    except HydraException as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except Exception as exc:  # YAML syntax errors and the like
        raise ConfigError(f"{path}: could not read the config: {exc}") from None
    if "hydra" in cfg:  # Hydra's own section is not part of our schema
        cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    return cfg


def _apply_override(cfg: DictConfig, text: str) -> None:
    """One override in Hydra's grammar: `key=value` (a value where the schema has a list becomes a
    one-value list; `a,b` is a list), `+key=value` (add a key that is not there yet, e.g. a method's
    options or a documents entry), `++key=value` (add or replace) and `~key` (remove an entry of a
    dict section, or put a setting back to its default)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        (ov,) = OverridesParser.create().parse_overrides([text])
    except HydraException as exc:
        raise ConfigError(f"bad override {text!r}: {exc}. Use key=value, e.g. run.repeats=3 or "
                          f"sweep.seq_len=[512,1024]") from None
    key = ov.key_or_group
    exists = OmegaConf.select(cfg, key, default=_MISSING_KEY) is not _MISSING_KEY
    if ov.is_delete():
        _delete(cfg, key, text)
        return
    value = list(ov.sweep_iterator()) if ov.is_sweep_override() else ov.value()
    if ov.is_add() and exists:
        raise ConfigError(f"override {text!r}: {key!r} is already set; use {key}=... to change it "
                          f"(or ++{key}=... to add or replace)")
    if not exists and not (ov.is_add() or ov.is_force_add()):
        raise ConfigError(_unknown_key_message(key) + (f" (to add an entry to a dict section, write +{key}=...)"
                                                       if _in_dict_section(key) else ""))
    parts = key.split(".")
    schema = _schema_for(parts[:-1])
    if schema is not None and _list_field(schema, parts[-1]) and not isinstance(value, list) and value is not None:
        value = [value]
    try:
        OmegaConf.update(cfg, key, value, merge=False, force_add=not exists and _in_dict_section(key))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"override {text!r}: {_explain(exc)}") from None


def _in_dict_section(key: str) -> bool:
    """Whether `key` lies under a free-form dict of the schema (method_options, documents)."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        schema = _schema_for(parts[:i - 1]) if i > 1 else SuiteConfig
        if schema is None:
            continue
        hit = {f.name: f for f in fields(schema)}.get(parts[i - 1])
        if hit is not None:
            default = hit.default_factory() if hit.default_factory is not dataclasses.MISSING else hit.default
            return isinstance(default, dict)
    return False


def _delete(cfg: DictConfig, key: str, text: str) -> None:
    if OmegaConf.select(cfg, key, default=_MISSING_KEY) is _MISSING_KEY:
        raise ConfigError(f"override {text!r}: nothing to remove at {key!r}")
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if _in_dict_section(key):
        from omegaconf import open_dict
        with open_dict(parent):  # the schema's struct flag forbids deletion, also in its dict sections
            del parent[leaf]
        return
    default = OmegaConf.select(OmegaConf.structured(SuiteConfig), key, default=_MISSING_KEY)
    if default is _MISSING_KEY or OmegaConf.is_missing(parent, leaf) or key == "name":
        raise ConfigError(f"override {text!r}: {key!r} is required and has no default to go back to")
    OmegaConf.update(cfg, key, default, merge=False)


_MISSING_KEY = object()


def _schema_for(path: list[str]):
    node: Any = SuiteConfig
    for part in path:
        hit = {f.name: f for f in fields(node)}.get(part) if dataclasses.is_dataclass(node) else None
        if hit is None or not (isinstance(hit.default_factory, type) and dataclasses.is_dataclass(hit.default_factory)):
            return None
        node = hit.default_factory  # nested dataclass sections use default_factory=Class
    return node


def _unknown_key_message(full_key: str) -> str:
    parts = full_key.split(".")
    parent = _schema_for(parts[:-1])
    where = ".".join(parts[:-1]) or "the top level"
    if parent is None:
        return f"unknown config key {full_key!r}"
    allowed = ", ".join(f.name for f in fields(parent))
    return f"unknown config key {full_key!r}; allowed keys under {where}: {allowed}"


def _explain(exc: OmegaConfBaseException, source: str = "") -> str:
    key = getattr(exc, "full_key", None) or ""
    prefix = f"{source}: " if source else ""
    if isinstance(exc, ConfigKeyError) or "not in" in str(exc):
        return prefix + _unknown_key_message(key) if key else prefix + str(exc).splitlines()[0]
    if isinstance(exc, ValidationError):
        msg = str(exc).splitlines()[0]
        return f"{prefix}{key}: {msg}" if key else prefix + msg
    return prefix + str(exc).splitlines()[0]


# ---------------------------------------------------------------------------------------------
# Validation of values
# ---------------------------------------------------------------------------------------------
def _require(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {message}")


def _choice(value: Any, key: str, allowed: tuple) -> None:
    _require(value in allowed, key, f"{value!r} is not allowed; choose one of {list(allowed)}")


def validate(cfg: SuiteConfig) -> None:
    """Check values the schema types cannot (ranges, choices, names). Raises ConfigError."""
    import methods
    from methods.base import DTYPES
    from methods.kernels import KERNEL_CHOICES

    _require(bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", cfg.name or "")), "name",
             f"{cfg.name!r} must be letters, digits, '-', '_' or '.' (it names a folder)")
    _require(len(cfg.name) <= MAX_NAME, "name", f"is {len(cfg.name)} characters; at most {MAX_NAME} (it names a "
                                                f"folder and an MLflow experiment): use a shorter name")
    s, r = cfg.sweep, cfg.run
    try:
        methods.load_plugins(r.plugins)
    except ImportError as exc:
        raise ConfigError(f"run.plugins: {exc}") from None
    known = set(methods.available()) | set(methods.unavailable())
    for axis in ("methods", "world_size", "batch", "seq_len", "heads", "kv_heads", "head_dim", "dtype",
                 "causal", "passes", "workload"):
        values = getattr(s, axis)
        _require(len(values) > 0, f"sweep.{axis}", "needs at least one value")
        _require(len(set(map(str, values))) == len(values), f"sweep.{axis}", f"has duplicates: {values}")
    for m in s.methods:
        _require(m in known, "sweep.methods",
                 f"unknown method {m!r}; registered methods: {', '.join(sorted(known))}")
    for axis in ("world_size", "batch", "seq_len", "heads", "kv_heads", "head_dim"):
        for v in getattr(s, axis):
            _require(v >= 1, f"sweep.{axis}", f"values must be >= 1, got {v}")
    for d in s.dtype:
        _choice(d, "sweep.dtype", tuple(DTYPES))
    for p in s.passes:
        _choice(p, "sweep.passes", PASSES)
    option_keys = {k for opts in s.method_options.values() for k in opts}
    for i, rule in enumerate(s.exclude):
        _require(bool(rule), f"sweep.exclude[{i}]", "an empty rule would exclude everything")
        for k in rule:
            _require(k in AXES or k in option_keys, f"sweep.exclude[{i}]",
                     f"unknown axis {k!r}; axes are {list(AXES)} and the options in sweep.method_options")
    for m, opts in s.method_options.items():
        _require(m in s.methods, "sweep.method_options", f"options for {m!r}, which is not in sweep.methods")
        if m in methods.available():
            from methods.base import option_names
            allowed = option_names(methods.method_class(m))
            for k, v in opts.items():
                _require(k in allowed and k != "kernel", f"sweep.method_options.{m}",
                         f"unknown option {k!r}; options of {m}: {[a for a in allowed if a != 'kernel']} "
                         f"(the kernel is run.kernel)")
                if isinstance(v, (list, tuple)):
                    _require(len(v) > 0 and len(set(map(repr, v))) == len(v), f"sweep.method_options.{m}.{k}",
                             f"a list of values is an axis and needs distinct values; got {list(v)}")
            for point in option_points(dict(opts)):  # every value must build the method
                try:
                    methods.get_method(m, **point)
                except (TypeError, ValueError) as exc:
                    raise ConfigError(f"sweep.method_options.{m}: {exc}") from None
    _choice(r.executor, "run.executor", EXECUTORS)
    _choice(r.device, "run.device", DEVICES)
    _choice(r.backend, "run.backend", BACKENDS)
    _choice(r.kernel, "run.kernel", KERNEL_CHOICES)
    _require(r.warmup >= 0, "run.warmup", f"must be >= 0, got {r.warmup}")
    _require(r.repeats >= 1, "run.repeats", f"must be >= 1, got {r.repeats}")
    _require(r.check_max_seq_len >= 1, "run.check_max_seq_len", "must be >= 1")
    for k in ("timeout_s", "startup_timeout_s", "prepare_timeout_s", "fail_grace_s"):
        v = getattr(r, k)  # inf or NaN would overflow the waits (OverflowError) or never time out
        _require(math.isfinite(v) and 0 <= v <= MAX_TIMEOUT_S and (v > 0 or k == "fail_grace_s"), f"run.{k}",
                 f"must be a finite number of seconds, {'>=' if k == 'fail_grace_s' else '>'} 0 and at most "
                 f"{MAX_TIMEOUT_S} (a week), got {v}")
    _require(math.isfinite(r.max_ranks_per_core) and r.max_ranks_per_core > 0, "run.max_ranks_per_core",
             f"must be a finite number > 0, got {r.max_ranks_per_core}")
    _require(r.threads_per_rank >= 0, "run.threads_per_rank", "must be >= 0 (0 = automatic)")
    if r.backend == "nccl":
        _require(r.device != "cpu", "run.backend", "nccl needs run.device cuda (or auto on a GPU machine)")
    _require(bool(cfg.results.root), "results.root", "must be a folder path")
    _validate_documents(cfg)
    _choice(cfg.kind, "kind", KINDS)
    if cfg.kind == "perplexity":
        _validate_perplexity(cfg)
    if r.executor == "sim":
        _validate_sim(cfg)


def _validate_documents(cfg: SuiteConfig) -> None:
    from suite.lengths import UNIFORM, Distribution, LengthsError

    dists = {}
    for name, d in cfg.documents.items():
        _require(bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name)) and name != UNIFORM, f"documents.{name}",
                 "names are letters, digits, '-', '_' or '.', and not 'uniform' (the unpacked workload)")
        try:
            dists[name] = Distribution.from_config(name, dataclasses.asdict(d))
            for seq_len in cfg.sweep.seq_len:  # every distribution must fill every sequence
                dists[name].draw(seq_len, 1, cfg.run.seed)
        except LengthsError as exc:
            raise ConfigError(str(exc)) from None
    for w in cfg.sweep.workload:
        _require(w == UNIFORM or w in dists, "sweep.workload",
                 f"unknown workload {w!r}: use 'uniform' or a name defined under documents: "
                 f"({', '.join(sorted(dists)) or 'none defined'})")


def _validate_sim(cfg: SuiteConfig) -> None:
    from suite.sim.compute import ComputeModel
    from suite.sim.topology import TopologyError, load_topology

    _require(cfg.kind == "attention", "run.executor",
             "sim predicts attention trials; a perplexity check trains a model and needs dist or threads")
    _require(len(cfg.sim.topology) > 0, "sim.topology", "needs at least one topology")
    names = []
    for t in cfg.sim.topology:
        try:
            topo = load_topology(t)
            ComputeModel(topo)
        except TopologyError as exc:
            raise ConfigError(f"sim.topology: {exc}") from None
        names.append(topo.name)
    _require(len(set(names)) == len(names), "sim.topology",
             f"topology names must differ (they name the trials); got {names}: change `name:` in the copied file")


def _validate_perplexity(cfg: SuiteConfig) -> None:
    from suite.perplexity.data import SOURCES
    from suite.perplexity.train import PLANTED_BUGS

    p = cfg.perplexity
    _require(list(cfg.sweep.causal) == [True], "sweep.causal",
             f"a perplexity check trains a causal language model: set sweep.causal: [true] (got {cfg.sweep.causal})")
    for k in ("layers", "steps", "eval_batches", "max_bytes"):
        where = p.data if k == "max_bytes" else p
        _require(getattr(where, k) >= 1, f"perplexity.{'data.' if k == 'max_bytes' else ''}{k}", "must be >= 1")
    for k in ("mlp_hidden", "warmup_steps", "weight_decay", "grad_clip"):
        _require(getattr(p, k) >= 0, f"perplexity.{k}", "must be >= 0")
    for k in ("lr", "rope_theta", "loss_rtol", "ppl_rtol"):
        _require(getattr(p, k) > 0, f"perplexity.{k}", "must be > 0")
    _choice(p.planted_bug, "perplexity.planted_bug", tuple(PLANTED_BUGS))
    _choice(p.data.source, "perplexity.data.source", SOURCES)
    _require(0 < p.data.val_fraction < 1, "perplexity.data.val_fraction", "must be between 0 and 1")
    if p.data.source == "file":
        _require(bool(p.data.path) and Path(p.data.path).is_file(), "perplexity.data.path",
                 f"data.source is file: give an existing text file (got {p.data.path!r})")
    if p.data.source == "hf":
        _require(bool(p.data.hf_dataset), "perplexity.data.hf_dataset", "data.source is hf: name a dataset")


def option_points(options: dict[str, Any]) -> list[dict[str, Any]]:
    """Method options with list values are axes: {ulysses_degree: [1, 2]} -> two option sets."""
    keys = sorted(options)
    values = [v if isinstance(v, (list, tuple)) else [v] for v in (options[k] for k in keys)]
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def to_dict(cfg: SuiteConfig) -> dict:
    """Plain dict of the config (for MLflow artifacts and workers)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]
