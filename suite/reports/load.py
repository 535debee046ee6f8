"""Read stored results into one table (several sweeps at once), without rerunning anything.

Sources: results folders (`results/<sweep>/<time>/`, or a sweep folder `results/<sweep>/`, read
as its latest run; with none named, the latest run of every sweep the user ran: the advisor's own
simulated sweeps only when named), and optionally an MLflow experiment (its child runs, for stores that only
live in MLflow). Every row keeps where it came from (`sweep`, `run_dir`) and its `executor`, so
measured and simulated rows are never mistaken for each other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pandas as pd

from suite import metrics as M
from suite.results import CONFIG, ENVIRONMENT, TRIALS, ResultsStore


@dataclass
class Source:
    """One run that a report draws on."""

    sweep: str
    run_dir: str
    config_yaml: str = ""
    environment: dict = field(default_factory=dict)
    rows: int = 0


@dataclass
class ResultSet:
    frame: pd.DataFrame
    sources: list[Source]
    notes: list[str] = field(default_factory=list)  # what was read differently from what is stored


# How `suite advise` describes the simulated sweep it runs for itself (suite/advise/ranking.py,
# build_config; tests/test_reports.py checks the two agree). Its results are the advisor's
# working, not a sweep the user ran: a report of "everything" leaves them out.
ADVISOR_DESCRIPTION = "suite advise:"


def is_advisor_run(run_dir: Path) -> bool:
    """Whether a run folder holds the advisor's own simulated sweep (its resolved config says so)."""
    import yaml

    try:
        cfg = yaml.safe_load((Path(run_dir) / CONFIG).read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return False
    if not isinstance(cfg, dict):
        return False
    run = cfg.get("run")
    if not isinstance(run, dict):
        run = {}
    return str(cfg.get("description") or "").startswith(ADVISOR_DESCRIPTION) and run.get("executor") == "sim"


def resolve_runs(paths: list[str | Path], root: str | Path = "results", notes: Optional[list] = None) -> list[Path]:
    """Results folders from user paths: a run folder, a sweep folder (its latest run), or, with no
    paths, the latest run of every sweep under `root` but the advisor's (said in `notes`)."""
    if not paths:
        root = Path(root)
        sweeps = sorted(p for p in root.glob("*") if p.is_dir()) if root.exists() else []
        found = [run.run_dir for s in sweeps if (run := ResultsStore.latest(root, s.name)) is not None]
        advisor = [r for r in found if is_advisor_run(r)]
        found = [r for r in found if r not in advisor]
        if advisor and notes is not None:
            notes.append(
                f"left out the advisor's simulated sweep(s) {', '.join(r.parent.name for r in advisor)} "
                f"(name one, e.g. {advisor[0].parent}, to report it)"
            )
        if not found:
            hint = f"; {len(advisor)} advisor sweep(s) left out: name one to report it" if advisor else ""
            raise FileNotFoundError(f"no results under {root}/ (run a sweep first, or name RESULTS_DIR{hint})")
        return found
    runs = []
    for p in map(Path, paths):
        if (p / TRIALS).exists():
            runs.append(p)
        elif p.is_dir() and (latest := ResultsStore.latest(p.parent, p.name)) is not None:
            runs.append(latest.run_dir)
        else:
            raise FileNotFoundError(f"{p} is neither a results run folder (with {TRIALS}) nor a sweep folder")
    return runs


def load_runs(run_dirs: list[Path]) -> ResultSet:
    """Every run's rows: one per trial key (the latest, where a key was written twice), damaged
    lines skipped, and a run that cannot be read at all skipped; each of these is said in `notes`
    (a report over many sweeps must not fail, nor count silently, because of one)."""
    import warnings

    frames, sources, notes = [], [], []
    for run_dir in run_dirs:
        store = ResultsStore(run_dir)
        try:
            with warnings.catch_warnings():  # each damaged line is said once, in the notes
                warnings.simplefilter("ignore", RuntimeWarning)
                rows, duplicates = store.latest_rows()
            config = (run_dir / CONFIG).read_text() if (run_dir / CONFIG).exists() else ""
            env = json.loads((run_dir / ENVIRONMENT).read_text()) if (run_dir / ENVIRONMENT).exists() else {}
        except (OSError, ValueError) as exc:
            notes.append(f"{run_dir}: skipped, it cannot be read ({type(exc).__name__}: {exc})")
            continue
        notes.extend(store.damaged)
        problems = [p for p in map(row_problem_of, rows) if p]
        if problems and len(problems) == len(rows):
            notes.append(f"{run_dir}: skipped, its rows are not trial rows ({problems[0]})")
            continue
        if problems:  # one malformed row must not take the folder's good rows with it
            rows = [r for r in rows if not row_problem_of(r)]
            notes.append(
                f"{run_dir}: {len(problems)} of {len(problems) + len(rows)} row(s) skipped, not trial "
                f"rows (first: {problems[0]})"
            )
        if duplicates:
            notes.append(
                f"{run_dir}: {duplicates} row(s) of keys recorded twice were dropped (the latest row of "
                f"each key is kept)"
            )
        sweep = run_dir.parent.name
        sources.append(Source(sweep, str(run_dir), config, env, len(rows)))
        if rows:
            df = pd.DataFrame(rows)
            df["sweep"], df["run_dir"] = sweep, str(run_dir)
            frames.append(df)
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return ResultSet(normalise(frame), sources, notes)


# What every stored row has had since the first version, with its type: a report groups and
# divides by these, so a row without them (or with text where a number belongs) is not a trial row.
REQUIRED_COLUMNS = {
    "method": str,
    "world_size": int,
    "batch": int,
    "seq_len": int,
    "heads": int,
    "kv_heads": int,
    "head_dim": int,
    "dtype": str,
    "pass": str,
    M.STATUS: str,
}


def row_problem_of(row: dict) -> str:
    """The first column of `row` that a report cannot use (missing, or of the wrong type), said in
    words naming the row's key and the column; "" when the row is usable."""
    where = f"row {str(row.get(M.KEY, '?'))[:16]}"
    for col, kind in REQUIRED_COLUMNS.items():
        value = row.get(col)
        if value is None:
            return f"{where} has no column {col!r}"
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{where}: column {col!r} is {value!r}, not {'an integer' if kind is int else 'text'}"
    for col in M.NUMERIC_METRICS:
        value = row.get(col)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"{where}: column {col!r} is {value!r}, not a number"
    return ""


def load_mlflow(experiment: str, uri: Optional[str] = None) -> ResultSet:
    """The child runs of an MLflow experiment as result rows (identity from params, numbers from
    metrics, status and reason from tags)."""
    from mlflow.tracking import MlflowClient

    DISPLAY_ONLY = (
        set(M.MLFLOW_SHOWN) | set(M.MLFLOW_SHOWN_BEFORE) | {M.MLFLOW_RUN_FOLDER}
    )  # tags that only show a row's numbers and folder in the UI
    from suite.results import mlflow_client_uri

    client_uri = mlflow_client_uri(uri)  # its user info moved to MLflow's variables: never printed
    client = MlflowClient(client_uri) if client_uri else MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise FileNotFoundError(f"no MLflow experiment named {experiment!r} at {client.tracking_uri}")
    rows = []
    for run in client.search_runs([exp.experiment_id], max_results=50000):
        tags = run.data.tags
        if "mlflow.parentRunId" not in tags:  # the sweep's own run
            continue
        row: dict[str, Any] = dict(run.data.params)
        row.update(run.data.metrics)
        row.update({k: v for k, v in tags.items() if not k.startswith("mlflow.") and k not in DISPLAY_ONLY})
        rows.append(row)
    out = pd.DataFrame(rows)
    if out.empty:
        return ResultSet(normalise(out), [Source(experiment, f"mlflow:{experiment}")])
    for col in (a.name for a in M.TRIAL_AXES if a.type in (int, float)):  # params are text
        if col in out:
            out[col] = pd.to_numeric(out[col], errors="coerce")
    for col in (*(a.name for a in M.TRIAL_AXES if a.type is bool), M.CHECKED):  # "False" must not read as true
        if col in out:
            out[col] = out[col].map(lambda v: str(v).lower() == "true")
    out["sweep"], out["run_dir"] = experiment, f"mlflow:{experiment}"
    return ResultSet(normalise(out), [Source(experiment, f"mlflow:{experiment}", rows=len(out))])


def combine(sets: list[ResultSet]) -> ResultSet:
    frames = [s.frame for s in sets if not s.frame.empty]
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return ResultSet(normalise(frame), [src for s in sets for src in s.sources], [n for s in sets for n in s.notes])


def _dims(r) -> str:
    """D, or D/Dv where the values' head dim differs from the query/key one (MLA)."""
    return f"{r['head_dim']}" if r["head_dim_v"] == r["head_dim"] else f"{r['head_dim']}/{r['head_dim_v']}"


def _read(axis: M.Axis, v):
    """A stored value of a variant axis as its type; the plain value where a row has none (rows of
    trials that did not set it, and rows from before the axis)."""
    if v is None or (not isinstance(v, str) and pd.isna(v)):
        return axis.default
    if axis.type is bool:
        return v is True or str(v).lower() == "true"
    return axis.type(v)


def normalise(df: pd.DataFrame) -> pd.DataFrame:
    """Every documented column present (missing ones as empty), derived labels added."""
    df = df.copy()
    for col in M.COLUMNS + ("sweep", "run_dir"):
        if col not in df:
            df[col] = None
    if df.empty:
        return df
    # the length mix (uniform, or packed documents of a named distribution) is part of the mask:
    # a document-causal mask is another problem than the causal one
    df["workload"] = df["workload"].fillna("")  # rows from before the column existed: one document each
    # a variant's identity, on rows that set it only (metrics.VARIANT_IDENTITY): the plain value
    # elsewhere, so that grouping by it never drops a row (a NaN key) nor splits plain rows
    for a in M.VARIANTS:
        col = df[a.name] if a.name in df else pd.Series(None, index=df.index, dtype=object)
        values = [_read(a, v) for v in col]
        if a.name == "head_dim_v":  # a missing value head dim is head_dim's (grouped and labelled as D=192/128)
            values = [int(h) if not v else v for h, v in zip(df["head_dim"], values)]
        df[a.name] = values
    sinks = df["sinks"] if "sinks" in df else pd.Series(None, index=df.index, dtype=object)
    df["sinks"] = [on is True or str(on).lower() == "true" for on in sinks]  # rows from before sinks: none
    df["mix"] = df["workload"].map(M.workload_label)
    # the row's own column: the full, parseable name ("" for the plain masks, whose flag is `causal`,
    # and rows from before the column)
    # (normalise runs again on combined sets: the label below replaces "mask", so derive once)
    if "mask_name" not in df or df["mask_name"].isna().any():
        df["mask_name"] = [m if isinstance(m, str) and m not in M.PLAIN_MASKS else "" for m in df["mask"]]
    df["family"] = [M.mask_label(m, c) for m, c in zip(df["mask_name"], df["causal"])]
    variants = df[list(M.VARIANT_IDENTITY)].to_dict("records")
    df["mask"] = [
        fam + M.variant_labels(v) + ("" if mix == "uniform" else f", {mix}")
        for fam, v, mix in zip(df["family"], variants, df["mix"])
    ]
    # shape: everything of the problem but its length, mask and pass (figures draw one shape at a
    # time: rows of different shapes are never averaged into one point)
    # rows as dicts: apply(axis=1) builds a Series per row (seconds at 10,000 rows)
    rows = df[["batch", "heads", "kv_heads", "head_dim", "head_dim_v", "dtype"]].to_dict("records")
    df["shape"] = [f"B={r['batch']} H={r['heads']}/{r['kv_heads']} D={_dims(r)} {r['dtype']}" for r in rows]
    df["config"] = [
        f"{shape} S={s} {mask} {p}" for shape, s, mask, p in zip(df["shape"], df["seq_len"], df["mask"], df["pass"])
    ]
    return df
