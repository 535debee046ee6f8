"""`python -m suite validate`: the simulator against published tables, as a command and a record.

Each file of configs/validate/ is a sweep with `run.executor: sim` that reproduces one published
table's setting, plus a `validation:` section holding the table's numbers row by row, their source
and unit, and how each row maps onto a simulated row. The command:

-> runs each sweep through the runner (rows stored under --results-root like any sweep; MLflow off
   unless --mlflow);
-> matches every published row to its simulated row(s): the row's `match` (identity columns, and
   `options` as a subset of the row's options) over the table's `defaults`; a list value (e.g. four
   document splits a benchmark cycles through) means the mean time over those rows; a measured peer
   that the simulator cannot trace yet is replaced by the row's `stand_in` method, and the row says so;
-> turns the time into the published unit (ms, iter/s, TFLOP/s, percent or speedup of a `baseline`
   row times `factor`) and the error = predicted / published - 1, in percent;
-> sorts each row into a family (suite/sim/bands.py: kernel- or comm-bound x topology kind) and
   prints, per table and per family, published vs predicted, mean, median and largest |error|;
-> writes the report (reports/recorded/sim_validation.md) and the record that ships with the package
   (configs/validate/bands.yaml), whose per-family means every simulated row carries as its band;
-> with --check, compares with the record instead: exit 1 when the mean |error| exceeds the recorded
   one by more than the record's margin, or any row's |error| exceeds its row limit.

Rows marked `counted: false` (a table's derived lines, e.g. percentages of its own iter/s rows) are
shown but not counted in any summary.

Validation is kept apart from fitting. A row says whether it may calibrate anything (`calibrates`,
per table under `validation:` or per row; default false): only a calibrating row (a single-GPU kernel
benchmark, never an end-to-end sequence-parallel result) may be a topology figure's source, and a
topology that took a figure from one names the row's source under `fitted_from` (each table's
`source.id`, default its file stem; tables of one publication share it). Besides the table above,
the command prints the leave-one-source-out error: each source's rows as predicted by a model that
never saw that source. No parameter is fitted in code, so a row's blind prediction is its own
unless a topology it runs on was fitted on its source; such rows cannot be predicted blind without
a figure from elsewhere, and are left out of the line and listed (as are calibrating rows):

    leave-one-source-out: N rows, K sources, mean X %, median Y %, max Z %
"""

from __future__ import annotations

import datetime as _dt
import functools
import itertools
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

import yaml

from suite import metrics as M
from suite.bundled import CONFIGS
from suite.sim.bands import BANDS, BOUNDS, Bands, Summary, bound_of, family, load_bands, topology_kind, write_bands

VALIDATE_DIR = CONFIGS / "validate"
REPORT = Path("reports/recorded/sim_validation.md")
UNITS = ("ms", "iter/s", "TFLOP/s", "percent", "speedup")
COMMAND = "python -m suite validate"


class ValidationError(ValueError):
    """A validation file that cannot be used, naming the file and the key."""


# -- the published tables ---------------------------------------------------------------------------
@dataclass
class PublishedRow:
    label: str
    value: float
    unit: str
    match: dict[str, Any]
    baseline: Optional[dict[str, Any]] = None  # percent / speedup: the row divided into
    factor: float = 1.0  # percent = 100 x factor x baseline time / time; speedup = factor x baseline / time
    counted: bool = True
    stand_in: Optional[dict[str, Any]] = None  # {method, options, note}: what stands in for a measured peer
    note: str = ""  # why a row is not counted, or any other caveat the report repeats
    calibrates: bool = False  # may be a topology figure's source (a single-GPU kernel benchmark row)


@dataclass
class PublishedTable:
    name: str  # the file's stem
    path: Path
    title: str
    source: dict[str, Any]
    notes: str
    rows: list[PublishedRow]
    source_id: str = ""  # the publication: tables of one source share it (leave-one-source-out)


def validation_files(root: Path = VALIDATE_DIR) -> list[Path]:
    """The files of `root` that hold a `validation:` section (bands.yaml, the record, holds none)."""
    return [p for p in sorted(root.glob("*.yaml")) if "validation" in (yaml.safe_load(p.read_text()) or {})]


