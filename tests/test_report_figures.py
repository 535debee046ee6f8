"""Figures a paper can use: checked on the matplotlib figures themselves (what is drawn where) and
on the written PDFs (fonts), from small synthetic result sets."""

import re
import zlib
from pathlib import Path

import matplotlib
import pytest
from matplotlib.colors import to_hex

from suite import metrics as M
from suite.reports import build_report
from suite.reports.figures import draw as D
from suite.reports.figures import plan_figures
from suite.reports.style import COLOURS, delta_e, palette_for
from tests.test_reports import frame_of, row, write_run

REPORTS = Path(__file__).resolve().parents[1] / "suite" / "reports"


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    matplotlib.pyplot.close("all")


def _figures(df, baseline="ring"):
    palette = palette_for(df)
    jobs, _ = plan_figures(df, baseline)
    return {job.name: D.draw(job, palette) for job in jobs}, palette


def _legend(fig) -> dict[str, str]:
    legend = fig.legends[0]
    handles = getattr(legend, "legend_handles", None) or legend.legendHandles
    out = {}
    for h, text in zip(handles, legend.get_texts()):
        colour = h.get_color() if hasattr(h, "get_color") and not hasattr(h, "get_facecolor") else h.get_facecolor()
        out[text.get_text()] = to_hex(colour)
    return out


def _texts(fig) -> str:
    return " ".join(t.get_text() for t in fig.findobj(matplotlib.text.Text))


def _sweep():
    rows = [row("reference", 1, S) for S in (512, 1024)]
    rows += [row(m, P, S) for m in ("ring", "ulysses", "new_method") for P in (2, 4) for S in (512, 1024)]
    return rows


# -- PDF fonts ---------------------------------------------------------------------------------------
def pdf_font_subtypes(path: Path) -> set[str]:
    """Subtypes of every font a PDF embeds (read from its objects, inflating any compressed stream)."""
    data = Path(path).read_bytes()
    chunks = [data]
    for m in re.finditer(rb"stream\r?\n(.*?)\r?\nendstream", data, re.S):
        try:
            chunks.append(zlib.decompress(m.group(1)))
        except zlib.error:
            pass
    found = set()
    for chunk in chunks:
        for obj in re.findall(rb"<<(?:[^<>]|<<(?:[^<>]|<<[^<>]*>>)*>>)*>>", chunk):
            if re.search(rb"/Type\s*/Font\b", obj):
                sub = re.search(rb"/Subtype\s*/(\w+)", obj)
                found.add(sub.group(1).decode() if sub else "?")
    return found


def test_pdfs_embed_truetype_never_type3(tmp_path):
    rows = _sweep() + [row("ring", 2, 512, pass_="fwd_bwd")]
    rep = build_report([str(write_run(tmp_path / "results", "fonts", rows))], out=tmp_path / "rep", log_to_mlflow=False)
    pdfs = [Path(f) for f in rep.figures if f.endswith(".pdf")]
    assert len(pdfs) >= 5
    for pdf in pdfs:
        subtypes = pdf_font_subtypes(pdf)
        assert subtypes and "Type3" not in subtypes, (pdf.name, subtypes)
        assert subtypes <= {"Type0", "CIDFontType2", "TrueType"}, (pdf.name, subtypes)


def test_the_font_check_catches_type3(tmp_path):
    """The check above is real: matplotlib's default (fonttype 3) is caught."""
    import matplotlib.pyplot as plt

    with plt.rc_context({"pdf.fonttype": 3}):
        fig = plt.figure(figsize=(2, 2))
        fig.text(0.5, 0.5, "TFLOP/s")
        fig.savefig(tmp_path / "t3.pdf")
        plt.close(fig)
    assert "Type3" in pdf_font_subtypes(tmp_path / "t3.pdf")


