"""Run a configured sweep end to end.

config -> executor (where trials run) and workload (what they are) -> plan (trials with stable
keys) -> for each trial: supported? -> executor -> the workload's row -> results store (flushed)
+ MLflow child run -> summary. Only this process (rank 0 under an external launcher) writes
anything persistent; under an external launcher the other ranks serve rank 0's trials.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional, TextIO

import methods
from suite import metrics as M
from suite.budget import Budget, runs_on_target, target_method
from suite.config import SuiteConfig, to_dict
from suite.env import busy_note, fingerprint, machine_load, redact_uri
from suite.executors import Executor, make_executor
from suite.plan import RunSettings, TrialSpec, expand, plan_size
from suite.records import RowContext, skipped_row
from suite.results import CONFIG, ENVIRONMENT, RESUMES, ResultsStore, StoreError
from suite.summary import summary_table
from suite.tracking import config_params, make_tracker
from suite.workloads import Workload, make_workload


def check_supported(
    spec: TrialSpec, executor: Executor, workload: Workload, budget: Optional[Budget] = None
) -> tuple[bool, str]:
    """Decided in the parent, before any rank is involved; a False becomes a recorded skip. The
    method, the workload and the executor each state their own limits; with a `budget`, a trial
    predicted over the device's memory is refused too (suite/budget.py, `run.memory_check`)."""
    if spec.method not in methods.available():
        return False, methods.unavailable().get(spec.method, f"method {spec.method!r} is not registered here")
    try:
        method = executor.build_method(spec)
    except (TypeError, ValueError) as exc:
        return False, str(exc)
    case = spec.run_case(method)  # padded to the method's granule, with any packed documents
    ok, reason = method.supports(case)
    if not ok:
        return False, reason
    if spec.pass_ != "fwd":
        why = method.forward_only_reason(case)
        if why:
            return False, why
    ok, reason = workload.supports(spec, method)
    if not ok:
        return False, reason
    ok, reason = executor.supports(spec, method, workload)
    if ok and budget is not None:
        return budget.fits(spec, method)
    return ok, reason


def sweep_params(cfg: SuiteConfig) -> dict:
    """The sweep's own MLflow params: every setting of its resolved config, flattened
    (`sweep.methods = ring,ulysses`, `perplexity.train.lr = 0.001`)."""
    return config_params(to_dict(cfg))


@dataclass
class SweepResult:
    run_dir: Path
    records: list[dict]
    wall_s: float
    mlflow_uri: Optional[str]
    mlflow_disabled: Optional[str]


def run_sweep(
    cfg: SuiteConfig,
    config_yaml: str,
    *,
    resume: Optional[str] = None,
    dry_run: bool = False,
    out: Optional[TextIO] = None,
    progress: bool = True,
    force: bool = False,
    list_all: bool = False,
) -> Optional[SweepResult]:
    """Run (or, with `dry_run`, only plan) a sweep. `resume`: a run folder, or "latest" (the newest
    folder whose config matches); `force`: resume a named folder even where a setting that changes
    results differs from its config (recorded in its resumes.jsonl).
    `list_all`: a dry run lists every planned trial, not only the first PLAN_LINES.

    Returns None for a dry run and on the ranks other than 0 of an external launch."""
    out = out or sys.stdout  # looked up now, not at import (pytest swaps sys.stdout)
    methods.load_plugins(cfg.run.plugins)
    executor = make_executor(cfg, dry_run=dry_run)
    if not executor.leader:  # an external launch's other ranks: serve rank 0's trials
        executor.serve()
        return None
    try:
        workload = make_workload(cfg.kind, cfg)
        size = plan_size(cfg, workload, executor.places())
        if size > cfg.run.max_trials:  # counted from the axis sizes: planning it could take hours
            from suite.config import ConfigError

            raise ConfigError(
                f"run.max_trials: the sweep's axes multiply to {size:,} trials (before sweep.exclude), "
                f"more than run.max_trials={cfg.run.max_trials:,}; narrow the sweep axes, or raise "
                f"run.max_trials to plan them all"
            )
        plan = expand(cfg, workload, executor.places(), executor.device)
        if not plan:  # a run folder with no trials in it is a mistake in the config, not a result
            from suite.config import ConfigError

            raise ConfigError(
                "sweep.exclude: the rules remove every trial of the sweep (nothing to run); "
                "narrow the rules or widen the sweep axes"
            )
        budget = Budget.of(cfg, executor.device)
        if dry_run:
            print_plan(plan, executor, workload, out, list_all=list_all, budget=budget)
            return None
        return _drive(
            cfg,
            config_yaml,
            plan,
            executor,
            workload,
            resume=resume,
            out=out,
            progress=progress,
            force=force,
            budget=budget,
        )
    finally:
        executor.close()


