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

Each family is a `Family` subclass registered with `@family` (the registry `FAMILIES`, as methods
have theirs): its parameters, its slices, its dense definition, whether it lies inside the causal
mask, and the parameter choices the tests run (`examples`). The config's validation, the plan, the
option flips and every test that runs "every family" read the registry; adding a family is its
class here and its own test (docs/extending.md, "A mask family").

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
from typing import Any, ClassVar, Mapping, Optional, Union

import torch

INF = 1 << 40  # a band side that never binds (positions are far below it)

Size = Union[int, float]
Slice = tuple[int, int, int, int, int, int]  # (qa, qb, ka, kb, lo, hi): rows x rows with lo <= i - j <= hi

# the kinds of a family's parameters, each checked by `Mask` and flipped by suite/flips.py
SIZE = "size"  # tokens (an int >= 1) or a fraction of the document's length (a float in (0, 1))
COUNT = "count"  # an int >= 1
FLAG = "flag"  # true or false


class Family:
    """A mask family: subclass it, set the class attributes, write `slices` and `dense` (and
    `causal` when the family can lie inside the causal mask), and decorate it with `@family`."""

    name: ClassVar[str]
    # (name, kind) in order: the first is the one a shorthand `family:value` sets, the next the
    # second value of `family:a,b`
    params: ClassVar[tuple[tuple[str, str], ...]] = ()
    defaults: ClassVar[dict[str, Any]] = {}  # the optional parameters and their values
    # parameter choices every generic test runs (the methods against float64, early stopping,
    # sharding by area, dispatch): sizes that fit a sequence of 7P + 5 tokens and packed documents
    # of a few tokens (fractions, or sizes of a few tokens)
    examples: ClassVar[tuple[str, ...]] = ()
    # further choices only the mask's own tests run (tests/test_masks.py: slices, block masks):
    # sizes of one token, other fractions, the shorthand and keyword forms
    edge_examples: ClassVar[tuple[str, ...]] = ()

    def causal(self, mask: "Mask") -> bool:
        """Whether no query ever sees a later key (the visible pairs lie inside the causal mask):
        methods then run their causal plan, which the block masks refine. The one rule of the
        suite's causal flag (`Mask.causal`)."""
        return False

    def slices(self, mask: "Mask", n: int) -> list[Slice]:
        """The slices of one document of n tokens, positions from its start; disjoint. Raises
        ValueError when the parameters do not fit the document."""
        raise NotImplementedError

    def dense(self, mask: "Mask", n: int) -> torch.Tensor:
        """[n, n] bool straight from the family's definition, not from the slices: the independent
        statement the slices are tested against (small n only)."""
        raise NotImplementedError

    def example(self) -> str:
        """A name in full for error messages: `sliding_window:64`."""
        return self.examples[0] if self.examples else self.name


FAMILIES: dict[str, Family] = {}  # name -> family, in registration order


def family(cls: type[Family]) -> type[Family]:
    """Register a mask family (a class decorator); a name registered twice is an error."""
    if not getattr(cls, "name", ""):
        raise ValueError(f"{cls.__name__}: a mask family needs a name")
    if cls.name in FAMILIES:
        raise ValueError(f"mask family {cls.name!r} is registered twice")
    names = [p for p, _ in cls.params]
    bad = [k for p, k in cls.params if k not in (SIZE, COUNT, FLAG)]
    if bad or len(set(names)) != len(names) or set(cls.defaults) - set(names):
        raise ValueError(f"mask family {cls.name}: parameters {cls.params}, defaults {cls.defaults} do not agree")
    FAMILIES[cls.name] = cls()
    return cls


def families() -> list[str]:
    """The registered family names, in registration order."""
    return list(FAMILIES)


def examples(edge: bool = False) -> list[str]:
    """Every family's `examples` (with `edge`, its `edge_examples` too), in registration order:
    what a test parametrizes over to run every family."""
    return [e for f in FAMILIES.values() for e in (f.examples + (f.edge_examples if edge else ()))]


