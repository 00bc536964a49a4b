"""The algebra registry as the engine sees it: lookups, and the user's own operators.

The records themselves (:class:`Join`, :class:`Agg`) and the built-in ones live in
``tensorql_kernels.algebra`` -- the bottom layer, so the chunk kernels read the same torch
functions as every planning module without importing upward. This module re-exports them and
adds lookups raising :class:`UnknownOperatorError` (listing the valid names) and validated
registration of user-defined joins (:func:`register_join`, or any elementwise callable passed
as ``join=``) and aggregations (:func:`register_agg`).

A user's join is an elementwise, torch-traceable function of its operands: it is probed on
small tensors (the output must have the operands' broadcast shape, and each output element
must depend only on the operands' elements at its position) before it is registered, so a
bad function is a :class:`JoinFunctionError` at ``tq.einsum`` time, not a failure half way
through a query. A callable passed without a name gets a stable one, ``join<lambda#1>``, keyed
by the function object (a lambda is not hashable by value): the same object is the same join.

>>> join_record(JoinName.MUL).commutative, agg_record(AggName.PROD).identity
(True, 1.0)
>>> join_record("nope")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
tensorql.algebra.UnknownOperatorError: unknown join 'nope'; choose one of mul, add, sub, div, max, \
min, pow, lt, le, gt, ge, eq, ne, where...
>>> import torch
>>> register_join("logaddexp", torch.logaddexp, identity=float("-inf"),
...               sql="ln(exp({0}) + exp({1}))")
'logaddexp'
>>> resolve_join(lambda a, b: a * torch.exp(b)).startswith("join<lambda#")
True

"""

from __future__ import annotations

import inspect
import itertools
import numbers
from collections.abc import Callable
from typing import Any

import torch
from tensorql_kernels.algebra import (
    AGGS,
    BOOL,
    BUILTIN_AGGS,
    BUILTIN_JOINS,
    COMPARISON_JOINS,
    CONDITION,
    FLOATING,
    JOINS,
    NUMERIC,
    PROBE,
    PROMOTE,
    UPDATE,
    UPDATE_JOINS,
    Agg,
    AggName,
    Join,
    JoinName,
    UpdateRule,
    add_agg,
    add_join,
    fold_reduce,
    is_update,
    owned_result,
    update_join,
    without_inference,
)

from tensorql.errors import TensorQLError

__all__ = [
    "AGGS", "BOOL", "BUILTIN_AGGS", "BUILTIN_JOINS", "COMPARISON_JOINS", "CONDITION", "FLOATING",
    "JOINS", "NUMERIC", "PROBE", "PROMOTE", "UPDATE", "UPDATE_JOINS", "Agg", "AggName", "Join",
    "JoinName", "UnknownOperatorError", "agg_record", "check_operators", "is_update",
    "join_record", "offered_aggs", "offered_joins", "semiring_pairs", "JoinFunctionError",
    "AggFunctionError", "register_join", "register_agg", "resolve_join", "resolve_agg",
    "join_dtype", "derivative_join", "add_user_join", "UpdateRule", "update_join",
]


class UnknownOperatorError(TensorQLError, ValueError):
    """A join or agg name that tensorql does not know."""


class JoinFunctionError(TensorQLError, ValueError):
    """A user's join function that is not an elementwise torch function of its operands
    (wrong arity, output not of the broadcast shape, not elementwise, raising on tensors)."""


class AggFunctionError(TensorQLError, ValueError):
    """A user's aggregation that is not a binary, elementwise torch function (or a reduction)
    with the properties it declares."""


def join_record(name: str) -> Join:
    """The registered join ``name``; UnknownOperatorError listing the valid ones if none."""
    record = JOINS.get(name) if isinstance(name, str) else None
    if record is None:
        raise UnknownOperatorError(f"unknown join {name!r}; choose one of "
                                   f"{', '.join(offered_joins())}")
    return record


