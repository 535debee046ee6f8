"""Document-length distributions for packed workloads (`sweep.workload`, `documents:` in a config).

A packed workload fills each of a trial's `batch` sequences of `seq_len` tokens with documents
drawn from a named distribution, laid end to end, the last one cut (methods.documents.pack). The
draw is seeded by run.seed, the distribution's name, the length and the batch element, so that
every rank, every method and a later `--resume` see the same documents; the lengths' digest is
part of the trial's identity and the lengths are stored with its row.

Distributions (`distribution:`):
- `fixed`: `lengths`, used once in order (they must fill the longest sequence);
- `lognormal`: `median` and `sigma` (of log length), the long tail of web text;
- `powerlaw`: P(L) ~ L^-alpha on [`min`, `max`] (`alpha` > 1), heavier tails (code, books);
- `histogram`: an empirical histogram in a YAML `file` with `bins: [[low, high, weight], ...]`
  (a length drawn uniformly inside a bin chosen by weight); configs/documents/ ships some.
Every distribution clips lengths to [`min`, `max`] (`max` 0: no cap).
"""

from __future__ import annotations

import functools
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from methods.documents import Documents, pack
from suite.bundled import DOCUMENTS

UNIFORM = "uniform"  # one document per sequence: today's workload
DISTRIBUTIONS = ("fixed", "lognormal", "powerlaw", "histogram")


