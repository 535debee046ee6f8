"""Text corpora as byte-level tokens, with a fixed train/validation split and a content hash.

The default corpus needs no download: the Python standard library's own source files (every
`*.py` under the interpreter's stdlib folder, sorted by path, `site-packages` and `test` folders
left out), concatenated up to `max_bytes`. Its SHA-256 is recorded with every trial, so two runs
compare only when they trained on the same bytes (the stdlib differs between Python versions).
A user's text file and, when the `datasets` package is installed, a Hugging Face dataset load the
same way. Tokens are bytes (vocabulary 256): no tokenizer to download or to disagree about.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

VOCAB = 256
SOURCES = ("stdlib", "file", "hf")


@dataclass(frozen=True)
class Corpus:
    """Byte tokens split into train and validation (the validation part is the corpus's tail)."""

    name: str
    sha256: str
    train: torch.Tensor  # uint8 [N_train]
    val: torch.Tensor  # uint8 [N_val]


def load_corpus(
    source: str = "stdlib",
    *,
    path: Optional[str] = None,
    hf_dataset: Optional[str] = None,
    hf_split: str = "train",
    hf_text_field: str = "text",
    max_bytes: int = 4_000_000,
    val_fraction: float = 0.1,
) -> Corpus:
    """The corpus a perplexity check trains and evaluates on (deterministic for a given source)."""
    if source == "stdlib":
        name, blob = "python-stdlib", _stdlib_bytes(max_bytes)
    elif source == "file":
        if not path:
            raise ValueError("data source 'file' needs perplexity.data.path (a text file)")
        name, blob = Path(path).name, Path(path).read_bytes()[:max_bytes]
    elif source == "hf":
        if not hf_dataset:
            raise ValueError("data source 'hf' needs perplexity.data.hf_dataset (a dataset name or local path)")
        name, blob = hf_dataset, _hf_bytes(hf_dataset, hf_split, hf_text_field, max_bytes)
    else:
        raise ValueError(f"unknown data source {source!r}; choose one of {list(SOURCES)}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    tokens = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    n_val = int(len(tokens) * val_fraction)
    return Corpus(
        name=name,
        sha256=hashlib.sha256(blob).hexdigest(),
        train=tokens[: len(tokens) - n_val],
        val=tokens[len(tokens) - n_val :],
    )


def _stdlib_bytes(max_bytes: int) -> bytes:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    out, size = [], 0
    for p in files:
        data = p.read_bytes()
        out.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    return b"".join(out)[:max_bytes]


def _hf_bytes(name: str, split: str, field: str, max_bytes: int) -> bytes:
    try:
        import datasets
    except ImportError:
        raise ImportError("data source 'hf' needs the `datasets` package (pip install datasets)") from None
    ds = datasets.load_dataset(name, split=split, streaming=True)
    out, size = [], 0
    for row in ds:
        data = (str(row[field]) + "\n").encode("utf-8")
        out.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    return b"".join(out)[:max_bytes]


def train_windows(corpus: Corpus, *, steps: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """Random windows of seq_len + 1 tokens for every step: int64 [steps, batch, seq_len + 1].

    The same on every rank (drawn from `seed` alone); labels are the window shifted by one on the
    *global* sequence, before any sharding.
    """
    n = corpus.train.numel() - seq_len - 1
    if n <= 0:
        raise ValueError(
            f"the training split has {corpus.train.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}"
        )
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, n, (steps, batch), generator=g)
    offsets = torch.arange(seq_len + 1)
    return corpus.train[starts[..., None] + offsets].long()


def val_windows(corpus: Corpus, *, batches: int, batch: int, seq_len: int) -> torch.Tensor:
    """Consecutive non-overlapping windows from the validation split: int64 [batches, batch, seq_len + 1]."""
    need = batches * batch
    have = (corpus.val.numel() - 1) // seq_len
    if have < need:
        raise ValueError(
            f"the validation split ({corpus.val.numel()} tokens) holds {have} windows of {seq_len} "
            f"tokens; eval needs {need} (lower perplexity.eval_batches or raise data.max_bytes)"
        )
    starts = torch.arange(need) * seq_len
    return corpus.val[starts[:, None] + torch.arange(seq_len + 1)].long().view(batches, batch, seq_len + 1)