# -- palette -----------------------------------------------------------------------------------------
def test_palette_is_derived_from_the_data_and_distinct(tmp_path):
    # any method name gets a colour: nothing in the reports lists methods
    names = [
        "allgather_kv",
        "burst",
        "ring",
        "stripe_ring",
        "tasp",
        "tokenring",
        "ulysses",
        "usp",
        "zigzag_ring",
        "yunchang_usp",
        "rfa_ring",
        "rfa_zigzag",
        "a_method_nobody_listed",
    ]
    rows = [row("reference", 1, 512)] + [row(m, 2, 512) for m in names]
    palette = palette_for(frame_of(tmp_path, rows))
    assert palette.methods[0] == "reference" and sorted(palette.methods[1:]) == palette.methods[1:]
    colours = [palette.method_colours[m] for m in names]
    assert len(set(colours)) == len(names)
    # the first 12 method colours are far apart (CIE76 > 25), every colour of 13 still clearly different
    assert min(delta_e(a, b) for i, a in enumerate(COLOURS[:12]) for b in COLOURS[i + 1 : 12]) > 25
    assert min(delta_e(a, b) for i, a in enumerate(colours) for b in colours[i + 1 :]) > 15
    # the single-device baseline is neutral, not one of the method colours
    assert palette.method_colours["reference"] not in COLOURS
    sources = [*sorted((REPORTS / "figures").glob("*.py")), REPORTS / "style.py", REPORTS / "html.py"]
    for source in sources:  # and no method list hides in the drawing code
        text = source.read_text()
        assert not re.search(r'"(ring|ulysses|zigzag_ring|tasp|burst|usp)"', text), source.name


def test_every_figure_of_a_report_gives_a_series_the_same_colour(tmp_path):
    rows = _sweep() + [row("ring", 2, S, executor="sim", topology="h100_sxm") for S in (512, 1024)]
    figs, palette = _figures(frame_of(tmp_path, rows))
    seen = {}
    for name, fig in figs.items():
        for label, colour in _legend(fig).items():
            if name.startswith(("time_split", "sim_vs")):
                continue  # legends of components / of methods, not of series
            seen.setdefault(label, set()).add(colour)
    assert len(seen) >= 5 and all(len(c) == 1 for c in seen.values()), seen
    # variants of a method are shades of its colour: the measured ring is the method colour itself
    assert seen["ring [dist]"] == {palette.method_colours["ring"].lower()}
    assert seen["ring [sim:h100_sxm]"] != seen["ring [dist]"]


# -- what the panels show ----------------------------------------------------------------------------
def test_panels_share_y_per_row_from_zero_with_sample_intervals(tmp_path):
    rows = _sweep()
    rows[1] = row("reference", 1, 1024, samples=[0.5 * 104.8576, 104.8576, 4 * 104.8576])
    figs, _ = _figures(frame_of(tmp_path, rows))
    fig = figs["throughput_B-1-H-8-8-D-64-float32"]
    axes = fig.axes
    assert len(axes) == 3  # one row (causal, fwd), a column per world size
    assert all(axes[0].get_shared_y_axes().joined(axes[0], ax) for ax in axes)
    assert axes[0].get_ylim()[0] == 0 and axes[0].get_yscale() == "linear"
    # the error bar of the noisy reference point spans the rate at its slowest and fastest sample
    ref = [r for r in rows if r["method"] == "reference" and r["seq_len"] == 1024][0]
    rate = ref[M.TFLOPS_PER_GPU] * 1e3  # CPU ranks are drawn in GFLOP/s
    segments = [seg for coll in axes[0].collections for seg in coll.get_segments()]
    spans = sorted((min(s[:, 1]), max(s[:, 1])) for s in segments if len(s) == 2 and s[0][0] == s[1][0])
    assert any(lo == pytest.approx(rate / 4) and hi == pytest.approx(rate * 2) for lo, hi in spans), spans


def test_one_point_series_are_markers_and_equal_values_are_dodged(tmp_path):
    # one sequence length: the figures are drawn against world size; reference has a single point
    rows = [row("reference", 1, 512)] + [row(m, P, 512, time_ms=5.0) for m in ("ring", "ulysses") for P in (2, 4)]
    figs, _ = _figures(frame_of(tmp_path, rows))
    fig = figs["throughput_B-1-H-8-8-D-64-float32"]
    ax = fig.axes[0]
    assert ax.get_xlabel() == "ranks (P CPU processes)"
    lines = [ln for ln in ax.get_lines() if ln.get_marker() not in (None, "None", "", "_")]  # not error-bar caps
    single = [ln for ln in lines if len(ln.get_xdata()) == 1]
    assert single and all(ln.get_linestyle() == "None" for ln in single)  # the reference: a marker
    # ring and ulysses have equal values at every P: their markers sit side by side, not on top
    multi = [ln for ln in lines if len(ln.get_xdata()) == 2]
    assert len(multi) == 2 and list(multi[0].get_ydata()) == pytest.approx(list(multi[1].get_ydata()))
    assert all(abs(a - b) > 0.05 for a, b in zip(multi[0].get_xdata(), multi[1].get_xdata()))


