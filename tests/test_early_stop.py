"""No wasted work for local masks: K/V rings stop once no rank has a visible pair left, and rows
count the K/V bytes a rank received that none of its queries attends (`redundant_bytes_per_rank`).

Exactness under every mask family, with packed documents and padding, is checked against float64
(tests/test_varlen.py's machinery); bytes against the counting comm in tests/test_methods.py.
"""

from dataclasses import replace

import pytest
import torch

import methods
from methods import kv_ring
from methods.base import Case
from methods.comm.counting import CommRecord
from methods.documents import Documents
from methods.masks import examples, parse
from tests.test_varlen import check_documents

RING_FAMILY = ["ring", "zigzag_ring", "stripe_ring", "usp", "burst"]
MASKS = examples()  # every mask family (methods/masks.py)


@pytest.mark.parametrize("name", RING_FAMILY)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_rings_cut_short_stay_exact(name, world_size):
    """Odd lengths (padding), one document and two packed ones, every family with its causal flag:
    a third of the families per world size, so every (method, family) pair runs at one P (a
    different one for neighbouring methods)."""
    seq_len = 7 * world_size + 5
    shift = (RING_FAMILY.index(name) + world_size) % 3
    for lengths in (((seq_len,),), ((5, seq_len - 5),)):
        for spec in MASKS[shift::3]:
            mask = parse(spec)
            why = check_documents(name, {}, world_size, seq_len, lengths, mask.causal, mask=mask)
            assert not why or "heads divisible" in why, why


def _case(seq_len, world_size, mask, batch=1, heads=4, kv_heads=2, head_dim=8, dtype="bfloat16"):
    family = parse(mask)
    docs = Documents.single(batch, seq_len, mask=family)
    return Case(batch, seq_len, heads, kv_heads, head_dim, dtype, family.causal, world_size, documents=docs)


def test_a_window_ring_circulates_only_the_steps_it_needs():
    """Window 3 at local length 4: every query sees its own block and the one before; the plain
    causal and a global mask keep all P steps (and every byte)."""
    m = methods.get_method("ring")
    assert m.case_steps(_case(16, 4, "sliding_window:3")) == 2
    assert m.case_steps(_case(16, 4, "sliding_window:6")) == 3  # 5 keys back reach two blocks back
    assert m.case_steps(_case(16, 4, "global_window:globals=1,window=2")) == 4
    plain = Case(1, 16, 4, 2, 8, "bfloat16", True, 4)
    assert m.case_steps(plain) == 4
    docs = replace(plain, documents=Documents(((5, 11),), 16))  # packed, plain mask: unchanged
    assert m.case_steps(docs) == 4 and m.expected_bytes(docs, "fwd_bwd") == m.expected_bytes(plain, "fwd_bwd")


def _brute_unseen_bytes(case, q_pos, k_pos, kv_heads):
    vis = case.documents.block(torch.arange(case.seq_len), torch.arange(case.seq_len), case.causal).dense()
    seen = vis[:, q_pos][:, :, k_pos].any(dim=1)  # [B, keys]
    return int((~seen).sum()) * 2 * kv_heads * case.head_dim * case.torch_dtype.itemsize


@pytest.mark.parametrize("mask", ["sliding_window:3", "chunked:5", "prefix_lm:0.25"])
def test_redundant_bytes_equal_brute_force(mask):
    """What each rank receives (its ring's first steps - 1 blocks, all other ranks' K/V for
    all-gather, the other ranks' tokens of its heads for Ulysses), keys checked one by one against
    the dense mask."""
    p, s = 4, 48
    # padding too: 45 true tokens in a layout of 48
    case = _case(s, p, mask, batch=2)
    case = replace(case, documents=Documents(((20, 25), (45,)), s, parse(mask)))
    for name in ("ring", "zigzag_ring", "stripe_ring"):
        m = methods.get_method(name)
        pos, n = m.layout(case).positions, m.case_steps(case)
        for r in range(p):
            want = sum(_brute_unseen_bytes(case, pos(r), pos((r - t) % p), 2) for t in range(1, n))
            assert m.redundant_kv_bytes(case, r) == want, (name, r)
    ag = methods.get_method("allgather_kv")
    pos = ag.layout(case).positions
    for r in range(p):
        want = sum(_brute_unseen_bytes(case, pos(r), pos(o), 2) for o in range(p) if o != r)
        assert ag.redundant_kv_bytes(case, r) == want
    uly = methods.get_method("ulysses")
    pos, everything = uly.layout(case).positions, torch.arange(s)
    for r in range(p):  # 2 KV heads on 4 ranks: replicated to one each; only padding is unseen
        want = sum(_brute_unseen_bytes(case, everything, pos(o), 1) for o in range(p) if o != r)
        assert uly.redundant_kv_bytes(case, r) == want
        assert want == (2 * 3 * 2 * 8 * 2 if r != p - 1 else 0)  # 3 padding keys a sequence, on the last rank
    usp = methods.get_method("usp", ulysses_degree=2)
    lay = usp.layout(case)
    pair = [torch.cat([lay.positions(2 * rr), lay.positions(2 * rr + 1)]) for rr in range(2)]
    for r in range(p):
        ring_rank, other = r // 2, r ^ 1
        want = _brute_unseen_bytes(case, pair[ring_rank], lay.positions(other), 1)
        if usp._case_steps(case) == 2:
            want += _brute_unseen_bytes(case, pair[ring_rank], pair[1 - ring_rank], 1)
        assert usp.redundant_kv_bytes(case, r) == want


