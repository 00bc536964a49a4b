"""EINSUM over element rows (tensorql/sql/relational.py): relation operands that must stay
sparse run as one DuckDB join + GROUP BY, never densified (issue 16, bug 4).

Oracle: a plain-Python evaluation of the relational meaning -- every combination of rows whose
shared labels agree joins, output cells no combination reaches are absent."""

from __future__ import annotations

import itertools
import math
import operator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorql as tq
from tensorql.sql.errors import SQLOperatorError, SQLShapeError

PY_JOINS = {
    "mul": operator.mul, "add": operator.add, "sub": operator.sub,
    "div": operator.truediv, "max": max, "min": min, "pow": operator.pow,
    "lt": operator.lt, "ge": operator.ge, "eq": operator.eq,
}
PY_AGGS = {"sum": sum, "max": max, "min": min, "prod": math.prod}


def relational_oracle(inputs, output, relations, join, agg):
    """{output index: value} by joining every combination of rows (plain Python)."""
    groups: dict[tuple, list] = {}
    for combo in itertools.product(*relations):
        bound: dict[str, int] = {}
        ok = True
        for labels, (index, _) in zip(inputs, combo):
            for label, i in zip(labels, index):
                if bound.setdefault(label, i) != i:
                    ok = False
        if not ok:
            continue
        value = combo[0][1]
        for _, v in combo[1:]:
            value = PY_JOINS[join](value, v)
        groups.setdefault(tuple(bound[label] for label in output), []).append(value)
    return {key: PY_AGGS[agg](values) for key, values in groups.items()}


def values_sql(labels, rows):
    """A VALUES subquery holding ``rows`` [(index tuple, val)] with columns labels + val."""
    body = ", ".join("(" + ", ".join([*map(str, index), repr(float(v))]) + ")"
                     for index, v in rows)
    names = ", ".join([*labels, "val"])
    return f"(SELECT * FROM (VALUES {body}) AS t({names}))"


def einsum_arguments(inputs, output, relations):
    """The equation and the VALUES subqueries of a drawn query, for EINSUM's SQL."""
    equation = ",".join("".join(labels) for labels in inputs) + "->" + "".join(output)
    operands = ", ".join(values_sql(labels, rows) for labels, rows in zip(inputs, relations))
    return equation, operands


@st.composite
def relational_queries(draw):
    alphabet = "ijkl"
    n_ops = draw(st.integers(1, 3))
    inputs = [draw(st.lists(st.sampled_from(alphabet), min_size=1, max_size=3))
              for _ in range(n_ops)]
    used = sorted({label for labels in inputs for label in labels})
    output = draw(st.permutations(used).map(lambda p: p[:draw(st.integers(0, len(p)))]))
    sizes = {label: draw(st.integers(1, 3)) for label in used}
    join = draw(st.sampled_from(sorted(PY_JOINS)))
    agg = draw(st.sampled_from(sorted(PY_AGGS)))
    relations = []
    for labels in inputs:
        cells = list(itertools.product(*(range(sizes[label]) for label in labels)))
        picked = draw(st.lists(st.sampled_from(cells), min_size=1, max_size=4))
        relations.append([(index, draw(st.integers(1, 4)) / 2) for index in picked])
    return inputs, list(output), sizes, join, agg, relations


