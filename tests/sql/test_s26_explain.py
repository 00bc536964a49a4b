"""EXPLAIN [ANALYZE] runs what the statement runs (fuzz findings of session 26).

Each test holds EXPLAIN to an oracle: the same statement without EXPLAIN, plain
``duckdb.connect()``, or numpy.
"""

from __future__ import annotations

import duckdb
import numpy as np
import pytest

import tensorql as tq
from tensorql.backend.duckdb_sql import SQLPlan
from tensorql.errors import MemoryLimitError, PlanError
from tensorql.sql.errors import SQLExecutionError, SQLUnknownTensorError


@pytest.fixture
def db():
    session = tq.connect(workers=1)
    yield session
    session.close()


# -- EXPLAIN ANALYZE registers the statement's rows --------------------------------------

def test_explain_analyze_create_table_over_rows_matches_the_statement(db):
    """An absent relation row meeting an inf: the statement recomputes over the rows (no
    NaN); EXPLAIN ANALYZE CREATE TABLE must store those same rows."""
    db.from_numpy("B", np.array([[2.0, 3.0], [np.inf, 5.0]], np.float32))
    db.sql("CREATE TABLE e AS SELECT 0::BIGINT AS i, 0::BIGINT AS j, 1.0::DOUBLE AS val")
    q = "SELECT * FROM EINSUM('ij,jk->ik', e, B) WHERE val IS NOT NULL"
    db.sql("CREATE TABLE t1 AS " + q)
    db.sql("EXPLAIN ANALYZE CREATE TABLE t2 AS " + q)
    plain = db.sql("SELECT * FROM t1 ORDER BY ALL").fetchall()
    explained = db.sql("SELECT * FROM t2 ORDER BY ALL").fetchall()
    assert plain == [(0, 0, 2.0), (0, 1, 3.0)]
    assert explained == plain


# -- EXPLAIN ANALYZE under process_memory_limit ------------------------------------------

@pytest.fixture
def small():
    session = tq.connect(workers=1, process_memory_limit="2MiB")  # 600x600 float32: 1.4 MiB
    session.from_numpy("A", np.ones((600, 8), np.float32))
    session.from_numpy("B", np.arange(8 * 600, dtype=np.float32).reshape(8, 600) % 7)
    yield session
    session.close()


def test_explain_analyze_refuses_a_dense_result_as_the_statement_does(small):
    q = "SELECT * FROM EINSUM('ij,jk->ik', A, B)"
    with pytest.raises(MemoryLimitError) as plain:
        small.sql(q)
    with pytest.raises(MemoryLimitError) as explained:
        small.sql("EXPLAIN ANALYZE " + q)
    assert str(explained.value).split(" at ")[0] == str(plain.value).split(" at ")[0]


def test_explain_analyze_streams_where_the_statement_streams(small):
    q = "SELECT * FROM EINSUM('ij,jk->ik', A, B) WHERE val > 20"
    small.sql("CREATE TABLE t1 AS " + q)
    text = str(small.sql("EXPLAIN ANALYZE CREATE TABLE t2 AS " + q))
    assert "stream into DuckDB chunk by chunk" in text
    expected = np.ones((600, 8), np.float32) @ (
        np.arange(8 * 600, dtype=np.float32).reshape(8, 600) % 7)
    count = int((expected > 20).sum())
    assert small.sql("SELECT count(*) FROM t1").fetchall() == [(count,)]
    assert small.sql("SELECT * FROM t2 EXCEPT SELECT * FROM t1").fetchall() == []
    assert small.sql("SELECT count(*) FROM t2").fetchall() == [(count,)]


def test_plain_explain_of_a_streamed_einsum_registers_only_its_columns(small):
    q = "SELECT count(*) FROM EINSUM('ij,jk->ik', A, B)"
    text = str(small.sql("EXPLAIN " + q))
    assert "stream into DuckDB chunk by chunk" in text
    assert small.sql(q).fetchall() == [(600 * 600,)]


def test_explain_analyze_create_tensor_stores_chunks_as_the_statement_does(small):
    q = "SELECT * FROM EINSUM('ij,jk->ik', A, B)"
    text = str(small.sql("EXPLAIN ANALYZE CREATE TENSOR C AS " + q))
    assert "go to the store as computed" in text
    assert text.splitlines()[-1] == "-- CREATE TENSOR C 600x600 float32"
    expected = np.ones((600, 8), np.float32) @ (
        np.arange(8 * 600, dtype=np.float32).reshape(8, 600) % 7)
    got = small.sql("SELECT sum(val), max(val) FROM C").fetchall()[0]
    assert got == pytest.approx((float(expected.sum()), float(expected.max())))


# -- EXPLAIN [ANALYZE] DROP TENSOR -------------------------------------------------------

def test_explain_drop_tensor_checks_the_name_as_drop_tensor_does(db):
    db.from_numpy("A", np.ones((2, 3), np.float32))
    with pytest.raises(SQLUnknownTensorError):
        db.sql("DROP TENSOR nosuch")
    with pytest.raises(SQLUnknownTensorError) as err:
        db.sql("EXPLAIN DROP TENSOR nosuch")
    assert err.value.position == len("EXPLAIN DROP TENSOR ")
    with pytest.raises(SQLUnknownTensorError):
        db.sql("EXPLAIN ANALYZE DROP TENSOR nosuch")
    assert "not present" in str(db.sql("EXPLAIN DROP TENSOR IF EXISTS nosuch"))
    text = str(db.sql("EXPLAIN DROP TENSOR a"))  # the stored spelling, as DROP TENSOR
    assert "DROP TENSOR A: removes" in text
    assert db.tensors() == ["A"]  # plain EXPLAIN drops nothing


