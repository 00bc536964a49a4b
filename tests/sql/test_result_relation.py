"""``db.sql()`` results behave like DuckDB relations (issue 16: what users expect)."""

from __future__ import annotations

import numpy as np
import pytest

import tensorql as tq


@pytest.fixture
def small(db):
    db.from_numpy("A", np.arange(6, dtype=np.float32).reshape(2, 3))
    return db


def test_fetch_methods_walk_the_rows_once(small):
    r = small.sql("SELECT * FROM EINSUM('ij->ij', A)")
    assert len(r) == 6 and r.columns == ["i", "j", "val"]
    assert r.fetchone() == (0, 0, 0.0)
    assert r.fetchmany(2) == [(0, 1, 1.0), (0, 2, 2.0)]
    assert r.fetchall() == [(1, 0, 3.0), (1, 1, 4.0), (1, 2, 5.0)]
    assert r.fetchone() is None and r.fetchall() == []
    assert list(r)[5] == (1, 2, 5.0)  # iteration starts from the top
    cols = r.fetchnumpy()
    assert cols["val"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and cols["j"].dtype == np.int64
    assert r.arrow().num_rows == 6 and np.asarray(r).shape == (2, 3)


def test_show_and_repr_are_bounded(small, capsys):
    r = small.sql("SELECT range AS x FROM range(1000)")
    r.show(max_rows=3)
    out = capsys.readouterr().out
    assert "1000 rows (3 shown)" in out and out.count("\n") < 12
    assert len(repr(r)) < 1000 and "1000 row(s)" in repr(r)
    big = small.sql("SELECT * FROM EINSUM('i,j->ij', (SELECT range AS i, 1.0 AS val FROM "
                    "range(2000)), (SELECT range AS j, 1.0 AS val FROM range(2000)))")
    assert repr(big) == "<SQLResult tensor (i, j) 2000x2000 float64>"
    text = str(big)  # only the rows shown are built
    assert "4000000 rows (40 shown)" in text


def test_query_parameters(small):
    assert small.sql("SELECT ? + 1 AS x", [41]).fetchall() == [(42,)]
    assert small.sql("SELECT $n * 2 AS x", {"n": 21}).fetchall() == [(42,)]
    r = small.sql("SELECT i, val FROM EINSUM('ij->i', A) WHERE val > ?", [5])
    assert r.fetchall() == [(1, 12.0)]
    with pytest.raises(tq.TensorQLError, match="single statement"):
        small.sql("SELECT ?; SELECT ?", [1])


def test_einsum_results_feed_further_sql(small):
    small.sql("CREATE TABLE sums AS SELECT * FROM EINSUM('ij->i', A)")
    small.sql("INSERT INTO sums SELECT i + 2, val FROM EINSUM('ij->i', A)")
    assert small.sql("SELECT * FROM sums ORDER BY i").fetchall() == [
        (0, 3.0), (1, 12.0), (2, 3.0), (3, 12.0)]
    assert small.sql("SELECT * FROM EINSUM('i->', sums)").numpy().tolist() == 30.0


def test_named_arguments_accept_duckdb_arrows_and_any_case(small):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    r = small.sql("SELECT * FROM EINSUM('ij,kj->ik', A, A, join => 'ADD', agg => 'Max')")
    assert np.allclose(r.numpy(), (a[:, None, :] + a[None, :, :]).max(-1))


@pytest.mark.parametrize("call, error, words", [
    (lambda r: r.filter("nope > 1"), tq.ExecutionError, "filter('nope > 1')"),
    (lambda r: r.filter("val >"), tq.ExecutionError, "filter('val >')"),
    (lambda r: r.project(""), tq.ExecutionError, "project('')"),
    (lambda r: r.order("nope"), tq.ExecutionError, "order('nope')"),
    (lambda r: r.aggregate("sum(nope)"), tq.ExecutionError, "aggregate('sum(nope)', '')"),
    (lambda r: r.limit(10**20), tq.ExecutionError, "limit(100000000000000000000, 0)"),
    (lambda r: r.limit(2.5), tq.ExecutionError, "limit(2.5, 0)"),
    (lambda r: r.to_table("v"), tq.ExecutionError, "to_table('v')"),
    (lambda r: r.write_csv("/nonexistent/dir/o.csv"), tq.StorageError, "write_csv("),
    (lambda r: r.write_parquet("/nonexistent/dir/o.parquet"), tq.StorageError, "write_parquet("),
])
def test_relational_methods_name_the_call_duckdb_refused(small, call, error, words):
    """Found by fuzzing (s9): DuckDB's Binder/Parser/Conversion/IO errors of a result's
    relational methods came out raw; the table the session already has is left as it was."""
    small.sql("CREATE TABLE v AS SELECT 7 AS x")
    r = small.sql("SELECT * FROM EINSUM('ij->ij', A)")
    with pytest.raises(error) as info:
        call(r)
    assert words in str(info.value)
    assert small.sql("SELECT * FROM v").fetchall() == [(7,)]
    assert r.filter("val > 4").fetchall() == [(1, 2, 5.0)]  # the result still works


def test_fetchnumpy_and_pl_keep_repeated_column_names_apart(small):
    """Found by fuzzing (s9): two EINSUMs joined gave columns i, val, i, val, and fetchnumpy
    raised pyarrow's KeyError, pl() polars' DuplicateError; as DuckDB's, a repeated name gets
    a suffix."""
    r = small.sql("SELECT * FROM EINSUM('ij->i', A) a, EINSUM('ij->i', A) b WHERE a.i = b.i")
    cols = r.fetchnumpy()
    assert list(cols) == ["i", "val", "i_1", "val_1"]
    assert cols["val"].tolist() == cols["val_1"].tolist() == [3.0, 12.0]
    pytest.importorskip("polars")
    assert r.pl().columns == ["i", "val", "i_1", "val_1"]
