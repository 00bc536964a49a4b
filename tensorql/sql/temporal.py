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

Told a column's DuckDB type, :func:`python_values` gives every value as DuckDB's Python
client does where Arrow's encoding is not the value (a BIT's or BIGNUM's bytes, a HUGEINT as
a Decimal, a UUID as text, an INTERVAL as MonthDayNano, a MAP as pairs, TIMESTAMP_NS as a
pandas Timestamp), nested values too; inside a list, struct or map an infinite date or
timestamp is Python's ``date.max`` / ``min`` (as DuckDB's client gives), other values Python
cannot hold DuckDB's text:

>>> rel = duckdb.sql("SELECT '101'::BIT AS b, [1::HUGEINT] AS h, MAP {'k': 'infinity'::DATE} AS m")
>>> [python_values(rel.to_arrow_table().column(k), kind) for k, kind in enumerate(rel.types)]
[['101'], [[1]], [{'k': datetime.date(9999, 12, 31)}]]
"""

from __future__ import annotations

import datetime
import re
import uuid
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tensorql.errors import UnsupportedError

__all__ = ["holds_unrepresentable", "intervals_as_durations", "python_values",
           "text_where_unrepresentable"]

_FIRST_DAY = -719162  # 0001-01-01, days from 1970-01-01: Python's date.min
_LAST_DAY = 2932896  # 9999-12-31: Python's date.max
_PER_DAY = {"s": 86_400, "ms": 86_400_000, "us": 86_400_000_000, "ns": 86_400_000_000_000}
_INFINITE_DAYS = 2**31 - 1  # DuckDB's DATE 'infinity' (its negation: '-infinity')
_INFINITE_STAMP = 2**63 - 1  # DuckDB's TIMESTAMP 'infinity'


def python_values(column: pa.Array | pa.ChunkedArray, kind: Any = None,
                  text: pa.Array | pa.ChunkedArray | None = None) -> list[Any]:
    """``column.to_pylist()``, except that a date, time or timestamp Python cannot hold is
    DuckDB's text for it, and, with ``kind`` (the column's ``duckdb.DuckDBPyType``; None: the
    Arrow type alone tells), each value is what DuckDB's Python client gives (see the module
    doc); ``text``, DuckDB's text of the column cast to VARCHAR inside (the same nesting),
    gives a TIME WITH TIME ZONE its offset, which Arrow's encoding drops.

    >>> import duckdb
    >>> python_values(pa.array([b"\\x05\\xfd", None]), duckdb.sql("SELECT '1'::BIT").types[0])
    ['101', None]
    """
    if _walked(column.type, kind):
        array = _whole(column)
        return _values(array, kind, None if text is None else _whole(text), top=True)
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


def holds_unrepresentable(column: pa.Array | pa.ChunkedArray) -> bool:
    """Whether a list, struct or map column holds, anywhere inside, a date, time or timestamp
    Python cannot hold (pandas fails on such a column, or shows midnight for 24:00:00).

    >>> import duckdb
    >>> holds_unrepresentable(duckdb.sql("SELECT [TIME '24:00:00'] l").to_arrow_table()[0])
    True
    """
    array = _whole(column)
    kind = array.type
    if pa.types.is_struct(kind):
        return any(holds_unrepresentable(child) for child in array.flatten())
    if pa.types.is_fixed_size_list(kind):
        return holds_unrepresentable(_fixed_size_children(array))
    if pa.types.is_map(kind):
        low, high = _offset_range(array)
        return any(holds_unrepresentable(child.slice(low, high - low))
                   for child in (array.keys, array.items))
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        low, high = _offset_range(array)
        return holds_unrepresentable(array.values.slice(low, high - low))
    odd = _unrepresentable(array)
    return bool(odd is not None and odd.any())


_TEXT_KINDS = ("hugeint", "uhugeint", "uuid", "bit", "bignum", "time with time zone")
_INFINITE = {"date32": (datetime.date.max, datetime.date.min),
             "timestamp": (datetime.datetime.max, datetime.datetime.min)}
_TIME_WITH_ZONE = re.compile(r"(\d+):(\d\d):(\d\d)(?:\.(\d+))?([+-])(\d\d)(?::(\d\d))?(?::(\d\d))?")


def _whole(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def _kind_id(kind: Any) -> str:
    return getattr(kind, "id", "") if kind is not None else ""


def _child_kinds(kind: Any, count: int) -> list[Any]:
    """The DuckDB types of a nested type's ``count`` children (None each where unknown)."""
    children = list(getattr(kind, "children", None) or []) if kind is not None else []
    if _kind_id(kind) == "union":
        children = children[1:]  # the tag
    kinds = [child[1] for child in children if hasattr(child[1], "id")]
    return kinds[:count] if len(kinds) >= count else [None] * count


