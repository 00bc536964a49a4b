"""Fuzz round 24 of the SQL face: parameters pasted as literals, EINSUM in views, names that
clash, NULL labels, many labels, unreadable caller frames, case-insensitive DROP TENSOR.
Each answer is checked against plain DuckDB or numpy."""

from __future__ import annotations

import subprocess
import sys

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import tensorql as tq
from tensorql.cli import main
from tensorql.sql.errors import SQLExecutionError


@pytest.fixture
def db():
    with tq.connect() as session:
        session.from_numpy("A", np.ones((2, 3)))
        session.sql("CREATE TABLE v AS SELECT range AS j, 10.0 AS val FROM range(3)")
        yield session


def _plain(sql: str, params: list) -> list:
    """What plain DuckDB answers, over the same table v."""
    con = duckdb.connect()
    con.execute("CREATE TABLE v AS SELECT range AS j, 10.0 AS val FROM range(3)")
    return con.execute(sql, params).fetchall()


@pytest.mark.parametrize("expr", ["val-?", "val-? * 0 + 1", "2*-?", "3 - -?", "val - ?::DOUBLE",
                                  "val * ?::DOUBLE", "-$1"])
@pytest.mark.parametrize("value", [-5, 5])
def test_parameters_bind_as_in_duckdb(db, expr, value):
    # a negative value after '-' once made '--5', a line comment; '?::' once did not parse
    inner = f"SELECT j, ({expr})::DOUBLE AS val FROM v"
    want = np.ones((2, 3)) @ np.array([float(row[1]) for row in _plain(inner, [value])])
    got = db.sql(f"SELECT * FROM EINSUM('ij,j->i', A, ({inner}))", [value]).numpy()
    np.testing.assert_allclose(got, want)


@pytest.mark.parametrize("statement", [
    "CREATE VIEW ev AS SELECT * FROM EINSUM('ij->j', A)",
    "CREATE OR REPLACE TEMP VIEW ev AS WITH c AS (SELECT * FROM EINSUM('ij->j', A)) "
    "SELECT * FROM c",
    "CREATE MACRO ev() AS TABLE SELECT * FROM EINSUM('ij->j', A)",
    "EXPLAIN CREATE VIEW ev AS SELECT * FROM EINSUM('ij->j', A)",
])
def test_einsum_in_a_view_or_macro_is_refused(db, statement):
    with pytest.raises(SQLExecutionError, match="CREATE TENSOR t AS") as info:
        db.sql(statement)
    assert statement[info.value.position:].startswith("EINSUM(")
    names = db.sql("SELECT view_name FROM duckdb_views() UNION ALL "
                   "SELECT function_name FROM duckdb_functions()").fetchall()
    assert ("ev",) not in names
    db.sql("CREATE TABLE t AS SELECT * FROM EINSUM('ij->j', A)")  # what it advises
    db.sql("CREATE VIEW ev AS SELECT * FROM t")
    assert sorted(db.sql("SELECT j, val FROM ev").fetchall()) == [(0, 2.0), (1, 2.0), (2, 2.0)]


@pytest.mark.parametrize("statement, target", [
    ("ALTER TABLE e RENAME TO a", "a"),
    ("ALTER TABLE IF EXISTS main.e RENAME TO \"A\"", '"A"'),
    ("ALTER TABLE e RENAME TO a__CHUNKS", "a__CHUNKS"),
    ("ALTER VIEW w RENAME TO a", "a"),
])
def test_rename_to_a_tensors_name_is_refused(db, statement, target):
    db.sql("CREATE TABLE e AS SELECT 1 AS x")
    db.sql("CREATE VIEW w AS SELECT 2 AS x")
    with pytest.raises(SQLExecutionError, match="clashes with the stored tensor 'A'") as info:
        db.sql(statement)
    assert statement[info.value.position:] == target
    assert db.sql("SELECT * FROM e").fetchall() == [(1,)]  # nothing renamed
    assert db.sql("SELECT * FROM w").fetchall() == [(2,)]
    db.sql("ALTER TABLE e RENAME TO e2")  # other renames still work
    db.sql("ALTER TABLE e2 RENAME COLUMN x TO a")
    assert db.sql("SELECT a FROM e2").fetchall() == [(1,)]


_TEMP_NAMES = """
import numpy as np, tensorql as tq
db = tq.connect()
db.from_numpy("A", np.ones((2, 3)))
db.sql("CREATE TABLE v AS SELECT range AS j, 10.0 AS val FROM range(3)")
names = [f"__tq_einsum_{k}" for k in range(3)] + [f"__tq_rows_{k}" for k in range(3)]
for name in names:
    db.sql(f'CREATE TENSOR "{name}" AS SELECT i, 7.0 AS val FROM range(5) r(i)')
for _ in range(3):
    print(db.sql("SELECT count(*) FROM EINSUM('ij->i', A)").fetchall(),
          db.sql("SELECT sum(val) AS s FROM EINSUM('ij,j->i', A, v)").fetchall())
print(set(names) <= set(db.tensors()))
"""


