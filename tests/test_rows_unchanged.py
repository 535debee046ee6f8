"""Restructuring the harness must not change what a sweep records.

The rows in tests/data/golden/ were written by the harness before its layers were separated
(commit 901a5e7), with the commands below; each test runs the same sweep with today's code and
compares every column except times and bookkeeping (those differ from run to run). Errors and
tolerances are floating-point results of the same kernels on the same inputs; they are compared
loosely (a factor of 2), since another CPU may round differently, while everything else (keys,
identity, status, bytes, operation counts, losses' length, skip reasons) must be equal.

    python -m suite run configs/quickstart.yaml run.repeats=2 run.warmup=1 run.hardware=golden-cpu ...
    (the overrides of each test below, plus tracking.mlflow=false results.root=<tmp>)

When a change is meant to change rows (a new column, a method's bytes), regenerate the files with
`python -m tests.test_rows_unchanged quickstart methods_cpu_threads perplexity_threads simulate`
and say why in the commit.
"""

import json
import math
from pathlib import Path

import pytest

from suite.config import load_config
from suite.runner import run_sweep

GOLDEN = Path(__file__).parent / "data" / "golden"
ROOT = Path(__file__).resolve().parents[1]
VOLATILE = {
    "time_ms_median",
    "time_ms_min",
    "time_ms_max",
    "time_ms_samples",
    "tflops_per_gpu",
    "tokens_per_s",
    "trial_wall_s",
    "started_at",
    "run_id",
    "kernel_ms",
    "comm_wait_ms",
    "overhead_ratio",
    "compute_only_ms",
    "comm_only_ms",
    "ccr",
    "overlap_efficiency",
    "error_trace",
    "kernel_ms_spread",
}
LOOSE = ("err_", "tol_", "val_loss", "perplexity", "loss_", "peak_mem_bytes")
# A relative difference of a few float32 roundings is rounding on any CPU: 1 and 3 ulp differ by a
# factor of 3 but say the same (seen between two CPUs for the perplexity check's ring row).
ROUNDING = 16 * 2.0**-23
# Columns added after the golden rows were written, with the value every older trial has: a row
# that holds exactly these (sinks off, no dsink checked) records what it recorded before.
NEW_COLUMNS = {"sinks": False, "err_dsink": None, "tol_dsink": None}

SWEEPS = {
    "quickstart": ("configs/quickstart.yaml", ["run.repeats=2", "run.warmup=1", "run.hardware=golden-cpu"]),
    "methods_cpu_threads": (
        "configs/methods_cpu.yaml",
        ["run.executor=threads", "run.repeats=1", "run.warmup=1", "run.breakdown=false", "run.hardware=golden-cpu"],
    ),
    "perplexity_threads": (
        "configs/perplexity.yaml",
        [
            "run.executor=threads",
            "sweep.methods=[ring,ulysses,tasp]",
            "sweep.world_size=[2]",
            "perplexity.steps=4",
            "perplexity.eval_batches=2",
            "perplexity.data.max_bytes=200000",
            "run.hardware=golden-cpu",
        ],
    ),
    "simulate": (
        "configs/simulate_multinode.yaml",
        ["sweep.world_size=[4,8]", "sweep.seq_len=[32768]", "sim.topology=[h100_sxm,mi300x]"],
    ),
}
# Compared in the tests on a part of a sweep (the time budget of the whole suite): every trial of the
# part must be in the golden file with the same row. The files hold the whole sweeps.
PARTS = {
    "quickstart": ["sweep.kv_heads=[4]", "sweep.passes=[fwd_bwd]"],
}


def _close(a, b, key: str = "") -> bool:
    if (
        key.endswith("rel_diff")
        and isinstance(a, float)
        and isinstance(b, float)
        and abs(a) <= ROUNDING
        and abs(b) <= ROUNDING
    ):
        return True
    if a is None or b is None or isinstance(a, str) or isinstance(b, str):
        return a == b
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(map(_close, a, b))
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or (a * b > 0 and 0.5 <= a / b <= 2.0)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SWEEPS))
def test_rows_equal_the_recorded_rows(name, tmp_path):
    config, overrides = SWEEPS[name]
    part = PARTS.get(name, [])
    cfg, text = load_config(ROOT / config, overrides + part + ["tracking.mlflow=false", f"results.root={tmp_path}"])
    result = run_sweep(cfg, text, progress=False)
    got = {r["key"]: r for r in result.records}
    want = {r["key"]: r for r in map(json.loads, (GOLDEN / f"{name}.jsonl").read_text().splitlines())}
    if part:
        assert got and set(got) <= set(want), "the planned trials (their keys) changed"
        want = {k: want[k] for k in got}
    assert sorted(got) == sorted(want), "the planned trials (their keys) changed"
    for key, old in want.items():
        new = {k: v for k, v in got[key].items() if k not in VOLATILE}
        for k, default in NEW_COLUMNS.items():
            if k not in old:
                assert new.pop(k) == default, (key, k)
        assert set(new) == set(old), (key, set(new) ^ set(old))
        diff = {
            k: (old[k], new[k])
            for k in old
            if not (_close(old[k], new[k], k) if k.startswith(LOOSE) else old[k] == new[k])
        }
        assert not diff, (key, old["method"], diff)


def regenerate(names: list[str], root: str = "/tmp/golden-rows") -> None:
    """Write the golden files anew from today's code (see the module docstring)."""
    import io

    for name in names:
        config, overrides = SWEEPS[name]
        cfg, text = load_config(ROOT / config, overrides + ["tracking.mlflow=false", f"results.root={root}"])
        res = run_sweep(cfg, text, progress=False, out=io.StringIO())
        with open(GOLDEN / f"{name}.jsonl", "w") as f:
            for r in res.records:
                f.write(json.dumps({k: v for k, v in r.items() if k not in VOLATILE}, sort_keys=True) + "\n")
        print(f"{name}: {len(res.records)} rows, {sum(r['status'] == 'ok' for r in res.records)} ok")


if __name__ == "__main__":
    import sys

    regenerate(sys.argv[1:] or sorted(SWEEPS))
