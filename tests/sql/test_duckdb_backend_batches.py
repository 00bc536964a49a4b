"""The DuckDB backend's batched kernels (issue 31): the join function folds every product of
one output chunk within a batch into one partial, and results stay those of numpy however
DuckDB splits the join's rows into batches."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import tensorql as tq
from tensorql.backend import duckdb_sql
from tensorql.backend.duckdb_sql import SQLPlan
from tensorql.storage.blob_codec import decode_payloads


def _plan_and_rows(db, a, b, tile):
    """The plan of ``A @ B`` and the join's rows (keys and payloads of every tile pair)."""
    A = db.from_numpy("A", a, tile=(tile, tile))
    B = db.from_numpy("B", b, tile=(tile, tile))
    plan = SQLPlan.build(tq.einsum("ij,jk->ik", A, B).compile().logical, db.chunk_store)
    grid_a, grid_b = A.compile().logical.relation.grid, B.compile().logical.relation.grid
    rows = [(ka, kb) for ka in grid_a.keys() for kb in grid_b.keys() if ka[1] == kb[0]]
    return plan, rows, grid_a, grid_b


def _pages(tiles, rng):
    """Each tile's bytes as two pages, listed in a random order with their page numbers (as
    DuckDB's ``list(payload)``, ``list(page)`` may come)."""
    lists, numbers = [], []
    for tile in tiles:
        raw = np.ascontiguousarray(tile).tobytes()
        half = len(raw) // 2
        order = [0, 1] if rng.random() < 0.5 else [1, 0]
        lists.append([(raw[:half], raw[half:])[i] for i in order])
        numbers.append(order)
    return [pa.array(lists, pa.list_(pa.binary())), pa.array(numbers, pa.list_(pa.int32()))]


def _columns(rows, a, b, grid_a, grid_b, rng):
    cols = [pa.array([r[s][d] for r in rows], pa.int32()) for s in (0, 1) for d in (0, 1)]
    cols += _pages([a[grid_a.slices(ka)] for ka, _ in rows], rng)
    cols += _pages([b[grid_b.slices(kb)] for _, kb in rows], rng)
    return cols


