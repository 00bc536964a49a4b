"""Issue 32's numbered bugs and the pass-through on the SQL face, each with DuckDB (or numpy)
as the oracle where there is one."""

from __future__ import annotations

import numpy as np
import pytest

import tensorql as tq
from tensorql.sql.errors import SQLShapeError


@pytest.fixture
def db():
    with tq.connect() as session:
        session.from_numpy("m", np.ones((3, 3)))
        session.connection.execute("CREATE TABLE e (i BIGINT, j BIGINT, w DOUBLE)")
        session.connection.execute("INSERT INTO e VALUES (0, 1, 2.0)")
        yield session


@pytest.mark.parametrize("query", [
    "SELECT * FROM EINSUM('ij,jk->ik', e, e, sizes := {'i': 3, 'j': 3, 'k': 3})",
    "SELECT * FROM EINSUM('ij,jk->ik', e, m, sizes := {'i': 3})",
    "SELECT * FROM EINSUM('ij,jk->ik', m, e)",
    "SELECT * FROM EINSUM('ij,jk->ik', e, m)",
])
def test_relation_without_val_names_the_operand(db, query):
    with pytest.raises(SQLShapeError, match="needs a 'val' column; got columns") as caught:
        db.sql(query)
    assert caught.value.position == query.index(" e") + 1  # the caret is at the operand


@pytest.mark.parametrize("query", [
    "SELECT * FROM EINSUM('" + "ij" * 500_000 + "', m)",
    "SELECT * FROM EINSUM('ij->i', nope" + "x" * 1_000_000 + ")",
    "SELECT 1 +" + " " * 1_000_000 + "FROM",
    "SELECT '" + "y" * 1_000_000 + "' FROM nowhere",
])
def test_sql_error_messages_bound_a_huge_statement(db, query):
    with pytest.raises(tq.TensorQLError) as caught:
        db.sql(query)
    lines = str(caught.value).splitlines()
    assert len(str(caught.value)) < 2_000, str(caught.value)[:300]
    caret = [n for n, line in enumerate(lines) if line.strip() == "^"]
    if caret:  # the caret still points into the excerpt of the line above it
        assert len(lines[caret[0] - 1]) > lines[caret[0]].index("^")


def _nested_subqueries(n: int) -> str:
    query = "SELECT 1 AS x"
    for _ in range(n):
        query = f"SELECT * FROM ({query})"
    return query


@pytest.mark.parametrize("query, params", [
    ("SELECT ?::INT + 1", [41]),
    ("SELECT $1::INT + $2", [40, 2]),
    ("SELECT $a + 1 AS a", {"a": 41}),
    ("EXPLAIN (FORMAT JSON) SELECT 1", None),
    (_nested_subqueries(97), None),
    ("SELECT 'EINSUM(' AS s -- EINSUM('ij->i', A)\n", None),  # EINSUM in a string, a comment
    ("FROM range(3) SELECT sum(range) AS s", None),  # DuckDB's FROM-first form
    ("SELECT 1 AS einsum", None),
])
def test_statements_without_einsum_reach_duckdb_as_written(db, query, params):
    import duckdb

    with duckdb.connect() as plain:  # the oracle: DuckDB itself
        want = plain.execute(query, params).fetchall() if params is not None else \
            plain.execute(query).fetchall()
    got = db.sql(query, params) if params is not None else db.sql(query)
    if query.startswith("EXPLAIN"):
        import json

        assert json.loads(got.text) == json.loads(want[0][1])
    else:
        assert got.fetchall() == want


def test_a_syntax_error_of_plain_sql_is_duckdbs_as_a_parse_error(db):
    with pytest.raises(tq.ParseError) as caught:
        db.sql("SELECT 1;\nSELECT * FROM (SELECT 2")
    assert caught.value.line == 2 and "syntax error" in str(caught.value)


def _nested_einsums(n: int) -> str:
    operand = "m"
    for _ in range(n):
        operand = f"(SELECT * FROM EINSUM('ij->ij', {operand}))"
    return operand[1:-1]


def test_nested_einsums_have_a_depth_limit_not_a_recursion_error(db):
    np.testing.assert_array_equal(db.sql(_nested_einsums(8)).numpy(), np.ones((3, 3)))
    for depth in (29, 300):
        with pytest.raises(tq.ParseError, match="EINSUM calls nest 29 deep|nest 300 deep") \
                as caught:
            db.sql(_nested_einsums(depth))
        assert "WITH" in str(caught.value)  # the advice: name the inner calls in CTEs
    deep = "SELECT * FROM EINSUM('ij->ij', (" + _nested_subqueries(97) + "))"
    with pytest.raises(tq.ParseError, match="nest"):  # deep, but not in EINSUMs
        db.sql(deep)


@pytest.fixture
def small():
    """A session whose dense results may take about 36 MiB, and a (4096 x 16) tensor whose
    Gram matrix (64 MiB) passes that."""
    rng = np.random.default_rng(32)
    a = rng.standard_normal((4096, 16)).astype(np.float32)
    with tq.connect(process_memory_limit="80MiB", chunk_cache_bytes=8 << 20,
                    memory_limit="16MiB", devices="cpu") as session:
        session.from_numpy("A", a, tile=(512, 16))
        yield session, a


def test_a_query_over_an_einsum_past_the_memory_limit_streams_its_rows(small):
    db, a = small
    gram = a.astype(np.float64) @ a.T.astype(np.float64)
    got = db.sql("SELECT count(*) AS n, sum(val) AS s FROM EINSUM('ik,jk->ij', A, A) "
                 "WHERE val > 0").fetchall()
    assert got[0][0] == int(((a @ a.T) > 0).sum())  # float32 products, as computed
    np.testing.assert_allclose(got[0][1], gram[gram > 0].sum(), rtol=1e-4)
    rows = db.sql("SELECT i, j, val FROM EINSUM('ik,jk->ij', A, A) WHERE i = 4000 AND j < 3 "
                  "ORDER BY j").fetchall()
    assert [(i, j) for i, j, _ in rows] == [(4000, 0), (4000, 1), (4000, 2)]
    np.testing.assert_allclose([v for *_, v in rows], gram[4000, :3], rtol=1e-4)
    assert len(db.sql("SELECT * FROM EINSUM('ik,jk->ij', A, A) LIMIT 3").fetchall()) == 3


def test_a_dense_einsum_result_past_the_memory_limit_gets_sql_advice(small):
    db, _ = small
    with pytest.raises(tq.MemoryLimitError) as caught:
        db.sql("SELECT * FROM EINSUM('ik,jk->ij', A, A)")
    message = str(caught.value)
    assert "CREATE TENSOR" in message and "db.iter_chunks" not in message
    db.sql("CREATE TENSOR G AS SELECT * FROM EINSUM('ik,jk->ij', A, A)")  # the advice works
    assert db.sql("SELECT count(*) FROM G WHERE d0 = d1").fetchall() == [(4096,)]
    assert "EINSUM" in db.sql("EXPLAIN SELECT * FROM EINSUM('ik,jk->ij', A, A)").text
