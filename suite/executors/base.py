"""The executor protocol: how a trial reaches its ranks, and what an executor cannot run.

Executors: `LocalDistExecutor` (worker processes on this machine), `TorchrunExecutor` (the
processes of an external launch, torchrun or SLURM), `ThreadExecutor` (virtual ranks as threads)
and the simulator's `SimExecutor` (suite/executors/sim.py). Each holds its own limits in
`supports`, says where its trials run (`places`, for the plan) and how long it spent starting
worker groups (`startup_s`, which is not any trial's time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from suite.plan import Place, TrialSpec
from suite.records import Outcome

if TYPE_CHECKING:
    from methods.base import Method
    from suite.workloads import Workload


class Executor:
    name: ClassVar[str]
    device: str = "cpu"  # "cpu" or "cuda": where trials run (the simulator traces on CPU)
    startup_s: float = 0.0  # time spent starting worker groups (harness overhead, reported)
    groups_started: int = 0
    leader: bool = True  # False on the ranks of an external launch other than 0: they only serve()

    def places(self) -> list[Place]:
        """Where this executor's trials run (hardware, topology, nodes per world size)."""
        raise NotImplementedError

    def build_method(self, spec: TrialSpec) -> "Method":
        """The method a trial runs, as this executor runs it (the simulator's traced peers differ)."""
        return spec.build_method()

    def supports(self, spec: TrialSpec, method: "Method", workload: "Workload") -> tuple[bool, str]:
        """Whether this executor can run `spec` (after the method and the workload agreed), and why not."""
        return True, ""

    def run(self, spec: TrialSpec) -> Outcome:
        raise NotImplementedError

    def serve(self) -> None:
        """A follower rank's loop: run the trials the leader sends until it closes."""
        raise NotImplementedError(f"executor {self.name} has no follower ranks")

    def close(self) -> None:
        """Release worker groups after the sweep."""

    def abort(self) -> None:
        """Stop at once (Ctrl-C), without waiting for a trial in flight."""