def agg_record(name: str) -> Agg:
    """The registered aggregation ``name``; UnknownOperatorError listing the valid ones."""
    record = AGGS.get(name) if isinstance(name, str) else None
    if record is None:
        raise UnknownOperatorError(f"unknown agg {name!r}; choose one of {', '.join(AGGS)}")
    return record


def offered_joins() -> tuple[str, ...]:
    """The joins offered by name (in Python and SQL): every registered one but the
    optimizer updates and the joins of anonymous functions (and their derivatives)."""
    return tuple(name for name, record in JOINS.items() if record.listed)


def offered_aggs() -> tuple[str, ...]:
    """Every registered aggregation."""
    return tuple(AGGS)


def semiring_pairs() -> tuple[tuple[str, str], ...]:
    """Every (join, agg) pair with a semiring zero (an absent sparse row may stand for it).

    >>> semiring_pairs()[:2]
    (('mul', 'sum'), ('add', 'min'))
    """
    return tuple((name, agg) for name, record in JOINS.items() for agg, _ in record.zeros)


def check_operators(join: str, agg: str) -> None:
    """UnknownOperatorError unless ``join`` and ``agg`` are registered names."""
    join_record(join)
    agg_record(agg)


# -- the user's own joins ------------------------------------------------------------------
# (id(fn), arity where its signature does not say it) -> (fn kept alive, name)
_ANONYMOUS: dict[tuple[int, int | None], tuple[Callable[..., Any], str]] = {}
_COUNTER = itertools.count(1)
_PROBE_SHAPE = (3, 4)


def resolve_join(join: Any, arity: int | None = None) -> str:
    """The registered name of ``join``: a name (any case) as is, a callable registered under
    a stable anonymous name (the same object: the same name); UnknownOperatorError for an
    unknown name. ``arity`` -- the operands of the einsum it joins -- is that of a callable
    whose signature does not say (a torch builtin: torch.exp takes one, torch.logaddexp
    two), which then has a name for each arity.

    >>> resolve_join("MUL")
    'mul'
    >>> resolve_join(torch.sigmoid, arity=1).startswith("join<sigmoid#")
    True
    """
    if isinstance(join, str):
        name = join if join in JOINS else join.lower()
        join_record(name)
        return name
    if callable(join):
        if _signature_arity(join) is not None:
            arity = None  # its own (an einsum of another operand count is refused by it)
        key = (id(join), arity)
        known = _ANONYMOUS.get(key)
        if known is not None and known[0] is join:
            return known[1]
        label = str(getattr(join, "__name__", type(join).__name__)).strip("<>").lower()
        name = f"join<{label}#{next(_COUNTER)}>"
        register_join(name, join, arity=arity, _listed=False)
        _ANONYMOUS[key] = (join, name)
        return name
    raise UnknownOperatorError(f"join must be a name or an elementwise function, got "
                               f"{type(join).__name__}; choose one of "
                               f"{', '.join(offered_joins())}")


