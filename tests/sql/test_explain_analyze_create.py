"""``EXPLAIN ANALYZE CREATE TENSOR`` creates the tensor, as DuckDB's ``EXPLAIN ANALYZE CREATE
TABLE`` creates its table; plain ``EXPLAIN`` creates nothing; an existing name is refused first."""

from __future__ import annotations

import duckdb
import numpy as np
import pytest

import tensorql as tq

A = np.arange(12.0).reshape(3, 4)
B = np.arange(8.0).reshape(4, 2) - 3.0


@pytest.fixture
def db():
    session = tq.connect()
    session.from_numpy("A", A, tile=(2, 2))
    session.from_numpy("B", B)
    return session


def test_duckdb_itself_creates_under_explain_analyze():
    con = duckdb.connect()
    con.sql("EXPLAIN ANALYZE CREATE TABLE t AS SELECT 1 AS x")
    assert con.sql("SELECT table_name FROM duckdb_tables()").fetchall() == [("t",)]


@pytest.mark.parametrize("query, expected", [
    ("SELECT * FROM EINSUM('ij,jk->ik', A, B)", A @ B),
    ("SELECT i, k, val * 2 AS val FROM EINSUM('ij,jk->ik', A, B)", 2 * (A @ B)),
    ("SELECT * FROM A", A),
    ("SELECT * FROM EINSUM('ij,j->i', A, (SELECT d0 AS j, val FROM B WHERE d1 = 1))",
     A @ B[:, 1]),
], ids=["einsum", "einsum-then-duckdb", "plain", "relation-operand"])
def test_explain_analyze_create_tensor_stores_the_result(db, query, expected):
    text = str(db.sql(f"EXPLAIN ANALYZE CREATE TENSOR C AS {query}"))
    assert "CREATE TENSOR C" in text.splitlines()[-1]
    np.testing.assert_allclose(db.tensor("C").numpy(), expected)
    assert sorted(db.tensors()) == ["A", "B", "C"]


def test_plain_explain_creates_nothing(db):
    db.sql("EXPLAIN CREATE TENSOR C AS SELECT * FROM EINSUM('ij,jk->ik', A, B)")
    assert sorted(db.tensors()) == ["A", "B"]


@pytest.mark.parametrize("head", ["EXPLAIN", "EXPLAIN ANALYZE"])
def test_an_existing_name_is_refused_before_anything_runs(db, head):
    with pytest.raises(tq.TensorQLError, match="already exists"):
        db.sql(f"{head} CREATE TENSOR B AS SELECT * FROM EINSUM('ij,jk->ik', A, B)")
    np.testing.assert_array_equal(db.tensor("B").numpy(), B)


def test_explain_analyze_create_or_replace_replaces(db):
    db.sql("EXPLAIN ANALYZE CREATE OR REPLACE TENSOR B AS SELECT * FROM EINSUM('ij->ji', A)")
    np.testing.assert_array_equal(db.tensor("B").numpy(), A.T)
