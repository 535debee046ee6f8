"""GPU checks: `make gpu-check` on a machine with a CUDA GPU (skipped without one), or part by part
through `benchmarks/gpu_check.py`, the one command for a lent GPU machine (docs/gpu_and_clusters.md).

- every own method, emulated with 2, 4 and 8 virtual ranks on the one GPU (executor threads), in bf16
  with the GPU kernels, checked against float64 (out, lse, dq, dk, dv), causal and full, MHA and GQA;
- every own method under every mask family (uniform and packed documents), emulated with 4 virtual
  ranks in bf16 and checked against float64;
- every own method with the attention variants (sinks, soft cap, MLA head dims, GQA) at 1, 2, 4 and
  8 virtual ranks in bf16, checked against float64 (dsink too);
- world size 1 over NCCL (executor dist) for every method and every importable peer;
- `suite calibrate` on the GPU: a kernel table for the block shapes of the main sweep, with each
  block's TFLOP/s against the device's bf16 peak (written to $SUITE_GPU_CHECK_OUT/kernels.md);
- PyTorch's CUDA flash kernel, and the fused kernels with MLA head dims and soft cap, block by block
  against float64 (CUDA only).

Each sweep's rows are stored per trial under $SUITE_GPU_CHECK_OUT/results/<sweep>/ (so a check cut
at its time limit keeps the rows it finished) and, once it ends, in $SUITE_GPU_CHECK_OUT/<sweep>.jsonl.
SUITE_GPU_CHECK_DEVICE=cpu runs the same checks on CPU (gloo, CPU kernels, shorter sequences and
head dims): that tests the checks themselves on a machine without a GPU.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import own_methods

DEVICE = os.environ.get("SUITE_GPU_CHECK_DEVICE", "cuda")
OUT = Path(os.environ.get("SUITE_GPU_CHECK_OUT", "results/gpu_check"))
ROOT = Path(__file__).resolve().parents[1]
OWN = own_methods()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(),
        reason="needs a CUDA device: run `make gpu-check` on a GPU machine (SUITE_GPU_CHECK_DEVICE=cpu checks the "
        "checks on CPU)",
    ),
]
HEAD_DIM = 128 if DEVICE == "cuda" else 32
# Tokens per sequence: 1008 = 16 x 63 takes every layout at 8 ranks; the CPU run keeps 16 x 21.
SEQ = 1008 if DEVICE == "cuda" else 336
# MLA head dims (DeepSeek-V3: q/k 192, v 128), and a CPU pair in the same proportion.
MLA_QK, MLA_V = (192, 128) if DEVICE == "cuda" else (48, 32)


def _sweep(tmp_path, name: str, sweep: dict, run: dict, **sections) -> list[dict]:
    """Run one sweep; its rows reach OUT/results/<name>/ trial by trial, and OUT/<name>.jsonl at the end."""
    from suite.config import load_config
    from suite.runner import run_sweep

    path = tmp_path / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": name,
                "sweep": sweep,
                "run": {"device": DEVICE, **run},
                "results": {"root": str((OUT / "results").resolve())},
                "tracking": {"mlflow": False},
                **sections,
            }
        )
    )
    cfg, text = load_config(path)
    res = run_sweep(cfg, text, progress=False)
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / f"{name}.jsonl", "w") as f:
        for r in res.records:
            f.write(json.dumps(r) + "\n")
    return res.records


def _bad(rows: list[dict]) -> list[str]:
    return [
        f"{r['method']} P={r['world_size']} {r['dtype']} causal={r['causal']} {r['pass']} H={r['heads']}/"
        f"{r['kv_heads']}: {r['status']}: {r['reason'][:300]}"
        for r in rows
        if r["status"] != "ok"
    ]


def test_single_gpu_emulation_checks_every_own_method_in_bf16(tmp_path):
    rows = _sweep(
        tmp_path,
        "gpu_emulation",
        {
            "methods": OWN,
            "world_size": [2, 4, 8],
            "batch": [1],
            "seq_len": [SEQ],
            "heads": [8],
            "kv_heads": [8, 2],
            "head_dim": [HEAD_DIM],
            "dtype": ["bfloat16"],
            "causal": [True, False],
            "passes": ["fwd_bwd"],  # its forward is checked too (out, lse); fwd-only trials run on CPU
            "method_options": {"usp": {"ulysses_degree": 2}},
        },
        {"executor": "threads", "warmup": 1, "repeats": 2, "breakdown": False},
    )
    assert len(rows) == len(OWN) * 3 * 2 * 2
    assert not _bad(rows), "\n".join(_bad(rows))
    assert all(r["checked"] for r in rows)
    from methods import kernels

    if DEVICE == "cuda":  # a GPU kernel, not the math fallback: flash-attn where installed, else PyTorch's own
        gpu_kernel = "flash_attn" if kernels.kernel_status("flash_attn")[0] else "torch_flash"
        assert {r["kernel_used"] for r in rows} == {gpu_kernel}, {r["kernel_used"] for r in rows}


def test_single_gpu_emulation_checks_every_mask_family(tmp_path):
    rows = _sweep(
        tmp_path,
        "gpu_masks",
        {
            "methods": OWN,
            "world_size": [4],
            "batch": [1],
            "seq_len": [SEQ],
            "heads": [8],
            "kv_heads": [2],
            "head_dim": [HEAD_DIM],
            "dtype": ["bfloat16"],
            "mask": ["window", "window_sym", "chunks", "prefix", "blocks", "question", "globals"],
            "passes": ["fwd_bwd"],
            "workload": ["uniform", "docs"],
            "method_options": {"usp": {"ulysses_degree": 2}},
        },
        {"executor": "threads", "warmup": 0, "repeats": 1, "breakdown": False},
        masks={
            "window": {"family": "sliding_window", "window": 100},
            "window_sym": {"family": "sliding_window", "window": 100, "symmetric": True},
            "chunks": {"family": "chunked", "chunk": 96},
            "prefix": {"family": "prefix_lm", "prefix": 0.25},
            "blocks": {"family": "block_causal", "block": 40},
            "question": {"family": "shared_question", "question": 64, "answers": 3},
            "globals": {"family": "global_window", "globals": 4, "window": 64},
        },
        documents={"docs": {"distribution": "lognormal", "median": 200, "sigma": 0.8, "min": 16, "max": SEQ}},
    )
    assert len(rows) == len(OWN) * 7 * 2
    assert not _bad(rows), "\n".join(_bad(rows))
    assert all(r["checked"] for r in rows)


# The variant points: three of the eight (sinks, soft cap, value head dim) combinations, so that each
# variant runs twice and every pair of them meets once; the soft-capped MLA point runs full, the others
# causal. Excluded: (sinks, cap, MLA) = (no, 0, any), (yes, 0, no), (no, 5, no), (yes, 5, yes), and
# the causal flag of the other kind.
VARIANT_EXCLUDES = [
    {"sinks": False, "softcap": 0},
    {"sinks": True, "softcap": 0, "head_dim_v": None},
    {"sinks": False, "softcap": 5, "head_dim_v": None},
    {"sinks": True, "softcap": 5, "head_dim_v": MLA_V},
    {"sinks": False, "causal": True},
    {"sinks": True, "causal": False},
]


def test_single_gpu_emulation_checks_the_variants_at_one_to_eight_ranks(tmp_path):
    """Attention sinks, logit soft cap and MLA head dims (v narrower than q/k), with GQA, for every own
    method at 1, 2, 4 and 8 virtual ranks in bf16 against float64: sinks + MLA (causal), soft cap +
    MLA (full), sinks + soft cap (causal). The soft-capped points run on the math kernel under
    torch_flash (no cap argument), on flash-attn's own where installed."""
    rows = _sweep(
        tmp_path,
        "gpu_variants",
        {
            "methods": OWN,
            "world_size": [1, 2, 4, 8],
            "batch": [1],
            "seq_len": [SEQ],
            "heads": [8],
            "kv_heads": [2],
            "head_dim": [MLA_QK],
            "head_dim_v": [None, MLA_V],
            "softcap": [0, 5],
            "sinks": [False, True],
            "dtype": ["bfloat16"],
            "causal": [True, False],
            "passes": ["fwd_bwd"],
            "exclude": VARIANT_EXCLUDES,
        },
        {"executor": "threads", "warmup": 0, "repeats": 1, "breakdown": False},
    )
    assert len(rows) == len(OWN) * 4 * 3
    seen = {(r.get("sinks", False), r.get("softcap", 0) > 0, r.get("head_dim_v") == MLA_V, r["causal"]) for r in rows}
    assert seen == {(True, False, True, True), (False, True, True, False), (True, True, False, True)}, seen
    assert not _bad(rows), "\n".join(_bad(rows))
    assert all(r["checked"] for r in rows)
    assert all(r.get("err_dsink") is not None for r in rows if r.get("sinks"))