def register_join(name: str, fn: Callable[..., torch.Tensor], *, identity: float | None = None,
                  sql: str | None = None, adjoint: Callable[..., torch.Tensor] | None = None,
                  commutative: bool = False, associative: bool = False,
                  arity: int | None = None, _listed: bool = True) -> str:
    """Register ``fn``, an elementwise torch function of the operands, as join ``name``.

    Its arity is its number of positional parameters without defaults (an einsum using it has
    that many operands), or ``arity`` where its signature does not say (a torch builtin).
    ``identity`` is the join's identity element, if any (logaddexp's is -inf); ``sql``
    spells it for DuckDB's relational path as a template over ``{0}``, ``{1}``, ...
    (without it, sparse relation operands are densified or refused); ``adjoint(k,
    *operands)`` gives d out / d operand k elementwise (without it, torch's autograd derives it for
    ``tq.grad``). Returns the name; JoinFunctionError when ``fn`` is not such a function --
    it is probed on small float64 tensors with values in [0.5, 1.5) that broadcast against
    each other (so it must accept floating operands).

    >>> register_join("hypot2", lambda a, b: torch.sqrt(a * a + b * b))
    'hypot2'
    >>> register_join("bad", lambda a, b: a.sum() + b)
    Traceback (most recent call last):
    ...
    tensorql.algebra.JoinFunctionError: join 'bad': an output element depends on operand \
elements at other positions: the function is not elementwise
    """
    if not isinstance(name, str) or not name or name.lower() != name or "{" in name:
        raise JoinFunctionError(f"a join's name must be a non-empty lower-case string, got "
                                f"{name!r}")
    if name in BUILTIN_JOINS:
        raise JoinFunctionError(f"join {name!r} is built in; choose another name")
    if _listed and name.startswith("join<"):  # join<lambda#3>, join<(a, b) -> a + b>: ours
        raise JoinFunctionError(f"join {name!r}: names join<...> are those tensorql gives "
                                "lambda joins; choose another name")
    if name.partition("(")[0] in UPDATE_JOINS:  # adam(beta1=...): see update_join
        raise JoinFunctionError(f"join {name!r}: names {', '.join(UPDATE_JOINS)}(...) are "
                                "the optimizers' update joins; choose another name")
    if not callable(fn):
        raise JoinFunctionError(f"join {name!r}: {type(fn).__name__} is not callable")
    if identity is not None:
        identity = _number(identity, f"join {name!r}: identity", JoinFunctionError)
    old = JOINS.get(name)
    if old is not None:
        if old.source is fn:
            return name
        raise JoinFunctionError(f"join {name!r} is already registered to another function")
    if arity is not None and (not isinstance(arity, int) or arity < 1):
        raise JoinFunctionError(f"join {name!r}: arity must be a positive int, got {arity!r}")
    arity = arity or _arity(name, fn, JoinFunctionError, "join")
    add_user_join(name, fn, arity=arity, sql=sql,
                  identity=identity, adjoint=adjoint, commutative=commutative,
                  associative=associative, listed=_listed, check_sql=True)
    return name


def add_user_join(name: str, fn: Callable[..., torch.Tensor], *, arity: int,
                  sql: str | None = None, identity: float | None = None,
                  adjoint: Callable[..., torch.Tensor] | None = None, commutative: bool = False,
                  associative: bool = False, listed: bool = False,
                  check_sql: bool = False) -> Join:
    """Probe ``fn`` (JoinFunctionError unless it is an elementwise torch function of
    ``arity`` operands) and register it as join ``name`` (the name is the caller's); with
    ``check_sql`` (a user's own template) DuckDB runs ``sql`` on the probe operands too, and
    it must give what ``fn`` gives (a SQL lambda's template is translated with its function
    from one expression: not run)."""
    if sql is not None:
        _check_template(name, sql, arity)
    _probe_join(name, fn, arity)
    if sql is not None and check_sql:
        _probe_template(name, sql, fn, arity)
    if adjoint is not None:
        _probe_adjoint(name, adjoint, arity)
    return add_join(Join(name, owned_result(fn), source=fn, arity=arity, nary=arity != 2,
                         associative=associative, commutative=commutative, sql=sql,
                         dtype_rule=PROBE, adjoint=adjoint, user=True, identity=identity,
                         label=getattr(fn, "__name__", name), listed=listed))


def _number(value: Any, what: str, error: type[TensorQLError]) -> float:
    """``value`` as a float when it is a real number (a numpy scalar too, not a bool), else
    ``error`` naming ``what``.

    >>> import numpy as np
    >>> _number(np.float32(0.5), "identity", TensorQLError)
    0.5
    >>> _number("0", "agg 'x': identity", TensorQLError)
    Traceback (most recent call last):
    ...
    tensorql.errors.TensorQLError: agg 'x': identity must be a number, got '0'
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{what} must be a number, got {value!r}")
    return float(value)


def _arity(name: str, fn: Callable[..., Any], error: type[TensorQLError], what: str) -> int:
    """``fn``'s operand count by its signature; 2 where the signature does not say."""
    arity = _signature_arity(fn)
    if arity == 0:
        raise error(f"{what} {name!r}: the function takes no operands")
    return 2 if arity is None else arity


