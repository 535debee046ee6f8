"""The rules a config's values must meet beyond their types (ranges, choices, names), each
failure a ConfigError naming the key and the fix; and the method groups of `sweep.methods`."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

from suite import metrics as M
from suite.config.schema import (
    AXES,
    BACKENDS,
    DEVICES,
    EXECUTORS,
    KINDS,
    MAX_NAME,
    MAX_REPEATS,
    MAX_SEED,
    MAX_SEQ_LEN,
    MAX_THREAD_RANKS,
    MAX_TIMEOUT_S,
    PASSES,
    ConfigError,
    SuiteConfig,
    SweepConfig,
    option_points,
)


def _require(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {message}")


def _choice(value: Any, key: str, allowed: tuple) -> None:
    _require(value in allowed, key, f"{value!r} is not allowed; choose one of {list(allowed)}")


def validate(cfg: SuiteConfig) -> None:
    """Check values the schema types cannot (ranges, choices, names), after expanding the method
    groups in place (expand_method_groups). Raises ConfigError."""
    import methods
    from methods.base import DTYPES
    from methods.kernels import KERNEL_CHOICES

    _require(
        bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", cfg.name or "")),
        "name",
        f"{cfg.name!r} must be letters, digits, '-', '_' or '.' (it names a folder)",
    )
    _require(
        len(cfg.name) <= MAX_NAME,
        "name",
        f"is {len(cfg.name)} characters; at most {MAX_NAME} (it names a "
        f"folder and an MLflow experiment): use a shorter name",
    )
    expand_method_groups(cfg)  # imports run.plugins first
    s, r = cfg.sweep, cfg.run
    known = set(methods.available()) | set(methods.unavailable())
    _validate_axes(s)
    for m in s.methods:
        _require(
            m in known,
            "sweep.methods",
            f"unknown method {m!r}; registered methods: {', '.join(sorted(known))}; groups: "
            f"{', '.join(methods.GROUPS)}",
        )
    for v in s.seq_len:
        _require(
            v <= MAX_SEQ_LEN,
            "sweep.seq_len",
            f"{v} tokens is more than {MAX_SEQ_LEN} (2**31 - 1: flash-attn indexes a sequence with int32 "
            f"offsets, and the check and simulator grow with the length); use a shorter sequence",
        )
    for d in s.dtype:
        _choice(d, "sweep.dtype", tuple(DTYPES))
    for p in s.passes:
        _choice(p, "sweep.passes", PASSES)
    option_keys = {k for opts in s.method_options.values() for k in opts}
    for i, rule in enumerate(s.exclude):
        _require(bool(rule), f"sweep.exclude[{i}]", "an empty rule would exclude everything")
        for k in rule:
            _require(
                k in AXES or k in option_keys,
                f"sweep.exclude[{i}]",
                f"unknown axis {k!r}; axes are {list(AXES)} and the options in sweep.method_options",
            )
    for m, opts in s.method_options.items():
        # options of a known method the sweep does not run apply to nothing: narrowing a config's
        # methods (sweep.methods=[ring] on h100_sweep, whose file sets yunchang_usp's) is no error.
        # Their values are still checked below, so a typo in a config file is caught on every run.
        _require(
            m in s.methods or m in known,
            "sweep.method_options",
            f"options for {m!r}, which is no method; registered methods: {sorted(known)}",
        )
        if m in methods.available():
            from methods.base import option_names

            allowed = option_names(methods.method_class(m))
            for k, v in opts.items():
                _require(
                    k in allowed and k != "kernel",
                    f"sweep.method_options.{m}",
                    f"unknown option {k!r}; options of {m}: {[a for a in allowed if a != 'kernel']} "
                    f"(the kernel is run.kernel)",
                )
                if isinstance(v, (list, tuple)):
                    _require(
                        len(v) > 0 and len(set(map(repr, v))) == len(v),
                        f"sweep.method_options.{m}.{k}",
                        f"a list of values is an axis and needs distinct values; got {list(v)}",
                    )
            for point in option_points(dict(opts)):  # every value must build the method
                try:
                    methods.get_method(m, **point)
                except (TypeError, ValueError) as exc:
                    raise ConfigError(f"sweep.method_options.{m}: {exc}") from None
    _choice(r.executor, "run.executor", EXECUTORS)
    _choice(r.device, "run.device", DEVICES)
    _choice(r.backend, "run.backend", BACKENDS)
    _choice(r.kernel, "run.kernel", KERNEL_CHOICES)
    _require(0 <= r.warmup <= MAX_REPEATS, "run.warmup", f"must be between 0 and {MAX_REPEATS}, got {r.warmup}")
    _require(
        1 <= r.repeats <= MAX_REPEATS,
        "run.repeats",
        f"must be between 1 and {MAX_REPEATS} (every sample is stored with its row), got {r.repeats}",
    )
    _require(
        0 <= r.seed <= MAX_SEED,
        "run.seed",
        f"must be between 0 and 2**63 - 1 (numpy's generators take no negative seed), got {r.seed}",
    )
    if r.executor == "threads":
        big = [p for p in s.world_size if p > MAX_THREAD_RANKS]
        _require(
            not big,
            "sweep.world_size",
            f"{big[0] if big else 0} virtual ranks with run.executor=threads; at most {MAX_THREAD_RANKS} (every "
            f"rank is a thread of one process, with its own tensors and CPU thread pool): use run.executor=dist "
            f"or sim for more ranks",
        )
    _require(r.check_max_seq_len >= 1, "run.check_max_seq_len", "must be >= 1")
    _require(
        math.isfinite(r.device_memory_gb) and r.device_memory_gb >= 0,
        "run.device_memory_gb",
        f"must be a finite number of GB >= 0 (0: detected from the device), got {r.device_memory_gb}",
    )
    for k in ("timeout_s", "startup_timeout_s", "prepare_timeout_s", "fail_grace_s"):
        v = getattr(r, k)  # inf or NaN would overflow the waits (OverflowError) or never time out
        _require(
            math.isfinite(v) and 0 <= v <= MAX_TIMEOUT_S and (v > 0 or k == "fail_grace_s"),
            f"run.{k}",
            f"must be a finite number of seconds, {'>=' if k == 'fail_grace_s' else '>'} 0 and at most "
            f"{MAX_TIMEOUT_S} (a week), got {v}",
        )
    _require(
        math.isfinite(r.max_ranks_per_core) and r.max_ranks_per_core > 0,
        "run.max_ranks_per_core",
        f"must be a finite number > 0, got {r.max_ranks_per_core}",
    )
    _require(r.threads_per_rank >= 0, "run.threads_per_rank", "must be >= 0 (0 = automatic)")
    _require(r.max_trials >= 1, "run.max_trials", f"must be >= 1, got {r.max_trials}")
    if r.backend == "nccl":
        _require(r.device != "cpu", "run.backend", "nccl needs run.device cuda (or auto on a GPU machine)")
    _require(bool(cfg.results.root), "results.root", "must be a folder path")
    cfg.results.root = _expand_path(cfg.results.root, "results.root")
    _validate_documents(cfg)
    _validate_masks(cfg)
    _choice(cfg.kind, "kind", KINDS)
    if cfg.kind == "perplexity":
        from suite.perplexity.config import problems

        problem = next(problems(cfg.perplexity, cfg.sweep.causal, cfg.sweep.mask, cfg.masks), None)
        if problem is not None:
            raise ConfigError(f"{problem[0]}: {problem[1]}")
        # the trained model takes a value head dim (its wv and wo projections) but no cap
        # (suite/perplexity/model.py)
        _require(not any(s.softcap), "sweep.softcap", "a perplexity check trains a model without a logit cap; use [0]")
    if r.executor == "sim":
        _validate_sim(cfg)


def _validate_axes(s: SweepConfig) -> None:
    """Every sweep list of suite.metrics.TRIAL_AXES: at least one value, no value twice, bools true
    or false, numbers finite and at least the axis's minimum (or null where null is a value). The
    mask list (empty: the `causal` axis) is `_validate_masks`'s: each name is parsed there."""
    for a in M.TRIAL_AXES:
        if not a.sweep or a.sweep == "mask":
            continue
        key, values = f"sweep.{a.sweep}", getattr(s, a.sweep)
        means = f" ({a.means})" if a.means else ""
        _require(len(values) > 0, key, f"needs at least one value{means}")
        seen = [v if v is None or a.type is str else a.type(v) for v in values]
        _require(len(set(map(str, seen))) == len(values), key, f"has duplicates: {values}")
        for v in values:
            if v is None:
                _require(a.nullable, key, f"null is not a value here; got {values}")
            elif a.type is bool:
                _require(isinstance(v, bool), key, f"values must be true or false, got {v!r}")
            elif a.minimum is not None:
                _require(
                    math.isfinite(v) and v >= a.minimum,
                    key,
                    f"values must be {'finite and ' if a.type is float else ''}>= {a.minimum:g}"
                    f"{means}, got {v}" + (f"; {a.example}" if a.example else ""),
                )


