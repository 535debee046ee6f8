"""Reports regenerated from stored results: tables (Markdown, LaTeX, CSV), figures (PNG, PDF) and
one self-contained HTML page (docs/DESIGN.md section 9). Nothing is rerun.

    python -m suite report [RESULTS_DIR ...] [--out reports/NAME] [--baseline ring]
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from suite.reports.load import ResultSet, combine, load_mlflow, load_runs, resolve_runs


@dataclass
class Report:
    out_dir: Path
    html: Path
    tables: dict = field(default_factory=dict)      # name -> {fmt: path}
    figures: list = field(default_factory=list)     # paths (PNG and PDF)
    notes: list = field(default_factory=list)
    rows: int = 0
    seconds: float = 0.0
    logged_to: list = field(default_factory=list)   # MLflow parent runs the HTML was attached to


def build_report(paths: list[str] | None = None, *, out: Optional[str | Path] = None, baseline: str = "ring",
                 results_root: str | Path = "results", mlflow_experiment: Optional[str] = None,
                 mlflow_uri: Optional[str] = None, log_to_mlflow: bool = True) -> Report:
    """Read the runs (and optionally an MLflow experiment), write tables, figures and the HTML."""
    from suite.reports.figures import build_figures
    from suite.reports.html import write_html
    from suite.reports.tables import build_tables, with_series, write_tables

    t0 = time.perf_counter()
    sets: list[ResultSet] = []
    if paths or not mlflow_experiment:
        sets.append(load_runs(resolve_runs(list(paths or []), results_root)))
    if mlflow_experiment:
        sets.append(load_mlflow(mlflow_experiment, mlflow_uri))
    data = combine(sets)
    df = with_series(data.frame)
    name = "+".join(dict.fromkeys(s.sweep for s in data.sources)) or "report"
    out_dir = Path(out) if out else Path("reports") / name
    out_dir.mkdir(parents=True, exist_ok=True)

    tables = build_tables(df, baseline)
    written = write_tables(tables, out_dir / "tables")
    figures, notes = build_figures(df, out_dir / "figures", baseline) if not df.empty else ([], ["no rows"])
    html = write_html(out_dir / "report.html", title=f"Sequence-parallel attention: {name}", tables=tables,
                      figure_pngs=[f for f in figures if f.endswith(".png")], sources=data.sources, notes=notes,
                      rows=len(df), executors=sorted(df["executor"].dropna().unique()) if not df.empty else [])
    report = Report(out_dir, html, written, figures, notes, len(df))
    if log_to_mlflow:
        report.logged_to = _log_html(html, data.sources)
    report.seconds = time.perf_counter() - t0
    return report


def _log_html(html: Path, sources) -> list[str]:
    """Attach the page to the MLflow parent run of every source run that was logged to MLflow."""
    import json

    logged = []
    for src in sources:
        meta = Path(src.run_dir) / "mlflow.json"
        if not meta.exists():
            continue
        info = json.loads(meta.read_text())
        try:
            from mlflow.tracking import MlflowClient
            MlflowClient(info["uri"]).log_artifact(info["parent_run_id"], str(html), artifact_path="report")
            logged.append(info["parent_run_id"])
        except Exception as exc:  # noqa: BLE001 - the report on disk is what matters
            warnings.warn(f"could not attach the report to MLflow run {info.get('parent_run_id')}: {exc}",
                          RuntimeWarning, stacklevel=2)
    return logged
