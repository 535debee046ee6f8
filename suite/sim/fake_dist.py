"""A fake `torch.distributed` for tracing a peer library's own code with virtual ranks.

Peer libraries (ring-flash-attn, yunchang) call `torch.distributed` themselves, with the process
groups they create. While a trace runs (`installed()`), the few module functions they call are
replaced by functions that route each call of a virtual-rank thread (`virtual_rank()`) to that
rank's `Comm` - the tracer's recording comm over `ThreadComm` (methods/comm/threads.py) - so their
bytes follow the suite's one counting convention (methods/comm/counting.py) and the events land in
the rank's trace exactly as an own method's would:

- `P2POp` + `batch_isend_irecv`, `isend`, `irecv` -> one `exchange` per call; the first `wait()` on
  any of its requests is the rank's `Wait` (ring-flash-attn waits on every request of a batch);
- `all_to_all_single`, `all_gather_into_tensor` / `all_gather`, `reduce_scatter_tensor` /
  `reduce_scatter`, `all_reduce`, `barrier` -> the comm's collective; called with `async_op=True`,
  the handle's first `wait()` is the rank's `Wait` on it, so the simulator runs the collective
  beside what the rank does until then (ring-flash-attn's llama3 gathers the next heads' K/V while
  it computes the current ones), as it runs an exchange until its `Wait`;
- `new_group`, `get_rank`, `get_world_size`, `get_global_rank`, `get_group_rank`,
  `get_process_group_ranks`, `is_initialized`, `get_backend` -> answered from the virtual ranks.

Why not a registered backend with a fake store (torch's `Backend.register_backend`): a process has
one default process group, while the virtual ranks are threads of one process that each need
their own rank. So the functions are patched for the duration of one trace, and a thread that is
not a virtual rank gets the real torch.distributed.

Groups: `new_group` is collective in torch (every rank calls it, in the same order, for every
group, member or not), so the n-th call names the same group on every rank; its members share one
`ThreadWorld`. A call with other ranks than the other ranks' n-th call, or a rank outside the
trace's world, raises ValueError.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from methods.comm.base import P2P, Comm
from methods.comm.counting import CommRecord, CountingComm
from methods.comm.threads import ThreadWorld
from suite.sim.ledger import Wait

_local = threading.local()  # .rank: the _VirtualRank of a virtual-rank thread
_INSTALL = threading.Lock()  # one trace at a time patches torch.distributed


class FakeGroup:
    """A process group as one virtual rank holds it: its members (global ranks) and, if this rank
    is one of them, the rank's comm over the group (local ranks 0..size-1)."""

    def __init__(self, ranks: tuple[int, ...], comm: Optional[Comm]):
        self.ranks, self.comm = ranks, comm

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        return self.comm.rank if self.comm is not None else -1

    def __repr__(self) -> str:
        return f"FakeGroup(ranks={list(self.ranks)})"


class FakeWorld:
    """What the virtual ranks of one trace share: the groups they create (one `ThreadWorld` per
    group), so that a failing rank can wake the ranks blocked in them."""

    def __init__(self, world_size: int, timeout_s: float):
        self.world_size, self.timeout_s = world_size, timeout_s
        self._groups: dict[int, tuple[tuple[int, ...], ThreadWorld]] = {}
        self._lock = threading.Lock()

    def group_world(self, index: int, ranks: tuple[int, ...]) -> ThreadWorld:
        """The shared world of the `index`-th group created (the same group on every rank)."""
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if bad or len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(
                f"new_group({list(ranks)}): ranks must be distinct and within the trace's "
                f"{self.world_size} virtual ranks (0..{self.world_size - 1})"
            )
        with self._lock:
            if index not in self._groups:
                self._groups[index] = (ranks, ThreadWorld(len(ranks), self.timeout_s))
            known, world = self._groups[index]
        if known != ranks:
            raise ValueError(
                f"new_group call {index} names ranks {list(ranks)} on one rank and {list(known)} on another: "
                f"every rank must create the same groups in the same order"
            )
        return world

    def abort(self) -> None:
        with self._lock:
            worlds = [w for _, w in self._groups.values()]
        for w in worlds:
            w.abort()


