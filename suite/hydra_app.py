"""`python -m suite.hydra_app`: the suite as a Hydra application (docs/DESIGN.md section 3).

Every sweep file of configs/ is an option of the config group `config` (`config=quickstart`,
`config=paper/usp_grid`), placed at the top level, so overrides read as on `suite run`
(`sweep.seq_len=512`, `+sweep.method_options.usp.ulysses_degree=2`, `~run.warmup`). What Hydra
adds over `suite run`: `--cfg job` (print the composed config), `-m` multirun (one sweep per
combination: `-m config=quickstart,perplexity` or `-m sweep.seq_len=256,512`), its launchers
(`hydra/launcher=submitit_slurm` submits each sweep as a SLURM job through
hydra-submitit-launcher, `pip install -e '.[slurm]'`) and its output folders (outputs/ or
multirun/, with the composed config and the job's log). Results go to the results store exactly
as with `suite run` (each job of a multirun its own run folder), and the run ends the same way
(signals, one-line errors, exit codes); `cli.dry_run=true`, `cli.resume=latest`, `cli.force=true`
and `cli.progress=false` stand for its options.

Each job also writes what it printed (the sweep's summary, or its one-line error) to
`summary.txt` in its Hydra output folder, and a multirun ends by printing each job's summary
(a job under submitit prints only into a hidden `.submitit/` log). submitit_local starts every job
at once on this machine: a warning says so when more than one would share its cores.

The composed config is validated by the same schema as `suite run` (suite/config.py), so errors
name the key. Hydra runs in this parent process only; the workers get the validated dataclasses.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from suite.bundled import CONFIGS, sweep_files
from suite.config import ConfigError, SuiteConfig, config_from_node

GROUP = "config"
SUMMARY = "summary.txt"  # in each job's Hydra output folder: what the job printed
LOCAL_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


def register(root: Path = CONFIGS) -> None:
    """Put every sweep file in Hydra's ConfigStore as an option of the group `config` (package
    _global_: its keys at the top level), and the primary config `suite` that picks one."""
    cs = ConfigStore.instance()
    for name, path in sweep_files(root).items():
        group, _, option = f"{GROUP}/{name}".rpartition("/")
        cs.store(group=group, name=option, node=OmegaConf.load(path), package="_global_")
    # The primary config holds every key of the schema at its default (plain values, not typed, so
    # that one value for a list axis is accepted and checked later by the schema), then the chosen
    # sweep file on top: any setting can be overridden, also one the file does not mention.
    defaults = OmegaConf.to_container(OmegaConf.structured(SuiteConfig))
    assert isinstance(defaults, dict)  # a structured config is a mapping
    defaults.pop("name")  # required: it comes from the sweep file
    cs.store(
        name="suite",
        node={
            "defaults": ["_self_", {GROUP: "quickstart"}],
            **defaults,
            "cli": {"dry_run": False, "resume": None, "progress": True, "force": False},
            "hydra": {"callbacks": {"suite_jobs": {"_target_": f"{__name__}.JobSummaries"}}},
        },
    )


def multirun_jobs(task_overrides: list[str]) -> int:
    """How many jobs the basic sweeper makes of these overrides (the product of each sweep's
    values); 0 where that cannot be told (a sweep with no fixed list of values)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        n = 1
        for override in OverridesParser.create().parse_overrides(list(task_overrides)):
            if override.is_sweep_override():
                n *= len(list(override.sweep_string_iterator()))
        return n
    except Exception:  # noqa: BLE001 - an interval sweep (for an optimizing sweeper) has no count
        return 0


