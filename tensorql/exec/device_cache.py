"""Stored chunks kept in a GPU's memory across queries (``Options.device_cache``).

A query reading stored weights copies each chunk host → pinned pool → GPU; the next query
reading the same weights copied them again (a LLaMA layer's 826 MB on every prompt, where
transformers keeps its weights on the GPU). A :class:`DeviceCache` per device and process
keeps the device copy a load made, under a byte budget, least recently used first out, so a
later run's load of the same chunk completes on the runtime's coordinator with no copy.

What identifies a chunk's bytes is the store, the tensor's name, the chunk (or region) and
the *version* the run pinned (:class:`~tensorql.storage.chunk_store.StoredVersion`: the
DuckDB store's chunk table, which a replace never reuses; the memory store's chunk dict). A
``store()`` of new values is a new version: the next load finds the entry of the old one,
drops it and copies the new chunk. A device copy written in place since it was kept (its
torch version counter moved) is dropped too. A store that keeps no versions is not cached.

>>> cache = DeviceCache()
>>> cache.resize(64)
>>> class Store: pass
>>> store, t = Store(), torch.zeros(4)          # 16 bytes
>>> cache.put((store, ("w", (0,)), "v1"), t)
>>> cache.get((store, ("w", (0,)), "v1")) is t
True
>>> cache.get((store, ("w", (0,)), "v2")) is None  # stored again: the old copy is dropped
True
>>> len(cache), cache.nbytes
(0, 0)
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

#: a chunk's identity across runs: (its store, what in it, the pinned version's handle)
CacheKey = tuple[Any, Any, Any]


@dataclass
class _Entry:
    store: weakref.ref
    handle: Any  # the version's handle, held: an id in it cannot be reused meanwhile
    tensor: torch.Tensor
    version: int  # the tensor's version counter when it was kept
    nbytes: int


def _same_version(a: Any, b: Any) -> bool:
    return a is b or (isinstance(a, (str, int)) and a == b)


class DeviceCache:
    """Device copies of stored chunks, at most ``capacity`` bytes, LRU (see module)."""

    def __init__(self) -> None:
        self.capacity = 0
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0
        self._entries: OrderedDict[tuple[int, Any], _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def resize(self, capacity: int) -> None:
        """Keep at most ``capacity`` bytes from now on (the least recently used go first)."""
        with self._lock:
            self.capacity = max(0, int(capacity))
            self._shrink(self.capacity)

    def get(self, key: CacheKey) -> torch.Tensor | None:
        """The device copy of ``key``'s chunk, if kept and still of that version."""
        store, what, handle = key
        slot = (id(store), what)
        with self._lock:
            entry = self._entries.get(slot)
            if entry is None:
                self.misses += 1
                return None
            if entry.store() is not store or not _same_version(entry.handle, handle) \
                    or entry.tensor._version != entry.version:
                self._drop(slot)
                self.misses += 1
                return None
            self._entries.move_to_end(slot)
            self.hits += 1
            return entry.tensor

    def put(self, key: CacheKey, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` (a load's device copy of ``key``'s chunk) if it fits."""
        store, what, handle = key
        nbytes = tensor.untyped_storage().nbytes()
        slot = (id(store), what)
        with self._lock:
            if slot in self._entries:
                self._drop(slot)
            if nbytes > self.capacity:
                return
            self._shrink(self.capacity - nbytes)
            self._entries[slot] = _Entry(weakref.ref(store), handle, tensor, tensor._version,
                                         nbytes)
            self.nbytes += nbytes

    def clear(self) -> None:
        with self._lock:
            self._shrink(0)

    def _shrink(self, limit: int) -> None:
        while self._entries and self.nbytes > limit:
            self._drop(next(iter(self._entries)))
            self.evictions += 1

    def _drop(self, slot: tuple[int, Any]) -> None:
        self.nbytes -= self._entries.pop(slot).nbytes


__all__ = ["CacheKey", "DeviceCache"]
