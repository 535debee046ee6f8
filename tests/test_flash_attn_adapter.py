"""The flash-attn adapter without a GPU: fake flash-attn modules in the shape of flash-attn >= 2.7
(private functions as torch.library custom ops, whose own signature is (*args, **kwargs)) record
what the adapter passes. The real kernels run in `make gpu-check` on a GPU."""

import sys
import types
from typing import Optional

import pytest
import torch

CALLS = []


@torch.library.custom_op("suite_test_fa::fwd", mutates_args=())
def _fake_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    return_softmax: bool,
) -> list[torch.Tensor]:
    CALLS.append(
        dict(
            sq=q.shape[1],
            sk=k.shape[1],
            causal=causal,
            left=window_size_left,
            right=window_size_right,
            scale=softmax_scale,
            softcap=softcap,
            dv=v.shape[-1],
        )
    )
    lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
    return [q.clone(), lse, torch.empty(0), torch.empty(2)]


@pytest.fixture
def fake_flash_attn(monkeypatch):
    from methods import _flash_attn

    mod = types.ModuleType("flash_attn")
    mod.__version__ = "2.8.3"
    fai = types.ModuleType("flash_attn.flash_attn_interface")
    fai._flash_attn_forward = _fake_forward
    fai._flash_attn_backward = _fake_forward
    mod.flash_attn_interface = fai
    monkeypatch.setitem(sys.modules, "flash_attn", mod)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", fai)
    _flash_attn._load.cache_clear()
    CALLS.clear()
    yield _flash_attn
    _flash_attn._load.cache_clear()


def test_arguments_reach_a_custom_op_by_name(fake_flash_attn):
    fa = fake_flash_attn
    assert fa.version() == "2.8.3"
    q = torch.randn(1, 8, 2, 16)
    fa.forward(q, q, q, scale=0.25, causal_offset=None)
    assert CALLS[-1] == dict(sq=8, sk=8, causal=False, left=-1, right=-1, scale=0.25, softcap=0.0, dv=16)


@pytest.mark.parametrize(
    "sq,sk,offset,expect",
    [
        (8, 8, 0, dict(sq=8, sk=8, causal=True, left=-1, right=-1)),  # aligned diagonal
        (4, 12, 8, dict(sq=4, sk=12, causal=True, left=-1, right=-1)),  # bottom-right (allgather_kv)
        (8, 8, 3, dict(sq=8, sk=8, causal=False, left=-1, right=3)),  # a window to the right
        (8, 8, -1, dict(sq=7, sk=7, causal=True, left=-1, right=-1)),  # striped: q[1:] vs k[:-1]
    ],
)
def test_mask_mapping(fake_flash_attn, sq, sk, offset, expect):
    q, k = torch.randn(1, sq, 2, 16), torch.randn(1, sk, 2, 16)
    out, lse = fake_flash_attn.forward(q, k, k, scale=1.0, causal_offset=offset)
    got = dict(CALLS[-1])
    for name in ("scale", "softcap", "dv"):
        got.pop(name)
    assert got == expect
    if offset == -1:  # the first row sees nothing: zero output, lse -inf
        assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0])) and torch.isneginf(lse[..., 0]).all()


def test_head_dim_limits_are_a_skip_reason(fake_flash_attn, monkeypatch):
    from methods import kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kernels.resolve_kernel("auto", torch.device("cuda"), torch.bfloat16, 128) == "flash_attn"
    assert kernels.resolve_kernel("auto", torch.device("cuda"), torch.bfloat16, 20) == "math"
    with pytest.raises(ValueError, match="multiple of 8 up to 256"):
        kernels.resolve_kernel("flash_attn", torch.device("cuda"), torch.bfloat16, 512)


def test_softcap_and_a_narrower_value_head_reach_flash_attn(fake_flash_attn, monkeypatch):
    """A scale carrying a soft cap passes it as flash-attn's `softcap`, and a value head dim other
    than the query/key one reaches the kernel padded with zero columns to the wider (flash-attn 2
    takes one head dim), the output sliced back to the values' width."""
    from methods import kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert fake_flash_attn.takes_softcap()
    cuda = torch.device("cuda")
    assert kernels.resolve_kernel("auto", cuda, torch.bfloat16, 192, head_dim_v=128, softcap=5.0) == "flash_attn"
    q, v = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 8)
    fake_flash_attn.forward(q, q, q, scale=kernels.ScoreScale(0.25, 5.0), causal_offset=None)
    assert CALLS[-1]["softcap"] == 5.0 and CALLS[-1]["scale"] == 0.25
    monkeypatch.setattr(kernels, "resolve_kernel", lambda *a, **kw: "flash_attn")
    out, _ = kernels.block_forward(q, q, v, scale=0.25, causal_offset=None, kernel="flash_attn")
    assert CALLS[-1]["dv"] == 16 and out.shape == (1, 8, 2, 8)
