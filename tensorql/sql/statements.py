"""Run the statements of a script: DuckDB runs plain SQL, the engine computes each EINSUM.

A statement without EINSUM goes to DuckDB verbatim. In a statement with EINSUM, each call
becomes an einsum-graph node (:mod:`tensorql.sql.operands`) that the pipeline compiles and runs
on the backend of the registry; its result is registered in DuckDB as an Arrow table of element
rows under a temporary name, the sqlglot tree is rewritten to read that table, and DuckDB runs
what is left. A statement that is exactly ``SELECT * FROM EINSUM(...)`` never leaves the
engine: its result is the dense tensor.

>>> import numpy as np, tensorql as tq
>>> db = tq.connect()
>>> _ = db.from_numpy("A", np.arange(6, dtype=np.float32).reshape(2, 3))
>>> db.sql("SELECT * FROM EINSUM('ij->i', A)").numpy().tolist()
[3.0, 12.0]
>>> db.sql("SELECT i, val FROM EINSUM('ij->i', A) WHERE val > 5").fetchall()
[(1, 12.0)]
"""

from __future__ import annotations

import contextlib
import difflib
import re
from collections.abc import Sequence
from typing import Any

import duckdb
import pyarrow as pa
import sqlglot
import torch
from sqlglot import exp
from sqlglot.tokens import TokenType

from tensorql.dtypes import torch_dtype
from tensorql.errors import (
    MemoryLimitError,
    OptionError,
    ParseError,
    StorageError,
    TensorQLError,
)
from tensorql.pipeline import CompiledQuery
from tensorql.pipeline.run import check_dense_fits
from tensorql.sql.arrow_fixes import arrow_of
from tensorql.sql.dialect import (
    CreateTensor,
    DropTensor,
    Einsum,
    Explain,
    Statement,
    has_einsum,
    position_of,
    split_script,
)
from tensorql.sql.errors import SQLExecutionError, SQLUnknownTensorError, _Located, located
from tensorql.sql.operands import EinsumCall, OperandResolver, RelationalEinsum
from tensorql.sql.parameters import bind_parameters
from tensorql.sql.result import DenseForm, SQLResult
from tensorql.sql.rewriting import (
    ancestors,
    prune_ctes,
    pure_einsum,
    scope_of,
    temp_name,
    with_ctes,
)
from tensorql.sql.streaming import chunk_rows
from tensorql.storage.duckdb_store import INTERNAL_SCHEMA, interrupts_as_python
from tensorql.storage.spill import SPILL_PREFIX
from tensorql.storage.sql_text import quote_ident

__all__ = ["ScriptRunner", "explain_each", "explain_graphs"]

SQL_ADVICE = ("store it as a tensor (CREATE TENSOR t AS SELECT * FROM EINSUM(...)) and query "
              "t, or read the EINSUM in a larger query (a WHERE, an aggregate, a LIMIT): its "
              "rows then stream through DuckDB chunk by chunk")

_EXPLAIN_HEAD = re.compile(r"^\s*EXPLAIN\s+(ANALYZE\s+)?", re.I)  # before what DuckDB runs


def tensor_view_owner(parts: Sequence[str], tensors: Sequence[str], con: Any) -> str | None:
    """The stored tensor (of ``tensors``) whose view (``A``) or chunk view (``A__chunks``) a
    table or view named ``parts`` (qualifiers first) would be, in any case (DuckDB's names are
    case-insensitive); None when there is none. The views live in the temporary catalog,
    which DuckDB searches first: ``A``, ``main.A``, ``temp.A`` and ``<db>.main.A`` reach them,
    ``other_schema.A`` does not (``con`` tells the database's name).

    >>> import duckdb
    >>> con = duckdb.connect()
    >>> [tensor_view_owner(p, ["A"], con) for p in (("a",), ("main", "A__chunks"),
    ...                                              ("memory", "main", "A"), ("s", "A"))]
    ['A', 'A', 'A', None]
    """
    if len(parts) > 1:
        qualifier = [p.lower() for p in parts[:-1]]
        catalogs = {"temp"}
        if qualifier != ["main"]:
            catalogs.add(con.sql("SELECT current_database()").fetchall()[0][0].lower())
        if len(qualifier) == 1:
            reaches = qualifier[0] == "main" or qualifier[0] in catalogs
        else:
            reaches = len(qualifier) == 2 and qualifier[1] == "main" \
                and qualifier[0] in catalogs
        if not reaches:
            return None
    lowered = parts[-1].lower()
    return next((t for t in tensors
                 if t.lower() in (lowered, lowered.removesuffix("__chunks"))), None)


def check_new_table_name(session: Any, name: str) -> None:
    """SQLExecutionError when a table created as ``name`` (DuckDB's dotted form, as
    ``SQLResult.to_table`` takes it) would take a stored tensor's view's name."""
    try:
        target = exp.to_table(name, dialect="duckdb")
    except (sqlglot.errors.ParseError, sqlglot.errors.TokenError):
        return  # DuckDB reports the bad name
    parts = tuple(p for p in (target.catalog, target.db, target.name) if p)
    owner = tensor_view_owner(parts, session.tensors(), session.connection)
    if owner is not None:
        raise _clash(name, owner)


def _clash(name: str, owner: str, script: str | None = None,
           position: int | None = None) -> SQLExecutionError:
    """The error of a table or view ``name`` that would take stored tensor ``owner``'s."""
    return SQLExecutionError(f"{name!r} clashes with the stored tensor {owner!r} (names are "
                             "case-insensitive, as in DuckDB); pick another name or DROP "
                             f"TENSOR {owner}", text=script, position=position)


