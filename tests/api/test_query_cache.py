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
