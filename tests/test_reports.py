"""Reports from small synthetic result sets: table contents, every figure written, a well-formed
self-contained HTML page, and executors never mixed without a label."""

import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from suite import metrics as M
from suite.reports import ReportError, build_report
from suite.reports.load import load_runs
from suite.reports.render import frame
from suite.reports.tables import build_tables
from suite.reports.tables.rows import with_series
from suite.results import ResultsStore


def row(
    method,
    P,
    S,
    *,
    causal=True,
    pass_="fwd",
    executor="dist",
    status=M.OK,
    time_ms=None,
    reason="",
    breakdown=True,
    options="{}",
    heads=8,
    kv_heads=8,
    samples=None,
    hardware="cpu:test",
    **extra,
):
    """A complete result row; the default time is S^2 / P (per 1e4) times a method factor, the
    timed samples that median -10 % and +20 %."""
    factor = {"reference": 1.0, "ring": 1.25, "ulysses": 1.0, "burst": 1.1}.get(method, 1.0)
    t = time_ms if time_ms is not None else S * S / P / 1e4 * factor
    rec = {
        "key": f"{method}-{P}-{S}-{causal}-{pass_}-{executor}-{options}-{kv_heads}",
        "method": method,
        "impl": "own",
        "executor": executor,
        "hardware": hardware,
        "topology": "single-node",
        "world_size": P,
        "nodes": 1,
        "ulysses_degree": 1,
        "ring_degree": P,
        "batch": 1,
        "seq_len": S,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": 64,
        "dtype": "float32",
        "causal": causal,
        "pass": pass_,
        "kernel": "auto",
        "options": options,
        M.STATUS: status,
        M.REASON: reason,
        M.CHECKED: status in (M.OK, M.INCORRECT),
        M.REPEATS: 3,
    }
    if status in (M.OK, M.INCORRECT):
        samples = samples or [0.9 * t, t, 1.2 * t]
        flops = M.attention_flops(1, S, heads, 64, causal, pass_)
        rec.update(
            {
                M.TIME_MS_MEDIAN: t,
                M.TIME_MS_MIN: min(samples),
                M.TIME_MS_MAX: max(samples),
                M.TIME_MS_SAMPLES: samples,
                M.TFLOPS_PER_GPU: M.tflops_per_gpu(flops, t / 1e3, P),
                M.TOKENS_PER_S: S / t * 1e3,
                M.BYTES_SENT: (P - 1) * S * 1024,
                M.BYTES_RECV: (P - 1) * S * 1024,
                M.PEAK_MEM: S * 4096,
                M.COMM_OPS: '{"p2p": %d}' % (2 * (P - 1)) if P > 1 else "{}",
                M.ERR["out"]: 1e-7 if status == M.OK else 0.3,
                M.TOL["out"]: 1e-5,
            }
        )
        if breakdown:
            rec.update(
                {
                    M.KERNEL_MS: 0.6 * t,
                    M.COMM_WAIT_MS: 0.3 * t,
                    M.OVERHEAD_RATIO: 1 / 0.9,
                    M.COMPUTE_ONLY_MS: 0.7 * t,
                    M.COMM_ONLY_MS: 0.4 * t,
                    M.CCR: 1.75,
                    M.OVERLAP_EFF: 0.25,
                }
            )
    rec.update(extra)
    return {c: rec.get(c) for c in M.COLUMNS}  # every column, in the stored order


def write_run(root: Path, sweep: str, rows: list[dict]) -> Path:
    store = ResultsStore.create(root, sweep, f"name: {sweep}\n", {"cpu": "test", "torch": "x"})
    for r in rows:
        store.append(r)
    return store.run_dir


def frame_of(tmp_path, rows, sweep="syn"):
    return with_series(load_runs([write_run(tmp_path, sweep, rows)]).frame)


SHAPE = "B=1 H=8/8 D=64 float32"


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


def _pick(data, **where):
    for k, v in where.items():
        data = data[data[k] == v]
    assert len(data) == 1, where
    return data.iloc[0]


# -- tables ------------------------------------------------------------------------------------------
GPU = "cuda:NVIDIA H100 80GB HBM3"  # a hardware label whose ranks are devices: percent of ideal means something


def on_gpu(rows: list[dict]) -> list[dict]:
    return [dict(r, hardware=GPU) for r in rows]


