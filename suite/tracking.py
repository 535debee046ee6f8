"""MLflow as a derived view of the results store (docs/DESIGN.md section 8).

The store (trials.jsonl) is the truth; MLflow is a view of it that can always be rebuilt: one
parent run per run folder, one child run per stored row, found again by the tag `key` (the trial
hash). Every start (a new sweep, `--resume`, `python -m suite relog`) reconciles the two: stored
rows without a child run are logged, half-logged children (RUNNING) are completed, duplicate
children are deleted and RUNNING runs with no stored row are ended KILLED. A child run starts and
ends at its trial's own times and every value carries those timestamps, so that logging a row
twice adds nothing (MLflow drops a metric equal in key, value, step and timestamp).

Only the parent process logs (concurrent sqlite writers corrupt the store), from one background
thread, so that importing MLflow and writing runs overlap the trials. Identity goes to params
(flattened: `option.ulysses_degree`, `workload.train.lr`), numbers to metrics (summary values
under their row names, the raw samples as the step series `samples/time_ms`), status and
environment to tags. MLflow failing never loses a result: a transient database error (sqlite's
"disk I/O error" or "database is locked", a dropped connection) is retried with backoff (every write
is idempotent: a child run is known by its key as soon as it exists, and an equal metric is dropped);
an error that persists disables tracking with a warning, the sweep goes on, and at its end the
tracker tries once to catch up as `relog` would (reconcile the store's rows with the child runs).
Only if that fails too does the user run `relog` later. A sqlite store left half-created (the
process killed or the disk full while MLflow created or migrated it, so that every later open fails)
is moved aside, kept, and created afresh; the start's reconcile logs the stored rows to it.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import queue
import threading
import time
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

from suite import metrics as M
from suite.env import redact_text, redact_uri
from suite.env import tags as env_tags
from suite.metrics import IDENTITY
from suite.results import CONFIG, ENVIRONMENT, MLFLOW, PARQUET, TRIALS, ResultsStore, mlflow_client_uri

_MAX_TAG = 4000
_MAX_PARAM = 6000
SAMPLES = "samples/time_ms"  # the per-iteration times of a trial, as a step series
TRAIN_LOSS = "train_loss"  # the per-step training loss of a perplexity trial, as a step series
TABLE = "trials_table.json"  # the parent run's table of its trials
UI_URL = "http://127.0.0.1:5000"  # where `python -m suite ui` serves by default
# MLflow 3 opens an experiment without this tag on its GenAI (traces) pages; this kind opens the
# classic machine-learning runs table.
_EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
# The numbers as a person reads them, as tags beside the exact metrics: MLflow's runs table cuts a
# metric to its first digits and drops the exponent (4.28e-07 shows as "4.28336514..."), and shows
# bytes raw. Tags are text, so the table shows them as written. Keys hold a space, so that no tag of
# a row (status, reason, ...) and no metric name can be one of them.
RUN_FOLDER = M.MLFLOW_RUN_FOLDER  # <sweep>/<timestamp> of the row's run folder: which run a row comes from
SHOWN = M.MLFLOW_SHOWN  # tag -> (metric, how it is written)
# A saved view of the runs table (MLflow's "shared view": an experiment tag the page reads when the
# link names it; MLflow 3 chooses the columns of its runs table only from a view the browser saved
# or a shared one, whose banner it always shows): the trials with their identity, their run folder,
# status and the headline numbers (the tags above) as columns. Ordered by a metric, the children are
# flat rows; ordered by start time, MLflow nests them under their parent run.
VIEW = "trials"
_VIEW_COLUMNS = (
    [
        "params.`method`",
        "params.`world_size`",
        "params.`seq_len`",
        "params.`heads`",
        "params.`kv_heads`",
        "params.`causal`",
        "params.`pass`",
        f"tags.`{M.STATUS}`",
    ]
    + [f"tags.`{k}`" for k in SHOWN]
    + [f"tags.`{RUN_FOLDER}`"]
)
_VIEW_STATE = json.dumps(
    {
        "orderByKey": f"metrics.`{M.TFLOPS_PER_GPU}`",
        "orderByAsc": False,
        "selectedColumns": _VIEW_COLUMNS,
    }
)
_VIEW_TAG = f"mlflow.sharedViewState.{VIEW}"


def default_uri(results_root: str | Path) -> str:
    """$MLFLOW_TRACKING_URI, else a sqlite file in the results root."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{(Path(results_root).resolve() / 'mlflow.db').as_posix()}"


def runs_link(uri: str, experiment_id: str, ui_url: str = UI_URL) -> str:
    """The browser link to an experiment's machine-learning runs view: the tracking server itself
    for an http(s) URI, else the address `python -m suite ui` serves on."""
    base = redact_uri(uri) if uri.startswith(("http://", "https://")) else ui_url
    return (
        f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={VIEW}"
    )