def _walked(kind: pa.DataType, duck: Any) -> bool:
    """Whether a column's values need more than ``to_pylist`` and the temporal fix-up."""
    if pa.types.is_union(kind) or pa.types.is_dictionary(kind):
        return False
    return (pa.types.is_nested(kind) or isinstance(kind, pa.BaseExtensionType)
            or kind == pa.month_day_nano_interval()
            or (pa.types.is_timestamp(kind) and kind.unit == "ns")
            or _kind_id(duck) in _TEXT_KINDS)


def _offset_range(array: pa.Array) -> tuple[int, int]:
    offsets = array.offsets
    return (offsets[0].as_py(), offsets[-1].as_py()) if len(offsets) else (0, 0)


def _fixed_size_children(array: pa.Array) -> pa.Array:
    size = array.type.list_size
    return array.values.slice(array.offset * size, len(array) * size)


def _valid(array: pa.Array) -> np.ndarray:
    return array.is_valid().to_numpy(zero_copy_only=False)


def _values(array: pa.Array, kind: Any, text: pa.Array | None, top: bool) -> list[Any]:
    """The Python values of ``array`` (DuckDB type ``kind``, DuckDB's text ``text``), as
    DuckDB's client gives them; ``top``: the column itself, not a value inside one."""
    arrow_kind = array.type
    if isinstance(arrow_kind, pa.BaseExtensionType):
        if getattr(arrow_kind, "type_name", "") in ("bignum", "varint"):
            kind = kind if kind is not None else "bignum"
        array = array.storage
        arrow_kind = array.type
    if pa.types.is_struct(arrow_kind):
        return _struct_values(array, kind, text)
    if pa.types.is_map(arrow_kind):
        return _map_values(array, kind, text)
    if pa.types.is_fixed_size_list(arrow_kind):
        inner = _values(_fixed_size_children(array), _child_kinds(kind, 1)[0],
                        None if text is None else _fixed_size_children(text), False)
        size = arrow_kind.list_size
        return [tuple(inner[k * size:(k + 1) * size]) if ok else None
                for k, ok in enumerate(_valid(array))]
    if pa.types.is_list(arrow_kind) or pa.types.is_large_list(arrow_kind):
        low, high = _offset_range(array)
        inner_text = None
        if text is not None:
            text_low, text_high = _offset_range(text)
            inner_text = text.values.slice(text_low, text_high - text_low)
        inner = _values(array.values.slice(low, high - low), _child_kinds(kind, 1)[0],
                        inner_text, False)
        offsets = (array.offsets.to_numpy(zero_copy_only=False) - low).tolist()
        return [inner[offsets[k]:offsets[k + 1]] if ok else None
                for k, ok in enumerate(_valid(array))]
    if pa.types.is_union(arrow_kind) or pa.types.is_dictionary(arrow_kind):
        return array.to_pylist()
    return _leaf_values(array, kind if isinstance(kind, str) else _kind_id(kind), text, top)


def _struct_values(array: pa.Array, kind: Any, text: pa.Array | None) -> list[Any]:
    fields = [array.type.field(k).name for k in range(array.type.num_fields)]
    kinds = _child_kinds(kind, len(fields))
    texts = text.flatten() if text is not None else [None] * len(fields)
    columns = [_values(child, child_kind, child_text, False)
               for child, child_kind, child_text in zip(array.flatten(), kinds, texts)]
    rows = zip(*columns) if columns else ([] for _ in range(len(array)))
    return [dict(zip(fields, row)) if ok else None for row, ok in zip(rows, _valid(array))]


def _map_values(array: pa.Array, kind: Any, text: pa.Array | None) -> list[Any]:
    """Each map as a dict (DuckDB's ``{'key': [...], 'value': [...]}`` where its keys are
    lists, structs or maps, which a dict cannot hold)."""
    low, high = _offset_range(array)
    key_kind, value_kind = _child_kinds(kind, 2)
    key_text = value_text = None
    if text is not None:
        text_low, text_high = _offset_range(text)
        key_text = text.keys.slice(text_low, text_high - text_low)
        value_text = text.items.slice(text_low, text_high - text_low)
    keys = _values(array.keys.slice(low, high - low), key_kind, key_text, False)
    items = _values(array.items.slice(low, high - low), value_kind, value_text, False)
    offsets = (array.offsets.to_numpy(zero_copy_only=False) - low).tolist()
    nested_keys = pa.types.is_nested(array.type.key_type)
    out: list[Any] = []
    for k, ok in enumerate(_valid(array)):
        if not ok:
            out.append(None)
            continue
        these = slice(offsets[k], offsets[k + 1])
        out.append({"key": keys[these], "value": items[these]} if nested_keys
                   else dict(zip(keys[these], items[these])))
    return out


