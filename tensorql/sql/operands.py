"""One EINSUM call of a SQL statement made into an einsum-graph node.

Each operand becomes a graph node: a stored tensor is a ``Source``; a CTE that is itself a bare
``SELECT * FROM EINSUM(...)`` is fused (its node is used directly); any other relation (table,
view, subquery, CTE) is read as rows and densified into a ``Constant`` with relational meaning:
absent rows hold the semiring's zero and a presence mask records which cells have rows, so the
call knows which output cells anything contributed to (:attr:`EinsumCall.present`).

>>> from tensorql.sql.rewriting import operand_labels
>>> presence_equation([["i", "j"], ["j", "k"]], ["i", "k"])
('ab,bc->ac', ['i', 'k'])
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import opt_einsum
import pyarrow as pa
import torch
from sqlglot import exp

from tensorql.algebra import (
    AggName,
    JoinFunctionError,
    JoinName,
    agg_record,
    join_record,
    offered_aggs,
    offered_joins,
    semiring_pairs,
)
from tensorql.dtypes import canonical_dtype, itemsize
from tensorql.einsum.graph import EinsumOp, Node, Source
from tensorql.einsum.literals import constant_node
from tensorql.einsum.spec import EinsumSpec
from tensorql.errors import ParseError, ShapeError, TensorQLError
from tensorql.sql.dialect import Einsum
from tensorql.sql.errors import SQLJoinFunctionError, SQLOperatorError, SQLShapeError, located
from tensorql.sql.lambdas import LambdaSyntaxError, lambda_join
from tensorql.sql.relational import RelationalOperand, dense_bytes, relational_sql
from tensorql.sql.relations import (
    absent_value,
    densify,
    filled_dtype,
    label_columns,
    order_columns,
    validate_indices,
)
from tensorql.sql.rewriting import operand_labels, pure_einsum, scope_of, temp_name
from tensorql.units import format_bytes

__all__ = ["DerivedOperand", "EinsumCall", "OperandResolver", "RelationalEinsum", "TensorOperand",
           "presence_equation"]

NAMED_ARGUMENTS = ("join", "agg", "backend", "sizes", "sparse")


@dataclass(frozen=True)
class EinsumCall:
    """One EINSUM resolved: its graph node, output labels, backend and, when relation operands
    take part, the mask of output cells that at least one combination of rows reached."""

    node: EinsumOp
    labels: tuple[str, ...]
    backend: str | None
    sql: Einsum
    present: torch.Tensor | None = None
    # the same call over rows (``sparse := true``), for a dense result whose present cells
    # hold a NaN: an absent row's fill (the semiring's zero) met an inf or NaN there
    # (0 * inf, inf - inf), where over rows the absent row joins nothing
    over_rows: Callable[[], RelationalEinsum] | None = field(default=None, compare=False,
                                                             repr=False)


@dataclass(frozen=True)
class TensorOperand:
    """An operand that is a tensor: a stored one (a ``Source``) or a fused CTE's EINSUM node,
    with the mask of its present cells when relation operands took part in it."""

    node: Node
    present: torch.Tensor | None = None


@dataclass(frozen=True)
class DerivedOperand:
    """A tensor operand of a relational call that DuckDB cannot read as it is (a fused CTE's
    EINSUM): ``call`` is computed and its present rows registered under ``name`` with label
    columns ``columns`` before the query runs."""

    name: str
    columns: tuple[str, ...]
    call: EinsumCall


@dataclass(frozen=True)
class RelationalEinsum:
    """One EINSUM run as a DuckDB join + GROUP BY over element rows (``sql``), because
    ``reason``. The rows it yields are the present output cells (labels, ``val`` of
    ``dtype``); as a dense tensor it has ``shape`` with ``agg``'s identity where no row is,
    refused beyond ``dense_limit`` bytes."""

    sql: str
    labels: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    agg: str
    operands: tuple[RelationalOperand, ...]
    derived: tuple[DerivedOperand, ...]
    reason: str
    einsum: Einsum
    dense_limit: int | None = None


@dataclass(frozen=True)
class _Factor:
    """A mask of present cells over some labels of the equation."""

    mask: torch.Tensor
    labels: tuple[str, ...]


def presence_equation(factors: Sequence[Sequence[str]], output: Sequence[str]) \
        -> tuple[str, list[str]]:
    """An einsum equation (opt_einsum's symbols a, b, ..., Z, then others) over the factors'
    labels whose output keeps the ``output`` labels some factor carries; those labels, in
    output order."""
    letters: dict[str, str] = {}
    for labels in factors:
        for label in labels:
            letters.setdefault(label, opt_einsum.get_symbol(len(letters)))
    kept = [label for label in output if label in letters]
    lhs = ",".join("".join(letters[label] for label in labels) for labels in factors)
    return f"{lhs}->{''.join(letters[label] for label in kept)}", kept


def _presence(factors: list[_Factor], output: Sequence[str],
              shape: Sequence[int]) -> torch.Tensor:
    """Output cells some combination of present rows reaches (broadcastable to ``shape``; a
    mask may be broadcastable too, size 1 along a label it does not vary with)."""
    equation, kept = presence_equation([f.labels for f in factors], output)
    masks = [f.mask.to(torch.float32) for f in factors]
    try:  # pairwise steps, each in torch.einsum's letters: more than 52 labels in all work
        counts = opt_einsum.contract(equation, *masks, backend="torch")
    except (RuntimeError, ValueError) as err:  # one step over more labels than torch takes
        raise ShapeError("the presence mask of the relation operands needs one einsum step "
                         "over more labels than torch.einsum takes (52): "
                         f"{str(err).splitlines()[0]}") from None
    present = counts > 0
    view = [present.shape[kept.index(label)] if label in kept else 1 for label in output]
    return present.reshape(view)


class OperandResolver:
    """Turns EINSUM calls into graph nodes for one script.

    ``session`` is the database (``chunk_store``, ``options``, ``tensors()``); ``rows`` runs a
    query and returns its Arrow table; ``relational_rows(call)`` runs a
    :class:`RelationalEinsum` and returns its rows; ``fail(cls, message, node)`` makes a
    positioned error and ``pos(node)`` the position of a node in the script.
    """

    def __init__(self, session: Any, script: str, rows: Callable[..., pa.Table],
                 relational_rows: Callable[[RelationalEinsum], pa.Table],
                 fail: Callable[..., TensorQLError], pos: Callable[[Any], int | None],
                 backend: str | None) -> None:
        self.session = session
        self.script = script
        self.rows = rows
        self.relational_rows = relational_rows
        self.fail = fail
        self.pos = pos
        self.backend = backend
        self.expanding: set[str] = set()  # CTEs being read as rows (a cycle is an error)

    # -- one call -----------------------------------------------------------------------
    def call(self, node: Einsum, scope: dict[str, exp.CTE],
             seen: frozenset[str] = frozenset()) -> EinsumCall:
        spec = node.this
        if not (isinstance(spec, exp.Literal) and spec.is_string):
            raise ParseError("EINSUM needs the equation as its first argument, a string such "
                             "as 'ij,jk->ik'", text=self.script, position=self.pos(spec or node))
        equation = spec.this
        named, operands = self._arguments(node)
        join = self._join(named.get("join"), len(operands))
        agg = self._word(named.get("agg"), AggName.SUM, offered_aggs(), "agg")
        backend = self._backend(named.get("backend"))
        sizes = self._sizes(named.get("sizes"))
        parts = operand_labels(equation)
        if parts is not None and len(parts) != len(operands):
            raise self.fail(SQLShapeError, f"equation {equation!r} names {len(parts)} "
                            f"operand(s) but EINSUM was given {len(operands)}", node)
        resolved = [self.operand(arg, scope, seen) for arg in operands]
        known = dict(sizes)
        for k, value in enumerate(resolved):
            if not isinstance(value, pa.Table) and parts is not None and "..." not in parts[k]:
                for label, size in zip(parts[k], value.node.shape):
                    if label in sizes and sizes[label] != size and size != 1:
                        raise self.fail(SQLShapeError, f"sizes := gives label {label!r} size "
                                        f"{sizes[label]}, but operand {k} has {size} there",
                                        operands[k])
                    known.setdefault(label, size)
        has_relation = any(isinstance(value, pa.Table) for value in resolved)
        fill = absent_value(join, agg, len(operands))
        if has_relation and fill is None and self._flag(named.get("sparse")) is False:
            if len(operands) == 1:
                raise self.fail(SQLOperatorError, "a one-operand EINSUM's join function is "
                                "applied to each row of a relation operand, which a dense "
                                "block cannot do (absent cells and duplicate rows); drop "
                                "sparse := false to join the rows", node)
            supported = ", ".join(f"join := '{j}', agg := '{a}'" for j, a in semiring_pairs())
            raise self.fail(SQLOperatorError, f"join {join!r} with agg {agg!r} has no zero, so "
                            "an absent row of a relation operand cannot be left out of a "
                            "dense block; with sparse := false, relation operands of "
                            f"several-operand EINSUMs need one of: {supported} (or drop "
                            "sparse := false to join the rows)", node)
        shapes: dict[int, list[int]] = {}
        for k, (value, arg) in enumerate(zip(resolved, operands)):
            if not isinstance(value, pa.Table):
                continue
            if parts is None or "..." in parts[k]:
                raise self.fail(SQLShapeError, "a relation operand needs explicit labels (no "
                                "'...') in the equation", arg)
            try:
                shapes[k] = [self._size(label, known, resolved, parts, arg)
                             for label in parts[k]]
            except ShapeError as err:
                raise self.fail(SQLShapeError, str(err), arg) from None
        reason = self._relational_reason(named.get("sparse"), equation, resolved, shapes,
                                         join, agg, fill)
        if reason is not None:
            return self._relational(node, equation, resolved, operands, parts, shapes, join,
                                    agg, reason)
        nodes: list[Node] = []
        factors: list[_Factor] = []
        max_bytes = self._dense_limit()
        for k, (value, arg) in enumerate(zip(resolved, operands)):
            if not isinstance(value, pa.Table):
                nodes.append(value.node)
                if value.present is not None and parts is not None and "..." not in parts[k]:
                    factors.append(_Factor(value.present, tuple(parts[k])))
                continue
            try:
                columns = order_columns(value, parts[k])
                dense = densify(value, columns, shapes[k], fill=fill, agg=agg,
                                max_bytes=max_bytes)
            except ShapeError as err:
                raise self.fail(SQLShapeError, str(err), arg) from None
            nodes.append(constant_node(dense.values, self.session.options.tile_target_elems))
            factors.append(_Factor(dense.present, tuple(parts[k])))
        op = self._build(equation, nodes, join, agg, spec, node, operands)
        labels = tuple(op.spec.output)
        if factors:  # a stored operand has every cell; with a label of size 0 it has none
            factors += [_Factor(torch.ones(0, dtype=torch.bool), (label,))
                        for label, size in op.spec.sizes.items() if size == 0]
        present = _presence(factors, labels, op.shape) if factors else None
        over_rows = None
        if has_relation and self._flag(named.get("sparse")) is None \
                and join_record(join).sql is not None and agg_record(agg).sql is not None:
            def over_rows() -> RelationalEinsum:
                rows = node.copy()
                rows.append("expressions", exp.PropertyEQ(this=exp.to_identifier("sparse"),
                                                          expression=exp.true()))
                return self.call(rows, scope, seen)
        return EinsumCall(node=op, labels=labels, backend=backend, sql=node, present=present,
                          over_rows=over_rows)

    def _build(self, equation: str, nodes: list[Node], join: str, agg: str, spec: exp.Expr,
               node: Einsum, operands: list[exp.Expr]) -> EinsumOp:
        """The einsum node, its errors positioned in the script."""
        try:
            return EinsumOp.build(equation, nodes, join=join, agg=agg)
        except ParseError as err:
            raise ParseError(err.message, text=self.script,
                             position=self.pos(spec) + 1 + (err.position or 0)) from None
        except TensorQLError as err:
            mentioned = [int(n) for n in re.findall(r"operand (\d+)", str(err))]
            where = operands[mentioned[-1]] if mentioned and mentioned[-1] < len(operands) \
                else node  # the last operand named is the one that disagrees
            raise located(err, self.script, self.pos(where)) from None

    # -- the relational path ------------------------------------------------------------
    def _relational_reason(self, flag: exp.Expr | None, equation: str, resolved: list,
                           shapes: dict[int, list[int]], join: str, agg: str,
                           fill: float | None) -> str | None:
        """Why this call runs over rows instead of dense blocks (None: it runs dense).

        Only calls with a relation operand qualify: ``sparse := true`` asks for it; a
        join/agg pair without a zero needs it; so does a relation (or the output) whose dense
        form would pass the memory bound, unless ``sparse := false`` (then densifying is
        refused with the bound's error)."""
        forced = self._flag(flag)
        if not shapes or forced is False:
            return None
        if forced:
            return "sparse := true"
        if fill is None and len(resolved) == 1:
            return ("the one-operand join function is applied to each row, so the relation "
                    "operand joins as rows")
        if fill is None:
            return (f"join {join!r} with agg {agg!r} has no zero an absent row could stand "
                    "for, so the relation operands join as rows")
        limit = self._dense_limit()
        if limit is None:
            return None
        for k, shape in shapes.items():  # as densify counts it: values plus the mask
            try:
                size = itemsize(_relation_dtype(resolved[k], join, agg, len(resolved)))
            except ShapeError:
                return None  # the dense path reports the bad column where it is
            need = dense_bytes(shape, size)
            if need > limit:
                return (f"operand {k} ({resolved[k].num_rows} row(s)) would take "
                        f"{format_bytes(need)} dense (shape {tuple(shape)}), more than the "
                        f"limit of {format_bytes(limit)} (Options.relation_dense_bytes / "
                        "memory_limit)")
        try:
            spec = EinsumSpec.parse(equation, [shapes[k] if k in shapes else value.node.shape
                                               for k, value in enumerate(resolved)], join, agg)
        except TensorQLError:
            return None  # the dense path reports the error where it is
        else:
            need = dense_bytes(spec.output_shape, 8)  # the result (<= 8-byte values) + mask
            if need > limit:
                return (f"the result would take {format_bytes(need)} dense, more than the "
                        f"limit of {format_bytes(limit)} (Options.relation_dense_bytes / "
                        "memory_limit)")
        return None

    def _flag(self, arg: exp.Expr | None) -> bool | None:
        if arg is None:
            return None
        value = arg.expression
        if isinstance(value, exp.Boolean):
            return bool(value.this)
        raise self.fail(SQLOperatorError, "sparse := takes true or false", value)

    def _relational(self, node: Einsum, equation: str, resolved: list,
                    operands: list[exp.Expr], parts: list[list[str]], shapes: dict,
                    join: str, agg: str, reason: str) -> RelationalEinsum:
        """The call as one DuckDB query over element rows (see :mod:`tensorql.sql.relational`)."""
        placeholders: list[Node] = []
        inputs: list[RelationalOperand] = []
        derived: list[DerivedOperand] = []
        for k, (value, arg) in enumerate(zip(resolved, operands)):
            name = temp_name("rows")
            if isinstance(value, pa.Table):
                columns = order_columns(value, parts[k])
                try:
                    _check_indices(value, columns, shapes[k])
                    dtype = _relation_dtype(value, join, agg, len(operands))
                except ShapeError as err:
                    raise self.fail(SQLShapeError, str(err), arg) from None
                val = next(n for n in value.column_names if n.lower() == "val")
                inputs.append(RelationalOperand(name=name, columns=tuple(columns),
                                                val=val, dtype=dtype, rows=value))
                placeholders.append(Source(shape=tuple(shapes[k]), dtype=dtype, name=name))
                continue
            tensor = value.node
            columns = tuple(f"d{d}" for d in range(len(tensor.shape)))
            if isinstance(tensor, Source) and tensor.offset is None:
                name = tensor.name  # the stored tensor's element view
            else:
                derived.append(DerivedOperand(name=name, columns=columns, call=EinsumCall(
                    node=tensor, labels=columns, backend=self.backend, sql=node,
                    present=value.present)))
            inputs.append(RelationalOperand(name=name, columns=columns, val="val",
                                            dtype=tensor.dtype))
            placeholders.append(tensor)
        op = self._build(equation, placeholders, join, agg, node.this, node, operands)
        return RelationalEinsum(
            sql=relational_sql(op.spec, inputs, op.dtype), labels=tuple(op.spec.output),
            shape=tuple(op.shape), dtype=op.dtype, agg=agg,
            operands=tuple(inputs), derived=tuple(derived), reason=reason, einsum=node,
            dense_limit=self._dense_limit())

    def _arguments(self, node: Einsum) -> tuple[dict[str, exp.Expr], list[exp.Expr]]:
        """Named arguments (``name := value`` or ``name => value``) and operands."""
        named: dict[str, exp.Expr] = {}
        operands: list[exp.Expr] = []
        for arg in node.expressions:
            if isinstance(arg, (exp.PropertyEQ, exp.Kwarg, exp.EQ)) and \
                    isinstance(arg.this, (exp.Identifier, exp.Column, exp.Var)):
                key = arg.this.name.lower()
                if key not in NAMED_ARGUMENTS:
                    raise self.fail(SQLOperatorError, f"unknown EINSUM argument {key!r}; "
                                    f"choose among {', '.join(NAMED_ARGUMENTS)}", arg)
                if key in named:
                    raise self.fail(SQLOperatorError, f"EINSUM argument {key!r} is given "
                                    "twice", arg)
                named[key] = arg
            elif named:
                raise self.fail(SQLShapeError, "operands must come before named arguments",
                                arg)
            else:
                operands.append(arg)
        return named, operands

    def _dense_limit(self) -> int | None:
        options = self.session.options
        limits = [v for v in (options.relation_dense_bytes, options.memory_limit) if v]
        return min(limits) if limits else None

    def _size(self, label: str, known: dict[str, int], resolved: list, parts: list[list[str]],
              arg: exp.Expr) -> int:
        """A label's size: from a tensor operand or sizes := {...}, else the largest index
        over the relation operands carrying it, plus one."""
        size = known.get(label)
        if size is not None:
            return size
        size = 0
        for other, other_labels in zip(resolved, parts):
            if isinstance(other, pa.Table) and label in other_labels:
                columns = order_columns(other, other_labels)
                carrying = [c for c, name in zip(columns, other_labels) if name == label]
                size = max([size, *(high + 1 for high in validate_indices(other, carrying))])
        if size < 1:
            raise ShapeError(f"cannot infer the size of label {label!r}: the relation "
                             f"operands carrying it have no rows; give sizes := "
                             f"{{'{label}': n}}")
        known[label] = size
        return size

    def _word(self, arg: exp.Expr | None, default: str, allowed: Sequence[str],
              what: str) -> str:
        if arg is None:
            return default
        value = arg.expression
        if not (isinstance(value, exp.Literal) and value.is_string):
            lam = " or a lambda such as (a, b) -> a * exp(b)" if what == "join" else ""
            raise self.fail(SQLOperatorError, f"{what} := takes a string such as "
                            f"'{allowed[0]}'{lam}", value)
        word = value.this.lower()
        if word not in allowed:
            raise self.fail(SQLOperatorError, f"unknown {what} {value.this!r}; choose one of "
                            f"{', '.join(allowed)}", value)
        return word

    def _join(self, arg: exp.Expr | None, operands: int) -> str:
        """The join's registered name: a DuckDB lambda's (translated to torch and SQL), or a
        registered join's name."""
        if arg is not None and isinstance(arg.expression, exp.Lambda):
            for param in arg.expression.expressions:  # 'a' reads as a quoted name there
                start = param.meta.get("start")
                if start is not None and self.script[start:start + 1] == "'":
                    raise self.fail(SQLJoinFunctionError, "a join lambda's parameters are "
                                    f"names, one per operand; got the string '{param.name}'",
                                    param)
            params = len(arg.expression.expressions)
            if params != operands:
                raise self.fail(SQLJoinFunctionError, f"the join lambda takes {params} "
                                f"parameter(s) but EINSUM has {operands} operand(s)",
                                arg.expression)
            try:
                return lambda_join(arg.expression).name
            except LambdaSyntaxError as err:
                raise self.fail(SQLJoinFunctionError, str(err), err.node) from None
            except JoinFunctionError as err:
                raise self.fail(SQLJoinFunctionError, str(err), arg.expression) from None
        return self._word(arg, JoinName.MUL, offered_joins(), "join")

    def _backend(self, arg: exp.Expr | None) -> str | None:
        from tensorql.pipeline import BACKENDS

        if arg is None:
            return self.backend
        return self._word(arg, self.backend or self.session.options.backend,
                          sorted(BACKENDS), "backend")

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
                                f"whole number from 0 to 2**62, got {text}", item)
            size = int(text)
            if size < 0:
                raise self.fail(SQLShapeError, f"size of label {item.this.name!r} must be "
                                ">= 0", item)
            if item.this.name in out:
                raise self.fail(SQLShapeError, f"sizes := gives label {item.this.name!r} "
                                "twice", item)
            out[item.this.name] = size
        return out

    # -- operands -----------------------------------------------------------------------
    def operand(self, arg: exp.Expr, scope: dict[str, exp.CTE], seen: frozenset[str]) \
            -> TensorOperand | pa.Table:
        """A stored tensor or a fused CTE EINSUM (its node and presence mask), or the rows of
        a relation."""
        if isinstance(arg, exp.Subquery):
            return self.rows(arg.this, scope)
        if isinstance(arg, exp.Column) and not arg.table:
            name = arg.name
            key = name.lower()
            cte = scope.get(key)
            if cte is not None:
                if key in seen or key in self.expanding:
                    raise self.fail(SQLShapeError, f"CTE {name!r} refers to itself through "
                                    "EINSUM; recursive tensor CTEs are not supported (iterate "
                                    "from Python instead)", arg)
                inner = pure_einsum(cte.this)
                call = self.call(inner, {**scope, **scope_of(inner)}, seen | {key}) \
                    if inner is not None else None
                if isinstance(call, EinsumCall):
                    return TensorOperand(node=call.node, present=call.present)
                if isinstance(call, RelationalEinsum):  # resolved already: just its rows
                    return self.relational_rows(call)
                self.expanding.add(key)  # CTEs being read as rows: a cycle is an error
                try:
                    return self.rows(exp.select("*").from_(
                        exp.Table(this=exp.to_identifier(name, quoted=True))), scope)
                finally:
                    self.expanding.discard(key)
            source = self.stored(name, arg.this.quoted)
            if source is not None:
                return TensorOperand(node=source)
            return self.rows(exp.select("*").from_(exp.to_table(arg.sql(dialect="duckdb"))),
                             scope, missing=arg)
        if isinstance(arg, (exp.Column, exp.Dot, exp.Table)):
            return self.rows(exp.select("*").from_(exp.to_table(arg.sql(dialect="duckdb"))),
                             scope, missing=arg)
        raise self.fail(SQLShapeError, "an EINSUM operand is a tensor name, a table name or "
                        "a subquery", arg)

    def stored(self, name: str, quoted: bool) -> Source | None:
        """The stored tensor ``name``: exact, or (unquoted) its case-insensitive match."""
        store = self.session.chunk_store
        if not store.has(name):
            if quoted:
                return None
            matches = [t for t in store.names() if t.lower() == name.lower()]
            if len(matches) != 1:
                return None
            name = matches[0]
        meta = store.meta(name)
        return Source(shape=meta.shape, dtype=meta.dtype, name=name, grid=meta.grid)


def _check_indices(table: pa.Table, columns: Sequence[str], shape: Sequence[int]) -> None:
    """Label columns hold integers from 0 to the label's size - 1 (ShapeError naming the
    column otherwise)."""
    for name, size, high in zip(columns, shape, validate_indices(table, columns)):
        if high >= size:
            raise ShapeError(f"column {name!r} has index {high} outside 0..{size - 1} "
                             f"(label size {size})")


def _relation_dtype(table: pa.Table, join: str, agg: str, operands: int) -> str:
    """The dtype a relation's values count as, as when densified (:func:`filled_dtype`);
    ShapeError (naming the columns) for a relation without a ``val`` column."""
    label_columns(table)  # ShapeError without a val column
    val = next(n for n in table.column_names if n.lower() == "val")
    return canonical_dtype(filled_dtype(table.column(val), absent_value(join, agg, operands)))
