"""Rule ``balance_lanes``: a large product whose output chunks do not divide evenly among a
CPU device's worker lanes is planned with its row tile cut so that they do (plan shape
asserted, not timing), reading row bands of the stored chunks as views; the result matches
numpy (float64) and torch; small, balanced, one-lane and non-result products are left alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq
from tensorql.logical.lower import lower
from tensorql.logical.rules.balance import MIN_TASK_FLOPS, balance_lanes
from tensorql.storage.memory_store import MemoryChunkStore


def _arrays(seed: int, m: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, k), dtype=np.float32),
            rng.standard_normal((k, n), dtype=np.float32))


def _product_step(expr: tq.Tensor):
    physical = expr.compile().physical
    return physical, physical.result_step


def _check(expr: tq.Tensor, want: np.ndarray) -> None:
    got = expr.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


# 3 output chunks of 512 x 512 rows, two K tiles: 2 lanes would run 2 and 1
M, K, N = 1536, 2048, 512


def test_three_output_chunks_are_cut_into_six_row_bands_for_two_lanes():
    x, y = _arrays(0, M, K, N)
    db = tq.connect(workers=2, intra_op_threads=1)
    a = db.from_numpy("a", x, tile=(512, 1024))
    b = db.from_numpy("b", y, tile=(1024, 512))
    expr = a @ b
    physical, step = _product_step(expr)
    assert "balance_lanes" in physical.rules_fired
    assert step.relation.grid.tile == (256, 512) and step.relation.grid.blocks == (6, 1)
    assert len(step.tasks) == 6 and len({t.flops for t in step.tasks}) == 1  # 3 a lane
    assert 2 * M * K * N // len(step.tasks) >= MIN_TASK_FLOPS
    want = x.astype(np.float64) @ y.astype(np.float64)
    _check(expr, want)
    torch.testing.assert_close(torch.from_numpy(expr.numpy()),
                               torch.from_numpy(x) @ torch.from_numpy(y), rtol=1e-4, atol=1e-3)
    assert "rewrite rules: balance_lanes" in expr.explain()


def test_a_region_of_a_stored_tensor_and_a_constant_are_cut_as_well():
    x, y = _arrays(1, M + 512, K, N)
    db = tq.connect(workers=2, intra_op_threads=1)
    a = db.from_numpy("a", x, tile=(512, 1024))
    b = db.from_numpy("b", y, tile=(1024, 512))
    region = a[512:]  # a scan of a region of a stored tensor
    physical, step = _product_step(region @ b)
    assert "balance_lanes" in physical.rules_fired and len(step.tasks) == 6
    _check(region @ b, x[512:].astype(np.float64) @ y.astype(np.float64))
    const = db.constant(x[:M], tile=(512, 1024))
    physical, step = _product_step(const @ b)
    assert "balance_lanes" in physical.rules_fired and len(step.tasks) == 6
    _check(const @ b, x[:M].astype(np.float64) @ y.astype(np.float64))


@pytest.mark.parametrize("case", ["one lane", "balanced", "small", "not a result"])
def test_the_rule_leaves_other_products_alone(case):
    workers = 1 if case == "one lane" else 2
    db = tq.connect(workers=workers, intra_op_threads=1)
    m = {"balanced": 2048, "small": 96}.get(case, M)
    x, y = _arrays(2, m, K if case != "small" else 64, N if case != "small" else 32)
    tile = (512, 1024) if case != "small" else (32, 64)
    a = db.from_numpy("a", x, tile=tile)
    b = db.from_numpy("b", y, tile=(tile[1], y.shape[1]))
    expr = (a @ b).relu() if case == "not a result" else a @ b
    physical, _ = _product_step(expr)
    assert "balance_lanes" not in physical.rules_fired
    want = x.astype(np.float64) @ y.astype(np.float64)
    _check(expr, np.maximum(want, 0) if case == "not a result" else want)
    plain = lower((a @ b).node)
    assert balance_lanes(1)(plain) is plain


def test_a_region_inside_one_stored_chunk_is_a_view_of_it():
    from tensorql.grid import ChunkGrid
    from tensorql.storage.chunk_store import TensorMeta

    store = MemoryChunkStore()
    grid = ChunkGrid((8, 4), (4, 4))
    full = torch.arange(32.0).reshape(8, 4)
    store.put_tensor(TensorMeta("t", (8, 4), "float32", grid),
                     ((k, full[grid.slices(k)].clone()) for k in grid.keys()))
    chunk = store.read_region("t", (4, 0), (8, 4))
    band = store.read_region("t", (6, 0), (8, 4))
    assert band.data_ptr() == chunk.data_ptr() + 2 * 4 * 4  # rows 2..3 of chunk (1, 0)
    assert band.is_contiguous() and torch.equal(band, full[6:8])