@pytest.mark.parametrize("split", [None, 7])
def test_partial_function_returns_one_sum_per_output_chunk_and_batch(split):
    rng = np.random.default_rng(31)
    a, b = rng.standard_normal((8, 12)), rng.standard_normal((12, 6))
    with tq.connect(backend="duckdb") as db:
        plan, rows, grid_a, grid_b = _plan_and_rows(db, a, b, 2)
        (partial,) = [u for u in plan.udfs if "partial" in u.name]
        assert partial.null_handling == "special"
        assert partial.params == ("INTEGER",) * 4 + ("BLOB[]", "INTEGER[]") * 2  # page lists
        order = rng.permutation(len(rows))  # DuckDB's join emits rows in no set order
        rows = [rows[i] for i in order]
        batches = [rows] if split is None else [rows[:split], rows[split:]]
        total = np.zeros((8, 6))
        sums = 0
        for batch in batches:
            out = partial.fn(*_columns(batch, a, b, grid_a, grid_b, rng))
            assert len(out) == len(batch)
            outputs = {(ka[0], kb[1]) for ka, kb in batch}
            assert len(out) - out.null_count == len(outputs)  # one partial per output chunk
            valid = [r for r in range(len(batch)) if out[r].is_valid]
            chunks = decode_payloads(out.filter(pa.array([out[r].is_valid
                                                          for r in range(len(batch))])),
                                     "float64", [(2, 2)] * len(valid))
            for r, chunk in zip(valid, chunks):
                ka, kb = batch[r]
                total[2 * ka[0]:2 * ka[0] + 2, 2 * kb[1]:2 * kb[1] + 2] += chunk.numpy()
                sums += 1
        assert sums == 12 if split is None else sums >= 12
        np.testing.assert_allclose(total, a @ b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("threads", [1, 2])
def test_output_chunks_summed_over_several_batches_match_numpy(threads, monkeypatch):
    """2,500 tile pairs per output chunk: more than one DuckDB vector (2,048 rows), so each
    output chunk's products reach the partial function in several batches, and its partials
    are folded by the aggregate function."""
    partials = []
    sparse_out = duckdb_sql._sparse_out

    def counting(n_rows, sizes, data):
        partials.append(len(sizes))
        return sparse_out(n_rows, sizes, data)

    monkeypatch.setattr(duckdb_sql, "_sparse_out", counting)
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((2, 2500)), rng.standard_normal((2500, 3))
    with tq.connect(backend="duckdb") as db:
        db.connection.execute(f"SET threads = {threads}")
        A = db.from_numpy("A", a, tile=(1, 1))
        B = db.from_numpy("B", b, tile=(1, 1))
        np.testing.assert_allclose((A @ B).numpy(), a @ b, rtol=1e-12, atol=1e-12)
        assert sum(partials) > 6  # 6 output chunks, some summed from several partials
        got = tq.einsum("ij,jk->ik", A, B, join="add", agg="max").numpy()
        np.testing.assert_allclose(got, (a[:, :, None] + b[None]).max(axis=1), rtol=1e-12)


def test_plan_sql_gathers_only_partials_that_are_not_null():
    with tq.connect(backend="duckdb") as db:
        A = db.from_numpy("A", np.ones((4, 4)), tile=(2, 2))
        plan = SQLPlan.build(tq.einsum("ij,jk->ik", A, A).compile().logical, db.chunk_store)
    assert 'FILTER (WHERE "partial" IS NOT NULL)' in plan.sql
    assert 'CASE WHEN len("parts") = 1 THEN "parts"[1]' in plan.sql  # a lone partial as is
    assert [u.null_handling for u in plan.udfs] == ["special", "default"]


def test_only_steps_read_twice_are_materialized():
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((6, 8)), rng.standard_normal((8, 4))
    with tq.connect(backend="duckdb") as db:
        A, B = db.from_numpy("A", a, tile=(3, 4)), db.from_numpy("B", b, tile=(4, 2))
        x = tq.einsum("ij,jk->ik", A, B)
        chain = tq.einsum("ij,jk,kl->il", A, B, tq.einsum("ki->ik", x))
        squared = tq.einsum("ik,ik->ik", x, x)
        for expr, expected, materialized in ((chain, a @ b @ (a @ b).T, 0),
                                             (squared, (a @ b) ** 2, 1)):
            sql = SQLPlan.build(expr.compile().logical, db.chunk_store).sql
            assert sql.count("MATERIALIZED") == materialized
            np.testing.assert_allclose(expr.numpy(), expected, rtol=1e-12, atol=1e-12)


def test_stored_tiles_of_several_pages_read_as_pages_by_joins_only():
    """Tiles of 8 KiB (two 4 KiB pages) and ragged edge tiles: a join reads the stored pages
    (no chunk view), a Map still reads whole chunks through the chunk view."""
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((80, 72)), rng.standard_normal((72, 40))
    with tq.connect(backend="duckdb") as db:
        db.connection.execute("SET threads = 2")
        A = db.from_numpy("A", a, tile=(32, 32))
        B = db.from_numpy("B", b, tile=(32, 32))
        product = tq.einsum("ij,jk->ik", A, B)
        steps = dict(SQLPlan.build(product.compile().logical, db.chunk_store).steps)
        assert sorted(v for v in steps.values() if v.startswith("Scan")) == \
            ["Scan A (chunk pages)", "Scan B (chunk pages)"]
        np.testing.assert_allclose(product.numpy(), a @ b, rtol=1e-12, atol=1e-12)
        scaled = tq.einsum("ij,jk->ik", A * 2.0, B)
        steps = dict(SQLPlan.build(scaled.compile().logical, db.chunk_store).steps)
        assert sorted(v for v in steps.values() if v.startswith("Scan")) == \
            ["Scan A (chunk view)", "Scan B (chunk pages)"]
        np.testing.assert_allclose(scaled.numpy(), 2 * a @ b, rtol=1e-12, atol=1e-12)


def test_chunk_pages_sql_names_the_page_rows_of_a_stored_tensor():
    with tq.connect() as db:
        db.from_numpy("A", np.arange(12.0).reshape(3, 4), tile=(2, 2))
        store = db.chunk_store
        store.sync_views()
        rows = db.connection.sql(f"SELECT k0, k1, page, octet_length(payload) FROM "
                                 f"{store.chunk_pages_sql('A')} ORDER BY k0, k1").fetchall()
        assert rows == [(0, 0, 0, 32), (0, 1, 0, 32), (1, 0, 0, 16), (1, 1, 0, 16)]
        assert store.chunk_pages_sql("missing") is None
