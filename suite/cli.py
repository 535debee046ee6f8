"""`python -m suite`: run a sweep, list methods, open the MLflow UI, re-log a stored sweep."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from suite.bundled import MODELS
from suite.metrics import suite_command

# what `add_subparsers` returns: each command's function below adds its parser to it
Subcommands = argparse._SubParsersAction

EPILOG = """examples:
  python -m suite run configs/quickstart.yaml
  python -m suite run configs/quickstart.yaml run.repeats=3 sweep.seq_len=[256,512]
  python -m suite run configs/quickstart.yaml --resume            # continue the newest run with this config
  python -m suite run configs/h100_sweep.yaml --dry-run           # the planned trials: counts, first 40
  python -m suite run configs/simulate_tasp.yaml                   # predicted on topology models (executor sim)
  python -m suite calibrate configs/sim_check_cpu.yaml             # kernel/link times for the simulator
  python -m suite advise --model llama3_8b --topology h100_sxm --nodes 2 --seq-len 262144
  python -m suite validate --check                                # the simulator against published tables
  python -m suite list
  python -m suite ui
  python -m suite report                                          # latest run of every sweep
  python -m suite report results/quickstart --baseline ulysses --out reports/qs
"""


def _add_run(sub: Subcommands) -> None:
    run = sub.add_parser(
        "run",
        help="run a sweep from a YAML config",
        description="Run every trial of a sweep: check each method against float64 attention, "
        "time it, count its bytes; write results/<name>/<time>/ and log to MLflow.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    run.add_argument("config", help="path to a sweep YAML (e.g. configs/quickstart.yaml)")
    run.add_argument(
        "overrides",
        nargs="*",
        help="Hydra-style overrides: key=value (run.repeats=3, sweep.world_size=[2,4], sweep.seq_len=512,1024)",
    )
    run.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="RUN_DIR",
        help="continue an interrupted sweep: skip trials already recorded (default: the newest "
        "run folder of this sweep whose config matches; refused if none does)",
    )
    run.add_argument(
        "--force",
        action="store_true",
        help="with --resume RUN_DIR: continue even where a sweep axis, a setting that changes "
        "results (run.repeats, run.seed, ...) or the sweep name differs from the folder's; the "
        "change is recorded in the folder's resumes.jsonl",
    )
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="print the planned trials (the first 40) and whether each can run here, then counts by method and "
        "by skip reason",
    )
    run.add_argument("-v", "--verbose", action="store_true", help="with --dry-run: list every planned trial")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_advise(sub: Subcommands) -> None:
    adv = sub.add_parser(
        "advise",
        help="rank methods x degrees for a model, a cluster and a length mix (simulated)",
        description="Which sequence-parallel configuration to use: every own method x its "
        "Ulysses/ring degrees, layouts and ranks per node, pruned by validity and "
        "memory, predicted by the simulator (a sweep with executor=sim) and ranked "
        "by step time.",
    )
    adv.add_argument(
        "--model",
        required=True,
        help=f"a model of configs/models ({', '.join(sorted(p.stem for p in MODELS.glob('*.yaml')))}), "
        "a model YAML, or heads/kv_heads/head_dim such as 32/8/128",
    )
    adv.add_argument(
        "--topology",
        required=True,
        help="a name in configs/topologies (h100_sxm, mi300x, ...) or a "
        "topology YAML, e.g. results/calibration/cpu_host.yaml from "
        "`suite calibrate`",
    )
    adv.add_argument("--nodes", type=int, default=None, help="nodes of the topology (default 1)")
    adv.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="ranks sharing the sequence (default: every GPU of --nodes; give it for a CPU host topology, e.g. 4)",
    )
    adv.add_argument("--seq-len", type=int, default=None, help="tokens per sequence, global (default 131072)")
    adv.add_argument(
        "--workload",
        default=None,
        help="length mix: uniform (default), a histogram of configs/documents "
        "(stdlib_files) or a file, or lognormal:median=M,sigma=S",
    )
    adv.add_argument("--batch", type=int, default=1)
    adv.add_argument("--memory-gb", type=float, default=None, help="memory budget per GPU for attention (GB)")
    adv.add_argument(
        "--recompute",
        action="store_true",
        help="activation recomputation: the other layers keep only their input hidden states for backward (memory)",
    )
    adv.add_argument("--pass", dest="pass_", default="fwd_bwd", choices=["fwd", "fwd_bwd"])
    adv.add_argument(
        "--dtype", default="auto", help="auto: bfloat16 where the topology has a rate for it, else float32"
    )
    adv.add_argument("--no-causal", action="store_true", help="full (bidirectional) attention instead of causal")
    adv.add_argument(
        "--mask",
        default=None,
        help="every layer's mask, any family as in sweep.mask (sliding_window:0.0625, "
        "shared_question:question=128,answers=4, ...); default: the model file's per-layer "
        "attention_pattern, else causal (full with --no-causal)",
    )
    adv.add_argument(
        "--ulysses-degree", type=int, action="append", default=None, help="weigh only this Ulysses degree (repeatable)"
    )
    adv.add_argument("--top", type=int, default=10, help="rows shown, and configurations --emit-config measures")
    adv.add_argument(
        "--out", default=None, help="folder for advice.md and advice.csv (default reports/<sweep name>_<seq len>)"
    )
    adv.add_argument("--emit-config", default=None, help="write a sweep YAML measuring the top --top (executor dist)")
    adv.add_argument(
        "--compare",
        default=None,
        metavar="RESULTS_DIR",
        help="a measured run (or sweep) folder: print predicted vs measured order and Spearman's rho",
    )
    adv.add_argument("--results-root", default="results")
    adv.add_argument("--no-mlflow", action="store_true", help="do not log the simulated sweep to MLflow")
    adv.add_argument("--no-progress", action="store_true", help="no progress bar (on stderr)")


def _add_validate(sub: Subcommands) -> None:
    val = sub.add_parser(
        "validate",
        help="the simulator against published tables: error per row and per family, and its record",
        description="Simulate every published table of configs/validate/ (a sweep with executor=sim "
        "each), print published vs predicted with the error per row and per family (kernel- or "
        "comm-bound x topology kind x method family), the leave-one-source-out error (each source's rows "
        "as a model that never saw that source predicts them), write reports/recorded/sim_validation.md and the record "
        "configs/validate/bands.yaml whose per-family bands every simulated row carries.",
    )
    val.add_argument(
        "configs",
        nargs="*",
        help="validation files (default: every file of configs/validate/ with a validation section)",
    )
    val.add_argument("--out", default=None, help="report file (default reports/recorded/sim_validation.md)")
    val.add_argument("--bands", default=None, help="the record to write or check against (default: the bundled one)")
    val.add_argument(
        "--check",
        action="store_true",
        help="compare with the record instead of rewriting it: exit 1 when the mean |error| exceeds the "
        "recorded one by more than its margin, or a row's |error| exceeds its row limit",
    )
    val.add_argument("--results-root", default="results", help="where the simulated sweeps' rows go")
    val.add_argument("--mlflow", action="store_true", help="log the simulated sweeps to MLflow (off by default)")


def _add_conformance(sub: Subcommands) -> None:
    conf = sub.add_parser(
        "conformance",
        help="mutation conformance: seeded bugs, each of which the float64 check must catch",
        description="Apply each mutant (a small deliberate bug in a method or the shared machinery, "
        "suite/conformance.py), run its small grid of trials on virtual ranks, and print which check "
        "caught it. Exit 1 when a mutant is missed or an unmutated trial fails. docs/conformance.md.",
    )
    conf.add_argument("--mutants", default="", help="comma-separated mutant names (default: all; --list names them)")
    conf.add_argument("--methods", default="", help="comma-separated methods: only the mutants' trials of these")
    conf.add_argument("--out", default=None, help="also write the table as conformance.md and conformance.jsonl here")
    conf.add_argument("--list", action="store_true", help="list the mutants and what each breaks, then exit")
    conf.add_argument("-v", "--verbose", action="store_true", help="print every trial's verdict as it runs")


def _add_list(sub: Subcommands) -> None:
    sub.add_parser("list", help="list every method and kernel, whether it can run here, and why not")


def _add_ui(sub: Subcommands) -> None:
    ui = sub.add_parser(
        "ui", help="start the MLflow UI (default http://127.0.0.1:5000) over the suite's tracking store"
    )
    ui.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (0.0.0.0: every interface, for a "
        "remote node; anyone who reaches it can read and edit runs)",
    )
    ui.add_argument("--port", type=int, default=5000)
    ui.add_argument("--workers", type=int, default=None, help="server worker processes (MLflow's default: 4)")
    ui.add_argument(
        "--allowed-hosts",
        default=None,
        help="host names the server answers to besides localhost (MLflow's --allowed-hosts), e.g. "
        "the node's name when the UI is opened through it",
    )
    ui.add_argument("--results-root", default="results", help="folder holding mlflow.db (default: results)")
    ui.add_argument(
        "--verbose", action="store_true", help="show the server's own console (access lines, warnings) here"
    )
    ui.add_argument(
        "--uri", default=None, help="tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///<results-root>/mlflow.db)"
    )


def _add_report(sub: Subcommands) -> None:
    rep = sub.add_parser(
        "report",
        help="tables, figures and an HTML page from stored results (nothing is rerun)",
        description="Regenerate paper-style tables (Markdown, LaTeX, CSV), figures (PNG, PDF) and a "
        "self-contained HTML page from results folders; several sweeps may be combined.",
    )
    rep.add_argument(
        "results",
        nargs="*",
        metavar="RESULTS_DIR",
        help="run folders (results/<sweep>/<time>) or sweep folders (their latest run); default: the "
        "latest run of every sweep under --results-root but the advisor's own simulated sweeps",
    )
    rep.add_argument("--out", default=None, help="output folder (default: reports/<sweep names>)")
    rep.add_argument(
        "--baseline",
        default=None,
        help="method the speedup tables and figures divide by (default: ring, where the runs have it)",
    )
    rep.add_argument("--results-root", default="results")
    rep.add_argument("--mlflow-experiment", default=None, help="also read the child runs of this MLflow experiment")
    rep.add_argument("--mlflow-uri", default=None)
    rep.add_argument("--no-mlflow", action="store_true", help="do not attach the HTML to the sweeps' MLflow runs")


def _add_calibrate(sub: Subcommands) -> None:
    cal = sub.add_parser(
        "calibrate",
        help="measure kernel times (and, on CPU, loopback links) for the simulator",
        description="Time every block shape a sweep's schedules emit with the suite's kernels on "
        "this device and write a topology YAML for run.executor=sim: on CPU a full model "
        "of this host (gloo loopback latency and bandwidth measured too), on a GPU the "
        "--base topology with its tile model replaced by the measured table.",
    )
    cal.add_argument("config", help="sweep YAML whose block shapes to time (its methods, sizes and world sizes)")
    cal.add_argument("overrides", nargs="*", help="Hydra-style overrides, as for run")
    cal.add_argument("--out", default=None, help="topology file to write (default: results/calibration/<host>.yaml)")
    cal.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    cal.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads per kernel (default: as the dist executor gives each rank of the smallest world size)",
    )
    cal.add_argument("--repeats", type=int, default=5)
    cal.add_argument("--base", default="h100_sxm", help="GPU only: topology whose links and placement to keep")


def _add_hf_perplexity(sub: Subcommands) -> None:
    hf = sub.add_parser(
        "hf-perplexity",
        help="perplexity of a Hugging Face causal LM with its attention replaced "
        "by suite methods (virtual ranks), against its own eager attention",
        description="Numerics, not performance: ranks are threads of this process (ThreadComm).",
    )
    hf.add_argument("model", help="a local model folder (from_pretrained, no download) or tiny-llama (random, tiny)")
    hf.add_argument("--methods", default="ring,zigzag_ring,ulysses", help="comma-separated method names")
    hf.add_argument("--world-size", default="2,4", help="comma-separated world sizes")
    hf.add_argument("--seq-len", type=int, default=512)
    hf.add_argument("--batch", type=int, default=1)
    hf.add_argument("--batches", type=int, default=2)
    hf.add_argument("--text", default=None, help="a text file (default: the stdlib corpus's validation split)")
    hf.add_argument("--dtype", default="float32")
    hf.add_argument("--device", default="cpu")


def _add_flips(sub: Subcommands) -> None:
    flips = sub.add_parser(
        "flips",
        help="flip every option the suite passes (causal, mask parameters, sinks, soft cap, value head dim, "
        "scale): the output must change, else the method drops it",
        description="For each method, run one small problem with each option flipped on the same inputs: "
        "the output must change beyond the float64 check's bound and the flipped run must pass its check; "
        "an option the method declares it cannot take is a recorded skip naming it (docs/conformance.md).",
    )
    flips.add_argument(
        "--methods",
        nargs="+",
        default=["own"],
        help="methods or groups (own, peers, all), with options as name:key=value,... (default: own)",
    )
    flips.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="OPTION",
        help="flip only these options (causal, scale, softcap, 'softcap value', sinks, 'sink values', "
        "head_dim_v, documents, 'document lengths', a mask family, family.parameter such as sliding_window.window)",
    )
    _probe_arguments(flips)


def _add_repeats(sub: Subcommands) -> None:
    repeats = sub.add_parser(
        "repeats",
        help="flake mode: one trial N times on the same inputs (bitwise identical? spread? a repeat failing "
        "the check?)",
        description="Call one method N times on the same inputs within one trial; report per tensor whether "
        "every repeat is bitwise identical, the spread, and any repeat failing the float64 check (exit 1); "
        "non-determinism alone fails only with --require-deterministic (docs/conformance.md).",
    )
    repeats.add_argument(
        "--method", required=True, help="a method, with options as name:key=value,... (usp:ulysses_degree=2)"
    )
    repeats.add_argument("-n", "--repeats", type=int, default=20, help="calls on the same inputs (default 20)")
    repeats.add_argument(
        "--require-deterministic",
        action="store_true",
        help="exit 1 when any tensor differs between repeats, even where every repeat passes the check",
    )
    _probe_arguments(repeats)
    repeats.add_argument("--no-causal", action="store_true", help="full (bidirectional) attention")
    repeats.add_argument(
        "--mask", default="", help="a mask family as in sweep.mask (sliding_window:8); its causality sets the flag"
    )
    repeats.add_argument("--documents", default="", help="packed document lengths of every sequence, e.g. 24,24")
    repeats.add_argument("--sinks", action="store_true", help="attention sinks (one logit per head)")
    repeats.add_argument("--softcap", type=float, default=0.0, help="logit soft cap (0: none)")
    repeats.add_argument("--head-dim-v", type=int, default=None, help="the values' head dim (default: --head-dim)")
    repeats.add_argument("--scale", type=float, default=None, help="softmax scale (default 1/sqrt(head_dim))")
    repeats.add_argument(
        "--pass", dest="pass_", default=None, choices=["fwd", "fwd_bwd"], help="default: fwd_bwd where it can"
    )


def _add_relog(sub: Subcommands) -> None:
    relog = sub.add_parser("relog", help="log a stored sweep (results folder) to MLflow again")
    relog.add_argument("run_dir")
    relog.add_argument("--uri", default=None)
    relog.add_argument("--experiment", default=None)


# Every subcommand's parser, in the order `--help` lists them.
SUBCOMMANDS: tuple[Callable[[Subcommands], None], ...] = (
    _add_run,
    _add_advise,
    _add_validate,
    _add_conformance,
    _add_list,
    _add_ui,
    _add_report,
    _add_calibrate,
    _add_hf_perplexity,
    _add_flips,
    _add_repeats,
    _add_relog,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=suite_command(),
        description="Sequence-parallel attention benchmark suite",
        epilog=EPILOG.replace("python -m suite", suite_command()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return p


def _probe_arguments(p: argparse.ArgumentParser) -> None:
    """The base problem of `flips` and `repeats` (suite/flips.py `Shape`; None: its default)."""
    p.add_argument("--world-size", type=int, default=None, help="ranks (default 2)")
    p.add_argument("--batch", type=int, default=None, help="default 1")
    p.add_argument(
        "--seq-len", type=int, default=None, help="global tokens, rounded up to the method's granule (default 48)"
    )
    p.add_argument("--heads", type=int, default=None, help="default 4")
    p.add_argument("--kv-heads", type=int, default=None, help="default 2")
    p.add_argument("--head-dim", type=int, default=None, help="default 16")
    p.add_argument(
        "--dtype",
        default=None,
        help="float32 (default; a method refusing it but taking bfloat16, ring-flash-attn, runs in bfloat16), "
        "bfloat16, float16 or float64",
    )
    p.add_argument("--kernel", default=None, help="the methods' kernel option (default auto)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument(
        "--executor",
        default="auto",
        choices=["auto", "threads", "dist"],
        help="auto: virtual ranks (threads) for own methods, worker processes (dist) for peer libraries",
    )
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        help="a module registering methods, imported here and in every worker (tests.plugins.rfa_cpu_shim)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=None, help="per probe (default: run.timeout_s's default)")


def main(argv: Optional[list[str]] = None) -> int:
    parser = _parser()
    # Overrides may come before or after options (`run cfg.yaml --resume run.repeats=3`): argparse
    # stops the positional list at the first option, so the rest arrive as unknown words.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if args.command not in ("run", "calibrate") or any(word.startswith("-") or "=" not in word for word in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    # `run --resume run.repeats=3`: argparse takes the override for --resume's optional folder
    if args.command == "run" and args.resume and "=" in args.resume and not Path(args.resume).exists():
        args.overrides, args.resume = list(args.overrides) + [args.resume], "latest"
    return HANDLERS[args.command](args)


def _load_config(args):
    """(config, its YAML), or None after printing the config error."""
    from suite.config import ConfigError, load_config

    try:
        return load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return None


def _calibrate(args) -> int:
    from pathlib import Path

    import torch

    from suite.calibrate import calibrate
    from suite.env import hardware_label

    loaded = _load_config(args)
    if loaded is None:
        return 2
    cfg = loaded[0]
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is available here", file=sys.stderr)
        return 2
    label = "".join(c if c.isalnum() or c in "-_." else "_" for c in hardware_label(device))[:60]
    out = Path(args.out or f"results/calibration/{label}.yaml")
    path = calibrate(
        cfg, out=out, device=torch.device(device), threads=args.threads, repeats=args.repeats, base=args.base
    )
    print(f"wrote {path}; use it with run.executor=sim sim.topology=[{path}]")
    return 0


def _run(args) -> int:
    if args.force and not args.resume:
        print("error: --force only applies to --resume", file=sys.stderr)
        return 2
    if args.verbose and not args.dry_run:
        print("error: --verbose only applies to --dry-run (it lists every planned trial)", file=sys.stderr)
        return 2
    loaded = _load_config(args)
    if loaded is None:
        return 2
    cfg, yaml_text = loaded
    return sweep_exit_code(
        cfg,
        yaml_text,
        resume=args.resume,
        dry_run=args.dry_run,
        progress=not args.no_progress,
        force=args.force,
        list_all=args.verbose,
    )


def sweep_exit_code(
    cfg,
    yaml_text: str,
    *,
    resume: Optional[str],
    dry_run: bool,
    progress: bool,
    force: bool = False,
    out=None,
    err=None,
    list_all: bool = False,
) -> int:
    """Run a loaded sweep as a command does (`suite run`, the Hydra app): SIGTERM/SIGHUP stop it like
    Ctrl-C, and each way it can end is one line and an exit code. `out`/`err`: where the sweep's
    lines and the error line go (default: stdout, stderr)."""
    from suite.config import ConfigError
    from suite.results import StoreError
    from suite.runner import run_sweep

    err = err or sys.stderr
    try:
        with _signals_interrupt():
            run_sweep(
                cfg,
                yaml_text,
                resume=resume,
                dry_run=dry_run,
                progress=progress,
                force=force,
                out=out,
                list_all=list_all,
            )
    except ConfigError as exc:
        print(f"config error: {exc}", file=err)
        return 2
    except (FileNotFoundError, StoreError) as exc:
        print(f"error: {exc}", file=err)
        return 2
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        print(
            f"\ninterrupted ({signal.Signals(signum).name}): every finished trial is saved; continue with --resume",
            file=err,
        )
        return 128 + signum
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the sweep is so that it stops as on Ctrl-C: the trial in
    flight is abandoned, the store compacted and the MLflow parent run ended KILLED."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _signals_interrupt:
    """SIGTERM (a scheduler's or `kill`'s stop) and SIGHUP (the terminal closed) raise Terminated
    in the main thread; the previous handlers come back on exit."""

    SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s)

    def __enter__(self):
        def handler(signum, frame):
            raise Terminated(signum)

        # a signal ignored on entry (SIGHUP under nohup) stays ignored
        self._old = {s: signal.signal(s, handler) for s in self.SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
        return self

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)
        return False


def _hf_perplexity(args) -> int:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("error: hf-perplexity needs transformers (pip install -e '.[hf]')", file=sys.stderr)
        return 2
    from tabulate import tabulate

    from suite.perplexity.hf import hf_perplexity, load_model_and_batches

    try:
        model, batches = load_model_and_batches(
            args.model,
            text_path=args.text,
            batch=args.batch,
            seq_len=args.seq_len,
            batches=args.batches,
            dtype=args.dtype,
            device=args.device,
        )
        results = hf_perplexity(model, batches, args.methods.split(","), [int(p) for p in args.world_size.split(",")])
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = [
        [
            r.method,
            r.world_size,
            f"{r.perplexity:.6f}",
            f"{r.eager_perplexity:.6f}",
            f"{r.rel_diff:+.2e}",
            f"{r.max_logit_diff:.2e}",
        ]
        for r in results
    ]
    print(
        tabulate(
            rows,
            headers=["method", "P (threads)", "perplexity", "eager perplexity", "rel. diff", "max |logit diff|"],
            disable_numparse=True,
        )
    )
    return 0


def _report(args) -> int:
    from suite.reports import ReportError, build_report

    counting = [False]  # on a terminal the figure count updates one line in place

    def progress(line: str) -> None:  # on stderr, so that stdout stays the summary below
        live = sys.stderr.isatty() and line.startswith("figures ")
        if counting[0] and not live:
            print(file=sys.stderr)
        print(("\r" if live else "") + f"report: {line}", end="" if live else "\n", file=sys.stderr, flush=True)
        counting[0] = live

    try:
        rep = build_report(
            args.results,
            out=args.out,
            baseline=args.baseline,
            results_root=args.results_root,
            mlflow_experiment=args.mlflow_experiment,
            mlflow_uri=args.mlflow_uri,
            log_to_mlflow=not args.no_mlflow,
            progress=progress,
        )
    except (FileNotFoundError, ReportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report of {rep.rows} trial rows in {rep.seconds:.1f}s -> {rep.out_dir}")
    print(f"  {rep.html}")
    print(f"  {len(rep.tables)} tables (md, tex, csv) in {rep.out_dir / 'tables'}")
    print(f"  {len(rep.figures)} figure files (png, pdf) in {rep.out_dir / 'figures'}")
    for note in rep.read_notes:
        print(f"  read: {note}")
    for note in rep.notes:
        print(f"  not drawn: {note}")
    if rep.logged_to:
        print(f"  attached to MLflow run(s) {', '.join(rep.logged_to)}")
    return 0


def _list() -> int:
    import torch
    from tabulate import tabulate

    import methods
    from methods import kernels

    rows = []
    for name in methods.available():
        cls = methods.method_class(name)
        ok, why = cls.available_here()
        rows.append([name, cls.impl, cls.layout_kind, "yes" if ok else "no", why or cls.description])
    for name, reason in sorted(methods.unavailable().items()):
        rows.append([name, "-", "-", "no", reason])
    print("Methods")
    print(tabulate(rows, headers=["method", "impl", "layout", "runs here", "notes / why not"], tablefmt="simple"))
    krows = []
    for name in kernels.KERNELS:
        ok, why = kernels.kernel_status(name)
        krows.append([name, "yes" if ok else "no", why])
    print("\nLocal attention kernels (run.kernel; auto picks flash_attn on CUDA fp16/bf16, cpu_flash on CPU)")
    print(tabulate(krows, headers=["kernel", "available", "notes / why not"], tablefmt="simple"))
    from suite.sim.topology import available_topologies

    cuda = torch.cuda.is_available()
    erows = [
        [
            "dist",
            "yes",
            f"worker processes over torch.distributed ({'nccl' if cuda else 'gloo'}); "
            "the only executor whose timings are performance",
        ],
        ["threads", "yes", "virtual ranks in one process (numerics; timings are not hardware communication)"],
        [
            "sim",
            "yes",
            "predicted on a topology model, nothing runs; topologies: "
            + ", ".join(available_topologies())
            + " (or a file from `suite calibrate`)",
        ],
        [
            "cuda device",
            "yes" if cuda else "no",
            f"{torch.cuda.device_count()} GPU(s)"
            if cuda
            else "no CUDA device: GPU kernels, NCCL and CUDA timing are unavailable here",
        ],
    ]
    print("\nExecutors and devices")
    print(tabulate(erows, headers=["", "available", "notes"], tablefmt="simple"))
    return 0


def _ui_command(uri: str, args) -> list[str]:
    """The MLflow server's command line."""
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "ui",
        "--backend-store-uri",
        uri,
        "--host",
        args.host,
        "--port",
        str(args.port),
    ]
    if args.workers:
        cmd += ["--workers", str(args.workers)]
    if args.allowed_hosts:
        cmd += ["--allowed-hosts", args.allowed_hosts]
    return cmd