class JobSummaries(Callback):
    """Hydra callback (registered by the primary config): warns when submitit_local would run
    several sweeps at once on this machine's cores, and ends a multirun by printing each job's
    summary.txt, which under a submitit launcher never reached the console."""

    def __init__(self) -> None:
        self.started = 0.0

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.time()
        launcher = str(OmegaConf.select(config, "hydra.launcher._target_", default=""))
        jobs = multirun_jobs(list(OmegaConf.select(config, "hydra.overrides.task", default=[]) or []))
        if launcher == LOCAL_LAUNCHER and jobs != 1:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
            print(
                f"warning: hydra/launcher=submitit_local starts {jobs or 'all the'} jobs of this multirun at "
                f"once on this machine's {cores} cores: their trials share the cores (and any GPU), so their "
                f"timings are not comparable; leave out hydra/launcher=submitit_local to run them one after another",
                file=sys.stderr,
                flush=True,
            )

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(OmegaConf.select(config, "hydra.sweep.dir")))
        launcher = str(OmegaConf.select(config, "hydra.launcher._target_", default=""))
        found = [p for p in sweep_dir.glob(f"*/{SUMMARY}") if p.stat().st_mtime >= self.started - 1]
        found.sort(key=lambda p: (int(p.parent.name) if p.parent.name.isdigit() else 1 << 30, p.parent.name))
        print_job_summaries(found, full=launcher != BASIC_LAUNCHER, out=sys.stdout)


def print_job_summaries(paths: list[Path], *, full: bool, out: TextIO) -> None:
    """Each job's summary: whole where the console never saw it (`full`), else only where it is."""
    if not paths:
        return
    print(f"\n{len(paths)} multirun job(s):", file=out)
    for path in paths:
        if full:
            print(f"\n== job {path.parent.name}: {path}", file=out)
            print(path.read_text(errors="replace").rstrip("\n"), file=out)
        else:  # the console showed the job's lines; its last line is its exit code
            lines = path.read_text(errors="replace").strip().splitlines() or ["?"]
            print(f"  job {path.parent.name}: {lines[-1]}; summary in {path}", file=out)
    out.flush()


class _Tee:
    """A text stream that writes to a stream and a file."""

    def __init__(self, stream: TextIO, file: TextIO):
        self.stream, self.file = stream, file

    def write(self, text: str) -> int:
        self.file.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.file.flush()
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()


register()
_entered = [False]  # whether Hydra composed a config and called `main` (see `run`)


@hydra.main(version_base="1.3", config_path=None, config_name="suite")
def main(cfg: DictConfig) -> None:
    from suite.cli import sweep_exit_code

    _entered[0] = True
    hc = HydraConfig.get()
    choice = hc.runtime.choices.get(GROUP, "?")
    cli = cfg.get("cli") or {}
    keep: list[Any] = [k for k in cfg if k not in ("cli", "hydra")]  # keys as they are (see config.load._keys)
    node = OmegaConf.masked_copy(cfg, keep)
    output_dir = Path(hc.runtime.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    # under torchrun every rank runs this; only rank 0 (the one that writes results) writes it
    leader = os.environ.get("RANK", "0") == "0"
    with open(output_dir / SUMMARY if leader else os.devnull, "w", encoding="utf-8") as summary:
        out, err = _Tee(sys.stdout, summary), _Tee(sys.stderr, summary)
        named = [o for o in hc.overrides.task if not o.startswith(f"{GROUP}=")]
        print(" ".join([f"{GROUP}={choice}", *named]), file=summary)  # which job this is
        try:
            suite_cfg, text = config_from_node(node, source=f"config={choice}")
        except ConfigError as exc:
            print(f"config error: {exc}", file=err)
            print("exit code 2", file=summary)
            raise SystemExit(2) from None
        code = sweep_exit_code(
            suite_cfg,
            text,
            resume=cli.get("resume"),
            dry_run=bool(cli.get("dry_run")),
            progress=bool(cli.get("progress", True)),
            force=bool(cli.get("force")),
            out=out,
            err=err,
        )
        print(f"exit code {code}", file=summary)
    if code:
        raise SystemExit(code)


def run() -> None:
    """`main` with one exit code for a config error: Hydra itself exits 1 when it cannot compose
    the config (a key not in the schema, an unknown `config=` option, an override it cannot
    parse), before `main` runs; `suite run` exits 2 for those, and so does this app."""
    try:
        main()
    except SystemExit as exc:
        if exc.code == 1 and not _entered[0]:
            raise SystemExit(2) from None
        raise


if __name__ == "__main__":
    run()
