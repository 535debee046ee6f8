"""`python -m suite validate`: the simulator against published tables, and the error band every
simulated row carries. The full validation runs here (about 35 s on two shared cores) and fails when
its mean |error| regresses past the record; the row matching and the error arithmetic are tested on
their own, with rows that make them fail."""

import json
import math

import pandas as pd
import pytest

from suite import metrics as M
from suite.advise import within_bands
from suite.sim.bands import (
    COMM_BOUND,
    KERNEL_BOUND,
    Bands,
    Summary,
    bound_of,
    load_bands,
    topology_kind,
    write_bands,
)
from suite.sim_validation import (
    PublishedRow,
    RowResult,
    ValidationError,
    candidates,
    check,
    error_pct,
    expand_match,
    find,
    load_table,
    make_bands,
    record_matches,
    summarize,
    validate,
    validation_files,
    value_in_unit,
)


def _rec(method="ring", time=10.0, compute=10.0, status=M.OK, options=None, workload=None, **kw):
    r = {
        "method": method,
        "world_size": 8,
        "seq_len": 65536,
        "pass": "fwd",
        "topology": "h100_sxm",
        M.STATUS: status,
        M.REASON: "",
        M.TIME_MS_MEDIAN: time,
        M.COMPUTE_ONLY_MS: compute,
        "options": json.dumps(options or {}),
        "workload": json.dumps({"documents": {"name": workload}}) if workload else None,
    }
    r.update(kw)
    return r


# -- matching --------------------------------------------------------------------------------------------
def test_a_match_compares_columns_options_as_a_subset_and_the_mix_by_name():
    r = _rec("usp", options={"ulysses_degree": 4, "kernel": "auto"}, workload="docs_g2")
    assert record_matches(r, {"method": "usp", "options": {"ulysses_degree": 4}, "workload": "docs_g2"})
    assert not record_matches(r, {"method": "usp", "options": {"ulysses_degree": 2}})
    assert not record_matches(r, {"workload": "uniform"})
    assert record_matches(_rec(), {"workload": "uniform", "pass": "fwd"})
    assert not record_matches(_rec(), {"pass": "fwd_bwd"})


def test_a_list_value_is_the_mean_time_over_its_rows():
    match = {"method": "ring", "workload": ["a", "b"], "seq_len": 65536}
    assert expand_match(match) == [{**match, "workload": "a"}, {**match, "workload": "b"}]
    rows = [_rec(time=10.0, workload="a"), _rec(time=30.0, compute=20.0, workload="b")]
    found, why = find(rows, match)
    assert why == "" and found.time_ms == 20.0 and found.compute_only_ms == 15.0
    found, why = find(rows[:1], match)  # one of the splits missing: no prediction
    assert found is None and "no simulated row" in why


def test_a_peer_that_cannot_be_simulated_gives_way_to_its_stand_in():
    peer = {"method": "rfa_zigzag", "pass": "fwd"}
    row = PublishedRow("zigzag", 63.0, "iter/s", peer, stand_in={"method": "zigzag_ring"})
    tried = candidates(row)
    assert tried == [(peer, False), ({"method": "zigzag_ring", "pass": "fwd"}, True)]
    skipped = _rec("rfa_zigzag", status=M.SKIPPED, time=None, reason="ring-flash-attn is not importable")
    found, why = find([skipped], peer)
    assert found is None and "skipped" in why and "not importable" in why
    # a stand-in without a method: the own method matched is itself the stand-in
    assert candidates(PublishedRow("b", 1.0, "ms", {"method": "burst"}, stand_in={"note": "own"})) == [
        ({"method": "burst"}, True)
    ]
    # method null: nothing stands in
    assert candidates(PublishedRow("u", 1.0, "ms", peer, stand_in={"method": None})) == [(peer, False)]


