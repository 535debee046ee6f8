"""MLflow logging: one parent run per sweep, one nested child run per trial (docs/DESIGN.md section 8).

Only the parent process logs (concurrent sqlite writers corrupt the store), from one background
thread, so that importing MLflow and writing runs overlap the trials instead of adding to the
sweep's wall time. Identity goes to
params, numbers to metrics (the raw per-iteration times as the step series `time_ms`),
environment and status to tags. MLflow failing never loses a result: the first error disables
tracking with a warning, the results store stays complete, and `python -m suite relog RUN_DIR`
logs a stored sweep again later.
"""
from __future__ import annotations

import functools
import os
import queue
import threading
import time
import warnings
from pathlib import Path
from typing import Optional

from suite import metrics as M
from suite.env import tags as env_tags
from suite.metrics import IDENTITY
from suite.results import CONFIG, ENVIRONMENT, MLFLOW, PARQUET, TRIALS, ResultsStore

_MAX_TAG = 4000


def default_uri(results_root: str | Path) -> str:
    """$MLFLOW_TRACKING_URI, else a sqlite file in the results root."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{(Path(results_root).resolve() / 'mlflow.db').as_posix()}"


class NullTracker:
    """Tracking switched off (tracking.mlflow: false)."""

    enabled = False
    uri: Optional[str] = None
    seconds = 0.0
    disabled_reason: Optional[str] = "tracking.mlflow is false"
    parent_run_id: Optional[str] = None

    def start(self, *args, **kwargs) -> None: ...
    def log_trial(self, record: dict, label: str = "") -> None: ...
    def finish(self, store: ResultsStore, status: str = "FINISHED") -> None: ...


def _timed(fn):
    """Add the call's duration to `self.seconds` (MLflow's share of the harness overhead)."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
    return wrapper


