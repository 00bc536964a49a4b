"""Oracle tests for the DuckDB execution backend: the same random extended einsums as the
native executor's oracle (tests/einsum/test_oracle.py), run as SQL inside DuckDB."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import tensorql as tq
from tests.einsum.test_oracle import _store, einsum_problems
from tests.reference import extended_einsum


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(einsum_problems(max_operands=4))
def test_duckdb_backend_matches_numpy_einsum(problem):
    equation, shapes, tiles, seed = problem
    with tq.connect(backend="duckdb") as db:
        arrays, tensors = _store(db, shapes, tiles, seed)
        expected = np.einsum(equation, *arrays)
        got = tq.einsum(equation, *tensors).numpy()
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("join", ["mul", "add", "max"])
@pytest.mark.parametrize("agg", ["sum", "max", "min", "prod"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=einsum_problems(max_operands=3))
def test_duckdb_backend_semirings(join, agg, problem):
    equation, shapes, tiles, seed = problem
    with tq.connect(backend="duckdb") as db:
        arrays, tensors = _store(db, shapes, tiles, seed, positive=True)
        expected = extended_einsum(equation, *arrays, join=join, agg=agg)
        got = tq.einsum(equation, *tensors, join=join, agg=agg).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.int64])
def test_duckdb_backend_dtypes(dtype):
    rng = np.random.default_rng(3)
    a = (rng.standard_normal((9, 7)) * 4).astype(dtype)
    b = (rng.standard_normal((7, 5)) * 4).astype(dtype)
    with tq.connect(backend="duckdb") as db:
        A, B = db.from_numpy("A", a, tile=(4, 3)), db.from_numpy("B", b, tile=(3, 2))
        got = (A @ B).numpy()
        assert got.dtype == (np.int64 if dtype == np.int32 else dtype)  # sums widen int32
        np.testing.assert_allclose(got.astype(np.float64),
                                   a.astype(np.float64) @ b.astype(np.float64),
                                   rtol=1e-2 if dtype == np.float16 else 1e-5)
        np.testing.assert_allclose(tq.einsum("ij,jk->ki", A, B).numpy().astype(np.float64),
                                   (a.astype(np.float64) @ b.astype(np.float64)).T,
                                   rtol=1e-2 if dtype == np.float16 else 1e-5)


def test_duckdb_backend_joins_of_three_or_more_operands():
    """A ternary ``where`` and an optimizer's 7-operand update join put every operand in
    the query (they named only the first and failed to bind)."""
    rng = np.random.default_rng(12)
    cond, a, b = rng.random((4, 6)) > 0.5, rng.normal(size=(4, 6)), rng.normal(size=6)
    w0 = rng.normal(size=(6, 4))
    weights = {}
    for backend in ("native", "duckdb"):
        with tq.connect(backend=backend) as db:
            picked = tq.einsum("ij,ij,j->ij", db.from_numpy("c", cond, tile=(2, 3)),
                               db.from_numpy("a", a, tile=(2, 3)),
                               db.from_numpy("b", b, tile=(3,)), join="where")
            np.testing.assert_array_equal(picked.numpy(), np.where(cond, a, b))
            db.from_numpy("w", w0, tile=(3, 2))
            opt = tq.optim.Adam(db, ["w"], lr=0.05)
            w = opt.params()["w"]
            loss = (w * w * w).sum()
            for _ in range(3):
                opt.step(loss)
            weights[backend] = db.tensor("w").numpy()
    np.testing.assert_allclose(weights["duckdb"], weights["native"], rtol=1e-12)


@pytest.mark.parametrize("backend", ["native", "duckdb"])
def test_an_input_stored_again_with_another_tiling_or_dtype_is_stale_on_both_backends(
        backend):
    """The DuckDB backend read the new chunks through the old grid: a raw ExecutionError
    from inside its load function (a page outside a chunk, pages missing)."""
    a = np.arange(12, dtype="f8").reshape(3, 4)
    db = tq.connect(backend=backend)
    A = db.from_numpy("A", a, tile=(2, 2))
    doubled = A * 2.0
    np.testing.assert_array_equal(doubled.numpy(), a * 2)
    for tile, dtype in (((3, 1), "f8"), ((2, 2), "f4")):
        db.from_numpy("A", (a + 1).astype(dtype), tile=tile, replace=True)
        with pytest.raises(tq.StaleTensorError, match="'A' changed since this query"):
            doubled.numpy()
        np.testing.assert_array_equal((db.tensor("A") * 2.0).numpy(), (a + 1) * 2)
