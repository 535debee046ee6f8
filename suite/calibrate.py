"""`python -m suite calibrate`: measure what the simulator needs on the machine at hand.

- Kernel times: every block shape that a sweep's schedules emit (traced, not guessed) is timed
  with the suite's own block kernels on this device (median of repeats), written as a table the
  compute model reads (`compute.table`). On a GPU this is the per-block-shape calibration
  topology_sim.md section 5 asks for: one GPU can time every block, though not the links.
- Links (CPU only): gloo over loopback between local processes, through the suite's DistComm -
  latency of a small exchange, one flow's bandwidth (one sender), and the aggregate of four ranks
  exchanging along a ring at once (what all flows of the host share: memory copies on its cores).

The output is a topology YAML (and its table beside it): on CPU a complete model of this host
(`shared_cores`: the ranks share the cores as worker processes do); on a GPU the `--base`
topology with its tile model replaced by the measured table.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
from pathlib import Path
from typing import Optional

import torch
import yaml

from methods import kernels
from methods.stopwatch import Stopwatch
from suite.sim.ledger import Compute

KB, MB = 1 << 10, 1 << 20


def sweep_blocks(cfg) -> list[Compute]:
    """The distinct blocks (shape, mask, dtype) of every own-method trial of a sweep, traced."""
    import methods
    from suite.plan import Place, expand
    from suite.sim.trace import TraceCache
    from suite.workloads import make_workload

    cache, seen = TraceCache(), set()
    places = [Place("calibrate", "single-node", lambda world_size: 1)]
    for spec in expand(cfg, make_workload(cfg.kind, cfg), places, "cpu"):
        if spec.method not in methods.available() or spec.world_size < 2:
            continue
        m = spec.build_method()
        case = spec.run_case(m)
        if m.needs_processes or not m.supports(case)[0] or (spec.pass_ != "fwd" and m.forward_only_reason(case)):
            continue
        for rank in cache.get(spec.method, case, spec.pass_, spec.method_options).ranks:
            for e in rank:
                if isinstance(e, Compute) and e.pairs:
                    seen.add(e)
    return sorted(seen, key=lambda e: (e.op, e.flops))


def _random_block(e: Compute, device: torch.device):
    """Random q, k, v and dout of block `e`'s shapes (seeded), on `device` in its dtype."""
    dt = getattr(torch, e.dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    shapes = [(e.sq, e.heads), (e.sk, e.kv_heads), (e.sk, e.kv_heads), (e.sq, e.heads)]
    return tuple(
        torch.randn(e.batch, n, h, e.head_dim, generator=g, dtype=torch.float32).to(device=device, dtype=dt)
        for n, h in shapes
    )


def time_block(e: Compute, device: torch.device, kernel: str, repeats: int) -> float:
    """Median seconds of one block call with the suite's kernel (random inputs)."""
    q, k, v, dout = _random_block(e, device)
    scale = kernels.default_scale(e.head_dim)
    if e.op == "fwd":

        def call():
            kernels.block_forward(q, k, v, scale=scale, causal_offset=e.causal_offset, kernel=kernel)
    else:
        out, lse = kernels.block_forward(q, k, v, scale=scale, causal_offset=e.causal_offset, kernel=kernel)

        def call():
            kernels.block_backward(dout, q, k, v, out, lse, scale=scale, causal_offset=e.causal_offset, kernel=kernel)

    return median_seconds(call, device, repeats)


def median_seconds(fn, device: torch.device, repeats: int) -> float:
    """Median time of `fn` over `repeats` calls after two warm-up calls (the suite's one timer:
    CUDA events on a GPU, wall time on CPU)."""
    samples = []
    for i in range(repeats + 2):
        watch = Stopwatch(device)
        with watch.region():
            fn()
        if i >= 2:
            samples.append(watch.seconds)
    return statistics.median(samples)


def measure_memory(device: torch.device, repeats: int) -> dict:
    """The methods' bookkeeping rates: bandwidth of an elementwise op on a large tensor (bytes read
    + written), and the fixed cost of one op on a tiny tensor."""

    def timed(fn) -> float:
        return median_seconds(fn, device, repeats)

    n = (64 if device.type == "cuda" else 8) * MB // 4
    a, b = torch.ones(n, device=device), torch.ones(n, device=device)
    tiny = torch.ones(4, device=device)
    op = timed(lambda: tiny.mul_(1.0))
    big = timed(lambda: b.mul_(1.0).add_(a))  # two ops: 2 + 3 tensor passes of n floats
    return {"GBps": round(5 * n * 4 / max(big - 2 * op, 1e-9) / 1e9, 3), "op_us": round(op * 1e6, 3)}


def _sleep_cycles_per_second(device: torch.device) -> float:
    """Clock rate that torch.cuda._sleep counts in, measured (it spins for a number of GPU cycles)."""
    n = 10_000_000
    secs = median_seconds(lambda: torch.cuda._sleep(n), device, 3)
    return n / secs


def measure_overlap(e: Compute, device: torch.device, kernel: str, repeats: int, rates_GBps=(180.0, 370.0)) -> dict:
    """How much a kernel slows while the GPU moves data beside it (CUDA only): block `e` is timed
    alone, then while a second stream copies a 64 MiB buffer at a paced rate (copies separated by
    GPU-side sleeps), for each rate in GB/s of bytes copied (each byte is read and written: a send
    and a receive of that rate each). A stand-in for NCCL traffic, which also holds a few SMs for
    the whole exchange: it measures the HBM and SM contention of the copies, not NCCL's own kernels.
    Returns {block, alone_ms, rows: [{target_GBps, achieved_GBps, ms, slowdown}]}."""
    q, k, v, _ = _random_block(e, device)
    scale = kernels.default_scale(e.head_dim)

    def call():
        kernels.block_forward(q, k, v, scale=scale, causal_offset=e.causal_offset, kernel=kernel)

    alone = median_seconds(call, device, repeats)
    src = torch.empty(64 * MB, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = median_seconds(lambda: dst.copy_(src), device, repeats)
    hz = _sleep_cycles_per_second(device)
    side = torch.cuda.Stream(device)
    rows = []
    for rate in rates_GBps:
        period = src.numel() / (rate * 1e9)
        gap = max(period - copy_s, 0.0)
        copies = int(alone * 3 / period) + 2  # the side traffic outlasts the kernel
        samples, achieved = [], []
        for i in range(repeats + 1):
            torch.cuda.synchronize(device)
            start_side, end_side = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(side):
                start_side.record(side)
                for _ in range(copies):
                    dst.copy_(src)
                    if gap:
                        torch.cuda._sleep(int(gap * hz))
                end_side.record(side)
            torch.cuda._sleep(int(alone * 0.5 * hz))  # let the side stream reach its steady rate first
            watch = Stopwatch(device)
            with watch.region():
                call()
            torch.cuda.synchronize(device)
            if i >= 1:
                samples.append(watch.seconds)
                achieved.append(copies * src.numel() / (start_side.elapsed_time(end_side) / 1e3) / 1e9)
        ms = statistics.median(samples)
        rows.append(
            {
                "target_GBps": rate,
                "achieved_GBps": round(statistics.median(achieved), 1),
                "ms": round(ms * 1e3, 4),
                "slowdown": round(ms / alone - 1.0, 4),
            }
        )
    block = f"fwd {e.sq}x{e.sk} heads {e.heads}/{e.kv_heads} D {e.head_dim} offset {e.causal_offset} {e.dtype}"
    return {"block": block, "alone_ms": round(alone * 1e3, 4), "copy_64MiB_ms": round(copy_s * 1e3, 4), "rows": rows}


# ---------------------------------------------------------------------------------------------
# Loopback links (CPU, gloo)
# ---------------------------------------------------------------------------------------------
def _link_worker(rank: int, world: int, port: int, sizes: list[int], repeats: int, pattern: str, out) -> None:
    import torch.distributed as dist

    from methods.comm.base import P2P
    from methods.comm.dist import DistComm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    comm = DistComm()
    res = {}
    for n in sizes:
        send, recv = torch.zeros(max(n // 4, 1)), torch.empty(max(n // 4, 1))
        if pattern == "one-way":  # rank 0 -> rank 1 only: one flow
            ops = [P2P("send", send, 1)] if rank == 0 else [P2P("recv", recv, 0)]
        else:  # every rank sends to the next and receives from the previous, as a ring step does
            ops = [P2P("send", send, (rank + 1) % world), P2P("recv", recv, (rank - 1) % world)]
        samples = []
        for i in range(repeats + 2):
            comm.barrier()
            watch = Stopwatch("cpu")
            with watch.region():
                comm.exchange(ops).wait()
            if i >= 2:
                samples.append(watch.seconds)
        res[n] = statistics.median(samples)
    dist.barrier()
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def measure_link(world: int, sizes: list[int], repeats: int, pattern: str) -> dict[int, float]:
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_link_worker, args=(r, world, port, sizes, repeats, pattern, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return res


def _busy_worker(threads: int, seconds_out, barrier, repeats: int) -> None:
    torch.set_num_threads(threads)
    e = Compute("fwd", 1, 512, 512, 8, 8, 64, None, "float32")
    time_block(e, torch.device("cpu"), "auto", 1)
    barrier.wait()
    seconds_out.put(time_block(e, torch.device("cpu"), "auto", repeats))


def effective_cores(procs: int, threads: int, repeats: int) -> float:
    """How many ranks' worth of kernel work the host does at once: `procs` processes time the same
    block together; effective cores = procs x (time alone / time together). Hyperthreads, shared
    caches and memory bandwidth make it less than the core count."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")

    def run(n: int) -> float:
        q, barrier = ctx.Queue(), ctx.Barrier(n)
        ps = [ctx.Process(target=_busy_worker, args=(threads, q, barrier, repeats)) for _ in range(n)]
        for p in ps:
            p.start()
        times = [q.get(timeout=300) for _ in ps]
        for p in ps:
            p.join(timeout=60)
        return statistics.median(times)

    alone = run(1)
    return procs * alone / run(procs)


def fit_alpha_beta(times: dict[int, float]) -> tuple[float, float]:
    """(latency s, bandwidth B/s) from exchange times: latency = the smallest message's time,
    bandwidth = least squares of (time - latency) against bytes over messages >= 1 MiB."""
    alpha = times[min(times)]
    big = [(n, t - alpha) for n, t in times.items() if n >= MB]
    beta = sum(n * n for n, _ in big) / sum(n * t for n, t in big)
    return alpha, beta


def calibrate(
    cfg, *, out: Path, device: torch.device, threads: Optional[int], repeats: int, base: Optional[str], log=print
) -> Path:
    from suite.env import hardware_label
    from suite.executors.local import available_cores

    kernel_name = kernels.resolve_kernel(
        cfg.run.kernel, device, torch.float32 if device.type == "cpu" else torch.bfloat16
    )
    ws = sorted(w for w in cfg.sweep.world_size if w >= 2) or [2]
    if device.type == "cpu":  # as the dist executor sets it for the smallest multi-rank world
        threads = threads or max(1, available_cores() // ws[0])
        torch.set_num_threads(threads)
    blocks = sweep_blocks(cfg)
    log(
        f"timing {len(blocks)} distinct blocks on {device} with kernel {kernel_name}"
        + (f", {threads} thread(s)" if device.type == "cpu" else "")
    )
    rows = []
    for e in blocks:
        secs = time_block(e, device, cfg.run.kernel, repeats)
        rows.append({**dataclasses.asdict(e), "pairs": e.pairs, "flops": e.flops, "seconds": secs})
    label = hardware_label(device.type)
    memory = measure_memory(device, repeats)
    log(f"bookkeeping: {memory['GBps']} GB/s elementwise, {memory['op_us']} us per op")
    overlap = None
    if device.type == "cuda" and blocks:
        fwd = [e for e in blocks if e.op == "fwd" and e.causal_offset is None] or blocks
        e = dataclasses.replace(max(fwd, key=lambda b: b.flops), op="fwd")
        overlap = measure_overlap(e, device, cfg.run.kernel, repeats)
        log(
            f"overlap ({overlap['block']}, {overlap['alone_ms']} ms alone): "
            + ", ".join(f"{r['achieved_GBps']} GB/s copied beside it -> +{r['slowdown']:.1%}" for r in overlap["rows"])
        )
    table = {
        "device": label,
        "kernel": kernel_name,
        "threads": threads,
        "memory": memory,
        **({"overlap": overlap} if overlap else {}),
        "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "sweep": cfg.name,
        "blocks": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    table_path = out.with_name(out.stem + ".blocks.yaml")
    table_path.write_text(yaml.safe_dump(table, sort_keys=False))
    if device.type == "cuda":
        from suite.sim.topology import load_topology, topology_path

        base_path = topology_path(base or "h100_sxm")
        topo = yaml.safe_load(base_path.read_text())
        topo["name"] = out.stem
        topo["compute"]["table"] = table_path.name
        topo["description"] = f"{base_path.stem} with kernel times measured on {label}"
        out.write_text(yaml.safe_dump(topo, sort_keys=False))
        load_topology(str(out))
        return out
    sizes = [4, 64 * KB, MB, 4 * MB, 16 * MB]
    cores = available_cores()
    assert threads is not None  # set above: past the CUDA case, the host's CPU
    eff_cores = min(effective_cores(cores, threads, repeats), float(cores))
    log(f"{cores} cores do {eff_cores:.2f} ranks' worth of kernel work at once")
    log("measuring gloo loopback: latency and one flow (2 ranks), a ring step of 4 ranks")
    one = measure_link(2, sizes, repeats, "one-way")
    ring4 = measure_link(4, sizes, repeats, "ring")
    alpha, flow = fit_alpha_beta(one)
    _, per_flow4 = fit_alpha_beta(ring4)
    fabric = 4 * per_flow4  # four flows at once share the host (its cores copy every byte)
    topo = {
        "name": out.stem,
        "gpu": label,
        "description": f"this host, measured by `python -m suite calibrate` ({table['measured']})",
        "gpus_per_node": 64,
        "max_nodes": 1,
        "intra": {
            "kind": "switch",
            "port_GBps": round(flow / 1e9, 4),
            "flow_GBps": round(flow / 1e9, 4),
            "fabric_GBps": round(min(fabric, 2 * flow) / 1e9, 4),
            "latency_us": round(alpha * 1e6, 2),
            "measured": {
                "one_flow_s": {int(k): v for k, v in one.items()},
                "ring4_s": {int(k): v for k, v in ring4.items()},
            },
        },
        "compute": {"shared_cores": round(eff_cores, 3), "table": table_path.name, "cores": cores},
    }
    out.write_text(yaml.safe_dump(topo, sort_keys=False))
    log(
        f"latency {alpha * 1e6:.1f} us, one flow {flow / 1e9:.2f} GB/s, 4-rank ring {fabric / 1e9:.2f} GB/s "
        f"aggregate -> {out}"
    )
    return out