def test_world_size_one_over_nccl_runs_every_method_and_peer(tmp_path):
    import methods

    names = sorted(methods.available())
    rows = _sweep(
        tmp_path,
        "gpu_world1",
        {
            "methods": names,
            "world_size": [1],
            "batch": [2],
            "seq_len": [4096 if DEVICE == "cuda" else 256],
            "heads": [8],
            "kv_heads": [2],
            "head_dim": [HEAD_DIM],
            "dtype": ["bfloat16"],
            "causal": [True, False],
            "passes": ["fwd", "fwd_bwd"],
        },
        {"executor": "dist", "warmup": 1, "repeats": 3},
    )
    ran = [r for r in rows if r["status"] != "skipped"]
    assert {r["method"] for r in ran} >= {"reference", *OWN}, sorted({r["method"] for r in ran})
    assert not _bad(ran), "\n".join(_bad(ran))


def test_calibrate_writes_the_kernel_table_of_the_main_shapes(tmp_path):
    out = OUT / "calibration" / "gpu.yaml"
    cfg = ROOT / "configs" / "gpu_kernels.yaml"
    over = (
        []
        if DEVICE == "cuda"
        else [
            "sweep.seq_len=[448]",
            "sweep.heads=[4]",
            "sweep.kv_heads=[4]",
            "sweep.head_dim=[32]",
            "sweep.world_size=[2]",
        ]
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "suite",
            "calibrate",
            str(cfg),
            *over,
            "--device",
            DEVICE,
            "--out",
            str(out),
            "--repeats",
            "3",
        ]
        + (["--base", "h100_sxm"] if DEVICE == "cuda" else []),
        check=True,
        cwd=ROOT,
    )
    table = yaml.safe_load(out.with_name("gpu.blocks.yaml").read_text())
    blocks = table["blocks"]
    assert blocks and all(b["seconds"] > 0 for b in blocks)
    peak = 989e12 if DEVICE == "cuda" else None
    lines = [
        f"# Kernel times on {table['device']} ({table['kernel']}), from `suite calibrate`",
        "",
        "| op | sq | sk | heads | kv | D | mask offset | ms | TFLOP/s | of bf16 peak |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in blocks:
        tf = b["flops"] / b["seconds"] / 1e12
        lines.append(
            f"| {b['op']} | {b['sq']} | {b['sk']} | {b['heads']} | {b['kv_heads']} | {b['head_dim']} | "
            f"{b['causal_offset']} | {b['seconds'] * 1e3:.3f} | {tf:.1f} | "
            f"{'' if peak is None else f'{tf * 1e12 / peak:.1%}'} |"
        )
    (OUT / "kernels.md").write_text("\n".join(lines) + "\n")


@pytest.mark.skipif(DEVICE != "cuda", reason="PyTorch's CUDA flash kernel runs on CUDA only")
def test_torch_flash_blocks_match_float64():
    """PyTorch's own CUDA flash kernel as a block kernel: out, lse and the gradients taken with a
    given out and lse, for full, causal and shifted blocks, GQA, odd lengths, against float64 math."""
    from methods import kernels

    if not kernels.kernel_status("torch_flash")[0]:
        pytest.skip(kernels.kernel_status("torch_flash")[1])
    g = torch.Generator(device="cuda").manual_seed(0)
    for sq, sk, offset in [(256, 256, None), (200, 200, 0), (256, 256, -1), (256, 256, -64), (129, 300, None)]:
        q = torch.randn(2, sq, 8, HEAD_DIM, device="cuda", generator=g, dtype=torch.bfloat16)
        k, v = (torch.randn(2, sk, 2, HEAD_DIM, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
        dout = torch.randn_like(q)
        scale = HEAD_DIM**-0.5
        out, lse = kernels.block_forward(q, k, v, scale=scale, causal_offset=offset, kernel="torch_flash")
        q64, k64, v64, d64 = (x.double() for x in (q, k, v, dout))
        ref_out, ref_lse = kernels.block_forward(q64, k64, v64, scale=scale, causal_offset=offset, kernel="math")
        grads = kernels.block_backward(dout, q, k, v, out, lse, scale=scale, causal_offset=offset, kernel="torch_flash")
        ref = kernels.block_backward(
            d64, q64, k64, v64, ref_out, ref_lse, scale=scale, causal_offset=offset, kernel="math"
        )
        seen = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), seen), (sq, sk, offset)
        torch.testing.assert_close(lse[seen].double(), ref_lse[seen], atol=2e-2, rtol=0)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2e-2)
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
            torch.testing.assert_close(got.double(), want, atol=5e-2, rtol=5e-2, msg=f"{name} {sq} {sk} {offset}")


