"""ulysses vs usp(ulysses_degree=4) side by side in one gloo group of 4 CPU processes.

The two run the same schedule (USP with ring degree 1 is Ulysses); this calls both methods'
forward and backward directly, alternating which goes first, and prints per-call wall time,
process CPU time and kernel time (methods.kernels.TimedKernel) of rank 0, and the median ratios.
Shape of reports/recorded/advise_cpu_check.md: 8 heads, 4 KV heads, head dim 64, S=2400, float32,
causal, fwd_bwd. Usage: .venv/bin/python benchmarks/ulysses_usp_ab.py [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from methods.comm.dist import DistComm  # noqa: E402
from methods.kernels import TimedKernel, default_scale  # noqa: E402
from methods.registry import get_method  # noqa: E402

B, S, H, HKV, D, P = 1, 2400, 8, 4, 64, 4


def worker(rank: int, port: int, repeats: int, results) -> None:
    torch.set_num_threads(1)  # as the suite's CPU workers: 4 ranks share the cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P)
    comm = DistComm()
    g = torch.Generator().manual_seed(rank)
    local = S // P
    q = torch.randn(B, local, H, D, generator=g)
    k, v = torch.randn(B, local, HKV, D, generator=g), torch.randn(B, local, HKV, D, generator=g)
    dout = torch.randn(B, local, H, D, generator=g)
    methods = {"ulysses": get_method("ulysses"), "usp4": get_method("usp", ulysses_degree=4)}
    scale = default_scale(D)
    rows = {n: [] for n in methods}
    for it in range(repeats + 1):  # iteration 0 is a warm-up
        for name in list(methods) if it % 2 == 0 else list(methods)[::-1]:
            m = methods[name]
            m.kernel = TimedKernel("cpu_flash")
            dist.barrier()
            w0, c0 = time.perf_counter(), time.process_time()
            _, _, residuals = m.forward(q, k, v, comm=comm, causal=True, scale=scale, return_lse=False)
            m.backward(dout, residuals, comm=comm, causal=True, scale=scale)
            w1, c1 = time.perf_counter(), time.process_time()
            if it > 0:
                rows[name].append((w1 - w0, c1 - c0, m.kernel.seconds, m.kernel.calls))
    dist.barrier()
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=worker, args=(r, port, args.repeats, results)) for r in range(P)]
    for p in procs:
        p.start()
    rows = results.get()
    for p in procs:
        p.join()
    for name, rs in rows.items():
        print(
            f"{name:8s} wall ms {[round(r[0] * 1e3) for r in rs]}  cpu ms {[round(r[1] * 1e3) for r in rs]}  "
            f"kernel ms {[round(r[2] * 1e3) for r in rs]}  kernel calls {rs[0][3]}"
        )
    for i, what in enumerate(("wall", "cpu", "kernel")):
        a = statistics.median(r[i] for r in rows["ulysses"])
        b = statistics.median(r[i] for r in rows["usp4"])
        print(f"{what:6s} median ms: ulysses {a * 1e3:.1f}  usp4 {b * 1e3:.1f}  ratio ulysses/usp4 {a / b:.3f}")


if __name__ == "__main__":
    main()
