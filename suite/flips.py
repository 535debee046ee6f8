"""Option flips (`python -m suite flips`, docs/conformance.md): does a method use every option the
suite passes it?

The bugs users of context-parallel libraries meet are silent ones: an option dropped on the way
(sinks ignored, the soft cap passed as 0, a window applied per ring step). For each method and
each option the suite passes (the causal flag, every parameter of every mask family, packed
documents and their lengths, sinks on and their values, the soft cap on and its value, a value
head dim other than the query/key one, the softmax scale) a flip runs the problem twice on the
same inputs (the probe workload, suite/workloads/probe.py), once with the option changed, and:
- the output must change: max |out_flipped - out| (or of the LSE) above the float64 check's own
  bound, the error it allows as rounding (a change below it could be rounding, not the option);
- the float64 attention itself must change as much (else the flip says nothing at this size, a
  failure of the flip, not of the method);
- both runs must pass their float64 checks;
- where the method declares it cannot take the option (`supports` refuses the case), the flip is
  a skip naming the option and the method's reason. A method that accepts the option and returns
  the same output fails: "option X dropped".

Probes run on the executor a method needs: virtual ranks (threads) for the suite's own methods,
worker processes over torch.distributed (`dist`) for peer libraries. `ProbeRunner` is shared with
the repeat check (suite/repeats.py).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

import methods
from methods.base import Case
from methods.masks import COUNT, FAMILIES, FLAG, SIZE, Mask
from suite.check import tolerance
from suite.config.schema import RunConfig
from suite.executors.base import Executor
from suite.plan import RunSettings, TrialSpec, single_node_trial
from suite.records import worst
from suite.workloads.probe import KIND, ProbeReport, ProbeSettings, ProbeWorkload, assemble, probe_case

FORWARD = ("out", "lse")  # what "the output changed" is judged on


@dataclass(frozen=True)
class Shape:
    """The problem every probe of a method shares (its options vary by `Variant`)."""

    world_size: int = 2
    batch: int = 1
    seq_len: int = 48
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    dtype: str = "float32"
    kernel: str = "auto"


@dataclass(frozen=True)
class Variant:
    """The options of one run: what a flip changes."""

    causal: bool = True
    mask: str = ""  # a mask family's canonical name (methods/masks.py); "": the plain mask of `causal`
    lengths: Optional[tuple[tuple[int, ...], ...]] = None  # packed documents per sequence; None: one
    sinks: bool = False
    sink_shift: float = 0.0
    softcap: float = 0.0
    head_dim_v: Optional[int] = None
    scale: Optional[float] = None  # None: 1/sqrt(head_dim)


@dataclass(frozen=True)
class Flip:
    option: str  # what is flipped: "causal", "softcap", "sliding_window.window", ...
    base: Variant
    flipped: Variant
    change: str  # "true -> false", for the table
    needs: str = ""  # the flip whose flipped run is this one's base ("": the plain problem)


def flips(shape: Shape) -> list[Flip]:
    """Every option the suite passes, each flipped once from a base that has it (sizes in tokens,
    from the sequence length: a window of S/6 -> S/3, documents S/2 + S/2 -> S/4 + 3S/4)."""
    s, d = shape.seq_len, shape.head_dim
    w = max(2, s // 6)
    causal, full = Variant(), Variant(causal=False)
    halves = tuple((s // 2, s - s // 2) for _ in range(shape.batch))
    quarter = tuple((max(1, s // 4), s - max(1, s // 4)) for _ in range(shape.batch))
    out = [
        Flip("causal", causal, full, "true -> false"),
        Flip("scale", causal, Variant(scale=0.5 / math.sqrt(d)), "1/sqrt(D) -> 0.5/sqrt(D)"),
        Flip("softcap", causal, Variant(softcap=1.0), "0 -> 1"),
        Flip("softcap value", Variant(softcap=1.0), Variant(softcap=2.0), "1 -> 2", "softcap"),
        Flip("sinks", causal, Variant(sinks=True), "off -> on"),
        Flip("sink values", Variant(sinks=True), Variant(sinks=True, sink_shift=2.0), "s -> s + 2", "sinks"),
        Flip("head_dim_v", causal, Variant(head_dim_v=max(1, d // 2)), f"{d} -> {max(1, d // 2)}"),
        Flip("documents", causal, Variant(lengths=halves), f"[{s}] -> {list(halves[0])}"),
        Flip(
            "document lengths",
            Variant(lengths=halves),
            Variant(lengths=quarter),
            f"{list(halves[0])} -> {list(quarter[0])}",
            "documents",
        ),
    ]
    # every registered mask family (methods/masks.py) from its plain mask, then each parameter: a
    # size of S/6 tokens doubled, a count of 2 made 3, a flag from its default (or false) to the other
    for fam in FAMILIES.values():
        if not fam.params:
            continue  # full and causal: the causal flip above
        params = {k: fam.defaults.get(k, {SIZE: w, COUNT: 2, FLAG: False}[kind]) for k, kind in fam.params}
        base = _mask_variant(fam.name, params)
        plain = Variant(causal=base.causal)
        label = Mask(fam.name, tuple(params.items())).short
        out.append(Flip(fam.name, plain, base, f"{'causal' if base.causal else 'full'} -> {label}"))
        for key, kind in fam.params:
            value = params[key]
            changed = not value if kind == FLAG else 2 * value if kind == SIZE else value + 1
            flipped = _mask_variant(fam.name, {**params, key: changed})
            change = f"{str(value).lower()} -> {str(changed).lower()}"
            out.append(Flip(f"{fam.name}.{key}", base, flipped, change, fam.name))
    return out


def selected(shape: Shape, only: Optional[list[str]]) -> list[Flip]:
    """The flips named in `only` (all when None); an unknown name raises, listing the options."""
    every = flips(shape)
    if only is None:
        return every
    names = [f.option for f in every]
    unknown = [o for o in only if o not in names]
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} to flip; the options are {names}")
    return [f for f in every if f.option in only]


def warm(
    chosen: list[tuple[str, dict[str, Any], Shape]], runner: ProbeRunner, only: Optional[list[str]] = None
) -> None:
    """Run the probes of every method's flips problem by problem, every method in turn, before
    `run_flips` reads them from the runner's cache: consecutive probes then share one problem, whose
    float64 reference a worker builds once (`check.ProblemCache` keeps the latest)."""
    variants: list[Variant] = []
    for _, _, shape in chosen:
        for f in selected(shape, only):
            variants += [v for v in (f.base, f.flipped) if v not in variants]
    for variant in [Variant(), *variants]:
        for name, options, shape in chosen:
            try:
                pass_ = runner.pass_for(name, options, shape, Variant())
                runner.run(runner.spec(name, options, shape, variant, pass_=pass_))
            except (KeyError, TypeError, ValueError):  # `run_flips` reports it
                continue


def _mask_variant(family: str, params: dict[str, Any]) -> Variant:
    mask = Mask(family, tuple(params.items()))
    return Variant(causal=mask.causal, mask=mask.name)


# -- running probes ------------------------------------------------------------------------------------
@dataclass
class ProbeResult:
    """One probe as the parent sees it: refused, failed, or every rank's report put together."""

    status: str  # "ok", "skipped" (the method refuses the case), "failed" (an error, a hang)
    reason: str = ""
    reports: list[ProbeReport] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # the first repeat, global (`assemble`)
    tol: dict[str, float] = field(default_factory=dict)  # the pass rule's bound per tensor
    errors: dict[str, float] = field(default_factory=dict)  # the first repeat's, max over ranks
    pass_: str = "fwd_bwd"

    @property
    def bad(self) -> list[str]:
        """What exceeded its bound in the first repeat (the check's message)."""
        return [
            f"{n}: error {e:.3g} > tolerance {self.tol[n]:.3g}" for n, e in self.errors.items() if not e <= self.tol[n]
        ]


