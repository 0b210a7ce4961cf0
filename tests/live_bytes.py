"""Live tensor bytes on the CPU, as torch.cuda.memory_allocated counts them on a GPU, and their peak.

torch's MemTracker does the same through module hooks, which fail inside an autograd Function's forward (the tiled
MLP's); this one only watches ops: every op's output storages are counted from the op until they are freed (a weakref
finalizer on the storage, whose Python object torch keeps alive as long as the storage itself).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """`with LiveBytes() as live:` counts what the ops inside allocate; `live.track(...)` adds tensors made before
    (weights, optimizer state, the batch). `live.now` and `live.peak` in bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.now = self.peak = 0

    def track(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            key = storage._cdata  # the StorageImpl: the same for every view of it
            if key in self.sizes or storage.nbytes() == 0:
                continue
            self.sizes[key] = storage.nbytes()
            self.now += storage.nbytes()
            weakref.finalize(storage, self._freed, key)
        self.peak = max(self.peak, self.now)

    def _freed(self, key: int) -> None:
        self.now -= self.sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(*(t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.device.type == "cpu"))
        return out
