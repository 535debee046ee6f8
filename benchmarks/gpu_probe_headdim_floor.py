"""GPU probe (reports/recorded/h100_probe_headdim_floor.md): which PyTorch CUDA attention kernels take a
value head dim unlike q/k's (MLA: 192/128), and the per-call floor of the flash op. Needs a CUDA device;
writes probe4.json to $OUT (or the current folder)."""

import functools
import json
import os

import torch
from gpu_kernel_grid import median_ms  # beside this file (run as a script from the repository root)
from torch.nn.attention import SDPBackend, sdpa_kernel

out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
A = torch.ops.aten
dev = "cuda"
dt = torch.bfloat16
t = functools.partial(median_ms, n=20)  # CUDA-event median of 20 calls after 3 warm-up calls


def mk(b, h, s, d, dv=None):
    q = torch.randn(b, h, s, d, device=dev, dtype=dt)
    k = torch.randn(b, h, s, d, device=dev, dtype=dt)
    v = torch.randn(b, h, s, dv or d, device=dev, dtype=dt)
    return q, k, v


# 1. head dims 192/128 on the flash op and the efficient op
for name, fn in [
    ("flash", lambda q, k, v: A._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=0.1)),
    ("efficient", lambda q, k, v: A._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True, scale=0.1)),
    ("cudnn_public", lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)),
]:
    for d, dv in [(192, 128), (192, 192), (128, 128), (64, 64)]:
        key = f"{name}_{d}_{dv}"
        try:
            q, k, v = mk(1, 4, 256, d, dv)
            r = fn(q, k, v)
            torch.cuda.synchronize()
            o = r[0] if isinstance(r, tuple) else r
            out[key] = f"ok out {tuple(o.shape)}"
        except Exception as e:
            out[key] = "error: " + str(e).splitlines()[0][:300]
# public SDPA backends with dv != d
for be in [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]:
    try:
        q, k, v = mk(1, 4, 256, 192, 128)
        q.requires_grad_()
        k.requires_grad_()
        v.requires_grad_()
        with sdpa_kernel([be]):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.sum().backward()
        torch.cuda.synchronize()
        out[f"sdpa_{be.name}_192_128_fwdbwd"] = "ok"
    except Exception as e:
        out[f"sdpa_{be.name}_192_128_fwdbwd"] = "error: " + str(e).splitlines()[0][:300]
# 2. per-call floor of the flash op, fwd and bwd, causal and full, B=1 H=8 D=128
floor = []
for s in [64, 128, 256, 512, 1024, 2048, 4096, 8192]:
    q, k, v = mk(1, 8, s, 128)
    for causal in (False, True):

        def f():
            return A._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=0.088)

        r = f()
        o, lse = r[0], r[1]
        u = torch.empty((), dtype=torch.int64, device=dev)

        def g():
            return A._scaled_dot_product_flash_attention_backward(
                o, q, k, v, o, lse, None, None, s, s, 0.0, causal, u, u, scale=0.088
            )

        fl = 4 * 1 * 8 * s * s * 128 * (0.5 if causal else 1.0)
        tf, tb = t(f), t(g)
        floor.append(
            dict(s=s, causal=causal, fwd_ms=tf, bwd_ms=tb, fwd_tflops=fl / tf / 1e9, bwd_tflops=2.5 * fl / tb / 1e9)
        )
out["floor_b1_h8_d128"] = floor
# 3. empty launch floor: a tiny add and a tiny flash call
x = torch.zeros(1, device=dev)
out["tiny_add_ms"] = t(lambda: x.add_(1))
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe4.json"), "w"), indent=1)
print(json.dumps(out, indent=1))
