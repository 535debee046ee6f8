"""Reports regenerated from stored results: tables (Markdown, LaTeX, CSV), figures (PNG, PDF) and
one self-contained HTML page (docs/DESIGN.md section 9). Nothing is rerun.

    python -m suite report [RESULTS_DIR ...] [--out reports/NAME] [--baseline ring]

Layering: this package reads stored rows only (suite.results, suite.metrics); it never imports
torch, Hydra, `methods` or the planner, so a report is quick to start and runs anywhere.
"""

from __future__ import annotations

import difflib
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from suite.reports.load import ResultSet, combine, load_mlflow, load_runs, resolve_runs

DEFAULT_BASELINE = "ring"


class ReportError(ValueError):
    """A report that cannot be made as asked (e.g. a baseline method the runs do not have)."""


@dataclass
class Report:
    out_dir: Path
    html: Path
    tables: dict = field(default_factory=dict)  # name -> {fmt: path}
    figures: list = field(default_factory=list)  # paths (PNG and PDF)
    notes: list = field(default_factory=list)
    rows: int = 0
    seconds: float = 0.0
    logged_to: list = field(default_factory=list)  # MLflow parent runs the HTML was attached to
    redrawn: int = 0  # figures drawn (the others were unchanged)
    read_notes: list = field(default_factory=list)  # what reading the store skipped or de-duplicated


def build_report(
    paths: list[str] | None = None,
    *,
    out: Optional[str | Path] = None,
    baseline: Optional[str] = None,
    results_root: str | Path = "results",
    mlflow_experiment: Optional[str] = None,
    mlflow_uri: Optional[str] = None,
    log_to_mlflow: bool = True,
    progress: Optional[Callable[[str], None]] = None,
    workers: Optional[int] = None,
) -> Report:
    """Read the runs (and optionally an MLflow experiment), write tables, figures and the HTML.

    baseline: the method speedups divide by; None means `ring` where the runs have it (no speedup
    otherwise). A named baseline the runs do not have is an error that lists the methods they have.
    progress: called with one line per step (reading, tables, each figure drawn, page).
    """
    from suite.reports.figures import plan_figures, render_figures
    from suite.reports.html import write_html
    from suite.reports.render import write_tables
    from suite.reports.style import palette_for
    from suite.reports.tables import build_tables
    from suite.reports.tables.rows import with_series

    say = progress or (lambda _line: None)
    t0 = time.perf_counter()
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise ReportError(f"--out: {out} is a file; name a folder for the report")
    for parent in Path(out or ".").parents:
        if parent.exists() and not parent.is_dir():
            raise ReportError(f"--out: {parent} is a file, so the report folder {out} cannot be made under it")
    sets: list[ResultSet] = []
    selection: list[str] = []  # what choosing the runs left out
    if paths or not mlflow_experiment:
        sets.append(load_runs(resolve_runs(list(paths or []), results_root, selection)))
    if mlflow_experiment:
        sets.append(load_mlflow(mlflow_experiment, mlflow_uri))
    data = combine(sets)
    if not data.sources and data.notes:  # every folder named was skipped: nothing to report on
        raise ReportError(
            f"no readable results: {data.notes[0]}"
            + (f" (and {len(data.notes) - 1} more)" if len(data.notes) > 1 else "")
        )
    data.notes[:0] = selection
    df = with_series(data.frame)
    say(f"read {len(df)} rows from {len(data.sources)} run(s) in {time.perf_counter() - t0:.1f}s")
    base = _baseline(df, baseline)
    name = "+".join(dict.fromkeys(s.sweep for s in data.sources)) or "report"
    out_dir = Path(out) if out else Path("reports") / name
    out_dir.mkdir(parents=True, exist_ok=True)

    tables = build_tables(df, base or DEFAULT_BASELINE)
    written = write_tables(tables, out_dir / "tables")
    say(f"wrote {len(written)} tables (md, tex, csv) in {time.perf_counter() - t0:.1f}s")
    palette = palette_for(df)
    jobs, notes = plan_figures(df, base) if not df.empty else ([], ["no rows"])
    if baseline is None and base is None and not df.empty:
        notes.append(f"speedup: no {DEFAULT_BASELINE} rows; name a baseline with --baseline")

    def figure_progress(done: int, total: int) -> None:
        if total:
            say(f"figures {done}/{total} ({time.perf_counter() - t0:.1f}s)")

    files, drawn = render_figures(jobs, palette, out_dir / "figures", workers=workers, progress=figure_progress)
    if len(jobs) > drawn:
        say(f"{len(jobs) - drawn} of {len(jobs)} figures unchanged since the last report in {out_dir} (not redrawn)")
    figures = [p for job in jobs for p in files[job.name]]
    html = write_html(
        out_dir / "report.html",
        title=f"Sequence-parallel attention: {name}",
        tables=tables,
        jobs=jobs,
        files=files,
        sources=data.sources,
        notes=data.notes + notes,
        df=df,
    )
    _remove_stale(
        out_dir / "tables",
        {Path(p).name for paths in written.values() for p in paths.values()},
        (".md", ".tex", ".csv"),
    )
    _remove_stale(
        out_dir / "figures",
        {Path(p).name for p in figures} | {f".{j.name}.key" for j in jobs},
        (".png", ".pdf", ".key"),
    )
    say(f"wrote {html} ({time.perf_counter() - t0:.1f}s)")
    report = Report(out_dir, html, written, figures, notes, len(df), redrawn=drawn, read_notes=list(data.notes))
    logged = [s for s in data.sources if (Path(s.run_dir) / "mlflow.json").exists()] if log_to_mlflow else []
    if logged:
        pngs = [Path(p) for p in figures if str(p).endswith(".png")]
        say(
            f"attaching the page and {len(pngs)} figures to {len(logged)} MLflow run(s) "
            f"(importing MLflow takes a few seconds)"
        )
        report.logged_to = _log_html(html, logged, pngs)
        say(f"attached to MLflow ({time.perf_counter() - t0:.1f}s)")
    report.seconds = time.perf_counter() - t0
    return report