_UI_POLL_S = 0.25  # how often `suite ui` asks the starting server whether it answers
_UI_NOTE_S = 20.0  # how often it says it is still waiting


def _ui(args) -> int:
    """Serve the MLflow UI until Ctrl-C, SIGTERM or SIGHUP. The server (MLflow's CLI, which starts
    uvicorn or gunicorn and their workers) runs in its own process group, and every way of stopping
    this command stops that whole group, so no server or worker outlives it. The link is printed once
    the server answers (MLflow takes a minute or more to start on a busy machine); the server's own
    console (access lines, warnings, its workers' restarts) goes to a temporary file unless
    --verbose, and its last lines are shown if it stops by itself."""
    import tempfile

    from suite.env import redact_uri
    from suite.tracking import default_uri

    uri = args.uri or default_uri(args.results_root)
    wildcard = args.host in ("0.0.0.0", "::")
    shown = "<this host's name>" if wildcard else args.host
    base = f"http://{shown}:{args.port}"
    probe_host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(args.host, args.host)
    if ":" in probe_host and not probe_host.startswith("["):
        probe_host = f"[{probe_host}]"
    print(f"starting the MLflow UI on {base} (store {redact_uri(uri)}); waiting until it answers", flush=True)
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY=os.environ.get("MLFLOW_DISABLE_TELEMETRY", "true"))
    log = None if args.verbose else tempfile.TemporaryFile()
    server = subprocess.Popen(
        _ui_command(uri, args),
        start_new_session=True,
        env=env,
        stdout=log,
        stderr=None if log is None else subprocess.STDOUT,
    )
    code = 0
    try:
        with _signals_interrupt():
            if _wait_ready(f"http://{probe_host}:{args.port}/health", server):
                print(f"MLflow UI ready on {base}; Ctrl-C to stop", flush=True)
                for line in _experiment_links(uri, base):  # after the server has opened (migrated) the store
                    print(f"  {line}", flush=True)
            else:
                tail = ""
                if log is not None:
                    log.seek(0)
                    lines = log.read().decode(errors="replace").splitlines()[-15:]
                    tail = "; its last lines:\n" + "\n".join(f"  {line}" for line in lines)
                print(
                    f"error: the MLflow server stopped (exit code {server.returncode}) before it answered{tail}",
                    file=sys.stderr,
                )
                return server.returncode or 1
            code = server.wait()
    except KeyboardInterrupt as exc:
        code = 128 + getattr(exc, "signum", signal.SIGINT)
    finally:
        _stop_group(server)
        if log is not None:
            log.close()
    return code if code != 128 + signal.SIGINT else 0


