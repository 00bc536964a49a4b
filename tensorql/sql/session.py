"""Run SQL scripts with EINSUM: the engine computes each EINSUM, DuckDB runs the rest.

A statement without EINSUM goes to DuckDB verbatim. In a statement with EINSUM, each EINSUM
call becomes a lazy tensorql expression over its operands (stored tensors; CTEs that are
themselves a bare EINSUM, fused into one plan; or any relation, read as a sparse tensor); its
result is registered in DuckDB as an Arrow table of element rows under a temporary name, the
sqlglot tree is rewritten to read that table, and DuckDB runs what is left. A statement that is
exactly ``SELECT * FROM EINSUM(...)`` never leaves the engine: its result is the dense tensor.

>>> import numpy as np, tensorql as tq
>>> db = tq.connect()
>>> _ = db.from_numpy("A", np.arange(6, dtype=np.float32).reshape(2, 3))
>>> db.sql("SELECT * FROM EINSUM('ij->i', A)").numpy().tolist()
[3.0, 12.0]
>>> db.sql("SELECT i, val FROM EINSUM('ij->i', A) WHERE val > 5").fetchall()
[(1, 12.0)]
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np
import pyarrow as pa
import torch
from sqlglot import exp

from tensorql.api.einsum import einsum as lazy_einsum
from tensorql.api.tensor import Tensor
from tensorql.dtypes import torch_dtype
from tensorql.einsum.spec import AGGS, JOINS, UnknownOperatorError
from tensorql.errors import ParseError, ShapeError, TensorQLError
from tensorql.sql.dialect import (
    CreateTensor,
    DropTensor,
    Einsum,
    Explain,
    Statement,
    has_einsum,
    parse_script,
    position_of,
)
from tensorql.sql.errors import (
    SQLExecutionError,
    SQLOperatorError,
    SQLShapeError,
    SQLUnknownTensorError,
    located,
)
from tensorql.sql.relations import label_columns, rows_to_dense, tensor_rows, value_dtype

if TYPE_CHECKING:
    from tensorql.api.database import Database

__all__ = ["SQLResult", "run_sql"]

_NAMED = ("join", "agg", "backend", "sizes")
_TEMP = itertools.count()


@dataclass(frozen=True)
class SQLResult:
    """What a statement returned: element rows, a dense tensor, or text (EXPLAIN, DDL).

    ``.arrow()`` / ``.fetchall()`` give rows; ``.numpy()`` / ``.torch()`` the dense tensor of a
    tensor-valued result (integer label columns + ``val``); ``str()`` the text or a table.

    >>> SQLResult(text="ok").fetchall()
    [('ok',)]
    """

    table: pa.Table | None = None
    tensor: torch.Tensor | None = None
    labels: tuple[str, ...] = ()
    text: str | None = None
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def columns(self) -> list[str]:
        return self.arrow().column_names

    def arrow(self) -> pa.Table:
        """The result as an Arrow table (element rows for a tensor result)."""
        if self.table is not None:
            return self.table
        if "arrow" not in self._cache:
            if self.tensor is not None:
                self._cache["arrow"] = tensor_rows(self.tensor, self.labels)
            else:
                self._cache["arrow"] = pa.table({"result": [self.text or ""]})
        return self._cache["arrow"]

    def fetchall(self) -> list[tuple]:
        table = self.arrow()
        return list(zip(*(col.to_pylist() for col in table.columns))) if table.num_columns \
            else []

    def torch(self) -> torch.Tensor:
        """The dense tensor: label columns index it (sizes: max index + 1), missing rows are 0."""
        if self.tensor is not None:
            return self.tensor
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
                shape.append(int(col.to_numpy().max()) + 1 if table.num_rows else 0)
            self._cache["dense"] = rows_to_dense(table, labels, shape)
        return self._cache["dense"]

    def numpy(self) -> np.ndarray:
        return self.torch().numpy()

    def __str__(self) -> str:
        if self.text is not None:
            return self.text
        return format_table(self.arrow())


def format_table(table: pa.Table, limit: int = 40) -> str:
    """A plain-text table of the first ``limit`` rows."""
    names = table.column_names
    rows = [[_cell(v) for v in row] for row in
            zip(*(c.to_pylist() for c in table.slice(0, limit).columns))] if names else []
    widths = [max([len(n)] + [len(r[k]) for r in rows]) for k, n in enumerate(names)]
    line = " | ".join(n.ljust(w) for n, w in zip(names, widths))
    out = [line, "-+-".join("-" * w for w in widths)]
    out += [" | ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    if table.num_rows > limit:
        out.append(f"... ({table.num_rows} rows)")
    return "\n".join(out)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


@dataclass
class _Call:
    """One EINSUM call resolved into a lazy tensor."""

    tensor: Tensor
    labels: tuple[str, ...]
    backend: str
    node: Einsum


class _Runner:
    """Runs the statements of one script against a database."""

    def __init__(self, db: Database, script: str, backend: str | None) -> None:
        self.db = db
        self.script = script
        self.backend = backend
        self.con = db.connection
        self.registered: list[str] = []
        self.statement: Statement | None = None
        self.explain_sections: list[str] | None = None
        self.analyze = False
        self.expanding: set[str] = set()  # CTEs being read as rows (a cycle is an error)

    # -- positions --------------------------------------------------------------------
    def pos(self, node: exp.Expr | None) -> int | None:
        st = self.statement
        p = position_of(node)
        if st is None:
            return p
        return st.offset + (p if p is not None else 0)

    def fail(self, cls, message: str, node: exp.Expr | None):
        return cls(message, text=self.script, position=self.pos(node))

    # -- statements -------------------------------------------------------------------
    def run(self) -> SQLResult:
        statements = parse_script(self.script)
        if not statements:
            raise ParseError("no SQL statement given", text=self.script, position=0)
        result = SQLResult(text="")
        for st in statements:
            self.statement = st
            try:
                result = self.statement_result(st)
            finally:
                self.unregister()
        return result

    def unregister(self) -> None:
        for name in self.registered:
            try:
                self.con.unregister(name)
            except duckdb.Error:  # pragma: no cover - already gone
                pass
        self.registered.clear()

    def statement_result(self, st: Statement) -> SQLResult:
        e = st.expression
        if isinstance(e, Explain):
            return self.explain(e)
        if isinstance(e, CreateTensor):
            return self.create_tensor(e)
        if isinstance(e, DropTensor):
            return self.drop_tensor(e)
        if not has_einsum(e):
            return self.duckdb(st.text, original=True)
        if not isinstance(e, exp.Query):
            raise self.fail(SQLExecutionError, "EINSUM may only appear in a query (SELECT, "
                            "WITH, CREATE TENSOR ... AS, EXPLAIN)", e.find(Einsum))
        return self.query(e, {})

    def duckdb(self, sql: str, original: bool = False) -> SQLResult:
        try:
            rel = self.con.sql(sql)
            table = rel.to_arrow_table() if rel is not None else None
        except duckdb.Error as err:
            raise self._duckdb_error(err, sql, original) from None
        if table is None:
            return SQLResult(text="OK")
        return SQLResult(table=table)

    def _duckdb_error(self, err: duckdb.Error, sql: str, original: bool) -> TensorQLError:
        st = self.statement
        message = str(err).split("\n")[0]
        position = st.offset if st else 0
        names = re.findall(r'(?:name|column) "?([A-Za-z_][\w]*)"?', message)
        if st is not None:
            for name in names:
                m = re.search(rf"\b{re.escape(name)}\b", st.text)
                if m:
                    position = st.offset + m.start()
                    break
        return SQLExecutionError(f"DuckDB: {message}", text=self.script, position=position)

    def create_tensor(self, e: CreateTensor) -> SQLResult:
        name = e.this.name
        replace = bool(e.args.get("replace"))
        if not replace and self.db.chunk_store.has(name):
            raise self.fail(SQLExecutionError, f"tensor {name!r} already exists "
                            "(write CREATE OR REPLACE TENSOR)", e.this)
        query = e.expression
        call = self.pure_call(query, {})
        if call is not None and call.backend == "native":
            stored = self.db.store(name, call.tensor, replace=replace)
        else:
            dense = self.compute(call) if call is not None else self.query(query, {}).torch()
            stored = self.db.from_torch(name, dense, replace=replace)
        shape = "x".join(map(str, stored.shape)) or "scalar"
        return SQLResult(text=f"CREATE TENSOR {name} {shape} {stored.dtype}")

    def drop_tensor(self, e: DropTensor) -> SQLResult:
        name = e.this.name
        if not self.db.chunk_store.has(name):
            if e.args.get("exists"):
                return SQLResult(text=f"DROP TENSOR {name}: not present")
            raise SQLUnknownTensorError(name, self.db.tensors(), text=self.script,
                                        position=self.pos(e.this))
        self.db.drop(name)
        return SQLResult(text=f"DROP TENSOR {name}")

    # -- EXPLAIN ----------------------------------------------------------------------
    def explain(self, e: Explain) -> SQLResult:
        inner = e.this
        analyze = bool(e.args.get("analyze"))
        head = f"EXPLAIN{' ANALYZE' if analyze else ''}"
        if isinstance(inner, DropTensor):
            return SQLResult(text=f"{head}\nDROP TENSOR {inner.this.name}: removes the stored "
                                  "tensor, its chunk table and its views (one transaction)")
        if isinstance(inner, CreateTensor):
            inner = inner.expression
        if not has_einsum(inner):
            result = self.duckdb(self.statement.text, original=True)
            if result.table is not None and "explain_value" in result.table.column_names:
                text = "\n".join(result.table.column("explain_value").to_pylist())
                return SQLResult(text=text.rstrip("\n"))
            return result
        self.explain_sections = []
        self.analyze = analyze
        try:
            call = self.pure_call(inner, {})
            if call is not None:
                self.compute(call)
            else:
                self.query(inner, {}, explain=True)
            sections = self.explain_sections
        finally:
            self.explain_sections = None
            self.analyze = False
        return SQLResult(text="\n".join([self.statement.text, *sections]))

    # -- queries ----------------------------------------------------------------------
    def query(self, query: exp.Expr, ctes: dict[str, exp.CTE], explain: bool = False) \
            -> SQLResult:
        call = self.pure_call(query, ctes)
        if call is not None:
            return SQLResult(tensor=self.compute(call), labels=call.labels)
        tree = query.copy()
        while True:
            _prune_ctes(tree)
            calls = [node for node in tree.find_all(Einsum)
                     if not any(isinstance(a, Einsum) for a in _ancestors(node))]
            if not calls:
                break
            node = calls[-1]  # the last first: CTEs it reads can still be fused into it
            parent = node.parent
            if not isinstance(parent, exp.Table):
                raise self.fail(SQLExecutionError, "EINSUM is a table function: use it in "
                                "FROM (or JOIN)", node)
            resolved = self.call(node, {**ctes, **_scope(node)})
            name = f"__tq_einsum_{next(_TEMP)}"
            rows = tensor_rows(self.compute(resolved), resolved.labels)
            self.con.register(name, rows)
            self.registered.append(name)
            parent.set("this", exp.to_identifier(name, quoted=True))
        sql = tree.sql(dialect="duckdb")
        if explain and self.explain_sections is not None:
            prefix = "EXPLAIN ANALYZE " if self.analyze else "EXPLAIN "
            plan = self.duckdb(prefix + sql)
            text = "\n".join(plan.table.column("explain_value").to_pylist()) \
                if plan.table is not None else str(plan)
            self.explain_sections.append(f"-- DuckDB runs the rest: {sql}\n{text.rstrip()}")
            return plan
        return self.duckdb(sql)

    def pure_call(self, query: exp.Expr, ctes: dict[str, exp.CTE]) -> _Call | None:
        """The call when ``query`` is exactly ``SELECT * FROM EINSUM(...)``."""
        node = _pure_einsum(query)
        if node is None:
            return None
        scope = {**ctes, **_scope(node)}
        return self.call(node, scope)

    def compute(self, call: _Call) -> torch.Tensor:
        """Run the call's tensor on its backend (adding EXPLAIN text when explaining)."""
        from tensorql.backend.duckdb_sql import explain_compiled, run_compiled

        compiled = call.tensor.compile()
        sections = self.explain_sections
        if call.backend == "duckdb":
            if sections is not None:
                text, result = explain_compiled(compiled, self.con, analyze=self.analyze)
                sections.append(self._call_head(call) + "\n" + text)
                return result if result is not None else _zeros(call)
            return run_compiled(compiled, self.con, dense=True).dense()
        if sections is not None:
            from tensorql.physical.explain import render_plan

            title = f"{compiled.node.describe()} -> " \
                    f"{'x'.join(map(str, compiled.node.shape)) or 'scalar'} " \
                    f"{compiled.node.dtype} (native executor)"
            if self.analyze:
                result = compiled.run(dense=True)
                sections.append(self._call_head(call) + "\n"
                                + render_plan(compiled.physical, result.stats, title=title))
                return result.dense()
            sections.append(self._call_head(call) + "\n"
                            + render_plan(compiled.physical, None, title=title))
            return _zeros(call)
        return compiled.run(dense=True).dense()

    def _call_head(self, call: _Call) -> str:
        return f"-- {call.node.sql(dialect=_dialect())} -> ({', '.join(call.labels)}, val)"

    # -- one EINSUM call --------------------------------------------------------------
    def call(self, node: Einsum, scope: dict[str, exp.CTE],
             seen: frozenset[str] = frozenset()) -> _Call:
        spec = node.this
        if not (isinstance(spec, exp.Literal) and spec.is_string):
            raise ParseError("EINSUM needs the equation as its first argument, a string such "
                             "as 'ij,jk->ik'", text=self.script, position=self.pos(spec or node))
        equation = spec.this
        named: dict[str, exp.Expr] = {}
        operands: list[exp.Expr] = []
        for arg in node.expressions:
            if isinstance(arg, (exp.PropertyEQ, exp.Kwarg, exp.EQ)) and \
                    isinstance(arg.this, (exp.Identifier, exp.Column)):
                key = arg.this.name.lower()
                if key not in _NAMED:
                    raise self.fail(SQLOperatorError, f"unknown EINSUM argument {key!r}; "
                                    f"choose among {', '.join(_NAMED)}", arg)
                named[key] = arg
            elif named:
                raise self.fail(SQLShapeError, "operands must come before named arguments",
                                arg)
            else:
                operands.append(arg)
        join = self._word(named.get("join"), "mul", JOINS, "join")
        agg = self._word(named.get("agg"), "sum", AGGS, "agg")
        backend = self._word(named.get("backend"), self.backend or self.db.options.backend,
                             ("native", "duckdb"), "backend")
        sizes = self._sizes(named.get("sizes"))
        parts = _operand_labels(equation)
        if parts is not None and len(parts) != len(operands):
            raise self.fail(SQLShapeError, f"equation {equation!r} names {len(parts)} "
                            f"operand(s) but EINSUM was given {len(operands)}", node)
        resolved: list[Tensor | pa.Table] = [self.operand(arg, scope, seen)
                                             for arg in operands]
        known = dict(sizes)
        for k, value in enumerate(resolved):
            if isinstance(value, Tensor) and parts is not None and "..." not in parts[k]:
                for label, size in zip(parts[k], value.shape):
                    known.setdefault(label, size)
        tensors: list[Tensor] = []
        for k, (value, arg) in enumerate(zip(resolved, operands)):
            if isinstance(value, Tensor):
                tensors.append(value)
                continue
            if parts is None or "..." in parts[k]:
                raise self.fail(SQLShapeError, "a relation operand needs explicit labels (no "
                                "'...') in the equation", arg)
            tensors.append(self.db.constant(
                self.sparse(value, parts[k], known, resolved, parts, arg)))
        try:
            tensor = lazy_einsum(equation, *tensors, join=join, agg=agg)
        except ParseError as err:
            raise ParseError(err.message, text=self.script,
                             position=self.pos(spec) + 1 + (err.position or 0)) from None
        except TensorQLError as err:
            mentioned = [int(n) for n in re.findall(r"operand (\d+)", str(err))]
            where = operands[mentioned[-1]] if mentioned and mentioned[-1] < len(operands) \
                else node  # the last operand named is the one that disagrees
            raise located(err, self.script, self.pos(where)) from None
        labels = tuple(tensor.node.spec.output)
        return _Call(tensor=tensor, labels=labels, backend=backend, node=node)

    def _word(self, arg: exp.Expr | None, default: str, allowed, what: str) -> str:
        if arg is None:
            return default
        value = arg.expression
        if not (isinstance(value, exp.Literal) and value.is_string):
            raise self.fail(SQLOperatorError, f"{what} := takes a string such as "
                            f"'{allowed[0]}'", value)
        word = value.this.lower()
        if word not in allowed:
            cls = SQLOperatorError
            raise self.fail(cls, f"unknown {what} {value.this!r}; choose one of "
                            f"{', '.join(allowed)}", value)
        return word

    def _sizes(self, arg: exp.Expr | None) -> dict[str, int]:
        if arg is None:
            return {}
        value = arg.expression
        out: dict[str, int] = {}
        items = value.expressions if isinstance(value, exp.Struct) else None
        if items is None:
            raise self.fail(SQLShapeError, "sizes := takes a struct such as {'i': 10}", value)
        for item in items:
            if not isinstance(item, exp.PropertyEQ) or not isinstance(
                    item.expression, exp.Literal) or item.expression.is_string:
                raise self.fail(SQLShapeError, "sizes := takes a struct such as {'i': 10}",
                                item)
            text = item.expression.this
            if not text.isdigit() or int(text) > 2**62:
                raise self.fail(SQLShapeError, f"size of label {item.this.name!r} must be a "
                                f"whole number from 1 to 2**62, got {text}", item)
            size = int(text)
            if size < 1:
                raise self.fail(SQLShapeError, f"size of label {item.this.name!r} must be "
                                ">= 1", item)
            out[item.this.name] = size
        return out

    def operand(self, arg: exp.Expr, scope: dict[str, exp.CTE], seen: frozenset[str]) \
            -> Tensor | pa.Table:
        """A stored tensor, a fused CTE EINSUM, or the rows of a relation."""
        if isinstance(arg, exp.Subquery):
            return self.rows(arg.this, scope)
        if isinstance(arg, exp.Column) and not arg.table:
            name = arg.name
            key = name.lower()
            cte = scope.get(key)
            if cte is not None:
                expanding = self.expanding
                if key in seen or key in expanding:
                    raise self.fail(SQLShapeError, f"CTE {name!r} refers to itself through "
                                    "EINSUM; recursive tensor CTEs are not supported (iterate "
                                    "from Python instead)", arg)
                inner = _pure_einsum(cte.this)
                if inner is not None:
                    return self.call(inner, {**scope, **_scope(inner)}, seen | {key}).tensor
                expanding.add(key)
                try:
                    return self.rows(exp.select("*").from_(
                        exp.Table(this=exp.to_identifier(name, quoted=True))), scope)
                finally:
                    expanding.discard(key)
            tensor = self._stored(name, arg.this.quoted)
            if tensor is not None:
                return tensor
            return self.rows(exp.select("*").from_(exp.to_table(arg.sql(dialect="duckdb"))),
                             scope, missing=arg)
        if isinstance(arg, (exp.Column, exp.Dot, exp.Table)):
            return self.rows(exp.select("*").from_(exp.to_table(arg.sql(dialect="duckdb"))),
                             scope, missing=arg)
        raise self.fail(SQLShapeError, "an EINSUM operand is a tensor name, a table name or "
                        "a subquery", arg)

    def _stored(self, name: str, quoted: bool) -> Tensor | None:
        store = self.db.chunk_store
        if store.has(name):
            return self.db.tensor(name)
        if not quoted:
            matches = [t for t in self.db.tensors() if t.lower() == name.lower()]
            if len(matches) == 1:
                return self.db.tensor(matches[0])
        return None

    def rows(self, query: exp.Expr, scope: dict[str, exp.CTE],
             missing: exp.Expr | None = None) -> pa.Table:
        """The rows of ``query`` (with the CTEs it needs from ``scope``)."""
        query = _with_ctes(query.copy(), scope)
        saved, self.explain_sections = self.explain_sections, None  # operands run for real
        try:
            result = self.query(query, {})
        except SQLExecutionError as err:
            if missing is not None and "does not exist" in str(err):
                raise SQLUnknownTensorError(missing.sql(dialect="duckdb"), self.db.tensors(),
                                            text=self.script, position=self.pos(missing)) \
                    from None
            raise
        finally:
            self.explain_sections = saved
        return result.arrow()

    def sparse(self, table: pa.Table, labels: list[str], known: dict[str, int],
               resolved: list, parts: list[list[str]], arg: exp.Expr) -> torch.Tensor:
        """The dense tensor of a relation operand with labels ``labels``."""
        try:
            columns = label_columns(table)
        except ShapeError as err:
            raise self.fail(SQLShapeError, str(err), arg) from None
        if len(columns) != len(labels):
            raise self.fail(SQLShapeError, f"operand has {len(columns)} label column(s) "
                            f"{columns} but the equation gives it {len(labels)} label(s) "
                            f"{''.join(labels)!r}", arg)
        lowered = [c.lower() for c in columns]
        if len(set(labels)) == len(labels) and sorted(lowered) == sorted(labels):
            by_label = {c.lower(): c for c in columns}
            columns = [by_label[label] for label in labels]  # matched by name
        shape = []
        for label in labels:
            size = known.get(label)
            if size is None:  # max index + 1 over every relation operand carrying the label
                size = 0
                for other, other_labels in zip(resolved, parts):
                    if isinstance(other, pa.Table) and label in other_labels:
                        cols = [c for c in other.column_names if c.lower() != "val"]
                        if len(cols) != len(other_labels):
                            continue
                        if sorted(c.lower() for c in cols) == sorted(other_labels):
                            col = next(c for c in cols if c.lower() == label)
                        else:
                            col = cols[other_labels.index(label)]
                        values = other.column(col)
                        if values.null_count < len(values) and pa.types.is_integer(
                                values.type) and len(values):
                            size = max(size, int(np.max(values.to_numpy(
                                zero_copy_only=False))) + 1)
                if size < 1:
                    raise self.fail(SQLShapeError, f"cannot infer the size of label "
                                    f"{label!r} from an empty relation; give sizes := "
                                    f"{{'{label}': n}}", arg)
                known[label] = size
            shape.append(size)
        try:
            dtype = value_dtype(table.column(next(c for c in table.column_names
                                                  if c.lower() == "val")))
            return rows_to_dense(table, columns, shape, dtype,
                                 max_bytes=self.db.options.dense_result_budget())
        except TensorQLError as err:
            if not isinstance(err, ShapeError):
                raise located(err, self.script, self.pos(arg)) from None
            raise self.fail(SQLShapeError, str(err), arg) from None


