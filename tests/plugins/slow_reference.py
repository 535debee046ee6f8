"""Test-only plugin (`run.plugins`): every rank takes 12 s longer to build a trial's inputs and
float64 reference, so a test can tell the preparation limit from the trial limit without relying
on how fast this machine computes the reference."""

import time

import suite.workloads.attention

_build = suite.workloads.attention.build_sharded_problem


def _slow_build(*args, **kwargs):
    time.sleep(12.0)
    return _build(*args, **kwargs)


suite.workloads.attention.build_sharded_problem = _slow_build
