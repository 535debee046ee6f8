"""executor=dist on this machine: worker processes over torch.distributed.

One group of worker processes per world size (gloo on CPU, NCCL on CUDA), started on the first
trial of that size and reused for all of them. A trial that fails on any rank, hangs past its
timeout, or loses a worker gets the group replaced before the next trial (its communicators may
hold unmatched messages).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import Optional

import torch

from suite.env import hardware_label
from suite.executors.base import Executor
from suite.executors.worker import WorkerSettings, worker_main
from suite.plan import Place, RunSettings, TrialSpec
from suite.records import Outcome, RankReport


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_rank(configured: int, world_size: int) -> int:
    return configured if configured > 0 else max(1, available_cores() // world_size)


class sigint_ignored:
    """Processes started inside ignore SIGINT from their first instruction (the disposition is
    inherited through exec, and Python keeps an ignored SIGINT ignored): Ctrl-C at a terminal
    reaches the whole process group, and each worker printed a KeyboardInterrupt traceback of
    about fifty lines while the parent, which handles Ctrl-C, kills them anyway. Only in the main
    thread (where signal handlers can be set); elsewhere nothing changes."""

    def __enter__(self):
        self._set = threading.current_thread() is threading.main_thread()
        if self._set:
            # None: a handler not installed from Python (a library's C handler): put back the default
            self._old = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return self

    def __exit__(self, *exc):
        if self._set:
            signal.signal(signal.SIGINT, signal.SIG_DFL if self._old is None else self._old)
        return False


class GroupStartError(RuntimeError):
    """A worker group could not be started (the trials that needed it are recorded as failed)."""


class LocalGroup:
    """`world_size` worker processes joined in one torch.distributed group, reused across trials."""

    def __init__(self, settings: WorkerSettings, startup_timeout_s: float):
        import torch.distributed as dist

        self.world_size = settings.world_size
        ctx = mp.get_context("spawn")
        # The parent hosts the rendezvous store on a free port (port 0: no port race), on loopback
        # only: TCPStore's own server listens on every interface, which would let any host on the
        # network reach an unauthenticated key-value store that steers the workers. The socket is
        # bound here and handed over.
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(max(64, 2 * self.world_size))
        self._store = dist.TCPStore(
            "127.0.0.1",
            self._listener.getsockname()[1],
            None,
            True,
            wait_for_workers=False,
            timeout=timedelta(seconds=startup_timeout_s),
            master_listen_fd=self._listener.fileno(),
            use_libuv=True,
        )
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=worker_main,
                name=f"suite-worker-{r}",
                daemon=True,
                args=(r, self._store.port, settings, self._tasks[r], self._results, os.getpid()),
            )
            for r in range(self.world_size)
        ]
        with sigint_ignored():  # Ctrl-C is the parent's to handle; the workers follow it
            for p in self._procs:
                p.start()
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        ready: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(ready) < self.world_size:
            try:
                kind, rank, _, payload = self._results.get(timeout=0.5)
            except queue.Empty:
                dead = self.dead_ranks()
                if dead:
                    raise GroupStartError(f"worker(s) {dead} exited during start-up")
                if time.monotonic() > deadline:
                    raise GroupStartError(f"worker group of {self.world_size} not ready after {timeout_s}s")
                continue
            if kind == "startup_error":
                raise GroupStartError(f"rank {rank} failed to start:\n{payload}")
            ready.add(rank)

    def dead_ranks(self) -> list[tuple[int, Optional[int]]]:
        return [(r, p.exitcode) for r, p in enumerate(self._procs) if not p.is_alive()]

    def run(self, spec: TrialSpec, timeout_s: float, grace_s: float, prepare_timeout_s: float) -> tuple[Outcome, bool]:
        """Send `spec` to every rank and collect their reports.

        The limit is `prepare_timeout_s` for building inputs and the float64 reference, then
        `timeout_s` from the moment every rank has prepared. Returns (outcome, healthy): `healthy`
        is False when the group must be replaced (a rank failed, hung or died).
        """
        for q in self._tasks:
            q.put(spec)
        reports: list[Optional[RankReport]] = [None] * self.world_size
        prepared: set[int] = set()
        deadline = time.monotonic() + prepare_timeout_s  # the trial's own limit starts once all have prepared
        while any(r is None for r in reports):
            now = time.monotonic()
            if now > deadline:
                missing = [r for r, rep in enumerate(reports) if rep is None]
                failed = any(rep is not None and not rep.ok for rep in reports)
                if failed:  # someone failed and the others are stuck waiting for it
                    return Outcome("failed", reports, f"ranks {missing} did not finish after the failure"), False
                if len(prepared) < self.world_size:
                    return Outcome(
                        "timeout",
                        reports,
                        f"ranks {sorted(set(range(self.world_size)) - prepared)} "
                        f"still building inputs and the float64 reference after "
                        f"{prepare_timeout_s:g}s (run.prepare_timeout_s)",
                    ), False
                return Outcome(
                    "timeout", reports, f"no report from ranks {missing} within {timeout_s:g}s (run.timeout_s)"
                ), False
            try:
                kind, rank, key, payload = self._results.get(timeout=min(0.5, deadline - now))
            except queue.Empty:
                dead = self.dead_ranks()
                if dead:
                    desc = ", ".join(f"rank {r} exited with code {c}" for r, c in dead)
                    return Outcome("failed", reports, f"worker died: {desc}"), False
                continue
            if key != spec.key:
                continue  # a stale message from before; cannot happen with fresh groups, but be safe
            if kind == "prepared":
                prepared.add(rank)
                if len(prepared) == self.world_size:  # the trial's own time starts now
                    deadline = time.monotonic() + timeout_s
                continue
            if kind != "report":
                continue
            reports[rank] = payload
            if not payload.ok:
                deadline = min(deadline, time.monotonic() + grace_s)
        ok = all(rep is not None and rep.ok for rep in reports)  # every rank reported: the loop ended
        return Outcome("reported", reports), ok

    def close(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=10)
        self.kill()

    def kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        for q in self._tasks + [self._results]:
            q.cancel_join_thread()
            q.close()
        self._listener.close()


class LocalDistExecutor(Executor):
    """executor=dist on this machine: worker groups per world size, replaced after failures."""

    name = "dist"

    def __init__(
        self,
        *,
        device: str,
        backend: str,
        run: RunSettings,
        threads_per_rank: int,
        plugins: tuple[str, ...],
        timeout_s: float,
        startup_timeout_s: float,
        grace_s: float,
        prepare_timeout_s: float,
        hardware: str = "auto",
    ):
        self.device = device
        self._hardware = hardware_label(device) if hardware == "auto" else hardware
        self._device, self._backend, self._run = device, backend, run
        self._threads, self._plugins = threads_per_rank, plugins
        self._timeout_s, self._startup_timeout_s, self._grace_s = timeout_s, startup_timeout_s, grace_s
        self._prepare_timeout_s = prepare_timeout_s
        self._group: Optional[LocalGroup] = None
        self.groups_started = 0
        self.startup_s = 0.0  # time spent starting worker groups (harness overhead, reported)

    def places(self) -> list[Place]:
        return [Place(self._hardware, "single-node", lambda world_size: 1)]

    def supports(self, spec, method, workload) -> tuple[bool, str]:
        if self.device == "cuda" and spec.world_size > torch.cuda.device_count():
            return False, (
                f"needs {spec.world_size} GPUs on this node, found {torch.cuda.device_count()} "
                f"(run.executor=threads emulates ranks on one GPU, for numerics only)"
            )
        return True, ""

    def _group_for(self, world_size: int) -> LocalGroup:
        if self._group is not None and self._group.world_size == world_size:
            return self._group
        self.close()
        settings = WorkerSettings(
            world_size=world_size,
            device=self._device,
            backend=self._backend,
            threads=threads_per_rank(self._threads, world_size),
            plugins=self._plugins,
            comm_timeout_s=self._timeout_s + self._prepare_timeout_s + 60,
            run=self._run,
        )
        self.groups_started += 1
        t0 = time.perf_counter()
        try:
            self._group = LocalGroup(settings, self._startup_timeout_s)
        finally:
            self.startup_s += time.perf_counter() - t0
        return self._group

    def run(self, spec: TrialSpec) -> Outcome:
        try:
            group = self._group_for(spec.world_size)
        except GroupStartError as exc:
            self._group = None
            return Outcome("failed", [None] * spec.world_size, f"could not start worker group: {exc}")
        outcome, healthy = group.run(spec, self._timeout_s, self._grace_s, self._prepare_timeout_s)
        if not healthy:
            group.kill()
            self._group = None
        return outcome

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def abort(self) -> None:
        """Kill the current group without waiting for its trial (Ctrl-C)."""
        if self._group is not None:
            self._group.kill()
            self._group = None