def load_table(path: Path) -> PublishedTable:
    raw = yaml.safe_load(Path(path).read_text()) or {}
    v = raw.get("validation")
    where = f"{path}: validation"
    if not isinstance(v, dict):
        raise ValidationError(f"{path}: no `validation:` section")
    unit = v.get("unit")
    defaults = dict(v.get("defaults") or {})
    calibrates = v.get("calibrates", False)
    if not isinstance(calibrates, bool):
        raise ValidationError(f"{where}.calibrates: true or false, got {calibrates!r}")
    rows = []
    for i, r in enumerate(v.get("rows") or []):
        at = f"{where}.rows[{i}]"
        if not isinstance(r, dict) or "value" not in r or "match" not in r:
            raise ValidationError(f"{at}: each row needs `value` and `match`")
        u = r.get("unit", unit)
        if u not in UNITS:
            raise ValidationError(f"{at}.unit: {u!r} is not one of {list(UNITS)}")
        if u in ("percent", "speedup") and not r.get("baseline"):
            raise ValidationError(f"{at}.baseline: a {u} row needs the row it is relative to")
        row_cal = r.get("calibrates", calibrates)
        if not isinstance(row_cal, bool):
            raise ValidationError(f"{at}.calibrates: true or false, got {row_cal!r}")
        value = r["value"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValidationError(f"{at}.value: a published number > 0, got {value!r}")
        rows.append(
            PublishedRow(
                label=str(r.get("label", f"row {i + 1}")),
                value=float(value),
                unit=u,
                match={**defaults, **r["match"]},
                baseline={**defaults, **r["baseline"]} if r.get("baseline") else None,
                factor=float(r.get("factor", 1.0)),
                counted=bool(r.get("counted", True)),
                stand_in=dict(r["stand_in"]) if r.get("stand_in") else None,
                note=str(r.get("note", "")),
                calibrates=row_cal,
            )
        )
    if not rows:
        raise ValidationError(f"{where}.rows: no published rows")
    labels = [r.label for r in rows]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:  # the record names a row by its table and label (`row_id`): one name, one row
        raise ValidationError(f"{where}.rows: labels must be unique, {twice} name more than one row; tell them apart")
    source = dict(v.get("source") or {})
    return PublishedTable(
        Path(path).stem, Path(path), str(v.get("title", Path(path).stem)), source,
        " ".join(str(v.get("notes", "")).split()), rows, str(source.get("id") or Path(path).stem),
    )  # fmt: skip


# -- matching published rows to simulated rows ----------------------------------------------------------
def _workload_name(record: dict[str, Any]) -> str:
    w = record.get("workload")
    if not w:
        return "uniform"
    try:
        docs = json.loads(w).get("documents")
    except (ValueError, AttributeError):
        return "uniform"
    return docs["name"] if docs else "uniform"


def record_matches(record: dict[str, Any], match: dict[str, Any]) -> bool:
    """Whether a stored row has every value of `match` (scalars): `options` is a subset of the row's
    options, `workload` the name of its length mix, `pass` its pass, anything else a column."""
    for key, want in match.items():
        if key == "options":
            have = json.loads(record.get("options") or "{}")
            if any(have.get(k) != v for k, v in (want or {}).items()):
                return False
        elif key == "workload":
            if _workload_name(record) != want:
                return False
        elif record.get(key) != want:
            return False
    return True


def expand_match(match: dict[str, Any]) -> list[dict[str, Any]]:
    """A match with list values -> one scalar match per combination (the rows to average)."""
    lists = {k: v for k, v in match.items() if isinstance(v, list)}
    if not lists:
        return [match]
    keys = sorted(lists)
    return [{**match, **dict(zip(keys, combo))} for combo in itertools.product(*(lists[k] for k in keys))]


@dataclass
class Found:
    """The simulated rows one match stands for: their mean time and compute-only time."""

    records: list[dict[str, Any]]

    @property
    def time_ms(self) -> float:
        return sum(r[M.TIME_MS_MEDIAN] for r in self.records) / len(self.records)

    @property
    def compute_only_ms(self) -> Optional[float]:
        c = [x for r in self.records if (x := r.get(M.COMPUTE_ONLY_MS)) is not None]
        return None if len(c) < len(self.records) else sum(c) / len(c)


def find(records: list[dict[str, Any]], match: dict[str, Any]) -> tuple[Optional[Found], str]:
    """(the ok rows of every combination of `match`, "") or (None, why not)."""
    found = []
    for m in expand_match(match):
        hits = [r for r in records if record_matches(r, m)]
        ok = [r for r in hits if r.get(M.STATUS) == M.OK and r.get(M.TIME_MS_MEDIAN)]
        if not ok:
            if hits:
                return None, f"{hits[0].get(M.STATUS)}: {hits[0].get(M.REASON) or ''}".strip().rstrip(":")
            return None, f"no simulated row matches {m}"
        found.append(ok[0])
    return Found(found), ""


def candidates(row: PublishedRow) -> list[tuple[dict[str, Any], bool]]:
    """(match, is a stand-in) in the order tried: the measured code first, then its stand-in."""
    s = row.stand_in
    if s is None:
        return [(row.match, False)]
    if "method" not in s:  # the matched own method itself stands in for the measured code
        return [(row.match, True)]
    out = [(row.match, False)]
    if s["method"]:
        alt = {k: v for k, v in row.match.items() if k != "options"}
        alt["method"] = s["method"]
        if s.get("options"):
            alt["options"] = dict(s["options"])
        out.append((alt, True))
    return out


def error_pct(predicted: float, published: float) -> float:
    """Relative error of a prediction, in percent of the published value (positive: predicted higher)."""
    if not published > 0 or not math.isfinite(predicted):
        raise ValueError(f"cannot compare predicted {predicted!r} with published {published!r}")
    return 100.0 * (predicted / published - 1.0)


def value_in_unit(row: PublishedRow, found: Found, base: Optional[Found]) -> float:
    """The prediction in the published row's unit."""
    t = found.time_ms
    if row.unit == "ms":
        return t
    if row.unit == "iter/s":
        return 1e3 / t
    if row.unit == "TFLOP/s":  # the suite's FLOP convention, at the rows' mean time
        flops = [r[M.TFLOPS_PER_GPU] * r[M.TIME_MS_MEDIAN] for r in found.records]
        return sum(flops) / len(flops) / t
    assert base is not None, row.label
    ratio = row.factor * base.time_ms / t
    return 100.0 * ratio if row.unit == "percent" else ratio


@dataclass
class RowResult:
    table: str
    row: PublishedRow
    predicted: Optional[float] = None
    error: Optional[float] = None  # percent
    simulated_as: str = ""  # the method (and options) whose rows were used
    stand_in: bool = False
    note: str = ""  # a stand-in's note, or why the row was not simulated
    bound: str = ""
    kind: str = ""
    method: str = ""  # the method whose simulated rows were used (a stand-in's, where one stood in)
    topologies: tuple[str, ...] = ()  # the topologies of the simulated rows used (the baseline's too)

    @property
    def family(self) -> str:
        return family(self.bound, self.kind, self.method) if self.bound else ""

    @property
    def counted(self) -> bool:
        return self.row.counted and self.error is not None


def _label(match: dict[str, Any]) -> str:
    return M.method_label(str(match.get("method")), dict(match.get("options") or {}))


def evaluate(table: PublishedTable, records: list[dict[str, Any]], kinds: dict[tuple, str]) -> list[RowResult]:
    """Every published row of `table` against the simulated `records`. `kinds`: (topology, world
    size) -> topology kind of the rows (filled here from the topology files, once each)."""
    from suite.sim.topology import TopologyError, load_topology

    out = []
    for row in table.rows:
        res = RowResult(table.name, row)
        why = ""
        for match, standin in candidates(row):
            found, why = find(records, match)
            if found is None:
                continue
            base = None
            if row.baseline is not None:
                base, why = find(records, row.baseline)
                if base is None:
                    why = f"baseline {_label(row.baseline)}: {why}"
                    break
            res.predicted = value_in_unit(row, found, base)
            res.error = error_pct(res.predicted, row.value)
            res.simulated_as, res.stand_in = _label(match), standin
            res.note = "; ".join(
                n for n in (str((row.stand_in or {}).get("note", "")) if standin else "", row.note) if n
            )
            first = found.records[0]
            key = (first["topology"], first["world_size"])
            if key not in kinds:
                try:
                    kinds[key] = topology_kind(load_topology(first["topology"]), first["world_size"])
                except TopologyError:
                    kinds[key] = "unknown"
            res.bound, res.kind = bound_of(found.time_ms, found.compute_only_ms), kinds[key]
            res.method = str(first["method"])
            used = found.records + (base.records if base else [])
            res.topologies = tuple(sorted({str(r["topology"]) for r in used if r.get("topology")}))
            break
        if res.error is None:
            note = str((row.stand_in or {}).get("note", ""))
            res.note = "not simulated: " + (note or why)
        out.append(res)
    return out


# -- summaries, the record and the check ------------------------------------------------------------------
def summarize(results: list[RowResult]) -> tuple[Optional[Summary], dict[str, Summary], dict[str, Summary]]:
    """(overall, per bound, per family) over the counted rows."""
    counted = [r for r in results if r.counted]
    if not counted:
        return None, {}, {}

    def by(key) -> dict[str, Summary]:
        groups: dict[str, list[float]] = {}
        for r in counted:
            assert r.error is not None  # a counted row has its error
            groups.setdefault(key(r), []).append(r.error)
        return {k: Summary.of(v) for k, v in sorted(groups.items())}

    bounds = by(lambda r: r.bound)
    return (
        Summary.of([r.error for r in counted if r.error is not None]),
        {b: bounds[b] for b in BOUNDS if b in bounds},
        by(lambda r: r.family),
    )


@functools.lru_cache(maxsize=None)
def code_version() -> str:
    """The commit validated, asked once per process: the files this command writes must not make
    the tree look changed to its own second question."""
    from suite.env import git_info

    git = git_info()
    if not git.get("commit"):
        return "unknown (not a git checkout)"
    return git["commit"][:12] + (" (with uncommitted changes)" if git.get("dirty") else "")


def make_bands(results: list[RowResult], previous: Optional[Bands], configs: list[str]) -> Bands:
    overall, bounds, families = summarize(results)
    if overall is None:
        raise ValidationError("no published row was simulated: nothing to record")
    row_limit = previous.row_limit_pct if previous else 20.0
    return Bands(
        overall=overall,
        bounds=bounds,
        families=families,
        margin_pct=previous.margin_pct if previous else 2.0,
        row_limit_pct=row_limit,
        over_limit={
            row_id(r): round(abs(r.error), 2)
            for r in results
            if r.counted and r.error is not None and abs(r.error) > row_limit
        },
        meta={
            "recorded": _dt.date.today().isoformat(),
            "command": COMMAND,
            "code_version": code_version(),
            "configs": configs,
        },
    )


def row_id(r: RowResult) -> str:
    """How the record names a row: its table and label."""
    return f"{r.table}: {r.row.label}"


def check(results: list[RowResult], bands: Bands) -> list[str]:
    """What fails against the record: the mean |error| beyond the recorded mean + margin, and every
    counted row beyond the row limit, unless the record lists it as a known miss and it has not grown
    past its recorded |error| + margin. Empty: the check passes."""
    overall, _, _ = summarize(results)
    problems = []
    if overall is None:
        return ["no published row was simulated"]
    bound = bands.overall.mean_abs_pct + bands.margin_pct
    if overall.mean_abs_pct > bound:
        problems.append(
            f"mean |error| {overall.mean_abs_pct:.1f}% exceeds the recorded {bands.overall.mean_abs_pct:.1f}% "
            f"+ margin {bands.margin_pct:g}% = {bound:.1f}%"
        )
    for r in results:
        if not (r.counted and r.error is not None and abs(r.error) > bands.row_limit_pct):
            continue
        known = bands.over_limit.get(row_id(r))
        if known is None:
            problems.append(f"{row_id(r)}: |error| {abs(r.error):.1f}% > {bands.row_limit_pct:g}%")
        elif abs(r.error) > known + bands.margin_pct:
            problems.append(
                f"{row_id(r)}: |error| {abs(r.error):.1f}% grew past its recorded {known:.1f}% "
                f"+ margin {bands.margin_pct:g}% (a known miss beyond {bands.row_limit_pct:g}%)"
            )
    return problems


# -- leave one source out -----------------------------------------------------------------------------------------
@dataclass
class LeaveOneOut:
    """The rows each predicted by a model that never saw its source: their |error| summary, the
    number of sources they come from, and the rows left out with why."""

    summary: Optional[Summary]
    sources: int
    left_out: list[tuple[RowResult, str]]

    def line(self) -> str:
        if self.summary is None:
            return "leave-one-source-out: 0 rows, 0 sources (no row could be predicted blind)"
        s = self.summary
        return (
            f"leave-one-source-out: {s.rows} rows, {self.sources} sources, mean {s.mean_abs_pct:.1f} %, "
            f"median {s.median_abs_pct:.1f} %, max {s.max_abs_pct:.1f} %"
        )


def fitted_sources(topologies: set[str]) -> dict[str, dict[str, str]]:
    """topology name -> {validation source id: what of it was derived from that source}."""
    from suite.sim.topology import TopologyError, load_topology

    out = {}
    for name in sorted(topologies):
        try:
            out[name] = {str(k): str(v) for k, v in load_topology(name).fitted_from.items()}
        except TopologyError:
            out[name] = {}
    return out


def check_fitting(tables: list[PublishedTable], fitted: dict[str, dict[str, str]]) -> None:
    """Every source a topology says it was fitted on must have a calibrating row: an end-to-end
    result may never be a topology's source."""
    calibrating = {t.source_id for t in tables if any(r.calibrates for r in t.rows)}
    known = {t.source_id for t in tables}
    for topo, sources in fitted.items():
        for src in sources:
            if src in known and src not in calibrating:
                raise ValidationError(
                    f"topology {topo}: fitted_from names {src!r}, none of whose rows says `calibrates: true`; "
                    f"a topology figure may come from a micro-benchmark or a calibrating (single-GPU kernel) row "
                    f"only: take the figure from elsewhere, or mark the row it came from `calibrates: true`"
                )


def leave_one_source_out(tables: list[PublishedTable], results: list[RowResult]) -> LeaveOneOut:
    """Each source's counted rows as a model that never saw the source predicts them. Nothing is
    fitted in code, so that is the row's own prediction unless a topology it ran on names the source
    under `fitted_from` (then it is left out: it has no blind prediction); calibrating rows are the
    fit's inputs and are left out too."""
    source_of = {t.name: t.source_id for t in tables}
    fitted = fitted_sources({x for r in results for x in r.topologies})
    check_fitting(tables, fitted)
    errors: list[float] = []
    sources: set[str] = set()
    left: list[tuple[RowResult, str]] = []
    for r in results:
        if not r.counted:
            continue
        src = source_of.get(r.table, r.table)
        if r.row.calibrates:
            left.append((r, "a calibrating row (a fit's input, not a prediction)"))
            continue
        seen = [f"{t}: {fitted[t][src]}" for t in r.topologies if src in fitted.get(t, {})]
        if seen:
            left.append((r, f"its topology was fitted on its own source ({'; '.join(seen)})"))
            continue
        assert r.error is not None  # a counted row has its error
        errors.append(r.error)
        sources.add(src)
    return LeaveOneOut(Summary.of(errors) if errors else None, len(sources), left)


# -- output ---------------------------------------------------------------------------------------------------
def _num(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if abs(x) < 1000 else f"{x:.0f}"


def row_table(results: list[RowResult]) -> list[list[str]]:
    out = []
    for r in results:
        err = "-" if r.error is None else f"{r.error:+.1f}" + ("" if r.row.counted else " (not counted)")
        sim = r.simulated_as + (" (stand-in)" if r.stand_in else "") if r.error is not None else "-"
        out.append([r.row.label, r.row.unit, _num(r.row.value), _num(r.predicted), err, sim, r.family or "-"])
    return out


ROW_HEADERS = ["published row", "unit", "published", "predicted", "error %", "simulated as", "family"]
SUMMARY_HEADERS = ["family", "rows", "mean abs error %", "median abs error %", "max abs error %"]


def summary_table(results: list[RowResult]) -> list[list[str]]:
    overall, bounds, families = summarize(results)
    lines = [[k, str(s.rows), f"{s.mean_abs_pct:.1f}", f"{s.median_abs_pct:.1f}", f"{s.max_abs_pct:.1f}"]
             for k, s in list(families.items()) + [(f"{b} (all kinds)", s) for b, s in bounds.items()]]  # fmt: skip
    if overall is not None:
        s = overall
        lines.append(
            ["all rows", str(s.rows), f"{s.mean_abs_pct:.1f}", f"{s.median_abs_pct:.1f}", f"{s.max_abs_pct:.1f}"]
        )
    return lines


def render_report(
    tables: list[PublishedTable], results: list[RowResult], command: str, loso: Optional[LeaveOneOut] = None
) -> str:
    from tabulate import tabulate

    overall, _, _ = summarize(results)
    lines = [
        "# The simulator against published tables (suite validate)",
        "",
        f"Command: `{command}`. Date: {_dt.date.today().isoformat()}. Code version: {code_version()}.",
        "",
        "Every prediction below is simulated (executor=sim) from the setting of a published table "
        "(configs/validate/); error = predicted / published - 1 in the published unit (positive: the "
        "prediction is higher; for ms that is slower, for iter/s, percent and speedup faster). A "
        "stand-in is an own method simulated where the table measured code the simulator cannot trace "
        "(yet). Family: kernel-bound when the simulated row's exposed communication is under 15 % of its "
        "time, else comm-bound, by the topology kind (suite/sim/bands.py). The per-family mean |error| is "
        "the band every simulated row carries (`sim_error_pct`), recorded in configs/validate/bands.yaml.",
        "",
    ]
    if overall is not None:
        lines += [
            f"**Over {overall.rows} counted rows: mean |error| {overall.mean_abs_pct:.1f} %, median "
            f"{overall.median_abs_pct:.1f} %, max {overall.max_abs_pct:.1f} %.**",
            "",
        ]
    if loso is not None:
        lines += [
            "## Leave one source out",
            "",
            f"`{loso.line()}`",
            "",
            "Each source's rows as predicted by a model that never saw that source (tables of one publication "
            "are one source). No parameter is fitted in code: a topology figure comes from a micro-benchmark, or "
            "from a row marked `calibrates: true` (a single-GPU kernel benchmark), and the topology then names "
            "that row's source under `fitted_from`. A row's blind prediction is therefore its own, except where a "
            "topology it runs on was fitted on its own source: such rows, and the calibrating rows themselves, "
            "are left out of this line:",
            "",
            *[f"- {r.table}: {r.row.label}: {why}" for r, why in loso.left_out],
            "",
        ]
    lines += [
        "## Per family",
        "",
        "A family is a kind of hardware (switch, mesh, pcie, multi-node, host) x method family x kernel- or "
        "comm-bound. A simulated row of a family with no validated row here carries no band and says "
        "`unvalidated` (no band is borrowed from another family).",
        "",
        tabulate(summary_table(results), headers=SUMMARY_HEADERS, tablefmt="github", disable_numparse=True),
        "",
    ]
    for t in tables:
        mine = [r for r in results if r.table == t.name]
        src = t.source
        head = f"Config: `configs/validate/{t.path.name}`. Source: {src.get('url', '-')}"
        head += (f", {src['where']}" if src.get("where") else "") + "."
        if src.get("measured"):
            head += f" Measured: {' '.join(str(src['measured']).split())}."
        lines += [f"## {t.title}", "", head, ""]
        if t.notes:
            lines += [t.notes, ""]
        lines += [tabulate(row_table(mine), headers=ROW_HEADERS, tablefmt="github", disable_numparse=True), ""]
        notes = [f"- {r.row.label}: {r.note}" for r in mine if r.note]
        if notes:
            lines += ["Notes:", *notes, ""]
    return "\n".join(lines) + "\n"


# -- running ----------------------------------------------------------------------------------------------------
@dataclass
class Validation:
    tables: list[PublishedTable]
    results: list[RowResult]
    run_dirs: dict[str, Path] = field(default_factory=dict)


def validate(
    paths: list[Path], *, results_root: str = "results", mlflow: bool = False, out: Optional[TextIO] = None
) -> Validation:
    """Simulate each validation file's sweep and compare every published row with its prediction."""
    import io

    from omegaconf import OmegaConf

    from suite.config import config_from_node
    from suite.runner import run_sweep

    out = out or sys.stdout
    tables, results, run_dirs = [], [], {}
    kinds: dict[tuple, str] = {}
    for i, path in enumerate(paths, 1):
        t0 = time.perf_counter()
        table = load_table(path)
        raw = yaml.safe_load(Path(path).read_text())
        raw.setdefault("results", {})["root"] = results_root
        raw.setdefault("tracking", {})["mlflow"] = mlflow
        cfg, _ = config_from_node(raw, source=str(path))
        yaml_text = OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True)
        swept = run_sweep(cfg, yaml_text, out=io.StringIO(), progress=False)
        assert swept is not None  # not a dry run, and the sim executor's one rank leads
        mine = evaluate(table, swept.records, kinds)
        tables.append(table)
        results += mine
        run_dirs[table.name] = swept.run_dir
        done = [r for r in mine if r.error is not None]
        counted = [abs(r.error) for r in done if r.row.counted and r.error is not None]
        mean = f", mean |error| {sum(counted) / len(counted):.1f}%" if counted else ""
        print(
            f"[{i}/{len(paths)}] {table.name}: {len(swept.records)} trials simulated, {len(done)} of "
            f"{len(mine)} published rows matched ({sum(r.stand_in for r in done)} by stand-ins){mean}, "
            f"{time.perf_counter() - t0:.1f}s",
            file=out,
            flush=True,
        )
    return Validation(tables, results, run_dirs)


def run_command(args) -> int:
    from tabulate import tabulate

    from suite.config import ConfigError

    t0 = time.perf_counter()
    try:
        paths = [Path(p) for p in args.configs] if args.configs else validation_files()
        for p in paths:
            if not p.is_file():
                raise ValidationError(f"no such validation file: {p}")
        if not paths:
            raise ValidationError(f"no validation files in {VALIDATE_DIR}")
        bands_path = Path(args.bands) if args.bands else BANDS
        recorded = load_bands(bands_path)
        if args.check and recorded is None:
            raise ValidationError(f"--check: no record at {bands_path} (run `{COMMAND}` once to write it)")
        v = validate(paths, results_root=args.results_root, mlflow=args.mlflow)
    except (ValidationError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for t in v.tables:
        mine = [r for r in v.results if r.table == t.name]
        print(f"\n{t.title} ({t.source.get('url', '')})")
        print(tabulate(row_table(mine), headers=ROW_HEADERS, disable_numparse=True))
    print()
    print(tabulate(summary_table(v.results), headers=SUMMARY_HEADERS, disable_numparse=True))
    try:
        loso = leave_one_source_out(v.tables, v.results)
    except ValidationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(loso.line())
    command = COMMAND + (" " + " ".join(str(p) for p in args.configs) if args.configs else "")
    if args.out or not args.check:
        report = Path(args.out) if args.out else REPORT
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(render_report(v.tables, v.results, command, loso))
        print(f"report: {report}")
    if args.check:
        assert recorded is not None  # --check without a record stopped above
        problems = check(v.results, recorded)
        for problem in problems:
            print(f"CHECK FAILED: {problem}")
        print(f"check against {bands_path}: {'failed' if problems else 'passed'} ({time.perf_counter() - t0:.1f}s)")
        return 1 if problems else 0
    if args.configs:
        print(f"record not rewritten: only part of {VALIDATE_DIR} was validated")
    else:
        names = [p.stem for p in paths]
        path = write_bands(make_bands(v.results, recorded, names), bands_path, BANDS_HEADER)
        print(f"record: {path}")
    print(f"validated in {time.perf_counter() - t0:.1f}s")
    return 0


BANDS_HEADER = """\
# The simulator's validated error per family of rows, written by `python -m suite validate` from the
# published tables of configs/validate/ (the full report: reports/recorded/sim_validation.md).
# Every simulated row carries its family's mean |error| as `sim_error_pct` (suite/sim/bands.py).
# `check` is kept when the record is rewritten: `suite validate --check` fails when the mean |error|
# exceeds overall.mean_abs_pct + margin_pct, or a row's |error| exceeds row_limit_pct, unless
# `over_limit` lists that row (a known miss, recorded with its |error|) and it has not grown past
# that |error| + margin_pct.
"""
