"""`ThreadComm`: P virtual ranks as threads of one process.

Used for unit tests without spawning processes and, on a single GPU, to check every own method's
numerics with the real GPU kernels (NCCL refuses two ranks on one GPU). Its timings measure
Python threads copying tensors, never hardware communication; rows it produces carry
`executor=threads`.

Semantics match `DistComm`: point-to-point messages between a pair of ranks arrive in the order
they were sent; an exchange's `wait()` returns once its receives have arrived *and* its sends have
been taken by their receivers (as with a real transport, a rank cannot run ahead of a slow peer
and pile up messages); collectives complete only when every rank of the group has called them.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Sequence

import torch

from methods.comm.base import P2P, CommAborted, CommError, DoneWork, check_contiguous, validate_partition

_POLL_S = 0.05


class ThreadWorld:
    """Shared state of one group of virtual ranks (mailboxes, a barrier, collective slots)."""

    def __init__(self, world_size: int, timeout_s: float = 60.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._mailboxes: dict[tuple[int, int], queue.SimpleQueue[tuple[torch.Tensor, threading.Event]]] = {
            (s, d): queue.SimpleQueue() for s in range(world_size) for d in range(world_size)
        }
        self._barrier = threading.Barrier(world_size)
        self._slots: list[Any] = [None] * world_size
        self._lock = threading.Lock()
        self._subworlds: dict[tuple, list["ThreadWorld"]] = {}
        self._aborted = threading.Event()

    def comm(self, rank: int) -> "ThreadComm":
        return ThreadComm(self, rank)

    def abort(self) -> None:
        """Wake every rank blocked in this world (and its sub-worlds) with a CommError."""
        self._aborted.set()
        self._barrier.abort()
        with self._lock:
            subs = [w for ws in self._subworlds.values() for w in ws]
        for w in subs:
            w.abort()

    # -- primitives used by ThreadComm ------------------------------------------------------
    def wait_barrier(self) -> None:
        if self._aborted.is_set():
            raise CommAborted("virtual-rank group aborted (another rank failed)")
        try:
            self._barrier.wait(timeout=self.timeout_s)
        except threading.BrokenBarrierError:
            if self._aborted.is_set():
                raise CommAborted("virtual-rank group aborted (another rank failed)") from None
            self.abort()
            raise CommError(f"collective timed out after {self.timeout_s}s: a rank never arrived") from None

    def put(self, src: int, dst: int, tensor: torch.Tensor) -> threading.Event:
        taken = threading.Event()
        self._mailboxes[(src, dst)].put((tensor, taken))
        return taken

    def get(self, src: int, dst: int) -> tuple[torch.Tensor, threading.Event]:
        """The next message from src to dst, and the event to set once it has been copied."""
        deadline = time.monotonic() + self.timeout_s
        box = self._mailboxes[(src, dst)]
        while True:
            if self._aborted.is_set():
                raise CommAborted("virtual-rank group aborted (another rank failed)")
            try:
                return box.get(timeout=_POLL_S)
            except queue.Empty:
                if time.monotonic() > deadline:
                    self.abort()
                    raise CommError(f"recv from rank {src} on rank {dst} timed out after {self.timeout_s}s") from None

    def wait_taken(self, taken: threading.Event, src: int, dst: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not taken.wait(timeout=_POLL_S):
            if self._aborted.is_set():
                raise CommAborted("virtual-rank group aborted (another rank failed)")
            if time.monotonic() > deadline:
                self.abort()
                raise CommError(f"send from rank {src} to rank {dst} not received after {self.timeout_s}s")

    def collective(self, rank: int, value: Any) -> list[Any]:
        """Publish `value` for this rank and return every rank's value (after all have published).

        The caller must call `finish_collective()` after it has read what it needs, so no rank
        overwrites a slot another rank is still reading.
        """
        self._slots[rank] = value
        self.wait_barrier()
        return list(self._slots)

    def finish_collective(self) -> None:
        self.wait_barrier()

    def subworld(self, partition: tuple[tuple[int, ...], ...], group_index: int) -> "ThreadWorld":
        with self._lock:
            if partition not in self._subworlds:
                self._subworlds[partition] = [ThreadWorld(len(g), self.timeout_s) for g in partition]
            return self._subworlds[partition][group_index]


class _ThreadWork:
    def __init__(self, world: ThreadWorld, rank: int, recvs: list[P2P], sends: list[tuple[int, threading.Event]]):
        self._world, self._rank, self._recvs, self._sends = world, rank, recvs, sends
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        for op in self._recvs:
            incoming, taken = self._world.get(op.peer, self._rank)
            if incoming.shape != op.tensor.shape or incoming.dtype != op.tensor.dtype:
                raise CommError(
                    f"rank {self._rank} expected {tuple(op.tensor.shape)} {op.tensor.dtype} from rank "
                    f"{op.peer}, got {tuple(incoming.shape)} {incoming.dtype} (mismatched send/recv order)"
                )
            op.tensor.copy_(incoming)
            del incoming
            taken.set()
        for peer, taken in self._sends:
            self._world.wait_taken(taken, self._rank, peer)
        self._recvs, self._sends = [], []
        self._done = True


class ThreadComm:
    """One virtual rank's view of a `ThreadWorld`; implements the `Comm` protocol."""

    def __init__(self, world: ThreadWorld, rank: int):
        if not 0 <= rank < world.world_size:
            raise ValueError(f"rank {rank} outside 0..{world.world_size - 1}")
        self._world = world
        self._rank = rank
        self._splits: dict[tuple, ThreadComm] = {}

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world.world_size

    def exchange(self, ops: Sequence[P2P]) -> _ThreadWork | DoneWork:
        recvs, sends = [], []
        check_contiguous(*(op.tensor for op in ops))  # the same rule as DistComm, so tests here catch it
        for op in ops:
            if not 0 <= op.peer < self.world_size or op.peer == self._rank:
                raise CommError(f"rank {self._rank}: invalid peer {op.peer} in a world of {self.world_size}")
            if op.op == "send":
                sends.append((op.peer, self._world.put(self._rank, op.peer, op.tensor.detach().clone())))
            else:
                recvs.append(op)
        return _ThreadWork(self._world, self._rank, recvs, sends) if ops else DoneWork()

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        check_contiguous(output, input)
        if output.device.type != "meta" and output.data_ptr() == input.data_ptr():  # meta: no storage to share
            raise ValueError("all_to_all needs distinct input and output buffers")
        inputs = self._world.collective(self._rank, input)
        p = self.world_size
        for src, out_chunk in enumerate(output.chunk(p, dim=0)):
            out_chunk.copy_(inputs[src].chunk(p, dim=0)[self._rank])
        self._world.finish_collective()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        check_contiguous(output, input)
        inputs = self._world.collective(self._rank, input)
        for src, out_chunk in enumerate(output.chunk(self.world_size, dim=0)):
            out_chunk.copy_(inputs[src])
        self._world.finish_collective()

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        check_contiguous(output, input)
        inputs = self._world.collective(self._rank, input)
        p = self.world_size
        total = inputs[0].chunk(p, dim=0)[self._rank].clone()
        for t in inputs[1:]:  # fixed rank order, as all_reduce
            total += t.chunk(p, dim=0)[self._rank]
        self._world.finish_collective()
        output.copy_(total)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        check_contiguous(tensor)
        inputs = self._world.collective(self._rank, tensor.clone())
        total = inputs[0].clone()
        for t in inputs[1:]:  # fixed rank order: every rank gets identical bits
            total += t
        self._world.finish_collective()
        tensor.copy_(total)

    def barrier(self) -> None:
        self._world.wait_barrier()

    def split(self, groups: Sequence[Sequence[int]]) -> "ThreadComm":
        partition = validate_partition(groups, self.world_size)
        if partition not in self._splits:
            index = next(i for i, g in enumerate(partition) if self._rank in g)
            sub = self._world.subworld(partition, index)
            self._splits[partition] = ThreadComm(sub, partition[index].index(self._rank))
        return self._splits[partition]


def run_threads(world_size: int, fn: Callable[[ThreadComm], Any], *, timeout_s: float = 120.0) -> list[Any]:
    """Run `fn(comm)` on `world_size` virtual ranks; return the per-rank results in rank order.

    If any rank raises, the group is aborted (so no rank hangs) and the first real error is
    re-raised (a rank's own failure before communication errors, and those before the CommAborted
    of ranks that were only woken by the abort).
    """
    world = ThreadWorld(world_size, timeout_s)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def target(rank: int) -> None:
        try:
            results[rank] = fn(world.comm(rank))
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            errors[rank] = exc
            world.abort()

    threads = [threading.Thread(target=target, args=(r,), name=f"vrank{r}", daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s + 5
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        world.abort()
        raise CommError(f"virtual ranks still running after {timeout_s}s (hang)")
    found = [e for e in errors if e is not None]
    if found:
        raise min(found, key=lambda e: 2 if isinstance(e, CommAborted) else 1 if isinstance(e, CommError) else 0)
    return results
