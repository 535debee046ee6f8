"""Loading a sweep config: a YAML file composed with Hydra's Compose API (so `defaults:` lists
work), merged into the schema, then command-line overrides in Hydra's grammar (`run.repeats=3`,
`sweep.seq_len=[512,1024]`, or the sweep form `sweep.seq_len=512,1024`); the result is validated."""

from __future__ import annotations

import dataclasses
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterable, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from suite.bundled import sweep_config, sweep_files
from suite.config.schema import ConfigError, SuiteConfig
from suite.config.validate import validate


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[SuiteConfig, str]:
    """Compose `path` with Hydra, validate it and apply `overrides`.

    Returns the typed config and its resolved YAML text (saved with the run).
    """
    path = sweep_config(path)  # a path, or a bundled sweep's name
    raw = _compose(path)
    cfg = _merge_schema(raw, str(path))
    for text in overrides:
        _apply_override(cfg, text)
    _anchor_files(cfg, path.resolve().parent)
    return _finish(cfg, str(path))


def _anchor_files(cfg: DictConfig, folder: Path) -> None:
    """A histogram `file` given as a relative path names a file beside the config (as Hydra reads a
    config's `defaults:`), not one under whatever folder the command runs from: where that file
    exists it becomes the absolute path, so every later reader (validation, planning, the saved
    config) finds the same file. Otherwise it stays as written (the current folder, then the
    histograms that ship with the suite, suite/lengths.py `histogram_path`)."""
    for entry in (cfg.get("documents") or {}).values():
        file = entry.get("file") if hasattr(entry, "get") else None
        if isinstance(file, str) and file and not Path(file).is_absolute() and (folder / file).is_file():
            entry["file"] = str(folder / file)


def bundled_configs() -> list[str]:
    """Names of the sweeps that ship with the suite (`python -m suite run quickstart`)."""
    return sorted(sweep_files())


def config_from_node(node: DictConfig | dict, source: str = "") -> tuple[SuiteConfig, str]:
    """A config composed elsewhere (the Hydra application, suite/hydra_app.py), validated as
    load_config validates a file: the same schema, the same errors naming the key."""
    raw = node if isinstance(node, DictConfig) else OmegaConf.create(node)
    if "hydra" in raw:
        raw = OmegaConf.masked_copy(raw, _keys(raw, ("hydra",)))
    return _finish(_merge_schema(raw, source), source)


# Top-level sections a sweep file may carry for a command other than the sweep itself, dropped
# before the schema sees them: `validation` holds a published table's values and their source
# (configs/validate/, read by `python -m suite validate`).
FOREIGN_SECTIONS = ("validation",)


def _keys(node: DictConfig, drop: Iterable[str]) -> list[Any]:
    """The keys of `node` but `drop`, as they are (omegaconf's keys need not be strings; masked_copy
    compares them as they are, though its annotation says list[str])."""
    drop = set(drop)
    return [k for k in node if k not in drop]


def _merge_schema(raw: DictConfig, source: str) -> DictConfig:
    if any(k in raw for k in FOREIGN_SECTIONS):
        raw = OmegaConf.masked_copy(raw, _keys(raw, FOREIGN_SECTIONS))
    schema = OmegaConf.structured(SuiteConfig)
    _lists_from_scalars(raw, SuiteConfig)
    try:
        return cast(DictConfig, OmegaConf.merge(schema, raw))  # a mapping merged onto the schema's mapping
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc, source=source)) from None


def _finish(cfg: DictConfig, source: str) -> tuple[SuiteConfig, str]:
    try:
        obj = cast(SuiteConfig, OmegaConf.to_object(cfg))  # a structured config's object is its dataclass
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc, source=source)) from None
    validate(obj)
    return obj, config_yaml(obj)


def config_yaml(cfg: SuiteConfig) -> str:
    """The resolved config as saved with a run (config.yaml, an MLflow artifact): the tracking URI
    redacted (suite.env.redact_uri), whichever way it was given, so no credential is ever stored."""
    from suite.env import redact_uri

    node = OmegaConf.structured(cfg)
    node.tracking.uri = redact_uri(cfg.tracking.uri)
    return OmegaConf.to_yaml(node, resolve=True)


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
        raise ConfigError(
            f"{source}: the YAML expands to {total} nodes through its aliases (at most "
            f"{MAX_YAML_NODES}); write the values out instead of repeating aliases"
        )


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
        elif (
            _list_field(schema, f.name)
            and not OmegaConf.is_list(value)
            and value is not None
            and not OmegaConf.is_missing(node, f.name)
            and node[f.name] is not None
        ):
            node[f.name] = [node[f.name]]


def _compose(path: Path) -> DictConfig:
    if not path.is_file():
        raise ConfigError(
            f"config file not found: {path}; give a path, or the name of a bundled sweep "
            f"({', '.join(bundled_configs())})"
        )
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
        cfg = OmegaConf.masked_copy(cfg, _keys(cfg, ("hydra",)))
    return cfg


def _apply_override(cfg: DictConfig, text: str) -> None:
    """One override in Hydra's grammar: `key=value` (a value where the schema has a list becomes a
    one-value list; `a,b` is a list), `+key=value` (add a key that is not there yet, e.g. a method's
    options or a documents entry), `++key=value` (add or replace) and `~key` (remove an entry of a
    dict section, or put a setting back to its default)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from suite.env import redact_text  # an override may carry a tracking URI's credentials

    try:
        (ov,) = OverridesParser.create().parse_overrides([text])
    except HydraException as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(
            redact_text(
                f"bad override {text!r}: {reason}. Use key=value, e.g. run.repeats=3 or sweep.seq_len=[512,1024] "
                f"(quote a value with '=' or '?' in it: tracking.uri='http://host/?a=b')"
            )
        ) from None
    key = ov.key_or_group
    exists = OmegaConf.select(cfg, key, default=_MISSING_KEY) is not _MISSING_KEY
    if ov.is_delete():
        _delete(cfg, key, text)
        return
    value = list(ov.sweep_iterator()) if ov.is_sweep_override() else ov.value()
    if ov.is_add() and exists:
        raise ConfigError(
            f"override {text!r}: {key!r} is already set; use {key}=... to change it (or ++{key}=... to add or replace)"
        )
    if not exists and not (ov.is_add() or ov.is_force_add()):
        raise ConfigError(
            _unknown_key_message(key)
            + (f" (to add an entry to a dict section, write +{key}=...)" if _in_dict_section(key) else "")
        )
    parts = key.split(".")
    schema = _schema_for(parts[:-1])
    if schema is not None and _list_field(schema, parts[-1]) and not isinstance(value, list) and value is not None:
        value = [value]
    try:
        OmegaConf.update(cfg, key, value, merge=False, force_add=not exists and _in_dict_section(key))
    except OmegaConfBaseException as exc:
        raise ConfigError(redact_text(f"override {text!r}: {_explain(exc)}")) from None


def _in_dict_section(key: str) -> bool:
    """Whether `key` lies under a free-form dict of the schema (method_options, documents)."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        schema = _schema_for(parts[: i - 1]) if i > 1 else SuiteConfig
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
