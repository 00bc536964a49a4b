"""Results as text for the ``tensorql`` shell: the output modes of DuckDB's shell.

A mode is a function in :data:`MODES` from a :class:`Rows` (an Arrow table, DuckDB's names of
its column types and the number of rows in all) to text: ``box`` (the default), ``csv``,
``json``, ``markdown`` and ``line``.

The box is drawn here rather than by DuckDB's renderer (``DuckDBPyRelation.show``) or rich
(installed, but not a declared dependency): DuckDB's renderer wraps long values over several
lines, draws nothing narrower than its own minimum whatever ``max_width`` says, and heads
columns with its internal aliases (``int32``, ``varchar``); the shell cuts the box to the
terminal, elides long values and BLOBs with "…" on one line, and heads columns with the type
names DuckDB's relations report (``INTEGER``, ``VARCHAR``), as the issue asks.

>>> import pyarrow as pa
>>> rows = Rows(pa.table({"i": [1, 2], "s": ["a", "b" * 40]}), ["INTEGER", "VARCHAR"])
>>> print(render(rows, "box", width=30))
┌─────────┬──────────────────┐
│    i    │        s         │
│ INTEGER │     VARCHAR      │
├─────────┼──────────────────┤
│       1 │ a                │
│       2 │ bbbbbbbbbbbbbbb… │
└─────────┴──────────────────┘
>>> print(render(rows, "csv"))
i,s
1,a
2,bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb
"""

from __future__ import annotations

import csv
import datetime
import decimal
import io
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from tensorql.sql.arrow_fixes import column_values, duckdb_columns_of

ELLIPSIS = "…"
MAX_VALUE_WIDTH = 32  # a box cell shows at most this many characters
MIN_VALUE_WIDTH = 8  # ... and a column cut to the terminal keeps at least this many
NUMERIC = ("TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT",
           "UINTEGER", "UBIGINT", "UHUGEINT", "FLOAT", "DOUBLE", "DECIMAL")


@dataclass(frozen=True)
class Rows:
    """Rows to print: ``table`` (the rows shown), ``types`` (DuckDB's type name per column)
    and ``total`` (rows in the whole result; default the table's).

    >>> Rows(pa.table({"x": [1]}), ["BIGINT"]).count
    1
    """

    table: pa.Table
    types: list[str]
    total: int | None = None

    @property
    def count(self) -> int:
        return self.table.num_rows if self.total is None else self.total


def duckdb_types(table: pa.Table) -> list[str]:
    """DuckDB's names of the types of ``table``'s columns: those of the statement that made
    it, for a plain SQL result's rows (``HUGEINT``, ``UUID``, ``BIT``, ...), else those of a
    relation over it.

    >>> duckdb_types(pa.table({"x": pa.array([1], pa.int32()), "y": [0.5], "z": ["a"]}))
    ['INTEGER', 'DOUBLE', 'VARCHAR']
    """
    import duckdb

    columns = duckdb_columns_of(table)
    if columns is not None and len(columns.types) == table.num_columns:
        return [str(t) for t in columns.types]
    con = duckdb.connect()
    try:
        return [str(t) for t in con.from_arrow(table).types]
    finally:
        con.close()


def _text(value: Any, kind: str) -> str:
    """One value as the shell prints it: NULL, the shortest float (float32's for FLOAT), a
    BLOB's bytes as DuckDB escapes them, a list, struct or map as DuckDB writes it.

    >>> import datetime
    >>> _text([datetime.date(2024, 1, 2), None], "DATE[]"), _text({"a": 1.5}, "STRUCT(a DOUBLE)")
    ('[2024-01-02, NULL]', "{'a': 1.5}")
    >>> _text({"k": 1}, "MAP(VARCHAR, INTEGER)"), _text(2.5, "DOUBLE")
    ('{k=1}', '2.5')
    """
    if isinstance(value, (list, tuple)):
        inner = _element_kind(kind)
        return "[" + ", ".join(_text(v, inner) for v in value) + "]"
    if isinstance(value, dict):
        if kind.upper().startswith("MAP("):
            return "{" + ", ".join(f"{_text(k, '')}={_text(v, '')}"
                                   for k, v in value.items()) + "}"
        return "{" + ", ".join(f"'{k}': {_text(v, '')}" for k, v in value.items()) + "}"
    if value is None:
        return "NULL"
    if isinstance(value, datetime.timedelta):
        return _interval_text(value)
    if isinstance(value, bytes):
        return "".join(chr(b) if 32 <= b < 127 and b != 92 else f"\\x{b:02X}" for b in value)
    if isinstance(value, float):
        if kind == "FLOAT" and math.isfinite(value):
            import numpy as np

            return str(np.float32(value))
        return repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _interval_text(value: datetime.timedelta) -> str:
    """An INTERVAL as DuckDB writes it (days, then the time of day when there is one).

    >>> _interval_text(datetime.timedelta(days=3)), _interval_text(datetime.timedelta(0))
    ('3 days', '00:00:00')
    >>> _interval_text(datetime.timedelta(days=1, seconds=3723, microseconds=5))
    '1 day 01:02:03.000005'
    """
    days, rest = value.days, value - datetime.timedelta(days=value.days)
    seconds, micros = rest.seconds, rest.microseconds
    clock = f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
    clock += f".{micros:06d}" if micros else ""
    if not days:
        return clock
    head = f"{days} day{'s' if abs(days) != 1 else ''}"
    return head if not (seconds or micros) else f"{head} {clock}"


