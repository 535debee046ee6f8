"""executor=threads: virtual ranks as threads of this process (ThreadComm).

Numerics, not performance: every own method's check runs without spawning processes, on the CPU or
on one GPU (NCCL refuses two ranks on one GPU). Rows say executor=threads.

Limits as the dist executor keeps them (suite/executors/local.py): `run.prepare_timeout_s` for
building the inputs and the float64 reference, then `run.timeout_s` from the moment every rank has
them; after one rank fails, `run.fail_grace_s` for the others. A limit that fires records the row
`timeout` (or `failed` after a rank's failure) and wakes every rank blocked in communication. What
a thread cannot be made to do is stop: Python has no way to kill one. A rank stuck outside
communication (a sleep, a lock, a loop) is left running as a daemon thread until the sweep ends,
the row says so, and later trials get a fresh problem cache (the stuck rank may still hold the old
one); `run.executor=dist` kills such a rank's process instead.

A rank that ends the process (`os._exit`, as a plugin might on a fatal error) would end the sweep
with it: while this executor runs, `os._exit` called on one of its rank threads raises in that
thread instead, and the trial is recorded `failed` (as is `sys.exit`). A crash in native code
(a segfault) still ends the process; `run.executor=dist` records those.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from typing import Any, Callable, Optional

import torch

from methods.comm import ThreadWorld
from methods.comm.base import CommAborted
from suite.check import ProblemCache
from suite.env import hardware_label
from suite.executors.base import Executor
from suite.plan import Place, RunSettings, TrialSpec
from suite.records import Outcome, RankReport
from suite.trial import run_trial

_POLL_S = 0.05
_STOP_WAIT_S = 2.0  # after a limit fires: how long woken ranks get to leave before they count as stuck


class RankExited(BaseException):
    """A virtual rank called os._exit: raised in its thread so that the process (the sweep) lives
    on. A BaseException, so that a method's `except Exception` does not swallow it."""

    def __init__(self, code: Any):
        super().__init__(f"the rank called os._exit({code}); a virtual rank cannot end the process")
        self.code = code


class _ExitGuard:
    """While installed, `os._exit` on one of `threads` raises RankExited there; elsewhere (the
    main thread, a worker's parent watch) it ends the process as always."""

    def __init__(self) -> None:
        self.threads: set[threading.Thread] = set()
        self._real: Optional[Callable[[int], Any]] = None

    def install(self) -> None:
        if self._real is not None:
            return
        real = self._real = os._exit

        def guarded(code: int) -> Any:
            if threading.current_thread() in self.threads:
                raise RankExited(code)
            return real(code)

        os._exit = guarded  # type: ignore[assignment]

    def remove(self) -> None:
        if self._real is not None:
            os._exit = self._real  # type: ignore[assignment]
            self._real = None


