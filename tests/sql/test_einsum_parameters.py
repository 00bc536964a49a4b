"""Query parameters in statements tensorql takes apart (EINSUM operand subqueries, CREATE
TENSOR ... AS, EXPLAIN): bound as literals of the type DuckDB binds the value as, so every
part gets its value (they reached none: "Values were not provided"). Oracle: DuckDB's own
binding of the same values, and the same query with the values written in."""

from __future__ import annotations

import datetime
import decimal

import duckdb
import numpy as np
import pytest

import tensorql as tq
from tensorql.sql.errors import SQLExecutionError
from tensorql.sql.parameters import sql_literal

VALUES = [None, True, 0, -7, 2**40, 2.5, -0.1, float("inf"), "it's ? -- not a comment",
          "", b"\x00\xffab", datetime.date(2024, 2, 29), datetime.datetime(2024, 2, 29, 1, 2, 3, 4),
          datetime.time(23, 59, 59, 5), datetime.timedelta(days=3, microseconds=7),
          decimal.Decimal("12.345"), decimal.Decimal("-0.005"), decimal.Decimal("7"),
          decimal.Decimal("0.5"), decimal.Decimal("1.50"), decimal.Decimal("1E+3"),
          np.float32(1.5), np.int16(3)]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_a_literal_is_what_duckdb_binds_the_value_as(value):
    con = duckdb.connect()
    bound = value.item() if isinstance(value, np.generic) else value  # DuckDB takes no numpy
    want = con.execute("SELECT ? AS v, typeof(?) AS t", [bound, bound]).fetchall()
    got = con.sql(f"SELECT {sql_literal(value)} AS v, typeof({sql_literal(value)}) AS t")
    assert got.fetchall() == want


@pytest.fixture()
def pdb():
    with tq.connect() as db:
        db.sql("CREATE TABLE r (i BIGINT, val DOUBLE)")
        db.sql("INSERT INTO r VALUES (0, 1.0), (1, 2.0), (2, 5.0)")
        db.from_numpy("A", np.arange(6.0).reshape(2, 3))
        yield db


def test_parameters_reach_every_part_of_an_einsum_statement(pdb):
    written = pdb.sql("SELECT * FROM EINSUM('i->', (SELECT * FROM r WHERE val > 1.5))")
    written = written.fetchall()
    for query, params in (
            ("SELECT * FROM EINSUM('i->', (SELECT * FROM r WHERE val > ?))", [1.5]),
            ("SELECT * FROM EINSUM('i->', (SELECT * FROM r WHERE val > $1))", [1.5]),
            ("SELECT * FROM EINSUM('i->', (SELECT * FROM r WHERE val > $low))", {"low": 1.5})):
        assert pdb.sql(query, params).fetchall() == written == [(7.0,)]
    rows = pdb.sql("SELECT ? AS tag, i, val FROM EINSUM('ij->i', A) WHERE val > ? ORDER BY i",
                   ["x", 4]).fetchall()
    assert rows == [("x", 1, 12.0)]
    pdb.sql("CREATE TENSOR picked AS SELECT * FROM EINSUM('i->i', "
            "(SELECT * FROM r WHERE val > ?))", [1.5])
    np.testing.assert_array_equal(pdb.tensor("picked").numpy(), [0.0, 2.0, 5.0])
    plan = pdb.sql("EXPLAIN SELECT * FROM EINSUM('i->', (SELECT * FROM r WHERE val > ?))",
                   [1.5]).fetchall()[0][0]
    assert "val > CAST('1.5' AS DOUBLE)" in plan


def test_missing_surplus_or_mixed_parameters_are_errors_naming_them(pdb):
    query = "SELECT * FROM EINSUM('i->', (SELECT * FROM r WHERE val > ? AND i < ?))"
    with pytest.raises(SQLExecutionError, match=r"no value for parameter \$2: 1 given"):
        pdb.sql(query, [1.5])
    with pytest.raises(SQLExecutionError, match="does not use: #3"):
        pdb.sql(query, [1.5, 2, 3])
    with pytest.raises(SQLExecutionError, match=r"\$low"):
        pdb.sql("SELECT * FROM EINSUM('i->', (SELECT * FROM r WHERE val > $low))", {"x": 1})
    with pytest.raises(SQLExecutionError, match="has no SQL literal"):
        pdb.sql(query, [object(), 1])
    assert pdb.sql("SELECT count(*) FROM r WHERE val > ?", [1.5]).fetchall() == [(2,)]
