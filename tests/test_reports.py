"""Reports from small synthetic result sets: table contents, every figure written, a well-formed
self-contained HTML page, and executors never mixed without a label."""
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from suite import metrics as M
from suite.records import complete as _complete
from suite.reports import build_report
from suite.reports.load import load_runs
from suite.reports.tables import build_tables, with_series
from suite.results import ResultsStore


def row(method, P, S, *, causal=True, pass_="fwd", executor="dist", status=M.OK, time_ms=None, reason="",
        breakdown=True, options="{}", heads=8, kv_heads=8, **extra):
    """A complete result row; the default time is S^2 / P (per 1e4) times a method factor."""
    factor = {"reference": 1.0, "ring": 1.25, "ulysses": 1.0, "burst": 1.1}.get(method, 1.0)
    t = time_ms if time_ms is not None else S * S / P / 1e4 * factor
    rec = {"key": f"{method}-{P}-{S}-{causal}-{pass_}-{executor}-{options}", "method": method, "impl": "own",
           "executor": executor, "hardware": "cpu:test", "topology": "single-node", "world_size": P, "nodes": 1,
           "ulysses_degree": 1, "ring_degree": P, "batch": 1, "seq_len": S, "heads": heads, "kv_heads": kv_heads,
           "head_dim": 64, "dtype": "float32", "causal": causal, "pass": pass_, "kernel": "auto", "options": options,
           M.STATUS: status, M.REASON: reason, M.CHECKED: status in (M.OK, M.INCORRECT)}
    if status in (M.OK, M.INCORRECT):
        rec.update({M.TIME_MS_MEDIAN: t, M.TIME_MS_MIN: t, M.TIME_MS_MAX: t, M.TIME_MS_SAMPLES: [t],
                    M.TFLOPS_PER_GPU: 1.0 / t, M.TOKENS_PER_S: S / t * 1e3, M.BYTES_SENT: (P - 1) * S * 1024,
                    M.BYTES_RECV: (P - 1) * S * 1024, M.PEAK_MEM: S * 4096, M.COMM_OPS: "{}",
                    M.ERR["out"]: 1e-7 if status == M.OK else 0.3, M.TOL["out"]: 1e-5})
        if breakdown:
            rec.update({M.KERNEL_MS: 0.6 * t, M.COMM_WAIT_MS: 0.3 * t, M.OVERHEAD_RATIO: 1 / 0.9,
                        M.COMPUTE_ONLY_MS: 0.7 * t, M.COMM_ONLY_MS: 0.4 * t, M.CCR: 1.75, M.OVERLAP_EFF: 0.25})
    rec.update(extra)
    return _complete(rec)


def write_run(root: Path, sweep: str, rows: list[dict]) -> Path:
    store = ResultsStore.create(root, sweep, f"name: {sweep}\n", {"cpu": "test", "torch": "x"})
    for r in rows:
        store.append(r)
    return store.run_dir


@pytest.fixture
def sweep_rows():
    rows = []
    for S in (256, 512, 1024):
        for causal in (True, False):
            rows.append(row("reference", 1, S, causal=causal))
            for P in (2, 4):
                for method in ("ring", "ulysses", "burst"):
                    rows.append(row(method, P, S, causal=causal))
    rows.append(row("ulysses", 3, 512, status=M.SKIPPED, reason="ulysses needs heads divisible by the ulysses degree"))
    rows.append(row("burst", 3, 512, status=M.FAILED, reason="rank 1: RuntimeError: boom"))
    rows.append(row("ring", 3, 512, status=M.TIMEOUT, reason="no report from ranks [2] within 5s"))
    rows.append(row("wrong", 2, 512, status=M.INCORRECT, reason="out: error 0.3 > tolerance 1e-05"))
    return rows


