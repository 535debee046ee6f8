"""The results store: the source of truth of every sweep (docs/DESIGN.md section 8).

    results/<sweep name>/<YYYYmmdd-HHMMSS>/
        config.yaml        the resolved config
        environment.json   hardware and software fingerprint
        trials.jsonl       one JSON row per trial, appended and fsync'ed as each trial ends
        trials.parquet     the same rows, written when the sweep ends (and on resume)
        mlflow.json        the MLflow parent run this folder was logged to (if any)

Killing a sweep loses at most the trial in flight; `--resume` skips the keys already recorded.
Only the parent process writes here.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator, Optional

TRIALS = "trials.jsonl"
PARQUET = "trials.parquet"
CONFIG = "config.yaml"
ENVIRONMENT = "environment.json"
MLFLOW = "mlflow.json"


class ResultsStore:
    """One sweep run's folder."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.trials_path = self.run_dir / TRIALS

    # -- creating and reopening ------------------------------------------------------------------
    @classmethod
    def create(cls, root: str | Path, sweep: str, config_yaml: str, environment: dict) -> "ResultsStore":
        base = Path(root) / sweep
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir, n = base / stamp, 1
        while run_dir.exists():  # two sweeps started in the same second
            n += 1
            run_dir = base / f"{stamp}-{n}"
        run_dir.mkdir(parents=True)
        store = cls(run_dir)
        (run_dir / CONFIG).write_text(config_yaml)
        store.write_json(ENVIRONMENT, environment)
        store.trials_path.touch()
        return store

    @classmethod
    def latest(cls, root: str | Path, sweep: str) -> Optional["ResultsStore"]:
        base = Path(root) / sweep
        runs = sorted(p for p in base.glob("*") if (p / TRIALS).exists()) if base.exists() else []
        return cls(runs[-1]) if runs else None

    @classmethod
    def open(cls, run_dir: str | Path) -> "ResultsStore":
        store = cls(Path(run_dir))
        if not store.trials_path.exists():
            raise FileNotFoundError(f"{run_dir} is not a results folder (no {TRIALS})")
        store._drop_torn_tail()
        return store

    def _drop_torn_tail(self) -> None:
        """A sweep killed mid-write can leave a partial last line; cut it off before appending."""
        data = self.trials_path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self.trials_path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)

    # -- writing ------------------------------------------------------------------------------------
    def append(self, record: dict) -> None:
        # NaN and +-inf stay numbers (Python's JSON writes and reads NaN/Infinity): a NaN error must
        # not read back as "not checked" (None), and Parquet needs one type per column.
        line = json.dumps(record, sort_keys=False) + "\n"
        with open(self.trials_path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

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
        if not self.trials_path.exists():
            return
        with open(self.trials_path, encoding="utf-8") as f:
            for line in f:
                if not line.endswith("\n"):
                    break  # torn final line of a killed sweep
                yield json.loads(line)

    def completed_keys(self) -> set[str]:
        return {r["key"] for r in self.iter_records()}

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