def _validate_masks(cfg: SuiteConfig) -> None:
    """sweep.mask names and the masks: section: each parses (known family, known parameters, sizes
    >= 1 token or fractions in (0, 1)), and fits a uniform sequence of every length (a prefix longer
    than the sequence is refused here; packed documents are checked when their lengths are drawn)."""
    from methods.masks import parse

    for name, entry in cfg.masks.items():
        _require(
            bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name)) and ":" not in name,
            f"masks.{name}",
            "names are letters, digits, '-', '_' or '.'",
        )
        _require(isinstance(entry, dict) or hasattr(entry, "items"), f"masks.{name}", "must be a mapping")
        try:
            parse(name, cfg.masks)
        except ValueError as exc:
            raise ConfigError(f"masks.{name}: {exc}") from None
    canonical: dict[str, str] = {}  # a mask's canonical name -> the first spelling that named it
    for i, text in enumerate(cfg.sweep.mask):
        try:
            m = parse(text, cfg.masks)
        except ValueError as exc:
            raise ConfigError(f"sweep.mask[{i}]: {exc}") from None
        # two spellings of one mask (`sliding_window:4`, `sliding_window:window=4`) would plan every
        # trial of it twice
        _require(
            m.name not in canonical or canonical[m.name] == text,
            f"sweep.mask[{i}]",
            f"{text!r} is the mask {canonical.get(m.name)!r} names already ({m.name}); list it once",
        )
        canonical.setdefault(m.name, text)
        if "uniform" in cfg.sweep.workload:
            for n in cfg.sweep.seq_len:
                try:
                    m.slices(n)
                except ValueError as exc:
                    raise ConfigError(f"sweep.mask[{i}]: {exc} (sweep.seq_len {n})") from None
    names = [m for m in cfg.sweep.mask]
    _require(len(set(names)) == len(names), "sweep.mask", f"lists a mask twice: {names}")


