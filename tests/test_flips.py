"""Option flips and repeats (suite/flips.py, suite/repeats.py; docs/conformance.md).

Flips: every own method, and every peer library that runs here (through the CPU test doubles
tests/test_peers.py uses), changes its output when any option the suite passes is flipped, and
passes the float64 check flipped, or refuses the option by name; a method that drops the soft cap
fails. Repeats: N calls on the same inputs report bitwise identity, the spread and any repeat
failing the check, and catch planted noise and a planted broken call.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import methods
import tests.plugins.probe_doubles as doubles
from methods.masks import FAMILIES
from suite.cli import main
from suite.flips import FAIL, PASS, SKIP, ProbeRunner, Shape, Variant, flips, run_flips, warm
from suite.repeats import run_repeats
from tests.helpers import own_methods

ROOT = Path(__file__).resolve().parents[1]
TINY = Shape(world_size=2, batch=1, seq_len=24, heads=2, kv_heads=1, head_dim=8)


@pytest.fixture(scope="module")
def runner():
    r = ProbeRunner()
    yield r
    r.close()


def test_every_own_method_uses_every_option(runner):
    """Each flip (causal, scale, soft cap and its value, sinks and their values, value head
    dim, documents and their lengths, every mask family and each of its parameters) changes every
    own method's output beyond the check's bound, and the flipped run passes the float64 check."""
    names = own_methods()
    warm([(n, {}, TINY) for n in names], runner)
    expected = {f.option for f in flips(TINY)}
    # 9 of the problem, and each registered mask family with a parameter: the family, then each parameter
    per_family = [1 + len(f.params) for f in FAMILIES.values() if f.params]
    assert len(expected) == 9 + sum(per_family) and len(per_family) == len(FAMILIES) - 2
    assert {"scale", "sink values", "softcap value", "sliding_window.window", "global_window.globals"} <= expected
    for name in names:
        rows = run_flips(name, {}, TINY, runner)
        assert {r.option for r in rows} == expected, name
        for r in rows:
            assert r.status in (PASS, SKIP), (name, r.option, r.reason)
            if r.status == SKIP:  # a refusal names the option (own methods take every one today)
                assert r.reason.startswith((r.option, "needs ")), (name, r.option, r.reason)
                continue
            assert r.changed and r.flipped_check == "ok", (name, r.option)
            assert r.delta != r.delta or r.delta > r.threshold > 0, (name, r.option, r.delta, r.threshold)


def test_a_method_dropping_the_soft_cap_fails_its_flips(runner, capsys):
    """drops_softcap passes the cap's ScoreScale on as a plain float: its output does not move when
    the cap is switched on or changed, so both soft-cap flips fail as dropped (and the flipped run
    fails the float64 check), while an option it keeps (the scale) passes."""
    rows = {r.option: r for r in run_flips("drops_softcap", {}, TINY, runner, ["softcap", "softcap value", "scale"])}
    for option in ("softcap", "softcap value"):
        r = rows[option]
        assert r.status == FAIL and f"option {option} dropped" in r.reason, r.reason
        assert r.changed is False and r.delta <= r.threshold and r.flipped_check == "INCORRECT"
    assert rows["scale"].status == PASS
    # the command exits 1 and names it
    argv = ["flips", "--methods", "drops_softcap", "--only", "softcap", "--seq-len", "24", "--heads", "2"]
    assert main(argv + ["--kv-heads", "1", "--head-dim", "8"]) == 1
    assert "dropped: drops_softcap softcap" in capsys.readouterr().out


def test_a_base_problem_the_method_refuses_is_one_skip_row(runner):
    """Ulysses scatters heads over the ranks: with 3 heads on 2 ranks nothing can be flipped, which is
    one row giving the method's reason; an unknown option to flip is an error listing the options."""
    rows = run_flips("ulysses", {}, Shape(world_size=2, seq_len=24, heads=3, kv_heads=3, head_dim=8), runner)
    assert len(rows) == 1 and rows[0].status == SKIP and rows[0].option == "*"
    assert "base problem" in rows[0].reason and "3" in rows[0].reason
    with pytest.raises(ValueError, match="the options are"):
        run_flips("ring", {}, TINY, runner, ["window"])
    assert main(["flips", "--methods", "ring", "--only", "nope"]) == 2


needs_peers = pytest.mark.skipif(
    not any(n in methods.available() for n in methods.registry.group_members("peers")),
    reason="no peer library installed (pip install -e .[peers])",
)


