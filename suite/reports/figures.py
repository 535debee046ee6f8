"""Paper-style figures (seaborn on matplotlib, PNG and PDF).

Consistency rules: a method has the same colour and marker in every figure (a fixed table, so
adding a method never recolours the others); the executor is the line style (solid dist, dashed
sim, dotted threads), and series labels name it whenever a figure mixes executors. Axes carry
units; log axes are ticked at the swept values with plain labels (no "4x10^3" clutter).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import matplotlib

matplotlib.use("Agg")  # headless: no display on CI or worker nodes
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter, NullLocator  # noqa: E402

from suite import metrics as M  # noqa: E402
from suite.reports.tables import attention_rows, measured, perplexity_rows, sim_pairs  # noqa: E402

# Fixed method styles: (colour, marker). Unknown methods get the next free style deterministically.
_ORDER = ["reference", "ring", "zigzag_ring", "stripe_ring", "ulysses", "usp", "allgather_kv", "burst", "tasp",
          "tokenring", "yunchang_usp", "yunchang_ulysses", "rfa_ring", "rfa_zigzag", "rfa_stripe", "rfa_llama3",
          "torch_cp_allgather", "torch_cp_alltoall"]
_PALETTE = sns.color_palette("colorblind", 10) + sns.color_palette("dark", 10)
_MARKERS = ["o", "s", "^", "v", "D", "P", "X", "*", "h", "<", ">", "p", "d", "H", "8"]  # filled only: seaborn cannot mix in line-art markers
_DASHES = {"dist": "", "threads": (1, 2), "sim": (5, 3)}
_EPS = {"float32": 2.0**-23, "float64": 2.0**-52, "bfloat16": 2.0**-7, "float16": 2.0**-10}


def method_style(method: str) -> tuple[tuple, str]:
    """(colour, marker) of a method: fixed for known methods, stable by name for others."""
    i = _ORDER.index(method) if method in _ORDER else len(_ORDER) + sum(map(ord, method))
    return _PALETTE[i % len(_PALETTE)], _MARKERS[i % len(_MARKERS)]


def _series_styles(df: pd.DataFrame):
    """hue order, palette, markers and dashes for the `series` of a frame."""
    first = df.drop_duplicates("series").set_index("series")
    order = sorted(first.index, key=lambda s: (_ORDER.index(first.loc[s, "method"])
                                               if first.loc[s, "method"] in _ORDER else 99, s))
    palette = {}
    for method in dict.fromkeys(first.loc[order, "method"]):  # one hue per method, shades per variant
        variants = [s for s in order if first.loc[s, "method"] == method]
        colour = method_style(method)[0]
        shades = ([colour] if len(variants) == 1 else
                  sns.blend_palette([_shade(colour, 0.45), colour, _shade(colour, -0.55)], len(variants)))
        palette.update(zip(variants, shades))
    markers = {s: method_style(first.loc[s, "method"])[1] for s in order}
    dashes = {s: _DASHES.get(first.loc[s, "executor"], "") for s in order}
    return order, palette, markers, dashes


def _shade(colour, amount: float) -> tuple:
    """Darker (amount > 0, towards black) or lighter (amount < 0, towards white) `colour`."""
    r, g, b = colour[:3]
    if amount >= 0:
        return (r * (1 - amount), g * (1 - amount), b * (1 - amount))
    a = -amount
    return (r + (1 - r) * a, g + (1 - g) * a, b + (1 - b) * a)


def _log2_axis(ax, values, axis: str = "x") -> None:
    """Log-2 axis ticked exactly at `values`, plain labels, no minor labels."""
    values = sorted({int(v) for v in values if pd.notna(v) and v > 0})
    set_scale = ax.set_xscale if axis == "x" else ax.set_yscale
    set_scale("log", base=2)
    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_locator(FixedLocator(values))
    target.set_minor_locator(NullLocator())
    target.set_minor_formatter(NullFormatter())
    labels = [_short(v) for v in values]
    (ax.set_xticks if axis == "x" else ax.set_yticks)(values, labels)
    if axis == "x" and len(values) > 6:
        ax.tick_params(axis="x", labelrotation=45)


def _log_y(ax) -> None:
    """Log y axis with plain labels at 1-2-5 steps (no "2x10^0", no minor labels)."""
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_minor_formatter(NullFormatter())


def _short(v: int) -> str:
    if v >= 2**20 and v % 2**20 == 0:
        return f"{v // 2**20}M"
    if v >= 1024 and v % 1024 == 0:
        return f"{v // 1024}K"
    return str(v)


def _per_shape(df: pd.DataFrame):
    """(file-name suffix, title suffix, rows) per problem shape: numbers of different shapes are
    never drawn as one point. No suffix when there is a single shape."""
    shapes = sorted(df["shape"].dropna().unique())
    for shape in shapes:
        slug = "_" + "".join(ch if ch.isalnum() else "-" for ch in shape).strip("-") if len(shapes) > 1 else ""
        yield slug, f", {shape}", df[df["shape"] == shape]


def _save(fig, out_dir: Path, name: str) -> list[str]:
    paths = []
    for ext in ("png", "pdf"):
        path = out_dir / f"{name}.{ext}"
        fig.savefig(path, dpi=130 if ext == "png" else None, bbox_inches="tight")
        paths.append(str(path))
    plt.close(fig)
    return paths


def _lines(df: pd.DataFrame, *, x: str, y: str, xlabel: str, ylabel: str, title: str, logx: bool,
           logy: bool = False, col: str = "world_size", row: Optional[str] = "mask"):
    """Faceted line plot, hue/style by series (sharey off: ranks of different sizes differ a lot)."""
    order, palette, markers, dashes = _series_styles(df)
    g = sns.relplot(data=df, x=x, y=y, hue="series", style="series", hue_order=order, style_order=order,
                    palette=palette, markers=markers, dashes=dashes, col=col, row=row, kind="line",
                    height=3.0, aspect=1.25, facet_kws={"sharey": False, "sharex": True}, errorbar=None)
    col_name = {"world_size": "P"}.get(col, col)
    g.set_titles(row_template="{row_name}", col_template=f"{col_name} = {{col_name}}")
    g.set_axis_labels(xlabel, ylabel)
    for ax in g.axes.flat:
        if logx:
            _log2_axis(ax, df[x].unique(), "x")
        if logy:
            _log_y(ax)
        ax.grid(True, which="major", alpha=0.3)
    g.figure.suptitle(title, y=1.02)
    sns.move_legend(g, "upper left", bbox_to_anchor=(1.0, 0.95), title="method")
    return g.figure


# ---------------------------------------------------------------------------------------------------
def fig_throughput(df: pd.DataFrame, out: Path) -> list[str]:
    paths = []
    for slug, shape, m in _per_shape(measured(df)):
        for pass_, part in m.groupby("pass"):
            fig = _lines(part, x="seq_len", y=M.TFLOPS_PER_GPU, xlabel="sequence length (tokens, log scale)",
                         ylabel="TFLOP/s per GPU", title=f"Attention throughput ({pass_}{shape})", logx=True)
            paths += _save(fig, out, f"throughput_{pass_}{slug}")
    return paths


def fig_speedup(df: pd.DataFrame, out: Path, baseline: str) -> list[str]:
    from suite.reports.tables import speedup
    sp = speedup(df, baseline)
    if sp.empty:
        return []
    long = sp.reset_index().melt(id_vars=["shape", "P", "mask", "pass", "seq_len"], var_name="series",
                                 value_name="speedup")
    long = long.dropna(subset=["speedup"])
    methods = measured(df).drop_duplicates("series").set_index("series")
    long["method"] = long["series"].map(methods["method"])
    long["executor"] = long["series"].map(methods["executor"])
    long["S"] = long["seq_len"].map(_short)
    paths = []
    shapes = sorted(long["shape"].unique())
    for (shape, pass_, mask), part in long.groupby(["shape", "pass", "mask"]):
        slug = "_" + "".join(ch if ch.isalnum() else "-" for ch in shape).strip("-") if len(shapes) > 1 else ""
        shape_title = f", {shape}" if len(shapes) > 1 else ""
        order, palette, _, _ = _series_styles(part)
        ps = sorted(part["P"].unique())
        fig, axes = plt.subplots(1, len(ps), figsize=(4.2 * len(ps) + 1.5, 3.4), squeeze=False)
        for ax, p in zip(axes[0], ps):
            sub = part[part["P"] == p]
            s_order = [_short(v) for v in sorted(sub["seq_len"].unique())]
            sns.barplot(data=sub, x="S", y="speedup", hue="series", hue_order=[o for o in order if o in set(sub["series"])],
                        order=s_order, palette=palette, ax=ax, errorbar=None)
            ax.axhline(1.0, ls="--", c="grey", lw=1)
            ax.set_xlabel("sequence length (tokens)")
            ax.set_ylabel(f"speedup over {baseline} (x)")
            ax.set_title(f"P = {p}")
            ax.legend_.remove() if ax.legend_ else None
        legend = {}  # every series of every panel (the first panel may not have them all)
        for ax in axes[0]:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                legend.setdefault(lab, h)
        labels = [o for o in order if o in legend]
        fig.legend([legend[lab] for lab in labels], labels, loc="upper left", bbox_to_anchor=(1.0, 0.9),
                   title="method")
        fig.suptitle(f"Speedup over {baseline} ({mask}, {pass_}{shape_title})", y=1.03)
        fig.tight_layout()
        paths += _save(fig, out, f"speedup_{mask}_{pass_}{slug}")
    return paths


def fig_time_split(df: pd.DataFrame, out: Path) -> list[str]:
    """Stacked bars: time in kernels, exposed (blocked) communication, and the rest, at the largest
    sequence length of the largest world size."""
    m_all = measured(df).dropna(subset=[M.KERNEL_MS, M.COMM_WAIT_MS])
    if m_all.empty:
        return []
    paths = []
    for slug, shape, m in _per_shape(m_all):
        paths += _time_split(df, m, out, slug, shape)
    return paths


def _time_split(df, m, out, slug, shape) -> list[str]:
    paths = []
    for (pass_, mask), part in m.groupby(["pass", "mask"]):
        p = part["world_size"].max()
        part = part[part["world_size"] == p]
        s = part["seq_len"].max()
        part = part[part["seq_len"] == s].groupby("series", as_index=False)[
            [M.TIME_MS_MEDIAN, M.KERNEL_MS, M.COMM_WAIT_MS]].median()
        if part.empty:
            continue
        part["other"] = (part[M.TIME_MS_MEDIAN] - part[M.KERNEL_MS] - part[M.COMM_WAIT_MS]).clip(lower=0)
        order, _, _, _ = _series_styles(measured(df)[measured(df)["series"].isin(part["series"])])
        part = part.set_index("series").loc[order]
        fig, ax = plt.subplots(figsize=(max(4.5, 0.7 * len(part) + 2), 3.6))
        bottom = None
        for col, label, colour in ((M.KERNEL_MS, "attention kernels", "#4c72b0"),
                                   (M.COMM_WAIT_MS, "exposed communication", "#dd8452"),
                                   ("other", "other (merge, copies, Python)", "#8c8c8c")):
            ax.bar(part.index, part[col], bottom=bottom, label=label, color=colour)
            bottom = part[col] if bottom is None else bottom + part[col]
        ax.set_ylabel("time per iteration (ms)")
        ax.set_xlabel("method")
        ax.set_title(f"Time split, P = {p}, S = {_short(s)} ({mask}, {pass_}{shape})")
        ax.tick_params(axis="x", labelrotation=30)
        for lbl in ax.get_xticklabels():
            lbl.set_horizontalalignment("right")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
        paths += _save(fig, out, f"time_split_{mask}_{pass_}{slug}")
    return paths


def fig_bytes(df: pd.DataFrame, out: Path) -> list[str]:
    m = measured(df)
    m = m[m["world_size"] > 1].assign(MiB=lambda d: d[M.BYTES_SENT] / 2**20)
    m = m[m["MiB"] > 0]
    if m.empty:
        return []
    return _per_pass_lines(m, out, "bytes", ylabel="MiB sent per rank (log scale)",
                           title="Communication volume per rank", logy=True)


def fig_scaling(df: pd.DataFrame, out: Path) -> list[str]:
    m = measured(df)
    if m["world_size"].nunique() < 2:
        return []
    paths = []
    for slug, shape, sm in _per_shape(m):
        for pass_, part in sm.groupby("pass"):
            s = part["seq_len"].max()
            part = part[part["seq_len"] == s]
            if part["world_size"].nunique() < 2:
                continue
            fig = _lines(part, x="world_size", y=M.TOKENS_PER_S, xlabel="ranks (GPUs)", ylabel="tokens per second",
                         title=f"Scaling with ranks, S = {_short(s)} ({pass_}{shape})", logx=True, col="mask",
                         row=None)
            paths += _save(fig, out, f"scaling_{pass_}{slug}")
    return paths


def fig_memory(df: pd.DataFrame, out: Path) -> list[str]:
    m = measured(df).dropna(subset=[M.PEAK_MEM])
    m = m.assign(MiB=m[M.PEAK_MEM] / 2**20)
    if m.empty:
        return []
    return _per_pass_lines(m, out, "memory", ylabel="peak memory per rank (MiB)", title="Peak memory per rank")


def _per_pass_lines(m: pd.DataFrame, out: Path, name: str, *, ylabel: str, title: str,
                    logy: bool = False) -> list[str]:
    """Column `MiB` against sequence length, one figure per problem shape and pass."""
    paths = []
    for slug, shape, sm in _per_shape(m):
        for pass_, part in sm.groupby("pass"):
            fig = _lines(part, x="seq_len", y="MiB", xlabel="sequence length (tokens, log scale)", ylabel=ylabel,
                         title=f"{title} ({pass_}{shape})", logx=True, logy=logy)
            paths += _save(fig, out, f"{name}_{pass_}{slug}")
    return paths


def fig_sim_vs_measured(df: pd.DataFrame, out: Path) -> list[str]:
    """Simulated against measured time of the same trial identity (needs both executors)."""
    pair = sim_pairs(df)
    if pair.empty:
        return []
    fig, ax = plt.subplots(figsize=(4.6, 4.2))
    for method, part in pair.groupby("method"):
        colour, marker = method_style(method)
        ax.scatter(part[f"{M.TIME_MS_MEDIAN}_dist"], part[f"{M.TIME_MS_MEDIAN}_sim"], color=colour, marker=marker,
                   label=method)
    lim = [min(pair[f"{M.TIME_MS_MEDIAN}_dist"].min(), pair[f"{M.TIME_MS_MEDIAN}_sim"].min()) * 0.8,
           max(pair[f"{M.TIME_MS_MEDIAN}_dist"].max(), pair[f"{M.TIME_MS_MEDIAN}_sim"].max()) * 1.25]
    ax.plot(lim, lim, ls="--", c="grey", lw=1)
    ax.set(xscale="log", yscale="log", xlim=lim, ylim=lim, xlabel="measured time (ms, executor dist)",
           ylabel="simulated time (ms, executor sim)", title="Simulated vs measured")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), title="method")
    return _save(fig, out, "sim_vs_measured")


def fig_loss_curves(df: pd.DataFrame, out: Path) -> list[str]:
    """Model-level check: training loss per step of every method over the single-device baseline
    (left), and each method's relative difference to the baseline per step, log scale (right:
    the curves on the left lie on top of each other when the methods are right)."""
    t = perplexity_rows(df)
    t = t[t[M.LOSS_CURVE].map(lambda c: c is not None and len(c) > 0)] if not t.empty else t
    if t.empty:
        return []
    paths = []
    groups = t.groupby(["shape", "seq_len", "workload"], dropna=False)
    for (shape, s, workload), part in groups:
        base = part[part["method"] == "baseline"]
        base_curve = list(base[M.LOSS_CURVE].iloc[0]) if not base.empty else None
        fig, (ax_l, ax_d) = plt.subplots(1, 2, figsize=(10.0, 3.6))
        order, palette, markers, _ = _series_styles(part)
        for series in order:
            row = part[part["series"] == series].iloc[0]
            curve = list(row[M.LOSS_CURVE])
            steps = range(1, len(curve) + 1)
            if row["method"] == "baseline":
                ax_l.plot(steps, curve, color="black", lw=2.5, alpha=0.35, label="baseline (1 device)")
                continue
            label = f"{series} P={row['world_size']}"
            ax_l.plot(steps, curve, color=palette[series], lw=1.0, label=label)
            if base_curve is not None:  # running max: exact zeros (equal bits) have no place on a log axis
                worst, diff = 0.0, []
                for a, b in zip(curve, base_curve):
                    worst = max(worst, abs(a - b) / abs(b))
                    diff.append(worst if worst > 0 else float("nan"))
                ax_d.plot(steps, diff, color=palette[series], marker=markers[series], markevery=max(1, len(diff) // 8),
                          ms=4, lw=1.0, label=label)
        eps = _EPS.get(str(part["dtype"].iloc[0]))
        if eps is not None and base_curve is not None:
            ax_d.axhline(eps, ls=":", color="grey", lw=1)
            ax_d.annotate(f"{part['dtype'].iloc[0]} machine epsilon", (0.02, eps), xycoords=("axes fraction", "data"),
                          xytext=(0, 3), textcoords="offset points", fontsize=7, color="grey")
        ax_l.set(xlabel="training step", ylabel="training loss (nats per byte)", title="Training loss")
        ax_d.set(xlabel="training step", ylabel="max so far of |loss - baseline| / baseline",
                 title="Difference to the single-device baseline")
        ax_d.set_yscale("log")
        ax_d.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax_d.yaxis.set_minor_formatter(NullFormatter())
        for ax in (ax_l, ax_d):
            ax.grid(True, which="major", alpha=0.3)
        handles, labels = ax_l.get_legend_handles_labels()
        ax_d.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), title="method")
        fig.suptitle(f"Model-level check, {shape} S={_short(int(s))}", y=1.02)
        fig.tight_layout()
        slug = "".join(ch if ch.isalnum() else "-" for ch in f"{shape}-S{s}").strip("-")
        suffix = f"_{slug}" if groups.ngroups > 1 else ""
        paths += _save(fig, out, f"loss_curves{suffix}")
    return paths


FIGURES: dict[str, Callable] = {
    "throughput": fig_throughput, "speedup": fig_speedup, "time_split": fig_time_split, "bytes": fig_bytes,
    "scaling": fig_scaling, "memory": fig_memory, "sim_vs_measured": fig_sim_vs_measured,
    "loss_curves": fig_loss_curves,
}


def _draw(name: str, df: pd.DataFrame, out: Path, baseline: str) -> list[str]:
    sns.set_theme(context="paper", style="whitegrid", font_scale=1.0)
    fn = FIGURES[name]
    if name == "loss_curves":
        return fn(df, out)
    att = attention_rows(df)  # the attention figures never draw model-level rows
    return fn(att, out, baseline) if name == "speedup" else fn(att, out)


def build_figures(df: pd.DataFrame, out_dir, baseline: str) -> tuple[list[str], list[str]]:
    """Draw every figure the data allows; returns (files written, notes on figures not drawn).

    The figure kinds are independent, so they are drawn in parallel worker processes (forked: no
    re-import) when the machine has more than one core."""
    import multiprocessing as mp
    import os
    from concurrent.futures import ProcessPoolExecutor

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    workers = min(len(FIGURES), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    if workers > 1 and "fork" in mp.get_all_start_methods():
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as pool:
            results = dict(zip(FIGURES, pool.map(_draw, FIGURES, *zip(*[(df, out, baseline)] * len(FIGURES)))))
    else:
        results = {name: _draw(name, df, out, baseline) for name in FIGURES}
    written, notes = [], []
    for name in FIGURES:
        if results[name]:
            written += results[name]
        else:
            notes.append(_WHY_NOT.get(name, f"{name}: no data"))
    return written, notes


_WHY_NOT = {
    "throughput": "throughput: no measured rows",
    "speedup": "speedup: the baseline method has no measured row at the same points",
    "time_split": "time split: the runs have no breakdown columns (run.breakdown was off)",
    "bytes": "communication volume: no multi-rank rows",
    "scaling": "scaling: fewer than two world sizes at one sequence length",
    "memory": "memory: no peak memory recorded",
    "sim_vs_measured": "simulated vs measured: needs rows of both executors dist and sim for the same trials",
    "loss_curves": "loss curves: no model-level (kind: perplexity) rows with loss curves in these runs",
}
