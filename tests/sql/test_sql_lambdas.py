"""DuckDB lambdas as EINSUM joins: ``join := (a, b) -> a * exp(b)``.

Random extended einsums with random lambdas (the grammar of tests/user_algebra.py, written as
SQL) against numpy on one device and on three, on the DuckDB backend, and over sparse relation
operands (DuckDB's relational path runs the lambda's SQL); registered joins and aggregations
by name; every bad lambda is an error with the SQL position that leaves stored data as it was.
"""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorql as tq
from tensorql.sql.errors import SQLJoinFunctionError
from tests.user_algebra import (
    NUMPY_AGG,
    PARAMS,
    numpy_extended,
    numpy_fn,
    random_expr,
    random_spec,
)


def _case(seed: int):
    r = random.Random(seed)
    arity = r.choice((1, 2, 2, 3))
    equation, shapes = random_spec(r, arity)
    expr = random_expr(r, arity)
    agg = r.choice(("sum", "max", "min", "prod"))
    arrays = [np.random.default_rng(r.randint(0, 2**31)).uniform(0.5, 1.5, s) for s in shapes]
    return arity, equation, expr, agg, arrays


def _lambda(expr, arity: int) -> str:
    params = ", ".join(PARAMS[:arity])
    return f"({params}) -> {expr.sql()}"


