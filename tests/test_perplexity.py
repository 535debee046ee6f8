"""Model-level equivalence (kind: perplexity): data, the small model, training with every own
method against the single-device baseline, planted bugs caught, and the sweep end to end."""

import dataclasses
import functools
import json
import math
import os

import pytest
import torch

import methods
from methods import layouts
from methods.base import Case
from methods.comm import run_threads
from methods.documents import BlockMasks, Documents
from suite import metrics as M
from suite.config import ConfigError, load_config
from suite.perplexity.data import load_corpus, train_windows, val_windows
from suite.perplexity.model import ModelConfig, TinyLlama, rope, sdpa_attend
from suite.perplexity.train import PLANTED_BUGS, TrainConfig, train_and_evaluate
from tests.helpers import own_methods, plan_for

CAUSAL_METHODS = own_methods()  # every own method takes the causal mask
MODEL = ModelConfig(heads=4, kv_heads=2, head_dim=8, layers=2)
TRAIN = TrainConfig(steps=6, batch=2, seq_len=96, lr=3e-3, warmup_steps=2, eval_batches=2)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus("stdlib", max_bytes=300_000)


@pytest.fixture(scope="module")
def baseline(corpus):
    return train_and_evaluate(
        MODEL, TRAIN, corpus, layout=layouts.contiguous(TRAIN.seq_len, 1), comm=None, make_attend=lambda c: sdpa_attend
    )


def layer_case(tc, model, world_size) -> Case:
    """The attention problem of one layer of `model` trained with `tc` on `world_size` ranks."""
    return Case(
        batch=tc.batch,
        seq_len=tc.seq_len,
        heads=model.heads,
        kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        dtype="float32",
        causal=True,
        world_size=world_size,
    )


def train_sp(corpus, name, world_size, tc=TRAIN, model=MODEL, **options):
    method = methods.get_method(name, **options)
    case = layer_case(tc, model, world_size)
    ok, why = method.supports(case)
    if not ok:
        pytest.skip(why)
    layout = method.layout(case)
    return run_threads(
        world_size,
        lambda comm: train_and_evaluate(
            model,
            tc,
            corpus,
            layout=layout,
            comm=comm,
            make_attend=lambda c: functools.partial(method.attention, causal=True, comm=c),
        ),
    )