class _VirtualRank:
    def __init__(self, world: FakeWorld, comm: CountingComm):
        if comm.world_size != world.world_size:
            raise ValueError(f"a comm of {comm.world_size} ranks in a fake world of {world.world_size}")
        self.world, self.comm = world, comm
        self.groups_created = 0

    def new_group(self, ranks: Optional[Sequence[int]]) -> FakeGroup:
        members = tuple(range(self.world.world_size)) if ranks is None else tuple(sorted(int(r) for r in ranks))
        shared = self.world.group_world(self.groups_created, members)
        self.groups_created += 1
        me = self.comm.rank
        if me not in members:
            return FakeGroup(members, None)
        # the rank's recording comm over the group (a counting comm's type keeps itself, as `split`)
        inner = shared.comm(members.index(me))
        return FakeGroup(members, type(self.comm)(inner, self.comm.ledger, members))

    def comm_of(self, group) -> Comm:
        if group is None:
            return self.comm
        if not isinstance(group, FakeGroup):
            raise TypeError(f"a traced library passed {group!r}, not a group it created under the trace")
        if group.comm is None:
            raise ValueError(f"rank {self.comm.rank} is not a member of {group}")
        return group.comm

    def ranks_of(self, group) -> tuple[int, ...]:
        return tuple(range(self.world.world_size)) if group is None else group.ranks


def _current() -> Optional[_VirtualRank]:
    return getattr(_local, "rank", None)


@contextlib.contextmanager
def virtual_rank(world: FakeWorld, comm: CountingComm):
    """Make this thread virtual rank `comm.rank` of `world` while the block runs: its
    torch.distributed calls go to `comm` (and the groups it creates). If the block raises, the
    world's groups are aborted so that no other rank hangs in one of them."""
    _local.rank = _VirtualRank(world, comm)
    try:
        yield
    except BaseException:
        world.abort()
        raise
    finally:
        _local.rank = None


# ---------------------------------------------------------------------------------------------
# The fake functions
# ---------------------------------------------------------------------------------------------
class _Request:
    """What `isend`/`irecv`/`batch_isend_irecv` return: every request of one call shares its
    exchange, waited for (and recorded as waited for) once."""

    def __init__(self, batch: "_Exchange"):
        self._batch = batch

    def wait(self, timeout=None) -> bool:
        self._batch.wait()
        return True

    def is_completed(self) -> bool:
        return self._batch.done


class _Exchange:
    def __init__(self, work):
        self._work, self.done = work, False

    def wait(self) -> None:
        if not self.done:
            self.done = True
            self._work.wait()


