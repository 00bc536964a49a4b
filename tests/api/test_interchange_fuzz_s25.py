"""Interchange and storage fixes from fuzzing (session 25): negative views, masked arrays,
grids with no blocks, a progress callback that raises, dims of 2^31 or more in SQL views."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq


@pytest.fixture
def db():
    return tq.connect()


def _negative_views():
    c = torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j], dtype=torch.complex64)
    return [torch.conj(c).imag, torch.conj(c[:1]).imag,
            torch._neg_view(torch.arange(6.0).reshape(2, 3))]


@pytest.mark.parametrize("k", range(3))
@pytest.mark.parametrize("route", ["from_torch", "from_torch_tiled", "from_dlpack"])
def test_a_negative_view_is_stored_with_its_values(db, k, route):
    view = _negative_views()[k]
    expected = view.resolve_neg().numpy()
    if route == "from_torch":
        stored = db.from_torch("v", view)
    elif route == "from_torch_tiled":
        stored = db.from_torch("v", view, tile=(1,) * view.ndim)
    else:  # torch's own DLPack export drops the negative bit
        stored = tq.from_dlpack(db, "v", view)
    np.testing.assert_array_equal(stored.numpy(), expected)


def test_from_dlpack_takes_a_tensor_that_requires_grad_as_from_torch_does(db):
    w = torch.arange(3.0, requires_grad=True)
    np.testing.assert_array_equal(tq.from_dlpack(db, "w", w).numpy(), [0.0, 1.0, 2.0])


def test_masked_arrays(db):
    clean = np.ma.masked_array([1.0, 2.0], mask=[False, False])
    np.testing.assert_array_equal(db.from_numpy("m", clean).numpy(), [1.0, 2.0])
    with pytest.raises(tq.UnsupportedError, match="1 masked value"):
        db.from_numpy("n", np.ma.masked_array([1.0, 2.0], mask=[False, True]))
    assert db.tensors() == ["m"]


def test_a_grid_with_no_blocks_along_one_dim_lists_no_keys_at_once(db):
    stored = db.from_numpy("z", np.zeros((0, 2**33), np.float32), tile=(1, 1))
    assert stored.shape == (0, 2**33) and stored.numpy().shape == (0, 2**33)


def test_a_raising_progress_callback_in_from_numpy_is_named_and_stores_nothing(db):
    db.from_numpy("A", np.zeros((4, 4)))

    def boom(done, total):
        if done == 2:
            raise ValueError("boom")

    with pytest.raises(tq.ProgressCallbackError, match="ValueError: boom") as info:
        db.from_numpy("A", np.ones((4, 4)), tile=(1, 1), replace=True, progress=boom)
    assert isinstance(info.value.__cause__, ValueError)
    np.testing.assert_array_equal(db.tensor("A").numpy(), np.zeros((4, 4)))


def test_sql_views_of_a_dim_past_int32_count_in_bigint():
    """The element view of a tensor 2^31 + 3 long, over a chunk table holding its last chunk
    only (the real view SQL, without storing 2 GiB): k * tile overflowed INTEGER."""
    from tensorql.grid import ChunkGrid
    from tensorql.storage.chunk_store import TensorMeta
    from tensorql.storage.duckdb_store import DuckDBChunkStore

    n, tile = 2**31 + 3, 2**30
    store = DuckDBChunkStore()  # its connection has the view's decoding functions
    con = store.connection
    con.execute("CREATE TABLE chunks (k0 INTEGER, page INTEGER, payload BLOB)")
    con.execute("INSERT INTO chunks VALUES (2, 0, ?)", [bytes([7, 8, 9])])
    meta = TensorMeta("big", (n,), "int8", ChunkGrid((n,), (tile,)))
    DuckDBChunkStore._create_views(con, meta, "chunks")
    rows = con.sql('SELECT d0, val FROM "big" ORDER BY d0').fetchall()
    assert rows == [(2147483648, 7), (2147483649, 8), (2147483650, 9)]
