"""Hugging Face `transformers` causal LMs with their attention replaced by a suite method.

transformers (>= 4.48) looks attention functions up by name in `AttentionInterface`; registering
`suite_sp` there and setting it as a model's attention implementation makes every attention layer
call `_suite_attention`, which runs the active method over the active comm (per thread, so virtual
ranks can share one model object). Each rank feeds the model only its layout's tokens with their
*global* `position_ids`, so RoPE is right; the causal mask is the method's, on global positions
(the mask transformers builds for the local tokens is not used, and not built). A sliding-window
layer (Mistral, Qwen2's `layer_types`, ...) passes its window to the method as the
`sliding_window` mask (methods/masks.py: a query sees itself and the window - 1 tokens before it,
as transformers' sliding-window mask), carried by the documents the method masks with; a method
without a path for documents and masks is refused with its reason.

    with sequence_parallel(method, comm):
        logits = sharded_logits(model, input_ids, method, comm)   # this rank's tokens

`hf_perplexity` evaluates a local model's perplexity with each method against its own eager
attention (`python -m suite hf-perplexity MODEL_DIR`). Virtual ranks (executor threads): numerics,
not performance.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from methods.base import Case, Method, dtype_name
from methods.comm.base import Comm
from methods.documents import Documents
from methods.masks import Mask

NAME = "suite_sp"
_active = threading.local()


def _suite_attention(
    module, query, key, value, attention_mask, scaling: Optional[float] = None, dropout: float = 0.0, **kwargs
):
    """transformers' attention signature: q [B, H, S, D], k/v [B, Hkv, S, D] -> ([B, S, H, D], None)."""
    state = getattr(_active, "state", None)
    if state is None:
        raise RuntimeError(f"attention implementation {NAME!r} called outside `sequence_parallel(method, comm)`")
    if dropout:
        raise ValueError("suite methods have no attention dropout; evaluate with model.eval()")
    method, comm, docs, batch, seq_len = state
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    if window:
        if not method.supports_documents:
            raise ValueError(
                f"{method.name} cannot apply the model's sliding window of {window}: "
                + (method.documents_reason or "it has no path for masks inside documents")
            )
        docs = _window_documents(docs, int(window), batch, seq_len)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    extra = {"docs": docs} if docs is not None else {}
    out = method.attention(q, k, v, causal=True, comm=comm, softmax_scale=scaling, **extra)
    return out, None


def sliding_window_mask(window: int) -> Mask:
    """transformers' sliding window (query i sees keys i - window < j <= i) as the suite's mask."""
    return Mask("sliding_window", (("window", int(window)),))


def _window_documents(docs: Optional[Documents], window: int, batch: int, seq_len: int) -> Documents:
    """`docs` (or one document per sequence) carrying a sliding window of `window` tokens, built
    once per (documents, window) and thread: every layer and every call reuses its slices."""
    cache = _active.__dict__.setdefault("windows", {})
    key = (docs, window, batch, seq_len)
    if key not in cache:
        mask = sliding_window_mask(window)
        cache.clear()  # one sequence's documents at a time
        cache[key] = (
            Documents.single(batch, seq_len, mask=mask)
            if docs is None
            else Documents(docs.lengths, docs.padded_len, mask)
        )
    return cache[key]


def model_window(model) -> Optional[int]:
    """The model's sliding window when some layer uses one (None: every layer attends causally)."""
    cfg = model.config
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window)


def _no_mask(*args, **kwargs):
    return None  # the method applies the causal mask on global positions