def test_tables_hold_the_right_numbers(tmp_path, sweep_rows):
    t = build_tables(frame_of(tmp_path, on_gpu(sweep_rows)), "ring")
    # speedup over ring = ring time / method time (ring factor 1.25, ulysses 1.0, burst 1.1); ring
    # itself (1 by definition) has no column
    sp = t["speedup_over_ring"].data
    assert _pick(sp, P=4, mask="causal", seq_len=1024)["ulysses"] == pytest.approx(1.25)
    assert _pick(sp, P=2, mask="full", seq_len=256)["burst"] == pytest.approx(1.25 / 1.1)
    assert "ring" not in sp.columns
    # percent of ideal = (reference time / P) / method time: ring 80%, ulysses 100%
    thr = t["throughput"].data
    assert _pick(thr, series="ring", P=4, seq_len=512, mask="causal")["pct_of_ideal"] == pytest.approx(80.0)
    assert _pick(thr, series="ulysses", P=2, seq_len=256, mask="full")["pct_of_ideal"] == pytest.approx(100.0)
    assert "(80%)" in _pick(t["throughput_by_seq_len"].data, P=4, mask="causal", series="ring")["S=512"]
    # the spread of the timed samples is in the throughput table
    ring = _pick(thr, series="ring", P=2, seq_len=512, mask="causal")
    assert ring["time_ms_min"] == pytest.approx(0.9 * ring["time_ms"]) and ring["time_ms_max"] > ring["time_ms"]
    # correctness matrix: the largest error of a checked ok, the status otherwise
    cm = t["correctness"].data.set_index(["series", "P"])
    assert cm.loc[("ring", 2), "S=512 causal"] == pytest.approx(1e-7)
    assert cm.loc[("wrong", 2), "S=512 causal"] == "INCORRECT 3.0e-1"
    assert cm.loc[("burst", 3), "S=512 causal"] == "FAILED"
    # every row that is not ok, with its reason
    probs = t["skips_and_failures"].data.set_index("series")
    assert probs.loc["ulysses", "status"] == M.SKIPPED and "divisible" in probs.loc["ulysses", "reason"]
    assert probs.loc["ring", "status"] == M.TIMEOUT and probs.loc["burst", "status"] == M.FAILED
    # communication: bytes per rank in MiB, readable operation counts, the time split columns
    c = _pick(t["communication"].data, series="ring", P=4, seq_len=1024, mask="causal")
    assert c["MiB_sent_per_rank"] == pytest.approx(3.0) and c[M.CCR] == pytest.approx(1.75) and c["ops"] == "p2p 6"
    assert _pick(t["memory_peak_MiB"].data, P=2, mask="causal", seq_len=512)["ring"] == pytest.approx(2.0)
    counts = t["status_counts"].data.set_index("series")
    assert counts.loc["ring", M.TIMEOUT] == 1 and counts.loc["ring", "total"] == 13


def test_cpu_rows_show_no_percent_of_ideal_and_say_why(tmp_path, sweep_rows):
    """On CPU the P ranks share one machine's cores: single-device time / P bounds nothing (issue 39:
    the quick start showed up to 190 %). CPU rows carry no percent of ideal, every table that would
    show it says why, and GPU rows beside them keep theirs."""
    fast = row("ring", 2, 512, time_ms=0.2 * 512 * 512 / 2 / 1e4)  # 5x faster than ideal: 500 %
    t = build_tables(frame_of(tmp_path, sweep_rows + [dict(fast, key="fast")]), "ring")
    thr = t["throughput"].data
    assert "pct_of_ideal" not in thr and "pct_of_ideal" not in t["throughput"].cols
    assert "no percent of ideal on CPU rows" in t["throughput"].what
    assert "%)" not in "".join(t["throughput_by_seq_len"].data.astype(str).values.ravel())
    assert "no percent of ideal on CPU rows" in t["throughput_by_seq_len"].what
    # a mix: GPU rows keep theirs, CPU rows are empty
    mixed = build_tables(
        frame_of(tmp_path / "mix", sweep_rows + [dict(r, key=r["key"] + "-gpu") for r in on_gpu(sweep_rows[:7])]),
        "ring",
    )["throughput"]
    pct = mixed.data.set_index("series")["pct_of_ideal"]
    assert pct.notna().sum() == 7 and pct.isna().sum() == len(pct) - 7  # the GPU reference (100 %) and 6 others


