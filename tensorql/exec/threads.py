"""Threads kept between jobs that only wait: a transfer between ranks waits on its peer, so
each runs on a thread of its own, and starting a thread per transfer cost ~0.3 ms on a
2-core machine.

:data:`PARKED` is the process's pool: :meth:`ParkedThreads.start` hands a function to an
idle thread (or starts one when none is idle); a thread whose function returned waits for
the next one, and ends after :data:`IDLE_THREAD_S` without work. A parked thread holds nothing
of the job it served. Threads that run torch kernels are not parked (see
:class:`~tensorql.exec.devices.base.LaneThreads`): a live thread keeps the OpenMP pool its
kernels made, which slowed the process's later torch work.

>>> done = threading.Event()
>>> PARKED.start("tensorql-demo", done.set)
>>> done.wait(5)
True
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

IDLE_THREAD_S = 60.0  # an idle parked thread ends after this long


class ParkedThreads:
    """Threads that run one function each and then wait for the next (see the module)."""

    def __init__(self, idle_s: float = IDLE_THREAD_S) -> None:
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._idle: list[tuple[threading.Event, list]] = []

    def start(self, name: str, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on an idle thread (renamed ``name``), or on a new one."""
        with self._lock:
            slot = self._idle.pop() if self._idle else None
        if slot is None:
            wake, job = threading.Event(), [(name, fn, args)]
            threading.Thread(target=self._serve, args=(wake, job), daemon=True,
                             name=name).start()
            return
        wake, job = slot
        job.append((name, fn, args))
        wake.set()

    def idle(self) -> int:
        """How many threads wait for work now."""
        with self._lock:
            return len(self._idle)

    def _serve(self, wake: threading.Event, job: list) -> None:
        me = threading.current_thread()
        while True:
            me.name, fn, args = job.pop()
            fn(*args)
            del fn, args  # an idle thread holds nothing of the job it served
            me.name = "tensorql-parked"
            wake.clear()
            with self._lock:
                self._idle.append((wake, job))
            if not wake.wait(self.idle_s):
                with self._lock:  # retire, unless a job was handed over meanwhile
                    if (wake, job) in self._idle:
                        self._idle.remove((wake, job))
                        return
                wake.wait()


PARKED = ParkedThreads()


@contextlib.contextmanager
def with_torch_threads(n: int) -> Iterator[None]:
    """Run the calling thread's torch work inside on ``n`` torch threads, the setting
    restored after (nothing is set where it is ``n`` already).

    >>> import torch
    >>> before = torch.get_num_threads()
    >>> with with_torch_threads(1):
    ...     torch.get_num_threads()
    1
    >>> torch.get_num_threads() == before
    True
    """
    import torch

    previous = torch.get_num_threads()
    if previous == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def one_torch_thread() -> contextlib.AbstractContextManager[None]:
    """Run the calling thread's torch work inside on that thread alone (``torch`` threads 1,
    the setting restored after) -- for the small writes made just before a query runs (a
    prompt's embeddings gathered into their constant). Run on two threads, such a write
    leaves the second one of the OpenMP team (libgomp's) spinning for its next job, ~10 ms
    of a core on the 2-core AMD host, while the query's workers, one a core, start: the
    spinner takes a third of each core from them (a LLaMA prefill's first products were
    preempted for ~4 ms, and 16-27 ms of CPU a run went to other threads than the workers,
    4-13 ms with the gather on one thread).

    >>> import torch
    >>> before = torch.get_num_threads()
    >>> with one_torch_thread():
    ...     torch.get_num_threads()
    1
    >>> torch.get_num_threads() == before
    True
    """
    return with_torch_threads(1)


def run_shared(jobs: Sequence[Callable[[], Any]], threads: int,
               torch_threads: int = 1) -> list[Any]:
    """Each of ``jobs`` run once, shared out over ``threads`` threads -- the calling thread
    and ``threads - 1`` started for the call and ended with it -- each taking the next job
    not yet taken, with ``torch_threads`` torch threads each (restored after); the results
    in the jobs' order. An error is raised once every thread has stopped taking
    jobs (of the lowest-numbered job that failed). With one thread or one job, everything
    runs on the calling thread as it is set.

    For chunk kernels called from a thread that is not the executor's (the DuckDB backend's
    Arrow functions, called by one DuckDB thread for a whole batch of tile products): torch
    releases the interpreter lock inside a kernel, so the products of a batch run side by
    side, as the native executor's lanes run them. The threads are not kept (see
    :class:`~tensorql.exec.devices.base.LaneThreads`: a live thread that ran kernels holds
    an OpenMP pool).

    >>> run_shared([lambda i=i: i * i for i in range(5)], threads=2)
    [0, 1, 4, 9, 16]
    """
    jobs = list(jobs)
    n = min(max(1, int(threads)), len(jobs))
    if n <= 1:
        return [job() for job in jobs]
    results: list[Any] = [None] * len(jobs)
    errors: list[tuple[int, BaseException]] = []
    taken = iter(range(len(jobs)))
    take_lock = threading.Lock()

    def serve() -> None:
        with with_torch_threads(torch_threads):
            while True:
                with take_lock:
                    i = next(taken, None)
                    if i is None or errors:
                        return
                try:
                    results[i] = jobs[i]()
                except BaseException as err:  # noqa: BLE001 - raised by the caller below
                    with take_lock:
                        errors.append((i, err))
                    return

    helpers = [threading.Thread(target=serve, daemon=True, name=f"tensorql-shared-{k}")
               for k in range(n - 1)]
    for helper in helpers:
        helper.start()
    serve()
    for helper in helpers:
        helper.join()
    if errors:
        raise min(errors, key=lambda e: e[0])[1]
    return results