def register() -> str:
    """Register the `suite_sp` attention (and its no-op mask) with transformers; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, _suite_attention)
    AttentionMaskInterface.register(NAME, _no_mask)
    return NAME


@contextlib.contextmanager
def sequence_parallel(
    method: Method, comm: Comm, docs: Optional[Documents] = None, shape: Optional[tuple[int, int]] = None
) -> Iterator[None]:
    """Make `method` over `comm` the attention of `suite_sp` models in this thread (with packed
    documents `docs`, if any). `shape`: the global (batch, sequence length), which a sliding-window
    layer needs when there are no documents to take it from."""
    previous = getattr(_active, "state", None)
    if shape is None and docs is not None:
        shape = (docs.batch, docs.padded_len)
    _active.state = (method, comm, docs, *(shape or (None, None)))
    try:
        yield
    finally:
        _active.state = previous


def use_suite_attention(model) -> None:
    register()
    model.set_attn_implementation(NAME)


def model_case(model, batch: int, seq_len: int, world_size: int, dtype: str = "float32", device: str = "cpu") -> Case:
    """The attention problem of `model` on [batch, seq_len] tokens (with the model's sliding window
    as a mask, when it has one, so that `method.supports` answers for it)."""
    cfg = model.config
    heads = cfg.num_attention_heads
    window = model_window(model)
    return Case(
        batch=batch,
        seq_len=seq_len,
        heads=heads,
        kv_heads=getattr(cfg, "num_key_value_heads", heads),
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        dtype=dtype,
        causal=True,
        world_size=world_size,
        device=device,
        documents=Documents.single(batch, seq_len, mask=sliding_window_mask(window)) if window else None,
    )


def _layout(model, input_ids: torch.Tensor, method: Method, world_size: int, docs: Optional[Documents] = None):
    b, s = input_ids.shape
    dtype = dtype_name(next(model.parameters()).dtype)
    case = model_case(model, b, s, world_size, dtype, input_ids.device.type)
    windowed = case.documents
    if windowed is not None and docs is not None:
        window = model_window(model)
        assert window is not None  # the case's documents are the window's mask
        windowed = _window_documents(docs, window, b, docs.padded_len)
    layout = method.layout(Case(**{**case.__dict__, "documents": docs}))
    if windowed is not None:  # a layout that follows the mask cannot serve windowed and global layers
        other = method.layout(Case(**{**case.__dict__, "documents": windowed}))
        if any(not torch.equal(other.positions(r), layout.positions(r)) for r in range(world_size)):
            raise ValueError(
                f"{method.name} {method.options()}: its layout follows the mask, so the model's "
                "sliding-window and global layers would need different layouts"
            )
    return layout


def sharded_logits(
    model, input_ids: torch.Tensor, method: Method, comm: Comm, docs: Optional[Documents] = None
) -> torch.Tensor:
    """This rank's logits [B, S_local, vocab] for the global `input_ids` [B, S] (model in suite_sp
    mode). With packed documents `docs`, `position_ids` restart at every document and the method
    masks across documents (as packed training feeds a Hugging Face model)."""
    b = input_ids.shape[0]
    layout = _layout(model, input_ids, method, comm.world_size, docs)
    tokens = layout.shard(input_ids, comm.rank)
    positions = layout.positions(comm.rank).to(input_ids.device)[None].expand(b, -1)
    if docs is not None:
        positions = positions - docs.starts[:, layout.positions(comm.rank)].to(input_ids.device)
    with sequence_parallel(method, comm, docs, shape=(b, layout.seq_len)):
        return model(input_ids=tokens, position_ids=positions, use_cache=False).logits


def gathered_logits(
    model, input_ids: torch.Tensor, method: Method, world_size: int, docs: Optional[Documents] = None
) -> torch.Tensor:
    """Global logits [B, S, vocab] computed by `world_size` virtual ranks with `method`."""
    from methods.comm import run_threads

    layout = _layout(model, input_ids, method, world_size, docs)
    use_suite_attention(model)

    def rank(comm: Comm) -> torch.Tensor:
        with torch.no_grad():  # grad mode is per thread
            return sharded_logits(model, input_ids, method, comm, docs)

    parts = run_threads(world_size, rank)
    return layout.unshard(parts)


def eager_logits(model, input_ids: torch.Tensor, docs: Optional[Documents] = None) -> torch.Tensor:
    """The model's own eager attention on one device (the reference). With packed documents, each
    document by itself: a packed sequence's logits are exactly its documents' own."""
    model.set_attn_implementation("eager")
    with torch.no_grad():
        if docs is None:
            return model(input_ids=input_ids, use_cache=False).logits
        rows = []
        for b, lengths in enumerate(docs.lengths):
            starts = [0] + [sum(lengths[: i + 1]) for i in range(len(lengths) - 1)]
            rows.append(
                torch.cat(
                    [
                        model(input_ids=input_ids[b : b + 1, a : a + n], use_cache=False).logits
                        for a, n in zip(starts, lengths)
                    ],
                    dim=1,
                )
            )
        return torch.cat(rows)


@dataclass
class HFResult:
    method: str
    world_size: int
    perplexity: float
    eager_perplexity: float
    max_logit_diff: float

    @property
    def rel_diff(self) -> float:
        return self.perplexity / self.eager_perplexity - 1.0


def _nll(logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[float, int]:
    """Summed next-token NLL (labels shifted on the global sequence) and the token count."""
    lp = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), input_ids[:, 1:].flatten(), reduction="sum"
    )
    return float(lp), input_ids[:, 1:].numel()


def hf_perplexity(
    model, batches: list[torch.Tensor], method_names: list[str], world_sizes: list[int]
) -> list[HFResult]:
    """Perplexity of `model` on `batches` ([B, S] token ids each) with each method and world size,
    against the model's eager attention on the same tokens."""
    import methods

    model.eval()
    eager = [eager_logits(model, ids) for ids in batches]
    e_nll, n = map(sum, zip(*(_nll(lg, ids) for lg, ids in zip(eager, batches))))
    dtype = dtype_name(next(model.parameters()).dtype)
    results = []
    for name in method_names:
        method = methods.get_method(name)
        for p in world_sizes:
            b, s = batches[0].shape  # [batch, seq_len] tokens
            ok, why = method.supports(model_case(model, b, s, p, dtype, batches[0].device.type))
            if not ok:
                print(f"  skip {name} P={p}: {why}")
                continue
            got = [gathered_logits(model, ids, method, p) for ids in batches]
            nll = sum(_nll(lg, ids)[0] for lg, ids in zip(got, batches))
            diff = max(float((a - b).abs().max()) for a, b in zip(got, eager))
            results.append(HFResult(name, p, math.exp(nll / n), math.exp(e_nll / n), diff))
    model.set_attn_implementation("eager")
    return results


