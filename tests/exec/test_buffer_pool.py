"""The pool of dead chunk buffers: only memory nothing else can reach is reused, a query run
again computes into it, and what a run handed back is never overwritten by the next."""

from __future__ import annotations

import numpy as np
import torch

import tensorql as tq
from tensorql.exec.buffer_pool import BufferPool


def _reclaimed(pool: BufferPool, make) -> bool:
    """Whether the pool keeps the chunk ``make()`` returns (held by nothing but the run's
    dict of values)."""
    before = pool.stats.kept
    pool.reclaim({"chunk": make()}, "chunk")
    return pool.stats.kept > before


def test_only_memory_nothing_else_reaches_is_kept():
    pool = BufferPool(max_bytes=1 << 20)
    assert _reclaimed(pool, lambda: torch.ones(8))
    assert _reclaimed(pool, lambda: torch.ones(8, 8)[2:4])  # of a base nothing else holds
    held = torch.ones(8)
    values = {"chunk": held}
    pool.reclaim(values, "chunk")
    assert pool.stats.kept == 2 and held.sum().item() == 8  # the caller still holds it
    live_base = torch.ones(8)
    assert not _reclaimed(pool, lambda: live_base[2:])
    borrowed = np.ones(16, dtype=np.float32)
    assert not _reclaimed(pool, lambda: torch.from_numpy(borrowed))  # numpy's, not torch's


def test_take_hands_out_a_buffer_of_the_same_size_once():
    pool = BufferPool(max_bytes=1 << 20)
    pool.reclaim({"a": torch.zeros(4, 6)}, "a")
    buf = pool.take((3, 8), torch.float32)
    assert buf is not None and tuple(buf.shape) == (3, 8) and buf._base is None
    assert pool.take((3, 8), torch.float32) is None
    assert pool.take((5,), torch.float32) is None
    assert (pool.stats.hits, pool.stats.misses) == (1, 2)
    pool.restore(buf)
    assert pool.take((24,), torch.int32) is not None  # same bytes, another dtype


def test_the_pool_holds_at_most_its_size():
    pool = BufferPool(max_bytes=100)
    assert _reclaimed(pool, lambda: torch.ones(20))       # 80 bytes
    assert not _reclaimed(pool, lambda: torch.ones(20))   # 160 > 100
    assert pool.held_bytes == 80
    pool.clear()
    assert pool.held_bytes == 0


def test_a_query_run_again_computes_into_the_buffers_of_the_last_run():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 192)).astype(np.float32)
    w = rng.standard_normal((192, 128)).astype(np.float32)
    b = rng.standard_normal(128).astype(np.float32)
    with tq.connect(workers=2) as db:
        xs, ws, bs = (db.from_numpy(n, a, tile=t) for n, a, t in
                      (("x", x, (64, 64)), ("w", w, (64, 64)), ("b", b, (64,))))
        expr = (((xs @ ws + bs).relu() @ ws.T) * 0.05).tanh()
        reference = np.tanh((np.maximum(x @ w + b, 0) @ w.T) * 0.05)
        first = expr.numpy()
        assert db.buffer_pool.stats.kept > 0
        hits = db.buffer_pool.stats.hits
        second = expr.numpy()
        assert db.buffer_pool.stats.hits > hits
        np.testing.assert_allclose(second, reference, atol=1e-5)
        # the first run's result is the caller's: the second run wrote elsewhere
        np.testing.assert_allclose(first, reference, atol=1e-5)
    assert db.buffer_pool.held_bytes == 0  # closing the session frees the pool


def test_buffer_pool_bytes_zero_turns_it_off():
    x = np.random.default_rng(1).standard_normal((128, 128)).astype(np.float32)
    with tq.connect(workers=2, buffer_pool_bytes=0) as db:
        a = db.from_numpy("a", x, tile=(64, 64))
        expr = ((a @ a).relu() @ a)
        for _ in range(2):
            np.testing.assert_allclose(expr.numpy(), np.maximum(x @ x, 0) @ x,
                                       rtol=1e-3, atol=1e-3)
        assert db.buffer_pool.stats.kept == db.buffer_pool.stats.hits == 0


def test_chunks_results_handed_back_are_not_reused():
    """A run that keeps its result as chunks (not one dense tensor) hands those chunks to
    the caller: a later run must not compute into them."""
    x = np.random.default_rng(2).standard_normal((128, 128)).astype(np.float32)
    with tq.connect(workers=2) as db:
        a = db.from_numpy("a", x, tile=(64, 64))
        query = ((a @ a) * 2.0).compile()
        kept = query.run()
        before = {key: chunk.clone() for key, chunk in kept.chunks.items()}
        for _ in range(3):
            query.run()
        for key, chunk in kept.chunks.items():
            torch.testing.assert_close(chunk, before[key])
