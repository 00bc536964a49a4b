"""Products against stored weights use a packed copy of the weight (oneDNN's layout, or MKL's
packed sgemm), made once and kept while the stored chunk lives: same values as torch, the
same bits every run, and never for a tensor that may change behind the product's back."""

from __future__ import annotations

import dataclasses
import gc

import numpy as np
import pytest
import torch
from tensorql_kernels import packed_weights
from tensorql_kernels.packed_weights import mark_immutable, matmul, packed_bytes

import tensorql as tq

HOST_PACKINGS = [name for name, p in packed_weights.PACKINGS.items() if p.available]


@pytest.fixture(params=HOST_PACKINGS)
def packing_on(request, monkeypatch):
    """The packed path is tested on every host and with every packing this torch has (the
    host's default picks one), as ``TENSORQL_PACKED_WEIGHTS=<name>`` would, for products of
    any size (their small weights are far below ``MIN_MACS``)."""
    monkeypatch.setattr(packed_weights, "BACKEND", request.param)
    monkeypatch.setattr(packed_weights, "ENABLED", True)
    monkeypatch.setattr(packed_weights, "MIN_MACS", 0)
    return request.param


@pytest.fixture(params=[n for n in HOST_PACKINGS if packed_weights.PACKINGS[n].in_place])
def in_place_packing(request, monkeypatch):
    """As ``packing_on``, for the packings whose products into or added to a tile use the
    packed copy too (``Packing.in_place``)."""
    monkeypatch.setattr(packed_weights, "BACKEND", request.param)
    monkeypatch.setattr(packed_weights, "ENABLED", True)
    monkeypatch.setattr(packed_weights, "MIN_MACS", 0)
    return request.param


@pytest.mark.parametrize("setting, vendor, mkl, onednn, mkl_packing, packing", [
    (None, "GenuineIntel", True, True, True, "mkl"),      # MKL's own packed sgemm
    (None, "GenuineIntel", True, True, False, None),      # MKL's kernels beat oneDNN's packing
    (None, "AuthenticAMD", True, True, True, "onednn"),   # MKL off its home ground
    ("auto", "GenuineIntel", False, True, False, "onednn"),  # another BLAS
    (None, None, True, True, True, "onednn"),             # vendor unknown (no /proc/cpuinfo)
    ("1", "GenuineIntel", True, True, True, "mkl"),       # asked for: the host's packing
    ("1", "GenuineIntel", True, True, False, "onednn"),   # asked for, no MKL packing: oneDNN
    ("on", "AuthenticAMD", True, True, True, "onednn"),
    ("onednn", "GenuineIntel", True, True, True, "onednn"),  # one named
    ("MKL", "AuthenticAMD", True, True, True, "mkl"),
    ("mkl", "AuthenticAMD", True, True, False, None),     # named but absent
    ("0", "AuthenticAMD", True, True, True, None),        # refused
    ("1", "AuthenticAMD", True, False, False, None),      # no oneDNN: nothing to pack with
])
def test_packing_is_chosen_by_the_setting_and_the_host(setting, vendor, mkl, onednn,
                                                       mkl_packing, packing):
    chosen, why = packed_weights.choose(setting, vendor, mkl, onednn, mkl_packing)
    assert chosen == packing
    assert why.startswith(packing if packing else "off")


def test_the_default_follows_the_environment_in_a_new_process():
    import os
    import subprocess
    import sys

    code = ("from tensorql_kernels import packed_weights as p; "
            "print(p.BACKEND, p.RULE == p.choose(p.os.environ.get('TENSORQL_PACKED_WEIGHTS'), "
            "p.cpu_vendor(), p.torch.backends.mkl.is_available(), p.AVAILABLE, "
            "p.PACKINGS['mkl'].available)[1])")
    seen = {}
    for setting in ("0", "1", "auto"):
        env = {**os.environ, "TENSORQL_PACKED_WEIGHTS": setting}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, check=True)
        seen[setting] = done.stdout.split()
    assert seen["0"] == ["None", "True"]
    for setting in ("1", "auto"):
        expected = packed_weights.choose(setting, packed_weights.cpu_vendor(),
                                         torch.backends.mkl.is_available(),
                                         packed_weights.AVAILABLE,
                                         packed_weights.PACKINGS["mkl"].available)
        assert seen[setting] == [str(expected[0]), "True"]


