"""`python -m suite advise` on the command line: the question from the arguments, the checks of
where outputs go (before the simulation), the printed answer."""

from __future__ import annotations

import sys
from pathlib import Path

from suite import metrics as M
from suite.advise.compare import compare
from suite.advise.output import (
    advice_sentence,
    counts_line,
    emit_config,
    evidence_line,
    header,
    next_step,
    pruned_lines,
    render,
    tie_line,
    write_outputs,
)
from suite.advise.question import AdviceError, make_question
from suite.advise.ranking import advise, sweep_name


def _check_writable(option: str, path: Path, *, folder: bool) -> None:
    """Raise AdviceError when `path` (a folder to create, or a file to write) cannot be made: it or
    one of its parents is a file (or a folder where a file is asked for)."""
    if folder and path.exists() and not path.is_dir():
        raise AdviceError(option, f"{path} is a file; name a folder")
    if not folder and path.is_dir():
        raise AdviceError(option, f"{path} is a folder; name a YAML file to write")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise AdviceError(option, f"{parent} is a file, so nothing can be written under it: {path}")
            break


def command_line(args) -> str:
    """This advise command as typed (the options that differ from their defaults), without --top,
    --emit-config, --out and --compare: the start of the next command to run."""
    import shlex

    parts = [f"{M.suite_command()} advise", "--model", args.model, "--topology", args.topology]
    for flag, value, default in (
        ("--nodes", args.nodes, None),
        ("--gpus", args.gpus, None),
        ("--seq-len", args.seq_len, None),
        ("--workload", args.workload, None),
        ("--batch", args.batch, 1),
        ("--memory-gb", args.memory_gb, None),
        ("--pass", args.pass_, "fwd_bwd"),
        ("--dtype", args.dtype, "auto"),
        ("--mask", getattr(args, "mask", None), None),
        ("--results-root", args.results_root, "results"),
    ):
        if value != default:
            parts += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    for u in args.ulysses_degree or []:
        parts += ["--ulysses-degree", str(u)]
    parts += [flag for flag, on in (("--recompute", args.recompute), ("--no-causal", args.no_causal)) if on]
    return " ".join(parts[:1] + [shlex.quote(p) for p in parts[1:]])


def run_command(args) -> int:
    import time

    t0 = time.perf_counter()
    try:
        if args.top < 1:
            raise AdviceError("--top", f"must be >= 1, got {args.top}")
        q = make_question(
            model=args.model,
            topology=args.topology,
            nodes=args.nodes,
            gpus=args.gpus,
            seq_len=args.seq_len,
            workload=args.workload,
            memory_gb=args.memory_gb,
            pass_=args.pass_,
            dtype=args.dtype,
            causal=not args.no_causal,
            batch=args.batch,
            ulysses_degree=args.ulysses_degree,
            recompute=args.recompute,
            mask=getattr(args, "mask", None),
        )
        if args.compare and not Path(args.compare).exists():
            raise AdviceError("--compare", f"no such folder: {args.compare}")
        # where the outputs go, checked before the simulation rather than failing after it
        _check_writable("--out", Path(args.out or f"reports/{sweep_name(q)}_{q.seq_len}"), folder=True)
        if args.emit_config:
            _check_writable("--emit-config", Path(args.emit_config), folder=False)
        advice = advise(
            q,
            results_root=args.results_root,
            mlflow=not args.no_mlflow,
            progress=not getattr(args, "no_progress", False),
        )
    except AdviceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    emitted = None
    if args.emit_config:
        emitted = str(emit_config(advice, Path(args.emit_config), args.top))
    step = next_step(advice, command_line(args), emitted)
    print(advice_sentence(advice))
    if not args.compare:  # with --compare, the measured order is printed below
        print(evidence_line(advice))
    print(header(advice))
    print(render(advice, args.top))
    print(counts_line(advice, args.top))
    tie = tie_line(advice)
    if tie:
        print(tie)
    for line in pruned_lines(advice):
        print(line)
    files = write_outputs(advice, Path(args.out or f"reports/{sweep_name(q)}_{q.seq_len}"), args.top, step)
    print(
        f"{len(advice.ranked)} configurations ranked, {len(advice.pruned)} pruned, in "
        f"{time.perf_counter() - t0:.1f}s; rows in {advice.run_dir}; tables {', '.join(map(str, files))}"
    )
    if emitted:
        print(f"sweep measuring the top {args.top}: {emitted}")
    print(step)
    if args.compare:
        try:
            text, _ = compare(advice, Path(args.compare))
        except AdviceError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(text)
    return 0
