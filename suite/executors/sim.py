"""The `sim` executor: a sweep's trials predicted on topology models instead of run.

For each trial: the method's schedule (traced once per schedule shape, `TraceCache`) is replayed
on the trial's topology three times - as is, with free communication (compute-only) and with free
compute (comm-only) - and reported per rank exactly as a measured trial is (the attention
workload builds the row from the same `RankReport`s), so simulated rows carry the same columns:
time, bytes per rank, kernel time, time blocked on communication, CCR and overlap efficiency.
Nothing is checked numerically (a simulated row is `checked=false`) and every row says executor=sim.

Peer libraries are traced as they are written (suite/sim/peers.py): the executor builds their
adapters as the simulator's (`build_method`), so they answer `supports` for the GPU they would run
on; their kernels are trace stand-ins, which the rows' `kernel_used` says. A peer that cannot be
traced (torch's context_parallel) is a recorded skip with the reason.
Each row also carries the simulator's validated error for its family (`sim_error_pct`: kernel- or
comm-bound x topology kind x method family, from configs/validate/bands.yaml, written by `suite
validate`), or none when no published row of its family was validated: the row is "unvalidated".
"""

from __future__ import annotations

from typing import Optional

from suite.executors.base import Executor
from suite.plan import Place, TrialSpec
from suite.records import Breakdown, Outcome, RankReport, redundant_bytes
from suite.sim import peers
from suite.sim.bands import Bands, bound_of, load_bands, topology_kind
from suite.sim.compute import ComputeModel
from suite.sim.engine import replay
from suite.sim.topology import load_topology
from suite.sim.trace import TraceCache, one_torch_thread, traced_method


class SimExecutor(Executor):
    name = "sim"
    device = "cpu"  # traces run on meta tensors: the device here is irrelevant to what is predicted

    def __init__(self, topologies: list[str], timeout_s: float = 120.0):
        self.topologies = {}
        for t in topologies:
            topo = load_topology(t)
            self.topologies[topo.name] = (topo, ComputeModel(topo))
        self.traces = TraceCache(timeout_s)  # run.timeout_s bounds each trace
        self.bands = load_bands()

    def places(self) -> list[Place]:
        """One set of trials per topology, each with its GPU and node count."""
        return [Place(topo.gpu, topo.name, topo.nodes_for) for topo, _ in self.topologies.values()]

    def build_method(self, spec: TrialSpec):
        """The method as the tracer runs it: a peer adapter made the simulator's, or ValueError (a
        recorded skip) with why its library cannot be traced."""
        method = spec.build_method()
        if method.needs_processes:
            peers.prepare(method)
        return method

    def supports(self, spec: TrialSpec, method, workload) -> tuple[bool, str]:
        if method.needs_processes and not getattr(method, "simulated", False):  # not built by build_method
            return False, f"{spec.method} calls torch.distributed itself and was not prepared for tracing"
        topo, compute = self.topologies[spec.topology]
        ok, why = topo.fits(spec.world_size)
        if not ok:
            return ok, why
        return compute.supports(spec.dtype, max(spec.head_dim, spec.head_dim_v or 0))  # kernels run the wider

    def run(self, spec: TrialSpec) -> Outcome:
        try:
            with one_torch_thread():  # tracing computes nothing: torch's thread pool only costs CPU
                return Outcome("reported", predict(spec, *self.topologies[spec.topology], self.traces, self.bands))
        except Exception as exc:  # noqa: BLE001 - a trace that hangs or breaks is this trial's failure, not the sweep's
            return Outcome("failed", [], f"simulation failed: {type(exc).__name__}: {exc}")


def predict(
    spec: TrialSpec, topology, compute: ComputeModel, traces: TraceCache, bands: Optional[Bands] = None
) -> list[RankReport]:
    """Per-rank reports of one simulated trial, as a measured trial's ranks would report it, each
    with the error band of the trial's family (None without a record)."""
    method = traced_method(spec.method, {"kernel": spec.kernel, **spec.method_options})
    case = spec.run_case(method)
    tr = traces.get(spec.method, case, spec.pass_, spec.method_options)
    # a peer's rows say whose code was traced and that its kernels were stand-ins
    traced = f"; traced {method.impl}, kernels: flash-attn trace stand-in" if method.needs_processes else ""
    full = replay(tr, topology, compute.time)
    comp = replay(tr, topology, compute.time, comm=False)
    comm = replay(tr, topology, compute.time, compute=False)
    forward = tr.forward_part()
    # the family as the row will show it: time and compute-only time are maxima over ranks
    bound = bound_of(full.time_s * 1e3, max(comp.end_s[r] for r in range(spec.world_size)) * 1e3)
    kind = topology_kind(topology, spec.world_size)
    # None: no published row of this family was validated; the row then says "unvalidated"
    band = bands.band_pct(bound, kind, spec.method) if bands is not None else None
    reports = []
    for r in range(spec.world_size):
        ledger = tr.ledger(r)  # what the counting comm of a measured trial reports
        # what a measured trial's pair-counting kernel reports: visible pairs x heads of the forward
        pairs = round(sum(c.pairs * c.batch * c.heads for c in forward.compute(r) if c.op == "fwd"))
        reports.append(
            RankReport(
                rank=r,
                checked=False,
                kernel_used=f"sim: {compute.source}{traced}",
                bytes_sent=ledger.bytes_sent,
                bytes_recv=ledger.bytes_recv,
                comm_ops=dict(sorted(ledger.counts().items())),
                samples_ms=[full.time_s * 1e3],
                peak_mem=None,
                pairs=pairs,
                sim_error_pct=band,
                redundant_bytes=redundant_bytes(method, case, r),
                padded_len=case.seq_len,
                breakdown=Breakdown(
                    iter_ms=full.end_s[r] * 1e3,
                    kernel_ms=full.kernel_s[r] * 1e3,
                    comm_wait_ms=full.blocked_s[r] * 1e3,
                    compute_only_ms=[comp.end_s[r] * 1e3],
                    comm_only_ms=[comm.end_s[r] * 1e3],
                ),
            )
        )
    return reports
