"""The DuckDB execution backend: a logical plan as one SQL query over chunk relations.

Every logical node becomes a CTE with columns ``k0, k1, ...`` (its chunk keys) and ``chunk``
(a BIGINT handle of the chunk in the run's :class:`ChunkArena`). Joins on chunk keys and
GROUP BY run inside DuckDB as real SQL; the chunk kernels are vectorized Arrow UDFs (one
Python call per batch of rows) that take and return handles and run the same torch kernels as
the native executor. A stored chunk's bytes cross from DuckDB into Python once, in the scan
(``tq_load``: the chunk's stored pages, viewed in place), however many pairs it joins into;
chunks a kernel computes stay torch tensors and never go back into DuckDB as bytes:

- ``Scan``: the stored page rows of each chunk handed to a load function, one handle a chunk
  after a GROUP BY on its key; the chunks it loads go into the store's chunk cache, and a
  tensor whose chunks the cache holds (at the version the run pinned) is read from there
  instead, as the native executor reads it: a registered Arrow table of handles, as for
  constant chunks;
- ``Join`` (+ ``Aggregate``): ``FROM x0 JOIN x1 ON x0.k1 = x1.k0`` with a partial aggregate
  kernel over the matching pairs' handles, then ``GROUP BY`` the output keys gathering the
  partials' handles -- ``SUM(matmul(A.chunk, B.chunk))`` of the tensor-relational algebra;
- ``Rekey``: a registered mapping of new to old keys, joined and grouped;
- ``Map``: a kernel per chunk;
- ``Reshape``: a kernel per chunk, its keys mapped in SQL.

>>> import numpy as np, tensorql as tq
>>> db = tq.connect()
>>> a = db.from_numpy("A", np.ones((4, 4), np.float32), tile=(2, 2))
>>> plan = SQLPlan.build(tq.einsum("ij,jk->ik", a, a).compile().logical, db.chunk_store)
>>> print(plan.sql.splitlines()[-1])
SELECT "k0", "k1", "chunk" FROM "s1"
>>> run_compiled(tq.einsum("ij,jk->ik", a, a).compile(), db.connection).dense()[0].tolist()
[4.0, 4.0, 4.0, 4.0]
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import duckdb
import numpy as np
import pyarrow as pa
import torch
from tensorql_kernels.algebra import version_counter
from tensorql_kernels.chunk_einsum import combine

from tensorql.algebra import AggName
from tensorql.dtypes import itemsize, torch_dtype
from tensorql.einsum.graph import Node
from tensorql.errors import ExecutionError, PlanError, StaleTensorError, UnsupportedError
from tensorql.exec.host_malloc import empty_result
from tensorql.exec.run_types import RunStats
from tensorql.exec.threads import run_shared, with_torch_threads
from tensorql.grid import ChunkGrid, Key, regrid_pieces
from tensorql.logical.plan import (
    Aggregate,
    Join,
    LogicalNode,
    Map,
    Rekey,
    Reshape,
    Scan,
    Softmax,
    walk,
)
from tensorql.physical.kernels import ContractChunk, ContractSeries, MapChunk, SoftmaxChunk
from tensorql.physical.planner import PhysicalPlan
from tensorql.physical.result import QueryResult, assemble
from tensorql.storage.blob_codec import decode_payloads, view_bytes
from tensorql.storage.pages import PAGE_BYTES
from tensorql.storage.sql_text import quote_ident as q
from tensorql.units import format_bytes

if TYPE_CHECKING:
    from tensorql.storage.chunk_store import ChunkStore, StoredVersion


class _Session(Protocol):
    """What the backend needs of a database session."""

    @property
    def chunk_store(self) -> ChunkStore: ...

    @property
    def connection(self) -> duckdb.DuckDBPyConnection: ...


class CompiledPlan(Protocol):
    """What the backend needs of a compiled query (``tensorql.pipeline.CompiledQuery``)."""

    @property
    def node(self) -> Node: ...

    @property
    def logical(self) -> LogicalNode: ...

    @property
    def physical(self) -> PhysicalPlan: ...

    @property
    def db(self) -> _Session: ...


__all__ = ["ChunkArena", "CompiledPlan", "SQLPlan", "explain_compiled", "pinned_scans",
           "run_compiled"]

class _PlanIds:
    """The numbers in the names of the functions and tables an :class:`SQLPlan` registers
    (``tq_load_<n>_<k>``): the smallest number no live plan holds, so that the same query
    built again (a second EXPLAIN) gets the same names, while two plans alive at once (runs
    on several threads, a plan kept by its caller) never share one. A plan holds its number
    until :meth:`SQLPlan.release` (the run and EXPLAIN functions call it when done) or until
    it is garbage collected."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[int] = set()

    def lease(self) -> _PlanId:
        with self._lock:
            n = 0
            while n in self._held:
                n += 1
            self._held.add(n)
        return _PlanId(n, self)

    def free(self, n: int) -> None:
        with self._lock:
            self._held.discard(n)


class _PlanId:
    """One plan's number, given back once (:meth:`release`; a second call does nothing)."""

    def __init__(self, value: int, pool: _PlanIds) -> None:
        self.value = value
        self._pool: _PlanIds | None = pool

    def release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.free(self.value)


_IDS = _PlanIds()

#: in-memory scans (constant or cached chunks) of up to this many chunks are inlined in the
#: query as ``VALUES``; bigger ones are registered Arrow tables (registering one costs ~0.5
#: ms a run, DuckDB's planning of a VALUES list ~15 us a row)
_INLINE_CHUNKS = 32


