"""The ``ChunkStore`` interface: tensors at rest as relations ``key -> chunk``.

Every store (in-memory, DuckDB) implements it; the executor pulls only the chunks a task
needs, when it needs them.

>>> from tensorql.grid import ChunkGrid
>>> meta = TensorMeta(name="A", shape=(4, 4), dtype="float32", grid=ChunkGrid((4, 4), (2, 4)))
>>> meta.nbytes
64
"""

from __future__ import annotations

import abc
import contextlib
import itertools
import math
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tensorql.dtypes import canonical_dtype, itemsize
from tensorql.errors import ShapeError, StaleTensorError, StorageError
from tensorql.grid import ChunkGrid, Key

ChunkData = "np.ndarray | torch.Tensor"


@dataclass(frozen=True)
class TensorMeta:
    """Catalog entry of a stored tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    grid: ChunkGrid

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if tuple(self.shape) != self.grid.shape:
            raise ShapeError(f"tensor {self.name!r}: shape {self.shape} != grid {self.grid.shape}")
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True, eq=False)
class StoredVersion:
    """One version of a stored tensor, as :meth:`ChunkStore.pin` resolved it: its catalog
    entry and the store's handle on that version's chunks (``handle``: the DuckDB store's
    chunk table, the memory store's chunk dict; None where a store keeps no versions and
    reads go by name). A replace makes a new version; a pinned one stays readable through
    :meth:`ChunkStore.read_chunk_at` until it is unpinned."""

    meta: TensorMeta
    handle: Any = None

    @property
    def name(self) -> str:
        return self.meta.name


class ChunkStore(abc.ABC):
    """Where tensors rest. Writes are atomic per tensor: all chunks or none."""

    @abc.abstractmethod
    def put_tensor(
        self,
        meta: TensorMeta,
        chunks: Iterable[tuple[Key, np.ndarray | torch.Tensor]],
        *,
        replace: bool = False,
    ) -> None:
        """Store every chunk of ``meta`` in one transaction.

        ``chunks`` yields ``(key, data)`` covering the grid exactly once each; it may be a
        generator so large tensors stream through. Raises StorageError if the name exists and
        ``replace`` is False; on any error nothing stored changes.
        """

    def put_tensors(self, items: Sequence[tuple[TensorMeta, Iterable[tuple[Key, Any]]]], *,
                    replace: bool = False) -> None:
        """Store several tensors in one commit (all or none; e.g. a training checkpoint)."""
        raise StorageError(f"{type(self).__name__} cannot store several tensors atomically")

    @abc.abstractmethod
    def meta(self, name: str) -> TensorMeta:
        """The catalog entry of ``name``; UnknownTensorError if absent."""

    @abc.abstractmethod
    def read_chunk(self, name: str, key: Key) -> torch.Tensor:
        """One chunk as a CPU torch tensor of the stored dtype and chunk shape."""

    def read_chunks(self, name: str, keys: Iterable[Key]) -> Iterator[tuple[Key, torch.Tensor]]:
        """Several chunks; stores override this to batch the reads."""
        for key in keys:
            yield key, self.read_chunk(name, key)

    # -- versions: what a run reads ------------------------------------------------------
    def pin(self, names: Iterable[str]) -> dict[str, StoredVersion]:
        """The current version of each of ``names``, resolved at once (one catalog read where
        the store has a catalog, so a multi-tensor commit is seen whole or not at all) and
        kept readable through :meth:`read_chunk_at` until :meth:`unpin`, whatever is stored
        under those names meanwhile. UnknownTensorError for a name not stored. A run pins
        the tensors it reads when it starts, so every chunk it loads is of one version.

        The default keeps no versions: its reads go by name (a store that replaces tensors
        while reading them overrides this)."""
        return {name: StoredVersion(self.meta(name)) for name in names}

    def unpin(self, versions: Iterable[StoredVersion]) -> None:  # noqa: B027 - optional
        """Release versions :meth:`pin` returned (each once): a replaced version's chunks
        may go once no pin holds them."""

    def read_chunk_at(self, version: StoredVersion, key: Key) -> torch.Tensor:
        """Chunk ``key`` of a pinned ``version`` (as :meth:`read_chunk`)."""
        return self.read_chunk(version.name, key)

    def read_region(self, name: str, lo: Sequence[int], hi: Sequence[int]) -> torch.Tensor:
        """The region ``[lo, hi)`` of ``name``: the one chunk it is, or assembled from the
        chunks it overlaps, all of one version (pinned while they are read). Stores with a
        chunk cache keep assembled regions there too, so a partitioned plan's pieces are cut
        once, not every run. Do not modify the result.

        >>> from tensorql.storage.memory_store import MemoryChunkStore
        >>> from tensorql.grid import ChunkGrid
        >>> store = MemoryChunkStore()
        >>> grid = ChunkGrid((4, 4), (2, 2))
        >>> meta = TensorMeta("t", (4, 4), "float32", grid)
        >>> store.put_tensor(meta, ((k, torch.arange(16.0).reshape(4, 4)[grid.slices(k)])
        ...                         for k in grid.keys()))
        >>> store.read_region("t", (1, 1), (3, 4)).tolist()
        [[5.0, 6.0, 7.0], [9.0, 10.0, 11.0]]
        """
        versions = self.pin([name])
        try:
            return self.read_region_at(versions[name], lo, hi)
        finally:
            self.unpin(versions.values())

    def read_region_at(self, version: StoredVersion, lo: Sequence[int],
                       hi: Sequence[int]) -> torch.Tensor:
        """The region ``[lo, hi)`` of a pinned ``version`` (as :meth:`read_region`)."""
        grid = version.meta.grid
        lo, hi = tuple(int(a) for a in lo), tuple(int(b) for b in hi)
        keys = region_keys(grid, lo, hi)
        if len(keys) == 1 and grid.slices(keys[0]) == tuple(
                slice(a, b) for a, b in zip(lo, hi)):
            return self.read_chunk_at(version, keys[0])  # the region is one stored chunk
        out = None
        for key in keys:
            chunk = self.read_chunk_at(version, key)
            if out is None:
                out = torch.empty(tuple(b - a for a, b in zip(lo, hi)), dtype=chunk.dtype)
            src, dst = region_slices(grid, key, lo, hi)
            out[dst] = chunk[src]
        return out

    @abc.abstractmethod
    def names(self) -> list[str]:
        """Names of the stored tensors, sorted."""

    @abc.abstractmethod
    def drop(self, name: str) -> None:
        """Remove ``name``; UnknownTensorError if absent."""

    def has(self, name: str) -> bool:
        return name in self.names()

    def read_dense(self, name: str) -> torch.Tensor:
        """The whole tensor, assembled from its chunks."""
        meta = self.meta(name)
        from tensorql.dtypes import torch_dtype

        out = torch.empty(meta.shape, dtype=torch_dtype(meta.dtype))
        for key, chunk in self.read_chunks(name, meta.grid.keys()):
            out[meta.grid.slices(key)] = chunk
        return out

    def sync_views(self) -> None:  # noqa: B027 - optional hook
        """Bring any SQL views of the stored tensors up to date with the catalog (which another
        process may have changed); stores without SQL views have nothing to do."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; the default store holds none."""


