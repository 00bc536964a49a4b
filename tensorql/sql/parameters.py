"""Query parameters (``?``, ``$1``, ``$name``) of a statement tensorql runs itself, bound as
SQL literals.

A statement without EINSUM goes to DuckDB with its parameters, which DuckDB binds. One with
EINSUM is taken apart: its operand subqueries, ``CREATE TENSOR ... AS`` and ``EXPLAIN`` run as
separate DuckDB queries, which a prepared statement's parameters would not reach. So each
placeholder token is replaced by the literal of its value (found by DuckDB's own tokenizer
rules, so a ``?`` inside a string or a comment is left alone), typed as DuckDB would bind the
Python value: a float is a DOUBLE, a ``datetime.date`` a DATE, a string a VARCHAR with its
quotes doubled -- never text spliced in unquoted.

>>> bind_parameters("SELECT * FROM EINSUM('i->', (SELECT * FROM r WHERE val > ?)) -- ?",
...                 [1.5])
"SELECT * FROM EINSUM('i->', (SELECT * FROM r WHERE val > CAST('1.5' AS DOUBLE))) -- ?"
>>> bind_parameters("SELECT $who", {"who": "O'Brien"})
"SELECT 'O''Brien'"
>>> try:
...     bind_parameters("SELECT $who, $1", {"who": "O'Brien"})
... except SQLExecutionError as err:
...     print(str(err).splitlines()[0])
parameter $1 is positional, but the parameters are a dict (for $name) at line 1, column 14
"""

from __future__ import annotations

import datetime
import decimal
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from sqlglot.dialects.dialect import Dialect
from sqlglot.tokens import TokenType

from tensorql.sql.dialect import TensorQL
from tensorql.sql.errors import SQLExecutionError

__all__ = ["bind_parameters", "sql_literal"]


def bind_parameters(script: str, params: Sequence[Any] | Mapping[str, Any]) -> str:
    """``script`` (one statement) with every placeholder replaced by its value's literal;
    SQLExecutionError (positioned at the placeholder) for a missing or surplus value, or a
    value of a type SQL has no literal for."""
    tokens = Dialect.get_or_raise(TensorQL).tokenize(script)
    spans: list[tuple[int, int, Any]] = []
    anonymous = 0
    used: set[Any] = set()
    for k, token in enumerate(tokens):
        if token.token_type == TokenType.PLACEHOLDER and token.text == "?":
            key, start, end = anonymous, token.start, token.end
            anonymous += 1
        elif token.token_type == TokenType.PARAMETER and k + 1 < len(tokens) \
                and tokens[k + 1].start == token.end + 1:
            word = tokens[k + 1].text
            key = int(word) - 1 if word.isdigit() else word
            start, end = token.start, tokens[k + 1].end
        else:
            continue
        spans.append((start, end, _value(params, key, script, start)))
        used.add(key)
    if isinstance(params, Mapping):
        extra = sorted(set(params) - used)
    else:
        extra = [f"#{n + 1}" for n in range(len(params)) if n not in used]
    if extra:
        raise SQLExecutionError(f"{len(extra)} parameter value(s) given that the statement "
                                f"does not use: {', '.join(map(str, extra))}", text=script,
                                position=0)
    for start, end, literal in reversed(spans):
        script = script[:start] + literal + script[end + 1:]
    return script


def _value(params: Sequence[Any] | Mapping[str, Any], key: int | str, script: str,
           position: int) -> str:
    name = f"${key + 1}" if isinstance(key, int) else f"${key}"
    if isinstance(params, Mapping):
        if isinstance(key, int):
            raise SQLExecutionError(f"parameter {name} is positional, but the parameters are "
                                    "a dict (for $name)", text=script, position=position)
        if key not in params:
            raise SQLExecutionError(f"no value for parameter {name}; given: "
                                    f"{', '.join(map(str, params)) or 'none'}", text=script,
                                    position=position)
        value = params[key]
    else:
        if not isinstance(key, int):
            raise SQLExecutionError(f"parameter {name} is named, but the parameters are a "
                                    "list (for ? and $1)", text=script, position=position)
        if not 0 <= key < len(params):
            raise SQLExecutionError(f"no value for parameter {name}: {len(params)} given",
                                    text=script, position=position)
        value = params[key]
    try:
        return sql_literal(value)
    except TypeError as err:
        raise SQLExecutionError(f"parameter {name}: {err}", text=script,
                                position=position) from None


def sql_literal(value: Any) -> str:
    """DuckDB's literal for a Python value, of the type DuckDB binds that value as;
    TypeError for a value of another type.

    >>> [sql_literal(v) for v in (None, True, 7, -7, 2.5, "it's", datetime.date(2024, 2, 29))]
    ['NULL', 'TRUE', '7', '(-7)', "CAST('2.5' AS DOUBLE)", "'it''s'", "CAST('2024-02-29' AS DATE)"]
    """
    if isinstance(value, np.generic):
        value = value.item()
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, numbers.Integral):
        # parenthesized when negative: after a '-' ('val-?') a bare -5 would make '--', the
        # start of a line comment
        return str(int(value)) if value >= 0 else f"({int(value)})"
    if isinstance(value, float):
        text = repr(value) if math.isfinite(value) else str(value)  # 'nan', 'inf', '-inf'
        return f"CAST('{text}' AS DOUBLE)"
    if isinstance(value, decimal.Decimal):
        if not value.is_finite():
            raise TypeError(f"the decimal {value} has no SQL value")
        sign, digits, exponent = value.as_tuple()
        scale = max(0, -int(exponent))
        # as DuckDB types a bound Decimal: its digits, or one more than the scale when the
        # digits are fewer (0.05 is DECIMAL(3,2), 0.5 DECIMAL(1,1))
        written = len(digits) + max(0, int(exponent))
        precision = min(38, written if len(digits) >= scale else scale + 1)
        return f"CAST('{value}' AS DECIMAL({precision}, {scale}))"
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "CAST('" + "".join(f"\\x{b:02X}" for b in bytes(value)) + "' AS BLOB)"
    if isinstance(value, datetime.datetime):
        kind = "TIMESTAMPTZ" if value.tzinfo is not None else "TIMESTAMP"
        return f"CAST('{value.isoformat(sep=' ')}' AS {kind})"
    if isinstance(value, datetime.date):
        return f"CAST('{value.isoformat()}' AS DATE)"
    if isinstance(value, datetime.time):
        return f"CAST('{value.isoformat()}' AS TIME)"
    if isinstance(value, datetime.timedelta):
        micros = (value.days * 86_400 + value.seconds) * 1_000_000 + value.microseconds
        return f"to_microseconds({micros})"
    raise TypeError(f"a {type(value).__name__} has no SQL literal that a statement with "
                    "EINSUM could bind (numbers, strings, bytes, dates, times, None)")
