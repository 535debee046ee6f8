"""`DistComm`: the `Comm` protocol over torch.distributed (gloo on CPU, NCCL on CUDA).

The process group is passed in explicitly (no module globals). Sub-groups made by `split` are
created once per partition and cached on the comm, because `new_group` is collective over the
whole default group and creating communicators is expensive (NCCL).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from methods.comm.base import P2P, DoneWork, check_contiguous, validate_partition

# torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single (FutureWarning).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _DistWork:
    def __init__(self, works: list):
        self._works = works

    def wait(self) -> None:
        # Wait on every request: waiting on only one of a batch can hang gloo.
        for w in self._works:
            w.wait()
        self._works = []


class DistComm:
    """A `Comm` over `group` (default: the whole default process group).

    Every rank of the *default* group must create its DistComm objects and call `split` in the
    same order (torch.distributed.new_group is collective over all processes).
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_initialized():
            raise RuntimeError("DistComm needs torch.distributed.init_process_group() first")
        self.group = group if group is not None else dist.group.WORLD
        self._rank = dist.get_rank(self.group)
        self._world_size = dist.get_world_size(self.group)
        self._global_ranks = (
            [dist.get_global_rank(group, r) for r in range(self._world_size)]
            if group is not None
            else list(range(self._world_size))
        )
        self._splits: dict[tuple, DistComm] = {}

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def exchange(self, ops: Sequence[P2P]) -> _DistWork | DoneWork:
        if not ops:
            return DoneWork()
        p2p = []
        for op in ops:
            if op.peer == self._rank:
                raise ValueError(f"rank {self._rank}: send/recv to self is not allowed (gloo cannot do it)")
            check_contiguous(op.tensor)
            fn = dist.isend if op.op == "send" else dist.irecv
            p2p.append(dist.P2POp(fn, op.tensor, self._global_ranks[op.peer], group=self.group))
        return _DistWork(dist.batch_isend_irecv(p2p))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        check_contiguous(output, input)
        dist.all_to_all_single(output, input, group=self.group)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        check_contiguous(output, input)
        _all_gather_single(output, input, group=self.group)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        check_contiguous(output, input)
        _reduce_scatter_single(output, input, group=self.group)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        check_contiguous(tensor)
        dist.all_reduce(tensor, group=self.group)

    def barrier(self) -> None:
        # A barrier by a tiny all_reduce: works on gloo and NCCL without device guessing.
        flag = torch.zeros(1, device=_comm_device(self.group))
        dist.all_reduce(flag, group=self.group)

    def split(self, groups: Sequence[Sequence[int]]) -> "DistComm":
        partition = validate_partition(groups, self._world_size)
        if partition not in self._splits:
            mine = None
            # new_group is collective over the default group: create every group, in order.
            for g in partition:
                pg = dist.new_group([self._global_ranks[r] for r in g])
                if self._rank in g:
                    mine = pg
            self._splits[partition] = DistComm(mine)
        return self._splits[partition]


def _comm_device(group) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