def _signature_arity(fn: Callable[..., Any]) -> int | None:
    """The positional parameters without defaults of ``fn``; None where its signature does
    not say (a builtin without one, torch.logaddexp; only ``*args``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    if any(p.kind == p.VAR_POSITIONAL for p in params) and not positional:
        return None
    return len(positional)


def _check_template(name: str, sql: str, arity: int) -> None:
    if not isinstance(sql, str):
        raise JoinFunctionError(f"join {name!r}: sql template must be a string like "
                                f"'{{0}} + {{1}}', got {type(sql).__name__} {sql!r}")
    try:
        sql.format(*[f"x{k}" for k in range(arity)])
    except (IndexError, KeyError, ValueError, AttributeError, TypeError) as err:
        raise JoinFunctionError(f"join {name!r}: sql template {sql!r} must use only {{0}}.."
                                f"{{{arity - 1}}} ({err})") from None


def _probe_template(name: str, sql: str, fn: Callable[..., Any], arity: int) -> None:
    """JoinFunctionError unless the SQL template, run by DuckDB over the probe operands, is
    valid SQL giving what ``fn`` gives (the relational path and the dense one would otherwise
    answer the same query differently, or fail later at a position inside the user's query)."""
    import duckdb
    import pyarrow as pa

    operands = _probe_operands(arity)
    xs = [x.expand(_PROBE_SHAPE).reshape(-1) for x in operands]
    want = fn(*operands).expand(_PROBE_SHAPE).reshape(-1).double()
    columns = {f"x{k}": x.numpy() for k, x in enumerate(xs)}
    rows = pa.table({"i": list(range(len(xs[0]))), **columns})
    expression = sql.format(*columns)
    con = duckdb.connect()
    try:
        con.register("probe", rows)
        got = con.execute(f"SELECT CAST(({expression}) AS DOUBLE) AS v FROM probe "
                          "ORDER BY i").fetchnumpy()["v"]
    except (duckdb.Error, TypeError, ValueError) as err:
        raise JoinFunctionError(f"join {name!r}: sql template {sql!r} is not valid DuckDB SQL "
                                f"over numbers ({type(err).__name__}: {err})") from None
    finally:
        con.close()
    got = torch.from_numpy(got.astype("float64"))
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-8, equal_nan=True):
        at = int((got - want).abs().nan_to_num(float("inf")).argmax())
        operands = ", ".join(f"{x[at].item():.4g}" for x in xs)
        raise JoinFunctionError(f"join {name!r}: sql template {sql!r} gives {got[at].item():.6g}"
                                f" where the function gives {want[at].item():.6g} (operands "
                                f"{operands}): the two spellings disagree")


def _probe_operands(arity: int) -> list[torch.Tensor]:
    """Operands broadcasting to ``_PROBE_SHAPE``: the first a column, the second a row, the
    rest full; positive values away from 0 and 1 (so log, sqrt, division are defined)."""
    gen = torch.Generator().manual_seed(7)
    rows, cols = _PROBE_SHAPE
    shapes = [(rows, 1), (1, cols)] + [_PROBE_SHAPE] * (arity - 2)
    return [torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5
            for shape in shapes[:arity]] if arity > 1 else \
        [torch.rand(_PROBE_SHAPE, generator=gen, dtype=torch.float64) + 0.5]


