"""Plain SQL through ``db.sql`` gives what DuckDB's own Python API gives for the statement
(the oracle: a fresh ``duckdb.connect()`` running it): values in fetchall / fetchone /
iteration, ``types`` / ``description``, ``df`` / ``pl`` / ``fetchnumpy`` column names; the
statement runs once and ``.arrow()`` stays DuckDB's Arrow export."""

from __future__ import annotations

import datetime

import duckdb
import pytest

import tensorql as tq

UUID = "uuid '12345678-1234-5678-1234-567812345678'"
QUERIES = [
    # Arrow's encoding is not the value: BIT, BIGNUM (VARINT), TIME WITH TIME ZONE
    "SELECT '101'::BIT, 12345678901234567890123::VARINT, TIMETZ '12:00:00+05'",
    "SELECT (-12345678901234567890)::VARINT AS n, 0::VARINT AS z, ''::BIT AS e, NULL::BIT",
    "SELECT [TIMETZ '12:00:00+05', NULL, TIMETZ '24:00:00+15:59'] AS a, "
    "{'x': [TIMETZ '01:02:03.5-03:30']} AS b, MAP {TIMETZ '12:00:00+05': 1} AS c",
    "SELECT * FROM (VALUES (1, [TIMETZ '12:00:00+05']), (2, NULL), (3, [])) t(i, l) "
    "ORDER BY i DESC",
    # TIME '24:00:00' inside a list / struct / map
    "SELECT [TIME '24:00:00'] AS l, {'t': TIME '24:00:00'} AS s, MAP {1: TIME '24:00:00'} m",
    # Python types: INTERVAL, MAP, HUGEINT, UUID, TIMESTAMP_NS, ARRAY, top level and nested
    f"SELECT INTERVAL 3 MONTH + INTERVAL 1 MICROSECOND AS i, MAP {{'a': 1}} AS m, "
    f"2::HUGEINT ** 70 AS h, {UUID} AS u, TIMESTAMP_NS '2020-01-01 00:00:00.123456789' AS ns",
    f"SELECT [INTERVAL 3 MONTH] AS i, [MAP {{'a': 1}}] AS m, {{'h': 1::HUGEINT}} AS h, "
    f"[{UUID}] AS u, [TIMESTAMP_NS '2020-01-01 00:00:00.123456789'] AS ns, "
    "[1, 2]::INTEGER[2] AS a, MAP {[1]: 'a'} AS k, [(2::UHUGEINT ** 127)::UHUGEINT + 5] AS w",
    # out-of-range dates and timestamps nested
    "SELECT ['infinity'::DATE, '-infinity'::DATE], [DATE '0044-03-15 (BC)'], "
    "[TIMESTAMP 'infinity'], {'d': '10000-01-01'::DATE}",
]


@pytest.fixture
def db():
    with tq.connect() as database:
        yield database


@pytest.mark.parametrize("query", QUERIES)
def test_rows_types_and_description_are_duckdbs(db, query):
    oracle = duckdb.connect().sql(query)
    want = oracle.fetchall()
    assert db.sql(query).fetchall() == want
    assert db.sql(query).fetchone() == want[0]
    assert list(db.sql(query)) == want
    result = db.sql(query)
    assert result.types == [str(t) for t in oracle.types]
    assert result.description == [(name, str(kind), None, None, None, None, None)
                                  for name, kind in zip(oracle.columns, oracle.types)]


def test_types_name_duckdbs_own_types(db):
    query = (f"SELECT 1::HUGEINT, 'a'::ENUM('a', 'b'), '{{}}'::JSON, {UUID}, '1'::BIT, "
             "TIMETZ '12:00:00+05', [1::HUGEINT]")
    assert db.sql(query).types == ["HUGEINT", "ENUM('a', 'b')", "JSON", "UUID", "BIT",
                                   "TIME WITH TIME ZONE", "HUGEINT[]"]


def test_a_parameter_past_64_bits_is_an_int(db):
    assert db.sql("SELECT ?", [2**70]).fetchall() == [(2**70,)]


def test_arrow_stays_duckdbs_export_and_the_statement_runs_once(db):
    query = "SELECT '101'::BIT AS b, [TIMETZ '12:00:00+05'] AS t, 1 AS a, 2 AS a"
    assert db.sql(query).arrow().equals(duckdb.connect().sql(query).to_arrow_table(),
                                        check_metadata=True)
    db.sql("CREATE SEQUENCE s")
    result = db.sql("SELECT nextval('s') AS n, TIMETZ '12:00:00+05' AS t")
    assert result.fetchall()[0][0] == 1
    assert db.sql("SELECT nextval('s')").fetchall() == [(2,)]


def test_out_of_range_nested_values_reach_the_shell(capsys):
    from tensorql.cli import main

    assert main(["-c", "SELECT ['infinity'::DATE] AS d, '101'::BIT AS b"]) == 0
    out = capsys.readouterr().out
    assert "9999" in out and "101" in out and "BIT" in out
    assert main(["--mode", "json", "-c", "SELECT {'d': '10000-01-01'::DATE} AS d"]) == 0
    assert "10000-01-01" in capsys.readouterr().out


def test_df_of_a_struct_holding_24_oclock(db):
    query = "SELECT {'t': TIME '24:00:00'} AS s, 1 AS n"
    frame = db.sql(query).df()
    assert frame["s"].tolist() == duckdb.connect().sql(query).df()["s"].tolist()
    assert frame["n"].tolist() == [1]


@pytest.mark.parametrize("query", ["SELECT 1 AS a, 2 AS a", "SELECT 1 a, 2 a, 3 A",
                                   "SELECT 1 a, 2 a_1, 3 A, 4 a", "SELECT 1 a, 2 a, 3 a_1"])
def test_repeated_names_are_suffixed_as_duckdb_does(db, query):
    oracle = duckdb.connect().sql(query)
    want = list(oracle.df().columns)
    assert list(db.sql(query).df().columns) == want
    assert list(db.sql(query).fetchnumpy()) == want
    polars = pytest.importorskip("polars")
    assert db.sql(query).pl().columns == oracle.pl().columns and polars is not None


def test_time_with_time_zone_keeps_its_offset(db):
    value = db.sql("SELECT TIMETZ '12:00:00.5-03:30'").fetchone()[0]
    assert value == datetime.time(12, 0, 0, 500000,
                                  tzinfo=datetime.timezone(-datetime.timedelta(hours=3.5)))