class ScriptRunner:
    """Runs the statements of one script against a session (a ``tensorql.Database``: its
    ``chunk_store``, ``options``, ``connection``, ``tensors()``, ``drop``, ``from_torch`` and
    ``store_node``)."""

    def __init__(self, session: Any, script: str, backend: str | None = None,
                 params: Any = None, frames: Any = None) -> None:
        self.session = session
        self.script = script
        self.params = params
        self.frames = frames  # the caller's frames registered for the script (or None)
        self.con = session.connection
        self.registered: list[str] = []
        self.views: list[str] = []  # temporary views of relational EINSUMs
        self.statement: Statement | None = None
        self.explain_sections: list[str] | None = None
        # what an EXPLAIN found, part by part, for the graph formats (explain_graphs): an
        # EINSUM's {"einsum", "compiled", "result"}, or DuckDB's {"duckdb", "plan"}
        self.explain_parts: list[dict[str, Any]] = []
        self.analyze = False
        self.operands = OperandResolver(session, script, self.rows, self.relational_rows,
                                        self.fail, self.pos, backend)

    # -- positions --------------------------------------------------------------------
    def pos(self, node: exp.Expr | None) -> int | None:
        st = self.statement
        p = position_of(node)
        if st is None:
            return p
        return st.offset + (p if p is not None else 0)

    def fail(self, cls, message: str, node: exp.Expr | None) -> TensorQLError:
        return cls(message, text=self.script, position=self.pos(node))

    # -- statements -------------------------------------------------------------------
    @interrupts_as_python  # DuckDB's answer to a Ctrl-C mid-statement, as the interrupt
    def run(self) -> SQLResult:
        """Run the script on the session's main connection, one thread at a time (DuckDB
        refuses a connection two threads use at once; scripts from several threads wait
        their turn, as writers do to drop a tensor's views there)."""
        lock = getattr(self.session.chunk_store, "main_connection_lock", None)
        written = self.script
        with lock if lock is not None else contextlib.nullcontext():
            try:
                return self._run()
            except TensorQLError as err:  # parameters were bound into the text: point into
                if self.script != written:  # the text the caller wrote
                    _relocate(err, self.script, written)
                raise

    def _run(self) -> SQLResult:
        statements = split_script(self.script)
        if not statements:
            raise ParseError("no SQL statement given", text=self.script, position=0)
        if self.params is not None and not isinstance(self.params, (list, tuple, dict)):
            raise SQLExecutionError("query parameters are a list or tuple (for ? and $1) or a "
                                    f"dict (for $name), got {type(self.params).__name__}",
                                    text=self.script, position=0)
        if self.params is not None and len(statements) > 1:
            raise SQLExecutionError("query parameters need a single statement, but the script "
                                    f"has {len(statements)}", text=self.script, position=0)
        if self.params is not None and statements[0].expression is not None:
            # tensorql takes the statement apart into several DuckDB queries: bind the
            # values as literals, so each part has its own
            self.script = self.operands.script = bind_parameters(self.script, self.params)
            self.params = None
            statements = split_script(self.script)
        try:
            self.session.chunk_store.sync_views()  # another process may have stored tensors
        except duckdb.TransactionException as err:  # an earlier statement aborted the user's
            if statements[0].transaction != "end":  # transaction: ROLLBACK first (a statement
                # that ends a transaction runs even when an error aborted it)
                raise SQLExecutionError(f"DuckDB: {err}; the transaction was aborted by an "
                                        "earlier error: run ROLLBACK", text=self.script,
                                        position=statements[0].offset) from None
        except duckdb.Error as err:
            first = str(err).split("\n")[0]
            raise StorageError("could not bring this session's views of the stored tensors "
                               f"up to date with their catalog before the script ran: DuckDB: "
                               f"{first}") from None
        result = SQLResult(text="")
        for st in statements:
            self.statement = st
            if st.transaction == "begin":  # (a BEGIN's token, comments aside) tensor writes
                # from here on ask the store whether the transaction is still open
                self.session.sql_transaction_begun = True
            if self.frames is not None and st.created is not None:  # the catalog wins over
                self.frames.release(st.created[0][-1])  # a frame from here on, as in DuckDB
            try:
                result = self.statement_result(st)
            except TensorQLError as err:  # a shape, label or run error found past the parse
                twin = located(err, self.script, st.offset)  # says which statement
                if twin is err or not isinstance(twin, type(err)):  # (a MemoryLimitError
                    raise  # stays one)
                raise twin from err
            finally:
                self.unregister()
        return result

    def unregister(self) -> None:
        for name in self.views:
            try:
                self.con.execute(f"DROP VIEW IF EXISTS temp.main.{quote_ident(name)}")
            except duckdb.Error:  # pragma: no cover - already gone
                pass
        self.views.clear()
        for name in self.registered:
            try:
                self.con.unregister(name)
            except duckdb.Error:  # pragma: no cover - already gone
                pass
        self.registered.clear()

    def statement_result(self, st: Statement) -> SQLResult:
        e = st.expression
        self.check_names(st)
        if e is None:  # no EINSUM, no tensorql DDL: DuckDB runs it as written
            self.check_no_opaque_einsum(st)
            result = self.duckdb(st.text, params=self.params)
            if not st.explain:
                return result
            result = self.explain_text(result)
            self.explain_parts = [{"duckdb": _EXPLAIN_HEAD.sub("", st.text), "plan": result.text}]
            return result
        if isinstance(e, Explain):
            return self.explain(e)
        if isinstance(e, CreateTensor):
            return self.create_tensor(e)
        if isinstance(e, DropTensor):
            return self.drop_tensor(e)
        self.check_name_free(e)
        if not has_einsum(e):
            self.check_no_opaque_einsum(st)
            return self.duckdb(st.text, params=self.params)
        self.check_einsum_not_kept(e)
        # queries, and statements around one (CREATE TABLE ... AS, INSERT ... SELECT): the
        # EINSUMs become registered row tables and DuckDB runs the rewritten statement
        return self.query(e, {}, params=self.params)

    def check_no_opaque_einsum(self, st: Statement) -> None:
        """SQLExecutionError for an EINSUM inside a statement DuckDB would run as written
        (``PREPARE p AS ...``, ``SHOW ...``: commands sqlglot keeps as opaque text, so no
        EINSUM in them is computed, and DuckDB knows no EINSUM table function)."""
        at = _einsum_in_text(st.text) if "EINSUM" in st.text.upper() else None
        if at is None:
            return
        word = st.text.split(None, 1)[0].upper()
        raise SQLExecutionError(
            f"EINSUM is not supported inside {word} (DuckDB runs a {word} statement as "
            "written, and EINSUM is tensorql's): run the query itself with db.sql(query, "
            "params), which binds ? / $1 / $name parameters, or store the EINSUM first "
            "(CREATE TENSOR t AS ...) and use t", text=self.script, position=st.offset + at)

    def check_einsum_not_kept(self, e: exp.Expr) -> None:
        """SQLExecutionError for an EINSUM in a view's or macro's definition: DuckDB would
        keep the name of the temporary table its rows are registered under for this statement,
        which is gone when the statement ends (or, later, holds another query's rows)."""
        kind = str(e.args.get("kind", "")).upper() if isinstance(e, exp.Create) else ""
        if kind not in ("VIEW", "MACRO", "FUNCTION"):
            return
        raise self.fail(SQLExecutionError, f"EINSUM cannot be part of a {kind}'s definition "
                        "(its rows live only while the statement runs): store it with "
                        "CREATE TENSOR t AS ... or CREATE TABLE t AS ..., and define the "
                        f"{kind} over that", e.find(Einsum))

    def check_names(self, st: Statement) -> None:
        """The name guards, before the statement runs (as DuckDB runs it: through an EXPLAIN
        ANALYZE head too, EINSUM or not): a table or view it creates or renames to may not
        take a stored tensor's name, one it drops or alters may not be a tensor's view, and
        nothing it writes may be one of tensorql's own tables (:meth:`check_internal_name`).
        """
        if st.created is not None:
            self.check_created_name(*st.created)
        for name, position in st.altered:
            self.check_altered_name(name, position)
        for name, position in st.written:
            self.check_internal_name(name, position)

    def check_internal_name(self, parts: tuple[str, ...], position: int | None) -> None:
        """SQLExecutionError if a statement would write, create, drop or alter (``parts``,
        qualifiers first; a schema as its parts then ``"*"``) one of the tables tensorql
        keeps its stored tensors in -- its catalog and chunk tables, in the store's internal
        schema (:data:`~tensorql.storage.duckdb_store.INTERNAL_SCHEMA`), reached by a
        qualified name or, unqualified, through ``USE`` / ``search_path`` -- or that schema
        itself: the tensors would be corrupted (their chunks gone, a catalog row without its
        table). Reading them stays allowed."""
        store = self.session.chunk_store
        schema, database = getattr(store, "schema", None), getattr(store, "database", None)
        if not isinstance(schema, str) or not parts:
            return
        internal = schema.lower() == INTERNAL_SCHEMA  # all in it is tensorql's (else, in a
        # file from before that schema, its tables sit in main beside the user's own)
        lowered = [p.lower() for p in parts]
        qualifier, name = lowered[:-1], lowered[-1]
        if name == "*":  # a schema: DROP / ALTER / CREATE SCHEMA
            if not internal or not qualifier or qualifier[-1] != schema.lower() \
                    or (len(qualifier) > 1 and qualifier[-2] != str(database).lower()):
                return
            raise SQLExecutionError(f"{parts[-2]!r} is tensorql's own schema {schema!r} (the "
                                    "stored tensors' catalog and chunk tables): SQL may read "
                                    "its tables but not drop or change the schema; change "
                                    "tensors with CREATE / DROP TENSOR", text=self.script,
                                    position=position)
        ours = name == "tensorql_catalog" or name.startswith(("tq_chunks_", SPILL_PREFIX))
        if qualifier:
            reached = qualifier[-1] == schema.lower() and (
                len(qualifier) == 1 or qualifier[-2] == str(database).lower())
            reached = reached and (internal or ours)
        else:
            reached = self.reaches_unqualified(name, schema, str(database), internal or ours)
        if reached:
            raise SQLExecutionError(f"{parts[-1]!r} is in tensorql's own schema {schema!r} "
                                    "(the stored tensors' catalog and chunk tables): SQL may "
                                    "read its tables but not write, create, alter or drop "
                                    "them; change tensors with CREATE / DROP TENSOR",
                                    text=self.script, position=position)

    def reaches_unqualified(self, name: str, schema: str, database: str, ours: bool) -> bool:
        """Whether the unqualified table ``name`` (lower case) is found -- or, created, goes
        -- in ``database.schema``, as DuckDB resolves it: after ``USE schema`` everything
        does (``ours``: a name of tensorql's there), else the first schema of the search
        path (``SET search_path``) that holds a table or view of that name."""
        try:
            current_db, current, path, holders = self.con.execute(
                "SELECT current_database(), current_schema(), current_schemas(true), "
                "(SELECT list(DISTINCT lower(schema_name)) FROM (SELECT database_name, "
                "schema_name, table_name AS n FROM duckdb_tables() UNION ALL SELECT "
                "database_name, schema_name, view_name FROM duckdb_views()) "
                "WHERE database_name = current_database() AND lower(n) = ?)",
                [name]).fetchall()[0]
        except duckdb.Error:  # (an aborted transaction: the statement fails there too)
            return False
        if current_db.lower() != database.lower():
            return False
        if current.lower() == schema.lower():
            return ours
        holders = holders or []
        for searched in (s.lower() for s in path):
            if searched == schema.lower():
                return searched in holders
            if searched in holders:
                return False
        return False

    def check_name_free(self, e: exp.Expr) -> None:
        """``CREATE TABLE`` / ``CREATE VIEW`` may not take a stored tensor's name in any case:
        DuckDB's identifiers are case-insensitive, and the tensor's view holds that name."""
        if not isinstance(e, exp.Create) or str(e.args.get("kind", "")).upper() not in (
                "TABLE", "VIEW"):
            return
        target = e.this.this if isinstance(e.this, exp.Schema) else e.this
        if not isinstance(target, exp.Table):
            return
        parts = tuple(p for p in (target.catalog, target.db, target.name) if p)
        self.check_created_name(parts, self.pos(target))

    def check_created_name(self, parts: tuple[str, ...], position: int | None) -> None:
        """SQLExecutionError if a table or view named ``parts`` (created at ``position`` of
        the script) would take a stored tensor's name or its chunk view's."""
        owner = tensor_view_owner(parts, self.session.tensors(), self.con)
        if owner is not None:
            raise _clash(parts[-1], owner, self.script, position)

    def check_altered_name(self, parts: tuple[str, ...], position: int | None) -> None:
        """SQLExecutionError if a ``DROP`` or ``ALTER`` of a table or view names a stored
        tensor's view or its chunk view: the tensor would stay in the catalog without them
        for the rest of the session (DROP TENSOR and CREATE OR REPLACE TENSOR change both)."""
        owner = tensor_view_owner(parts, self.session.tensors(), self.con)
        name = parts[-1]
        if owner is not None:
            raise SQLExecutionError(f"{name!r} is a view of the stored tensor {owner!r}; "
                                    f"change the tensor instead (DROP TENSOR {owner}, "
                                    "CREATE OR REPLACE TENSOR ...)", text=self.script,
                                    position=position)

    def duckdb(self, sql: str, params: Any = None) -> SQLResult:
        try:
            rel = self.con.sql(sql, params=params) if params is not None else self.con.sql(sql)
            table = arrow_of(rel) if rel is not None else None
        except duckdb.Error as err:
            raise self._duckdb_error(err) from None
        if table is None:
            return SQLResult(text="OK")
        return SQLResult(table=table)

    def _duckdb_error(self, err: duckdb.Error) -> TensorQLError:
        st = self.statement
        message = str(err).split("\n")[0]
        position = st.offset if st else 0
        if isinstance(err, duckdb.ParserException) and st is not None:  # a syntax error:
            near = re.search(r'at or near "([^"]*)"', message)  # where DuckDB's parser says
            at = st.text.find(near.group(1)) if near else -1
            if at < 0 and "end of input" in message:
                at = len(st.text)
            return ParseError(f"SQL syntax error (DuckDB): {message}", text=self.script,
                              position=st.offset + max(at, 0))
        names = re.findall(r'(?:name|column) "?([A-Za-z_][\w]*)"?', message)
        if st is not None:
            for name in names:
                m = re.search(rf"\b{re.escape(name)}\b", st.text)
                if m:
                    position = st.offset + m.start()
                    break
        return SQLExecutionError(f"DuckDB: {message}", text=self.script, position=position)

    def tensor_name(self, ident: exp.Identifier) -> str:
        """The stored tensor a CREATE / DROP TENSOR names, resolved as EINSUM operands are:
        an unquoted name whose only case-insensitive match is a stored tensor is that tensor
        (its stored spelling kept: ``DROP TENSOR z`` drops ``Z``); otherwise the name as
        written."""
        name = ident.name
        store = self.session.chunk_store
        if ident.quoted or store.has(name):
            return name
        matches = [t for t in store.names() if t.lower() == name.lower()]
        return matches[0] if len(matches) == 1 else name

    def create_tensor(self, e: CreateTensor, dense: torch.Tensor | None = None) -> SQLResult:
        """Run ``CREATE [OR REPLACE] TENSOR name AS query``; with ``dense``, store that (the
        query's result, computed already by EXPLAIN ANALYZE) instead of running it."""
        name = self.check_creatable(e)
        replace = bool(e.args.get("replace"))
        query = e.expression
        call = self.pure_call(query, {}) if dense is None else None
        if isinstance(call, RelationalEinsum):
            call = None  # its rows, made dense below
        if dense is not None:
            stored = self.session.from_torch(name, dense, replace=replace)
        elif call is not None and call.present is None:  # chunks go to the store as computed
            compiled = CompiledQuery.compile(call.node, self.session, backend=call.backend)
            stored = self.session.store_node(name, call.node, replace=replace,
                                             compiled=compiled)
        else:
            dense = self.compute(call) if call is not None else self.query(query, {}).torch()
            stored = self.session.from_torch(name, dense, replace=replace)
        shape = "x".join(map(str, stored.shape)) or "scalar"
        return SQLResult(text=f"CREATE TENSOR {name} {shape} {stored.dtype}")

    def check_creatable(self, e: CreateTensor) -> str:
        """The name ``CREATE TENSOR`` stores under; an SQLExecutionError when a tensor has it
        and the statement does not replace it."""
        name = self.tensor_name(e.this)
        if not e.args.get("replace") and self.session.chunk_store.has(name):
            raise self.fail(SQLExecutionError, f"tensor {name!r} already exists "
                            "(write CREATE OR REPLACE TENSOR)", e.this)
        return name

    def drop_tensor(self, e: DropTensor) -> SQLResult:
        name = self.tensor_name(e.this)
        if not self.session.chunk_store.has(name):
            if e.args.get("exists"):
                return SQLResult(text=f"DROP TENSOR {name}: not present")
            raise SQLUnknownTensorError(name, self.session.tensors(), text=self.script,
                                        position=self.pos(e.this))
        self.session.drop(name)
        return SQLResult(text=f"DROP TENSOR {name}")

    # -- EXPLAIN ----------------------------------------------------------------------
    def explain(self, e: Explain) -> SQLResult:
        inner = e.this
        analyze = bool(e.args.get("analyze"))
        head = f"EXPLAIN{' ANALYZE' if analyze else ''}"
        if isinstance(inner, DropTensor):
            return self.explain_drop(inner, head, analyze)
        created = None
        if isinstance(inner, CreateTensor):
            created, inner = inner, inner.expression
            self.check_creatable(created)  # before anything runs
        self.explain_parts = []
        if not has_einsum(inner):
            sql = self.statement.text if created is None else inner.sql(dialect="duckdb")
            plain = _EXPLAIN_HEAD.sub("", sql)
            result = self.explain_text(self.duckdb(sql if created is None else
                                                   f"{head} {sql}"))
            self.explain_parts.append({"duckdb": plain, "plan": result.text})
            if created is not None:  # DuckDB knows no CREATE TENSOR: its query, then a note
                text = (f"{self.statement.text}\n-- CREATE TENSOR {created.this.name}: the "
                        f"query's element rows (labels, val), made dense and stored\n"
                        f"{result.text}")
                if analyze:  # as DuckDB's EXPLAIN ANALYZE CREATE TABLE: it is created
                    text += "\n-- " + self.create_tensor(created).text
                return SQLResult(text=text)
            return result
        self.check_einsum_not_kept(inner)
        self.explain_sections = []
        self.analyze = analyze
        try:
            call = self.pure_call(inner, {})
            if isinstance(call, RelationalEinsum):
                self.relational(call)
            elif call is not None:
                compiled = CompiledQuery.compile(call.node, self.session, backend=call.backend)
                if created is not None and call.present is None \
                        and not self.fits_dense(compiled):  # as CREATE TENSOR: never dense
                    self.explain_streamed(call, compiled, "its chunks go to the store as "
                                          "computed" if analyze else "they would be stored "
                                          "chunk by chunk as computed")
                else:
                    self.compute(call, compiled)
            else:
                self.query(inner, {}, explain=True)
            sections = self.explain_sections
        finally:
            self.explain_sections = None
            self.analyze = False
        if created is not None and analyze:  # it is created, as DuckDB's EXPLAIN ANALYZE
            # CREATE TABLE creates its table: from the result the analysis computed when it
            # was the whole query's, else by running the statement
            dense = None
            if isinstance(call, EinsumCall) and call.present is None \
                    and len(self.explain_parts) == 1 \
                    and self.explain_parts[0].get("result") is not None:
                dense = self.explain_parts[0]["result"].dense()
            sections.append("-- " + self.create_tensor(created, dense=dense).text)
        return SQLResult(text="\n".join([self.statement.text, *sections]))

    def explain_drop(self, e: DropTensor, head: str, analyze: bool) -> SQLResult:
        """``EXPLAIN [ANALYZE] DROP TENSOR``: the name checked as DROP TENSOR checks it (an
        unknown tensor is an SQLUnknownTensorError unless ``IF EXISTS``); ANALYZE drops it,
        as DuckDB's EXPLAIN ANALYZE runs the statement it explains (the last line reads
        ``-- DROP TENSOR name``)."""
        name = self.tensor_name(e.this)
        if self.session.chunk_store.has(name):
            what = ("removes the stored tensor, its chunk table and its views (one "
                    "transaction)")
        elif e.args.get("exists"):
            what = "not present, nothing to remove"
        else:
            raise SQLUnknownTensorError(name, self.session.tensors(), text=self.script,
                                        position=self.pos(e.this))
        text = f"{head}\nDROP TENSOR {name}: {what}"
        if analyze:
            text += "\n-- " + self.drop_tensor(e).text
        return SQLResult(text=text)

    @staticmethod
    def explain_text(result: SQLResult) -> SQLResult:
        """DuckDB's EXPLAIN result as text (its ``explain_value`` column)."""
        if result.table is not None and "explain_value" in result.table.column_names:
            text = "\n".join(result.table.column("explain_value").to_pylist())
            return SQLResult(text=text.rstrip("\n"))
        return result

    # -- queries ----------------------------------------------------------------------
    def query(self, query: exp.Expr, ctes: dict[str, exp.CTE], explain: bool = False,
              params: Any = None) -> SQLResult:
        call = self.pure_call(query, ctes)
        if isinstance(call, RelationalEinsum):
            return self.relational(call)
        if call is not None:
            return SQLResult(tensor=self.compute(call), labels=call.labels,
                             present=call.present)
        tree = query.copy()
        if isinstance(tree, exp.Create):
            _with_data_as_query(tree)
        while True:
            prune_ctes(tree)
            calls = [node for node in tree.find_all(Einsum)
                     if not any(isinstance(a, Einsum) for a in ancestors(node))]
            if not calls:
                break
            node = calls[-1]  # the last first: CTEs it reads can still be fused into it
            parent = node.parent
            if not isinstance(parent, exp.Table):
                raise self.fail(SQLExecutionError, "EINSUM is a table function: use it in "
                                "FROM (or JOIN)", node)
            resolved = self.operands.call(node, {**ctes, **scope_of(node)})
            name = temp_name("einsum")
            if isinstance(resolved, RelationalEinsum) and self.explain_sections is None:
                self.relational_view(resolved, name)  # DuckDB streams it into the statement
            else:
                if isinstance(resolved, RelationalEinsum):
                    rows = self.relational(resolved).arrow()
                else:
                    rows = self.call_rows(resolved)
                self.register(name, rows)
            parent.set("this", exp.to_identifier(name, quoted=True))
        sql = tree.sql(dialect="duckdb")
        if explain and self.explain_sections is not None:
            prefix = "EXPLAIN ANALYZE " if self.analyze else "EXPLAIN "
            plan = self.duckdb(prefix + sql)
            text = "\n".join(plan.table.column("explain_value").to_pylist()) \
                if plan.table is not None else str(plan)
            self.explain_sections.append(f"-- DuckDB runs the rest: {sql}\n{text.rstrip()}")
            self.explain_parts.append({"duckdb": sql, "plan": text.rstrip()})
            return plan
        return self.duckdb(sql, params=params)

    def pure_call(self, query: exp.Expr, ctes: dict[str, exp.CTE]) \
            -> EinsumCall | RelationalEinsum | None:
        """The call when ``query`` is exactly ``SELECT * FROM EINSUM(...)``."""
        node = pure_einsum(query)
        if node is None:
            return None
        return self.operands.call(node, {**ctes, **scope_of(node)})

    def call_rows(self, call: EinsumCall) -> pa.Table | pa.RecordBatchReader:
        """The element rows of a call another statement reads: a table of them, or, when the
        dense result would pass the memory limit, a stream DuckDB pulls chunk by chunk."""
        compiled = CompiledQuery.compile(call.node, self.session, backend=call.backend)
        if call.present is None and not self.fits_dense(compiled):
            if self.explain_sections is None:
                return chunk_rows(compiled, call.labels)
            # EXPLAIN shows the plan the statement runs: the rows stream into DuckDB
            # (EXPLAIN ANALYZE runs it so, under DuckDB's EXPLAIN ANALYZE of the rest; plain
            # EXPLAIN registers no rows, only their columns)
            self.explain_streamed(call, compiled, "its rows stream into DuckDB chunk by chunk")
            rows = chunk_rows(compiled, call.labels)
            return rows if self.analyze else rows.schema.empty_table()
        return SQLResult(tensor=self.compute(call, compiled), labels=call.labels,
                         present=call.present).arrow()

    def fits_dense(self, compiled: CompiledQuery) -> bool:
        """Whether ``compiled``'s dense result fits the session's memory limits (else a
        statement streams it: into DuckDB as rows, into the store as chunks)."""
        try:
            check_dense_fits(compiled.physical.result_step.relation, self.session.options)
        except MemoryLimitError:
            return False
        return True

    def explain_streamed(self, call: EinsumCall, compiled: CompiledQuery, how: str) -> None:
        """The EXPLAIN section of a call whose result the statement streams (past the memory
        limit, never dense): its plan, without measurements (the run happens as its chunks
        are read), and ``how`` the chunks go on."""
        text, _ = compiled.explain_and_result(analyze=False)
        einsum = f"{call.sql.sql(dialect=_dialect())} -> ({', '.join(call.labels)}, val)"
        self.explain_sections.append(f"-- {einsum}\n{text}\n-- the result is past the memory "
                                     f"limit, never held dense: {how}")
        self.explain_parts.append({"einsum": einsum, "compiled": compiled, "result": None})

    def compute(self, call: EinsumCall, compiled: CompiledQuery | None = None) -> torch.Tensor:
        """Run the call on its backend through the pipeline (adding EXPLAIN text when
        explaining; plain EXPLAIN computes nothing and returns a placeholder). A dense result
        past the memory limit is a MemoryLimitError with advice in SQL."""
        if compiled is None:
            compiled = CompiledQuery.compile(call.node, self.session, backend=call.backend)
        sections = self.explain_sections
        if sections is None:
            check_dense_fits(compiled.physical.result_step.relation, self.session.options,
                             advice=SQL_ADVICE)
            return self.over_rows_fixed(call, compiled.run(dense=True).dense())
        if self.analyze:  # it runs as the statement runs: refused past the memory limit
            check_dense_fits(compiled.physical.result_step.relation, self.session.options,
                             advice=SQL_ADVICE)
        text, result = compiled.explain_and_result(analyze=self.analyze)
        einsum = f"{call.sql.sql(dialect=_dialect())} -> ({', '.join(call.labels)}, val)"
        sections.append(f"-- {einsum}\n{text}")
        self.explain_parts.append({"einsum": einsum, "compiled": compiled, "result": result})
        if result is not None:
            return self.over_rows_fixed(call, result.dense())
        return torch.zeros(call.node.shape, dtype=torch_dtype(call.node.dtype))

    def over_rows_fixed(self, call: EinsumCall, dense: torch.Tensor) -> torch.Tensor:
        """``dense``, the call's result, or, where an absent row's fill met an inf or NaN
        (0 * inf gives NaN in a cell some rows reached), the result computed over the rows
        (an absent row joins nothing there), run for real also under EXPLAIN ANALYZE so that
        it registers the statement's rows."""
        if call.over_rows is None or not _nan_where_present(dense, call.present):
            return dense
        saved, self.explain_sections = self.explain_sections, None
        try:
            return self.relational(call.over_rows()).torch().to(dense.dtype)
        finally:
            self.explain_sections = saved

    def relational_view(self, call: RelationalEinsum, name: str) -> None:
        """Make a relational EINSUM readable as the temporary view ``name`` for the rest of
        the statement: its rows are never materialised outside DuckDB."""
        self._register_operands(call)
        try:  # DuckDB binds the view here: its errors read as a statement's (SQLExecutionError)
            self.con.execute(f"CREATE TEMP VIEW {quote_ident(name)} AS {call.sql}")
        except duckdb.Error as err:
            raise self._duckdb_error(err) from None
        self.views.append(name)

    def _register_operands(self, call: RelationalEinsum) -> None:
        for derived in call.derived:
            tensor = self.compute(derived.call)
            self.register(derived.name, SQLResult(tensor=tensor, labels=derived.columns,
                                                  present=derived.call.present).arrow())
        for operand in call.operands:
            if operand.rows is not None:
                self.register(operand.name, operand.rows)

    def relational(self, call: RelationalEinsum) -> SQLResult:
        """Run a relational EINSUM in DuckDB: register its operands' rows, run its join +
        GROUP BY, and return the rows (EXPLAIN shows DuckDB's plan of it; plain EXPLAIN runs
        nothing and returns no rows)."""
        sections = self.explain_sections
        self._register_operands(call)
        dense = DenseForm(shape=call.shape, agg=call.agg, limit=call.dense_limit)
        if sections is not None:
            prefix = "EXPLAIN ANALYZE " if self.analyze else "EXPLAIN "
            plan = self.duckdb(prefix + call.sql)
            text = "\n".join(plan.table.column("explain_value").to_pylist())
            head = (f"-- {call.einsum.sql(dialect=_dialect())} -> ({', '.join(call.labels)}, "
                    f"val)\nrelational join over element rows in DuckDB: {call.reason}")
            sections.append(f"{head}\n{call.sql}\n{text.rstrip()}")
            self.explain_parts.append({"duckdb": call.sql, "plan": text.rstrip()})
            if not self.analyze:
                empty = self.duckdb(f"SELECT * FROM ({call.sql}) LIMIT 0").table
                return SQLResult(table=empty, labels=call.labels, dense=dense)
        table = self.duckdb(call.sql).table
        return SQLResult(table=table, labels=call.labels, dense=dense)

    def relational_rows(self, call: RelationalEinsum) -> pa.Table:
        """The rows of a relational EINSUM read as another EINSUM's operand (run for real,
        also under EXPLAIN, like any relation operand)."""
        saved, self.explain_sections = self.explain_sections, None
        try:
            return self.relational(call).arrow()
        finally:
            self.explain_sections = saved

    def register(self, name: str, table: pa.Table) -> None:
        """Make ``table`` readable in DuckDB as ``name`` until the statement ends."""
        try:
            self.con.register(name, table)
        except duckdb.Error as err:
            raise SQLExecutionError(f"could not register the statement's temporary table "
                                    f"{name!r}: {str(err).splitlines()[0]}", text=self.script,
                                    position=self.statement.offset if self.statement else 0
                                    ) from None
        self.registered.append(name)

    def rows(self, query: exp.Expr, scope: dict[str, exp.CTE],
             missing: exp.Expr | None = None) -> pa.Table:
        """The rows of ``query`` (with the CTEs it needs from ``scope``), run for real."""
        query = with_ctes(query.copy(), scope)
        saved, self.explain_sections = self.explain_sections, None
        try:
            result = self.query(query, {})
        except SQLExecutionError as err:
            if missing is not None and "does not exist" in str(err):
                raise SQLUnknownTensorError(missing.sql(dialect="duckdb"),
                                            self.session.tensors(), text=self.script,
                                            position=self.pos(missing)) from None
            raise
        finally:
            self.explain_sections = saved
        return result.arrow()


