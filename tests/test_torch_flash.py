"""methods/_torch_flash.py on CPU: PyTorch's CUDA flash ops replaced by float64 stand-ins with the
same calling convention ([B, H, S, D] views, a causal flag used only on square calls), so that the
cutting of any causal offset into the op's calls, the merge of the pieces and the gradient sums are
checked against the math kernel here. tests/test_gpu.py runs the real ops on a GPU."""

import pytest
import torch

from methods import _torch_flash, kernels


def _stand_in_forward(q, k, v, dropout_p, causal, return_debug_mask, *, scale):
    assert dropout_p == 0.0 and not return_debug_mask
    assert not causal or q.shape[2] == k.shape[2], "the causal flag is only used on square calls"
    out, lse = kernels.math_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, causal_offset=0 if causal else None
    )
    return out.transpose(1, 2), lse, None, None, q.shape[2], k.shape[2], None, None, None


def _stand_in_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, causal, s1, s2, *, scale):
    assert cum_q is None and cum_k is None and dropout_p == 0.0
    assert (max_q, max_k) == (q.shape[2], k.shape[2])
    assert not causal or q.shape[2] == k.shape[2]
    t = [x.transpose(1, 2) for x in (dout, q, k, v, out)]
    grads = kernels.math_backward(*t[:4], t[4], lse, scale=scale, causal_offset=0 if causal else None)
    return tuple(g.transpose(1, 2) for g in grads)


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(_torch_flash, "_ops", lambda: (_stand_in_forward, _stand_in_backward))


SHAPES = [(s, t) for s in (1, 5, 12) for t in (1, 7, 12, 20)]


@pytest.mark.parametrize("sq,sk", SHAPES)
def test_pieces_cover_the_visible_pairs_exactly_once(sq, sk):
    for c in [None, *range(-sq - 1, sk + 2)]:
        seen = torch.zeros(sq, sk, dtype=torch.int64)
        for rows, cols, causal in _torch_flash.pieces(sq, sk, c):
            assert rows.stop > rows.start and cols.stop > cols.start
            if causal:
                assert rows.stop - rows.start == cols.stop - cols.start, "causal flag on a non-square call"
                block = torch.ones(rows.stop - rows.start, cols.stop - cols.start).tril().long()
            else:
                block = torch.ones(rows.stop - rows.start, cols.stop - cols.start, dtype=torch.int64)
            seen[rows, cols] += block
        want = kernels.band_visible(sq, sk, c, None).long()
        assert torch.equal(seen, want), (sq, sk, c)
        assert len(_torch_flash.pieces(sq, sk, c)) <= 3


@pytest.mark.parametrize("sq,sk", [(12, 12), (5, 20), (20, 7), (9, 13)])
def test_any_offset_matches_the_math_kernel_in_float64(stand_in, sq, sk):
    g = torch.Generator().manual_seed(sq * 100 + sk)
    q = torch.randn(2, sq, 6, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, sk, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))  # GQA
    dout = torch.randn_like(q)
    for c in [None, -sq - 1, -3, -1, 0, 1, 4, sk - sq, sk - 2, sk]:
        if kernels.is_empty(sq, sk, c):
            continue
        out, lse = _torch_flash.forward(q, k, v, scale=0.3, causal_offset=c)
        ref_out, ref_lse = kernels.math_forward(q, k, v, scale=0.3, causal_offset=c)
        torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=0, msg=f"lse c={c}")
        torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=0, msg=f"out c={c}")
        grads = _torch_flash.backward(dout, q, k, v, ref_out, ref_lse, scale=0.3, causal_offset=c)
        ref = kernels.math_backward(dout, q, k, v, ref_out, ref_lse, scale=0.3, causal_offset=c)
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
            torch.testing.assert_close(got, want, atol=1e-12, rtol=0, msg=f"{name} c={c}")
