"""What a LLaMA prefill's workers do between tasks, and what another task order could gain:
the bench model's cached prefill (``bench/llama.py``: 512 tokens, ~100M parameters, fp32) run
``--runs`` times on ``--workers`` one-thread workers, every task timed on its worker (the
lanes' ``_execute`` wrapped). Not a bench (no record, no goal): the measurement behind issue
31's account of the prefill's time outside its kernels.

    python bench/profile/prefill_gaps.py [--runs 5] [--workers 2] [--seq 512]

Printed per run:

* ``wall``: the call; ``busy / workers``: the tasks' time shared by the workers (the bound no
  order of these tasks beats on these workers);
* ``between tasks``: a worker's time from the end of a task to the start of its next one when
  that one's inputs were ready before the first ended (the engine's own bookkeeping: finish,
  take, locks -- median per task and the sum over the workers), and ``waits`` (the next task's
  inputs ended later: the worker idled until then, plus its wake-up);
* ``list schedule``: the run's measured task times scheduled again on the workers with no
  bookkeeping at all (:func:`list_schedule`), tasks taken in the plan's order (the engine's
  priority) and by critical path (longest chain of measured time to the end first).

The two list schedules against ``busy / workers`` say what any task order could gain; the
bookkeeping sum and the waits say where the rest of the wall time goes.
"""

from __future__ import annotations

import argparse
import heapq
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for llama.py
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository


def list_schedule(durations: Mapping[int, float], deps: Mapping[int, set[int]],
                  priority: Callable[[int], object], workers: int) -> float:
    """The makespan of running tasks ``durations`` (id -> seconds) with dependencies ``deps``
    (id -> ids it waits for) on ``workers`` workers that each take the ready task of lowest
    ``priority`` as soon as they are free, with no cost between tasks.

    >>> durations = {0: 1.0, 1: 1.0, 2: 2.0, 3: 1.0}
    >>> deps = {0: set(), 1: set(), 2: {0}, 3: {1}}
    >>> [list_schedule(durations, deps, lambda t: t, workers) for workers in (2, 1)]
    [3.0, 5.0]
    """
    consumers: dict[int, list[int]] = defaultdict(list)
    pending = {t: len(d) for t, d in deps.items()}
    for t, d in deps.items():
        for p in d:
            consumers[p].append(t)
    ready = [(priority(t), t) for t, n in pending.items() if n == 0]
    heapq.heapify(ready)
    running: list[tuple[float, int]] = []
    idle, now, end = workers, 0.0, 0.0
    while ready or running:
        while ready and idle:
            _, t = heapq.heappop(ready)
            heapq.heappush(running, (now + durations[t], t))
            idle -= 1
        now, t = heapq.heappop(running)
        idle += 1
        end = max(end, now)
        for c in consumers[t]:
            pending[c] -= 1
            if pending[c] == 0:
                heapq.heappush(ready, (priority(c), c))
    return end


def critical_path(durations: Mapping[int, float], deps: Mapping[int, set[int]]) -> dict[int, float]:
    """Each task's longest chain of ``durations`` from its start to the end of the graph (its
    own time included); task ids must be in a topological order.

    >>> critical_path({0: 1.0, 1: 2.0, 2: 1.0}, {0: set(), 1: {0}, 2: {0}})
    {2: 1.0, 1: 2.0, 0: 3.0}
    """
    consumers: dict[int, list[int]] = defaultdict(list)
    for t, d in deps.items():
        for p in d:
            consumers[p].append(t)
    rank: dict[int, float] = {}
    for t in sorted(durations, reverse=True):
        rank[t] = durations[t] + max((rank[c] for c in consumers[t]), default=0.0)
    return rank


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args(argv)
    import llama
    from prefill_breakdown import warm_prefill

    import tensorql.exec.executor as executor

    timed: list[tuple[int, float, float, object]] = []  # worker, start, end, task
    execute = executor._execute

    def timed_execute(state, task):
        start = time.perf_counter()
        try:
            return execute(state, task)
        finally:
            timed.append((threading.get_ident(), start, time.perf_counter(), task))

    executor._execute = timed_execute
    ours, prefill = warm_prefill(args.workers, args.seq)
    tasks = prefill.query().physical.task_graph().tasks
    producers: dict[object, list[int]] = defaultdict(list)
    for task in tasks:
        producers[task.output].append(task.id)
    deps = {task.id: {p for ref in task.inputs for p in producers.get(ref, ())}
            for task in tasks}
    priority = {task.id: (task.priority, task.id) for task in tasks}
    print(f"prefill of {args.seq} tokens on {args.workers} one-thread workers, {len(tasks)} "
          f"tasks; times in ms")
    for call in range(args.runs):
        timed.clear()
        start = time.perf_counter()
        prefill.logits(llama.prompt(ours.shape.vocab, args.seq, 100 + call))
        wall = time.perf_counter() - start
        durations = {t.id: 0.0 for t in tasks}  # views run inline, untimed
        ended = {}
        for _, begin, end, task in timed:
            durations[task.id] = end - begin
            ended[task.id] = end
        by_worker: dict[int, list[tuple[float, float, int]]] = defaultdict(list)
        for worker, begin, end, task in timed:
            by_worker[worker].append((begin, end, task.id))
        between, waits = [], 0.0
        for runs in by_worker.values():
            runs.sort()
            for (_, previous_end, _), (begin, _, tid) in zip(runs, runs[1:]):
                ready = max((ended[p] for p in deps[tid] if p in ended), default=previous_end)
                if ready <= previous_end:
                    between.append(begin - previous_end)
                else:
                    waits += begin - previous_end
        busy = sum(durations.values()) / args.workers
        rank = critical_path(durations, deps)
        in_order = list_schedule(durations, deps, priority.__getitem__, args.workers)
        by_path = list_schedule(durations, deps, lambda t, rank=rank: (-rank[t], t),
                                args.workers)
        print(f"wall {wall * 1e3:6.1f}  busy / workers {busy * 1e3:6.1f}  between tasks: "
              f"median {statistics.median(between) * 1e6:4.0f} us, sum {sum(between) * 1e3:5.1f}"
              f"  waits {waits * 1e3:5.1f}  list schedule: plan order {in_order * 1e3:6.1f}, "
              f"critical path {by_path * 1e3:6.1f}  (critical path alone "
              f"{max(rank.values()) * 1e3:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
