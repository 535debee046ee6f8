"""report.html as a reader sees it: rendered by headless Chromium (skipped where Chromium is not
installed). A copy of the page gets a small script that measures the rendered page (the report
itself has none: it must stay a plain, mailable file); Chromium's --dump-dom hands the numbers back.

Run on a real report, with the screenshot kept (optional: window height in pixels):
    python -m tests.test_report_browser reports/quickstart/report.html reports/recorded/report_screenshot.png 3000
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from suite import metrics as M

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
# The flags keep a headless start quick and quiet on a machine without network access.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--virtual-time-budget=15000",
]
MIN_NATURAL_WIDTH = 600  # pixels of a figure PNG: below this tick labels blur

_PROBE = """<script>
window.addEventListener('load', () => {
  const ids = new Set([...document.querySelectorAll('[id]')].map(e => e.id));
  const links = [...document.querySelectorAll('nav.toc a')].map(a => a.getAttribute('href'));
  const r = {
    toc: links, broken: links.filter(h => !h.startsWith('#') || !ids.has(h.slice(1))),
    images: [...document.images].map(img => ({alt: img.alt, complete: img.complete, natural: img.naturalWidth,
      shown: img.getBoundingClientRect().width, declared: +img.getAttribute('width')})),
    numbers: [...document.querySelectorAll('td.num')].slice(0, 200).map(td => getComputedStyle(td).textAlign),
    height: document.documentElement.scrollHeight, text: document.body.innerText.length,
    overflow: document.documentElement.scrollWidth - document.documentElement.clientWidth,
    figcaptions: document.querySelectorAll('figure figcaption').length,
    captions: document.querySelectorAll('p.tcaption').length,
  };
  const out = document.createElement('pre');
  out.id = 'browser-check';
  out.textContent = JSON.stringify(r);
  document.body.appendChild(out);
});
</script>"""


def _chromium(args: list[str], profile: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [BROWSER, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=timeout
    )


def browser_check(page: Path, screenshot: Path, width: int = 1600, height: int = 2200) -> dict:
    """Measure `page` as Chromium renders it, and save a screenshot of its top. Returns the probe's
    numbers plus the screenshot's share of non-white pixels."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        probe = tmp / "page.html"
        probe.write_text(page.read_text(encoding="utf-8").replace("</body>", _PROBE + "</body>"), encoding="utf-8")
        out = _chromium([f"--window-size={width},{height}", "--dump-dom", probe.as_uri()], tmp / "profile")
        found = re.search(r'<pre id="browser-check">(.*?)</pre>', out.stdout, re.S)
        assert found, f"no probe output from Chromium (rc {out.returncode}): {out.stderr[-2000:]}"
        result = json.loads(html.unescape(found.group(1)))
        shot = _chromium(
            [f"--window-size={width},{height}", f"--screenshot={screenshot}", page.as_uri()], tmp / "profile2"
        )
        assert shot.returncode == 0 and screenshot.exists(), shot.stderr[-2000:]
    from matplotlib.image import imread

    pixels = imread(screenshot)[..., :3]
    result["ink"] = float((pixels.min(axis=-1) < 0.9).mean())  # share of pixels that are not (near) white
    return result


def assert_readable(result: dict, images: int) -> None:
    assert result["toc"] and not result["broken"], f"contents links without a target: {result['broken']}"
    assert len(result["images"]) == images, "every figure is on the page"
    for img in result["images"]:
        assert img["complete"] and img["natural"] >= MIN_NATURAL_WIDTH, img
        # drawn at its declared size (inches x 96 px), never shrunk to fit a column
        assert img["shown"] >= img["declared"] - 1, img
    assert result["figcaptions"] == images and result["captions"] >= 1
    assert result["numbers"] and set(result["numbers"]) == {"right"}, "numbers are right-aligned"
    assert result["overflow"] <= 0, "wide tables scroll in their box, never past the page's right edge"
    assert result["ink"] > 0.02 and result["text"] > 500, "the page renders (not blank)"


@pytest.mark.skipif(BROWSER is None, reason="Chromium is not installed (apt-get install chromium runs this check)")
def test_report_page_in_headless_chromium(tmp_path):
    from suite.reports import build_report
    from tests.test_reports import row, write_run

    rows = [row("reference", 1, S) for S in (256, 512)]
    rows += [
        row(m, P, S, kv_heads=kv) for m in ("ring", "ulysses") for P in (2, 4) for S in (256, 512) for kv in (8, 4)
    ]
    rows.append(row("burst", 2, 512, status=M.FAILED, reason="rank 1: RuntimeError: boom"))
    rep = build_report([str(write_run(tmp_path / "results", "syn", rows))], out=tmp_path / "rep", log_to_mlflow=False)
    result = browser_check(rep.html, tmp_path / "shot.png")
    assert_readable(result, sum(f.endswith(".png") for f in rep.figures))
    # an anchor per section and per problem shape
    assert {
        "#correctness",
        "#throughput",
        "#throughput-b-1-h-8-4-d-64-float32",
        "#throughput-b-1-h-8-8-d-64-float32",
    } <= set(result["toc"])


if __name__ == "__main__":
    page, shot = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    res = browser_check(page, shot, height=int(sys.argv[3]) if len(sys.argv) > 3 else 2200)
    assert_readable(res, len(res["images"]))
    print(json.dumps({k: v for k, v in res.items() if k not in ("numbers",)}, indent=1))
