"""The simulator's validated error: how far its predictions fell from published measurements.

`python -m suite validate` (suite/sim_validation.py) simulates every published table of configs/validate/
and records, per family of rows, the mean, median and largest |error| in configs/validate/bands.yaml.
A family is what decides which part of the model a prediction leans on:

- bound: `kernel-bound` when the row's exposed communication (time - compute-only time) is under
  EXPOSED_SHARE of its time (the kernel model decides it), else `comm-bound` (the links and the
  overlap decide it);
- kind: the topology as the row's ranks see it: `switch` (NVSwitch), `mesh` (MI300X xGMI), `pcie`,
  `multi-node` (ranks on more than one node), or `host` (a calibrated CPU host whose ranks share
  its cores; no published table covers it).

- method: the method family whose schedule was simulated (`method_family`): a ring, Ulysses/USP, an
  all-gather of K/V, Burst, TASP, TokenRing, dispatch, or one GPU's kernel alone.

Every simulated row carries the band of its family (`sim_error_pct`, suite/metrics.py): the family's
mean |error| over its validated rows. A family with no validated row borrows nothing: its rows carry
no band and say "unvalidated" (suite/metrics.py `UNVALIDATED`) wherever a band would be shown
(simulated rows, the advisor, reports, MLflow). A band measured on one kind of hardware, method or
regime says nothing about another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from suite.bundled import CONFIGS

BANDS = CONFIGS / "validate" / "bands.yaml"
KERNEL_BOUND, COMM_BOUND = "kernel-bound", "comm-bound"
BOUNDS = (KERNEL_BOUND, COMM_BOUND)
KINDS = ("switch", "mesh", "pcie", "multi-node", "host")
# a row whose exposed communication is below this share of its time is kernel-bound (the advisor's
# "main cost" threshold, suite/advise/ranking.py)
EXPOSED_SHARE = 0.15


def topology_kind(topology, world_size: int) -> str:
    """The kind of fabric `world_size` ranks of `topology` (suite.sim.topology.Topology) talk over."""
    if topology.compute.get("shared_cores"):
        return "host"
    if topology.nodes_for(world_size) > 1:
        return "multi-node"
    return str(topology.intra["kind"])


def bound_of(time_ms: Optional[float], compute_only_ms: Optional[float]) -> str:
    """kernel-bound or comm-bound, from a row's time and its compute-only time."""
    if not time_ms or compute_only_ms is None:
        return COMM_BOUND
    return KERNEL_BOUND if (time_ms - compute_only_ms) / time_ms < EXPOSED_SHARE else COMM_BOUND


# Methods whose simulated schedules share what the simulator leans on (the same messages per step and
# the same overlap): a peer library's method joins the family of the own method it mirrors. A method
# not named here is a family of its own.
METHOD_FAMILIES = {
    "reference": "single-gpu",
    **dict.fromkeys(("ring", "zigzag_ring", "stripe_ring", "rfa_ring", "rfa_zigzag", "rfa_stripe"), "ring"),
    **dict.fromkeys(("ulysses", "usp", "yunchang_ulysses", "yunchang_usp", "torch_cp_alltoall"), "ulysses-usp"),
    **dict.fromkeys(("allgather_kv", "rfa_llama3", "torch_cp_allgather"), "allgather"),
}


def method_family(method: str) -> str:
    """The method family a simulated row of `method` is validated as (see METHOD_FAMILIES)."""
    return METHOD_FAMILIES.get(method, method)


def family(bound: str, kind: str, method: str = "") -> str:
    """A family's key: `bound/kind/method family` (`bound/kind` for a summary over every method)."""
    return f"{bound}/{kind}/{method_family(method)}" if method else f"{bound}/{kind}"


@dataclass
class Summary:
    """|error| statistics of a set of validated rows, in percent."""

    rows: int
    mean_abs_pct: float
    median_abs_pct: float
    max_abs_pct: float

    @classmethod
    def of(cls, errors_pct: list[float]) -> "Summary":
        a = sorted(abs(e) for e in errors_pct)
        if not a:
            raise ValueError("a summary needs at least one error")
        n = len(a)
        median = a[n // 2] if n % 2 else (a[n // 2 - 1] + a[n // 2]) / 2
        return cls(n, sum(a) / n, median, a[-1])

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "mean_abs_pct": round(self.mean_abs_pct, 2),
            "median_abs_pct": round(self.median_abs_pct, 2),
            "max_abs_pct": round(self.max_abs_pct, 2),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Summary":
        return cls(int(d["rows"]), float(d["mean_abs_pct"]), float(d["median_abs_pct"]), float(d["max_abs_pct"]))


@dataclass
class Bands:
    """The record: per family, per bound and over all rows; and the limits `suite validate --check`
    holds a new run to (kept when the record is rewritten, so that an integrator can tighten them)."""

    overall: Summary
    bounds: dict[str, Summary] = field(default_factory=dict)
    families: dict[str, Summary] = field(default_factory=dict)
    margin_pct: float = 2.0  # --check: the mean |error| may exceed the recorded one by this much
    row_limit_pct: float = 20.0  # --check: no row's |error| beyond this, unless the record lists it
    # The counted rows the record saw beyond the row limit ("table: label" -> |error|, percent): known
    # misses, listed in the record for anyone to read. --check holds each to its recorded |error| +
    # margin, so that a known miss neither hides a new one nor keeps the check red.
    over_limit: dict[str, float] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)  # date, command, code version, configs

    def band_pct(self, bound: str, kind: str, method: str) -> Optional[float]:
        """The error band (mean |error|, percent) a simulated row of this family carries; None when
        no validated row is of its family (the row is unvalidated: no band is borrowed from another)."""
        exact = self.families.get(family(bound, kind, method))
        return None if exact is None else exact.mean_abs_pct

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.meta,
            "check": {"margin_pct": self.margin_pct, "row_limit_pct": self.row_limit_pct},
            "overall": self.overall.to_dict(),
            "bounds": {k: v.to_dict() for k, v in self.bounds.items()},
            "families": {k: v.to_dict() for k, v in sorted(self.families.items())},
            **({"over_limit": dict(sorted(self.over_limit.items()))} if self.over_limit else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Bands":
        check = d.get("check") or {}
        meta = {k: v for k, v in d.items() if k not in ("check", "overall", "bounds", "families", "over_limit")}
        return cls(
            overall=Summary.from_dict(d["overall"]),
            bounds={k: Summary.from_dict(v) for k, v in (d.get("bounds") or {}).items()},
            families={k: Summary.from_dict(v) for k, v in (d.get("families") or {}).items()},
            margin_pct=float(check.get("margin_pct", 2.0)),
            row_limit_pct=float(check.get("row_limit_pct", 20.0)),
            over_limit={str(k): float(v) for k, v in (d.get("over_limit") or {}).items()},
            meta=meta,
        )


def load_bands(path: Optional[Path] = None) -> Optional[Bands]:
    """The record at `path` (default: the bundled configs/validate/bands.yaml), or None when there is
    none yet or it cannot be read (a simulated row then carries no band; nothing fails)."""
    path = Path(path) if path is not None else BANDS
    try:
        raw = yaml.safe_load(path.read_text())
        return Bands.from_dict(raw) if isinstance(raw, dict) and raw.get("overall") else None
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return None


def write_bands(bands: Bands, path: Optional[Path] = None, header: str = "") -> Path:
    path = Path(path) if path is not None else BANDS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(bands.to_dict(), sort_keys=False))
    return path