def run_link(uri: str, experiment_id: str, run_id: str, ui_url: str = UI_URL) -> str:
    """The browser link to one run's page in the machine-learning view (MLflow 3 opens a run page
    whose link does not name the view in its GenAI pages, whatever the experiment's kind)."""
    base = redact_uri(uri) if uri.startswith(("http://", "https://")) else ui_url
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


# ---------------------------------------------------------------------------------------------
# What a row becomes in MLflow (pure functions)
# ---------------------------------------------------------------------------------------------
def _flat_value(value: Any) -> str:
    """A param value as a person types it: lists comma-joined, booleans lower case."""
    if isinstance(value, (list, tuple)):
        return ",".join(_flat_value(v) for v in value)
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return ""
    return str(value)


def flatten(prefix: str, value: Any) -> dict[str, str]:
    """Nested dicts as dotted keys (`perplexity.train.lr`), lists of scalars comma-joined; a list
    holding dicts (e.g. exclude rules) stays one JSON value."""
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for k, v in value.items():
            out.update(flatten(f"{prefix}.{k}" if prefix else str(k), v))
        return out
    if isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in value):
        return {prefix: json.dumps(value, sort_keys=True)}
    return {prefix: _flat_value(value)}


def config_params(cfg: dict) -> dict[str, str]:
    """The sweep's params from its resolved config (a plain dict): every setting, flattened. Where
    results and tracking go is not a setting of the measurement."""
    return flatten("", {k: v for k, v in cfg.items() if k not in ("results", "tracking", "description")})


def run_name(record: dict) -> str:
    """A child run's name: what the trial is, made unique by the start of its key."""
    opts = _json(record.get("options"))
    name = M.method_label(record["method"], opts if isinstance(opts, dict) else {})
    mask = M.mask_label(record.get("mask"), record.get("causal"))
    mix = M.workload_label(record.get("workload"))
    return (
        f"{name} P={record['world_size']} B={record['batch']} S={record['seq_len']} H={record['heads']}/"
        f"{record['kv_heads']} D={record['head_dim']} {mask}{'' if mix == 'uniform' else ' ' + mix} "
        f"{record['pass']} #{str(record[M.KEY])[:7]}"
    )


def _json(text: Any) -> Any:
    if not text or not isinstance(text, str):
        return {}
    try:
        return json.loads(text)
    except ValueError:
        return {}


def trial_times(record: dict) -> tuple[int, int]:
    """(start, end) of a trial in ms since the epoch: its recorded start plus its own wall time."""
    try:
        start = int(datetime.fromisoformat(str(record[M.STARTED_AT])).timestamp() * 1000)
    except (KeyError, ValueError):
        start = int(time.time() * 1000)
    return start, start + int(round((record.get(M.DURATION_S) or 0.0) * 1000))


SIM_BAND = M.SIM_BAND  # tag of a simulated child run: "±4.3 %", or "unvalidated" (suite/sim/bands.py)


def child_values(record: dict) -> tuple[dict, dict, dict, dict]:
    """(params, metrics, tags, step series) of a trial row."""
    params = {k: _flat_value(record.get(k)) for k in IDENTITY if k not in ("options", "workload")}
    params.update({k: _flat_value(record[k]) for k in M.VARIANT_IDENTITY if record.get(k) is not None})
    opts = _json(record.get("options"))
    params.update(flatten("option", opts) if opts else {})
    work = _json(record.get("workload"))
    params.update(flatten("workload", work) if isinstance(work, dict) and work else {})
    for k in (M.SEED, M.WARMUP, M.REPEATS):
        if record.get(k) is not None:
            params[k] = _flat_value(record[k])
    metrics = {
        k: record[k]
        for k in M.NUMERIC_METRICS
        if isinstance(record.get(k), (int, float)) and not isinstance(record.get(k), bool)
    }
    # the trial hash and the raw identity JSON are tags: they find a run again (and let a report
    # read an experiment back into rows) but are no axis to compare runs by
    tags = {
        M.KEY: record[M.KEY],
        M.STATUS: record[M.STATUS],
        M.REASON: record.get(M.REASON) or "",
        M.CHECKED: record.get(M.CHECKED),
        M.KERNEL_USED: record.get(M.KERNEL_USED) or "",
        M.COMM_OPS: record.get(M.COMM_OPS) or "",
        "options": record.get("options") or "{}",
        "workload": record.get("workload") or "",
    }
    tags.update(shown_tags(metrics))
    band = M.sim_band_label(record)
    if band is not None:  # a simulated row: its validated band, or "unvalidated" (no number borrowed)
        tags[SIM_BAND] = band
    steps = {SAMPLES: record[M.TIME_MS_SAMPLES]} if record.get(M.TIME_MS_SAMPLES) else {}
    if record.get(M.LOSS_CURVE):
        steps[TRAIN_LOSS] = record[M.LOSS_CURVE]
    return params, metrics, tags, steps


