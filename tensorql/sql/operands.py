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
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch
from sqlglot import exp

from tensorql.einsum.graph import EinsumOp, Node, Source
from tensorql.einsum.literals import constant_node
from tensorql.einsum.spec import AGGS, JOINS
from tensorql.errors import ParseError, ShapeError, TensorQLError
from tensorql.sql.dialect import Einsum
from tensorql.sql.errors import SQLOperatorError, SQLShapeError, located
from tensorql.sql.relations import (
    SEMIRING_ZERO,
    absent_value,
    densify,
    order_columns,
    validate_indices,
)
from tensorql.sql.rewriting import operand_labels, pure_einsum, scope_of

__all__ = ["EinsumCall", "OperandResolver", "presence_equation"]

NAMED_ARGUMENTS = ("join", "agg", "backend", "sizes")


@dataclass(frozen=True)
class EinsumCall:
    """One EINSUM resolved: its graph node, output labels, backend and, when relation operands
    take part, the mask of output cells that at least one combination of rows reached."""

    node: EinsumOp
    labels: tuple[str, ...]
    backend: str | None
    sql: Einsum
    present: torch.Tensor | None = None


@dataclass(frozen=True)
class _Factor:
    """A mask of present cells over some labels of the equation."""

    mask: torch.Tensor
    labels: tuple[str, ...]


def presence_equation(factors: Sequence[Sequence[str]], output: Sequence[str]) \
        -> tuple[str, list[str]]:
    """A torch einsum equation (letters a, b, ...) over the factors' labels whose output keeps
    the ``output`` labels some factor carries; those labels, in output order."""
    letters: dict[str, str] = {}
    for labels in factors:
        for label in labels:
            letters.setdefault(label, chr(ord("a") + len(letters)))
    kept = [label for label in output if label in letters]
    lhs = ",".join("".join(letters[label] for label in labels) for labels in factors)
    return f"{lhs}->{''.join(letters[label] for label in kept)}", kept


def _presence(factors: list[_Factor], output: Sequence[str],
              shape: Sequence[int]) -> torch.Tensor:
    """Output cells some combination of present rows reaches (broadcastable to ``shape``)."""
    equation, kept = presence_equation([f.labels for f in factors], output)
    counts = torch.einsum(equation, *[f.mask.to(torch.float32) for f in factors])
    present = counts > 0
    view = [shape[k] if label in kept else 1 for k, label in enumerate(output)]
    return present.reshape(view)


class OperandResolver:
    """Turns EINSUM calls into graph nodes for one script.

    ``session`` is the database (``chunk_store``, ``options``, ``tensors()``); ``rows`` runs a
    query and returns its Arrow table; ``fail(cls, message, node)`` makes a positioned error and
    ``pos(node)`` the position of a node in the script.
    """

    def __init__(self, session: Any, script: str, rows: Callable[..., pa.Table],
                 fail: Callable[..., TensorQLError], pos: Callable[[Any], int | None],
                 backend: str | None) -> None:
        self.session = session
        self.script = script
        self.rows = rows
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
        join = self._word(named.get("join"), "mul", JOINS, "join")
        agg = self._word(named.get("agg"), "sum", AGGS, "agg")
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
                for label, size in zip(parts[k], value[0].shape):
                    known.setdefault(label, size)
        has_relation = any(isinstance(value, pa.Table) for value in resolved)
        fill = absent_value(join, agg, len(operands))
        if has_relation and fill is None:
            supported = ", ".join(f"join := '{j}', agg := '{a}'" for j, a in SEMIRING_ZERO)
            raise self.fail(SQLOperatorError, f"join {join!r} with agg {agg!r} has no zero, so "
                            "an absent row of a relation operand cannot be left out; relation "
                            f"operands of several-operand EINSUMs need one of: {supported} "
                            "(or store the relation as a tensor with CREATE TENSOR)", node)
        nodes: list[Node] = []
        factors: list[_Factor] = []
        max_bytes = self._dense_limit()
        for k, (value, arg) in enumerate(zip(resolved, operands)):
            if not isinstance(value, pa.Table):
                nodes.append(value[0])
                if value[1] is not None and parts is not None and "..." not in parts[k]:
                    factors.append(_Factor(value[1], tuple(parts[k])))
                continue
            if parts is None or "..." in parts[k]:
                raise self.fail(SQLShapeError, "a relation operand needs explicit labels (no "
                                "'...') in the equation", arg)
            try:
                columns = order_columns(value, parts[k])
                shape = [self._size(label, known, resolved, parts, arg) for label in parts[k]]
                dense = densify(value, columns, shape, fill=fill, agg=agg, max_bytes=max_bytes)
            except ShapeError as err:
                raise self.fail(SQLShapeError, str(err), arg) from None
            nodes.append(constant_node(dense.values, self.session.options.tile_target_elems))
            factors.append(_Factor(dense.present, tuple(parts[k])))
        try:
            op = EinsumOp.build(equation, nodes, join=join, agg=agg)
        except ParseError as err:
            raise ParseError(err.message, text=self.script,
                             position=self.pos(spec) + 1 + (err.position or 0)) from None
        except TensorQLError as err:
            mentioned = [int(n) for n in re.findall(r"operand (\d+)", str(err))]
            where = operands[mentioned[-1]] if mentioned and mentioned[-1] < len(operands) \
                else node  # the last operand named is the one that disagrees
            raise located(err, self.script, self.pos(where)) from None
        labels = tuple(op.spec.output)
        present = _presence(factors, labels, op.shape) if factors else None
        return EinsumCall(node=op, labels=labels, backend=backend, sql=node, present=present)

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
                (high,) = validate_indices(other, [columns[other_labels.index(label)]])
                size = max(size, high + 1)
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
            raise self.fail(SQLOperatorError, f"{what} := takes a string such as "
                            f"'{allowed[0]}'", value)
        word = value.this.lower()
        if word not in allowed:
            raise self.fail(SQLOperatorError, f"unknown {what} {value.this!r}; choose one of "
                            f"{', '.join(allowed)}", value)
        return word

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
            out[item.this.name] = size
        return out

    # -- operands -----------------------------------------------------------------------
    def operand(self, arg: exp.Expr, scope: dict[str, exp.CTE], seen: frozenset[str]) \
            -> tuple[Node, torch.Tensor | None] | pa.Table:
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
                if inner is not None:
                    call = self.call(inner, {**scope, **scope_of(inner)}, seen | {key})
                    return call.node, call.present
                self.expanding.add(key)  # CTEs being read as rows: a cycle is an error
                try:
                    return self.rows(exp.select("*").from_(
                        exp.Table(this=exp.to_identifier(name, quoted=True))), scope)
                finally:
                    self.expanding.discard(key)
            source = self.stored(name, arg.this.quoted)
            if source is not None:
                return source, None
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