def _probe_join(name: str, fn: Callable[..., Any], arity: int, *,
                title: str | None = None) -> None:
    """JoinFunctionError unless ``fn`` maps tensors to a tensor of their broadcast shape whose
    elements each depend on the operands' elements at their position only (``title`` names
    it in the messages: ``join 'name'`` unless given)."""
    title = title or f"join {name!r}"
    xs = _probe_operands(arity)
    out = _call(name, fn, xs, "join", JoinFunctionError, title)
    try:
        out = out.expand(_PROBE_SHAPE)  # a function may ignore an operand
    except RuntimeError:
        raise JoinFunctionError(f"{title}: output has shape {tuple(out.shape)}, not the "
                                f"operands' broadcast shape {_PROBE_SHAPE}: the function is "
                                "not elementwise") from None
    # a corner of the operands must give the same corner of the output
    corner = [x[tuple(slice(1, None) if n > 1 else slice(None) for n in x.shape)] for x in xs]
    part = _call(name, fn, corner, "join", JoinFunctionError, title)
    try:
        part = part.expand(out[1:, 1:].shape)
    except RuntimeError:
        part = None
    if part is None or not torch.allclose(
            part.double(), out[1:, 1:].double(), equal_nan=True):
        raise JoinFunctionError(f"{title}: an output element depends on operand "
                                "elements at other positions: the function is not elementwise")


def _probe_adjoint(name: str, adjoint: Callable[..., Any], arity: int) -> None:
    """JoinFunctionError unless ``adjoint(k, *operands)`` is, for every operand ``k``, an
    elementwise function giving a floating tensor (a gradient): the engine broadcasts what it
    returns, so a sum or an integer cast would be a wrong gradient, not an error. An adjoint
    that raises is left to ``tq.grad``, which names its error as a GradientError.

    >>> _probe_adjoint("sq", lambda k, a, b: (a * b).sum(), 2)
    Traceback (most recent call last):
    ...
    tensorql.algebra.JoinFunctionError: join 'sq' adjoint(0, ...): an output element depends \
on operand elements at other positions: the function is not elementwise
    """
    if not callable(adjoint):
        raise JoinFunctionError(f"join {name!r}: adjoint {type(adjoint).__name__} is not "
                                "callable (adjoint(k, *operands) gives d out / d operand k)")
    for k in range(arity):
        def partial(*xs: torch.Tensor, k: int = k) -> Any:
            return adjoint(k, *xs)

        title = f"join {name!r} adjoint({k}, ...)"
        try:
            partial(*_probe_operands(arity))
        except Exception:  # noqa: BLE001 - the user's: tq.grad names it (a GradientError)
            continue
        _probe_join(name, partial, arity, title=title)
        out = _call(name, partial, _probe_operands(arity), "join", JoinFunctionError, title)
        if not out.is_floating_point():
            raise JoinFunctionError(f"{title} gives {out.dtype}, not a floating tensor: a "
                                    "gradient has the operands' dtype")


def _call(name: str, fn: Callable[..., Any], xs: list[torch.Tensor], what: str,
          error: type[TensorQLError], title: str | None = None) -> torch.Tensor:
    title = title or f"{what} {name!r}"
    before = [x.clone() for x in xs]
    try:
        out = fn(*xs)
    except Exception as err:  # the user's function: any failure is theirs to see
        raise error(f"{title} raised {type(err).__name__} on torch tensors of "
                    f"shapes {[tuple(x.shape) for x in xs]}: {err} (it must be a torch "
                    "function of tensors)") from err
    if any(not torch.equal(x, old) for x, old in zip(xs, before)):
        raise error(f"{title} changed its operands in place; it must compute a new "
                    "tensor (the operands are stored data)")
    if not isinstance(out, torch.Tensor):
        raise error(f"{title} returned {type(out).__name__}, not a torch tensor (it "
                    "must be a torch function of tensors)")
    return out


