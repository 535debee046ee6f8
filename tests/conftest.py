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


def pytest_addoption(parser):
    parser.addoption(
        "--long",
        action="store_true",
        help="also run the tests marked `long` (make test-long): wider grids of properties that a "
        "default test already checks",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--long"):
        return
    # A `long` test widens a grid whose property a default test checks (docs/contributing.md): it
    # is a recorded skip in `make test`, and `make test-long` runs it.
    skip = pytest.mark.skip(reason="a wider grid of a property a default test checks: run with --long (make test-long)")
    for item in items:
        if item.get_closest_marker("long"):
            item.add_marker(skip)


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
