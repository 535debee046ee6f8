import pytest
import torch

from methods.comm import P2P, CommError, CommLedger, CountingComm, run_threads
from tests.helpers import run_dist


def exercise(comm):
    """Every Comm operation; returns what this rank saw (same function for threads and gloo)."""
    p, r = comm.world_size, comm.rank
    out = {}
    # ring exchange
    send = torch.full((3,), float(r))
    recv = torch.empty(3)
    comm.exchange([P2P("send", send, (r + 1) % p), P2P("recv", recv, (r - 1) % p)]).wait()
    out["ring"] = recv[0].item()
    # all_to_all: chunk j of rank r holds 10*r + j
    a2a_in = torch.tensor([10.0 * r + j for j in range(p)]).repeat_interleave(2)
    a2a_out = torch.empty_like(a2a_in)
    comm.all_to_all(a2a_out, a2a_in)
    out["a2a"] = a2a_out[::2].tolist()
    ag = torch.empty(p * 2)
    comm.all_gather(ag, torch.full((2,), float(r)))
    out["ag"] = ag[::2].tolist()
    t = torch.tensor([float(r + 1)])
    comm.all_reduce(t)
    out["ar"] = t.item()
    rs = torch.empty(2)
    comm.reduce_scatter(rs, torch.arange(2.0 * p) * (r + 1))  # chunk j of rank r: (r+1)*[2j, 2j+1]
    out["rs"] = rs.tolist()
    # split into even / odd ranks, then a ring inside the sub-group
    groups = [list(range(0, p, 2)), list(range(1, p, 2))] if p > 1 else [[0]]
    sub = comm.split(groups)
    assert comm.split(groups) is sub  # cached
    out["sub"] = (sub.rank, sub.world_size)
    s = torch.tensor([float(r)])
    sub.all_reduce(s)
    out["sub_sum"] = s.item()
    comm.barrier()
    return out


def check(results, p):
    for r, got in enumerate(results):
        assert got["ring"] == (r - 1) % p
        assert got["a2a"] == [10.0 * src + r for src in range(p)]
        assert got["ag"] == list(map(float, range(p)))
        assert got["ar"] == p * (p + 1) / 2
        assert got["rs"] == [2.0 * r * p * (p + 1) / 2, (2.0 * r + 1) * p * (p + 1) / 2]
        mine = list(range(r % 2, p, 2)) if p > 1 else [0]
        assert got["sub"] == (mine.index(r), len(mine))
        assert got["sub_sum"] == float(sum(mine))


@pytest.mark.parametrize("p", [2, 3, 4])
def test_thread_comm_semantics(p):
    check(run_threads(p, exercise), p)


@pytest.mark.slow
def test_dist_comm_semantics_over_gloo():
    check(run_dist(4, exercise), 4)


def test_counting_comm_bytes():
    def fn(comm):
        ledger = CommLedger()
        c = CountingComm(comm, ledger)
        p, r = c.world_size, c.rank
        x = torch.zeros(8, dtype=torch.float32)  # 32 bytes
        c.exchange([P2P("send", x, (r + 1) % p), P2P("recv", torch.empty(8), (r - 1) % p)]).wait()
        c.all_to_all(torch.empty(8), x)
        c.all_gather(torch.empty(8 * p), x)
        c.split([[0, 1], [2, 3]]).all_reduce(torch.zeros(4))  # 16 bytes in a group of 2
        c.reduce_scatter(torch.empty(2), torch.zeros(8))  # 8 of 32 bytes stay; 3 peers x 8 bytes arrive
        return ledger

    ledgers = run_threads(4, fn)
    for rank, led in enumerate(ledgers):
        kinds = [rec.kind for rec in led.records]
        assert kinds == ["p2p", "all_to_all", "all_gather", "all_reduce", "reduce_scatter"]
        assert [rec.bytes_sent for rec in led.records] == [32, 24, 96, 16, 24]
        assert [rec.bytes_recv for rec in led.records] == [32, 24, 96, 16, 24]
        assert led.bytes_sent == 192 and led.counts()["p2p"] == 1
        r = led.records[0]
        assert r.per_peer == {(rank + 1) % 4: (32, 0), (rank - 1) % 4: (0, 32)}  # the per-link view
    assert ledgers[2].records[3].peers == (2, 3)  # sub-group peers reported as outer ranks


def test_thread_comm_error_aborts_every_rank_quickly():
    def fn(comm):
        if comm.rank == 1:
            raise RuntimeError("boom")
        buf = torch.empty(2)
        comm.exchange([P2P("recv", buf, 1)]).wait()  # would wait forever for rank 1

    with pytest.raises(RuntimeError, match="boom"):
        run_threads(3, fn, timeout_s=30)


def test_thread_comm_timeout_and_misuse():
    def recv_nothing(comm):
        comm.exchange([P2P("recv", torch.empty(1), (comm.rank + 1) % 2)]).wait()

    with pytest.raises(CommError, match="timed out"):
        run_threads(2, recv_nothing, timeout_s=0.5)

    def bad_shape(comm):
        if comm.rank == 0:
            comm.exchange([P2P("send", torch.zeros(3), 1)]).wait()
        else:
            comm.exchange([P2P("recv", torch.empty(2), 0)]).wait()

    with pytest.raises(CommError, match="mismatched"):
        run_threads(2, bad_shape, timeout_s=5)

    def self_send(comm):
        comm.exchange([P2P("send", torch.zeros(1), comm.rank)])

    with pytest.raises(CommError, match="invalid peer"):
        run_threads(2, self_send, timeout_s=5)

    def not_partition(comm):
        comm.split([[0], [0, 1]])

    with pytest.raises(ValueError, match="partition"):
        run_threads(2, not_partition, timeout_s=5)
