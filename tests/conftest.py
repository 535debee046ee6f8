import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def write_config(tmp_path):
    """Write a sweep YAML into tmp_path; results go to tmp_path/results unless overridden."""

    def write(text: str, name: str = "sweep.yaml") -> Path:
        body = textwrap.dedent(text)
        if "results:" not in body:
            body += f"\nresults:\n  root: {tmp_path / 'results'}\n"
        path = tmp_path / name
        path.write_text(body)
        return path

    return write
