"""An interrupt (Ctrl-C) at any point of a streaming store leaves the session settled: the
writer thread has committed or rolled back before the interrupt comes through, and no writer
is left holding the store's write lock. Found by fuzzing with real SIGINTs (session 25): an
interrupt while the writer started left it waiting for chunks forever (every later write
hung); one while the writer was joined let it commit after the interrupt came through."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import tensorql as tq
import tensorql.storage.stream_write as stream_write


@pytest.fixture
def db(tmp_path):
    session = tq.connect(str(tmp_path / "s.duckdb"))
    session.from_numpy("A", np.ones((256, 256), np.float32), tile=(64, 64))
    yield session
    session.close()


def _writer_threads():
    return [t for t in threading.enumerate() if t.name.startswith("tensorql-store-")]


def test_an_interrupt_while_the_writer_starts_leaves_no_writer_behind(db, monkeypatch):
    real_init = stream_write.StreamingWrite.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        real_start = self._thread.start

        def start():  # the writer runs, then a SIGINT lands in Thread.start's wait
            real_start()
            raise KeyboardInterrupt

        self._thread.start = start

    monkeypatch.setattr(stream_write.StreamingWrite, "__init__", init)
    A = db.tensor("A")
    with pytest.raises(KeyboardInterrupt):
        db.store("B", A @ A)
    monkeypatch.undo()
    assert _writer_threads() == [] and db.tensors() == ["A"]
    done = []  # every write goes on (it hung on the write lock)
    worker = threading.Thread(target=lambda: done.append(db.store("C", A * 2)), daemon=True)
    worker.start()
    worker.join(60)
    assert done and db.tensors() == ["A", "C"]


def test_an_interrupt_while_the_writer_is_joined_comes_through_once_it_settled(db,
                                                                            monkeypatch):
    real_exit = stream_write.StreamingWrite.__exit__
    seen = []

    def exit_(self, kind, error, tb):
        if error is None:  # the run finished: a SIGINT lands in the first join
            real_join = self._thread.join
            calls = []

            def join(timeout=None):
                calls.append(1)
                if len(calls) == 1:
                    raise KeyboardInterrupt
                return real_join(timeout)

            self._thread.join = join
        try:
            return real_exit(self, kind, error, tb)
        finally:
            seen.append(self._thread.is_alive())

    monkeypatch.setattr(stream_write.StreamingWrite, "__exit__", exit_)
    A = db.tensor("A")
    with pytest.raises(KeyboardInterrupt):
        db.store("B", A @ A)
    monkeypatch.undo()
    assert seen == [False]  # the writer had settled when the interrupt came through
    settled = db.tensors()
    assert settled in (["A"], ["A", "B"]) and _writer_threads() == []
    if "B" in settled:  # it was committing: whole
        np.testing.assert_array_equal(db.tensor("B").numpy(), np.full((256, 256), 256.0))
    assert db.tensors() == settled  # nothing changes afterwards


@pytest.mark.parametrize("options", [{"memory_limit": "8MiB"},
                                     {"devices": 2, "memory_limit": "8MiB"}])
def test_an_interrupt_from_progress_comes_through_as_it_is_on_the_streams_engine(options):
    db = tq.connect(**options)
    X = db.from_numpy("X", np.ones((600, 600)), tile=(200, 200))

    def interrupt(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        (X @ X).numpy(progress=interrupt)
    with pytest.raises(KeyboardInterrupt):
        db.store("Y", X @ X, progress=interrupt)
    assert db.tensors() == ["X"]
    np.testing.assert_allclose((X @ X).numpy(), np.full((600, 600), 600.0))


def test_duckdb_s_query_interrupted_comes_through_as_keyboard_interrupt(db, monkeypatch):
    """DuckDB's client answers a Ctrl-C during a statement with ``RuntimeError: Query
    interrupted``: a write raises it as the KeyboardInterrupt it is, and stores nothing."""
    store = db.chunk_store

    def interrupted(*args, **kwargs):
        raise RuntimeError("Query interrupted")

    monkeypatch.setattr(store, "_check_name_free", interrupted)
    with pytest.raises(KeyboardInterrupt):
        db.from_numpy("B", np.ones(4))
    monkeypatch.undo()
    assert db.tensors() == ["A"]
    db.from_numpy("B", np.ones(4))
    assert db.tensors() == ["A", "B"]