def test_labels_name_the_device(tmp_path):
    cpu, _ = _figures(frame_of(tmp_path / "cpu", _sweep()))
    for name, fig in cpu.items():
        assert "GPU" not in _texts(fig), name
    # a CPU rank's rate in GFLOP/s (in TFLOP/s its ticks read 0.0175), a GPU's in TFLOP/s: the same
    # rows drawn on each carry values 1000x apart
    assert "GFLOP/s per CPU rank" in _texts(cpu["throughput_B-1-H-8-8-D-64-float32"])
    assert "TFLOP/s" not in _texts(cpu["throughput_B-1-H-8-8-D-64-float32"])
    gpu_rows = [dict(r, hardware="NVIDIA H100 80GB HBM3") for r in _sweep()]
    gpu, _ = _figures(frame_of(tmp_path / "gpu", gpu_rows))
    assert "TFLOP/s per GPU" in _texts(gpu["throughput_B-1-H-8-8-D-64-float32"])
    top = [
        max(
            ln.get_ydata().max()
            for ln in f["throughput_B-1-H-8-8-D-64-float32"].axes[0].get_lines()
            if len(ln.get_ydata())
        )
        for f in (cpu, gpu)
    ]
    assert top[0] == pytest.approx(1e3 * top[1])
    assert "GPUs (P)" in _texts(gpu["scaling_B-1-H-8-8-D-64-float32"])


def test_log_axes_carry_at_least_two_labels(tmp_path):
    # bytes from 8K to 512K tokens span two orders of magnitude: a log axis; and one within a
    # single 1-2-5 step still gets two labels
    rows = [row("ring", 4, S) for S in (8192, 65536, 524288)] + [row("ulysses", 4, S) for S in (8192, 65536, 524288)]
    figs, _ = _figures(frame_of(tmp_path, rows))
    fig = figs["bytes_B-1-H-8-8-D-64-float32"]
    fig.canvas.draw()
    logs = [ax for ax in fig.axes if ax.get_yscale() == "log"]
    assert logs
    # a log axis says so in its label (the report sets it beside linear ones); a linear one does not
    assert fig.axes[0].get_ylabel().endswith("(log scale)")
    linear = _figures(frame_of(tmp_path / "linear", _sweep()))[0]["throughput_B-1-H-8-8-D-64-float32"]
    assert linear.axes[0].get_yscale() == "linear" and "log scale" not in linear.axes[0].get_ylabel()
    for ax in logs:
        lo, hi = ax.get_ylim()
        shown = [t for t in ax.get_yticklabels() if t.get_text() and lo <= t.get_position()[1] <= hi]
        assert len(shown) >= 2 and not any("10^" in t.get_text() or "times" in t.get_text() for t in shown)
    ax = matplotlib.pyplot.figure().add_subplot()
    D._readable_log(ax, 3.1, 3.4, "y")
    assert len(ax.get_yticks()) >= 2 and ax.get_ylim()[0] <= 2 and ax.get_ylim()[1] >= 5
    assert D.tick_labels([8064, 32256, 129024]) == ["8.06K", "32.3K", "129K"]
    assert D.tick_labels([4096, 524288]) == ["4K", "512K"] and D.tick_labels([96, 2400]) == ["96", "2400"]


def test_panels_equal_for_both_masks_are_drawn_once(tmp_path):
    rows = [row(m, P, 512, causal=c) for m in ("ring", "ulysses") for P in (2, 4) for c in (True, False)]
    rows[0] = dict(rows[0], **{M.PEAK_MEM: 10 * 2**20})  # ring, P=2, causal: memory differs from full
    figs, _ = _figures(frame_of(tmp_path, rows))
    titles = [ax.get_title() for ax in figs["bytes_B-1-H-8-8-D-64-float32"].axes]
    assert titles == ["fwd, causal = full"]  # bytes sent do not depend on the mask here
    assert len(figs["memory_B-1-H-8-8-D-64-float32"].axes) == 2
    assert len(figs["throughput_B-1-H-8-8-D-64-float32"].axes) == 2


