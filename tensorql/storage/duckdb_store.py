"""The DuckDB chunk store: tensors at rest as chunk relations in an embedded database.

Each tensor is one catalog row (``tensorql_catalog``) plus one chunk table ``tq_chunks_<id>``
with a key column per dimension and a BLOB payload (the chunk's bytes). Storing a tensor is one
transaction; reads pull only the chunks asked for and view Arrow buffers without copying.
Plain SQL sees every tensor as element rows through a view named exactly as the tensor
(``d0, d1, ..., val``) and as chunks through ``"<name>__chunks"``.

>>> import numpy as np
>>> from tensorql.grid import ChunkGrid
>>> store = DuckDBChunkStore()
>>> meta = TensorMeta("v", (3,), "float32", ChunkGrid((3,), (2,)))
>>> store.put_tensor(meta, [((0,), np.ones(2, np.float32)), ((1,), np.full(1, 5, np.float32))])
>>> store.connection.sql('SELECT d0, val FROM "v" ORDER BY d0').fetchall()
[(0, 1.0), (1, 1.0), (2, 5.0)]
>>> store.close()
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator

import duckdb
import numpy as np
import pyarrow as pa
import torch

from tensorql.dtypes import SUPPORTED, itemsize
from tensorql.errors import StorageError, UnknownTensorError
from tensorql.grid import ChunkGrid, Key
from tensorql.storage.blob_codec import chunk_bytes, decode_payloads, decode_values, encode_payloads
from tensorql.storage.chunk_store import ChunkStore, TensorMeta, as_chunk_tensor, check_chunk
from tensorql.storage.sql_text import ddl, quote_ident

_VALUE_SQL_TYPE = {
    "float16": "FLOAT", "bfloat16": "FLOAT", "float32": "FLOAT", "float64": "DOUBLE",
    "int32": "INTEGER", "int64": "BIGINT", "bool": "BOOLEAN",
}


def values_function(dtype: str) -> str:
    """Name of the SQL function decoding a payload of ``dtype`` into a list of values."""
    return f"tq_values_{dtype}"


def register_functions(con: duckdb.DuckDBPyConnection) -> None:
    """Register the payload-decoding functions the element views use on ``con``."""
    for dtype in SUPPORTED:
        try:
            con.create_function(values_function(dtype), _decoder(dtype), [duckdb.sqltype("BLOB")],
                                duckdb.sqltype(f"{_VALUE_SQL_TYPE[dtype]}[]"), type="arrow")
        except duckdb.Error as err:
            if "already exists" not in str(err):
                raise


def _decoder(dtype: str):
    def decode(column):
        return decode_values(column, dtype)

    return decode


class DuckDBChunkStore(ChunkStore):
    """A ``ChunkStore`` in a DuckDB database file (``path``) or in memory (``path=None``).

    Another process holding the file makes ``__init__`` retry for ``lock_timeout`` seconds
    before raising StorageError: DuckDB allows one writing process per file.
    """

    def __init__(self, path: str | None = None, *, read_only: bool = False,
                 batch_bytes: int = 64 << 20, lock_timeout: float = 10.0,
                 cache_bytes: int = 1 << 30, duckdb_memory_bytes: int = 0) -> None:
        self.path = path
        self.cache = ChunkCache(cache_bytes)
        self.read_only = read_only
        self.batch_bytes = batch_bytes
        self.connection = self._open(path, read_only, lock_timeout)
        register_functions(self.connection)
        if not read_only:
            if duckdb_memory_bytes:
                self.connection.execute(f"SET memory_limit = '{int(duckdb_memory_bytes)}B'")
            self.connection.execute(ddl("catalog.sql"))
            self._remove_orphans()
        self._local = threading.local()
        self._write_lock = threading.RLock()
        self._tables: dict[str, tuple[str, TensorMeta]] = {}

    @staticmethod
    def _open(path, read_only, lock_timeout) -> duckdb.DuckDBPyConnection:
        deadline = time.monotonic() + lock_timeout
        while True:
            try:
                return duckdb.connect(path or ":memory:", read_only=read_only)
            except duckdb.Error as err:
                locked = "lock" in str(err).lower()
                if not locked or time.monotonic() > deadline:
                    raise StorageError(f"cannot open tensor database {path!r}: {err}") from err
                time.sleep(0.05)

    def _cursor(self) -> duckdb.DuckDBPyConnection:
        cursor = getattr(self._local, "cursor", None)
        if cursor is None:
            cursor = self.connection.cursor()
            self._local.cursor = cursor
        return cursor

    def close(self) -> None:
        try:
            self.connection.close()
        except duckdb.Error:  # pragma: no cover - closing twice
            pass

    # -- catalog ------------------------------------------------------------------------
    def names(self) -> list[str]:
        rows = self._cursor().execute(
            "SELECT name FROM tensorql_catalog ORDER BY name").fetchall()
        return [r[0] for r in rows]

    def has(self, name: str) -> bool:
        return self._lookup(name) is not None

    def _lookup(self, name: str) -> tuple[str, TensorMeta] | None:
        row = self._cursor().execute(
            "SELECT chunk_table, dtype, shape, tile FROM tensorql_catalog WHERE name = ?",
            [name]).fetchall()
        if not row:
            return None
        table, dtype, shape, tile = row[0]
        grid = ChunkGrid(tuple(shape), tuple(tile))
        return table, TensorMeta(name=name, shape=grid.shape, dtype=dtype, grid=grid)

    def _entry(self, name: str) -> tuple[str, TensorMeta]:
        entry = self._tables.get(name)
        if entry is None:
            entry = self._lookup(name)
            if entry is None:
                raise UnknownTensorError(name, self.names())
            self._tables[name] = entry
        return entry

    def meta(self, name: str) -> TensorMeta:
        self._tables.pop(name, None)  # always answer from the catalog
        return self._entry(name)[1]

    # -- writing ------------------------------------------------------------------------
    def put_tensor(self, meta: TensorMeta, chunks: Iterable[tuple[Key, np.ndarray | torch.Tensor]],
                   *, replace: bool = False) -> None:
        """Store ``meta``'s chunks: staged into a fresh chunk table batch by batch (bounded
        memory), then published by one transaction that adds the catalog row and the views.
        Until that commit nobody sees the tensor; a crash leaves only an unreferenced staging
        table, which the next writer removes."""
        if self.read_only:
            raise StorageError(f"cannot store {meta.name!r}: the database is open read-only")
        if not isinstance(meta.name, str) or not meta.name:
            raise StorageError(f"tensor name must be a non-empty string, got {meta.name!r}")
        quote_ident(meta.name)  # rejects NUL before anything is written
        with self._write_lock:
            con = self.connection
            if not replace and self._lookup(meta.name) is not None:
                raise StorageError(f"tensor {meta.name!r} already exists (pass replace=True)")
            table_id = con.execute("SELECT nextval('tensorql_chunk_table_seq')").fetchall()[0][0]
            table = f"tq_chunks_{table_id}"
            try:
                self._stage(con, meta, chunks, table)
                con.execute("BEGIN TRANSACTION")
                try:
                    old = self._lookup(meta.name)
                    if old is not None:
                        if not replace:
                            raise StorageError(
                                f"tensor {meta.name!r} already exists (pass replace=True)")
                        self._drop_objects(con, meta.name, old[0])
                    con.execute(
                        "INSERT INTO tensorql_catalog (name, chunk_table, dtype, shape, tile, "
                        "nbytes) VALUES (?, ?, ?, ?, ?, ?)",
                        [meta.name, table, meta.dtype, list(meta.shape), list(meta.grid.tile),
                         meta.nbytes])
                    self._create_views(con, meta, table)
                    con.execute("COMMIT")
                except BaseException:
                    _rollback(con)
                    raise
            except BaseException as err:
                _drop_table_quietly(con, table)
                if isinstance(err, duckdb.Error):
                    raise StorageError(f"storing tensor {meta.name!r} failed: {err}") from err
                raise
            finally:
                self._tables.pop(meta.name, None)

    def _stage(self, con, meta: TensorMeta, chunks, table: str) -> None:
        """Write every chunk into ``table``, a new chunk table nothing references yet."""
        ndim = meta.grid.ndim
        keys = "".join(f"{quote_ident(f'k{d}')} INTEGER NOT NULL, " for d in range(ndim))
        con.execute(ddl("chunk_table.sql").format(table=quote_ident(table), key_columns=keys))
        seen: set[Key] = set()
        batch: list[tuple[Key, np.ndarray]] = []
        batch_size = 0
        for key, data in chunks:
            key = meta.grid.check_key(key)
            if key in seen:
                raise StorageError(f"tensor {meta.name!r}: chunk {key} given twice")
            seen.add(key)
            payload = chunk_bytes(_with_dtype(data, meta.dtype))
            expected = meta.grid.chunk_shape(key)
            if payload.size != int(np.prod(expected, dtype=np.int64)) * itemsize(meta.dtype):
                check_chunk(meta, key, as_chunk_tensor(data, meta.dtype))
            batch.append((key, payload))
            batch_size += payload.size
            if batch_size >= self.batch_bytes:
                self._insert(con, table, ndim, batch)
                batch, batch_size = [], 0
        if batch:
            self._insert(con, table, ndim, batch)
        if len(seen) != meta.grid.num_chunks:
            raise StorageError(f"tensor {meta.name!r}: got {len(seen)} chunks, grid has "
                               f"{meta.grid.num_chunks}")

    def _remove_orphans(self) -> None:
        """Drop staging tables no catalog row references (left by an interrupted write)."""
        rows = self.connection.execute(
            "SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main' AND "
            "table_name LIKE 'tq_chunks_%' AND table_name NOT IN "
            "(SELECT chunk_table FROM tensorql_catalog)").fetchall()
        for (table,) in rows:
            _drop_table_quietly(self.connection, table)

    @staticmethod
    def _insert(con, table: str, ndim: int, batch: list[tuple[Key, np.ndarray]]) -> None:
        columns = {f"k{d}": pa.array(np.fromiter((k[d] for k, _ in batch), dtype=np.int32,
                                                 count=len(batch)))
                   for d in range(ndim)}
        columns["payload"] = encode_payloads([p for _, p in batch])
        arrow_batch = pa.table(columns)  # noqa: F841 - read by DuckDB through registration
        con.register("tq_insert_batch", arrow_batch)
        try:
            con.execute(f"INSERT INTO {quote_ident(table)} SELECT * FROM tq_insert_batch")
        finally:
            con.unregister("tq_insert_batch")

    @staticmethod
    def _create_views(con, meta: TensorMeta, table: str) -> None:
        grid = meta.grid
        keys = [quote_ident(f"k{d}") for d in range(grid.ndim)]
        key_list = "".join(f"{k}, " for k in keys)
        extents = [f"least({t}, {n} - {k} * {t})" for k, t, n in zip(keys, grid.tile, grid.shape)]
        coords = []
        for d, (k, t) in enumerate(zip(keys, grid.tile)):
            stride = " * ".join(extents[d + 1:]) or "1"
            coords.append(f"{k} * {t} + (i // ({stride})) % {extents[d]} AS d{d}")
        select = "".join(f"{c}, " for c in coords)
        decode = values_function(meta.dtype)
        con.execute(
            f"CREATE VIEW {quote_ident(meta.name)} AS SELECT {select}val FROM ("
            f"SELECT {key_list}generate_subscripts(vals, 1) - 1 AS i, unnest(vals) AS val "
            f"FROM (SELECT {key_list}{decode}(payload) AS vals FROM {quote_ident(table)}))")
        con.execute(f"CREATE VIEW {quote_ident(meta.name + '__chunks')} AS "
                    f"SELECT * FROM {quote_ident(table)}")

    @staticmethod
    def _drop_objects(con, name: str, table: str) -> None:
        con.execute(f"DROP VIEW IF EXISTS {quote_ident(name)}")
        con.execute(f"DROP VIEW IF EXISTS {quote_ident(name + '__chunks')}")
        con.execute(f"DROP TABLE IF EXISTS {quote_ident(table)}")
        con.execute("DELETE FROM tensorql_catalog WHERE name = ?", [name])

    def drop(self, name: str) -> None:
        if self.read_only:
            raise StorageError(f"cannot drop {name!r}: the database is open read-only")
        with self._write_lock:
            entry = self._lookup(name)
            if entry is None:
                raise UnknownTensorError(name, self.names())
            con = self.connection
            con.execute("BEGIN TRANSACTION")
            try:
                self._drop_objects(con, name, entry[0])
                con.execute("COMMIT")
            except BaseException:
                _rollback(con)
                raise
            self._tables.pop(name, None)

    # -- reading ------------------------------------------------------------------------
    def read_chunk(self, name: str, key: Key) -> torch.Tensor:
        table, meta = self._entry(name)
        key = meta.grid.check_key(key)
        cached = self.cache.get((table, key))
        if cached is not None:
            return cached
        where = " AND ".join(f"{quote_ident(f'k{d}')} = ?" for d in range(len(key))) or "TRUE"
        column = self._cursor().sql(
            f"SELECT payload FROM {quote_ident(table)} WHERE {where}", params=list(key)
        ).to_arrow_table().column(0)
        if len(column) != 1:
            raise StorageError(f"tensor {name!r}: chunk {key} is missing from {table}")
        chunk = decode_payloads(column, meta.dtype, [meta.grid.chunk_shape(key)])[0]
        self.cache.put((table, key), chunk)
        return chunk

    def read_chunks(self, name: str, keys: Iterable[Key]) -> Iterator[tuple[Key, torch.Tensor]]:
        """The chunks ``keys``, streamed from one query in record batches."""
        table, meta = self._entry(name)
        wanted = {meta.grid.check_key(k) for k in keys}
        ndim = meta.grid.ndim
        key_cols = ", ".join(quote_ident(f"k{d}") for d in range(ndim))
        select = f"SELECT {key_cols + ', ' if ndim else ''}payload FROM {quote_ident(table)}"
        rows = max(1, self.batch_bytes // max(1, meta.nbytes // max(1, meta.grid.num_chunks)))
        cursor = self.connection.cursor()  # its own: the caller may stop iterating early
        try:
            yield from self._iter_batches(cursor.sql(select).to_arrow_reader(rows), meta,
                                          wanted)
        finally:
            cursor.close()

    @staticmethod
    def _iter_batches(reader, meta: TensorMeta, wanted: set[Key]):
        ndim = meta.grid.ndim
        for batch in reader:
            batch_keys = list(zip(*(batch.column(d).to_numpy() for d in range(ndim)))) \
                if ndim else [()] * batch.num_rows
            batch_keys = [tuple(int(k) for k in key) for key in batch_keys]
            shapes = [meta.grid.chunk_shape(k) for k in batch_keys]
            tensors = decode_payloads(batch.column(ndim), meta.dtype, shapes)
            for key, tensor in zip(batch_keys, tensors):
                if key in wanted:
                    yield key, tensor


class ChunkCache:
    """A bounded LRU of decoded chunks, keyed by (chunk table, key).

    A stored tensor's chunk table is never rewritten (a replace makes a new table), so entries
    cannot go stale; dropped tables simply age out.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = max(0, int(capacity_bytes))
        self.size = 0
        self.hits = self.misses = 0
        self._items: OrderedDict[tuple[str, Key], torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, ident: tuple[str, Key]) -> torch.Tensor | None:
        with self._lock:
            chunk = self._items.get(ident)
            if chunk is None:
                self.misses += 1
                return None
            self._items.move_to_end(ident)
            self.hits += 1
            return chunk

    def put(self, ident: tuple[str, Key], chunk: torch.Tensor) -> None:
        nbytes = chunk.nbytes
        if nbytes > self.capacity:
            return
        with self._lock:
            if ident in self._items:
                return
            self._items[ident] = chunk
            self.size += nbytes
            while self.size > self.capacity:
                _, old = self._items.popitem(last=False)
                self.size -= old.nbytes


def _drop_table_quietly(con: duckdb.DuckDBPyConnection, table: str) -> None:
    try:
        con.execute(f"DROP TABLE IF EXISTS {quote_ident(table)}")
    except duckdb.Error:  # pragma: no cover - best effort; the next open retries
        pass


def _rollback(con: duckdb.DuckDBPyConnection) -> None:
    """Roll back if a transaction is still open (a failed COMMIT has already ended it)."""
    try:
        con.execute("ROLLBACK")
    except duckdb.Error:
        pass


def _with_dtype(data: np.ndarray | torch.Tensor, dtype: str) -> np.ndarray | torch.Tensor:
    """``data`` converted to ``dtype`` only when it is not already of it."""
    if isinstance(data, torch.Tensor):
        from tensorql.dtypes import torch_dtype

        return data if data.dtype == torch_dtype(dtype) else data.to(torch_dtype(dtype))
    from tensorql.dtypes import numpy_dtype

    target = numpy_dtype(dtype)
    return data if data.dtype == target else data.astype(target)