def _dialect():
    from tensorql.sql.dialect import TensorQL

    return TensorQL


def _einsum_in_text(text: str) -> int | None:
    """Where (an offset into ``text``) the first ``EINSUM(`` call of a statement is, looking
    into the raw body of a command sqlglot keeps as text (``PREPARE p AS ...``); None when
    there is none (strings and comments do not count).

    >>> _einsum_in_text("PREPARE p AS SELECT 'EINSUM(' AS s, * FROM einsum('i', A)")
    43
    """
    try:
        tokens = _dialect()().tokenize(text)
    except sqlglot.errors.TokenError:
        return None
    for k, tok in enumerate(tokens):
        if tok.token_type == TokenType.VAR and tok.text.upper() == "EINSUM" \
                and k + 1 < len(tokens) and tokens[k + 1].token_type == TokenType.L_PAREN:
            return tok.start
        if tok.token_type == TokenType.STRING and k > 0 \
                and tokens[k - 1].token_type == TokenType.COMMAND:
            body = text.find(tok.text, tokens[k - 1].end + 1)
            inner = _einsum_in_text(tok.text) if body >= 0 else None
            if inner is not None:
                return body + inner
    return None


def _relocate(err: TensorQLError, bound: str, written: str) -> None:
    """Make ``err``, positioned in ``bound`` (``written`` with its query parameters bound as
    literals), point at the same place of ``written``: a place inside a bound literal is its
    placeholder's. Errors positioned in other text are left as they are."""
    if not isinstance(err, (_Located, ParseError)) or err.text != bound \
            or err.position is None:
        return
    position = len(written)
    matcher = difflib.SequenceMatcher(None, written, bound, autojunk=False)
    for tag, i1, _, j1, j2 in matcher.get_opcodes():
        if j1 <= err.position < j2:
            position = i1 + (err.position - j1) if tag == "equal" else i1
            break
    if isinstance(err, _Located):
        err.args = (err._place(err.message, written, position), *err.args[1:])
        return
    before = written[:position]
    err.text, err.position = written, position
    err.line = before.count("\n") + 1
    err.column = position - (before.rfind("\n") + 1) + 1
    err.args = (err._render(), *err.args[1:])


