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