# -- the arithmetic ----------------------------------------------------------------------------------------
def test_error_is_relative_to_the_published_value_in_its_unit():
    assert error_pct(11.0, 10.0) == pytest.approx(10.0)
    assert error_pct(9.0, 10.0) == pytest.approx(-10.0)
    with pytest.raises(ValueError):
        error_pct(1.0, 0.0)
    with pytest.raises(ValueError):
        error_pct(math.inf, 1.0)
    found, base = find([_rec(time=50.0)], {})[0], find([_rec(time=5.0)], {})[0]
    assert value_in_unit(PublishedRow("a", 1, "ms", {}), found, None) == 50.0
    assert value_in_unit(PublishedRow("a", 1, "iter/s", {}), found, None) == pytest.approx(20.0)
    # ring-flash-attn's percent: ring iter/s over (flash iter/s / 8) = 8 x flash time / ring time
    pct = PublishedRow("a", 1, "percent", {}, baseline={}, factor=8)
    assert value_in_unit(pct, found, base) == pytest.approx(80.0)
    assert value_in_unit(PublishedRow("a", 1, "speedup", {}, baseline={}), found, base) == pytest.approx(0.1)


def test_summaries_count_only_counted_simulated_rows():
    def res(err, counted=True, bound=KERNEL_BOUND, kind="switch"):
        row = PublishedRow("r", 1.0, "ms", {}, counted=counted)
        return RowResult("t", row, 1.0, err, bound=bound, kind=kind, method="zigzag_ring")

    results = [res(-10.0), res(30.0), res(5.0, bound=COMM_BOUND, kind="pcie"), res(500.0, counted=False)]
    results.append(RowResult("t", PublishedRow("x", 1.0, "ms", {})))  # not simulated
    overall, bounds, families = summarize(results)
    assert overall.rows == 3 and overall.mean_abs_pct == pytest.approx(15.0) and overall.max_abs_pct == 30.0
    assert overall.median_abs_pct == 10.0
    assert families["kernel-bound/switch/ring"].mean_abs_pct == pytest.approx(20.0)
    assert set(bounds) == {KERNEL_BOUND, COMM_BOUND}


def test_check_fails_on_a_regressed_mean_and_on_a_row_beyond_the_limit():
    bands = Bands(Summary(2, 10.0, 10.0, 12.0), margin_pct=2.0, row_limit_pct=20.0)

    def res(err):
        return RowResult("t", PublishedRow(f"row {err}", 1.0, "ms", {}), 1.0, err, bound=KERNEL_BOUND, kind="switch")

    assert check([res(11.0), res(-11.0)], bands) == []
    problems = check([res(13.0), res(-13.0)], bands)  # mean 13 > 10 + 2
    assert len(problems) == 1 and "mean |error| 13.0%" in problems[0]
    problems = check([res(1.0), res(21.0)], bands)  # mean 11 passes, one row over 20
    assert len(problems) == 1 and "row 21.0" in problems[0]
    # a row the record lists beyond the limit is a known miss: held to its recorded |error| + margin
    bands.over_limit = {"t: row 21.0": 20.5, "t: row 23.0": 20.5}
    assert check([res(1.0), res(21.0)], bands) == []
    problems = check([res(-1.0), res(23.0)], bands)  # 23 > 20.5 + 2
    assert len(problems) == 1 and "row 23.0" in problems[0] and "grew past its recorded 20.5%" in problems[0]


def test_the_record_lists_the_rows_beyond_its_limit_and_reads_them_back(tmp_path):
    def res(label, err):
        return RowResult("t", PublishedRow(label, 1.0, "ms", {}), 1.0, err, bound=KERNEL_BOUND, kind="switch")

    previous = Bands(Summary(1, 1.0, 1.0, 1.0), row_limit_pct=15.0)
    bands = make_bands([res("near", 14.0), res("far", -31.234), res("farther", 40.0)], previous, ["t"])
    assert bands.over_limit == {"t: far": 31.23, "t: farther": 40.0}
    path = write_bands(bands, tmp_path / "bands.yaml", "# header\n")
    again = load_bands(path)
    assert again is not None and again.over_limit == bands.over_limit and again.row_limit_pct == 15.0
    assert check([res("near", 14.0), res("far", -31.234), res("farther", 40.0)], again) == []