@needs_peers
def test_peer_libraries_flip_or_refuse_each_option_by_name():
    """Every peer that runs on this CPU (ring-flash-attn through its CPU test double, yunchang with its
    kernel shim; torch context parallel refuses the CPU) over gloo worker processes: each option it
    takes changes its output and passes the check; each it refuses is a skip naming the option and
    the library's reason. Nothing it accepts is dropped."""
    from methods.base import option_names
    from methods.registry import group_members

    peers = []  # every registered peer; with its kernel shim where it has one (yunchang's torch path is wrong)
    for name in (n for n in group_members("peers") if n in methods.available()):
        shim = "kernel_shim" in option_names(methods.method_class(name))
        peers.append(name + (":kernel_shim=true" if shim else ""))
    out = subprocess.run(
        [sys.executable, "-m", "suite", "flips", "--methods", *peers]
        + (["--plugin", "tests.plugins.rfa_cpu_shim"] if importlib.util.find_spec("ring_flash_attn") else []),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [
        [c.strip() for c in line.strip("|").split("|")] for line in out.stdout.splitlines() if line.startswith("| ")
    ][1:]
    by = {(r[0], r[1]): r for r in rows}
    for method, option, _, changed, check, status, reason in rows:
        assert status in (PASS, SKIP), (method, option, reason)
        if status == PASS:
            assert changed.startswith("yes") and check == "ok", (method, option)
        elif option != "*":
            assert reason.startswith((option + ":", f"needs {option.split('.')[0].split(' ')[0]}")), (
                method,
                option,
                reason,
            )
    if "rfa_ring" in peers:
        for option in ("causal", "scale", "documents", "document lengths"):
            assert by[("rfa_ring", option)][5] == PASS, option
        assert "softcap" in by[("rfa_ring", "softcap")][6] and by[("rfa_ring", "softcap")][5] == SKIP
        assert "asserts causal=True" in by[("rfa_zigzag", "causal")][6]
        assert "no attention-sink argument" in by[("rfa_llama3", "sinks")][6]
    if "yunchang_ulysses:kernel_shim=true" in peers:  # the kernel shim computes the cap yunchang hands on
        assert by[("yunchang_ulysses:kernel_shim=True", "softcap value")][5] == PASS
    assert "flips: " in out.stdout and " 0 fail" in out.stdout


# -- repeats ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ring", "ulysses"])
def test_repeats_of_a_deterministic_method(runner, name):
    """20 calls on the same inputs on virtual CPU ranks: every tensor bitwise identical, no spread, no
    failing repeat, every tensor checked against its bound."""
    rep = run_repeats(name, {}, TINY, Variant(), 20, runner)
    assert rep.status == "ok" and rep.repeats == 20 and rep.pass_ == "fwd_bwd"
    assert set(rep.identical) == {"out", "lse", "dq", "dk", "dv"}
    assert rep.deterministic and all(v == 0.0 for v in rep.spread.values()) and rep.differing == []
    assert rep.failures == [] and set(rep.tol) == set(rep.identical)
    assert all(0 < rep.worst[t] <= rep.tol[t] for t in rep.tol)


def test_repeats_report_noise_on_one_call_with_its_spread(runner):
    """noisy_once adds ~1e-7 to rank 0's output on call 5 only: out is reported not identical, the
    spread is exactly the noise added, only repeat 5 differs, and no repeat fails the check (the
    noise is below its bound): not a failure unless determinism is required."""
    doubles.NOISE.clear()
    rep = run_repeats("noisy_once", {}, TINY, Variant(), 20, runner)
    assert rep.status == "ok" and not rep.identical["out"] and not rep.deterministic
    assert rep.spread["out"] == doubles.NOISE[0] > 0
    assert rep.differing == [doubles.NOISY_CALL]
    assert rep.failures == []
    common = ["repeats", "--method", "noisy_once", "-n", "20", "--seq-len", "24", "--heads", "2", "--kv-heads", "1"]
    assert main(common + ["--head-dim", "8"]) == 0
    assert main(common + ["--head-dim", "8", "--require-deterministic"]) == 1


def test_repeats_flag_the_one_broken_repeat(capsys):
    """broken_once scales rank 1's output by 1.5 on call 7: that repeat, and only it, fails the check;
    the command names it and exits 1."""
    argv = ["repeats", "--method", "broken_once", "-n", "20", "--seq-len", "24", "--heads", "2", "--kv-heads", "1"]
    assert main(argv + ["--head-dim", "8"]) == 1
    text = capsys.readouterr().out
    assert f"repeat {doubles.BROKEN_CALL} FAILS the check: out" in text
    assert "1 repeat(s) fail the float64 check" in text and "repeats differing from repeat 0: 1 of 19" in text
