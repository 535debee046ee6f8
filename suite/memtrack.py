"""Peak tensor memory of a region, on any device (docs/DESIGN.md section 7: memory on CPU).

CUDA has an allocator with peak statistics; the CPU does not. `TensorMemoryTracker` is a
TorchDispatchMode that sees every op in its thread, counts the bytes of each *new* storage an op
returns (views and in-place results share an input's storage and are not new), and drops a
storage's bytes when it is freed. `peak_bytes` is the most memory the region's own tensors held at
once, beyond what was alive before it. Kernel-internal workspaces that never become tensors are
not seen. It costs a Python call per op, so trials run it in an untimed iteration.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorMemoryTracker(TorchDispatchMode):
    """with TensorMemoryTracker() as t: ...; t.peak_bytes"""

    def __init__(self):
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage data_ptr -> (weak ref, bytes)
        self.current_bytes = 0
        self.peak_bytes = 0

    def _prune(self) -> None:
        for ptr, (ref, nbytes) in list(self._live.items()):
            if ref.expired():
                del self._live[ptr]
                self.current_bytes -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        self._prune()
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in inputs or ptr in self._live or storage.nbytes() == 0:
                continue  # a view, an in-place result, or already counted
            self._live[ptr] = (StorageWeakRef(storage), storage.nbytes())
            self.current_bytes += storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return out