def shown(value: float, how: str) -> str:
    """A number as the runs table shows it: 3 significant digits ("sig3"), 2 with the exponent kept
    for an error ("err": 4.3e-07), a signed relative difference ("signed": +1.2e-03), or bytes in
    binary units ("bytes": 1.5 MiB)."""
    if how == "bytes":
        size, unit = float(value), "B"
        for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(size) < 1024 or unit == "TiB":
                break
            size /= 1024
        return f"{size:.0f} B" if unit == "B" else f"{size:.3g} {unit}"
    if how == "err":
        return f"{value:.1e}"
    if how == "signed":
        return f"{value:+.1e}"
    return f"{value:.3g}"


def shown_tags(metrics: dict) -> dict[str, str]:
    """The SHOWN tags of a trial's metrics (those it has)."""
    return {tag: shown(metrics[m], how) for tag, (m, how) in SHOWN.items() if m in metrics}


def run_status(record: dict) -> str:
    return "FAILED" if record[M.STATUS] in (M.FAILED, M.TIMEOUT) else "FINISHED"


# ---------------------------------------------------------------------------------------------
# Opening the store: one process at a time creates (migrates) a fresh sqlite database
# ---------------------------------------------------------------------------------------------
def _sqlite_path(uri: str) -> Optional[Path]:
    return Path(uri[len("sqlite:///") :]) if uri.startswith("sqlite:///") else None


@contextlib.contextmanager
def _store_lock(uri: str):
    """An fcntl lock on `<db>.lock` beside a sqlite store while it is opened: two processes that
    create the same fresh database at once both run MLflow's schema migration and one of them
    (or the database) is broken ("table already exists", a half-migrated schema)."""
    path = _sqlite_path(uri)
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def quiet_mlflow_logs() -> None:
    """MLflow and Alembic log INFO lines when they open or migrate a store; on the console they
    break the progress bar and say nothing a user acts on."""
    for name in ("alembic", "mlflow"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _client_env() -> None:
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail fast on an unreachable server
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def open_client_readonly(uri: str):
    """An MlflowClient on an existing store (a sqlite file that does not exist is not created)."""
    path = _sqlite_path(uri)
    if path is not None and not path.exists():
        raise FileNotFoundError(path)
    _client_env()
    from mlflow.tracking import MlflowClient

    quiet_mlflow_logs()
    with _store_lock(uri):
        client = MlflowClient(tracking_uri=mlflow_client_uri(uri))
        client.search_experiments(max_results=1)  # opens (and, for an older schema, migrates) the store
    return client


# Words of a sqlite store whose creation or migration was cut off (the process killed, the disk full):
# MLflow runs the migrations again from the last one the file records, and the first finds what the
# cut-off run had made ("table trace_info already exists", "_alembic_tmp_trace_info already exists",
# an index); or sqlite finds the file itself cut short.
_HALF_MIGRATED = ("already exists", "duplicate column name")
_DAMAGED = ("database disk image is malformed", "file is not a database")


def _schema(path: Path) -> Optional[tuple[Optional[str], int]]:
    """(the schema revision the file records, None without one; its number of runs), read without
    MLflow and without writing; None when the file cannot be read so (locked, unreadable)."""
    import sqlite3

    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=1.0)
    except sqlite3.Error:
        return None
    try:
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        rows = db.execute("SELECT version_num FROM alembic_version").fetchall() if "alembic_version" in tables else []
        runs = db.execute("SELECT COUNT(*) FROM runs").fetchone()[0] if "runs" in tables else 0
        return (rows[0][0] if rows else None), runs
    except sqlite3.Error:
        return None
    finally:
        db.close()


def _unfinished_revision(revision: Optional[str]) -> bool:
    """Whether `revision` is where an MLflow migration of this version stops short of its last one
    (None: the file was never stamped). A revision this MLflow does not know is a newer MLflow's
    store, not a broken one."""
    if revision is None:
        return True
    import mlflow
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(Path(mlflow.__file__).parent / "store" / "db_migrations"))
    try:
        script.get_revision(revision)
    except Exception:  # noqa: BLE001 - alembic's error for a revision it has no script of
        return False
    return revision not in script.get_heads()