@settings(max_examples=15, derandomize=True, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_random_sql_lambdas_against_numpy(db1, db3, seed):
    arity, equation, expr, agg, arrays = _case(seed)
    want = numpy_extended(equation, arrays, numpy_fn(expr), NUMPY_AGG[agg])
    names = ", ".join(f"L{k}" for k in range(arity))
    query = (f"SELECT * FROM EINSUM('{equation}', {names}, join := {_lambda(expr, arity)}, "
             f"agg := '{agg}')")
    for db in (db1, db3):
        for k, a in enumerate(arrays):
            db.from_numpy(f"L{k}", a, tile=tuple(max(1, min(2, n)) for n in a.shape),
                          replace=True)
        np.testing.assert_allclose(db.sql(query).numpy(), want, rtol=1e-9, atol=1e-12,
                                   err_msg=query)


@settings(max_examples=6, derandomize=True, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_random_sql_lambdas_on_the_duckdb_backend(db1, seed):
    arity, equation, expr, agg, arrays = _case(seed)
    want = numpy_extended(equation, arrays, numpy_fn(expr), NUMPY_AGG[agg])
    for k, a in enumerate(arrays):
        db1.from_numpy(f"D{k}", a, replace=True)
    names = ", ".join(f"D{k}" for k in range(arity))
    query = (f"SELECT * FROM EINSUM('{equation}', {names}, join := {_lambda(expr, arity)}, "
             f"agg := '{agg}', backend := 'duckdb')")
    np.testing.assert_allclose(db1.sql(query).numpy(), want, rtol=1e-9, atol=1e-12,
                               err_msg=query)


def _rows_sql(labels: str, rows) -> str:
    body = ", ".join("(" + ", ".join([*map(str, index), repr(float(v))]) + ")"
                     for index, v in rows)
    return f"(SELECT * FROM (VALUES {body}) AS t({', '.join([*labels, 'val'])}))"


@settings(max_examples=12, derandomize=True, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_lambdas_over_sparse_relations_run_as_duckdb_sql(db1, seed):
    """Relation operands stay sparse: the lambda's SQL runs inside DuckDB's join."""
    r = random.Random(seed)
    arity = r.choice((1, 2))
    terms = ["".join(r.sample("ijk", r.randint(1, 2))) for _ in range(arity)]
    used = sorted(set("".join(terms)))
    output = r.sample(used, r.randint(0, len(used)))
    sizes = {lab: r.randint(1, 3) for lab in used}
    expr = random_expr(r, arity)
    agg = r.choice(("sum", "max", "min"))
    relations = []
    for labels in terms:
        cells = list(itertools.product(*(range(sizes[lab]) for lab in labels)))
        picked = sorted(set(r.choice(cells) for _ in range(3)))
        relations.append([(index, r.uniform(0.5, 1.5)) for index in picked])
    fn = numpy_fn(expr)
    groups: dict[tuple, list] = {}
    for combo in itertools.product(*relations):
        bound: dict[str, int] = {}
        if all(bound.setdefault(lab, i) == i
               for labels, (index, _) in zip(terms, combo) for lab, i in zip(labels, index)):
            value = float(fn(*[np.float64(v) for _, v in combo]))
            groups.setdefault(tuple(bound[lab] for lab in output), []).append(value)
    expected = {key: {"sum": sum, "max": max, "min": min}[agg](v) for key, v in groups.items()}
    equation = ",".join(terms) + "->" + "".join(output)
    operands = ", ".join(_rows_sql(labels, rows) for labels, rows in zip(terms, relations))
    got = db1.sql(f"SELECT * FROM EINSUM('{equation}', {operands}, "
                  f"join := {_lambda(expr, arity)}, agg := '{agg}', sparse := true)").fetchall()
    assert [row[:-1] for row in got] == sorted(expected)
    for row in got:
        assert row[-1] == pytest.approx(expected[row[:-1]], rel=1e-9)


def test_registered_join_and_agg_by_name_in_sql(db1):
    tq.register_join("t_sql_hypot", lambda a, b: torch.sqrt(a * a + b * b),
                     sql="sqrt({0} * {0} + {1} * {1})")
    tq.register_agg("t_sql_absmax", lambda a, b: torch.maximum(a.abs(), b.abs()),
                    identity=0.0)
    a = np.array([[3.0, -1.0], [0.5, 2.0]])
    b = np.array([[4.0, 1.0], [-2.0, 1.5]])
    db1.from_numpy("HA", a, replace=True)
    db1.from_numpy("HB", b, replace=True)
    got = db1.sql("SELECT * FROM EINSUM('ij,jk->ik', HA, HB, join := 't_sql_hypot', "
                  "agg := 'T_SQL_ABSMAX')").numpy()
    want = np.abs(np.sqrt(a[:, :, None] ** 2 + b[None] ** 2)).max(1)
    np.testing.assert_allclose(got, want)
    rows = db1.sql("SELECT * FROM EINSUM('ij,jk->ik', " + _rows_sql("ij", [((0, 0), 3.0)])
                   + ", " + _rows_sql("jk", [((0, 1), 4.0)])
                   + ", join := 't_sql_hypot', sparse := true)").fetchall()
    assert rows == [(0, 1, 5.0)]


def test_the_same_lambda_is_the_same_join_and_explain_names_it(db1):
    db1.from_numpy("EA", np.ones((2, 3)), replace=True)
    text = "EXPLAIN SELECT * FROM EINSUM('ij,jk->ik', EA, EA, join := (x, y) -> x - 2 * y)"
    text = text.replace("EA, EA", "EA, EB")
    db1.from_numpy("EB", np.ones((3, 2)), replace=True)
    first, second = str(db1.sql(text)), str(db1.sql(text))
    assert first == second
    assert "join=join<(x, y) -> x - 2 * y>" in first
    got = db1.sql(text.removeprefix("EXPLAIN ")).numpy()
    np.testing.assert_allclose(got, np.full((2, 2), -3.0))


BAD = [
    ("(a, b) -> a * foo(b)", "function 'foo' is not allowed", "foo"),
    ("(a, b) -> a * c", "unknown name 'c'", "c)"),
    ("(a, b) -> a || 'x'", "not allowed", "a ||"),
    ("(a, b) -> a * 'x'", "is a string", "'x'"),
    ("(a) -> a", "takes 1 parameter(s) but EINSUM has 2", "a)"),
    ("(a, a) -> a", "distinct parameter names", "a, a"),
    ("(a, b) -> t.a + b", "unknown name 't.a'", "t.a"),
    # found by fuzzing (s16): a literal where a parameter's name goes was taken as a name
    ("(1, b) -> b", "parameters are names, one per operand; got '1'", "1, b"),
    ("(1.5, b) -> b", "got '1.5'", "1.5"),
    ("('a', b) -> b", "got the string 'a'", "'a', b"),
]


@pytest.mark.parametrize("body, message, at", BAD)
def test_bad_lambdas_are_errors_with_their_position(db1, body, message, at):
    data = np.arange(6.0).reshape(2, 3)
    db1.from_numpy("BA", data, replace=True)
    db1.from_numpy("BB", data.T.copy(), replace=True)
    before = sorted(db1.tensors())
    query = f"CREATE TENSOR never AS SELECT * FROM EINSUM('ij,jk->ik', BA, BB, join := {body})"
    with pytest.raises(SQLJoinFunctionError) as err:
        db1.sql(query)
    assert message in str(err.value)
    assert isinstance(err.value, tq.JoinFunctionError) and isinstance(err.value, tq.TensorQLError)
    assert err.value.position == query.index(at, query.index(":="))
    assert sorted(db1.tensors()) == before
    np.testing.assert_array_equal(db1.tensor("BA").numpy(), data)


def test_case_when_comparisons_and_logs_follow_duckdb(db1):
    a = np.array([[0.5, 2.0], [3.0, 1.0]])
    db1.from_numpy("CA", a, replace=True)
    body = ("(x, y) -> CASE WHEN x < y AND NOT x = 1 THEN log(x) ELSE ln(y) + log(2, x) END "
            "+ pow(x, 2) - x ^ 2 + sign(x - y) + x % 0.75")
    got = db1.sql(f"SELECT * FROM EINSUM('ij,jk->ik', CA, CA, join := {body})").numpy()
    x, y = a[:, :, None], a[None]
    value = np.where((x < y) & ~(x == 1), np.log10(x), np.log(y) + np.log2(x)) \
        + np.sign(x - y) + np.fmod(x, 0.75)
    np.testing.assert_allclose(got, value.sum(1), rtol=1e-12)
    # DuckDB itself reads the same body the same way (log is base 10 there)
    duck = db1.connection.execute(
        "SELECT CASE WHEN x < y AND NOT x = 1 THEN log(x) ELSE ln(y) + log(2, x) END "
        "+ pow(x, 2) - x ^ 2 + sign(x - y) + x % 0.75 FROM (VALUES (0.5, 2.0), (3.0, 0.5)) "
        "t(x, y)").fetchall()
    ours = [float(value[0, 0, 1]), float(value[1, 0, 0])]  # x = a[i, j], y = a[j, k]
    assert [row[0] for row in duck] == pytest.approx(ours, rel=1e-12)
    assert not math.isnan(float(got.sum()))


@pytest.mark.parametrize("backend", ["native", "duckdb"])
def test_duckdb_s_lambda_keyword_and_case_insensitive_parameters(backend):
    """DuckDB 1.3+ writes ``lambda a, b: body`` (the arrow form is deprecated there); its
    names are case-insensitive, so ``(X, y) -> x * Y`` is ``x * y``."""
    db = tq.connect(backend=backend)
    a = np.arange(6.0).reshape(2, 3) / 4
    b = np.arange(12.0).reshape(3, 4) / 8
    db.from_numpy("A", a)
    db.from_numpy("B", b)
    cases = [
        ("'ij,ij->ij', A, A, join := lambda x, y: x * exp(y)", a * np.exp(a)),
        ("'ij,ij->ij', A, A, join := lambda X, y: x * Y + 1", a * a + 1),
        ("'ij,ij->ij', A, A, join := (X, y) -> x - Y * 2", a - a * 2),
        ("'ij,jk->ik', A, B, join => lambda p, q: p + q, agg := 'max'",
         (a[:, :, None] + b[None]).max(axis=1)),
        ("'i->i', (SELECT d1 AS i, val FROM A WHERE d0 = 1), join := lambda V: v * 3",
         a[1] * 3),
    ]
    for args, expected in cases:
        np.testing.assert_allclose(db.sql(f"SELECT * FROM EINSUM({args})").numpy(), expected,
                                   rtol=1e-12)
    with pytest.raises(SQLJoinFunctionError, match="distinct parameter names"):
        db.sql("SELECT * FROM EINSUM('ij,ij->ij', A, A, join := lambda x, X: x + 1)")
    assert sorted(db.tensors()) == ["A", "B"]


@pytest.mark.parametrize("backend", ["native", "duckdb"])
def test_parameters_and_numeric_casts_in_a_join_lambda(backend):
    """A float parameter binds as ``CAST('1.5' AS DOUBLE)``: a lambda takes numeric casts,
    computed as DuckDB does (to an integer: half away from zero)."""
    db = tq.connect(backend=backend)
    a = np.arange(4.0).reshape(2, 2) - 1.5
    db.from_numpy("A", a)
    half_away = np.sign(a) * np.floor(np.abs(a) + 0.5)
    cases = [
        ("join := lambda x, y: x * y + ?", [1.5], a * a + 1.5),
        ("join := (x, y) -> x - ? * y", [-2.25], a + 2.25 * a),
        ("join := lambda x, y: CAST(x AS INTEGER) + y", None, half_away + a),
        ("join := lambda x, y: CAST(x AS REAL) * CAST('2' AS DOUBLE)", None, 2 * a),
    ]
    for join, params, expected in cases:
        got = db.sql(f"SELECT * FROM EINSUM('ij,ij->ij', A, A, {join})", params=params)
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6)
    for bad, message in (("CAST(y AS VARCHAR)", "casts to DOUBLE"),
                         ("CAST('a' AS DOUBLE)", "not a number")):
        with pytest.raises(SQLJoinFunctionError, match=message):
            db.sql(f"SELECT * FROM EINSUM('ij,ij->ij', A, A, join := lambda x, y: x + {bad})")
