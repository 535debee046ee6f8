import dataclasses

import pytest
import torch

from methods.comm import run_threads
from suite import metrics as M
from suite.check import ProblemCache
from suite.plan import RunSettings, TrialSpec
from suite.records import Breakdown, Outcome, RankReport, RowContext, check_columns, skipped_row
from suite.trial import run_trial
from suite.workloads.attention import AttentionWorkload

SETTINGS = RunSettings(warmup=1, repeats=3, check=True, check_max_seq_len=1 << 20, seed=0)
CTX = RowContext(SETTINGS, "run")


def make_record(spec, outcome, ctx=CTX, wall_s=1.0):
    return AttentionWorkload().row(spec, outcome, ctx, "t", wall_s)


def spec(**kw):
    base = dict(
        method="ring",
        impl="own",
        executor="threads",
        hardware="cpu:test",
        topology="single-node",
        world_size=2,
        nodes=1,
        ulysses_degree=1,
        ring_degree=2,
        batch=2,
        seq_len=32,
        heads=4,
        kv_heads=2,
        head_dim=8,
        dtype="float32",
        causal=True,
        pass_="fwd_bwd",
        kernel="auto",
    )
    base.update(kw)
    return TrialSpec(**base)


@pytest.mark.parametrize("autograd", [True, False])
def test_ranks_report_errors_bytes_and_samples(autograd):
    s = spec()
    cache = ProblemCache()
    reports = run_threads(2, lambda c: run_trial(s, SETTINGS, c, torch.device("cpu"), cache, autograd=autograd))
    assert not check_columns(reports)[1]  # every error within the bound the ranks' parts give
    for r in reports:
        assert r.ok, r.traceback
        assert set(r.errors) == {"out", "lse", "dq", "dk", "dv"}
        assert len(r.samples_ms) == 3 and r.kernel_used == "cpu_flash"
        # ring, P=2, fwd+bwd, one K block = B*L*Hkv*D*4 bytes: forward K,V; backward K,V again
        # plus the fp32 dK,dV accumulators on P=2 hops; 1 + 3 exchanges
        block = 2 * 16 * 2 * 8 * 4
        assert r.bytes_sent == r.bytes_recv == 2 * block + 2 * block + 2 * 2 * block
        assert r.comm_ops == {"p2p": 4}
        # CPU peak memory is tracked: at least the two K/V blocks in flight of the forward
        assert r.peak_mem >= 2 * block
        # the breakdown: kernel time, blocked time, compute-only and comm-only samples
        b = r.breakdown
        assert 0 < b.kernel_ms <= b.iter_ms and b.comm_wait_ms >= 0
        assert len(b.compute_only_ms) == len(b.comm_only_ms) == 3


def test_record_takes_the_worst_rank():
    s = spec()
    base = dict(checked=True, kernel_used="cpu_flash", comm_ops={"p2p": 1}, peak_mem=None, tol_floor=2e-6)
    # the bound is put together from the ranks' parts: 2 x the largest naive error + floor x max|ref|
    r0 = RankReport(
        rank=0,
        errors={"out": 1e-7},
        samples_ms=[1.0, 5.0, 2.0],
        bytes_sent=10,
        bytes_recv=10,
        **base,
        naive_err={"out": 4e-6},
        ref_max={"out": 1.0},
    )
    r1 = RankReport(
        rank=1,
        errors={"out": 3e-6},
        samples_ms=[2.0, 1.0, 3.0],
        bytes_sent=12,
        bytes_recv=8,
        **base,
        naive_err={"out": 1e-6},
        ref_max={"out": 1.5},
    )
    rec = make_record(s, Outcome("reported", [r0, r1]))
    assert rec[M.STATUS] == M.OK and rec[M.ERR["out"]] == 3e-6
    assert rec[M.TOL["out"]] == pytest.approx(2 * 4e-6 + 2e-6 * 1.5)
    assert rec[M.CCR] is None  # no breakdown reported
    assert rec[M.TIME_MS_SAMPLES] == [2.0, 5.0, 3.0]  # per iteration: the slowest rank
    assert (rec[M.TIME_MS_MEDIAN], rec[M.TIME_MS_MIN], rec[M.TIME_MS_MAX]) == (3.0, 2.0, 5.0)
    assert rec[M.BYTES_SENT] == 12 and rec[M.BYTES_RECV] == 10
    flops = 4 * 2 * 32 * 32 * 4 * 8 / 2 * 3.5
    assert rec[M.TFLOPS_PER_GPU] == pytest.approx(flops / (3e-3 * 2) / 1e12)
    assert rec[M.TOKENS_PER_S] == pytest.approx(64 / 3e-3)
    assert list(rec) == list(M.COLUMNS)

    r1_bad = dataclasses.replace(r1, errors={"out": float("nan")})
    rec = make_record(s, Outcome("reported", [r0, r1_bad]))
    assert rec[M.STATUS] == M.INCORRECT and "out: error nan" in rec[M.REASON]


