"""Dates, times and timestamps that Python's ``datetime`` cannot hold, as DuckDB's text.

DuckDB stores dates from 5877642 BC to 5881580 AD, ``'infinity'`` and ``'-infinity'``, and
the time ``24:00:00``; Python's ``datetime`` stops at years 1..9999 and 23:59:59.999999.
Arrow's ``to_pylist`` raises ``OverflowError`` / ``ValueError`` on the former and silently
wraps ``24:00:00`` to ``00:00:00``. Here such a value comes back as DuckDB's own text for it
(as DuckDB's Python client does for a year past 9999), every other value as Python's object.

>>> import duckdb
>>> table = duckdb.sql("SELECT * FROM (VALUES (DATE '2024-02-29'), ('infinity'::DATE), "
...                    "(DATE '12345-06-07'), (NULL)) AS t(d)").to_arrow_table()
>>> python_values(table.column("d"))
[datetime.date(2024, 2, 29), 'infinity', '12345-06-07', None]
>>> python_values(duckdb.sql("SELECT TIME '24:00:00' AS t").to_arrow_table().column("t"))
['24:00:00']
>>> text_where_unrepresentable(table).column("d").to_pylist()
['2024-02-29', 'infinity', '12345-06-07', None]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tensorql.errors import UnsupportedError

__all__ = ["intervals_as_durations", "python_values", "text_where_unrepresentable"]

_FIRST_DAY = -719162  # 0001-01-01, days from 1970-01-01: Python's date.min
_LAST_DAY = 2932896  # 9999-12-31: Python's date.max
_PER_DAY = {"s": 86_400, "ms": 86_400_000, "us": 86_400_000_000, "ns": 86_400_000_000_000}
_INFINITE_DAYS = 2**31 - 1  # DuckDB's DATE 'infinity' (its negation: '-infinity')
_INFINITE_STAMP = 2**63 - 1  # DuckDB's TIMESTAMP 'infinity'


def python_values(column: pa.Array | pa.ChunkedArray) -> list[Any]:
    """``column.to_pylist()``, except that a date, time or timestamp Python cannot hold is
    DuckDB's text for it (see the module doc)."""
    odd = _unrepresentable(column)
    if odd is None or not odd.any():
        return column.to_pylist()
    safe = pc.if_else(pa.array(odd), pa.scalar(None, column.type), column)
    values = safe.to_pylist()
    counts = _counts(column)
    for k in np.flatnonzero(odd):
        values[k] = _text(column.type, int(counts[k]))
    return values


def text_where_unrepresentable(table: pa.Table) -> pa.Table:
    """``table`` with each date, time or timestamp column holding a value Python cannot hold
    as a column of text (every value DuckDB's text), for pandas, numpy and polars, which
    would fail on the value or, for ``24:00:00``, show midnight; a UNION column (which
    none of them reads) as the text of each member's value."""
    for k, column in enumerate(table.columns):
        if pa.types.is_union(column.type):  # neither pandas nor polars reads a UNION
            text = [None if v is None else str(v) for v in column.to_pylist()]
            table = table.set_column(k, table.field(k).name, pa.array(text, pa.string()))
            continue
        odd = _unrepresentable(column)
        if odd is None or not odd.any():
            continue
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        text = [_text(column.type, count) if ok else None
                for count, ok in zip(_counts(column).tolist(), valid)]
        table = table.set_column(k, table.field(k).name, pa.array(text, pa.string()))
    return table


def intervals_as_durations(table: pa.Table) -> pa.Table:
    """``table`` with each INTERVAL column (Arrow's month-day-nano, which polars cannot read)
    as a duration in nanoseconds; UnsupportedError naming the column when one holds months,
    whose length in days is not fixed.

    >>> import duckdb
    >>> rows = duckdb.sql("SELECT INTERVAL 3 DAY + INTERVAL 5 SECOND AS iv").to_arrow_table()
    >>> column = intervals_as_durations(rows).column("iv")
    >>> column.type, column.cast(pa.int64()).to_pylist()  # 3 days 5 s in nanoseconds
    (DurationType(duration[ns]), [259205000000000])
    """
    for k, column in enumerate(table.columns):
        if column.type != pa.month_day_nano_interval():
            continue
        values = column.to_pylist()
        if any(v is not None and v.months for v in values):
            raise UnsupportedError(f"column {table.field(k).name!r} holds INTERVALs with "
                                   "months, which have no fixed length for polars' Duration; "
                                   "cast it in SQL (to VARCHAR, or epoch(...) for seconds)")
        nanos = [None if v is None else v.days * _PER_DAY["ns"] + v.nanoseconds for v in values]
        table = table.set_column(k, table.field(k).name, pa.array(nanos, pa.duration("ns")))
    return table


