"""The DuckDB backend's batched kernels (issue 31): the join function folds every product of
one output chunk within a batch into one partial, and results stay those of numpy however
DuckDB splits the join's rows into batches."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import tensorql as tq
from tensorql.backend.duckdb_sql import SQLPlan
from tensorql.storage.blob_codec import decode_payloads, encode_payloads


def _plan_and_rows(db, a, b, tile):
    """The plan of ``A @ B`` and the join's rows (keys and payloads of every tile pair)."""
    A = db.from_numpy("A", a, tile=(tile, tile))
    B = db.from_numpy("B", b, tile=(tile, tile))
    plan = SQLPlan.build(tq.einsum("ij,jk->ik", A, B).compile().logical, db.chunk_store)
    grid_a, grid_b = A.compile().logical.relation.grid, B.compile().logical.relation.grid
    rows = [(ka, kb) for ka in grid_a.keys() for kb in grid_b.keys() if ka[1] == kb[0]]
    return plan, rows, grid_a, grid_b


def _columns(rows, a, b, grid_a, grid_b):
    cols = [pa.array([r[s][d] for r in rows], pa.int32()) for s in (0, 1) for d in (0, 1)]
    cols.append(encode_payloads([np.ascontiguousarray(a[grid_a.slices(ka)]) for ka, _ in rows])
                .cast(pa.binary()))
    cols.append(encode_payloads([np.ascontiguousarray(b[grid_b.slices(kb)]) for _, kb in rows])
                .cast(pa.binary()))
    return cols


@pytest.mark.parametrize("split", [None, 7])
def test_partial_function_returns_one_sum_per_output_chunk_and_batch(split):
    rng = np.random.default_rng(31)
    a, b = rng.standard_normal((8, 12)), rng.standard_normal((12, 6))
    with tq.connect(backend="duckdb") as db:
        plan, rows, grid_a, grid_b = _plan_and_rows(db, a, b, 2)
        (partial,) = [u for u in plan.udfs if "partial" in u.name]
        assert partial.null_handling == "special"
        order = rng.permutation(len(rows))  # DuckDB's join emits rows in no set order
        rows = [rows[i] for i in order]
        batches = [rows] if split is None else [rows[:split], rows[split:]]
        total = np.zeros((8, 6))
        sums = 0
        for batch in batches:
            out = partial.fn(*_columns(batch, a, b, grid_a, grid_b))
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
def test_many_batches_of_join_rows_match_numpy(threads):
    """8,000 tile pairs: more than one DuckDB vector (2,048 rows), so one output chunk's
    products may reach the partial function in several batches (and threads)."""
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((20, 40)), rng.standard_normal((40, 10))
    with tq.connect(backend="duckdb") as db:
        db.connection.execute(f"SET threads = {threads}")
        A = db.from_numpy("A", a, tile=(1, 1))
        B = db.from_numpy("B", b, tile=(1, 1))
        np.testing.assert_allclose((A @ B).numpy(), a @ b, rtol=1e-12, atol=1e-12)
        got = tq.einsum("ij,jk->ik", A, B, join="add", agg="max").numpy()
        np.testing.assert_allclose(got, (a[:, :, None] + b[None]).max(axis=1), rtol=1e-12)


def test_plan_sql_gathers_only_partials_that_are_not_null():
    with tq.connect(backend="duckdb") as db:
        A = db.from_numpy("A", np.ones((4, 4)), tile=(2, 2))
        plan = SQLPlan.build(tq.einsum("ij,jk->ik", A, A).compile().logical, db.chunk_store)
    assert 'FILTER (WHERE "partial" IS NOT NULL)' in plan.sql
    assert [u.null_handling for u in plan.udfs] == ["special", "default"]