def _rng():
    return np.random.default_rng(11)


def test_a_query_over_a_stored_weight_packs_it_once_and_gives_the_same_bits_each_run(packing_on):
    """With either packing; a dense result's tiles only with one whose products into a tile
    use it (``in_place``), else the result's chunks, products of their own."""
    rng = _rng()
    x = rng.standard_normal((64, 96)).astype(np.float32)
    w = rng.standard_normal((96, 80)).astype(np.float32)
    dense = packed_weights.PACKINGS[packing_on].in_place
    with tq.connect(devices="cpu") as db:  # packs for the CPU
        db.from_numpy("w", w)
        query = (db.constant(x) @ db.tensor("w")).compile()
        before = packed_bytes()
        first = query.run(dense=dense).dense().numpy()
        assert packed_bytes() - before >= w.nbytes  # packed on its first product
        runs = [query.run(dense=dense).dense().numpy() for _ in range(3)]
    np.testing.assert_allclose(first, x @ w, rtol=1e-4, atol=1e-4)
    for again in runs:
        np.testing.assert_array_equal(again, first)


def test_a_tensor_not_marked_immutable_is_never_packed(packing_on):
    """A constant over a user's array may be rewritten in place (numpy does not tell torch):
    its products keep torch.mm and follow the new values."""
    rng = _rng()
    x = rng.standard_normal((32, 16)).astype(np.float32)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    with tq.connect(devices="cpu") as db:  # packs for the CPU
        query = (db.constant(x) @ db.constant(w)).compile()
        np.testing.assert_allclose(query.run(dense=True).dense().numpy(), x @ w, rtol=1e-5,
                                   atol=1e-5)
        w *= 2  # in place, behind torch's back
        np.testing.assert_allclose(query.run(dense=True).dense().numpy(), x @ w, rtol=1e-5,
                                   atol=1e-5)