class ThreadExecutor(Executor):
    """executor=threads: P virtual ranks as threads of this process (numerics, not performance)."""

    name = "threads"

    def __init__(
        self,
        *,
        device: str,
        run: RunSettings,
        timeout_s: float,
        prepare_timeout_s: float,
        grace_s: float = 10.0,
        hardware: str = "auto",
    ):
        self.device = device
        self._hardware = hardware_label(device) if hardware == "auto" else hardware
        self._device = torch.device(device)
        self._run = run
        self._timeout_s, self._prepare_timeout_s, self._grace_s = timeout_s, prepare_timeout_s, grace_s
        self._cache = ProblemCache()
        self._guard = _ExitGuard()
        self._world: Optional[ThreadWorld] = None
        self.stuck: list[threading.Thread] = []  # rank threads that outlived their trial's limit
        # On CUDA, autograd runs all backward work of a device on one thread: virtual ranks that
        # wait for each other inside backward would deadlock there, so call backward directly.
        self._autograd = self._device.type != "cuda"
        # The first tensor call of a trial that reaches a dynamo-guarded torch function imports
        # torch._dynamo (seconds; over ten on a loaded machine): inside the first trial's limit,
        # where it is no method's time. Paid here instead, before any limit runs.
        importlib.import_module("torch._dynamo")

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
        p = spec.world_size
        # every communication waits at most this long on its own (a backstop: the limits below fire first)
        world = self._world = ThreadWorld(p, self._timeout_s + self._prepare_timeout_s + 60)
        reports: list[Optional[RankReport]] = [None] * p
        prepared: set[int] = set()
        cache = self._cache

        def target(rank: int) -> None:
            comm = world.comm(rank)
            try:
                report = run_trial(
                    spec,
                    self._run,
                    comm,
                    self._device,
                    cache,
                    autograd=self._autograd,
                    on_prepared=lambda: prepared.add(rank),
                )
            except BaseException as exc:  # noqa: BLE001 - os._exit (RankExited), sys.exit: recorded, never the sweep's end
                report = RankReport.failure(rank, exc)
                report.rank = rank
            reports[rank] = report
            if not report.ok:
                world.abort()  # the other ranks stop waiting for this one

        threads = [threading.Thread(target=target, args=(r,), name=f"vrank{r}", daemon=True) for r in range(p)]
        self._guard.threads.update(threads)
        self._guard.install()
        for t in threads:
            t.start()
        deadline = time.monotonic() + self._prepare_timeout_s  # the trial's own limit starts once all have prepared
        timed = False
        while any(t.is_alive() for t in threads):
            now = time.monotonic()
            if now > deadline:
                break
            if not timed and len(prepared) == p:
                timed, deadline = True, now + self._timeout_s
            if any(r is not None and not r.ok for r in reports):
                deadline = min(deadline, now + self._grace_s)
            next(t for t in threads if t.is_alive()).join(timeout=_POLL_S)
        else:
            self._guard.threads.difference_update(threads)
            return self._reported(reports)
        return self._over_limit(threads, reports, prepared, world)

    @staticmethod
    def _reported(reports: list[Optional[RankReport]]) -> Outcome:
        failed = [r for r in reports if r is not None and not r.ok]
        if not failed:
            return Outcome("reported", list(reports))
        # the ranks only woken by another's failure say so; the cause is the other rank's report
        causes = [r for r in failed if not r.error.startswith(CommAborted.__name__)]
        return Outcome("failed", causes or failed[:1])

    def _over_limit(self, threads, reports, prepared: set[int], world: ThreadWorld) -> Outcome:
        """A limit fired: wake every rank, give them a moment to leave, and say which could not."""
        p = len(threads)
        missing = [r for r in range(p) if reports[r] is None]
        failed = [r for r in reports if r is not None and not r.ok]
        world.abort()
        until = time.monotonic() + _STOP_WAIT_S
        for t in threads:
            t.join(timeout=max(0.0, until - time.monotonic()))
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        self._guard.threads.difference_update(t for t in threads if not t.is_alive())
        note = ""
        if stuck:
            self.stuck.extend(threads[r] for r in stuck)
            self._cache = ProblemCache()  # a stuck rank may still touch the old one
            note = (
                f"; rank{'s' if len(stuck) > 1 else ''} {stuck} could not be stopped (a thread cannot be "
                f"killed): left running in the background until the sweep ends (run.executor=dist kills them)"
            )
        if failed:  # someone failed and the others are stuck waiting for it
            causes = [r for r in failed if not r.error.startswith(CommAborted.__name__)] or failed
            return Outcome("failed", causes, f"ranks {missing} did not finish after the failure{note}")
        if len(prepared) < p:
            waiting = sorted(set(range(p)) - prepared)
            return Outcome(
                "timeout",
                [],
                f"ranks {waiting} still building inputs and the float64 reference after "
                f"{self._prepare_timeout_s:g}s (run.prepare_timeout_s){note}",
            )
        return Outcome(
            "timeout", [], f"no report from ranks {missing} within {self._timeout_s:g}s (run.timeout_s){note}"
        )

    def close(self) -> None:
        if not any(t.is_alive() for t in self.stuck):
            self._guard.remove()  # a stuck rank may still call os._exit: the guard stays while it lives

    def abort(self) -> None:
        if self._world is not None:
            self._world.abort()
