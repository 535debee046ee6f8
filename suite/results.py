"""The results store: the source of truth of every sweep (docs/DESIGN.md section 8).

    results/<sweep name>/<YYYYmmdd-HHMMSS>[-<N>]/   (-<N>: the N-th run started in the same second)
        config.yaml        the resolved config
        environment.json   hardware and software fingerprint
        trials.jsonl       one JSON row per trial, appended and fsync'ed as each trial ends
        trials.parquet     the same rows, written when the sweep ends (and on resume)
        mlflow.json        the MLflow parent run this folder was logged to (if any)
        resumes.jsonl      each `--resume --force` that changed a setting: what changed, and when
        .lock              held (fcntl) by the one process writing the folder; it holds that pid

Killing a sweep loses at most the trial in flight; `--resume` skips the keys already recorded.
Only the parent process writes here, and only one process at a time (`lock`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator, Optional

TRIALS = "trials.jsonl"
PARQUET = "trials.parquet"
CONFIG = "config.yaml"
ENVIRONMENT = "environment.json"
MLFLOW = "mlflow.json"
RESUMES = "resumes.jsonl"
LOCK = ".lock"
SYNC_EVERY_S = 1.0


def _stamp_order(path: Path) -> tuple[str, int]:
    """Folders in the order they were created: `<stamp>`, `<stamp>-2`, ..., `<stamp>-10` (by name
    alone `-10` would sort before `-2`)."""
    name = path.name
    if name[15:16] == "-" and name[16:].isdigit():
        return name[:15], int(name[16:])
    return name, 1


class StoreError(RuntimeError):
    """The results folder cannot be written as asked (in use, another sweep's, disk full...): a
    one-line message for the user, never a traceback."""


class StoreLocked(StoreError):
    """Another process writes this results folder."""


class ResultsStore:
    """One sweep run's folder."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.trials_path = self.run_dir / TRIALS
        self.damaged: list[str] = []  # "file:line: why" of each row the last read skipped
        self._lock_fd: Optional[int] = None
        self._synced = 0.0  # when trials.jsonl was last fsync'ed
        self._warned: set[str] = set()

    # -- one writer per folder ----------------------------------------------------------------------
    def lock(self) -> "ResultsStore":
        """Own the folder until `unlock` or this process ends (the OS drops the lock of a killed
        process, so a kill -9 never leaves a stale lock). Raises StoreLocked naming the holder's pid:
        two writers would time trials on the same cores and append the same keys twice."""
        path = self.run_dir / LOCK
        if self.trials_path.exists() and not self.trials_path.is_file():
            raise StoreError(f"{self.trials_path} is not a file (a folder?): this is not a results folder to write")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:  # a read-only folder (--resume of a copy on a read-only mount): one line
            raise StoreError(
                f"cannot write to the run folder {self.run_dir}: {exc.strerror or exc} (make it writable, "
                f"or copy it somewhere writable and --resume the copy)"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise StoreLocked(
                    f"{self.run_dir} is being written by another sweep (pid {holder}); wait for "
                    f"it to end, or run elsewhere (a new run folder)"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        if self.trials_path.exists():
            self._drop_torn_tail()  # only the writer cuts, under the lock: a live writer may be mid-line
        return self

    def unlock(self) -> None:
        if self._lock_fd is not None:
            self.sync()
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    # -- creating and reopening ------------------------------------------------------------------
    @classmethod
    def create(cls, root: str | Path, sweep: str, config_yaml: str, environment: dict) -> "ResultsStore":
        """A new run folder <root>/<sweep>/<time>[-<N>]. Two processes starting in the same second (the
        jobs of a Hydra multirun) get distinct folders: mkdir is the claim, only one can create a name."""
        base = Path(root) / sweep
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir, n = base / stamp, 1
        try:
            base.mkdir(parents=True, exist_ok=True)
            while True:
                try:
                    run_dir.mkdir()
                    break
                except FileExistsError:  # another sweep took this name: the next number
                    n += 1
                    run_dir = base / f"{stamp}-{n}"
            store = cls(run_dir).lock()
            (run_dir / CONFIG).write_text(config_yaml)
            store.write_json(ENVIRONMENT, environment)
            store.trials_path.touch()
        except OSError as exc:  # a read-only or invalid results.root, a full disk: one line, no traceback
            raise StoreError(
                f"cannot create the run folder {run_dir}: {exc.strerror or exc} (set results.root to "
                f"a writable folder, or free space)"
            ) from None
        return store

    @classmethod
    def runs(cls, root: str | Path, sweep: str) -> list["ResultsStore"]:
        """Every run folder of `sweep` under `root`, the newest first."""
        base = Path(root) / sweep
        found = (
            sorted((p for p in base.glob("*") if (p / TRIALS).exists()), key=_stamp_order, reverse=True)
            if base.exists()
            else []
        )
        return [cls(p) for p in found]

    @classmethod
    def latest(cls, root: str | Path, sweep: str) -> Optional["ResultsStore"]:
        runs = cls.runs(root, sweep)
        return runs[0] if runs else None

    @classmethod
    def open(cls, run_dir: str | Path) -> "ResultsStore":
        store = cls(Path(run_dir))
        if not store.trials_path.exists():
            raise FileNotFoundError(f"{run_dir} is not a results folder (no {TRIALS})")
        if not store.trials_path.is_file():
            raise StoreError(f"{run_dir} is not a results folder ({TRIALS} is not a file)")
        return store

    def _drop_torn_tail(self) -> None:
        """A sweep killed mid-write can leave a partial last line; the next writer cuts it off before
        appending (readers skip it).
        Reads backwards from the end (the store can hold tens of thousands of rows)."""
        with open(self.trials_path, "r+b") as f:
            end = f.seek(0, os.SEEK_END)
            pos = end
            while pos > 0:
                start = max(0, pos - 65536)
                f.seek(start)
                chunk = f.read(pos - start)
                if pos == end and chunk.endswith(b"\n"):
                    return
                cut = chunk.rfind(b"\n")
                if cut >= 0:
                    f.truncate(start + cut + 1)
                    return
                pos = start
            if end:
                f.truncate(0)

    # -- writing ------------------------------------------------------------------------------------
    def append(self, record: dict) -> None:
        """Add one row. The line goes to the kernel in unbuffered writes before this returns, so a
        killed sweep (kill -9 included) keeps it; fsync, which only a power cut or an OS crash needs,
        runs at most once per SYNC_EVERY_S (once per trial cost more than the harness's whole
        budget per trial at the main sweep's scale) and when the folder is unlocked. A write that
        fails (disk full) is cut back to the last whole line and raises StoreError."""
        # NaN and +-inf stay numbers (Python's JSON writes and reads NaN/Infinity): a NaN error must
        # not read back as "not checked" (None), and Parquet needs one type per column.
        line = (json.dumps(record, sort_keys=False) + "\n").encode("utf-8")
        fd = os.open(self.trials_path, os.O_WRONLY | os.O_APPEND)
        try:
            start = os.fstat(fd).st_size
            try:
                view = memoryview(line)
                while view:
                    view = view[os.write(fd, view) :]
            except OSError as exc:
                try:
                    os.ftruncate(fd, start)
                    kept = "every earlier row is complete"
                except OSError:
                    kept = "its last line is partial and is skipped on reading"
                raise StoreError(
                    f"could not write a row to {self.trials_path}: {exc.strerror or exc} ({kept}; "
                    f"free space, then continue with --resume)"
                ) from None
            now = time.monotonic()
            if now - self._synced >= SYNC_EVERY_S:
                os.fsync(fd)
                self._synced = now
        finally:
            os.close(fd)

    def sync(self) -> None:
        """fsync trials.jsonl (what survives a power cut)."""
        if self.trials_path.exists():
            fd = os.open(self.trials_path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self._synced = time.monotonic()

    def record_resume(self, changes: dict[str, tuple[Any, Any]]) -> None:
        """Note a forced resume's changed settings ({key: (recorded, now)}) in resumes.jsonl."""
        entry = {
            "time": datetime.now().isoformat(timespec="seconds"),
            "pid": os.getpid(),
            "changed": {k: {"recorded": a, "now": b} for k, (a, b) in changes.items()},
        }
        with open(self.run_dir / RESUMES, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, default=str) + "\n")

    def write_json(self, name: str, data: Any) -> None:
        tmp = self.run_dir / (name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
        tmp.replace(self.run_dir / name)

    def read_json(self, name: str) -> Optional[Any]:
        path = self.run_dir / name
        return json.loads(path.read_text()) if path.exists() else None

    # -- reading ------------------------------------------------------------------------------------
    def records(self) -> list[dict]:
        return list(self.iter_records())

    def iter_records(self) -> Iterator[dict]:
        """The stored rows in order. A damaged line (garbage, NULs, bytes that are not UTF-8, a row
        without a key) is skipped with a warning naming file:line and noted in `damaged`, so that
        one bad line neither blocks --resume and report nor counts as a trial. `damaged` is replaced
        once a read ends (each read collects its own notes: the tracker's thread may read while the
        sweep does)."""
        damaged: list[str] = []
        if not self.trials_path.exists():
            self.damaged = damaged
            return
        with open(self.trials_path, "rb") as f:
            for number, raw in enumerate(f, 1):
                if not raw.endswith(b"\n"):
                    self._skip(damaged, number, "partial last line (a write that did not finish)")
                    break
                try:
                    row = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, ValueError) as exc:
                    self._skip(damaged, number, f"not a JSON row: {type(exc).__name__}: {str(exc)[:80]}")
                    continue
                if not isinstance(row, dict) or not isinstance(row.get("key"), str) or not row["key"]:
                    self._skip(damaged, number, "not a trial row (no key)")
                    continue
                yield row
        self.damaged = damaged

    def _skip(self, damaged: list[str], number: int, why: str) -> None:
        note = f"{self.trials_path}:{number}: {why}; the line is skipped"
        damaged.append(note)
        if note not in self._warned:  # once per line, however often this handle reads the file
            self._warned.add(note)
            warnings.warn(note, RuntimeWarning, stacklevel=3)

    def completed_keys(self) -> set[str]:
        return {r["key"] for r in self.iter_records()}

    def latest_rows(self) -> tuple[list[dict], int]:
        """(one row per key, the latest where a key was written twice; how many earlier duplicates
        were dropped). Two writers of one folder (before the lock existed) or a forced resume can
        leave a key twice; counting both would count the trial twice."""
        rows: dict[str, dict] = {}
        n = 0
        for row in self.iter_records():
            n += 1
            rows.pop(row["key"], None)  # re-insert: the latest row takes the latest position
            rows[row["key"]] = row
        return list(rows.values()), n - len(rows)

    def compact(self) -> Optional[Path]:
        """Write trials.parquet from trials.jsonl (the JSON lines stay the source of truth)."""
        import pandas as pd

        rows = self.records()
        if not rows:
            return None
        df = pd.DataFrame(rows)
        for col in ("time_ms_samples",):  # lists become JSON text: parquet needs one type per column
            if col in df:
                df[col] = df[col].map(lambda v: None if v is None else json.dumps(v))
        out = self.run_dir / PARQUET
        tmp = self.run_dir / (PARQUET + ".tmp")
        df.to_parquet(tmp, index=False)
        tmp.replace(out)
        return out


def mlflow_client_uri(uri: Optional[str]) -> Optional[str]:
    """The URI to hand MLflow's client, with the user info of `uri` moved out of it: MLflow prints
    the server's address as given ("View run NAME at: URI" when a run ends, its request errors), so
    a URI carrying user:password@ put them on the console. The credentials go where MLflow reads
    them instead (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, sent as basic auth as
    before), and MLflow's own run links are switched off (the suite prints its own, redacted).
    `uri` None: MLflow's default ($MLFLOW_TRACKING_URI), treated the same way. It lives here, in
    the bottom layer, because both the tracker and the reports (which load no torch) open clients."""
    from urllib.parse import unquote, urlsplit, urlunsplit

    os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    given = uri if uri is not None else os.environ.get("MLFLOW_TRACKING_URI")
    if not given or "://" not in given:
        return uri
    try:
        parts = urlsplit(given)
    except ValueError:
        return uri
    if "@" not in parts.netloc or parts.scheme.startswith(("sqlite", "file")):
        return given if uri is not None else None
    userinfo, host = parts.netloc.rsplit("@", 1)
    user, _, password = userinfo.partition(":")
    os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(user)
    if password:
        os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(password)
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