def _dialect():
    from tensorql.sql.dialect import TensorQL

    return TensorQL


def _zeros(call: _Call) -> torch.Tensor:
    """A stand-in result for plain EXPLAIN (nothing is computed)."""
    return torch.zeros(call.tensor.shape, dtype=torch_dtype(call.tensor.dtype))


def _operand_labels(equation: str) -> list[list[str]] | None:
    """Each operand's labels as written ('...' kept as one item); None if unreadable."""
    if not isinstance(equation, str):
        return None
    lhs = equation.split("->")[0]
    parts = []
    for part in lhs.split(","):
        labels: list[str] = []
        i = 0
        while i < len(part):
            if part.startswith("...", i):
                labels.append("...")
                i += 3
            elif part[i].isalpha():
                labels.append(part[i])
                i += 1
            elif part[i] == " ":
                i += 1
            else:
                return None
        parts.append(labels)
    return parts


def _ancestors(node: exp.Expr) -> Iterator[exp.Expr]:
    parent = node.parent
    while parent is not None:
        yield parent
        parent = parent.parent


def _scope(node: exp.Expr) -> dict[str, exp.CTE]:
    """CTEs visible at ``node``: the WITH clauses of its ancestors, inner ones shadowing."""
    scopes = []
    for anc in _ancestors(node):
        with_ = anc.args.get("with_") if isinstance(anc, exp.Expr) else None
        if isinstance(with_, exp.With):
            scopes.append({cte.alias_or_name.lower(): cte for cte in with_.expressions})
    out: dict[str, exp.CTE] = {}
    for scope in reversed(scopes):
        out.update(scope)
    return out