def _counts(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The column's stored integers (days, milli/micro/nanoseconds), 0 for NULL."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    width = pa.int32() if array.type.bit_width == 32 else pa.int64()
    return array.view(width).fill_null(0).to_numpy()


def _unrepresentable(column: pa.Array | pa.ChunkedArray) -> np.ndarray | None:
    """Where the column's values lie outside Python's datetime (None: not a temporal type)."""
    kind = column.type
    if pa.types.is_date32(kind):
        days = _counts(column)
    elif pa.types.is_date64(kind):
        days = _counts(column) // _PER_DAY["ms"]
    elif pa.types.is_timestamp(kind):
        counts = _counts(column)
        if kind.unit == "ns":  # pandas and Python hold every finite nanosecond stamp
            return np.abs(counts) == _INFINITE_STAMP
        days = counts // _PER_DAY[kind.unit]
    elif pa.types.is_time(kind):
        counts = _counts(column)
        return (counts >= _PER_DAY[kind.unit]) | (counts < 0)
    else:
        return None
    return (days < _FIRST_DAY) | (days > _LAST_DAY)


def _text(kind: pa.DataType, count: int) -> str:
    """DuckDB's text for one stored value of a temporal type."""
    if pa.types.is_time(kind):
        return _clock(count, _PER_DAY[kind.unit] // 86_400)
    if pa.types.is_date32(kind):
        if abs(count) == _INFINITE_DAYS:
            return "infinity" if count > 0 else "-infinity"
        return _date(count)
    if pa.types.is_date64(kind):
        return _date(count // _PER_DAY["ms"])
    if abs(count) == _INFINITE_STAMP:
        return "infinity" if count > 0 else "-infinity"
    per_day = _PER_DAY[kind.unit]
    days, within = divmod(count, per_day)
    zone = "+00" if kind.tz is not None else ""
    return f"{_date(days)} {_clock(within, per_day // 86_400)}{zone}"


def _clock(count: int, per_second: int) -> str:
    """``HH:MM:SS[.fraction]`` of ``count`` units since midnight (24:00:00 allowed)."""
    seconds, fraction = divmod(count, per_second)
    hours, rest = divmod(seconds, 3600)
    text = f"{hours:02d}:{rest // 60:02d}:{rest % 60:02d}"
    if fraction:
        digits = len(str(per_second)) - 1
        text += "." + f"{fraction:0{digits}d}".rstrip("0")
    return text


def _date(days: int) -> str:
    """``YYYY-MM-DD`` of ``days`` from 1970-01-01 in the proleptic Gregorian calendar; years
    before 1 as DuckDB writes them, ``0044-03-15 (BC)``."""
    year, month, day = _civil(days)
    if year <= 0:
        return f"{1 - year:04d}-{month:02d}-{day:02d} (BC)"
    return f"{year:04d}-{month:02d}-{day:02d}"


def _civil(days: int) -> tuple[int, int, int]:
    """(year, month, day) of ``days`` from 1970-01-01; year 0 is 1 BC (the days-from-civil
    inverse of H. Hinnant's chrono algorithms, valid for any integer).

    >>> _civil(0), _civil(-719162), _civil(2932896), _civil(-719163)
    ((1970, 1, 1), (1, 1, 1), (9999, 12, 31), (0, 12, 31))
    """
    shifted = days + 719468  # days from 0000-03-01
    era, day_of_era = divmod(shifted, 146097)
    year_of_era = (day_of_era - day_of_era // 1460 + day_of_era // 36524
                   - day_of_era // 146096) // 365
    day_of_year = day_of_era - (365 * year_of_era + year_of_era // 4 - year_of_era // 100)
    shifted_month = (5 * day_of_year + 2) // 153
    day = day_of_year - (153 * shifted_month + 2) // 5 + 1
    month = shifted_month + 3 if shifted_month < 10 else shifted_month - 9
    return year_of_era + era * 400 + (month <= 2), month, day