def tolerances(reports: list[ProbeReport]) -> dict[str, float]:
    """The float64 check's bound per tensor over the whole problem (as `records.check_columns`)."""
    first = reports[0]
    if not first.checked or first.tol_floor is None:
        return {}
    return {
        n: tolerance(max(r.naive_err[n] for r in reports), max(r.ref_max[n] for r in reports), first.tol_floor)
        for n in first.errors
    }


def repeat_errors(reports: list[ProbeReport], i: int) -> dict[str, float]:
    """Repeat i's check errors, max over ranks (NaN kept)."""
    return {n: worst(r.repeat_errors[i][n] for r in reports) for n in reports[0].repeat_errors[i]}


class ProbeRunner:
    """Runs probes of any method on the executor it needs, caching results by what they run."""

    def __init__(
        self,
        *,
        device: str = "cpu",
        plugins: tuple[str, ...] = (),
        seed: int = 0,
        executor: str = "auto",
        timeout_s: Optional[float] = None,
    ):
        if executor not in ("auto", "threads", "dist"):
            raise ValueError(f"executor must be auto, threads or dist, got {executor!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda, but no CUDA device is available here (use --device cpu)")
        self.device, self.plugins, self.seed, self.executor = device, tuple(plugins), seed, executor
        defaults = RunConfig()
        self.timeout_s = defaults.timeout_s if timeout_s is None else timeout_s
        self.settings = RunSettings(
            warmup=0, repeats=1, check=True, check_max_seq_len=defaults.check_max_seq_len, seed=seed, breakdown=False
        )
        self._executors: dict[str, Executor] = {}
        self._cache: dict[tuple, ProbeResult] = {}
        self.workload = ProbeWorkload()

    def _executor(self, kind: str) -> Executor:
        if kind not in self._executors:
            defaults = RunConfig()
            if kind == "threads":
                from suite.executors.threads import ThreadExecutor

                self._executors[kind] = ThreadExecutor(
                    device=self.device,
                    run=self.settings,
                    timeout_s=self.timeout_s,
                    prepare_timeout_s=defaults.prepare_timeout_s,
                    hardware="probe",
                )
            else:
                from suite.executors import resolve_backend
                from suite.executors.local import LocalDistExecutor

                self._executors[kind] = LocalDistExecutor(
                    device=self.device,
                    backend=resolve_backend("auto", self.device),
                    run=self.settings,
                    threads_per_rank=0,
                    plugins=self.plugins,
                    timeout_s=self.timeout_s,
                    startup_timeout_s=defaults.startup_timeout_s,
                    grace_s=defaults.fail_grace_s,
                    prepare_timeout_s=defaults.prepare_timeout_s,
                    hardware="probe",
                )
        return self._executors[kind]

    def close(self) -> None:
        for ex in self._executors.values():
            ex.close()
        self._executors.clear()

    def spec(
        self,
        name: str,
        options: dict[str, Any],
        shape: Shape,
        variant: Variant,
        *,
        pass_: str,
        repeats: int = 1,
        keep: bool = True,
    ) -> TrialSpec:
        method = methods.get_method(name, kernel=shape.kernel, **options)
        mask = variant.mask or ("causal" if variant.causal else "full")
        probe = ProbeSettings(
            lengths=variant.lengths, scale=variant.scale, sink_shift=variant.sink_shift, repeats=repeats, keep=keep
        )
        case = Case(
            shape.batch,
            shape.seq_len,
            shape.heads,
            shape.kv_heads,
            shape.head_dim,
            shape.dtype,
            variant.causal,
            shape.world_size,
            self.device,
            sinks=variant.sinks,
            head_dim_v=variant.head_dim_v,
            softcap=variant.softcap,
        )
        try:
            degrees = method.degrees(case)
        except ValueError:  # `supports` says why
            degrees = (1, shape.world_size)
        return single_node_trial(
            name,
            method,
            case,
            pass_=pass_,
            kernel=shape.kernel,
            options=options,
            executor="probe",
            hardware="probe",
            workload=probe.to_json(),
            mask=mask,
            degrees=degrees,
            kind=KIND,
        )

    def refusal(self, spec: TrialSpec) -> str:
        """Why `spec` cannot run here ("" if it can): the method's, the workload's or the executor's."""
        method = spec.build_method()
        try:
            case = probe_case(spec, ProbeSettings.of(spec), method)
        except ValueError as exc:  # documents that do not fit (a mask longer than a document)
            return str(exc)
        ok, why = method.supports(case)
        if not ok:
            return why
        if spec.pass_ == "fwd_bwd":
            why_not = method.forward_only_reason(case)
            if why_not:
                return why_not
        ok, why = self._executor_for(method).supports(spec, method, self.workload)
        return "" if ok else why

    def _executor_for(self, method) -> Executor:
        kind = self.executor if self.executor != "auto" else ("dist" if method.needs_processes else "threads")
        return self._executor(kind)

    def pass_for(self, name: str, options: dict[str, Any], shape: Shape, variant: Variant) -> str:
        """fwd_bwd where the method has a backward for the case, else fwd."""
        spec = self.spec(name, options, shape, variant, pass_="fwd")
        method = spec.build_method()
        try:
            case = probe_case(spec, ProbeSettings.of(spec), method)
        except ValueError:
            return "fwd_bwd"
        return "fwd" if method.forward_only_reason(case) else "fwd_bwd"

    def run(self, spec: TrialSpec) -> ProbeResult:
        key = (spec.key, ProbeSettings.of(spec).to_json())
        if key in self._cache:
            return self._cache[key]
        why = self.refusal(spec)
        if why:
            result = ProbeResult("skipped", why, pass_=spec.pass_)
        else:
            outcome = self._executor_for(spec.build_method()).run(spec)
            reports = [r for r in outcome.reports if r is not None]
            failed = [r for r in reports if not r.ok]
            if outcome.kind != "reported" or failed or len(reports) != spec.world_size:
                msgs = [f"rank {r.rank}: {r.error}" for r in failed] + ([outcome.message] if outcome.message else [])
                result = ProbeResult("failed", "; ".join(msgs) or outcome.kind, pass_=spec.pass_)
            else:
                result = ProbeResult("ok", reports=reports, pass_=spec.pass_)  # type: ignore[arg-type]
                result.tol = tolerances(result.reports)
                result.errors = repeat_errors(result.reports, 0) if result.tol else {}
                if ProbeSettings.of(spec).keep:
                    result.tensors = assemble(result.reports, spec.seq_len)
        self._cache[key] = result
        return result