def test_tables_hold_the_right_numbers(tmp_path, sweep_rows):
    df = with_series(load_runs([write_run(tmp_path, "syn", sweep_rows)]).frame)
    t = build_tables(df, "ring")
    # speedup over ring = ring time / method time (ring factor 1.25, ulysses 1.0, burst 1.1)
    sp = t["speedup_over_ring"]
    assert sp.loc[("B=1 H=8/8 D=64 float32", 4, "causal", "fwd", 1024), "ulysses"] == pytest.approx(1.25)
    assert sp.loc[("B=1 H=8/8 D=64 float32", 2, "full", "fwd", 256), "burst"] == pytest.approx(1.25 / 1.1)
    assert sp["ring"].dropna().eq(1.0).all()
    # percent of ideal = (reference time / P) / method time: ring 80%, ulysses 100%
    thr = t["throughput"]
    ring4 = thr[(thr.series == "ring") & (thr.P == 4) & (thr.seq_len == 512) & (thr["mask"] == "causal")]
    assert ring4["pct_of_ideal"].item() == pytest.approx(80.0)
    uly2 = thr[(thr.series == "ulysses") & (thr.P == 2) & (thr.seq_len == 256) & (thr["mask"] == "full")]
    assert uly2["pct_of_ideal"].item() == pytest.approx(100.0)
    assert "(80%)" in t["throughput_by_seq_len"].loc[("B=1 H=8/8 D=64 float32", 4, "causal", "fwd", "ring"), "S=512"]
    # correctness matrix: status and the largest error
    cm = t["correctness"]
    assert cm.loc[("ring", 2), "B=1 H=8/8 D=64 float32 S=512 causal fwd"] == "ok 1.0e-07"
    assert cm.loc[("wrong", 2), "B=1 H=8/8 D=64 float32 S=512 causal fwd"] == "INCORRECT 3.0e-01"
    assert cm.loc[("burst", 3), "B=1 H=8/8 D=64 float32 S=512 causal fwd"] == "FAILED"
    # every row that is not ok, with its reason
    probs = t["skips_and_failures"].set_index("series")
    assert probs.loc["ulysses", "status"] == M.SKIPPED and "divisible" in probs.loc["ulysses", "reason"]
    assert probs.loc["ring", "status"] == M.TIMEOUT and probs.loc["burst", "status"] == M.FAILED
    # communication: bytes per rank in MiB, and the time split columns
    comm = t["communication"]
    c = comm[(comm.series == "ring") & (comm.P == 4) & (comm.seq_len == 1024)].iloc[0]
    assert c["MiB_sent_per_rank"] == pytest.approx(3 * 1024 * 1024 / 2**20) and c[M.CCR] == pytest.approx(1.75)
    # memory pivot in MiB
    assert t["memory_peak_MiB"].loc[("B=1 H=8/8 D=64 float32", 2, "causal", "fwd", 512), "ring"] == pytest.approx(2.0)
    assert t["status_counts"].loc["ring", M.TIMEOUT] == 1


def test_report_writes_every_table_figure_and_a_self_contained_page(tmp_path, sweep_rows):
    run = write_run(tmp_path / "results", "syn", sweep_rows)
    rep = build_report([str(run)], out=tmp_path / "rep", log_to_mlflow=False)
    names = {Path(f).name for f in rep.figures}
    for stem in ("throughput_fwd", "speedup_causal_fwd", "speedup_full_fwd", "time_split_causal_fwd", "bytes_fwd",
                 "scaling_fwd", "memory_fwd"):
        assert {f"{stem}.png", f"{stem}.pdf"} <= names, stem
        assert (tmp_path / "rep" / "figures" / f"{stem}.png").stat().st_size > 5000
    for table in ("correctness", "throughput", "speedup_over_ring", "communication", "skips_and_failures"):
        for ext in ("md", "tex", "csv"):
            assert (tmp_path / "rep" / "tables" / f"{table}.{ext}").stat().st_size > 0
    tex = (tmp_path / "rep" / "tables" / "speedup_over_ring.tex").read_text()
    assert "\\toprule" in tex and "speedup over ring" in tex
    assert any("simulated vs measured" in n for n in rep.notes)
    page = rep.html.read_text()
    assert_well_formed_and_self_contained(page)
    assert page.count("data:image/png;base64,") == sum(f.endswith(".png") for f in rep.figures)
    assert "name: syn" in page and "rank 1: RuntimeError: boom" in page


def test_mixed_executors_are_labelled_and_compared(tmp_path):
    rows = [row("ring", 4, S, executor=ex, time_ms=S / 100 * (1.2 if ex == "sim" else 1.0),
                **({"topology": "h100_sxm"} if ex == "sim" else {}))
            for S in (512, 1024) for ex in ("dist", "sim")]
    rows += [row("ulysses", 4, S, executor="dist") for S in (512, 1024)]
    df = with_series(load_runs([write_run(tmp_path, "mix", rows)]).frame)
    assert set(df["series"]) == {"ring [dist]", "ring [sim:h100_sxm]", "ulysses [dist]"}
    t = build_tables(df, "ring")
    # the simulated ring is its own column, never averaged with the measured one; speedups only
    # compare rows of the same executor
    assert {"ring [dist]", "ring [sim:h100_sxm]"} <= set(t["speedup_over_ring"].columns)
    sv = t["sim_vs_measured"]
    assert len(sv) == 2 and sv["error %"].tolist() == pytest.approx([20.0, 20.0])
    # a report of predictions alone still says, in every series, that they are predictions
    only_sim = with_series(df[df["executor"] == "sim"])
    assert set(only_sim["series"]) == {"ring [sim:h100_sxm]"}
    rep = build_report([str(df["run_dir"].iloc[0])], out=tmp_path / "rep", log_to_mlflow=False)
    assert any(f.endswith("sim_vs_measured.png") for f in rep.figures)