def test_an_immutable_chunk_written_anyway_is_packed_again(packing_on):
    w = torch.randn(24, 12, generator=torch.Generator().manual_seed(3))
    x = torch.randn(20, 24, generator=torch.Generator().manual_seed(4))
    mark_immutable(w)
    torch.testing.assert_close(matmul(x, w), x @ w, rtol=1e-5, atol=1e-5)
    w.mul_(-1)  # torch counts the write: the packed copy is stale and is not used
    torch.testing.assert_close(matmul(x, w), x @ w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(matmul(x, w[:, 4:]), x @ w[:, 4:], rtol=1e-5, atol=1e-5)


def test_few_rows_keep_torch_mm_and_a_dead_chunk_drops_its_packed_copy(packing_on):
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


def test_a_small_product_keeps_torch_mm(packing_on, monkeypatch):
    """Below MIN_MACS multiply-adds the product is torch's own (same bits as torch.mm) and
    nothing is packed; at it, the weight is packed."""
    w = torch.randn(64, 4, generator=torch.Generator().manual_seed(8))
    x = torch.randn(576, 64, generator=torch.Generator().manual_seed(9))
    mark_immutable(w)
    monkeypatch.setattr(packed_weights, "MIN_MACS", 576 * 64 * 4 + 1)
    before = packed_bytes()
    assert torch.equal(matmul(x, w), torch.mm(x, w))
    assert packed_bytes() == before
    monkeypatch.setattr(packed_weights, "MIN_MACS", 576 * 64 * 4)
    torch.testing.assert_close(matmul(x, w), x @ w, rtol=1e-5, atol=1e-5)
    assert packed_bytes() > before


def test_a_packed_product_into_a_tile_makes_no_product_sized_temporary(packing_on,
                                                                         monkeypatch):
    """Neither packed product has an ``out``: into a tile of a dense result, the product is
    made row block by row block through a scratch of OUT_BLOCK_BYTES at most (even blocks, the
    last one shorter), each block (oneDNN) the bits of the whole product's rows. The blocks' packed
    copies are made on the first call (MKL packs for each row count); the second makes no
    temporary larger than a block."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(packed_weights, "OUT_BLOCK_BYTES", 40 * 48 * 4)  # 40-row blocks
    monkeypatch.setattr(packed_weights, "MAX_ROW_COUNTS", 3)  # 150 rows, 38, 36
    rng = _rng()
    x = torch.from_numpy(rng.standard_normal((150, 32)).astype(np.float32))
    w = torch.from_numpy(rng.standard_normal((32, 48)).astype(np.float32))
    mark_immutable(w)
    whole = matmul(x, w)  # the packed product, made at once
    big = torch.full((200, 100), -3.0)
    tile = big[10:160, 20:68]
    matmul(x, w, out=tile)
    tile.fill_(0.0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        got = matmul(x, w, out=tile)
    assert got.data_ptr() == tile.data_ptr()
    largest = max(e.cpu_memory_usage for e in prof.events())  # per call
    assert largest <= 40 * 48 * 4, largest
    exact = packing_on == "onednn"
    torch.testing.assert_close(tile, whole, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5)
    torch.testing.assert_close(tile, x @ w, rtol=1e-5, atol=1e-5)
    tile.fill_(-3.0)
    assert (big == -3.0).all()  # nothing outside the tile was written


@pytest.mark.parametrize("rows", [1, 15, 150, 682, 1536, 3072, 4097, 8192])
@pytest.mark.parametrize("row_bytes", [4, 192, 1536 * 4, 3072 * 4, 8192 * 4])
@pytest.mark.parametrize("budget", [40 * 48 * 4, 1 << 20, 8 << 20])
def test_row_blocks_cover_the_rows_evenly_within_the_budget(rows, row_bytes, budget):
    """The blocks of a blocked product: within the scratch budget (or MIN_ROWS rows), every
    block but the last the same size, no more blocks than the budget needs plus one (an
    aligned size rounded down), and a multiple of BLOCK_ROW_ALIGN rows wherever that costs
    no more than that block --
    never 682 rows of a 3072-wide float32 result under 8 MiB, which oneDNN ran ~8 % slower."""
    size = packed_weights.block_rows(rows, row_bytes, budget)
    cap = max(packed_weights.MIN_ROWS, budget // row_bytes)
    assert 1 <= size <= max(cap, 1)
    starts = list(range(0, rows, size))
    assert sum(min(size, rows - s) for s in starts) == rows
    fewest = -(-rows // cap)
    assert fewest <= len(starts) <= fewest + 1
    align = packed_weights.BLOCK_ROW_ALIGN
    even = -(-rows // fewest)
    if size < rows and (-(-even // align) * align <= cap or (
            even >= align and -(-rows // (even // align * align)) <= fewest + 1)):
        assert size % align == 0
    assert packed_weights.block_rows(3072, 3072 * 4, 8 << 20) == 640


def test_an_accumulating_product_adds_the_packed_product_in_row_blocks(in_place_packing,
                                                                       monkeypatch):
    """``acc += x @ w`` (a K-split product's later contributions) with a packed ``w``: row
    blocks of ACC_BLOCK_BYTES added into ``acc`` (here a strided tile of a larger result),
    nothing outside it written; a weight not marked immutable is left to the caller."""
    monkeypatch.setattr(packed_weights, "ACC_BLOCK_BYTES", 40 * 48 * 4)  # 40-row blocks
    rng = _rng()
    x = torch.from_numpy(rng.standard_normal((150, 32)).astype(np.float32))
    w = torch.from_numpy(rng.standard_normal((32, 48)).astype(np.float32))
    start = torch.from_numpy(rng.standard_normal((150, 48)).astype(np.float32))
    big = torch.full((200, 100), -3.0)
    tile = big[10:160, 20:68]
    tile.copy_(start)
    loose = w.clone()  # never marked: no packed copy
    assert not packed_weights.matmul_add(tile, x, loose)
    torch.testing.assert_close(tile, start, rtol=0, atol=0)
    mark_immutable(w)
    assert packed_weights.matmul_add(tile, x, w)
    torch.testing.assert_close(tile, start + x @ w, rtol=1e-5, atol=1e-5)
    tile.fill_(-3.0)
    assert (big == -3.0).all()


def test_every_contribution_of_a_k_split_product_over_a_stored_weight_is_packed(
        in_place_packing, monkeypatch):
    """A weight stored in 3 tiles along the contracted label: the first contribution and both
    later ones (accumulated) use the packed copy; MKL's ``addmm_`` runs for none of them."""
    addmm_calls = []
    real_addmm_ = torch.Tensor.addmm_

    def counting_addmm_(self, *args, **kwargs):
        addmm_calls.append(self.shape)
        return real_addmm_(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "addmm_", counting_addmm_)
    rng = _rng()
    x = rng.standard_normal((64, 96)).astype(np.float32)
    w = rng.standard_normal((96, 80)).astype(np.float32)
    with tq.connect(devices="cpu") as db:
        db.from_numpy("w", w, tile=(32, 80))
        db.from_numpy("x", x, tile=(64, 32))
        query = (db.tensor("x") @ db.tensor("w")).compile()
        before = packed_bytes()
        got = query.run(dense=True).dense().numpy()
        assert packed_bytes() - before >= w.nbytes  # all three tiles packed
    np.testing.assert_allclose(got, x @ w, rtol=1e-4, atol=1e-4)
    assert addmm_calls == []


def _counting_mkl(monkeypatch) -> list[int]:
    """MKL's packing for products of any size, each copy's row count recorded in the list
    returned (the test is skipped where this torch has no MKL packing)."""
    if not packed_weights.PACKINGS["mkl"].available:
        pytest.skip("this torch has no MKL packing")
    monkeypatch.setattr(packed_weights, "BACKEND", "mkl")
    monkeypatch.setattr(packed_weights, "ENABLED", True)
    monkeypatch.setattr(packed_weights, "MIN_MACS", 0)
    made: list[int] = []
    packing = packed_weights.PACKINGS["mkl"]
    monkeypatch.setitem(packed_weights.PACKINGS, "mkl", dataclasses.replace(
        packing, pack=lambda right, rows: made.append(rows) or packing.pack(right, rows)))
    return made


def test_mkl_packs_for_the_first_row_counts_only(monkeypatch):
    """MKL's packed copy serves one row count: a chunk gets copies for the first
    MAX_ROW_COUNTS row counts of its products (made once each, reused, counted at the
    weight's resident bytes), and a product of any other row count keeps torch.mm, bit for
    bit, packing nothing more; so do products into a tile or added to one."""
    made = _counting_mkl(monkeypatch)
    gc.collect()
    gen = torch.Generator().manual_seed(12)
    w = torch.randn(64, 48, generator=gen)
    mark_immutable(w)
    before = packed_bytes()
    for rows in (32, 20, 32, 20):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(matmul(x, w), x @ w, rtol=1e-5, atol=1e-5)
    assert made == [32, 20]
    assert packed_bytes() - before == 2 * w.nbytes
    x = torch.randn(24, 64, generator=gen)  # a third row count
    assert torch.equal(matmul(x, w), torch.mm(x, w))
    assert made == [32, 20]
    # into a tile or added to one, torch's own product writes there: no scratch to copy
    x = torch.randn(32, 64, generator=gen)
    tile = torch.full((40, 60), 7.0)[4:36, 6:54]
    assert matmul(x, w, out=tile).data_ptr() == tile.data_ptr()
    assert torch.equal(tile, torch.mm(x, w))
    assert not packed_weights.matmul_add(tile, x, w)  # the caller adds its own product
    assert made == [32, 20]
    del w
    gc.collect()
    assert packed_bytes() == before


def test_mkl_pads_a_few_rows_to_a_kept_row_count(monkeypatch):
    """A product of a few rows fewer than a kept MKL copy serves (at most PAD_FRACTION of its
    own) uses that copy, its rows padded with zeros and the pad's rows dropped: torch's
    values, a contiguous result, no new copy; more rows fewer than that packs its own."""
    made = _counting_mkl(monkeypatch)
    gen = torch.Generator().manual_seed(13)
    w = torch.randn(64, 48, generator=gen)
    mark_immutable(w)
    for rows, packs in ((64, [64]), (57, [64]), (56, [64, 56])):  # 56 + 56 / 8 < 64
        x = torch.randn(rows, 64, generator=gen)
        got = matmul(x, w)
        assert got.shape == (rows, 48) and got.is_contiguous()
        torch.testing.assert_close(got, x @ w, rtol=1e-5, atol=1e-5)
        assert made == packs