def max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# -- data ------------------------------------------------------------------------------------------
def test_stdlib_corpus_is_real_text_deterministic_and_split(corpus):
    again = load_corpus("stdlib", max_bytes=300_000)
    assert again.sha256 == corpus.sha256 and len(corpus.sha256) == 64
    assert corpus.train.numel() + corpus.val.numel() == 300_000
    assert corpus.val.numel() == 30_000
    text = bytes(corpus.train[:20_000].tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import" in text  # Python source, not noise
    assert load_corpus("stdlib", max_bytes=200_000).sha256 != corpus.sha256


def test_windows_shift_labels_on_the_global_sequence(corpus):
    w = train_windows(corpus, steps=3, batch=2, seq_len=16, seed=1)
    assert w.shape == (3, 2, 17) and w.dtype == torch.long
    assert torch.equal(w, train_windows(corpus, steps=3, batch=2, seq_len=16, seed=1))
    assert not torch.equal(w, train_windows(corpus, steps=3, batch=2, seq_len=16, seed=2))
    # every window is a contiguous piece of the training split
    train = corpus.train.long()
    for window in w.view(-1, 17):
        starts = (train[:-16] == window[0]).nonzero().flatten()
        assert any(torch.equal(train[s : s + 17], window) for s in starts)
    v = val_windows(corpus, batches=2, batch=2, seq_len=16)
    assert v.shape == (2, 2, 17) and torch.equal(v[0, 1, :], corpus.val[16:33].long())
    with pytest.raises(ValueError, match="eval_batches"):
        val_windows(corpus, batches=10_000, batch=2, seq_len=16)


def test_text_file_source_and_clear_errors(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("hello world\n" * 100)
    c = load_corpus("file", path=str(f), val_fraction=0.2)
    assert c.name == "t.txt" and c.val.numel() == 240 and bytes(c.train[:5].tolist()) == b"hello"
    with pytest.raises(ValueError, match="perplexity.data.path"):
        load_corpus("file")
    with pytest.raises(ValueError, match="unknown data source"):
        load_corpus("web")


# -- model -------------------------------------------------------------------------------------------
def test_rope_depends_only_on_relative_positions():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 5, 2, 8, generator=g), torch.randn(1, 5, 2, 8, generator=g)
    pos = torch.arange(5)
    dots = (rope(q, pos, 1e4) * rope(k, pos, 1e4)).sum(-1)
    shifted = (rope(q, pos + 37, 1e4) * rope(k, pos + 37, 1e4)).sum(-1)
    assert torch.allclose(dots, shifted, atol=1e-5)
    assert not torch.allclose(rope(q, pos, 1e4), rope(q, pos + 1, 1e4))


def test_sharded_forward_equals_full_forward_only_with_global_positions():
    """The model run per rank on layout shards with global positions gives the full model's logits."""
    model = TinyLlama(MODEL)
    model.init_weights(torch.Generator().manual_seed(3))
    tokens = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        full = model(tokens, torch.arange(32), sdpa_attend)
        method = methods.get_method("zigzag_ring")
        layout = layouts.zigzag(32, 4)

        def rank(comm, positions_fn):
            attend = functools.partial(method.attention, causal=True, comm=comm)
            with torch.no_grad():
                return model(layout.shard(tokens, comm.rank), positions_fn(comm.rank), attend)

        good = layout.unshard(run_threads(4, lambda c: rank(c, layout.positions)))
        bad = layout.unshard(run_threads(4, lambda c: rank(c, lambda r: torch.arange(8))))
    assert (good - full).abs().max() < 1e-5
    assert (bad - full).abs().max() > 1e-3


# -- training with every method ----------------------------------------------------------------------
@pytest.mark.parametrize("name", CAUSAL_METHODS)
def test_every_method_trains_like_the_single_device_baseline(corpus, baseline, name):
    results = train_sp(corpus, name, 4)
    for r in results:  # every rank logs the same global loss
        assert r.losses == results[0].losses
        assert max_rel(r.losses, baseline.losses) < 1e-5
        assert abs(r.perplexity / baseline.perplexity - 1) < 1e-5
    assert baseline.losses[-1] < baseline.losses[0] - 0.5  # it really trains
    assert results[0].attn_bytes_sent > 0


@pytest.mark.parametrize(
    "name,world_size", [("ring", 2), ("ring", 3), ("tasp", 3), ("zigzag_ring", 2), ("ulysses", 2), ("burst", 3)]
)
def test_other_world_sizes(corpus, baseline, name, world_size):
    results = train_sp(corpus, name, world_size)
    assert max_rel(results[0].losses, baseline.losses) < 1e-5


# (sink_per_rank acts on a model with attention sinks only: tests/test_sinks.py)
@pytest.mark.parametrize(
    "bug", [b for b in PLANTED_BUGS if b not in ("none", "cross_document_attention", "sink_per_rank")]
)
@pytest.mark.parametrize("name", ["ring", "zigzag_ring"])
def test_planted_bugs_are_caught(corpus, baseline, name, bug):
    """Each way sequence parallelism breaks a model silently moves the loss far beyond the 1e-4
    tolerance (while the correct run stays below 1e-5: see above). (cross_document_attention acts
    on packed documents only: test_cross_document_attention_is_caught_on_packed_documents.)"""
    results = train_sp(corpus, name, 4, tc=dataclasses.replace(TRAIN, planted_bug=bug))
    assert (
        max_rel(results[0].losses, baseline.losses) > 1e-3
        or abs(results[0].perplexity / baseline.perplexity - 1) > 1e-2
    )


# -- configuration ------------------------------------------------------------------------------------
def test_config_errors_name_the_key(write_config):
    base = """
    name: ppl
    kind: perplexity
    sweep: {methods: [ring], world_size: [2], seq_len: [64], heads: [4], kv_heads: [2], head_dim: [8],
            causal: [true]}
    """
    path = write_config(base)
    cfg, _ = load_config(path)
    assert cfg.kind == "perplexity" and cfg.perplexity.steps == 50
    for override, key in [
        ("sweep.causal=[true,false]", "sweep.causal"),
        ("kind=training", "kind"),
        ("perplexity.planted_bug=typo", "perplexity.planted_bug"),
        ("perplexity.steps=0", "perplexity.steps"),
        ("perplexity.data.source=file", "perplexity.data.path"),
        ("perplexity.data.val_fraction=1.5", "perplexity.data.val_fraction"),
    ]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(path, [override])
    with pytest.raises(ConfigError, match="allowed keys under perplexity"):
        load_config(path, ["perplexity.stepz=3"])


def test_plan_has_one_train_trial_per_point_with_the_corpus_hash(write_config):
    path = write_config("""
    name: ppl
    kind: perplexity
    sweep: {methods: [ring, ulysses], world_size: [2, 4], seq_len: [64], heads: [4], kv_heads: [2],
            head_dim: [8], causal: [true], passes: [fwd, fwd_bwd]}
    perplexity: {data: {max_bytes: 100000}}
    """)
    cfg, _ = load_config(path)
    plan = plan_for(cfg, "cpu:test")
    assert [s.pass_ for s in plan] == ["train"] * 4
    sha = load_corpus("stdlib", max_bytes=100_000).sha256
    assert all(sha in s.workload for s in plan) and len({s.key for s in plan}) == 4
    cfg2, _ = load_config(path, ["perplexity.steps=7"])
    assert {s.key for s in plan_for(cfg2, "cpu:test")}.isdisjoint({s.key for s in plan})


# -- the sweep, end to end ---------------------------------------------------------------------------
def _sweep(path, *overrides, resume=None, force=False):
    from suite.runner import run_sweep

    cfg, text = load_config(path, list(overrides))
    return run_sweep(cfg, text, resume=resume, force=force, progress=False, out=open(os.devnull, "w"))


PPL_SWEEP = """
name: ppl
kind: perplexity
sweep: {{methods: [ring, zigzag_ring, ulysses], world_size: [2], batch: [2], seq_len: [64], heads: [4],
        kv_heads: [2], head_dim: [8], causal: [true]}}
perplexity: {{steps: 8, warmup_steps: 2, eval_batches: 2, data: {{max_bytes: 200000}}}}
run: {{warmup: 1, timeout_s: 120}}
tracking: {{uri: "sqlite:///{db}"}}
"""


@pytest.mark.slow
def test_perplexity_sweep_records_baseline_curves_and_mlflow_and_resumes(write_config, tmp_path):
    db = tmp_path / "mlflow.db"
    path = write_config(PPL_SWEEP.format(db=db))
    res = _sweep(path)
    recs = res.records
    base = [r for r in recs if r["method"] == "baseline"]
    assert len(recs) == 4 and len(base) == 1 and base[0]["executor"] == "local" and base[0]["world_size"] == 1
    for r in recs:
        assert r[M.STATUS] == M.OK, r[M.REASON]
        assert len(r[M.LOSS_CURVE]) == 8 and r[M.PPL] == pytest.approx(math.exp(r[M.VAL_LOSS]))
        assert r[M.PPL] < 256  # better than uniform over bytes
        if r["method"] != "baseline":
            assert r["executor"] == "dist" and r["pass"] == "train" and r[M.BYTES_SENT] > 0
            assert r[M.LOSS_MAX_REL_DIFF] < 1e-5 and abs(r[M.PPL_REL_DIFF]) < 1e-5
            assert r[M.PPL_BASELINE] == base[0][M.PPL]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name("ppl")
    child = next(r for r in client.search_runs([exp.experiment_id]) if r.data.params.get("method") == "zigzag_ring")
    history = client.get_metric_history(child.info.run_id, "train_loss")
    assert sorted(m.step for m in history) == list(range(8))
    assert {"perplexity", "perplexity_rel_diff", "loss_max_rel_diff"} <= set(child.data.metrics)
    # every setting of the model and its training is a param to compare runs by
    assert child.data.params["workload.train.steps"] == "8" and "workload.model.layers" in child.data.params
    assert {"workload.train.lr", "workload.data.max_bytes"} <= set(child.data.params)
    parent = client.get_run(child.data.tags["mlflow.parentRunId"])
    assert parent.data.params["perplexity.steps"] == "8" and "perplexity.lr" in parent.data.params
    # resume with one more method (forced: the folder's config has three): the stored baseline is
    # reused, not trained again
    res2 = _sweep(path, "sweep.methods=[ring,zigzag_ring,ulysses,tasp]", resume=str(res.run_dir), force=True)
    assert "sweep.methods" in json.loads((res.run_dir / "resumes.jsonl").read_text())["changed"]
    assert len(res2.records) == 5 and sum(r["method"] == "baseline" for r in res2.records) == 1
    assert res2.mlflow_disabled is None  # a setting changed on resume is no MLflow error
    # the resumed sweep continues the same parent run: one child per stored row, nothing twice
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert sorted(r.data.tags["key"] for r in runs if r not in parents) == sorted(r[M.KEY] for r in res2.records)
    assert parents[0].data.tags["resumed_with.sweep.methods"] == "ring,zigzag_ring,ulysses,tasp"
    assert next(r for r in res2.records if r["method"] == "tasp")[M.STATUS] == M.OK
    # the report: a perplexity table and the loss-curve figure, no attention tables
    from suite.reports import build_report

    rep = build_report([str(res.run_dir)], out=tmp_path / "rep", log_to_mlflow=False)
    assert "perplexity" in rep.tables and "throughput" not in rep.tables
    assert any(f.endswith("loss_curves.png") for f in rep.figures)
    import pandas as pd

    table = pd.read_csv(tmp_path / "rep" / "tables" / "perplexity.csv")
    assert len(table) == 5 and set(table["status"]) == {"ok"}


@pytest.mark.slow
def test_planted_bug_is_recorded_incorrect_through_the_sweep(write_config, tmp_path):
    path = write_config(PPL_SWEEP.format(db=tmp_path / "m.db"))
    res = _sweep(path, "perplexity.planted_bug=local_positions", "sweep.methods=[zigzag_ring]")
    row = next(r for r in res.records if r["method"] == "zigzag_ring")
    assert row[M.STATUS] == M.INCORRECT and "differs from the single-device baseline" in row[M.REASON]
    assert row[M.LOSS_MAX_REL_DIFF] > 1e-4
    # the baseline has no planted bug to suffer from: it is the plain single-device model
    assert next(r for r in res.records if r["method"] == "baseline")[M.STATUS] == M.OK


PACKED_SWEEP = """
name: ppl_packed
kind: perplexity
sweep: {{methods: {methods}, world_size: [3], batch: [2], seq_len: [90], heads: [6],
        kv_heads: [3], head_dim: [8], causal: [true], workload: [docs]}}
documents: {{docs: {{distribution: lognormal, median: 16, sigma: 0.8}}}}
perplexity: {{steps: 6, warmup_steps: 2, eval_batches: 2, data: {{max_bytes: 200000}}}}
run: {{executor: threads, warmup: 1}}
tracking: {{mlflow: false}}
results: {{root: {root}}}
"""


def test_packed_documents_train_like_the_baseline_with_every_causal_method(write_config, tmp_path):
    """Packed documents (positions restarting at each, document-causal mask), an odd length that
    some layouts pad (90 tokens at P = 3): every method's losses and perplexity equal the
    single-device baseline's, which masks the same documents in SDPA."""
    path = write_config(PACKED_SWEEP.format(methods=f"[{', '.join(CAUSAL_METHODS)}]", root=tmp_path))
    res = _sweep(path)
    rows = [r for r in res.records if r["method"] != "baseline"]
    assert {r["method"] for r in rows} == set(CAUSAL_METHODS)
    for r in rows:
        assert r[M.STATUS] == M.OK, (r["method"], r[M.REASON])
        assert r[M.LOSS_MAX_REL_DIFF] < 1e-5 and '"documents"' in r["workload"]
    assert any(r[M.PADDED_TOKENS] for r in rows) is False  # perplexity rows record no attention balance columns


def test_cross_document_attention_is_caught_on_packed_documents(write_config, tmp_path):
    """A method that attends across packed documents trains another model than the baseline's."""
    path = write_config(PACKED_SWEEP.format(methods="[zigzag_ring]", root=tmp_path))
    res = _sweep(path, "perplexity.planted_bug=cross_document_attention")
    row = next(r for r in res.records if r["method"] == "zigzag_ring")
    assert row[M.STATUS] == M.INCORRECT and row[M.LOSS_MAX_REL_DIFF] > 1e-4


# -- Hugging Face ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 4])
def test_hf_llama_gives_the_same_logits_with_every_method(world_size):
    pytest.importorskip("transformers", reason="the Hugging Face path needs transformers (extra hf)")
    from suite.perplexity.hf import eager_logits, gathered_logits, tiny_llama

    model = tiny_llama(seed=1)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    ref = eager_logits(model, ids)
    for name in CAUSAL_METHODS:
        got = gathered_logits(model, ids, methods.get_method(name), world_size)
        assert got.shape == ref.shape
        assert (got - ref).abs().max() < 1e-5, name


def test_hf_check_fails_without_global_positions():
    """Feeding each rank's tokens without position_ids (transformers then numbers them 0..S_local-1)
    gives different logits: the comparison above can fail."""
    pytest.importorskip("transformers", reason="the Hugging Face path needs transformers (extra hf)")
    from suite.perplexity import hf

    model = hf.tiny_llama(seed=1)
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))
    ref = hf.eager_logits(model, ids)
    method = methods.get_method("zigzag_ring")
    layout = layouts.zigzag(64, 4)
    hf.use_suite_attention(model)

    def rank(comm):
        with torch.no_grad(), hf.sequence_parallel(method, comm):
            return model(input_ids=layout.shard(ids, comm.rank), use_cache=False).logits

    bad = layout.unshard(run_threads(4, rank))
    assert (bad - ref).abs().max() > 1e-4
    with pytest.raises(RuntimeError, match="outside"):
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)


