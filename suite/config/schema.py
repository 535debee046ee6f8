"""The sweep config's schema: every section as a dataclass, every field documented (the
defaults are the documentation's values). Loading is in load.py, value rules in validate.py."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf

from suite import metrics as M
from suite.perplexity.config import PerplexityConfig

PASSES = ("fwd", "fwd_bwd")
KINDS = ("attention", "perplexity")
EXECUTORS = ("dist", "threads", "sim")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")
# Sweep axes as they appear in trial identities (and in exclude rules): suite.metrics.TRIAL_AXES.
AXES = tuple(a.name for a in M.TRIAL_AXES if a.rule)


class ConfigError(ValueError):
    """A configuration problem, reported before anything runs."""


MAX_NAME = 100  # a sweep name is a folder name and an MLflow experiment name
MAX_TIMEOUT_S = 7 * 86400  # a week: longer waits are a typo (and inf overflows the waits)
# A global sequence of at most 2**31 - 1 tokens: flash-attn's varlen kernels index a packed
# sequence with int32 offsets (cu_seqlens), and the float64 check, the document draws and the
# simulator's per-block arrays all grow with the length (2**62 tokens would need petabytes).
MAX_SEQ_LEN = 2**31 - 1
# Timed and warm-up iterations per trial: every sample is stored with its row, and 10,000 pin a
# median far below run-to-run noise; more is a typo that would run for days.
MAX_REPEATS = 10_000
# Seeds of numpy's and torch's generators: non-negative (numpy refuses negative seeds) and 64-bit.
MAX_SEED = 2**63 - 1
# executor=threads runs every virtual rank as a thread of this one process, each with its own
# shards, buffers and (on CPU) intra-op thread pool: past 64 ranks the process's threads and memory
# outgrow a host (the OS kills it) and the ring's P steps of P threads take minutes for a tiny problem.
MAX_THREAD_RANKS = 64


def _table_axes(cls):
    """Add to the sweep a list for every axis of suite.metrics.TRIAL_AXES the class does not spell
    out (its default and documentation are the table's), before `dataclass` makes the fields: a
    new axis of the problem is one entry in that table."""
    for a in M.TRIAL_AXES:
        if a.sweep and a.sweep not in cls.__annotations__:
            kind: Any = Optional[a.type] if a.nullable else a.type
            cls.__annotations__[a.sweep] = list[kind]
            setattr(cls, a.sweep, field(default_factory=functools.partial(list, a.planned)))
    return cls


@dataclass
@_table_axes
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
    head_dim_v: list[Optional[int]] = field(default_factory=lambda: [None])
    """The values' (and the output's) head dim: null, the default, is equal to head_dim (a value
    equal to head_dim is that same point). MLA models differ: DeepSeek-V3 has head_dim 192 and
    head_dim_v 128, so K and V cost different bytes on every link."""
    softcap: list[float] = field(default_factory=lambda: [0.0])
    """Logit soft caps (Gemma 2): scores become softcap * tanh(s / softcap) before the softmax; 0 is
    off. Kernels without a cap argument (cpu_flash, torch_flash) skip the point; kernel auto runs
    it on math (or flash-attn where it takes `softcap`)."""
    dtype: list[str] = field(default_factory=lambda: ["float32"])
    causal: list[bool] = field(default_factory=lambda: [True, False])
    """The two plain masks (causal, full). `mask`, when given, replaces this axis."""
    mask: list[str] = field(default_factory=list)
    """Mask families (methods/masks.py), an axis that replaces `causal` when given: `full`, `causal`,
    `sliding_window:<w>` (or `sliding_window:window=<w>,symmetric=true`), `chunked:<c>`,
    `prefix_lm:<p>`, `block_causal:<b>`, `shared_question:question=<q>,answers=<k>`,
    `global_window:globals=<g>,window=<w>`, or names of `masks:` entries. A size is tokens (>= 1) or a
    fraction of each document (0 < f < 1). Every family applies inside each packed document."""
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
    sinks: list[bool] = field(default_factory=lambda: [False])
    """Attention sinks (gpt-oss): `true` gives every query head a learned logit in each row's softmax
    denominator (drawn per head from run.seed with the inputs; its gradient is checked as dsink).
    Methods without sinks (peer libraries) skip those trials with the reason."""


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
    memory_check: bool = True
    """Skip (recorded, with both figures) a trial whose predicted per-rank peak exceeds the device's
    memory, before it starts (suite/budget.py); false runs every trial (out of memory is then a
    recorded failure)."""
    device_memory_gb: float = 0.0
    """The memory one rank may use, in GB (10^9 bytes), for the memory check and the dry run's
    summary; 0: detected (CUDA: the device's total less 4 GB; CPU: the machine's RAM / ranks)."""
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
    max_trials: int = 200_000
    """A sweep whose axes multiply to more trials than this (before `sweep.exclude`) is refused
    before anything is planned: a typo in an axis should not plan for hours. The main GPU sweep
    plans about 6,600; raise it for a larger sweep on purpose."""


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
    masks: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Named masks, used by sweep.mask: {family: sliding_window, window: 4096} (methods/masks.py)."""
    results: ResultsConfig = field(default_factory=ResultsConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


def mask_points(sweep: SweepConfig, named: Optional[dict[str, dict[str, Any]]] = None) -> list[tuple[bool, str]]:
    """The mask axis as (causal flag, canonical mask name): `sweep.mask` when given, else the two
    plain families of `sweep.causal`. The causal flag is the family's own (`Mask.causal`: whether it
    lies inside the causal mask; methods then run their causal plan, which its block masks refine)."""
    from methods.masks import parse, plain

    masks = [parse(text, named) for text in sweep.mask] if sweep.mask else [plain(bool(c)) for c in sweep.causal]
    return [(m.causal, m.name) for m in masks]


def option_points(options: dict[str, Any]) -> list[dict[str, Any]]:
    """Method options with list values are axes: {ulysses_degree: [1, 2]} -> two option sets."""
    keys = sorted(options)
    values = [v if isinstance(v, (list, tuple)) else [v] for v in (options[k] for k in keys)]
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def to_dict(cfg: SuiteConfig) -> dict:
    """Plain dict of the config (for MLflow artifacts and workers)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]