def _element_kind(kind: str) -> str:
    """The element type of a list type's name (``FLOAT[]`` -> ``FLOAT``; else "")."""
    kind = kind.strip()
    if kind.endswith("[]"):
        return kind[:-2]
    if kind.endswith("]") and "[" in kind:  # a fixed-size ARRAY: FLOAT[3]
        return kind[:kind.rindex("[")]
    return ""


def _cells(rows: Rows, limit: int | None = None) -> list[list[str]]:
    """The first ``limit`` rows (None: all) as text, each value as DuckDB's Python client
    gives it (:func:`column_values`)."""
    columns = column_values(rows.table, 0, limit)
    return [[_text(v, k) for v, k in zip(row, rows.types)] for row in zip(*columns)]


def _elide(text: str, width: int) -> str:
    """``text`` on one line, at most ``width`` characters (the last one "…" when cut).

    >>> _elide("abcdef", 4), _elide("ab\\ncd", 9)
    ('abc…', 'ab\\\\ncd')
    """
    text = text.replace("\n", "\\n").replace("\t", " ")
    return text if len(text) <= width else text[: max(0, width - 1)] + ELLIPSIS


def _box_width(widths: list[int]) -> int:
    return sum(widths) + 3 * len(widths) + 1


def _fit(widths: list[int], width: int,
         floors: list[int] | None = None) -> tuple[list[int], list[int]]:
    """Which columns a box of at most ``width`` characters shows (indices, in order, with -1
    where the left-out ones were) and how wide each is: columns are taken from the left and
    the right in turn, as DuckDB's shell does, after the widest ones are narrowed down to
    their ``floors`` (default ``MIN_VALUE_WIDTH``); a lone column too wide is narrowed
    further."""
    n = len(widths)
    widths = list(widths)
    floors = floors or [MIN_VALUE_WIDTH] * n
    while _box_width(widths) > width:
        widest = max(range(n), key=lambda k: widths[k] - floors[k])
        if widths[widest] <= floors[widest]:
            break
        widths[widest] -= 1
    if _box_width(widths) <= width:
        return list(range(n)), widths
    order = [i for pair in zip(range(n), reversed(range(n))) for i in pair]
    chosen: list[int] = []
    for i in dict.fromkeys(order[:n]):
        trial = sorted(chosen + [i])
        if _box_width([widths[k] for k in trial] + [1]) > width:
            break
        chosen = trial
    if not chosen:  # not even one column fits: narrow the first one
        narrow = max(MIN_VALUE_WIDTH, width - _box_width([1]) - 1 - (3 if n > 1 else 0))
        return ([0, -1] if n > 1 else [0]), [min(widths[0], narrow)] + ([1] if n > 1 else [])
    shown: list[int] = []
    for i in chosen:
        if shown and shown[-1] >= 0 and i != shown[-1] + 1:
            shown.append(-1)
        shown.append(i)
    if len(chosen) < n and -1 not in shown:
        shown.append(-1)
    return shown, [widths[i] if i >= 0 else 1 for i in shown]


def box(rows: Rows, width: int = 80, max_rows: int = 40) -> str:
    """The rows in a box of at most ``width`` characters (names and DuckDB types on top), at
    most ``max_rows`` of them; values longer than ``MAX_VALUE_WIDTH`` and columns beyond the
    width are elided with "…", and a footer counts what was left out.

    >>> t = pa.table({f"c{i}": [i] for i in range(12)})
    >>> print(box(Rows(t, ["BIGINT"] * 12), width=40))
    ┌────────┬────────┬───┬────────┐
    │   c0   │   c1   │ … │  c11   │
    │ BIGINT │ BIGINT │   │ BIGINT │
    ├────────┼────────┼───┼────────┤
    │      0 │      1 │ … │     11 │
    └────────┴────────┴───┴────────┘
      12 columns (3 shown)
    """
    names = rows.table.column_names
    if not names:
        return ""
    cells = [[_elide(c, MAX_VALUE_WIDTH) for c in r] for r in _cells(rows, max(0, max_rows))]
    heads = [_elide(n, MAX_VALUE_WIDTH) for n in names]
    widths = [max([len(h), len(t)] + [len(r[k]) for r in cells])
              for k, (h, t) in enumerate(zip(heads, rows.types))]
    floors = [min(w, max(MIN_VALUE_WIDTH, len(h), len(t)))
              for w, h, t in zip(widths, heads, rows.types)]
    order, widths = _fit(widths, width, floors)

    def pick(values: list[str], gap: str) -> list[str]:
        return [_elide(values[i], w) if i >= 0 else gap for i, w in zip(order, widths)]

    right = [i >= 0 and rows.types[i].split("(")[0] in NUMERIC for i in order]

    def line(values: Any) -> str:
        return "│ " + " │ ".join(values)

    out = ["┌─" + "─┬─".join("─" * w for w in widths) + "─┐",
           line(h.center(w) for h, w in zip(pick(heads, ELLIPSIS), widths)) + " │",
           line(t.center(w) for t, w in zip(pick(rows.types, ""), widths)) + " │",
           "├─" + "─┼─".join("─" * w for w in widths) + "─┤"]
    for r in cells:
        out.append(line((v.rjust(w) if num else v.ljust(w))
                        for v, w, num in zip(pick(r, ELLIPSIS), widths, right)) + " │")
    out.append("└─" + "─┴─".join("─" * w for w in widths) + "─┘")
    notes = []
    if rows.count > len(cells):
        notes.append(f"{rows.count} rows ({len(cells)} shown)")
    if -1 in order:
        notes.append(f"{len(names)} columns ({len(order) - 1} shown)")
    if notes:
        out.append("  " + "  ".join(notes))
    return "\n".join(out)


