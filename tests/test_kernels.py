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
    from suite.sim.ledger import Memory, TraceLedger, _Bookkeeping

    ledger = TraceLedger()
    meta = dict(device="meta")
    out, lse = torch.empty(1, 64, 4, 32, **meta), torch.empty(1, 4, 64, **meta)
    block_out, block_lse = torch.empty(1, 64, 4, 32, dtype=torch.bfloat16, **meta), torch.empty(1, 4, 64, **meta)
    with _Bookkeeping(ledger):
        merge.merge_(out, lse, block_out, block_lse)
    ledger.flush()
    acc, blk, row = 64 * 4 * 32 * 4, 64 * 4 * 32 * 2, 4 * 64 * 4
    assert ledger.events == [Memory(2 * acc + blk + 3 * row, 1)]


# -- query tiles (kernels.Tiling): memory and work follow a tile and a band ------------------------
def _banded_oracle(q, k, v, visible, scale):
    """float64 autograd under a [B, Sq, Sk] bool mask (rows that see nothing: output 0, lse -inf)."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(g, 2)) * scale
    s = s.masked_fill(~visible.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.nan_to_num(torch.softmax(s, -1)), v.repeat_interleave(g, 2))
    return out, lse, (q, k, v)


def _band(sq, sk, offset, lower):
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    vis = torch.ones(sq, sk, dtype=torch.bool)
    if offset is not None:
        vis &= j - i <= offset
    if lower is not None:
        vis &= j - i >= lower
    return vis


# (Sq, Sk, causal offset, lower): unmasked, causal offsets of every alignment (strictly lower,
# bottom-right, rows that see nothing), windows, a band open above, a band of rows that see nothing
TILED = [
    (37, 41, None, None),
    (41, 37, 0, None),
    (37, 37, -1, None),
    (29, 43, 14, None),
    (43, 29, -5, None),
    (40, 40, 0, -6),
    (33, 50, 20, 9),
    (45, 31, None, -12),
    (35, 35, -9, -16),
]


@pytest.mark.parametrize("kernel", ["math", "cpu_flash"])
@pytest.mark.parametrize("sq,sk,offset,lower", TILED)
@pytest.mark.parametrize("heads,kv_heads", [(5, 5), (6, 2)])
def test_tiled_blocks_match_float64(monkeypatch, kernel, sq, sk, offset, lower, heads, kv_heads):
    """Blocks cut into query tiles far smaller than the block (7 rows, fewer where a tile's keys
    pass the element budget) against float64 autograd, forward and backward (from out and from
    delta), in float64 and float32."""
    monkeypatch.setattr(kernels, "CPU_TILING", kernels.Tiling(rows=7, elements=2 * heads * 7 * 20))
    keys = kernels._BandKeys(2, sq, sk, offset, lower)
    assert len(kernels._tiles(keys, 2, heads, sq, sk, kernels.CPU_TILING)) >= 5
    torch.manual_seed(sq * sk)
    q, k, v = torch.randn(2, sq, heads, 8), torch.randn(2, sk, kv_heads, 8), torch.randn(2, sk, kv_heads, 8)
    vis = _band(sq, sk, offset, lower).expand(2, sq, sk)
    ref_out, ref_lse, leaves = _banded_oracle(q, k, v, vis, 0.35)
    dout = torch.randn_like(ref_out)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        qq, kk, vv, do = (x.to(dtype) for x in (q, k, v, dout))
        out, lse = kernels.block_forward(qq, kk, vv, scale=0.35, causal_offset=offset, lower=lower, kernel=kernel)
        assert out.dtype == dtype and out.shape == (2, sq, heads, 8)
        grads = kernels.block_backward(
            do, qq, kk, vv, out, lse, scale=0.35, causal_offset=offset, lower=lower, kernel=kernel
        )
        delta = (do.to(lse.dtype) * out.to(lse.dtype)).sum(-1).transpose(1, 2)
        from_delta = kernels.block_backward(
            do, qq, kk, vv, None, lse, scale=0.35, causal_offset=offset, lower=lower, kernel=kernel, delta=delta
        )
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        seen = torch.isfinite(ref_lse)
        torch.testing.assert_close(lse[seen].double(), ref_lse[seen], rtol=0, atol=tol)
        torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=tol)
        for got, alt, want in zip(grads, from_delta, ref_grads):
            assert got.dtype == dtype
            torch.testing.assert_close(got.double(), want, rtol=0, atol=10 * tol)
            torch.testing.assert_close(alt.double(), want, rtol=0, atol=10 * tol)


@pytest.mark.parametrize("kernel", ["math", "cpu_flash"])
def test_tiled_document_blocks_match_float64(monkeypatch, kernel):
    """Partly visible blocks of packed documents (a mask family inside each, strided positions as
    zigzag and stripe layouts give) cut into query tiles whose keys come from the block mask's key
    bounds, against float64 under the dense mask."""
    from methods.documents import PARTIAL, Documents
    from methods.masks import parse

    monkeypatch.setattr(kernels, "CPU_TILING", kernels.Tiling(rows=6, elements=2 * 4 * 6 * 30))
    torch.manual_seed(5)
    tiled = 0
    for text in ("causal", "sliding_window:5", "chunked:7", "shared_question:question=6,answers=3", "full"):
        docs = Documents(((23, 40, 17), (50, 30)), 83, parse(text))
        for qp, kp, causal in [
            (torch.arange(0, 80), torch.arange(0, 80), True),
            (torch.arange(1, 83, 2), torch.arange(0, 83, 2), True),
            (torch.arange(20, 70), torch.arange(10, 60), text != "full"),
        ]:
            m = docs.block(qp, kp, causal)
            if m.kind != PARTIAL:
                continue
            tiled += 1
            q, k, v = torch.randn(2, len(qp), 4, 8), torch.randn(2, len(kp), 2, 8), torch.randn(2, len(kp), 2, 8)
            ref_out, ref_lse, leaves = _banded_oracle(q, k, v, m.dense(), 0.3)
            dout = torch.randn_like(ref_out)
            ref_grads = torch.autograd.grad(ref_out, leaves, dout)
            q, k, v, dout = (x.double() for x in (q, k, v, dout))
            assert len(kernels._tiles(kernels._MaskKeys(m), 2, 4, len(qp), len(kp), kernels.CPU_TILING)) > 5
            out, lse = kernels.block_forward(q, k, v, scale=0.3, causal_offset=0, kernel=kernel, mask=m)
            grads = kernels.block_backward(dout, q, k, v, out, lse, scale=0.3, causal_offset=0, kernel=kernel, mask=m)
            assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
            seen = torch.isfinite(ref_lse)
            torch.testing.assert_close(lse[seen], ref_lse[seen], rtol=0, atol=1e-10)
            torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-10)
            for got, want in zip(grads, ref_grads):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    assert tiled >= 8


@pytest.mark.parametrize("kernel", ["math", "cpu_flash"])
def test_a_block_that_fits_one_tile_runs_as_the_untiled_kernel(kernel):
    """Below the tile budget nothing changes: the same call on the whole block, the same bits."""
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 30, 4, 16), torch.randn(2, 30, 2, 16), torch.randn(2, 30, 2, 16)
    vis = kernels.band_visible(30, 30, 0, -7).expand(2, 30, 30)
    want_out, want_lse = kernels._dense_forward(q, k, v, scale=0.25, visible=vis, backend=kernel)
    out, lse = kernels.block_forward(q, k, v, scale=0.25, causal_offset=0, lower=-7, kernel=kernel)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    dout = torch.randn_like(out)
    want = kernels._dense_backward(dout, q, k, v, out, lse, scale=0.25, visible=vis, backend=kernel, delta=None)
    got = kernels.block_backward(dout, q, k, v, out, lse, scale=0.25, causal_offset=0, lower=-7, kernel=kernel)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    want_out, want_lse = kernels.math_forward(q, k, v, scale=0.25, causal_offset=3)
    out, lse = kernels.block_forward(q, k, v, scale=0.25, causal_offset=3, kernel="math")
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("kernel", ["math", "cpu_flash"])
def test_a_long_window_block_runs_in_memory_that_follows_its_band(kernel):
    """A 16384 x 16384 block under a sliding window of 32 tokens (issue 36: a 32768-token block's
    dense scores and masks killed a rank): the tensors it allocates at its peak (suite.memtrack)
    stay under its outputs plus a few tiles of rows x (rows + window) scores, and within
    `cpu_block_working_set`; the untiled kernels allocated an [Sq, Sk] mask (GiBs) here."""
    from suite.memtrack import TensorMemoryTracker

    b, s, h, hkv, d, window = 1, 16384, 4, 2, 32, 32
    tiling = kernels.CPU_TILING
    keys = kernels._BandKeys(b, s, s, 0, -(window - 1))
    tiles = kernels._tiles(keys, b, h, s, s, tiling)
    assert sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in tiles) <= s * (tiling.rows + window)  # work: the band
    tile = b * h * tiling.rows * (tiling.rows + window) * 4  # one tile's float32 scores
    torch.manual_seed(0)
    q, k, v = torch.randn(b, s, h, d), torch.randn(b, s, hkv, d), torch.randn(b, s, hkv, d)
    with TensorMemoryTracker() as fwd:
        out, lse = kernels.block_forward(q, k, v, scale=0.2, causal_offset=0, lower=-(window - 1), kernel=kernel)
    dout = torch.randn_like(out)
    with TensorMemoryTracker() as bwd:
        kernels.block_backward(dout, q, k, v, out, lse, scale=0.2, causal_offset=0, lower=-(window - 1), kernel=kernel)
    results = {"fwd": out.nbytes + lse.nbytes, "bwd": q.nbytes + 2 * (k.nbytes + v.nbytes)}  # dk, dv: fp32 sums
    for op, tracker in (("fwd", fwd), ("bwd", bwd)):
        bound = results[op] + 16 * tile
        assert tracker.peak_bytes <= bound, (op, tracker.peak_bytes, bound)
        stated = kernels.cpu_block_working_set(
            b, s, s, h, hkv, d, op=op, causal_offset=0, lower=-(window - 1), kernel=kernel
        )
        assert tracker.peak_bytes <= stated <= bound, (op, tracker.peak_bytes, stated)
    assert 10 * max(fwd.peak_bytes, bwd.peak_bytes) < b * s * s  # under a tenth of a byte per (query, key)


WORKING_SETS = [  # (B, H, Hkv, D, Dv, Sq, Sk, causal offset, lower)
    (1, 4, 2, 32, 32, 2000, 2000, 0, -31),
    (1, 4, 2, 32, 32, 1500, 1700, 300, None),
    (1, 4, 2, 32, 32, 3000, 3000, 0, None),
    (2, 6, 3, 16, 24, 700, 900, None, None),
    (2, 6, 3, 16, 24, 200, 150, 40, -20),
    (2, 6, 3, 16, 16, 1201, 1199, -1, None),
]


@pytest.mark.parametrize("kernel", ["math", "cpu_flash"])
@pytest.mark.parametrize("case", WORKING_SETS)
def test_cpu_block_working_set_bounds_the_tracked_peak(kernel, case):
    """The stated working set of a block call is never below the peak suite.memtrack tracks, and
    at most 4 times it: one tile and whole blocks, bands, offsets, GQA, Dv != D (padded on cpu_flash)."""
    from suite.memtrack import TensorMemoryTracker

    b, h, hkv, d, dv, sq, sk, offset, lower = case
    torch.manual_seed(4)
    q, k, v = torch.randn(b, sq, h, d), torch.randn(b, sk, hkv, d), torch.randn(b, sk, hkv, dv)
    with TensorMemoryTracker() as fwd:
        out, lse = kernels.block_forward(q, k, v, scale=0.2, causal_offset=offset, lower=lower, kernel=kernel)
    dout = torch.randn_like(out)
    with TensorMemoryTracker() as bwd:
        kernels.block_backward(dout, q, k, v, out, lse, scale=0.2, causal_offset=offset, lower=lower, kernel=kernel)
    for op, tracker in (("fwd", fwd), ("bwd", bwd)):
        stated = kernels.cpu_block_working_set(
            b, sq, sk, h, hkv, d, dv, op=op, causal_offset=offset, lower=lower, kernel=kernel
        )
        assert tracker.peak_bytes <= stated <= 4 * tracker.peak_bytes, (op, tracker.peak_bytes, stated)


def test_tiled_math_soft_caps_as_the_untiled_kernel(monkeypatch):
    """A soft cap rides on the scale into every tile (forward and the backward's chain rule)."""
    torch.manual_seed(6)
    q, k, v = (torch.randn(2, 39, h, 8, dtype=torch.float64) for h in (6, 3, 3))
    dout = torch.randn(2, 39, 6, 8, dtype=torch.float64)
    scale = kernels.ScoreScale(0.9, softcap=2.0)
    results = []
    for tiling in (kernels.Tiling(), kernels.Tiling(rows=5, elements=2 * 6 * 5 * 12)):
        monkeypatch.setattr(kernels, "CPU_TILING", tiling)
        out, lse = kernels.block_forward(q, k, v, scale=scale, causal_offset=0, lower=-9, kernel="math")
        grads = kernels.block_backward(dout, q, k, v, out, lse, scale=scale, causal_offset=0, lower=-9, kernel="math")
        results.append((out, lse) + grads)
    for untiled, tiled in zip(*results):
        torch.testing.assert_close(tiled, untiled, rtol=0, atol=1e-12)
