"""Products against stored weights use a packed copy of the weight (oneDNN's layout), made
once and kept while the stored chunk lives: same values as torch, the same bits every run,
and never for a tensor that may change behind the product's back."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from tensorql_kernels import packed_weights
from tensorql_kernels.packed_weights import mark_immutable, matmul, packed_bytes

import tensorql as tq

pytestmark = pytest.mark.skipif(not packed_weights.ENABLED, reason="no oneDNN in this torch")


def _rng():
    return np.random.default_rng(11)


def test_a_query_over_a_stored_weight_packs_it_once_and_gives_the_same_bits_each_run():
    rng = _rng()
    x = rng.standard_normal((64, 96)).astype(np.float32)
    w = rng.standard_normal((96, 80)).astype(np.float32)
    with tq.connect(devices="cpu") as db:  # oneDNN packs for the CPU
        db.from_numpy("w", w)
        query = (db.constant(x) @ db.tensor("w")).compile()
        before = packed_bytes()
        first = query.run(dense=True).dense().numpy()
        assert packed_bytes() - before >= w.nbytes  # packed on its first product
        runs = [query.run(dense=True).dense().numpy() for _ in range(3)]
    np.testing.assert_allclose(first, x @ w, rtol=1e-4, atol=1e-4)
    for again in runs:
        np.testing.assert_array_equal(again, first)


def test_a_tensor_not_marked_immutable_is_never_packed():
    """A constant over a user's array may be rewritten in place (numpy does not tell torch):
    its products keep torch.mm and follow the new values."""
    rng = _rng()
    x = rng.standard_normal((32, 16)).astype(np.float32)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    with tq.connect(devices="cpu") as db:  # oneDNN packs for the CPU
        query = (db.constant(x) @ db.constant(w)).compile()
        np.testing.assert_allclose(query.run(dense=True).dense().numpy(), x @ w, rtol=1e-5,
                                   atol=1e-5)
        w *= 2  # in place, behind torch's back
        np.testing.assert_allclose(query.run(dense=True).dense().numpy(), x @ w, rtol=1e-5,
                                   atol=1e-5)


def test_an_immutable_chunk_written_anyway_is_packed_again():
    w = torch.randn(24, 12, generator=torch.Generator().manual_seed(3))
    x = torch.randn(20, 24, generator=torch.Generator().manual_seed(4))
    mark_immutable(w)
    torch.testing.assert_close(matmul(x, w), x @ w, rtol=1e-5, atol=1e-5)
    w.mul_(-1)  # torch counts the write: the packed copy is stale and is not used
    torch.testing.assert_close(matmul(x, w), x @ w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(matmul(x, w[:, 4:]), x @ w[:, 4:], rtol=1e-5, atol=1e-5)


def test_few_rows_keep_torch_mm_and_a_dead_chunk_drops_its_packed_copy():
    gc.collect()  # an earlier test's chunks in cyclic garbage would leave during this one
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(5))
    mark_immutable(w)
    before = packed_bytes()
    row = torch.randn(1, 64, generator=torch.Generator().manual_seed(6))
    assert torch.equal(matmul(row, w), torch.mm(row, w))  # a decoded token's product
    assert packed_bytes() == before
    rows = torch.randn(packed_weights.MIN_ROWS, 64, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(matmul(rows, w), rows @ w, rtol=1e-5, atol=1e-5)
    assert packed_bytes() > before
    del w
    gc.collect()
    assert packed_bytes() == before


def test_a_packed_product_into_a_tile_makes_no_product_sized_temporary(monkeypatch):
    """oneDNN's linear has no ``out``: into a tile of a dense result, the product is made row
    block by row block through a scratch of OUT_BLOCK_BYTES at most (the last block shorter),
    each block the bits of the whole product's rows."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(packed_weights, "OUT_BLOCK_BYTES", 40 * 48 * 4)  # 40-row blocks
    rng = _rng()
    x = torch.from_numpy(rng.standard_normal((150, 32)).astype(np.float32))
    w = torch.from_numpy(rng.standard_normal((32, 48)).astype(np.float32))
    mark_immutable(w)
    whole = matmul(x, w)  # the packed product, made at once
    big = torch.full((200, 100), -3.0)
    tile = big[10:160, 20:68]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        got = matmul(x, w, out=tile)
    assert got.data_ptr() == tile.data_ptr()
    largest = max(e.cpu_memory_usage for e in prof.events())  # per call
    assert largest <= 40 * 48 * 4, largest
    torch.testing.assert_close(tile, whole, rtol=0, atol=0)
    torch.testing.assert_close(tile, x @ w, rtol=1e-5, atol=1e-5)
    tile.fill_(-3.0)
    assert (big == -3.0).all()  # nothing outside the tile was written
