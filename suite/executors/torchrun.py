"""executor=dist under an external launcher (torchrun, or srun with MASTER_ADDR/MASTER_PORT set).

Every launched process runs `python -m suite run CONFIG`; together they are one worker group of
the launched size (possibly several nodes). Rank 0 runs the sweep's normal drive loop (plan,
store, MLflow, progress), and this executor sends each trial to the other ranks over a gloo
control group; every rank runs the trial and the reports are gathered on rank 0. The other ranks
only `serve()` until rank 0 closes the executor. Trials of another world size are recorded as
skipped with the command that covers them.

Limits compared with the local launcher: there is no fresh group after a failure, so later trials
run on the same communicators (their rows say so), and hangs depend on the backend. On gloo a
stuck collective raises after the process-group timeout (run.timeout_s) and the trial is recorded
as failed. On NCCL, PyTorch's watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING, default 3) ends the
processes on a collective timeout, so a hang ends the job; every finished trial is already in the
store and `--resume` (a new launch) continues after it. Trials that raise are recorded under both
backends.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch

from suite.check import ProblemCache
from suite.env import hardware_label
from suite.executors.base import Executor
from suite.plan import Place, RunSettings, TrialSpec
from suite.records import Outcome
from suite.trial import run_trial

# Ranks other than 0 wait on the control group while rank 0 plans, writes rows, or trains a
# perplexity baseline in between trials: a wait that long is normal, so its limit is generous.
# (A dead rank 0 does not leave them waiting: the launcher stops every rank when one exits.)
CONTROL_TIMEOUT = timedelta(hours=12)
REUSED = "ran on communicators reused after an earlier failed trial"


def external_launch() -> Optional[dict]:
    """Rank facts when this process was started by torchrun (or srun with MASTER_ADDR set)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        return {
            "rank": int(env["RANK"]),
            "world_size": int(env["WORLD_SIZE"]),
            "local_rank": int(env.get("LOCAL_RANK", 0)),
            "local_world_size": int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
        }
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1 and "MASTER_ADDR" in env:
        return {
            "rank": int(env["SLURM_PROCID"]),
            "world_size": int(env["SLURM_NTASKS"]),
            "local_rank": int(env.get("SLURM_LOCALID", 0)),
            "local_world_size": int(env.get("SLURM_NTASKS_PER_NODE", env["SLURM_NTASKS"]).split("(")[0]),
        }
    return None


class TorchrunExecutor(Executor):
    """The launched processes are the group; rank 0 is the parent (`leader`)."""

    name = "dist"

    def __init__(
        self, launch: dict, *, device: str, backend: str, run: RunSettings, timeout_s: float, hardware: str = "auto"
    ):
        import torch.distributed as dist

        self.rank, self.world = launch["rank"], launch["world_size"]
        self.leader = self.rank == 0
        os.environ.setdefault("RANK", str(self.rank))
        os.environ.setdefault("WORLD_SIZE", str(self.world))
        self.device = device
        if device == "cuda":
            torch.cuda.set_device(launch["local_rank"])
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // launch["local_world_size"]))
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
        self._control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)  # object messages
        from methods.comm import DistComm

        self._comm = DistComm()
        self._dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        self._run = run
        self._cache = ProblemCache()
        self.nodes = max(1, self.world // launch["local_world_size"])
        self._hardware = hardware_label(device) if hardware == "auto" else hardware
        self._failed_before = False
        self._open = True

    def places(self) -> list[Place]:
        topology = "single-node" if self.nodes == 1 else f"{self.nodes}-node"
        return [Place(self._hardware, topology, lambda world_size: self.nodes)]

    def supports(self, spec, method, workload) -> tuple[bool, str]:
        if spec.world_size != self.world:
            return False, (
                f"world_size {spec.world_size} needs its own launch: this group has {self.world} "
                f"ranks (torchrun --nproc-per-node ... with {spec.world_size} ranks in all)"
            )
        return True, ""

    def run(self, spec: TrialSpec) -> Outcome:
        """Rank 0: send `spec` to every rank, run it here too, gather every rank's report."""
        import torch.distributed as dist

        dist.broadcast_object_list([spec], src=0, group=self._control)
        report = run_trial(spec, self._run, self._comm, self._dev, self._cache)
        gathered: list = [None] * self.world
        dist.gather_object(report, gathered, dst=0, group=self._control)
        outcome = Outcome("reported", gathered, note=REUSED if self._failed_before else "")
        self._failed_before = self._failed_before or not all(r.ok for r in gathered)
        return outcome

    def serve(self) -> None:
        """Ranks other than 0: run the trials rank 0 sends until it sends None, then leave."""
        import torch.distributed as dist

        try:
            while True:
                box: list = [None]
                dist.broadcast_object_list(box, src=0, group=self._control)
                spec = box[0]
                if spec is None:
                    break
                report = run_trial(spec, self._run, self._comm, self._dev, self._cache)
                dist.gather_object(report, None, dst=0, group=self._control)
        finally:
            self._teardown()

    def close(self) -> None:
        """Rank 0: tell the other ranks to leave, then leave the group."""
        if not self._open:
            return
        import torch.distributed as dist

        if self.leader:
            dist.broadcast_object_list([None], src=0, group=self._control)
        self._teardown()

    def abort(self) -> None:
        self.close()

    def _teardown(self) -> None:
        import torch.distributed as dist

        if self._open:
            self._open = False
            dist.destroy_process_group()