class ChunkArena:
    """The chunks of one run of an :class:`SQLPlan`, by the BIGINT handles its SQL carries.

    A kernel's Arrow function resolves the handles of its rows (:meth:`get`) and registers
    the chunks it makes (:meth:`put`); only handles go through DuckDB's joins, list
    aggregates and GROUP BYs, never a chunk's bytes. A chunk a scan loads is a view of the
    Arrow buffer DuckDB handed its pages in (kept alive by the view) when they came whole and
    in order in one batch, else copied together (:meth:`assemble`); every chunk lives until
    the run ends (the arena is dropped). Handles of the plan's constant chunks are fixed and
    negative (``preset``); the run's own count up from 1.

    Counters, which do not depend on the host's load: ``calls`` and ``rows`` of the Arrow
    functions (counted by the registered wrappers), ``loaded_bytes``, the chunk bytes that
    crossed from DuckDB into Python (each stored chunk a scan reads, once), ``made``, the
    chunks registered, and ``assembled``, those of them copied together from pieces of their
    pages (the others a scan loads are views of DuckDB's Arrow buffers).

    >>> arena = ChunkArena()
    >>> handles = arena.put([torch.ones(2), None, torch.zeros(3)])
    >>> handles.to_pylist()
    [1, None, 2]
    >>> [t.tolist() for t in arena.get(pa.array([2, 1]))]
    [[0.0, 0.0, 0.0], [1.0, 1.0]]
    """

    def __init__(self, preset: Mapping[int, torch.Tensor] | None = None,
                 result: tuple[ChunkGrid, torch.Tensor] | None = None,
                 threads: int = 1, torch_threads: int = 1) -> None:
        self._chunks: dict[int, torch.Tensor] = dict(preset or {})
        #: threads a batch's kernels may be shared out over (the session's workers, each
        #: with ``torch_threads`` torch threads): :meth:`share`
        self.threads = max(1, int(threads))
        self.torch_threads = max(1, int(torch_threads))
        self._sharing = 0  # batches whose kernels run now (see share)
        #: the run's dense result and its grid, when one was asked for: the root step's
        #: partials are written straight into it (:meth:`result_view`)
        self.result = result
        self._claimed: set[Key] = set()
        self._next = itertools.count(1)
        self._lock = threading.Lock()  # DuckDB may call the functions from several threads
        self.calls = 0
        self.rows = 0
        self.loaded_bytes = 0
        self.made = 0
        self.assembled = 0
        # chunks whose pages came in pieces (a chunk cut by a batch boundary or out of order)
        self._assembling: dict[tuple, tuple[int, torch.Tensor]] = {}
        self._missing: dict[int, int] = {}  # handle -> bytes not yet copied in
        #: the chunks the scans loaded: (scan, key) -> (handle, version counter at load),
        #: for the store's chunk cache after the run (:meth:`SQLPlan.keep_loaded`)
        self.scanned: dict[tuple[str, Key], tuple[int, int]] = {}

    def count(self, rows: int) -> None:
        """One Arrow function call over ``rows`` rows."""
        with self._lock:
            self.calls += 1
            self.rows += rows

    def loaded(self, nbytes: int) -> None:
        """``nbytes`` chunk bytes were loaded from DuckDB (counted in ``loaded_bytes``)."""
        with self._lock:
            self.loaded_bytes += nbytes

    def note_loaded(self, scan: str, key: Key, handle: int) -> None:
        """Chunk ``key`` of ``scan`` was loaded as ``handle`` (first piece, for an assembled
        chunk: its bytes are copied in through a numpy view, which torch does not count as a
        write)."""
        if (scan, key) not in self.scanned:
            self.scanned[scan, key] = (handle, version_counter(self._chunks[handle]))

    def loaded_chunks(self) -> Iterator[tuple[str, Key, torch.Tensor]]:
        """Each chunk the scans loaded whole and unwritten since: (scan, key, chunk)."""
        for (scan, key), (handle, version) in self.scanned.items():
            chunk = self._chunks[handle]
            if self._missing.get(handle, 0) == 0 and version_counter(chunk) == version:
                yield scan, key, chunk

    def put(self, tensors: Sequence[torch.Tensor | None]) -> pa.Array:
        """Handles of ``tensors`` as an Arrow BIGINT array (NULL where ``None``)."""
        out: list[int | None] = []
        for tensor in tensors:
            if tensor is None:
                out.append(None)
                continue
            handle = next(self._next)  # atomic under the GIL
            self._chunks[handle] = tensor
            out.append(handle)
        with self._lock:
            self.made += sum(h is not None for h in out)
        return pa.array(out, pa.int64())

    def get(self, column: pa.Array | pa.ChunkedArray | Sequence[int]) -> list[torch.Tensor]:
        """The chunks of the handles in ``column`` (no NULLs), in order."""
        handles = column if isinstance(column, list) else _ints(column).tolist()
        if self._missing:
            self._check_complete(handles)
        try:
            return [self._chunks[h] for h in handles]
        except KeyError as err:
            raise ExecutionError(f"DuckDB backend: no chunk with handle {err.args[0]} in this "
                                 f"run (a handle of another run?)") from None

    def share(self, jobs: Sequence[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
        """Run a batch's kernel ``jobs`` (independent: one output chunk each), their results
        in order: shared out over the arena's ``threads`` (:func:`run_shared`) when no other
        batch runs its kernels meanwhile (DuckDB may call the functions from several of its
        threads; those calls then keep to their own thread, so the cores are not
        oversubscribed), else on the calling thread."""
        with self._lock:
            alone = self._sharing == 0
            self._sharing += 1
        try:
            if alone and self.threads > 1 and len(jobs) > 1:
                return run_shared(jobs, self.threads, self.torch_threads)
            return [job() for job in jobs]
        finally:
            with self._lock:
                self._sharing -= 1

    def result_view(self, key: Key) -> torch.Tensor | None:
        """The view of chunk ``key`` of the dense result, for the first caller asking for it
        (a partial of the root step: another partial of the same chunk, from another batch,
        gets None and writes a tensor of its own, folded later); None without a result."""
        if self.result is None:
            return None
        with self._lock:
            if key in self._claimed:
                return None
            self._claimed.add(key)
        grid, dense = self.result
        return dense[grid.slices(key)]

    def assemble(self, where: tuple, shape: tuple[int, ...], dtype: str, at: int,
                 raw: np.ndarray) -> int:
        """Copy ``raw`` (bytes of a chunk from byte ``at`` on) into the chunk ``where`` (a
        scan and a key) assembled from pieces, made on its first piece; its handle. The
        chunk is readable (:meth:`get`) once every byte has come."""
        with self._lock:
            got = self._assembling.get(where)
            if got is None:
                chunk = torch.empty(shape, dtype=torch_dtype(dtype))
                handle = next(self._next)
                self._chunks[handle] = chunk
                got = self._assembling[where] = (handle, chunk)
                self._missing[handle] = chunk.numel() * chunk.element_size()
                self.made += 1
                self.assembled += 1
            handle, chunk = got
        flat = _flat_bytes(chunk)
        if at < 0 or at + raw.size > flat.size:
            raise ExecutionError(f"DuckDB backend: a page of {format_bytes(raw.size)} at "
                                 f"offset {format_bytes(at)} falls outside chunk {where[1]} "
                                 f"({format_bytes(flat.size)})")
        flat[at:at + raw.size] = raw  # pieces of one chunk are disjoint: no lock needed
        with self._lock:
            self._missing[handle] -= raw.size
        return handle

    def _check_complete(self, handles: Sequence[int]) -> None:
        with self._lock:
            for handle in handles:
                left = self._missing.get(handle)
                if left is None:
                    continue
                if left != 0:
                    raise ExecutionError(f"DuckDB backend: chunk of handle {handle} read with "
                                         f"{format_bytes(left)} of its pages missing")
                del self._missing[handle]

    def __len__(self) -> int:
        return len(self._chunks)


@dataclass(frozen=True)
class UDF:
    """A vectorized Arrow scalar function the plan's SQL calls: ``fn(arena, *columns)``, the
    run's :class:`ChunkArena` first, then one Arrow array per parameter."""

    name: str
    fn: Callable[..., pa.Array]
    params: tuple[str, ...]
    returns: str = "BIGINT"
    #: "special": NULLs reach the function and it may return them (a partial aggregate that
    #: leaves a row empty); "default": DuckDB filters them out
    null_handling: str = "default"


@dataclass(frozen=True)
class SQLPlan:
    """The SQL text of a logical plan, with the UDFs and Arrow tables it needs.

    ``sql`` selects ``k0.., chunk`` (the handles of the root relation's chunks); ``steps``
    names each CTE's logical node for EXPLAIN; ``constants`` are the chunks of constant (or
    non-DuckDB, or cached) scans, by the fixed handles their registered tables hold;
    ``loads`` the pinned version each page-loading scan reads, by its load function's name
    (the chunks it loads go into the store's cache after the run: :meth:`keep_loaded`).
    """

    root: LogicalNode
    sql: str
    udfs: tuple[UDF, ...]
    tables: dict[str, pa.Table] = field(hash=False)
    steps: tuple[tuple[str, str], ...] = ()
    constants: dict[int, torch.Tensor] = field(default_factory=dict, hash=False, compare=False)
    loads: dict[str, StoredVersion] = field(default_factory=dict, hash=False, compare=False)
    #: a scan reads a tensor's chunk view (a temp view of the connection, made by the
    #: store's ``sync_views``) rather than a pinned version's pages
    reads_views: bool = False
    #: the number in the names of its functions and tables, held while the plan may run
    lease: _PlanId | None = field(default=None, hash=False, compare=False, repr=False)

    @classmethod
    def build(cls, root: LogicalNode, store: ChunkStore | None,
              versions: Mapping[str, StoredVersion] | None = None) -> SQLPlan:
        """The plan of ``root`` over ``store``; with ``versions`` (the stored tensors' versions
        a run pinned: :func:`pinned_scans`), its scans read those versions, from the store's
        chunk cache where it holds all of a tensor's chunks; without, the tables the store's
        views show now, never from the cache."""
        lease = _IDS.lease()
        builder = _Builder(store, lease.value, versions)
        builder.root = id(root)
        names: dict[int, str] = {}
        ctes = []
        fused = {id(n.input) for n in walk(root) if isinstance(n, Aggregate)}
        for node in walk(root):
            if id(node) in fused:
                continue
            name = f"s{len(ctes)}"
            body, what = builder.step(node, names)
            names[id(node)] = name
            ctes.append((name, body, what))
        readers = dict.fromkeys(names.values(), 0)
        readers[names[id(root)]] += 1  # the final SELECT
        for node in walk(root):
            if id(node) not in fused:
                for source in (node.input.inputs if isinstance(node, Aggregate) else
                               node.inputs):
                    readers[names[id(source)]] += 1
        keys = "".join(f"{q(f'k{d}')}, " for d in range(len(root.relation.labels)))
        # steps read more than once are MATERIALIZED (their handles: a few bytes a chunk), so
        # each kernel runs and each stored chunk is loaded once, whoever reads it; a step read
        # once is inlined into its reader
        with_sql = ",\n".join(
            f"{q(n)} AS {'MATERIALIZED ' if readers[n] > 1 else ''}(\n  {body}\n)"
            for n, body, what in ctes)
        sql = f"WITH {with_sql}\nSELECT {keys}\"chunk\" FROM {q(ctes[-1][0])}"
        plan = cls(root=root, sql=sql, udfs=tuple(builder.udfs), tables=builder.tables,
                   steps=tuple((n, what) for n, _, what in ctes), constants=builder.constants,
                   loads=builder.loads, reads_views=builder.reads_views, lease=lease)
        weakref.finalize(plan, lease.release)  # a plan nobody releases gives it back when
        return plan  # collected

    def release(self) -> None:
        """Give the number in the plan's function and table names back for the next plan
        built (call it when the plan will not run again; its names may then be reused)."""
        if self.lease is not None:
            self.lease.release()

    def keep_loaded(self, arena: ChunkArena, store: ChunkStore | None) -> int:
        """Put the chunks ``arena``'s run loaded from its pinned versions into ``store``'s
        chunk cache (whole, unwritten ones), so that the next run reads them from there as
        the native executor does; how many. Call it after a run that succeeded."""
        keep = getattr(store, "cache_chunk_at", None)
        if keep is None or not self.loads:
            return 0
        kept = 0
        for scan, key, chunk in arena.loaded_chunks():
            version = self.loads.get(scan)
            if version is not None:
                keep(version, key, chunk)
                kept += 1
        return kept

    def arena(self, dense: bool = False, threads: int = 1, torch_threads: int = 1
              ) -> ChunkArena:
        """A fresh arena for one run (the constant chunks preset); with ``dense``, a dense
        result the root step's kernels write into (read it with :meth:`dense_result`);
        ``threads`` (of ``torch_threads`` torch threads each) a batch's kernels may be
        shared out over (:meth:`ChunkArena.share`)."""
        result = None
        if dense:
            rel = self.root.relation
            result = (rel.grid, empty_result(rel.grid.shape, torch_dtype(rel.dtype)))
        return ChunkArena(self.constants, result, threads, torch_threads)

    def dense_result(self, chunks: Mapping[Key, torch.Tensor], arena: ChunkArena
                     ) -> torch.Tensor:
        """The run's dense result: ``arena``'s, with every chunk a kernel did not write in
        place copied in (or assembled anew when the arena has none)."""
        if arena.result is None:
            rel = self.root.relation
            return assemble(rel.grid, rel.dtype, dict(chunks))
        grid, dense = arena.result
        for key, chunk in chunks.items():
            view = dense[grid.slices(key)]
            if chunk.data_ptr() != view.data_ptr() or chunk.stride() != view.stride():
                view.copy_(chunk)
        return dense

    def run(self, con: duckdb.DuckDBPyConnection, arena: ChunkArena | None = None
            ) -> tuple[dict[Key, torch.Tensor], float]:
        """Execute on ``con``; the result chunks by key and the wall time. ``arena``: the
        run's chunks (a fresh one by default; pass one to read its counters after)."""
        arena = self.arena() if arena is None else arena
        registered = self._register(con, arena)
        try:
            start = time.perf_counter()
            try:  # rows of keys and a handle: plain Python tuples, no Arrow table needed
                rows = con.execute(self.sql).fetchall()
            except duckdb.Error as err:
                raise ExecutionError(f"DuckDB backend failed: {str(err).splitlines()[0]}") \
                    from None
            chunks = self.decode(rows, arena)
            return chunks, time.perf_counter() - start
        finally:
            self._unregister(con, registered)

    def explain_analyze(self, con: duckdb.DuckDBPyConnection, analyze: bool) -> str:
        registered = self._register(con, self.arena())
        try:
            prefix = "EXPLAIN ANALYZE " if analyze else "EXPLAIN "
            try:
                rows = con.sql(prefix + self.sql).fetchall()
            except duckdb.Error as err:
                raise ExecutionError(f"DuckDB backend failed to explain its query: "
                                     f"{str(err).splitlines()[0]}") from None
            return "\n".join(r[1] for r in rows).rstrip()
        finally:
            self._unregister(con, registered)

    def decode(self, rows: Sequence[tuple[int, ...]], arena: ChunkArena
               ) -> dict[Key, torch.Tensor]:
        """The result chunks by key from the result ``rows`` (keys, then a handle)."""
        grid = self.root.relation.grid
        chunks = arena.get([row[-1] for row in rows])
        out: dict[Key, torch.Tensor] = {}
        for row, chunk in zip(rows, chunks):
            key = tuple(row[:-1])
            if tuple(chunk.shape) != tuple(grid.chunk_shape(key)):
                raise ExecutionError(f"DuckDB backend: chunk {key} has shape "
                                     f"{tuple(chunk.shape)}, expected "
                                     f"{tuple(grid.chunk_shape(key))}")
            out[key] = chunk
        return out

    def _register(self, con, arena: ChunkArena) -> list[str]:
        done: list[str] = []
        try:
            for udf in self.udfs:
                con.create_function(udf.name, _bound(udf.fn, arena, len(udf.params)),
                                    [_sqltype(p) for p in udf.params],
                                    _sqltype(udf.returns), type="arrow",
                                    null_handling=udf.null_handling, side_effects=False)
                done.append("f:" + udf.name)
            for name, table in self.tables.items():
                con.register(name, table)
                done.append("t:" + name)
        except BaseException:
            self._unregister(con, done)
            raise
        return done

    @staticmethod
    def _unregister(con, done: list[str]) -> None:
        for item in done:
            kind, name = item.split(":", 1)
            try:
                if kind == "f":
                    con.remove_function(name)
                else:
                    con.unregister(name)
            except duckdb.Error:  # pragma: no cover - already gone
                pass


@functools.cache
def _sqltype(name: str) -> duckdb.DuckDBPyType:
    """``duckdb.sqltype(name)``, parsed once (a parse costs ~0.2 ms, a few per UDF and run)."""
    return duckdb.sqltype(name)


def _bound(fn: Callable[..., pa.Array], arena: ChunkArena, n: int) -> Callable[..., pa.Array]:
    """``fn(arena, *cols)`` seen by DuckDB as a function of exactly ``n`` parameters, each
    call counted in ``arena``."""

    def call(*cols):
        arena.count(len(cols[-1]))
        # a DuckDB thread's torch work runs on the session's torch threads a worker, not on
        # OpenMP's default of every core: two such threads calling at once (DuckDB splits a
        # join's rows over its threads) would each start a team of every core
        with with_torch_threads(arena.torch_threads):
            return fn(arena, *cols)

    kind = inspect.Parameter.POSITIONAL_ONLY
    call.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(f"a{i}", kind) for i in range(n)])
    return call


