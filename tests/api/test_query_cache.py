"""The session's compiled-query cache (tensorql/pipeline/query_cache.py): a query written
again reuses its plan, and every change the plan depends on plans it anew. Results are
checked against numpy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tensorql as tq
from tensorql.logical.path import PATH_CACHE
from tensorql.pipeline.query_cache import QueryCache, query_key

EQ = "ab,bc,cd,de->ae"
SHAPES = [(3, 4), (4, 5), (5, 6), (6, 2)]


def _session(seed: int = 0):
    db = tq.connect()
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    return db, arrays, [db.from_numpy(f"t{n}", a) for n, a in enumerate(arrays)]


def test_repeated_query_reuses_its_plan_and_stays_right():
    db, arrays, stored = _session()
    first = tq.einsum(EQ, *stored)
    plan = first.compile()
    for _ in range(3):
        again = tq.einsum(EQ, *stored)  # a new graph of new nodes, the same structure
        assert again.node is not first.node
        assert again.compile() is plan
        np.testing.assert_allclose(again.numpy(), np.einsum(EQ, *arrays), rtol=1e-5,
                                   atol=1e-5)
    assert db.query_cache.hits >= 3


def test_other_structure_is_planned_apart():
    db, arrays, stored = _session()
    plan = tq.einsum(EQ, *stored).compile()
    other = tq.einsum("ab,bc,cd,de->ea", *stored)
    assert other.compile() is not plan
    np.testing.assert_allclose(other.numpy(), np.einsum("ab,bc,cd,de->ea", *arrays),
                               rtol=1e-5, atol=1e-5)
    swapped = tq.einsum("ab,bc->ac", stored[0], stored[1])
    assert query_key(swapped.node) != query_key(tq.einsum("ab,bc->ac", stored[0],
                                                          db.from_numpy("u", arrays[1])).node)


def test_replaced_stored_tensor_is_read_anew():
    db, arrays, stored = _session()
    plan = tq.einsum(EQ, *stored).compile()
    new = np.random.default_rng(9).standard_normal(SHAPES[2]).astype(np.float32)
    stored[2] = db.from_numpy("t2", new, replace=True)  # same name and shape, new values
    query = tq.einsum(EQ, *stored)
    assert query.compile() is not plan
    np.testing.assert_allclose(query.numpy(), np.einsum(EQ, *arrays[:2], new, arrays[3]),
                               rtol=1e-5, atol=1e-5)


def test_clearing_the_path_cache_plans_again():
    _, arrays, stored = _session()
    plan = tq.einsum(EQ, *stored).compile()
    PATH_CACHE.clear()
    misses = PATH_CACHE.misses
    query = tq.einsum(EQ, *stored)
    assert query.compile() is not plan
    assert PATH_CACHE.misses > misses  # the path was searched again
    np.testing.assert_allclose(query.numpy(), np.einsum(EQ, *arrays), rtol=1e-5, atol=1e-5)


def test_other_options_plan_again():
    db, arrays, stored = _session()
    plan = tq.einsum(EQ, *stored).compile()
    db.options = dataclasses.replace(db.options, deterministic=not db.options.deterministic)
    query = tq.einsum(EQ, *stored)
    assert query.compile() is not plan
    np.testing.assert_allclose(query.numpy(), np.einsum(EQ, *arrays), rtol=1e-5, atol=1e-5)


def test_in_memory_operand_is_not_cached():
    _, arrays, stored = _session()
    literal = np.ones(SHAPES[3], dtype=np.float32)
    query = tq.einsum(EQ, *stored[:3], literal)
    assert query_key(query.node) is None
    literal *= 3  # a user may change an array in place between two queries
    again = tq.einsum(EQ, *stored[:3], literal)
    np.testing.assert_allclose(again.numpy(), np.einsum(EQ, *arrays[:3], literal), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("capacity", [1, 2])
def test_cache_is_bounded(capacity):
    cache = QueryCache(capacity=capacity)
    for n in range(5):
        cache.get((n,), stamp=0)
        cache.put((n,), 0, f"plan {n}")
    assert len(cache) == capacity
    assert cache.get((4,), stamp=0) == "plan 4"
    cache.put((5,), 1, "stale")  # put under an older stamp than the cache's: ignored
    assert cache.get((5,), stamp=0) is None


def test_leaf_entries_are_kept_per_node_and_key_alike():
    """A stored operand's key entry is kept with its node (issue 31: a 120-operand network
    keyed 600 fields a call): the key is the one computed afresh, and the entry goes with
    its node."""
    import gc

    from tensorql.einsum.graph import EinsumOp, Source
    from tensorql.grid import ChunkGrid
    from tensorql.pipeline import query_cache

    _, _, stored = _session()
    query = tq.einsum(EQ, *stored)
    first = query_key(query.node)
    assert all(t.node in query_cache._LEAF_ENTRIES for t in stored)
    assert query.node not in query_cache._LEAF_ENTRIES  # it has inputs: keyed by position
    query_cache._LEAF_ENTRIES.clear()
    assert query_key(tq.einsum(EQ, *stored).node) == first
    # a node of another name, shape or grid has its own entry
    grid = ChunkGrid((2, 3), (2, 3))
    a = Source(shape=(2, 3), dtype="float32", name="A", grid=grid)
    others = [Source(shape=(2, 3), dtype="float32", name="B", grid=grid),
              Source(shape=(2, 3), dtype="float64", name="A", grid=grid),
              Source(shape=(2, 3), dtype="float32", name="A", grid=ChunkGrid((2, 3), (1, 3)))]
    key = query_key(EinsumOp.build("ij->i", [a]))
    assert all(query_key(EinsumOp.build("ij->i", [b])) != key for b in others)
    before = len(query_cache._LEAF_ENTRIES)
    del a, others
    gc.collect()
    assert len(query_cache._LEAF_ENTRIES) == before - 4


def test_values_changed_between_calls_are_read_each_call():
    """Stored values replaced between two warm calls of the same query (same names, shapes
    and tiles): the second call computes with the new values (numpy oracle)."""
    db, arrays, stored = _session()
    np.testing.assert_allclose(tq.einsum(EQ, *stored).numpy(), np.einsum(EQ, *arrays),
                               rtol=1e-5, atol=1e-5)
    for step in range(3):
        arrays[step] = arrays[step] * (step + 2)
        stored[step] = db.from_numpy(f"t{step}", arrays[step], replace=True)
        _close(tq.einsum(EQ, *stored).numpy(), np.einsum(EQ, *arrays))
    # the old Tensor objects name the same stored tensors: they read the new values too
    old = [db.tensor(f"t{n}") for n in range(4)]
    _close(tq.einsum(EQ, *old).numpy(), np.einsum(EQ, *arrays))


def _close(got, want):
    """Equal up to float32 rounding, relative to the result's scale."""
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())
