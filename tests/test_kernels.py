import pytest
import torch

from methods import kernels, merge


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
    out, lse = merge.empty_accumulators(q)
    for j0, j1 in [(0, 5), (5, 9), (9, 12)]:
        # keys j0.. of a causal block with offset 2: query i sees key j0+j' iff j' <= i + 2 - j0
        bo, bl = kernels.block_forward(q, k[:, j0:j1], v[:, j0:j1], scale=0.3, causal_offset=2 - j0)
        merge.merge_(out, lse, bo, bl)
    torch.testing.assert_close(out, full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, full_lse, rtol=1e-6, atol=1e-6)


def test_merge_keeps_empty_rows_finite():
    out, lse = merge.empty_accumulators(torch.zeros(1, 3, 2, 4))
    empty_out = torch.zeros(1, 3, 2, 4)
    empty_lse = torch.full((1, 2, 3), float("-inf"))
    merge.merge_(out, lse, empty_out, empty_lse)  # -inf with -inf must not give NaN
    assert not torch.isnan(out).any() and torch.isneginf(lse).all()
    block = torch.randn(1, 3, 2, 4)
    block_lse = torch.randn(1, 2, 3)
    merge.merge_(out, lse, block, block_lse)
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
    from_delta = kernels.block_backward(
        dout, q, k, v, None, lse, scale=0.25, causal_offset=0, kernel=kernel, delta=delta
    )
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    for a, b in zip(from_out, from_delta):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=tol)
    with pytest.raises(ValueError, match="exactly one"):
        kernels.block_backward(dout, q, k, v, out, lse, scale=0.25, causal_offset=0, delta=delta)


def _merge_reference(out, lse, block_out, block_lse):
    """The online-softmax merge in float64 by its definition (separate ops, no fusion)."""
    out, lse, block_out, block_lse = (x.double() for x in (out, lse, block_out, block_lse))
    new = torch.logaddexp(lse, block_lse)
    ref = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    w_old = torch.exp(lse - ref).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(block_lse - ref).transpose(1, 2).unsqueeze(-1)
    return out * w_old + block_out * w_new, new


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_fused_merge_and_final_merge_equal_the_definition(dtype):
    """The registered merge (in place, on a view of the accumulator) and the final merge (cast
    fused in) give the float64 merge, with empty rows on either side; the final merge leaves the
    accumulator untouched."""
    torch.manual_seed(0)
    acc = merge.acc_dtype(dtype)
    out = torch.randn(2, 9, 3, 4, dtype=acc)
    lse = torch.randn(2, 3, 9, dtype=acc)
    block_out = torch.randn(2, 5, 3, 4).to(dtype)
    block_lse = torch.randn(2, 3, 5, dtype=acc)
    lse[0, 0, 2] = float("-inf")
    out[0, 2, 0] = 0
    block_lse[0, 0, 1] = float("-inf")  # row 4 of the view: nothing new
    block_out[0, 1, 0] = 0
    block_lse[1, 2, 0] = lse[1, 2, 4] = float("-inf")  # nothing on either side
    block_out[1, 0, 2] = out[1, 4, 2] = 0
    want_out, want_lse = _merge_reference(out[:, 4:], lse[:, :, 4:], block_out, block_lse)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    o, l = out.clone(), lse.clone()
    merge.merge_(o[:, 4:], l[:, :, 4:], block_out, block_lse)
    assert torch.equal(o[:, :4], out[:, :4]) and torch.equal(l[:, :, :4], lse[:, :, :4])
    assert (o[:, 4:].double() - want_out).abs().max() < tol
    assert torch.equal(torch.isinf(l[:, :, 4:]), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    assert (l[:, :, 4:].double()[finite] - want_lse[finite]).abs().max() < tol
    o, l = out[:, 4:].clone(), lse[:, :, 4:].clone()
    before = o.clone()
    result = merge.merge_final(o, l, block_out, block_lse, dtype)
    assert result.dtype == dtype and torch.equal(o, before)
    assert (result.double() - want_out.to(dtype).double()).abs().max() <= (tol if dtype == torch.float64 else 2**-7)
    assert not torch.isnan(result).any()


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_two_block_starts_equal_the_definition(dtype, direct):
    """merge_start (two blocks' results into fresh accumulators) and sum_start (two gradients into
    a fresh fp32 sum), through the operator and called directly (grad off: the eager code), equal
    the float64 definition, with empty rows on either side and on both; their inputs stay as they
    are, except lse_a, which a direct caller hands over."""
    torch.manual_seed(1)
    acc = merge.acc_dtype(dtype)
    out_a, out_b = torch.randn(2, 7, 3, 4).to(dtype), torch.randn(2, 7, 3, 4).to(dtype)
    lse_a, lse_b = torch.randn(2, 3, 7, dtype=acc), torch.randn(2, 3, 7, dtype=acc)
    lse_a[0, 1, 2] = float("-inf")
    out_a[0, 2, 1] = 0
    lse_b[1, 0, 5] = float("-inf")
    out_b[1, 5, 0] = 0
    lse_a[1, 2, 6] = lse_b[1, 2, 6] = float("-inf")
    out_a[1, 6, 2] = out_b[1, 6, 2] = 0
    want_out, want_lse = _merge_reference(out_a.double(), lse_a.double(), out_b.double(), lse_b.double())
    a_before, b_before, lse_b_before = out_a.clone(), out_b.clone(), lse_b.clone()
    with torch.set_grad_enabled(not direct):
        out, lse = merge.merge_start(out_a, lse_a.clone(), out_b, lse_b)
        total = merge.sum_start(out_a, out_b)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert out.dtype == lse.dtype == total.dtype == acc
    assert (out.double() - want_out).abs().max() < tol and not torch.isnan(out).any()
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert (lse.double()[torch.isfinite(want_lse)] - want_lse[torch.isfinite(want_lse)]).abs().max() < tol
    assert (total.double() - (out_a.double() + out_b.double())).abs().max() < tol
    assert torch.equal(out_a, a_before) and torch.equal(out_b, b_before) and torch.equal(lse_b, lse_b_before)


def test_fused_merge_is_traced_as_one_op_with_its_bytes():
    """On meta tensors (the simulator's tracer) the merge is one operator that reads the accumulator
    and the block and writes the accumulator: what one fused kernel moves."""
    from suite.sim.record import Memory, TraceLedger, _Bookkeeping

    ledger = TraceLedger()
    meta = dict(device="meta")
    out, lse = torch.empty(1, 64, 4, 32, **meta), torch.empty(1, 4, 64, **meta)
    block_out, block_lse = torch.empty(1, 64, 4, 32, dtype=torch.bfloat16, **meta), torch.empty(1, 4, 64, **meta)
    with _Bookkeeping(ledger):
        merge.merge_(out, lse, block_out, block_lse)
    ledger.flush()
    acc, blk, row = 64 * 4 * 32 * 4, 64 * 4 * 32 * 2, 4 * 64 * 4
    assert ledger.events == [Memory(2 * acc + blk + 3 * row, 1)]
