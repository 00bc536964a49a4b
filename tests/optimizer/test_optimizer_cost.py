"""The cost model, candidates and the plan's public surface."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tensorql as tq
from tensorql.grid import ChunkGrid
from tensorql.logical.path import contraction_path
from tensorql.optimizer import InfeasiblePlanError, SearchTooLargeError, UnknownStrategyError
from tensorql.optimizer.cost import candidates, layout, piece_bounds, scatter_splits, splits
from tensorql.optimizer.graph import OpGraph


@pytest.fixture
def db():
    with tq.connect(workers=2) as database:
        yield database


def _matmul(db, m=8, k=4, n=6):
    x = db.from_numpy("x", np.ones((m, k), dtype=np.float32))
    w = db.from_numpy("w", np.ones((k, n), dtype=np.float32))
    return x @ w


def test_exports_and_frozen(db):
    plan = tq.optimize(_matmul(db), devices=2)
    assert isinstance(plan, tq.PartitionPlan) and isinstance(plan.cost, tq.Cost)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.cost.flops = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.devices = 3  # type: ignore[misc]


def test_matmul_costs_by_hand(db):
    # 2 devices: split the rows of x; w (4x6 float32 = 96 B) is held half on each device and
    # each task needs all of it -> 2 x 48 B move; FLOPs 8*4*6*2 / 2; peak = x half + w + out half
    plan = tq.optimize(_matmul(db), devices=2)
    assert plan.cost == tq.Cost(flops=192, bytes_moved=96, peak_bytes=64 + 96 + 96)
    op = plan.ops[-1]
    assert op.vector == "i:2 k:1 j:1"
    text = plan.explain()
    assert text.startswith("partitioning for 2 devices (strategy auto): 96 B moved")
    assert "operand 1 <- [1] Scan w: 96 B (all-gather: repartitioned from (j:1 k:2) to " \
        "(j:1 k:1)" in text


def test_partial_aggregates_counted(db):
    # only the aggregated label can be split: partials of the 1x1 output go to its owner
    x = db.from_numpy("v", np.ones((1, 12), dtype=np.float32))
    plan = tq.optimize(tq.einsum("ij,ij->i", x, x), devices=4)
    op = plan.ops[-1]
    assert op.pieces == (1, 4) and op.partial_bytes == 3 * 4
    assert "partial aggregates: 12 B (aggregated labels split j:4;" in plan.explain()


def test_reduce_scatter_spreads_the_same_bytes_over_every_device():
    # a 16x6 output summed over a label in 4 pieces: a reduce sends 3 whole partials to one
    # owner; a reduce-scatter cuts the output's rows 4 ways and every device receives the
    # other 3 contributors' parts of its own quarter -- the same bytes, spread evenly
    reduce = layout((16, 6, 8), (1, 1, 4), 2, 4)
    scatter = layout((16, 6, 8), (1, 1, 4), 2, 4, scatter=(0, 4))
    assert reduce.owners() == {(0, 0): 0}
    assert scatter.owners() == {(q, 0): q for q in range(4)} and scatter.out_pieces == (4, 1)
    sizes = [np.prod(lay.outputs.lens, axis=1) for lay in (reduce, scatter)]
    for lay, size in zip((reduce, scatter), sizes):
        index = {key: int(n) for key, n in zip(lay.outputs.keys(), size)}
        received = np.zeros(4, dtype=int)
        for _, dst, piece in lay.partial_sends():
            received[dst] += index[piece]
        assert received.sum() == 3 * 16 * 6
        assert received.tolist() == ([3 * 96, 0, 0, 0] if lay is reduce else [3 * 24] * 4)
    # only splits that keep the finer output a chunk grid are offered
    assert scatter_splits(16, 1, 4) and scatter_splits(12, 2, 3)
    assert not scatter_splits(10, 2, 2) and not scatter_splits(3, 1, 4)


def test_piece_bounds_are_chunk_grids():
    # pieces are cut like a chunk grid so that a partitioned step's chunks are its pieces
    assert piece_bounds(10, 4) == (0, 3, 6, 9, 10)
    assert piece_bounds(7, 7) == tuple(range(8))
    assert splits(10, 4) and not splits(6, 4) and not splits(3, 4)
    for n in range(1, 40):
        for p in range(1, n + 1):
            bounds = piece_bounds(n, p)
            if splits(n, p):
                assert all(b > a for a, b in zip(bounds, bounds[1:]))
                assert bounds == tuple(ChunkGrid((n,), (-(-n // p),)).dim_extent(0, k)[0]
                                       for k in range(p)) + (n,)


@pytest.mark.parametrize("n", [2, 3, 5, 6, 7, 12])
def test_candidates_any_device_count(n):
    cands = candidates((8, 9, 10), n)
    assert cands and len({int(np.prod(c)) for c in cands}) == 1
    assert all(splits(s, p) for c in cands for p, s in zip(c, (8, 9, 10)))
    if n != 7:  # 7 pieces cannot be cut from 8, 9 or 10 as a grid: fewer are offered
        assert all(np.prod(c) == n for c in cands)
    else:
        assert np.prod(cands[0]) < 7


def test_candidates_fall_back_when_sizes_are_small():
    assert candidates((2, 1), 8) == ((2, 1),)
    assert candidates((), 4) == ((),)


def test_device_list_and_count(db):
    expr = _matmul(db)
    assert tq.optimize(expr, devices=["cuda:0", "cuda:1", "cuda:2"]).devices == 3
    with pytest.raises(tq.PlanError, match="devices"):
        tq.optimize(expr, devices=0)


def test_unknown_strategy_lists_options(db):
    with pytest.raises(UnknownStrategyError) as err:
        tq.optimize(_matmul(db), devices=2, strategy="fastest")
    assert "auto, data, exhaustive, model" in str(err.value)
    assert isinstance(err.value, tq.PlanError) and isinstance(err.value, KeyError)


def test_memory_limit(db):
    expr = _matmul(db, 64, 64, 64)
    free = tq.optimize(expr, devices=4)
    tight = tq.optimize(expr, devices=4, memory_limit=free.cost.peak_bytes)
    assert tight.cost.peak_bytes <= free.cost.peak_bytes
    assert "limit" in tight.explain().splitlines()[0]
    with pytest.raises(InfeasiblePlanError, match="memory_limit=100 bytes"):
        tq.optimize(expr, devices=4, memory_limit=100)
    with pytest.raises(tq.PlanError):
        tq.optimize(expr, devices=4, memory_limit="1KiB")


def test_exhaustive_bound(db):
    from tensorql.models import llama_block

    w = llama_block(db, batch=2, seq=8, d_model=16, heads=2, head_dim=8, d_ff=32,
                    materialize=False)
    with pytest.raises(SearchTooLargeError, match="use strategy='auto'"):
        tq.optimize(w.output, devices=4, strategy="exhaustive")


def test_contraction_order_prefers_small_intermediates():
    sizes = {"i": 64, "j": 8, "k": 64, "l": 8}
    assert contraction_path([("i", "j"), ("j", "k"), ("k", "l")], ("i", "l"), sizes) == \
        [(1, 2), (0, 1)]


def test_nary_einsum_binarized(db):
    a = db.from_numpy("a", np.ones((4, 5), dtype=np.float32))
    b = db.from_numpy("b", np.ones((5, 6), dtype=np.float32))
    c = db.from_numpy("c", np.ones((6, 2), dtype=np.float32))
    graph = OpGraph.build(tq.einsum("ij,jk,kl->il", a, b, c).node)
    steps = [n for n in graph.nodes if n.kind == "einsum"]
    assert len(steps) == 2 and all(len(n.inputs) == 2 for n in steps)
    assert steps[-1].out_labels == ("i", "l")


def test_explain_section_only_with_several_devices():
    with tq.connect(devices=4) as many, tq.connect() as one:
        for db, expect in ((many, True), (one, False)):
            expr = _matmul(db)
            text = expr.explain()
            assert ("partitioning for 4 devices" in text) == expect
            assert text.startswith("EXPLAIN einsum")
