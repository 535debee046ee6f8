"""One self-contained HTML page per report: figures embedded (base64 PNG), tables, and the resolved
configs and environment fingerprints of the runs it draws on. No external scripts, styles or
images, so the file can be mailed, archived or attached to an MLflow run as it is."""
from __future__ import annotations

import base64
import html
import json
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
from jinja2 import Environment

_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{{ title|e }}</title>
<style>
 body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1200px;
        color: #222; line-height: 1.4; padding: 0 1em; }
 h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 2em; }
 table { border-collapse: collapse; font-size: .85em; margin: .5em 0 1.5em; }
 th, td { border: 1px solid #ddd; padding: .25em .5em; text-align: right; white-space: nowrap; }
 th { background: #f4f4f4; } td:first-child, th:first-child { text-align: left; }
 .scroll { overflow-x: auto; } img { max-width: 100%; margin: .5em 0 1.5em; }
 pre { background: #f7f7f7; padding: .8em; overflow-x: auto; font-size: .8em; }
 .note { color: #666; font-size: .9em; } .warn { color: #a33; }
</style>
</head>
<body>
<h1>{{ title|e }}</h1>
<p class="note">Generated {{ generated|e }} from {{ sources|length }} run(s), {{ rows }} trial rows.
Executors: {{ executors|e }}. Rows from different executors are labelled in every table and figure;
numbers from <code>threads</code> (virtual ranks) or <code>sim</code> (simulator) are not measured hardware performance.</p>
<h2>Runs</h2>
<div class="scroll"><table><tr><th>sweep</th><th>run folder</th><th>rows</th></tr>
{% for s in sources %}<tr><td>{{ s.sweep|e }}</td><td>{{ s.run_dir|e }}</td><td>{{ s.rows }}</td></tr>
{% endfor %}</table></div>
{% for t in tables %}
<h2>{{ t.title|e }}</h2>
{% if t.note %}<p class="note">{{ t.note|e }}</p>{% endif %}
<div class="scroll">{{ t.html }}</div>
{% endfor %}
<h2>Figures</h2>
{% for f in figures %}<figure><img alt="{{ f.name|e }}" src="data:image/png;base64,{{ f.data }}"><figcaption class="note">{{ f.name|e }}</figcaption></figure>
{% endfor %}
{% if notes %}<h2>Not drawn</h2><ul>{% for n in notes %}<li class="note">{{ n|e }}</li>{% endfor %}</ul>{% endif %}
<h2>Resolved configs and environments</h2>
{% for s in sources %}<h3>{{ s.sweep|e }}: {{ s.run_dir|e }}</h3>
<pre>{{ s.config_yaml|e }}</pre>
<pre>{{ s.environment|e }}</pre>
{% endfor %}
</body>
</html>
"""

_NOTES = {
    "correctness": "status and the largest max-abs error (out, lse, dq, dk, dv) vs float64 on the unsharded inputs",
    "throughput_by_seq_len": "TFLOP/s per GPU (percent of ideal: single-device reference time / P)",
    "communication": "bytes one iteration moves per rank; time split from the run's breakdown (ms)",
}


# Tables kept out of the page (in the tables/ files only): the flat per-row throughput table, which
# the by-sequence-length table shows in the paper layout.
_FILES_ONLY = {"throughput"}


def _table_html(table: pd.DataFrame) -> str:
    def fmt(v):
        if isinstance(v, float):
            return "" if pd.isna(v) else (f"{v:.3g}" if abs(v) < 1e4 else f"{v:.4g}")
        return html.escape(str(v))
    shown = table.apply(lambda c: c.map(fmt)) if not table.empty else table
    return shown.to_html(escape=False, border=0)


def write_html(path: Path, *, title: str, tables: dict[str, pd.DataFrame], figure_pngs: list[str],
               sources, notes: list[str], rows: int, executors: list[str]) -> Path:
    env = Environment(autoescape=False)
    page = env.from_string(_TEMPLATE).render(
        title=title, generated=datetime.now(timezone.utc).isoformat(timespec="seconds"), rows=rows,
        executors=", ".join(executors) or "none",
        sources=[{"sweep": s.sweep, "run_dir": s.run_dir, "rows": s.rows, "config_yaml": s.config_yaml or "(none)",
                  "environment": json.dumps(s.environment, indent=2, sort_keys=True) if s.environment else "(none)"}
                 for s in sources],
        tables=[{"title": name.replace("_", " "), "note": _NOTES.get(name, ""), "html": _table_html(t)}
                for name, t in tables.items() if t is not None and not t.empty and name not in _FILES_ONLY],
        figures=[{"name": Path(p).stem, "data": base64.b64encode(Path(p).read_bytes()).decode()} for p in figure_pngs],
        notes=notes)
    path.write_text(page, encoding="utf-8")
    return path