def _remove_stale(folder: Path, keep: set[str], suffixes: tuple[str, ...]) -> None:
    """Delete what an earlier report left in `folder` that this one did not write (a table or
    figure of data no longer there), so the folder holds exactly this report."""
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        if path.is_file() and path.suffix in suffixes and path.name not in keep:
            path.unlink()


def _baseline(df, baseline: Optional[str]) -> Optional[str]:
    """The baseline to use, or a ReportError naming the methods the rows have."""
    methods = sorted(df["method"].dropna().unique()) if not df.empty else []
    if baseline is None:
        return DEFAULT_BASELINE if DEFAULT_BASELINE in methods else None
    if baseline not in methods:
        close = difflib.get_close_matches(baseline, methods, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ReportError(
            f"--baseline {baseline!r} is not a method of these runs (they have: "
            f"{', '.join(methods) or 'no rows'}).{hint}"
        )
    return baseline


def _log_html(html: Path, sources, pngs: Sequence[Path] = ()) -> list[str]:
    """Attach the page and its figures (PNG) to the MLflow parent run of every source run that was
    logged to MLflow. The figures are drawn in worker processes, so the files are logged, not
    figure objects."""
    import json
    import os

    logged = []
    for src in sources:
        meta = Path(src.run_dir) / "mlflow.json"
        if not meta.exists():
            continue
        info = json.loads(meta.read_text())
        uri = info["uri"]
        if "***@" in uri:  # stored without its credentials: they come from the environment again
            uri = os.environ.get("MLFLOW_TRACKING_URI", uri)
        try:
            from mlflow.tracking import MlflowClient

            from suite.results import mlflow_client_uri

            client = MlflowClient(mlflow_client_uri(uri))
            client.log_artifact(info["parent_run_id"], str(html), artifact_path="report")
            for png in pngs:
                client.log_artifact(info["parent_run_id"], str(png), artifact_path="report/figures")
            logged.append(info["parent_run_id"])
        except Exception as exc:  # noqa: BLE001 - the report on disk is what matters
            warnings.warn(
                f"could not attach the report to MLflow run {info.get('parent_run_id')}: {type(exc).__name__}",
                RuntimeWarning,
                stacklevel=2,
            )
    return logged
