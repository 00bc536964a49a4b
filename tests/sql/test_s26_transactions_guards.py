"""Transaction detection and the name guards, found by fuzzing (s26).

- A ``BEGIN`` (or ``ROLLBACK``) with a comment before it was not recognised: the statement kind
  was matched on the raw text, so tensor writes ran inside the user's transaction and its
  ROLLBACK left a tensor dropped; an aborted transaction's commented ROLLBACK was refused.
- A script ``CREATE TENSOR ...; BEGIN`` lost the BEGIN: the flag was set before the script ran
  and cleared by the CREATE TENSOR's probe.
- ``EXPLAIN ANALYZE`` runs its statement, yet the guards looked only at the first token
  (EXPLAIN): ``EXPLAIN ANALYZE DROP VIEW A`` dropped a tensor's view.
- Plain SQL could write, drop or alter tensorql's own tables (``tq_internal``).
- A DuckDB error from bringing the session's views up to date reached the caller raw.
"""

from __future__ import annotations

import duckdb
import numpy as np
import pytest

import tensorql as tq
from tensorql.sql.errors import SQLExecutionError

A = np.arange(6, dtype=np.float32).reshape(2, 3)
ONE = "SELECT * FROM EINSUM('i->i', (SELECT 0 AS i, 1.0 AS val))"


@pytest.fixture(params=["memory", "file"])
def db(request, tmp_path):
    path = None if request.param == "memory" else str(tmp_path / "t.duckdb")
    with tq.connect(path, workers=1) as session:
        session.from_numpy("A", A, tile=(1, 2))
        yield session


def _intact(db) -> None:
    assert db.tensors() == ["A"]
    np.testing.assert_array_equal(db.tensor("A").numpy(), A)
    np.testing.assert_array_equal(db.sql("SELECT * FROM EINSUM('ij->i', A)").numpy(),
                                  A.sum(axis=1))


@pytest.mark.parametrize("begin", ["-- start a transaction\nBEGIN", "/* c */ START TRANSACTION",
                                   "-- one\n-- two\nbegin transaction"])
def test_a_begin_after_a_comment_still_guards_tensor_writes(db, begin):
    db.sql(begin)
    for write in ("DROP TENSOR A", f"CREATE TENSOR B AS {ONE}"):
        with pytest.raises(tq.StorageError, match="COMMIT or ROLLBACK first"):
            db.sql(write)
    db.sql("-- undo\nROLLBACK")
    _intact(db)


def test_a_commented_rollback_ends_an_aborted_transaction_as_in_duckdb(db):
    oracle = duckdb.connect()
    for con in (oracle, db):
        con.sql("CREATE TABLE t AS SELECT 1.0 AS val")
        con.sql("BEGIN")
        con.sql("UPDATE t SET val = 2.0")
        with pytest.raises((duckdb.Error, tq.TensorQLError)):
            con.sql("SELECT 'x'::INT").fetchall()  # aborts the transaction
        con.sql("-- undo it\nROLLBACK")
    assert db.sql("SELECT val FROM t").fetchall() == oracle.sql("SELECT val FROM t").fetchall()
    assert db.sql("SELECT val FROM t").fetchall() == [(1.0,)]
    _intact(db)


def test_a_begin_later_in_a_script_guards_the_next_tensor_write(db):
    db.sql(f"CREATE TENSOR X AS {ONE}; BEGIN")
    with pytest.raises(tq.StorageError, match="COMMIT or ROLLBACK first"):
        db.sql("DROP TENSOR X")
    db.sql("ROLLBACK")
    assert db.tensors() == ["A", "X"]
    np.testing.assert_array_equal(db.tensor("X").numpy(), [1.0])
    db.sql("DROP TENSOR X")  # outside the transaction it runs
    _intact(db)


