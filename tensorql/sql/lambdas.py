"""DuckDB lambdas as joins: ``EINSUM(..., join := (a, b) -> a * exp(b))``.

The lambda's body is translated, node by node, into a torch function of the parameters by a
small whitelist of DuckDB's scalar operators and functions (:data:`FUNCTIONS`, arithmetic,
comparisons, ``AND`` / ``OR`` / ``NOT``, ``CASE WHEN``); nothing of the user's text is
evaluated. A name that is not a parameter, a function outside the whitelist or a string is an
error naming the node, which the caller reports with its SQL position. The same body, its
parameters replaced by the operands' values, is the join's SQL for DuckDB's relational path.
The join is registered under the lambda's own text (the same lambda: the same join).

>>> import sqlglot, torch
>>> node = sqlglot.parse_one("SELECT list_transform(x, (a, b) -> a * exp(b) + greatest(a, 2))",
...                          read="duckdb").find(sqlglot.exp.Lambda)
>>> join = lambda_join(node)
>>> join.name, join.sql
('join<(a, b) -> a * EXP(b) + GREATEST(a, 2)>', '({0} * EXP({1}) + GREATEST({0}, 2))')
>>> join.fn(torch.tensor([1.0, 3.0]), torch.tensor([0.0, 0.0])).tolist()
[3.0, 6.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from sqlglot import exp

from tensorql.algebra import JOINS, add_user_join

__all__ = ["FUNCTIONS", "LambdaJoin", "LambdaSyntaxError", "lambda_join"]

Env = dict[str, torch.Tensor]
Compiled = Callable[[Env], torch.Tensor]


class LambdaSyntaxError(Exception):
    """What is wrong in a lambda, and the node where (the caller adds the SQL position)."""

    def __init__(self, message: str, node: exp.Expr) -> None:
        super().__init__(message)
        self.node = node


def _tensor(x: object) -> torch.Tensor:
    """A value of the lambda as a tensor: a constant as DuckDB types it (BIGINT, DOUBLE)."""
    if isinstance(x, torch.Tensor):
        return x
    return torch.tensor(x, dtype=torch.float64 if isinstance(x, float) else None)


def _fold(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    def call(*xs: torch.Tensor) -> torch.Tensor:
        value = _tensor(xs[0])
        for x in xs[1:]:
            value = fn(value, _tensor(x))
        return value

    return call


def _float(fn: Callable[[torch.Tensor], torch.Tensor]):
    """A function DuckDB computes in DOUBLE: integer operands become floating first."""
    def call(x: torch.Tensor) -> torch.Tensor:
        x = _tensor(x)
        return fn(x if x.is_floating_point() else x.double())

    return call


def _log(*xs: torch.Tensor) -> torch.Tensor:
    """DuckDB's ``log(x)`` is base 10; ``log(b, x)`` base ``b``."""
    if len(xs) == 1:
        return _float(torch.log10)(xs[0])
    base, x = (_float(torch.log)(v) for v in xs)
    return x / base


# DuckDB's scalar functions a lambda may call: sqlglot's node class -> torch function
FUNCTIONS: dict[type, Callable[..., torch.Tensor]] = {
    exp.Exp: _float(torch.exp),
    exp.Ln: _float(torch.log),
    exp.Log: _log,
    exp.Sqrt: _float(torch.sqrt),
    exp.Abs: lambda x: torch.abs(_tensor(x)),
    exp.Sign: lambda x: torch.sign(_tensor(x)),
    exp.Sin: _float(torch.sin),
    exp.Cos: _float(torch.cos),
    exp.Tan: _float(torch.tan),
    exp.Tanh: _float(torch.tanh),
    exp.Floor: lambda x: torch.floor(_tensor(x)),
    exp.Ceil: lambda x: torch.ceil(_tensor(x)),
    exp.Greatest: _fold(torch.maximum),
    exp.Least: _fold(torch.minimum),
    exp.Pow: lambda x, y: torch.pow(_tensor(x).double() if not _tensor(x).is_floating_point()
                                    else _tensor(x), _tensor(y)),
}
_BINARY: dict[type, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    exp.Add: torch.add,
    exp.Sub: torch.sub,
    exp.Mul: torch.mul,
    exp.Div: torch.true_divide,
    exp.Mod: torch.fmod,
    exp.LT: torch.lt,
    exp.LTE: torch.le,
    exp.GT: torch.gt,
    exp.GTE: torch.ge,
    exp.EQ: torch.eq,
    exp.NEQ: torch.ne,
    exp.And: torch.logical_and,
    exp.Or: torch.logical_or,
}


@dataclass(frozen=True)
class LambdaJoin:
    """A lambda registered as a join: its name, parameters, torch function and SQL template."""

    name: str
    params: tuple[str, ...]
    sql: str
    fn: Callable[..., torch.Tensor] = field(repr=False)


