"""The runner owns timing (a method never times itself).

Each timed iteration starts after a barrier, so ranks start together and the per-iteration time
of the group is the maximum over ranks (taken by the parent from every rank's samples). CUDA uses
events around the iteration; CPU uses perf_counter (gloo collectives are synchronous, so the
iteration is complete when the call returns).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

from methods.comm.base import Comm


def time_iterations(step: Callable[[], None], *, comm: Comm, repeats: int, device: torch.device) -> list[float]:
    """Run `step` `repeats` times after a barrier each; return per-iteration times in ms."""
    samples = []
    for _ in range(repeats):
        comm.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            samples.append(float(start.elapsed_time(end)))
        else:
            t0 = time.perf_counter()
            step()
            samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def group_samples(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per-iteration group time: the slowest rank of each iteration."""
    return [max(vals) for vals in zip(*per_rank)]


def summarize(samples: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of samples in ms."""
    return statistics.median(samples), min(samples), max(samples)
