import pytest
import torch

from methods import kernels


def naive(q, k, v, offset, scale):
    """Independent oracle: float64 autograd over a masked softmax."""
    q, k, v = (x.double() for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if offset is not None:
        i = torch.arange(q.shape[1])[:, None]
        j = torch.arange(k.shape[1])[None]
        s = s.masked_fill(j > i + offset, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.softmax(s, -1))  # empty rows -> 0
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


CASES = [(7, 7, None), (7, 7, 0), (6, 9, 0), (9, 6, 0), (8, 8, -1), (8, 8, -3), (5, 8, 3), (8, 5, 20)]


@pytest.mark.parametrize("kernel", ["math", "cpu_flash"])
@pytest.mark.parametrize("sq,sk,offset", CASES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_block_forward_backward_match_float64_autograd(kernel, sq, sk, offset, heads, kv_heads):
    torch.manual_seed(0)
    q = torch.randn(2, sq, heads, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, sk, kv_heads, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, sk, kv_heads, 8, dtype=torch.float64, requires_grad=True)
    scale = 0.35
    ref_out, ref_lse = naive(q, k, v, offset, scale)
    out, lse = kernels.block_forward(q, k, v, scale=scale, causal_offset=offset, kernel=kernel)
    assert out.shape == (2, sq, heads, 8) and lse.shape == (2, heads, sq)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-10)
    # rows that see no key: lse must be -inf (the CPU op reports 0 there), output 0
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin], ref_lse[fin], rtol=0, atol=1e-10)
    dout = torch.randn_like(ref_out)
    gref = torch.autograd.grad(ref_out, (q, k, v), dout)
    # the backward takes the (here: global) out and lse; empty rows contribute nothing
    g = kernels.block_backward(dout, q, k, v, out, lse, scale=scale, causal_offset=offset, kernel=kernel)
    for a, b in zip(g, gref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)


def test_merge_of_key_blocks_equals_full_attention():
    torch.manual_seed(1)
    q = torch.randn(2, 10, 4, 8)
    k = torch.randn(2, 12, 2, 8)
    v = torch.randn(2, 12, 2, 8)
    full, full_lse = kernels.block_forward(q, k, v, scale=0.3, causal_offset=2)
    out, lse = kernels.empty_accumulators(q)
    for j0, j1 in [(0, 5), (5, 9), (9, 12)]:
        # keys j0.. of a causal block with offset 2: query i sees key j0+j' iff j' <= i + 2 - j0
        bo, bl = kernels.block_forward(q, k[:, j0:j1], v[:, j0:j1], scale=0.3, causal_offset=2 - j0)
        kernels.merge_(out, lse, bo, bl)
    torch.testing.assert_close(out, full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, full_lse, rtol=1e-6, atol=1e-6)


def test_merge_keeps_empty_rows_finite():
    out, lse = kernels.empty_accumulators(torch.zeros(1, 3, 2, 4))
    empty_out = torch.zeros(1, 3, 2, 4)
    empty_lse = torch.full((1, 2, 3), float("-inf"))
    kernels.merge_(out, lse, empty_out, empty_lse)  # -inf with -inf must not give NaN
    assert not torch.isnan(out).any() and torch.isneginf(lse).all()
    block = torch.randn(1, 3, 2, 4)
    block_lse = torch.randn(1, 2, 3)
    kernels.merge_(out, lse, block, block_lse)
    torch.testing.assert_close(out, block)
    torch.testing.assert_close(lse, block_lse)


def test_empty_block_is_skipped_with_minus_inf_lse():
    q = torch.randn(1, 4, 2, 8)
    k = torch.randn(1, 4, 2, 8)
    out, lse = kernels.block_forward(q, k, k, scale=1.0, causal_offset=-4)
    assert torch.equal(out, torch.zeros_like(q)) and torch.isneginf(lse).all()


def test_kernel_resolution_and_errors():
    assert kernels.resolve_kernel("auto", torch.device("cpu"), torch.float32) == "cpu_flash"
    with pytest.raises(ValueError, match="choose one of"):
        kernels.resolve_kernel("fastest", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="flash_attn"):
        kernels.resolve_kernel("flash_attn", torch.device("cpu"), torch.bfloat16)
    ok, why = kernels.kernel_status("flash_attn")
    assert isinstance(ok, bool) and why


def test_block_kernels_reject_mismatched_inputs():
    q = torch.randn(1, 4, 4, 8)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        kernels.block_forward(q, torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3, 8), scale=1.0, causal_offset=None)
    with pytest.raises(ValueError, match="dtypes differ"):
        kernels.block_forward(q, q.double(), q.double(), scale=1.0, causal_offset=None)


@pytest.mark.parametrize("kernel", ["math", "cpu_flash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_from_delta_equals_backward_from_out(kernel, dtype):
    """BurstAttention ships D = rowsum(dO * O) instead of O; the gradients must not change."""
    torch.manual_seed(3)
    q = torch.randn(2, 9, 4, 16, dtype=dtype)
    k = torch.randn(2, 9, 2, 16, dtype=dtype)
    v = torch.randn(2, 9, 2, 16, dtype=dtype)
    out, lse = kernels.block_forward(q, k, v, scale=0.25, causal_offset=0, kernel=kernel)
    dout = torch.randn_like(out)
    dout[0, 3] = 0  # rows with dO = 0 (and so D = 0) must not divide by zero
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    from_out = kernels.block_backward(dout, q, k, v, out, lse, scale=0.25, causal_offset=0, kernel=kernel)
    from_delta = kernels.block_backward(dout, q, k, v, None, lse, scale=0.25, causal_offset=0, kernel=kernel,
                                        delta=delta)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    for a, b in zip(from_out, from_delta):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=tol)
    with pytest.raises(ValueError, match="exactly one"):
        kernels.block_backward(dout, q, k, v, out, lse, scale=0.25, causal_offset=0, delta=delta)
