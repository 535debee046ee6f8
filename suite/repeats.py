"""Repeats, the flake mode (`python -m suite repeats`, docs/conformance.md): one trial N times on the
same inputs.

A race in a backward pass (a reduction whose order depends on which thread or stream finishes
first, a buffer reused before its reader is done) shows in a fraction of a percent of launches,
and one trial of a sweep almost never meets it. Here the probe workload (suite/workloads/probe.py)
calls the method N times on the very same inputs within one trial, and reports per tensor (out,
lse, dq, dk, dv, and dsink with sinks):
- whether every repeat equals the first bit for bit;
- the spread: max over repeats of max |x_i - x_0|;
- every repeat whose float64 check fails (its errors against the pass rule's bound).
A repeat failing the check is a failure (exit 1); non-determinism alone is reported, and fails
only with `--require-deterministic` (a reduction in another order is still correct attention).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from suite.flips import (
    ProbeRunner,
    Shape,
    Variant,
    device_of,
    method_label,
    parse_method,
    repeat_errors,
    shape_of,
)
from suite.records import worst as worst_error

TENSORS = ("out", "lse", "dq", "dk", "dv", "dsink")


@dataclass
class RepeatReport:
    """What N calls on the same inputs gave."""

    method: str
    repeats: int
    status: str  # "ok", "skipped" (the method refuses the case), "failed" (an error or a hang)
    reason: str = ""
    pass_: str = "fwd_bwd"
    identical: dict[str, bool] = field(default_factory=dict)  # tensor -> every repeat bitwise equal to the first
    spread: dict[str, float] = field(default_factory=dict)  # tensor -> max over repeats and ranks of max |x_i - x_0|
    differing: list[int] = field(default_factory=list)  # repeats (0-based) differing from the first on any rank
    failures: list[tuple[int, str, float, float]] = field(default_factory=list)  # (repeat, tensor, error, bound)
    tol: dict[str, float] = field(default_factory=dict)
    worst: dict[str, float] = field(default_factory=dict)  # tensor -> the largest error of any repeat

    @property
    def deterministic(self) -> bool:
        return all(self.identical.values())

    @property
    def failed_repeats(self) -> list[int]:
        return sorted({i for i, *_ in self.failures})


def run_repeats(
    name: str,
    options: dict[str, Any],
    shape: Shape,
    variant: Variant,
    n: int,
    runner: ProbeRunner,
    pass_: Optional[str] = None,
) -> RepeatReport:
    """Method `name` called `n` times on the same inputs, within one trial on every rank."""
    if n < 2:
        raise ValueError(f"repeats: -n must be at least 2 (got {n}); the flake mode wants 20 or more")
    pass_ = pass_ or runner.pass_for(name, options, shape, variant)
    spec = runner.spec(name, options, shape, variant, pass_=pass_, repeats=n, keep=False)
    res = runner.run(spec)
    report = RepeatReport(method_label(name, options), n, res.status, res.reason, pass_)
    if res.status != "ok":
        return report
    reports = res.reports
    names = [t for t in TENSORS if t in reports[0].identical]
    report.identical = {t: all(r.identical[t] for r in reports) for t in names}
    report.spread = {t: max(r.spread[t] for r in reports) for t in names}
    report.differing = sorted({i for r in reports for i in r.differing})
    report.tol = res.tol
    for i in range(n):
        errs = repeat_errors(reports, i) if res.tol else {}
        for t, err in errs.items():
            report.worst[t] = worst_error([report.worst.get(t, 0.0), err])
            if not err <= res.tol[t]:  # also NaN
                report.failures.append((i, t, err, res.tol[t]))
    return report


def format_report(rep: RepeatReport) -> str:
    if rep.status != "ok":
        return f"{rep.method}: {rep.status}: {rep.reason}"
    lines = [
        f"{rep.method}: {rep.repeats} repeats ({rep.pass_}) on the same inputs",
        "| tensor | bitwise identical | spread (max |x_i - x_0|) | worst error | check bound |",
        "|---|---|---|---|---|",
    ]
    for t, same in rep.identical.items():
        worst = f"{rep.worst[t]:.3g}" if t in rep.worst else "-"
        bound = f"{rep.tol[t]:.3g}" if t in rep.tol else "-"
        lines.append(f"| {t} | {'yes' if same else 'NO'} | {rep.spread[t]:.3g} | {worst} | {bound} |")
    if rep.differing:
        shown = ", ".join(map(str, rep.differing[:20])) + (" ..." if len(rep.differing) > 20 else "")
        lines.append(f"repeats differing from repeat 0: {len(rep.differing)} of {rep.repeats - 1} ({shown})")
    for i, t, err, tol in rep.failures[:20]:
        lines.append(f"repeat {i} FAILS the check: {t}: error {err:.3g} > tolerance {tol:.3g}")
    verdict = "deterministic (bitwise)" if rep.deterministic else "NOT deterministic"
    check = (
        f"{len(rep.failed_repeats)} repeat(s) fail the float64 check"
        if rep.failures
        else "every repeat passes the float64 check"
    )
    lines.append(f"repeats: {verdict}; {check}")
    return "\n".join(lines)


def variant_of(args, shape: Shape) -> Variant:
    from methods.masks import parse

    causal = not args.no_causal
    mask = ""
    if args.mask:
        m = parse(args.mask)
        causal = m.causal
        mask = "" if m.plain else m.name
    lengths = None
    if args.documents:
        try:
            one = tuple(int(x) for x in args.documents.split(","))
        except ValueError:
            raise ValueError(f"--documents: comma-separated token counts, e.g. 24,24; got {args.documents!r}") from None
        if sum(one) != shape.seq_len:
            raise ValueError(
                f"--documents: the lengths add up to {sum(one)}, not the sequence length {shape.seq_len} "
                f"(--seq-len, rounded up to the method's granule)"
            )
        lengths = tuple(one for _ in range(shape.batch))
    return Variant(
        causal=causal,
        mask=mask,
        lengths=lengths,
        sinks=args.sinks,
        softcap=args.softcap,
        head_dim_v=args.head_dim_v,
        scale=args.scale,
    )


def run_command(args, out=None) -> int:
    """`python -m suite repeats`: the report; exit 1 when a repeat fails the check (or, with
    --require-deterministic, differs), 2 on bad input or a problem the method cannot run."""
    out = out or sys.stdout
    import methods

    try:
        methods.load_plugins(args.plugin)
        name, options = parse_method(args.method)
        methods.get_method(name, **options)
        shape = shape_of(args, name, options)
        variant = variant_of(args, shape)
        runner = ProbeRunner(
            device=device_of(args),
            plugins=tuple(args.plugin),
            seed=args.seed,
            executor=args.executor,
            timeout_s=args.timeout_s,
        )
    except (ValueError, KeyError, TypeError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        rep = run_repeats(name, options, shape, variant, args.repeats, runner, args.pass_)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        runner.close()
    print(format_report(rep), file=out)
    if rep.status != "ok":
        return 2 if rep.status == "skipped" else 1
    if rep.failures or (args.require_deterministic and not rep.deterministic):
        return 1
    return 0