def tiny_llama(seed: int = 0, layers: int = 2, vocab: int = 256):
    """A randomly initialised tiny LlamaForCausalLM (no download): width 64, 4 heads, 2 KV heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )
    return LlamaForCausalLM(cfg).eval()


def load_model_and_batches(
    model_ref: str, *, text_path: Optional[str], batch: int, seq_len: int, batches: int, dtype: str, device: str
):
    """The model (`tiny-llama` or a local folder for `from_pretrained`) and token batches of the text:
    the model's own tokenizer when its folder has one, else byte tokens (vocabulary >= 256)."""
    from methods.base import torch_dtype
    from suite.perplexity.data import load_corpus

    if model_ref == "tiny-llama":
        model, tokenizer = tiny_llama(), None
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(model_ref, local_files_only=True)
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_ref, local_files_only=True)
        except (OSError, ValueError):
            tokenizer = None
    model = model.to(device=device, dtype=torch_dtype(dtype)).eval()
    corpus = load_corpus("file", path=text_path) if text_path else load_corpus("stdlib")
    text = bytes(corpus.val.tolist())
    if tokenizer is not None:
        ids = torch.tensor(tokenizer(text.decode("utf-8", errors="replace"))["input_ids"], dtype=torch.long)
    else:
        if model.config.vocab_size < 256:
            raise ValueError(f"no tokenizer in {model_ref} and vocabulary {model.config.vocab_size} < 256 for bytes")
        ids = torch.tensor(list(text), dtype=torch.long)
    need = batch * seq_len * batches
    if ids.numel() < need:
        raise ValueError(f"the text has {ids.numel()} tokens; {batches} batches of {batch} x {seq_len} need {need}")
    return model, [b.to(device) for b in ids[:need].view(batches, batch, seq_len)]
