"""The algebra registry: every join and every aggregation an extended einsum may use.

``out[o] = AGG_{a} JOIN(in1[..], in2[..], ...)``: a :class:`Join` is one record (its torch
function, folded left to right over the operands, or called once with all of them when
``nary``; its algebraic flags; the aggregations it distributes over and the semiring zero it
has with each; its SQL spelling; how its result dtype is found) and an :class:`Agg` another
(its torch reduction, in-place combine of partials, identity, SQL spelling, whether it is
associative). Every module that needs one of these facts reads it here, by the names below
(:class:`JoinName`, :class:`AggName`) -- no other module spells an operator's name.

The registry lives in ``tensorql_kernels``, the bottom layer, because the chunk kernels need
the torch functions and may import nothing above them; ``tensorql.algebra`` re-exports it and
adds what needs the engine's errors: validated registration of the user's own joins and
aggregations (``tq.register_join`` / ``tq.register_agg``) and lookups that raise
``UnknownOperatorError``. The registry is process-wide (not per session), so a plan cached by
a join's name means the same function in every session and on every device.

>>> join_of(JoinName.ADD).fn(torch.tensor(1.0), torch.tensor(2.0)).item()
3.0
>>> join_of(JoinName.MUL).distributes(AggName.SUM), join_of(JoinName.MUL).zero(AggName.SUM)
(True, 0.0)
>>> agg_of(AggName.MAX).reduce(torch.tensor([[1.0, 5.0], [7.0, 2.0]]), [1]).tolist()
[5.0, 7.0]
>>> sorted(BUILTIN_JOINS)[:4], sorted(AGGS)
(['adam', 'adamw', 'add', 'div'], ['max', 'min', 'prod', 'sum'])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch


class JoinName:
    """The built-in joins' names (use these, never the strings)."""

    MUL = "mul"
    ADD = "add"
    SUB = "sub"
    DIV = "div"
    MAX = "max"
    MIN = "min"
    POW = "pow"
    LT = "lt"
    LE = "le"
    GT = "gt"
    GE = "ge"
    EQ = "eq"
    NE = "ne"
    WHERE = "where"
    FLOORDIV = "floordiv"
    MOD = "mod"
    ADAM = "adam"
    ADAMW = "adamw"
    SILU_GRAD = "silu_grad"
    RELU_GRAD = "relu_grad"


class AggName:
    """The built-in aggregations' names (use these, never the strings)."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"
    PROD = "prod"


@dataclass(frozen=True)
class UpdateRule:
    """What an optimizer's update join computes (the ``rule`` of its :class:`Join`): Adam
    (weight decay added to the gradient) or, ``decoupled``, AdamW; and the hyperparameters
    fixed for the optimizer's life, ``hyper`` = (beta1, beta2, eps, weight_decay), carried
    by the join itself -- or None: the join reads them from scalar operands (the general
    joins ``adam`` / ``adamw``, operands lr, beta1, beta2, eps, weight_decay, step).

    A join carrying its hyperparameters has two scalar operands, lr and step (they change
    per step): a kernel on a GPU reads both where they are, on the device, and nothing back
    on the host (:func:`update_join` names and registers one).

    >>> UpdateRule(True, (0.9, 0.999, 1e-08, 0.01)).name
    'adamw(beta1=0.9,beta2=0.999,eps=1e-08,weight_decay=0.01)'
    >>> UpdateRule(False).name, UpdateRule(False).scalars
    ('adam', ('lr', 'beta1', 'beta2', 'eps', 'weight_decay', 'step'))
    >>> UpdateRule(True, (0.9, 0.99, 0.0, 0.0)).scalars
    ('lr', 'step')
    """

    decoupled: bool
    hyper: tuple[float, float, float, float] | None = None

    @property
    def kind(self) -> str:
        """``adamw`` (decoupled weight decay) or ``adam``."""
        return JoinName.ADAMW if self.decoupled else JoinName.ADAM

    @property
    def name(self) -> str:
        """The join's name: the kind, then the hyperparameters it carries (exact reprs)."""
        if self.hyper is None:
            return self.kind
        return self.kind + "(" + ",".join(f"{k}={v!r}" for k, v in zip(HYPERPARAMETERS,
                                                                  self.hyper)) + ")"

    @property
    def scalars(self) -> tuple[str, ...]:
        """The join's scalar operands, in order (after gradient, weight, moments, slots)."""
        return ("lr", *(HYPERPARAMETERS if self.hyper is None else ()), "step")