def test_rows_with_a_time_but_no_rate_do_not_crash_the_report(tmp_path, sweep_rows):
    """A measured row whose TFLOP/s is empty (None in the store) is left out of the pivot, kept in the
    throughput table, and crashes nothing (it was a TypeError in throughput_pivot)."""
    rows = [dict(r, **{M.TFLOPS_PER_GPU: None}) if r["method"] == "burst" else r for r in sweep_rows]
    t = build_tables(frame_of(tmp_path, rows), "ring")
    assert "burst" not in set(t["throughput_by_seq_len"].data["series"])
    assert "ring" in set(t["throughput_by_seq_len"].data["series"])
    thr = t["throughput"].data
    assert thr.loc[thr["series"] == "burst", "gflops_per_rank"].isna().all()
    rep = build_report([str(write_run(tmp_path / "r", "syn", rows))], out=tmp_path / "out", log_to_mlflow=False)
    assert rep.tables
    # no row with a rate at all: the column is read back as None objects (None * 1e3 was the TypeError)
    none = [dict(r, **{M.TFLOPS_PER_GPU: None}) for r in sweep_rows]
    t = build_tables(frame_of(tmp_path / "none", none), "ring")
    assert t["throughput_by_seq_len"].empty and t["throughput"].data["gflops_per_rank"].isna().all()


def test_tables_read_like_a_paper(tmp_path, sweep_rows):
    """No index column, human headers with units, captions from the sweep, numbers right-aligned
    (siunitx S columns in LaTeX), constant columns named once in the caption."""
    from suite.reports.render import latex, markdown

    t = build_tables(frame_of(tmp_path, sweep_rows, sweep="my_sweep"), "ring")
    md = markdown(t["throughput"])
    header = md.splitlines()[2]
    assert header.split("|")[1].strip() == "CPU ranks"  # the first column is data, not a pandas index
    assert "Time (ms)" in header and "GFLOP/s per CPU rank" in header
    assert "('" not in md and "_" not in header
    assert "Sweep my_sweep" in md and "cpu:test" in md and "All rows: B=1 H=8/8 D=64 float32" in md
    align = md.splitlines()[3].split("|")[1:-1]
    shown = frame(t["throughput"])
    for col, rule in zip(shown.columns, align):
        assert rule.strip().endswith(":") == (col not in ("Mask", "Pass", "Method")), col
    # numbers as decimals, never 1.204e+05 in a left-aligned column
    assert "e+" not in md
    tex = latex(t["throughput"])
    assert "\\toprule" in tex and "S[table-format=" in tex and "\\caption{Throughput." in tex
    assert "{Time (ms)}" in tex
    # operations are words, not JSON
    assert "{" not in markdown(t["communication"]).split("\n", 2)[2]


def test_latex_tables_compile(tmp_path, sweep_rows):
    import shutil

    if not shutil.which("pdflatex"):
        pytest.skip("pdflatex is not installed (apt-get install texlive-latex-recommended texlive-science)")
    probe = subprocess.run(["kpsewhich", "siunitx.sty", "booktabs.sty"], capture_output=True, text=True)
    if probe.stdout.count(".sty") < 2:
        pytest.skip("LaTeX packages siunitx and booktabs are not installed")
    from suite.reports.render import write_tables

    written = write_tables(build_tables(frame_of(tmp_path, sweep_rows), "ring"), tmp_path / "tables")
    doc = tmp_path / "tables" / "doc.tex"
    doc.write_text(
        "\\documentclass{article}\n\\usepackage[a3paper,landscape,margin=1cm]{geometry}\n"
        "\\usepackage{booktabs}\n\\usepackage{siunitx}\n\\begin{document}\n"
        + "".join(f"\\input{{{name}}}\n" for name in written)
        + "\\end{document}\n"
    )
    out = subprocess.run(
        ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", doc.name],
        cwd=doc.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-3000:]


def perplexity_rows(values):
    rows = [
        row(
            "baseline",
            1,
            256,
            pass_="train",
            executor="local",
            **{M.PPL: values[0], M.PPL_BASELINE: values[0], M.LOSS_CURVE: [3.0, 2.5, 2.0], M.LOSS_MAX_REL_DIFF: 0.0},
        )
    ]
    for method, v in zip(("ring", "ulysses", "zigzag_ring"), values[1:]):
        rows.append(
            row(
                method,
                4,
                256,
                pass_="train",
                **{
                    M.PPL: v,
                    M.PPL_BASELINE: values[0],
                    M.PPL_REL_DIFF: v / values[0] - 1,
                    M.LOSS_CURVE: [3.0, 2.5 * (1 + (v / values[0] - 1)), 2.0 + 1e-7],
                    M.LOSS_MAX_REL_DIFF: 5e-8,
                },
            )
        )
    return rows