@settings(max_examples=60, deadline=None)
@given(relational_queries())
def test_relational_einsum_matches_the_plain_python_join(query):
    inputs, output, sizes, join, agg, relations = query
    equation, operands = einsum_arguments(inputs, output, relations)
    with tq.connect() as db:
        got = db.sql(f"SELECT * FROM EINSUM('{equation}', {operands}, join := '{join}', "
                     f"agg := '{agg}', sparse := true)").fetchall()
    expected = relational_oracle(inputs, output, relations, join, agg)
    assert [row[:-1] for row in got] == sorted(expected)  # present cells, in C order
    for row in got:
        want = expected[row[:-1]]
        if isinstance(row[-1], bool):  # a comparison summed over duplicates only: any / all
            want = bool(want)
        assert row[-1] == pytest.approx(want, rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(relational_queries())
def test_relational_and_dense_paths_agree_where_the_semiring_has_a_zero(query):
    inputs, output, sizes, _, _, relations = query
    equation, operands = einsum_arguments(inputs, output, relations)
    size_arg = "{" + ", ".join(f"'{k}': {v}" for k, v in sizes.items()) + "}"
    for join, agg in (("mul", "sum"), ("add", "min"), ("add", "max")):
        with tq.connect() as db:
            query_text = (f"SELECT * FROM EINSUM('{equation}', {operands}, join := '{join}', "
                          f"agg := '{agg}', sizes := {size_arg}, sparse := ")
            sparse = db.sql(query_text + "true)")
            dense = db.sql(query_text + "false)")
            got, want = sparse.fetchall(), dense.fetchall()
            assert [row[:-1] for row in got] == [row[:-1] for row in want]
            assert [row[-1] for row in got] == pytest.approx([row[-1] for row in want],
                                                             rel=1e-12)
            np.testing.assert_allclose(sparse.numpy(), dense.numpy(), rtol=1e-12)


def test_a_huge_sparse_operand_stays_rows(db):
    # 1e5 x 1e5 as a dense block would take 90 GB; as rows it is one row
    r = db.sql("SELECT * FROM EINSUM('ij->i', (SELECT 99999 AS i, 99999 AS j, 1.0 AS val))")
    assert r.fetchall() == [(99999, 1.0)]
    assert r.numpy().shape == (100000,) and r.numpy()[99999] == 1.0
    plan = db.sql("EXPLAIN SELECT * FROM EINSUM('ij,jk->ik', (SELECT 99999 AS i, 5 AS j, "
                  "1.0 AS val), (SELECT 5 AS j, 99998 AS k, 2.0 AS val))").text
    assert "relational join over element rows in DuckDB" in plan and "Hash Join" in plan
    r = db.sql("SELECT * FROM EINSUM('ij,jk->ik', (SELECT 99999 AS i, 5 AS j, 1.0 AS val), "
               "(SELECT 5 AS j, 99998 AS k, 2.0 AS val))")
    assert r.fetchall() == [(99999, 99998, 2.0)]
    with pytest.raises(tq.ShapeError, match="read its rows"):
        r.numpy()  # 1e10 cells: refused, not allocated


def test_shortest_paths_on_a_large_sparse_graph(db):
    # 200,000 nodes: the dense (min,+) square would be 4e10 cells; the rows are 400,000 edges
    n, m = 200_000, 400_000
    rng = np.random.default_rng(5)
    src, dst = rng.integers(0, n, m), rng.integers(0, n, m)
    weight = rng.integers(1, 10, m).astype(np.float64)
    import pyarrow as pa

    db.connection.register("g", pa.table({"i": src, "j": dst, "val": weight}))
    got = db.sql("SELECT i, k, val FROM EINSUM('ij,jk->ik', g, g, join := 'add', "
                 "agg := 'min') WHERE i < 300").fetchall()
    best: dict[tuple[int, int], float] = {}
    out_edges: dict[int, list[tuple[int, float]]] = {}
    for a, b, w in zip(src.tolist(), dst.tolist(), weight.tolist()):
        out_edges.setdefault(a, []).append((b, w))
    for a in range(300):
        for b, w in out_edges.get(a, []):
            for c, w2 in out_edges.get(b, []):
                best[(a, c)] = min(best.get((a, c), math.inf), w + w2)
    assert sorted((i, k) for i, k, _ in got) == sorted(best)
    assert all(best[(i, k)] == v for i, k, v in got)


def test_tensor_operands_and_fused_ctes_join_as_rows(db):
    a = np.arange(12.0).reshape(3, 4)
    db.from_numpy("A", a)
    rel = "(SELECT 1 AS j, 0 AS k, 2.0 AS val UNION ALL SELECT 3, 1, -1.0)"
    expected = np.zeros((3, 2))
    expected[:, 0] = 2 * a[:, 1]
    expected[:, 1] = -a[:, 3]
    stored = db.sql(f"SELECT * FROM EINSUM('ij,jk->ik', A, {rel}, sparse := true)")
    np.testing.assert_array_equal(stored.numpy(), expected)
    fused = db.sql(f"WITH c AS (SELECT * FROM EINSUM('ij->ij', A)) "
                   f"SELECT * FROM EINSUM('ij,jk->ik', c, {rel}, sparse := true)")
    np.testing.assert_array_equal(fused.numpy(), expected)
    inner = db.sql(f"WITH c AS (SELECT * FROM EINSUM('ij,jk->ik', A, {rel}, sparse := true)) "
                   "SELECT * FROM EINSUM('ik->k', c)")  # a relational CTE read as rows
    np.testing.assert_array_equal(inner.numpy(), expected.sum(axis=0))


def test_diagonals_and_scalar_results(db):
    r = db.sql("SELECT * FROM EINSUM('ii->i', (SELECT 1 AS a, 1 AS b, 3.0 AS val UNION ALL "
               "SELECT 1, 0, 4.0), sparse := true)")
    assert r.fetchall() == [(1, 3.0)]
    assert r.numpy().tolist() == [0.0, 3.0]
    r = db.sql("SELECT * FROM EINSUM('i,i->', (SELECT 1 AS i, 3.0 AS val), "
               "(SELECT 1 AS i, 2.0 AS val UNION ALL SELECT 0, 5.0), sparse := true)")
    assert r.fetchall() == [(6.0,)] and r.numpy().tolist() == 6.0
    r = db.sql("SELECT * FROM EINSUM('i,i->', (SELECT 1 AS i, 3.0 AS val), "
               "(SELECT 0 AS i, 5.0 AS val), sparse := true)")
    assert r.fetchall() == []  # nothing joined: no row


def test_semirings_without_a_zero_join_as_rows(db):
    r = db.sql("SELECT * FROM EINSUM('i,i->i', (SELECT 0 AS i, 1.0 AS val UNION ALL "
               "SELECT 1, 3.0), (SELECT 0 AS i, 2.0 AS val), join := 'mul', agg := 'max')")
    assert r.fetchall() == [(0, 2.0)]
    assert r.numpy().tolist() == [2.0, -math.inf]
    with pytest.raises(SQLOperatorError, match="has no zero") as info:
        db.sql("SELECT * FROM EINSUM('i,i->i', (SELECT 0 AS i, 1.0 AS val), "
               "(SELECT 0 AS i, 2.0 AS val), join := 'mul', agg := 'max', sparse := false)")
    assert info.value.column == 15


def test_relational_errors_name_their_cause(db):
    with pytest.raises(SQLShapeError, match="index 7 outside 0..2"):
        db.sql("SELECT * FROM EINSUM('i->i', (SELECT 7 AS i, 1.0 AS val), sizes := {'i': 3}, "
               "sparse := true)")
    with pytest.raises(SQLOperatorError, match="sparse := takes true or false"):
        db.sql("SELECT * FROM EINSUM('i->i', (SELECT 0 AS i, 1.0 AS val), sparse := 'yes')")
    with pytest.raises(SQLShapeError, match="more than the limit"):  # refused, as asked
        db.sql("SELECT * FROM EINSUM('ij->i', (SELECT 99999 AS i, 99999 AS j, 1.0 AS val), "
               "sparse := false)")


def test_explain_analyze_of_a_relational_einsum_runs_it(db):
    text = db.sql("EXPLAIN ANALYZE SELECT * FROM EINSUM('ij,jk->ik', (SELECT 0 AS i, 0 AS j, "
                  "1.0 AS val), (SELECT 0 AS j, 0 AS k, 1.0 AS val), join := 'mul', "
                  "agg := 'max')").text
    assert "has no zero" in text and "Total Time" in text


def test_a_relational_einsum_inside_a_statement_streams_through_a_temporary_view(db):
    db.connection.execute("CREATE TABLE e AS SELECT range % 1000 AS i, (range * 7) % 1000 AS j, "
                          "1.0 AS val FROM range(5000)")
    query = ("SELECT count(*), min(val), max(val) FROM EINSUM('ij,jk->ik', e, e, "
             "join := 'add', agg := 'min', sparse := true) WHERE i < 500")
    (count, low, high), = db.sql(query).fetchall()
    pairs = {(i, j) for i, j in ((r % 1000, (r * 7) % 1000) for r in range(5000))}
    out = {}
    for i, j in pairs:
        out.setdefault(i, set()).add(j)
    expected = {(i, k) for i in range(500) for j in out.get(i, ()) for k in out.get(j, ())}
    assert (count, low, high) == (len(expected), 2.0, 2.0)
    views = db.connection.execute("SELECT count(*) FROM duckdb_views() WHERE temporary AND "
                                  "view_name LIKE '__tq_einsum_%'").fetchone()[0]
    assert views == 0  # dropped when the statement ended


@pytest.mark.parametrize("sparse", ["", ", sparse := true"])
def test_a_one_operand_join_lambda_is_applied_to_each_row(db, sparse):
    """Per row, then aggregated, as the relational meaning says: not to the fill of absent
    cells, nor to duplicates after they combine (the dense path did both)."""
    rows = [((0, 0), 1.0), ((0, 0), 2.0), ((1, 2), 3.0)]
    operand = values_sql(["i", "j"], rows)
    for body, fn, agg in (("a * 10 + 1", lambda a: a * 10 + 1, "sum"),
                          ("a * a", lambda a: a * a, "sum"), ("-a", operator.neg, "max")):
        got = db.sql(f"SELECT * FROM EINSUM('ij->i', {operand}, join := (a) -> {body}, "
                     f"agg := '{agg}'{sparse})").fetchall()
        want = {}
        for (i, _), v in rows:
            want.setdefault(i, []).append(fn(v))
        assert got == [(i, PY_AGGS[agg](vs)) for i, vs in sorted(want.items())]


def test_a_one_operand_join_lambda_cannot_be_forced_dense(db):
    with pytest.raises(SQLOperatorError, match="applied to each row"):
        db.sql("SELECT * FROM EINSUM('ij->i', (SELECT 0 AS i, 0 AS j, 1.0 AS val), "
               "join := (a) -> a + 1, sparse := false)")


@pytest.mark.parametrize("agg", ["min", "max", "sum"])
def test_a_nan_reaches_the_result_on_both_paths(db, agg):
    """DuckDB orders NaN above every number (its min skipped it); torch.amin returns it."""
    operand = "(SELECT * FROM (VALUES (0, 0, 'NaN'::DOUBLE), (0, 1, 2.0), (1, 1, -1.0)) " \
        "AS t(i, j, val))"
    for two in (False, True):
        equation, operands = ("ij,ij->i", f"{operand}, {operand}") if two \
            else ("ij->i", operand)
        pair = "add" if agg in ("min", "max") else "mul"  # a pair with a zero
        join = f", join := '{pair}'" if two else ""
        out = {}
        for sparse in ("true", "false"):
            rows = db.sql(f"SELECT * FROM EINSUM('{equation}', {operands}{join}, "
                          f"agg := '{agg}', sparse := {sparse})").fetchall()
            out[sparse] = rows
            assert rows[0][0] == 0 and math.isnan(rows[0][1])
            assert rows[1] == (1, (-2.0 if pair == "add" else 1.0) if two else -1.0)
        assert len(out["true"]) == len(out["false"]) == 2


def test_a_label_of_size_zero_leaves_nothing_present(db):
    """A stored operand with no cells along a summed label: no combination reaches any
    output cell, on the dense path as on the sparse one."""
    db.from_numpy("empty_s", np.zeros((0,)))
    operand = values_sql(["k", "j"], [((0, 0), 1.0), ((0, 1), 2.0)])
    for sparse in ("true", "false"):
        result = db.sql(f"SELECT * FROM EINSUM('i,kj->j', empty_s, {operand}, "
                        f"sparse := {sparse})")
        assert result.fetchall() == []


def test_a_fused_cte_of_a_stored_tensor_and_a_relation_is_an_operand(db):
    """The CTE's presence varies along the relation's labels only (size 1 along the stored
    tensor's): reading it in another EINSUM used to fail reshaping that mask."""
    t = np.arange(6.0).reshape(2, 3)
    db.from_numpy("cte_t", t)
    q_rows = [((0, 0), 1.0), ((2, 1), 2.0)]
    q = np.zeros((3, 2))
    for (j, k), v in q_rows:
        q[j, k] = v
    c = t @ q
    got = db.sql(f"WITH c AS (SELECT * FROM EINSUM('ij,jk->ik', cte_t, "
                 f"{values_sql(['j', 'k'], q_rows)})) "
                 "SELECT * FROM EINSUM('ik,ik->i', c, c)").fetchall()
    assert got == [(i, pytest.approx(v)) for i, v in enumerate((c * c).sum(1))]


NAN_X = [math.nan, 1.0, 2.0, math.nan]
NAN_R = [1.0, math.nan, 3.0, math.nan]
NAN_REL = ("(SELECT * FROM (VALUES (0, 1.0), (1, 'nan'::DOUBLE), (2, 3.0), (3, 'nan'::DOUBLE))"
           " t(i, val))")


def _same(got, want):
    return len(got) == len(want) and all(
        a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))
        for a, b in zip(got, want))


