"""The runner owns timing (a method never times itself).

Each timed iteration starts after a barrier, so ranks start together and the per-iteration time
of the group is the maximum over ranks (taken by the parent from every rank's samples). The clock
is the suite's one timer (methods/stopwatch.py): CUDA events around the iteration on GPU, wall time
on CPU (gloo collectives are synchronous, so the iteration is complete when the call returns).
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch

from methods.comm.base import Comm
from methods.stopwatch import Stopwatch


def time_iterations(step: Callable[[], None], *, comm: Comm, repeats: int, device: torch.device) -> list[float]:
    """Run `step` `repeats` times after a barrier each; return per-iteration times in ms."""
    samples = []
    for _ in range(repeats):
        comm.barrier()
        watch = Stopwatch(device)
        with watch.region():
            step()
        samples.append(watch.seconds * 1e3)
    return samples


def group_samples(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per-iteration group time: the slowest rank of each iteration."""
    return [max(vals) for vals in zip(*per_rank)]


def summarize(samples: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of samples in ms."""
    return statistics.median(samples), min(samples), max(samples)
