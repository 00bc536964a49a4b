"""The algebra registry as the engine sees it: lookups that raise tensorql's errors.

The records themselves (:class:`Join`, :class:`Agg`) and the built-in ones live in
``tensorql_kernels.algebra`` -- the bottom layer, so the chunk kernels read the same torch
functions as every planning module without importing upward. This module re-exports them and
adds lookups raising :class:`UnknownOperatorError` (listing the valid names).

>>> join_record(JoinName.MUL).commutative, agg_record(AggName.PROD).identity
(True, 1.0)
>>> join_record("nope")
Traceback (most recent call last):
...
tensorql.algebra.UnknownOperatorError: unknown join 'nope'; choose one of mul, add, sub, div, max, \
min, pow, lt, le, gt, ge, eq, ne, where, adam, adamw
"""

from __future__ import annotations

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
    UPDATE_JOINS,
    Agg,
    AggName,
    Join,
    JoinName,
    is_update,
)

from tensorql.errors import TensorQLError

__all__ = [
    "AGGS", "BOOL", "BUILTIN_AGGS", "BUILTIN_JOINS", "COMPARISON_JOINS", "CONDITION", "FLOATING",
    "JOINS", "NUMERIC", "PROBE", "PROMOTE", "UPDATE_JOINS", "Agg", "AggName", "Join",
    "JoinName", "UnknownOperatorError", "agg_record", "check_operators", "is_update",
    "join_record", "offered_aggs", "offered_joins", "semiring_pairs",
]


class UnknownOperatorError(TensorQLError, ValueError):
    """A join or agg name that tensorql does not know."""


def join_record(name: str) -> Join:
    """The registered join ``name``; UnknownOperatorError listing the valid ones if none."""
    record = JOINS.get(name) if isinstance(name, str) else None
    if record is None:
        raise UnknownOperatorError(f"unknown join {name!r}; choose one of {', '.join(JOINS)}")
    return record


def agg_record(name: str) -> Agg:
    """The registered aggregation ``name``; UnknownOperatorError listing the valid ones."""
    record = AGGS.get(name) if isinstance(name, str) else None
    if record is None:
        raise UnknownOperatorError(f"unknown agg {name!r}; choose one of {', '.join(AGGS)}")
    return record


def offered_joins() -> tuple[str, ...]:
    """The joins offered by name (in Python and SQL): every registered one but the
    optimizer updates."""
    return tuple(name for name, record in JOINS.items() if not record.update)


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