def test_duckdb_runs_ddl_under_explain_analyze():
    con = duckdb.connect()
    con.sql("CREATE VIEW v AS SELECT 1 AS x")
    con.sql("EXPLAIN ANALYZE DROP VIEW v")
    con.sql("EXPLAIN (ANALYZE) CREATE TABLE w AS SELECT 1 AS x")
    assert con.sql("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall() == []
    assert con.sql("SELECT table_name FROM duckdb_tables()").fetchall() == [("w",)]


@pytest.mark.parametrize("statement", [
    "EXPLAIN ANALYZE DROP VIEW A",
    "EXPLAIN ANALYZE DROP VIEW IF EXISTS a__chunks",
    "EXPLAIN (ANALYZE) ALTER VIEW A RENAME TO z",
    "EXPLAIN ANALYZE CREATE TABLE a AS SELECT 42 AS x",
    "EXPLAIN (FORMAT json, ANALYZE) CREATE OR REPLACE VIEW A AS SELECT 1 AS x",
    "EXPLAIN ANALYZE CREATE TABLE A__chunks AS SELECT * FROM EINSUM('ij->i', A)",
    "EXPLAIN ANALYZE CREATE TABLE main.a AS SELECT * FROM EINSUM('ij->i', A)",
])
def test_explain_analyze_is_guarded_as_the_statement_it_runs(db, statement):
    with pytest.raises(SQLExecutionError, match="stored tensor 'A'"):
        db.sql(statement)
    _intact(db)
    names = db.sql("SELECT table_name FROM information_schema.tables "
                   "WHERE table_schema = 'main' ORDER BY 1").fetchall()
    assert names == [("A",), ("A__chunks",)]


def test_plain_explain_plans_only_and_stays_allowed(db):
    assert "DROP" in str(db.sql("EXPLAIN DROP VIEW A")).upper()
    db.sql("EXPLAIN ANALYZE CREATE TABLE b AS SELECT * FROM EINSUM('ij->i', A)")
    assert db.sql("SELECT * FROM b ORDER BY 1").fetchall() == [(0, 3.0), (1, 12.0)]
    _intact(db)


def _chunk_table(db) -> str:
    return db.sql("SELECT chunk_table FROM tq_internal.tensorql_catalog "
                  "WHERE name = 'A'").fetchall()[0][0]


@pytest.mark.parametrize("statement", [
    "DROP TABLE tq_internal.{chunks}",
    "DROP TABLE IF EXISTS mine, TQ_INTERNAL.{chunks}",
    "DELETE FROM tq_internal.{chunks}",
    "WITH c AS (SELECT 1) DELETE FROM tq_internal.tensorql_catalog",
    "UPDATE tq_internal.tensorql_catalog SET name = 'Q'",
    "INSERT INTO tq_internal.tensorql_catalog SELECT * FROM tq_internal.tensorql_catalog",
    "TRUNCATE tq_internal.{chunks}",
    "ALTER TABLE tq_internal.{chunks} RENAME TO z",
    "CREATE OR REPLACE TABLE tq_internal.{chunks} AS SELECT 1 AS x",
    "CREATE TABLE tq_internal.extra (x INT)",
    "CREATE INDEX ix ON tq_internal.{chunks} (page)",
    "DROP SCHEMA tq_internal CASCADE",
    "EXPLAIN ANALYZE DELETE FROM tq_internal.{chunks}",
    "USE tq_internal; DROP TABLE {chunks}",
    "SET search_path = 'main,tq_internal'; DELETE FROM tensorql_catalog",
])
def test_sql_cannot_change_tensorqls_own_tables(db, statement):
    db.sql("CREATE TABLE mine AS SELECT 1 AS x")
    home = db.sql("SELECT current_database()").fetchall()[0][0]
    sql = statement.format(chunks=_chunk_table(db))
    with pytest.raises(SQLExecutionError, match="tensorql's own schema 'tq_internal'"):
        db.sql(sql)
    db.sql(f"USE {home}.main")  # (sets the search path back as well)
    _intact(db)
    assert db.sql("SELECT x FROM mine").fetchall() == [(1,)]


def test_the_file_catalog_qualified_name_is_guarded_too(tmp_path):
    with tq.connect(str(tmp_path / "f.duckdb"), workers=1) as db:
        db.from_numpy("A", A)
        chunks = _chunk_table(db)
        with pytest.raises(SQLExecutionError, match="tensorql's own schema"):
            db.sql(f"DROP TABLE tensorql.tq_internal.{chunks}")
    with tq.connect(str(tmp_path / "f.duckdb"), workers=1) as db:  # reopens whole
        np.testing.assert_array_equal(db.tensor("A").numpy(), A)


def test_reads_of_tensorqls_tables_and_writes_elsewhere_stay_allowed(db):
    chunks = _chunk_table(db)
    assert db.sql("SELECT name FROM tq_internal.tensorql_catalog").fetchall() == [("A",)]
    db.sql(f"CREATE TABLE copy AS SELECT * FROM tq_internal.{chunks}")
    count = db.sql(f"SELECT count(*) FROM tq_internal.{chunks}").fetchall()
    assert db.sql("SELECT count(*) FROM copy").fetchall() == count
    db.sql(f"INSERT INTO copy SELECT * FROM tq_internal.{chunks}")
    assert db.sql("SELECT count(*) FROM copy").fetchall() == [(2 * count[0][0],)]
    # a user's table found first on the search path is the user's to drop
    home = db.sql("SELECT current_database()").fetchall()[0][0]
    db.sql(f"SET search_path = 'main,tq_internal'; DROP TABLE copy; USE {home}.main")
    assert db.sql("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'copy'"
                  ).fetchall() == [(0,)]
    _intact(db)


def test_a_duckdb_error_bringing_the_views_up_to_date_is_a_storage_error(db, monkeypatch):
    # the store's view sync failing in DuckDB (as a clash with a TEMP table once made it,
    # for every later statement): injected, as the store now heals those cases itself
    def failing() -> None:
        raise duckdb.CatalogException('Existing object "X" is of type Table, trying to '
                                      "replace with type View")

    monkeypatch.setattr(db.chunk_store, "sync_views", failing)
    with pytest.raises(tq.StorageError, match="views of the stored tensors") as info:
        db.sql("SELECT 1")
    assert 'Existing object "X"' in str(info.value)
    monkeypatch.undo()
    assert db.sql("SELECT 1").fetchall() == [(1,)]
    _intact(db)