def _leaf_values(array: pa.Array, kind: str, text: pa.Array | None, top: bool) -> list[Any]:
    """The Python values of a column of scalars of DuckDB type id ``kind`` ("" unknown)."""
    arrow_kind = array.type
    if arrow_kind == pa.month_day_nano_interval():  # DuckDB's client: a month is 30 days
        return [None if v is None else datetime.timedelta(
            days=v.months * 30 + v.days, microseconds=v.nanoseconds // 1000)
            for v in array.to_pylist()]
    if kind == "time with time zone" and text is not None:
        return [None if v is None else _time_with_zone(v) for v in text.to_pylist()]
    if kind in ("hugeint", "uhugeint") and pa.types.is_decimal(arrow_kind):
        wrap = 1 << 128 if kind == "uhugeint" else 0  # Arrow's decimal128 is signed
        return [None if v is None else int(v) + (wrap if v < 0 else 0)
                for v in array.to_pylist()]
    if kind == "uuid" and (pa.types.is_string(arrow_kind) or pa.types.is_large_string(arrow_kind)):
        return [None if v is None else uuid.UUID(v) for v in array.to_pylist()]
    if kind == "bit" and pa.types.is_binary(arrow_kind):
        return [None if v is None else _bit_text(v) for v in array.to_pylist()]
    if kind == "bignum" and pa.types.is_binary(arrow_kind):
        return [None if v is None else _bignum_text(v) for v in array.to_pylist()]
    odd = _unrepresentable(array)
    if odd is None:
        return array.to_pylist()
    if pa.types.is_timestamp(arrow_kind) and arrow_kind.unit == "ns":
        values = _nanoseconds_as_micros(array, odd).to_pylist()  # as DuckDB: datetime
    elif odd.any():
        values = pc.if_else(pa.array(odd), pa.scalar(None, arrow_kind), array).to_pylist()
    else:
        return array.to_pylist()
    counts = _counts(array)
    for k in np.flatnonzero(odd):
        values[k] = _text(arrow_kind, int(counts[k])) if top \
            else _nested_value(arrow_kind, int(counts[k]))
    return values


def _nanoseconds_as_micros(array: pa.Array, odd: np.ndarray) -> pa.Array:
    """A TIMESTAMP_NS column in microseconds, cut toward zero as DuckDB's client cuts them;
    NULL where ``odd``."""
    counts = _counts(array)
    micros = np.where(counts < 0, -(-counts // 1000), counts // 1000)
    missing = ~_valid(array) | odd
    return pa.array(micros, pa.timestamp("us", array.type.tz), mask=missing)


def _nested_value(kind: pa.DataType, count: int) -> Any:
    """A value Python cannot hold inside a list, struct or map, as DuckDB's client gives it:
    an infinite date or timestamp is Python's ``max`` / ``min``, anything else DuckDB's
    text."""
    infinite = _INFINITE_DAYS if pa.types.is_date32(kind) else _INFINITE_STAMP
    group = "date32" if pa.types.is_date32(kind) else "timestamp"
    if (pa.types.is_date32(kind) or pa.types.is_timestamp(kind)) and abs(count) == infinite:
        return _INFINITE[group][0 if count > 0 else 1]
    return _text(kind, count)


def _time_with_zone(text: str) -> Any:
    """A TIME WITH TIME ZONE from DuckDB's text (``12:00:00.5+05:30``); the text itself
    where Python cannot hold it (24:00:00), as DuckDB's client gives.

    >>> str(_time_with_zone("12:00:00.5-03:30")), _time_with_zone("24:00:00+15:59")
    ('12:00:00.500000-03:30', '24:00:00+15:59')
    """
    match = _TIME_WITH_ZONE.fullmatch(text)
    if match is None or int(match.group(1)) >= 24:
        return text
    hour, minute, second = (int(match.group(k)) for k in (1, 2, 3))
    micros = int((match.group(4) or "").ljust(6, "0")[:6])
    offset = datetime.timedelta(hours=int(match.group(6)), minutes=int(match.group(7) or 0),
                                seconds=int(match.group(8) or 0))
    zone = datetime.timezone(-offset if match.group(5) == "-" else offset)
    return datetime.time(hour, minute, second, micros, tzinfo=zone)


def _bit_text(stored: bytes) -> str:
    """A BIT's ``0``/``1`` text from DuckDB's bytes: a first byte counting the padding bits
    that lead the rest.

    >>> _bit_text(b"\\x05\\xfd")
    '101'
    """
    bits = "".join(f"{byte:08b}" for byte in stored[1:])
    return bits[stored[0]:] if stored else ""


def _bignum_text(stored: bytes) -> str:
    """A BIGNUM's decimal text from DuckDB's bytes: a 3-byte header (its top bit set for a
    number >= 0), then the magnitude big-endian, every byte inverted for a negative one.

    >>> _bignum_text(b"\\x80\\x00\\x02\\x01\\x00"), _bignum_text(b"\\x7f\\xff\\xfe\\xfa")
    ('256', '-5')
    """
    if stored[0] & 0x80:
        return str(int.from_bytes(stored[3:], "big"))
    return str(-int.from_bytes(bytes(255 - byte for byte in stored[3:]), "big"))


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
