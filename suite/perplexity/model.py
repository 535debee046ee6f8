"""A small LLaMA-style decoder whose attention is any sequence-parallel method.

RMSNorm, rotary position embedding (RoPE), SwiGLU MLP and grouped-query attention, as in LLaMA.
Under sequence parallelism each rank runs the model on its own tokens only: everything but
attention is per token, so the only things that must know about the other ranks are

- RoPE, which must use each token's *global* position (`positions`, from the method's layout;
  under zigzag, striped or TASP layouts a rank's tokens are not a contiguous range), and
- attention itself, the `attend(q, k, v)` callable: local [B, S_local, H, D] shards in, local
  output out, causal on global positions (a method's `attention` bound to its comm), or one
  such callable per layer when the layers mask differently (`perplexity.layer_masks`). With
  attention sinks (`ModelConfig.sinks`, gpt-oss) each layer has one learned logit per query head
  and calls `attend(q, k, v, sinks=...)`: the sinks are a weight like any other, whose gradient
  each rank gives for its own rows and the training loop sums over the ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

# attend(q, k, v), or attend(q, k, v, sinks=...) in a model with attention sinks
Attend = Callable[..., torch.Tensor]
Attends = Union[Attend, Sequence[Attend]]
"""One attention for every layer, or one per layer (a per-layer mask pattern)."""


@dataclass(frozen=True)
class ModelConfig:
    heads: int
    kv_heads: int
    head_dim: int
    layers: int = 2
    vocab: int = 256
    mlp_hidden: int = 0  # 0: LLaMA's rule, 2/3 * 4 * dim rounded up to a multiple of 32
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    sinks: bool = False  # attention sinks: a learned logit per query head in every row's softmax
    head_dim_v: Optional[int] = None  # the values' head dim (MLA-like); None: head_dim

    @property
    def dv(self) -> int:
        return self.head_dim_v or self.head_dim

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def hidden(self) -> int:
        return self.mlp_hidden or 32 * math.ceil(8 * self.dim / 3 / 32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate [B, S, H, D] by the angles of `positions` [S], or [B, S] when they differ per sequence
    (packed documents: positions restart at each document) (LLaMA's rotate-half convention)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float64) / d)
    angles = positions.to(x.device, torch.float64)[..., None] * inv_freq  # [(B,) S, D/2]
    angles = torch.cat((angles, angles), dim=-1)
    if angles.dim() == 2:
        angles = angles.unsqueeze(0)  # [1, S, D]
    cos, sin = angles.cos().to(x.dtype)[:, :, None, :], angles.sin().to(x.dtype)[:, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wq = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.dv, bias=False)  # head_dim_v: MLA's narrower values
        self.wo = nn.Linear(cfg.heads * cfg.dv, cfg.dim, bias=False)
        # zero: at the start the sink weighs as much as one key of score 0 (init_weights draws only
        # the matrices, so the other weights are drawn the same with or without sinks)
        self.sinks = nn.Parameter(torch.zeros(cfg.heads)) if cfg.sinks else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        b, s, _ = x.shape
        c = self.cfg
        q = rope(self.wq(x).view(b, s, c.heads, c.head_dim), positions, c.rope_theta)
        k = rope(self.wk(x).view(b, s, c.kv_heads, c.head_dim), positions, c.rope_theta)
        v = self.wv(x).view(b, s, c.kv_heads, c.dv)
        out = attend(q, k, v) if self.sinks is None else attend(q, k, v, sinks=self.sinks)
        return self.wo(out.reshape(b, s, c.heads * c.dv))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.dim, cfg.norm_eps), Attention(cfg)
        self.mlp_norm, self.mlp = RMSNorm(cfg.dim, cfg.norm_eps), MLP(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions, attend)
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    """Decoder-only LM: tokens [B, S_local] at global `positions` [S_local] -> logits [B, S_local, vocab]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Normal init with std 1/sqrt(fan_in) (residual output projections further scaled by
        1/sqrt(2 * layers)), drawn from `generator` so that every rank, thread or not, gets the same
        weights. Unlike GPT-2's fixed 0.02, which is tuned for wide models, this gives a small model
        attention logits of order one at initialisation, as a 7B model has: attention then depends
        on positions from the first step, so a position bug shows in the loss at once."""
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 1.0 if name == "embed.weight" else p.shape[1] ** -0.5
                if name.endswith(("wo.weight", "down.weight")):
                    std /= math.sqrt(2 * self.cfg.layers)
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.dtype) * std)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attends) -> torch.Tensor:
        x = self.embed(tokens)
        per_layer = list(attend) if isinstance(attend, (list, tuple)) else [attend] * len(self.blocks)
        if len(per_layer) != len(self.blocks):
            raise ValueError(f"{len(per_layer)} attention callables for {len(self.blocks)} layers")
        for block, layer_attend in zip(self.blocks, per_layer):
            x = block(x, positions, layer_attend)
        return self.head(self.norm(x))


def sdpa_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Single-device causal attention with torch's SDPA (the baseline; none of the suite's code).
    `mask`: [B, S, S] bool of visible pairs (packed documents), instead of the plain causal mask.
    `sinks`: [H] sink logits; SDPA takes none, so the baseline then writes the softmax out with the
    sink as one more score column (gpt-oss's reference does the same), differentiated by autograd."""
    rep = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)))
    if sinks is not None:
        s = q.shape[2]
        visible = mask.unsqueeze(1) if mask is not None else torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B, H, S, S]
        scores = scores.masked_fill(~visible, float("-inf"))
        column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :s]
        return (probs @ v).transpose(1, 2)
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1)).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