# -- judging a flip ------------------------------------------------------------------------------------
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass
class FlipRow:
    method: str
    option: str
    change: str
    status: str
    changed: Optional[bool] = None
    delta: Optional[float] = None  # max |out_flipped - out| (NaN: the shapes differ)
    threshold: Optional[float] = None  # the bound the change must pass
    ref_delta: Optional[float] = None
    flipped_check: str = "-"
    reason: str = ""


def _delta(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[float]:
    """max |a - b| (NaN where the shapes differ, as a value head dim flip makes them; None if absent)."""
    if a is None or b is None:
        return None
    if a.shape != b.shape:
        return math.nan
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _changed(base: ProbeResult, flip: ProbeResult, prefix: str = "") -> tuple[bool, float, float]:
    """(whether out or lse moved beyond the check's bound, max |delta out|, the bound on out)."""
    moved, shown, bound = False, 0.0, 0.0
    for n in FORWARD:
        d = _delta(base.tensors.get(prefix + n), flip.tensors.get(prefix + n))
        if d is None:
            continue
        tol = max(base.tol.get(n, 0.0), flip.tol.get(n, 0.0))
        moved = moved or math.isnan(d) or d > tol
        if n == "out":
            shown, bound = d, tol
    return moved, shown, bound


def judge(label: str, flip: Flip, base: ProbeResult, flipped: ProbeResult) -> FlipRow:
    row = FlipRow(label, flip.option, flip.change, SKIP)
    if base.status == "skipped":  # the row of the flip that makes this base gives the reason in full
        row.reason = f"needs {flip.needs}, refused (see its row)" if flip.needs else f"{flip.option}: {base.reason}"
        return row
    if flipped.status == "skipped":
        row.reason = f"{flip.option}: {flipped.reason}"
        return row
    for which, res in (("base", base), ("flipped", flipped)):
        if res.status == "failed":
            row.status, row.reason = FAIL, f"{which} run failed: {res.reason}"[:500]
            return row
    row.changed, row.delta, row.threshold = _changed(base, flipped)
    ref_moved, row.ref_delta, _ = _changed(base, flipped, prefix="ref_")
    row.flipped_check = "ok" if not flipped.bad else "INCORRECT"
    if not row.changed:
        row.status = FAIL
        row.reason = (
            f"option {flip.option} dropped: the output did not change (max |delta out| {row.delta:.3g} <= "
            f"{row.threshold:.3g}, the check's bound)"
        )
        if flipped.bad:
            row.reason += "; flipped run incorrect: " + "; ".join(flipped.bad)
    elif flipped.bad:
        row.status, row.reason = FAIL, "flipped run incorrect: " + "; ".join(flipped.bad)
    elif base.bad:
        row.status, row.reason = FAIL, "base run incorrect: " + "; ".join(base.bad)
    elif not ref_moved and "ref_out" in base.tensors:  # an unchecked probe (past run.check_max_seq_len) has none
        row.status = FAIL
        row.reason = f"the flip does not change float64 attention at this size (max |delta| {row.ref_delta:.3g})"
    else:
        row.status = PASS
    return row


def method_label(name: str, options: dict[str, Any]) -> str:
    return name + (":" + ",".join(f"{k}={v}" for k, v in sorted(options.items())) if options else "")


def run_flips(
    name: str, options: dict[str, Any], shape: Shape, runner: ProbeRunner, only: Optional[list[str]] = None
) -> list[FlipRow]:
    """Every flip of `flips(shape)` (those named in `only`, if given) for one method; one row per
    flip (one row in all when the method cannot run the plain causal base problem here)."""
    label = method_label(name, options)
    try:
        methods.get_method(name, kernel=shape.kernel, **options)
    except (KeyError, TypeError, ValueError) as exc:
        return [FlipRow(label, "*", "-", SKIP, reason=str(exc).strip("'\""))]
    pass_ = runner.pass_for(name, options, shape, Variant())
    base = runner.run(runner.spec(name, options, shape, Variant(), pass_=pass_))
    if base.status == "skipped":
        return [FlipRow(label, "*", "-", SKIP, reason=f"the base problem (causal, {shape.dtype}): {base.reason}")]
    rows = []
    for flip in selected(shape, only):
        a = runner.run(runner.spec(name, options, shape, flip.base, pass_=pass_))
        b = runner.run(runner.spec(name, options, shape, flip.flipped, pass_=pass_))
        rows.append(judge(label, flip, a, b))
    return rows


def format_table(rows: list[FlipRow]) -> str:
    """The table: method | option | flip | changed? (max |delta out|) | flipped check | status | reason."""
    head = ("method", "option", "flip", "changed? (max |delta out|)", "flipped check", "status", "reason")
    body = []
    for r in rows:
        if r.changed is None:
            changed = "-"
        elif r.delta is not None and math.isnan(r.delta):
            changed = "yes (shape)"
        else:
            changed = f"{'yes' if r.changed else 'NO'} ({r.delta:.2g})"
        body.append((r.method, r.option, r.change, changed, r.flipped_check, r.status, r.reason))
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in body]
    return "\n".join(lines)


