"""DuckDB as the spill tier: chunk copies the host tier has no room for, as BLOB pages.

A :class:`SpillSpace` belongs to a session: an in-memory DuckDB database of its own, made at
the first spill, under a memory limit beyond which DuckDB writes its pages to temporary
files in a folder beside the session's file (``work.duckdb.spill-<pid>-<id>/``), or for an
in-memory session in the temporary directory; the folder goes when the session closes. Each
run that spills gets a :class:`SpillPages`: a table ``tq_internal."tq_spill_<run>_c<id>"`` of
``(id BIGINT, page INTEGER, payload BLOB)`` rows per chunk, a chunk being the pages of its
C-contiguous bytes (no pickle; up to 4 MiB a page, :func:`page_bytes_for`), inserted from
Arrow views of the chunk's own memory by one ``INSERT`` into its empty table, and read back by
their ``rowid`` range (a direct fetch; a filter on ``id`` scanned the table and read whole
vectors of pages). Each byte is copied once on the way in: DuckDB moves the rows of an insert
into an empty table at its commit; an insert into a table holding rows scans them (pinning a
vector of pages) and copies them a second time (4 statements per 16 MiB chunk did: 1.7x the
CPU of a write). DuckDB still hashes each page whole for its distinct-value statistics (a BLOB
in a STRUCT has none, but a scan of a STRUCT column reads every row of its vector, whatever
the ``rowid`` range: a read pinned the whole chunk). A chunk's
table is dropped as soon as its copy is no longer needed (:meth:`SpillPages.discard`, at its
last read): its blocks leave DuckDB's memory and temporary files at once. With one table per
run, blocks read back stayed in DuckDB's buffer pool until evicted -- written to the
temporary files a second time (1.95 bytes written per byte spilled, now 1.0). Chunks at rest
use 4 KiB pages (``pages.py``) because a file database keeps longer BLOBs pinned until a
checkpoint; this database has no checkpoint, and its long BLOBs go to its temporary files like
any other block. What is left is dropped when the run ends. A process killed
while spilling leaves its folder behind: it is named after the process, and the next session
to open the database file (or to spill, for in-memory sessions) removes those of processes
that no longer run (:func:`remove_stale_files`).

>>> import torch
>>> space = SpillSpace()  # an in-memory session's: in the temporary directory
>>> pages = space.open_run("r1")
>>> n = pages.write(torch.arange(3000, dtype=torch.float32))
>>> pages.read(n, (3000,), "float32")[-1].item(), pages.bytes_written
(2999.0, 12000)
>>> pages.discard(n); pages.live_chunks
0
>>> pages.close(); folder = space.path; space.close()
>>> os.path.exists(folder)
False
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import logging
import os
import shutil
import tempfile
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from tensorql.dtypes import canonical_dtype, itemsize
from tensorql.errors import StorageError
from tensorql.storage.blob_codec import chunk_bytes, view_bytes
from tensorql.storage.pages import join_pages
from tensorql.storage.sql_text import quote_ident
from tensorql.units import format_bytes

log = logging.getLogger("tensorql.spill")

SPILL_PREFIX = "tq_spill_"
SCHEMA = "tq_internal"
MIN_MEMORY_BYTES = 32 << 20  # below about this, DuckDB fails to commit pages it must pin
# statements (a write's INSERT, a read's SELECT) on the spill database at once. A read pins
# the pages of its result (at most 1/8 of the memory a statement); a write pins one page at a
# time (each page is a block of its own, unpinned once copied; the rows move to the table at
# its commit without a scan). Unbounded, two workers' writes beside the prefetcher's read and
# a load's read (writes then in 1/8 batches, each pinned twice at its commit: the rows were
# copied into a table holding rows) pinned more than 32 MiB ("failed to pin block").
SPILL_STATEMENTS = 2
MAX_PAGE_BYTES = 4 << 20
_RUNS = itertools.count(1)


def page_bytes_for(memory_bytes: int) -> int:
    """The page size of spilled chunks: 4 MiB, or an eighth of the spill database's memory
    when that is less (DuckDB assembles a BLOB in its memory to read it back).

    >>> page_bytes_for(64 << 20) >> 20, page_bytes_for(16 << 20) >> 20
    (4, 2)
    """
    return max(PAGE_FLOOR, min(MAX_PAGE_BYTES, int(memory_bytes) // 8))


PAGE_FLOOR = 64 << 10


def spill_prefix(path: str | None, directory: str | None = None) -> str:
    """The start of the name of a session's spill files: ``<file>.spill-`` beside a
    session's database file (the disk the user chose for it; ``/tmp`` may be RAM), else
    ``tensorql-spill-`` in ``directory`` (default: the system's temporary directory)."""
    if path is not None:
        return os.fspath(path) + ".spill-"
    return os.path.join(directory or tempfile.gettempdir(), "tensorql-spill-")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_files(prefix: str) -> list[str]:
    """Remove the spill folders ``<prefix><pid>-*`` of processes that no longer run: a
    process killed while spilling leaves its folder of DuckDB temporary files behind."""
    removed = []
    for path in glob.glob(glob.escape(prefix) + "*-*"):
        try:
            pid = int(path[len(prefix):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            removed.append(path)
    if removed:
        log.info("removed %d spill folder(s) a killed process left behind", len(removed))
    return removed


class SpillSpace:
    """Where a session's runs spill: an in-memory DuckDB database of its own whose pages
    beyond ``memory_bytes`` go to DuckDB's temporary files in a folder made at the first
    spill -- beside the session's file (``path``) or, in memory, in ``directory`` -- and
    removed by :meth:`close`. It is not the session's database: its memory limit is its own,
    so a spill never competes with the store for DuckDB's memory (in the store's file, a
    commit that cannot pin a block fails, and a checkpoint that fails invalidates the
    database), no spilled page is ever in the user's file, and spilled pages are neither
    logged nor checkpointed (a file database wrote them twice: 2.5x slower writes)."""

    def __init__(self, path: str | None = None, *, directory: str | None = None,
                 memory_bytes: int = 64 << 20) -> None:
        self.prefix = spill_prefix(path, directory)
        self.memory_bytes = max(MIN_MEMORY_BYTES, int(memory_bytes))
        self.path: str | None = None  # the folder of DuckDB's temporary files
        self._con: Any = None
        self._lock = threading.Lock()
        self.statements = threading.BoundedSemaphore(SPILL_STATEMENTS)

    def _connection(self) -> Any:
        with self._lock:
            if self._con is None:
                import duckdb

                remove_stale_files(self.prefix)
                directory, stem = os.path.split(self.prefix)
                try:
                    path = tempfile.mkdtemp(prefix=f"{stem}{os.getpid()}-",
                                            dir=directory or None)
                except OSError as err:  # e.g. a read-only session's folder
                    self.prefix = spill_prefix(None)
                    log.info("cannot spill beside the database (%s); spilling in %s", err,
                             tempfile.gettempdir())
                    remove_stale_files(self.prefix)
                    path = tempfile.mkdtemp(prefix=f"tensorql-spill-{os.getpid()}-")
                con = duckdb.connect(":memory:")
                con.execute(f"SET memory_limit = '{self.memory_bytes}B'")
                # one thread: a spill moves one chunk at a time (a second thread made writes
                # ~1.4x dearer in CPU time), and the kernels have the cores
                con.execute("SET threads = 1")
                con.execute("SET temp_directory = ?", [path])
                con.execute(f"CREATE SCHEMA IF NOT EXISTS {quote_ident(SCHEMA)}")
                self._con, self.path = con, path
                log.debug("spill tier: DuckDB with %d MiB of memory, beyond it in %s",
                          self.memory_bytes >> 20, path)
            return self._con

    def cursor(self) -> Any:
        """A cursor (one thread's) on the spill database."""
        return self._connection().cursor()

    def open_run(self, tag: str) -> SpillPages:
        """A fresh spill table for one run."""
        return SpillPages(self, f"{SPILL_PREFIX}{next(_RUNS)}_{tag}")

    def close(self) -> None:
        """Close the spill database and remove its folder, if one was made."""
        with self._lock:
            con, path, self._con = self._con, self.path, None
        if con is None:
            return
        con.close()
        shutil.rmtree(path, ignore_errors=True)


class SpillPages:
    """One run's spilled chunks, a DuckDB table each: :meth:`write` a chunk (its id back),
    :meth:`read` it by id, :meth:`discard` it once no longer needed (its table dropped);
    :meth:`close` drops what is left. Thread-safe: each thread uses its own cursor, writes
    and drops are serialised."""

    def __init__(self, space: SpillSpace, table: str) -> None:
        self.space = space
        self.table = table  # the run's tables are ``<table>_c<id>``
        self._next_id = 0
        self._local = threading.local()
        self._cursors: list[Any] = []
        self._write_lock = threading.Lock()
        self._created: set[int] = set()  # ids whose table exists
        self.page_bytes = page_bytes_for(space.memory_bytes)
        self._rows: dict[int, tuple[str, int]] = {}  # id -> (its table, pages)
        self.bytes_written = self.bytes_read = 0
        self.chunks_written = self.chunks_read = self.chunks_discarded = 0
        self.statements_run = 0  # INSERTs and SELECTs that moved pages

    def chunk_table(self, ident: int) -> str:
        """The quoted name of chunk ``ident``'s table."""
        return f"{quote_ident(SCHEMA)}.{quote_ident(f'{self.table}_c{int(ident)}')}"

    @property
    def live_chunks(self) -> int:
        """Chunks written and not yet discarded."""
        with self._write_lock:
            return len(self._rows)

    def _cursor(self) -> Any:
        cursor = getattr(self._local, "cursor", None)
        if cursor is None:
            cursor = self.space.cursor()
            self._local.cursor = cursor
            with self._write_lock:
                self._cursors.append(cursor)
        return cursor

    def _pages_per_statement(self) -> int:
        """Pages one SELECT reads back (its result pins them all): an eighth of the spill
        database's memory (at most :data:`SPILL_STATEMENTS` run at once)."""
        return max(1, (self.space.memory_bytes // 8) // self.page_bytes)

    def prepare(self) -> None:
        """Make this thread's cursor and the next chunk's table now (the spill database too,
        at a session's first spill), so the first :meth:`write` does not wait for them."""
        con = self._cursor()
        with self._write_lock:
            self._create(con, self._next_id)

    def _create(self, con: Any, ident: int) -> None:  # holding the write lock
        if ident not in self._created:
            con.execute(f"CREATE TABLE IF NOT EXISTS {self.chunk_table(ident)} "
                        "(id BIGINT NOT NULL, page INTEGER NOT NULL, "
                        "payload BLOB NOT NULL USING COMPRESSION uncompressed)")
            self._created.add(ident)

    def write(self, value: torch.Tensor) -> int:
        """Store ``value``'s bytes as pages of a new table under a new id: one ``INSERT``
        (one committed transaction) into the chunk's own, empty table.

        The pages are Arrow views of the chunk's own bytes (no copy before DuckDB's), and
        DuckDB copies each page once, into a block of its own that it unpins at once: the
        statement pins one page at a time, whatever the chunk's size. At the commit the rows
        move to the empty table whole (into a table holding rows they would be scanned --
        pinning a vector of pages -- and copied again)."""
        raw = chunk_bytes(value)
        count = max(1, -(-raw.size // self.page_bytes))
        offsets = np.minimum(np.arange(count + 1, dtype=np.int64) * self.page_bytes, raw.size)
        payload = pa.LargeBinaryArray.from_buffers(
            pa.large_binary(), count, [None, pa.py_buffer(offsets), pa.py_buffer(raw)])
        con = self._cursor()
        with self._write_lock:
            ident, self._next_id = self._next_id, self._next_id + 1
            batch = pa.table({"id": pa.array(np.full(count, ident, np.int64)),
                              "page": pa.array(np.arange(count, dtype=np.int32)),
                              "payload": payload})
            self._create(con, ident)
            ref = self.chunk_table(ident)
            con.register("tq_spill_batch", batch)
            try:
                with self.space.statements:
                    con.execute(f"INSERT INTO {ref} SELECT * FROM tq_spill_batch")
            finally:
                con.unregister("tq_spill_batch")
            self.statements_run += 1
            self._rows[ident] = (ref, count)
            self.bytes_written += raw.size
            self.chunks_written += 1
        return ident

    def discard(self, ident: int) -> None:
        """Drop chunk ``ident``'s table: its blocks leave DuckDB's memory and temporary files
        now (not written out again when evicted, as blocks read back but still held were).
        A chunk never written, or already discarded, is ignored."""
        con = self._cursor()
        with self._write_lock:
            if self._rows.pop(ident, None) is None:
                return
            self._created.discard(ident)
            con.execute(f"DROP TABLE IF EXISTS {self.chunk_table(ident)}")
            self.chunks_discarded += 1

    def read(self, ident: int, shape: tuple[int, ...], dtype: str | torch.dtype) -> torch.Tensor:
        """The chunk written under ``ident``, as a tensor of ``shape`` and ``dtype``: its
        rows fetched by ``rowid`` (no scan of the table), checked by id and page."""
        dtype = canonical_dtype(dtype)
        with self._write_lock:
            entry = self._rows.get(ident)
        if entry is None:
            raise StorageError(f"spill tables {self.table}_c*: no chunk {ident} (never "
                               "written, or discarded)")
        ref, count = entry
        first = 0
        expected = int(np.prod(shape, dtype=np.int64)) * itemsize(dtype)
        raw = np.empty(expected, dtype=np.uint8)
        filled = 0
        per = self._pages_per_statement()
        cursor = self._cursor()
        for lo in range(first, first + count, per):  # an eighth of DuckDB's memory at a time
            hi = min(first + count, lo + per)
            with self.space.statements:
                result = cursor.sql(f"SELECT id, page, payload FROM {ref} "
                                    f"WHERE rowid >= {int(lo)} AND rowid < {int(hi)}"
                                    ).to_arrow_table()
            with self._write_lock:
                self.statements_run += 1
            ids = result.column(0).to_numpy()
            pages = result.column(1).to_numpy()
            payload = result.column(2)
            if len(ids) != hi - lo or np.any(ids != ident):
                raise StorageError(f"spill table {ref}: rows {lo}..{hi - 1} are not "
                                   f"pages of chunk {ident} ({count} page(s))")
            if np.any(pages != np.arange(lo - first, hi - first)):
                order = np.argsort(pages, kind="stable")
                if np.any(pages[order] != np.arange(lo - first, hi - first)):
                    raise StorageError(f"spill table {ref}: chunk {ident} lacks pages "
                                       f"{lo - first}..{hi - first - 1}")
                payload = payload.combine_chunks().take(pa.array(order))
            piece = join_pages(payload)
            if filled + piece.size > expected:
                filled += piece.size
                break
            raw[filled:filled + piece.size] = piece
            filled += piece.size
            del result, payload, piece
        if filled != expected:
            more = " or more" if filled > expected else ""
            raise StorageError(f"spill table {ref}: chunk {ident} holds "
                               f"{format_bytes(filled)}{more}, expected {format_bytes(expected)}")
        with self._write_lock:
            self.bytes_read += raw.size
            self.chunks_read += 1
        return view_bytes(raw, dtype, tuple(shape))

    def close(self) -> None:
        """Drop the tables left (nothing a run spilled outlives it) and close the cursors."""
        with self._write_lock:
            cursors, self._cursors = self._cursors, []
            created, self._created = sorted(self._created), set()
            self._rows.clear()
        try:
            if created:
                con = self.space.cursor()
                try:
                    for ident in created:
                        con.execute(f"DROP TABLE IF EXISTS {self.chunk_table(ident)}")
                finally:
                    con.close()
        finally:
            for cursor in cursors:
                try:
                    cursor.close()
                except Exception:  # noqa: BLE001 - a cursor of a closed connection
                    pass