@dataclass(frozen=True)
class Mask:
    """A mask family with its parameters (sorted (name, value) pairs)."""

    family: str
    params: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown mask family {self.family!r}; choose one of {sorted(FAMILIES)}")
        fam = FAMILIES[self.family]
        kinds = dict(fam.params)
        given = dict(self.params)
        for key in given:
            if key not in kinds:
                raise ValueError(
                    f"mask {self.family}: unknown parameter {key!r}"
                    + (f"; it takes {list(kinds)}" if kinds else "; it takes none")
                )
        full = {**fam.defaults, **given}
        for key in kinds:
            if key not in full:
                raise ValueError(f"mask {self.family}: parameter {key!r} is missing (e.g. {fam.example()})")
        for key, value in full.items():
            _check_param(self.family, key, kinds[key], value)
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
    def definition(self) -> Family:
        """The registered family."""
        return FAMILIES[self.family]

    @property
    def plain(self) -> bool:
        """full or causal: the mask every method computes without documents."""
        return self.family in PLAIN

    @property
    def causal(self) -> bool:
        """Whether the family never lets a query see a later key (its visible pairs lie inside the
        causal mask): methods then run their causal plan, which the block masks refine. This is
        the causal flag of every trial, probe and model layer of the mask (true for `causal`,
        false for `full`), decided here and nowhere else."""
        return self.definition.causal(self)

    # -- the slices -----------------------------------------------------------------------------
    def size(self, key: str, n: int) -> int:
        """A size parameter in tokens for a document of n tokens: a count as it is, a fraction v
        as ceil(v * n) (at least 1) computed exactly, v being the decimal it is written as (the
        float's shortest repr, `Fraction(repr(v))`): 0.28 of 25 tokens is 7. In floating point
        0.28 * 25 is 7.000000000000001, whose ceiling took one token too many wherever the
        product is a whole number."""
        v = self.param(key)
        return v if isinstance(v, int) else max(1, math.ceil(Fraction(repr(v)) * n))

    def slices(self, n: int) -> list[Slice]:
        """The slices (qa, qb, ka, kb, lo, hi) of one document of n tokens, positions from its start.

        Raises ValueError when the parameters do not fit the document (a prefix longer than it)."""
        return self.definition.slices(self, n)

    def dense(self, n: int) -> torch.Tensor:
        """[n, n] bool, straight from the family's definition (the table above), not from the slices:
        the independent statement the slices are tested against (small n only)."""
        return self.definition.dense(self, n)


