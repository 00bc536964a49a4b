"""Issue 32: ``db.sql()`` results used like DuckDB relations, each against DuckDB itself as
the oracle, and local DataFrames / Arrow tables usable by name (DuckDB's replacement scans)."""

from __future__ import annotations

import importlib.util
import sys

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tensorql as tq

QUERY = ("SELECT range AS i, range / 2 AS x, 'r' || range AS s, range % 2 = 0 AS even, "
         "range::TINYINT AS t FROM range(7)")


@pytest.fixture
def small(db):
    db.from_numpy("A", np.arange(6, dtype=np.float32).reshape(2, 3))
    return db


def test_description_types_shape_match_duckdb(small):
    r, want = small.sql(QUERY), duckdb.sql(QUERY)
    assert r.types == [str(t) for t in want.types]
    assert r.types == ["BIGINT", "DOUBLE", "VARCHAR", "BOOLEAN", "TINYINT"]
    assert r.dtypes == r.types
    assert [(d[0], str(d[1])) for d in r.description] == \
        [(d[0], str(d[1])) for d in want.description]
    assert all(d[2:] == (None,) * 5 for d in r.description)
    assert r.shape == want.shape == (7, 5) and r.columns == want.columns


def test_tensor_results_describe_their_element_rows(small):
    r = small.sql("SELECT * FROM EINSUM('ij->ij', A)")
    assert r.columns == ["i", "j", "val"] and r.shape == (6, 3)
    assert r.types == ["BIGINT", "BIGINT", "FLOAT"]


def test_df_and_fetchdf_match_duckdb(small):
    r = small.sql(QUERY)
    pd.testing.assert_frame_equal(r.df(), duckdb.sql(QUERY).df())
    pd.testing.assert_frame_equal(r.fetchdf(), duckdb.sql(QUERY).fetchdf())
    rows = small.sql("SELECT * FROM EINSUM('ij->i', A)").df()
    assert rows.to_dict("list") == {"i": [0, 1], "val": [3.0, 12.0]}


def test_pl_gives_polars_or_says_it_is_missing(small):
    r = small.sql(QUERY)
    if importlib.util.find_spec("polars") is None:
        with pytest.raises(tq.UnsupportedError, match="pl\\(\\) needs polars"):
            r.pl()
    else:
        assert r.pl().to_arrow().equals(duckdb.sql(QUERY).pl().to_arrow())


def test_df_and_pl_say_which_package_is_missing(small, monkeypatch):
    r = small.sql(QUERY)
    monkeypatch.setitem(sys.modules, "pandas", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "polars", None)
    with pytest.raises(tq.UnsupportedError, match="df\\(\\) / fetchdf\\(\\) needs pandas"):
        r.df()
    with pytest.raises(tq.UnsupportedError, match="pl\\(\\) needs polars, which is not"):
        r.pl()


def test_relational_chaining_matches_duckdb(small):
    r, want = small.sql(QUERY), duckdb.sql(QUERY)
    assert r.filter("even").fetchall() == want.filter("even").fetchall()
    assert r.project("i + 1 AS k", "s").fetchall() == want.project("i + 1 AS k, s").fetchall()
    assert r.order("x DESC").limit(3).fetchall() == want.order("x DESC").limit(3).fetchall()
    assert r.limit(2, offset=3).fetchall() == want.limit(2, offset=3).fetchall()
    assert r.aggregate("even, sum(x) AS total", "even").order("even").fetchall() == \
        want.aggregate("even, sum(x) AS total", "even").order("even").fetchall()
    assert sorted(r.project("even").distinct().fetchall()) == [(False,), (True,)]
    chained = r.filter("i > 2").order("i DESC")
    assert chained.types == ["BIGINT", "DOUBLE", "VARCHAR", "BOOLEAN", "TINYINT"]
    assert chained.fetchone() == (6, 3.0, "r6", True, 6)


def test_relational_chaining_over_a_tensor_result(small):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    r = small.sql("SELECT * FROM EINSUM('ij->ij', A)")
    big = r.filter("val > 2").order("val DESC").fetchall()
    assert big == [(int(i), int(j), float(a[i, j])) for i, j in
                   sorted(zip(*np.nonzero(a > 2)), key=lambda ij: -a[ij])]
    assert r.aggregate("i, sum(val) AS s", "i").order("i").fetchall() == \
        [(0, float(a[0].sum())), (1, float(a[1].sum()))]


