"""The DuckDB store when a file is damaged (a chunk table gone) and when a tensor's name is
taken by a temp table or view of the session's own connection: opening, reading the intact
tensors, and nothing stored on a refused write."""

from __future__ import annotations

import duckdb
import numpy as np
import pytest

import tensorql as tq
from tensorql.errors import StorageError
from tensorql.grid import ChunkGrid
from tensorql.storage.chunk_store import TensorMeta


def _damaged_file(path: str) -> str:
    """A file holding tensors A and B whose A lost its chunk table (dropped by a plain DuckDB
    client); returns that table's name."""
    with tq.connect(path, workers=1) as db:
        db.from_numpy("A", np.arange(6.0))
        db.from_numpy("B", np.arange(3.0) + 10)
    con = duckdb.connect(path)
    try:
        table = con.execute("SELECT chunk_table FROM tq_internal.tensorql_catalog "
                            "WHERE name = 'A'").fetchall()[0][0]
        con.execute(f'DROP TABLE tq_internal."{table}"')
    finally:
        con.close()
    return table


@pytest.mark.parametrize("read_only", [False, True])
def test_reopen_file_missing_a_chunk_table(tmp_path, read_only):
    path = str(tmp_path / "damaged.duckdb")
    table = _damaged_file(path)
    with tq.connect(path, workers=1, read_only=read_only) as db:
        assert db.tensors() == ["A", "B"]
        assert db.chunk_store.broken_tensors() == {
            "A": f"its chunk table tq_internal.{table} is missing"}
        np.testing.assert_array_equal(db.tensor("B").numpy(), np.arange(3.0) + 10)
        rows = db.sql('SELECT d0, val FROM "B" ORDER BY d0').fetchall()
        assert rows == [(i, float(i + 10)) for i in range(3)]
        for read in (lambda: db.tensor("A").numpy(),
                     lambda: db.tensor("A").sum().numpy(),
                     lambda: db.chunk_store.read_chunk("A", (0,))):
            with pytest.raises(StorageError, match=rf"'A'.*{table} is missing"):
                read()
        np.testing.assert_array_equal(db.tensor("B").numpy(), np.arange(3.0) + 10)


def test_drop_repairs_a_file_missing_a_chunk_table(tmp_path):
    path = str(tmp_path / "damaged.duckdb")
    _damaged_file(path)
    with tq.connect(path, workers=1) as db:
        db.drop("A")
        assert db.tensors() == ["B"]
        assert db.chunk_store.broken_tensors() == {}
        db.from_numpy("A", np.full(2, 7.0))  # the name is free again
    with tq.connect(path, workers=1, read_only=True) as db:
        assert db.tensors() == ["A", "B"]
        assert db.chunk_store.broken_tensors() == {}
        np.testing.assert_array_equal(db.tensor("A").numpy(), np.full(2, 7.0))
        np.testing.assert_array_equal(db.tensor("B").numpy(), np.arange(3.0) + 10)


def test_sync_views_failure_is_a_storage_error(monkeypatch):
    db = tq.connect(workers=1)
    store = db.chunk_store

    def failing():
        raise duckdb.CatalogException("Catalog Error: Table with name tq_chunks_9 does not "
                                      "exist!")

    monkeypatch.setattr(store, "_sync_views_once", failing)
    with pytest.raises(StorageError, match="tensor catalog.*tq_chunks_9"):
        store.sync_views()
    monkeypatch.undo()
    store.sync_views()
    db.close()


def _plain_state(db) -> tuple[list, list]:
    """The catalog rows and chunk tables the store's database holds (asked of DuckDB)."""
    con = db.chunk_store.cursor()
    try:
        rows = con.execute(f"SELECT name FROM {db.chunk_store._catalog}").fetchall()
        tables = con.execute("SELECT table_name FROM duckdb_tables() WHERE schema_name = "
                             "'tq_internal' AND table_name LIKE 'tq_chunks_%'").fetchall()
    finally:
        con.close()
    return rows, tables