HYPERPARAMETERS = ("beta1", "beta2", "eps", "weight_decay")

# How a join's result dtype follows from its operands' (see tensorql.einsum.graph.result_dtype)
PROMOTE = "promote"        # torch's type promotion of the operands
BOOL = "bool"              # a comparison: bool (with two or more operands)
FLOATING = "floating"      # division: promoted, integral results become the default float
NUMERIC = "numeric"        # arithmetic: promoted, bool results become int64
CONDITION = "condition"    # where: promotion of every operand but the first (the condition)
PROBE = "probe"            # a user's function: the dtype torch gives it on the operands'
UPDATE = "update"          # an optimizer's update: the weight's (operand 1); its 0-d scalars
#                            (lr, step) are read in their own, maybe wider, dtype

DTYPE_RULES = (PROMOTE, BOOL, FLOATING, NUMERIC, CONDITION, PROBE, UPDATE)


@dataclass(frozen=True)
class Join:
    """One elementwise join.

    ``fn`` is a binary torch function folded left to right over the operands (``nary`` False)
    or a function of all ``arity`` operands at once (``nary`` True: ``where``, the optimizer
    updates, a user's function of three operands). ``sql`` spells one step of the fold for
    DuckDB as a template over ``{0}`` and ``{1}`` (all operands ``{0}..{n-1}`` for an n-ary
    join); ``sql_double`` casts the first operand to DOUBLE first ("always", or "nonint": only
    when the result is not integral). ``zeros`` maps an aggregation to the semiring's zero (a
    value ``z`` with ``JOIN(z, x) = JOIN(x, z) = identity`` of the aggregation, which an absent
    sparse row may stand for); ``distributes_over`` names the aggregations the join
    distributes over (with ``commutative``: labels may be aggregated early and operands
    reordered -- the contraction path's freedom). ``adjoint`` is a user's derivative
    ``adjoint(k, *operands) -> d out / d operand k``; None means the built-in rule of
    ``tensorql.api.autodiff`` (built-ins) or one derived with ``torch.func`` (``user``).
    """

    name: str
    fn: Callable[..., torch.Tensor] = field(repr=False, compare=False)
    arity: int | None = None
    nary: bool = False
    associative: bool = False
    commutative: bool = False
    comparison: bool = False
    update: bool = False
    distributes_over: frozenset[str] = frozenset()
    zeros: tuple[tuple[str, float], ...] = ()
    sql: str | None = None
    sql_double: str = ""
    dtype_rule: str = PROMOTE
    adjoint: Callable[..., torch.Tensor] | None = field(default=None, repr=False,
                                                       compare=False)
    user: bool = False
    label: str = ""  # a readable name for EXPLAIN (a user's function's own name)
    identity: float | None = None  # JOIN(identity, x) == x, where the join has one
    listed: bool = True  # offered by name in messages and SQL (not updates, anonymous joins)
    source: Callable[..., torch.Tensor] | None = field(default=None, repr=False,
                                                      compare=False)  # a user's own fn
    # the join with a Python number as one operand, as an elementwise map of the other
    # (tensorql_kernels.elementwise): (map, its scalar from the number) for ``x JOIN c`` and
    # for ``c JOIN x``; None where there is no such map
    scalar_maps: tuple[tuple[str, Callable[[float], float]],
                       tuple[str, Callable[[float], float]]] | None = field(
        default=None, repr=False, compare=False)
    rule: UpdateRule | None = None  # what an update join (``update``) computes

    def distributes(self, agg: str) -> bool:
        """Whether labels aggregated by ``agg`` may be aggregated early (a semiring)."""
        return self.commutative and agg in self.distributes_over

    def zero(self, agg: str) -> float | None:
        """The semiring zero of (this join, ``agg``), None where there is none."""
        return dict(self.zeros).get(agg)

    def apply(self, operands: Sequence[torch.Tensor]) -> torch.Tensor:
        """The join of ``operands`` (broadcast against each other)."""
        if self.nary:
            return self.fn(*operands)
        if len(operands) == 1:  # nothing to fold
            return operands[0]
        value = self.fn(operands[0], operands[1])
        for other in operands[2:]:
            value = self.fn(value, other)
        return value


