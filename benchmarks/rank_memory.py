"""Peak resident memory of the largest rank of one sweep point, sampled from outside.

Runs `python -m suite run CONFIG OVERRIDES...` once per value of the swept override, samples every
process under it every 10 ms (psutil), and prints the largest peak RSS of any worker (a rank) and
of the parent. What issue 36 measured for the inputs every rank built:

    python benchmarks/rank_memory.py --vary sweep.head_dim=[2048] sweep.head_dim=[4096] -- \\
        configs/quickstart.yaml sweep.methods=[ring] sweep.world_size=[4] sweep.seq_len=[8192] \\
        sweep.heads=[1] sweep.kv_heads=[1] sweep.causal=[true] sweep.passes=[fwd] run.check=false \\
        run.warmup=1 run.repeats=1 tracking.mlflow=false

Prints one line per value: the worker peak and the parent peak in MB.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time

import psutil


def peak_rss(cmd: list[str]) -> tuple[int, int, int]:
    """(largest worker's peak RSS, parent's peak RSS, exit code) of `cmd`, in bytes."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    top = psutil.Process(proc.pid)
    worker, parent = 0, 0
    while proc.poll() is None:
        try:
            parent = max(parent, top.memory_info().rss)
            for child in top.children(recursive=True):
                try:
                    worker = max(worker, child.memory_info().rss)
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        time.sleep(0.01)
    if proc.returncode:
        sys.stderr.write(proc.stderr.read().decode(errors="replace")[-2000:])
    return worker, parent, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vary", nargs="+", required=True, help="one override per run")
    ap.add_argument("rest", nargs="+", help="the config, then overrides every run shares")
    args = ap.parse_args()
    for value in args.vary:
        with tempfile.TemporaryDirectory() as root:
            cmd = [sys.executable, "-m", "suite", "run", *args.rest, value, f"results.root={root}", "--no-progress"]
            worker, parent, rc = peak_rss(cmd)
        print(f"{value}: largest rank {worker / 1e6:.0f} MB, parent {parent / 1e6:.0f} MB, exit {rc}")


if __name__ == "__main__":
    main()