def test_a_tensor_named_like_a_temporary_table():
    # in a new process: the temporary names were a counter from 0 in each process
    run = subprocess.run([sys.executable, "-c", _TEMP_NAMES], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["[(2,)] [(60.0,)]"] * 3 + ["True"]


@pytest.mark.parametrize("query", [
    "SELECT NULL::BIGINT AS i, val FROM EINSUM('ij->i', A)",
    "SELECT CASE WHEN i = 0 THEN NULL ELSE i END AS i, val FROM EINSUM('ij->i', A)",
])
def test_null_labels_in_a_result(db, query):
    assert any(row[0] is None for row in db.sql(query).fetchall())  # the rows are fine
    with pytest.raises(tq.TensorQLError, match="column 'i' has NULL indices"):
        db.sql(query).numpy()
    with pytest.raises(tq.TensorQLError, match="column 'i' has NULL indices"):
        db.sql(f"CREATE TENSOR z AS {query}")
    assert "z" not in db.tensors()


def test_null_labels_from_the_cli_leave_no_database(tmp_path, capsys):
    path = tmp_path / "new.duckdb"
    code = main(["sql", "CREATE TENSOR z AS SELECT NULL::BIGINT AS i, 1.0 AS val",
                 "--db", str(path)])
    assert code != 0 and "has NULL indices" in capsys.readouterr().err
    assert not path.exists()


@pytest.mark.parametrize("n", [26, 27, 53, 60])
def test_more_than_26_labels_over_relations(db, n):
    labels = [chr(0x3B1 + k) if k < 25 else chr(0x410 + k) for k in range(n)]
    ops = ", ".join(f"(SELECT 0 AS i, {1 + k / 100} AS val)" for k in range(n))
    got = db.sql(f"SELECT * FROM EINSUM('{','.join(labels)}->', {ops})").fetchall()
    np.testing.assert_allclose(got[0][0], np.prod([1 + k / 100 for k in range(n)]))


def test_a_step_over_more_than_52_labels_is_an_error(db):
    labels = "".join(chr(0x410 + k) for k in range(54))
    columns = ", ".join(f"0 AS c{k}" for k in range(54))
    with pytest.raises(tq.TensorQLError, match="more labels than torch.einsum takes"):
        db.sql(f"SELECT * FROM EINSUM('{labels}->{labels}', (SELECT {columns}, 2.0 AS val))")


def test_frames_duckdb_cannot_scan(db):
    h = pa.table({"j": pa.array([0, 1], pa.int64()), "val": pa.array([1.0, 2.0], pa.float16())})
    c = pd.DataFrame({"j": [0, 1], "val": [1 + 2j, 2.0]})
    assert h.num_rows == len(c) == 2  # read by name below
    for name, words in (("h", "pyarrow Table 'h'"), ("c", "pandas DataFrame 'c'")):
        for query in (f"SELECT * FROM {name}", f"SELECT * FROM EINSUM('ij,j->i', A, {name})"):
            with pytest.raises(SQLExecutionError, match=words) as info:
                db.sql(query)
            assert query[info.value.position:].startswith(name)
    # only an alias: the query runs (numpy: A summed over j)
    got = db.sql("SELECT h.val FROM EINSUM('ij->i', A) AS h ORDER BY h.i").fetchall()
    assert got == [(3.0,), (3.0,)]
    assert db.sql("SELECT c.x FROM (SELECT 1 AS x) AS c").fetchall() == [(1,)]


def test_drop_and_replace_tensor_resolve_case_insensitively(db):
    db.sql("CREATE TENSOR Z AS SELECT i, 1.0 AS val FROM range(3) r(i)")
    db.sql("CREATE OR REPLACE TENSOR z AS SELECT i, 2.0 AS val FROM range(3) r(i)")
    assert db.tensors() == ["A", "Z"]  # replaced, the stored spelling kept
    np.testing.assert_array_equal(db.tensor("Z").numpy(), np.full(3, 2.0))
    with pytest.raises(SQLExecutionError, match="already exists"):
        db.sql("CREATE TENSOR z AS SELECT i, 3.0 AS val FROM range(3) r(i)")
    assert db.sql("DROP TENSOR IF EXISTS z").fetchall() == [("DROP TENSOR Z",)]
    assert db.tensors() == ["A"]
    db.sql("CREATE TENSOR Z AS SELECT 1.0 AS val")
    db.sql("DROP TENSOR z")
    assert db.tensors() == ["A"]
    with pytest.raises(tq.TensorQLError, match="unknown tensor 'z'"):
        db.sql("DROP TENSOR z")


def test_quoted_names_stay_exact(db):
    db.sql("CREATE TENSOR Z AS SELECT 1.0 AS val")
    assert db.sql('DROP TENSOR IF EXISTS "z"').fetchall() == [('DROP TENSOR z: not present',)]
    with pytest.raises(tq.TensorQLError, match="clashes with the stored tensor 'Z'"):
        db.sql('CREATE OR REPLACE TENSOR "z" AS SELECT 2.0 AS val')
    assert db.tensors() == ["A", "Z"]


def test_a_view_reads_no_other_querys_rows_in_a_new_process(tmp_path):
    path = str(tmp_path / "w.duckdb")
    with tq.connect(path) as session:
        session.from_numpy("B", np.full((4, 5), 7.0))
        with pytest.raises(SQLExecutionError):
            session.sql("CREATE VIEW ev AS SELECT * FROM EINSUM('ij->j', B)")
    code = ("import sys, tensorql as tq\n"
            "db = tq.connect(sys.argv[1])\n"
            "print(db.sql(\"SELECT count(*) FROM duckdb_views() WHERE view_name = 'ev'\")"
            ".fetchall())\n")
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[(0,)]"