# Settings that never change what a row says (where it is stored, how it is logged, how long a
# trial may take, how many ranks may share a core): a resume may change them freely. Every other
# setting of the resolved config (the name, every sweep axis and option, run.*, the workload's own
# sections) must match the folder's config.yaml, or rows would disagree with it.
NOT_COMPARED = (
    "description",
    "results",
    "tracking",
    "run.timeout_s",
    "run.prepare_timeout_s",
    "run.startup_timeout_s",
    "run.fail_grace_s",
    "run.max_ranks_per_core",
    "run.max_trials",
)


def _setting(d: dict, key: str):
    node: Any = d
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _has(d: dict, key: str) -> bool:
    for part in key.split("."):
        if not isinstance(d, dict) or part not in d:
            return False
        d = d[part]
    return True


def _compared_keys(obj, prefix: str = "") -> list[str]:
    """Dotted keys of every setting of the schema (a dict or list setting is one value), less
    NOT_COMPARED."""
    keys = []
    for f in dataclasses.fields(obj):
        key = prefix + f.name
        if key in NOT_COMPARED:
            continue
        value = getattr(obj, f.name)
        keys.extend(_compared_keys(value, key + ".") if dataclasses.is_dataclass(value) else [key])
    return keys


def resume_changes(recorded_yaml: str, cfg: SuiteConfig) -> dict[str, tuple]:
    """{key: (the folder's value, this run's value)} of each setting that differs: the name, every
    sweep axis and every setting that changes rows (all but NOT_COMPARED). A key the folder's
    config.yaml lacks (written before the key existed) is not compared, but the name always is."""
    import yaml

    try:
        recorded = yaml.safe_load(recorded_yaml) or {}
    except yaml.YAMLError:
        recorded = {}
    if not isinstance(recorded, dict):
        recorded = {}
    now = to_dict(cfg)
    keys = [k for k in _compared_keys(cfg) if k == "name" or _has(recorded, k)]
    changes = {k: (_setting(recorded, k), _setting(now, k)) for k in keys}
    return {k: v for k, v in changes.items() if v[0] != v[1]}


def _describe(changes: dict[str, tuple], limit: int = 4) -> str:
    what = [f"{k}: {a!r} recorded, {b!r} now" for k, (a, b) in changes.items()]
    shown = "; ".join(w if len(w) <= 160 else w[:157] + "..." for w in what[:limit])
    return shown + (f"; and {len(what) - limit} more" if len(what) > limit else "")


def _folder_changes(run_dir: Path, cfg: SuiteConfig) -> dict[str, tuple]:
    config_path = run_dir / CONFIG
    try:
        text = config_path.read_text() if config_path.exists() else ""
    except (OSError, UnicodeDecodeError):
        text = ""
    return resume_changes(text, cfg)


def _pick_latest(cfg: SuiteConfig) -> ResultsStore:
    """`--resume` without a folder: the newest run folder of this sweep whose config matches this
    run's. Never a folder run with other settings (another multirun job of the same name, an
    earlier sweep with other axes): refused, naming the newest candidates and what differs."""
    runs = ResultsStore.runs(cfg.results.root, cfg.name)
    if not runs:
        raise FileNotFoundError(f"--resume: no earlier run of {cfg.name!r} under {cfg.results.root}/")
    differing = []
    for store in runs:
        changes = _folder_changes(store.run_dir, cfg)
        if not changes:
            return store
        differing.append((store.run_dir, changes))
    shown = " | ".join(f"{d} ({_describe(c, 2)})" for d, c in differing[:3])
    more = f" | and {len(differing) - 3} older" if len(differing) > 3 else ""
    raise StoreError(
        f"--resume: no run folder of {cfg.name!r} under {cfg.results.root}/ was run with this "
        f"config: {shown}{more}. Start a new run (no --resume), or name one folder and add "
        f"--force to mix settings (--resume RUN_DIR --force; the change is recorded in its {RESUMES})"
    )


