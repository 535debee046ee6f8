"""The host's cost of issuing the traced ops, measured on this machine's CPU: what the simulator's
`host` section of a topology charges per op (suite/sim/engine.py, docs/simulator.md).

A method's host (the Python process driving one GPU) issues every op of its schedule in order; the GPU
cannot start an op the host has not issued yet. What one op costs the host is mostly the same on any
device: Python, the binding, PyTorch's dispatcher and the allocator; the CUDA launch itself comes on
top of it (a published figure, added in the topology file). Three costs, each on tiny tensors so that
the arithmetic is negligible beside the host path:

- `op`: one eager aten op of the kind a method runs between its kernels (the online-softmax merge's
  dtype cast, subtractions, sigmoid, log-sigmoid and products, in a loop of such chains);
- `attention call`: one fused attention call through PyTorch's dispatcher, output and LSE allocated
  (`scaled_dot_product_attention` on CPU): the host path that a flash-attn call also takes;
- `p2p op`: one point-to-point op of `torch.distributed.batch_isend_irecv` (the P2POp objects, the
  process group's coalescing and its Work objects), two processes on gloo; NCCL's own enqueue is in
  its per-message latency, not here.

One torch thread; each figure is the lowest of `--repeats` means over `--calls` calls (a shared
machine's other work only adds time, so the lowest mean is the least disturbed one).

    .venv/bin/python benchmarks/host_cost.py --calls 2000 --repeats 15
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def lowest_mean(fn, calls: int, repeats: int) -> float:
    """Seconds per call: the lowest of `repeats` means over `calls` calls."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def merge_chain(out, lse, block_out, block_lse):
    """Eager ops of the kinds of an online-softmax merge step (cast, differences, sigmoid,
    log-sigmoid, products); returns the new accumulator and LSE."""
    b = block_out.to(torch.float32)
    d = block_lse - lse
    w = torch.sigmoid(d)
    new_out = out - w * (out - b)
    new_lse = lse - F.logsigmoid(-d)
    return new_out, new_lse


def count_ops(fn, *args) -> int:
    """How many aten ops `fn(*args)` dispatches (so the per-op figure divides by what ran)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            Count.n += 1
            return func(*a, **(kw or {}))

    with Count():
        fn(*args)
    return Count.n


def _p2p_worker(rank: int, calls: int, repeats: int, port: int, result) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    peer = 1 - rank
    send, recv = torch.zeros(64), torch.empty(64)
    issue = float("inf")
    for _ in range(repeats):
        dist.barrier()
        spent = 0.0
        for _ in range(calls):
            t = time.perf_counter()
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)])
            spent += time.perf_counter() - t
            for r in reqs:
                r.wait()
        issue = min(issue, spent / calls / 2)  # two P2POps per call
    if rank == 0:
        result.put(issue)
    dist.barrier()
    dist.destroy_process_group()


def p2p_issue_s(calls: int, repeats: int) -> float:
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_p2p_worker, args=(r, calls, repeats, port, result)) for r in range(2)]
    for p in procs:
        p.start()
    value = result.get(timeout=600)
    for p in procs:
        p.join()
    return value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with torch.no_grad():
        # [batch, seq, heads, dim] accumulator and [batch, heads, seq, 1] LSE, as the merge holds them, tiny
        out, block_out = torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16)
        lse, block_lse = torch.zeros(1, 4, 2, 1), torch.zeros(1, 4, 2, 1)
        n_ops = count_ops(merge_chain, out, lse, block_out, block_lse)
        chain = lowest_mean(lambda: merge_chain(out, lse, block_out, block_lse), args.calls, args.repeats)
        q = torch.zeros(1, 2, 16, 64)  # [batch, heads, seq, dim]
        attn = lowest_mean(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True), args.calls, args.repeats)
    p2p = p2p_issue_s(max(args.calls // 4, 50), args.repeats)
    print(f"# host cost per op on {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread")
    print(f"# calls {args.calls}, repeats {args.repeats}: the lowest mean of the repeats")
    per_op = chain / n_ops * 1e6
    print(f"op_us: {per_op:.2f}   # one eager aten op ({n_ops} per merge chain, {chain * 1e6:.1f} us a chain)")
    print(f"attention_call_us: {attn * 1e6:.2f}   # scaled_dot_product_attention, 16 tokens, 2 heads, dim 64")
    print(f"p2p_op_us: {p2p * 1e6:.2f}   # one P2POp of batch_isend_irecv (gloo), its issue only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
