"""Plain SQL against DuckDB itself, from fuzzing (session 25): a caller's DataFrame gives way
to a table the script creates under its name; ``USE`` of another database leaves the
session's tensors where they are."""

from __future__ import annotations

import duckdb
import numpy as np
import pandas as pd
import pytest

import tensorql as tq


@pytest.mark.parametrize("script", [
    "CREATE TABLE df AS SELECT 100 AS x; SELECT * FROM df",
    "CREATE TEMP TABLE df AS SELECT 100 AS x; SELECT * FROM df",
    "SELECT sum(x) FROM df; CREATE VIEW DF AS SELECT 7 AS x; SELECT * FROM df",
    "SELECT * FROM df",
])
def test_a_table_the_script_creates_wins_over_the_caller_s_frame(script):
    df = pd.DataFrame({"x": [1, 2, 3]})  # noqa: F841 - read by name in the scripts
    expected = duckdb.connect().sql(script).fetchall()
    assert tq.connect().sql(script).fetchall() == expected


@pytest.mark.parametrize("path", [None, "file"])
def test_use_of_another_database_keeps_the_tensors_reachable(tmp_path, path):
    db = tq.connect(None if path is None else str(tmp_path / "t.duckdb"))
    db.from_numpy("A", np.arange(4.0))
    db.sql("ATTACH ':memory:' AS o")
    db.sql("USE o")
    assert db.sql("SELECT 1").fetchall() == [(1,)]
    assert db.sql("SELECT current_database()").fetchall() == [("o",)]
    assert db.sql("SELECT sum(val) FROM A").fetchall() == [(6.0,)]
    db.sql("CREATE TABLE t AS SELECT 5 AS x")
    assert db.sql("SELECT * FROM o.main.t").fetchall() == [(5,)]
    db.from_numpy("B", np.ones(3))
    assert db.tensors() == ["A", "B"]
    assert db.sql("SELECT * FROM EINSUM('i->', B)").fetchall() == [(3.0,)]
    np.testing.assert_array_equal(db.tensor("A").numpy(), np.arange(4.0))
    db.close()


def test_duckdb_s_query_interrupted_in_a_script_comes_through_as_keyboard_interrupt(
        monkeypatch):
    from tensorql.sql.statements import ScriptRunner

    db = tq.connect()

    def interrupted(self, *args, **kwargs):
        raise RuntimeError("Query interrupted")

    monkeypatch.setattr(ScriptRunner, "duckdb", interrupted)
    with pytest.raises(KeyboardInterrupt):
        db.sql("SELECT 1")
    monkeypatch.undo()
    assert db.sql("SELECT 1").fetchall() == [(1,)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])  # (float16 rows are FLOAT)
def test_rows_made_dense_keep_their_bits_one_row_a_cell(dtype):
    """-0.0 and a signalling NaN's payload survive ``SELECT * FROM t`` made dense and
    ``CREATE TENSOR ... AS SELECT * FROM t`` (they were added to a 0.0: +0.0, a quiet NaN);
    duplicate coordinates still add up."""
    db = tq.connect()
    signalling = {np.float64: 0x7FF4000000000001, np.float32: 0x7FBFFFFF}[dtype]
    bits = np.dtype(dtype).itemsize * 8
    nan = np.array([signalling], dtype=f"uint{bits}").view(dtype)[0]
    a = np.array([-0.0, 1.5, nan, -2.0], dtype=dtype)
    db.from_numpy("S", a)
    dense = db.sql('SELECT * FROM "S"').numpy()
    db.sql('CREATE TENSOR C AS SELECT * FROM "S"')
    for got in (dense, db.tensor("C").numpy()):
        assert got.dtype == a.dtype
        np.testing.assert_array_equal(got.view(f"uint{bits}"), a.view(f"uint{bits}"))
    rows = "(VALUES (0, 1.0), (0, 2.0), (1, 4.0)) t(i, val)"
    np.testing.assert_array_equal(db.sql(f"SELECT * FROM {rows}").numpy(), [3.0, 4.0])


@pytest.mark.parametrize("mode, expected", [
    ("line", ["[2024-01-02, NULL]", "{k=1}", "{'x': 1.5}", "3 days", "1234567.0"]),
    ("json", ['"d":["2024-01-02", null]', '"m":{"k": 1}', '"s":{"x": 1.5}', '"i":"3 days"',
              '"f":1234567.0']),
])
def test_the_shell_writes_nested_values_as_duckdb_does(capsys, mode, expected):
    from tensorql.cli import main

    query = ("SELECT [DATE '2024-01-02', NULL] d, MAP {'k': 1} m, {'x': 1.5} s, "
             "INTERVAL 3 DAY i, 1234567.0::DOUBLE f")
    assert main(["-c", query, "--mode", mode]) == 0
    out = capsys.readouterr().out
    for piece in expected:
        assert piece in out
    assert "datetime" not in out and "Decimal" not in out