# -- issue 29: colours that stay, predictions that say so, one iteration's time split ----------------
def test_a_method_keeps_its_colour_in_reports_of_different_method_sets(tmp_path):
    from suite.reports.style import method_colour

    one = palette_for(frame_of(tmp_path / "a", [row(m, 2, 512) for m in ("ring", "ulysses")]))
    two = palette_for(frame_of(tmp_path / "b", [row(m, 2, 512) for m in ("allgather_kv", "burst", "ring", "tasp")]))
    # before: colours went by alphabetical rank among the report's methods (ring first, then third)
    assert one.method_colours["ring"] == two.method_colours["ring"] == method_colour("ring")
    assert one.method_colours["ring"] in COLOURS
    # and in a report of many methods every colour is still its own
    names = [f"method_{i}" for i in range(len(COLOURS) + 3)]
    many = palette_for(frame_of(tmp_path / "c", [row(m, 2, 512) for m in names]))
    assert len(set(many.method_colours.values())) == len(names)


def _sim_rows(band=None):
    extra = {M.SIM_ERROR_PCT: band} if band is not None else {}
    rows = [row("reference", 1, S, executor="sim", topology="h100_sxm", samples=[1.0], **extra) for S in (512, 1024)]
    rows += [
        row(m, 4, S, executor="sim", topology="h100_sxm", **extra) for m in ("ring", "ulysses") for S in (512, 1024)
    ]
    for r in rows:  # a prediction is one value, no repeats
        r[M.TIME_MS_SAMPLES] = [r[M.TIME_MS_MEDIAN]]
        r[M.TIME_MS_MIN] = r[M.TIME_MS_MAX] = r[M.TIME_MS_MEDIAN]
    return rows


@pytest.mark.parametrize("band", [None, 12.0])
def test_simulated_figures_say_predicted_never_timed_repeats(tmp_path, band):
    jobs, _ = plan_figures(frame_of(tmp_path, _sim_rows(band)), "ring")
    drawn = {j.name.split("_B-")[0]: j for j in jobs}
    assert {"throughput", "speedup", "memory"} <= set(drawn)
    for name in ("throughput", "speedup", "scaling", "time_split", "memory", "bytes"):
        if name not in drawn:
            continue
        job = drawn[name]
        assert job.params["title"].startswith("Predicted "), job.params["title"]
        assert "timed repeats" not in job.caption and "instrumented" not in job.caption, job.caption
    tp = drawn["throughput"]
    assert "predict" in tp.caption
    if band is not None:  # the error band in the title and the caption
        assert tp.params["title"].endswith("(±12 %)") and "±12 %" in tp.caption


def test_time_split_is_one_iterations_parts(tmp_path):
    # the median timed repeat (100 ms) is another iteration than the instrumented one (kernels 40 +
    # waits 20, overhead ratio 1.05): its rest is 0.05 x 60 = 3 ms, not 100 - 60 = 40 ms
    r = row("ring", 2, 512, time_ms=100.0, **{M.KERNEL_MS: 40.0, M.COMM_WAIT_MS: 20.0, M.OVERHEAD_RATIO: 1.05})
    jobs, _ = plan_figures(frame_of(tmp_path, [r]), None)
    split = next(j for j in jobs if j.kind == "split")
    got = split.data.iloc[0]
    assert (got["kernels"], got["comm"]) == (40.0, 20.0) and got["other"] == pytest.approx(3.0)
    assert "same iteration" in split.caption
    # the rows ran on CPU processes: the title says so, as the throughput figure's does (issue 39)
    assert split.params["title"].startswith("Time split, P = 2 CPU ranks, S = ")
    gpu = plan_figures(frame_of(tmp_path / "gpu", [dict(r, hardware="cuda:H100")]), None)[0]
    assert next(j for j in gpu if j.kind == "split").params["title"].startswith("Time split, P = 2, S = ")


def test_busy_rings_have_a_legend_entry_only_where_drawn(tmp_path):
    """The red rings of busy points are named in the legend (issue 39: circles without a legend entry
    read as a data series); a figure without busy points has no such entry."""
    t = 512 * 512 / 2 / 1e4
    rows = [row("ring", 2, 256), row("ring", 2, 512, samples=[t, t, 2 * t]), row("ulysses", 2, 512)]
    figs, _ = _figures(frame_of(tmp_path, rows))
    texts = [x.get_text() for x in figs["throughput_B-1-H-8-8-D-64-float32"].legends[0].get_texts()]
    assert D.BUSY_LABEL in texts and "ring" in texts
    calm, _ = _figures(frame_of(tmp_path / "calm", [row("ring", 2, 256), row("ring", 2, 512)]))
    assert D.BUSY_LABEL not in [x.get_text() for x in calm["throughput_B-1-H-8-8-D-64-float32"].legends[0].get_texts()]
