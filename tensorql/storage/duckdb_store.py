"""The DuckDB chunk store: tensors at rest as chunk relations in an embedded database.

Each tensor is one catalog row (``tq_internal.tensorql_catalog``) plus one chunk table
``tq_internal.tq_chunks_<id>`` with a key column per dimension, a page number and a BLOB
payload: each chunk's bytes in 4 KiB pages (``tensorql.storage.pages``). Storing a tensor is
one transaction; reads pull only the chunks asked for and view Arrow buffers without copying.
Plain SQL on a tensorql connection sees every tensor as element rows through a view named
exactly as the tensor (``d0, d1, ..., val``) and as chunks through ``"<name>__chunks"``. Those
views decode chunk pages with tensorql's functions, so they are TEMP views of the tensorql
connection, never stored in the file: a plain DuckDB client opening the file sees nothing in
its ``main`` schema, the catalog and raw page tables in schema ``tq_internal``, and no view
that fails.

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

import functools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import torch
from cachetools import LRUCache
from tensorql_kernels.algebra import version_counter
from tensorql_kernels.packed_weights import mark_immutable

from tensorql.dtypes import SUPPORTED, itemsize
from tensorql.errors import StorageError, UnknownTensorError
from tensorql.grid import ChunkGrid, Key
from tensorql.storage.blob_codec import chunk_bytes, decode_values, view_bytes
from tensorql.storage.chunk_store import (
    ChunkStore,
    StoredVersion,
    TensorMeta,
    as_chunk_tensor,
    check_chunk,
    region_keys,
    region_slices,
)
from tensorql.storage.pages import PAGE_BYTES, encode_pages, join_page_lists, join_pages
from tensorql.storage.spill import remove_stale_files, spill_prefix
from tensorql.storage.sql_text import check_tensor_name, ddl, quote_ident
from tensorql.units import format_bytes

CATALOG_ALIAS = "tensorql"  # the name a database file is attached under
INTERNAL_SCHEMA = "tq_internal"  # the catalog and chunk tables: out of the user's ``main``
ROW_GROUP_ROWS = 16384  # 64 MiB of pages: a big write goes to the file row group by row group
JOIN_PAGES = "tq_join_pages"
CHUNK_VIEW_SUFFIX = "__chunks"  # a tensor's chunk view is named "<name>__chunks"
_RACE_RETRIES = 8  # reads that go again after a concurrent replace dropped their table
_INT32_MAX = 2**31 - 1  # past it, a view computes coordinates in BIGINT
# the chunk tables present in the store's database and schema (bound as two parameters):
# joined to the catalog, a row naming a table that is gone marks a damaged file
_TABLES = ("(SELECT table_name FROM duckdb_tables() WHERE database_name = ? "
           "AND schema_name = ?)")


def _is_text(name: str) -> bool:
    """Whether ``name`` is valid text (UTF-8 encodable: no lone surrogate).

    >>> _is_text("A"), _is_text("a\\ud800")
    (True, False)
    """
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def interrupts_as_python(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` with DuckDB's ``RuntimeError: Query interrupted`` (its Python client's
    answer to a Ctrl-C during a statement) raised as the KeyboardInterrupt it is.

    >>> @interrupts_as_python
    ... def statement():
    ...     raise RuntimeError("Query interrupted")
    >>> try:
    ...     statement()
    ... except KeyboardInterrupt:
    ...     print("interrupted")
    interrupted
    """
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except RuntimeError as err:
            if type(err) is RuntimeError and str(err) == "Query interrupted":
                raise KeyboardInterrupt from err
            raise

    return call

_VALUE_SQL_TYPE = {
    "float16": "FLOAT", "bfloat16": "FLOAT", "float32": "FLOAT", "float64": "DOUBLE",
    "int8": "TINYINT", "uint8": "UTINYINT", "int16": "SMALLINT", "int32": "INTEGER",
    "int64": "BIGINT",
    "bool": "BOOLEAN",
}


def values_function(dtype: str) -> str:
    """Name of the SQL function decoding a payload of ``dtype`` into a list of values."""
    return f"tq_values_{dtype}"


def register_functions(con: duckdb.DuckDBPyConnection) -> None:
    """Register on ``con`` the functions the views use: payload decoders for the element views
    and ``tq_join_pages(list of pages)`` for the chunk views."""
    blob = duckdb.sqltype("BLOB")
    functions = [(values_function(dtype), _decoder(dtype), [blob],
                  duckdb.sqltype(f"{_VALUE_SQL_TYPE[dtype]}[]")) for dtype in SUPPORTED]
    functions.append((JOIN_PAGES, join_page_lists, [duckdb.list_type(blob)], blob))
    for name, fn, params, returns in functions:
        try:
            con.create_function(name, fn, params, returns, type="arrow")
        except duckdb.Error as err:
            if "already exists" not in str(err):
                raise


def _decoder(dtype: str):
    def decode(column):
        return decode_values(column, dtype)

    return decode


class AbortedTransactionError(StorageError, duckdb.TransactionException):
    """The main connection's SQL transaction was aborted by an earlier error (ROLLBACK
    first): a StorageError that is DuckDB's TransactionException too, which the callers
    that answer an aborted transaction (a ROLLBACK passes) catch."""