@pytest.mark.parametrize("on_file", [False, True])
@pytest.mark.parametrize("kind, value", [("TABLE", 1), ("VIEW", 2)])
@pytest.mark.parametrize("taken", ["X", "x", "X__chunks"])
def test_name_of_a_temp_object_is_refused_before_anything_is_stored(tmp_path, on_file, kind,
                                                                   value, taken):
    db = tq.connect(str(tmp_path / "t.duckdb") if on_file else None, workers=1)
    try:
        # made on the session's main connection, as a user's SQL would
        db.connection.execute(f'CREATE TEMP {kind} "{taken}" AS SELECT {value} AS a')
        with pytest.raises(StorageError, match=f"'X'.*clashes.*'{taken}'"):
            db.from_numpy("X", np.arange(3.0))
        with pytest.raises(StorageError, match=f"'X'.*clashes.*'{taken}'"):
            db.chunk_store.check_name("X")  # asked before a streamed write
        with pytest.raises(StorageError, match=f"'X'.*clashes.*'{taken}'"):
            db.sql("CREATE TENSOR X AS SELECT * FROM EINSUM('i->i', "
                   "(SELECT 0 AS i, 1.0 AS val))")
        assert db.tensors() == []
        assert _plain_state(db) == ([], [])
        # the session works on: the user's object is untouched, other tensors are stored
        assert db.sql(f'SELECT a FROM "{taken}"').fetchall() == [(value,)]
        assert db.sql("SELECT 1").fetchall() == [(1,)]
        db.from_numpy("Y", np.arange(4.0) * 2)
        assert db.sql('SELECT d0, val FROM "Y" ORDER BY d0').fetchall() == [
            (i, 2.0 * i) for i in range(4)]
        db.connection.execute(f'DROP {kind} "{taken}"')
        db.from_numpy("X", np.arange(3.0))
        np.testing.assert_array_equal(db.tensor("X").numpy(), np.arange(3.0))
        assert db.sql('SELECT val FROM "X" ORDER BY d0').fetchall() == [(0.0,), (1.0,), (2.0,)]
    finally:
        db.close()


@pytest.mark.parametrize("on_file", [False, True])
def test_views_refused_at_publish_roll_the_write_back(tmp_path, on_file, monkeypatch):
    """A clash the name check misses (forced here) fails when the views are made, before the
    commit: the catalog is rolled back and a replaced tensor keeps its old version and views."""
    db = tq.connect(str(tmp_path / "t.duckdb") if on_file else None, workers=1)
    try:
        store = db.chunk_store
        db.from_numpy("Z", np.arange(3.0))
        db.connection.execute("CREATE TEMP TABLE X AS SELECT 1 AS a")
        monkeypatch.setattr(store, "_main_temp_clashes", lambda name: [])
        grid = ChunkGrid((3,), (3,))
        items = [(TensorMeta("Z", (3,), "float64", grid), [((0,), np.full(3, 9.0))]),
                 (TensorMeta("X", (3,), "float64", grid), [((0,), np.full(3, 5.0))])]
        with pytest.raises(StorageError, match="storing tensor.*X.*Existing object"):
            store.put_tensors(items, replace=True)
        assert db.tensors() == ["Z"]
        rows, tables = _plain_state(db)
        assert rows == [("Z",)] and len(tables) == 1
        np.testing.assert_array_equal(db.tensor("Z").numpy(), np.arange(3.0))
        assert db.sql('SELECT val FROM "Z" ORDER BY d0').fetchall() == [(0.0,), (1.0,), (2.0,)]
        assert db.sql("SELECT a FROM X").fetchall() == [(1,)]
        assert db.chunk_store.broken_tensors() == {}
    finally:
        db.close()


def test_sync_views_in_an_aborted_transaction():
    """A transaction an error aborted: the sync's error is a StorageError, still DuckDB's
    TransactionException for its callers, and a ROLLBACK through tensorql's SQL ends it."""
    db = tq.connect(workers=1)
    try:
        db.from_numpy("A", np.arange(3.0))
        db.connection.execute("BEGIN")
        with pytest.raises(duckdb.Error):
            db.connection.execute("SELECT * FROM no_such_table_s26")
        with pytest.raises(StorageError, match="ROLLBACK") as caught:
            db.chunk_store.sync_views()
        assert isinstance(caught.value, duckdb.TransactionException)
        db.sql("ROLLBACK")
        assert db.sql('SELECT val FROM "A" ORDER BY d0').fetchall() == [(0.0,), (1.0,), (2.0,)]
    finally:
        db.close()


def test_a_streamed_create_tensor_named_like_a_temp_table_is_refused_before_it_stores():
    """``CREATE TENSOR X AS <EINSUM>`` streams its chunks from a writer thread, which cannot
    ask the main connection about its temp tables: the name is checked before the stream
    starts, nothing is stored, and the user's temp table still reads."""
    db = tq.connect()
    db.from_numpy("A", np.arange(16, dtype=np.float32).reshape(4, 4))
    db.connection.execute("CREATE TEMP TABLE X AS SELECT 7 AS q")
    with pytest.raises(tq.StorageError, match="clashes"):
        db.sql("CREATE TENSOR X AS SELECT * FROM EINSUM('ij->i', A)")
    assert db.tensors() == ["A"]
    assert db.sql("SELECT * FROM X").fetchall() == [(7,)]
    db.sql("CREATE OR REPLACE TENSOR A AS SELECT * FROM EINSUM('ij->ij', A)")  # its own views
    np.testing.assert_array_equal(db.tensor("A").numpy(), np.arange(16).reshape(4, 4))
