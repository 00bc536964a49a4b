"""EINSUM over element rows: one DuckDB join + GROUP BY, for operands that must stay sparse.

A relation operand of EINSUM is a sparse tensor with relational meaning (an absent row does
not join). When densifying it would pass the memory bound (``Options.relation_dense_bytes`` /
``memory_limit``), when its join/agg pair has no zero that an absent cell could stand for
(e.g. ``join := 'mul', agg := 'max'``), or when asked with ``sparse := true``, the call is not
densified: it runs as one SQL query over the rows themselves, so only rows that exist are
read, joined and grouped, and DuckDB's hash join and aggregation (which spill to disk under
its own memory limit) do the work:

``out[o] = AGG over joined rows of JOIN(val_0, val_1, ...)``  becomes
``SELECT o, AGG(JOIN(t0.val, t1.val)) FROM t0, t1 WHERE <shared labels equal> GROUP BY o``.

Output cells no row combination reaches are absent from the result, exactly as with the dense
path's presence mask. A floating ``min`` is spelled to give back a NaN it meets, as the dense
path's ``torch.amin`` does (DuckDB's ``min`` skips it).

>>> import pyarrow as pa
>>> edges = RelationalOperand(name="e", columns=("i", "j"), val="val", dtype="int64")
>>> spec = EinsumSpec.parse("ij,jk->ik", [(3, 3), (3, 3)], join="add", agg="min")
>>> print(relational_sql(spec, [edges, edges], "int64"))
SELECT CAST(t0."i" AS BIGINT) AS "i",
       CAST(t1."j" AS BIGINT) AS "k",
       CAST(min(t0."val" + t1."val") AS BIGINT) AS val
FROM "e" AS t0, "e" AS t1
WHERE t0."val" IS NOT NULL AND t1."val" IS NOT NULL AND t1."i" = t0."j"
GROUP BY ALL
ORDER BY 1, 2
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from tensorql.algebra import AggName, agg_record, join_record
from tensorql.einsum.spec import EinsumSpec
from tensorql.errors import UnsupportedError
from tensorql.storage.sql_text import quote_ident as q

__all__ = ["RelationalOperand", "dense_bytes", "duckdb_type", "relational_sql"]

_DUCKDB_TYPES = {
    "float64": "DOUBLE", "float32": "REAL", "float16": "REAL", "bfloat16": "REAL",
    "int64": "BIGINT", "int32": "INTEGER", "int16": "SMALLINT", "int8": "TINYINT",
    "uint8": "UTINYINT",
    "bool": "BOOLEAN",
}
_INTEGRAL = ("int64", "int32", "int16", "int8", "uint8")
_FLOATING = ("float64", "float32", "float16", "bfloat16")


def duckdb_type(dtype: str) -> str:
    """The DuckDB column type holding values of a canonical dtype.

    >>> duckdb_type("float32"), duckdb_type("int64")
    ('REAL', 'BIGINT')
    """
    return _DUCKDB_TYPES[dtype]


def dense_bytes(shape: Sequence[int], itemsize: int) -> int:
    """Bytes of a dense tensor of ``shape`` plus its one-byte presence mask.

    >>> dense_bytes((1000, 1000), 8)
    9000000
    """
    return math.prod(shape) * (itemsize + 1)


@dataclass(frozen=True)
class RelationalOperand:
    """One operand as DuckDB reads it: the table or view ``name``, its label columns in the
    order of the equation's labels, its value column and the dtype its values have; ``rows``
    are registered under ``name`` before the query runs (None for a stored tensor's element
    view, which DuckDB already has)."""

    name: str
    columns: tuple[str, ...]
    val: str
    dtype: str
    rows: pa.Table | None = field(default=None, compare=False, repr=False)

    @property
    def ref(self) -> str:
        """The quoted name, as SQL refers to it."""
        return q(self.name)


def _joined(join: str, values: list[str], dtype: str) -> str:
    """SQL for JOIN folded left to right over ``values`` (as the chunk kernels fold it), from
    the join's SQL template in the algebra registry."""
    record = join_record(join)
    if record.sql is None:
        raise UnsupportedError(f"join {join!r} has no SQL spelling (register it with sql=...) "
                               "and cannot run over sparse rows; densify the operands instead")
    if record.nary:
        return record.sql.format(*values)
    out = values[0]
    if record.sql_double == "always" or (record.sql_double == "nonint"
                                         and dtype not in _INTEGRAL):
        out = f"CAST({out} AS DOUBLE)"
    for n, value in enumerate(values[1:], start=1):
        left = out if n == 1 or not record.comparison else f"CAST({out} AS DOUBLE)"
        out = record.sql.format(left, value)  # a bool against a number: compared as one
        if n < len(values) - 1:
            out = f"({out})"
    return out