class DuckDBChunkStore(ChunkStore):
    """A ``ChunkStore`` in a DuckDB database file (``path``) or in memory (``path=None``).

    Another process holding the file makes ``__init__`` retry for ``lock_timeout`` seconds
    before raising StorageError: DuckDB allows one writing process per file. A file is attached
    as catalog ``tensorql`` with 16 Ki-row row groups, so a large write streams to the file
    instead of collecting in memory; ``duckdb_memory_bytes`` caps DuckDB's memory for files.
    """

    def __init__(self, path: str | None = None, *, read_only: bool = False,
                 batch_bytes: int = 64 << 20, lock_timeout: float = 10.0,
                 cache_bytes: int = 1 << 30, duckdb_memory_bytes: int = 0) -> None:
        self.path = path
        self.cache = ChunkCache(cache_bytes)
        self.read_only = read_only
        self.batch_bytes = batch_bytes
        self._closed = False
        self._connection = self._open(path, read_only, lock_timeout)
        # the store's database, named in every reference to its tables: a user's USE of
        # another database on the main connection must not move them
        self.database = CATALOG_ALIAS if path is not None else "memory"
        if path is not None:  # spill files of a process killed while it spilled
            remove_stale_files(spill_prefix(path))
        register_functions(self.connection)
        try:
            if path is not None and duckdb_memory_bytes:
                self.connection.execute(f"SET memory_limit = '{int(duckdb_memory_bytes)}B'")
            self.schema = self._internal_schema()
        except duckdb.Error as err:  # e.g. a memory figure too small to open the file in
            self.connection.close()
            limit = (f" with DuckDB's memory limit at {format_bytes(duckdb_memory_bytes)} "
                     "(store_memory_limit, at most a quarter of process_memory_limit)"
                     if path is not None and duckdb_memory_bytes else "")
            raise StorageError(f"cannot open tensor database {path!r}{limit}: "
                               f"{str(err).splitlines()[0]}") from err
        if read_only and not self._has_catalog():
            self.connection.close()
            where = repr(path) if path is not None else "an in-memory database"
            raise StorageError(f"cannot open {where} read-only: it holds no tensorql catalog "
                               "(read_only opens a tensor database written before)")
        if not read_only:
            self.connection.execute(ddl("catalog.sql").format(schema=quote_ident(self.schema)))
            self._remove_orphans()
        self._paged_catalog = self._catalog_has_pages()
        self._unpaged_tables: set[str] = set()  # written before paging: one page per chunk
        self._local = threading.local()
        self._write_lock = threading.RLock()
        self._views_lock = threading.RLock()  # the main connection's temp views
        self._tables: dict[str, tuple[str, TensorMeta]] = {}
        self._views: dict[str, str] = {}  # tensor name -> chunk table its temp views read
        self._missing: dict[str, str] = {}  # tensor name -> its chunk table, gone (damaged)
        self._unviewable: dict[str, str] = {}  # tensor name -> why DuckDB refused its views
        # versions pinned by runs: a chunk table replaced or dropped while pinned is kept
        # (retired) until its last pin goes, then dropped by the next writer
        self._pins_lock = threading.Lock()
        self._pins: dict[str, int] = {}  # chunk table -> pins held
        self._retired: set[str] = set()  # replaced or dropped, still pinned
        self._unpinned: set[str] = set()  # replaced or dropped, no pin left: to drop
        # the current version of each tensor a pin resolved: a run pins without a catalog
        # query; only this store changes the catalog while it is open (DuckDB: one writer),
        # and every change it commits clears its names here (_release_tables)
        self._versions: dict[str, StoredVersion] = {}
        if not read_only:
            self._drop_stored_views()
        self.sync_views()

    @staticmethod
    def _open(path, read_only, lock_timeout) -> duckdb.DuckDBPyConnection:
        if path is None:
            return duckdb.connect(":memory:")
        con = duckdb.connect(":memory:")
        mode = "READ_ONLY, " if read_only else ""
        deadline = time.monotonic() + lock_timeout
        while True:
            try:
                con.execute(f"ATTACH ? AS {quote_ident(CATALOG_ALIAS)} "
                            f"({mode}ROW_GROUP_SIZE {ROW_GROUP_ROWS})", [path])
                break
            except duckdb.Error as err:
                locked = "lock" in str(err).lower()
                if not locked or time.monotonic() > deadline:
                    con.close()
                    raise StorageError(f"cannot open tensor database {path!r}: {err}") from err
                time.sleep(0.05)
        con.execute(f"USE {quote_ident(CATALOG_ALIAS)}")
        con.execute("SET temp_directory = ?", [path + ".tmp"])
        return con

    @property
    def connection(self) -> duckdb.DuckDBPyConnection:
        """The store's DuckDB connection; StorageError once :meth:`close` closed it (a
        tensor or statement of a closed session names that, not DuckDB's closed connection).

        >>> store = DuckDBChunkStore(); store.close()
        >>> store.connection
        Traceback (most recent call last):
        ...
        tensorql.errors.StorageError: the session is closed: its tensors and SQL can no longer \
be used (open it again with tq.connect)
        """
        self._check_open()
        return self._connection

    def _check_open(self) -> None:
        """StorageError once :meth:`close` closed the store."""
        if self._closed:
            raise StorageError("the session is closed: its tensors and SQL can no longer be "
                               "used (open it again with tq.connect)")

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A new cursor on the store's database (its own transaction, usable on one thread)."""
        cursor = self.connection.cursor()
        if self.path is not None:
            cursor.execute(f"USE {quote_ident(CATALOG_ALIAS)}")
        return cursor

    def thread_cursor(self) -> duckdb.DuckDBPyConnection:
        """The calling thread's own cursor on the store's database, made on its first use
        and kept (a query from several threads at once runs on each one's; DuckDB refuses a
        connection used by two threads at once). It sees committed data only, and none of
        the main connection's temp views."""
        return self._cursor()

    @property
    def main_connection_lock(self) -> threading.RLock:
        """Held by tensorql around its uses of the main connection (:attr:`connection`):
        its temp views' sync, and SQL statements run there, one thread at a time."""
        return self._views_lock

    def _cursor(self) -> duckdb.DuckDBPyConnection:
        cursor = getattr(self._local, "cursor", None)
        if cursor is None or self._closed:  # (a closed store's cursor: StorageError)
            cursor = self.cursor()
            self._local.cursor = cursor
        return cursor

    def _internal_schema(self) -> str:
        """Where the catalog and chunk tables live: the ``tq_internal`` schema, so that a plain
        DuckDB client's ``main`` holds only the user's own tables; files written before it
        keep theirs in ``main`` (read and written there, nothing is moved). A user's own
        table of that name -- without the catalog's ``chunk_table`` column -- is not one."""
        rows = self.connection.execute(
            "SELECT schema_name FROM duckdb_columns() WHERE database_name = current_database() "
            "AND table_name = 'tensorql_catalog' AND column_name = 'chunk_table'").fetchall()
        found = {row[0] for row in rows}
        return "main" if "main" in found and INTERNAL_SCHEMA not in found else INTERNAL_SCHEMA

    def _has_catalog(self) -> bool:
        rows = self.connection.execute(
            "SELECT count(*) FROM duckdb_tables() WHERE database_name = current_database() "
            "AND schema_name = ? AND table_name = 'tensorql_catalog'", [self.schema]).fetchall()
        return rows[0][0] > 0

    @property
    def _catalog(self) -> str:
        return f"{quote_ident(self.database)}.{quote_ident(self.schema)}.tensorql_catalog"

    def _ref(self, table: str) -> str:
        """The SQL reference of chunk table ``table`` (a name the store generated)."""
        return f"{quote_ident(self.database)}.{quote_ident(self.schema)}.{quote_ident(table)}"

    def _catalog_has_pages(self) -> bool:
        """False for a catalog written before chunks were paged (then read as one page each)."""
        rows = self.connection.execute(
            "SELECT count(*) FROM duckdb_columns() WHERE database_name = current_database() "
            "AND schema_name = ? AND table_name = 'tensorql_catalog' "
            "AND column_name = 'page_bytes'", [self.schema]).fetchall()
        return rows[0][0] > 0

    def _drop_stored_views(self) -> None:
        """Files written by earlier versions kept the tensor views in the file, where plain
        DuckDB clients found views they could not read: drop them (they are temp views now)."""
        rows = self.connection.execute(
            "SELECT view_name FROM duckdb_views() WHERE database_name = current_database() "
            f"AND NOT internal AND (view_name IN (SELECT name FROM {self._catalog}) OR "
            f"view_name IN (SELECT name || '__chunks' FROM {self._catalog}))").fetchall()
        for (view,) in rows:
            self.connection.execute(f"DROP VIEW IF EXISTS {quote_ident(view)}")

    def _commit_with_views(self, con: duckdb.DuckDBPyConnection,
                           staged: list[tuple[TensorMeta, str]],
                           olds: dict[str, tuple[str, TensorMeta] | None]) -> None:
        """Publish the views of the tensors ``staged`` (each with its new chunk table) and
        commit ``con``'s transaction, which holds their catalog rows; ``olds`` are the
        entries they replace. The views are temp views of the main connection: made there on
        the main thread, before the commit, under the views' lock until it is done; if DuckDB
        refuses one or the commit fails, the views made are undone (a replaced tensor's put
        back) and the error raised for the caller to roll back. A streamed write runs on a
        writer thread while the main connection may be busy: its views wait for
        :meth:`sync_views` (run before each SQL script and backend query)."""
        if threading.current_thread() is not threading.main_thread():
            for meta, _ in staged:
                self._views.pop(meta.name, None)
            con.execute("COMMIT")
            return
        with self._views_lock:
            made: list[tuple[str, str | None]] = []  # name, the table its views read before
            try:
                for meta, table in staged:
                    made.append((meta.name, self._views.get(meta.name)))
                    self._create_views(self.connection, meta, self._ref(table))
                    self._views[meta.name] = table
                con.execute("COMMIT")
            except BaseException:
                for name, before in reversed(made):
                    self._restore_views(name, before, olds.get(name))
                raise

    def _restore_views(self, name: str, before: str | None,
                       old: tuple[str, TensorMeta] | None) -> None:
        """Put back tensor ``name``'s views as they were before a write that failed: over
        chunk table ``before`` (its stored version ``old``), or none."""
        if before is not None and old is not None and old[0] == before:
            try:
                self._create_views(self.connection, old[1], self._ref(before),
                                   paged=self._is_paged(before))
                self._views[name] = before
                return
            except duckdb.Error:
                pass
        self._drop_own_views(name)

    def in_sql_transaction(self) -> bool:
        """Whether a transaction the user began with SQL (``BEGIN``) is open on the main
        connection (probed without disturbing it: DuckDB's Python API does not say). Tensors
        are stored and dropped in transactions of their own, which the user's ``ROLLBACK``
        would not undo.

        >>> store = DuckDBChunkStore()
        >>> store.in_sql_transaction()
        False
        >>> _ = store.connection.execute("BEGIN")
        >>> store.in_sql_transaction()
        True
        """
        con = self.connection
        try:  # each statement outside a transaction runs in one of its own, with a new id
            first = con.execute("SELECT txid_current()").fetchall()
            return con.execute("SELECT txid_current()").fetchall() == first
        except duckdb.TransactionException:  # one an earlier error aborted: still open
            return True

    def sync_views(self) -> None:
        """Create (or drop) this connection's temp views so they match the catalog, which
        another process or a writer thread may have changed. Each tensor's views are made on
        their own: a tensor whose chunk table is missing from the file (damaged) gets none and
        is recorded in :meth:`broken_tensors` (reading it raises StorageError naming the
        table; ``drop`` removes it), and one whose views DuckDB refuses (a temp table of
        that name) is recorded too, without failing the sync of the others. A failure of
        the sync as a whole is a StorageError (an aborted SQL transaction's is an
        :class:`AbortedTransactionError`, which its callers answer as DuckDB's)."""
        with self._views_lock:
            failed_before: dict[str, tuple[str, str]] | None = None
            for attempt in range(_RACE_RETRIES + 1):
                try:
                    failed = self._sync_views_once()
                except duckdb.TransactionException as err:
                    raise AbortedTransactionError(str(err)) from err
                except duckdb.Error as err:
                    where = repr(self.path) if self.path is not None else "in memory"
                    raise StorageError(f"cannot read the tensor catalog of the database "
                                       f"{where}: {str(err).splitlines()[0]}") from err
                # a view refused because a writer thread committed a replace or drop and
                # dropped the old chunk table between the catalog read and the view: read
                # the catalog again; the same refusal twice over is no race
                if not failed or failed == failed_before or attempt == _RACE_RETRIES:
                    self._unviewable = {name: why for name, (_, why) in failed.items()}
                    return
                failed_before = failed

    def broken_tensors(self) -> dict[str, str]:
        """Tensors of the catalog this connection has no views of, after the last
        :meth:`sync_views`: each with why (its chunk table missing from a damaged file, or
        its views refused by DuckDB). They stay listed by :meth:`names`; reading one whose
        table is missing raises StorageError, and :meth:`drop` removes it."""
        with self._views_lock:
            missing = {name: f"its chunk table {self.schema}.{table} is missing"
                       for name, table in self._missing.items()}
            return {**self._unviewable, **missing}

    def _sync_views_once(self) -> dict[str, tuple[str, str]]:
        """One pass of :meth:`sync_views` (the caller holds the views' lock): the tensors
        whose views DuckDB refused, each with its chunk table and the reason."""
        page_bytes = "page_bytes" if self._paged_catalog else "0"
        # the catalog rows and whether each chunk table exists, from one snapshot
        rows = self.connection.execute(
            f"SELECT c.name, c.chunk_table, c.dtype, c.shape, c.tile, {page_bytes}, "
            f"t.table_name IS NOT NULL FROM {self._catalog} c LEFT JOIN {_TABLES} t "
            "ON t.table_name = c.chunk_table", [self.database, self.schema]).fetchall()
        current = {row[0]: row for row in rows}
        for name in [n for n in self._views if n not in current]:
            self._drop_views(self.connection, name)
        self._missing = {row[0]: row[1] for row in rows if not row[6]}
        failed: dict[str, tuple[str, str]] = {}
        for name, table, dtype, shape, tile, paged, exists in current.values():
            if not exists:  # a damaged file: no views over a table that is gone
                if name in self._views:
                    self._drop_views(self.connection, name)
                continue
            if self._views.get(name) == table:
                continue
            if not paged:
                self._unpaged_tables.add(table)
            grid = ChunkGrid(tuple(shape), tuple(tile))
            try:
                self._create_views(self.connection,
                                   TensorMeta(name=name, shape=grid.shape, dtype=dtype,
                                              grid=grid), self._ref(table), paged=bool(paged))
            except duckdb.TransactionException:
                raise
            except duckdb.Error as err:
                self._drop_own_views(name)
                failed[name] = (table, f"its views could not be made: "
                                       f"{str(err).splitlines()[0]}")
                continue
            self._views[name] = table
        return failed

    def _drop_own_views(self, name: str) -> None:
        """After DuckDB refused tensor ``name``'s views: drop what of them was made (a view
        of that name; DuckDB refuses to drop a user's table as a view)."""
        for view in (name, name + CHUNK_VIEW_SUFFIX):
            try:
                self.connection.execute(f"DROP VIEW IF EXISTS temp.main.{quote_ident(view)}")
            except duckdb.Error:
                pass
        self._views.pop(name, None)

    def _missing_table_error(self, name: str, table: str) -> StorageError:
        return StorageError(
            f"tensor {name!r} cannot be read: its chunk table {self.schema}.{table} is missing "
            "from the database (the file is damaged); drop the tensor (db.drop("
            f"{name!r})) or store it again")

    def _table_exists(self, table: str) -> bool:
        rows = self._cursor().execute(
            "SELECT count(*) FROM duckdb_tables() WHERE database_name = ? AND schema_name = ? "
            "AND table_name = ?", [self.database, self.schema, table]).fetchall()
        return rows[0][0] > 0

    def chunk_pages_sql(self, name: str, version: StoredVersion | None = None) -> str | None:
        """The page rows ``k0.., page, payload`` that tensor ``name``'s chunk view joins (an
        SQL table expression on :attr:`connection`, current after :meth:`sync_views`), for
        readers that take a chunk's pages as they are stored (the DuckDB backend's kernels);
        None when this connection has no view of ``name``. With ``version`` (pinned by
        :meth:`pin`), the pages of that version, whatever the view shows now."""
        if version is None and name in self._missing:
            raise self._missing_table_error(name, self._missing[name])
        table = version.handle if version is not None else self._views.get(name)
        if table is None:
            return None
        ref = self._ref(table)
        return ref if self._is_paged(table) else f"(SELECT *, 0 AS page FROM {ref})"

    def close(self) -> None:
        if self._closed:
            return
        if not self.read_only and self._write_lock.acquire(blocking=False):
            try:
                self._drop_unpinned(self.connection)
            finally:
                self._write_lock.release()
        try:
            self.connection.close()
        except duckdb.Error:  # pragma: no cover - closing twice
            pass
        self._closed = True

    # -- catalog ------------------------------------------------------------------------
    def names(self) -> list[str]:
        rows = self._cursor().execute(
            f"SELECT name FROM {self._catalog} ORDER BY name").fetchall()
        return [r[0] for r in rows]

    def has(self, name: str) -> bool:
        return self._lookup(name) is not None

    def _lookup(self, name: str) -> tuple[str, TensorMeta] | None:
        if not isinstance(name, str) or not _is_text(name):  # never stored (a number would
            return None  # cast the column; DuckDB refuses a lone surrogate)
        page_bytes = "page_bytes" if self._paged_catalog else "0"
        row = self._cursor().execute(
            f"SELECT chunk_table, dtype, shape, tile, {page_bytes} FROM {self._catalog} "
            "WHERE name = ?", [name]).fetchall()
        if not row:
            return None
        table, dtype, shape, tile, paged = row[0]
        grid = ChunkGrid(tuple(shape), tuple(tile))
        if not paged:
            self._unpaged_tables.add(table)
        return table, TensorMeta(name=name, shape=grid.shape, dtype=dtype, grid=grid)

    def _is_paged(self, table: str) -> bool:
        return table not in self._unpaged_tables

    def _entry(self, name: str) -> tuple[str, TensorMeta]:
        if not isinstance(name, str):  # a list or dict as a name: never stored (nor hashable)
            raise UnknownTensorError(name, self.names())
        entry = self._tables.get(name)
        if entry is None:
            entry = self._lookup(name)
            if entry is None:
                raise UnknownTensorError(name, self.names())
            self._tables[name] = entry
        return entry

    def meta(self, name: str) -> TensorMeta:
        if isinstance(name, str):
            self._tables.pop(name, None)  # always answer from the catalog
        return self._entry(name)[1]

    # -- writing ------------------------------------------------------------------------
    def put_tensor(self, meta: TensorMeta, chunks: Iterable[tuple[Key, np.ndarray | torch.Tensor]],
                   *, replace: bool = False) -> None:
        """Store ``meta``'s chunks: staged into a fresh chunk table batch by batch (bounded
        memory), then published by one transaction that adds the catalog row and the views.
        Until that commit nobody sees the tensor; a crash leaves only an unreferenced staging
        table, which the next writer removes."""
        self.put_tensors([(meta, chunks)], replace=replace)

    @interrupts_as_python
    def put_tensors(self, items: Sequence[tuple[TensorMeta, Iterable[tuple[Key, Any]]]], *,
                    replace: bool = False) -> None:
        """Store several tensors in one commit: each is staged into its own chunk table, then
        one transaction publishes all of them (a training step's weights and optimizer state:
        after a crash either every tensor is of the new step or none is)."""
        names = [meta.name for meta, _ in items]
        for name in names:
            if self.read_only:
                raise StorageError(f"cannot store {name!r}: the database is open read-only")
            check_tensor_name(name)  # rejects NUL before anything is written
        if len(set(names)) != len(names):
            raise StorageError(f"tensor names given twice in one write: {names}")
        lowered = {name.lower(): name for name in names}
        for name in names:
            view = lowered.get(name.lower() + CHUNK_VIEW_SUFFIX)
            if view is not None:
                raise StorageError(f"tensor name {view!r} is the name of the chunk view of "
                                   f"{name!r}, stored in the same write; pick another name")
        with self._write_lock, self.cursor() as con:  # its own connection: a streamed
            # write runs on a writer thread while the query may use the main connection
            staged: list[tuple[TensorMeta, str]] = []
            try:
                for meta, chunks in items:
                    if not replace and self._lookup(meta.name) is not None:
                        raise StorageError(
                            f"tensor {meta.name!r} already exists (pass replace=True)")
                    self._check_name_free(meta.name, con)
                    table_id = con.execute(
                        f"SELECT nextval('{self.schema}.tensorql_chunk_table_seq')"
                    ).fetchall()[0][0]
                    table = f"tq_chunks_{table_id}"
                    staged.append((meta, table))
                    self._stage(con, meta, chunks, table)
                con.execute("BEGIN TRANSACTION")
                replaced: list[str] = []
                olds: dict[str, tuple[str, TensorMeta] | None] = {}
                try:
                    for meta, table in staged:
                        old = olds[meta.name] = self._lookup(meta.name)
                        if old is not None:
                            if not replace:
                                raise StorageError(
                                    f"tensor {meta.name!r} already exists (pass replace=True)")
                            self._drop_objects(con, meta.name)
                            replaced.append(old[0])
                        con.execute(
                            f"INSERT INTO {self._catalog} (name, chunk_table, dtype, shape, "
                            "tile, nbytes, page_bytes) VALUES (?, ?, ?, ?, ?, ?, ?)",
                            [meta.name, table, meta.dtype, list(meta.shape),
                             list(meta.grid.tile), meta.nbytes, PAGE_BYTES])
                    # the views before the commit: a view DuckDB refuses rolls the catalog
                    # rows back (held locked until the commit, so no sync sees them early)
                    self._commit_with_views(con, staged, olds)
                except BaseException:
                    _rollback(con)
                    raise
                self._release_tables(con, names, replaced)
            except BaseException as err:
                if not self._committed(staged):
                    for _, table in staged:
                        _drop_table_quietly(con, self._ref(table))
                if isinstance(err, duckdb.Error):
                    raise StorageError(f"storing tensor(s) {', '.join(names)} failed: "
                                       f"{err}") from err
                raise
            finally:
                with self._pins_lock:
                    for name in names:
                        self._tables.pop(name, None)
                        self._versions.pop(name, None)

    def _committed(self, staged: list[tuple[TensorMeta, str]]) -> bool:
        """Whether the catalog already points at the staged tables (the commit happened)."""
        if not staged:
            return False
        found = self._lookup(staged[0][0].name)
        return found is not None and found[0] == staged[0][1]

    def _check_name_free(self, name: str, con: duckdb.DuckDBPyConnection | None = None) -> None:
        """DuckDB's identifiers are case-insensitive: a tensor's views may not clash with
        another tensor's name in another case, nor with a table or view of the user's."""
        for other in self.names():
            if other != name and other.lower() == name.lower():
                raise StorageError(f"tensor name {name!r} clashes with the stored tensor "
                                   f"{other!r}: names are case-insensitive, as in DuckDB")
            if other.lower() + CHUNK_VIEW_SUFFIX == name.lower():
                raise StorageError(f"tensor name {name!r} is the name of the chunk view of the "
                                   f"stored tensor {other!r}; pick another name")
            if name.lower() + CHUNK_VIEW_SUFFIX == other.lower():
                raise StorageError(f"tensor name {name!r} would name its chunk view {other!r}, "
                                   "the name of a stored tensor; pick another name")
        for suffix in ("", CHUNK_VIEW_SUFFIX):
            # a writer's own connection: the main one may be running the query whose result
            # is being stored; it sees the file's tables and views, not the main connection's
            # temp ones, where the views go: asked there too, when it may be used now
            rows = self._clashes(con or self.connection, name + suffix,
                                 "(current_database(), 'temp')")
            if not rows and con is not None:
                rows = self._main_temp_clashes(name + suffix)
            if rows:
                raise StorageError(f"tensor name {name!r} clashes with the DuckDB table or view "
                                   f"{rows[0][0]!r} (names are case-insensitive); pick "
                                   "another name or drop that table")

    def check_name(self, name: str) -> None:
        """StorageError when tensor ``name``'s views would clash with a table or view (the
        main connection's temp ones included) or another tensor's name; nothing is written.
        A streamed write's writer thread cannot always ask the main connection (its query
        may be running there): a caller about to start one asks here first, on its thread."""
        with self._views_lock, self.cursor() as con:
            self._check_name_free(name, con)

    def _clashes(self, con: duckdb.DuckDBPyConnection, name: str, databases: str) -> list:
        """Tables and views (not a tensor's own views) named ``name`` in any case, that
        ``con`` sees in ``databases`` (an SQL list of database names)."""
        return con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name IN "
            f"{databases} AND lower(table_name) = lower(?) UNION ALL "
            "SELECT view_name FROM duckdb_views() WHERE NOT internal AND database_name IN "
            f"{databases} AND lower(view_name) = lower(?) AND view_name NOT IN "
            f"(SELECT name FROM {self._catalog} UNION ALL "
            f" SELECT name || '{CHUNK_VIEW_SUFFIX}' FROM {self._catalog})",
            [name, name]).fetchall()

    def _main_temp_clashes(self, name: str) -> list:
        """:meth:`_clashes` among the main connection's temp tables and views (a user's
        ``CREATE TEMP TABLE``), which a cursor does not see. Asked on the main thread (which
        makes the views) and by a writer thread when no other thread is using the main
        connection; a writer thread that cannot ask leaves the views to :meth:`sync_views`,
        which records a tensor whose views DuckDB refuses (:meth:`broken_tensors`)."""
        on_main = threading.current_thread() is threading.main_thread()
        if not self._views_lock.acquire(blocking=on_main):
            return []
        try:
            return self._clashes(self.connection, name, "('temp')")
        finally:
            self._views_lock.release()

    def _stage(self, con, meta: TensorMeta, chunks, table: str) -> None:
        """Write every chunk into ``table``, a new chunk table nothing references yet."""
        ndim = meta.grid.ndim
        keys = "".join(f"{quote_ident(f'k{d}')} INTEGER NOT NULL, " for d in range(ndim))
        con.execute(ddl("chunk_table.sql").format(table=self._ref(table), key_columns=keys))
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
                self._insert(con, self._ref(table), ndim, batch)
                batch, batch_size = [], 0
        if batch:
            self._insert(con, self._ref(table), ndim, batch)
        if len(seen) != meta.grid.num_chunks:
            raise StorageError(f"tensor {meta.name!r}: got {len(seen)} chunks, grid has "
                               f"{meta.grid.num_chunks}")

    def _remove_orphans(self) -> None:
        """Drop staging tables no catalog row references (left by an interrupted write)."""
        rows = self.connection.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database() "
            "AND schema_name = ? AND "
            "table_name LIKE 'tq_chunks_%' AND table_name NOT IN "
            f"(SELECT chunk_table FROM {self._catalog})", [self.schema]).fetchall()
        for (table,) in rows:
            _drop_table_quietly(self.connection, self._ref(table))

    @staticmethod
    def _insert(con, ref: str, ndim: int, batch: list[tuple[Key, np.ndarray]]) -> None:
        """Append ``batch``'s chunks as pages to the chunk table ``ref`` (an SQL reference)."""
        pages = encode_pages([p for _, p in batch])
        columns = {f"k{d}": pa.array(np.fromiter((k[d] for k, _ in batch), dtype=np.int32,
                                                 count=len(batch))[pages.chunk_index])
                   for d in range(ndim)}
        columns["page"] = pa.array(pages.page_numbers)
        columns["payload"] = pages.payload
        arrow_batch = pa.table(columns)  # noqa: F841 - read by DuckDB through registration
        con.register("tq_insert_batch", arrow_batch)
        try:
            con.execute(f"INSERT INTO {ref} SELECT * FROM tq_insert_batch")
        finally:
            con.unregister("tq_insert_batch")

    @staticmethod
    def _create_views(con, meta: TensorMeta, ref: str, paged: bool = True) -> None:
        """The temp views of a tensor over its chunk table ``ref`` (an SQL reference)."""
        grid = meta.grid
        source = ref if paged else \
            f"(SELECT *, 0 AS page FROM {ref})"  # written before paging
        keys = [quote_ident(f"k{d}") for d in range(grid.ndim)]
        key_list = "".join(f"{k}, " for k in keys)
        # a dim of 2^31 or more counts in BIGINT (the keys are INTEGER: k * tile overflowed)
        wide = [f"CAST({k} AS BIGINT)" if n > _INT32_MAX else k
                for k, n in zip(keys, grid.shape)]
        extents = [f"least({t}, {n} - {k} * {t})" for k, t, n in zip(wide, grid.tile, grid.shape)]
        coords = []
        for d, (k, t) in enumerate(zip(wide, grid.tile)):
            stride = " * ".join(extents[d + 1:]) or "1"
            coords.append(f"{k} * {t} + (i // ({stride})) % {extents[d]} AS d{d}")
        select = "".join(f"{c}, " for c in coords)
        decode = values_function(meta.dtype)
        per_page = PAGE_BYTES // itemsize(meta.dtype)
        con.execute(
            f"CREATE OR REPLACE TEMP VIEW {quote_ident(meta.name)} AS SELECT {select}val FROM ("
            f"SELECT {key_list}page * {per_page} + generate_subscripts(vals, 1) - 1 AS i, "
            f"unnest(vals) AS val "
            f"FROM (SELECT {key_list}page, {decode}(payload) AS vals FROM {source}))")
        group = f" GROUP BY {', '.join(keys)}" if keys else ""
        con.execute(f"CREATE OR REPLACE TEMP VIEW {quote_ident(meta.name + '__chunks')} AS "
                    f"SELECT {key_list}{JOIN_PAGES}(list(payload ORDER BY page)) AS payload "
                    f"FROM {source}{group}")

    def _drop_views(self, con, name: str) -> None:
        self._missing.pop(name, None)  # (a dropped tensor is broken no more)
        self._unviewable.pop(name, None)
        for view in (name, name + "__chunks"):
            con.execute(f"DROP VIEW IF EXISTS temp.main.{quote_ident(view)}")
        self._views.pop(name, None)

    def _drop_objects(self, con, name: str) -> None:
        """Remove ``name``'s catalog row (its chunk table goes after the commit, by
        :meth:`_release_tables`, unless a run still reads it; its temp views, on the main
        connection, are the caller's to drop or replace)."""
        con.execute(f"DELETE FROM {self._catalog} WHERE name = ?", [name])

    def _release_tables(self, con, names: Sequence[str], tables: Sequence[str]) -> None:
        """After a commit that replaced or dropped ``names``, whose chunk tables were
        ``tables``: drop each table no run has pinned; a pinned one is retired, dropped by
        a writer after its last pin goes. (A crash before the drop leaves a table no catalog
        row names, which the next writer to open the file removes.)"""
        with self._pins_lock:  # a pin resolves and counts under this lock: after this
            # section no pin can reach the old tables
            for name in names:
                self._tables.pop(name, None)
                self._versions.pop(name, None)
            for table in tables:
                if self._pins.get(table):
                    self._retired.add(table)
                else:
                    self._unpinned.add(table)
        self._drop_unpinned(con)

    def _drop_unpinned(self, con) -> None:
        """Drop the replaced chunk tables no pin holds (the caller holds the write lock)."""
        with self._pins_lock:
            tables, self._unpinned = self._unpinned, set()
        for table in sorted(tables):
            _drop_table_quietly(con, self._ref(table))

    @interrupts_as_python
    def drop(self, name: str) -> None:
        if self.read_only:
            raise StorageError(f"cannot drop {name!r}: the database is open read-only")
        # its own connection, as a write's: another thread may be using the main one
        with self._write_lock, self.cursor() as con:
            entry = self._lookup(name)
            if entry is None:
                raise UnknownTensorError(name, self.names())
            con.execute("BEGIN TRANSACTION")
            try:
                self._drop_objects(con, name)
                con.execute("COMMIT")
            except BaseException:
                _rollback(con)
                raise
            self._release_tables(con, [name], [entry[0]])
        # its views on the main connection, once no SQL of another thread runs there; a
        # user's own statement running there meanwhile leaves them to the next sync
        with self._views_lock:
            try:
                self._drop_views(self.connection, name)
            except duckdb.Error:
                pass

    # -- reading ------------------------------------------------------------------------
    def _current(self, name: str, table: str, err: duckdb.Error) -> tuple[str, TensorMeta]:
        """The entry of ``name`` after a read of its chunk table ``table`` failed with ``err``:
        a ``replace=True`` from another thread committed and dropped that table between the
        catalog lookup and the read, so the read goes again to the new version; any other
        error (or the same table still named) is raised as it is."""
        if not isinstance(err, duckdb.CatalogException) or table not in str(err):
            raise err
        self._tables.pop(name, None)
        entry = self._entry(name)  # UnknownTensorError if it was dropped meanwhile
        if entry[0] == table:
            if not self._table_exists(table):  # a damaged file: the catalog names a table
                raise self._missing_table_error(name, table) from err  # that is gone
            raise err
        return entry

    def pin(self, names: Iterable[str]) -> dict[str, StoredVersion]:
        """As :meth:`ChunkStore.pin`: each tensor's chunk table, counted, so that a replace
        or drop keeps it until :meth:`unpin`. The tables come from the catalog, in one query
        for the names not pinned since this store last changed them.

        >>> from tensorql.grid import ChunkGrid
        >>> store = DuckDBChunkStore()
        >>> meta = TensorMeta("v", (2,), "float32", ChunkGrid((2,), (2,)))
        >>> store.put_tensor(meta, [((0,), np.zeros(2, np.float32))])
        >>> pinned = store.pin(["v"])
        >>> store.put_tensor(meta, [((0,), np.ones(2, np.float32))], replace=True)
        >>> store.read_chunk_at(pinned["v"], (0,)).tolist(), store.read_chunk("v", (0,)).tolist()
        ([0.0, 0.0], [1.0, 1.0])
        >>> store.unpin(pinned.values()); store.close()
        """
        self._check_open()  # a run pins what it reads first: none starts on a closed store
        names = list(dict.fromkeys(names))
        if not names:
            return {}
        with self._pins_lock:  # (a writer clears _versions under it after its commit)
            unknown = [name for name in names if name not in self._versions]
            if unknown:
                self._versions.update(self._catalog_versions(unknown))
            pinned = {name: self._versions[name] for name in names}
            for version in pinned.values():
                self._pins[version.handle] = self._pins.get(version.handle, 0) + 1
        return pinned

    def _catalog_versions(self, names: list[str]) -> dict[str, StoredVersion]:
        """The current version of each of ``names``, from the catalog in one query."""
        page_bytes = "page_bytes" if self._paged_catalog else "0"
        rows = self._cursor().execute(
            f"SELECT c.name, c.chunk_table, c.dtype, c.shape, c.tile, {page_bytes}, "
            f"t.table_name IS NOT NULL FROM {self._catalog} c LEFT JOIN {_TABLES} t "
            "ON t.table_name = c.chunk_table WHERE list_contains(?, c.name)",
            [self.database, self.schema, names]).fetchall()
        found = {row[0]: row[1:] for row in rows}
        missing = [name for name in names if name not in found]
        if missing:
            raise UnknownTensorError(missing[0], self.names())
        versions = {}
        for name in names:
            table, dtype, shape, tile, paged, exists = found[name]
            if not exists:  # a damaged file: the catalog names a chunk table that is gone
                raise self._missing_table_error(name, table)
            if not paged:
                self._unpaged_tables.add(table)
            grid = ChunkGrid(tuple(shape), tuple(tile))
            meta = TensorMeta(name=name, shape=grid.shape, dtype=dtype, grid=grid)
            versions[name] = StoredVersion(meta, table)
        return versions

    def unpin(self, versions: Iterable[StoredVersion]) -> None:
        """As :meth:`ChunkStore.unpin`. A retired table whose last pin goes is dropped now if
        no write is under way, else by the next writer (a run must not wait for a write --
        a streamed store may be waiting for that run's chunks)."""
        with self._pins_lock:
            for version in versions:
                table = version.handle
                left = self._pins.get(table, 0) - 1
                if left > 0:
                    self._pins[table] = left
                    continue
                self._pins.pop(table, None)
                if table in self._retired:
                    self._retired.discard(table)
                    self._unpinned.add(table)
            drop = bool(self._unpinned)
        if drop and not self.read_only and self._write_lock.acquire(blocking=False):
            try:
                with self.cursor() as con:
                    self._drop_unpinned(con)
            finally:
                self._write_lock.release()

    def read_chunk(self, name: str, key: Key) -> torch.Tensor:
        table, meta = self._entry(name)
        key = meta.grid.check_key(key)
        for attempt in range(_RACE_RETRIES + 1):
            cached = self.cache.get((table, key))
            if cached is not None:
                return cached
            try:
                result = self._read_pages(table, key)
                break
            except duckdb.Error as err:
                if attempt == _RACE_RETRIES:
                    raise
                table, meta = self._current(name, table, err)
                key = meta.grid.check_key(key)
        return self._chunk_of(meta, table, key, result)

    def read_chunk_at(self, version: StoredVersion, key: Key) -> torch.Tensor:
        """As :meth:`ChunkStore.read_chunk_at`: from the pinned version's chunk table."""
        table, meta = version.handle, version.meta
        key = meta.grid.check_key(key)
        cached = self.cache.get((table, key))
        if cached is not None:
            return cached
        return self._chunk_of(meta, table, key, self._read_pages_at(meta.name, table, key))

    def cached_chunks_at(self, version: StoredVersion, keys: Iterable[Key]
                         ) -> dict[Key, torch.Tensor] | None:
        """The chunks ``keys`` of the pinned ``version`` when the chunk cache holds every one
        of them, else None; nothing is read from the tables either way.

        >>> from tensorql.grid import ChunkGrid
        >>> store = DuckDBChunkStore()
        >>> meta = TensorMeta("v", (4,), "float32", ChunkGrid((4,), (2,)))
        >>> store.put_tensor(meta, [((0,), np.zeros(2, np.float32)),
        ...                         ((1,), np.ones(2, np.float32))])
        >>> version = store.pin(["v"])["v"]
        >>> store.cached_chunks_at(version, [(0,), (1,)]) is None  # nothing read yet
        True
        >>> _ = [store.read_chunk_at(version, k) for k in [(0,), (1,)]]
        >>> sorted(store.cached_chunks_at(version, [(0,), (1,)]))
        [(0,), (1,)]
        >>> store.unpin([version]); store.close()
        """
        table = version.handle
        found = {}
        for key in keys:
            chunk = self.cache.get((table, key))
            if chunk is None:
                return None
            found[key] = chunk
        return found

    def cache_chunk_at(self, version: StoredVersion, key: Key, chunk: torch.Tensor) -> None:
        """Keep ``chunk``, decoded by a reader of the pinned ``version``'s pages of its own
        (the DuckDB backend's page loader), in the chunk cache as its chunk ``key``, as a
        read of it here would (the regions cut from it before are views of it from now on).
        The caller must not write it afterwards."""
        self.cache.put((version.handle, key), chunk)
        self.cache.discard_regions_within(version.handle, version.meta.grid, key)

    def _chunk_of(self, meta: TensorMeta, table: str, key: Key, result: pa.Table,
                  cache: bool = True):
        """Chunk ``key`` decoded from its page rows ``result`` read from ``table``, cached
        unless ``cache`` is False; a cached chunk replaces the regions cut from it before
        (they are views of it from now on)."""
        if result.num_rows == 0:
            raise StorageError(f"tensor {meta.name!r}: chunk {key} is missing from {table}")
        chunk = self._decode(meta, key, result.column(0).to_numpy(), result.column(1))
        if cache:
            self.cache.put((table, key), chunk)
            self.cache.discard_regions_within(table, meta.grid, key)
        return chunk

    def _read_pages(self, table: str, key: Key) -> pa.Table:
        where = " AND ".join(f"{quote_ident(f'k{d}')} = ?" for d in range(len(key))) or "TRUE"
        page = "page" if self._is_paged(table) else "0 AS page"
        return self._cursor().sql(
            f"SELECT {page}, payload FROM {self._ref(table)} WHERE {where}", params=list(key)
        ).to_arrow_table()

    def _read_pages_at(self, name: str, table: str, key: Key) -> pa.Table:
        """:meth:`_read_pages` of a pinned version of tensor ``name``: a chunk table missing
        from a damaged file is a StorageError naming the tensor and the table."""
        try:
            return self._read_pages(table, key)
        except duckdb.CatalogException as err:
            if not self._table_exists(table):
                raise self._missing_table_error(name, table) from err
            raise

    def read_region_at(self, version: StoredVersion, lo: Sequence[int],
                       hi: Sequence[int]) -> torch.Tensor:
        """As :meth:`ChunkStore.read_region_at`, with the chunk cache holding what the plan
        reads and no more: a region that is a whole chunk is that chunk; one inside a chunk
        the cache holds is a view of it (no bytes more); any other region is cut from the
        chunks it overlaps, decoded without being cached, and the region alone is cached
        (under its table, so a replaced tensor's regions are never served). A rank reading
        half of each of two stored chunks holds the two halves, not the two chunks.
        """
        lo, hi = tuple(int(a) for a in lo), tuple(int(b) for b in hi)
        ident = (version.handle, ("region", *lo, *hi))
        cached = self.cache.get(ident)
        if cached is not None:
            return cached
        table, meta = version.handle, version.meta
        grid = meta.grid
        keys = region_keys(grid, lo, hi)
        if len(keys) == 1:
            (key,) = keys
            if grid.slices(key) == tuple(slice(a, b) for a, b in zip(lo, hi)):
                return self.read_chunk_at(version, key)  # the region is one stored chunk
            chunk = self.cache.get((table, meta.grid.check_key(key)))
            if chunk is not None:  # a view of the cached chunk
                return chunk[region_slices(grid, key, lo, hi)[0]]
        region = None
        for key in keys:
            key = grid.check_key(key)
            chunk = self.cache.get((table, key))
            if chunk is None:
                chunk = self._chunk_of(meta, table, key,
                                       self._read_pages_at(meta.name, table, key), cache=False)
            if region is None:
                region = torch.empty(tuple(b - a for a, b in zip(lo, hi)), dtype=chunk.dtype)
            src, dst = region_slices(grid, key, lo, hi)
            region[dst] = chunk[src]
        assert region is not None  # a region overlaps at least one chunk
        self.cache.put(ident, region)
        return region

    @staticmethod
    def _decode(meta: TensorMeta, key: Key, page_numbers: np.ndarray,
                payload: pa.ChunkedArray | pa.Array) -> torch.Tensor:
        """One chunk from its page rows (in page order as scanned; re-sorted if not)."""
        if np.any(page_numbers != np.arange(len(page_numbers))):
            if isinstance(payload, pa.ChunkedArray):
                payload = payload.combine_chunks()
            order = np.argsort(page_numbers, kind="stable")
            if np.any(page_numbers[order] != np.arange(len(order))):
                raise StorageError(f"tensor {meta.name!r}: chunk {key} has pages "
                                   f"{sorted(page_numbers.tolist())}, expected 0..n-1")
            payload = payload.take(pa.array(order))
        raw = join_pages(payload)
        shape = meta.grid.chunk_shape(key)
        expected = int(np.prod(shape, dtype=np.int64)) * itemsize(meta.dtype)
        if raw.size != expected:
            raise StorageError(f"tensor {meta.name!r}: chunk {key} holds "
                               f"{format_bytes(raw.size)} ({raw.size} bytes), expected "
                               f"{format_bytes(expected)} ({expected} bytes)")
        return view_bytes(raw, meta.dtype, shape)

    def read_chunks(self, name: str, keys: Iterable[Key]) -> Iterator[tuple[Key, torch.Tensor]]:
        """The chunks ``keys``, streamed from one scan in record batches."""
        table, meta = self._entry(name)
        keys = list(keys)
        wanted = {meta.grid.check_key(k) for k in keys}
        rows = max(1024, self.batch_bytes // PAGE_BYTES)
        cursor = self.cursor()  # its own: the caller may stop iterating early
        try:
            for attempt in range(_RACE_RETRIES + 1):
                ndim = meta.grid.ndim
                key_cols = "".join(f"{quote_ident(f'k{d}')}, " for d in range(ndim))
                page = "page" if self._is_paged(table) else "0 AS page"
                select = f"SELECT {key_cols}{page}, payload FROM {self._ref(table)}"
                try:  # the scan's snapshot holds its table: only opening it can race
                    reader = cursor.sql(select).to_arrow_reader(rows)
                    break
                except duckdb.Error as err:
                    if attempt == _RACE_RETRIES:
                        raise
                    table, meta = self._current(name, table, err)
                    wanted = {meta.grid.check_key(k) for k in keys}
            yield from self._group_pages(reader, meta, wanted)
        finally:
            cursor.close()

    def _group_pages(self, reader, meta: TensorMeta, wanted: set[Key]):
        """Chunks from a scan of page rows; a chunk's pages are consecutive rows (they were
        inserted so), and a chunk cut by a record-batch boundary is joined across it."""
        ndim = meta.grid.ndim
        carry_key: Key | None = None
        carry: list[tuple[np.ndarray, pa.Array]] = []  # pages of carry_key seen so far

        def finish():
            pages = np.concatenate([p for p, _ in carry])
            payload = pa.chunked_array([b for _, b in carry], type=carry[0][1].type)
            return carry_key, self._decode(meta, carry_key, pages, payload)

        for batch in reader:
            if batch.num_rows == 0:
                continue
            key_arrays = [batch.column(d).to_numpy() for d in range(ndim)]
            pages = batch.column(ndim).to_numpy()
            payload = batch.column(ndim + 1)
            change = np.zeros(batch.num_rows, dtype=bool)
            change[0] = True
            for arr in key_arrays:
                change[1:] |= arr[1:] != arr[:-1]
            starts = np.flatnonzero(change).tolist() + [batch.num_rows]
            for lo, hi in zip(starts[:-1], starts[1:]):
                key = tuple(int(arr[lo]) for arr in key_arrays)
                if key != carry_key:
                    if carry:
                        yield finish()
                    carry, carry_key = [], key
                if key in wanted:
                    carry.append((pages[lo:hi], payload.slice(lo, hi - lo)))
        if carry:
            yield finish()


class ChunkCache:
    """A bounded LRU of decoded chunks, keyed by (chunk table, key).

    A stored tensor's chunk table is never rewritten (a replace makes a new table), so entries
    cannot go stale; dropped tables simply age out. An entry written in place since it was
    cached (its version counter moved: a user's join function that wrote its operand) is
    dropped when next asked for, and the chunk decoded again from the table.

    >>> cache = ChunkCache(1 << 20)
    >>> cache.put(("t", (0,)), torch.zeros(3))
    >>> _ = cache.get(("t", (0,))).add_(1.0)  # written in place by someone
    >>> cache.get(("t", (0,))) is None
    True
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = max(0, int(capacity_bytes))
        self.hits = self.misses = 0
        # cachetools' LRU, sized in bytes (each chunk weighs its nbytes); it is not
        # thread-safe, so every access holds the lock
        self._items: LRUCache[tuple[str, Key], tuple[torch.Tensor, int | None]] = LRUCache(
            maxsize=max(1, self.capacity), getsizeof=_chunk_bytes)
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        """Bytes of the chunks held."""
        return int(self._items.currsize)

    def items(self) -> list[tuple[tuple[str, Key], torch.Tensor]]:
        """Every cached chunk with its (chunk table, key), least recently used first."""
        with self._lock:
            return [(ident, entry[0]) for ident, entry in self._items.items()]

    def get(self, ident: tuple[str, Key]) -> torch.Tensor | None:
        with self._lock:
            entry = self._items.get(ident)
            if entry is not None and version_counter(entry[0]) != entry[1]:
                del self._items[ident]  # written in place since: decoded again
                entry = None
            if entry is None:
                self.misses += 1
                return None
            self.hits += 1
            return entry[0]

    def put(self, ident: tuple[str, Key], chunk: torch.Tensor) -> None:
        if chunk.nbytes > self.capacity or self.capacity == 0:
            return
        with self._lock:
            if ident in self._items:
                return
            # never written again: products may use a packed copy of it while it is cached
            mark_immutable(chunk)
            # the least recently used go, to stay within capacity
            self._items[ident] = (chunk, version_counter(chunk))

    def discard_regions_within(self, table: str, grid: Any, key: Key) -> None:
        """Drop the cached regions of ``table`` that lie inside its chunk ``key`` (cached
        now: such a region is read as a view of it from now on)."""
        bounds = [grid.dim_extent(d, b) for d, b in enumerate(key)]
        with self._lock:
            for ident in [i for i in self._items if i[0] == table and i[1]
                          and i[1][0] == "region"]:
                coords = ident[1][1:]
                lo, hi = coords[:len(bounds)], coords[len(bounds):]
                if all(blo <= a and b <= bhi for (blo, bhi), a, b in zip(bounds, lo, hi)):
                    del self._items[ident]


def _chunk_bytes(entry: tuple[torch.Tensor, int | None]) -> int:
    return max(1, entry[0].nbytes)


def _drop_table_quietly(con: duckdb.DuckDBPyConnection, ref: str) -> None:
    """Drop chunk table ``ref`` (an SQL reference), if it can be."""
    try:
        con.execute(f"DROP TABLE IF EXISTS {ref}")
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
