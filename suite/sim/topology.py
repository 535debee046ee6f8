"""Topologies for the simulator: documented, editable YAML files (configs/topologies/*.yaml).

A topology is one node type repeated `nodes` times (as many as a world size needs):

- `intra`: how the GPUs of a node talk, one of
  - `switch` (NVSwitch, or a host's loopback): each GPU has an egress and an ingress port of
    `port_GBps` that all its flows share; one flow is capped at `flow_GBps` (NCCL send/recv to a
    single peer does not fill the port); optionally every flow of the node shares `fabric_GBps`;
  - `mesh` (MI300X xGMI): one link of `link_GBps` per ordered pair, and optionally a per-GPU
    aggregate `gpu_GBps` each way that all of a GPU's links share (an all-to-all does not reach
    seven times one link);
  - `pcie`: a PCIe tree, every link full duplex (each direction its own capacity): GPUs under
    PCIe switches (`gpus_per_switch`), each with its own x16 link (`gpu_GBps` up and down); traffic
    between switches, or all traffic when `p2p: false` (host-staged), also crosses the switch
    uplinks (`switch_GBps` each way) and the host bridge between the two switches' CPU sockets
    (`host_GBps` per direction and ordered socket pair; `switches_per_socket`, default all on one
    socket); a node's NICs hang off its PCIe switches (NIC k under the switch of its first GPU), so
    inter-node traffic crosses the GPU's own x16 link, and the uplinks when GPU and NIC sit under
    different switches;
  and `latency_us` per message.
- `inter` (nodes > 1): one NIC per GPU (rail-optimised; or per `gpus_per_nic` GPUs), `nic_GBps`
  each way, `latency_us`.
- `overlap` (optional): what communication costs the computation beside it. `compute_slowdown`:
  a kernel runs (1 + s) times slower while its rank has a flow of its own in flight (NCCL's
  channels hold SMs and its copies take HBM bandwidth); `sync_us`: one cross-stream event
  dependency, paid twice per exchange (the communication stream waits for the compute stream
  before its flows start; the compute stream waits for the communication stream at `Wait`).
  Both default to 0 (a host topology, where gloo runs on CPU threads without streams). A value
  measured on the device (`python -m suite calibrate`) replaces the sourced one: write it here.
- `compute`: the tile model (`peak_tflops` per dtype, `sms`, `kernel` and each generation's tiles
  and published throughput under `kernels`, `launch_us`; suite/sim/compute.py), or a `table` of
  measured block times (`python -m suite calibrate`); `shared_cores` when the
  ranks share CPU cores instead of owning a GPU each; `host_sync_us`: what the device idles each
  time the code makes the host wait for it (suite/sim/engine.py `HostSync`; default 0).
- `host` (optional): what issuing each traced op costs the host that drives the GPU, in µs:
  `kernel_us` per block-kernel call, `op_us` per aten op of the method's own tensor work, `comm_us`
  per send, receive or collective call, `wait_us` per wait; the device cannot start an op before
  its host has issued it (suite/sim/engine.py). Default 0 (free: a host topology's ranks are the
  host itself, timed as a whole by calibrate).

- `fitted_from` (optional): the published validation sources (a validation file's `source.id`,
  configs/validate/) some figure of the file was derived from, each with what: `suite validate`
  then does not count that source's rows on this topology in its leave-one-source-out error (a
  model fitted on them cannot predict them blind), and refuses a source named here none of whose
  rows says `calibrates: true`. Hardware figures should come from micro-benchmarks instead.

GB/s are 1e9 bytes per second, one direction. Every number in the shipped files carries its
source in a comment, tagged [P] (a primary source: the vendor's or the library's own
document or code), [S] (a secondary source), [D] (derived by arithmetic from cited numbers) or
[assumed].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from suite.bundled import TOPOLOGIES

FABRICS = ("switch", "mesh", "pcie")
HOST_KEYS = ("kernel_us", "op_us", "comm_us", "wait_us")
GB = 1e9


class TopologyError(ValueError):
    """A topology file that cannot be used, with the key to fix."""


def available_topologies() -> list[str]:
    return sorted(p.stem for p in TOPOLOGIES.glob("*.yaml"))


def topology_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    q = TOPOLOGIES / f"{name_or_path}.yaml"
    if q.is_file():
        return q
    raise TopologyError(
        f"unknown topology {name_or_path!r}: give a YAML file or one of {available_topologies()} (in {TOPOLOGIES})"
    )


def load_topology(name_or_path: str) -> "Topology":
    """A topology by name or file; `NAME:KERNEL` (e.g. `h100_sxm:torch_flash`) is that topology with
    its block kernel's generation swapped for another it lists under `compute.kernels`, named so."""
    base, _, kernel = str(name_or_path).rpartition(":")
    if not base or "/" in kernel or kernel.endswith((".yaml", ".yml")):
        base, kernel = str(name_or_path), ""
    path = topology_path(base)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise TopologyError(f"{path}: not valid YAML: {exc}") from None
    if kernel:
        listed = sorted(((raw or {}).get("compute") or {}).get("kernels") or {})
        if kernel not in listed:
            raise TopologyError(
                f"topology {name_or_path!r}: {base} lists no kernel {kernel!r} under compute.kernels; "
                f"choose one of {listed}"
            )
        raw = {**raw, "name": f"{raw.get('name', base)}:{kernel}", "compute": {**raw["compute"], "kernel": kernel}}
    return Topology.from_dict(raw, source=path)


