"""The sweep expanded into trials, each with a stable key (hash of its identity).

`expand` is given where trials run (`Place`s, from the executor) and what they are (the workload's
passes and identity), so that planning needs neither the executors nor the workloads.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Optional, Protocol

import methods
from methods.base import Case
from methods.documents import Documents
from methods.masks import Mask, plain
from methods.masks import parse as parse_mask
from suite import metrics as M
from suite.config import SuiteConfig, mask_points, option_points
from suite.lengths import lengths_of
from suite.metrics import IDENTITY, method_label


@dataclass(frozen=True)
class RunSettings:
    """How every trial of a sweep runs on its ranks (picklable; sent to workers once)."""

    warmup: int
    repeats: int
    check: bool
    check_max_seq_len: int
    seed: int
    breakdown: bool = True

    @classmethod
    def of(cls, cfg: SuiteConfig) -> "RunSettings":
        r = cfg.run
        return cls(
            warmup=r.warmup,
            repeats=r.repeats,
            check=r.check,
            check_max_seq_len=r.check_max_seq_len,
            seed=r.seed,
            breakdown=r.breakdown,
        )


@dataclass(frozen=True)
class ProblemKey:
    """What makes trials one problem: equal keys share the global inputs and the float64 reference
    (hashable: the caches of problems are keyed by it). Each field at its default is the plain
    problem's."""

    batch: int
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    causal: bool
    workload: str = ""  # the packed documents' identity ("": one document per sequence)
    head_dim_v: Optional[int] = None
    softcap: float = 0.0
    mask: str = ""  # a mask family's canonical name ("": the plain mask of `causal`)
    sinks: bool = False
    variants: tuple[tuple[str, Any], ...] = ()
    """The set values of the identity axes added to suite.metrics.TRIAL_AXES without a field of
    their own (`TrialSpec.variants`): a new axis separates problems (their inputs' seed, the cached
    reference) without an edit here."""

    @property
    def args(self) -> tuple:
        """The positional arguments of `check.build_problem` (and `reference.build_sharded_problem`):
        the first seven fields, then each set one as it was listed before the key had names. The
        inputs' seed hashes their repr (`check.problem_seed`), so this form stays as it was: every
        problem draws the numbers it drew, and recorded rows keep their errors."""
        key: tuple = (self.batch, self.seq_len, self.heads, self.kv_heads, self.head_dim, self.dtype, self.causal)
        key += (self.workload,) if self.workload else ()
        key += (("head_dim_v", self.head_dim_v),) if self.head_dim_v is not None else ()
        key += (("softcap", self.softcap),) if self.softcap else ()
        key += (self.mask,) if self.mask else ()
        key += ("sinks",) if self.sinks else ()
        return key + self.variants


