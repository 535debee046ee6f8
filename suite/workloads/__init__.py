"""Workloads by the config's `kind` (suite/workloads/base.py describes the seam)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from suite.workloads.base import RankContext, Workload

if TYPE_CHECKING:
    from suite.config import SuiteConfig

__all__ = ["RankContext", "Workload", "make_workload", "workload_class"]


def workload_class(kind: str) -> type[Workload]:
    """The class of workload `kind` (a value of the config's `kind`, see suite.config.KINDS)."""
    if kind == "attention":
        from suite.workloads.attention import AttentionWorkload

        return AttentionWorkload
    if kind == "perplexity":  # imported on demand: it loads the model and its corpus code
        from suite.workloads.perplexity import PerplexityWorkload

        return PerplexityWorkload
    if kind == "probe":  # the option-flip and repeat checks' runs (suite/flips.py), never a config's kind
        from suite.workloads.probe import ProbeWorkload

        return ProbeWorkload
    raise KeyError(f"unknown workload kind {kind!r}")


def make_workload(kind: str, cfg: Optional["SuiteConfig"] = None) -> Workload:
    return workload_class(kind)(cfg)