def test_hf_perplexity_command(capsys):
    pytest.importorskip("transformers", reason="the Hugging Face path needs transformers (extra hf)")
    from suite.cli import main

    assert (
        main(
            [
                "hf-perplexity",
                "tiny-llama",
                "--methods",
                "ring,ulysses",
                "--world-size",
                "2",
                "--seq-len",
                "64",
                "--batches",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith(("ring", "ulysses"))]
    assert len(lines) == 2
    for ln in lines:
        ppl, eager = float(ln.split()[2]), float(ln.split()[3])
        assert ppl == pytest.approx(eager, rel=1e-5) and 100 < ppl < 1000  # random model: near uniform


def test_training_the_baseline_prints_a_line_when_it_starts_and_ends(write_config, monkeypatch):
    """The baseline trains before the first trial's bar moves (tens of seconds): the user is told."""
    from suite.config import load_config
    from suite.tracking import NullTracker
    from suite.workloads import perplexity as P
    from tests.helpers import plan_for

    cfg, _ = load_config(write_config(PPL_SWEEP.format(db="unused.db")), ["tracking.mlflow=false"])
    spec = plan_for(cfg, hardware="cpu:test")[0]
    appended, lines = [], []

    class Store:
        def iter_records(self):
            return iter(())

        def append(self, row):
            appended.append(row)

    monkeypatch.setattr(
        P,
        "run_baseline",
        lambda bspec, ctx: {M.KEY: bspec.key, "method": P.BASELINE, M.STATUS: M.OK, M.DURATION_S: 1.5, M.PPL: 12.25},
    )
    baselines = P.Baselines(Store(), NullTracker(), None, say=lines.append)
    baselines.get(spec)
    baselines.get(spec)  # trained once
    assert len(appended) == 1 and len(lines) == 2
    assert lines[0].startswith("training the single-device baseline (baseline P=1")
    assert lines[1] == "baseline ok in 1.5s: perplexity 12.2500"


# -- per-layer masks ---------------------------------------------------------------------------------
WINDOW_PATTERN = ["sliding_window:20", "causal"]  # a local layer, then a global one; 20 < 96 / 2


def _masked_attends(masks, method, comm, docs, batch, seq_len):
    from suite.workloads.perplexity import layer_documents

    out = []
    for m in masks:
        d = layer_documents(docs, m, batch, seq_len)
        extra = {"docs": d} if d is not None else {}
        out.append(functools.partial(method.attention, causal=m.plain or m.causal, comm=comm, **extra))
    return out


def train_pattern(corpus, pattern, name=None, world_size=1, tc=TRAIN, model=MODEL):
    """Train with the per-layer masks `pattern` (repeated over the layers): on one device with SDPA
    and each layer's dense mask when `name` is None (the workload's baseline), else with method
    `name` on `world_size` virtual ranks."""
    from methods.masks import parse
    from suite.perplexity.train import prefix_loss_skip
    from suite.workloads.perplexity import check_one_layout, layer_documents

    masks = [parse(pattern[i % len(pattern)]) for i in range(model.layers)]
    skip = prefix_loss_skip(None, tc.batch, tc.seq_len, masks)
    if name is None:
        everything = torch.arange(tc.seq_len)
        attends = []
        for m in masks:
            d = layer_documents(None, m, tc.batch, tc.seq_len)
            dense = d.block(everything, everything, m.causal).dense() if d is not None else None
            attends.append(functools.partial(sdpa_attend, mask=dense))
        layout = layouts.contiguous(tc.seq_len, 1)
        return train_and_evaluate(
            model, tc, corpus, layout=layout, comm=None, make_attend=lambda c: attends, loss_skip=skip
        )
    method = methods.get_method(name)
    case = layer_case(tc, model, world_size)
    padded = method.padded_len(case)
    docs = None
    if padded != tc.seq_len:  # as the workload's run_case: padding travels as documents
        docs = Documents.single(tc.batch, tc.seq_len, padded)
        case = dataclasses.replace(case, seq_len=padded, documents=docs)
    ok, why = method.supports(case)
    if not ok:
        pytest.skip(why)
    layout = method.layout(case)
    try:  # as the workload: a layout that follows the mask cannot serve layers that mask differently
        check_one_layout(method, case, layout, [layer_documents(docs, m, tc.batch, padded) for m in masks])
    except ValueError as exc:
        pytest.skip(str(exc))
    return run_threads(
        world_size,
        lambda comm: train_and_evaluate(
            model,
            tc,
            corpus,
            layout=layout,
            comm=comm,
            make_attend=lambda c: _masked_attends(masks, method, c, docs, tc.batch, padded),
            docs=docs,
            loss_skip=skip,
        ),
    )


class WindowOnlyOnOwnBlocks(BlockMasks):
    """The planted bug: blocks of queries against another rank's keys get the documents without
    the mask (the window is applied only to a rank's own block)."""

    def __call__(self, q_rank, q_rows, k_rank, k_rows):
        if q_rank == k_rank or self.docs.mask is None:
            return super().__call__(q_rank, q_rows, k_rank, k_rows)
        plain = Documents(self.docs.lengths, self.docs.padded_len)
        return plain.block(self.positions(q_rank)[q_rows], self.positions(k_rank)[k_rows], self.causal)


@pytest.fixture(scope="module")
def window_baseline(corpus):
    return train_pattern(corpus, WINDOW_PATTERN)


def test_the_window_pattern_trains_another_model_than_plain_causal(baseline, window_baseline):
    """The window really masks: the pattern's baseline is not the causal one (so equality below is
    a statement about the window)."""
    assert max_rel(window_baseline.losses, baseline.losses) > 1e-3
    assert window_baseline.losses[-1] < window_baseline.losses[0] - 0.5


@pytest.mark.parametrize("name", CAUSAL_METHODS)
def test_every_method_trains_like_the_baseline_with_a_sliding_window_layer(corpus, window_baseline, name):
    results = train_pattern(corpus, WINDOW_PATTERN, name, 2)
    assert max_rel(results[0].losses, window_baseline.losses) < 1e-5
    assert abs(results[0].perplexity / window_baseline.perplexity - 1) < 1e-5


def test_a_window_ignored_on_blocks_from_other_ranks_is_caught(corpus, window_baseline, monkeypatch):
    """Planted bug: blocks of queries against another rank's keys get the documents without the
    mask (the window is applied only to a rank's own block); the ring then trains another model."""
    import methods.base
    import methods.documents as D

    monkeypatch.setattr(D, "BlockMasks", WindowOnlyOnOwnBlocks)
    monkeypatch.setattr(methods.base, "BlockMasks", WindowOnlyOnOwnBlocks)
    results = train_pattern(corpus, WINDOW_PATTERN, "ring", 2)
    assert max_rel(results[0].losses, window_baseline.losses) > 1e-3


def test_prefix_lm_layers_leave_the_prefix_labels_out(corpus):
    """A prefix_lm layer sees the whole prefix both ways: the labels inside it are left out of the
    loss, and a method then trains like the baseline."""
    from methods.masks import parse
    from suite.perplexity.train import prefix_loss_skip

    skip = prefix_loss_skip(((5, 7),), 1, 12, [parse("causal"), parse("prefix_lm:3")])
    assert skip[0].nonzero().flatten().tolist() == [0, 1, 5, 6]  # labels 1, 2 and 6, 7: in a prefix
    assert prefix_loss_skip(None, 2, 8, [parse("sliding_window:4")]) is None
    pattern = ["prefix_lm:0.25", "causal"]
    base = train_pattern(corpus, pattern)
    results = train_pattern(corpus, pattern, "zigzag_ring", 2)
    assert max_rel(results[0].losses, base.losses) < 1e-5


def test_layer_masks_in_the_config(write_config):
    """The pattern is checked (masks a causal LM cannot train with are refused, naming the key),
    named masks resolve, and only a pattern other than plain causal enters the trials' identity."""
    from suite.workloads.perplexity import layer_masks, workload_json

    path = write_config("""
    name: ppl
    kind: perplexity
    sweep: {methods: [ring], world_size: [2], seq_len: [64], heads: [4], kv_heads: [2], head_dim: [8],
            causal: [true]}
    masks: {local: {family: sliding_window, window: 16}}
    perplexity: {layers: 3, data: {max_bytes: 100000}}
    """)
    cfg, _ = load_config(path)
    assert cfg.perplexity.layer_masks == ["causal"] and "layer_masks" not in workload_json(cfg)
    plain_key = plan_for(cfg, "cpu:test")[0].key
    cfg2, _ = load_config(path, ["perplexity.layer_masks=[causal,causal]"])
    assert plan_for(cfg2, "cpu:test")[0].key == plain_key
    cfg3, _ = load_config(path, ["perplexity.layer_masks=[local,chunked:16]"])
    spec = plan_for(cfg3, "cpu:test")[0]
    assert spec.key != plain_key
    assert [m.name for m in layer_masks(spec, 3)] == [
        "sliding_window:symmetric=false,window=16",
        "chunked:chunk=16",
        "sliding_window:symmetric=false,window=16",
    ]
    for override, key, what in [
        ("perplexity.layer_masks=[causal,block_causal:8]", r"perplexity\.layer_masks\[1\]", "later tokens"),
        ("perplexity.layer_masks=[full]", r"perplexity\.layer_masks\[0\]", "bidirectional"),
        ("perplexity.layer_masks=['sliding_window:window=8,symmetric=true']", r"layer_masks\[0\]", "later"),
        ("perplexity.layer_masks=[global_window:2]", r"layer_masks\[0\]", "global_window"),
        ("perplexity.layer_masks=[nope]", r"layer_masks\[0\]", "unknown mask"),
        ("perplexity.layer_masks=[]", r"perplexity\.layer_masks", "at least one"),
        ("sweep.mask=[sliding_window:8]", r"sweep\.mask", "perplexity.layer_masks"),
    ]:
        with pytest.raises(ConfigError, match=f"{key}.*{what}"):
            load_config(path, [override])


def tiny_qwen2_with_a_window(window: int):
    """A random tiny Qwen2 whose second layer has a sliding window (transformers' `layer_types`)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(2)
    cfg = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        use_sliding_window=True,
        sliding_window=window,
        max_window_layers=1,
    )
    return Qwen2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("world_size", [2, 3])
def test_hf_sliding_window_model_gives_the_same_logits_with_every_method(world_size):
    """A model with a sliding-window layer is no longer refused: the window reaches each method as
    a mask, and the logits equal the model's own eager attention (which masks the window)."""
    pytest.importorskip("transformers", reason="the Hugging Face path needs transformers (extra hf)")
    from suite.perplexity.hf import eager_logits, gathered_logits, model_case, model_window

    model = tiny_qwen2_with_a_window(8)
    assert model.config.layer_types == ["full_attention", "sliding_attention"] and model_window(model) == 8
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    ref = eager_logits(model, ids)
    no_window = eager_logits(tiny_qwen2_with_a_window(4096), ids)
    assert (no_window - ref).abs().max() > 1e-3  # the window changes the logits
    checked = 0
    for name in CAUSAL_METHODS:
        method = methods.get_method(name)
        if not method.supports(model_case(model, 2, 48, world_size))[0]:
            continue
        try:
            got = gathered_logits(model, ids, method, world_size)
        except ValueError as exc:  # a layout that follows the mask (dispatch) serves no model whose layers differ
            assert "follows the mask" in str(exc), name
            continue
        assert (got - ref).abs().max() < 1e-5, name
        checked += 1
    assert checked >= 5


MASKED_SWEEP = """
name: ppl_masks
kind: perplexity
sweep: {{methods: [ring, zigzag_ring], world_size: [2], batch: [2], seq_len: [64], heads: [4],
        kv_heads: [2], head_dim: [8], causal: [true]}}
perplexity: {{layer_masks: ["sliding_window:12", causal], steps: 4, warmup_steps: 2, eval_batches: 2,
              data: {{max_bytes: 200000}}}}
run: {{executor: threads, warmup: 1}}
tracking: {{mlflow: false}}
results: {{root: {root}}}
"""


def test_the_sweep_checks_layer_masks_and_reports_a_window_ignored_across_ranks(write_config, tmp_path, monkeypatch):
    """Through the workload (config, baseline row, trial rows): with [sliding_window:12, causal]
    the methods' rows are ok; with the window ignored on blocks from other ranks (the planted bug
    above) the ring's row is incorrect."""
    import methods.base

    path = write_config(MASKED_SWEEP.format(root=tmp_path / "good"))
    rows = _sweep(path).records
    assert '"layer_masks"' in rows[0]["workload"]
    for r in rows:
        assert r[M.STATUS] == M.OK, (r["method"], r[M.REASON])

    monkeypatch.setattr(methods.base, "BlockMasks", WindowOnlyOnOwnBlocks)
    path = write_config(MASKED_SWEEP.format(root=tmp_path / "bug"))
    ring = next(r for r in _sweep(path, "sweep.methods=[ring]").records if r["method"] == "ring")
    assert ring[M.STATUS] == M.INCORRECT and "differs from the single-device baseline" in ring[M.REASON]