def test_perplexity_digits_show_the_differences_the_check_is_about(tmp_path):
    """The HTML page, Markdown and LaTeX show the perplexities to the digit where they differ."""
    values = [13.691992, 13.6919921, 13.6919925, 13.691992]
    rep = build_report(
        [str(write_run(tmp_path / "results", "ppl", perplexity_rows(values)))],
        out=tmp_path / "rep",
        log_to_mlflow=False,
    )
    md = Path(rep.tables["perplexity"]["md"]).read_text()
    page = rep.html.read_text()
    for text in (md, page, Path(rep.tables["perplexity"]["tex"]).read_text()):
        assert "13.69199200" in text and "13.69199210" in text and "13.69199250" in text
    assert "13.7<" not in page
    assert "P (ranks)" not in md and "Perplexity rel. diff." in md
    # a model-level report is not told it lacks attention figures
    assert not [n for n in rep.notes if "throughput" in n or "memory" in n]


# -- the report as a whole ---------------------------------------------------------------------------
def test_report_writes_every_table_figure_and_a_self_contained_page(tmp_path, sweep_rows, monkeypatch):
    import suite.reports

    run = write_run(tmp_path / "results", "syn", sweep_rows)
    (run / "mlflow.json").write_text("{}")  # logged to MLflow: the page is attached to its run (not here)
    monkeypatch.setattr(suite.reports, "_log_html", lambda html, sources, pngs: [f"{len(sources)}:{len(pngs)}"])
    lines = []
    rep = build_report([str(run)], out=tmp_path / "rep", progress=lines.append)
    names = {Path(f).name for f in rep.figures}
    # seq_len and world size both swept: throughput against S with a column per P, scaling against P
    for stem in ("throughput", "speedup", "time_split", "bytes", "scaling", "memory"):
        stem += "_B-1-H-8-8-D-64-float32"
        assert {f"{stem}.png", f"{stem}.pdf"} <= names, stem
        assert (tmp_path / "rep" / "figures" / f"{stem}.png").stat().st_size > 5000
    for table in ("correctness", "throughput", "speedup_over_ring", "communication", "skips_and_failures"):
        for ext in ("md", "tex", "csv"):
            assert (tmp_path / "rep" / "tables" / f"{table}.{ext}").stat().st_size > 0
    assert not any("simulated" in n for n in rep.notes)  # no sim rows: nothing to miss
    page = rep.html.read_text()
    ids, hrefs = assert_well_formed_and_self_contained(page)
    assert page.count("data:image/png;base64,") == sum(f.endswith(".png") for f in rep.figures)
    assert "name: syn" in page and "rank 1: RuntimeError: boom" in page
    # contents: an anchor per section and per problem shape, all resolving
    assert {"#correctness", "#throughput", "#throughput-b-1-h-8-8-d-64-float32", "#speedup"} <= set(hrefs)
    assert all(h[1:] in ids for h in hrefs if h.startswith("#"))
    # progress: each step and each figure
    assert lines[0].startswith("read ") and any(line.startswith("figures 6/6") for line in lines)
    # the MLflow step (seconds: MLflow's import) says so before it starts and when it is done
    assert rep.logged_to == ["1:6"]
    assert lines[-2].startswith("attaching the page and 6 figures to 1 MLflow run(s)")
    assert lines[-1].startswith("attached to MLflow")


def test_mixed_executors_are_labelled_and_compared(tmp_path):
    rows = [
        row(
            "ring",
            4,
            S,
            executor=ex,
            time_ms=S / 100 * (1.2 if ex == "sim" else 1.0),
            **({"topology": "h100_sxm"} if ex == "sim" else {}),
        )
        for S in (512, 1024)
        for ex in ("dist", "sim")
    ]
    rows += [row("ulysses", 4, S, executor="dist") for S in (512, 1024)]
    df = frame_of(tmp_path, rows, "mix")
    assert set(df["series"]) == {"ring [dist]", "ring [sim:h100_sxm]", "ulysses [dist]"}
    t = build_tables(df, "ring")
    # speedups only compare rows of the same executor: ulysses against the measured ring
    sp = t["speedup_over_ring"].data
    assert list(sp.columns[-1:]) == ["ulysses [dist]"] and sp["ulysses [dist]"].notna().all()
    sv = t["sim_vs_measured"].data
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
    assert any(Path(f).name == "throughput_B-1-H-8-8-D-64-float32.png" for f in rep.figures)
    assert any("time split" in n for n in rep.notes) and any("memory" in n for n in rep.notes)
    assert_well_formed_and_self_contained(rep.html.read_text())


