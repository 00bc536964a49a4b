"""``db.store`` streams result chunks into the store; ``.numpy()`` is bounded (issue 17)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import tensorql as tq
from tensorql.errors import MemoryLimitError, StorageError
from tensorql.exec.executor import Executor
from tensorql.exec.runtime import Runtime
from tensorql.grid import ChunkGrid
from tensorql.options import Options
from tensorql.pipeline import CompiledQuery
from tensorql.storage.chunk_store import TensorMeta
from tensorql.storage.memory_store import MemoryChunkStore
from tensorql.storage.stream_write import StreamingWrite


def _operands(db, rng):
    a = rng.standard_normal((40, 24)).astype(np.float32)
    b = rng.standard_normal((24, 36)).astype(np.float32)
    return a, b, db.from_numpy("A", a, tile=(16, 8)), db.from_numpy("B", b, tile=(8, 16))


def _tables(db):
    return db.connection.execute(
        "SELECT count(*) FROM duckdb_tables() WHERE table_name LIKE 'tq_chunks_%'").fetchall()[0][0]


@pytest.mark.parametrize("memory_limit", [None, "64KiB"])
def test_store_streams_the_right_values(tmp_path, memory_limit):
    rng = np.random.default_rng(0)
    with tq.connect(str(tmp_path / "s.duckdb"), memory_limit=memory_limit, devices="cpu") as db:
        a, b, A, B = _operands(db, rng)
        stored = db.store("C", A @ B)
        np.testing.assert_allclose(stored.numpy(), a @ b, rtol=1e-5, atol=1e-5)
        assert db.tensors() == ["A", "B", "C"]


@pytest.mark.parametrize("executor", [Executor(workers=2, mode="threads"),
                                      Executor(workers=2, mode="serial"),
                                      Runtime("cpu", 1 << 16)],
                         ids=["executor", "serial", "runtime"])
def test_streamed_run_keeps_no_result_chunk(executor):
    rng = np.random.default_rng(1)
    db = tq.connect()
    a, b, A, B = _operands(db, rng)
    query = (A @ B).compile()
    sid = query.physical.result_step.id
    seen = {}
    result = executor.run(query.physical.task_graph(), keep_outputs=False,
                          sink=lambda ref, chunk: seen.setdefault(ref, chunk.clone()))
    assert not {r for r, v in result.outputs.items() if r.step == sid and v is not None}
    grid = query.physical.result_step.relation.grid
    assert {r.key for r in seen if r.step == sid} == set(grid.keys())


def test_streaming_write_consumes_while_the_producer_runs():
    received = []
    arrived = threading.Event()

    class Recording(MemoryChunkStore):
        def put_tensor(self, meta, chunks, *, replace=False):
            def spy():
                for key, chunk in chunks:
                    received.append(key)
                    arrived.set()
                    yield key, chunk
            super().put_tensor(meta, spy(), replace=replace)

    store = Recording()
    meta = TensorMeta("v", (4,), "float32", ChunkGrid((4,), (2,)))
    with StreamingWrite(store, meta) as write:
        write.put((0,), np.ones(2, np.float32))
        assert arrived.wait(10), "the writer did not take the first chunk before the second"
        assert received == [(0,)] and not store.has("v")  # taken, not yet visible
        write.put((1,), np.zeros(2, np.float32))
    assert store.read_dense("v").tolist() == [1.0, 1.0, 0.0, 0.0]


def test_interrupted_store_leaves_nothing(tmp_path, monkeypatch):
    rng = np.random.default_rng(2)
    db = tq.connect(str(tmp_path / "i.duckdb"))
    _, _, A, B = _operands(db, rng)
    before = _tables(db)

    def two_chunks_then_interrupt(self, sink, progress=None):
        for key, chunk in list(self.run().iter_chunks())[:2]:
            sink(key, chunk)
        raise KeyboardInterrupt

    monkeypatch.setattr(CompiledQuery, "stream", two_chunks_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        db.store("C", A @ B)
    assert db.tensors() == ["A", "B"] and _tables(db) == before
    monkeypatch.undo()
    assert db.store("C", A @ B).shape == (40, 36)  # the name is free, nothing half-written
    db.close()


def test_failing_write_stops_the_run_and_stores_nothing():
    rng = np.random.default_rng(3)
    db = tq.connect()
    _, _, A, B = _operands(db, rng)
    with pytest.raises(StorageError):
        db.store("bad\x00name", A @ B)
    assert db.tensors() == ["A", "B"] and _tables(db) == 2


def test_dense_result_that_cannot_fit_fails_before_running():
    db = tq.connect(process_memory_limit="64MiB")
    u = db.from_numpy("u", np.ones(8192, np.float32))
    with pytest.raises(MemoryLimitError, match=r"256\.0 MiB .*db\.store"):
        tq.einsum("i,j->ij", u, u).numpy()
    with pytest.raises(MemoryLimitError):
        db.sql("SELECT * FROM EINSUM('i,j->ij', u, u)").numpy()
    stored = db.store("outer", tq.einsum("i,j->ij", u, u))  # storing streams instead
    assert stored.shape == (8192, 8192)


def test_process_memory_limit_is_one_figure():
    options = Options(process_memory_limit="2GiB")  # the cache takes 1/8, DuckDB 1/4
    assert options.chunk_cache_bytes == 256 << 20 and options.store_memory_limit == 512 << 20
    assert options.process_memory_bytes == 2 << 30
    assert options.dense_result_budget() <= (2 << 30) - (768 << 20)
    assert Options().process_memory_bytes > 0
    assert Options(process_memory_limit="1GiB", chunk_cache_bytes=1 << 20).chunk_cache_bytes \
        == 1 << 20


@pytest.mark.parametrize("settings", [dict(backend="duckdb"), dict(devices=2)],
                         ids=["duckdb-backend", "two-devices"])
def test_store_on_other_backends_and_devices(settings):
    rng = np.random.default_rng(4)
    with tq.connect(**settings) as db:
        a, b, A, B = _operands(db, rng)
        np.testing.assert_allclose(db.store("C", A @ B).numpy(), a @ b, rtol=1e-5, atol=1e-5)


def test_a_streamed_store_gives_free_heap_memory_back_as_it_goes(tmp_path, monkeypatch):
    """The chunks the store has written are freed between DuckDB's own allocations, where the
    heap cannot shrink: while the result streams, the free heap memory beyond
    ``STREAM_RETAINED_FREE_BYTES`` goes back to the system (bench/memory.py's 6 GiB store
    peaked at 2.5-3.5 GiB without it, 1.6 GiB with it), not only when the run ends."""
    from tensorql.exec import host_malloc
    from tensorql.pipeline import compile as compile_module

    calls = []
    stored_chunks = []

    def release(keep=None, every=host_malloc.RELEASE_CHECK_S):
        calls.append((keep, every, len(stored_chunks)))
        return False

    original_put = StreamingWrite.put

    def put(self, key, chunk):
        stored_chunks.append(key)
        original_put(self, key, chunk)

    monkeypatch.setattr(compile_module, "release_free_memory", release)
    monkeypatch.setattr(StreamingWrite, "put", put)
    rng = np.random.default_rng(3)
    with tq.connect(str(tmp_path / "s.duckdb"), memory_limit="1MiB", devices="cpu") as db:
        a, b, A, B = _operands(db, rng)
        db.store("C", A @ B)
        np.testing.assert_allclose(db.tensor("C").numpy(), a @ b, rtol=1e-5, atol=1e-5)
    during = [c for c in calls if c[2] < len(stored_chunks)]
    assert during, calls  # looked at while chunks were still to come
    assert all(keep == host_malloc.STREAM_RETAINED_FREE_BYTES for keep, _, _ in during)
