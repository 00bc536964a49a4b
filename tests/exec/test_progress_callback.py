"""A ``progress`` callback that raises stops the run on every strategy with a
ProgressCallbackError (the callback's exception its cause), and nothing is stored. On the
lanes it used to end the worker threads it ran on and leave the run reporting a deadlock
("13 task(s) never became ready"), with the threads' tracebacks on stderr."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import tensorql as tq


class Stop(Exception):
    pass


def stop_after(n):
    def progress(done, total):
        if done > n:
            raise Stop(f"stop at {done}")
    return progress


@pytest.mark.parametrize("options", [{}, {"workers": 1}, {"deterministic": True},
                                     {"devices": 2}])
def test_a_raising_progress_callback_stops_the_run_and_stores_nothing(options):
    db = tq.connect(**options)
    a = np.arange(360_000, dtype=np.float64).reshape(600, 600) / 1e5
    X = db.from_numpy("X", a, tile=(200, 200))
    before = threading.active_count()
    with pytest.raises(tq.ProgressCallbackError, match="progress callback raised Stop") as err:
        db.store("Y", X * 2, progress=stop_after(3))
    assert isinstance(err.value.__cause__, Stop)
    assert "Y" not in db.tensors()
    with pytest.raises(tq.ProgressCallbackError):
        (X @ X).numpy(progress=stop_after(2))
    # the session goes on: every worker came back, the same query runs to the end
    seen = []
    np.testing.assert_allclose((X @ X).numpy(progress=lambda d, t: seen.append(d)), a @ a)
    assert seen and threading.active_count() <= before + 1
    db.store("Y", X * 2)
    np.testing.assert_array_equal(db.tensor("Y").numpy(), a * 2)


def test_an_interrupt_from_the_progress_callback_comes_through_as_it_is():
    db = tq.connect(workers=2)
    X = db.from_numpy("X", np.ones((600, 600)), tile=(200, 200))

    def interrupt(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        (X @ X).numpy(progress=interrupt)
    np.testing.assert_allclose((X @ X).numpy(), np.full((600, 600), 600.0))


def test_an_interrupt_while_waiting_for_the_workers_stops_them_first(monkeypatch):
    """A Ctrl-C that lands in the wait for the worker threads (not in a task) stops the
    workers at their next task before it comes through: none is left computing the rest."""
    import tensorql.exec.executor as executor

    db = tq.connect(workers=2)
    X = db.from_numpy("X", np.ones((600, 600)), tile=(100, 100))
    real_thread = executor.threading.Thread
    joins = []

    class InterruptedJoin(real_thread):
        def join(self, timeout=None):
            joins.append(self.name)
            if len(joins) == 1:
                raise KeyboardInterrupt
            return super().join(timeout)

    monkeypatch.setattr(executor.threading, "Thread", InterruptedJoin)
    with pytest.raises(KeyboardInterrupt):
        ((X @ X) @ X).numpy()
    monkeypatch.undo()
    assert not [t for t in threading.enumerate() if t.name.startswith("tensorql-worker-")]
    np.testing.assert_allclose((X @ X).numpy(), np.full((600, 600), 600.0))