class _Done:
    """A handle with nothing to wait for (a batch of messages to itself only, or a collective on a
    comm that records no events)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class FakeP2POp:
    """`dist.P2POp`: a send or receive to post with `batch_isend_irecv` (peer: a global rank)."""

    def __init__(self, op, tensor: torch.Tensor, peer: Optional[int] = None, group=None, tag: int = 0, group_peer=None):
        if op not in (isend, irecv, _REAL["isend"], _REAL["irecv"]):
            raise ValueError(f"P2POp takes isend or irecv, not {op!r}")
        self.op, self.tensor, self.group, self.tag = op, tensor, group, tag
        ranks = _rank().ranks_of(group)
        self.peer = ranks[group_peer] if peer is None else int(peer)
        if self.peer not in ranks:
            raise ValueError(f"peer {self.peer} is not in {group or 'the default group'}")

    @property
    def is_send(self) -> bool:
        return self.op in (isend, _REAL["isend"])


def _rank() -> _VirtualRank:
    vr = _current()
    if vr is None:
        raise RuntimeError("the fake torch.distributed was called outside a virtual rank")
    return vr


def _post(ops: Sequence[FakeP2POp]) -> _Exchange:
    vr = _rank()
    groups = {id(o.group) for o in ops}
    if len(groups) > 1:
        raise ValueError("batch_isend_irecv: every op of a batch must use the same group")
    group = ops[0].group
    ranks, comm = vr.ranks_of(group), vr.comm_of(group)
    me = ranks[comm.rank]
    # a rank's messages to itself (yunchang's ring of one rank passes dK/dV to itself; NCCL does it
    # as a local copy) are a copy on the device, not communication
    to_self = [o for o in ops if o.peer == me]
    sends, recvs = [o for o in to_self if o.is_send], [o for o in to_self if not o.is_send]
    if len(sends) != len(recvs):
        raise ValueError(f"rank {me} posts {len(sends)} sends to itself and {len(recvs)} receives")
    for s, r in zip(sends, recvs):
        r.tensor.copy_(s.tensor)
    others = [P2P("send" if o.is_send else "recv", o.tensor, ranks.index(o.peer)) for o in ops if o.peer != me]
    return _Exchange(comm.exchange(others) if others else _Done())


def batch_isend_irecv(p2p_op_list):
    if _current() is None:
        return _REAL["batch_isend_irecv"](p2p_op_list)
    if not p2p_op_list:
        return []
    batch = _post(p2p_op_list)
    return [_Request(batch) for _ in p2p_op_list]


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    if _current() is None:
        return _REAL["isend"](tensor, dst, group, tag, group_dst=group_dst)
    return _Request(_post([FakeP2POp(isend, tensor, dst, group, tag, group_dst)]))


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    if _current() is None:
        return _REAL["irecv"](tensor, src, group, tag, group_src=group_src)
    return _Request(_post([FakeP2POp(irecv, tensor, src, group, tag, group_src)]))


class _Posted:
    """The handle of a collective called with async_op=True on a recording comm: its first `wait()`
    appends the rank's `Wait` on the collective's event (the event's index in the rank's trace)."""

    def __init__(self, ledger, index: int):
        self._ledger, self._index, self.done = ledger, index, False

    def wait(self, timeout=None) -> bool:
        if not self.done:
            self.done = True
            self._ledger.add(Wait(self._index))
        return True

    def is_completed(self) -> bool:
        return self.done


def _collective_result(async_op: bool, comm: Optional[Comm] = None):
    """What a collective returns: None, or for async_op=True a handle whose wait the trace records
    (the collective is the last event of the rank's trace when this is called)."""
    if not async_op:
        return None
    ledger = getattr(comm, "ledger", None)
    events = getattr(ledger, "events", None)
    if not events or not isinstance(events[-1], CommRecord):
        return _Done()
    return _Posted(ledger, len(events) - 1)


def all_to_all_single(
    output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False, **kwargs
):
    vr = _current()
    if vr is None:
        return _REAL["all_to_all_single"](output, input, output_split_sizes, input_split_sizes, group, async_op)
    if output_split_sizes is not None or input_split_sizes is not None:
        raise NotImplementedError("the fake torch.distributed traces equal-split all_to_all_single only")
    comm = vr.comm_of(group)
    comm.all_to_all(output, input)
    return _collective_result(async_op, comm)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False, **kwargs):
    vr = _current()
    if vr is None:
        return _REAL["all_gather_into_tensor"](output_tensor, input_tensor, group, async_op)
    comm = vr.comm_of(group)
    comm.all_gather(output_tensor, input_tensor)
    return _collective_result(async_op, comm)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    vr = _current()
    if vr is None:
        return _REAL["all_gather"](tensor_list, tensor, group, async_op)
    comm = vr.comm_of(group)
    with _paused(comm):  # the stacking is the fake's, not the library's work
        out = tensor.new_empty((len(tensor_list), *tensor.shape))
        source = tensor.contiguous()
    comm.all_gather(out, source)
    handle = _collective_result(async_op, comm)
    with _paused(comm):
        for dst, part in zip(tensor_list, out):
            dst.copy_(part)
    return handle


def reduce_scatter_tensor(output, input, op=None, group=None, async_op=False):
    vr = _current()
    if vr is None:
        return _REAL["reduce_scatter_tensor"](
            output, input, op if op is not None else dist.ReduceOp.SUM, group, async_op
        )
    _sum_only(op)
    comm = vr.comm_of(group)
    comm.reduce_scatter(output, input)
    return _collective_result(async_op, comm)


def reduce_scatter(output, input_list, op=None, group=None, async_op=False):
    vr = _current()
    if vr is None:
        return _REAL["reduce_scatter"](output, input_list, op if op is not None else dist.ReduceOp.SUM, group, async_op)
    _sum_only(op)
    comm = vr.comm_of(group)
    with _paused(comm):
        stacked = torch.cat([t.reshape(-1) for t in input_list])
    comm.reduce_scatter(output.view(-1), stacked)
    return _collective_result(async_op, comm)


