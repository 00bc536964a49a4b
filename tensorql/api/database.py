"""``tq.connect``: a session over a chunk store, the entry point of the Python API.

>>> import numpy as np, tensorql as tq
>>> with tq.connect() as db:
...     a = db.from_numpy("A", np.eye(3, dtype=np.float32), tile=(2, 2))
...     _ = db.store("B", a @ a)
...     db.tensors(), float(db.tensor("B").numpy().trace())
(['A', 'B'], 3.0)
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tensorql.api.tensor import Tensor
from tensorql.dtypes import canonical_dtype
from tensorql.einsum.graph import Node, Source
from tensorql.einsum.literals import constant_node, literal_array
from tensorql.errors import (
    OptionError,
    ProgressCallbackError,
    ShapeError,
    StorageError,
    UnsupportedError,
    as_flag,
)
from tensorql.exec.progress import ProgressCallback, progress_bar
from tensorql.grid import ChunkGrid, Key, auto_tile
from tensorql.optimizer.search import get_strategy
from tensorql.options import Options
from tensorql.pipeline import CompiledQuery, get_backend
from tensorql.pipeline.query_cache import QueryCache
from tensorql.storage.chunk_store import ChunkStore, TensorMeta
from tensorql.storage.mapped import MappedPageReleaser
from tensorql.storage.sql_text import check_tensor_name
from tensorql.storage.stream_write import StreamingWrite


def _contiguous(chunk: np.ndarray) -> np.ndarray:
    """A C-contiguous array (``np.ascontiguousarray`` would turn 0-d into 1-d)."""
    chunk = np.asarray(chunk)
    return chunk if chunk.flags.c_contiguous else chunk.copy(order="C")


def _tile_sizes(tile: Any) -> tuple[int, ...]:
    """A tile as positive integers; ShapeError for strings, fractions and other junk."""
    if isinstance(tile, (str, bytes)) or not isinstance(tile, Sequence | np.ndarray) or (
            isinstance(tile, np.ndarray) and tile.ndim != 1):
        raise ShapeError(f"tile must be a sequence of positive integers, got {tile!r}")
    sizes = []
    for dim, size in enumerate(tile):
        if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, np.integer)):
            raise ShapeError(f"tile {tuple(tile)!r}: dimension {dim} is {size!r}, "
                             "not a positive integer")
        if size < 1:
            raise ShapeError(f"tile {tuple(tile)!r}: dimension {dim} is {size}; tiles must "
                             "be >= 1")
        sizes.append(int(size))
    return tuple(sizes)


def _open_store(path: str | None, options: Options, read_only: bool) -> ChunkStore:
    from tensorql.storage.duckdb_store import DuckDBChunkStore

    return DuckDBChunkStore(path, read_only=read_only, cache_bytes=options.chunk_cache_bytes,
                            duckdb_memory_bytes=options.store_memory_limit or 0)


def connect(
    path: str | None = None,
    *,
    devices: Any = None,
    memory_limit: int | str | None = None,
    options: Options | None = None,
    store: ChunkStore | None = None,
    read_only: bool = False,
    **settings: Any,
) -> Database:
    """Open a session: in-memory with no ``path``, else a DuckDB file (created if missing).

    ``devices`` ("auto" | "cpu" | "cuda" | ["cuda:0", ...]) and ``memory_limit`` (bytes or a
    string like "20GiB") go into the session's :class:`Options`, as does any other ``settings``.
    """
    if options is not None and not isinstance(options, Options):
        raise OptionError(f"connect(options=...) takes a tq.Options, not "
                          f"{type(options).__name__}; pass settings as keywords instead "
                          "(tq.connect(workers=2))")
    if store is not None and not isinstance(store, ChunkStore):
        raise StorageError(f"connect(store=...) takes a ChunkStore, not {type(store).__name__}"
                           "; pass a path to open a DuckDB file (tq.connect('work.duckdb'))")
    read_only = as_flag(read_only, "read_only")
    base = options or Options.from_env()
    changes = {k: v for k, v in dict(devices=devices, memory_limit=memory_limit,
                                       **settings).items() if v is not None}
    opts = base.with_(**changes) if changes else base
    get_backend(opts.backend)  # UnknownBackendError names the registered ones
    get_strategy(opts.strategy)  # as does UnknownStrategyError the strategies, before any query
    opts.device_set.check_present()  # "cuda:1" on a machine without it fails here
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise StorageError(f"database path must be a string or path, got {path!r}")
    path = os.fspath(path) if path is not None else None
    chunk_store = store if store is not None else _open_store(path, opts, read_only)
    return Database(chunk_store, opts, path=path)


class Database:
    """A tensorql session: stored tensors, lazy expressions over them, and their plans."""

    def __init__(self, store: ChunkStore, options: Options, path: str | None = None) -> None:
        self.chunk_store = store
        self.options = options
        self.path = path
        self._closed = False
        self._connection: Any = None  # a private DuckDB connection when the store has none
        self.generation = 0  # bumped on every change to stored tensors (plan caches check it)
        self.query_cache = QueryCache()  # compiled queries by structure (Tensor.compile)
        self._spill_space: Any = None
        # a SQL script of this session began a transaction (BEGIN) that may still be open:
        # writes then ask the store (see _refuse_in_sql_transaction)
        self.sql_transaction_begun = False

    @property
    def spill_space(self) -> Any:
        """Where this session's runs spill host copies beyond the host tier's budget: a DuckDB
        file of its own beside the session's file (in memory: in the temporary directory),
        made at the first spill and deleted at :meth:`close`
        (:class:`~tensorql.storage.spill.SpillSpace`)."""
        if self._spill_space is None:
            from tensorql.storage.spill import SpillSpace

            self._spill_space = SpillSpace(self.path,
                                           memory_bytes=self.options.spill_memory_bytes)
        return self._spill_space

    # -- context management -----------------------------------------------------------
    def close(self) -> None:
        if not self._closed:
            if self._connection is not None:
                self._connection.close()
            if self._spill_space is not None:
                self._spill_space.close()
            self.chunk_store.close()
            self._closed = True

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = self.path or ":memory:"
        if self._closed:
            return f"<tensorql.Database {where} closed>"
        return f"<tensorql.Database {where} tensors={len(self.tensors())}>"

    # -- SQL ----------------------------------------------------------------------------
    @property
    def connection(self) -> Any:
        """The DuckDB connection SQL runs on: the chunk store's, else a private in-memory one."""
        con = getattr(self.chunk_store, "connection", None)
        if con is not None:
            return con
        if self._connection is None:
            import duckdb

            self._connection = duckdb.connect()
        return self._connection

    def sql(self, query: str, params: Any = None, *, backend: str | None = None) -> Any:
        """Run SQL (DuckDB's dialect plus EINSUM, CREATE/DROP TENSOR, EXPLAIN); the last
        statement's result (see ``tensorql.sql.result.SQLResult``). ``params`` binds DuckDB
        query parameters (``?`` / ``$1`` from a sequence, ``$name`` from a dict).

        A pandas or polars DataFrame or an Arrow table in a variable of the caller is usable
        by its name, as with ``duckdb.sql`` (see ``tensorql.sql.replacement``).

        >>> import pyarrow as pa, tensorql as tq
        >>> tq.connect().sql("SELECT ? + 1 AS x", [41]).fetchall()
        [(42,)]
        >>> prices = pa.table({"p": [1.5, 2.5]})
        >>> tq.connect().sql("SELECT sum(p) AS total FROM prices").fetchall()
        [(4.0,)]
        """
        from tensorql.sql.replacement import frame_objects, registered
        from tensorql.sql.session import run_sql
        from tensorql.sql.statements import check_new_table_name

        caller = inspect.currentframe().f_back
        try:
            scope = {**caller.f_globals, **caller.f_locals} if caller is not None else {}
        finally:
            del caller
        con = self.connection
        with registered(con, frame_objects(query, scope, con)) as frames:
            result = run_sql(self, query, backend=backend, params=params, frames=frames)
        return result.bound(con, lambda name: check_new_table_name(self, name))

    # -- tensors at rest ----------------------------------------------------------------
    def tensors(self) -> list[str]:
        """Names of the stored tensors."""
        return self.chunk_store.names()

    def tensor(self, name: str) -> Tensor:
        """A stored tensor, by name (UnknownTensorError if absent)."""
        meta = self.chunk_store.meta(name)
        return Tensor(Source(shape=meta.shape, dtype=meta.dtype, name=name, grid=meta.grid),
                      self)

    def _refuse_in_sql_transaction(self, what: str) -> None:
        """StorageError while a SQL transaction of the user's (``BEGIN``) is open: tensors are
        written in transactions of their own, so the user's ``ROLLBACK`` would not undo them
        (and the user's transaction would not see their new tables)."""
        probe = getattr(self.chunk_store, "in_sql_transaction", None)
        if not self.sql_transaction_begun or probe is None:
            return
        if not probe():  # (~0.3-0.6 ms: asked only after a BEGIN)
            self.sql_transaction_begun = False
            return
        raise StorageError(f"{what}: a SQL transaction (BEGIN) is open on this session, and "
                           "tensors are stored in transactions of their own that its ROLLBACK "
                           "would not undo; COMMIT or ROLLBACK first")

    def drop(self, name: str) -> None:
        self._refuse_in_sql_transaction(f"cannot drop {name!r}")
        self.chunk_store.drop(name)
        self.generation += 1

    def _tile(self, shape: Sequence[int], tile: Sequence[int] | None) -> tuple[int, ...]:
        if tile is None:
            return auto_tile(shape, self.options.tile_target_elems)
        tile = _tile_sizes(tile)
        if len(tile) != len(shape):
            raise ShapeError(f"tile {tile} has {len(tile)} dims but the tensor has "
                             f"{len(shape)} {tuple(shape)}")
        return tile

    def from_numpy(self, name: str, array: np.ndarray, tile: Sequence[int] | None = None,
                   *, replace: bool = False, progress: ProgressCallback | None = None) -> Tensor:
        """Store ``array`` under ``name`` as a chunk relation (chunks are sliced lazily, so a
        memory-mapped array streams in chunk by chunk). ``progress(done, total)`` is called as
        chunks are written; with ``Options.progress`` and no callback a bar is drawn."""
        if not isinstance(array, np.ndarray):
            array = literal_array(array)
        if isinstance(array, np.ma.MaskedArray):
            if np.ma.is_masked(array):  # a tensor has no missing values (numpy's own asarray
                # would keep the masked entries' underlying data)
                raise UnsupportedError(f"from_numpy {name!r}: a masked array with "
                                       f"{int(np.ma.count_masked(array))} masked value(s); "
                                       "fill them first (array.filled(0.0))")
            array = array.data
        canonical_dtype(array.dtype)  # ShapeError names an unsupported dtype before any write
        releaser = MappedPageReleaser.for_array(array)

        def chunk(sl):
            piece = _contiguous(array[sl])
            releaser.consumed(piece.nbytes)
            return piece

        return self._put(name, array.shape, canonical_dtype(array.dtype), tile, chunk, replace,
                         progress)

    def from_torch(self, name: str, tensor: torch.Tensor, tile: Sequence[int] | None = None,
                   *, replace: bool = False, progress: ProgressCallback | None = None) -> Tensor:
        """Store a torch tensor under ``name`` (moved to CPU chunk by chunk); ``progress`` as
        in :meth:`from_numpy`."""
        if not isinstance(tensor, torch.Tensor):
            raise UnsupportedError(f"from_torch {name!r}: expected a torch.Tensor, got "
                                   f"{type(tensor).__name__}")
        if tensor.is_meta:
            raise UnsupportedError(f"from_torch {name!r}: a tensor on the meta device has no "
                                   "values to store")
        if tensor.is_nested:  # (its layout may read strided)
            raise UnsupportedError(f"from_torch {name!r}: a nested tensor has no one shape; "
                                   "pad it first (tensor.to_padded_tensor(0.0))")
        if tensor.layout != torch.strided:
            raise UnsupportedError(f"from_torch {name!r}: a {str(tensor.layout)[6:]} tensor is "
                                   "not stored as such; pass tensor.to_dense()")
        tensor = tensor.detach()
        return self._put(name, tuple(tensor.shape), canonical_dtype(tensor.dtype), tile,
                         # a negative view's (torch.conj(c).imag) bit resolved per chunk
                         lambda sl: tensor[sl].cpu().resolve_neg().resolve_conj().contiguous(),
                         replace, progress)

    def from_dlpack(self, name: str, tensor: Any, tile: Sequence[int] | None = None, *,
                    replace: bool = False) -> Tensor:
        """Store any tensor that exports DLPack (torch, numpy, JAX, CuPy, a tensorql tensor)
        under ``name`` (see ``tensorql.api.interchange.from_dlpack``)."""
        from tensorql.api.interchange import from_dlpack

        return from_dlpack(self, name, tensor, tile, replace=replace)

    def from_arrow(self, name: str, data: Any, tile: Sequence[int] | None = None, *,
                   replace: bool = False) -> Tensor:
        """Store numeric Arrow data under ``name``: an array (1-D), a table or record batch
        of numeric columns (2-D, rows x columns), a fixed-shape tensor array or a
        ``pyarrow.Tensor`` (its shape); DTypeError / UnsupportedError naming a column that
        is not numeric or holds nulls.

        >>> import pyarrow as pa, tensorql as tq
        >>> tq.connect().from_arrow("v", pa.array([1.5, 2.5])).shape
        (2,)
        """
        from tensorql.api.interchange import arrow_to_numpy

        return self.from_numpy(name, arrow_to_numpy(data), tile, replace=replace)

    def from_pandas(self, name: str, frame: Any, tile: Sequence[int] | None = None, *,
                    replace: bool = False) -> Tensor:
        """Store a pandas DataFrame of numeric columns under ``name`` as a 2-D tensor (rows x
        columns, numpy's common dtype), a Series as 1-D; DTypeError naming a column that is
        not numeric, UnsupportedError for missing values."""
        from tensorql.api.interchange import pandas_to_numpy

        return self.from_numpy(name, pandas_to_numpy(frame), tile, replace=replace)

    def _put(self, name, shape, dtype, tile, slicer, replace, progress=None) -> Tensor:
        check_tensor_name(name)
        replace = as_flag(replace, "replace")
        if progress is not None and not callable(progress):
            raise OptionError(f"progress must be a function (done, total) or None, got "
                              f"{progress!r:.60}")
        self._refuse_in_sql_transaction(f"cannot store {name!r}")
        grid = ChunkGrid(tuple(shape), self._tile(shape, tile))
        meta = TensorMeta(name=name, shape=grid.shape, dtype=dtype, grid=grid)
        if progress is None and self.options.progress:
            with progress_bar(f"storing {name}", unit="chunk") as bar:
                return self._put(name, shape, dtype, tile, slicer, replace, bar)
        total = grid.num_chunks

        def chunks():
            for done, key in enumerate(grid.keys(), start=1):
                yield key, slicer(grid.slices(key))
                if progress is not None:  # the store has taken this chunk
                    try:
                        progress(done, total)
                    except Exception as err:  # (an interrupt passes as it is)
                        raise ProgressCallbackError(
                            f"the progress callback raised {type(err).__name__}: {err} (at "
                            f"chunk {done} of {total} of {name!r}; nothing is stored)") from err

        self.chunk_store.put_tensor(meta, chunks(), replace=replace)
        self.generation += 1
        return self.tensor(name)

    def store(self, name: str, expr: Tensor, *, replace: bool = False,
              progress: Any = None) -> Tensor:
        """Compute ``expr`` and persist it under ``name``; returns the stored tensor.

        Result chunks stream into the store as the run completes them, so memory stays
        bounded by the session's limits, not by the result's size; the tensor appears only
        once every chunk is written (an error or interrupt stores nothing)."""
        expr = self.constant(expr) if not isinstance(expr, Tensor) else expr
        return self.store_node(name, expr.node, replace=replace, progress=progress,
                               compiled=expr.compile())

    def store_node(self, name: str, node: Node, *, replace: bool = False, progress: Any = None,
                   compiled: CompiledQuery | None = None) -> Tensor:
        """Compute the graph ``node`` and persist it under ``name`` (what ``CREATE TENSOR``
        calls), streaming result chunks into the store; returns the stored tensor."""
        check_tensor_name(name)
        replace = as_flag(replace, "replace")
        if not replace and self.chunk_store.has(name):
            raise StorageError(f"tensor {name!r} already exists (pass replace=True)")
        self._refuse_in_sql_transaction(f"cannot store {name!r}")
        # the writer thread cannot ask the main connection whether the name clashes with
        # one of its temp tables (an SQL statement may be running there): asked here first
        check = getattr(self.chunk_store, "check_name", None)
        if check is not None:
            check(name)
        compiled = compiled or CompiledQuery.compile(node, self)
        rel = compiled.physical.result_step.relation
        meta = TensorMeta(name=name, shape=rel.shape, dtype=rel.dtype, grid=rel.grid)
        with StreamingWrite(self.chunk_store, meta, replace=replace) as write:
            compiled.stream(write.put, progress=progress)
        self.generation += 1
        return self.tensor(name)

    def compute(self, *exprs: Tensor) -> list[torch.Tensor]:
        """Several expressions computed by one query (a subgraph they share runs once), as
        dense torch tensors in the order given.

        >>> import numpy as np, tensorql as tq
        >>> db = tq.connect()
        >>> a = db.from_numpy("a", np.arange(4.0))
        >>> [t.tolist() for t in db.compute(a.sum(), a * 2)]
        [6.0, [0.0, 2.0, 4.0, 6.0]]
        """
        from tensorql.pipeline import CompiledGroup

        tensors = [self.constant(e) if not isinstance(e, Tensor) else e for e in exprs]
        for n, tensor in enumerate(tensors):  # (its names would be read in this session)
            if tensor.db is not self:
                raise UnsupportedError(f"expression {n} belongs to another database: compute "
                                       "and store_many take this session's tensors (store "
                                       "copies another session's values)")
        return CompiledGroup.compile([t.node for t in tensors], self).run()

    def store_many(self, items: dict[str, Any], *, replace: bool = False) -> list[Tensor]:
        """Compute every expression (one query, shared work once) and store them all in one
        commit: after a crash either all are stored or none (a training checkpoint). Values may
        be expressions, arrays or torch tensors; a name already stored keeps its tiling.

        >>> import numpy as np, tensorql as tq
        >>> db = tq.connect()
        >>> a = db.from_numpy("a", np.arange(4.0))
        >>> [t.shape for t in db.store_many({"s": a.sum(), "d": a * 2})]
        [(), (4,)]
        """
        replace = as_flag(replace, "replace")
        if not isinstance(items, Mapping):
            raise UnsupportedError(f"store_many takes a dict of name -> expression, not "
                                   f"{type(items).__name__}")
        names = list(items)
        for name in names:
            check_tensor_name(name)
            if not replace and self.chunk_store.has(name):
                raise StorageError(f"tensor {name!r} already exists (pass replace=True)")
        by_folded: dict[str, str] = {}
        for name in names:  # as the store's own check against stored names
            other = by_folded.setdefault(name.lower(), name)
            if other != name:
                raise StorageError(f"store_many: names {other!r} and {name!r} differ only in "
                                   "case: names are case-insensitive, as in DuckDB")
        self._refuse_in_sql_transaction(f"cannot store {', '.join(map(repr, names))}")
        values = self.compute(*items.values())
        writes = []
        for name, value in zip(names, values):
            tile = None
            if self.chunk_store.has(name):
                old = self.chunk_store.meta(name)
                tile = old.grid.tile if old.shape == tuple(value.shape) else None
            grid = ChunkGrid(tuple(value.shape), self._tile(value.shape, tile))
            meta = TensorMeta(name=name, shape=grid.shape,
                              dtype=canonical_dtype(value.dtype), grid=grid)
            writes.append((meta, [(key, value[grid.slices(key)].contiguous())
                                  for key in grid.keys()]))
        self.chunk_store.put_tensors(writes, replace=replace)
        self.generation += 1
        return [self.tensor(name) for name in names]

    # -- expressions ------------------------------------------------------------------
    def constant(self, value: Any, tile: Sequence[int] | None = None) -> Tensor:
        """An in-memory literal usable in expressions (not stored), in chunks of ``tile``
        (default: automatic tiles of ``Options.tile_target_elems`` elements)."""
        if isinstance(value, Tensor):
            return value
        return Tensor(constant_node(value, self.options.tile_target_elems,
                                    None if tile is None else _tile_sizes(tile)), self)

    def iter_chunks(self, name: str) -> Iterator[tuple[Key, torch.Tensor]]:
        meta = self.chunk_store.meta(name)
        return self.chunk_store.read_chunks(name, meta.grid.keys())
