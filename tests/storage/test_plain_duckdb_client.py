"""A plain DuckDB client opening a tensorql file sees no broken views (issue 16, bug 6):
the tensor views are temp views of tensorql's own connection."""

from __future__ import annotations

import duckdb
import numpy as np

import tensorql as tq


def test_plain_client_sees_no_tensor_views_and_every_listed_object_reads(tmp_path):
    path = str(tmp_path / "t.duckdb")
    with tq.connect(path) as db:
        db.from_numpy("A", np.arange(6, dtype=np.float32).reshape(3, 2))
        assert db.sql('SELECT sum(val) FROM "A"').fetchall() == [(15.0,)]
        assert db.sql('SELECT count(*) FROM "A__chunks"').fetchall() == [(1,)]
    plain = duckdb.connect(path, read_only=True)
    try:
        names = [r[0] for r in plain.sql("SHOW TABLES").fetchall()]
        assert names == []  # the user's namespace (main) holds nothing of tensorql's
        assert not plain.sql("SELECT * FROM duckdb_views() WHERE NOT internal").fetchall()
        listed = plain.sql("SELECT schema_name, table_name FROM duckdb_tables()").fetchall()
        assert {schema for schema, _ in listed} == {"tq_internal"}
        for schema, name in listed:  # everything a plain client can list can be read
            plain.sql(f'SELECT count(*) FROM "{schema}"."{name}"').fetchall()
        assert plain.sql("SELECT name, shape FROM tq_internal.tensorql_catalog").fetchall() == [
            ("A", [3, 2])]
    finally:
        plain.close()
    with tq.connect(path) as db:  # and tensorql still shows the views after reopening
        assert db.sql('SELECT d0, d1, val FROM "A" WHERE val = 5').fetchall() == [(2, 1, 5.0)]


def test_views_follow_tensors_stored_by_another_connection(tmp_path):
    path = str(tmp_path / "t.duckdb")
    first = tq.connect(path)
    try:
        first.from_numpy("A", np.ones(3, np.float32))
        first.close()
        with tq.connect(path) as second:
            second.from_numpy("B", np.ones(4, np.float32))
            second.drop("A")
        first = tq.connect(path)
        assert first.sql('SELECT count(*) FROM "B"').fetchall() == [(4,)]
    finally:
        first.close()


def test_files_with_stored_views_are_cleaned_on_open(tmp_path):
    path = str(tmp_path / "t.duckdb")
    with tq.connect(path) as db:
        db.from_numpy("A", np.ones(3, np.float32))
    con = duckdb.connect(path)  # what earlier versions left in the file
    con.execute('CREATE VIEW "A" AS SELECT 1 AS d0, 1.0 AS val')
    con.close()
    with tq.connect(path) as db:
        assert db.sql('SELECT count(*) FROM "A"').fetchall() == [(3,)]
    con = duckdb.connect(path, read_only=True)
    assert not con.sql("SELECT * FROM duckdb_views() WHERE NOT internal").fetchall()
    con.close()


def test_files_of_the_earlier_layout_keep_working_in_main(tmp_path):
    """A file written when the catalog lived in ``main`` is read and written there."""
    path = str(tmp_path / "old.duckdb")
    with tq.connect(path) as db:
        db.from_numpy("A", np.arange(4, dtype=np.float32))
    con = duckdb.connect(path)  # rebuild it as the earlier layout had it
    con.execute("CREATE TABLE main.tensorql_catalog AS SELECT * FROM tq_internal.tensorql_catalog")
    con.execute("CREATE TABLE main.tq_chunks_1 AS SELECT * FROM tq_internal.tq_chunks_1")
    con.execute("CREATE SEQUENCE main.tensorql_chunk_table_seq START 2")
    con.execute("DROP TABLE tq_internal.tq_chunks_1")
    con.execute("DROP TABLE tq_internal.tensorql_catalog")
    con.execute("DROP SEQUENCE tq_internal.tensorql_chunk_table_seq")
    con.execute("DROP SCHEMA tq_internal")
    con.close()
    with tq.connect(path) as db:
        assert db.tensor("A").numpy().tolist() == [0.0, 1.0, 2.0, 3.0]
        db.from_numpy("B", np.ones(2, np.float32))
        assert sorted(db.tensors()) == ["A", "B"]
    con = duckdb.connect(path, read_only=True)
    try:
        schemas = {r[0] for r in con.sql("SELECT schema_name FROM duckdb_tables()").fetchall()}
        assert schemas == {"main"}  # nothing was moved or duplicated
    finally:
        con.close()