def _with_data_as_query(create: exp.Create) -> None:
    """Rewrite ``CREATE TABLE t AS query WITH [NO] DATA`` (in place) so that DuckDB's SQL as
    sqlglot renders it keeps its meaning: sqlglot's DuckDB writer drops the ``WITH [NO]
    DATA`` clause, so ``WITH NO DATA`` (an empty table with the query's columns) becomes
    ``AS SELECT * FROM (query) LIMIT 0``, and ``WITH DATA`` (the default) is left out.

    >>> import sqlglot
    >>> tree = sqlglot.parse_one("CREATE TABLE t AS SELECT 1 AS x WITH NO DATA", read="duckdb")
    >>> _with_data_as_query(tree); tree.sql(dialect="duckdb")
    'CREATE TABLE t AS SELECT * FROM (SELECT 1 AS x) LIMIT 0'
    """
    props = create.args.get("properties")
    if props is None:
        return
    clauses = [p for p in props.expressions if isinstance(p, exp.WithDataProperty)]
    if not clauses:
        return
    for clause in clauses:
        clause.pop()
    if not props.expressions:
        create.set("properties", None)
    body = create.expression
    if body is None or not any(c.args.get("no") for c in clauses):
        return
    body.pop()
    source = body if isinstance(body, exp.Subquery) else exp.Subquery(this=body)
    create.set("expression", exp.select("*").from_(source, copy=False).limit(0, copy=False))