def _blobs(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    return column


def _ints(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return np.asarray(column.to_numpy() if isinstance(column, pa.ChunkedArray)
                      else column.to_numpy(zero_copy_only=False), dtype=np.int64)


def _keys(columns: Sequence[pa.Array | pa.ChunkedArray], n_rows: int) -> list[Key]:
    """The key tuples of ``n_rows`` rows from their key columns (``()`` each for none)."""
    if not columns:
        return [()] * n_rows
    return list(zip(*(_ints(c).tolist() for c in columns)))


def _int_lists(column: pa.Array | pa.ChunkedArray) -> list[list[int]]:
    """Each row of a LIST of integers (handles) as a Python list.

    >>> _int_lists(pa.array([[3, 1], [], [2]]))
    [[3, 1], [], [2]]
    """
    lists = _blobs(column)
    starts = np.asarray(lists.offsets).tolist()
    values = _ints(lists.values).tolist()
    return [values[lo:hi] for lo, hi in zip(starts[:-1], starts[1:])]


def _binary(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, bytes) of an Arrow binary array."""
    width = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
    offsets = np.frombuffer(arr.buffers()[1], dtype=width)[arr.offset:arr.offset + len(arr) + 1]
    data = arr.buffers()[2]
    return offsets, (np.frombuffer(data, dtype=np.uint8) if data is not None
                     else np.zeros(0, np.uint8))


def _flat_bytes(chunk: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a flat, writable uint8 array (a view)."""
    return chunk.view(-1).view(torch.uint8).numpy()


def _page_loader(name: str, grid, dtype: str) -> Callable[..., pa.Array]:
    """The load function of a stored tensor's scan: rows ``k.., page, payload``, one per
    stored page (``PAGE_BYTES`` each, the last of a chunk shorter), a chunk's handle back on
    each of its pages. Pages of one chunk that come in order in one batch lie back to back in
    the Arrow buffer: when they are the whole chunk (the usual case), the chunk is a view of
    that buffer; pages of a chunk cut by a batch boundary, or out of order, are copied into
    a chunk assembled in the arena (:meth:`ChunkArena.assemble`).

    >>> import tensorql.grid as g
    >>> load = _page_loader("t", g.ChunkGrid((2, 2), (1, 2)), "int16")
    >>> arena = ChunkArena()
    >>> pages = pa.array([b"\\x01\\x00\\x02\\x00", b"\\x03\\x00\\x04\\x00"])
    >>> cols = [pa.array([0, 1], pa.int32()), pa.array([0, 0], pa.int32()),
    ...         pa.array([0, 0], pa.int32()), pages]
    >>> [c.tolist() for c in arena.get(load(arena, *cols))]
    [[[1, 2]], [[3, 4]]]
    """
    ndim = grid.ndim
    size = itemsize(dtype)

    def load(arena: ChunkArena, *cols) -> pa.Array:
        n_rows = len(cols[-1])
        keys = _keys(cols[:ndim], n_rows)
        page = _ints(cols[ndim])
        offsets, data = _binary(_blobs(cols[ndim + 1]))
        # runs of rows: one chunk's pages in order
        cut = np.ones(n_rows, dtype=bool)
        if n_rows > 1:
            cut[1:] = page[1:] != page[:-1] + 1
            for d in range(ndim):
                k = _ints(cols[d])
                cut[1:] |= k[1:] != k[:-1]
        starts = np.flatnonzero(cut).tolist()
        out = np.empty(n_rows, dtype=np.int64)
        loaded = 0
        for lo, hi in zip(starts, starts[1:] + [n_rows]):
            key = keys[lo]
            shape = grid.chunk_shape(key)
            nbytes = math.prod(shape) * size
            a, b = int(offsets[lo]), int(offsets[hi])
            raw = data[a:b]
            first = int(page[lo])
            if first == 0 and b - a == nbytes:  # the whole chunk in order: a view
                handle = arena.put([view_bytes(raw, dtype, shape)])[0].as_py()
            else:
                handle = arena.assemble((name, key), shape, dtype, first * PAGE_BYTES, raw)
            arena.note_loaded(name, key, handle)
            out[lo:hi] = handle
            loaded += b - a
        arena.loaded(loaded)
        return pa.array(out)

    return load


class _Builder:
    def __init__(self, store: ChunkStore | None, plan_id: int,
                 versions: Mapping[str, StoredVersion] | None = None) -> None:
        self.store = store
        self.plan_id = plan_id
        self.versions = versions  # pinned by the run; None: read what the views show
        self.loads: dict[str, StoredVersion] = {}  # page-loading scans' versions
        self.reads_views = False
        self.udfs: list[UDF] = []
        self.tables: dict[str, pa.Table] = {}
        self.constants: dict[int, torch.Tensor] = {}  # fixed (negative) handles
        self.root = 0  # id of the plan's root node (its partials may write a dense result)

    def _name(self, kind: str) -> str:
        return f"tq_{kind}_{self.plan_id}_{len(self.udfs) + len(self.tables)}"

    def step(self, node: LogicalNode, names: dict[int, str]) -> tuple[str, str]:
        if isinstance(node, Scan):
            return self._scan(node)
        if isinstance(node, (Map, Softmax)):  # a kernel per chunk, keys unchanged
            return self._map(node, names)
        if isinstance(node, Rekey):
            return self._rekey(node, names)
        if isinstance(node, Reshape):
            return self._reshape(node, names)
        if isinstance(node, Aggregate):
            if not isinstance(node.input, Join):
                raise PlanError("the DuckDB backend needs every Aggregate over a Join")
            return self._contract(node.input, node, names)
        if isinstance(node, Join):
            return self._contract(node, None, names)
        raise PlanError(f"the DuckDB backend cannot run {type(node).__name__}")

    # -- scans --------------------------------------------------------------------------
    def _scan(self, node: Scan) -> tuple[str, str]:
        if node.offset is not None:
            raise UnsupportedError(f"the DuckDB backend does not read a region of "
                                   f"{node.source!r} (a slice); use the native backend")
        rel = node.relation
        grid, dtype, ndim = rel.grid, rel.dtype, len(rel.labels)
        keys = ", ".join(q(f"k{d}") for d in range(ndim))
        group = f" GROUP BY {keys}" if keys else ""
        keys = keys + ", " if keys else ""
        version = (self.versions or {}).get(node.source) if node.constant is None else None
        cached = getattr(self.store, "cached_chunks_at", None)
        cached = cached(version, grid.keys()) if cached and version is not None else None
        if cached is not None:  # every chunk in the store's cache: read from there
            return self._in_memory([cached[k] for k in grid.keys()], grid, keys,
                                   f"Scan {node.source} (cached chunks)")
        if node.constant is None and self.store is not None and hasattr(self.store,
                                                                         "connection"):
            pages = getattr(self.store, "chunk_pages_sql", None)
            pages = pages(node.source, version) if pages is not None else None
            name = self._name("load")
            if pages is not None:  # each chunk's stored pages, loaded once
                self.udfs.append(UDF(name, _page_loader(name, grid, dtype),
                                     ("INTEGER",) * ndim + ("INTEGER", "BLOB")))
                if version is not None:
                    self.loads[name] = version
                # the GROUP BY is a pipeline breaker: every page has been loaded before a
                # chunk's handle (the same on all its pages) goes on
                return (f"SELECT {keys}min(\"chunk\") AS \"chunk\" FROM (SELECT {keys}"
                        f"{q(name)}({keys}\"page\", \"payload\") AS \"chunk\" FROM {pages})"
                        f"{group}", f"Scan {node.source} (chunk pages)")

            def load_chunks(arena, *cols):
                shapes = [grid.chunk_shape(k) for k in _keys(cols[:ndim], len(cols[-1]))]
                chunks = decode_payloads(_blobs(cols[-1]), dtype, shapes)
                arena.loaded(sum(c.numel() * c.element_size() for c in chunks))
                return arena.put(chunks)

            self.udfs.append(UDF(name, load_chunks, ("INTEGER",) * ndim + ("BLOB",)))
            self.reads_views = True
            return (f"SELECT {keys}{q(name)}({keys}\"payload\") AS \"chunk\" FROM "
                    f"{q(node.source + '__chunks')}", f"Scan {node.source} (chunk view)")
        key_list = list(grid.keys())
        if node.constant is not None:
            chunks = [node.constant[grid.slices(k)].contiguous() for k in key_list]
        else:
            if self.store is None:
                raise PlanError(f"no store to read {node.source!r} from")
            got = dict(self.store.read_chunks(node.source, key_list))
            chunks = [got[k] for k in key_list]
        return self._in_memory(chunks, grid, keys, f"Scan {node.source} (in memory)")

    def _in_memory(self, chunks: list[torch.Tensor], grid: ChunkGrid, keys: str, what: str
                   ) -> tuple[str, str]:
        """A scan of ``chunks`` (one a key of ``grid``, in its order) held in memory, by
        fixed handles: a ``VALUES`` list of keys and handles for up to
        ``_INLINE_CHUNKS`` chunks (registering a table costs ~0.5 ms a run), else a
        registered table; ``keys`` the key columns' SQL, then ", "."""
        key_list = list(grid.keys())
        handles = [-(len(self.constants) + 1 + i) for i in range(len(chunks))]
        self.constants.update(zip(handles, chunks))
        if 0 < len(key_list) <= _INLINE_CHUNKS:  # (VALUES needs a row: an empty grid has none)
            rows = ", ".join(f"({', '.join(map(str, (*k, h)))})"
                             for k, h in zip(key_list, handles))
            names = [f"k{d}" for d in range(grid.ndim)] + ["chunk"]
            typed = ", ".join([f"CAST({q(n)} AS INTEGER) AS {q(n)}" for n in names[:-1]]
                              + ['CAST("chunk" AS BIGINT) AS "chunk"'])
            return (f"SELECT {typed} FROM (VALUES {rows}) AS "
                    f"t({', '.join(map(q, names))})"), what
        columns = {f"k{d}": pa.array([k[d] for k in key_list], pa.int32())
                   for d in range(grid.ndim)}
        columns["chunk"] = pa.array(handles, pa.int64())
        name = self._name("chunks")
        self.tables[name] = pa.table(columns)
        return f"SELECT {keys}\"chunk\" FROM {q(name)}", what

    # -- maps ---------------------------------------------------------------------------
    def _map(self, node: Map | Softmax, names: dict[int, str]) -> tuple[str, str]:
        rel = node.relation
        if isinstance(node, Softmax):
            kernel, what = SoftmaxChunk.of(node), node.title
        else:
            kernel = MapChunk(node.fn, node.scalar, rel.dtype)
            what = f"Map {node.fn}"

        def run(arena, chunks):
            return arena.put([kernel.run([c], None) for c in arena.get(chunks)])

        name = self._name("map")
        self.udfs.append(UDF(name, run, ("BIGINT",)))
        args = "".join(f"{q(f'k{d}')}, " for d in range(rel.grid.ndim))
        return (f"SELECT {args}{q(name)}(\"chunk\") AS \"chunk\" "
                f"FROM {q(names[id(node.input)])}", what)

    # -- reshape ------------------------------------------------------------------------
    def _reshape(self, node: Reshape, names: dict[int, str]) -> tuple[str, str]:
        new, lay = node.relation.grid, node.layout
        ndim = node.input.relation.grid.ndim

        def run(arena, *cols):
            keys = _keys(cols[:ndim], len(cols[-1]))
            return arena.put([c.reshape(new.chunk_shape(lay.output_key(k)))
                              for c, k in zip(arena.get(cols[-1]), keys)])

        name = self._name("reshape")
        self.udfs.append(UDF(name, run, ("INTEGER",) * ndim + ("BIGINT",)))
        leading = {g.outputs[0]: g.inputs[0] for g in lay.groups if g.inputs and g.outputs}
        sel = "".join(f"{q(f'k{leading[d]}') if d in leading else '0'} AS {q(f'k{d}')}, "
                      for d in range(new.ndim))
        args = "".join(f"{q(f'k{d}')}, " for d in range(ndim))
        return (f"SELECT {sel}{q(name)}({args}\"chunk\") AS \"chunk\" "
                f"FROM {q(names[id(node.input)])}", node.title)

    # -- rekey --------------------------------------------------------------------------
    def _rekey(self, node: Rekey, names: dict[int, str]) -> tuple[str, str]:
        old, new = node.input.relation.grid, node.relation.grid
        ndim = new.ndim
        plan: dict[Key, tuple[list[Key], list]] = {}
        rows: dict[str, list[int]] = {f"n{d}": [] for d in range(ndim)}
        rows.update({f"o{d}": [] for d in range(ndim)})
        rows["piece"] = []
        for key in new.keys():
            olds, pieces = [], []
            for n, piece in enumerate(regrid_pieces(old, new, key)):
                okey = piece.source_key
                olds.append(okey)
                pieces.append((piece.source_slices, piece.target_slices))
                for d in range(ndim):
                    rows[f"n{d}"].append(key[d])
                    rows[f"o{d}"].append(okey[d])
                rows["piece"].append(n)
            plan[tuple(key)] = (olds, pieces)

        def run(arena, *cols):
            out = []
            for key, handles in zip(_keys(cols[:ndim], len(cols[-1])), _int_lists(cols[-1])):
                olds, pieces = plan[key]
                parts = arena.get(handles)
                chunk = torch.empty(new.chunk_shape(key), dtype=parts[0].dtype)
                for part, (src, dst) in zip(parts, pieces):
                    chunk[dst] = part[src]
                out.append(chunk)
            return arena.put(out)

        table = self._name("rekeymap")
        self.tables[table] = pa.table({k: pa.array(v, pa.int32()) for k, v in rows.items()})
        name = self._name("rekey")
        self.udfs.append(UDF(name, run, ("INTEGER",) * ndim + ("BIGINT[]",)))
        nk = [f"m.{q(f'n{d}')}" for d in range(ndim)]
        on = " AND ".join(f"m.{q(f'o{d}')} = s.{q(f'k{d}')}" for d in range(ndim)) or "TRUE"
        sel = "".join(f"{k} AS {q(f'k{d}')}, " for d, k in enumerate(nk))
        args = "".join(f"{k}, " for k in nk)
        group = f" GROUP BY {', '.join(nk)}" if nk else ""
        return (f"SELECT {sel}{q(name)}({args}list(s.\"chunk\" ORDER BY m.\"piece\")) AS "
                f"\"chunk\" FROM {q(table)} AS m JOIN {q(names[id(node.input)])} AS s ON "
                f"{on}{group}", f"Rekey to tiles {new.tile}")

    # -- join (+ aggregate) -------------------------------------------------------------
    def _contract(self, join: Join, aggregate: Aggregate | None,
                  names: dict[int, str]) -> tuple[str, str]:
        out_rel = (aggregate or join).relation
        agg = aggregate.agg if aggregate else AggName.SUM
        kernel = ContractChunk(in_labels=join.input_labels, out_labels=out_rel.labels,
                               join=join.join, agg=agg, dtype=out_rel.dtype)
        ranks = [src.relation.grid.ndim for src in join.sources]
        # where each label's key is found: the first (source, dim) carrying it
        first: dict[str, str] = {}
        conds: list[str] = []
        for s, labels in enumerate(join.input_labels):
            for d, label in enumerate(labels):
                col = f"x{s}.{q(f'k{d}')}"
                if label in first:
                    conds.append(f"{first[label]} = {col}")
                else:
                    first[label] = col
        key_args: list[str] = []
        for s, labels in enumerate(join.input_labels):
            key_args += [f"x{s}.{q(f'k{d}')}" for d in range(len(labels))]
        chunk_args = [f"x{s}.\"chunk\"" for s in range(len(join.sources))]

        def decode_rows(arena: ChunkArena, cols) -> tuple[list[list[torch.Tensor]],
                                                          list[list[Key]], int]:
            """Each source's chunks and keys, row by row."""
            n_rows = len(cols[-1])
            pos = 0
            keys_per_source: list[list[Key]] = []
            for rank in ranks:
                keys_per_source.append(_keys(cols[pos:pos + rank], n_rows))
                pos += rank
            decoded = [arena.get(cols[pos + s]) for s in range(len(ranks))]
            return decoded, keys_per_source, n_rows

        def run_join(arena, *cols):
            decoded, _, n_rows = decode_rows(arena, cols)
            return arena.put([kernel.run([d[r] for d in decoded], None) for r in range(n_rows)])

        params = ("INTEGER",) * sum(ranks) + ("BIGINT",) * len(join.sources)
        join_fn = self._name("join" if aggregate is None else "partial")
        if aggregate is None:
            self.udfs.append(UDF(join_fn, run_join, params))
        else:
            self.udfs.append(UDF(join_fn, self._partial_fn(join, aggregate, kernel, decode_rows,
                                                           id(aggregate) == self.root),
                                 params, null_handling="special"))
        sources = [f"{q(names[id(src)])} AS x{s}" for s, src in enumerate(join.sources)]
        from_sql = sources[0]
        if len(sources) == 2:
            on = [c for c in conds if c.startswith("x0.") and " = x1." in c]
            inner = [c for c in conds if c not in on]
            from_sql += (f" JOIN {sources[1]} ON {' AND '.join(on)}" if on
                         else f" CROSS JOIN {sources[1]}")
        elif len(sources) > 2:  # every source in FROM, the key equalities in WHERE
            from_sql = ", ".join(sources)
            inner = conds
        else:
            inner = conds
        where = f" WHERE {' AND '.join(inner)}" if inner else ""
        out_keys = [first[label] for label in out_rel.labels]
        call = f"{q(join_fn)}({', '.join(key_args + chunk_args)})"
        if aggregate is None:
            sel = "".join(f"{k} AS {q(f'k{d}')}, " for d, k in enumerate(out_keys))
            what = (f"Join {join.join} on [{', '.join(join.on)}]" if len(sources) >= 2
                    else f"Project ({','.join(join.input_labels[0])})")
            return f"SELECT {sel}{call} AS \"chunk\" FROM {from_sql}{where}", what

        ndim = out_rel.grid.ndim

        def run_agg(arena, parts_column):
            # every part is a partial the run made (a fold's own tensor, or its chunk of the
            # dense result): the first takes the others' sums in place
            out = []
            for handles in _int_lists(parts_column):
                parts = arena.get(handles)
                acc = parts[0]
                for part in parts[1:]:
                    acc = combine(acc, part, agg)
                out.append(acc)
            return arena.put(out)

        agg_fn = self._name("agg")
        self.udfs.append(UDF(agg_fn, run_agg, ("BIGINT[]",)))
        over_keys = [first[label] for label in aggregate.over if label in first]
        inner_sel = "".join(f"{k} AS {q(f'k{d}')}, " for d, k in enumerate(out_keys))
        inner_sel += "".join(f"{k} AS {q(f'o{d}')}, " for d, k in enumerate(over_keys))
        order = ", ".join(q(f"o{d}") for d in range(len(over_keys)))
        order = f" ORDER BY {order}" if order else ""
        keys = [q(f"k{d}") for d in range(ndim)]
        sel = "".join(f"{k}, " for k in keys)
        group = f" GROUP BY {', '.join(keys)}" if keys else ""
        # the partial aggregates of each batch (NULL where a row's product went into another
        # row's), their handles gathered per output chunk in DuckDB and folded by the
        # aggregate kernel (a lone partial -- the whole sum came in one batch -- is the
        # result as it is)
        # ... in the order of the output keys: DuckDB then hands the step's rows on from
        # one sorted source, so a join reading it gets its pairs in as few batches as fit
        # (one call whose products are shared over the workers), where the GROUP BY's own
        # output, one part a DuckDB thread, split them into two calls at once, each on
        # one thread, and every output chunk's sum into two partials folded after
        ordered = f" ORDER BY {', '.join(keys)}" if keys else ""
        body = (f"SELECT {sel}CASE WHEN len(\"parts\") = 1 THEN \"parts\"[1] ELSE "
                f"{q(agg_fn)}(\"parts\") END AS \"chunk\" FROM (SELECT {sel}"
                f"list(\"partial\"{order}) FILTER (WHERE \"partial\" IS NOT NULL) AS \"parts\" "
                f"FROM (SELECT {inner_sel}{call} AS \"partial\" FROM {from_sql}{where}){group})"
                f"{ordered}")
        what = f"Aggregate {agg} over [{', '.join(aggregate.over)}] of join {join.join}"
        return body, what

    @staticmethod
    def _partial_fn(join: Join, aggregate: Aggregate, kernel: ContractChunk,
                    decode_rows: Callable, root: bool) -> Callable[..., pa.Array]:
        """The join's Arrow function when an Aggregate follows: a partial aggregate per batch.

        The rows of one batch that feed the same output chunk are folded in one call of the
        native executor's series kernel (:class:`ContractSeries`: the products accumulate
        into one tensor, in the order of the aggregated keys); that sum's handle is returned
        at the group's first row and NULL at its others, so one partial per output chunk and
        batch goes back to DuckDB instead of one per product. At the plan's ``root``, a
        run that asked for a dense result has the first partial of each chunk written straight
        into it (:meth:`ChunkArena.result_view`).
        """
        where: dict[str, tuple[int, int]] = {}  # label -> (source, dim) first carrying it
        for s, labels in enumerate(join.input_labels):
            for d, label in enumerate(labels):
                where.setdefault(label, (s, d))
        out_at = [where[label] for label in aggregate.relation.labels]
        over_at = [where[label] for label in aggregate.over if label in where]
        series = ContractSeries(kernel, arity=len(join.sources))
        out_grid, out_dtype = aggregate.relation.grid, torch_dtype(aggregate.relation.dtype)

        def run_partial(arena, *cols):
            decoded, keys, n_rows = decode_rows(arena, cols)
            groups: dict[Key, list[tuple[Key, int]]] = {}
            for r in range(n_rows):
                out_key = tuple(keys[s][r][d] for s, d in out_at)
                over_key = tuple(keys[s][r][d] for s, d in over_at)
                groups.setdefault(out_key, []).append((over_key, r))
            out: list[torch.Tensor | None] = [None] * n_rows

            def fold(key: Key, members: list[tuple[Key, int]]) -> torch.Tensor:
                # the first product into a tensor of its own (never into an input's memory)
                into = arena.result_view(key) if root else None
                if into is None:
                    into = torch.empty(out_grid.chunk_shape(key), dtype=out_dtype)
                return series.run_into([d[r] for _, r in members for d in decoded], into)

            # one job an output chunk (its products in the aggregated keys' order), the
            # longest series first (the threads finish together)
            order = sorted(((key, sorted(members)) for key, members in groups.items()),
                           key=lambda item: -len(item[1]))
            sums = arena.share([functools.partial(fold, key, members)
                                for key, members in order])
            for (_, members), total in zip(order, sums):
                out[members[0][1]] = total
            return arena.put(out)

        return run_partial


# -- entry points used by CompiledQuery and the SQL session -----------------------------

def _sync_views(compiled: CompiledPlan) -> None:
    """The store's tensor views in step with its catalog (temp views of the main connection;
    a write may have added tensors): for a plan that reads them."""
    sync = getattr(compiled.db.chunk_store, "sync_views", None)
    if sync is not None:
        sync()


@contextlib.contextmanager
def _query_connection(compiled: CompiledPlan, con: duckdb.DuckDBPyConnection | None,
                      plan: SQLPlan) -> Iterator[duckdb.DuckDBPyConnection]:
    """The connection ``plan``'s SQL runs on: ``con`` when the caller gave one; else a plan
    that reads the store's temp views runs on the main connection, whose views they are,
    under the store's lock of it; any other on a cursor of the calling thread's own --
    DuckDB refuses a connection two threads use at once, so queries from several threads
    each run on theirs (the plan's tables and functions are registered there)."""
    if con is not None:
        if plan.reads_views:
            _sync_views(compiled)
        yield con
        return
    store = compiled.db.chunk_store
    if plan.reads_views:
        with getattr(store, "main_connection_lock", contextlib.nullcontext()):
            _sync_views(compiled)
            yield compiled.db.connection
        return
    thread_cursor = getattr(store, "thread_cursor", None)
    if thread_cursor is not None:
        yield thread_cursor()
        return
    cursor = compiled.db.connection.cursor()  # a session whose store is not DuckDB's
    try:
        yield cursor
    finally:
        cursor.close()


def check_stored_layouts(root: LogicalNode, store: ChunkStore | None) -> None:
    """StaleTensorError unless every stored tensor ``root`` scans still has the shape, tiling
    and dtype the plan was made for -- one stored again differently since reads its chunks
    through the old grid (a page outside a chunk, a chunk of the wrong dtype), as the
    native executor's loads check (:func:`~tensorql.physical.kernels.check_layout`).

    >>> import numpy as np, tensorql as tq
    >>> db = tq.connect(backend="duckdb")
    >>> a = db.from_numpy("a", np.ones((2, 2)))
    >>> plan = (a * 2).compile().logical
    >>> _ = db.from_numpy("a", np.ones((2, 2), dtype=np.float32), replace=True)
    >>> try:
    ...     check_stored_layouts(plan, db.chunk_store)
    ... except tq.StaleTensorError as err:
    ...     print(str(err)[56:122])
    it is 2x2 float32 in tiles of 2x2 where the plan reads 2x2 float64
    """
    with pinned_scans(root, store):
        pass


@contextlib.contextmanager
def pinned_scans(root: LogicalNode, store: ChunkStore | None
                 ) -> Iterator[dict[str, StoredVersion]]:
    """The versions of the stored tensors ``root`` scans, pinned while the block runs (a
    replace or drop meanwhile keeps them), after checking that each still has the layout
    the plan was made for (:func:`check_stored_layouts`); {} without a store.

    >>> import numpy as np, tensorql as tq
    >>> db = tq.connect(backend="duckdb")
    >>> a = db.from_numpy("a", np.ones((2, 2)))
    >>> with pinned_scans((a * 2).compile().logical, db.chunk_store) as versions:
    ...     print(list(versions), versions["a"].meta.shape)
    ['a'] (2, 2)
    """
    if store is None:
        yield {}
        return
    scans = [node for node in walk(root) if isinstance(node, Scan) and node.constant is None
             and node.offset is None]
    # the versions the store resolves for a run (kept by the store, not a catalog query each)
    versions = store.pin(node.source for node in scans)
    try:
        _check_layouts(scans, versions)
        yield versions
    finally:
        store.unpin(versions.values())


def _check_layouts(scans: Sequence[Scan], versions: Mapping[str, StoredVersion]) -> None:
    for node in scans:
        meta = versions[node.source].meta
        rel = node.relation
        if meta.grid == rel.grid and meta.dtype == rel.dtype:
            continue

        def layout(grid: ChunkGrid, dtype: str) -> str:
            return (f"{'x'.join(map(str, grid.shape)) or 'a scalar'} {dtype} in tiles of "
                    f"{'x'.join(map(str, grid.tile)) or '()'}")
        raise StaleTensorError(
            f"stored tensor {node.source!r} changed since this query was planned: it is "
            f"{layout(meta.grid, meta.dtype)} where the plan reads {layout(rel.grid, rel.dtype)}"
            f" (it was stored again with another shape, dtype or tiling); build the expression "
            f"again, e.g. from db.tensor({node.source!r})")


def _session_arena(plan: SQLPlan, compiled: CompiledPlan, dense: bool) -> ChunkArena:
    """A run's arena with the session's workers and torch threads a worker."""
    options = getattr(compiled.db, "options", None)
    return plan.arena(dense=dense, threads=getattr(options, "workers", 1),
                      torch_threads=getattr(options, "intra_op_threads", 1))


def run_compiled(compiled: CompiledPlan, con: duckdb.DuckDBPyConnection | None = None,
                 dense: bool = False) -> QueryResult:
    """Run a compiled query on the DuckDB backend; a QueryResult like the native run's
    (``dense``: the dense result made during the run, the root's sums written into it)."""
    store = compiled.db.chunk_store
    with pinned_scans(compiled.logical, store) as versions:
        plan = SQLPlan.build(compiled.logical, store, versions)
        try:
            arena = _session_arena(plan, compiled, dense)
            with _query_connection(compiled, con, plan) as query_con:
                chunks, wall = plan.run(query_con, arena)
            plan.keep_loaded(arena, store)
        finally:
            plan.release()  # its functions are unregistered: the next plan may take the names
    rel = compiled.logical.relation
    missing = [k for k in rel.grid.keys() if k not in chunks]
    if missing:
        raise ExecutionError(f"DuckDB backend returned no chunk for keys {missing[:3]}")
    stats = RunStats(wall_s=wall, workers=1, tasks=len(chunks))
    assembled = plan.dense_result(chunks, arena) if dense else None
    return QueryResult(plan=compiled.physical, chunks=chunks, stats=stats, assembled=assembled)


def explain_compiled(compiled: CompiledPlan, con: duckdb.DuckDBPyConnection | None = None,
                     analyze: bool = False) -> tuple[str, torch.Tensor | None]:
    """EXPLAIN text of the DuckDB backend (the generated SQL, its steps and DuckDB's own plan):
    the plan a run would run now (on the versions it would pin, from the chunk cache where it
    holds a tensor; an expression whose tensors were stored again with another layout shows
    the plan of the tables the views name, as a run of it raises StaleTensorError); with
    ``analyze`` the query also runs, as :func:`run_compiled` runs it, and its dense result
    comes back."""
    store = compiled.db.chunk_store
    with contextlib.ExitStack() as stack:
        try:
            versions = stack.enter_context(pinned_scans(compiled.logical, store))
        except StaleTensorError:
            if analyze:
                raise
            _sync_views(compiled)
            versions = None
        plan = SQLPlan.build(compiled.logical, store, versions)
        stack.callback(plan.release)  # the same names in the next EXPLAIN of the query
        node = compiled.node
        shape = "x".join(map(str, node.shape)) or "scalar"
        lines = [f"{'EXPLAIN ANALYZE' if analyze else 'EXPLAIN'} {node.describe()} -> {shape} "
                 f"{node.dtype} (DuckDB backend)"]
        for name, what in plan.steps:
            lines.append(f"  {name}: {what}")
        lines.append("Generated SQL:")
        lines += ["  " + line for line in plan.sql.splitlines()]
        dense = None
        query_con = stack.enter_context(_query_connection(compiled, con, plan))
        if analyze:
            arena = _session_arena(plan, compiled, dense=False)
            chunks, wall = plan.run(query_con, arena)
            plan.keep_loaded(arena, store)
            rel = compiled.logical.relation
            dense = assemble(rel.grid, rel.dtype, chunks)
            lines.append(f"Measured: {wall * 1e3:.1f} ms wall, {len(chunks)} result chunk(s)")
        lines.append("DuckDB plan:")
        lines.append(plan.explain_analyze(query_con, analyze=analyze))
    return "\n".join(lines), dense
