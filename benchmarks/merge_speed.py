"""Wall time of one online-softmax merge on this machine's CPU: the unfused chain of torch ops the
methods ran before (a separate pass and an accumulator-sized temporary per op), the registered
merge's eager fallback (in place), and the torch.compile'd kernel (Inductor C++). One thread, so
that a shared machine's other work disturbs it least; the median of `--repeats` calls.

    .venv/bin/python benchmarks/merge_speed.py          # the overhead config's shape and the issue's
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from methods import merge  # noqa: E402


def unfused(out, lse, block_out, block_lse):
    """The merge as the methods wrote it before the fused operator (kept here for comparison)."""
    new_lse = torch.logaddexp(lse, block_lse)
    ref = torch.where(torch.isfinite(new_lse), new_lse, torch.zeros_like(new_lse))
    w_old = torch.exp(lse - ref).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(block_lse - ref).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).add_(block_out.to(out.dtype) * w_new)
    lse.copy_(new_lse)


def timed(fn, args, repeats):
    fn(*args)  # warm-up (and the compile, for the compiled kernel)
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument(
        "--no-compile", action="store_true", help="skip the compiled kernel (its first compile takes a while)"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    shapes = [
        ("overhead_cpu: L=256, 8 heads, D=64, float32", (1, 256, 8, 64), torch.float32),
        ("issue 15: L=1008, 32 heads, D=128, bfloat16", (1, 1008, 32, 128), torch.bfloat16),
    ]
    compiled = None if args.no_compile else torch.compile(merge._merge_fused, dynamic=True)
    print("| shape | unfused ops | merge_ (eager) | compiled kernel |")
    print("|---|---|---|---|")
    for label, (b, s, h, d), dtype in shapes:
        gen = torch.Generator().manual_seed(0)
        out, lse = torch.randn(b, s, h, d, generator=gen), torch.randn(b, h, s, generator=gen)
        block_out, block_lse = torch.randn(b, s, h, d, generator=gen).to(dtype), torch.randn(b, h, s, generator=gen)
        cells = [
            timed(unfused, (out, lse, block_out, block_lse), args.repeats),
            timed(merge._merge_eager, (out, lse, block_out, block_lse), args.repeats),
        ]
        if compiled is not None:
            cells.append(timed(compiled, (out, lse, block_out, block_lse), args.repeats))
        tail = " | - |" if compiled is None else " |"
        print(f"| {label} | " + " | ".join(f"{c * 1e6:.0f} us" for c in cells) + tail)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