def test_a_family_without_validated_rows_borrows_no_band():
    bands = Bands(
        Summary(10, 20.0, 10.0, 90.0),
        bounds={KERNEL_BOUND: Summary(6, 8.0, 7.0, 15.0)},
        families={"kernel-bound/switch/ring": Summary(4, 5.0, 5.0, 9.0)},
    )
    assert bands.band_pct(KERNEL_BOUND, "switch", "zigzag_ring") == 5.0  # a ring, as the validated rows
    assert bands.band_pct(KERNEL_BOUND, "switch", "rfa_stripe") == 5.0  # a peer's ring joins the family
    assert bands.band_pct(KERNEL_BOUND, "switch", "tasp") is None  # another method family: unvalidated
    assert bands.band_pct(KERNEL_BOUND, "mesh", "ring") is None  # another kind of hardware
    assert bands.band_pct(COMM_BOUND, "switch", "ring") is None  # another regime
    assert bands.band_pct(KERNEL_BOUND, "host", "ring") is None
    again = Bands.from_dict(bands.to_dict())
    assert again.band_pct(KERNEL_BOUND, "switch", "ring") == 5.0 and again.row_limit_pct == 20.0
    assert again.band_pct(KERNEL_BOUND, "mesh", "ring") is None
    assert bound_of(100.0, 86.0) == KERNEL_BOUND and bound_of(100.0, 84.0) == COMM_BOUND


def test_unvalidated_is_said_wherever_a_band_is_shown():
    sim = {"executor": "sim", M.SIM_ERROR_PCT: None}
    assert M.sim_band_label(sim) == M.UNVALIDATED
    assert M.sim_band_label({**sim, M.SIM_ERROR_PCT: 4.3}) == "±4.3 %"
    assert M.sim_band_label({"executor": "local", M.SIM_ERROR_PCT: None}) is None  # measured: no band at all
    from suite.tracking import SIM_BAND, child_values

    rec = {**_rec(), "executor": "sim", M.KEY: "k", M.SIM_ERROR_PCT: None}
    assert child_values(rec)[2][SIM_BAND] == M.UNVALIDATED  # MLflow: a tag, not a borrowed number
    assert child_values({**rec, M.SIM_ERROR_PCT: 5.0})[2][SIM_BAND] == "±5.0 %"
    assert SIM_BAND not in child_values({**rec, "executor": "local"})[2]


def test_topology_kinds():
    from suite.sim.topology import load_topology

    assert topology_kind(load_topology("h100_sxm"), 8) == "switch"
    assert topology_kind(load_topology("h100_sxm"), 16) == "multi-node"
    assert topology_kind(load_topology("mi300x"), 8) == "mesh"
    assert topology_kind(load_topology("a100_pcie"), 4) == "pcie"


def test_validation_files_name_their_source_and_unit():
    files = validation_files()
    assert {p.stem for p in files} >= {"rfa_batch", "rfa_varlen", "burst_readme", "usp_table3", "distflashattn_balance"}
    for p in files:
        t = load_table(p)
        assert t.source.get("url", "").startswith("https://") and t.source.get("where"), p
        assert all(r.value > 0 for r in t.rows)


