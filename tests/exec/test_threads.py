"""Parked threads (tensorql/exec/threads.py): a finished job's thread serves the next one,
and an idle thread ends after its idle time."""

from __future__ import annotations

import queue
import threading
import time

from tensorql.exec.threads import ParkedThreads


def _run(pool: ParkedThreads, name: str) -> tuple[int, str]:
    seen: queue.SimpleQueue = queue.SimpleQueue()
    pool.start(name, lambda: seen.put((threading.get_ident(), threading.current_thread().name)))
    return seen.get(timeout=5)


def _wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_a_parked_thread_serves_the_next_job_under_its_name():
    pool = ParkedThreads(idle_s=30)
    first, name = _run(pool, "tensorql-first")
    assert name == "tensorql-first"
    assert _wait_for(lambda: pool.idle() == 1)
    second, name = _run(pool, "tensorql-second")
    assert (second, name) == (first, "tensorql-second")


def test_jobs_at_once_get_threads_of_their_own():
    pool = ParkedThreads(idle_s=30)
    gate = threading.Event()
    started: queue.SimpleQueue = queue.SimpleQueue()

    def job():
        started.put(threading.get_ident())
        gate.wait(5)

    pool.start("a", job)
    pool.start("b", job)  # the first is still running: a second thread
    idents = {started.get(timeout=5), started.get(timeout=5)}
    gate.set()
    assert len(idents) == 2
    assert _wait_for(lambda: pool.idle() == 2)


def test_an_idle_thread_ends_after_its_idle_time():
    pool = ParkedThreads(idle_s=0.05)
    ident, _ = _run(pool, "tensorql-short")
    assert _wait_for(lambda: pool.idle() == 0 and
                     ident not in {t.ident for t in threading.enumerate()})
