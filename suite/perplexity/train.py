"""Train and evaluate the small model with one sequence-parallel method (or on one device).

The same function runs the single-device baseline and every rank of a sequence-parallel run, so
the two differ only where sequence parallelism must differ:

- inputs and labels: the window of S + 1 tokens is shifted *globally* (labels = next token on the
  whole sequence), then both are sharded by the method's layout;
- positions: RoPE gets the layout's global positions;
- loss: the sum of the rank's token losses divided by the *global* token count, so the ranks'
  losses add up to the baseline's mean;
- gradients: summed over the sequence-parallel group after backward (each rank's parameter
  gradient is its tokens' share; the attention backward already returned the dK/dV of its tokens'
  keys to their owners), so every rank takes the same optimizer step.

`planted_bug` breaks one of these on purpose, so that a test (or a user) can see the check catch it.

A layer pattern with a `prefix_lm` mask (the prefix attends both ways) would let a prefix token see
the token it predicts; `loss_skip` then leaves the labels inside each document's prefix out of the
loss (`prefix_loss_skip`), in the baseline and the methods alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from methods import layouts
from methods.comm import CommLedger, CountingComm
from methods.comm.base import Comm
from methods.documents import Documents
from methods.masks import Mask
from methods.stopwatch import Stopwatch
from suite.perplexity.data import Corpus, train_windows, val_windows
from suite.perplexity.model import Attends, ModelConfig, TinyLlama

PLANTED_BUGS = {
    "none": "no bug",
    "local_positions": "RoPE gets local positions 0..S_local-1 instead of the layout's global positions",
    "local_label_shift": "labels shifted per rank after sharding (each shard's last token loses its label, "
    "and non-contiguous layouts get wrong next tokens)",
    "no_grad_sync": "parameter gradients are not summed over the sequence-parallel group",
    "cross_document_attention": "with packed documents, the sequence-parallel attention ignores their boundaries "
    "(attends across documents; no effect on one document per sequence)",
    "sink_per_rank": "with attention sinks, the sink counts once per rank instead of once per row (as when "
    "every rank's partial result is folded with it before the merge: P e^s in the denominator; no effect "
    "without sinks)",
}


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 50
    batch: int = 4
    seq_len: int = 256
    lr: float = 3e-3
    warmup_steps: int = 5
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_batches: int = 4
    seed: int = 0
    planted_bug: str = "none"


@dataclass
class TrainResult:
    losses: list[float]  # global mean training loss of each step (before its update)
    val_loss: float  # global mean validation loss after training
    step_ms: list[float]  # wall time of each step on this rank
    attn_bytes_sent: int = 0  # attention communication of one training step (forward + backward)
    attn_bytes_recv: int = 0
    grad_norms: list[float] = field(default_factory=list)  # global gradient 2-norm of each step, before clipping

    @property
    def perplexity(self) -> float:
        return math.exp(self.val_loss)


def build_model(cfg: ModelConfig, seed: int, dtype: torch.dtype, device: torch.device) -> TinyLlama:
    """The same initial weights on every rank and in the baseline (a private generator: virtual
    ranks are threads sharing torch's global one)."""
    model = TinyLlama(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.to(device=device, dtype=dtype)


def train_and_evaluate(
    model_cfg: ModelConfig,
    tc: TrainConfig,
    corpus: Corpus,
    *,
    layout: layouts.Layout,
    comm: Optional[Comm],
    make_attend: Callable[[Optional[Comm]], Attends],
    dtype: torch.dtype = torch.float32,
    device: torch.device = torch.device("cpu"),
    docs: Optional[Documents] = None,
    loss_skip: Optional[torch.Tensor] = None,
) -> TrainResult:
    """Train for `tc.steps` steps, then evaluate on the validation windows.

    `comm` is the sequence-parallel group (None on a single device); `make_attend(comm)` returns the
    attention to use with that comm (the first step runs through a byte-counting comm). `docs`:
    packed documents of every window (RoPE positions restart at each document; the attention
    masks them), and the padding up to the layout's length (no loss on padding). `make_attend` may
    return one attention per layer. `loss_skip`: [B, S] bool, the positions whose label is left out
    of the loss (the loss is the mean over the others).
    """
    if tc.planted_bug not in PLANTED_BUGS:
        raise ValueError(f"unknown planted_bug {tc.planted_bug!r}; choose one of {list(PLANTED_BUGS)}")
    rank = comm.rank if comm is not None else 0
    model = build_model(model_cfg, tc.seed, dtype, device)
    params = [p for p in model.parameters()]
    decay = [p for p in params if p.dim() == 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, tc.warmup_steps)))
    windows = train_windows(corpus, steps=tc.steps, batch=tc.batch, seq_len=tc.seq_len, seed=tc.seed)
    n_tokens = tc.batch * tc.seq_len - (int(loss_skip.sum()) if loss_skip is not None else 0)
    result = TrainResult(losses=[], val_loss=math.nan, step_ms=[])

    model.train()
    for step in range(tc.steps):
        watch = Stopwatch(device)
        with watch.region():
            ledger = CommLedger() if step == 0 and comm is not None else None
            attend = make_attend(CountingComm(comm, ledger) if comm is not None and ledger is not None else comm)
            tokens, labels, positions = _shard(windows[step].to(device), layout, rank, tc.planted_bug, docs, loss_skip)
            logits = model(tokens, positions, attend)
            nll = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
            (nll / n_tokens).backward()
            # One all-reduce for every gradient and the loss (it is logged as the global mean).
            flat = torch.cat([_grad(p).reshape(-1).float() for p in params] + [nll.detach().float().view(1)])
            if comm is not None and comm.world_size > 1:
                if tc.planted_bug == "no_grad_sync":
                    loss_only = flat[-1:].clone()
                    comm.all_reduce(loss_only)
                    flat[-1:] = loss_only
                else:
                    comm.all_reduce(flat)
            _unflatten_grads(flat[:-1], params)
            result.losses.append(float(flat[-1]) / n_tokens)
            result.grad_norms.append(float(torch.linalg.vector_norm(flat[:-1])))
            if tc.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        result.step_ms.append(watch.seconds * 1e3)
        if ledger is not None:
            result.attn_bytes_sent, result.attn_bytes_recv = ledger.bytes_sent, ledger.bytes_recv

    result.val_loss = _evaluate(
        model, tc, corpus, layout, rank, comm, make_attend(comm), device, docs, loss_skip, n_tokens
    )
    return result