class PlanReads:
    """The stored tensors one plan's load tasks read, through ``store``: while a run of the
    plan is under way (:meth:`run`) every chunk or region is read from the version of its
    tensor pinned when the run began, so a tensor replaced meanwhile is read whole in the old
    version (the next run reads the new one); outside a run reads go by name.

    Runs of one plan that overlap (the same compiled query run from two threads at once)
    share the versions the first of them pinned until the last one ends.

    >>> from tensorql.storage.memory_store import MemoryChunkStore
    >>> from tensorql.grid import ChunkGrid
    >>> store = MemoryChunkStore()
    >>> meta = TensorMeta("t", (2,), "float32", ChunkGrid((2,), (1,)))
    >>> store.put_tensor(meta, [((0,), np.zeros(1)), ((1,), np.zeros(1))])
    >>> reads = PlanReads(store)
    >>> with reads.run(["t"]):
    ...     first = reads.read_chunk("t", (0,)).item()
    ...     store.put_tensor(meta, [((0,), np.ones(1)), ((1,), np.ones(1))], replace=True)
    ...     second = reads.read_chunk("t", (1,)).item()
    >>> first, second, reads.read_chunk("t", (1,)).item()
    (0.0, 0.0, 1.0)
    """

    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._pinned: dict[str, StoredVersion] = {}
        self._runs = 0

    @contextlib.contextmanager
    def run(self, names: Iterable[str]) -> Iterator[None]:
        """Pin the current versions of ``names`` (the tensors the plan reads) for a run."""
        with self._lock:
            if self._runs == 0:
                self._pinned = self.store.pin(names)
            self._runs += 1
        try:
            yield
        finally:
            with self._lock:
                self._runs -= 1
                if self._runs == 0:
                    pinned, self._pinned = self._pinned, {}
                    self.store.unpin(pinned.values())

    def read_chunk(self, name: str, key: Key) -> torch.Tensor:
        """Chunk ``key`` of ``name`` (of the version pinned for the run under way); a key
        off the stored grid is a StaleTensorError: the tensor was stored again with another
        shape or tiling after the plan was made (the plan's keys are its old grid's)."""
        version = self._pinned.get(name)
        try:
            if version is None:
                return self.store.read_chunk(name, key)
            return self.store.read_chunk_at(version, key)
        except ShapeError as err:
            raise StaleTensorError(
                f"stored tensor {name!r} changed since this query was planned: its chunk "
                f"{tuple(key)} cannot be read ({err}); build the expression again, e.g. from "
                f"db.tensor({name!r})") from err

    def version_of(self, name: str) -> StoredVersion | None:
        """The version of ``name`` the run under way pinned (None outside a run)."""
        return self._pinned.get(name)

    def read_region(self, name: str, lo: Sequence[int], hi: Sequence[int]) -> torch.Tensor:
        version = self._pinned.get(name)
        if version is None:
            return self.store.read_region(name, lo, hi)
        return self.store.read_region_at(version, lo, hi)