def _nan_where_present(dense: torch.Tensor, present: torch.Tensor | None) -> bool:
    """Whether a floating result holds a NaN in a cell some combination of rows reached."""
    if present is None or not dense.is_floating_point():
        return False
    nan = torch.isnan(dense)
    return bool(nan.any()) and bool((nan & present.expand(dense.shape)).any())


def explain_each(session: Any, script: str, analyze: bool = False,
                 backend: str | None = None) -> list[SQLResult]:
    """EXPLAIN (or EXPLAIN ANALYZE) every statement of ``script``, running none of them
    (except what ANALYZE runs): the CLI's ``tensorql explain``."""
    statements = split_script(script)
    if not statements:
        raise ParseError("no SQL statement given", text=script, position=0)
    return [result for result, _ in _explained(session, statements, analyze, backend)]


def _explained(session: Any, statements: list[Statement], analyze: bool,
               backend: str | None) -> list[tuple[SQLResult, list[dict[str, Any]]]]:
    """Each statement EXPLAINed: its result and the parts its plan is made of."""
    prefix = "EXPLAIN ANALYZE " if analyze else "EXPLAIN "
    out = []
    for st in statements:
        if isinstance(st.expression, Explain) or st.explain:
            text = st.text
        else:
            text = prefix + st.text
        runner = ScriptRunner(session, text, backend)
        out.append((runner.run(), runner.explain_parts))
    return out


