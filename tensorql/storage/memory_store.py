"""An in-process ``ChunkStore``: chunks as torch tensors in a dict (tests, temporaries).

>>> import numpy as np
>>> from tensorql.grid import ChunkGrid
>>> store = MemoryChunkStore()
>>> meta = TensorMeta("v", (3,), "float32", ChunkGrid((3,), (2,)))
>>> store.put_tensor(meta, [((0,), np.ones(2)), ((1,), np.ones(1))])
>>> store.read_dense("v").tolist()
[1.0, 1.0, 1.0]
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np
import torch

from tensorql.errors import StorageError, UnknownTensorError
from tensorql.grid import Key
from tensorql.storage.chunk_store import (
    ChunkStore,
    StoredVersion,
    TensorMeta,
    as_chunk_tensor,
    check_chunk,
)


class MemoryChunkStore(ChunkStore):
    """Chunks held in memory; a put is atomic (built aside, then swapped in). A version is
    a tensor's chunk dict, never changed once swapped in: a pinned one is simply kept.

    >>> from tensorql.grid import ChunkGrid
    >>> store = MemoryChunkStore()
    >>> meta = TensorMeta("v", (2,), "float32", ChunkGrid((2,), (2,)))
    >>> store.put_tensor(meta, [((0,), np.zeros(2))])
    >>> pinned = store.pin(["v"])
    >>> store.put_tensor(meta, [((0,), np.ones(2))], replace=True)
    >>> store.read_chunk_at(pinned["v"], (0,)).tolist(), store.read_chunk("v", (0,)).tolist()
    ([0.0, 0.0], [1.0, 1.0])
    """

    def __init__(self) -> None:
        self._metas: dict[str, TensorMeta] = {}
        self._chunks: dict[str, dict[Key, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def put_tensor(
        self,
        meta: TensorMeta,
        chunks: Iterable[tuple[Key, np.ndarray | torch.Tensor]],
        *,
        replace: bool = False,
    ) -> None:
        self.put_tensors([(meta, chunks)], replace=replace)

    def put_tensors(self, items, *, replace: bool = False) -> None:
        """Several tensors at once: all staged aside, then swapped in under one lock."""
        staged_all = []
        for meta, chunks in items:
            if not replace and meta.name in self._metas:
                raise StorageError(f"tensor {meta.name!r} already exists")
            staged: dict[Key, torch.Tensor] = {}
            for key, data in chunks:
                tensor = as_chunk_tensor(data, meta.dtype)
                key = meta.grid.check_key(key)
                check_chunk(meta, key, tensor)
                if key in staged:
                    raise StorageError(f"tensor {meta.name!r}: chunk {key} given twice")
                staged[key] = tensor
            if len(staged) != meta.grid.num_chunks:
                raise StorageError(f"tensor {meta.name!r}: got {len(staged)} chunks, grid has "
                                   f"{meta.grid.num_chunks}")
            staged_all.append((meta, staged))
        names = [meta.name for meta, _ in staged_all]
        if len(set(names)) != len(names):
            raise StorageError(f"tensor names given twice in one write: {names}")
        with self._lock:
            for meta, _ in staged_all:
                if not replace and meta.name in self._metas:
                    raise StorageError(f"tensor {meta.name!r} already exists")
            for meta, staged in staged_all:
                self._metas[meta.name] = meta
                self._chunks[meta.name] = staged

    def meta(self, name: str) -> TensorMeta:
        try:
            return self._metas[name]
        except (KeyError, TypeError):  # TypeError: a list or dict as a name, never stored
            raise UnknownTensorError(name, list(self._metas)) from None

    def read_chunk(self, name: str, key: Key) -> torch.Tensor:
        self.meta(name)
        return self._chunks[name][tuple(key)]

    def pin(self, names) -> dict[str, StoredVersion]:
        with self._lock:
            return {name: StoredVersion(self.meta(name), self._chunks[name]) for name in names}

    def read_chunk_at(self, version: StoredVersion, key: Key) -> torch.Tensor:
        return version.handle[version.meta.grid.check_key(key)]

    def names(self) -> list[str]:
        return sorted(self._metas)

    def drop(self, name: str) -> None:
        with self._lock:
            self.meta(name)
            del self._metas[name]
            del self._chunks[name]
