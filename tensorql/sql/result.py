"""What a SQL statement returns: element rows, a dense tensor or text, used like a DuckDB
relation (``fetchone`` / ``fetchmany`` / ``fetchall``, ``fetchnumpy``, ``fetchdf`` / ``df``,
``pl``, ``arrow``, ``description``, ``types``, ``shape``, ``show``, ``len``, iteration,
``to_table`` / ``write_parquet`` / ``write_csv``, and the relational chaining of
``filter`` / ``project`` / ``order`` / ``limit`` / ``aggregate``, which DuckDB runs over the
rows) and like a tensor (``numpy`` / ``torch``).

>>> r = SQLResult(table=pa.table({"i": [0, 1], "val": [2.5, 4.0]}))
>>> len(r), r.fetchone(), r.fetchmany(5)
(2, (0, 2.5), [(1, 4.0)])
>>> r.types, r.shape, r.filter("val > 3").fetchall()
(['BIGINT', 'DOUBLE'], (2, 2), [(1, 4.0)])
>>> print(r)
┌───────┬────────┐
│   i   │  val   │
│ int64 │ double │
├───────┼────────┤
│     0 │    2.5 │
│     1 │    4.0 │
└───────┴────────┘
"""

from __future__ import annotations

import html
import importlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from tensorql.errors import OptionError, ShapeError, StorageError, UnsupportedError, as_count
from tensorql.sql.arrow_fixes import (
    arrow_of,
    column_values,
    duckdb_columns_of,
    relation_of,
    wide_decimals_as_text,
)
from tensorql.sql.errors import SQLExecutionError
from tensorql.sql.relational import dense_bytes
from tensorql.sql.relations import agg_identity, densify, label_columns, rows_to_dense, tensor_rows
from tensorql.sql.temporal import (
    holds_unrepresentable,
    intervals_as_durations,
    text_where_unrepresentable,
)
from tensorql.units import format_bytes

__all__ = ["DenseForm", "SQLResult", "format_html", "format_table"]


@dataclass(frozen=True)
class DenseForm:
    """What the rows of a relational EINSUM are as a tensor: ``shape``, the aggregation
    ``agg`` whose identity fills cells without a row, and the most bytes densifying may take
    (``limit``; None: unbounded)."""

    shape: tuple[int, ...]
    agg: str
    limit: int | None = None