def lambda_join(node: exp.Lambda) -> LambdaJoin:
    """The join of a DuckDB lambda (registered once per lambda text); LambdaSyntaxError on a
    construct outside the whitelist, JoinFunctionError when the function is not elementwise."""
    for p in node.expressions:  # (DuckDB's parser reads any token there as a name)
        if not isinstance(p, (exp.Identifier, exp.Column)) or not (
                p.name.isidentifier() or (p.args.get("quoted") and p.name)):
            raise LambdaSyntaxError(f"a join lambda's parameters are names, one per operand; "
                                    f"got {p.name or p.sql(dialect='duckdb')!r}", p)
    params = tuple(p.name for p in node.expressions)
    canonical = {p.lower(): p for p in params}  # names are case-insensitive, as DuckDB's
    if not params or len(canonical) != len(params):
        raise LambdaSyntaxError("a join lambda needs distinct parameter names, one per operand",
                                node)

    def as_declared(n: exp.Expr) -> exp.Expr:
        if isinstance(n, (exp.Column, exp.Identifier)) and n.name not in params \
                and n.name.lower() in canonical and not (isinstance(n, exp.Column) and n.table):
            return exp.Identifier(this=canonical[n.name.lower()], quoted=False)
        return n

    node = exp.Lambda(this=node.this.transform(as_declared), expressions=node.expressions)
    body = _compile(node.this, params)

    def fn(*xs: torch.Tensor) -> torch.Tensor:
        out = body(dict(zip(params, xs)))
        return _tensor(out).expand(torch.broadcast_shapes(*(x.shape for x in xs)))

    text = node.this.sql(dialect="duckdb")
    name = f"join<({', '.join(params)}) -> {text}>"
    marked = node.this.transform(_ieee_nan).transform(
        lambda n: exp.Var(this=f"__tq_{params.index(n.name)}__")
        if isinstance(n, (exp.Column, exp.Identifier)) and n.name in params else n)
    template = "(" + marked.sql(dialect="duckdb").replace("{", "{{").replace("}", "}}") + ")"
    for k in range(len(params)):
        template = template.replace(f"__tq_{k}__", f"{{{k}}}")
    fn.__name__ = name
    if name not in JOINS:
        add_user_join(name, fn, arity=len(params), sql=template)
    return LambdaJoin(name, params, template, JOINS[name].fn)


def _isnan(value: exp.Expr) -> exp.Expr:
    return exp.Anonymous(this="isnan", expressions=[exp.cast(value.copy(), "DOUBLE")])


_COMPARISONS = (exp.LT, exp.LTE, exp.GT, exp.GTE, exp.EQ, exp.NEQ)


def _ieee_nan(node: exp.Expr) -> exp.Expr:
    """``node`` as DuckDB must run it to treat NaN as the torch function does: DuckDB orders
    NaN above every number and equal to itself, torch compares it false to anything (unequal
    to everything) and its minimum returns it. A comparison gets an ``isnan`` test; ``least``
    becomes NaN when ``greatest`` (NaN, when any is) is.

    >>> _ieee_nan(exp.GT(this=exp.column("a"), expression=exp.column("b"))).sql("duckdb")
    '(a > b AND NOT (ISNAN(CAST(a AS DOUBLE)) OR ISNAN(CAST(b AS DOUBLE))))'
    """
    if isinstance(node, _COMPARISONS):
        either = exp.or_(_isnan(node.this), _isnan(node.expression))
        if isinstance(node, exp.NEQ):
            return exp.paren(exp.or_(node.copy(), either))
        return exp.paren(exp.and_(node.copy(), exp.not_(exp.paren(either))))
    if isinstance(node, exp.Least):
        values = [node.this, *node.expressions]
        greatest = exp.Greatest(this=values[0].copy(),
                                expressions=[v.copy() for v in values[1:]])
        return exp.Case(ifs=[exp.If(this=_isnan(greatest), true=greatest.copy())],
                        default=node.copy())
    return node


def _compile(node: exp.Expr, params: tuple[str, ...]) -> Compiled:
    """``node`` as a function of the parameters' tensors."""
    if isinstance(node, exp.Paren):
        return _compile(node.this, params)
    if isinstance(node, (exp.Column, exp.Identifier)):  # a parameter (sqlglot: Identifier)
        if isinstance(node, exp.Column) and node.table or node.name not in params:
            raise LambdaSyntaxError(f"unknown name {node.sql(dialect='duckdb')!r} in the join "
                                    f"lambda; its parameters are {', '.join(params)}", node)
        name = node.name
        return lambda env: env[name]
    if isinstance(node, exp.Literal):
        if node.is_string:
            raise LambdaSyntaxError(f"a join lambda computes numbers; {node.sql()} is a string",
                                    node)
        value = float(node.this)
        value = int(value) if value.is_integer() and "." not in node.this \
            and "e" not in node.this.lower() else value
        return lambda env: value
    if isinstance(node, exp.Boolean):
        flag = bool(node.this)
        return lambda env: torch.tensor(flag)
    if isinstance(node, exp.Neg):
        inner = _compile(node.this, params)
        return lambda env: torch.neg(_tensor(inner(env)))
    if isinstance(node, exp.Not):
        inner = _compile(node.this, params)
        return lambda env: torch.logical_not(_tensor(inner(env)))
    if type(node) in _BINARY:
        fn = _BINARY[type(node)]
        left, right = _compile(node.this, params), _compile(node.expression, params)
        return lambda env: fn(_tensor(left(env)), _tensor(right(env)))
    if isinstance(node, exp.Case):
        return _case(node, params)
    if isinstance(node, exp.Cast):
        return _cast(node, params)
    if type(node) in FUNCTIONS:
        fn = FUNCTIONS[type(node)]
        args = [_compile(a, params) for a in _arguments(node)]
        return lambda env: fn(*[a(env) for a in args])
    if isinstance(node, (exp.Anonymous, exp.Func)):
        name = node.name if isinstance(node, exp.Anonymous) else node.sql_name()
        known = ", ".join(sorted(f.key.upper() for f in FUNCTIONS))
        raise LambdaSyntaxError(f"function {name.lower()!r} is not allowed in a join lambda; "
                                f"use {known}, arithmetic, comparisons or CASE", node)
    raise LambdaSyntaxError(f"{node.sql(dialect='duckdb')!r} ({node.key}) is not allowed in "
                            "a join lambda", node)


