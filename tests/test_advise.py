"""`suite advise`: pruning before tracing, bad input, ranking, the memory estimate, Spearman."""

import math

import pytest

import methods
import suite.sim.trace as trace_mod
from methods import Case
from suite import metrics as M
from suite.advise import advise, candidate_methods, emit_config, make_question, spearman
from suite.cli import main
from suite.config import load_config
from suite.sim.memory import estimate
from tests.helpers import own_variants, peak_bytes


def test_spearman_known_values():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties share their mean rank: y ranks [1, 2, 3.5, 5, 3.5] -> rho = 8 / sqrt(10 * 9.5)
    assert spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(8 / math.sqrt(95))
    # monotone but not linear: ranks only
    assert spearman([1, 2, 3], [1, 100, 101]) == pytest.approx(1.0)


@pytest.fixture
def no_tracing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("bad input must be refused before anything is traced")

    monkeypatch.setattr(trace_mod, "trace", refuse)


@pytest.mark.parametrize(
    "args,option,mentions",
    [
        (["--model", "llama9_1t", "--topology", "h100_sxm"], "--model", "llama3_8b"),
        (["--model", "32/5/128", "--topology", "h100_sxm"], "--model", "multiple of kv_heads"),
        (["--model", "llama3_8b", "--topology", "dgx_z"], "--topology", "mi300x"),
        (["--model", "llama3_8b", "--topology", "h100_sxm", "--seq-len", "0"], "--seq-len", "positive"),
        (["--model", "llama3_8b", "--topology", "h100_sxm", "--nodes", "0"], "--nodes", "between"),
        (["--model", "12/12/64", "--topology", "h100_sxm", "--ulysses-degree", "8"], "--ulysses-degree", "heads"),
        (["--model", "llama3_8b", "--topology", "h100_sxm", "--ulysses-degree", "3"], "--ulysses-degree", "divide"),
        (["--model", "llama3_8b", "--topology", "h100_sxm", "--memory-gb", "0.001"], "--memory-gb", "nothing fits"),
        (["--model", "llama3_8b", "--topology", "h100_sxm", "--workload", "nope"], "--workload", "stdlib_files"),
        (["--model", "llama3_8b", "--topology", "h100_sxm", "--dtype", "float64"], "--dtype", "float64"),
        (
            ["--model", "llama3_8b", "--topology", "h100_sxm", "--workload", "lognormal:median=100,sigma=0"],
            "--workload",
            "sigma",
        ),
        (["--model", "llama3_8b", "--topology", "h100_sxm", "--top", "0"], "--top", ">= 1"),
    ],
)
def test_bad_input_exits_2_naming_the_option(args, option, mentions, capsys, no_tracing, tmp_path):
    assert main(["advise", *args, "--no-mlflow", "--results-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {option}:") and mentions in err, err


def test_small_question_prunes_before_tracing_and_ranks(monkeypatch, tmp_path):
    """6 heads on 8 GPUs: Ulysses degrees 4 and 8 cannot split the heads, so neither Ulysses nor USP
    at those degrees may be traced; the others run as a simulated sweep and come back sorted."""
    traced = []
    real = trace_mod.trace

    def counting(method_name, case, pass_="fwd", options=None, timeout_s=120.0):
        traced.append((method_name, dict(options or {}), case.world_size))
        return real(method_name, case, pass_, options, timeout_s)

    monkeypatch.setattr(trace_mod, "trace", counting)
    q = make_question(model="6/6/16", topology="h100_sxm", seq_len=4800, pass_="fwd", memory_gb=10)
    adv = advise(q, results_root=str(tmp_path), mlflow=False)
    pruned = {c.label: c.pruned for c in adv.pruned}
    assert "ulysses" in pruned and "usp(ulysses_degree=8)" in pruned and "usp(ulysses_degree=4)" in pruned
    assert all("heads" in why for why in pruned.values()), pruned
    assert traced, "the survivors must be traced"
    for name, options, _ in traced:
        assert name != "ulysses" and options.get("ulysses_degree", 1) in (1, 2), (name, options)
    # every registered own method is weighed (pruned or ranked): nothing is kept in a list here
    merged = [s for c in adv.ranked for s in c.same]  # the same schedule under another name
    weighed = {c.method for c in adv.ranked + merged + adv.pruned + adv.failed}
    assert weighed == set(candidate_methods())
    times = [c.row[M.TIME_MS_MEDIAN] for c in adv.ranked]
    assert len(times) >= 5 and times == sorted(times)
    assert all(c.row["executor"] == "sim" and c.row["topology"] == "h100_sxm" for c in adv.ranked)
    assert (adv.run_dir / "trials.jsonl").is_file()
    assert not adv.failed
    rows = adv.table()
    assert [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
    assert all(0 < r["% of ideal"] and r["memory GB/GPU"] > 0 for r in rows)
    # the emitted sweep measures exactly the top 3
    path = emit_config(adv, tmp_path / "top3.yaml", 3)
    cfg, _ = load_config(path)
    assert cfg.run.executor == "dist" and cfg.sweep.world_size == [8]
    from suite.plan import Place, expand
    from suite.workloads import make_workload

    plan = expand(cfg, make_workload(cfg.kind, cfg), [Place("cpu", "local", lambda w: 1)], "cpu")
    assert sorted(M.method_label(s.method, s.method_options) for s in plan) == sorted(c.label for c in adv.ranked[:3])


@pytest.mark.parametrize("name,options", own_variants())
def test_memory_estimate_within_2x_of_measured(name, options):
    """The working set one call allocates (suite.memtrack sees every tensor on CPU), forward and
    forward+backward, P = 4 threads, GQA: the estimate is within a factor of 2 either way."""
    case = Case(1, 480, 8, 2, 16, "float32", True, 4)
    m = methods.get_method(name, **options)
    ok, why = m.supports(case)
    assert ok, why
    per_rank = peak_bytes(m, case)
    measured = {"fwd": max(f for f, _ in per_rank), "fwd_bwd": max(b for _, b in per_rank)}
    for pass_, peak in measured.items():
        est = estimate(m, case, pass_).working
        assert 0.5 <= est / peak <= 2.0, (pass_, est, peak)


def test_main_cost_reads_the_time_split():
    from suite.advise import main_cost

    row = {M.TIME_MS_MEDIAN: 10.0, M.COMPUTE_ONLY_MS: 6.0, M.IMBALANCE: 1.0}
    assert main_cost(row, 6.0).startswith("exposed communication (40%)")
    row = {M.TIME_MS_MEDIAN: 10.0, M.COMPUTE_ONLY_MS: 10.0, M.IMBALANCE: 2.0}
    assert main_cost(row, 5.0).startswith("imbalance (50%)")
    row = {M.TIME_MS_MEDIAN: 10.0, M.COMPUTE_ONLY_MS: 10.0, M.IMBALANCE: 1.0}
    assert main_cost(row, 4.0).startswith("compute overhead (60%)")
    assert main_cost(row, 9.5).startswith("compute-bound")


def test_packed_workload_weighs_document_sharding_and_plans_packed_trials():
    from suite.advise import build_config, enumerate_candidates, prune
    from suite.plan import Place, expand
    from suite.workloads import make_workload

    q = make_question(model="8/8/64", topology="h100_sxm", seq_len=4096, workload="lognormal:median=512,sigma=1.0")
    kept = prune(q, enumerate_candidates(q))
    assert {"zigzag_ring", "allgather_kv"} <= {c.method for c in kept if c.options.get("sharding") == "documents"}
    cfg = build_config(q, kept, mlflow=False)
    plan = expand(cfg, make_workload(cfg.kind, cfg), [Place("H100", "h100_sxm", lambda w: 1)], "cpu")
    assert sorted(M.method_label(s.method, s.method_options) for s in plan) == sorted(c.label for c in kept)
    lengths = q.documents().lengths
    assert all(s.document_lengths() == lengths for s in plan)  # the advisor's documents are the sweep's


def test_memory_budget_prunes_by_the_layers_kept_for_backward():
    """Llama-3-70B, 2x8 H100, 256K tokens, 60 GB: without recomputation the Ulysses variants keep
    head-scattered copies in all 80 layers and do not fit; with recomputation every one fits."""
    from suite.advise import enumerate_candidates, prune

    kept = {}
    for recompute in (False, True):
        q = make_question(
            model="llama3_70b", topology="h100_sxm", nodes=2, seq_len=262144, memory_gb=60, recompute=recompute
        )
        cands = enumerate_candidates(q)
        kept[recompute] = {c.label for c in prune(q, cands)}
        assert all(c.memory_bytes > 60e9 for c in cands if c.pruned)
    assert "ulysses" not in kept[False] and "zigzag_ring(sharding=sequence)" in kept[False]
    assert kept[True] == {c.label for c in cands}


# -- masks and per-layer patterns ------------------------------------------------------------------------
def test_advise_mask_answers_for_a_window_and_names_it(tmp_path, capsys):
    """`--mask sliding_window:...`: every simulated row is of that mask, the table and the header name
    it, and no configuration is above 100 % of the same mask's ideal."""
    from suite.advise.ranking import _mask_label

    # 4 GPUs: the property does not need a whole node, and each trial traces half the ranks
    q = make_question(model="8/8/64", topology="h100_sxm", seq_len=4096, pass_="fwd", mask="sliding_window:256", gpus=4)
    assert q.mask.name == "sliding_window:symmetric=false,window=256" and q.causal
    adv = advise(q, results_root=str(tmp_path), mlflow=False)
    assert len(adv.ranked) >= 5 and not adv.failed
    assert all(c.row["mask"] == q.mask.name for c in adv.ranked)
    rows = adv.table()
    assert all(r["mask"] == "sliding_window(256)" and 0 < r["% of ideal"] <= 100 for r in rows), rows
    assert _mask_label(q) == "sliding_window(256)"
    # the command line names it too, and a bad mask is refused naming --mask
    args = [
        "advise",
        "--model",
        "8/8/64",
        "--topology",
        "h100_sxm",
        "--seq-len",
        "4096",
        "--pass",
        "fwd",
        "--gpus",
        "4",
    ]
    common = ["--no-mlflow", "--results-root", str(tmp_path), "--out", str(tmp_path / "out"), "--top", "3"]
    assert main([*args, "--mask", "shared_question:question=512,answers=2", *common]) == 0
    out = capsys.readouterr().out
    label = "shared_question(answers=2, question=512)"  # Mask.short: several values name their parameters
    assert f"mask {label}" in out and label in (tmp_path / "out/advice.md").read_text()
    # a reader skimming for the answer learns it is a prediction no multi-GPU run backs (issue 39)
    backing = [line for line in out.splitlines() if line.startswith("No multi-GPU run backs this answer")]
    assert len(backing) == 1 and "4 x H100" in backing[0]
    assert main([*args, "--mask", "sliding_window:0", *common]) == 2
    assert capsys.readouterr().err.startswith("error: --mask:")


def test_a_per_layer_model_adds_its_layers_times(tmp_path):
    """A model file's attention_pattern repeats over its layers; the advisor simulates each distinct
    mask once (one row per candidate and mask) and ranks by the model total: per-layer time x count."""
    from suite.advise import ideal_ms, load_model, model_ideal_ms

    assert load_model("gpt_oss_20b").pattern == (("sliding_window:symmetric=false,window=128", 12), ("causal", 12))
    assert load_model("gemma3_27b").pattern == (("sliding_window:symmetric=false,window=1024", 52), ("causal", 10))
    assert load_model("llama3_8b").pattern == ()
    path = tmp_path / "tiny.yaml"
    path.write_text(
        "name: tiny\nheads: 8\nkv_heads: 8\nhead_dim: 64\nlayers: 5\nattention_pattern: [sliding_window:128, causal]\n"
    )
    q = make_question(model=str(path), topology="h100_sxm", seq_len=4096, pass_="fwd", gpus=4)
    assert q.per_layer and [(m.short, n) for m, n in q.layer_masks()] == [("sliding_window(128)", 3), ("causal", 2)]
    adv = advise(q, results_root=str(tmp_path), mlflow=False)
    assert len(adv.ranked) >= 5 and not adv.failed
    sw, causal = (m.name for m, _ in q.layer_masks())
    for c in adv.ranked:
        assert set(c.rows) == {sw, causal}
        per_layer = 3 * c.rows[sw][M.TIME_MS_MEDIAN] + 2 * c.rows[causal][M.TIME_MS_MEDIAN]
        assert c.row[M.TIME_MS_MEDIAN] == pytest.approx(per_layer)
    assert adv.ideal_ms == pytest.approx(
        3 * ideal_ms(q, q.layer_masks()[0][0]) + 2 * ideal_ms(q, q.layer_masks()[1][0])
    )
    assert model_ideal_ms(q) == adv.ideal_ms
    times = [c.row[M.TIME_MS_MEDIAN] for c in adv.ranked]
    assert times == sorted(times)
    rows = adv.table()
    assert all(r["% of ideal"] <= 100 and "x3" in r["per layer ms"] and "x2" in r["per layer ms"] for r in rows)
    # --mask replaces the pattern: one mask on every layer, one call's time
    q1 = make_question(model=str(path), topology="h100_sxm", seq_len=4096, pass_="fwd", mask="causal")
    assert not q1.per_layer and q1.layer_masks()[0][1] == 5


@pytest.mark.parametrize(
    "extra,mentions",
    [
        ("attention_pattern: [sliding_window:0]\n", ">= 1"),
        ("attention_layers: {causal: 2}\n", "the model has 5"),
        ("attention_pattern: [causal]\nattention_layers: {causal: 5}\n", "not both"),
    ],
)
def test_a_bad_layer_pattern_is_refused_naming_the_model(tmp_path, extra, mentions):
    from suite.advise import AdviceError, load_model

    path = tmp_path / "bad.yaml"
    path.write_text("heads: 8\nkv_heads: 8\nhead_dim: 64\nlayers: 5\n" + extra)
    with pytest.raises(AdviceError, match=mentions) as exc:
        load_model(str(path))
    assert exc.value.option == "--model"


# -- the answer: one sentence, one entry per schedule, counts, the next command ------------------------
def test_configurations_of_one_schedule_are_one_entry_and_named_plainly(tmp_path):
    """USP at Ulysses degree P is Ulysses, at degree 1 the zigzag ring (methods/usp.py): one entry
    each, found from the simulated traces and the token layout, never from method names."""
    from suite.advise import advice_sentence, command_line, counts_line, next_step, write_outputs
    from suite.cli import _parser

    argv = ["advise", "--model", "8/8/64", "--topology", "h100_sxm", "--seq-len", "2048", "--pass", "fwd"]
    args = _parser().parse_args([*argv, "--no-mlflow", "--results-root", str(tmp_path), "--top", "3"])
    q = make_question(model="8/8/64", topology="h100_sxm", seq_len=2048, pass_="fwd")
    adv = advise(q, results_root=str(tmp_path), mlflow=False)
    titles = [c.title for c in adv.ranked]
    assert "ulysses = usp(ulysses_degree=8)" in titles, titles
    # forward only, burst's flat ring is the zigzag K/V ring too (methods/burst.py: only its backward differs)
    usp1 = {"usp(ulysses_degree=1)", "zigzag_ring(sharding=sequence)"}
    assert any(usp1 <= set(t.split(" = ")) <= usp1 | {"burst (one flat ring)"} for t in titles), titles
    for c in adv.ranked:  # an entry's other names predict exactly what it does
        assert all(s.row[M.TIME_MS_MEDIAN] == c.row[M.TIME_MS_MEDIAN] for s in c.same)
    # same layout and bytes but another schedule (all-gather, not a ring): kept apart
    assert "allgather_kv(sharding=sequence)" in titles
    assert "burst (one flat ring)" in " = ".join(titles) and not any("ranks_per_node" in t for t in titles)
    merged = sum(len(c.same) for c in adv.ranked)
    assert merged >= 2
    # the advice names the first entry; the counts say what the top 3 hide and what was merged
    assert advice_sentence(adv).startswith(f"Advice: use {titles[0]} (Ulysses ")
    n = len(adv.ranked)
    assert counts_line(adv, 3).startswith(
        f"3 of {n} ranked configuration(s) shown (--top {n} shows all); {merged} more are the same schedule"
    )
    # the next command parses, and asks the same question
    step = next_step(adv, command_line(args))
    assert step.startswith("Next: measure the top ") and "--emit-config measure.yaml" in step
    command = step.split("`")[1].split()
    assert command[:3] == ["python", "-m", "suite"]
    again = _parser().parse_args(command[3:])
    assert (again.model, again.topology, again.seq_len, again.pass_) == ("8/8/64", "h100_sxm", 2048, "fwd")
    assert again.results_root == str(tmp_path) and again.emit_config == "measure.yaml"
    md = write_outputs(adv, tmp_path / "out", 3, step)[0].read_text()
    assert md.splitlines()[2] == advice_sentence(adv) and step in md


def _fake(name: str, t: float, band, **kw):
    from suite.advise import Candidate

    c = Candidate(name, {}, name, ulysses_degree=1, ring_degree=8, memory_bytes=10**9, **kw)
    c.row = {M.TIME_MS_MEDIAN: t, M.SIM_ERROR_PCT: band, M.COMPUTE_ONLY_MS: t, "status": M.OK}
    return c


def _advice(cands, pruned=()):
    from suite.advise import Advice

    q = make_question(model="8/8/64", topology="h100_sxm", seq_len=4096, pass_="fwd")
    return Advice(q, list(cands), list(pruned), [], ideal_ms=50.0)


def test_the_advice_sentence_names_the_choice_its_band_and_whether_it_holds():
    from suite.advise import advice_sentence, measure_count

    clear = _advice([_fake("a", 100.0, 5.0), _fake("b", 150.0, 5.0)])
    text = advice_sentence(clear)
    assert text.startswith("Advice: use a (Ulysses 1 x ring 8), predicted 100.0 ms ±5 %, 50.0 % of ideal")
    assert "50.0 % faster than the next, b, beyond both error bands" in text and measure_count(clear) == 2
    tied = _advice([_fake("a", 100.0, 5.0), _fake("b", 103.0, 5.0), _fake("c", 104.0, 5.0), _fake("d", 200.0, 5.0)])
    assert "2 more configuration(s) lie within its error band, so measure the top 3" in advice_sentence(tied)
    assert measure_count(tied) == 3
    unbanded = _advice([_fake("a", 100.0, None), _fake("b", 101.0, None)])
    text = advice_sentence(unbanded)
    assert "(unvalidated: no published row of its kind was validated)" in text
    assert "no validated band to say it holds (unvalidated)" in text
    from suite.advise import evidence_line

    line = evidence_line(clear)
    assert line.startswith("No multi-GPU run backs this answer") and "8 x " in line and "validate" in line


def test_advice_tables_right_align_numbers_and_count_what_they_hide():
    from suite.advise import counts_line, render

    adv = _advice([_fake("a", 100.0, 5.0), _fake("b", 150.0, 5.0), _fake("c", 250.0, 5.0)], [_fake("p", 1.0, 5.0)])
    adv.ranked[0].same = [_fake("a2", 100.0, 5.0)]
    header, rule = render(adv, 2, "pipe").splitlines()[:2]
    cells = dict(zip([h.strip() for h in header.strip("|").split("|")], rule.strip("|").split("|")))
    for numeric in ("rank", "ranks/node", "predicted ms", "± %", "% of ideal", "memory GB/GPU"):
        assert cells[numeric].endswith(":") and not cells[numeric].startswith(":"), (numeric, cells[numeric])
    assert cells["method"].startswith(":") and not cells["method"].endswith(":")
    assert "a = a2" in render(adv, 2, "pipe")
    # a row without a validated band says so in words; the band column stays right-aligned
    mixed = _advice([_fake("a", 100.0, 5.0), _fake("b", 150.0, None)])
    header, rule = render(mixed, None, "pipe").splitlines()[:2]
    cells = dict(zip([h.strip() for h in header.strip("|").split("|")], rule.strip("|").split("|")))
    assert cells["± %"].endswith(":") and not cells["± %"].startswith(":"), cells["± %"]
    assert M.UNVALIDATED in render(mixed)
    line = counts_line(adv, 2)
    assert line.startswith("2 of 3 ranked configuration(s) shown (--top 3 shows all)")
    assert "1 more are the same schedule" in line and "1 pruned before tracing" in line
    assert counts_line(adv, 10).startswith("3 of 3 ranked configuration(s) shown;")


def test_equal_predictions_merge_only_where_every_token_sits_on_the_same_rank():
    from suite.advise import Candidate, merge_same_schedules

    q = make_question(model="8/8/64", topology="h100_sxm", seq_len=2048, pass_="fwd")
    row = {M.TIME_MS_MEDIAN: 1.0, M.BYTES_SENT: 10, M.COMM_OPS: '{"p2p": 7}', "status": M.OK}

    def cand(method, **options):
        return Candidate(method, options, method, ulysses_degree=1, ring_degree=8, row=dict(row))

    kept = merge_same_schedules(q, [cand("usp", ulysses_degree=1), cand("stripe_ring"), cand("zigzag_ring")])
    assert [c.title for c in kept] == ["zigzag_ring = usp", "stripe_ring"]  # stripe places tokens otherwise
    # the entry with the fewest options leads (zigzag_ring above); among equals, the first ranked
    kept = merge_same_schedules(q, [cand("usp", ulysses_degree=1), cand("zigzag_ring", sharding="sequence")])
    assert [c.title for c in kept] == ["usp = zigzag_ring"]
    different = dict(row, **{M.BYTES_SENT: 11})  # one number apart: two schedules
    other = Candidate("zigzag_ring", {}, "zigzag_ring", ulysses_degree=1, ring_degree=8, row=different)
    assert len(merge_same_schedules(q, [cand("usp", ulysses_degree=1), other])) == 2


def test_a_value_head_dim_of_its_own_sets_the_bytes_of_k_and_v(tmp_path):
    """MLA (DeepSeek-V3: q/k head dim 192, v 128): the model file's head_dim_v reaches the simulated
    problem, and a K/V ring's bytes count K at the query/key head dim and V at the values'."""
    from suite.advise import load_model

    ds = load_model("deepseek_v3")
    assert (ds.heads, ds.kv_heads, ds.head_dim, ds.head_dim_v, ds.layers) == (128, 128, 192, 128, 61)
    assert load_model("qwen3_32b").head_dim_v is None  # absent: equal to head_dim
    path = tmp_path / "mla.yaml"
    path.write_text("name: mla\nheads: 4\nkv_heads: 4\nhead_dim: 48\nhead_dim_v: 32\nlayers: 2\n")
    q = make_question(model=str(path), topology="h100_sxm", seq_len=2048, pass_="fwd", gpus=4)
    assert q.case().head_dim_v == 32
    adv = advise(q, results_root=str(tmp_path), mlflow=False)
    ring = next(c for c in adv.ranked if c.method == "ring")
    local = 2048 // 4
    assert ring.row[M.BYTES_SENT] == 3 * local * 4 * (48 + 32) * 2  # 3 hops of K (48) and V (32), bf16