def _pure_einsum(query: exp.Expr | None) -> Einsum | None:
    """The EINSUM of ``SELECT * FROM EINSUM(...) [AS t]`` with nothing else; else None."""
    if not isinstance(query, exp.Select):
        return None
    exprs = query.expressions
    if len(exprs) != 1 or not isinstance(exprs[0], exp.Star) or exprs[0].args.get("except") \
            or exprs[0].args.get("replace"):
        return None
    for key, value in query.args.items():
        if key in ("expressions", "from_", "with_", "kind") or not value:
            continue
        return None
    table = query.args["from_"].this if query.args.get("from_") else None
    if not isinstance(table, exp.Table) or not isinstance(table.this, Einsum):
        return None
    alias = table.args.get("alias")
    if alias is not None and alias.columns:
        return None
    for key, value in table.args.items():
        if key not in ("this", "alias") and value:
            return None
    return table.this


def _references(tree: exp.Expr, skip: exp.Expr | None = None) -> set[str]:
    """Lower-cased names that tables and EINSUM operands in ``tree`` refer to."""
    names: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if node is skip:
            continue
        if isinstance(node, exp.Table) and isinstance(node.this, exp.Identifier):
            names.add(node.name.lower())
        if isinstance(node, Einsum):
            for arg in node.expressions:
                if isinstance(arg, exp.Column) and not arg.table:
                    names.add(arg.name.lower())
        stack.extend(node.iter_expressions())
    return names


