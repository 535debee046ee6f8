"""The worker process of the local dist executor: joins a torch.distributed group, then runs
trials sent by the parent.

Workers never write results or talk to MLflow: every trial's report goes back to the parent
through a queue (only the parent writes anything persistent). A worker exits when the parent sends None, or when the
parent disappears (so a killed sweep leaves no orphans).
"""

from __future__ import annotations

import importlib
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch

from suite.plan import RunSettings


@dataclass(frozen=True)
class WorkerSettings:
    """Everything a worker needs to start (picklable)."""

    world_size: int
    device: str  # "cpu" or "cuda"
    backend: str  # "gloo" or "nccl"
    threads: int  # torch CPU threads per worker
    plugins: tuple[str, ...]
    comm_timeout_s: float
    run: RunSettings


def watch_parent(parent_pid: int, every_s: float = 0.5) -> None:
    """End this process as soon as its parent is gone, whatever the main thread is doing: a worker
    blocked connecting to a dead parent's rendezvous waited for its whole timeout (minutes). The
    kernel's parent-death signal (Linux) covers it at once; a thread polling the parent pid covers
    the rest, and the case where the parent died before the signal was set."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError, TypeError):  # not Linux
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(every_s)

    threading.Thread(target=watch, name="suite-parent-watch", daemon=True).start()


def worker_main(rank: int, store_port: int, settings: WorkerSettings, tasks, results, parent_pid: int) -> None:
    """Entry point of one worker process (spawned by suite.executors.local.LocalGroup)."""
    watch_parent(parent_pid)
    try:
        torch.set_num_threads(settings.threads)
        import torch.distributed as dist

        import methods
        from methods.comm import DistComm
        from suite.check import ProblemCache
        from suite.trial import run_trial

        methods.load_plugins(settings.plugins)
        if settings.device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        store = dist.TCPStore(
            "127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=settings.comm_timeout_s)
        )
        dist.init_process_group(
            settings.backend,
            store=store,
            rank=rank,
            world_size=settings.world_size,
            timeout=timedelta(seconds=settings.comm_timeout_s),
        )
        # the first trial would import torch._dynamo on its clock (seconds; more under load)
        importlib.import_module("torch._dynamo")

        comm = DistComm()
        comm.barrier()  # the group really works before we say so
    except Exception:  # noqa: BLE001
        results.put(("startup_error", rank, None, traceback.format_exc(limit=20)))
        return
    results.put(("ready", rank, None, None))
    cache = ProblemCache()
    while True:
        try:
            spec = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent_pid:  # the parent died: do not linger
                break
            continue
        if spec is None:
            break

        def prepared(key=spec.key) -> None:
            results.put(("prepared", rank, key, None))

        results.put(
            ("report", rank, spec.key, run_trial(spec, settings.run, comm, device, cache, on_prepared=prepared))
        )
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