def test_shapes_are_never_averaged_together(tmp_path):
    rows = [row("ring", 2, 512, kv_heads=kv, time_ms=10.0 * kv) for kv in (8, 2)]
    rows += [row("ulysses", 2, 512, kv_heads=kv, time_ms=5.0 * kv) for kv in (8, 2)]
    df = frame_of(tmp_path, rows, "shapes")
    sp = build_tables(df, "ring")["speedup_over_ring"].data
    assert len(sp) == 2 and sp["ulysses"].tolist() == [2.0, 2.0]
    rep = build_report([str(df["run_dir"].iloc[0])], out=tmp_path / "rep", log_to_mlflow=False)
    assert sum(Path(f).name.startswith("throughput_") and f.endswith(".png") for f in rep.figures) == 2


def test_status_counts_are_per_sweep(tmp_path):
    a = write_run(tmp_path / "results", "first", [row("ring", 2, 512), row("ring", 2, 1024, status=M.FAILED)])
    b = write_run(tmp_path / "results", "second", [row("ring", 2, 512), row("ring", 2, 256)])
    rep = build_report([str(a), str(b)], out=tmp_path / "rep", log_to_mlflow=False)
    counts = build_tables(with_series(load_runs([a, b]).frame), "ring")["status_counts"].data
    assert counts.set_index("sweep").loc["first", M.FAILED] == 1 and counts.set_index("sweep").loc["second", "ok"] == 2
    assert "first" in rep.html.read_text() and "second" in rep.html.read_text()


