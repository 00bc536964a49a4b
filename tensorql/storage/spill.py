"""DuckDB as the spill tier: chunk copies the host tier has no room for, as BLOB pages.

A :class:`SpillSpace` belongs to a session. It writes into the session's DuckDB file, or,
for an in-memory session, into a temporary DuckDB file of its own (made at the first spill,
deleted at close). Each run that spills gets a :class:`SpillPages`: one table
``tq_internal."tq_spill_<run id>"`` of ``(id BIGINT, page INTEGER, payload BLOB)`` rows, a
chunk being the 4 KiB pages of its C-contiguous bytes (as chunks at rest, ``pages.py``; no
pickle), written in one transaction per chunk and read back by ``id``. The table is dropped
when the run ends; a process killed mid-run leaves it behind, and the next writer to open
the file drops every ``tq_spill_*`` table (:func:`clear_leftovers`: only one process may
write a DuckDB file, so any found then are leftovers). Temporary files of in-memory
sessions are named after their process; an in-memory session removes those of processes
that no longer run.

>>> import torch
>>> space = SpillSpace()  # an in-memory session's: a temporary DuckDB file
>>> pages = space.open_run("r1")
>>> n = pages.write(torch.arange(3000, dtype=torch.float32))
>>> pages.read(n, (3000,), "float32")[-1].item(), pages.bytes_written
(2999.0, 12000)
>>> pages.close(); path = space.path; space.close()
>>> os.path.exists(path)
False
"""

from __future__ import annotations

import glob
import itertools
import logging
import os
import tempfile
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from tensorql.dtypes import canonical_dtype, itemsize
from tensorql.errors import StorageError
from tensorql.storage.blob_codec import chunk_bytes, view_bytes
from tensorql.storage.pages import encode_pages, join_pages
from tensorql.storage.sql_text import quote_ident

log = logging.getLogger("tensorql.spill")

SPILL_PREFIX = "tq_spill_"
SCHEMA = "tq_internal"
_TEMP_PATTERN = "tensorql-spill-{pid}-*.duckdb"
_RUNS = itertools.count(1)


def clear_leftovers(con: Any, schema: str = SCHEMA) -> list[str]:
    """Drop every spill table in ``schema`` of ``con``'s current database (a crashed run's);
    the names dropped."""
    rows = con.execute(
        "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database() "
        "AND schema_name = ? AND starts_with(table_name, ?)", [schema, SPILL_PREFIX]).fetchall()
    for (table,) in rows:
        con.execute(f"DROP TABLE IF EXISTS {quote_ident(schema)}.{quote_ident(table)}")
    if rows:
        log.info("dropped %d spill table(s) a crashed run left behind", len(rows))
    return [table for (table,) in rows]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temp_files(directory: str | None = None) -> list[str]:
    """Remove the temporary spill files of in-memory sessions whose process is gone."""
    directory = directory or tempfile.gettempdir()
    removed = []
    for path in glob.glob(os.path.join(directory, _TEMP_PATTERN.format(pid="*"))):
        try:
            pid = int(os.path.basename(path).split("-")[2])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            for leftover in (path, path + ".wal"):
                try:
                    os.remove(leftover)
                    removed.append(leftover)
                except FileNotFoundError:
                    pass
    return removed


class SpillSpace:
    """Where a session's runs spill: ``store`` (a file-backed ``DuckDBChunkStore``) or, with
    none, a temporary DuckDB file in ``directory`` made at the first spill and deleted by
    :meth:`close`. ``memory_bytes`` caps a temporary file's DuckDB memory."""

    def __init__(self, store: Any = None, *, directory: str | None = None,
                 memory_bytes: int = 64 << 20) -> None:
        self.store = store if store is not None and getattr(store, "path", None) else None
        self.directory = directory
        self.memory_bytes = int(memory_bytes)
        self.path: str | None = self.store.path if self.store is not None else None
        self._temp: Any = None  # the temporary file's connection
        self._lock = threading.Lock()

    def _connection(self) -> Any:
        """A connection the spill tables' DDL runs on (the temporary file's, made here)."""
        if self.store is not None:
            return self.store.connection
        with self._lock:
            if self._temp is None:
                import duckdb

                remove_stale_temp_files(self.directory)
                fd, path = tempfile.mkstemp(prefix=f"tensorql-spill-{os.getpid()}-",
                                            suffix=".duckdb", dir=self.directory)
                os.close(fd)
                os.remove(path)  # DuckDB makes the file itself
                con = duckdb.connect(path)
                con.execute(f"SET memory_limit = '{max(16 << 20, self.memory_bytes)}B'")
                con.execute(f"CREATE SCHEMA IF NOT EXISTS {quote_ident(SCHEMA)}")
                self._temp, self.path = con, path
                log.debug("in-memory session: spill tier in temporary file %s", path)
            return self._temp

    def cursor(self) -> Any:
        """A cursor (one thread's) on the database the spill tables live in."""
        if self.store is not None:
            return self.store.cursor()
        return self._connection().cursor()

    def open_run(self, tag: str) -> SpillPages:
        """A fresh spill table for one run."""
        return SpillPages(self, f"{SPILL_PREFIX}{os.getpid()}_{next(_RUNS)}_{tag}")

    def close(self) -> None:
        """Close and delete the temporary file, if one was made."""
        with self._lock:
            con, path, self._temp = self._temp, self.path, None
        if con is None:
            return
        con.close()
        for leftover in (path, path + ".wal"):
            try:
                os.remove(leftover)
            except FileNotFoundError:
                pass