def _num(d: dict, key: str, where: str, *, optional: bool = False) -> Optional[float]:
    v = d.get(key)
    if v is None:
        if optional:
            return None
        raise TopologyError(f"{where}.{key} is missing")
    if not isinstance(v, (int, float)) or v <= 0:
        raise TopologyError(f"{where}.{key} must be a positive number, got {v!r}")
    return float(v)


@dataclass
class Topology:
    name: str
    gpu: str
    gpus_per_node: int
    max_nodes: int
    intra: dict
    inter: Optional[dict]
    compute: dict
    source: Optional[Path] = None
    overlap: dict = field(default_factory=dict)
    fitted_from: dict = field(default_factory=dict)  # validation source id -> what was derived from it
    host: dict = field(default_factory=dict)  # what issuing each op costs the host (suite/sim/engine.py)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: Optional[Path] = None) -> "Topology":
        where = str(source or "topology")
        if not isinstance(d, dict):
            raise TopologyError(f"{where}: expected a mapping")
        for k in ("name", "gpu", "gpus_per_node", "intra", "compute"):
            if k not in d:
                raise TopologyError(f"{where}: key {k!r} is missing")
        t = cls(
            name=str(d["name"]),
            gpu=str(d["gpu"]),
            gpus_per_node=int(d["gpus_per_node"]),
            max_nodes=int(d.get("max_nodes", 1)),
            intra=dict(d["intra"]),
            inter=dict(d["inter"]) if d.get("inter") else None,
            compute=dict(d["compute"]),
            source=source,
            overlap=dict(d.get("overlap") or {}),
            fitted_from=dict(d.get("fitted_from") or {}),
            host=dict(d.get("host") or {}),
        )
        t._validate(where)
        return t

    def _validate(self, where: str) -> None:
        kind = self.intra.get("kind")
        if kind not in FABRICS:
            raise TopologyError(f"{where}: intra.kind must be one of {list(FABRICS)}, got {kind!r}")
        need = {
            "switch": ("port_GBps", "flow_GBps"),
            "mesh": ("link_GBps",),
            "pcie": ("gpus_per_switch", "gpu_GBps", "switch_GBps", "host_GBps"),
        }[kind]
        for k in need + ("latency_us",):
            _num(self.intra, k, f"{where}: intra")
        _num(self.intra, "fabric_GBps", f"{where}: intra", optional=True)
        if kind == "mesh":
            _num(self.intra, "gpu_GBps", f"{where}: intra", optional=True)
        if kind == "pcie":
            spk = self.intra.get("switches_per_socket")
            if spk is not None and (isinstance(spk, bool) or not isinstance(spk, int) or spk < 1):
                raise TopologyError(f"{where}: intra.switches_per_socket must be an integer >= 1, got {spk!r}")
        for k in ("compute_slowdown", "sync_us"):
            v = self.overlap.get(k, 0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise TopologyError(f"{where}: overlap.{k} must be a number >= 0, got {v!r}")
        for k, v in self.host.items():
            if k not in HOST_KEYS:
                raise TopologyError(f"{where}: host.{k} is not a host cost; the keys are {', '.join(HOST_KEYS)}")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise TopologyError(f"{where}: host.{k} must be a number of microseconds >= 0, got {v!r}")
        if self.max_nodes > 1:
            if self.inter is None:
                raise TopologyError(
                    f"{where}: max_nodes is {self.max_nodes} but there is no inter section (nic_GBps, latency_us)"
                )
            for k in ("nic_GBps", "latency_us"):
                _num(self.inter, k, f"{where}: inter")

    # -- placement --------------------------------------------------------------------------------
    def nodes_for(self, world_size: int) -> int:
        return -(-world_size // self.gpus_per_node)

    def fits(self, world_size: int) -> tuple[bool, str]:
        n = self.nodes_for(world_size)
        if n > self.max_nodes:
            return False, (
                f"topology {self.name} has at most {self.max_nodes} node(s) of {self.gpus_per_node} "
                f"GPUs; world size {world_size} needs {n}"
            )
        return True, ""

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    @property
    def _inter(self) -> dict:
        """The inter section, which ranks on several nodes need (`validate` requires it for max_nodes > 1)."""
        assert self.inter is not None, "ranks on several nodes need the topology's inter section"
        return self.inter

    def nic(self, rank: int) -> int:
        """The NIC a rank's inter-node traffic leaves by (`inter.gpus_per_nic` GPUs share one)."""
        return rank // int(self._inter.get("gpus_per_nic", 1))

    # -- resources ----------------------------------------------------------------------------------
    def capacities(self, world_size: int) -> dict[tuple, float]:
        """Every shared resource of a world of `world_size` ranks and its capacity (bytes/s; compute
        in seconds of work per second)."""
        caps: dict[tuple, float] = {}
        i, kind = self.intra, self.intra["kind"]
        nodes = self.nodes_for(world_size)
        for g in range(world_size):
            if kind == "switch":
                caps[("out", g)] = caps[("in", g)] = i["port_GBps"] * GB
            elif kind == "mesh":
                for h in range(world_size):
                    if h != g and self.node(h) == self.node(g):
                        caps[("link", g, h)] = i["link_GBps"] * GB
                if i.get("gpu_GBps"):
                    caps[("out", g)] = caps[("in", g)] = i["gpu_GBps"] * GB
            else:
                caps[("up", g)] = caps[("down", g)] = i["gpu_GBps"] * GB
            if nodes > 1:
                caps[("nic_out", self.nic(g))] = caps[("nic_in", self.nic(g))] = self._inter["nic_GBps"] * GB
        for n in range(nodes):
            if i.get("fabric_GBps"):
                caps[("fabric", n)] = i["fabric_GBps"] * GB
            if kind == "pcie":
                switches = -(-self.gpus_per_node // int(i["gpus_per_switch"]))
                for s in range(switches):
                    caps[("sw_up", n, s)] = caps[("sw_down", n, s)] = i["switch_GBps"] * GB
                sockets = range(self._socket(switches - 1) + 1)
                for a in sockets:
                    for b in sockets:
                        caps[("host", n, a, b)] = i["host_GBps"] * GB
        cores = self.compute.get("shared_cores")
        if cores:
            caps[("cores",)] = float(cores)
        else:
            for g in range(world_size):
                caps[("gpu", g)] = 1.0
        return caps

    def compute_resource(self, rank: int) -> tuple[tuple, float]:
        """(resources, cap) of one rank's compute: its GPU, or one of the shared cores."""
        if self.compute.get("shared_cores"):
            return (("cores",),), 1.0
        return (("gpu", rank),), 1.0

    # -- the PCIe tree -----------------------------------------------------------------------------
    def _switch(self, rank: int) -> int:
        """The PCIe switch a GPU (by its rank) sits under, within its node."""
        return (rank % self.gpus_per_node) // int(self.intra["gpus_per_switch"])

    def _socket(self, switch: int) -> int:
        return switch // int(self.intra.get("switches_per_socket") or 1 << 30)

    def _between_switches(self, n: int, a: int, b: int, staged: bool = False) -> tuple:
        """PCIe resources from switch a to switch b of node n, each link in its own direction: up a's
        uplink, across the host bridge between their sockets, down b's uplink. Nothing when a == b and
        the switch routes peer to peer (`staged`: host-staged copies go up through the host even then)."""
        if a == b and not staged:
            return ()
        return (("sw_up", n, a), ("host", n, self._socket(a), self._socket(b)), ("sw_down", n, b))

    def _nic_switch(self, nic: int) -> int:
        """The switch a NIC hangs off: that of the first GPU it serves."""
        return self._switch(nic * int(self._inter.get("gpus_per_nic", 1)))

    def path(self, src: int, dst: int) -> tuple[tuple, float, float]:
        """(resources a flow src -> dst crosses, its own rate cap in bytes/s, latency in s)."""
        i, kind = self.intra, self.intra["kind"]
        if self.node(src) != self.node(dst):
            cap = self._inter.get("flow_GBps", self._inter["nic_GBps"]) * GB
            res: tuple = (("nic_out", self.nic(src)), ("nic_in", self.nic(dst)))
            if kind == "pcie":  # GPU -> (its switch ->) NIC, over the network, NIC (-> switch) -> GPU
                n_s, n_d = self.node(src), self.node(dst)
                res = (
                    (("up", src),)
                    + self._between_switches(n_s, self._switch(src), self._nic_switch(self.nic(src)))
                    + res
                    + self._between_switches(n_d, self._nic_switch(self.nic(dst)), self._switch(dst))
                    + (("down", dst),)
                )
            return res, cap, self._inter["latency_us"] * 1e-6
        n = self.node(src)
        lat = i["latency_us"] * 1e-6
        extra = (("fabric", n),) if i.get("fabric_GBps") else ()
        if kind == "switch":
            return (("out", src), ("in", dst)) + extra, i["flow_GBps"] * GB, lat
        if kind == "mesh":
            port = (("out", src), ("in", dst)) if i.get("gpu_GBps") else ()
            return (("link", src, dst),) + port + extra, i["link_GBps"] * GB, lat
        staged = not i.get("p2p", True)
        res = (
            (("up", src),) + self._between_switches(n, self._switch(src), self._switch(dst), staged) + (("down", dst),)
        )
        return res + extra, i.get("flow_GBps", i["gpu_GBps"]) * GB, lat