class LengthsError(ValueError):
    """A distribution that cannot be drawn from; `key` names the config key."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


@dataclass(frozen=True)
class Distribution:
    """A named document-length distribution (validated)."""

    name: str
    distribution: str
    params: tuple[tuple[str, Any], ...]  # the settings that define it, sorted (for identity)

    @classmethod
    def of(cls, name: str, distribution: str, settings: dict[str, Any]) -> "Distribution":
        return cls(name, distribution, tuple(sorted((k, _freeze(v)) for k, v in settings.items())))

    @classmethod
    def from_config(cls, name: str, cfg: dict[str, Any], root: Path = Path(".")) -> "Distribution":
        key = f"documents.{name}"
        kind = cfg.get("distribution")
        if kind not in DISTRIBUTIONS:
            raise LengthsError(f"{key}.distribution", f"{kind!r} is not one of {list(DISTRIBUTIONS)}")
        lo, hi = int(cfg.get("min", 1)), int(cfg.get("max", 0))
        if lo < 1:
            raise LengthsError(f"{key}.min", f"lengths must be >= 1, got {lo}")
        if hi and hi < lo:
            raise LengthsError(f"{key}.max", f"must be 0 (no cap) or >= min ({lo}), got {hi}")
        params: dict[str, Any] = {"min": lo, "max": hi}
        if kind == "fixed":
            lengths = list(cfg.get("lengths") or [])
            if not lengths or any(int(n) < 1 for n in lengths):
                raise LengthsError(f"{key}.lengths", f"needs a list of lengths >= 1, got {lengths}")
            params["lengths"] = [int(n) for n in lengths]
        elif kind == "lognormal":
            median, sigma = float(cfg.get("median") or 0), float(cfg.get("sigma") or 0)
            if not (median >= 1 and math.isfinite(median)):
                raise LengthsError(f"{key}.median", f"the median length must be >= 1 token, got {median}")
            if not (sigma > 0 and math.isfinite(sigma)):
                raise LengthsError(f"{key}.sigma", f"must be > 0, got {sigma}")
            params.update(median=median, sigma=sigma)
        elif kind == "powerlaw":
            alpha = float(cfg.get("alpha") or 0)
            if not (alpha > 1 and math.isfinite(alpha)):
                raise LengthsError(f"{key}.alpha", f"must be > 1 (a normalisable tail), got {alpha}")
            params["alpha"] = alpha
        else:
            path = histogram_path(str(cfg.get("file") or ""), root)
            params["file"] = str(cfg.get("file"))
            # the histogram itself (not only its file name) is what the trials ran
            params["bins"] = [list(b) for b in _read_histogram(path, f"{key}.file")]
        return cls.of(name, kind, params)

    @property
    def settings(self) -> dict[str, Any]:
        return {k: _thaw(v) for k, v in self.params}

    def draw(self, seq_len: int, batch: int, seed: int) -> tuple[tuple[int, ...], ...]:
        """Document lengths of `batch` packed sequences of `seq_len` tokens."""
        s = self.settings
        if self.distribution == "fixed":
            if sum(s["lengths"]) < seq_len:
                raise LengthsError(
                    f"documents.{self.name}.lengths",
                    f"{sum(s['lengths'])} tokens in all cannot fill a sequence of {seq_len}",
                )
            return tuple(pack(_clip(s["lengths"], s), seq_len) for _ in range(batch))
        out = []
        for b in range(batch):
            rng = np.random.default_rng([seed, zlib.crc32(self.name.encode()), seq_len, b])
            lengths, total = [], 0
            while total < seq_len:
                chunk = _clip(self._sample(rng, 256), s)
                lengths += chunk
                total += sum(chunk)
            out.append(pack(lengths, seq_len))
        return tuple(out)

    def _sample(self, rng: np.random.Generator, n: int) -> list[int]:
        s = self.settings
        if self.distribution == "lognormal":
            x = rng.lognormal(math.log(s["median"]), s["sigma"], n)
        elif self.distribution == "powerlaw":
            # inverse CDF of a Pareto tail above `min` (then clipped to `max`)
            with np.errstate(over="ignore"):  # inf past the float range: capped below
                x = s["min"] * (1.0 - rng.random(n)) ** (-1.0 / (s["alpha"] - 1.0))
        else:
            lows, highs, weights = (np.array(c, dtype=float) for c in zip(*s["bins"]))
            pick = rng.choice(len(weights), size=n, p=weights / weights.sum())
            x = lows[pick] + rng.random(n) * (highs[pick] - lows[pick])
        # A wide lognormal (sigma 1000) or a tail barely normalisable (alpha 1 + 1e-7) draws lengths
        # past any float (inf): cap them at LONGEST, far beyond any sequence, where packing cuts
        # them to the sequence anyway, so the packed documents are the same as for the true draw.
        x = np.minimum(np.nan_to_num(x, nan=1.0, posinf=LONGEST), LONGEST)
        return [int(max(1, round(v))) for v in x]


LONGEST = float(2**62)  # a drawn length beyond every sequence (config: sweep.seq_len <= 2**31 - 1)


def _clip(lengths: list[int], s: dict[str, Any]) -> list[int]:
    lo, hi = s["min"], s["max"] or None
    return [max(lo, min(n, hi)) if hi else max(lo, n) for n in lengths]


def histogram_path(file: str, root: Path = Path(".")) -> Path:
    """A histogram's file: a path (a relative one from `root`), or one that ships with the suite,
    named `configs/documents/<name>.yaml` as in a checkout or by its bare name (`stdlib_files`)."""
    path = Path(file)
    local = path if path.is_absolute() else root / path
    if local.is_file():
        return local
    if len(path.parts) == 1 or path.parent == Path("configs/documents"):
        for bundled in (DOCUMENTS / path.name, DOCUMENTS / f"{path.name}.yaml"):
            if bundled.is_file():
                return bundled
    return local


def _read_histogram(path: Path, key: str) -> tuple[tuple[int, int, float], ...]:
    import yaml

    if not path.is_file():
        raise LengthsError(key, f"histogram file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
        bins = tuple((int(lo), int(hi), float(w)) for lo, hi, w in data["bins"])
    except Exception as exc:  # noqa: BLE001 - any malformed file is the same error for the user
        raise LengthsError(
            key,
            f"{path} does not parse as a histogram ({type(exc).__name__}: {exc}); "
            f"expected `bins: [[low, high, weight], ...]`",
        ) from None
    if (
        not bins
        or any(lo < 1 or hi < lo or not (0 <= w < math.inf) for lo, hi, w in bins)
        or not 0 < sum(w for *_, w in bins) < math.inf
    ):
        raise LengthsError(key, f"{path}: bins need 1 <= low <= high and finite weights >= 0, not all 0")
    return bins


def _freeze(v):
    return tuple(_freeze(x) for x in v) if isinstance(v, list) else v


def _thaw(v):
    return [_thaw(x) for x in v] if isinstance(v, tuple) else v


# -- a trial's documents, in its identity ---------------------------------------------------------
def identity(dist: Distribution, seq_len: int, batch: int, seed: int) -> str:
    """The `workload` column of a packed trial: the distribution, the seed, and the digest of the
    lengths drawn for this (seq_len, batch)."""
    lengths = dist.draw(seq_len, batch, seed)
    digest = Documents(lengths, seq_len).digest()
    return json.dumps(
        {
            "documents": {
                "name": dist.name,
                "distribution": dist.distribution,
                **dist.settings,
                "seed": seed,
                "digest": digest,
            }
        },
        sort_keys=True,
        separators=(",", ":"),
    )


@functools.lru_cache(maxsize=256)
def lengths_of(workload: str, seq_len: int, batch: int) -> Optional[tuple[tuple[int, ...], ...]]:
    """The document lengths of a trial from its `workload` column (None: one document per sequence).
    Raises if this process draws other lengths than the planner did."""
    spec = json.loads(workload).get("documents") if workload else None
    if spec is None:
        return None
    settings = {k: v for k, v in spec.items() if k not in ("name", "distribution", "seed", "digest")}
    lengths = Distribution.of(spec["name"], spec["distribution"], settings).draw(seq_len, batch, spec["seed"])
    if Documents(lengths, seq_len).digest() != spec["digest"]:
        raise RuntimeError(
            f"the documents drawn here ({spec['name']}) differ from the planned ones (digest "
            f"{spec['digest']}): every process must draw the same lengths (same numpy version?)"
        )
    return lengths


def write_stdlib_histogram(path: str | Path) -> Path:
    """Write the histogram of the byte lengths of the Python standard library's source files (the
    files of the perplexity check's corpus; a real long tail, offline) in half-octave bins."""
    import sys
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib"}
    sizes = sorted(
        s for s in (p.stat().st_size for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)) if s > 0
    )
    edges = sorted({1} | {int(round(2 ** (k / 2))) for k in range(2, 2 * math.ceil(math.log2(sizes[-1] + 1)) + 2)})
    bins = [(lo, hi - 1, sum(lo <= s < hi for s in sizes)) for lo, hi in zip(edges[:-1], edges[1:])]
    lines = [
        "# Document lengths of the Python standard library's source files (bytes, the byte tokens of the",
        "# perplexity corpus): a real long-tailed distribution available offline, as an empirical histogram.",
        f"# {len(sizes)} files of Python {sys.version.split()[0]}; median {sizes[len(sizes) // 2]}, max "
        f"{sizes[-1]} bytes. Made by:",
        f"#   python -c \"from suite.lengths import write_stdlib_histogram as w; w('{Path(path).as_posix()}')\"",
        "bins:  # [low, high, weight]",
    ]
    lines += [f"  - [{lo}, {hi}, {n}]" for lo, hi, n in bins if n]
    out = Path(path)
    out.write_text("\n".join(lines) + "\n")
    return out