def _validate_documents(cfg: SuiteConfig) -> None:
    from suite.lengths import UNIFORM, Distribution, LengthsError

    dists = {}
    for name, d in cfg.documents.items():
        _require(
            bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name)) and name != UNIFORM,
            f"documents.{name}",
            "names are letters, digits, '-', '_' or '.', and not 'uniform' (the unpacked workload)",
        )
        try:
            dists[name] = Distribution.from_config(name, dataclasses.asdict(d))
            for seq_len in cfg.sweep.seq_len:  # every distribution must fill every sequence
                dists[name].draw(seq_len, 1, cfg.run.seed)
        except LengthsError as exc:
            raise ConfigError(str(exc)) from None
    for w in cfg.sweep.workload:
        _require(
            w == UNIFORM or w in dists,
            "sweep.workload",
            f"unknown workload {w!r}: use 'uniform' or a name defined under documents: "
            f"({', '.join(sorted(dists)) or 'none defined'})",
        )


def _validate_sim(cfg: SuiteConfig) -> None:
    from suite.sim.compute import ComputeModel
    from suite.sim.topology import TopologyError, load_topology

    _require(
        cfg.kind == "attention",
        "run.executor",
        "sim predicts attention trials; a perplexity check trains a model and needs dist or threads",
    )
    _require(len(cfg.sim.topology) > 0, "sim.topology", "needs at least one topology")
    names = []
    for t in cfg.sim.topology:
        try:
            topo = load_topology(t)
            ComputeModel(topo)
        except TopologyError as exc:
            raise ConfigError(f"sim.topology: {exc}") from None
        names.append(topo.name)
    _require(
        len(set(names)) == len(names),
        "sim.topology",
        f"topology names must differ (they name the trials); got {names}: change `name:` in the copied file",
    )


def _expand_path(path: str, key: str) -> str:
    """`path` with `~` and environment variables ($HOME, ${HOME}) expanded, as a shell would; a
    variable that is not set is a ConfigError naming `key` (a folder literally named `$HOME` is
    never what was meant)."""
    expanded = os.path.expanduser(os.path.expandvars(path))
    unset = re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", expanded)
    _require(
        not unset,
        key,
        f"{path!r} names the environment variable {unset[0] if unset else ''} that is not set here: "
        "set it, or give the folder itself",
    )
    return expanded


def expand_method_groups(cfg: SuiteConfig) -> None:
    """Replace the method groups of `sweep.methods` and of the exclude rules' `method` values by the
    registered names they stand for (methods.registry.GROUPS: `own`, `peers`, `all`), in place, after
    `run.plugins` are imported, so the saved config names every method that ran and a new method
    joins every sweep that asks for its group."""
    import methods

    try:
        methods.load_plugins(cfg.run.plugins)
    except ImportError as exc:
        raise ConfigError(f"run.plugins: {exc}") from None
    named = [str(m) for m in cfg.sweep.methods]
    twice = sorted({m for m in named if named.count(m) > 1})
    # as every other axis: a method named twice would run once, which the config does not say (a
    # group that holds a named method, `[own, ring]`, is a union and stays one)
    _require(not twice, "sweep.methods", f"names {twice} more than once: {named}; name each method once")
    cfg.sweep.methods = methods.expand_groups(cfg.sweep.methods)
    for rule in cfg.sweep.exclude:
        if "method" in rule:
            value = rule["method"]
            names = methods.expand_groups(value if isinstance(value, (list, tuple)) else [value])
            rule["method"] = names if isinstance(value, (list, tuple)) or len(names) != 1 else names[0]
