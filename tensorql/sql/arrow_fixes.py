"""Where DuckDB's Arrow export loses values, put right before a result is built.

DuckDB exports ``UHUGEINT`` (unsigned 128-bit) as Arrow's signed ``decimal128(38, 0)``: a
value of ``2**127`` or more comes out negative (the same 128 bits read as signed). Such a
column holding such a value becomes ``decimal256(39, 0)``, which holds every UHUGEINT.

>>> import duckdb
>>> rel = duckdb.sql("SELECT (2::UHUGEINT ** 127)::UHUGEINT + 5 AS v, -1 AS w")
>>> table = with_unsigned_huge_ints(rel.to_arrow_table(), [str(t) for t in rel.types])
>>> table.column("v").to_pylist(), str(table.schema.field("v").type)
([Decimal('170141183460469231731687303715884105733')], 'decimal256(39, 0)')

Arrow's types are not DuckDB's either (a HUGEINT is a decimal128, a UUID, JSON or ENUM text, a
BIT a BLOB), and some encodings are not the value (a TIME WITH TIME ZONE loses its offset):
:func:`arrow_of` keeps DuckDB's own column types with the table (:func:`duckdb_columns_of`),
and DuckDB's text of each TIME WITH TIME ZONE column, read in the same execution, for the
values DuckDB's Python client gives (:meth:`DuckDBColumns.values`).

>>> table = arrow_of(duckdb.sql("SELECT 1::HUGEINT AS h, TIMETZ '12:00:00+05' AS t"))
>>> columns = duckdb_columns_of(table)
>>> [str(t) for t in columns.types], table.column_names, columns.values(table)[1]
(['HUGEINT', 'TIME WITH TIME ZONE'], ['h', 't'], [datetime.time(12, 0, tzinfo=...)])
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from tensorql.sql.temporal import python_values
from tensorql.storage.sql_text import quote_ident

__all__ = ["DuckDBColumns", "arrow_of", "column_values", "duckdb_columns_of", "relation_of",
           "wide_decimals_as_text", "with_unsigned_huge_ints"]

_WRAP = 1 << 128
_LOSSY = "time with time zone"  # DuckDB types whose Arrow encoding drops part of the value
_COLUMNS_OF_TABLE: dict[int, DuckDBColumns] = {}  # id(table) -> its DuckDB columns, while alive


@dataclass(frozen=True)
class DuckDBColumns:
    """DuckDB's own types of a result's columns (``duckdb.DuckDBPyType``, one per column) and,
    by column index, DuckDB's text of each column whose Arrow encoding is not its value
    (``texts``: the column cast to VARCHAR inside, in the same nesting).

    >>> import duckdb
    >>> table = pa.table({"b": pa.array([b"\\x05\\xfd"])})
    >>> DuckDBColumns(tuple(duckdb.sql("SELECT '1'::BIT").types)).values(table)
    [['101']]
    """

    types: tuple[Any, ...]
    texts: dict[int, pa.ChunkedArray] = field(default_factory=dict)

    def values(self, table: pa.Table, start: int = 0, count: int | None = None,
               which: Sequence[int] | None = None) -> list[list]:
        """The Python values of rows ``start`` .. ``start + count`` of ``table`` (these
        columns' rows), column by column (those at the indices ``which``; None: all), as
        DuckDB's Python client gives them."""
        known = len(self.types) == table.num_columns
        out = []
        for k in range(table.num_columns) if which is None else which:
            text = self.texts.get(k) if known else None
            out.append(python_values(_rows_of(table.column(k), start, count),
                                     self.types[k] if known else None,
                                     None if text is None else _rows_of(text, start, count)))
        return out


def _rows_of(column: pa.ChunkedArray, start: int, count: int | None) -> pa.ChunkedArray:
    return column.slice(start, count) if count is not None else column.slice(start)


def column_values(table: pa.Table, start: int = 0, count: int | None = None,
                  which: Sequence[int] | None = None) -> list[list]:
    """The Python values of rows ``start`` .. ``start + count`` of ``table``, column by
    column (those at the indices ``which``; None: all): as DuckDB's Python client gives them
    for a table :func:`arrow_of` made, else as the Arrow types tell (:func:`python_values`).

    >>> column_values(pa.table({"x": [1, 2, 3], "y": [4, 5, 6]}), 1, which=[1])
    [[5, 6]]
    """
    columns = duckdb_columns_of(table)
    if columns is not None:
        return columns.values(table, start, count, which)
    return [python_values(_rows_of(table.column(k), start, count))
            for k in (range(table.num_columns) if which is None else which)]


def duckdb_columns_of(table: pa.Table) -> DuckDBColumns | None:
    """The DuckDB columns :func:`arrow_of` read ``table`` from (None for any other table)."""
    return _COLUMNS_OF_TABLE.get(id(table))


def _remember(table: pa.Table, columns: DuckDBColumns) -> None:
    key = id(table)
    if key not in _COLUMNS_OF_TABLE:
        weakref.finalize(table, _COLUMNS_OF_TABLE.pop, key, None)
    _COLUMNS_OF_TABLE[key] = columns


def arrow_of(relation: Any) -> pa.Table:
    """A DuckDB relation's rows as an Arrow table, run once, its UHUGEINT columns read back
    as unsigned (:func:`with_unsigned_huge_ints`); DuckDB's own column types (asked before
    it runs) stay with the table (:func:`duckdb_columns_of`), with, for a column holding a
    TIME WITH TIME ZONE, DuckDB's text of it, read in the same execution."""
    types = tuple(relation.types)
    names = list(relation.columns)
    lossy = [k for k, kind in enumerate(types) if _holds(kind, _LOSSY)]
    source = _with_texts(relation, types, lossy) if lossy else None
    if source is None:
        lossy = []
        source = relation
    table = source.to_arrow_table()
    texts = {k: table.column(len(types) + i) for i, k in enumerate(lossy)}
    if lossy:
        table = table.select(list(range(len(types)))).rename_columns(names)
    if any(pa.types.is_decimal128(t) for t in table.schema.types):
        table = with_unsigned_huge_ints(table, [str(t) for t in types])
    _remember(table, DuckDBColumns(types, texts))
    return table


def _holds(kind: Any, type_id: str) -> bool:
    """Whether DuckDB type ``kind`` is or holds (in a list, struct, map, ...) ``type_id``."""
    if kind.id == type_id:
        return True
    if kind.id in ("list", "array", "struct", "map", "union"):
        return any(hasattr(child[1], "id") and _holds(child[1], type_id)
                   for child in kind.children)
    return False


def _as_text(kind: Any) -> str:
    """The SQL type that is ``kind`` with each TIME WITH TIME ZONE inside as VARCHAR."""
    if kind.id == _LOSSY:
        return "VARCHAR"
    if not _holds(kind, _LOSSY):
        return str(kind)
    children = kind.children
    if kind.id == "list":
        return f"{_as_text(children[0][1])}[]"
    if kind.id == "array":
        return f"{_as_text(children[0][1])}[{children[1][1]}]"
    if kind.id == "map":
        return f"MAP({_as_text(children[0][1])}, {_as_text(children[1][1])})"
    if kind.id in ("struct", "union"):
        members = children[1:] if kind.id == "union" else children
        inner = ", ".join(f"{quote_ident(name)} {_as_text(child)}" for name, child in members)
        return f"{kind.id.upper()}({inner})"
    return str(kind)


def _with_texts(relation: Any, types: tuple[Any, ...], lossy: list[int]) -> Any:
    """``relation`` with, after its columns, DuckDB's text of each column in ``lossy``
    (one execution reads both); None when DuckDB cannot cast one (nothing has run then)."""
    import duckdb

    columns = [f"#{k + 1}" for k in range(len(types))]
    columns += [f"CAST(#{k + 1} AS {_as_text(types[k])})" for k in lossy]
    try:
        return relation.project(", ".join(columns))
    except duckdb.Error:
        return None


def with_unsigned_huge_ints(table: pa.Table, types: Sequence[str]) -> pa.Table:
    """``table`` with each column DuckDB typed ``UHUGEINT`` (``types``: DuckDB's type names,
    one per column) read back as unsigned, in ``decimal256(39, 0)``; ``table`` itself when
    there is none."""
    for k, kind in enumerate(types):
        if kind.upper() != "UHUGEINT":
            continue
        values = table.column(k).to_pylist()
        if not any(v is not None and v < 0 for v in values):
            continue  # every value below 2**127: decimal128 holds them
        values = [None if v is None else (int(v) + _WRAP if v < 0 else int(v)) for v in values]
        table = table.set_column(k, table.field(k).name, pa.array(values, pa.decimal256(39, 0)))
    return table


def wide_decimals_as_text(table: pa.Table) -> pa.Table:
    """``table`` with each ``decimal256`` column (a UHUGEINT of 2**127 or more, above) as
    text, for polars, which has no type for it."""
    for k, kind in enumerate(table.schema.types):
        if pa.types.is_decimal256(kind):
            table = table.set_column(k, table.field(k).name, table.column(k).cast(pa.string()))
    return table


def relation_of(connection: Any, table: pa.Table) -> Any:
    """A DuckDB relation over ``table`` on ``connection``; a ``decimal256(39, 0)`` column
    (UHUGEINT, above), which DuckDB cannot read from Arrow, travels as text and is cast back
    to UHUGEINT.

    >>> import duckdb
    >>> con = duckdb.connect()
    >>> rel = con.sql("SELECT 340282366920938463463374607431768211455::UHUGEINT AS v")
    >>> back = relation_of(con, with_unsigned_huge_ints(rel.to_arrow_table(), ["UHUGEINT"]))
    >>> [str(t) for t in back.types], back.fetchall()
    (['UHUGEINT'], [(340282366920938463463374607431768211455,)])
    """
    wide = [k for k, t in enumerate(table.schema.types) if pa.types.is_decimal256(t)]
    if not wide:
        return connection.from_arrow(table)
    for k in wide:
        table = table.set_column(k, table.field(k).name, table.column(k).cast(pa.string()))
    names = table.column_names
    columns = [f"CAST({quote_ident(n)} AS UHUGEINT) AS {quote_ident(n)}" if k in wide
               else quote_ident(n) for k, n in enumerate(names)]
    return connection.from_arrow(table).project(", ".join(columns))