@pytest.mark.skipif(DEVICE != "cuda", reason="the fused CUDA kernels run on CUDA only")
@pytest.mark.parametrize("kernel", ["torch_flash", "flash_attn"])
def test_mla_head_dims_and_softcap_on_the_gpu_kernels_match_float64(kernel):
    """DeepSeek-V3's head dims (q/k 192, v 128) on the fused kernels, which take one head dim: the
    kernel layer pads V with zero columns and slices out and dv back; flash-attn also soft-caps
    (cap 5 with scores of a few units). Against float64 math, forward and backward, causal and full."""
    from methods import kernels

    if not kernels.kernel_status(kernel)[0]:
        pytest.skip(kernels.kernel_status(kernel)[1])
    caps = [0.0] + ([5.0] if kernel == "flash_attn" and not kernels.softcap_reason(kernel) else [])
    g = torch.Generator(device="cuda").manual_seed(1)
    for cap in caps:
        for offset in (None, 0):
            q = 3 * torch.randn(1, 256, 8, 192, device="cuda", generator=g, dtype=torch.bfloat16)
            k = torch.randn(1, 256, 8, 192, device="cuda", generator=g, dtype=torch.bfloat16)
            v = torch.randn(1, 256, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16)
            dout = torch.randn(1, 256, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16)
            scale = kernels.with_softcap(192**-0.5, cap)
            out, lse = kernels.block_forward(q, k, v, scale=scale, causal_offset=offset, kernel=kernel)
            grads = kernels.block_backward(dout, q, k, v, out, lse, scale=scale, causal_offset=offset, kernel=kernel)
            q64, k64, v64, d64 = (x.double() for x in (q, k, v, dout))
            ref_out, ref_lse = kernels.block_forward(q64, k64, v64, scale=scale, causal_offset=offset, kernel="math")
            ref = kernels.block_backward(
                d64, q64, k64, v64, ref_out, ref_lse, scale=scale, causal_offset=offset, kernel="math"
            )
            assert out.shape == (1, 256, 8, 128) and grads[2].shape == v.shape
            torch.testing.assert_close(lse.double(), ref_lse, atol=2e-2, rtol=0)
            torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2e-2)
            for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
                torch.testing.assert_close(got.double(), want, atol=1e-1, rtol=5e-2, msg=f"{name} cap {cap} {offset}")