def prefix_loss_skip(
    lengths: Optional[Sequence[Sequence[int]]], batch: int, seq_len: int, masks: Sequence[Mask]
) -> Optional[torch.Tensor]:
    """[B, seq_len] bool: the positions whose label (the next token) lies inside its document's
    prefix under the layers' prefix_lm masks (the longest prefix of any layer), or None when no
    layer has one. A prefix token sees the whole prefix, the token it would predict included; the
    last prefix token's label (the first token after the prefix) stays in: nothing at or before it
    sees a later token."""
    prefixes = [m for m in masks if m.family == "prefix_lm"]
    if not prefixes:
        return None
    skip = torch.zeros(batch, seq_len, dtype=torch.bool)
    for b, ls in enumerate(lengths or [(seq_len,)] * batch):
        start = 0
        for n in ls:
            p = max(min(m.size("prefix", n), n) for m in prefixes)
            skip[b, start : start + p - 1] = True
            start += n
    return skip


def _shard(
    window: torch.Tensor,
    layout: layouts.Layout,
    rank: int,
    bug: str,
    docs: Optional[Documents] = None,
    loss_skip: Optional[torch.Tensor] = None,
):
    """This rank's (tokens, labels, positions) of a [B, S + 1] window: positions [S_local], or
    [B, S_local] with packed documents (each document's tokens numbered from 0)."""
    inputs, labels = window[:, :-1], window[:, 1:]  # shifted on the global sequence
    if loss_skip is not None:
        labels = labels.masked_fill(loss_skip.to(labels.device), -100)
    if docs is not None and docs.padding:  # padding: token 0, no loss
        inputs = torch.cat([inputs, inputs.new_zeros(inputs.shape[0], docs.padding)], dim=1)
        labels = torch.cat([labels, labels.new_full((labels.shape[0], docs.padding), -100)], dim=1)
    tokens = layout.shard(inputs, rank)
    positions = layout.positions(rank).to(window.device)
    if docs is not None:  # RoPE is relative, so this matters only where attention crosses documents
        positions = positions - docs.starts[:, layout.positions(rank)].to(window.device)
    if bug == "local_label_shift":
        local = tokens[:, 1:]
        labels = torch.cat([local, torch.full_like(tokens[:, :1], -100)], dim=1)
    else:
        labels = layout.shard(labels, rank)
    if bug == "local_positions":
        positions = torch.arange(tokens.shape[1], device=window.device)
    return tokens, labels, positions


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None  # every parameter takes part in the loss: backward gave it a gradient
    return p.grad


def _unflatten_grads(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        _grad(p).copy_(flat[offset : offset + n].view_as(_grad(p)))
        offset += n


@torch.no_grad()
def _evaluate(
    model: TinyLlama,
    tc: TrainConfig,
    corpus: Corpus,
    layout: layouts.Layout,
    rank: int,
    comm: Optional[Comm],
    attend: Attends,
    device: torch.device,
    docs: Optional[Documents],
    loss_skip: Optional[torch.Tensor],
    n_tokens: int,
) -> float:
    model.eval()
    windows = val_windows(corpus, batches=tc.eval_batches, batch=tc.batch, seq_len=tc.seq_len)
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for w in windows:
        tokens, labels, positions = _shard(w.to(device), layout, rank, tc.planted_bug, docs, loss_skip)
        logits = model(tokens, positions, attend)
        total += F.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        ).double()
    if comm is not None and comm.world_size > 1:
        comm.all_reduce(total)
    return float(total) / (windows.shape[0] * n_tokens)