@dataclass(frozen=True)
class SQLResult:
    """A statement's result. A tensor result (``tensor`` with its output ``labels``) yields one
    row per *present* element: with relation operands, cells nothing contributed to
    (``present`` False) are left out of the rows and hold the aggregation's identity in the
    dense tensor.

    >>> SQLResult(text="ok").fetchall()
    [('ok',)]
    """

    table: pa.Table | None = None
    tensor: torch.Tensor | None = None
    labels: tuple[str, ...] = ()
    text: str | None = None
    present: torch.Tensor | None = None
    dense: DenseForm | None = None
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    # -- rows -----------------------------------------------------------------------------
    @property
    def columns(self) -> list[str]:
        return self.arrow().column_names

    def arrow(self) -> pa.Table:
        """The result as an Arrow table (element rows for a tensor result)."""
        if self.table is not None:
            return self.table
        if "arrow" not in self._cache:
            if self.tensor is not None:
                rows = tensor_rows(self.tensor, self.labels)
                if self.present is not None:
                    mask = self.present.expand(self.tensor.shape).reshape(-1).numpy()
                    rows = rows.filter(pa.array(mask))
                self._cache["arrow"] = rows
            else:
                self._cache["arrow"] = pa.table({"result": [self.text or ""]})
        return self._cache["arrow"]

    def fetchall(self) -> list[tuple]:
        """Every remaining row as a tuple (all rows on a fresh result)."""
        start = self._cache.get("cursor", 0)
        rows = self._rows(start, None)
        self._cache["cursor"] = start + len(rows)
        return rows

    def fetchmany(self, size: int = 1) -> list[tuple]:
        """The next ``size`` rows."""
        start = self._cache.get("cursor", 0)
        rows = self._rows(start, as_count(size, "fetchmany size"))
        self._cache["cursor"] = start + len(rows)
        return rows

    def fetchone(self) -> tuple | None:
        """The next row, or None after the last."""
        rows = self.fetchmany(1)
        return rows[0] if rows else None

    def _rows(self, start: int, count: int | None) -> list[tuple]:
        """Rows ``start`` .. ``start + count`` as tuples of the values DuckDB's Python client
        gives (:func:`column_values`: by DuckDB's own column types for a plain SQL result).

        >>> r = SQLResult(table=arrow_of(_duckdb().sql("SELECT MAP {'k': 1} AS m")))
        >>> r.fetchall()
        [({'k': 1},)]
        """
        table = self.arrow()
        if not table.num_columns:
            return []
        return list(zip(*column_values(table, start, count)))

    def fetchnumpy(self) -> dict[str, np.ndarray]:
        """Columns as numpy arrays, by name (as DuckDB's ``fetchnumpy``: a repeated name gets
        a suffix, ``a``, ``a_1``, ...).

        >>> sorted(SQLResult(table=pa.table([[1], [2]], names=["a", "a"])).fetchnumpy())
        ['a', 'a_1']
        """
        table = text_where_unrepresentable(_unique_names(self.arrow()))
        return {name: table.column(name).to_numpy() for name in table.column_names}

    def __len__(self) -> int:
        return self.arrow().num_rows

    def __iter__(self) -> Iterator[tuple]:
        return iter(self._rows(0, None))

    def fetchdf(self) -> Any:
        """The rows as a pandas DataFrame (as DuckDB's ``fetchdf``; needs pandas)."""
        pandas = _optional("pandas", "df() / fetchdf()", ".arrow() / .fetchnumpy()")
        table = _unique_names(self.arrow())
        # pandas fails on a date or time Python cannot hold inside a list / struct / map:
        # such a column is one of Python objects, as DuckDB's client gives them
        odd = [k for k, column in enumerate(table.columns)
               if pa.types.is_nested(column.type) and holds_unrepresentable(column)]
        if not odd:
            return text_where_unrepresentable(table).to_pandas()
        objects = dict(zip(odd, column_values(self.arrow(), which=odd)))
        for k in odd:
            table = table.set_column(k, table.field(k).name, pa.nulls(table.num_rows))
        frame = text_where_unrepresentable(table).to_pandas()
        for k in odd:
            frame[table.field(k).name] = pandas.Series(objects[k], index=frame.index,
                                                       dtype=object)
        return frame

    def df(self) -> Any:
        """The rows as a pandas DataFrame (as DuckDB's ``df``; needs pandas)."""
        return self.fetchdf()

    def pl(self) -> Any:
        """The rows as a polars DataFrame (as DuckDB's ``pl``; needs polars)."""
        polars = _optional("polars", "pl()", ".arrow() / .df()")
        # polars refuses a repeated name and an INTERVAL; it would show TIME '24:00:00' as
        # midnight
        table = _unique_names(self.arrow())
        table = wide_decimals_as_text(intervals_as_durations(text_where_unrepresentable(table)))
        return polars.from_arrow(table)

    # -- as a DuckDB relation --------------------------------------------------------------
    def bound(self, connection: Any, check_name: Any = None) -> SQLResult:
        """This result, with the DuckDB ``connection`` that :meth:`to_table` writes to and
        the relational methods run on (``Database.sql`` binds its own, and ``check_name``,
        which refuses a table name taken by a stored tensor's view); returns ``self``."""
        self._cache["connection"] = connection
        if check_name is not None:
            self._cache["check_name"] = check_name
        return self

    def _duckdb(self, what: str, call: Any) -> Any:
        """``call()`` (a DuckDB relation method named ``what``, with its arguments); DuckDB's
        error becomes a tensorql one naming the call: a file it cannot write is a StorageError,
        anything else (an unknown column, a syntax error, a value out of range) an
        SQLExecutionError.

        >>> SQLResult(table=pa.table({"val": [1.0]})).filter("nope > 1")
        Traceback (most recent call last):
        ...
        tensorql.sql.errors.SQLExecutionError: filter('nope > 1'): DuckDB: Binder Error: ...
        """
        import duckdb

        try:
            return call()
        except duckdb.IOException as err:
            raise StorageError(f"{what}: DuckDB: {str(err).splitlines()[0]}") from None
        except (duckdb.Error, TypeError, ValueError, OverflowError) as err:
            raise SQLExecutionError(f"{what}: DuckDB: {str(err).splitlines()[0]}") from None

    def relation(self) -> Any:
        """A ``duckdb.DuckDBPyRelation`` over the rows (the element rows ``(labels..., val)``
        of a tensor result), on the bound connection (else a private in-memory one)."""
        if "relation" not in self._cache:
            import duckdb

            con = self._cache.get("connection")
            if con is None:
                con = self._cache["connection"] = duckdb.connect()
            try:
                self._cache["relation"] = relation_of(con, self.arrow())
            except duckdb.ConnectionException as err:  # its session was closed since
                raise StorageError(f"the connection of this result is closed ({err}); its "
                                   "rows are still here: .fetchall(), .arrow(), .df()") from None
        return self._cache["relation"]

    @property
    def description(self) -> list[tuple]:
        """One 7-tuple per column, as DuckDB's (and the DB-API's): name, type, then None."""
        return [(name, str(kind), None, None, None, None, None)
                for name, kind in zip(self.columns, self.types)]

    @property
    def types(self) -> list[str]:
        """DuckDB's names of the columns' types ("BIGINT", "DOUBLE", ...): those of the
        statement's own result for plain SQL (``HUGEINT``, ``UUID``, ``ENUM(...)``, which Arrow
        has no types for), else those of a relation over the rows.

        >>> SQLResult(table=arrow_of(_duckdb().sql("SELECT [1::HUGEINT] AS h"))).types
        ['HUGEINT[]']
        """
        if "types" not in self._cache:
            columns = duckdb_columns_of(self.arrow())
            kinds = columns.types if columns is not None else self.relation().types
            self._cache["types"] = [str(t) for t in kinds]
        return self._cache["types"]

    dtypes = types

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, columns), as DuckDB's relation's ``shape``."""
        table = self.arrow()
        return (table.num_rows, table.num_columns)

    def _chain(self, what: str, method: str, *args: Any) -> SQLResult:
        """The relation's ``method(*args)`` as a new result (``what`` names the call in an
        error)."""
        table = self._duckdb(what, lambda: arrow_of(getattr(self.relation(), method)(*args)))
        return SQLResult(table=table).bound(self._cache.get("connection"),
                                            self._cache.get("check_name"))

    def filter(self, condition: str) -> SQLResult:
        """The rows where the SQL ``condition`` holds (DuckDB's ``filter``)."""
        return self._chain(f"filter({condition!r})", "filter", condition)

    def project(self, *expressions: str) -> SQLResult:
        """The SQL ``expressions`` of each row (DuckDB's ``project``; several strings are
        one list)."""
        if all(isinstance(e, str) for e in expressions):
            expressions = (", ".join(expressions),)
        shown = ", ".join(repr(e) for e in expressions)
        return self._chain(f"project({shown})", "project", *expressions)

    select = project

    def order(self, expression: str) -> SQLResult:
        """The rows sorted by the SQL ``expression`` (DuckDB's ``order``)."""
        return self._chain(f"order({expression!r})", "order", expression)

    def limit(self, n: int, offset: int = 0) -> SQLResult:
        """At most ``n`` rows from ``offset`` (DuckDB's ``limit``)."""
        return self._chain(f"limit({n!r}, {offset!r})", "limit", n, offset)

    def aggregate(self, expressions: str, group: str = "") -> SQLResult:
        """The SQL aggregate ``expressions`` per ``group`` (DuckDB's ``aggregate``)."""
        return self._chain(f"aggregate({expressions!r}, {group!r})", "aggregate", expressions,
                           group)

    def distinct(self) -> SQLResult:
        """The distinct rows (DuckDB's ``distinct``)."""
        return self._chain("distinct()", "distinct")

    def to_table(self, name: str) -> None:
        """Create table ``name`` from the rows on the bound connection (DuckDB's
        ``to_table``)."""
        if not isinstance(name, str) or not name:
            raise SQLExecutionError(f"to_table: the table's name must be a non-empty string, "
                                    f"got {name!r:.60}")
        check = self._cache.get("check_name")
        if check is not None:
            check(name)
        self._duckdb(f"to_table({name!r})", lambda: self.relation().to_table(name))

    create = to_table

    def write_parquet(self, path: str, **options: Any) -> None:
        """Write the rows to a Parquet file (DuckDB's ``write_parquet``)."""
        path = _file_path(path, "write_parquet")
        self._duckdb(f"write_parquet({path!r})",
                     lambda: self.relation().write_parquet(path, **options))

    to_parquet = write_parquet

    def write_csv(self, path: str, **options: Any) -> None:
        """Write the rows to a CSV file (DuckDB's ``write_csv``)."""
        path = _file_path(path, "write_csv")
        self._duckdb(f"write_csv({path!r})",
                     lambda: self.relation().write_csv(path, **options))

    to_csv = write_csv

    # -- tensors --------------------------------------------------------------------------
    def torch(self) -> torch.Tensor:
        """The dense tensor: label columns index it (sizes: max index + 1), missing rows are 0."""
        if self.tensor is not None:
            return self.tensor
        if "dense" not in self._cache and self.dense is not None:
            self._cache["dense"] = self._densified(self.dense)
        if "dense" not in self._cache:
            table = self.arrow()
            try:
                labels = label_columns(table)
            except ShapeError as err:
                raise ShapeError(f"the result is not tensor-valued: {err}") from None
            shape = []
            for label in labels:
                col = table.column(label)
                if not pa.types.is_integer(col.type):
                    raise ShapeError(f"the result is not tensor-valued: column {label!r} is "
                                     f"{col.type}, not an integer index")
                if col.null_count:
                    raise ShapeError(f"the result is not tensor-valued: column {label!r} has "
                                     "NULL indices")
                shape.append(int(col.to_numpy().max()) + 1 if table.num_rows else 0)
            self._cache["dense"] = rows_to_dense(table, labels, shape)
        return self._cache["dense"]

    def _densified(self, form: DenseForm) -> torch.Tensor:
        """The rows of a relational EINSUM as a tensor of ``form.shape``, the aggregation's
        identity where no row is; ShapeError beyond ``form.limit`` bytes (read the rows
        instead)."""
        table = self.arrow()
        need = dense_bytes(form.shape, 8)  # as the relational path's bound counts it
        if form.limit is not None and need > form.limit:
            raise ShapeError(f"this EINSUM's result has {table.num_rows:,} row(s) but as a dense "
                             f"tensor of shape {form.shape} it would take {format_bytes(need)}, "
                             f"more than the limit of {format_bytes(form.limit)} "
                             "(Options.relation_dense_bytes / "
                             "memory_limit); read its rows (fetchall, arrow, fetchnumpy)")
        return densify(table, list(self.labels), form.shape, fill=agg_identity(form.agg),
                       agg=form.agg, max_bytes=None).values

    def numpy(self) -> np.ndarray:
        return self.torch().numpy()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.numpy()
        return out.astype(dtype) if dtype is not None else out

    # -- text -----------------------------------------------------------------------------
    def show(self, max_rows: int = 40) -> None:
        """Print the result as a box of at most ``max_rows`` rows (like DuckDB's ``show``)."""
        print(self.render(max_rows))

    def render(self, max_rows: int = 40) -> str:
        """The box :meth:`show` prints."""
        max_rows = as_count(max_rows, "max_rows")
        if self.text is not None:
            return self.text
        if self.tensor is not None and "arrow" not in self._cache:
            head, total = self._tensor_head(max_rows)
            return format_table(head, limit=max_rows, total=total)
        return format_table(self.arrow(), limit=max_rows)

    def _tensor_head(self, count: int) -> tuple[pa.Table, int]:
        """The first ``count`` element rows of a tensor result and the number of rows in all,
        without building the rest."""
        tensor = self.tensor.detach().cpu()
        if self.present is not None:
            mask = self.present.expand(tensor.shape).reshape(-1)
            flat = torch.nonzero(mask).reshape(-1)
            total = int(flat.numel())
            flat = flat[:count]
        else:
            total = tensor.numel()
            flat = torch.arange(min(count, total))
        columns: dict[str, Any] = {}
        rest = flat.clone()
        for label, size in reversed(list(zip(self.labels, tensor.shape))):
            columns[label] = pa.array((rest % max(size, 1)).numpy())
            rest = rest // max(size, 1)
        rows = {label: columns[label] for label in self.labels}
        values = tensor.reshape(-1)[flat]
        if values.dtype in (torch.bfloat16, torch.float16):
            values = values.to(torch.float32)
        rows["val"] = pa.array(values.numpy())
        return pa.table(rows), total

    def __str__(self) -> str:
        return self.render()

    def _repr_html_(self, max_rows: int = 40) -> str:
        """An HTML table of the first ``max_rows`` rows (names and DuckDB types on top), for
        notebooks; the text of an EXPLAIN as preformatted text."""
        max_rows = as_count(max_rows, "max_rows")
        if self.text is not None:
            return f"<pre>{html.escape(self.text)}</pre>"
        if self.tensor is not None and "arrow" not in self._cache:
            table, total = self._tensor_head(max_rows)
        else:
            table, total = self.arrow(), len(self)
        return format_html(table, total, limit=max_rows)

    def __repr__(self) -> str:
        if self.text is not None:
            text = self.text if len(self.text) <= 200 else self.text[:200] + "..."
            return f"<SQLResult text={text!r}>"
        if self.tensor is not None:
            shape = "x".join(map(str, self.tensor.shape)) or "scalar"
            return (f"<SQLResult tensor ({', '.join(self.labels)}) {shape} "
                    f"{str(self.tensor.dtype).removeprefix('torch.')}>")
        return f"<SQLResult {len(self)} row(s), columns {self.columns}>\n" \
               + format_table(self.arrow(), limit=10)


def _unique_names(table: pa.Table) -> pa.Table:
    """``table`` with a repeated column name suffixed as DuckDB's ``df`` / ``pl`` /
    ``fetchnumpy`` do: names compare ignoring case, a repeat gets the next free ``_<n>``.

    >>> _unique_names(pa.table([[1], [2], [3]], names=["a", "a", "a_1"])).column_names
    ['a', 'a_1', 'a_1_1']
    >>> _unique_names(pa.table([[1], [2], [3]], names=["a", "a", "A"])).column_names
    ['a', 'a_1', 'A_2']
    """
    names = table.column_names
    if len({name.lower() for name in names}) == len(names):
        return table
    next_suffix: dict[str, int] = {}  # a name taken (lower case) -> the next suffix to try
    unique = []
    for name in names:
        key = name
        if name.lower() in next_suffix:
            suffix = next_suffix[name.lower()]
            key = f"{name}_{suffix}"
            while key.lower() in next_suffix:
                suffix += 1
                key = f"{name}_{suffix}"
            next_suffix[name.lower()] = suffix + 1
        next_suffix[key.lower()] = 1
        unique.append(key)
    return table.rename_columns(unique)


def _duckdb() -> Any:
    """A fresh in-memory DuckDB connection (for the examples)."""
    import duckdb

    return duckdb.connect()


def _file_path(path: Any, what: str) -> str:
    """A file path argument as a string: a str or an ``os.PathLike``; anything else (None,
    a number) an OptionError -- ``str(None)`` would write a file named "None"."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise OptionError(f"{what} needs a file path (a str or pathlib.Path), got {path!r:.60}")
    return path


def _optional(module: str, what: str, instead: str) -> Any:
    """The optional ``module``; UnsupportedError saying ``what`` needs it when it is not
    installed (and what to use ``instead``)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UnsupportedError(f"{what} needs {module}, which is not installed; pip install "
                               f"{module}, or use {instead}") from None


def format_table(table: pa.Table, limit: int = 40, total: int | None = None) -> str:
    """A box of the first ``limit`` rows (column names and types on top, as DuckDB's shell
    prints), with a footer counting the rows (``total``, default the table's) when some are
    left out.

    >>> print(format_table(pa.table({"x": [1, 2, 3]}), limit=2))
    ┌───────┐
    │   x   │
    │ int64 │
    ├───────┤
    │     1 │
    │     2 │
    └───────┘
      3 rows (2 shown)
    """
    names = table.column_names
    if not names:
        return "(no columns)"
    limit = max(0, int(limit))
    rows = [[_cell(v) for v in row] for row in zip(*column_values(table, 0, limit))]
    types = [str(t) for t in table.schema.types]
    widths = [max([len(n), len(t)] + [len(r[k]) for r in rows])
              for k, (n, t) in enumerate(zip(names, types))]
    out = ["┌─" + "─┬─".join("─" * w for w in widths) + "─┐",
           "│ " + " │ ".join(n.center(w) for n, w in zip(names, widths)) + " │",
           "│ " + " │ ".join(t.center(w) for t, w in zip(types, widths)) + " │",
           "├─" + "─┼─".join("─" * w for w in widths) + "─┤"]
    out += ["│ " + " │ ".join(v.rjust(w) for v, w in zip(r, widths)) + " │" for r in rows]
    out.append("└─" + "─┴─".join("─" * w for w in widths) + "─┘")
    total = table.num_rows if total is None else total
    if total > len(rows):
        out.append(f"  {total} rows ({len(rows)} shown)")
    return "\n".join(out)


def format_html(table: pa.Table, total: int | None = None, limit: int | None = None) -> str:
    """The first ``limit`` rows of ``table`` (all: None) as an HTML table (column names over
    their DuckDB-style Arrow types), with a footer counting ``total`` rows when more exist
    than are shown.

    >>> format_html(pa.table({"x": [1]}))[:60]
    '<table><thead><tr><th>x<br><small>int64</small></th></tr></t'
    """
    head = "".join(f"<th>{html.escape(name)}<br><small>{html.escape(str(kind))}</small></th>"
                   for name, kind in zip(table.column_names, table.schema.types))
    rows = list(zip(*column_values(table, 0, limit)))
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(v))}</td>" for v in row) + "</tr>"
                   for row in rows)
    out = f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    total = table.num_rows if total is None else total
    if total > len(rows):
        out += f"<p>{total} rows ({len(rows)} shown)</p>"
    return out


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return repr(value)  # the shortest text that reads back the same, as DuckDB's
    return str(value)