def test_to_table_write_parquet_write_csv(small, tmp_path):
    r = small.sql(QUERY)
    r.to_table("copied")
    assert small.sql("SELECT * FROM copied ORDER BY i").fetchall() == \
        duckdb.sql(QUERY).fetchall()
    r.write_parquet(tmp_path / "r.parquet")
    assert pq.read_table(tmp_path / "r.parquet").to_pydict() == r.arrow().to_pydict()
    r.write_csv(tmp_path / "r.csv")
    back = duckdb.read_csv(str(tmp_path / "r.csv")).fetchall()
    assert back == duckdb.sql(QUERY).fetchall()
    t = small.sql("SELECT * FROM EINSUM('ij->i', A)")
    t.to_table("sums")
    assert small.sql("SELECT * FROM sums ORDER BY i").fetchall() == [(0, 3.0), (1, 12.0)]


def test_repr_html_is_a_bounded_escaped_table(small):
    r = small.sql("SELECT range AS x, '<b>' AS tag FROM range(100)")
    out = r._repr_html_()
    assert out.startswith("<table>") and out.count("<tr>") == 41
    assert "&lt;b&gt;" in out and "<b>" not in out and "100 rows (40 shown)" in out
    t = small.sql("SELECT * FROM EINSUM('ij->ij', A)")._repr_html_()
    assert t.count("<tr>") == 7 and "<td>5.0</td>" in t  # floats in full, as DuckDB's box
    e = small.sql("EXPLAIN SELECT * FROM EINSUM('ij->i', A)")._repr_html_()
    assert e.startswith("<pre>")


def test_local_frames_are_usable_by_name(small):
    df_prices = pd.DataFrame({"k": [0, 1, 2], "p": [1.5, 2.5, 4.0]})  # noqa: F841 - by name
    arrow_qty = pa.table({"k": [0, 2], "q": [10, 3]})  # noqa: F841 - read by name in SQL
    got = small.sql("SELECT p.k, p * q AS cost FROM df_prices p JOIN arrow_qty USING (k) "
                    "ORDER BY k").fetchall()
    assert got == [(0, 15.0), (2, 12.0)]
    # as a relation operand of EINSUM too
    vec = pd.DataFrame({"j": [0, 1, 2], "val": [1.0, 10.0, 100.0]})  # noqa: F841
    r = small.sql("SELECT * FROM EINSUM('ij,j->i', A, (SELECT j, val FROM vec))")
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(r.numpy(), a @ np.array([1.0, 10.0, 100.0]))
    # registered for the statement only, and a table of the database wins over a variable
    assert "df_prices" not in [row[0] for row in small.sql("SHOW TABLES").fetchall()]
    small.sql("CREATE TABLE arrow_qty AS SELECT 7 AS k")
    assert small.sql("SELECT * FROM arrow_qty").fetchall() == [(7,)]
    a = pd.DataFrame({"other": [1]})  # noqa: F841 - the stored tensor A wins (any case)
    assert small.sql("SELECT count(*) FROM a").fetchall() == [(6,)]
    assert small.sql("SELECT * FROM EINSUM('ij->', a)").numpy() == 15.0


def test_a_missing_name_is_still_duckdbs_error(small):
    not_a_frame = [1, 2, 3]  # noqa: F841 - a list is not scanned
    with pytest.raises(tq.TensorQLError, match="not_a_frame"):
        small.sql("SELECT * FROM not_a_frame")


def test_a_uhugeint_past_2_127_keeps_its_value_on_every_face():
    """DuckDB's Arrow export reads UHUGEINT as signed decimal128: 2**127 + 5 came back
    negative. Oracle: the value written in the query."""
    big = 2**128 - 1
    query = f"SELECT {big}::UHUGEINT AS m, 5::UHUGEINT AS s, 1 AS x"
    with tq.connect() as db:
        assert [int(v) for v in db.sql(query).fetchall()[0]] == [big, 5, 1]
        assert db.sql(query).types[0] == "UHUGEINT"
        assert [int(v) for v in db.sql(query).filter("x > 0").fetchall()[0]] == [big, 5, 1]
        assert int(db.sql(query).fetchnumpy()["m"][0]) == big
        assert int(db.sql(query).df()["m"][0]) == big
        assert str(big) in str(db.sql(query))
        pytest.importorskip("polars")
        assert db.sql(query).pl()["m"][0] == str(big)  # polars has no type for it: its text


def test_a_union_column_reaches_pandas_numpy_and_polars_as_text():
    query = ("SELECT union_value(num := 2)::UNION(num INT, str VARCHAR) AS u UNION ALL "
             "SELECT union_value(str := 'ab')::UNION(num INT, str VARCHAR) ORDER BY 1")
    with tq.connect() as db:
        want = sorted(str(v) for (v,) in duckdb.sql(query).fetchall())
        assert sorted(db.sql(query).df()["u"]) == want
        assert sorted(db.sql(query).fetchnumpy()["u"]) == want
        pytest.importorskip("polars")
        assert sorted(db.sql(query).pl()["u"]) == want