def as_chunk_tensor(data: np.ndarray | torch.Tensor, dtype: str) -> torch.Tensor:
    """A CPU torch tensor of ``dtype`` from chunk data, sharing memory where it can."""
    from tensorql.dtypes import torch_dtype

    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            data = data.copy(order="C")
        if dtype == "bfloat16" and data.dtype == np.uint16:
            return torch.from_numpy(data).view(torch.bfloat16)
        data = torch.from_numpy(data)
    return data.to(dtype=torch_dtype(dtype), device="cpu")


def check_chunk(meta: TensorMeta, key: Key, data: torch.Tensor) -> None:
    """ShapeError unless ``data`` has the shape chunk ``key`` of ``meta`` must have."""
    expected = meta.grid.chunk_shape(meta.grid.check_key(key))
    if tuple(data.shape) != expected:
        raise ShapeError(
            f"tensor {meta.name!r}: chunk {key} has shape {tuple(data.shape)}, expected {expected}"
        )


def region_keys(grid: ChunkGrid, lo: Sequence[int], hi: Sequence[int]) -> list[Key]:
    """The keys of ``grid``'s chunks the region ``[lo, hi)`` overlaps.

    >>> from tensorql.grid import ChunkGrid
    >>> region_keys(ChunkGrid((4, 4), (2, 2)), (1, 0), (3, 2))
    [(0, 0), (1, 0)]

    ShapeError when the region is not one of the grid's (another number of dimensions, or
    off its bounds): a plan's region of a tensor stored again with another shape.

    >>> region_keys(ChunkGrid((4,), (2,)), (0, 0), (2, 2))
    Traceback (most recent call last):
    ...
    tensorql.errors.ShapeError: region (0, 0)..(2, 2) is not inside a tensor of shape (4,)
    """
    if len(lo) != len(grid.shape) or len(hi) != len(grid.shape) or not all(
            0 <= a <= b <= n for a, b, n in zip(lo, hi, grid.shape)):
        raise ShapeError(f"region {tuple(lo)}..{tuple(hi)} is not inside a tensor of shape "
                         f"{grid.shape}")
    spans = [range(a // t, (b - 1) // t + 1) for a, b, t in zip(lo, hi, grid.tile)]
    return list(itertools.product(*spans))


def region_slices(grid: ChunkGrid, key: Key, lo: Sequence[int], hi: Sequence[int]
                  ) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    """(the slices of chunk ``key`` inside the region ``[lo, hi)``, where they go in the
    region).

    >>> from tensorql.grid import ChunkGrid
    >>> region_slices(ChunkGrid((4, 4), (2, 2)), (1, 0), (1, 0), (3, 2))
    ((slice(0, 1, None), slice(0, 2, None)), (slice(1, 2, None), slice(0, 2, None)))
    """
    src, dst = [], []
    for d, b in enumerate(key):
        blo, bhi = grid.dim_extent(d, b)
        start, end = max(lo[d], blo), min(hi[d], bhi)
        src.append(slice(start - blo, end - blo))
        dst.append(slice(start - lo[d], end - lo[d]))
    return tuple(src), tuple(dst)
