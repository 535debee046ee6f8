"""executor=threads: virtual ranks as threads of this process (ThreadComm).

Numerics, not performance: every own method's check runs without spawning processes, on the CPU or
on one GPU (NCCL refuses two ranks on one GPU). Rows say executor=threads.
"""

from __future__ import annotations

import torch

from methods.comm import run_threads
from suite.check import ProblemCache
from suite.env import hardware_label
from suite.executors.base import Executor
from suite.plan import Place, RunSettings, TrialSpec
from suite.records import Outcome, RankReport
from suite.trial import run_trial


class _RankFailed(Exception):
    def __init__(self, report: RankReport):
        super().__init__(report.error)
        self.report = report


class ThreadExecutor(Executor):
    """executor=threads: P virtual ranks as threads of this process (numerics, not performance)."""

    name = "threads"

    def __init__(self, *, device: str, run: RunSettings, timeout_s: float, hardware: str = "auto"):
        self.device = device
        self._hardware = hardware_label(device) if hardware == "auto" else hardware
        self._device = torch.device(device)
        self._run, self._timeout_s = run, timeout_s  # includes preparing the reference (threads cannot be stopped)
        self._cache = ProblemCache()
        # On CUDA, autograd runs all backward work of a device on one thread: virtual ranks that
        # wait for each other inside backward would deadlock there, so call backward directly.
        self._autograd = self._device.type != "cuda"

    def places(self) -> list[Place]:
        return [Place(self._hardware, "single-node", lambda world_size: 1)]

    def supports(self, spec, method, workload) -> tuple[bool, str]:
        if method.needs_processes:
            return False, f"{spec.method} calls torch.distributed itself; it needs run.executor=dist"
        if workload.needs_autograd and not self._autograd:
            return False, (
                "training needs autograd across ranks, which virtual ranks on one GPU cannot use "
                "(autograd runs a device's backward on one thread); use run.executor=dist"
            )
        return True, ""

    def run(self, spec: TrialSpec) -> Outcome:
        def rank_fn(comm):
            report = run_trial(spec, self._run, comm, self._device, self._cache, autograd=self._autograd)
            if not report.ok:
                raise _RankFailed(report)  # aborts the other virtual ranks at once
            return report

        try:
            return Outcome("reported", run_threads(spec.world_size, rank_fn, timeout_s=self._timeout_s))
        except _RankFailed as exc:
            return Outcome("failed", [exc.report])
        except Exception as exc:  # noqa: BLE001 - a hang (CommError) or an executor bug
            kind = "timeout" if "hang" in str(exc) or "timed out" in str(exc) else "failed"
            return Outcome(kind, [], f"{type(exc).__name__}: {exc}")