def test_explain_analyze_drop_tensor_drops(db):
    db.from_numpy("A", np.ones((2, 3), np.float32))
    db.from_numpy("K", np.ones(2, np.float32))
    text = str(db.sql("EXPLAIN ANALYZE DROP TENSOR A"))
    assert text.splitlines()[-1] == "-- DROP TENSOR A"
    assert db.tensors() == ["K"]
    db.sql("DROP TENSOR K")  # the oracle: DROP TENSOR leaves the same catalog
    assert db.tensors() == []
    assert str(db.sql("EXPLAIN ANALYZE DROP TENSOR IF EXISTS A")).splitlines()[-1] \
        == "-- DROP TENSOR A: not present"


# -- CREATE TABLE ... AS <EINSUM query> WITH NO DATA -------------------------------------

@pytest.mark.parametrize("clause, rows", [("WITH NO DATA", 0), ("WITH DATA", 5)])
def test_create_table_as_with_no_data_keeps_duckdbs_meaning(db, clause, rows):
    oracle = duckdb.connect()
    for con in (db, oracle):
        con.sql("CREATE TABLE v AS SELECT range AS i, (range * 1.5)::DOUBLE AS val "
                "FROM range(5)")
    db.sql(f"CREATE TABLE r AS SELECT * FROM EINSUM('i->i', v) {clause}")
    oracle.sql(f"CREATE TABLE r AS SELECT * FROM v {clause}")
    assert db.sql("SELECT count(*) FROM r").fetchall() == [(rows,)]
    assert oracle.sql("SELECT count(*) FROM r").fetchall() == [(rows,)]
    assert db.sql("DESCRIBE r").fetchall() == oracle.sql("DESCRIBE r").fetchall()


# -- EINSUM inside a statement DuckDB runs as written ------------------------------------

@pytest.mark.parametrize("prefix", ["PREPARE p AS ", "SHOW "])
def test_einsum_in_an_opaque_command_is_a_clear_error(db, prefix):
    db.sql("CREATE TABLE v AS SELECT range AS i, range * 1.5 AS val FROM range(5)")
    q = f"{prefix}SELECT * FROM EINSUM('i->i', v) WHERE i > 1"
    with pytest.raises(SQLExecutionError) as err:
        db.sql(q)
    word = prefix.split()[0]
    assert f"EINSUM is not supported inside {word}" in str(err.value)
    assert "db.sql(query, params)" in str(err.value)
    assert err.value.position == q.index("EINSUM")
    assert "does not exist" not in str(err.value)


def test_prepare_without_einsum_still_reaches_duckdb(db):
    db.sql("PREPARE q AS SELECT 'EINSUM(' AS s, $1 AS x")
    assert db.sql("EXECUTE q(3)").fetchall() == [("EINSUM(", 3)]


# -- explain() fails where the run fails -------------------------------------------------

def test_explain_raises_the_runs_plan_error_on_one_device():
    session = tq.connect(workers=1, devices=1, memory_limit=64)
    a = session.from_numpy("A", np.ones((8, 6), np.float32), tile=(4, 3))
    b = session.from_numpy("B", np.ones((6, 5), np.float32), tile=(3, 5))
    c = tq.einsum("ij,jk->ik", a, b)
    with pytest.raises(PlanError) as ran:
        c.numpy()
    with pytest.raises(PlanError) as explained:
        c.explain()
    assert str(explained.value) == str(ran.value)
    session.close()


def test_explain_without_a_limit_still_explains():
    session = tq.connect(workers=1)
    a = session.from_numpy("A", np.ones((8, 6), np.float32), tile=(4, 3))
    c = tq.einsum("ij->i", a)
    assert "EXPLAIN" in c.explain()
    np.testing.assert_array_equal(c.numpy(), np.full(8, 6.0, np.float32))
    session.close()


# -- the DuckDB backend's EXPLAIN is deterministic ---------------------------------------

def test_duckdb_backend_explain_is_the_same_each_time():
    session = tq.connect(workers=1, backend="duckdb")
    c = tq.einsum("ij->i", session.from_numpy("A", np.ones((2, 3), np.float32)))
    first = c.explain()
    assert "tq_load_" in first
    assert c.explain() == first
    np.testing.assert_array_equal(c.numpy(), np.full(2, 3.0, np.float32))
    after = c.explain()  # the run cached A's chunks: another plan, again the same each time
    assert c.explain() == after
    session.close()


def test_duckdb_backend_live_plans_never_share_names():
    session = tq.connect(workers=1, backend="duckdb")
    a = session.from_numpy("A", np.ones((4, 4), np.float32), tile=(2, 2))
    logical = tq.einsum("ij,jk->ik", a, a).compile().logical
    one = SQLPlan.build(logical, session.chunk_store)
    two = SQLPlan.build(logical, session.chunk_store)
    names_one = {u.name for u in one.udfs} | set(one.tables)
    names_two = {u.name for u in two.udfs} | set(two.tables)
    assert names_one and not names_one & names_two
    one.release()
    three = SQLPlan.build(logical, session.chunk_store)  # takes the number given back
    assert {u.name for u in three.udfs} | set(three.tables) == names_one
    two.release()
    three.release()
    session.close()


# -- error positions with query parameters -----------------------------------------------

def test_error_positions_point_into_the_text_with_parameters(db):
    db.sql("CREATE TABLE v AS SELECT range AS i, range * 1.5 AS val FROM range(5)")
    q = "SELECT * FROM EINSUM('i,i->i', (SELECT * FROM v WHERE val > ?), Nope)"
    with pytest.raises(SQLUnknownTensorError) as err:
        db.sql(q, [1.5])
    assert err.value.text == q
    assert err.value.position == q.index("Nope")
    assert err.value.column == q.index("Nope") + 1
    assert "?), Nope)" in str(err.value)
