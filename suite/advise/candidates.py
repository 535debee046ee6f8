"""The advisor's candidates: every own method of the registry x the values of its options that shape
the configuration, and their pruning before anything is traced (what a method refuses for the
question, no backward, a memory estimate over the budget)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import methods
from methods.base import Case, Method, option_names
from methods.documents import Documents
from methods.masks import Mask
from methods.ulysses_a2a import check_ulysses_heads
from suite import metrics as M
from suite.advise.question import GB, Question
from suite.sim.memory import MemoryEstimate, estimate


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# The values of each option that changes the configuration (not a kernel knob), by option name:
# any method that takes the option is weighed with each value. Options not named here keep the
# method's default.
OPTION_VALUES: dict[str, Callable[[Question], list[Any]]] = {
    "ulysses_degree": lambda q: q.ulysses_degrees or _divisors(q.world_size),
    "ranks_per_node": lambda q: [0] + ([q.topology.gpus_per_node] if q.nodes > 1 else []),
    "sharding": lambda q: ["sequence"] + (["documents"] if q.workload is not None else []),
    # dispatch's exchange in one stage (no overlap) or cut in 2 or 4 overlapped with the kernels
    "stages": lambda q: [1, 2, 4],
    # dispatch's chunks: 4 per rank (0, automatic), and 8 per rank where they fit (a finer balance,
    # smaller kernels)
    "chunk": lambda q: [0] + ([q.seq_len // (8 * q.world_size)] if q.seq_len % (8 * q.world_size) == 0 else []),
}


def _ranks_per_node_words(q: Question, value: int) -> str:
    # a ring route splits in two levels only when ranks span nodes (methods/kv_ring.py: make_route)
    return f"two-level ring, {value} ranks per node" if 0 < value < q.world_size else "one flat ring"


# Plain words for option values whose raw form says little to a reader ("ranks_per_node=0"), by option
# name as OPTION_VALUES; other options are shown as name=value.
OPTION_WORDS: dict[str, Callable[[Question, Any], str]] = {"ranks_per_node": _ranks_per_node_words}


def plain_name(q: Question, method: str, options: dict[str, Any]) -> str:
    """A configuration's name for people: `burst (one flat ring)`, `usp(ulysses_degree=4)`."""
    worded = [OPTION_WORDS[k](q, v) for k, v in options.items() if k in OPTION_WORDS]
    name = M.method_label(method, {k: v for k, v in options.items() if k not in OPTION_WORDS})
    return f"{name} ({', '.join(worded)})" if worded else name


@dataclass
class Candidate:
    method: str
    options: dict[str, Any]
    name: str = ""  # for people (plain_name); `label` is the identity's label
    ulysses_degree: int = 0
    ring_degree: int = 0
    layout: str = ""
    ranks_per_node: int = 0
    memory: Optional[MemoryEstimate] = None
    memory_bytes: int = 0
    pruned: str = ""  # why it was not simulated ("" = simulated)
    row: dict = field(default_factory=dict)
    """The row it is ranked by: the simulated row of its one mask, or with a per-layer pattern the
    model's total over its layers (`total_row`)."""
    rows: dict[str, dict] = field(default_factory=dict)  # per layer mask (canonical name): its simulated row
    same: list["Candidate"] = field(default_factory=list)
    """Other configurations that run this very schedule (`merge_same_schedules`): listed with it."""

    @property
    def label(self) -> str:
        return M.method_label(self.method, self.options)

    @property
    def title(self) -> str:
        """Its name, and the names of the configurations that are the same schedule: `a = b`."""
        return " = ".join([self.name or self.label] + [c.name or c.label for c in self.same])

    @property
    def options_json(self) -> str:
        return json.dumps(self.options, sort_keys=True)


def candidate_methods() -> list[str]:
    """The registry's own sequence-parallel methods (the group `own`: multi-rank, no test doubles),
    whose schedules the simulator can trace."""
    return [m for m in methods.group_members("own") if not methods.method_class(m).needs_processes]


