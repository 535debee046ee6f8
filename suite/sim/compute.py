"""Compute time of one traced block (`Compute` event) on a topology's GPU.

Two sources, per topology (`compute:` section of its YAML):

- a measured table (`table: file.yaml`, written by `python -m suite calibrate` on the real device):
  a block found in it takes its measured time; any other block takes its FLOPs at the achieved
  rate interpolated (in log FLOPs) between measured blocks of the same op, mask class, head dim
  and dtype;
- otherwise a roofline: FLOPs / (peak x efficiency) + launch, with efficiency interpolated (in log
  tokens) from the topology's table by the block's size sqrt(sq x sk), a full-mask and a
  causal-mask curve per op (flash-attention's published curves).

Blocks that see no key cost nothing (the methods skip the kernel for them). The methods' own
tensor work between blocks (`Memory` events) costs `op_us` per operation plus its bytes at
`mem_GBps`: measured by calibrate (the table's `memory` section) or the topology's figures.
"""

from __future__ import annotations

import bisect
import math
from pathlib import Path

import yaml

from suite.sim.topology import Topology, TopologyError
from suite.sim.trace import Compute, Memory


def mask_class(e: Compute) -> str:
    if e.pairs == 0:
        return "empty"
    return "full" if e.pairs == e.sq * e.sk else "masked"


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear interpolation, clamped to the end values."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    j = bisect.bisect_right(xs, x)
    t = (x - xs[j - 1]) / (xs[j] - xs[j - 1])
    return ys[j - 1] + t * (ys[j] - ys[j - 1])


class ComputeModel:
    def __init__(self, topology: Topology):
        self.topology = topology
        c = topology.compute
        self.launch_s = float(c.get("launch_us", 0.0)) * 1e-6
        self.peak = {k: float(v) * 1e12 for k, v in (c.get("peak_tflops") or {}).items()}
        self.eff = c.get("efficiency")
        self.log_tokens = [math.log(t) for t in self.eff["tokens"]] if self.eff else []
        self.table: dict[Compute, float] = {}
        self.rates: dict[tuple, tuple[list[float], list[float]]] = {}
        self.source = f"roofline {topology.gpu}"
        self.mem_Bps = float(c.get("mem_GBps", 0.0)) * 1e9
        self.op_s = float(c.get("op_us", 0.0)) * 1e-6
        if c.get("table"):
            path = Path(c["table"])
            if not path.is_absolute() and topology.source is not None:
                path = topology.source.parent / path
            self._load_table(path)
            self.source = f"measured table {path.name}"
        elif not self.peak or not self.eff:
            raise TopologyError(f"topology {topology.name}: compute needs peak_tflops and efficiency, or a table")

    def _load_table(self, path: Path) -> None:
        if not path.is_file():
            raise TopologyError(
                f"topology {self.topology.name}: compute table {path} not found "
                f"(write it with `python -m suite calibrate`)"
            )
        data = yaml.safe_load(path.read_text()) or {}
        mem = data.get("memory") or {}
        if mem:
            self.mem_Bps, self.op_s = float(mem["GBps"]) * 1e9, float(mem["op_us"]) * 1e-6
        by_class: dict[tuple, list[tuple[float, float]]] = {}
        for b in data.get("blocks", []):
            e = Compute(
                b["op"],
                b["batch"],
                b["sq"],
                b["sk"],
                b["heads"],
                b["kv_heads"],
                b["head_dim"],
                b["causal_offset"],
                b["dtype"],
            )
            self.table[e] = float(b["seconds"])
            if e.pairs:
                by_class.setdefault((e.op, mask_class(e), e.head_dim, e.dtype), []).append(
                    (math.log(e.flops), e.flops / float(b["seconds"]))
                )
        for k, pts in by_class.items():
            pts.sort()
            self.rates[k] = ([p[0] for p in pts], [p[1] for p in pts])

    def supports(self, dtype: str, head_dim: int) -> tuple[bool, str]:
        if self.table:
            if any(k[2:] == (head_dim, dtype) for k in self.rates):
                return True, ""
            return False, f"the compute table of {self.topology.name} has no {dtype} blocks of head dim {head_dim}"
        if dtype not in self.peak:
            return False, f"topology {self.topology.name} gives no {dtype} rate for {self.topology.gpu}"
        return True, ""

    def time(self, e: Compute | Memory) -> float:
        if isinstance(e, Memory):
            return e.ops * self.op_s + (e.bytes / self.mem_Bps if self.mem_Bps else 0.0)
        if e.pairs == 0:
            return 0.0
        if self.table:
            hit = self.table.get(e)
            if hit is not None:
                return hit
            cls = (e.op, mask_class(e), e.head_dim, e.dtype)
            if cls not in self.rates:
                raise TopologyError(
                    f"compute table of {self.topology.name} has no {cls} blocks near {e}; calibrate with this sweep"
                )
            xs, ys = self.rates[cls]
            return e.flops / _interp(xs, ys, math.log(e.flops))
        eff = self.eff
        curve = eff[e.op] if mask_class(e) == "full" else eff.get(f"{e.op}_causal", eff[e.op])
        return self.launch_s + e.flops / (
            self.peak[e.dtype] * _interp(self.log_tokens, curve, 0.5 * math.log(e.sq * e.sk))
        )
