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


def test_run_shared_runs_every_job_once_in_order_over_its_threads():
    import torch

    from tensorql.exec.threads import run_shared

    before = torch.get_num_threads()
    gate = threading.Barrier(2, timeout=5)  # two jobs can only pass it side by side
    seen: dict[int, tuple[str, int]] = {}

    def job(i):
        if i < 2:
            gate.wait()
        seen[i] = (threading.current_thread().name, torch.get_num_threads())
        return i * i

    got = run_shared([lambda i=i: job(i) for i in range(6)], threads=2)
    assert got == [0, 1, 4, 9, 16, 25]
    assert sorted(seen) == list(range(6))
    assert len({name for name, _ in seen.values()}) == 2  # the caller and one helper
    assert {n for _, n in seen.values()} == {1}  # one torch thread each
    assert torch.get_num_threads() == before  # the caller's setting restored
    assert not [t for t in threading.enumerate() if t.name.startswith("tensorql-shared")]


def test_run_shared_raises_the_first_failed_jobs_error_and_runs_alone_when_told():
    from tensorql.exec.threads import run_shared

    def fail(i):
        raise ValueError(f"job {i}")

    jobs = [lambda: 1, lambda: fail(1), lambda: fail(2)]
    try:
        run_shared(jobs, threads=2)
    except ValueError as err:
        assert str(err) in ("job 1", "job 2")  # whichever thread met its failure first
    else:
        raise AssertionError("no error raised")
    names = []
    assert run_shared([lambda: names.append(threading.current_thread().name)] * 3,
                      threads=1) == [None] * 3
    assert set(names) == {threading.current_thread().name}