class MlflowTracker:
    """Logs through MlflowClient (no global "active run" state) on one background thread.

    `start`, `log_trial` and `finish` queue the work and return at once; `finish` waits for the
    queue to drain (at most `finish_timeout_s`). After `finish`, `enabled`, `disabled_reason` and
    `parent_run_id` describe what happened.
    """

    enabled = True
    finish_timeout_s = 300.0

    def __init__(self, uri: str, experiment: str, results_root: str | Path):
        self.uri, self.experiment = uri, experiment
        self.results_root = Path(results_root).resolve()
        self.disabled_reason: Optional[str] = None
        self.parent_run_id: Optional[str] = None
        self._client = None
        self._exp_id: Optional[str] = None
        self.seconds = 0.0  # time spent in MLflow calls (on the background thread)
        self._queue: queue.Queue = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    # -- public: queue the work -----------------------------------------------------------------
    def start(self, store: ResultsStore, **kwargs) -> None:
        self._thread = threading.Thread(target=self._loop, name="mlflow-logger", daemon=True)
        self._thread.start()
        self._queue.put((self._start, (store,), kwargs))

    def log_trial(self, record: dict, label: str = "") -> None:
        if self._thread is not None:
            self._queue.put((self._log_trial, (dict(record), label), {}))

    def finish(self, store: ResultsStore, status: str = "FINISHED") -> None:
        if self._thread is None:
            return
        self._queue.put((self._finish, (store, status), {}))
        self._queue.put(None)
        self._thread.join(timeout=self.finish_timeout_s)
        if self._thread.is_alive():
            self._disable("logging did not finish", TimeoutError(f"still busy after {self.finish_timeout_s:g}s"))
        self._thread = None

    def _loop(self) -> None:
        # Lowest CPU priority for this thread (Linux: per-thread nice), so that logging the last
        # trial does not steal cycles from the timed iterations of the next one on small machines.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while (item := self._queue.get()) is not None:
            fn, args, kwargs = item
            if self.enabled:
                fn(*args, **kwargs)

    def _disable(self, what: str, exc: BaseException) -> None:
        self.disabled_reason = f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        self.enabled = False
        warnings.warn(f"MLflow disabled ({self.disabled_reason}); results are still written to the results "
                      f"store; log them later with `python -m suite relog RUN_DIR`", RuntimeWarning, stacklevel=2)

    # -- the work itself (background thread) -----------------------------------------------------
    @_timed
    def _start(self, store: ResultsStore, *, sweep: str, params: dict, environment: dict, description: str = "",
              resume: bool = False) -> None:
        # Fail fast when a tracking server is unreachable instead of retrying for minutes.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        try:
            from mlflow.tracking import MlflowClient

            if self.uri.startswith("sqlite:///"):
                Path(self.uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
            self._client = MlflowClient(tracking_uri=self.uri)
            exp = self._client.get_experiment_by_name(self.experiment)
            if exp is None:
                artifacts = None
                if self.uri.startswith("sqlite:"):  # keep artifacts beside the local store, explicitly
                    artifacts = (self.results_root / "mlartifacts" / self.experiment).as_uri()
                self._exp_id = self._client.create_experiment(self.experiment, artifact_location=artifacts)
            else:
                self._exp_id = exp.experiment_id
            previous = store.read_json(MLFLOW) if resume else None
            if previous and previous.get("uri") == self.uri:
                self.parent_run_id = previous["parent_run_id"]
                self._client.update_run(self.parent_run_id, status="RUNNING")
                return
            run_tags = dict(env_tags(environment))
            run_tags.update({"suite.run_dir": str(store.run_dir.resolve()), "suite.sweep": sweep,
                             "mlflow.note.content": description or f"sweep {sweep}"})
            run = self._client.create_run(self._exp_id, run_name=f"{sweep}@{store.run_dir.name}", tags=run_tags)
            self.parent_run_id = run.info.run_id
            self._log_batch(self.parent_run_id, params={k: v for k, v in params.items()})
            store.write_json(MLFLOW, {"uri": self.uri, "experiment": self.experiment,
                                      "experiment_id": self._exp_id, "parent_run_id": self.parent_run_id})
        except Exception as exc:  # noqa: BLE001 - never lose the sweep to tracking
            self._disable("could not start the sweep's run", exc)

    def _log_batch(self, run_id: str, *, params=None, metrics=None, tags=None, steps=None) -> None:
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        m = [Metric(k, float(v), now, 0) for k, v in (metrics or {}).items()]
        for key, series in (steps or {}).items():
            m += [Metric(key, float(v), now, i) for i, v in enumerate(series)]
        p = [Param(k, str(v)[:500]) for k, v in (params or {}).items()]
        t = [RunTag(k, str(v)[:_MAX_TAG]) for k, v in (tags or {}).items()]
        for i in range(0, max(len(m), 1), 900):  # log_batch takes at most 1000 metrics
            self._client.log_batch(run_id, metrics=m[i:i + 900], params=p if i == 0 else [],
                                   tags=t if i == 0 else [])

    @_timed
    def _log_trial(self, record: dict, label: str = "") -> None:
        if self.parent_run_id is None:
            return
        try:
            status = record[M.STATUS]
            child = self._client.create_run(self._exp_id, run_name=label or record[M.KEY],
                                            tags={"mlflow.parentRunId": self.parent_run_id})
            metrics = {k: record[k] for k in M.NUMERIC_METRICS if record.get(k) is not None}
            params = {k: record[k] for k in IDENTITY}
            params[M.KEY] = record[M.KEY]
            tags = {M.STATUS: status, M.REASON: record.get(M.REASON) or "", M.CHECKED: record.get(M.CHECKED),
                    M.KERNEL_USED: record.get(M.KERNEL_USED) or "", M.COMM_OPS: record.get(M.COMM_OPS) or ""}
            steps = {"time_ms": record[M.TIME_MS_SAMPLES]} if record.get(M.TIME_MS_SAMPLES) else {}
            if record.get(M.LOSS_CURVE):
                steps["train_loss"] = record[M.LOSS_CURVE]
            self._log_batch(child.info.run_id, params=params, metrics=metrics, tags=tags, steps=steps)
            self._client.set_terminated(child.info.run_id,
                                        "FAILED" if status in (M.FAILED, M.TIMEOUT) else "FINISHED")
        except Exception as exc:  # noqa: BLE001
            self._disable(f"could not log trial {record.get(M.KEY)}", exc)

    @_timed
    def _finish(self, store: ResultsStore, status: str = "FINISHED") -> None:
        if self.parent_run_id is None:
            return
        try:
            for name in (CONFIG, ENVIRONMENT, TRIALS, PARQUET):
                path = store.run_dir / name
                if path.exists():
                    self._client.log_artifact(self.parent_run_id, str(path), artifact_path="results")
            self._client.set_terminated(self.parent_run_id, status)
        except Exception as exc:  # noqa: BLE001
            self._disable("could not finish the sweep's run", exc)


def make_tracker(enabled: bool, uri: Optional[str], experiment: str, results_root: str):
    if not enabled:
        return NullTracker()
    return MlflowTracker(uri or default_uri(results_root), experiment, results_root)


def relog(run_dir: str | Path, uri: Optional[str] = None, experiment: Optional[str] = None) -> MlflowTracker:
    """Log a stored sweep (results folder) to MLflow as a new parent run with its child runs."""
    from omegaconf import OmegaConf

    store = ResultsStore.open(run_dir)
    cfg = OmegaConf.load(store.run_dir / CONFIG)
    name = str(cfg.get("name"))
    root = cfg.get("results", {}).get("root", "results")
    tracker = MlflowTracker(uri or default_uri(root), experiment or cfg.get("tracking", {}).get("experiment") or name,
                            root)
    params = {f"{section}.{k}": v for section in ("sweep", "run")
              for k, v in OmegaConf.to_container(cfg.get(section, {}), resolve=True).items()}
    tracker.start(store, sweep=name, params={"name": name, **params}, environment=store.read_json(ENVIRONMENT),
                  description=str(cfg.get("description") or ""))
    for record in store.iter_records():
        tracker.log_trial(record, f"{record['method']} P={record['world_size']} S={record['seq_len']} {record['pass']}")
    tracker.finish(store)
    return tracker