def test_a_64_token_window_ring_on_8_h100s_takes_2_steps_and_a_seventh_of_the_bytes(monkeypatch):
    """The issue's done-when, on the simulator's trace: ring, P = 8, S = 8192, sliding_window:64,
    32/8 heads of 128, bf16. Each rank's queries see its own block and the last 63 keys of the one
    before, so the ring stops after 2 steps (1 forward hop instead of 7) and a rank receives one
    block, of which rank 0's (the wrap-around) is wholly unseen: 1/7 of the full ring's waste."""
    from suite.sim.trace import trace

    p, s = 8, 8192
    case = _case(s, p, "sliding_window:64", heads=32, kv_heads=8, head_dim=128)
    block = 2 * (s // p) * 8 * 128 * 2  # one rank's K and V, bytes

    def hops(tr):
        return [sum(1 for e in ev if isinstance(e, CommRecord) and e.kind == "p2p") for ev in tr.ranks]

    m = methods.get_method("ring")
    early = {pass_: trace("ring", case, pass_) for pass_ in ("fwd", "fwd_bwd")}
    assert hops(early["fwd"]) == [1] * p  # 2 steps
    # backward: 1 K/V hop, the accumulator's hop and its direct hop home
    assert hops(early["fwd_bwd"]) == [1 + 3] * p
    assert all(early["fwd"].ledger(r).bytes_recv == block for r in range(p))
    redundant = max(m.redundant_kv_bytes(case, r) for r in range(p))
    assert redundant == block  # rank 0 receives rank 7's block, which it never sees

    monkeypatch.setattr(kv_ring, "useful_steps", lambda p, *_: p)  # the ring without early stop
    full = trace("ring", case, "fwd")
    assert hops(full) == [p - 1] * p
    assert m.case_steps(case) == p
    full_redundant = max(m.redundant_kv_bytes(case, r) for r in range(p))
    assert full_redundant == (p - 1) * block
    assert redundant <= full_redundant / 3


def test_rows_with_a_window_record_redundant_bytes_measured_and_simulated(write_config, tmp_path):
    """The row column: filled for a mask family by measured (threads) and simulated rows alike, with
    the method's own count; None for the plain mask (recorded rows stay as they were)."""
    from suite import metrics as M
    from suite.config import load_config
    from suite.runner import run_sweep

    rows = {}
    for executor, extra in (("threads", ""), ("sim", "sim: {topology: [h100_sxm]}")):
        path = write_config(f"""
        name: early_stop_{executor}
        sweep: {{methods: [ring, ulysses], world_size: [4], batch: [1], seq_len: [64], heads: [4],
                 kv_heads: [4], head_dim: [8], dtype: [bfloat16], mask: [causal, "sliding_window:4"],
                 passes: [fwd]}}
        run: {{executor: {executor}, warmup: 0, repeats: 1}}
        {extra}
        tracking: {{mlflow: false}}
        results: {{root: {tmp_path / executor}}}
        """)
        cfg, text = load_config(path)
        for r in run_sweep(cfg, text, progress=False, out=open("/dev/null", "w")).records:
            assert r[M.STATUS] == M.OK, r[M.REASON]
            rows[(executor, r["method"], r["mask"])] = r
    for executor in ("threads", "sim"):
        ring = rows[(executor, "ring", "sliding_window:symmetric=false,window=4")]
        # local length 16: 2 steps; rank 0 receives rank 3's block, none of which it sees
        assert ring[M.REDUNDANT_BYTES] == 16 * 2 * 4 * 8 * 2 and ring[M.BYTES_RECV] == 16 * 2 * 4 * 8 * 2
        uly = rows[(executor, "ulysses", "sliding_window:symmetric=false,window=4")]
        assert uly[M.REDUNDANT_BYTES] == 0  # every key is seen by some query (no padding)
        assert rows[(executor, "ring", "causal")][M.REDUNDANT_BYTES] is None


def test_tasp_receives_every_unit_and_token_ring_no_kv():
    """TASP circulates every unit to every rank (no early stop): its waste is all-gather K/V's;
    TokenRing moves queries, never K/V."""
    case = _case(48, 4, "sliding_window:3")
    tasp = methods.get_method("tasp")
    pos = tasp.layout(case).positions
    for r in range(4):
        want = sum(_brute_unseen_bytes(case, pos(r), pos(o), 2) for o in range(4) if o != r)
        assert tasp.redundant_kv_bytes(case, r) == want > 0
        assert methods.get_method("token_ring").redundant_kv_bytes(case, r) == 0


def test_packed_documents_record_redundant_bytes_under_the_plain_causal_mask():
    """causal_document (packed documents, no mask family: LongCA-bench's commonest workload) records
    the K/V a rank received and never reads (issue 39: it was None for every packed row); one
    document per sequence, with or without padding, stays None as recorded before."""
    from suite.records import redundant_bytes

    plain = Case(1, 16, 4, 2, 8, "bfloat16", True, 4)
    packed = replace(plain, documents=Documents(((5, 11),), 16))
    for name in ("ring", "zigzag_ring", "allgather_kv", "dispatch"):
        m = methods.get_method(name)
        pos = m.layout(packed).positions
        got = [redundant_bytes(m, packed, r) for r in range(4)]
        assert got == [m.redundant_kv_bytes(packed, r) for r in range(4)] and None not in got, name
        if name == "ring":  # rank 3 (keys 12-15, document 2) gets rank 0's keys 0-3, all of document 1
            assert got[3] >= _brute_unseen_bytes(packed, pos(3), pos(0), 2) > 0
        assert redundant_bytes(m, plain, 0) is None
        padded = replace(plain, seq_len=16, documents=Documents(((13,),), 16))
        assert redundant_bytes(m, padded, 0) is None
