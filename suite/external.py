"""executor=dist under an existing launcher (torchrun, or srun with MASTER_ADDR/MASTER_PORT set).

Every launched process runs `python -m suite run CONFIG`; together they are one worker group of
the launched size (possibly several nodes). Rank 0 is the parent: it plans (and broadcasts the
plan so every rank runs the same trials in the same order), gathers every rank's report, and is
the only writer of results and MLflow. Trials of another world size are recorded as skipped with
the command to cover them.

Limits compared with the local launcher: there is no fresh group after a failure, so later trials
run on the same communicators (the row's reason says so), and hangs depend on the backend. On
gloo a stuck collective raises after the process-group timeout (run.timeout_s) and the trial is
recorded as failed. On NCCL, PyTorch's watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING, default 3) ends
the processes on a collective timeout, so a hang ends the job; every finished trial is already
in the store and `--resume` (a new launch) continues after it. Trials that raise are recorded
under both backends.
"""
from __future__ import annotations

import os
import sys
import time
from datetime import datetime, timedelta, timezone
from typing import Optional, TextIO

import torch
import torch.distributed as dist

from methods.comm import DistComm
from suite import metrics as M
from suite.check import ProblemCache
from suite.config import SuiteConfig
from suite.env import hardware_label
from suite.plan import expand
from suite.trial import Outcome, make_record, run_trial, skipped_record


def run_external(cfg: SuiteConfig, config_yaml: str, launch: dict, *, resume: Optional[str], dry_run: bool,
                 out: TextIO, progress: bool):
    from suite.runner import (SweepResult, _compact, _print_footer, resolve_backend, resolve_device, run_settings,
                              sweep_params)
    from suite.summary import summary_table
    from suite.tracking import make_tracker

    rank, world = launch["rank"], launch["world_size"]
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    device = resolve_device(cfg.run.device)
    if device == "cuda":
        torch.cuda.set_device(launch["local_rank"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // launch["local_world_size"]))
    dist.init_process_group(resolve_backend(cfg.run.backend, device), init_method="env://",
                            timeout=timedelta(seconds=cfg.run.timeout_s))
    control = dist.new_group(backend="gloo")  # object collectives, whatever the data backend
    comm = DistComm()
    nodes = max(1, world // launch["local_world_size"])
    topology = "single-node" if nodes == 1 else f"{nodes}-node"
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")

    # Rank 0 plans; everyone runs the same list.
    box: list = [None]
    if rank == 0:
        try:
            mode, actions, store, resumed = _plan_on_rank0(cfg, config_yaml, device, topology, nodes, world, resume,
                                                           dry_run, out)
            box[0] = (mode, actions)
        except Exception as exc:  # noqa: BLE001 - tell the other ranks instead of leaving them waiting
            box[0] = ("error", f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(box, src=0, group=control)
    mode, actions = box[0]
    if mode in ("error", "dry"):
        dist.destroy_process_group()
        if mode == "error":
            raise RuntimeError(f"rank 0 could not plan the sweep: {actions}")
        return None

    settings = run_settings(cfg)
    cache = ProblemCache()
    tracker = bar = None
    t_start = time.perf_counter()
    if rank == 0:
        from tqdm import tqdm
        tracker = make_tracker(cfg.tracking.mlflow, cfg.tracking.uri, cfg.tracking.experiment or cfg.name,
                               cfg.results.root)
        tracker.start(store, sweep=cfg.name, params=sweep_params(cfg), environment=store.read_json("environment.json"),
                      description=cfg.description, resume=resumed)
        bar = tqdm(total=len(actions), disable=not progress, file=sys.stderr, unit="trial")
        baselines = None
        if cfg.kind == "perplexity":  # trained on rank 0 before the first trial that needs it
            from suite.perplexity.trial import Baselines
            baselines = Baselines(store, tracker, settings, store.run_dir.name)
            for spec, skip_reason in actions:
                if skip_reason is None:
                    baselines.get(spec)
        print(f"sweep {cfg.name}: {len(actions)} trials on {world} ranks ({topology}) -> {store.run_dir}",
              file=out, flush=True)
    if cfg.kind == "perplexity":  # the other ranks wait here while rank 0 trains the baselines
        dist.barrier(group=control)
    any_failed = False
    status = "FINISHED"
    try:
        for spec, skip_reason in actions:
            started = datetime.now(timezone.utc).isoformat(timespec="seconds")
            if skip_reason is not None:
                if rank == 0:
                    record = skipped_record(spec, skip_reason, settings, store.run_dir.name, started)
            else:
                t0 = time.perf_counter()
                report = run_trial(spec, settings, comm, dev, cache)
                gathered = [None] * world if rank == 0 else None
                dist.gather_object(report, gathered, dst=0, group=control)
                if rank == 0:
                    outcome = Outcome("reported", gathered)
                    if spec.pass_ == "train":
                        from suite.perplexity.trial import make_train_record
                        record = make_train_record(spec, outcome, baselines.get(spec), cfg.perplexity, settings,
                                                   store.run_dir.name, started, time.perf_counter() - t0)
                    else:
                        record = make_record(spec, outcome, settings, store.run_dir.name, started,
                                             time.perf_counter() - t0)
                    if any_failed and record[M.STATUS] != M.FAILED:
                        record[M.REASON] = ((record[M.REASON] or "") + " [ran on communicators reused after an "
                                            "earlier failed trial]").strip()
                    any_failed = any_failed or record[M.STATUS] in (M.FAILED, M.TIMEOUT)
            if rank == 0:
                store.append(record)
                tracker.log_trial(record, spec.label())
                bar.update(1)
    except BaseException:
        status = "KILLED"
        raise
    finally:
        if rank == 0:
            bar.close()
            _compact(store)
            tracker.finish(store, status)
    dist.barrier(group=control)
    dist.destroy_process_group()
    if rank != 0:
        return None
    wall = time.perf_counter() - t_start
    records = store.records()
    print(summary_table(records), file=out)
    _print_footer(records, [r for r in records if r[M.KEY] in {s.key for s, _ in actions}], wall, store,
                  tracker, out)
    return SweepResult(store.run_dir, records, wall, getattr(tracker, "uri", None), tracker.disabled_reason)


def _plan_on_rank0(cfg, config_yaml, device, topology, nodes, world, resume, dry_run, out):
    """Rank 0's plan: (mode "dry" or "run", [(spec, skip reason or None)], store, resumed)."""
    from suite.runner import check_supported, open_store, print_plan

    hardware = hardware_label(device) if cfg.run.hardware == "auto" else cfg.run.hardware
    plan = expand(cfg, hardware=hardware, device=device, topology=topology, nodes=nodes)
    if dry_run:
        print_plan(plan, out)
        return "dry", [], None, False
    store, resumed = open_store(cfg, config_yaml, device, resume)
    done = store.completed_keys()
    actions = []
    for spec in plan:
        if spec.key in done:
            continue
        if spec.world_size != world:
            actions.append((spec, f"world_size {spec.world_size} needs its own launch: this group has "
                                  f"{world} ranks (torchrun --nproc-per-node ... with {spec.world_size} "
                                  f"ranks in all)"))
        else:
            ok, reason = check_supported(spec)
            actions.append((spec, None if ok else reason))
    return "run", actions, store, resumed
