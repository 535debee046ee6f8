"""The method registry: names -> method classes, with clear errors for unknown names/options."""

from __future__ import annotations

import importlib
from typing import Iterable

from methods.base import Method, option_names

_REGISTRY: dict[str, type[Method]] = {}
# Methods whose module could not register them here (e.g. a peer library that is not installed):
# name -> reason. `suite list` shows them; asking for one gives the reason instead of a KeyError.
_UNAVAILABLE: dict[str, str] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: add a Method subclass under `cls.name`. A duplicate name raises."""
    name = getattr(cls, "name", None)
    if not name:
        raise ValueError(f"{cls.__qualname__} needs a `name` to be registered")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"method {name!r} is already registered by {_REGISTRY[name].__module__}")
    _REGISTRY[name] = cls
    _UNAVAILABLE.pop(name, None)
    return cls


def register_unavailable(name: str, reason: str) -> None:
    """Record a method that exists but cannot be registered here, and why."""
    if name not in _REGISTRY:
        _UNAVAILABLE[name] = reason


def available() -> list[str]:
    """Names of every registered (runnable-here-in-principle) method, sorted."""
    return sorted(_REGISTRY)


def unavailable() -> dict[str, str]:
    """Methods known but not registered on this machine, with the reason."""
    return dict(_UNAVAILABLE)


# Names in a method list that stand for several methods, expanded from the registry (a method
# registered tomorrow joins every sweep that asks for its group). The single-device baseline
# `reference` is in none: it is not a sequence-parallel method, and a sweep names it itself.
GROUPS = {
    "own": "every own sequence-parallel method (impl 'own')",
    "peers": "every wrapped peer library's method, registered here or not (an unavailable one is a recorded skip)",
    "all": "own and peers",
}


def group_members(group: str) -> list[str]:
    """The methods group `group` stands for, sorted."""
    if group not in GROUPS:
        raise KeyError(f"unknown method group {group!r}; groups: {', '.join(GROUPS)}")
    members = {n: cls for n, cls in _REGISTRY.items() if not cls.test_double}
    own = [n for n, cls in members.items() if cls.impl == "own" and not cls.single_device]
    peers = [n for n, cls in members.items() if cls.impl != "own"] + list(_UNAVAILABLE)
    return sorted({"own": own, "peers": peers, "all": own + peers}[group])


def expand_groups(names: Iterable[str]) -> list[str]:
    """`names` with every group replaced by its members, in order, each method once."""
    out: list[str] = []
    for name in names:
        for m in group_members(name) if name in GROUPS else [name]:
            if m not in out:
                out.append(m)
    return out


def method_class(name: str) -> type[Method]:
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _UNAVAILABLE:
        raise KeyError(f"method {name!r} is not available here: {_UNAVAILABLE[name]}")
    raise KeyError(f"unknown method {name!r}; registered methods: {', '.join(available())}")


def get_method(name: str, **options) -> Method:
    """Build method `name` with `options` (e.g. kernel="math", ulysses_degree=2)."""
    cls = method_class(name)
    allowed = option_names(cls)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"method {name!r} has no option(s) {unknown}; its options are {allowed}")
    return cls(**options)


def load_plugins(modules: Iterable[str]) -> None:
    """Import user modules that register extra methods (config key `run.plugins`)."""
    for mod in modules:
        try:
            importlib.import_module(mod)
        except Exception as exc:  # a plugin is user code: its own error, its syntax, a duplicate name
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise ImportError(f"plugin module {mod!r} could not be imported: {type(exc).__name__}: {first}") from exc