class SpillPages:
    """One run's spill table: :meth:`write` a chunk (its id back), :meth:`read` it by id;
    :meth:`close` drops the table. Thread-safe: each thread uses its own cursor, writes are
    serialised."""

    def __init__(self, space: SpillSpace, table: str) -> None:
        self.space = space
        self.table = table
        self.ref = f"{quote_ident(SCHEMA)}.{quote_ident(table)}"
        self._ids = itertools.count()
        self._local = threading.local()
        self._cursors: list[Any] = []
        self._write_lock = threading.Lock()
        self._created = False
        self.bytes_written = self.bytes_read = 0
        self.chunks_written = self.chunks_read = 0

    def _cursor(self) -> Any:
        cursor = getattr(self._local, "cursor", None)
        if cursor is None:
            cursor = self.space.cursor()
            self._local.cursor = cursor
            with self._write_lock:
                self._cursors.append(cursor)
        return cursor

    def write(self, value: torch.Tensor) -> int:
        """Store ``value``'s bytes as pages under a new id (one committed transaction)."""
        raw = chunk_bytes(value)
        pages = encode_pages([raw])
        ident = next(self._ids)
        batch = pa.table({"id": pa.array(np.full(len(pages.page_numbers), ident, np.int64)),
                          "page": pa.array(pages.page_numbers),
                          "payload": pages.payload})
        con = self._cursor()
        with self._write_lock:
            if not self._created:
                con.execute(f"CREATE TABLE IF NOT EXISTS {self.ref} (id BIGINT NOT NULL, "
                            "page INTEGER NOT NULL, "
                            "payload BLOB NOT NULL USING COMPRESSION uncompressed)")
                self._created = True
            con.register("tq_spill_batch", batch)
            try:
                con.execute(f"INSERT INTO {self.ref} SELECT * FROM tq_spill_batch")
            finally:
                con.unregister("tq_spill_batch")
            self.bytes_written += raw.size
            self.chunks_written += 1
        return ident

    def read(self, ident: int, shape: tuple[int, ...], dtype: str | torch.dtype) -> torch.Tensor:
        """The chunk written under ``ident``, as a tensor of ``shape`` and ``dtype``."""
        dtype = canonical_dtype(dtype)
        result = self._cursor().sql(f"SELECT page, payload FROM {self.ref} WHERE id = ?",
                                    params=[ident]).to_arrow_table()
        pages = result.column(0).to_numpy()
        payload = result.column(1)
        if np.any(pages != np.arange(len(pages))):
            order = np.argsort(pages, kind="stable")
            payload = payload.combine_chunks().take(pa.array(order))
        raw = join_pages(payload)
        expected = int(np.prod(shape, dtype=np.int64)) * itemsize(dtype)
        if raw.size != expected:
            raise StorageError(f"spill table {self.table}: chunk {ident} holds {raw.size} "
                               f"bytes, expected {expected}")
        with self._write_lock:
            self.bytes_read += raw.size
            self.chunks_read += 1
        return view_bytes(raw, dtype, tuple(shape))

    def close(self) -> None:
        """Drop the table (nothing a run spilled outlives it) and close the cursors."""
        with self._write_lock:
            cursors, self._cursors = self._cursors, []
            created = self._created
        try:
            if created:
                con = self.space.cursor()
                try:
                    con.execute(f"DROP TABLE IF EXISTS {self.ref}")
                finally:
                    con.close()
        finally:
            for cursor in cursors:
                try:
                    cursor.close()
                except Exception:  # noqa: BLE001 - a cursor of a closed connection
                    pass