def to_csv(rows: Rows, **_: Any) -> str:
    """A header line, then one line per row (DuckDB's ``.mode csv``)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(rows.table.column_names)
    for row in zip(*column_values(rows.table)):
        writer.writerow(["" if v is None else _text(v, k) for v, k in zip(row, rows.types)])
    return buf.getvalue().rstrip("\n")


def _json_value(value: Any, kind: str) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, (list, tuple)):  # JSON arrays and objects, as DuckDB's json mode
        inner = _element_kind(kind)
        return [_json_value(v, inner) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _json_value(v, "") for k, v in value.items()}
    if isinstance(value, decimal.Decimal) and value.is_finite():  # a number, as DuckDB's
        number = float(value)
        if decimal.Decimal(repr(number)) == value:  # (else its exact text)
            return number
    if isinstance(value, float):
        return value if math.isfinite(value) else _text(value, kind)
    return _text(value, kind)


def to_json(rows: Rows, **_: Any) -> str:
    """A JSON array with an object per row, one row a line (DuckDB's ``.mode json``).

    >>> print(to_json(Rows(pa.table({"x": [1, None]}), ["BIGINT"])))
    [{"x":1},
    {"x":null}]
    """
    names = rows.table.column_names
    keys = [json.dumps(n, ensure_ascii=False) for n in names]  # a repeated name kept, twice
    lines = ["{" + ",".join(f"{key}:{json.dumps(_json_value(v, k), ensure_ascii=False)}"
                            for key, v, k in zip(keys, row, rows.types)) + "}"
             for row in zip(*column_values(rows.table))]
    return "[" + ",\n".join(lines) + "]"


def to_markdown(rows: Rows, **_: Any) -> str:
    """A Markdown table, numbers aligned right (DuckDB's ``.mode markdown``).

    >>> print(to_markdown(Rows(pa.table({"x": [1], "s": ["a|b"]}), ["BIGINT", "VARCHAR"])))
    |  x  |  s   |
    |----:|------|
    |   1 | a\\|b |
    """
    names = [n.replace("|", "\\|") for n in rows.table.column_names]
    cells = [[v.replace("|", "\\|") for v in r] for r in _cells(rows)]
    widths = [max([len(n), 3] + [len(r[k]) for r in cells]) for k, n in enumerate(names)]
    right = [t.split("(")[0] in NUMERIC for t in rows.types]
    out = ["| " + " | ".join(n.center(w) for n, w in zip(names, widths)) + " |",
           "|" + "|".join(("-" * (w + 1) + ":") if num else "-" * (w + 2)
                          for w, num in zip(widths, right)) + "|"]
    out += ["| " + " | ".join(v.rjust(w) if num else v.ljust(w)
                              for v, w, num in zip(r, widths, right)) + " |" for r in cells]
    return "\n".join(out)


def to_line(rows: Rows, **_: Any) -> str:
    """One ``name = value`` line per column, rows apart by a blank line (DuckDB's ``.mode
    line``).

    >>> print(to_line(Rows(pa.table({"x": [1, 2], "name": ["a", "b"]}), ["BIGINT", "VARCHAR"])))
       x = 1
    name = a
    <BLANKLINE>
       x = 2
    name = b
    """
    names = rows.table.column_names
    pad = max((len(n) for n in names), default=0)
    blocks = ["\n".join(f"{n.rjust(pad)} = {v}" for n, v in zip(names, r))
              for r in _cells(rows)]
    return "\n\n".join(blocks)


MODES: dict[str, Callable[..., str]] = {"box": box, "csv": to_csv, "json": to_json,
                                        "markdown": to_markdown, "line": to_line}


def render(rows: Rows, mode: str = "box", *, width: int = 80, max_rows: int = 40) -> str:
    """``rows`` as text in output ``mode`` (a key of :data:`MODES`); only a box is cut to
    ``width`` and ``max_rows`` (the other modes are for programs, and print every row)."""
    if mode == "box":
        return box(rows, width=width, max_rows=max_rows)
    return MODES[mode](rows)
