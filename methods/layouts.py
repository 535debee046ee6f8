"""How global token positions map to ranks. Pure functions: no communication, no globals.

A `Layout` gives each rank an ordered list of global positions. `shard` takes a rank's tokens out
of a global tensor, `unshard` puts every rank's tokens back, and `positions` gives the global
positions (what RoPE and the loss labels need). Layouts:

- contiguous: rank r holds [r*S/P, (r+1)*S/P). Ring Attention, Ulysses.
- zigzag: the sequence in 2P chunks; rank r holds chunks r and 2P-1-r (balanced causal work;
  ring-flash-attn's zigzag, Megatron/TE's load balancing, PyTorch's head-tail).
- stripe: rank r holds positions r, r+P, r+2P, ... (Striped Attention).
- usp: USP's load-balanced layout for ulysses_degree U x ring_degree R = P (global rank
  g = ring_rank * U + ulysses_rank): ring rank r's zigzag pair (chunks r and 2R-1-r of 2R) is cut
  into U equal pieces, and Ulysses rank u holds piece u. U = P gives contiguous, U = 1 zigzag.
- documents: document-aware zigzag for packed sequences (Megatron/TE's THD sharding): every
  document is cut into 2P chunks (sizes differ by at most one) and rank r holds chunks r and
  2P-1-r of every document, so each document's causal work is balanced by itself; the tail is
  padded so that every rank holds as many tokens. Its contiguous variant (`zigzag=False`) cuts
  every document into P chunks and gives rank r chunk r (ring-flash-attn's varlen ring).
- area: the sequence in equal chunks (a multiple of P), each with its visible area (the pairs its
  queries see under the mask, computed by the caller), dealt largest first to the rank with the
  least area so far among the ranks that still have room: equal tokens per rank, area balanced
  for any mask (where zigzag balances only the plain causal one). Positions increase on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch

LAYOUTS = ("contiguous", "zigzag", "stripe", "usp", "documents", "area")


Positions = tuple[torch.Tensor, ...]  # per rank, LongTensor [S_local]


@dataclass(frozen=True, eq=False)
class Layout:
    """A token-to-rank map for one (seq_len, world_size).

    The builders check the sizes when the layout is made but build the position tensors only when
    they are first asked for: planning asks every trial's method whether its layout fits (thousands
    of times in the main sweep, at lengths of a million tokens) and never uses the positions."""

    kind: str
    seq_len: int
    world_size: int
    _positions: Union[Positions, Callable[[], Positions]]  # the tensors, or how to build them

    def _all(self) -> Positions:
        positions = self._positions
        if callable(positions):
            positions = tuple(positions())
            object.__setattr__(self, "_positions", positions)
        return positions

    def positions(self, rank: int) -> torch.Tensor:
        """Global positions held by `rank`, in local order: LongTensor [S_local]."""
        return self._all()[rank]

    def local_len(self, rank: int) -> int:
        return self._all()[rank].numel()

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """Rank `rank`'s tokens of global tensor `x` (sequence along `dim`), contiguous."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"tensor has {x.shape[dim]} tokens along dim {dim}; layout expects {self.seq_len}")
        index = self.positions(rank).to(x.device)
        return x.index_select(dim, index).contiguous()

    def unshard(self, parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Inverse of `shard`: the global tensor from every rank's local part, in rank order."""
        if len(parts) != self.world_size:
            raise ValueError(f"need {self.world_size} parts, got {len(parts)}")
        shape = list(parts[0].shape)
        shape[dim] = self.seq_len
        full = parts[0].new_empty(shape)
        for rank, part in enumerate(parts):
            full.index_copy_(dim, self.positions(rank).to(part.device), part)
        return full

    def causal_work(self, rank: int) -> int:
        """(query, key) pairs a rank's queries attend to under a causal mask: sum of (pos + 1)."""
        return int((self._all()[rank] + 1).sum())


def _check(kind: str, seq_len: int, world_size: int, divisor: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if seq_len < 1 or seq_len % divisor != 0:
        raise ValueError(
            f"{kind} layout needs seq_len divisible by {divisor} (= {divisor // world_size} x world_size "
            f"{world_size}); got seq_len={seq_len}"
        )


def contiguous(seq_len: int, world_size: int) -> Layout:
    _check("contiguous", seq_len, world_size, world_size)
    return Layout("contiguous", seq_len, world_size, lambda: torch.arange(seq_len).chunk(world_size))


def zigzag(seq_len: int, world_size: int) -> Layout:
    _check("zigzag", seq_len, world_size, 2 * world_size)

    def build() -> Positions:
        chunks = torch.arange(seq_len).chunk(2 * world_size)
        return tuple(torch.cat([chunks[r], chunks[2 * world_size - 1 - r]]) for r in range(world_size))

    return Layout("zigzag", seq_len, world_size, build)


def stripe(seq_len: int, world_size: int) -> Layout:
    _check("stripe", seq_len, world_size, world_size)
    return Layout(
        "stripe", seq_len, world_size, lambda: tuple(torch.arange(r, seq_len, world_size) for r in range(world_size))
    )


def usp(seq_len: int, world_size: int, ulysses_degree: int) -> Layout:
    if ulysses_degree < 1 or world_size % ulysses_degree != 0:
        raise ValueError(f"usp layout needs ulysses_degree dividing world_size: {ulysses_degree} vs {world_size}")
    ring_degree = world_size // ulysses_degree
    divisor = granule("usp", world_size, ulysses_degree=ulysses_degree)
    if seq_len % divisor != 0:
        raise ValueError(
            f"usp layout needs seq_len divisible by 2 x ring_degree ({2 * ring_degree}) and by "
            f"world_size ({world_size}); got seq_len={seq_len}"
        )
    # ring degree 1 is plain Ulysses: one ring rank holds the whole sequence in order, which needs no
    # even split into a zigzag pair
    pairs = zigzag(seq_len, ring_degree) if ring_degree > 1 else contiguous(seq_len, 1)

    def build() -> Positions:
        return tuple(piece for r in range(ring_degree) for piece in pairs.positions(r).chunk(ulysses_degree))

    return Layout("usp", seq_len, world_size, build)


def documents(doc_lengths: Sequence[int], world_size: int, zigzag: bool = True) -> Layout:
    """Document-aware zigzag of one packed sequence (see the module docstring); `zigzag=False`:
    every document in P chunks instead, chunk r on rank r. Its `seq_len` is the padded length: P
    times the most tokens any rank's chunks hold."""
    p = world_size
    chunks = 2 * p if zigzag else p
    held = [sorted({r, 2 * p - 1 - r}) if zigzag else [r] for r in range(p)]  # each rank's chunks of a document
    mine: list[list[int]] = [[] for _ in range(p)]
    start = 0
    for n in doc_lengths:
        bounds = [start + (n * i) // chunks for i in range(chunks + 1)]
        for r in range(p):
            for c in held[r]:
                mine[r].extend(range(bounds[c], bounds[c + 1]))
        start += n
    local = max(len(m) for m in mine)
    pad = iter(range(start, start + p * local))  # the tail padding, dealt to the ranks that hold fewer
    for m in mine:
        m.extend(next(pad) for _ in range(local - len(m)))
    kind = "documents" if zigzag else "documents_contiguous"
    return Layout(kind, p * local, p, tuple(torch.tensor(m, dtype=torch.long) for m in mine))


def assign_chunks(areas: Sequence[int], world_size: int) -> list[list[int]]:
    """Chunks (indices into `areas`, len a multiple of `world_size`) per rank, in increasing order:
    largest area first (ties: the earlier chunk) to the rank with the least area so far (ties: the
    lower rank) among those holding fewer than len(areas) / world_size chunks."""
    p, n = world_size, len(areas)
    if p < 1 or n % p != 0:
        raise ValueError(f"area layout: {n} chunks cannot be dealt equally to {p} ranks")
    room = n // p
    held: list[list[int]] = [[] for _ in range(p)]
    load = [0] * p
    for c in sorted(range(n), key=lambda i: (-areas[i], i)):
        r = min((r for r in range(p) if len(held[r]) < room), key=lambda r: (load[r], r))
        held[r].append(c)
        load[r] += areas[c]
    return [sorted(h) for h in held]


def area(seq_len: int, world_size: int, areas: Sequence[int]) -> Layout:
    """Area-balanced layout (see the module docstring): `seq_len` in len(`areas`) equal chunks,
    chunk i of visible area areas[i]."""
    n = len(areas)
    _check("area", seq_len, world_size, world_size)
    if n < 1 or n % world_size != 0 or seq_len % n != 0:
        raise ValueError(
            f"area layout needs a chunk count that is a multiple of world_size {world_size} and divides "
            f"seq_len {seq_len}; got {n} chunks"
        )
    size = seq_len // n
    held = assign_chunks(areas, world_size)
    return Layout(
        "area",
        seq_len,
        world_size,
        tuple(torch.cat([torch.arange(c * size, (c + 1) * size) for c in h]) for h in held),
    )


def granule(kind: str, world_size: int, **params) -> int:
    """The sequence lengths layout `kind` takes at `world_size` are the multiples of this."""
    if kind in ("contiguous", "stripe"):
        return world_size
    if kind == "zigzag":
        return 2 * world_size
    if kind == "usp":
        ring_degree = world_size // params["ulysses_degree"]
        return math.lcm(2 * ring_degree, world_size) if ring_degree > 1 else world_size
    raise ValueError(f"unknown layout {kind!r}; choose one of {LAYOUTS}")


def make(kind: str, seq_len: int, world_size: int, **params) -> Layout:
    """Build the layout named `kind` (one of LAYOUTS); `params` e.g. ulysses_degree for usp."""
    builders: dict[str, Callable[..., Layout]] = {
        "contiguous": contiguous,
        "zigzag": zigzag,
        "stripe": stripe,
        "usp": usp,
    }
    if kind not in builders:
        raise ValueError(f"unknown layout {kind!r}; choose one of {LAYOUTS}")
    return builders[kind](seq_len, world_size, **params)
