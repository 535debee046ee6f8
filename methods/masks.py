"""Attention masks inside a document: the families long-context models train with, as slices.

A family says which keys j a query i sees, both counted from the start of their document (every
family applies inside each packed document: a token never sees another document, and padding sees
nothing). Each family is a short list of slices: a rectangle of query rows [qa, qb) and key rows
[ka, kb) inside which query i sees key j iff lo <= i - j <= hi, a band (full is (-inf, inf),
causal (0, inf), a causal window of w tokens (0, w - 1)). The slices of a document never overlap,
so visible pairs add up over slices, and a block of queries against keys is classified and counted
from them in closed form, without an [S, S] mask (methods/documents.py does that).

| family | query i sees key j | parameters |
|---|---|---|
| full | always | |
| causal | j <= i | |
| sliding_window | i - w < j <= i (symmetric: abs(i - j) < w) | window, symmetric |
| chunked | i // c == j // c and j <= i | chunk |
| prefix_lm | j < p, or p <= j <= i | prefix |
| block_causal | j // b <= i // b | block |
| shared_question | j <= i, and j < q (the question) or j in the answer of i | question, answers |
| global_window | i < g or j < g or abs(i - j) < w | globals, window |

The answers split what follows the question as evenly as they can (the first ones a token longer).
A packed document too short for its question and answers holds as many answers as fit (none: it is
all question, causal); one shorter than the global tokens is all global. A prefix longer than a
document is refused (a ValueError naming the document's length): give it as a fraction instead.

A size (window, chunk, prefix, block, question, globals) is a number of tokens (an int >= 1) or a
fraction of each document's length (a float in (0, 1), rounded up), e.g. `sliding_window:0.0625`
for a window of 1/16 of the sequence. The product is exact (the fraction as the decimal it is
written as, `Mask.size`): 0.28 of 25 tokens is 7, 0.07 of 100 is 7, 0.281 of 25 is 8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping, Optional, Union

import torch

INF = 1 << 40  # a band side that never binds (positions are far below it)

Size = Union[int, float]

# family -> its parameters in order (the first is the one a shorthand `family:value` sets), and
# which of them are optional with their defaults
FAMILIES: dict[str, tuple[str, ...]] = {
    "full": (),
    "causal": (),
    "sliding_window": ("window", "symmetric"),
    "chunked": ("chunk",),
    "prefix_lm": ("prefix",),
    "block_causal": ("block",),
    "shared_question": ("question", "answers"),
    "global_window": ("globals", "window"),
}
DEFAULTS: dict[str, dict[str, Any]] = {"sliding_window": {"symmetric": False}}
SIZES = ("window", "chunk", "prefix", "block", "question", "globals")  # token counts or fractions
PLAIN = ("full", "causal")
WITHIN_CAUSAL = ("causal", "sliding_window", "chunked", "shared_question")  # never j > i (unless symmetric)


@dataclass(frozen=True)
class Mask:
    """A mask family with its parameters (sorted (name, value) pairs)."""

    family: str
    params: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown mask family {self.family!r}; choose one of {sorted(FAMILIES)}")
        known = FAMILIES[self.family]
        given = dict(self.params)
        for key in given:
            if key not in known:
                raise ValueError(
                    f"mask {self.family}: unknown parameter {key!r}"
                    + (f"; it takes {list(known)}" if known else "; it takes none")
                )
        full = {**DEFAULTS.get(self.family, {}), **given}
        for key in known:
            if key not in full:
                raise ValueError(f"mask {self.family}: parameter {key!r} is missing (e.g. {_example(self.family)})")
        for key, value in full.items():
            if key in SIZES:
                _check_size(self.family, key, value)
            elif key == "answers":
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"mask {self.family}: answers must be an integer >= 1, got {value!r}")
            elif key == "symmetric" and not isinstance(value, bool):
                raise ValueError(f"mask {self.family}: symmetric must be true or false, got {value!r}")
        object.__setattr__(self, "params", tuple(sorted(full.items())))

    # -- naming ---------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """Canonical name, parseable by `parse`: `causal`, `sliding_window:symmetric=false,window=64`."""
        if not self.params:
            return self.family
        return self.family + ":" + ",".join(f"{k}={_fmt(v)}" for k, v in self.params)

    @property
    def short(self) -> str:
        """A label for tables and figures: `sliding_window(64)`, `shared_question(answers=4,
        question=128)` (the suite's reports write the same from a row's name)."""
        shown = [(k, v) for k, v in self.params if not (k == "symmetric" and v is False)]
        if len(shown) == 1:
            k, v = shown[0]
            return f"{self.family}({'sym' if k == 'symmetric' else _fmt(v)})"
        values = ["sym" if k == "symmetric" else f"{k}={_fmt(v)}" for k, v in shown]
        return f"{self.family}({', '.join(values)})" if values else self.family

    def param(self, key: str) -> Any:
        return dict(self.params)[key]

    @property
    def plain(self) -> bool:
        """full or causal: the mask every method computes without documents."""
        return self.family in PLAIN

    @property
    def causal(self) -> bool:
        """Whether the family never lets a query see a later key (its visible pairs lie inside the
        causal mask): methods then run their causal plan, which the block masks refine."""
        if self.family == "sliding_window":
            return not self.param("symmetric")
        return self.family in WITHIN_CAUSAL

    # -- the slices -----------------------------------------------------------------------------
    def size(self, key: str, n: int) -> int:
        """A size parameter in tokens for a document of n tokens: a count as it is, a fraction v
        as ceil(v * n) (at least 1) computed exactly, v being the decimal it is written as (the
        float's shortest repr, `Fraction(repr(v))`): 0.28 of 25 tokens is 7. In floating point
        0.28 * 25 is 7.000000000000001, whose ceiling took one token too many wherever the
        product is a whole number."""
        v = self.param(key)
        return v if isinstance(v, int) else max(1, math.ceil(Fraction(repr(v)) * n))

    def slices(self, n: int) -> list[tuple[int, int, int, int, int, int]]:
        """The slices (qa, qb, ka, kb, lo, hi) of one document of n tokens, positions from its start.

        Raises ValueError when the parameters do not fit the document (a prefix longer than it)."""
        f = self.family
        if f == "full":
            return [(0, n, 0, n, -INF, INF)]
        if f == "causal":
            return [(0, n, 0, n, 0, INF)]
        if f == "sliding_window":
            w = self.size("window", n)
            return [(0, n, 0, n, -(w - 1) if self.param("symmetric") else 0, w - 1)]
        if f == "chunked":
            c = self.size("chunk", n)
            return [(a, min(a + c, n), a, min(a + c, n), 0, INF) for a in range(0, n, c)]
        if f == "prefix_lm":
            p = self.size("prefix", n)
            if p > n:
                raise ValueError(f"mask {self.name}: prefix {p} is longer than a document of {n} tokens")
            out = [(0, n, 0, p, -INF, INF)]
            return out + ([(p, n, p, n, 0, INF)] if p < n else [])
        if f == "block_causal":
            b = self.size("block", n)
            return [(a, min(a + b, n), 0, min(a + b, n), -INF, INF) for a in range(0, n, b)]
        if f == "shared_question":
            q, k = self._question(n)
            out = [(0, q, 0, q, 0, INF)]
            for s, e in _split(q, n, k):
                out += [(s, e, 0, q, -INF, INF), (s, e, s, e, 0, INF)]
            return out
        if f == "global_window":
            g, w = min(self.size("globals", n), n), self.size("window", n)
            out = [(0, g, 0, n, -INF, INF)]
            return out + ([(g, n, 0, g, -INF, INF), (g, n, g, n, -(w - 1), w - 1)] if g < n else [])
        raise AssertionError(f)

    def _question(self, n: int) -> tuple[int, int]:
        """(question tokens, answers) in a document of n tokens: a document too short for them all
        is the question and as many one-token-or-longer answers as fit."""
        q = min(self.size("question", n), n)
        return q, min(self.param("answers"), n - q)

    def dense(self, n: int) -> torch.Tensor:
        """[n, n] bool, straight from the family's definition (the table above), not from the slices:
        the independent statement the slices are tested against (small n only)."""
        i = torch.arange(n).unsqueeze(1)
        j = torch.arange(n).unsqueeze(0)
        f = self.family
        if f == "full":
            return torch.ones(n, n, dtype=torch.bool)
        if f == "causal":
            return j <= i
        if f == "sliding_window":
            w = self.size("window", n)
            return (i - j).abs() < w if self.param("symmetric") else (j <= i) & (i - j < w)
        if f == "chunked":
            c = self.size("chunk", n)
            return (i // c == j // c) & (j <= i)
        if f == "prefix_lm":
            p = self.size("prefix", n)
            return (j < p) | (j <= i)
        if f == "block_causal":
            b = self.size("block", n)
            return j // b <= i // b
        if f == "shared_question":
            q, k = self._question(n)
            answer = torch.full((n,), -1)
            for a, (s, e) in enumerate(_split(q, n, k)):
                answer[s:e] = a
            ai, aj = answer.unsqueeze(1), answer.unsqueeze(0)
            return (j <= i) & ((aj == -1) | (ai == aj))
        if f == "global_window":
            g, w = min(self.size("globals", n), n), self.size("window", n)
            return (i < g) | (j < g) | ((i - j).abs() < w)
        raise AssertionError(f)


CAUSAL, FULL = Mask("causal"), Mask("full")


def plain(causal: bool) -> Mask:
    return CAUSAL if causal else FULL


def parse(text: Union[str, Mask], named: Optional[Mapping[str, Mapping[str, Any]]] = None) -> Mask:
    """A mask from its name: a family (`causal`), a family with parameters
    (`sliding_window:window=64,symmetric=true`, or the first parameter alone: `sliding_window:64`,
    `shared_question:128,4` in order), or the name of an entry of the config's `masks:` section
    (`{family: ..., <parameter>: ...}`). Raises ValueError naming what is wrong."""
    if isinstance(text, Mask):
        return text
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"a mask is a name such as 'causal' or 'sliding_window:64', got {text!r}")
    text = text.strip()
    if named and text in named:
        entry = dict(named[text])
        family = entry.pop("family", None)
        if family is None:
            raise ValueError(f"masks.{text}: needs a `family` (one of {sorted(FAMILIES)})")
        return Mask(str(family), tuple(entry.items()))
    family, _, rest = text.partition(":")
    family = family.strip()
    if family not in FAMILIES:
        hint = f", or one of the config's masks: {sorted(named)}" if named else ""
        raise ValueError(f"unknown mask {text!r}: the family must be one of {sorted(FAMILIES)}{hint}")
    params: dict[str, Any] = {}
    if rest.strip():
        order = FAMILIES[family]
        for n, part in enumerate(rest.split(",")):
            key, eq, value = part.partition("=")
            if not eq:  # positional
                if n >= len(order):
                    raise ValueError(f"mask {text!r}: {family} takes at most {len(order)} values ({list(order)})")
                key, value = order[n], part
            params[key.strip()] = _value(value.strip(), text)
    return Mask(family, tuple(params.items()))


def _value(text: str, whole: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"mask {whole!r}: {text!r} is not a number or true/false") from None


def _check_size(family: str, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"mask {family}: {key} must be a number of tokens (>= 1) or a fraction in (0, 1), got {value!r}"
        )
    if isinstance(value, int) and value < 1:
        raise ValueError(f"mask {family}: {key} must be >= 1 token, got {value}")
    if isinstance(value, float) and not 0 < value < 1:
        raise ValueError(
            f"mask {family}: {key} {value} is neither a token count (an integer >= 1) nor a fraction in (0, 1)"
        )


def _split(q: int, n: int, k: int) -> list[tuple[int, int]]:
    """The k answers after a question of q tokens in a document of n: as equal as can be, the first
    ones one token longer."""
    if k == 0:
        return []
    base, extra = divmod(n - q, k)
    out, s = [], q
    for a in range(k):
        e = s + base + (1 if a < extra else 0)
        out.append((s, e))
        s = e
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v) if isinstance(v, float) else str(v)


def _example(family: str) -> str:
    return {
        "sliding_window": "sliding_window:64",
        "chunked": "chunked:8192",
        "prefix_lm": "prefix_lm:0.25",
        "block_causal": "block_causal:256",
        "shared_question": "shared_question:question=128,answers=4",
        "global_window": "global_window:globals=16,window=128",
    }.get(family, family)