def _wait_ready(url: str, server: subprocess.Popen) -> bool:
    """True once `url` answers 200, False if the server process ended first; says every
    _UI_NOTE_S seconds that it is still waiting."""
    import urllib.error
    import urllib.request

    t0 = noted = time.monotonic()
    while server.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return True
        except urllib.error.HTTPError:  # it answers, if not this path (a host name it refuses)
            return True
        except OSError:  # not listening yet (refused, reset, timed out)
            pass
        if time.monotonic() - noted >= _UI_NOTE_S:
            noted = time.monotonic()
            print(f"  still starting ({noted - t0:.0f}s)", flush=True)
        time.sleep(_UI_POLL_S)
    return False


def _stop_group(server: subprocess.Popen) -> None:
    """SIGTERM to the server's whole process group, SIGKILL to what is left after 10 s."""
    try:
        pgid = os.getpgid(server.pid)
    except ProcessLookupError:
        return
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            server.poll()
            try:
                os.killpg(pgid, 0)  # anyone of the group still alive?
            except ProcessLookupError:
                return
            time.sleep(0.1)


def _experiment_links(uri: str, base: str) -> list[str]:
    """One line per experiment of the store: its name and the link to its runs view. Best effort
    (the server shows them all anyway)."""
    try:
        from suite.tracking import open_client_readonly, runs_link

        client = open_client_readonly(uri)
        return [
            f"{e.name}: {runs_link(uri, e.experiment_id, base)}"
            for e in client.search_experiments()
            if e.name != "Default"
        ]
    except Exception:  # noqa: BLE001
        return []