def test_report_cli_progress_and_errors(tmp_path, sweep_rows, capsys):
    from suite.cli import main

    write_run(tmp_path / "results", "syn", sweep_rows)
    assert (
        main(["report", "--results-root", str(tmp_path / "results"), "--out", str(tmp_path / "o"), "--no-mlflow"]) == 0
    )
    out, err = capsys.readouterr()
    assert "report of" in out and (tmp_path / "o" / "report.html").exists()
    assert "report: figures" in err and "report: wrote 8 tables" in err
    assert main(["report", str(tmp_path / "nothing")]) == 2
    # a misspelt baseline is named, with the methods the runs have and the likely one
    assert (
        main(
            [
                "report",
                "--results-root",
                str(tmp_path / "results"),
                "--out",
                str(tmp_path / "o"),
                "--no-mlflow",
                "--baseline",
                "rnig",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "'rnig' is not a method of these runs" in err and "burst, reference, ring" in err and "'ring'?" in err
    with pytest.raises(ReportError):
        build_report(
            [str(next((tmp_path / "results" / "syn").iterdir()))],
            out=tmp_path / "o2",
            baseline="nope",
            log_to_mlflow=False,
        )


def test_unchanged_figures_are_not_redrawn_and_stale_files_go(tmp_path, sweep_rows):
    run = write_run(tmp_path / "results", "syn", sweep_rows)
    first = build_report([str(run)], out=tmp_path / "rep", log_to_mlflow=False)
    png = tmp_path / "rep" / "figures" / "throughput_B-1-H-8-8-D-64-float32.png"
    stamp = png.stat().st_mtime_ns
    (tmp_path / "rep" / "figures" / "old_figure.png").write_bytes(b"x")
    again = build_report([str(run)], out=tmp_path / "rep", log_to_mlflow=False)
    assert first.redrawn == 6 and again.redrawn == 0 and png.stat().st_mtime_ns == stamp
    assert not (tmp_path / "rep" / "figures" / "old_figure.png").exists()
    # one more method changes what several figures draw: those are drawn again, the rest reused
    store = ResultsStore.open(run)
    store.append(row("tasp", 2, 512))
    third = build_report([str(run)], out=tmp_path / "rep", log_to_mlflow=False)
    assert 0 < third.redrawn <= 6 and png.stat().st_mtime_ns != stamp


def test_wrong_answers_have_no_speedup_and_method_variants_get_their_own_shade(tmp_path):
    from suite.reports.style import palette_for
    from suite.reports.tables.speed import speedup

    rows = [
        row("ring", 2, 1024),
        row("usp", 2, 1024, options='{"ulysses_degree": 1}'),
        row("usp", 2, 1024, options='{"ulysses_degree": 2}'),
        row("burst", 2, 1024, status=M.INCORRECT, reason="out: error 0.3 > tolerance 1e-05"),
    ]
    df = frame_of(tmp_path, rows, "wrong")
    sp = speedup(df, "ring").data
    assert "burst" not in sp.columns and {"usp(U=1)", "usp(U=2)"} <= set(sp.columns)
    palette = palette_for(df)
    assert palette.style("usp(U=1)").colour != palette.style("usp(U=2)").colour


def test_importing_reports_loads_no_torch_hydra_methods_or_planner():
    """Reports read stored rows only: a fresh interpreter importing every reports module must not
    load torch, Hydra/OmegaConf, the methods or the suite's layers above the store."""
    code = (
        "import sys, suite.reports, suite.reports.figures.plan, suite.reports.figures.draw, "
        "suite.reports.figures.write, suite.reports.tables, suite.reports.html, suite.reports.render, "
        "suite.reports.style, suite.reports.load\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'hydra', 'omegaconf', 'methods') or "
        "m.startswith(('suite.plan', 'suite.config', 'suite.records', 'suite.workloads', 'suite.trial', "
        "'suite.executors', 'suite.runner', 'suite.tracking'))]\nprint(sorted(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


class _Checker(HTMLParser):
    VOID = {"meta", "img", "br", "hr", "link", "input", "col", "area", "base", "source", "wbr"}

    def __init__(self):
        super().__init__()
        self.stack, self.external, self.ids, self.hrefs = [], [], set(), []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("src", "href") and value and not value.startswith(("data:", "#")):
                self.external.append(value)
            if name == "id":
                self.ids.add(value)
            if name == "href":
                self.hrefs.append(value)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()


def assert_well_formed_and_self_contained(page: str) -> tuple[set, list]:
    checker = _Checker()
    checker.feed(page)
    checker.close()
    assert not checker.stack, f"unclosed tags: {checker.stack}"
    assert not checker.external, f"external references: {checker.external[:3]}"
    assert "<script" not in page
    return checker.ids, checker.hrefs


def test_packed_workloads_get_their_own_panels_balance_table_and_figure(tmp_path):
    """Rows of a packed length mix are another problem (their mask says so), never averaged with
    the uniform ones; the balance table, the packed-vs-uniform percent-of-ideal table and the
    balance figure show them side by side."""
    packed = '{"documents":{"digest":"abc","distribution":"lognormal","name":"short","seed":0}}'
    rows = []
    for workload, imb in (("", {"ring": 1.4, "zigzag_ring": 1.0}), (packed, {"ring": 1.3, "zigzag_ring": 1.2})):
        slow = 2.0 if workload else 1.0
        rows.append(
            row(
                "reference",
                1,
                512,
                workload=workload,
                time_ms=10.0 * slow,
                key=f"ref-{bool(workload)}",
                **{M.IMBALANCE: 1.0},
            )
        )
        for method in ("ring", "zigzag_ring"):
            rows.append(
                row(
                    method,
                    4,
                    512,
                    workload=workload,
                    time_ms=5.0 * slow * imb[method],
                    key=f"{method}-{bool(workload)}",
                    **{
                        M.IMBALANCE: imb[method],
                        M.PAIRS_MAX: 100 * imb[method],
                        M.PAIRS_MEAN: 100,
                        M.PADDING_FRACTION: 0.0,
                        M.DOCS_PER_SEQ: 9.0 if workload else 1.0,
                    },
                )
            )
    df = frame_of(tmp_path, on_gpu(rows))
    assert set(df["mask"]) == {"causal", "causal, docs:short"}
    tables = build_tables(df, "ring")
    bal = tables["balance"].data
    assert len(bal) == 6 and set(bal.loc[bal["series"] == "ring", "imbalance"]) == {1.4, 1.3}
    pvu = tables["packed_vs_uniform"].data.set_index("series")
    # ideal = the same mix's reference / P: 10/4 ms vs 5 x 1.4 ms for ring, uniform; 20/4 vs 10 x 1.3, packed
    assert pvu.loc["ring", "uniform"] == pytest.approx(100 * 2.5 / 7.0)
    assert pvu.loc["ring", "docs:short"] == pytest.approx(100 * 5.0 / 13.0)
    speed = tables["speedup_over_ring"].data
    assert set(speed["mask"]) == {"causal", "causal, docs:short"}  # pairs within one mix only
    rep = build_report([str(write_run(tmp_path / "r", "syn", rows))], out=tmp_path / "out", log_to_mlflow=False)
    assert any("balance_" in f and f.endswith(".png") for f in rep.figures)


def test_mask_families_get_their_own_reference_table_and_figure(tmp_path):
    """Rows of mask families (methods/masks.py) are other problems than the plain causal one: percent of
    ideal divides by the reference of the same mask (not the causal reference of the same shape), the
    labels name the family with its values, and the mask table and figure hold each family's numbers."""
    from suite.reports.figures.plan import plan_figures

    window = "sliding_window:symmetric=false,window=64"
    question = "shared_question:answers=4,question=128"
    rows = [row("reference", 1, 1024, time_ms=10.0), row("ring", 4, 1024, time_ms=5.0)]
    for name, ref_ms, ring_ms, redundant in ((window, 2.0, 1.0, 3 * 2**20), (question, 8.0, 4.0, 2**20)):
        rows.append(row("reference", 1, 1024, time_ms=ref_ms, mask=name, key=f"ref-{name}"))
        rows.append(
            row(
                "ring",
                4,
                1024,
                time_ms=ring_ms,
                mask=name,
                key=f"ring-{name}",
                **{M.REDUNDANT_BYTES: redundant, M.IMBALANCE: 1.5},
            )
        )
    df = frame_of(tmp_path, on_gpu(rows))
    assert set(df["family"]) == {"causal", "sliding_window(64)", "shared_question(answers=4, question=128)"}
    t = build_tables(df, "ring")
    thr = t["throughput"].data
    # causal: 10 / 4 / 5 = 50 %; the window: 2 / 4 / 1 = 50 % (against its own reference, not 10 ms)
    assert sorted(thr[thr["P"] == 4]["pct_of_ideal"].round(3)) == [50.0, 50.0, 50.0]
    masks = t["mask_families"].data
    got = {r["mask"]: (round(r["redundant_mib"], 3), r["imbalance"]) for _, r in masks.iterrows()}
    assert got["sliding_window(64)"] == (3.0, 1.5) and got["shared_question(answers=4, question=128)"] == (1.0, 1.5)
    jobs, _ = plan_figures(df, "ring")
    assert any(j.name.startswith("masks") for j in jobs)
    assert M.mask_label(window, True) == "sliding_window(64)" and M.mask_label(None, False) == "full"


# -- issue 29: what a report picks, and what its numbers say --------------------------------------------
def test_default_report_takes_the_latest_run_of_each_user_sweep_and_leaves_advisor_sweeps_out(tmp_path):
    from omegaconf import OmegaConf

    from suite.advise import build_config, enumerate_candidates, make_question, prune
    from suite.reports.load import resolve_runs

    root = tmp_path / "results"
    old = write_run(root, "mine", [row("ring", 2, 512, time_ms=9.0)])
    new = write_run(root, "mine", [row("ring", 2, 512, time_ms=3.0)])
    assert old != new and sorted([old.name, new.name])[-1] == new.name
    # the advisor's own simulated sweep, with the config `suite advise` stores for it
    q = make_question(model="8/8/64", topology="h100_sxm", seq_len=4096)
    cfg = build_config(q, prune(q, enumerate_candidates(q)), mlflow=False)
    store = ResultsStore.create(root, cfg.name, OmegaConf.to_yaml(OmegaConf.structured(cfg)), {})
    store.append(row("ulysses", 8, 4096, executor="sim", topology="h100_sxm"))
    notes: list = []
    assert resolve_runs([], root, notes) == [new]
    assert len(notes) == 1 and cfg.name in notes[0] and "name one" in notes[0]
    rep = build_report(results_root=root, out=tmp_path / "rep", log_to_mlflow=False)
    assert rep.rows == 1 and any(cfg.name in n for n in rep.read_notes)
    # named, the advisor's sweep is reported like any other
    assert resolve_runs([str(root / cfg.name)], root) == [store.run_dir]
    # an advisor sweep alone is no report of "everything": the error says how to ask for it
    with pytest.raises(FileNotFoundError, match="advisor sweep"):
        resolve_runs([], _only(root, cfg.name, tmp_path))


def _only(root: Path, sweep: str, tmp_path: Path) -> Path:
    """A results root holding only `sweep` (moved out of `root`)."""
    alone = tmp_path / "alone"
    alone.mkdir()
    (root / sweep).rename(alone / sweep)
    return alone


def test_speedup_interval_is_the_middle_half_of_the_per_sample_ratios(tmp_path):
    import numpy as np

    from suite.reports.tables.rows import SPEEDUP_INTERVAL, speedup_rows

    ring = [10.0, 10.5, 11.0, 30.0]  # one slow outlier repeat
    uly = [2.0, 5.0, 5.2, 5.4]  # one fast outlier repeat
    rows = [row("ring", 2, 512, samples=ring, time_ms=10.75), row("ulysses", 2, 512, samples=uly, time_ms=5.1)]
    sp = speedup_rows(frame_of(tmp_path, rows), "ring").set_index("method").loc["ulysses"]
    ratios = [b / u for b in ring for u in uly]
    assert sp["speedup"] == pytest.approx(10.75 / 5.1)
    assert (sp["speedup_lo"], sp["speedup_hi"]) == pytest.approx(tuple(np.percentile(ratios, SPEEDUP_INTERVAL)))
    # not the extremes (min/max over max/min: 10 / 5.4 to 30 / 2 = 1.9-15x), and the point lies inside
    assert min(ratios) < sp["speedup_lo"] <= sp["speedup"] <= sp["speedup_hi"] < max(ratios)


def test_busy_trials_are_flagged_and_overlap_out_of_range_is_explained(tmp_path):
    from suite.reports.render import markdown
    from suite.reports.tables.rows import BUSY_SPREAD

    rows = [row(m, 2, S) for m in ("ring", "ulysses") for S in (256, 512)]
    rows.append(row("reference", 1, 512))
    t = 512 * 512 / 2 / 1e4
    rows[1] = row("ring", 2, 512, samples=[t, t, 2 * t])  # slowest repeat 2x the median
    rows[2] = dict(rows[2], **{M.OVERLAP_EFF: -1.39})
    df = frame_of(tmp_path, rows)
    assert BUSY_SPREAD < 2
    tables = build_tables(df, "ring")
    pivot = tables["throughput_by_seq_len"]
    flagged = pivot.data.set_index("series")
    assert flagged.loc["ring", "S=512"].endswith(" *") and not flagged.loc["ring", "S=256"].endswith("*")
    assert not flagged.loc["ulysses", "S=512"].endswith("*")
    assert "may have been busy" in pivot.caption()
    thr = tables["throughput"].data
    assert list(thr.loc[thr["note"] != "", "series"]) == ["ring"] and "busy" not in thr.columns
    comm = markdown(tables["communication"])
    assert "medians of different runs" in comm and "below 0" in comm
    # in range everywhere: no such sentence
    calm = build_tables(frame_of(tmp_path / "calm", [row("ring", 2, 512), row("ulysses", 2, 512)]), "ring")
    assert "medians of different runs" not in markdown(calm["communication"])
    assert "busy" not in calm["throughput_by_seq_len"].caption()


def test_variant_identity_read_back_as_text_keeps_its_meaning():
    """Rows read back from MLflow carry their identity as text (params): "False" is no sinks, "4" a
    value head dim, "5.0" a cap; rows from before the variants get the plain values."""
    import pandas as pd

    from suite.reports.load import normalise

    df = pd.DataFrame(
        {
            "head_dim": [8, 8, 8],
            "head_dim_v": [None, "4", None],
            "softcap": [None, "5.0", None],
            "sinks": ["False", "true", None],
            "workload": ["", "", ""],
            "method": ["ring"] * 3,
            "status": ["ok"] * 3,
        }
    )
    out = normalise(df)
    assert list(out["sinks"]) == [False, True, False]
    assert list(out["head_dim_v"]) == [8, 4, 8] and list(out["softcap"]) == [0.0, 5.0, 0.0]


def test_html_page_says_the_machine_was_busy_as_the_console_does(tmp_path):
    """A run whose environment.json says the machine was loaded when the sweep started gets the
    console's load line on the HTML page and a warning at its top (issue 39); an idle run neither."""
    rows = [row("reference", 1, 256), row("ring", 2, 256)]

    def run_with_load(root, sweep, loadavg):
        load = [{"at": "start", "loadavg": [loadavg, 1.0, 1.0], "cpu_count": 2}]
        load.append({"at": "end", "loadavg": [2.0, 1.0, 1.0], "cpu_count": 2})
        store = ResultsStore.create(root, sweep, f"name: {sweep}\n", {"cpu": "test", "load": load})
        for r in rows:
            store.append(r)
        return str(store.run_dir)

    busy = build_report([run_with_load(tmp_path / "b", "loaded", 3.5)], out=tmp_path / "o1", log_to_mlflow=False)
    page = busy.html.read_text()
    assert "The machine was busy" in page and "machine load (1-minute average) 3.5 at the start" in page
    assert "BUSY: other work shared the machine" in page
    calm = build_report([run_with_load(tmp_path / "c", "idle", 0.1)], out=tmp_path / "o2", log_to_mlflow=False)
    page = calm.html.read_text()
    assert "The machine was busy" not in page and "machine load (1-minute average) 0.1 at the start" in page
