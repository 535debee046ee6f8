"""One table of a trial's identity axes (suite.metrics.TRIAL_AXES; docs/DESIGN.md section 7): the
config's lists and exclude axes, the checks, the key, the case, the rows and the reports derive what
they list from it, so that a new axis of the problem is one entry there (docs/extending.md)."""

import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from suite import metrics as M
from suite.config import AXES, ConfigError, load_config
from suite.config.schema import SweepConfig
from suite.plan import Place, TrialSpec, expand
from suite.workloads import make_workload

ROOT = Path(__file__).resolve().parents[1]


def test_the_config_lists_and_exclude_axes_are_the_tables():
    sweep = {f.name for f in fields(SweepConfig)}
    assert AXES == tuple(a.name for a in M.TRIAL_AXES if a.rule)
    assert all(a.sweep in sweep for a in M.TRIAL_AXES if a.sweep)
    # a variant is keyed and stored only off its plain value, so it has one (and no row carries it always)
    assert all(a.plain and not a.always for a in M.VARIANTS) and set(M.VARIANT_IDENTITY).isdisjoint(M.IDENTITY)


def test_a_plain_variant_leaves_the_key_and_a_set_one_joins_it():
    spec = TrialSpec("ring", "own", "threads", "h", "t", 2, 1, 1, 2, 1, 64, 4, 4, 8, "float32", True, "fwd", "auto")
    capped = TrialSpec(**{**{f.name: getattr(spec, f.name) for f in fields(TrialSpec)}, "softcap": 5.0})
    assert "softcap" not in spec.identity() and capped.identity()["softcap"] == 5.0
    assert capped.key != spec.key and capped.case().softcap == 5.0 and "cap=5" in capped.label()
    assert M.keyed_identity(capped.identity()) == {**M.keyed_identity(spec.identity()), "softcap": 5.0}


@pytest.mark.parametrize(
    "override, message",
    [("sweep.softcap=[-1.0]", ">= 0"), ("sweep.softcap=[5,5.0]", "duplicates"), ("sweep.head_dim_v=[]", "null")],
)
def test_the_tables_bounds_are_checked(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/quickstart.yaml", [override])


# A process whose table has one more entry than the checkout's: nothing else is edited.
NEW_AXIS = """
import json, sys, types
from pathlib import Path
src = Path("suite/metrics.py").read_text()
entry = "    Axis('qk_norm', bool, plain=(False,), always=False, sweep='qk_norm', label='qk'),\\n)\\nAXIS = {"
assert src.count("\\n)\\nAXIS = {") == 1
metrics = types.ModuleType("suite.metrics")
metrics.__file__ = str(Path("suite/metrics.py").resolve())
sys.modules["suite.metrics"] = metrics
exec(compile(src.replace("\\n)\\nAXIS = {", "\\n" + entry, 1), metrics.__file__, "exec"), metrics.__dict__)
import suite
suite.metrics = metrics
from suite.config import ConfigError, load_config
from suite.plan import Place, expand
from suite.records import complete
from suite.workloads import make_workload

def plan(overrides):
    cfg = load_config("configs/quickstart.yaml", ["sweep.methods=[ring]"] + overrides)[0]
    return expand(cfg, make_workload(cfg.kind, cfg), [Place("h", "t", lambda w: 1)], "cpu")

both = plan(["sweep.qk_norm=[false,true]", "sweep.exclude=[{qk_norm: true, world_size: 1}]"])
try:
    load_config("configs/quickstart.yaml", ["sweep.qk_norm=[true,true]"])
    refused = ""
except ConfigError as e:
    refused = str(e)
print(json.dumps({
    "plain": [s.key for s in plan([])],
    "off": [s.key for s in both if not s.value("qk_norm")],
    "off_rows": [c for s in both if not s.value("qk_norm") for c in complete(s.identity()) if c == "qk_norm"],
    "on": [[s.world_size, s.identity().get("qk_norm"), s.label(), complete(s.identity()).get("qk_norm")]
           for s in both if s.value("qk_norm")],
    "refused": refused,
    # the problem key: unset, the plain problem's; set, a problem of its own (inputs, reference)
    "problems": [[s.value("qk_norm"), repr(s.problem_key().args)] for s in both if s.world_size > 1],
}))
"""


def test_a_new_axis_is_one_entry_of_the_table():
    """An axis added to the table alone is a config list, checked, planned (and excludable), keyed
    and labelled only when set, and a row column; trials that leave it unset keep their keys."""
    out = subprocess.run([sys.executable, "-c", NEW_AXIS], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    cfg = load_config("configs/quickstart.yaml", ["sweep.methods=[ring]"])[0]
    today = [s.key for s in expand(cfg, make_workload(cfg.kind, cfg), [Place("h", "t", lambda w: 1)], "cpu")]
    assert got["plain"] == today and got["off"] == today and got["off_rows"] == []  # keys and columns as before
    assert got["on"] and all(ws > 1 and on is True and row and " qk " in label for ws, on, label, row in got["on"])
    assert "sweep.qk_norm: has duplicates" in got["refused"]
    off = {args for on, args in got["problems"] if not on}
    on = {args for on, args in got["problems"] if on}
    assert off and on and not off & on  # a set axis separates the problem from the plain one
    today_args = {
        repr(s.problem_key().args)
        for s in expand(cfg, make_workload(cfg.kind, cfg), [Place("h", "t", lambda w: 1)], "cpu")
    }
    assert off <= today_args  # and the plain one keeps its inputs' seed