def test_single_point_and_missing_columns(tmp_path):
    lone = row("ring", 2, 512, breakdown=False)
    del lone[M.PEAK_MEM]  # a store from an older version may lack columns
    run = write_run(tmp_path / "results", "one", [lone])
    rep = build_report([str(run)], out=tmp_path / "rep", log_to_mlflow=False)
    assert rep.rows == 1 and rep.html.exists()
    assert any(Path(f).name == "throughput_fwd.png" for f in rep.figures)
    assert any("time split" in n for n in rep.notes) and any("memory" in n for n in rep.notes)
    assert_well_formed_and_self_contained(rep.html.read_text())


def test_shapes_are_never_averaged_together(tmp_path):
    rows = [row("ring", 2, 512, kv_heads=kv, time_ms=10.0 * kv) for kv in (8, 2)]
    rows += [row("ulysses", 2, 512, kv_heads=kv, time_ms=5.0 * kv) for kv in (8, 2)]
    df = with_series(load_runs([write_run(tmp_path, "shapes", rows)]).frame)
    sp = build_tables(df, "ring")["speedup_over_ring"]
    assert len(sp) == 2 and sp["ulysses"].tolist() == [2.0, 2.0]
    rep = build_report([str(df["run_dir"].iloc[0])], out=tmp_path / "rep", log_to_mlflow=False)
    assert sum("throughput_fwd_" in Path(f).name and f.endswith(".png") for f in rep.figures) == 2


def test_report_cli_finds_the_latest_runs(tmp_path, sweep_rows, capsys):
    from suite.cli import main
    write_run(tmp_path / "results", "syn", sweep_rows)
    assert main(["report", "--results-root", str(tmp_path / "results"), "--out", str(tmp_path / "o"),
                 "--no-mlflow"]) == 0
    assert "report of" in capsys.readouterr().out and (tmp_path / "o" / "report.html").exists()
    assert main(["report", str(tmp_path / "nothing")]) == 2


class _Checker(HTMLParser):
    VOID = {"meta", "img", "br", "hr", "link", "input", "col", "area", "base", "source", "wbr"}

    def __init__(self):
        super().__init__()
        self.stack, self.external = [], []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("src", "href") and value and not value.startswith(("data:", "#")):
                self.external.append(value)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()


def assert_well_formed_and_self_contained(page: str) -> None:
    checker = _Checker()
    checker.feed(page)
    checker.close()
    assert not checker.stack, f"unclosed tags: {checker.stack}"
    assert not checker.external, f"external references: {checker.external[:3]}"
    assert "<script" not in page


@pytest.mark.skipif(not (shutil.which("chromium") or shutil.which("chromium-browser")),
                    reason="Chromium is not installed (apt-get install chromium to run this check)")
def test_html_renders_in_headless_chromium(tmp_path, sweep_rows):
    run = write_run(tmp_path / "results", "syn", sweep_rows)
    rep = build_report([str(run)], out=tmp_path / "rep", log_to_mlflow=False)
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    out = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                          "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
                          f"--screenshot={tmp_path / 'shot.png'}", "--window-size=1200,2000", rep.html.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "shot.png").stat().st_size > 10000


def test_wrong_answers_have_no_speedup_and_method_variants_get_their_own_shade(tmp_path):
    from suite.reports.figures import _series_styles
    from suite.reports.tables import speedup
    rows = [row("ring", 2, 1024), row("usp", 2, 1024, options='{"ulysses_degree": 1}'),
            row("usp", 2, 1024, options='{"ulysses_degree": 2}'),
            row("burst", 2, 1024, status=M.INCORRECT, reason="out: error 0.3 > tolerance 1e-05")]
    df = with_series(load_runs([write_run(tmp_path, "wrong", rows)]).frame)
    sp = speedup(df, "ring")
    assert "burst" not in sp.columns and {"usp(U=1)", "usp(U=2)"} <= set(sp.columns)
    order, palette, _, _ = _series_styles(df)
    assert palette["usp(U=1)"] != palette["usp(U=2)"]