def _advise(args) -> int:
    from suite.advise import run_command

    return run_command(args)


def _validate(args) -> int:
    from suite.sim_validation import run_command

    return run_command(args)


def _conformance(args) -> int:
    from suite.conformance import run_command

    return run_command(args)


def _flips(args) -> int:
    from suite.flips import run_command

    return run_command(args)


def _repeats(args) -> int:
    from suite.repeats import run_command

    return run_command(args)


def _relog(args) -> int:
    from suite.env import redact_uri
    from suite.tracking import relog, run_link

    def progress(line: str) -> None:  # on stderr, so that stdout stays the summary below
        print(f"relog: {line}", file=sys.stderr, flush=True)

    from suite.results import StoreError

    try:  # the folder is checked before any progress line: a bad one is one error line
        tracker = relog(args.run_dir, args.uri, args.experiment, progress=progress)
    except (FileNotFoundError, StoreError, ValueError) as exc:  # not a results folder; a stored URI it cannot use
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if tracker.rebuilt:
        print(tracker.rebuilt, file=sys.stderr if not tracker.enabled else sys.stdout)
    if not tracker.enabled:
        print(f"relog failed: {tracker.disabled_reason}", file=sys.stderr)
        return 1
    c = tracker.counts
    print(
        f"logged {args.run_dir} to {redact_uri(tracker.uri)} (parent run {tracker.parent_run_id}): "
        f"{c['logged']} child runs added, {c['completed']} completed, {c['deleted']} duplicates deleted, "
        f"{c['killed']} stale runs ended KILLED, {c['retagged']} given their display tags"
    )
    print(f"runs: {tracker.link} (serve it with `{suite_command()} ui`)")
    assert tracker.experiment_id is not None and tracker.parent_run_id is not None  # relog opened them
    print(f"the sweep's run: {run_link(tracker.uri, tracker.experiment_id, tracker.parent_run_id)}")
    return 0


# What runs each subcommand (its parser comes from SUBCOMMANDS above): the commands of other modules
# are imported when they run, so that `--help` and `list` load none of them.
HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": _run,
    "advise": _advise,
    "validate": _validate,
    "conformance": _conformance,
    "list": lambda args: _list(),
    "ui": _ui,
    "report": _report,
    "calibrate": _calibrate,
    "hf-perplexity": _hf_perplexity,
    "flips": _flips,
    "repeats": _repeats,
    "relog": _relog,
}