def test_failed_timeout_and_skipped_records():
    s = spec()
    err = RankReport(rank=1, ok=False, error="RuntimeError: boom", traceback="Traceback...")
    rec = make_record(s, Outcome("failed", [None, err], "ranks [0] did not finish"), wall_s=2.0)
    assert rec[M.STATUS] == M.FAILED and rec[M.REASON].startswith("rank 1: RuntimeError: boom")
    assert "ranks [0] did not finish" in rec[M.REASON] and rec[M.ERROR_TRACE] == "Traceback..."
    oom = dataclasses.replace(err, oom=True, error="OutOfMemoryError: CUDA out of memory")
    assert "out of memory" in make_record(s, Outcome("reported", [oom, oom]))[M.REASON]
    rec = make_record(s, Outcome("timeout", [None, None], "no report within 5s"), wall_s=5.0)
    assert rec[M.STATUS] == M.TIMEOUT and rec[M.TIME_MS_MEDIAN] is None
    rec = skipped_row(s, "needs CUDA", CTX, "t")
    assert rec[M.STATUS] == M.SKIPPED and rec[M.REASON] == "needs CUDA" and rec["pass"] == "fwd_bwd"


def test_unchecked_above_the_reference_limit():
    s = spec(pass_="fwd")
    settings = RunSettings(warmup=0, repeats=1, check=True, check_max_seq_len=16, seed=0)
    reports = run_threads(2, lambda c: run_trial(s, settings, c, torch.device("cpu"), ProblemCache()))
    rec = make_record(s, Outcome("reported", reports), RowContext(settings, "run"))
    assert rec[M.STATUS] == M.OK and rec[M.CHECKED] is False and rec[M.ERR["out"]] is None


def test_breakdown_columns():
    s = spec()
    base = dict(
        checked=False, kernel_used="cpu_flash", peak_mem=10, bytes_sent=0, bytes_recv=0, samples_ms=[10.0, 10.0, 10.0]
    )
    r0 = RankReport(
        rank=0,
        breakdown=Breakdown(
            iter_ms=10.0, kernel_ms=6.0, comm_wait_ms=2.0, compute_only_ms=[7.0, 7.0, 7.0], comm_only_ms=[4.0, 5.0, 4.0]
        ),
        **base,
    )
    r1 = RankReport(
        rank=1,
        breakdown=Breakdown(
            iter_ms=12.0, kernel_ms=4.0, comm_wait_ms=4.0, compute_only_ms=[8.0, 6.0, 6.0], comm_only_ms=[3.0, 3.0, 6.0]
        ),
        **base,
    )
    rec = make_record(s, Outcome("reported", [r0, r1]))
    assert rec[M.KERNEL_MS] == 5.0 and rec[M.COMM_WAIT_MS] == 3.0
    assert rec[M.OVERHEAD_RATIO] == pytest.approx((10 / 8 + 12 / 8) / 2)
    assert rec[M.COMPUTE_ONLY_MS] == 7.0 and rec[M.COMM_ONLY_MS] == 5.0  # median of per-iteration maxima
    assert rec[M.CCR] == pytest.approx(7 / 5)
    assert rec[M.OVERLAP_EFF] == pytest.approx((7 + 5 - 10) / 5)


def test_the_summary_shows_each_trials_spread_and_flags_a_noisy_one():
    """max/med = slowest repeat / median; over M.NOISY_SPREAD the row is marked and a note counts it."""
    from suite.summary import summary_table

    def row(samples, **kw):
        r = RankReport(rank=0, checked=False, kernel_used="cpu_flash", samples_ms=samples, bytes_sent=0, bytes_recv=0)
        return make_record(spec(**kw), Outcome("reported", [r, dataclasses.replace(r, rank=1)]))

    steady = row([2.0, 2.0, 2.2], seq_len=32)  # 1.10
    noisy = row([2.0, 2.0, 30.0], seq_len=64)  # 15.00: the loaded machine of the issue
    assert M.time_spread(noisy) == pytest.approx(15.0) and M.time_spread(steady) == pytest.approx(1.1)
    text = summary_table([steady, noisy])
    lines = {line.split()[2]: line for line in text.splitlines() if line.startswith("ring ")}  # by seq
    assert " 1.10 " in lines["32"] and "!" not in lines["32"]
    assert "15.00 !" in lines["64"]
    assert f"1 trial(s) marked '!' have a slowest repeat over {M.NOISY_SPREAD:g}x their median" in text
    assert "marked '!'" not in summary_table([steady])
    simulated = dict(noisy, executor="sim")  # one predicted value: no spread shown, none flagged
    assert "!" not in summary_table([simulated])