def broken_store(uri: str, exc: BaseException) -> Optional[str]:
    """What makes the sqlite store at `uri` recognisably half-created or damaged, judged from the
    error opening it raised (and the file itself), or None. Never a store that is merely busy
    (locked, a passing I/O error), a server, or a newer MLflow's store: those are left alone."""
    path = _sqlite_path(uri)
    if path is None or not path.is_file() or transient(exc):
        return None
    messages: list[str] = []
    seen: Optional[BaseException] = exc
    while seen is not None and len(messages) < 5:
        messages.append(str(seen).splitlines()[0] if str(seen) else "")
        seen = seen.__cause__ or seen.__context__
    # sqlalchemy starts its message with the driver's error class ("(sqlite3.OperationalError) ..."),
    # and MLflow's goes on with advice after its first sentence
    words = [(m.split(") ", 1)[1] if m.startswith("(") and ") " in m else m).split(". ")[0] for m in messages]
    damaged = [w for w in words if any(d in w.lower() for d in _DAMAGED)]
    if damaged:
        return damaged[0][:200]
    schema = _schema(path)
    if schema is None or not _unfinished_revision(schema[0]):
        return None
    conflict = [w for w in words if any(h in w.lower() for h in _HALF_MIGRATED)]
    if conflict:
        return conflict[0][:200]
    if schema[1] == 0:  # cut off at its last migration: MLflow calls it out of date; it holds nothing
        return words[0][:200]
    return None


def _move_aside(path: Path) -> Path:
    """Rename a broken sqlite file (and its journal, beside it) to `<name>.broken-<time>`: kept for
    a person to look at, never deleted. A journal left at the old name would be replayed into the
    fresh database."""
    stamp = datetime.now().strftime("%Y%m%dT%H%M%S")
    aside, n = path.with_name(f"{path.name}.broken-{stamp}"), 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}.broken-{stamp}-{n}"), n + 1
    path.rename(aside)
    for suffix in ("-journal", "-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            side.rename(aside.with_name(aside.name + suffix))
    return aside


def _forget_engines(uri: str) -> None:
    """MLflow keeps one database engine per URI for the life of the process; its pooled connections
    still read the file that was moved aside."""
    with contextlib.suppress(Exception):
        from mlflow.store.model_registry.sqlalchemy_store import SqlAlchemyStore as RegistryStore
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        for store in (SqlAlchemyStore, RegistryStore):
            engine = store._engine_map.pop(uri, None)
            if engine is not None:
                engine.dispose()


def open_client(
    uri: str,
    experiment: str,
    artifact_root: Optional[Path] = None,
    moved_aside: Optional[Callable[[str, Path], None]] = None,
):
    """(MlflowClient, experiment id): the store opened (migrated if new) and the experiment created
    if missing, under the store's lock. A sqlite store that is recognisably half-created or damaged
    (`broken_store`) is moved aside and created afresh; `moved_aside(why, new_path)` is told."""
    _client_env()
    from mlflow.tracking import MlflowClient

    quiet_mlflow_logs()  # after the import: importing mlflow sets its loggers' levels
    with _store_lock(uri):
        try:
            return _open_experiment(MlflowClient(tracking_uri=mlflow_client_uri(uri)), uri, experiment, artifact_root)
        except Exception as exc:  # noqa: BLE001 - judged below, raised again unless the file is broken
            why = broken_store(uri, exc)
            if why is None:
                raise
        path = _sqlite_path(uri)
        assert path is not None  # broken_store judges sqlite files only
        aside = _move_aside(path)
        _forget_engines(uri)
        opened = _open_experiment(MlflowClient(tracking_uri=mlflow_client_uri(uri)), uri, experiment, artifact_root)
    if moved_aside is not None:
        moved_aside(why, aside)
    return opened


def _open_experiment(client, uri: str, experiment: str, artifact_root: Optional[Path]):
    exp = client.get_experiment_by_name(experiment)  # the first call opens (creates, migrates) the store
    if exp is None:
        artifacts = None
        if uri.startswith("sqlite:") and artifact_root is not None:  # beside the local store, explicitly
            artifacts = (artifact_root / "mlartifacts" / experiment).as_uri()
        exp_id, tags = client.create_experiment(experiment, artifact_location=artifacts), {}
    else:
        exp_id, tags = exp.experiment_id, exp.tags
    if tags.get(_EXPERIMENT_KIND[0]) is None:
        client.set_experiment_tag(exp_id, *_EXPERIMENT_KIND)
    if tags.get(_VIEW_TAG) != _VIEW_STATE:
        client.set_experiment_tag(exp_id, _VIEW_TAG, _VIEW_STATE)
    return client, exp_id


# ---------------------------------------------------------------------------------------------
# Trackers
# ---------------------------------------------------------------------------------------------
class NullTracker:
    """Tracking switched off (tracking.mlflow: false)."""

    enabled = False
    uri: Optional[str] = None
    cpu_seconds = 0.0
    retries = 0
    caught_up: Optional[str] = None
    rebuilt: Optional[str] = None
    disabled_reason: Optional[str] = "tracking.mlflow is false"
    parent_run_id: Optional[str] = None
    experiment_id: Optional[str] = None
    link: Optional[str] = None

    def start(self, *args, **kwargs) -> None: ...
    def log_trial(self, record: dict) -> None: ...
    def finish(self, store: ResultsStore, status: str = "FINISHED") -> None: ...


# Errors worth a retry: the database or server was briefly unavailable, not a wrong request. Seen in
# CI: sqlite's "disk I/O error" on one commit of a 56-trial sweep lost its last 16 child runs.
_TRANSIENT = ("disk i/o error", "database is locked", "database is busy", "unable to open database", "connection")
RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0)  # backoff between the attempts of one write (7.5 s at most)