def _rows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(i, j): query positions as a column, key positions as a row, for dense definitions."""
    return torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)


# -- the families ----------------------------------------------------------------------------------
@family
class Full(Family):
    name = "full"
    examples = ("full",)

    def slices(self, mask, n):
        return [(0, n, 0, n, -INF, INF)]

    def dense(self, mask, n):
        return torch.ones(n, n, dtype=torch.bool)


@family
class Causal(Family):
    name = "causal"
    examples = ("causal",)

    def causal(self, mask):
        return True

    def slices(self, mask, n):
        return [(0, n, 0, n, 0, INF)]

    def dense(self, mask, n):
        i, j = _rows(n)
        return j <= i


PLAIN = ("full", "causal")


@family
class SlidingWindow(Family):
    name = "sliding_window"
    params = (("window", SIZE), ("symmetric", FLAG))
    defaults = {"symmetric": False}
    examples = ("sliding_window:5", "sliding_window:window=4,symmetric=true")
    edge_examples = ("sliding_window:1", "sliding_window:0.3", "sliding_window:window=0.2,symmetric=true")

    def causal(self, mask):
        return not mask.param("symmetric")

    def slices(self, mask, n):
        w = mask.size("window", n)
        return [(0, n, 0, n, -(w - 1) if mask.param("symmetric") else 0, w - 1)]

    def dense(self, mask, n):
        i, j = _rows(n)
        w = mask.size("window", n)
        return (i - j).abs() < w if mask.param("symmetric") else (j <= i) & (i - j < w)


@family
class Chunked(Family):
    name = "chunked"
    params = (("chunk", SIZE),)
    examples = ("chunked:0.3",)
    edge_examples = ("chunked:1", "chunked:3", "chunked:0.5")

    def causal(self, mask):
        return True

    def slices(self, mask, n):
        c = mask.size("chunk", n)
        return [(a, min(a + c, n), a, min(a + c, n), 0, INF) for a in range(0, n, c)]

    def dense(self, mask, n):
        i, j = _rows(n)
        c = mask.size("chunk", n)
        return (i // c == j // c) & (j <= i)


@family
class PrefixLM(Family):
    name = "prefix_lm"
    params = (("prefix", SIZE),)
    examples = ("prefix_lm:0.25",)
    edge_examples = ("prefix_lm:3",)

    def slices(self, mask, n):
        p = mask.size("prefix", n)
        if p > n:
            raise ValueError(f"mask {mask.name}: prefix {p} is longer than a document of {n} tokens")
        out = [(0, n, 0, p, -INF, INF)]
        return out + ([(p, n, p, n, 0, INF)] if p < n else [])

    def dense(self, mask, n):
        i, j = _rows(n)
        p = mask.size("prefix", n)
        return (j < p) | (j <= i)


@family
class BlockCausal(Family):
    name = "block_causal"
    params = (("block", SIZE),)
    examples = ("block_causal:3",)
    edge_examples = ("block_causal:1", "block_causal:4", "block_causal:0.3")

    def slices(self, mask, n):
        b = mask.size("block", n)
        return [(a, min(a + b, n), 0, min(a + b, n), -INF, INF) for a in range(0, n, b)]

    def dense(self, mask, n):
        i, j = _rows(n)
        b = mask.size("block", n)
        return j // b <= i // b


@family
class SharedQuestion(Family):
    name = "shared_question"
    params = (("question", SIZE), ("answers", COUNT))
    examples = ("shared_question:question=5,answers=3",)
    edge_examples = (
        "shared_question:question=6,answers=3",
        "shared_question:5,2",
        "shared_question:question=0.3,answers=4",
    )

    def causal(self, mask):
        return True

    def slices(self, mask, n):
        q, k = self._question(mask, n)
        out = [(0, q, 0, q, 0, INF)]
        for s, e in _split(q, n, k):
            out += [(s, e, 0, q, -INF, INF), (s, e, s, e, 0, INF)]
        return out

    def dense(self, mask, n):
        i, j = _rows(n)
        q, k = self._question(mask, n)
        answer = torch.full((n,), -1)
        for a, (s, e) in enumerate(_split(q, n, k)):
            answer[s:e] = a
        ai, aj = answer.unsqueeze(1), answer.unsqueeze(0)
        return (j <= i) & ((aj == -1) | (ai == aj))

    @staticmethod
    def _question(mask: Mask, n: int) -> tuple[int, int]:
        """(question tokens, answers) in a document of n tokens: a document too short for them all
        is the question and as many one-token-or-longer answers as fit."""
        q = min(mask.size("question", n), n)
        return q, min(mask.param("answers"), n - q)


@family
class GlobalWindow(Family):
    name = "global_window"
    params = (("globals", SIZE), ("window", SIZE))
    examples = ("global_window:globals=2,window=3",)
    edge_examples = ("global_window:globals=0.1,window=0.25", "global_window:1,1")

    def slices(self, mask, n):
        g, w = min(mask.size("globals", n), n), mask.size("window", n)
        out = [(0, g, 0, n, -INF, INF)]
        return out + ([(g, n, 0, g, -INF, INF), (g, n, g, n, -(w - 1), w - 1)] if g < n else [])

    def dense(self, mask, n):
        i, j = _rows(n)
        g, w = min(mask.size("globals", n), n), mask.size("window", n)
        return (i < g) | (j < g) | ((i - j).abs() < w)


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
        order = [p for p, _ in FAMILIES[family].params]
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


def _check_param(family: str, key: str, kind: str, value: Any) -> None:
    if kind == FLAG:
        if not isinstance(value, bool):
            raise ValueError(f"mask {family}: {key} must be true or false, got {value!r}")
    elif kind == COUNT:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"mask {family}: {key} must be an integer >= 1, got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"mask {family}: {key} must be a number of tokens (>= 1) or a fraction in (0, 1), got {value!r}"
        )
    elif isinstance(value, int) and value < 1:
        raise ValueError(f"mask {family}: {key} must be >= 1 token, got {value}")
    elif isinstance(value, float) and not 0 < value < 1:
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
