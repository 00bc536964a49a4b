"""Tensor names follow DuckDB's case-insensitive identifiers; clashes are clear errors that
change nothing (issue 16, bug 2)."""

from __future__ import annotations

import numpy as np
import pytest

import tensorql as tq
from tensorql.sql.errors import SQLExecutionError


@pytest.fixture(params=["duckdb", "memory"])
def any_db(request):
    if request.param == "duckdb":
        database = tq.connect(workers=2)
    else:
        from tensorql.storage.memory_store import MemoryChunkStore

        database = tq.connect(workers=2, store=MemoryChunkStore())
    with database:
        yield database


def test_tensor_names_differing_only_in_case_clash(db):
    db.from_numpy("A", np.ones((2, 2), np.float32))
    with pytest.raises(tq.StorageError, match="clashes with the stored tensor 'A'") as info:
        db.from_numpy("a", np.zeros((2, 2), np.float32))
    assert "Catalog Error" not in str(info.value)
    assert db.tensors() == ["A"] and db.tensor("A").numpy().sum() == 4


def test_tensor_name_may_not_take_a_table_name(db):
    db.connection.execute("CREATE TABLE t (x INT)")
    with pytest.raises(tq.StorageError, match="clashes with the DuckDB table or view 't'"):
        db.from_numpy("T", np.ones(2, np.float32))
    assert db.tensors() == []


def test_create_table_named_like_a_tensor_is_refused(any_db):
    db = any_db
    db.from_numpy("E2", np.eye(2, dtype=np.float32))
    db.from_numpy("x", np.ones(2, np.float32))
    with pytest.raises(SQLExecutionError, match="clashes with the stored tensor 'E2'") as info:
        db.sql("CREATE TABLE e2 (i BIGINT, j BIGINT, val DOUBLE)")
    assert info.value.column == 14
    with pytest.raises(SQLExecutionError, match="clashes"):
        db.sql("CREATE OR REPLACE VIEW E2 AS SELECT 1 AS i, 1.0 AS val")
    # so EINSUM's e2 can only mean the tensor
    assert db.sql("SELECT * FROM EINSUM('ij,j->i', e2, x)").numpy().tolist() == [1.0, 1.0]


@pytest.mark.parametrize("statement", [
    "DROP VIEW main.A", "DROP VIEW memory.main.a", "DROP VIEW IF EXISTS zz, main.A",
    "ALTER VIEW main.A RENAME TO A2", "CREATE TABLE main.a (x INT)",
    "CREATE TEMP TABLE temp.a (x INT)", "CREATE TABLE temp.main.a (x INT)",
    "CREATE VIEW memory.A__chunks AS SELECT 1",
    "CREATE TABLE main.a AS SELECT * FROM EINSUM('ij->i', A)"])
def test_a_qualified_name_reaches_the_tensors_views_too(statement):
    """``main.A`` is the view of tensor A as much as ``A`` is (they were let through: the
    view dropped, or a table created that the view hides)."""
    with tq.connect() as db:
        db.from_numpy("A", np.arange(6.0).reshape(2, 3))
        with pytest.raises(SQLExecutionError, match="stored tensor 'A'"):
            db.sql(statement)
        assert db.sql("SELECT count(*) FROM A").fetchall() == [(6,)]
        db.sql("CREATE SCHEMA s")
        db.sql("CREATE TABLE s.a (x INT)")  # another schema's: no clash
        db.sql("DROP TABLE s.a")


def test_to_table_refuses_a_tensors_view_name():
    with tq.connect() as db:
        db.from_numpy("A", np.arange(6.0).reshape(2, 3))
        result = db.sql("SELECT 1 AS x")
        for name in ("A", "main.a", "a__CHUNKS"):
            with pytest.raises(SQLExecutionError, match="clashes with the stored tensor 'A'"):
                result.to_table(name)
        result.filter("x > 0").to_table("fine")
        assert db.sql("SELECT * FROM fine").fetchall() == [(1,)]
        assert db.sql("SELECT count(*) FROM A").fetchall() == [(6,)]
