"""Relation operands of EINSUM have relational meaning (issue 16, bugs 3 and 4): an absent row
does not join, output cells nothing reached are absent from the rows, sizes and indices are
checked with one clear error per cause, and densifying is bounded."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

import tensorql as tq
from tensorql.sql.errors import SQLShapeError


def floyd_warshall(n: int, edges: list[tuple[int, int, float]]) -> list[list[float]]:
    """Plain-Python all-pairs shortest paths (paths of one or more edges)."""
    dist = [[math.inf] * n for _ in range(n)]
    for i, j, w in edges:
        dist[i][j] = min(dist[i][j], w)
    for k in range(n):
        for i in range(n):
            for j in range(n):
                if dist[i][k] + dist[k][j] < dist[i][j]:
                    dist[i][j] = dist[i][k] + dist[k][j]
    return dist


def random_edges(n: int, count: int, seed: int) -> list[tuple[int, int, float]]:
    rng = np.random.default_rng(seed)
    pairs = {(int(i), int(j)) for i, j in rng.integers(0, n, size=(count, 2)) if i != j}
    return [(i, j, float(rng.integers(1, 10))) for i, j in sorted(pairs)]


def store_edges(db, edges):
    db.connection.execute("CREATE OR REPLACE TABLE edges (i BIGINT, j BIGINT, val DOUBLE)")
    db.connection.executemany("INSERT INTO edges VALUES (?, ?, ?)", edges)


def test_min_plus_over_an_edge_table_is_two_hop_shortest_paths(db):
    n = 7
    edges = random_edges(n, 14, seed=3)
    store_edges(db, edges)
    r = db.sql("SELECT * FROM EINSUM('ij,jk->ik', edges, edges, join := 'add', agg := 'min')")
    expected = {}
    for i, j, w in edges:
        for j2, k, w2 in edges:
            if j == j2:
                expected[(i, k)] = min(expected.get((i, k), math.inf), w + w2)
    rows = {(i, k): v for i, k, v in r.fetchall()}
    assert rows == expected  # absent pairs are absent rows, not zeros
    dense = r.numpy()
    for i in range(dense.shape[0]):
        for k in range(dense.shape[1]):
            assert dense[i, k] == expected.get((i, k), math.inf)  # min's identity


def test_shortest_paths_by_repeated_squaring_match_floyd_warshall(db):
    n = 9
    edges = random_edges(n, 20, seed=11)
    store_edges(db, edges)
    # d1 = edges; d(2m) = min(d(m), d(m) (min,+) d(m)); three squarings cover paths of <= 8 hops
    db.sql("CREATE OR REPLACE TABLE d AS SELECT * FROM edges")
    for _ in range(3):
        db.sql("CREATE OR REPLACE TABLE d AS SELECT i, j, min(val) AS val FROM ("
               "SELECT * FROM d UNION ALL SELECT i, k AS j, val FROM EINSUM('ij,jk->ik', d, d, "
               "join := 'add', agg := 'min', sizes := {'i': 9, 'j': 9, 'k': 9})) "
               "GROUP BY i, j")
    got = {(i, j): v for i, j, v in db.sql("SELECT i, j, val FROM d").fetchall()}
    dist = floyd_warshall(n, edges)
    expected = {(i, j): dist[i][j] for i in range(n) for j in range(n)
                if dist[i][j] < math.inf}
    assert got == expected


def test_max_plus_absent_rows_are_minus_infinity(db):
    r = db.sql("SELECT * FROM EINSUM('ij,jk->ik', (SELECT 0 AS i, 0 AS j, -5.0 AS val), "
               "(SELECT 0 AS j, 1 AS k, -1.0 AS val UNION ALL SELECT 1, 1, 3.0), "
               "join := 'add', agg := 'max')")
    assert r.fetchall() == [(0, 1, -6.0)]
    assert r.numpy().tolist() == [[-math.inf, -6.0]]


def test_sum_of_products_keeps_zero_rows_out_and_duplicates_add(db):
    r = db.sql("SELECT * FROM EINSUM('ij,j->i', (SELECT 0 AS i, 1 AS j, 2.0 AS val "
               "UNION ALL SELECT 0, 1, 3.0 UNION ALL SELECT 2, 0, 1.0), "
               "(SELECT 1 AS j, 4.0 AS val))")
    assert r.fetchall() == [(0, 20.0)]  # row i=2 met no j=0 row: absent
    assert r.numpy().tolist() == [20.0, 0.0, 0.0]


def test_one_operand_absent_cells_are_the_aggregations_identity(db):
    # one operand: absent cells are the aggregation's identity whatever the join
    r = db.sql("SELECT * FROM EINSUM('ij->i', (SELECT 0 AS i, 1 AS j, -2.0 AS val), "
               "agg := 'max', sizes := {'i': 2})")
    assert r.fetchall() == [(0, -2.0)]


def test_negative_and_fractional_indices_are_named_as_such(db):
    with pytest.raises(SQLShapeError, match="index -1: indices start at 0"):
        db.sql("SELECT * FROM EINSUM('ij->i', (SELECT -1 AS i, 0 AS j, 1.0 AS val))")
    with pytest.raises(SQLShapeError, match="holds decimal.* label columns must be integers"):
        db.sql("SELECT * FROM EINSUM('i->i', (SELECT 1.5 AS i, 1.0 AS val))")
    with pytest.raises(SQLShapeError, match="have no rows; give sizes"):
        db.sql("SELECT * FROM EINSUM('i->i', (SELECT 1 AS i, 1.0 AS val WHERE false))")


def test_densifying_a_huge_sparse_operand_is_refused_not_allocated(db):
    # sparse := false keeps the dense path: it refuses instead of allocating (without it the
    # operand joins as rows: tests/sql/test_relational_einsum.py)
    with pytest.raises(SQLShapeError, match="more than the limit") as info:
        db.sql("SELECT * FROM EINSUM('ij->i', (SELECT 99999 AS i, 99999 AS j, 1.0 AS val), "
               "sparse := false)")
    assert isinstance(info.value, tq.ShapeError) and "relation_dense_bytes" in str(info.value)
    with pytest.raises(SQLShapeError, match="more than the limit"):
        db.sql("SELECT * FROM EINSUM('i->i', (SELECT 99999999 AS i, 1.0 AS val), "
               "sparse := false)")
    with tq.connect(memory_limit="1MiB") as small:  # memory_limit lowers the bound
        with pytest.raises(SQLShapeError, match=r"limit of 1\.0 MiB"):
            small.sql("SELECT * FROM EINSUM('i->i', (SELECT 199999 AS i, 1.0 AS val), "
                      "sparse := false)")
        r = small.sql("SELECT * FROM EINSUM('i->i', (SELECT 199999 AS i, 1.0 AS val))")
        assert r.fetchall() == [(199999, 1.0)]  # over the bound: joined as rows


def test_relation_operands_raise_no_torch_warning():
    # torch warns about non-writable arrays once per process, so check in a fresh one
    code = ("import tensorql as tq; db = tq.connect(); "
            "db.connection.execute('CREATE TABLE v AS SELECT range AS j, 1.0 AS val "
            "FROM range(4)'); "
            "assert db.sql(\"SELECT * FROM EINSUM('j,j->', v, v)\").numpy().tolist() == 4.0")
    done = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "not writable" not in done.stderr, done.stderr[-2000:]
