import textwrap
from pathlib import Path

import pytest
import torch

# One intra-op thread per test process. The tests' tensors are small, and `make test` runs one
# process per core (pytest-xdist): torch's default of a thread per core then puts two threads on
# each core, and they spend more time handing work to each other than computing (measured: 443
# tests of test_variants.py and test_sinks.py took 36-50 s with the default and 14-21 s with one
# thread, on 2 shared cores). Sweeps started by a test set their ranks' own threads, as in use.
torch.set_num_threads(1)

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