def enumerate_candidates(q: Question) -> list[Candidate]:
    import itertools

    out = []
    for name in candidate_methods():
        opts = [o for o in option_names(methods.method_class(name)) if o in OPTION_VALUES]
        for combo in itertools.product(*(OPTION_VALUES[o](q) for o in opts)):
            options = dict(zip(opts, combo))
            out.append(Candidate(name, options, plain_name(q, name, options)))
    return out


def _run_case(q: Question, method: Method, mask: Optional[Mask] = None) -> Case:
    """The case the method runs (as `TrialSpec.run_case`): padded to its granule, with the documents
    and the mask."""
    case = q.case(mask)
    docs = q.documents(mask)
    if docs is not None:
        case = replace(case, documents=docs)
    padded = method.padded_len(case)
    if docs is None and padded == q.seq_len:
        return case
    lengths = docs.lengths if docs is not None else tuple((q.seq_len,) for _ in range(q.batch))
    return replace(case, seq_len=padded, documents=Documents(lengths, padded, docs.mask if docs else None))


def prune(q: Question, candidates: list[Candidate]) -> list[Candidate]:
    """Fill each candidate's degrees, layout and memory, and mark the ones that cannot run (or do
    not fit the budget) with the reason. Nothing is traced here. Returns the candidates kept."""
    from suite.sim.trace import one_torch_thread

    with one_torch_thread():  # the plans' index arithmetic is small: torch's pool costs more than it saves
        return _prune(q, candidates)


def _prune(q: Question, candidates: list[Candidate]) -> list[Candidate]:
    kept = []
    layer_masks = [m for m, _ in q.layer_masks()]
    for c in candidates:
        try:
            m = methods.get_method(c.method, **c.options)
            cases = [_run_case(q, m, mask) for mask in layer_masks]
            case = cases[0]
            c.ulysses_degree, c.ring_degree = m.degrees(case)
        except (TypeError, ValueError) as exc:
            c.pruned = str(exc)
            continue
        c.layout = "documents" if c.options.get("sharding") == "documents" else m.layout_kind
        c.ranks_per_node = c.options.get("ranks_per_node") or q.ranks_per_node
        ok, why = True, ""
        for mask, mcase in zip(layer_masks, cases):  # every layer's mask must run
            ok, why = m.supports(replace(mcase, device="cpu"))
            if not ok:
                why = f"{why} ({mask.short})" if len(layer_masks) > 1 else why
                break
        if ok and c.ulysses_degree > 1:  # the heads must split over the Ulysses degree, whatever the method
            why = check_ulysses_heads(q.model.heads, q.model.kv_heads, c.ulysses_degree)
            ok = not why
        if ok and q.ulysses_degrees and c.ulysses_degree > 1 and c.ulysses_degree not in q.ulysses_degrees:
            ok, why = False, f"Ulysses degree {c.ulysses_degree} not among --ulysses-degree {q.ulysses_degrees}"
        if ok and q.pass_ != "fwd":
            why = m.forward_only_reason(case) or ""
            ok = not why
        if not ok:
            c.pruned = why
            continue
        c.memory = estimate(m, case, q.pass_)
        c.memory_bytes = c.memory.inputs + c.memory.working
        if q.pass_ == "fwd_bwd" and q.model.layers > 1:
            # what every other layer keeps for its backward: its attention tensors, or with
            # activation recomputation only its input hidden states [B, L, hidden]
            hidden = q.model.hidden or q.model.heads * (q.model.head_dim_v or q.model.head_dim)
            per_layer = (
                q.batch * (case.seq_len // q.world_size) * hidden * case.torch_dtype.itemsize
                if q.recompute
                else c.memory.saved
            )
            c.memory_bytes += (q.model.layers - 1) * per_layer
        if q.memory_gb is not None and c.memory_bytes > q.memory_gb * GB:
            c.pruned = f"needs ~{c.memory_bytes / GB:.1f} GB per GPU, over --memory-gb {q.memory_gb:g}"
            continue
        kept.append(c)
    return kept