def test_a_bad_validation_row_is_refused_naming_it(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("validation: {unit: furlongs, rows: [{value: 1, match: {method: ring}}]}\n")
    with pytest.raises(ValidationError, match=r"rows\[0\]\.unit"):
        load_table(path)
    path.write_text("validation: {unit: speedup, rows: [{value: 1, match: {method: ring}}]}\n")
    with pytest.raises(ValidationError, match="baseline"):
        load_table(path)
    # the record names a known miss by table and label: two rows of one label are refused
    rows = "[{label: a, value: 1, match: {method: ring}}, {label: a, value: 2, match: {method: tasp}}]"
    path.write_text(f"validation: {{unit: ms, rows: {rows}}}\n")
    with pytest.raises(ValidationError, match=r"labels must be unique, \['a'\]"):
        load_table(path)


def test_ties_are_times_within_each_others_band():
    assert within_bands(100.0, 10.0, 108.0, 10.0)
    assert not within_bands(100.0, 10.0, 115.0, 10.0)
    assert not within_bands(100.0, 10.0, 108.0, 5.0)  # 8 % apart: outside the second's 5 % band
    assert not within_bands(100.0, None, 100.5, 10.0)  # no record, no tie


def test_simulated_points_draw_their_band():
    from suite.reports.figures.plan import _with_band
    from suite.reports.tables.captions import sim_band_caption

    d = pd.DataFrame({"y": [10.0, 10.0], "lo": [10.0, 9.0], "hi": [10.0, 11.0], M.SIM_ERROR_PCT: [20.0, None]})
    out = _with_band(d)
    assert out["lo"].tolist() == [8.0, 9.0] and out["hi"].tolist() == [12.0, 11.0]  # measured rows keep theirs
    assert "±20 %" in sim_band_caption(d) and sim_band_caption(d.drop(columns=[M.SIM_ERROR_PCT])) == ""
    both_sim = d.assign(executor="sim")
    assert M.UNVALIDATED in sim_band_caption(both_sim)  # the row without a band says so
    assert M.UNVALIDATED not in sim_band_caption(both_sim.iloc[:1])


# -- the whole validation ------------------------------------------------------------------------------------
def test_validation_does_not_regress_past_the_record(tmp_path):
    """Every published table simulated; the mean |error| must stay within the record's margin, and
    every simulated row must carry the band its family has in the record."""
    bands = load_bands()
    assert bands is not None, "configs/validate/bands.yaml: run `python -m suite validate` to write it"
    import io

    v = validate(validation_files(), results_root=str(tmp_path), out=io.StringIO())
    overall, _, _ = summarize(v.results)
    assert overall is not None and overall.rows >= 40
    assert overall.mean_abs_pct <= bands.overall.mean_abs_pct + bands.margin_pct, (
        f"mean |error| {overall.mean_abs_pct:.1f}% regressed past the recorded "
        f"{bands.overall.mean_abs_pct:.1f}% + {bands.margin_pct}%"
    )
    from suite.results import ResultsStore
    from suite.sim.bands import family
    from suite.sim.topology import load_topology

    kinds = {}
    for run_dir in v.run_dirs.values():
        for r in ResultsStore.open(run_dir).records():
            key = (r["topology"], r["world_size"])
            if key not in kinds:
                kinds[key] = topology_kind(load_topology(r["topology"]), r["world_size"])

    for run_dir in v.run_dirs.values():
        for r in ResultsStore.open(run_dir).records():
            if r[M.STATUS] == M.OK:  # its family's recorded band, or none (unvalidated) when it has none
                bound = bound_of(r[M.TIME_MS_MEDIAN], r.get(M.COMPUTE_ONLY_MS))
                fam = family(bound, kinds[r["topology"], r["world_size"]], r["method"])
                want = bands.families.get(fam)
                assert r[M.SIM_ERROR_PCT] == (None if want is None else want.mean_abs_pct), (r["method"], fam)


def test_leave_one_source_out_predicts_no_row_with_a_model_fitted_on_its_source():
    from pathlib import Path

    from suite.sim_validation import PublishedTable, leave_one_source_out

    def table(name, source_id, rows):
        return PublishedTable(name, Path(f"{name}.yaml"), name, {}, "", rows, source_id)

    cal = PublishedRow("A100 one GPU", 1.0, "iter/s", {}, calibrates=True)
    ring_a100, ring_h800 = PublishedRow("A100 ring", 1.0, "iter/s", {}), PublishedRow("H800 ring", 1.0, "iter/s", {})
    burst = PublishedRow("burst", 1.0, "ms", {})
    # a100_sxm names ring-flash-attn-readme under fitted_from (its kernel figures come from that README)
    tables = [table("rfa", "ring-flash-attn-readme", [cal, ring_a100, ring_h800]), table("b", "b", [burst])]
    results = [
        RowResult("rfa", cal, 1.0, 2.0, topologies=("a100_sxm",)),
        RowResult("rfa", ring_a100, 1.0, 50.0, topologies=("a100_sxm",)),
        RowResult("rfa", ring_h800, 1.0, -10.0, topologies=("h800_sxm",)),
        RowResult("b", burst, 1.0, 20.0, topologies=("a100_sxm",)),  # fitted on another source: blind
    ]
    loso = leave_one_source_out(tables, results)
    assert loso.summary.rows == 2 and loso.sources == 2 and loso.summary.max_abs_pct == 20.0
    assert [r.row.label for r, _ in loso.left_out] == ["A100 one GPU", "A100 ring"]
    assert loso.line() == "leave-one-source-out: 2 rows, 2 sources, mean 15.0 %, median 15.0 %, max 20.0 %"
    # a topology may not be fitted on a source none of whose rows may calibrate (an end-to-end table)
    tables[0].rows[0] = PublishedRow("A100 one GPU", 1.0, "iter/s", {})
    with pytest.raises(ValidationError, match="fitted_from names 'ring-flash-attn-readme'"):
        leave_one_source_out(tables, results)
