"""Mutation conformance (suite/conformance.py, docs/conformance.md): every seeded bug is caught by the
float64 check, on a clean baseline, without reaching the reference that judges it."""

from __future__ import annotations

import json

import pytest

from suite import conformance as C
from suite import metrics as M
from tests.helpers import own_methods


@pytest.fixture(scope="module")
def report():
    return C.run_conformance()


def test_every_mutant_is_caught_by_a_check_column_on_a_clean_baseline(report):
    assert report.baseline and report.baseline_ok, [(v.label, v.caught_by()) for v in report.baseline if v.caught]
    assert len(report.results) == len(C.MUTANTS) >= 15
    missed = [r.mutant.name for r in report.results if not r.caught]
    assert not missed, f"mutants the check did not catch: {missed}"
    columns = set(M.ERR.values())
    for r in report.results:
        # caught by the pass rule itself, not by a crash (every mutant here is a silent wrong answer)
        assert r.caught_by() and set(r.caught_by()) <= columns, (r.mutant.name, r.caught_by())
        # far past the bound, not at its edge: a catch that a noisier dtype or shape would keep
        assert r.ratio > 10, (r.mutant.name, r.ratio)
    assert report.ok
    assert C.summary_line(report).startswith(f"caught {len(C.MUTANTS)}/{len(C.MUTANTS)} (100 %); baseline clean")


def test_the_grid_reaches_every_own_method_and_each_gradient_and_the_sinks(report):
    """A new method gets a mutant that runs it; every checked tensor catches some mutant."""
    reached = {pt.method for m in C.MUTANTS for pt in m.points}
    assert set(own_methods()) <= reached, set(own_methods()) - reached
    caught = {c for r in report.results for c in r.caught_by()}
    assert caught == set(M.ERR.values()), set(M.ERR.values()) - caught


def test_patches_are_undone_even_when_the_trial_raises():
    for m in C.MUTANTS:
        spec = m.points[0].spec()
        with pytest.raises(KeyError), m.apply(spec) as patches:
            targets = patches.targets
            assert targets, m.name
            changed = [(owner, name, vars(owner)[name]) for owner, name in targets]
            raise KeyError("the trial failed")
        for owner, name, mutated in changed:
            assert vars(owner)[name] is not mutated, (m.name, name)


def test_a_mutant_that_breaks_nothing_is_reported_missed_and_fails_the_run():
    noop = C.Mutant("noop", "none", "nothing", "patches a name to itself", (C.Point("ring", 2),), _same_circulate)
    report = C.run_conformance([noop])
    assert report.baseline_ok and not report.ok
    assert [r.caught for r in report.results] == [False]
    assert "MISSED" in C.format_text(report) and "caught 0/1 (0 %)" in C.format_text(report)


def _same_circulate(p, spec):
    from methods import kv_ring

    p.set(kv_ring, "circulate", kv_ring.circulate)


def test_a_mutant_that_reaches_the_reference_stops_the_run():
    """The reference of a mutated run comes from its unmutated run; a mutant that makes the check
    compute a new one (here: positions in another order) is refused, never counted as caught."""
    from methods import layouts

    def moved(p, spec):
        real = layouts.contiguous

        def contiguous(seq_len, world_size):
            lay = real(seq_len, world_size)
            held = [lay.positions(r).flip(0) for r in range(world_size)]
            return layouts.Layout("contiguous", seq_len, world_size, lambda: tuple(held))

        p.set(layouts, "contiguous", contiguous)

    bad = C.Mutant("moved", "layout", "layouts", "other positions", (C.Point("ring", 2, causal=False),), moved)
    with pytest.raises(RuntimeError, match="float64 reference"):
        C.run_conformance([bad])


def test_select_by_name_and_method_and_refuse_unknown_ones():
    assert [m.name for m in C.select(["stale_kv_buffer"])] == ["stale_kv_buffer"]
    only_usp = C.select(None, ["usp"])
    assert only_usp and all(pt.method == "usp" for m in only_usp for pt in m.points)
    assert "ring_last_step_dropped" not in [m.name for m in only_usp]  # it has no usp trial
    with pytest.raises(ValueError, match="unknown mutant"):
        C.select(["no_such_bug"])
    with pytest.raises(ValueError, match="unknown method"):
        C.select(None, ["no_such_method"])


def test_command_prints_the_table_and_writes_it(tmp_path, capsys):
    from suite.cli import main

    code = main(["conformance", "--mutants", "dq_rounded_to_bf16", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "dq_rounded_to_bf16" in out and "err_dq" in out and "caught 1/1 (100 %)" in out
    rows = [json.loads(line) for line in (tmp_path / "conformance.jsonl").read_text().splitlines()]
    assert rows[0]["mutant"] == "dq_rounded_to_bf16" and rows[0]["status"] == "caught"
    assert rows[0]["caught_by"] == ["err_dq"] and rows[-1]["caught_by"] == []  # the baseline's
    assert "| dq_rounded_to_bf16 |" in (tmp_path / "conformance.md").read_text()
    assert main(["conformance", "--mutants", "nope"]) == 2


def test_points_build_the_trials_a_sweep_would():
    docs = C.Point("ring", 3, documents=(5, 9, 4, 7, 11)).spec()
    assert docs.seq_len == 9 and docs.document_lengths() == ((5, 4), (5, 4))  # packed, the last cut
    assert json.loads(docs.workload)["documents"]["distribution"] == "fixed"
    window = C.Point("ring", 4, mask="sliding_window:5", seq_len=24).spec()
    assert window.mask_spec is not None and window.mask_spec.family == "sliding_window"
    usp = C.Point("usp", 4, heads=4, kv_heads=2, options=(("ulysses_degree", 2),)).spec()
    assert (usp.ulysses_degree, usp.ring_degree, usp.seq_len) == (2, 2, 3 * 4)