EXPLAIN_SCHEMA = "tensorql.explain/1"
_COMMENT = {"dot": "// ", "mermaid": "%% "}  # how each graph language writes a comment line


def explain_graphs(session: Any, script: str, fmt: str, analyze: bool = False,
                   backend: str | None = None) -> str:
    """Every statement of ``script`` EXPLAINed as ``fmt`` ("json", "dot" or "mermaid"): the
    CLI's ``tensorql explain --format``. Each EINSUM's plan is drawn as
    ``explain(format=fmt)`` draws it (:mod:`tensorql.physical.plan_graph`); what DuckDB runs
    is DuckDB's EXPLAIN text. JSON is one document::

        {"schema": "tensorql.explain/1",
         "statements": [{"sql": str,
                         "einsum": [{"call": str, "plan": <a tensorql.plan/1 document>}],
                         "duckdb": [{"sql": str, "plan": str}]}]}

    DOT and mermaid give one graph per EINSUM, each headed by comment lines naming the
    statement and the call; DuckDB's plans are comment lines too, so the text stays valid.

    >>> import numpy as np, tensorql as tq
    >>> db = tq.connect()
    >>> _ = db.from_numpy("A", np.ones((4, 6), np.float32), tile=(2, 3))
    >>> print(explain_graphs(db, "SELECT * FROM EINSUM('ij->i', A)", "mermaid"))
    %% SELECT * FROM EINSUM('ij->i', A)
    %% EINSUM('ij->i', A) -> (i, val)
    flowchart BT
      s0["Scan A<br/>(d0,d1) 4x6 float32 grid 2x2 of 2x3<br/>tasks=4"]
      s1["Aggregate sum over [j]<br/>(i) 4 float32 grid 2 of 2<br/>tasks=4"]
      s0 --> s1
    """
    import json

    from tensorql.physical.plan_graph import FORMATS

    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise OptionError(f"unknown EXPLAIN format {fmt!r}; choose one of text, "
                          f"{', '.join(FORMATS)}")
    statements = split_script(script)
    if not statements:
        raise ParseError("no SQL statement given", text=script, position=0)
    explained = _explained(session, statements, analyze, backend)
    if fmt == "json":
        docs = []
        for st, (_, parts) in zip(statements, explained):
            docs.append({
                "sql": st.text,
                "einsum": [{"call": p["einsum"],
                            "plan": p["compiled"].plan_doc(p["result"])}
                           for p in parts if "einsum" in p],
                "duckdb": [{"sql": p["duckdb"], "plan": p["plan"]}
                           for p in parts if "duckdb" in p]})
        return json.dumps({"schema": EXPLAIN_SCHEMA, "statements": docs}, indent=2)
    comment = _COMMENT[fmt]

    def commented(text: str) -> str:
        return "\n".join(comment + line for line in text.splitlines())

    blocks = []
    for st, (_, parts) in zip(statements, explained):
        lines = [commented(st.text)]
        for part in parts:
            if "einsum" in part:
                doc = part["compiled"].plan_doc(part["result"])
                lines.append(f"{commented(part['einsum'])}\n{FORMATS[fmt](doc)}")
            else:
                lines.append(commented(f"DuckDB runs: {part['duckdb']}\n{part['plan']}"))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
