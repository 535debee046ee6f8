"""The files that ship with the suite: sweep configs, topologies, model shapes and document-length
histograms. In a checkout they are its configs/ folder; an installed wheel carries the same folder as
suite/configs (pyproject.toml maps it), so `sp-suite run quickstart` works outside any checkout."""

from __future__ import annotations

import re
from pathlib import Path

_HERE = Path(__file__).resolve().parent
CONFIGS = _HERE / "configs" if (_HERE / "configs").is_dir() else _HERE.parent / "configs"
TOPOLOGIES = CONFIGS / "topologies"
MODELS = CONFIGS / "models"
DOCUMENTS = CONFIGS / "documents"


def sweep_files(root: Path = CONFIGS) -> dict[str, Path]:
    """Name -> sweep file: <root>/<name>.yaml and <root>/<folder>/<name>.yaml whose top level has a
    `sweep` section (the pieces beside them, topologies, models, length distributions, have none)."""
    out = {}
    for path in sorted(root.rglob("*.yaml")):
        if re.search(r"^sweep:", path.read_text(encoding="utf-8"), re.MULTILINE):
            out[path.relative_to(root).with_suffix("").as_posix()] = path
    return out


def sweep_config(name_or_path: str | Path) -> Path:
    """A sweep file: an existing path as given; else `configs/...` of the bundled folder (so the
    README's commands work outside a checkout); else a bundled sweep by name (`quickstart`,
    `paper/tasp_8gpu`). What matches nothing comes back unchanged, for the loader to report."""
    path = Path(name_or_path)
    if path.is_file() or path.is_absolute():
        return path
    if path.parts[:1] == ("configs",) and (CONFIGS.parent / path).is_file():
        return CONFIGS.parent / path
    return sweep_files().get(path.with_suffix("").as_posix() if path.suffix == ".yaml" else str(path), path)