@dataclass(frozen=True)
class Agg:
    """One aggregation: ``reduce(x, dims)`` reduces dims of a chunk, ``combine(acc, partial)``
    folds a partial result into ``acc`` in place (and returns it), ``identity`` is what an
    empty aggregation yields. ``sql`` / ``bool_sql`` are DuckDB's aggregate functions (for
    numbers / for bools), ``scatter`` torch's ``scatter_reduce`` name. Only an
    ``associative`` aggregation may be computed as partials over pieces of its labels and
    combined; ``widens`` says small integers accumulate in int64 (as ``torch.sum``)."""

    name: str
    reduce: Callable[[torch.Tensor, list[int]], torch.Tensor] = field(repr=False, compare=False)
    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = field(repr=False,
                                                                           compare=False)
    identity: float = 0.0
    associative: bool = True
    commutative: bool = True
    sql: str | None = None
    bool_sql: str | None = None
    scatter: str | None = None
    widens: bool = False
    user: bool = False
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = field(
        default=None, repr=False, compare=False)  # the binary function of a user's fold


def _prod(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    keep = [d for d in range(x.ndim) if d not in dims]
    flat = x.permute(keep + dims).reshape(*[x.shape[d] for d in keep], -1)
    return flat.prod(dim=-1)


def _where(cond: torch.Tensor, yes: torch.Tensor, no: torch.Tensor) -> torch.Tensor:
    return torch.where(cond.bool(), yes, no)


def _floordiv(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """numpy's ``a // b``: the floor of the quotient (toward -inf), integers divided by 0
    give 0 (numpy's value; torch raises), floats inf / nan.

    >>> _floordiv(torch.tensor([7, -7, 7]), torch.tensor([2, 2, 0])).tolist()
    [3, -4, 0]
    """
    return _integral_by_zero(torch.floor_divide, a, b)


def _mod(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """numpy's ``a % b``: the remainder with the divisor's sign (``a - b * (a // b)``),
    integers modulo 0 give 0 (numpy's value; torch raises), floats nan.

    >>> _mod(torch.tensor([7, -7, 7, -7]), torch.tensor([3, 3, -3, 0])).tolist()
    [1, 2, -2, 0]
    """
    return _integral_by_zero(torch.remainder, a, b)


def _pow(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a ** b``, refusing integers to negative integer powers as numpy does (torch gives 0,
    a wrong value rather than an error).

    >>> _pow(torch.tensor([2, 3]), torch.tensor([3, 0])).tolist()
    [8, 1]
    >>> _pow(torch.tensor([2]), torch.tensor([-1]))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: integers to negative integer powers are not allowed (as numpy's); ...
    """
    if not (a.is_floating_point() or b.is_floating_point() or b.dtype == torch.bool) \
            and not a.is_complex() and b.device.type == "cpu" and bool((b < 0).any()):
        # (on a device the check would stall the host on it every chunk: there torch's value,
        # the power truncated toward zero, stands)
        raise ValueError("integers to negative integer powers are not allowed (as numpy's); "
                         "convert the base to a floating dtype first")
    return torch.pow(a, b)


def _integral_by_zero(fn: Callable[..., torch.Tensor], a: torch.Tensor,
                      b: torch.Tensor) -> torch.Tensor:
    """``fn(a, b)`` with 0 where an integer ``b`` is 0. On the CPU the mask is skipped when
    no divisor is 0 (a host read of a host tensor); on a device, reading that back would
    stall the host on the device every chunk, so the device masks unconditionally.

    >>> _integral_by_zero(torch.remainder, torch.tensor([5, 5]), torch.tensor([3, 0])).tolist()
    [2, 0]
    >>> _integral_by_zero(torch.remainder, torch.zeros(2, dtype=torch.int64, device="meta"),
    ...                   torch.zeros(2, dtype=torch.int64, device="meta")).device
    device(type='meta')
    """
    if a.is_floating_point() or b.is_floating_point() or a.dtype == b.dtype == torch.bool:
        return fn(a, b)
    zero = b == 0
    if b.device.type == "cpu" and not bool(zero.any()):
        return fn(a, b)
    out = fn(a, torch.where(zero, torch.ones_like(b), b))
    return out.masked_fill(zero.expand(out.shape), 0)


# numpy's remainder in DuckDB: ``%`` is C's fmod (the dividend's sign), moved to the divisor's
# sign; an integer modulo 0 is 0 (DuckDB raises: TRY makes it NULL), a float one NaN
_FMOD = "COALESCE(TRY({0} % {1}), 0)"
_MOD_SQL = (f"CASE WHEN {_FMOD} <> 0 AND ({_FMOD} < 0) <> ({{1}} < 0) THEN {_FMOD} + {{1}} "
            f"ELSE {_FMOD} END")
# numpy's floor division: (a - a % b) / b rounded (numpy's divmod), an integer // 0 is 0
# (the integer % 0 that DuckDB refuses), a float one inf or NaN (a / 0); a finite number by
# an infinite one is 0 with the same signs, else -1 (numpy's divmod: inf / inf is NaN there)
_FLOORDIV_SQL = (f"CASE WHEN isinf(CAST({{1}} AS DOUBLE)) AND isfinite(CAST({{0}} AS DOUBLE)) "
                 f"THEN (CASE WHEN {{0}} = 0 OR ({{0}} > 0) = ({{1}} > 0) THEN 0 ELSE -1 END) "
                 f"WHEN {{1}} = 0 THEN (CASE WHEN TRY({{0}} % {{1}}) IS NULL THEN 0 "
                 f"ELSE {{0}} / {{1}} END) "
                 f"ELSE round(({{0}} - ({_MOD_SQL})) / {{1}}) END")
# DuckDB orders NaN above every number and equal to itself; torch (IEEE) compares a NaN false
# to anything (unequal to everything) and its minimum returns it: the SQL says so
_EITHER_NAN = "(isnan(CAST({0} AS DOUBLE)) OR isnan(CAST({1} AS DOUBLE)))"


def _ordered(op: str) -> str:
    """SQL for ``{0} op {1}`` that is false when either side is NaN, as in torch."""
    return f"({{0}} {op} {{1}} AND NOT {_EITHER_NAN})"


# greatest() is NaN when either is (NaN is DuckDB's largest): then least() must be too
_LEAST_SQL = "CASE WHEN isnan(CAST(greatest({0}, {1}) AS DOUBLE)) THEN greatest({0}, {1}) " \
    "ELSE least({0}, {1}) END"


def _silu_grad(grad: torch.Tensor, x: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU's adjoint, ``grad * silu'(x)`` = ``grad * s * (1 + x * (1 - s))`` with ``s`` the
    sigmoid of ``x``, as one kernel: aten's ``silu_backward`` (what torch.autograd runs), one
    pass over the operands where the formula spelt as joins and maps is six (with ``out``:
    written into it, as the arithmetic joins' ``out=``).

    >>> g, x = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 1.0])
    >>> [round(v, 4) for v in _silu_grad(g, x).tolist()]
    [0.5, 1.8553]
    """
    if out is None:
        return torch.ops.aten.silu_backward(grad, x)
    return torch.ops.aten.silu_backward.grad_input(grad, x, grad_input=out)


def _relu_grad(grad: torch.Tensor, y: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """ReLU's adjoint read from its output ``y``: ``grad`` where ``y > 0``, else 0, as one
    kernel -- aten's ``threshold_backward``, what torch.autograd runs for relu -- where
    ``grad * (y > 0)`` was a comparison, a cast and a product (with ``out``: written into
    it). At ``y`` NaN it passes ``grad`` on, as torch does.

    >>> _relu_grad(torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0.0, 1.0, 2.0])).tolist()
    [0.0, -2.0, 3.0]
    """
    if out is None:
        return torch.ops.aten.threshold_backward(grad, y, 0)
    return torch.ops.aten.threshold_backward.grad_input(grad, y, 0, grad_input=out)


# ``relu_grad`` in DuckDB (NaN <= 0 is false there too: the gradient passes, as in torch)
_RELU_GRAD_SQL = "CASE WHEN ({1}) <= 0 THEN 0 ELSE {0} END"

# ``silu_grad`` in DuckDB: {0} * s * (1 + {1} * (1 - s)), s = 1 / (1 + exp(-{1}))
_SIGMOID_SQL = "(1.0 / (1.0 + exp(-({1}))))"
_SILU_GRAD_SQL = f"({{0}}) * {_SIGMOID_SQL} * (1.0 + ({{1}}) * (1.0 - {_SIGMOID_SQL}))"


def _update(name: str) -> Callable[..., torch.Tensor]:
    def fn(*operands: torch.Tensor) -> torch.Tensor:
        from tensorql_kernels.optimizer_update import optimizer_update

        return optimizer_update(name, operands)

    return fn


_J, _A = JoinName, AggName


def _same(c: float) -> float:
    return c


def _negated(c: float) -> float:
    return -c


def _inverse(c: float) -> float:
    return 1.0 / c


_BUILTIN_JOINS = (
    Join(_J.MUL, torch.mul, associative=True, commutative=True,
         distributes_over=frozenset({_A.SUM}), zeros=((_A.SUM, 0.0),), sql="{0} * {1}",
         scalar_maps=(("scale", _same), ("scale", _same))),
    Join(_J.ADD, torch.add, associative=True, commutative=True,
         distributes_over=frozenset({_A.MAX, _A.MIN}),
         zeros=((_A.MIN, math.inf), (_A.MAX, -math.inf)), sql="{0} + {1}",
         dtype_rule=NUMERIC, scalar_maps=(("shift", _same), ("shift", _same))),
    Join(_J.SUB, torch.sub, sql="{0} - {1}", dtype_rule=NUMERIC,
         scalar_maps=(("shift", _negated), ("rsub", _same))),
    Join(_J.DIV, torch.div, sql="{0} / {1}", sql_double="always", dtype_rule=FLOATING,
         scalar_maps=(("scale", _inverse), ("rdiv", _same))),
    Join(_J.MAX, torch.maximum, associative=True, commutative=True,
         distributes_over=frozenset({_A.MAX, _A.MIN}), zeros=((_A.MIN, math.inf),),
         sql="greatest({0}, {1})", scalar_maps=(("maximum", _same), ("maximum", _same))),
    Join(_J.MIN, torch.minimum, associative=True, commutative=True,
         distributes_over=frozenset({_A.MAX, _A.MIN}), zeros=((_A.MAX, -math.inf),),
         sql=_LEAST_SQL, scalar_maps=(("minimum", _same), ("minimum", _same))),
    Join(_J.POW, _pow, sql="pow({0}, {1})", sql_double="nonint"),
    Join(_J.LT, torch.lt, comparison=True, sql=_ordered("<"), dtype_rule=BOOL),
    Join(_J.LE, torch.le, comparison=True, sql=_ordered("<="), dtype_rule=BOOL),
    Join(_J.GT, torch.gt, comparison=True, sql=_ordered(">"), dtype_rule=BOOL),
    Join(_J.GE, torch.ge, comparison=True, sql=_ordered(">="), dtype_rule=BOOL),
    Join(_J.EQ, torch.eq, comparison=True, sql=_ordered("="), dtype_rule=BOOL),
    Join(_J.NE, torch.ne, comparison=True, sql=f"({{0}} <> {{1}} OR {_EITHER_NAN})",
         dtype_rule=BOOL),
    Join(_J.WHERE, _where, arity=3, nary=True,
         sql="CASE WHEN CAST({0} AS BOOLEAN) THEN {1} ELSE {2} END", dtype_rule=CONDITION),
    Join(_J.FLOORDIV, _floordiv, sql=_FLOORDIV_SQL, sql_double="nonint"),
    Join(_J.MOD, _mod, sql=_MOD_SQL, sql_double="nonint"),
    # the adjoints of the maps silu and relu (tensorql.api.autodiff), not offered by name
    Join(_J.SILU_GRAD, _silu_grad, arity=2, sql=_SILU_GRAD_SQL, dtype_rule=FLOATING,
         listed=False),
    Join(_J.RELU_GRAD, _relu_grad, arity=2, sql=_RELU_GRAD_SQL, listed=False),
    Join(_J.ADAM, _update(_J.ADAM), nary=True, update=True, listed=False, dtype_rule=UPDATE,
         rule=UpdateRule(decoupled=False)),
    Join(_J.ADAMW, _update(_J.ADAMW), nary=True, update=True, listed=False,
         dtype_rule=UPDATE, rule=UpdateRule(decoupled=True)),
)
_BUILTIN_AGGS = (
    Agg(_A.SUM, lambda x, dims: x.sum(dim=dims), lambda acc, p: acc.add_(p), 0.0,
        sql="sum", bool_sql="bool_or", scatter="sum", widens=True),
    Agg(_A.MAX, lambda x, dims: x.amax(dim=dims),
        lambda acc, p: torch.maximum(acc, p, out=acc), -math.inf, sql="max",
        bool_sql="bool_or", scatter="amax"),
    Agg(_A.MIN, lambda x, dims: x.amin(dim=dims),
        lambda acc, p: torch.minimum(acc, p, out=acc), math.inf, sql="min",
        bool_sql="bool_and", scatter="amin"),
    Agg(_A.PROD, _prod, lambda acc, p: acc.mul_(p), 1.0, sql="product", bool_sql="bool_and",
        scatter="prod", widens=True),
)

_JOINS: dict[str, Join] = {j.name: j for j in _BUILTIN_JOINS}
_AGGS: dict[str, Agg] = {a.name: a for a in _BUILTIN_AGGS}
JOINS: Mapping[str, Join] = MappingProxyType(_JOINS)  # every join, the user's too
AGGS: Mapping[str, Agg] = MappingProxyType(_AGGS)
BUILTIN_JOINS = tuple(j.name for j in _BUILTIN_JOINS)
BUILTIN_AGGS = tuple(a.name for a in _BUILTIN_AGGS)
UPDATE_JOINS = tuple(j.name for j in _BUILTIN_JOINS if j.update)
COMPARISON_JOINS = frozenset(j.name for j in _BUILTIN_JOINS if j.comparison)


def join_of(name: str) -> Join:
    """The record of join ``name`` (KeyError when none is registered)."""
    return _JOINS[name]


def agg_of(name: str) -> Agg:
    """The record of aggregation ``name`` (KeyError when none is registered)."""
    return _AGGS[name]


def is_update(join: str) -> bool:
    """Whether ``join`` is an optimizer's n-ary update (adam, adamw).

    >>> is_update(JoinName.ADAM), is_update(JoinName.MUL), is_update("nope")
    (True, False, False)
    """
    record = _JOINS.get(join)
    return record is not None and record.update


def update_join(decoupled: bool, beta1: float, beta2: float, eps: float,
                weight_decay: float) -> str:
    """The name of the update join (Adam, or AdamW when ``decoupled``) that carries these
    hyperparameters itself, registered on first use (the same name is the same join in every
    session: its name spells the values). Its operands: gradient, weight, exp_avg,
    exp_avg_sq, the slot indices, lr and step (see ``tensorql_kernels.optimizer_update``).

    >>> name = update_join(False, 0.9, 0.999, 1e-8, 0.0)
    >>> name, join_of(name).rule.hyper, is_update(name)
    ('adam(beta1=0.9,beta2=0.999,eps=1e-08,weight_decay=0.0)', (0.9, 0.999, 1e-08, 0.0), True)
    """
    rule = UpdateRule(bool(decoupled), (float(beta1), float(beta2), float(eps),
                                        float(weight_decay)))
    name = rule.name
    known = _JOINS.get(name)
    if known is None:  # two threads may both build it: equal records
        _JOINS[name] = Join(name, _update(name), nary=True, update=True, listed=False,
                            dtype_rule=UPDATE, rule=rule)
    elif known.rule != rule:
        raise ValueError(f"join {name!r} is registered as another join (a user's)")
    return name


def add_join(record: Join) -> Join:
    """Register a user's join (the caller validated it); a built-in name cannot be replaced."""
    if record.name in BUILTIN_JOINS:
        raise ValueError(f"join {record.name!r} is built in")
    _JOINS[record.name] = record
    return record


def add_agg(record: Agg) -> Agg:
    """Register a user's aggregation (the caller validated it)."""
    if record.name in BUILTIN_AGGS:
        raise ValueError(f"agg {record.name!r} is built in")
    _AGGS[record.name] = record
    return record


def owned_result(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` (a user's) made safe for the engine, which accumulates into results in place: a
    result is broadcast to the operands' broadcast shape (a function may ignore an operand),
    and one that is a view of an operand, or not laid out densely (an expanded broadcast),
    comes back as a contiguous copy.

    A function that writes an operand in place (a stored chunk, or a view of one) is a
    ValueError: the engine's chunks are shared, read by other tasks and kept by the store. The
    version counters see the write (of a copy, under the caller's ``torch.inference_mode``,
    whose chunks count no versions: see :func:`without_inference`).

    >>> x = torch.ones(2, 1)
    >>> out = owned_result(lambda a, b: a.expand(2, 3))(x, torch.ones(1, 3))
    >>> out.is_contiguous(), out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    (True, True)
    >>> owned_result(lambda a, b: a.add_(b))(x, torch.ones(2, 1))
    Traceback (most recent call last):
    ...
    ValueError: join function <lambda> wrote its operand 0 in place; a join must return a new tensor
    """
    checked = without_inference(fn, f"join function {getattr(fn, '__name__', 'join')}",
                                "a join")

    def call(*operands: torch.Tensor) -> torch.Tensor:
        out = checked(*operands)
        if not isinstance(out, torch.Tensor):
            return out
        if out.requires_grad:  # a value, not a graph: chunks are combined in place
            out = out.detach()
        shape = torch.broadcast_shapes(*(x.shape for x in operands))
        if out.shape != shape:
            out = out.expand(shape)
        if (not out.is_contiguous() or any(
                isinstance(x, torch.Tensor)
                and x.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
                for x in operands)):
            return out.clone(memory_format=torch.contiguous_format)
        return out

    call.__name__ = getattr(fn, "__name__", "join")
    return call


def without_inference(fn: Callable[..., Any], title: str, kind: str) -> Callable[..., Any]:
    """``fn`` (a user's join or aggregation, ``title`` naming it, ``kind`` "a join" or "an
    aggregation") refusing, as a ValueError, to write an operand in place -- seen by the
    operands' version counters.

    An inference tensor (a chunk made under the caller's ``torch.inference_mode``) counts no
    versions, and torch, which refuses a write to one outside inference mode, does so only
    after writing it: such an operand is passed as a copy (a normal tensor, made with
    inference mode off, as the function is called), so the chunk -- kept by the store's
    cache -- is never written and the copy's counter sees the write.

    >>> with torch.inference_mode():
    ...     x = torch.ones(2)
    ...     without_inference(lambda a: a.add_(1.0), "join function f", "a join")(x)
    Traceback (most recent call last):
    ...
    ValueError: join function f wrote its operand 0 in place; a join must return a new tensor
    >>> x.tolist()
    [1.0, 1.0]
    """
    def call(*operands: Any) -> Any:
        with torch.inference_mode(False):
            xs = [x.clone() if isinstance(x, torch.Tensor) and x.is_inference() else x
                  for x in operands]
            versions = [version_counter(x) for x in xs]
            out = fn(*xs)
        written = [n for n, (x, v) in enumerate(zip(xs, versions))
                   if v is not None and version_counter(x) != v]
        if written:
            raise ValueError(f"{title} wrote its operand {', '.join(map(str, written))} in "
                             f"place; {kind} must return a new tensor")
        return out

    return call


def version_counter(x: object) -> int | None:
    """The version counter of tensor ``x``, bumped by every in-place write to it or a view of
    it (None: not a tensor, or an inference tensor, which keeps none).

    >>> t = torch.zeros(2); before = version_counter(t); _ = t[:1].add_(1.0)
    >>> version_counter(t) != before, version_counter(3.0)
    (True, None)
    """
    if not isinstance(x, torch.Tensor) or x.is_inference():
        return None
    return x._version


def fold_reduce(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], identity: float,
                associative: bool) -> Callable[[torch.Tensor, list[int]], torch.Tensor]:
    """A reduction over dims by a binary function, from ``identity``: pairwise halving (log
    steps) when it is associative and commutative, else left to right.

    >>> r = fold_reduce(torch.maximum, -math.inf, True)
    >>> r(torch.tensor([[1.0, 9.0, 3.0], [4.0, 0.0, 2.0]]), [1]).tolist()
    [9.0, 4.0]
    """
    def reduce(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
        dims = list(dims)
        keep = [d for d in range(x.ndim) if d not in dims]
        flat = x.permute(keep + dims).reshape(*[x.shape[d] for d in keep], -1)
        if flat.shape[-1] == 0:  # nothing to aggregate: the identity
            return torch.full(flat.shape[:-1], identity, dtype=x.dtype, device=x.device)
        value = torch.full(flat.shape[:-1], identity, dtype=x.dtype, device=x.device)
        if not associative:  # fn(...fn(fn(identity, x0), x1)..., xn)
            for k in range(flat.shape[-1]):
                value = fn(value, flat[..., k])
            return value
        while flat.shape[-1] > 1:  # the same, for an associative and commutative fn
            half = flat.shape[-1] // 2
            paired = fn(flat[..., :half], flat[..., half:2 * half])
            if flat.shape[-1] % 2:
                paired = torch.cat([paired, flat[..., 2 * half:]], dim=-1)
            flat = paired
        return fn(value, flat[..., 0])

    return reduce