def transient(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) reads like a passing database or network failure."""
    cause: Optional[BaseException] = exc
    seen = 0
    while cause is not None and seen < 5:
        if any(t in str(cause).lower() for t in _TRANSIENT):
            return True
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    return False


def _timed(fn):
    """Add the call's CPU time to `self.cpu_seconds` (MLflow's share of the harness overhead: what it
    takes from the trials on a busy machine; its wall time on a low-priority thread says nothing)."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        c0 = time.thread_time()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.cpu_seconds += time.thread_time() - c0

    return wrapper


class MlflowTracker:
    """Logs through MlflowClient (no global "active run" state) on one background thread.

    `start`, `log_trial` and `finish` queue the work and return at once; `finish` waits for the
    queue to drain (at most `finish_timeout_s`). After `finish`, `enabled`, `disabled_reason`,
    `parent_run_id`, `link`, `counts` (what reconciling did) and `rebuilt` (the line saying a broken
    store was moved aside) describe what happened.
    """

    enabled = True
    finish_timeout_s = 300.0

    def __init__(self, uri: str, experiment: str, results_root: str | Path):
        self.uri, self.experiment = uri, experiment
        self.results_root = Path(results_root).resolve()
        self.disabled_reason: Optional[str] = None
        self.parent_run_id: Optional[str] = None
        self.experiment_id: Optional[str] = None
        self.cpu_seconds = 0.0  # CPU time of the logging thread in MLflow calls
        self.counts = {"logged": 0, "completed": 0, "deleted": 0, "killed": 0, "retagged": 0}
        self.retries = 0  # writes tried again after a transient error
        self.caught_up: Optional[str] = None  # the error after which the end-of-sweep catch-up logged the rest
        self._moved: Optional[str] = None  # "<db> was half-created (why); moved to <file>"
        self._others = ""  # the other run folders the moved store held, as `rebuilt` says them
        self.say: Optional[Callable[[str], None]] = None  # told each step (relog's progress), if set
        self._client: Any = None  # an MlflowClient once `start` opened the store (mlflow is imported lazily)
        self._run_folder = ""  # RUN_FOLDER of this store, set on start
        self._children: dict[str, tuple[str, str]] = {}  # key -> (child run id, its status)
        self._queue: queue.Queue = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    @property
    def link(self) -> Optional[str]:
        return runs_link(self.uri, self.experiment_id) if self.experiment_id else None

    @property
    def rebuilt(self) -> Optional[str]:
        """One line for the console when a half-created store was moved aside, else None."""
        if self._moved is None:
            return None
        if not self.enabled:
            return f"MLflow: {self._moved}; not rebuilt ({self.disabled_reason})"
        return f"MLflow: {self._moved}; rebuilt from the results store{self._others}"

    # -- public: queue the work -----------------------------------------------------------------
    def start(self, store: ResultsStore, **kwargs) -> None:
        quiet_mlflow_logs()
        self._thread = threading.Thread(target=self._loop, name="mlflow-logger", daemon=True)
        self._thread.start()
        self._queue.put((self._start, (store,), kwargs))

    def log_trial(self, record: dict) -> None:
        if self._thread is not None:
            self._queue.put((self._log_trial, (dict(record),), {}))

    def finish(self, store: ResultsStore, status: str = "FINISHED", end_ms: Optional[int] = None) -> None:
        """end_ms: when the sweep ended (default: now; `relog` gives its last trial's end)."""
        if self._thread is None:
            return
        self._queue.put((self._catch_up, (store,), {}))
        self._queue.put((self._finish, (store, status, end_ms), {}))
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
            if self.enabled or fn == self._catch_up:
                fn(*args, **kwargs)

    def _retrying(self, fn: Callable[[], None]) -> None:
        """Run `fn`, again after each transient error (RETRY_DELAYS_S apart); the last error raises."""
        for delay in (*RETRY_DELAYS_S, None):
            try:
                fn()
                return
            except Exception as exc:  # noqa: BLE001
                if delay is None or not transient(exc):
                    raise
                self.retries += 1
                time.sleep(delay)

    def _say(self, line: str) -> None:
        if self.say is not None:
            self.say(line)

    def _disable(self, what: str, exc: BaseException) -> None:
        msg = redact_text(str(exc).splitlines()[0] if str(exc) else "", self.uri)[:300]
        self.disabled_reason = f"{what}: {type(exc).__name__}: {msg}"
        self.enabled = False
        warnings.warn(
            f"MLflow disabled ({self.disabled_reason}); results are still written to the results "
            f"store; log them later with `{M.suite_command()} relog RUN_DIR`",
            RuntimeWarning,
            stacklevel=2,
        )

    # -- the work itself (background thread) -----------------------------------------------------
    @_timed
    def _start(
        self,
        store: ResultsStore,
        *,
        sweep: str,
        params: dict,
        environment: dict,
        description: str = "",
        resume: bool = False,
        started_ms: Optional[int] = None,
    ) -> None:
        try:
            self._run_folder = f"{store.run_dir.parent.name}/{store.run_dir.name}"
            self._say(f"opening {redact_uri(self.uri)} (importing MLflow takes a few seconds)")
            self._client, self.experiment_id = open_client(
                self.uri, self.experiment, self.results_root, moved_aside=self._moved_aside
            )
            if self._moved is not None:
                self._others = self._other_folders(store)
            parent = self._find_parent(store) if resume else None
            if parent is None:
                run_tags = dict(env_tags(environment or {}))
                run_tags.update(
                    {
                        "suite.run_dir": str(store.run_dir.resolve()),
                        "suite.sweep": sweep,
                        "mlflow.note.content": description or f"sweep {sweep}",
                    }
                )
                parent = self._client.create_run(
                    self.experiment_id, run_name=f"{sweep}@{store.run_dir.name}", tags=run_tags, start_time=started_ms
                )
                self.parent_run_id = parent.info.run_id
            else:
                self.parent_run_id = parent.info.run_id
                self._client.update_run(self.parent_run_id, status="RUNNING")
            have = parent.data.params
            # a param cannot change: a setting changed on --resume (e.g. a method added) is a tag
            changed = {f"resumed_with.{k}": v for k, v in params.items() if k in have and have[k] != str(v)}
            changed[RUN_FOLDER] = self._run_folder
            self._log_missing(self.parent_run_id, params=params, tags=changed, existing=have)
            store.write_json(
                MLFLOW,
                {
                    "uri": redact_uri(self.uri),
                    "experiment": self.experiment,
                    "experiment_id": self.experiment_id,
                    "parent_run_id": self.parent_run_id,
                },
            )
            if resume:
                self._reconcile(store)
        except Exception as exc:  # noqa: BLE001 - never lose the sweep to tracking
            self._disable("could not start the sweep's run", exc)

    def _moved_aside(self, why: str, aside: Path) -> None:
        db = aside.with_name(aside.name.split(".broken-")[0])
        near = os.path.relpath(db)  # results/mlflow.db when run from the project, as a person typed it
        db = Path(near) if not near.startswith("..") else db
        self._moved = f"{db} was half-created ({why}); moved to {db.with_name(aside.name)}"

    def _other_folders(self, store: ResultsStore) -> str:
        """What to say of the other run folders of the results root that were logged to the store
        moved aside (their mlflow.json names it): a resume or relog rebuilds only its own."""
        uri, here, others = redact_uri(self.uri), store.run_dir.resolve(), 0
        for path in self.results_root.glob(f"*/*/{MLFLOW}"):
            if path.parent.resolve() == here:
                continue
            try:
                others += json.loads(path.read_text()).get("uri") == uri
            except (OSError, ValueError, AttributeError):  # a damaged mlflow.json names nothing
                continue
        if not others:
            return ""
        return f" (this run folder; {others} other(s) were logged there: `{M.suite_command()} relog RUN_DIR` each)"

    def _find_parent(self, store: ResultsStore):
        """The run folder's parent run: the one mlflow.json names, else the one tagged with the
        folder; other parents of the folder still RUNNING (killed sweeps) are ended KILLED."""
        known = store.read_json(MLFLOW) or {}
        folder = str(store.run_dir.resolve()).replace("'", "\\'")
        runs = self._client.search_runs(
            [self.experiment_id], filter_string=f"tags.`suite.run_dir` = '{folder}'", max_results=1000
        )
        parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
        named = [r for r in parents if r.info.run_id == known.get("parent_run_id")]
        chosen = (named or sorted(parents, key=lambda r: r.info.start_time or 0) or [None])[0]
        for r in parents:
            if r is not chosen and r.info.status == "RUNNING":
                self._client.set_terminated(r.info.run_id, "KILLED")
                self.counts["killed"] += 1
        return chosen

    def _reconcile(self, store: ResultsStore) -> None:
        """Make the parent's children match the store's rows (see the module docstring)."""
        runs = self._client.search_runs(
            [self.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{self.parent_run_id}'", max_results=50000
        )
        stored = {r[M.KEY]: r for r in store.latest_rows()[0]}
        by_key: dict[str, list] = {}
        for run in runs:
            by_key.setdefault(run.data.tags.get(M.KEY, ""), []).append(run)
        for key, group in by_key.items():
            # keep a finished run over a half-logged one, then the oldest
            group.sort(key=lambda r: (r.info.status == "RUNNING", r.info.start_time or 0))
            keep, extra = group[0], group[1:]
            for run in extra:
                self._client.delete_run(run.info.run_id)
                self.counts["deleted"] += 1
            if key not in stored:  # a child with no row: a trial that never finished
                if keep.info.status == "RUNNING":
                    self._client.set_terminated(keep.info.run_id, "KILLED")
                    self.counts["killed"] += 1
                continue
            self._children[key] = (keep.info.run_id, keep.info.status)
            if keep.info.status != "RUNNING":  # logged before: add the display tags it lacks
                want = self._display_tags(child_values(stored[key])[1])
                stale = {k: v for k, v in want.items() if keep.data.tags.get(k) != v}
                if stale:
                    self._log_missing(keep.info.run_id, tags=stale)
                    self.counts["retagged"] += 1
        todo = [r for k, r in stored.items() if self._children.get(k, ("", "RUNNING"))[1] == "RUNNING"]
        self._say(f"{len(stored)} stored rows, {len(by_key)} child runs found: {len(todo)} to log")
        shown_at = time.monotonic()
        for i, record in enumerate(todo, 1):
            self._log_record(record)
            if time.monotonic() - shown_at > 2.0 or i == len(todo):
                self._say(f"logged {i}/{len(todo)} child runs")
                shown_at = time.monotonic()

    def _display_tags(self, metrics: dict) -> dict[str, str]:
        """The tags of a child run that only show its row (numbers as text, its run folder)."""
        return {**shown_tags(metrics), RUN_FOLDER: self._run_folder}

    def _log_missing(
        self, run_id: str, *, params=None, metrics=None, tags=None, steps=None, timestamp=None, existing=None
    ) -> None:
        """log_batch in chunks of MLflow's limits (100 params, 100 tags, 1000 values per call); params
        already on the run are left alone (a param cannot change, and an equal one is a no-op)."""
        from mlflow.entities import Metric, Param, RunTag

        now = timestamp or int(time.time() * 1000)
        have = existing if existing is not None else {}
        m = [Metric(k, float(v), now, 0) for k, v in (metrics or {}).items()]
        for key, series in (steps or {}).items():
            m += [Metric(key, float(v), now, i) for i, v in enumerate(series)]
        p = [Param(k, str(v)[:_MAX_PARAM]) for k, v in (params or {}).items() if k not in have]
        t = [RunTag(k, str(v)[:_MAX_TAG]) for k, v in (tags or {}).items()]
        while m or p or t:
            bp, p, bt, t = p[:100], p[100:], t[:100], t[100:]
            room = 1000 - len(bp) - len(bt)
            bm, m = m[:room], m[room:]
            self._client.log_batch(run_id, metrics=bm, params=bp, tags=bt)

    def _log_record(self, record: dict) -> None:
        params, metrics, tags, steps = child_values(record)  # the shown tags among them
        tags[RUN_FOLDER] = self._run_folder
        start, end = trial_times(record)
        known = self._children.get(record[M.KEY])
        if known is None:
            run = self._client.create_run(
                self.experiment_id,
                start_time=start,
                run_name=run_name(record),
                tags={M.KEY: record[M.KEY], "mlflow.parentRunId": self.parent_run_id},
            )
            run_id, have = run.info.run_id, {}
            self._children[record[M.KEY]] = (run_id, "RUNNING")  # a retry completes it, never a second run
            self.counts["logged"] += 1
        else:
            run_id, have = known[0], self._client.get_run(known[0]).data.params
            self.counts["completed"] += 1
        self._log_missing(run_id, params=params, metrics=metrics, tags=tags, steps=steps, timestamp=end, existing=have)
        status = run_status(record)
        self._client.set_terminated(run_id, status, end_time=end)
        self._children[record[M.KEY]] = (run_id, status)

    @_timed
    def _log_trial(self, record: dict) -> None:
        if self.parent_run_id is None:
            return
        known = self._children.get(record[M.KEY])
        if known is not None and known[1] != "RUNNING":
            return  # already a finished child run of this row
        try:
            self._retrying(lambda: self._log_record(record))
        except Exception as exc:  # noqa: BLE001
            self._disable(f"could not log trial {record.get(M.KEY)}", exc)

    @_timed
    def _catch_up(self, store: ResultsStore) -> None:
        """At the sweep's end, after an error that disabled logging mid-sweep (the run was started):
        reconcile once, as `relog` would, so the rows written since are not missing from MLflow."""
        if self.enabled or self.parent_run_id is None or self._client is None:
            return
        reason, self.enabled = self.disabled_reason, True
        try:
            self._say(f"catching up after: {reason}")
            self._retrying(lambda: self._reconcile(store))
        except Exception as exc:  # noqa: BLE001
            self.enabled, self.disabled_reason = False, reason
            warnings.warn(f"MLflow catch-up failed too ({type(exc).__name__}); run `{M.suite_command()} relog RUN_DIR`")
            return
        self.disabled_reason, self.caught_up = None, reason

    @_timed
    def _finish(self, store: ResultsStore, status: str = "FINISHED", end_ms: Optional[int] = None) -> None:
        if self.parent_run_id is None:
            return
        try:
            self._say("attaching the store's files and the trials table to the parent run")
            for name in (CONFIG, ENVIRONMENT, TRIALS, PARQUET):
                path = store.run_dir / name
                if path.exists():

                    def log(p: Path = path) -> None:
                        self._client.log_artifact(self.parent_run_id, str(p), artifact_path="results")

                    self._retrying(log)
            self._retrying(lambda: self._log_table(store))
            self._retrying(lambda: self._client.set_terminated(self.parent_run_id, status, end_time=end_ms))
        except Exception as exc:  # noqa: BLE001
            self._disable("could not finish the sweep's run", exc)

    def _log_table(self, store: ResultsStore) -> None:
        """The trials as one table on the parent run (MLflow's artifact view shows it as a grid)."""
        import pandas as pd

        cols = (
            (M.KEY,)
            + IDENTITY
            + (
                M.STATUS,
                M.TIME_MS_MEDIAN,
                M.TIME_MS_MIN,
                M.TIME_MS_MAX,
                M.TFLOPS_PER_GPU,
                M.BYTES_SENT,
                M.ERR["out"],
                M.PPL,
                M.REASON,
            )
        )
        latest = store.latest_rows()[0]  # a key written twice: once
        # the variants some row sets (a soft cap, ...): rows of other values are other trials
        cols += tuple(c for c in M.VARIANT_IDENTITY if any(r.get(c) is not None for r in latest))
        rows = [{c: r.get(c) for c in cols} for r in latest]
        if not rows:
            return
        # written here and logged as a file, in log_table's format and with its tag: log_table
        # itself appends to a table already there, which would repeat every row on each relog
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / TABLE
            pd.DataFrame(rows).to_json(path, orient="split", index=False, date_format="iso")
            self._client.log_artifact(self.parent_run_id, str(path))
        logged = json.loads(self._client.get_run(self.parent_run_id).data.tags.get("mlflow.loggedArtifacts", "[]"))
        if {"path": TABLE, "type": "table"} not in logged:
            self._client.set_tag(
                self.parent_run_id, "mlflow.loggedArtifacts", json.dumps(logged + [{"path": TABLE, "type": "table"}])
            )


def make_tracker(enabled: bool, uri: Optional[str], experiment: str, results_root: str):
    if not enabled:
        return NullTracker()
    return MlflowTracker(uri or default_uri(results_root), experiment, results_root)


def relog(
    run_dir: str | Path,
    uri: Optional[str] = None,
    experiment: Optional[str] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> MlflowTracker:
    """Reconcile MLflow with a stored sweep (results folder): its existing parent run (a new one if
    this store has none) gets every stored row as a child run, each once. progress: told each step
    (from the logging thread)."""
    from omegaconf import OmegaConf

    store = ResultsStore.open(run_dir)
    cfg = OmegaConf.to_container(OmegaConf.load(store.run_dir / CONFIG), resolve=True)
    if not isinstance(cfg, dict):
        raise ValueError(f"{store.run_dir / CONFIG} is not a mapping of a sweep's config")
    name = str(cfg.get("name"))
    root = (cfg.get("results") or {}).get("root", "results")
    tracking = cfg.get("tracking") or {}
    stored = tracking.get("uri")
    if not uri and stored and "***" in str(stored):
        # the folder's config holds the URI redacted (its credentials are never stored)
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            raise ValueError(
                f"{store.run_dir} was logged to {stored} (stored without its credentials); give the URI "
                f"with --uri or set MLFLOW_TRACKING_URI"
            )
        stored = None
    tracker = MlflowTracker(uri or stored or default_uri(root), experiment or tracking.get("experiment") or name, root)
    tracker.say = progress
    env = store.read_json(ENVIRONMENT) or {}
    tracker.start(
        store,
        sweep=name,
        params=config_params(cfg),
        environment=env,
        description=str(cfg.get("description") or ""),
        resume=True,
        started_ms=_ms(env.get("timestamp")),
    )
    ends = [trial_times(r)[1] for r in store.iter_records()]
    tracker.finish(store, end_ms=max(ends) if ends else None)  # the parent's Duration: the sweep's, not now
    return tracker


def _ms(iso: Optional[str]) -> Optional[int]:
    try:
        return int(datetime.fromisoformat(str(iso)).timestamp() * 1000) if iso else None
    except ValueError:
        return None
