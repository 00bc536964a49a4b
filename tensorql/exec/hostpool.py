"""The host tier: a pinned pool allocated once, and a spill beyond it.

Chunks written back from a GPU land in :class:`PinnedPool` buffers (one pinned allocation made
at the first use, carved up first-fit; nothing is pinned per transfer), so H2D/D2H copies run
asynchronously at full PCIe speed. When the pool is full, chunks spill to ordinary host memory,
or, with a ``ChunkStore``, to the store (DuckDB) as one-chunk tensors.

>>> pool = PinnedPool(4096, pin=False)
>>> a = pool.alloc(1000); b = pool.alloc(1000)
>>> (a, b, pool.alloc(4096))
(0, 1024, None)
>>> pool.free(a); pool.alloc(512)
0

A process keeps one pinned pool (:func:`shared_pool`): every runtime, hence every query of
every session, copies through it instead of pinning a buffer of its own.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

import tensorql.cuda_api as cuda_api
from tensorql.exec.taskgraph import ChunkRef

_ALIGN = 512


class PinnedPool:
    """First-fit allocator over one (pinned) byte buffer; offsets are aligned to 512 bytes."""

    def __init__(self, capacity: int, pin: bool = True, api: Any = None) -> None:
        self.capacity = int(capacity)
        self.pin = pin
        self.api = api
        self._buffer: torch.Tensor | None = None
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (offset, size), sorted
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()
        self.in_use = 0
        self.peak = 0

    @property
    def buffer(self) -> torch.Tensor:
        if self._buffer is None:  # allocated once, at first use
            with self._lock:
                if self._buffer is None:
                    self._buffer = ((self.api or cuda_api.current()).pinned_empty(self.capacity)
                                    if self.pin
                                    else torch.empty(self.capacity, dtype=torch.uint8))
        return self._buffer

    def alloc(self, nbytes: int) -> int | None:
        size = max(_ALIGN, -(-int(nbytes) // _ALIGN) * _ALIGN)
        with self._lock:
            for n, (off, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        self._free.pop(n)
                    else:
                        self._free[n] = (off + size, free - size)
                    self._used[off] = size
                    self.in_use += size
                    self.peak = max(self.peak, self.in_use)
                    return off
        return None

    def free(self, offset: int) -> None:
        with self._lock:
            size = self._used.pop(offset)
            self.in_use -= size
            self._free.append((offset, size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for off, sz in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + sz)
                else:
                    merged.append((off, sz))
            self._free = merged

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.buffer[offset:offset + nbytes].view(dtype).view(shape)


#: the pinned pool's default size: 2 GiB, at most 1/16 of the machine's memory
DEFAULT_POOL_BYTES = 2 << 30

_pools_lock = threading.Lock()


def default_pool_bytes() -> int:
    """The shared pool's size when none is asked for: 2 GiB, at most 1/16 of physical memory
    (page-locked memory is taken from what the OS can page)."""
    from tensorql.options import physical_memory_bytes

    return max(64 << 20, min(DEFAULT_POOL_BYTES, physical_memory_bytes() // 16))


def shared_pool(capacity: int | None = None, api: Any = None) -> PinnedPool:
    """The process's pinned pool (one per :mod:`tensorql.cuda_api` in force), made at the first
    call and reused by every later one: of ``capacity`` bytes (default
    :func:`default_pool_bytes`). A call asking for more than the pool has gets a larger pool
    in its place while nothing is in the old one, else the pool as it is (chunks beyond it
    go to plain memory).

    >>> class Api:
    ...     def pinned_empty(self, n): return torch.empty(n, dtype=torch.uint8)
    >>> api = Api()
    >>> shared_pool(1 << 20, api) is shared_pool(4096, api), shared_pool(1 << 20, api).capacity
    (True, 1048576)
    """
    api = api if api is not None else cuda_api.current()
    want = int(capacity) if capacity is not None else default_pool_bytes()
    with _pools_lock:
        cache = cuda_api.cache_of(api)
        pool = cache.get("pinned pool")
        if pool is None or (pool.capacity < want and pool.in_use == 0):
            pool = cache["pinned pool"] = PinnedPool(want, pin=True, api=api)
        return pool


class HostTier:
    """Host copies of chunks: pinned pool slots, else plain memory, else a chunk store."""

    def __init__(self, pool: PinnedPool | None = None, store=None, run_tag: str = "run") -> None:
        self.pool = pool
        self.store = store
        self.tag = run_tag
        self._data: dict[ChunkRef, torch.Tensor] = {}
        self._slots: dict[ChunkRef, int] = {}
        self._stored: dict[ChunkRef, str] = {}
        self._lock = threading.Lock()
        self.spilled_bytes = 0
        self.pinned_bytes = 0

    def buffer_for(self, ref: ChunkRef, like: torch.Tensor) -> torch.Tensor | None:
        """A pinned buffer shaped like ``like`` for ``ref``, or None when the pool is full."""
        if self.pool is None:
            return None
        off = self.pool.alloc(like.nbytes)
        if off is None:
            return None
        with self._lock:
            self._slots[ref] = off
        return self.pool.view(off, tuple(like.shape), like.dtype)

    def put(self, ref: ChunkRef, value: torch.Tensor) -> None:
        with self._lock:
            pinned = ref in self._slots
        if pinned:
            self.pinned_bytes += value.nbytes
        else:
            self.spilled_bytes += value.nbytes
            if self.store is not None:
                self._to_store(ref, value)
                return
        with self._lock:
            self._data[ref] = value

    def _to_store(self, ref: ChunkRef, value: torch.Tensor) -> None:
        from tensorql.dtypes import canonical_dtype
        from tensorql.grid import ChunkGrid
        from tensorql.storage.chunk_store import TensorMeta

        name = f"__tq_spill_{self.tag}_{ref.step}_{'_'.join(map(str, ref.key)) or 'x'}"
        shape = tuple(value.shape)
        grid = ChunkGrid(shape, tuple(max(1, n) for n in shape))
        meta = TensorMeta(name=name, shape=shape, dtype=canonical_dtype(value.dtype), grid=grid)
        key = tuple(0 for _ in shape)
        self.store.put_tensor(meta, [(key, value.detach().cpu())], replace=True)
        with self._lock:
            self._stored[ref] = name

    def get(self, ref: ChunkRef) -> torch.Tensor:
        with self._lock:
            value = self._data.get(ref)
            name = self._stored.get(ref)
        if value is not None:
            return value
        if name is None:
            raise KeyError(ref)
        return self.store.read_dense(name)

    def has(self, ref: ChunkRef) -> bool:
        with self._lock:
            return ref in self._data or ref in self._stored

    def drop(self, ref: ChunkRef) -> None:
        with self._lock:
            self._data.pop(ref, None)
            off = self._slots.pop(ref, None)
            name = self._stored.pop(ref, None)
        if off is not None:
            self.pool.free(off)
        if name is not None:
            self.store.drop(name)

    def take_result(self, ref: ChunkRef) -> torch.Tensor:
        """The chunk as an ordinary tensor (copied out of the pinned pool), then dropped."""
        value = self.get(ref)
        with self._lock:
            pinned = ref in self._slots
        if pinned:
            value = value.clone()
        self.drop(ref)
        return value

    def close(self) -> None:
        for ref in list(self._data) + list(self._stored):
            self.drop(ref)
