"""One trial on one rank: the entry point every executor calls on every rank.

`run_trial` hands the trial to its workload (suite/workloads) and never raises: an exception
becomes a failed `RankReport` with its message and traceback, so that the parent records it and
the sweep goes on. Only the parent writes anything.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from methods.comm.base import Comm
from suite.check import ProblemCache
from suite.plan import RunSettings, TrialSpec
from suite.records import RankReport
from suite.workloads import RankContext, make_workload


def run_trial(
    spec: TrialSpec,
    settings: RunSettings,
    comm: Comm,
    device: torch.device,
    cache: ProblemCache,
    *,
    autograd: bool = True,
    on_prepared: Optional[Callable[[], None]] = None,
) -> RankReport:
    """Run `spec` on this rank.

    `autograd=False` computes gradients by calling the method's backward directly
    (`Method.attention_fwd_bwd`): virtual ranks on one GPU need it. `on_prepared` is called once
    the inputs and the float64 reference exist, so that the executor can start the trial's time
    limit there (building a large reference is not the method's time).
    """
    t0 = time.perf_counter()
    try:
        if comm.world_size != spec.world_size:
            raise RuntimeError(f"trial needs world_size {spec.world_size}, comm has {comm.world_size}")
        ctx = RankContext(
            settings=settings, comm=comm, device=device, cache=cache, autograd=autograd, on_prepared=on_prepared
        )
        report = make_workload(spec.kind).run_rank(spec, ctx)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a recorded row
        oom = device.type == "cuda" and isinstance(exc, torch.cuda.OutOfMemoryError)
        report = RankReport.failure(comm.rank, exc, oom=oom)
        if oom:
            torch.cuda.empty_cache()
    report.rank = comm.rank
    report.wall_s = time.perf_counter() - t0
    return report