def open_store(
    cfg: SuiteConfig, config_yaml: str, device: str, resume: Optional[str], force: bool = False
) -> tuple[ResultsStore, bool]:
    """The run folder, locked by this process: a new one, or with `resume` an earlier one whose
    resolved config matches this run's (or differs, with `force` and a named folder, recorded in
    resumes.jsonl); "latest" is the newest folder that matches."""
    if resume:
        store = _pick_latest(cfg) if resume == "latest" else ResultsStore.open(resume)
        store = ResultsStore(store.run_dir).lock()
        try:
            changes = _folder_changes(store.run_dir, cfg)
            if changes and not force:
                raise StoreError(
                    f"--resume: {store.run_dir} was run with other settings ({_describe(changes)}); rows "
                    f"would disagree with its config.yaml. Resume with the recorded values, start a new "
                    f"run (no --resume), or add --force to mix them (the change is recorded in its {RESUMES})"
                )
            if changes:
                store.record_resume(changes)
        except BaseException:
            store.unlock()
            raise
        return store, True
    return ResultsStore.create(cfg.results.root, cfg.name, config_yaml, fingerprint(device)), False


def _drive(
    cfg: SuiteConfig,
    config_yaml: str,
    plan: list[TrialSpec],
    executor: Executor,
    workload: Workload,
    *,
    resume: Optional[str],
    out: TextIO,
    progress: bool,
    force: bool = False,
    budget: Optional[Budget] = None,
) -> SweepResult:
    t_start = time.perf_counter()
    store, resumed = open_store(cfg, config_yaml, executor.device, resume, force)
    try:
        return _drive_locked(
            cfg, plan, executor, workload, store, resumed, t_start, out=out, progress=progress, budget=budget
        )
    finally:
        store.unlock()


def _drive_locked(
    cfg: SuiteConfig,
    plan: list[TrialSpec],
    executor: Executor,
    workload: Workload,
    store: ResultsStore,
    resumed: bool,
    t_start: float,
    *,
    out: TextIO,
    progress: bool,
    budget: Optional[Budget] = None,
) -> SweepResult:
    from tqdm import tqdm

    started_ms = int(time.time() * 1000)
    if resumed:  # a new sweep's fingerprint holds its start sample already
        _record_load(store, "start")
    done = store.completed_keys()
    todo = [s for s in plan if s.key not in done]
    tracker = make_tracker(cfg.tracking.mlflow, cfg.tracking.uri, cfg.tracking.experiment or cfg.name, cfg.results.root)
    tracker.start(
        store,
        sweep=cfg.name,
        params=sweep_params(cfg),
        environment=_environment(store),
        description=cfg.description,
        resume=resumed,
        started_ms=started_ms,
    )
    ctx = RowContext(RunSettings.of(cfg), store.run_dir.name)
    print(
        f"sweep {cfg.name}: {len(plan)} trials ({len(plan) - len(todo)} already recorded), "
        f"executor={cfg.run.executor}, device={executor.device} -> {store.run_dir}",
        file=out,
        flush=True,
    )
    if budget is not None:  # the trials still to run: memory and hours before the start
        print_budget(predict_sweep(todo, workload, budget), out)
    bar = tqdm(
        total=len(plan),
        initial=len(plan) - len(todo),
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
        unit="trial",
    )
    # lines a workload prints mid-sweep (a baseline being trained) go above the bar, not through it
    workload.start(store, tracker, ctx, say=bar.write if progress else (lambda line: print(line, file=out)))
    status = "FINISHED"
    try:
        for spec in todo:
            # shown now, while the trial runs (the bar otherwise redraws only after it finished)
            bar.set_description(spec.label(), refresh=True)
            started = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
            ok, reason = check_supported(spec, executor, workload, budget)
            if not ok:
                record = skipped_row(spec, reason, ctx, started)
            else:
                workload.before(spec)
                t0, startup0 = time.perf_counter(), executor.startup_s
                outcome = executor.run(spec)
                # the trial's own time: without starting the worker group it may have needed
                wall = time.perf_counter() - t0 - (executor.startup_s - startup0)
                record = workload.row(spec, outcome, ctx, started, wall)
            store.append(record)
            tracker.log_trial(record)
            bar.update(1)
            if record[M.STATUS] in (M.FAILED, M.TIMEOUT, M.INCORRECT):
                bar.write(f"  {record[M.STATUS]}: {spec.label()}: {str(record[M.REASON])[:300]}")
    except BaseException as exc:
        # Ctrl-C, SIGTERM and SIGHUP (raised as KeyboardInterrupt by the CLI) end the parent run
        # KILLED; an error of the harness itself (a full disk, a bug) ends it FAILED
        status = "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"
        executor.abort()  # do not wait for a trial in flight
        raise
    finally:
        bar.close()
        _record_load(store, "end")  # before MLflow takes environment.json as an artifact
        _compact(store)
        if progress and tracker.enabled:  # importing MLflow and logging what is queued take seconds
            print("MLflow: logging the trials still queued and the store's files ...", file=sys.stderr, flush=True)
        tracker.finish(store, status)
    wall = time.perf_counter() - t_start
    records, duplicates = store.latest_rows()
    print(summary_table(records), file=out)
    if duplicates:
        print(
            f"{duplicates} earlier row(s) of keys recorded twice are not counted (the latest row of each key is)",
            file=out,
        )
    if store.damaged:
        print(
            f"{len(store.damaged)} damaged line(s) of {store.trials_path} skipped (first: {store.damaged[0]})", file=out
        )
    todo_keys = {s.key for s in todo}
    this_run = [r for r in records if r[M.KEY] in todo_keys] + workload.added_rows()
    _print_footer(records, this_run, wall, store, tracker, out, executor.startup_s, executor.groups_started)
    # this run's start and end; a simulated sweep measures nothing the load could disturb
    load = busy_note(((_environment(store) or {}).get("load") or [])[-2:], measured=cfg.run.executor != "sim")
    if load:
        print(load, file=out)
    return SweepResult(store.run_dir, records, wall, tracker.uri, tracker.disabled_reason)