@dataclass(frozen=True)
class TrialSpec:
    """One point of a sweep: everything that identifies it. Picklable (sent to workers)."""

    method: str
    impl: str
    executor: str
    hardware: str
    topology: str
    world_size: int
    nodes: int
    ulysses_degree: int
    ring_degree: int
    batch: int
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    causal: bool
    pass_: str
    kernel: str  # configured kernel ("auto" or a backend); the one used is measured
    options: str = "{}"  # method options as canonical JSON
    workload: str = ""  # "" for attention trials; the model/data/training of a perplexity trial (JSON)
    mask: str = ""  # the mask's canonical name (methods/masks.py); "" for trials planned before masks
    sinks: bool = False  # attention sinks (one learned logit per query head)
    head_dim_v: Optional[int] = None  # the values' head dim; None: equal to head_dim (metrics.VARIANT_IDENTITY)
    softcap: float = 0.0  # logit soft cap; 0: none
    device: str = field(default="cpu", compare=False)
    kind: str = field(default="attention", compare=False)  # the workload that runs it (config `kind`)
    variants: tuple[tuple[str, Any], ...] = ()
    """The set values of the variant axes of suite.metrics.TRIAL_AXES that have no field above
    (name, value), sorted: an axis added to that table travels here from the plan to the case and
    the row without a field of its own (`value` reads any axis)."""

    def value(self, axis: str) -> Any:
        """This trial's value of an identity axis (suite.metrics.TRIAL_AXES): its field, else its
        entry in `variants`, else the axis's plain value."""
        if axis in _FIELDS:
            return getattr(self, "pass_" if axis == "pass" else axis)
        return dict(self.variants).get(axis, M.AXIS[axis].default)

    def identity(self) -> dict[str, Any]:
        """The row's identity columns: every axis of IDENTITY, and the variants that are set."""
        # plain attribute reads: `dataclasses.asdict` deep-copies every field, which cost more than the
        # hash itself at the main sweep's 6,608 trials
        out = {k: getattr(self, "pass_" if k == "pass" else k) for k in IDENTITY}
        for a in M.VARIANTS:  # only when set: other trials keep their keys and columns
            v = self.value(a.name)
            if v not in a.plain:
                out[a.name] = v
        return out

    @functools.cached_property
    def key(self) -> str:
        """Hashed once per spec (the plan, the resume filter and the post-sweep bookkeeping all ask).
        Axes at their plain values are left out (metrics.keyed_identity), so trials planned before
        an axis existed keep their keys."""
        blob = json.dumps(M.keyed_identity(self.identity()), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def method_options(self) -> dict[str, Any]:
        return json.loads(self.options)

    def case(self) -> Case:
        """The problem as methods see it: every `Case` field this spec has an axis (or field) of."""
        return Case(**{name: self.value(name) for name in _CASE_FIELDS if name in _FIELDS or name in M.AXIS})

    def build_method(self) -> methods.Method:
        return methods.get_method(self.method, kernel=self.kernel, **self.method_options)

    def document_lengths(self) -> Optional[tuple[tuple[int, ...], ...]]:
        """The packed documents' lengths per sequence (None: one document per sequence)."""
        return lengths_of(self.workload, self.seq_len, self.batch)

    def __post_init__(self):
        self.mask_obj  # parsed now: a mask that contradicts `causal` is refused where the trial is made

    @functools.cached_property
    def mask_obj(self) -> Mask:
        """The trial's mask, parsed once: its `mask` name, or the plain mask of `causal` for a trial
        planned before masks. Its causality (`Mask.causal`, the one rule) is the trial's flag: a
        trial whose `causal` says otherwise is an error (a row column and the method's plan would
        disagree)."""
        mask = parse_mask(self.mask) if self.mask else plain(self.causal)
        if mask.causal != self.causal:
            raise ValueError(
                f"trial {self.method}: causal={self.causal} contradicts mask {mask.name!r}, whose causal flag is "
                f"{mask.causal} (methods/masks.py Mask.causal); build the flag from the mask"
            )
        return mask

    @property
    def mask_spec(self) -> Optional[Mask]:
        """The mask family when it is not a plain one (None: causal or full by `causal`)."""
        return None if self.mask_obj.plain else self.mask_obj

    def documents(self, padded_len: Optional[int] = None) -> Optional[Documents]:
        """The true sequence's documents and mask (None: one document per sequence, a plain mask),
        padded to `padded_len`."""
        lengths, mask = self.document_lengths(), self.mask_spec
        if lengths is None and mask is None and (padded_len or self.seq_len) == self.seq_len:
            return None
        return Documents(lengths or tuple((self.seq_len,) for _ in range(self.batch)), padded_len or self.seq_len, mask)

    def run_case(self, method: methods.Method) -> Case:
        """The case `method` runs: the sequence padded to its granule, with the packed documents,
        the mask (and the padding) as `documents` when there are any."""
        case = self.case()
        docs = self.documents()
        if docs is not None:  # a layout may follow the documents (sharding by documents)
            case = dataclasses.replace(case, documents=docs)
        padded = method.padded_len(case)
        if docs is None and padded == self.seq_len:
            return case
        return dataclasses.replace(case, seq_len=padded, documents=self.documents(padded))

    def problem_key(self) -> "ProblemKey":
        """Trials with equal problem keys share global inputs and the float64 reference."""
        return ProblemKey(
            self.batch,
            self.seq_len,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.dtype,
            self.causal,
            workload=self.workload if self.document_lengths() is not None else "",
            head_dim_v=self.head_dim_v,
            softcap=self.softcap,
            mask=self.mask_obj.name if self.mask_spec is not None else "",
            sinks=self.sinks,
            variants=self.variants,
        )

    def label(self) -> str:
        mask = self.mask_obj.short
        name = method_label(self.method, self.method_options)
        d = f"{self.head_dim}/{self.head_dim_v}" if self.head_dim_v is not None else f"{self.head_dim}"
        variants = M.variant_labels(self.identity())  # " cap=5"
        return (
            f"{name} P={self.world_size} B={self.batch} S={self.seq_len} H={self.heads}/"
            f"{self.kv_heads} D={d}{variants} {self.dtype} {mask}{' sinks' if self.sinks else ''} {self.pass_}"
        )


_FIELDS = {f.name for f in dataclasses.fields(TrialSpec)} | {"pass"}
# an axis every row has (`Axis.always`) is read as a TrialSpec attribute; one added to the table
# without a field must say `always=False` and travel in `variants` (docs/extending.md)
_UNFIELDED = [a.name for a in M.TRIAL_AXES if a.always and a.name not in _FIELDS]
if _UNFIELDED:
    raise ImportError(
        f"suite/metrics.py TRIAL_AXES: {_UNFIELDED} have always=True but no TrialSpec field; give a new axis "
        "always=False (it then travels in TrialSpec.variants)"
    )
_CASE_FIELDS = tuple(f.name for f in dataclasses.fields(Case) if f.init)


def _matches(rule: dict[str, Any], point: dict[str, Any]) -> bool:
    """A rule matches when every axis it names has one of the listed values (an option the trial's
    method does not have never matches)."""
    for axis, wanted in rule.items():
        values = wanted if isinstance(wanted, (list, tuple)) else [wanted]
        if axis not in point or point[axis] not in values:
            return False
    return True


@dataclass(frozen=True)
class Place:
    """Where trials run: the hardware label, the topology label and the node count per world size."""

    hardware: str
    topology: str
    nodes_for: Callable[[int], int]


class PlannedWorkload(Protocol):
    """What planning needs of a workload (suite/workloads)."""

    kind: ClassVar[str]

    def passes(self, cfg: SuiteConfig) -> list[str]: ...

    def identity(self, cfg: SuiteConfig, *, workload: str, batch: int, seq_len: int) -> str: ...


def plan_size(cfg: SuiteConfig, workload: PlannedWorkload, places: list[Place]) -> int:
    """How many trials `expand` would plan at most, from the axis sizes alone (nothing enumerated):
    the product of the axes and of each method's list-valued options, before `sweep.exclude` (a
    rule's reach depends on the points themselves). A `head_dim_v` of null beside values equal to
    `head_dim` plans once in `expand`; here it counts as listed, so this is an upper bound."""
    s = cfg.sweep
    axes = (
        len(places),
        len(s.world_size),
        len(s.workload),
        len(s.batch),
        len(s.seq_len),
        len(s.heads),
        len(s.kv_heads),
        len(s.head_dim),
        *(len(getattr(s, a.sweep)) for a in M.VARIANTS),
        len(s.dtype),
        len(s.mask) if s.mask else len(s.causal),
        len(s.sinks),
        len(workload.passes(cfg)),
    )
    per_method = 0
    for m in s.methods:
        points = 1
        for value in dict(s.method_options.get(m, {})).values():
            points *= len(value) if isinstance(value, (list, tuple)) else 1
        per_method += points
    return math.prod(axes) * per_method


def single_node_trial(
    name: str,
    method: methods.Method,
    case: Case,
    *,
    pass_: str,
    kernel: str,
    options: dict[str, Any],
    executor: str,
    hardware: str,
    workload: str = "",
    mask: str = "",
    degrees: Optional[tuple[int, int]] = None,
    kind: str = "attention",
) -> TrialSpec:
    """A trial outside a sweep's plan (conformance mutants, option flips): `case`'s problem on one
    node, run by `method` (built from `name` and `options`), with the method's own degrees unless
    `degrees` gives them."""
    ulysses, ring = degrees or method.degrees(case)
    return TrialSpec(
        method=name,
        impl=method.impl,
        executor=executor,
        hardware=hardware,
        topology="single-node",
        world_size=case.world_size,
        nodes=1,
        ulysses_degree=ulysses,
        ring_degree=ring,
        batch=case.batch,
        seq_len=case.seq_len,
        heads=case.heads,
        kv_heads=case.kv_heads,
        head_dim=case.head_dim,
        dtype=case.dtype,
        causal=case.causal,
        pass_=pass_,
        kernel=kernel,
        options=json.dumps(options, sort_keys=True),
        workload=workload,
        mask=mask,
        sinks=case.sinks,
        head_dim_v=case.head_dim_v,
        softcap=float(case.softcap),
        device=case.device,
        kind=kind,
    )


def expand(cfg: SuiteConfig, workload: PlannedWorkload, places: list[Place], device: str) -> list[TrialSpec]:
    """Cartesian product of the sweep axes (and of list-valued method options) minus exclude
    rules, for every place, ordered for the runner: by world size (one worker group each), then
    problem (so inputs and the float64 reference are reused), then method and pass."""
    s = cfg.sweep
    specs = []
    passes = workload.passes(cfg)
    identities: dict[tuple, str] = {}  # a packed workload draws its documents once per (mix, batch, length)
    # the variant axes (metrics.VARIANTS: head_dim_v, softcap, ...) as one axis of their combinations
    variant_points = list(itertools.product(*(getattr(s, a.sweep) for a in M.VARIANTS)))
    # 14 axes: past typeshed's overloads of product, whose fallback would join the axes' types into one union
    axes: Iterable[tuple[Any, ...]] = itertools.product(
        places,
        s.world_size,
        s.workload,
        s.batch,
        s.seq_len,
        s.heads,
        s.kv_heads,
        s.head_dim,
        variant_points,
        s.dtype,
        mask_points(s, cfg.masks),
        s.sinks,
        s.methods,
        passes,
    )
    for place, ws, mix, b, sl, h, kvh, hd, point_variants, dt, (causal, mask), sinks, m, ps in axes:
        variants: dict[str, Any] = {a.name: v if v is None else a.type(v) for a, v in zip(M.VARIANTS, point_variants)}
        if variants["head_dim_v"] == hd and None in s.head_dim_v:
            continue  # equal to head_dim is the null point, planned once
        if variants["head_dim_v"] == hd:  # equal to head_dim: the plain point, its key unchanged
            variants["head_dim_v"] = None
        if (mix, b, sl) not in identities:
            identities[mix, b, sl] = workload.identity(cfg, workload=mix, batch=b, seq_len=sl)
        identity = identities[mix, b, sl]
        case = Case(
            batch=b,
            seq_len=sl,
            heads=h,
            kv_heads=kvh,
            head_dim=hd,
            dtype=dt,
            causal=bool(causal),
            world_size=ws,
            device=device,
            sinks=bool(sinks),
            **{k: v for k, v in variants.items() if k in _CASE_FIELDS},
        )
        # a variant with a field of TrialSpec's is given as that field, any other in `variants`
        fielded = {k: v for k, v in variants.items() if k in _FIELDS}
        carried = tuple(sorted((k, v) for k, v in variants.items() if k not in _FIELDS and v not in M.AXIS[k].plain))
        for options in option_points(dict(s.method_options.get(m, {}))):
            ud, rd, impl = _method_facts(m, options, cfg.run.kernel, case)
            point = dict(
                options,
                method=m,
                topology=place.topology,
                world_size=ws,
                batch=b,
                seq_len=sl,
                heads=h,
                kv_heads=kvh,
                head_dim=hd,
                dtype=dt,
                causal=causal,
                ulysses_degree=ud,
                ring_degree=rd,
                workload=mix,
                mask=mask,
                sinks=bool(sinks),
                **variants,
                **{"pass": ps},
            )
            if any(_matches(rule, point) for rule in s.exclude):
                continue
            specs.append(
                TrialSpec(
                    method=m,
                    impl=impl,
                    executor=cfg.run.executor,
                    hardware=place.hardware,
                    topology=place.topology,
                    world_size=ws,
                    nodes=place.nodes_for(ws),
                    ulysses_degree=ud,
                    ring_degree=rd,
                    batch=b,
                    seq_len=sl,
                    heads=h,
                    kv_heads=kvh,
                    head_dim=hd,
                    dtype=dt,
                    causal=bool(causal),
                    pass_=ps,
                    kernel=cfg.run.kernel,
                    options=json.dumps(options, sort_keys=True),
                    workload=identity,
                    mask=mask,
                    sinks=bool(sinks),
                    device=device,
                    kind=workload.kind,
                    variants=carried,
                    **fielded,
                )
            )
    return specs


def _method_facts(name: str, options: dict, kernel: str, case: Case) -> tuple[int, int, str]:
    """(ulysses_degree, ring_degree, impl) of a method, or placeholders if it is unavailable here."""
    if name not in methods.available():
        return 0, 0, "unavailable"
    try:
        m = methods.get_method(name, kernel=kernel, **options)
        ud, rd = m.degrees(case)
    except (ValueError, TypeError):
        return 0, 0, methods.method_class(name).impl
    return ud, rd, m.impl
