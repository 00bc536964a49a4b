"""Where DuckDB's Arrow export loses values, put right before a result is built.

DuckDB exports ``UHUGEINT`` (unsigned 128-bit) as Arrow's signed ``decimal128(38, 0)``: a
value of ``2**127`` or more comes out negative (the same 128 bits read as signed). Such a
column holding such a value becomes ``decimal256(39, 0)``, which holds every UHUGEINT.

>>> import duckdb
>>> rel = duckdb.sql("SELECT (2::UHUGEINT ** 127)::UHUGEINT + 5 AS v, -1 AS w")
>>> table = with_unsigned_huge_ints(rel.to_arrow_table(), [str(t) for t in rel.types])
>>> table.column("v").to_pylist(), str(table.schema.field("v").type)
([Decimal('170141183460469231731687303715884105733')], 'decimal256(39, 0)')
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from tensorql.storage.sql_text import quote_ident

__all__ = ["arrow_of", "relation_of", "wide_decimals_as_text", "with_unsigned_huge_ints"]

_WRAP = 1 << 128


def arrow_of(relation: Any) -> pa.Table:
    """A DuckDB relation's rows as an Arrow table, its UHUGEINT columns read back as
    unsigned (:func:`with_unsigned_huge_ints`; DuckDB's types are asked for only when a
    decimal128 column could be one)."""
    table = relation.to_arrow_table()
    if any(pa.types.is_decimal128(t) for t in table.schema.types):
        table = with_unsigned_huge_ints(table, [str(t) for t in relation.types])
    return table


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
