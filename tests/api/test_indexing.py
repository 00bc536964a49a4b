"""Indexing a stored tensor as numpy does: the region is read from only the stored chunks it
overlaps, on one device and partitioned on two; checked against numpy on seeded indices."""

from __future__ import annotations

import numpy as np
import pytest

import tensorql as tq
from tensorql.storage.duckdb_store import DuckDBChunkStore

A = np.arange(9 * 10 * 4, dtype=np.float32).reshape(9, 10, 4)


def _indices(n: int = 40, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)

    def one(size):
        kind = rng.integers(0, 4)
        if kind == 0:
            return int(rng.integers(-size, size))
        if kind == 1:
            return slice(None)
        lo, hi = sorted(int(v) for v in rng.integers(-size - 2, size + 2, 2))
        step = int(rng.choice([1, 1, 2, 3, -1, -2]))
        if step < 0:
            lo, hi = hi, lo
        return slice(lo, hi, step) if kind == 2 else slice(lo, None, step)

    out = []
    for _ in range(n):
        out.append(tuple(one(s) for s in A.shape[: int(rng.integers(1, 4))]))
    return out + [(Ellipsis, 1), (None, 2, Ellipsis), (slice(1, 3), None, -1), 3, (),
                  (slice(5, 5),)]


@pytest.mark.parametrize("devices", [1, 2])
def test_indexing_matches_numpy(devices):
    with tq.connect(devices=devices, workers=2) as db:
        a = db.from_numpy("a", A, tile=(4, 3, 2))
        for index in _indices():
            want = A[index]
            got = a[index]
            assert got.shape == want.shape, index
            np.testing.assert_array_equal(got.numpy(), want, err_msg=str(index))


def test_a_slice_reads_only_the_chunks_it_overlaps(monkeypatch):
    reads = []
    original = DuckDBChunkStore._read_pages  # every chunk read from DuckDB goes through it

    def counting(self, table, key):
        reads.append(key)
        return original(self, table, key)

    with tq.connect() as db:
        a = db.from_numpy("a", A, tile=(4, 3, 2))  # 3 x 4 x 2 stored chunks
        db.chunk_store.cache._items.clear()
        monkeypatch.setattr(DuckDBChunkStore, "_read_pages", counting)
        got = a[5:7, 1:2, :].numpy()
        np.testing.assert_array_equal(got, A[5:7, 1:2, :])
        assert sorted(set(reads)) == [(1, 0, 0), (1, 0, 1)]


def test_slices_compose_with_queries_and_with_each_other():
    b = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)
    with tq.connect(devices=2, workers=2) as db:
        a, w = db.from_numpy("a", A, tile=(4, 3, 2)), db.from_numpy("w", b, tile=(2, 3))
        np.testing.assert_allclose((a[2:8, 3] @ w[:, 1:5]).numpy(), A[2:8, 3] @ b[:, 1:5],
                                   rtol=1e-5)
        np.testing.assert_array_equal(a[1:][2:6, ::1][1].numpy(), A[1:][2:6][1])
        assert "scan a[" in (a[1:3] * 2).explain(stage="einsum")


def test_bad_indices_say_why():
    with tq.connect() as db:
        a = db.from_numpy("a", A, tile=(4, 3, 2))
        with pytest.raises(IndexError, match="out of bounds for dimension 1 of size 10"):
            a[0, 10]
        with pytest.raises(IndexError, match="too many indices"):
            a[0, 0, 0, 0]
        with pytest.raises(tq.UnsupportedError, match="only ints, slices"):
            a[1.5]
        with pytest.raises(tq.UnsupportedError, match="more than one array"):
            a[[0, 1], [0, 1]]  # numpy broadcasts index arrays together; one array is a gather


@pytest.mark.parametrize("devices", [1, 2])
def test_indexing_a_computed_expression_matches_numpy(devices):
    with tq.connect(devices=devices, workers=2) as db:
        a = db.from_numpy("a", A, tile=(4, 3, 2))
        expr = a * 2.0 + 1.0
        for index in _indices(seed=3):
            np.testing.assert_array_equal(expr[index].numpy(), (A * 2.0 + 1.0)[index],
                                          err_msg=str(index))
        flags = db.from_numpy("flags", A > 100)  # bool and integer tensors select as well
        np.testing.assert_array_equal(flags[::-3, 1].numpy(), (A > 100)[::-3, 1])
        ints = db.from_numpy("ints", A.astype(np.int64))
        np.testing.assert_array_equal((ints + 1)[2, ::2].numpy(), (A.astype(np.int64) + 1)[2, ::2])


def test_gradient_flows_through_a_strided_index():
    with tq.connect() as db:
        a = db.from_numpy("a", A.astype(np.float64))
        loss = ((a * 3.0)[::2, 1::3] ** 2).sum()
        (g,) = tq.grad(loss, [a])
        expected = np.zeros_like(A, dtype=np.float64)
        expected[::2, 1::3] = 2 * 9.0 * A[::2, 1::3]
        np.testing.assert_allclose(g.numpy(), expected)


def test_indexing_a_computed_tensor_never_mixes_in_other_rows():
    """A pick from a computed tensor is that value alone: a NaN or inf elsewhere in the dim
    does not reach it (a product with a 0/1 matrix made 0 * inf a NaN), and the dtype stays
    (an int index squeezed a bool or int8 through a sum, which widened it to int64)."""
    import numpy as np

    import tensorql as tq

    a = np.array([[1.0, 2.0, 5.0], [np.nan, np.inf, -1.0], [3.0, -np.inf, 7.0]])
    db = tq.connect()
    x = db.constant(a) * 1
    for index in (0, 1, -1, (slice(0, 2), 2), (np.array([2, 0]),), (slice(None), np.array([1, 2])),
                  (1, 2), (a[:, 0] > 2,), (2, slice(None, None, -1))):
        got = x[index].numpy()
        np.testing.assert_array_equal(got, a[index])
        assert got.dtype == a[index].dtype
    flags = db.constant(np.array([[True, False], [False, True]])).eq(db.constant(np.ones((2, 2))))
    assert flags[1].dtype == "bool" and flags[1].numpy().tolist() == [False, True]
    small = db.constant(np.array([[1, 2], [3, 4]], dtype=np.int8)) * 1
    assert small[:, 1].dtype == "int8" and small[:, 1].numpy().tolist() == [2, 4]