def _prune_ctes(tree: exp.Expr) -> None:
    """Drop CTEs holding an EINSUM that nothing reads any more (they would run for nothing);
    CTEs without EINSUM stay as written."""
    with_ = tree.args.get("with_")
    if not isinstance(with_, exp.With):
        return
    changed = True
    while changed:
        changed = False
        for cte in list(with_.expressions):
            if cte.find(Einsum) is None:
                continue
            if cte.alias_or_name.lower() not in _references(tree, skip=cte):
                cte.pop()
                changed = True
    if not with_.expressions:
        tree.set("with_", None)


def _with_ctes(query: exp.Expr, scope: dict[str, exp.CTE]) -> exp.Expr:
    """``query`` with the CTEs of ``scope`` it needs (transitively) prepended."""
    if not scope or not isinstance(query, exp.Query):
        return query
    own = query.args.get("with_")
    own_names = {c.alias_or_name.lower() for c in own.expressions} if own else set()
    needed: set[str] = set()
    frontier = _references(query) - own_names
    while frontier:
        name = frontier.pop()
        if name in scope and name not in needed:
            needed.add(name)
            frontier |= _references(scope[name].this)
    if not needed:
        return query
    ordered = [cte.copy() for key, cte in scope.items() if key in needed]  # written order
    existing = list(own.expressions) if own else []
    query.set("with_", exp.With(expressions=ordered + existing))
    return query


def run_sql(db: Database, script: str, backend: str | None = None) -> SQLResult:
    """Run every statement of ``script``; the result of the last one."""
    if backend is not None and backend not in ("native", "duckdb"):
        raise UnknownOperatorError(f"unknown backend {backend!r}; choose 'native' or 'duckdb'")
    return _Runner(db, script, backend).run()

