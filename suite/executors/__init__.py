"""Executors by `run.executor` (suite/executors/base.py describes the protocol)."""

from __future__ import annotations

import torch

from suite.config import ConfigError, SuiteConfig
from suite.executors.base import Executor
from suite.plan import RunSettings

__all__ = ["Executor", "make_executor", "resolve_backend", "resolve_device"]


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_backend(backend: str, device: str) -> str:
    if backend == "auto":
        return "nccl" if device == "cuda" else "gloo"
    return backend


def make_executor(cfg: SuiteConfig, *, dry_run: bool = False) -> Executor:
    """The executor of `run.executor`; under an external launcher (torchrun, SLURM) `dist` is the
    launched group. Raises ConfigError when the machine cannot give what the config asks for
    (except for a dry run, which only plans: a GPU sweep's plan can be read on a laptop)."""
    r = cfg.run
    settings = RunSettings.of(cfg)
    if r.executor == "sim":
        from suite.executors.sim import SimExecutor

        return SimExecutor(cfg.sim.topology, r.timeout_s)
    device = resolve_device(r.device)
    if device == "cuda" and not torch.cuda.is_available() and not dry_run:
        raise ConfigError(
            "run.device: cuda, but no CUDA device is available here (run.device=cpu runs on the "
            "CPU; --dry-run shows the plan)"
        )
    if r.executor == "threads":
        from suite.executors.threads import ThreadExecutor

        return ThreadExecutor(
            device=device,
            run=settings,
            timeout_s=r.timeout_s,
            prepare_timeout_s=r.prepare_timeout_s,
            grace_s=r.fail_grace_s,
            hardware=r.hardware,
        )
    from suite.executors.torchrun import TorchrunExecutor, external_launch

    launch = external_launch()
    if launch is not None:
        return TorchrunExecutor(
            launch,
            device=device,
            backend=resolve_backend(r.backend, device),
            run=settings,
            timeout_s=r.timeout_s,
            hardware=r.hardware,
        )
    from suite.executors.local import LocalDistExecutor, available_cores

    if device == "cpu" and not dry_run:
        cores = available_cores()
        limit = max(1, int(cores * r.max_ranks_per_core))
        too_big = [p for p in cfg.sweep.world_size if p > limit]
        if too_big:  # every rank would wait for a core: the timings would measure contention
            raise ConfigError(
                f"sweep.world_size: {too_big} exceed{'s' if len(too_big) == 1 else ''} this machine's "
                f"{cores} cores x run.max_ranks_per_core {r.max_ranks_per_core:g} = {limit} ranks; use "
                f"fewer ranks, run.executor=sim, or raise run.max_ranks_per_core to oversubscribe"
            )
    return LocalDistExecutor(
        device=device,
        backend=resolve_backend(r.backend, device),
        run=settings,
        threads_per_rank=r.threads_per_rank,
        plugins=tuple(r.plugins),
        timeout_s=r.timeout_s,
        startup_timeout_s=r.startup_timeout_s,
        grace_s=r.fail_grace_s,
        prepare_timeout_s=r.prepare_timeout_s,
        hardware=r.hardware,
    )