@pytest.mark.parametrize("join", ["min", "max", "lt", "le", "gt", "ge", "eq", "ne",
                                  "(a, b) -> CASE WHEN a > b THEN a ELSE b END",
                                  "(a, b) -> least(a, b, 0)"])
def test_a_nan_joins_as_in_torch_on_every_path(db, join):
    """DuckDB orders NaN above every number and equal to itself; torch (the dense path's
    kernels, and the oracle) compares it false to anything and its minimum returns it."""
    import torch

    x, r = torch.tensor(NAN_X, dtype=torch.float64), torch.tensor(NAN_R, dtype=torch.float64)
    oracle = {"min": torch.minimum, "max": torch.maximum, "lt": torch.lt, "le": torch.le,
              "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
              "(a, b) -> CASE WHEN a > b THEN a ELSE b END": lambda a, b: torch.where(a > b, a, b),
              "(a, b) -> least(a, b, 0)": lambda a, b: torch.minimum(torch.minimum(a, b),
                                                                     torch.zeros(()))}
    want = oracle[join](x, r).tolist()
    db.from_numpy("nan_x", np.array(NAN_X), replace=True)
    db.from_numpy("nan_r", np.array(NAN_R), replace=True)
    spelled = join if join.startswith("(") else f"'{join}'"
    for operands, mode in ((f"nan_x, {NAN_REL}", ", sparse := true"), (f"nan_x, {NAN_REL}", ""),
                           ("nan_x, nan_r", ", backend := 'duckdb'"), ("nan_x, nan_r", "")):
        got = [v for _, v in db.sql(f"SELECT * FROM EINSUM('i,i->i', {operands}, "
                                    f"join := {spelled}{mode})").fetchall()]
        assert _same(got, want), (operands, mode, got, want)