def all_reduce(tensor, op=None, group=None, async_op=False):
    vr = _current()
    if vr is None:
        return _REAL["all_reduce"](tensor, op if op is not None else dist.ReduceOp.SUM, group, async_op)
    _sum_only(op)
    comm = vr.comm_of(group)
    comm.all_reduce(tensor)
    return _collective_result(async_op, comm)


def barrier(group=None, async_op=False, device_ids=None):
    vr = _current()
    if vr is None:
        return _REAL["barrier"](group, async_op, device_ids)
    vr.comm_of(group).barrier()
    return _collective_result(async_op)


def new_group(ranks=None, *args, **kwargs):
    vr = _current()
    if vr is None:
        return _REAL["new_group"](ranks, *args, **kwargs)
    return vr.new_group(ranks)


def get_rank(group=None) -> int:
    vr = _current()
    if vr is None:
        return _REAL["get_rank"](group)
    return vr.comm.rank if group is None else vr.comm_of(group).rank


def get_world_size(group=None) -> int:
    vr = _current()
    if vr is None:
        return _REAL["get_world_size"](group)
    return len(vr.ranks_of(group))


def get_global_rank(group, group_rank: int) -> int:
    vr = _current()
    if vr is None:
        return _REAL["get_global_rank"](group, group_rank)
    ranks = vr.ranks_of(group)
    if not 0 <= group_rank < len(ranks):
        raise ValueError(f"group rank {group_rank} is not in {group}")
    return ranks[group_rank]


def get_group_rank(group, global_rank: int) -> int:
    vr = _current()
    if vr is None:
        return _REAL["get_group_rank"](group, global_rank)
    ranks = vr.ranks_of(group)
    if global_rank not in ranks:
        raise ValueError(f"global rank {global_rank} is not in {group}")
    return ranks.index(global_rank)


def get_process_group_ranks(group) -> list[int]:
    vr = _current()
    if vr is None:
        return _REAL["get_process_group_ranks"](group)
    return list(vr.ranks_of(group))


def is_initialized() -> bool:
    return True if _current() is not None else _REAL["is_initialized"]()


def get_backend(group=None) -> str:
    return "fake" if _current() is not None else _REAL["get_backend"](group)


def _sum_only(op) -> None:
    if op is not None and op != dist.ReduceOp.SUM:
        raise NotImplementedError(f"the fake torch.distributed traces sum reductions only, not {op}")


def _paused(comm):
    pause = getattr(getattr(comm, "ledger", None), "pause", None)
    return pause() if pause is not None else contextlib.nullcontext()


_FAKES: dict[str, Any] = {
    "P2POp": FakeP2POp,
    "batch_isend_irecv": batch_isend_irecv,
    "isend": isend,
    "irecv": irecv,
    "all_to_all_single": all_to_all_single,
    "all_gather_into_tensor": all_gather_into_tensor,
    "all_gather": all_gather,
    "reduce_scatter_tensor": reduce_scatter_tensor,
    "reduce_scatter": reduce_scatter,
    "all_reduce": all_reduce,
    "barrier": barrier,
    "new_group": new_group,
    "get_rank": get_rank,
    "get_world_size": get_world_size,
    "get_global_rank": get_global_rank,
    "get_group_rank": get_group_rank,
    "get_process_group_ranks": get_process_group_ranks,
    "is_initialized": is_initialized,
    "get_backend": get_backend,
}
_REAL: dict[str, Any] = {name: getattr(dist, name) for name in _FAKES}


@contextlib.contextmanager
def installed():
    """Replace torch.distributed's functions by the fakes while the block runs (one trace at a
    time; threads that are not virtual ranks are passed to the real functions)."""
    if not dist.is_available():
        raise RuntimeError("this torch has no torch.distributed: peer libraries cannot be traced")
    with _INSTALL:
        for name, fake in _FAKES.items():
            setattr(dist, name, fake)
        try:
            yield
        finally:
            for name, real in _REAL.items():
                setattr(dist, name, real)
