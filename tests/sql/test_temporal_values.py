"""Dates, times and timestamps Python cannot hold (DuckDB's 'infinity', years past 9999 or
before 1, TIME '24:00:00') reach every face of a result as DuckDB's own text for them, never
an OverflowError from Arrow nor midnight for 24:00:00. Oracle: DuckDB's ``CAST(x AS
VARCHAR)`` of the same values."""

from __future__ import annotations

import datetime

import duckdb
import pytest

import tensorql as tq
from tensorql.sql.temporal import python_values, text_where_unrepresentable

ODD = {  # SQL literal -> type
    "'infinity'::DATE": "DATE", "'-infinity'::DATE": "DATE", "DATE '294247-01-10'": "DATE",
    "DATE '0044-03-15 (BC)'": "DATE", "'infinity'::TIMESTAMP": "TIMESTAMP",
    "'-infinity'::TIMESTAMP": "TIMESTAMP", "TIMESTAMP '12345-06-07 08:09:10.5'": "TIMESTAMP",
    "TIMESTAMP '0044-03-15 (BC) 12:00:01.25'": "TIMESTAMP",
    "TIMESTAMP_MS '12345-01-01 00:00:00.123'": "TIMESTAMP_MS",
    "TIMESTAMP_S '12345-01-01'": "TIMESTAMP_S", "'infinity'::TIMESTAMP_NS": "TIMESTAMP_NS",
    "'infinity'::TIMESTAMPTZ": "TIMESTAMPTZ", "TIME '24:00:00'": "TIME",
}


@pytest.mark.parametrize("literal", sorted(ODD))
def test_values_python_cannot_hold_are_duckdbs_text(literal):
    con = duckdb.connect()
    con.sql("SET TimeZone = 'UTC'")
    want = con.sql(f"SELECT CAST({literal} AS VARCHAR)").fetchall()[0][0]
    column = con.sql(f"SELECT {literal} AS v").to_arrow_table().column("v")
    assert python_values(column) == [want]


def test_representable_values_stay_python_objects():
    con = duckdb.connect()
    column = con.sql("SELECT * FROM (VALUES (DATE '2024-02-29'), (NULL), ('infinity'::DATE))"
                     " AS t(d)").to_arrow_table().column("d")
    assert python_values(column) == [datetime.date(2024, 2, 29), None, "infinity"]
    table = text_where_unrepresentable(con.sql("SELECT DATE '2024-02-29' AS d, TIME "
                                               "'23:59:59' AS t").to_arrow_table())
    assert table.column("d").to_pylist() == [datetime.date(2024, 2, 29)]  # unchanged


def test_every_face_of_a_result_shows_them():
    with tq.connect() as db:
        query = ("SELECT 'infinity'::DATE AS d, TIMESTAMP '12345-06-07 08:09:10' AS ts, "
                 "TIME '24:00:00' AS t, 7 AS n")
        want = ("infinity", "12345-06-07 08:09:10", "24:00:00", 7)
        assert db.sql(query).fetchall() == [want]
        assert db.sql(query).fetchone() == want
        for text in (str(db.sql(query)), repr(db.sql(query)), db.sql(query)._repr_html_()):
            assert "infinity" in text and "24:00:00" in text and "12345-06-07" in text
        frame = db.sql(query).df()
        assert frame.iloc[0].tolist() == list(want)
        arrays = db.sql(query).fetchnumpy()
        assert [arrays[name][0] for name in ("d", "ts", "t", "n")] == list(want)
        polars = pytest.importorskip("polars")
        assert db.sql(query).pl().row(0) == want and polars is not None


def test_the_shell_modes_show_them_and_keep_every_column(tmp_path, capsys):
    from tensorql.cli import main

    query = "SELECT 'infinity'::DATE AS d, TIME '24:00:00' AS t, 1 AS a, 2 AS a, 'x|y' AS \"p|q\""
    for mode, want in (("json", '[{"d":"infinity","t":"24:00:00","a":1,"a":2,"p|q":"x|y"}]'),
                       ("csv", "d,t,a,a,p|q\ninfinity,24:00:00,1,2,x|y"),
                       ("markdown", "| infinity | 24:00:00 |   1 |   2 | x\\|y |")):
        assert main(["--mode", mode, "-c", query]) == 0
        out = capsys.readouterr().out
        assert want in out
        if mode == "markdown":
            assert "p\\|q" in out.splitlines()[0]


def test_intervals_reach_polars_as_durations():
    polars = pytest.importorskip("polars")
    with tq.connect() as db:
        frame = db.sql("SELECT INTERVAL 3 DAY + INTERVAL 5 SECOND AS iv, 1 AS n").pl()
        assert frame.schema["iv"] == polars.Duration("ns")
        assert frame.row(0) == (datetime.timedelta(days=3, seconds=5), 1)
        with pytest.raises(tq.TensorQLError, match="months"):
            db.sql("SELECT INTERVAL 1 MONTH AS iv").pl()
