"""One self-contained HTML page per report: contents with an anchor per section and per problem
shape, tables with captions, figures embedded (base64 PNG) at their drawn size, and the resolved
configs and environment fingerprints of the runs it draws on. No scripts, external styles or
images, so the file can be mailed, archived or attached to an MLflow run as it is."""

from __future__ import annotations

import base64
import html
import json
import struct
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from suite import metrics as M
from suite.reports.render import html_table
from suite.reports.style import DPI

CSS_PX_PER_INCH = 96
_LONG = 30  # tables with more rows than this start folded (their caption stays visible)

# Wide tables (a correctness matrix of 48 problems) scroll inside their box rather than run off the
# page: headers wrap, the first column and the header row stay in view, and the box is at most a
# window high, so its sideways scroll bar is on screen without scrolling to the table's end.
_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 1.5em auto; max-width: 1560px;
       color: #222; line-height: 1.45; padding: 0 1.2em; }
h1 { font-size: 1.6em; margin-bottom: .2em; }
h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 2em; }
h3 { margin: 1.4em 0 .4em; font-size: 1.05em; }
a { color: #0b5cad; text-decoration: none; } a:hover { text-decoration: underline; }
nav.toc { background: #f7f8fa; border: 1px solid #e3e6ea; padding: .6em 1.2em; display: inline-block; }
nav.toc ol { margin: .2em 0; padding-left: 1.4em; } nav.toc li { margin: .1em 0; }
nav.toc h2 { border: 0; margin: .2em 0; font-size: 1.1em; }
.scroll { overflow: auto; max-width: 100%; max-height: 85vh; margin: .4em 0 1.4em; }
table.data { border-collapse: separate; border-spacing: 0; font-size: .85em; }
.tcaption { color: #444; font-size: .9em; margin: .8em 0 .3em; max-width: 110ch; }
table.data th, table.data td { border: 1px solid #ddd; border-width: 0 1px 1px 0; padding: .22em .55em;
       white-space: nowrap; background: #fff; }
table.data tr > :first-child { border-left-width: 1px; } table.data thead th { border-top-width: 1px; }
table.data th { background: #f4f4f4; white-space: normal; min-width: 3.5em; vertical-align: bottom; }
table.data thead th { position: sticky; top: 0; z-index: 1; }
table.data tr > :first-child { position: sticky; left: 0; }
table.data thead tr > :first-child { z-index: 2; }
.num { text-align: right; font-variant-numeric: tabular-nums; }
.txt { text-align: left; }
.figs { display: flex; flex-wrap: wrap; gap: 0 2.4em; align-items: flex-start; }
.card { max-width: 100%; }
figure { margin: .4em 0 1.2em; max-width: 100%; overflow-x: auto; }
figure img { max-width: none; display: block; }
figcaption, .note { color: #555; font-size: .9em; }
.warn { color: #8a1c1c; background: #fdecea; padding: .4em .6em; }
details > summary { cursor: pointer; color: #444; margin: .3em 0; }
pre { background: #f7f7f7; padding: .8em; overflow-x: auto; font-size: .8em; }
"""

# (anchor, heading): the page's sections in order; {baseline} is filled in.
SECTIONS = [
    ("runs", "Runs and trial counts"),
    ("correctness", "Correctness"),
    ("throughput", "Throughput"),
    ("speedup", "Speedup"),
    ("scaling", "Scaling"),
    ("communication", "Communication and time split"),
    ("balance", "Load balance and packed documents"),
    ("memory", "Memory"),
    ("perplexity", "Model-level check (perplexity)"),
    ("sim", "Simulated vs measured"),
    ("problems", "Skips and failures"),
    ("not-drawn", "Figures not drawn"),
    ("configs", "Configs and environments"),
]


def _slug(text: str) -> str:
    return "".join(ch.lower() if ch.isalnum() else "-" for ch in text).strip("-")


def png_size(path: str | Path) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's header."""
    with open(path, "rb") as f:
        head = f.read(24)
    return struct.unpack(">II", head[16:24])


def write_html(
    path: Path, *, title: str, tables: dict, jobs: list, files: dict, sources, notes: list[str], df: pd.DataFrame
) -> Path:
    esc = html.escape
    body, toc = [], []
    n_table = n_figure = 0
    for anchor, heading in SECTIONS:
        parts, sub = [], []
        if anchor == "runs":
            parts.append(_runs(sources, df))
        for t in tables.values():
            if t.section != anchor or t.empty or not t.html:
                continue
            n_table += 1
            caption = f'<p class="tcaption"><b>Table {n_table}.</b> {esc(t.caption())}</p>'
            table = caption + _scroll(html_table(t, f"table-{t.name}"))
            if len(t.data) > _LONG:
                table = (
                    f"<details><summary>Table {n_table}: {esc(t.title)} ({len(t.data)} rows; click to "
                    f"unfold)</summary>{table}</details>"
                )
            parts.append(table)
        mine = [j for j in jobs if j.section == anchor]
        cards = []
        for shape in dict.fromkeys(j.shape for j in mine):
            card = []
            if shape:  # an anchor per problem shape; shapes sit side by side where the window is wide
                sid = f"{anchor}-{_slug(shape)}"
                sub.append((sid, shape))
                card.append(f'<h3 id="{sid}">{esc(shape)}</h3>')
            for job in (j for j in mine if j.shape == shape):
                n_figure += 1
                card.append(_figure(job, files[job.name], n_figure))
            cards.append('<div class="card">' + "\n".join(card) + "</div>")
        if cards:
            parts.append('<div class="figs">' + "\n".join(cards) + "</div>")
        if anchor == "not-drawn" and notes:
            parts.append("<ul>" + "".join(f'<li class="note">{esc(n)}</li>' for n in notes) + "</ul>")
        if anchor == "configs":
            parts.append(_configs(sources))
        if not parts:
            continue
        heading = next((t.title for t in tables.values() if t.section == anchor == "speedup" and not t.empty), heading)
        body.append(f'<section><h2 id="{anchor}">{esc(heading)}</h2>\n' + "\n".join(parts) + "</section>")
        toc.append(
            f'<li><a href="#{anchor}">{esc(heading)}</a>'
            + (
                "<ol>" + "".join(f'<li><a href="#{sid}">{esc(name)}</a></li>' for sid, name in sub) + "</ol>"
                if sub
                else ""
            )
            + "</li>"
        )
    executors = ", ".join(sorted(df["executor"].dropna().unique())) if not df.empty else "none"
    hardware = ", ".join(sorted(df["hardware"].dropna().astype(str).unique())) if not df.empty else "none"
    generated = datetime.now(timezone.utc).isoformat(timespec="seconds")
    busy_runs = [s for s in sources if "BUSY" in load_line(s, df[df["run_dir"] == s.run_dir] if not df.empty else df)]
    busy = (
        f'<p class="warn"><b>The machine was busy</b> when {len(busy_runs)} of {len(sources)} run(s) started '
        f"({esc(', '.join(s.sweep for s in busy_runs))}): other work shared it, so their timings are noisy; "
        'rerun on an idle machine before trusting them (<a href="#runs">machine load per run</a>).</p>'
        if busy_runs
        else ""
    )
    page = f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{esc(title)}</title>
<style>{_CSS}</style>
</head>
<body>
<h1>{esc(title)}</h1>
<p class="note">Generated {esc(generated)} from {len(sources)} run(s), {len(df)} trial rows. Hardware: {esc(hardware)}.
Executors: {esc(executors)}. Rows from different executors or machines are labelled in every table and figure and never
averaged together; numbers from <code>threads</code> (virtual ranks) or <code>sim</code> (simulator) are not measured
hardware performance.</p>
{busy}
<nav class="toc" id="contents"><h2>Contents</h2><ol>
{chr(10).join(toc)}
</ol></nav>
{chr(10).join(body)}
</body>
</html>
"""
    path.write_text(page, encoding="utf-8")
    return path


def _scroll(inner: str) -> str:
    return f'<div class="scroll">{inner}</div>'


def _figure(job, paths: list[str], number: int) -> str:
    esc = html.escape
    png = next(p for p in paths if p.endswith(".png"))
    w, h = png_size(png)
    css_w, css_h = round(w * CSS_PX_PER_INCH / DPI), round(h * CSS_PX_PER_INCH / DPI)
    data = base64.b64encode(Path(png).read_bytes()).decode()
    title = job.params.get("title", job.name)
    return (
        f'<figure id="fig-{esc(job.name)}" style="width:{css_w}px">'
        f'<img alt="{esc(title)}" width="{css_w}" height="{css_h}" src="data:image/png;base64,{data}">'
        f"<figcaption><b>Figure {number}.</b> {esc(title)}. {esc(job.caption)} "
        f'<span class="note">(figures/{esc(job.name)}.pdf)</span></figcaption></figure>'
    )


def load_line(source, part: pd.DataFrame) -> str:
    """The run's machine-load line (metrics.busy_note: the console's, from environment.json), "" where
    the run stored no load samples."""
    samples = ((source.environment or {}).get("load") or [])[-2:]
    measured = part.empty or bool((part["executor"] != "sim").any())
    return M.busy_note(samples, measured=measured)


def _runs(sources, df: pd.DataFrame) -> str:
    esc = html.escape
    rows = []
    for s in sources:
        part = df[df["run_dir"] == s.run_dir] if not df.empty else df
        hw = ", ".join(sorted(part["hardware"].dropna().astype(str).unique())) if not part.empty else ""
        ex = ", ".join(sorted(part["executor"].dropna().unique())) if not part.empty else ""
        counts = part["status"].value_counts().to_dict() if not part.empty else {}
        status = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        rows.append(
            f'<tr><td class="txt">{esc(s.sweep)}</td><td class="txt">{esc(s.run_dir)}</td>'
            f'<td class="num">{s.rows}</td><td class="txt">{esc(status)}</td><td class="txt">{esc(hw)}</td>'
            f'<td class="txt">{esc(ex)}</td><td class="txt">{esc(load_line(s, part))}</td></tr>'
        )
    return (
        '<p class="tcaption">The runs this report reads, with their trials per status and the machine\'s load.</p>'
        + _scroll(
            '<table class="data"><thead><tr><th class="txt">Sweep</th><th class="txt">Run folder</th>'
            '<th class="num">Rows</th><th class="txt">Status</th><th class="txt">Hardware</th>'
            '<th class="txt">Executors</th><th class="txt">Machine load</th></tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table>"
        )
    )


def _configs(sources) -> str:
    esc = html.escape
    out = []
    for s in sources:
        env = json.dumps(s.environment, indent=2, sort_keys=True) if s.environment else "(none)"
        out.append(
            f"<details><summary>{esc(s.sweep)}: {esc(s.run_dir)}</summary>"
            f"<pre>{esc(s.config_yaml or '(none)')}</pre><pre>{esc(env)}</pre></details>"
        )
    return "\n".join(out)
