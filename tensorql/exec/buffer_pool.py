"""Chunk buffers kept for reuse between tasks and between runs of the same query.

A chunk that dies (its last reader has run) frees memory that the next task producing a chunk
of the same size could write into. Handed back to the C allocator instead, a chunk-sized
buffer is often returned to the kernel (glibc unmaps a worker thread's arena heap once it is
empty, whatever the trim threshold) and the next chunk pays a page fault and the zeroing of
every page. Where torch's threads made arenas of their own before tensorql tuned the
allocator (see :mod:`tensorql.exec.host_malloc`), an MLP training step on a 2-core machine
faulted ~9,700 pages (38 MiB) a step and took 81 ms; computing into pooled buffers, 4,500
faults and 70 ms. The executor gives dead chunks to a ``BufferPool`` and computes a kernel's
output into a pooled buffer of the right size when the kernel can write into a given tensor
(``run_into``), as PyTorch's caching allocator does on CUDA.

A dead chunk's storage is only taken into the pool when nothing else can reach it: torch
allocated it (it is resizable: memory borrowed from numpy, Arrow or a memory map is not) and
no other tensor or Python reference uses it (a view counts, with the base it holds when
nothing else holds that base). A buffer is handed out for a chunk of exactly its size, as a
new tensor on the storage. The pool holds at most ``max_bytes`` (``Options.buffer_pool_bytes``,
per session; closing the session frees it).

>>> pool = BufferPool(max_bytes=1 << 20)
>>> values = {"dead": torch.ones(4, 4), "borrowed": torch.from_numpy(np.ones(16, np.float32))}
>>> pool.reclaim(values, "dead"), pool.held_bytes
(64, 64)
>>> buf = pool.take((2, 8), torch.float32)  # any shape of the same size and dtype
>>> tuple(buf.shape), pool.take((2, 8), torch.float32) is None
((2, 8), True)
>>> pool.reclaim(values, "borrowed"), pool.held_bytes  # memory numpy owns: never reused
(64, 0)
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

import numpy as np  # noqa: F401 - used by the doctest
import torch

# References to a tensor ``reclaim`` has popped when nothing else holds it: its local
# variable and ``getrefcount``'s argument.
_FREE_REFCOUNT = 2


@dataclass
class PoolStats:
    """What the pool did: buffers reused (``hits``), asked for and not held (``misses``),
    taken in and turned away (full, or reachable from elsewhere)."""

    hits: int = 0
    misses: int = 0
    kept: int = 0
    refused: int = 0


class BufferPool:
    """Storages of dead chunks by size, for outputs of the same size."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self.held_bytes = 0
        self.stats = PoolStats()
        self._free: dict[int, list[torch.UntypedStorage]] = {}
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A new contiguous tensor of ``shape`` on a pooled storage of exactly its size (its
        contents are garbage), or None."""
        numel = 1
        for n in shape:
            numel *= int(n)
        nbytes = numel * dtype.itemsize
        with self._lock:
            free = self._free.get(nbytes)
            if not free:
                self.stats.misses += 1
                return None
            storage = free.pop()
            self.held_bytes -= nbytes
            self.stats.hits += 1
        return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))

    def restore(self, buffer: torch.Tensor) -> None:
        """Put back a buffer :meth:`take` handed out that was not used (its kernel
        returned a tensor of its own)."""
        storage = buffer.untyped_storage()
        with self._lock:
            self._free.setdefault(storage.nbytes(), []).append(storage)
            self.held_bytes += storage.nbytes()
            self.stats.hits -= 1

    def reclaim(self, values: dict, key: object) -> int:
        """Remove ``values[key]`` (a dead chunk) and keep its storage for reuse when nothing
        else can reach it and the pool has room; the chunk's bytes."""
        tensor = values.pop(key)
        nbytes = tensor.nbytes
        storage = _sole_storage(tensor) if sys.getrefcount(tensor) <= _FREE_REFCOUNT else None
        del tensor
        if storage is None:
            self.stats.refused += 1
            return nbytes
        size = storage.nbytes()
        with self._lock:
            if size == 0 or self.held_bytes + size > self.max_bytes:
                self.stats.refused += 1
                return nbytes
            self._free.setdefault(size, []).append(storage)
            self.held_bytes += size
            self.stats.kept += 1
        return nbytes

    def clear(self) -> None:
        """Hand every pooled storage back to the allocator."""
        with self._lock:
            self._free.clear()
            self.held_bytes = 0


def _sole_storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """``tensor``'s storage when torch allocated it and only ``tensor`` (with the base it is
    a view of, when nothing else holds that base) uses it; else None."""
    if tensor.device.type != "cpu" or tensor.requires_grad or tensor.layout != torch.strided:
        return None
    holders = 1
    base = tensor._base
    if base is not None:
        # held by the view and by ``base`` here (and getrefcount's argument): nothing else
        if base._base is not None or sys.getrefcount(base) > 3:
            return None
        holders = 2
    del base
    storage = tensor.untyped_storage()
    if not storage.resizable():  # memory numpy, Arrow or a memory map lends torch
        return None
    # the TensorImpls above and the Python storage object ``storage``
    if torch._C._storage_Use_Count(storage._cdata) != holders + 1:
        return None
    return storage


__all__ = ["BufferPool", "PoolStats"]
