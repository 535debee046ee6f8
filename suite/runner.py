"""Run a configured sweep end to end (DESIGN.md section 3).

config -> plan (trials with stable keys) -> for each trial: supported? -> executor -> record ->
results store (flushed) + MLflow child run -> summary. Only this process (or rank 0 under an
external launcher) writes anything persistent.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, TextIO

import torch

import methods
from suite import metrics as M
from suite.config import SuiteConfig, to_dict
from suite.env import fingerprint, hardware_label
from suite.plan import TrialSpec, expand
from suite.results import ResultsStore
from suite.summary import summary_table
from suite.tracking import make_tracker
from suite.trial import Outcome, RunSettings, make_record, skipped_record


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_backend(backend: str, device: str) -> str:
    if backend == "auto":
        return "nccl" if device == "cuda" else "gloo"
    return backend


def check_supported(spec: TrialSpec, executor=None) -> tuple[bool, str]:
    """Decided in the parent, before any rank is involved; a False becomes a recorded skip. An
    executor with a `supports(spec)` method (the simulator's) adds its own limits."""
    if spec.method not in methods.available():
        return False, methods.unavailable().get(spec.method, f"method {spec.method!r} is not registered here")
    try:
        method = spec.build_method()
    except (TypeError, ValueError) as exc:
        return False, str(exc)
    ok, reason = method.supports(spec.case())
    if not ok:
        return False, reason
    if method.needs_processes and spec.executor == "threads":
        return False, f"{spec.method} calls torch.distributed itself; it needs run.executor=dist"
    if method.needs_processes and spec.executor == "sim":
        return False, (f"{spec.method} calls torch.distributed itself, so its schedule cannot be traced; "
                       f"simulate the suite's own implementation of the algorithm instead")
    if spec.pass_ != "fwd":
        why = method.forward_only_reason(spec.case())
        if why:
            return False, why
    if spec.device == "cuda" and spec.executor == "dist" and spec.nodes == 1 \
            and spec.world_size > torch.cuda.device_count():
        return False, (f"needs {spec.world_size} GPUs on this node, found {torch.cuda.device_count()} "
                       f"(run.executor=threads emulates ranks on one GPU, for numerics only)")
    if spec.device == "cuda" and spec.dtype == "float64" and spec.kernel == "flash_attn":
        return False, "flash_attn has no float64 kernels"
    if spec.pass_ == "train" and spec.executor == "threads" and spec.device == "cuda":
        return False, ("training needs autograd across ranks, which virtual ranks on one GPU cannot use "
                       "(autograd runs a device's backward on one thread); use run.executor=dist")
    if hasattr(executor, "supports"):  # what only the executor knows (e.g. a topology's node count)
        return executor.supports(spec)
    return True, ""


def run_settings(cfg: SuiteConfig) -> RunSettings:
    r = cfg.run
    return RunSettings(warmup=r.warmup, repeats=r.repeats, check=r.check, check_max_seq_len=r.check_max_seq_len,
                       seed=r.seed, breakdown=r.breakdown)


def sweep_params(cfg: SuiteConfig) -> dict:
    """The sweep's own MLflow params (the axes and run settings, flattened)."""
    d = to_dict(cfg)
    flat = {"name": cfg.name}
    for section in ("sweep", "run"):
        for k, v in d[section].items():
            flat[f"{section}.{k}"] = v
    return flat


def external_launch() -> Optional[dict]:
    """Rank facts when this process was started by torchrun (or srun with MASTER_ADDR set)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        return {"rank": int(env["RANK"]), "world_size": int(env["WORLD_SIZE"]),
                "local_rank": int(env.get("LOCAL_RANK", 0)),
                "local_world_size": int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))}
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1 and "MASTER_ADDR" in env:
        return {"rank": int(env["SLURM_PROCID"]), "world_size": int(env["SLURM_NTASKS"]),
                "local_rank": int(env.get("SLURM_LOCALID", 0)),
                "local_world_size": int(env.get("SLURM_NTASKS_PER_NODE", env["SLURM_NTASKS"]).split("(")[0])}
    return None


@dataclass
class SweepResult:
    run_dir: Path
    records: list[dict]
    wall_s: float
    mlflow_uri: Optional[str]
    mlflow_disabled: Optional[str]


def run_sweep(cfg: SuiteConfig, config_yaml: str, *, resume: Optional[str] = None, dry_run: bool = False,
              out: Optional[TextIO] = None, progress: bool = True) -> Optional[SweepResult]:
    """Run (or, with `dry_run`, only plan) a sweep. `resume`: a run folder, or "latest"."""
    out = out or sys.stdout  # looked up now, not at import (pytest swaps sys.stdout)
    methods.load_plugins(cfg.run.plugins)
    launch = external_launch() if cfg.run.executor == "dist" else None
    if launch is not None:
        from suite.external import run_external
        return run_external(cfg, config_yaml, launch, resume=resume, dry_run=dry_run, out=out, progress=progress)

    # the simulator traces on meta tensors: the device here is irrelevant to what it predicts
    device = "cpu" if cfg.run.executor == "sim" else resolve_device(cfg.run.device)
    hardware = hardware_label(device) if cfg.run.hardware == "auto" else cfg.run.hardware
    plan = expand(cfg, hardware=hardware, device=device)
    if dry_run:
        print_plan(plan, out)
        return None
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run.device=cuda but no CUDA device is available here (try --dry-run to see the plan)")

    from suite.launch import LocalDistExecutor, ThreadExecutor
    settings = run_settings(cfg)
    if cfg.run.executor == "sim":
        from suite.sim.executor import SimExecutor
        executor = SimExecutor(cfg.sim.topology)
    elif cfg.run.executor == "threads":
        executor = ThreadExecutor(device=device, run=settings, timeout_s=cfg.run.timeout_s + cfg.run.prepare_timeout_s)
    else:
        executor = LocalDistExecutor(device=device, backend=resolve_backend(cfg.run.backend, device), run=settings,
                                     threads_per_rank=cfg.run.threads_per_rank, plugins=tuple(cfg.run.plugins),
                                     timeout_s=cfg.run.timeout_s, startup_timeout_s=cfg.run.startup_timeout_s,
                                     grace_s=cfg.run.fail_grace_s, prepare_timeout_s=cfg.run.prepare_timeout_s)
    return _drive(cfg, config_yaml, plan, executor, device, resume=resume, out=out, progress=progress)


def open_store(cfg: SuiteConfig, config_yaml: str, device: str, resume: Optional[str]) -> tuple[ResultsStore, bool]:
    if resume:
        store = (ResultsStore.latest(cfg.results.root, cfg.name) if resume == "latest"
                 else ResultsStore.open(resume))
        if store is None:
            raise FileNotFoundError(f"--resume: no earlier run of {cfg.name!r} under {cfg.results.root}/")
        return ResultsStore.open(store.run_dir), True
    return ResultsStore.create(cfg.results.root, cfg.name, config_yaml, fingerprint(device)), False


def _drive(cfg: SuiteConfig, config_yaml: str, plan: list[TrialSpec], executor, device: str, *,
           resume: Optional[str], out: TextIO, progress: bool) -> SweepResult:
    from tqdm import tqdm

    t_start = time.perf_counter()
    store, resumed = open_store(cfg, config_yaml, device, resume)
    done = store.completed_keys()
    todo = [s for s in plan if s.key not in done]
    tracker = make_tracker(cfg.tracking.mlflow, cfg.tracking.uri, cfg.tracking.experiment or cfg.name,
                           cfg.results.root)
    tracker.start(store, sweep=cfg.name, params=sweep_params(cfg), environment=store.read_json("environment.json"),
                  description=cfg.description, resume=resumed)
    settings = run_settings(cfg)
    run_id = store.run_dir.name
    baselines = None
    if cfg.kind == "perplexity":
        from suite.perplexity.trial import Baselines, make_train_record
        baselines = Baselines(store, tracker, settings, run_id)
    print(f"sweep {cfg.name}: {len(plan)} trials ({len(plan) - len(todo)} already recorded), "
          f"executor={cfg.run.executor}, device={device} -> {store.run_dir}", file=out, flush=True)
    bar = tqdm(total=len(plan), initial=len(plan) - len(todo), disable=not progress, file=sys.stderr,
               dynamic_ncols=True, unit="trial")
    status = "FINISHED"
    try:
        for spec in todo:
            bar.set_description(spec.label(), refresh=False)
            started = datetime.now(timezone.utc).isoformat(timespec="seconds")
            ok, reason = check_supported(spec, executor)
            if not ok:
                record = skipped_record(spec, reason, settings, run_id, started)
            else:
                baseline = baselines.get(spec) if baselines is not None else None  # trained once per workload
                t0, startup0 = time.perf_counter(), getattr(executor, "startup_s", 0.0)
                outcome: Outcome = executor.run(spec)
                # the trial's own time: without starting the worker group it may have needed
                wall = time.perf_counter() - t0 - (getattr(executor, "startup_s", 0.0) - startup0)
                if baseline is not None:
                    record = make_train_record(spec, outcome, baseline, cfg.perplexity, settings, run_id, started,
                                               wall)
                else:
                    record = make_record(spec, outcome, settings, run_id, started, wall)
            store.append(record)
            tracker.log_trial(record, spec.label())
            bar.update(1)
            if record[M.STATUS] in (M.FAILED, M.TIMEOUT, M.INCORRECT):
                bar.write(f"  {record[M.STATUS]}: {spec.label()}: {str(record[M.REASON])[:300]}")
    except BaseException:
        status = "KILLED"
        executor.abort()  # do not wait for a trial in flight
        raise
    finally:
        bar.close()
        executor.close()
        _compact(store)
        tracker.finish(store, status)
    wall = time.perf_counter() - t_start
    records = store.records()
    print(summary_table(records), file=out)
    this_run = [r for r in records if r[M.KEY] in {s.key for s in todo}]
    if baselines is not None:
        this_run += baselines.created
    _print_footer(records, this_run, wall, store, tracker, out, getattr(executor, "startup_s", 0.0),
                  getattr(executor, "groups_started", 0))
    return SweepResult(store.run_dir, records, wall, getattr(tracker, "uri", None), tracker.disabled_reason)


def _compact(store: ResultsStore) -> None:
    """Write the Parquet copy; never let it stop the run's MLflow finish (the JSON lines are the
    results)."""
    try:
        store.compact()
    except Exception as exc:  # noqa: BLE001
        import warnings
        warnings.warn(f"could not write {store.run_dir}/trials.parquet: {exc} (trials.jsonl is complete)",
                      RuntimeWarning, stacklevel=2)


def _print_footer(records: list[dict], this_run: list[dict], wall: float, store: ResultsStore, tracker,
                  out: TextIO, startup_s: float = 0.0, groups: int = 0) -> None:
    counts: dict[str, int] = {}
    for r in records:
        counts[r[M.STATUS]] = counts.get(r[M.STATUS], 0) + 1
    trial_s = sum(r.get(M.DURATION_S) or 0.0 for r in this_run)
    print(f"\n{len(records)} trials: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())), file=out)
    print(f"wall time {wall:.1f}s = trials {trial_s:.1f}s + worker start-up {startup_s:.1f}s ({groups} groups) "
          f"+ other {wall - trial_s - startup_s:.1f}s (MLflow logging took {tracker.seconds:.1f}s in the "
          f"background); results in {store.run_dir}", file=out)
    if tracker.enabled:
        print(f"MLflow: {tracker.uri} (experiment {tracker.experiment!r}); browse with `python -m suite ui`",
              file=out)
    elif getattr(tracker, "uri", None):
        print(f"MLflow was disabled: {tracker.disabled_reason}", file=out)


def print_plan(plan: list[TrialSpec], out: TextIO) -> None:
    """The planned trials, one line each, with whether each can run here."""
    print(f"{len(plan)} planned trials:", file=out)
    for spec in plan:
        ok, reason = check_supported(spec)
        print(f"  {spec.key}  {spec.label():<80} {'run' if ok else 'skip: ' + reason}", file=out)
