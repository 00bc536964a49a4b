"""A run reads one version of each stored tensor (issue 32, finding 7): a query whose load
tasks read many chunks of a tensor that another thread replaces meanwhile sees every chunk
of the old version or every chunk of the new one, never a mix, and never a missing table."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import tensorql as tq
from tensorql.grid import ChunkGrid
from tensorql.storage.chunk_store import TensorMeta
from tensorql.storage.duckdb_store import DuckDBChunkStore
from tensorql.storage.memory_store import MemoryChunkStore

SHAPE, TILE = (32, 32), (8, 8)  # 4x4 chunks
VERSIONS = 60  # replaces made by the writer: version k holds k in every element


def _race(read, store_version, reads_per_thread=40, readers=2):
    """Run ``readers`` threads calling ``read()`` while the writer stores versions
    1..VERSIONS; each reader reads at least ``reads_per_thread`` times and until the writer
    is done (no sleeps: the threads run as fast as they can). Returns (results, errors)."""
    store_version(0)
    done = threading.Event()
    results: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def writer():
        try:
            for k in range(1, VERSIONS + 1):
                store_version(k)
        except BaseException as err:  # noqa: BLE001 - asserted on below
            with lock:
                errors.append(err)
        finally:
            done.set()

    def reader():
        n = 0
        while n < reads_per_thread or not done.is_set():
            n += 1
            try:
                value = read()
            except BaseException as err:  # noqa: BLE001 - asserted on below
                with lock:
                    errors.append(err)
                return
            with lock:
                results.append(value)
            if n > 20 * reads_per_thread:  # bounded whatever the scheduling
                return

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader)
                                                   for _ in range(readers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, errors


def _assert_one_version_each(results, errors):
    assert errors == [], errors[:3]
    per_version = float(np.prod(SHAPE))
    for total in results:  # the sum of a version k is exactly k * 1024
        k = total / per_version
        assert k == int(k) and 0 <= k <= VERSIONS, f"a read mixed versions: sum {total}"


def test_a_multi_chunk_query_racing_replace_sums_one_version():
    with tq.connect(workers=2) as db:
        def store_version(k):
            db.from_numpy("w", np.full(SHAPE, float(k)), tile=TILE, replace=True)

        def read():
            return float(tq.einsum("ij->", db.tensor("w")).numpy())

        _assert_one_version_each(*_race(read, store_version))


def test_a_plan_run_again_reads_the_version_current_at_its_start():
    """One compiled query run again and again (no recompiling between runs) while the
    tensor is replaced: each run sums one version, and a run after a replace is of the new
    version, not of the one an earlier run pinned."""
    with tq.connect(workers=2) as db:
        db.from_numpy("w", np.zeros(SHAPE), tile=TILE)
        query = tq.einsum("ij->", db.tensor("w")).compile()

        def store_version(k):
            db.from_numpy("w", np.full(SHAPE, float(k)), tile=TILE, replace=True)

        def read():
            return float(query.run(dense=True).dense())

        _assert_one_version_each(*_race(read, store_version))
        assert float(query.run(dense=True).dense()) == VERSIONS * np.prod(SHAPE)


@pytest.mark.parametrize("make_store", [DuckDBChunkStore, MemoryChunkStore])
def test_a_region_read_racing_replace_is_one_version(make_store):
    store = make_store()
    grid = ChunkGrid(SHAPE, TILE)
    meta = TensorMeta("w", SHAPE, "float64", grid)

    def store_version(k):
        store.put_tensor(meta, ((key, np.full(grid.chunk_shape(key), float(k)))
                                for key in grid.keys()), replace=True)

    def read():
        return float(store.read_region("w", (0, 0), SHAPE).sum())

    try:
        _assert_one_version_each(*_race(read, store_version))
    finally:
        store.close()


def test_a_pinned_version_stays_readable_after_replace_and_drop():
    store = DuckDBChunkStore()
    grid = ChunkGrid(SHAPE, TILE)
    meta = TensorMeta("w", SHAPE, "float64", grid)

    def put(k):
        store.put_tensor(meta, ((key, np.full(grid.chunk_shape(key), float(k)))
                                for key in grid.keys()), replace=True)

    try:
        put(1)
        pinned = store.pin(["w"])
        put(2)  # the replace keeps version 1's chunks while the pin holds them
        old = pinned["w"]
        assert float(store.read_region_at(old, (0, 0), SHAPE).sum()) == np.prod(SHAPE)
        assert float(store.read_region("w", (0, 0), SHAPE).sum()) == 2 * np.prod(SHAPE)
        store.drop("w")
        assert float(store.read_chunk_at(old, (3, 3)).sum()) == 64.0
        store.unpin(pinned.values())
        put(3)  # the next write removes the table no pin holds any more
        tables = {row[0] for row in store.connection.execute(
            "SELECT table_name FROM duckdb_tables() WHERE table_name LIKE 'tq_chunks_%'"
        ).fetchall()}
        assert tables == {store._entry("w")[0]}
    finally:
        store.close()