def _environment(store: ResultsStore) -> Optional[dict]:
    """The folder's environment.json, or None when it is missing or damaged (never stops a sweep)."""
    try:
        env = store.read_json(ENVIRONMENT)
    except (OSError, ValueError):
        return None
    return env if isinstance(env, dict) else None


def _record_load(store: ResultsStore, at: str) -> None:
    """Add a sample of the machine's load (suite/env.py: machine_load) to environment.json's `load`
    list: a noisy trial can then be read against how busy the machine was. Best effort."""
    env = _environment(store)
    if env is None:
        return
    env["load"] = list(env.get("load") or []) + [machine_load(at)]
    try:
        store.write_json(ENVIRONMENT, env)
    except OSError:
        pass


def _compact(store: ResultsStore) -> None:
    """Write the Parquet copy; never let it stop the run's MLflow finish (the JSON lines are the
    results)."""
    try:
        store.compact()
    except Exception as exc:  # noqa: BLE001
        import warnings

        warnings.warn(
            f"could not write {store.run_dir}/trials.parquet: {exc} (the rows are in trials.jsonl; "
            f"a line a failed write left partial is skipped on reading)",
            RuntimeWarning,
            stacklevel=2,
        )


def _print_footer(
    records: list[dict],
    this_run: list[dict],
    wall: float,
    store: ResultsStore,
    tracker,
    out: TextIO,
    startup_s: float = 0.0,
    groups: int = 0,
) -> None:
    counts: dict[str, int] = {}
    for r in records:
        counts[r[M.STATUS]] = counts.get(r[M.STATUS], 0) + 1
    trial_s = sum(r.get(M.DURATION_S) or 0.0 for r in this_run)
    print(f"\n{len(records)} trials: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())), file=out)
    print(
        f"wall time {wall:.1f}s = trials {trial_s:.1f}s + worker start-up {startup_s:.1f}s ({groups} groups) "
        f"+ other {wall - trial_s - startup_s:.1f}s (MLflow logging used "
        f"{tracker.cpu_seconds:.1f}s CPU in the background); results in {store.run_dir}",
        file=out,
    )
    if tracker.rebuilt:
        print(tracker.rebuilt, file=out)
    if tracker.enabled:
        print(
            f"MLflow: {redact_uri(tracker.uri)} (experiment {tracker.experiment!r}); browse with "
            f"`{M.suite_command()} ui`, then open {tracker.link}",
            file=out,
        )
        if tracker.caught_up:
            print(f"MLflow stopped mid-sweep ({tracker.caught_up}); the rows since were logged at the end", file=out)
        elif tracker.retries:
            print(f"MLflow: {tracker.retries} write(s) retried after a transient database error", file=out)
    elif tracker.uri:
        print(f"MLflow was disabled: {tracker.disabled_reason}", file=out)


# A dry run lists at most this many trials unless asked for all (`--dry-run --verbose`): the main GPU
# sweep plans thousands, and its summary (below the list) is what a reader needs first.
PLAN_LINES = 40
# ... and at most this many skip reasons, the most frequent first
PLAN_REASONS = 12


def print_plan(
    plan: list[TrialSpec],
    executor: Executor,
    workload: Workload,
    out: TextIO,
    list_all: bool = False,
    budget: Optional[Budget] = None,
) -> dict:
    """The planned trials, one line each with whether each can run here (the first PLAN_LINES of
    them unless `list_all`, which adds each trial's predicted per-rank peak and seconds), then a
    summary: trials by method and status (run or skip here), by skip reason and, with a `budget`,
    memory and hours per world size. Returns the counts: {"method": {name: {status: n}}, "reason":
    {reason: n}} and, with a budget, "budget": the SweepBudget."""
    from collections import Counter

    from tabulate import tabulate

    by_method: dict[str, Counter] = {}
    reasons: Counter = Counter()
    shown = len(plan) if list_all or len(plan) <= PLAN_LINES else PLAN_LINES
    predicted = predict_trials(plan, workload, budget) if budget is not None else None
    print(f"{len(plan)} planned trials:", file=out)
    for i, spec in enumerate(plan):
        ok, reason = check_supported(spec, executor, workload, budget)
        by_method.setdefault(spec.method, Counter())["run" if ok else "skip"] += 1
        if not ok:
            reasons[reason] += 1
        if i < shown:
            extra = ""
            if list_all and predicted is not None:
                extra = "  " + _trial_figures(predicted[i])
            print(f"  {spec.key}  {spec.label():<80} {'run' if ok else 'skip: ' + reason}{extra}", file=out)
    if shown < len(plan):
        print(f"  ... {len(plan) - shown} more (--dry-run --verbose lists every trial)", file=out)
    runs = sum(c["run"] for c in by_method.values())
    print(f"\nsummary: {len(plan)} trials, {runs} run here, {len(plan) - runs} skipped here", file=out)
    rows = [[m, c["run"], c["skip"], c["run"] + c["skip"]] for m, c in by_method.items()]
    print(tabulate(rows, headers=["method", "run", "skip", "trials"], tablefmt="simple"), file=out)
    if reasons:
        print("\nskipped, by reason:", file=out)
        top = reasons.most_common(PLAN_REASONS)
        rows = [[n, r if len(r) <= 110 else r[:107] + "..."] for r, n in top]
        print(tabulate(rows, headers=["trials", "reason"], tablefmt="simple"), file=out)
        rest = reasons.most_common()[PLAN_REASONS:]
        if rest:
            print(f"and {len(rest)} other reasons ({sum(n for _, n in rest)} trials)", file=out)
    counts: dict = {"method": {m: dict(c) for m, c in by_method.items()}, "reason": dict(reasons)}
    if budget is not None and predicted is not None:
        counts["budget"] = budget.sweep(predicted)
        print_budget(counts["budget"], out)
    return counts


def predict_trials(plan: list[TrialSpec], workload: Workload, budget: Budget) -> list:
    """Each trial's predicted memory and seconds (suite/budget.py), judged as on its target device:
    a trial this machine cannot run only for want of the device or a library still counts."""
    from suite.budget import TrialBudget

    methods_by_options: dict[tuple, object] = {}
    out: list[TrialBudget] = []
    for spec in plan:
        key = (spec.method, spec.kernel, repr(sorted(spec.method_options.items())))
        if key not in methods_by_options:
            methods_by_options[key] = target_method(spec)
        method = methods_by_options[key]
        out.append(budget.trial(spec, method, runs_on_target(spec, method, workload)))  # type: ignore[arg-type]
    return out


def predict_sweep(plan: list[TrialSpec], workload: Workload, budget: Budget):
    return budget.sweep(predict_trials(plan, workload, budget))


def _trial_figures(t) -> str:
    """A dry run's per-trial figures (`-v`): predicted per-rank peak (problem / method terms) and seconds."""
    from suite.budget import GB

    if t.memory is None:
        return "[no prediction]"
    m = t.memory
    return (
        f"[peak {m.peak / GB:.2f} GB/rank = check {m.problem.held / GB:.2f} (computing {m.problem.building / GB:.2f})"
        f" + shards {m.shards / GB:.2f} + method {m.working / GB:.2f} + workspace {m.workspace / GB:.2f};"
        f" {t.seconds:.1f} s{'; over memory' if t.over else ''}]"
    )


def print_budget(budget, out: TextIO) -> None:
    """Memory and hours per world size, and in total (suite/budget.py: the model and its band)."""
    print("\npredicted (suite/budget.py; hours [band], per-rank peak of the trials that run on the target):", file=out)
    for line in budget.lines():
        print(line, file=out)
