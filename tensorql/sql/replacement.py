"""DuckDB's replacement scans for ``db.sql``: a pandas or polars DataFrame or an Arrow table
held in a variable of the caller is usable by its name in SQL, as with ``duckdb.sql``.

DuckDB does this itself only for ``duckdb.sql`` called from the frame that holds the
variable; tensorql runs statements on its own connection, several frames below the caller.
So ``Database.sql`` passes the caller's frame here: every name that appears in the statement
as a word, is not a table or view of the connection, and holds such a frame in the caller's
locals or globals is registered on the connection for the statement and unregistered after.
One DuckDB cannot scan (a float16 Arrow column, a complex pandas column) is left out, so the
word may still be an alias; a statement that does read it fails with an SQLExecutionError
naming the object and DuckDB's reason.

>>> import duckdb, pyarrow as pa
>>> prices = pa.table({"p": [1.5, 2.5]})
>>> con = duckdb.connect()
>>> found = frame_objects("SELECT sum(p) FROM prices", {"prices": prices}, con)
>>> list(found)
['prices']
>>> with registered(con, found):
...     con.sql("SELECT sum(p) FROM prices").fetchall()
[(4.0,)]
>>> frame_objects("SELECT 1", {"prices": prices}, con)
{}
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import duckdb

from tensorql.errors import UnknownTensorError
from tensorql.sql.errors import SQLExecutionError

__all__ = ["Registered", "frame_objects", "is_frame", "registered"]

# (top-level module, class name) of the objects DuckDB scans by name
_FRAMES = frozenset({
    ("pandas", "DataFrame"), ("polars", "DataFrame"), ("polars", "LazyFrame"),
    ("pyarrow", "Table"), ("pyarrow", "RecordBatch"), ("pyarrow", "RecordBatchReader"),
    ("pyarrow", "Dataset"), ("pyarrow", "FileSystemDataset"), ("pyarrow", "Scanner"),
})
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def is_frame(obj: Any) -> bool:
    """Whether DuckDB scans ``obj`` as a table (a pandas / polars DataFrame, an Arrow table,
    record batch, reader or dataset), judged without importing pandas or polars.

    >>> import pyarrow as pa
    >>> is_frame(pa.table({"x": [1]})), is_frame([1, 2])
    (True, False)
    """
    kind = type(obj)
    return (kind.__module__.split(".")[0], kind.__name__) in _FRAMES


def frame_objects(query: str, scope: Mapping[str, Any], connection: Any) -> dict[str, Any]:
    """The objects of ``scope`` (a frame's globals updated by its locals) that ``query``
    names and DuckDB would scan: frames (:func:`is_frame`) under a name that is a word of the
    query and not a table or view of ``connection`` (the catalog wins, as in DuckDB)."""
    if not isinstance(query, str):
        return {}
    found = {word: scope[word] for word in set(_WORD.findall(query))
             if word in scope and is_frame(scope[word])}
    if found:
        taken = {row[0].lower() for row in connection.execute(
            "SELECT table_name FROM duckdb_tables() UNION ALL "
            "SELECT view_name FROM duckdb_views()").fetchall()}
        found = {name: obj for name, obj in found.items() if name.lower() not in taken}
    return found


class Registered:
    """The caller's frames registered for one ``db.sql`` script: :meth:`release` takes one
    back before a statement creates a table or view of its name, as DuckDB's catalog wins
    over a replacement scan from then on (a later ``SELECT * FROM df`` reads the new table).

    >>> import duckdb, pyarrow as pa
    >>> con = duckdb.connect()
    >>> with registered(con, {"df": pa.table({"x": [1]})}) as frames:
    ...     frames.release("DF")
    ...     _ = con.execute("CREATE TEMP TABLE df AS SELECT 100 AS x")
    ...     con.sql("SELECT * FROM df").fetchall()
    [(100,)]
    """

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.names: list[str] = []

    def release(self, name: str) -> None:
        """Unregister the frame registered under ``name`` (any case), if one is."""
        for held in [n for n in self.names if n.lower() == name.lower()]:
            self.connection.unregister(held)
            self.names.remove(held)


@contextmanager
def registered(connection: Any, objects: Mapping[str, Any]) -> Iterator[Registered]:
    """``objects`` registered on ``connection`` by name for the block, unregistered after
    (also when it raises). One DuckDB cannot scan is skipped; if the block then fails to
    find a table or tensor of its name, SQLExecutionError says why that object was not read.
    """
    frames = Registered(connection)
    done = frames.names
    skipped: dict[str, str] = {}  # name -> DuckDB's reason
    try:
        for name, obj in objects.items():
            try:
                connection.register(name, obj)
            except duckdb.Error as err:  # e.g. "Unsupported Internal Arrow Type e" (float16)
                skipped[name] = str(err).splitlines()[0]
                continue
            done.append(name)
        try:
            yield frames
        except Exception as err:
            name = next((n for n in skipped if _not_found(err, n)), None)
            if name is None:
                raise
            kind = type(objects[name])
            raise SQLExecutionError(
                f"the {kind.__module__.split('.')[0]} {kind.__name__} {name!r} of the caller's "
                f"scope cannot be read by DuckDB: {skipped[name]} (cast its columns to types "
                "DuckDB reads)", text=getattr(err, "text", None),
                position=getattr(err, "position", None)) from err
    finally:
        for name in done:
            connection.unregister(name)


def _not_found(err: Exception, name: str) -> bool:
    """Whether ``err`` says no table, view or tensor is named ``name``."""
    if isinstance(err, UnknownTensorError):
        return err.name.lower() == name.lower()
    pattern = rf"with name \"?{re.escape(name)}\"? does not exist"
    return re.search(pattern, str(err), re.IGNORECASE) is not None
