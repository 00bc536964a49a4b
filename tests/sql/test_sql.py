"""SQL with EINSUM: statement forms, relational operands, CTE nesting, semirings, EXPLAIN,
the DuckDB backend and error positions; results checked against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq
from tensorql.sql.dialect import Einsum, parse_script
from tensorql.sql.errors import SQLExecutionError, SQLShapeError, SQLUnknownTensorError


@pytest.fixture
def mats(db, rng):
    a = rng.standard_normal((5, 4)).astype(np.float32)
    b = rng.standard_normal((4, 3)).astype(np.float32)
    db.from_numpy("A", a, tile=(2, 2))
    db.from_numpy("B", b, tile=(3, 2))
    db.connection.execute(
        "CREATE TABLE v AS SELECT range AS j, (range + 1)::DOUBLE AS val FROM range(4)")
    return a, b


def close(x, y, tol=1e-4):
    return np.allclose(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64),
                       atol=tol, rtol=tol)


# -- parsing ---------------------------------------------------------------------------------

def test_dialect_round_trips_every_statement_form():
    script = ("SELECT * FROM EINSUM('ij,jk->ik', A, B, join := 'add', agg := 'max');\n"
              "CREATE OR REPLACE TENSOR C AS SELECT * FROM EINSUM('ij->i', A);\n"
              "DROP TENSOR IF EXISTS C;\nEXPLAIN ANALYZE SELECT 1;\nSELECT ';' AS s")
    kinds = [type(s.expression).__name__ for s in parse_script(script)]
    assert kinds == ["Select", "CreateTensor", "DropTensor", "Explain", "Select"]
    first = parse_script(script)[0].expression
    assert isinstance(first.find(Einsum), Einsum)
    assert parse_script(script)[4].text == "SELECT ';' AS s"


# -- EINSUM results ---------------------------------------------------------------------------

def test_select_einsum_rows_and_dense(db, mats):
    a, b = mats
    r = db.sql("SELECT * FROM EINSUM('ij,jk->ik', A, B)")
    assert r.columns == ["i", "k", "val"]
    assert close(r.numpy(), a @ b)
    assert isinstance(r.torch(), torch.Tensor)
    rows = r.fetchall()
    assert len(rows) == 15 and rows[4][:2] == (1, 1) and close(rows[4][2], (a @ b)[1, 1])
    assert r.arrow().num_rows == 15


@pytest.mark.parametrize("join,agg", [("add", "max"), ("add", "min"), ("max", "sum"),
                                      ("mul", "prod"), ("sub", "max")])
def test_semiring_arguments(db, mats, join, agg):
    a, b = mats
    fn = {"add": np.add, "max": np.maximum, "mul": np.multiply, "sub": np.subtract}[join]
    red = {"max": np.max, "min": np.min, "sum": np.sum, "prod": np.prod}[agg]
    expected = red(fn(a[:, :, None], b[None]), axis=1)
    r = db.sql(f"SELECT * FROM EINSUM('ij,jk->ik', A, B, join := '{join}', agg := '{agg}')")
    assert close(r.numpy(), expected)


def test_results_compose_with_where_join_group_by(db, mats):
    a, b = mats
    c = a @ b
    r = db.sql("SELECT i, sum(val) AS val FROM EINSUM('ij,jk->ik', A, B) WHERE k < 2 "
               "GROUP BY i ORDER BY i")
    assert close(r.numpy(), c[:, :2].sum(1))
    r = db.sql("SELECT e.i, e.val * v.val AS val FROM EINSUM('ij->i', A) AS e "
               "JOIN v ON e.i = v.j ORDER BY e.i")
    assert close(r.numpy(), a.sum(1)[:4] * np.arange(1, 5))
    r = db.sql("SELECT count(*) FROM EINSUM('ij,jk->ik', A, B) WHERE val > 0")
    assert r.fetchall() == [(int((c > 0).sum()),)]


def test_relation_operand_with_where_is_sparse(db, mats):
    a, _ = mats
    r = db.sql("SELECT * FROM EINSUM('ij,j->i', A, (SELECT j, val FROM v WHERE j < 2))")
    assert close(r.numpy(), a @ np.array([1.0, 2.0, 0.0, 0.0]))
    # a plain table name works too, and label columns may be matched by name
    r = db.sql("SELECT * FROM EINSUM('ij,j->i', A, v)")
    assert close(r.numpy(), a @ np.arange(1, 5))
    r = db.sql("SELECT * FROM EINSUM('ji,j->i', (SELECT val, j, i FROM "
               "(SELECT range AS i, range AS j, 2.0 AS val FROM range(3))), v)")
    assert close(r.numpy(), 2 * np.arange(1, 4))


def test_relation_only_operands_size_from_max_index_or_explicit(db, mats):
    r = db.sql("SELECT * FROM EINSUM('i,i->i', (SELECT 2 AS i, 3.0 AS val), "
               "(SELECT 1 AS i, 5.0 AS val))")
    assert r.numpy().tolist() == [0.0, 0.0, 0.0]
    r = db.sql("SELECT * FROM EINSUM('i->i', (SELECT 1 AS i, 5.0 AS val), sizes := {'i': 4})")
    assert r.numpy().tolist() == [0.0, 5.0, 0.0, 0.0]
    # stored tensors are relations too: their element view d0, d1, val
    r = db.sql("SELECT * FROM EINSUM('ij->', (SELECT * FROM A))")
    assert r.numpy().shape == ()


def test_nested_einsums_via_ctes(db, mats):
    a, b = mats
    c = a @ b
    r = db.sql("WITH c AS (SELECT * FROM EINSUM('ij,jk->ik', A, B)) "
               "SELECT * FROM EINSUM('ik,ik->i', c, c)")
    assert close(r.numpy(), (c ** 2).sum(1))
    r = db.sql("WITH c AS (SELECT * FROM EINSUM('ij,jk->ik', A, B) WHERE i < 3), "
               "d AS (SELECT * FROM EINSUM('ik->k', c)) SELECT k, val FROM d ORDER BY k")
    assert close(r.numpy(), c[:3].sum(0))
    r = db.sql("SELECT * FROM EINSUM('i,i->', (SELECT * FROM EINSUM('ij->i', A)), "
               "(SELECT * FROM EINSUM('ik->i', (SELECT * FROM EINSUM('ij,jk->ik', A, B)))))")
    assert close(r.numpy(), a.sum(1) @ c.sum(1), tol=1e-3)


def test_create_and_drop_tensor(db, mats):
    a, b = mats
    r = db.sql("CREATE TENSOR C AS SELECT * FROM EINSUM('ij,jk->ik', A, B)")
    assert "C 5x3 float32" in str(r)
    assert close(db.tensor("C").numpy(), a @ b)
    assert db.sql('SELECT count(*) FROM "C"').fetchall() == [(15,)]
    db.sql("CREATE OR REPLACE TENSOR C AS SELECT i, 2 * val AS val FROM "
           "EINSUM('ij->i', A) WHERE i > 0")
    assert close(db.tensor("C").numpy(), np.r_[0, 2 * a.sum(1)[1:]])
    db.sql("DROP TENSOR C")
    assert "C" not in db.tensors()
    db.sql("DROP TENSOR IF EXISTS C")


def test_plain_sql_passes_through(db, mats):
    assert db.sql('SELECT count(*) FROM "A"').fetchall() == [(20,)]
    db.sql("CREATE TABLE t (x INTEGER); INSERT INTO t VALUES (1), (2)")
    assert db.sql("SELECT sum(x) FROM t").fetchall() == [(3,)]


# -- EXPLAIN ----------------------------------------------------------------------------------

def test_explain_einsum_and_plain(db, mats):
    text = str(db.sql("EXPLAIN SELECT * FROM EINSUM('ij,jk->ik', A, B)"))
    assert text.startswith("EXPLAIN SELECT * FROM EINSUM")
    assert "Aggregate sum over [j]" in text and "Scan A" in text and "measured" not in text
    text = str(db.sql("EXPLAIN ANALYZE SELECT i, max(val) FROM EINSUM('ij,jk->ik', A, B) "
                      "GROUP BY i"))
    assert "measured: wall" in text and "DuckDB runs the rest" in text
    assert "__tq_einsum_" in text and "Total Time" in text
    text = str(db.sql("EXPLAIN SELECT count(*) FROM v WHERE j > 1"))
    assert "EINSUM" not in text and "╭" in text
    assert "Total Time" in str(db.sql("EXPLAIN ANALYZE SELECT count(*) FROM v"))
    assert "Aggregate" in str(db.sql("EXPLAIN CREATE TENSOR C AS "
                                     "SELECT * FROM EINSUM('ij,jk->ik', A, B)"))
    assert "C" not in db.tensors()
    # CREATE TENSOR ... AS a query without EINSUM: DuckDB's plan of the query (DuckDB itself
    # knows no CREATE TENSOR: it was a syntax error at "TENSOR")
    for head, mark in (("EXPLAIN", "Seq Scan"), ("EXPLAIN ANALYZE", "Total Time")):
        text = str(db.sql(f"{head} CREATE TENSOR D AS SELECT j AS i, val FROM v WHERE j > 1"))
        assert "CREATE TENSOR D: the query's element rows" in text and mark in text
        # EXPLAIN ANALYZE runs it and so creates D, as DuckDB's creates a table
        assert ("D" in db.tensors()) == (head == "EXPLAIN ANALYZE")


# -- DuckDB backend ---------------------------------------------------------------------------

def test_duckdb_backend_per_query_and_explain(db, mats):
    a, b = mats
    r = db.sql("SELECT * FROM EINSUM('ij,jk->ik', A, B, backend := 'duckdb')")
    assert close(r.numpy(), a @ b)
    r = db.sql("SELECT * FROM EINSUM('ij,jk->ik', A, B, join := 'add', agg := 'max')",
               backend="duckdb")
    assert close(r.numpy(), (a[:, :, None] + b[None]).max(1))
    text = str(db.sql("EXPLAIN SELECT * FROM EINSUM('ij,jk->ik', A, B)", backend="duckdb"))
    # the runs above kept A's chunks in the store's cache, so a run now reads them there
    # (issue 31); before, a join read the stored pages of A (no chunk view's round trip)
    assert "Generated SQL" in text and "Scan A (cached chunks)" in text and "GROUP BY" in text
    assert "Hash Join" in text


def test_duckdb_backend_option_runs_every_plan_kind(rng):
    with tq.connect(workers=2, backend="duckdb") as db:
        x = rng.standard_normal((6, 5)).astype(np.float32)
        y = rng.standard_normal((5, 4)).astype(np.float32)
        z = rng.standard_normal((4, 3)).astype(np.float32)
        X = db.from_numpy("X", x, tile=(4, 2))
        Y = db.from_numpy("Y", y, tile=(3, 3))  # retiled (Rekey) to match X's j tile
        Z = db.from_numpy("Z", z, tile=(2, 2))
        assert close(tq.einsum("ij,jk,kl->il", X, Y, Z).numpy(), x @ y @ z)
        assert close(tq.einsum("ij->ji", X).numpy(), x.T)
        assert close((X.exp() * 2).numpy(), np.exp(x) * 2, tol=1e-3)
        assert close(tq.einsum("ij->", X).numpy(), x.sum())
        assert close(tq.einsum("ij,kl->ijkl", X, Z).numpy(), np.einsum("ij,kl->ijkl", x, z))
        sq = db.from_numpy("S", rng.standard_normal((4, 4)).astype(np.float32), tile=(3, 3))
        assert close(tq.einsum("ii->i", sq).numpy(), np.diag(sq.numpy()))
        assert "Generated SQL" in tq.einsum("ij,jk->ik", X, Y).explain()


# -- errors -----------------------------------------------------------------------------------

def test_parse_error_has_line_and_column(db):
    with pytest.raises(tq.ParseError) as info:
        db.sql("SELECT 1;\nSELECT * FROM (SELECT 2")
    assert info.value.line == 2


def test_unknown_tensor_error_position(db, mats):
    with pytest.raises(SQLUnknownTensorError) as info:
        db.sql("SELECT *\nFROM EINSUM('ij,jk->ik', A, nope)")
    err = info.value
    assert isinstance(err, tq.UnknownTensorError) and (err.line, err.column) == (2, 29)
    assert "nope" in str(err)


def test_size_mismatch_error_points_at_operand(db, mats):
    with pytest.raises(SQLShapeError) as info:
        db.sql("SELECT * FROM EINSUM('ij,jk->ik', A, A)")
    assert isinstance(info.value, tq.ShapeError) and info.value.column == 38
    with pytest.raises(SQLShapeError) as info:
        db.sql("SELECT * FROM EINSUM('ij,j->i', A, (SELECT 7 AS j, 1.0 AS val))")
    assert "outside 0..3" in str(info.value) and info.value.column == 36
    with pytest.raises(SQLShapeError, match="names 2 operand"):
        db.sql("SELECT * FROM EINSUM('ij,jk->ik', A)")


def test_bad_join_agg_names(db, mats):
    with pytest.raises(tq.UnknownOperatorError) as info:
        db.sql("SELECT * FROM EINSUM('ij,jk->ik', A, B, join := 'xor')")
    assert info.value.column == 49 and "choose one of" in str(info.value)
    with pytest.raises(tq.UnknownOperatorError, match="unknown EINSUM argument"):
        db.sql("SELECT * FROM EINSUM('ij->i', A, how := 'x')")
    with pytest.raises(tq.UnknownOperatorError, match="'join' is given twice") as info:
        db.sql("SELECT * FROM EINSUM('ij,jk->ik', A, B, join := 'add', join := 'mul')")
    assert info.value.column == 56


def test_bad_equation_points_into_the_string(db, mats):
    with pytest.raises(tq.ParseError) as info:
        db.sql("SELECT * FROM EINSUM('i.,jk->ik', A, B)")
    assert info.value.column == 24  # the '.'


def test_failed_statement_changes_nothing(db, mats):
    before = db.tensors()
    with pytest.raises(tq.TensorQLError):
        db.sql("CREATE TENSOR D AS SELECT * FROM EINSUM('ij,jk->ik', A, A)")
    with pytest.raises(SQLExecutionError):
        db.sql("CREATE TENSOR A AS SELECT * FROM EINSUM('ij->i', A)")
    assert db.tensors() == before
    assert not db.connection.sql(
        "SELECT * FROM duckdb_views() WHERE view_name LIKE '__tq%'").fetchall()
    with pytest.raises(SQLExecutionError) as info:
        db.sql("SELECT * FROM missing_table")
    assert info.value.column == 15