def _value(k: int, op: RelationalOperand) -> str:
    """Operand ``k``'s value as the join reads it: a BOOLEAN column as the 0/1 of the dtype
    it counts as (DuckDB has no ``BOOLEAN * BOOLEAN`` nor ``BOOLEAN + DOUBLE``; the dense
    path computes with those numbers too), TINYINT for a bool tensor.

    >>> _value(0, RelationalOperand("r", ("i",), "val", "float64",
    ...                             pa.table({"i": [0], "val": [True]})))
    'CAST(t0."val" AS DOUBLE)'
    """
    ref = f"t{k}.{q(op.val)}"
    boolean = op.dtype == "bool" or (op.rows is not None
                                     and pa.types.is_boolean(op.rows.column(op.val).type))
    if not boolean:
        return ref
    return f"CAST({ref} AS {'TINYINT' if op.dtype == 'bool' else duckdb_type(op.dtype)})"


def relational_sql(spec: EinsumSpec, operands: Sequence[RelationalOperand], dtype: str) -> str:
    """The SELECT computing ``spec`` over the operands' rows; ``dtype`` is the result's.

    Shared labels become equalities (repeated labels in one operand too) and the value is
    cast back to ``dtype``.
    """
    home: dict[str, str] = {}
    where = [f"t{k}.{q(op.val)} IS NOT NULL" for k, op in enumerate(operands)]
    for k, (labels, op) in enumerate(zip(spec.inputs, operands)):
        squeezed = spec.squeezed[k] if spec.squeezed else (False,) * len(labels)
        for label, column, broadcast in zip(labels, op.columns, squeezed):
            if broadcast:  # a size-1 dim broadcast against the label: it matches every value
                continue
            ref = f"t{k}.{q(column)}"
            if label in home:
                where.append(f"{ref} = {home[label]}")
            else:
                home[label] = ref
    sources = [f"{op.ref} AS t{k}" for k, op in enumerate(operands)]
    value = _joined(spec.join, [_value(k, op) for k, op in enumerate(operands)], dtype)
    agg = agg_record(spec.agg)
    if dtype == "bool":
        inner = f"CAST({value} AS BOOLEAN)"
    elif dtype in _FLOATING:
        inner = f"CAST({value} AS DOUBLE)" if agg.widens else value
    else:
        inner = f"CAST({value} AS BIGINT)" if agg.widens else value
    function = agg.bool_sql if dtype == "bool" else agg.sql
    if function is None:
        raise UnsupportedError(f"agg {spec.agg!r} has no SQL spelling (register it with "
                               "sql=...) and cannot run over sparse rows")
    folded = f"{function}({inner})"
    if spec.agg == AggName.MIN and dtype in _FLOATING:
        # DuckDB orders NaN above every number, so its min skips a NaN that the dense path's
        # torch.amin (like numpy's) gives back -- and its max is NaN exactly then
        folded = f"CASE WHEN isnan(max({inner})) THEN max({inner}) ELSE {folded} END"
    aggregate = f"CAST({folded} AS {duckdb_type(dtype)})"
    select = [f"CAST({home[label]} AS BIGINT) AS {q(label)}" for label in spec.output]
    lines = ["SELECT " + ",\n       ".join([*select, f"{aggregate} AS val"]),
             f"FROM {', '.join(sources)}",
             f"WHERE {' AND '.join(where)}"]
    if spec.output:  # rows in the dense tensor's C order, as the dense path yields them
        lines.append("GROUP BY ALL")
        lines.append(f"ORDER BY {', '.join(str(n + 1) for n in range(len(spec.output)))}")
    else:
        lines.append("HAVING count(*) > 0")
    return "\n".join(lines)
