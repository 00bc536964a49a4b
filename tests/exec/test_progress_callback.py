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