def summary(rows: list[FlipRow]) -> str:
    counts = {s: sum(r.status == s for r in rows) for s in (PASS, FAIL, SKIP)}
    dropped = sorted({f"{r.method} {r.option}" for r in rows if r.status == FAIL and "dropped" in r.reason})
    line = (
        f"flips: {len({r.method for r in rows})} methods, {counts[PASS]} pass, {counts[FAIL]} fail, "
        f"{counts[SKIP]} skipped (option not taken)"
    )
    return line + (f"; dropped: {', '.join(dropped)}" if dropped else "")


# -- the command line (`python -m suite flips`; suite/cli.py holds the parser) ---------------------------
def parse_method(text: str) -> tuple[str, dict[str, Any]]:
    """`name` or `name:key=value,key=value` (values as JSON where they parse: 2, true, "x")."""
    name, _, rest = text.partition(":")
    options: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"method option {part!r} of {text!r}: write key=value (e.g. usp:ulysses_degree=2)")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value.strip()
    return name.strip(), options


def shape_of(args, name: str, options: dict[str, Any]) -> Shape:
    """The base problem for one method: the arguments, the length rounded up to the method's
    granule, and bfloat16 for a method that refuses float32 but takes it (ring-flash-attn), unless
    --dtype names one."""
    given = {k: getattr(args, k, None) for k in Shape.__dataclass_fields__}
    shape = Shape(**{k: v for k, v in given.items() if v is not None})
    try:
        method = methods.get_method(name, kernel=shape.kernel, **options)
    except (KeyError, TypeError, ValueError):
        return shape
    case = Case(
        shape.batch, shape.seq_len, shape.heads, shape.kv_heads, shape.head_dim, shape.dtype, True, shape.world_size
    )
    try:
        g = method.granule(case)
    except ValueError:
        g = 1
    shape = replace(shape, seq_len=-(-shape.seq_len // g) * g)
    if getattr(args, "dtype", None) is None:
        case = replace(case, seq_len=shape.seq_len)
        if not method.supports(case)[0] and method.supports(replace(case, dtype="bfloat16"))[0]:
            shape = replace(shape, dtype="bfloat16")
    return shape


def device_of(args) -> str:
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return args.device


def run_command(args, out=None) -> int:
    """`python -m suite flips`: the table, a summary line; exit 1 on any failed flip, 2 on bad input."""
    out = out or sys.stdout
    try:
        methods.load_plugins(args.plugin)
        from methods.registry import expand_groups

        chosen = [parse_method(n) for n in expand_groups(args.methods)]
        shapes = [(name, options, shape_of(args, name, options)) for name, options in chosen]
        selected(Shape(), args.only)  # an unknown option name
        runner = ProbeRunner(
            device=device_of(args),
            plugins=tuple(args.plugin),
            seed=args.seed,
            executor=args.executor,
            timeout_s=args.timeout_s,
        )
    except (ValueError, KeyError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows: list[FlipRow] = []
    try:
        warm(shapes, runner, args.only)
        for name, options, shape in shapes:
            got = run_flips(name, options, shape, runner, args.only)
            rows += got
            print(
                f"{method_label(name, options)}: {sum(r.status == PASS for r in got)} pass, "
                f"{sum(r.status == FAIL for r in got)} fail, {sum(r.status == SKIP for r in got)} skipped "
                f"(P={shape.world_size} S={shape.seq_len} {shape.dtype})",
                file=sys.stderr,
                flush=True,
            )
    finally:
        runner.close()
    print(format_table(rows), file=out)
    print(summary(rows), file=out)
    return 1 if any(r.status == FAIL for r in rows) else 0
