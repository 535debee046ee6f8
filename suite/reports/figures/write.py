"""Writing: each job's PNG and PDF, drawn in forked worker processes, and not drawn again when a
key stored beside its files says the same numbers were drawn by the same code before."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Optional

import matplotlib
import matplotlib.pyplot as plt
import matplotlib.text

from suite.reports import style as S
from suite.reports.figures import draw as D
from suite.reports.figures import plan as P
from suite.reports.figures.plan import FigureJob


def _code_version() -> str:
    h = hashlib.sha256(matplotlib.__version__.encode())
    for mod in (P.__file__, D.__file__, __file__, S.__file__):
        h.update(Path(mod).read_bytes())
    return h.hexdigest()


_CODE_VERSION = _code_version()


def _key(job: FigureJob, palette: S.Palette) -> str:
    """Content hash: the numbers, the parameters, the series' styles and the code that plans,
    draws and writes figures."""
    h = hashlib.sha256()
    h.update(_CODE_VERSION.encode())
    h.update(json.dumps([job.name, job.kind, job.params], sort_keys=True, default=str).encode())
    series = sorted(set(job.data["series"])) if "series" in job.data else []
    h.update(
        json.dumps(
            [[s, palette.styles.get(s).__dict__ if s in palette.styles else None] for s in series], sort_keys=True
        ).encode()
    )
    h.update(job.data.to_json(orient="split", double_precision=15).encode())
    return h.hexdigest()


_JOBS: list = []  # (job, palette, out_dir) of the current render, read by forked workers by index


def _write(i: int) -> list[str]:
    job, palette, out = _JOBS[i]
    fig = D.draw(job, palette)
    paths = []
    with plt.rc_context(S.RC):
        for ext in ("png", "pdf"):
            if ext == "pdf":
                # no ligatures ("fl" in "float32"): matplotlib embeds ligature glyphs as a second
                # subset of the font, and subsetting DejaVu Sans is most of a PDF's writing time
                for text in fig.findobj(matplotlib.text.Text):
                    text.set_fontfeatures(["-liga"])
            path = out / f"{job.name}.{ext}"
            tmp = path.with_name(f".{path.name}.tmp")
            fig.savefig(
                tmp,
                format=ext,
                dpi=S.DPI if ext == "png" else None,
                metadata={"Creator": "sp-attention-suite report"} if ext == "pdf" else None,
            )
            tmp.replace(path)
            paths.append(str(path))
    plt.close(fig)
    (out / f".{job.name}.key").write_text(_key(job, palette))
    return paths


def render_figures(
    jobs: list[FigureJob],
    palette: S.Palette,
    out_dir,
    *,
    workers: Optional[int] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    cache: bool = True,
) -> tuple[dict[str, list[str]], int]:
    """Write every job's PNG and PDF under `out_dir`; returns ({job name: paths}, figures drawn).
    A job whose key (numbers, styles, code) matches the one stored beside its files is not drawn
    again. The rest are drawn in forked worker processes, one figure per task."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done: dict[str, list[str]] = {}
    todo = []
    for job in jobs:
        files = [out / f"{job.name}.png", out / f"{job.name}.pdf"]
        key_file = out / f".{job.name}.key"
        if (
            cache
            and all(f.exists() for f in files)
            and key_file.exists()
            and key_file.read_text() == _key(job, palette)
        ):
            done[job.name] = [str(f) for f in files]
        else:
            todo.append(job)
    total = len(jobs)
    if progress:
        progress(len(done), total)
    global _JOBS
    _JOBS = [(job, palette, out) for job in todo]
    n = workers if workers is not None else min(len(todo), _cpus())
    try:
        if n > 1 and "fork" in mp.get_all_start_methods():
            _warm_up()
            with ProcessPoolExecutor(n, mp_context=mp.get_context("fork")) as pool:
                futures = {pool.submit(_write, i): job.name for i, job in enumerate(todo)}
                for fut in as_completed(futures):
                    done[futures[fut]] = fut.result()
                    if progress:
                        progress(len(done), total)
        else:
            for i, job in enumerate(todo):
                done[job.name] = _write(i)
                if progress:
                    progress(len(done), total)
    finally:
        _JOBS = []
    return {job.name: done[job.name] for job in jobs}, len(todo)


def _warm_up() -> None:
    """Load fonts and both backends once in the parent, so forked workers inherit them instead of
    each paying for them on its first figure."""
    import io

    with plt.rc_context(S.RC):
        fig = plt.figure(figsize=(1, 1))
        fig.text(0.5, 0.5, "0.5 x")
        for fmt in ("png", "pdf"):
            fig.savefig(io.BytesIO(), format=fmt)
        plt.close(fig)


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