# the numeric types a lambda may CAST to (a bound float parameter is CAST('1.5' AS DOUBLE))
_FLOAT_TYPES = {exp.DataType.Type.DOUBLE: torch.float64, exp.DataType.Type.FLOAT: torch.float32}
_INT_TYPES = frozenset({exp.DataType.Type.TINYINT, exp.DataType.Type.SMALLINT,
                        exp.DataType.Type.INT, exp.DataType.Type.BIGINT})


def _cast(node: exp.Cast, params: tuple[str, ...]) -> Compiled:
    """``CAST(x AS DOUBLE | FLOAT | REAL | INTEGER ...)`` as DuckDB computes it: a number
    written as a string is that number; a cast to an integer type rounds half away from zero.

    >>> import sqlglot
    >>> cast = sqlglot.parse_one("CAST('1.5' AS DOUBLE) + CAST(2.5 AS INTEGER)", read="duckdb")
    >>> _compile(cast, ()) ({}).item()
    4.5
    """
    to = node.to.this
    if to not in _FLOAT_TYPES and to not in _INT_TYPES:
        raise LambdaSyntaxError(f"a join lambda casts to DOUBLE, FLOAT, REAL or an integer "
                                f"type only; got {node.to.sql(dialect='duckdb')}", node)
    inner = node.this
    if isinstance(inner, exp.Literal) and inner.is_string:
        try:
            number = float(inner.this)
        except ValueError:
            raise LambdaSyntaxError(f"{inner.sql()} is not a number", inner) from None
        inner = exp.Literal.number(inner.this.strip()) if math.isfinite(number) else inner
        if not math.isfinite(number):
            value = torch.tensor(number, dtype=_FLOAT_TYPES.get(to, torch.float64))
            return lambda env: value
    compiled = _compile(inner, params)
    if to in _FLOAT_TYPES:
        dtype = _FLOAT_TYPES[to]
        return lambda env: _tensor(compiled(env)).to(dtype)

    def to_integer(env: Env) -> torch.Tensor:
        x = _tensor(compiled(env))
        if x.is_floating_point():
            x = torch.sign(x) * torch.floor(torch.abs(x) + 0.5)
        return x.to(torch.int64)

    return to_integer


def _arguments(node: exp.Func) -> list[exp.Expr]:
    """A function node's arguments in call order (``log(b, x)`` is base, then value);
    LambdaSyntaxError for an argument the torch function would not read (``floor(a, 2)``:
    DuckDB's floor takes one)."""
    extra = [value for key, value in node.args.items()
             if isinstance(value, exp.Expr) and key not in ("this", "expression")]
    if extra or (node.expression is not None and not isinstance(node, (exp.Log, exp.Pow))):
        raise LambdaSyntaxError(f"too many arguments to {node.sql_name().lower()} in a join "
                                "lambda", node)
    if isinstance(node, exp.Log) and node.expression is not None:
        return [node.this, node.expression]
    args = [node.this] if node.this is not None else []
    if isinstance(node, exp.Pow):
        return [node.this, node.expression]
    return args + list(node.expressions)


def _case(node: exp.Case, params: tuple[str, ...]) -> Compiled:
    """``CASE WHEN c THEN v ... ELSE d END`` as nested ``torch.where`` (NULL: NaN)."""
    if node.this is not None:
        raise LambdaSyntaxError("only searched CASE (CASE WHEN cond THEN ...) is allowed in a "
                                "join lambda", node)
    branches = [(_compile(i.this, params), _compile(i.args["true"], params))
                for i in node.args.get("ifs") or []]
    default = node.args.get("default")
    otherwise = _compile(default, params) if default is not None else (lambda env: math.nan)

    def case(env: Env) -> torch.Tensor:
        value = _tensor(otherwise(env))
        for cond, then in reversed(branches):
            value = torch.where(_tensor(cond(env)).bool(), _tensor(then(env)), value)
        return value

    return case
