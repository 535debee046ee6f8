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
    weighed = {c.method for c in adv.ranked + adv.pruned + adv.failed}
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
    from suite.advise import _mask_label

    q = make_question(model="8/8/64", topology="h100_sxm", seq_len=4096, pass_="fwd", mask="sliding_window:256")
    assert q.mask.name == "sliding_window:symmetric=false,window=256" and q.causal
    adv = advise(q, results_root=str(tmp_path), mlflow=False)
    assert len(adv.ranked) >= 5 and not adv.failed
    assert all(c.row["mask"] == q.mask.name for c in adv.ranked)
    rows = adv.table()
    assert all(r["mask"] == "sliding_window(256)" and 0 < r["% of ideal"] <= 100 for r in rows), rows
    assert _mask_label(q) == "sliding_window(256)"
    # the command line names it too, and a bad mask is refused naming --mask
    args = ["advise", "--model", "8/8/64", "--topology", "h100_sxm", "--seq-len", "4096", "--pass", "fwd"]
    common = ["--no-mlflow", "--results-root", str(tmp_path), "--out", str(tmp_path / "out"), "--top", "3"]
    assert main([*args, "--mask", "shared_question:question=512,answers=2", *common]) == 0
    out = capsys.readouterr().out
    label = "shared_question(answers=2, question=512)"  # Mask.short: several values name their parameters
    assert f"mask {label}" in out and label in (tmp_path / "out/advice.md").read_text()
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
    q = make_question(model=str(path), topology="h100_sxm", seq_len=4096, pass_="fwd")
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
