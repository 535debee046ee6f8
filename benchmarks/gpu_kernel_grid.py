"""PyTorch's CUDA flash attention (the suite's `torch_flash` kernel) on flash-attention's benchmark grid:
batch x tokens = 16384, heads x head dim = 2048, bf16, tokens 512..16384, full and causal, forward and
backward, as TFLOP/s (FLOPs 4 b s^2 h d, halved when causal, backward 2.5x). The simulator's per-generation
kernel table (configs/topologies/*.yaml `compute.kernels`) takes exactly these figures. Needs a CUDA
device; writes kernel_grid.json to $OUT (or the current folder)."""

import json
import os

import torch

A = torch.ops.aten
TOKENS = [512, 1024, 2048, 4096, 8192, 16384]


def median_ms(fn, n=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    xs = sorted(a.elapsed_time(b) for a, b in ev)
    return xs[len(xs) // 2]


def main():
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "rows": []}
    unused = torch.empty((), dtype=torch.int64, device="cuda")
    for d in (64, 128, 256):
        h = 2048 // d
        for s in TOKENS:
            b = 16384 // s
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            for causal in (False, True):
                scale = d**-0.5

                def fwd():
                    return A._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)

                o, lse = fwd()[:2]

                def bwd():
                    return A._scaled_dot_product_flash_attention_backward(
                        o, q, k, v, o, lse, None, None, s, s, 0.0, causal, unused, unused, scale=scale
                    )

                flops = 4 * b * s * s * h * d * (0.5 if causal else 1.0)
                tf, tb = median_ms(fwd), median_ms(bwd)
                row = dict(head_dim=d, heads=h, batch=b, tokens=s, causal=causal, fwd_ms=tf, bwd_ms=tb)
                row.update(fwd_tflops=flops / tf / 1e9, bwd_tflops=2.5 * flops / tb / 1e9)
                out["rows"].append(row)
                print(json.dumps(row))
    with open(os.path.join(os.environ.get("OUT", "."), "kernel_grid.json"), "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