def test_floor_division_by_an_infinity_is_numpys(db):
    a, b = np.array([1.25, -1.0, 0.0, -2.0]), np.array([-np.inf, np.inf, np.inf, -np.inf])
    db.from_numpy("fd_a", a, replace=True)
    rel = "(SELECT * FROM (VALUES " + ", ".join(
        f"({k}, '{v}'::DOUBLE)" for k, v in enumerate(b)) + ") t(i, val))"
    got = db.sql(f"SELECT * FROM EINSUM('i,i->i', fd_a, {rel}, join := 'floordiv')").fetchall()
    assert [v for _, v in got] == (a // b).tolist()


def test_a_recursive_cte_is_an_operand(db):
    query = ("WITH RECURSIVE c AS (SELECT 0 AS i, 1.0 AS val UNION ALL SELECT i + 1, val FROM "
             "c WHERE i < 3) SELECT * FROM EINSUM('i->', c)")
    assert db.sql(query).fetchall() == [(4.0,)]


@pytest.mark.parametrize("join, agg", [("mul", "sum"), ("add", "min"), ("add", "max"),
                                       ("max", "min"), ("min", "max")])
def test_an_absent_row_joins_nothing_even_against_an_infinity(db, join, agg):
    """A stored inf or NaN where the relation has no row: the dense path's fill (the
    semiring's zero) met it (0 * inf = NaN); an absent row joins nothing, as over rows."""
    db.from_numpy("inf_z", np.array([np.inf, 1.0, np.nan]), replace=True)
    rel = "(SELECT 1 AS i, 2.0 AS val)"
    one = PY_JOINS[join](1.0, 2.0)
    for mode in ("", ", sparse := true"):
        query = f"EINSUM('i,i->{{}}', inf_z, {rel}, join := '{join}', agg := '{agg}'{mode})"
        assert db.sql("SELECT * FROM " + query.format("")).fetchall() == [(one,)]
        assert db.sql("SELECT * FROM " + query.format("i")).fetchall() == [(1, one)]
    got = db.sql("SELECT * FROM EINSUM('i,i->', inf_z, (SELECT 2 AS i, 2.0 AS val))").fetchall()
    assert math.isnan(got[0][0])  # a NaN that did join stays