def join_dtype(join: Join, dtypes: list[torch.dtype]) -> torch.dtype:
    """The dtype a user's join gives on operands of ``dtypes`` (torch's own rule, found on
    one element of each); JoinFunctionError when the function fails on them."""
    xs = [torch.ones((), dtype=d) for d in dtypes]
    try:
        return join.apply(xs).dtype
    except Exception as err:  # the user's function
        raise JoinFunctionError(f"join {join.name!r} fails on operands of dtypes "
                                f"{[str(d).removeprefix('torch.') for d in dtypes]}: "
                                f"{type(err).__name__}: {err}") from err


def derivative_join(name: str, k: int) -> str:
    """The join computing d JOIN / d operand ``k`` elementwise (registered once): the user's
    ``adjoint`` when given, else torch's autograd: the vector-Jacobian product with ones,
    operand ``k`` broadcast to the output's shape (for an elementwise function, exactly the
    partial derivative at each position).

    >>> d = derivative_join(register_join("sq_times", lambda a, b: a * a * b), 0)
    >>> join_record(d).apply([torch.tensor([3.0]), torch.tensor([2.0])]).tolist()
    [12.0]
    """
    record = join_record(name)
    derived = f"d[{name}]/d{k}"
    if derived in JOINS:
        return derived
    fn, user_adjoint = record.source or record.fn, record.adjoint  # one call: all operands

    def partial(*xs: torch.Tensor) -> torch.Tensor:
        if user_adjoint is not None:
            return user_adjoint(k, *xs)
        # operand k broadcast to the output's shape: each output element then depends on its
        # own element of it only (elementwise), so the vector-Jacobian product with ones is
        # the partial derivative at every position (reverse mode: safe on worker threads,
        # where forward-mode levels are not)
        shape = torch.broadcast_shapes(*(x.shape for x in xs))
        with torch.enable_grad():
            x = xs[k].detach().expand(shape).contiguous().requires_grad_(True)
            out = fn(*[y.detach() for y in xs[:k]], x, *[y.detach() for y in xs[k + 1:]])
            if not out.requires_grad:  # a constant in operand k (a comparison, ...)
                return torch.zeros(shape, dtype=out.dtype, device=out.device)
            (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
        return grad

    arity = record.arity if record.arity is not None else 2
    add_join(Join(derived, owned_result(partial), arity=arity, nary=True, dtype_rule=PROBE,
                  user=True, label=derived, listed=False))
    return derived


# -- the user's own aggregations -----------------------------------------------------------
def resolve_agg(agg: Any) -> str:
    """The registered name of ``agg`` (any case); UnknownOperatorError when unknown."""
    if isinstance(agg, str):
        name = agg if agg in AGGS else agg.lower()
        agg_record(name)
        return name
    raise UnknownOperatorError(f"agg must be the name of an aggregation (register your own "
                               f"with tq.register_agg), got {type(agg).__name__}; choose "
                               f"one of {', '.join(AGGS)}")


def register_agg(name: str, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 *, identity: float, reduce: Callable[[torch.Tensor, int], torch.Tensor] | None
                 = None, associative: bool = True, sql: str | None = None) -> str:
    """Register aggregation ``name``: ``fn(a, b)`` an elementwise binary torch function
    (commutative; associative unless declared otherwise) folded over the aggregated labels,
    and/or ``reduce(x, dim)`` a torch reduction of one dim; ``identity`` what an empty group
    yields (``fn(identity, x) == x``). ``sql`` names DuckDB's aggregate function for the
    relational path. Only an ``associative`` aggregation may be computed as partials over
    pieces of its labels: the optimizer keeps the labels of any other whole.

    >>> register_agg("absmax", lambda a, b: torch.maximum(a.abs(), b.abs()), identity=0.0)
    'absmax'
    """
    if not isinstance(name, str) or not name or name.lower() != name:
        raise AggFunctionError(f"an aggregation's name must be a non-empty lower-case string, "
                               f"got {name!r}")
    if name in BUILTIN_AGGS:
        raise AggFunctionError(f"agg {name!r} is built in; choose another name")
    if fn is None and reduce is None:
        raise AggFunctionError(f"agg {name!r}: give fn(a, b) or reduce(x, dim)")
    identity = _number(identity, f"agg {name!r}: identity", AggFunctionError)
    old = AGGS.get(name)
    if old is not None:
        if old.fn is fn and fn is not None:
            return name
        raise AggFunctionError(f"agg {name!r} is already registered to another function")
    if fn is not None:
        if _arity(name, fn, AggFunctionError, "agg") != 2:
            raise AggFunctionError(f"agg {name!r}: fn must take two operands (a, b)")
        _probe_agg(name, fn, associative)
    if reduce is not None:
        _probe_reduce(name, reduce, fn)
    fold = fn if fn is not None else (lambda a, b: reduce(torch.stack([a, b]), 0))
    # the reduction runs on input chunks (stored data): a write to its operand is refused.
    # Not so the combination of partials: the accumulator may be a view of a buffer other
    # tasks write (its version counter moves under it)
    title = f"agg function {name!r}"
    reducer = _by_dims(without_inference(reduce, title, "an aggregation")) \
        if reduce is not None else \
        fold_reduce(without_inference(fold, title, "an aggregation"), float(identity),
                    associative)

    def combine(acc: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        return acc.copy_(fold(acc, partial))

    add_agg(Agg(name, reducer, combine, float(identity), associative=associative, sql=sql,
                user=True, fn=fold))
    return name


def _by_dims(reduce: Callable[[torch.Tensor, int], torch.Tensor]
             ) -> Callable[[torch.Tensor, list[int]], torch.Tensor]:
    def by_dims(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
        keep = [d for d in range(x.ndim) if d not in dims]
        flat = x.permute(keep + list(dims)).reshape(*[x.shape[d] for d in keep], -1)
        return reduce(flat, -1)

    return by_dims


def _probe_agg(name: str, fn: Callable[..., Any], associative: bool) -> None:
    """AggFunctionError unless ``fn`` is elementwise and commutative on probe tensors (and
    associative, when declared so)."""
    gen = torch.Generator().manual_seed(11)
    a, b, c = (torch.rand(_PROBE_SHAPE, generator=gen, dtype=torch.float64) * 4 - 2
               for _ in range(3))
    out = _call(name, fn, [a, b], "agg", AggFunctionError)
    if tuple(out.shape) != _PROBE_SHAPE:
        raise AggFunctionError(f"agg {name!r}: fn(a, b) has shape {tuple(out.shape)}, not "
                               f"the operands' {_PROBE_SHAPE}: it must be elementwise")
    swapped = _call(name, fn, [b, a], "agg", AggFunctionError)
    if not torch.allclose(out, swapped, equal_nan=True):
        raise AggFunctionError(f"agg {name!r}: fn(a, b) != fn(b, a): an aggregation must be "
                               "commutative (the engine combines partials in any order)")
    if associative:
        left = fn(fn(a, b), c)
        right = fn(a, fn(b, c))
        if not torch.allclose(left, right, equal_nan=True):
            raise AggFunctionError(f"agg {name!r}: fn(fn(a, b), c) != fn(a, fn(b, c)) -- it "
                                   "is not associative; register it with associative=False")


def _probe_reduce(name: str, reduce: Callable[..., Any], fn: Callable[..., Any] | None) -> None:
    gen = torch.Generator().manual_seed(13)
    x = torch.rand((3, 5), generator=gen, dtype=torch.float64)
    try:
        out = reduce(x, -1)
    except Exception as err:  # the user's function
        raise AggFunctionError(f"agg {name!r}: reduce(x, dim) raised {type(err).__name__}: "
                               f"{err}") from err
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (3,):
        raise AggFunctionError(f"agg {name!r}: reduce(x, dim) must return a tensor without "
                               "that dim")
