"""The CPU executor: worker threads run ready chunk tasks in priority order.

There is no barrier between plan steps: a task becomes ready the moment its own input chunks are
complete, so a consumer step starts while its producer is still running (fine-grained
dataflow). Chunks are freed as soon as their last reader has run.

Several tasks may add into one output chunk. A worker that finds that chunk free accumulates in
place (a matrix product goes straight into it with ``addmm_``); one that finds it busy computes
a partial aside and folds it in afterwards, so workers never wait for each other.

>>> import torch
>>> class Const:
...     def __init__(self, v): self.v = v
...     def run(self, inputs, acc):  # fold into acc when given
...         return torch.tensor(self.v) if acc is None else acc.add_(self.v)
...     def combine(self, acc, partial): return acc.add_(partial)
>>> graph = TaskGraph(tasks=(Task(0, (), ChunkRef(0, ()), Const(1.0)),
...                          Task(1, (), ChunkRef(0, ()), Const(2.0))), retain=frozenset({0}))
>>> Executor(workers=2).run(graph).outputs[ChunkRef(0, ())].item()
3.0
"""

from __future__ import annotations

import collections
import heapq
import threading
import time
from dataclasses import dataclass

import torch

from tensorql.exec.progress import ProgressCallback
from tensorql.exec.run_state import RunState
from tensorql.exec.run_types import (
    ChunkDestination,
    ChunkSink,
    RunResult,
    RunStats,
    StepStats,
    first_contribution,
    record_task,
)
from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph


@dataclass(frozen=True)
class _Template:
    """What every run of one task graph starts from, computed once per graph (a query run
    again -- a LLaMA decoder's token after token -- copies it instead of rebuilding it)."""

    contributions: dict[ChunkRef, int]
    uses: dict[ChunkRef, int]
    waiting: dict[ChunkRef, tuple[Task, ...]]
    pending: dict[int, int]
    ready: tuple[tuple[float, int, Task], ...]  # a heap, without the inline tasks
    inline: tuple[Task, ...]  # constant slices of retained steps, run as any task
    step_tasks: collections.Counter
    big_tasks: int  # tasks of WIDE_TASK_FLOPS or more in the graph
    # constant slices of steps not retained, run by the caller before the workers start;
    # what their completion does to the counts is worked out here once (``ready``,
    # ``pending`` and ``waiting`` are the state after them), so a run only takes the views
    views: tuple[Task, ...] = ()
    view_steps: tuple[tuple[int, int], ...] = ()  # (step, tasks) of ``views``

    @classmethod
    def of(cls, graph: TaskGraph) -> _Template:
        cached = graph.programs.get("executor-template")
        if cached is not None:
            return cached
        deps = graph.dependencies()
        contributions = deps.contributions
        uses: dict[ChunkRef, int] = {}
        for task in graph.tasks:
            for ref in task.inputs:
                uses[ref] = uses.get(ref, 0) + 1
        ready = [(task.priority, task.id, task) for task in deps.sources]
        inline = tuple(task for _, _, task in ready if getattr(task.kernel, "inline", False)
                       and contributions[task.output] == 1)
        ready = [entry for entry in ready if not (getattr(entry[2].kernel, "inline", False)
                                                  and contributions[entry[2].output] == 1)]
        views = tuple(task for task in inline if task.output.step not in graph.retain)
        inline = tuple(task for task in inline if task.output.step in graph.retain)
        waiting, pending = dict(deps.readers), dict(deps.pending)
        for task in views:  # each completes its chunk: its readers wait for one chunk less
            for consumer in waiting.pop(task.output, ()):
                pending[consumer.id] -= 1
                if pending[consumer.id] == 0:
                    ready.append((consumer.priority, consumer.id, consumer))
        heapq.heapify(ready)
        view_steps = collections.Counter(task.output.step for task in views)
        template = cls(contributions, uses, waiting, pending, tuple(ready), inline,
                       collections.Counter(task.output.step for task in graph.tasks),
                       sum(_big(task) for task in graph.tasks),
                       views, tuple(sorted(view_steps.items())))
        graph.programs["executor-template"] = template
        return template


class _Run(RunState):
    """The lanes' state of one run: the engine's run state plus readiness counts, chunk
    values and their readers left, and what the workers are running."""

    def __init__(self, graph: TaskGraph, progress: ProgressCallback | None,
                 sink: ChunkSink | None = None,
                 destination: ChunkDestination | None = None,
                 keep_outputs: bool = True) -> None:
        super().__init__(graph, progress, sink, destination, keep_outputs,
                         RunStats(tasks=len(graph.tasks)))
        template = _Template.of(graph)
        self.contributions = template.contributions  # read only
        self.remaining = dict(template.contributions)
        self.uses = dict(template.uses)
        self.waiting = dict(template.waiting)
        self.pending = dict(template.pending)
        self.values: dict[ChunkRef, torch.Tensor] = {}
        self.views = template.views
        for task in template.views:  # their chunks are complete: no contribution remains
            self.remaining[task.output] = 0
        self.done_tasks = len(template.views)
        self.view_steps = template.view_steps
        self.slot_locks = {ref: threading.Lock() for ref, n in self.contributions.items() if n > 1}
        self.ready = list(template.ready)
        self.inline = template.inline
        self.in_flight: dict[ChunkRef, int] = {}  # output chunk -> tasks writing it now
        self.cond = threading.Condition()
        self.running_big = 0  # tasks of WIDE_TASK_FLOPS or more taken and not yet finished
        self.wide = False  # a big task runs with every worker's torch threads
        self.big_started: dict[int, tuple[float, int]] = {}  # running big task -> start, flops
        self.big_taken = 0  # big tasks taken so far (a tail wait ends when another is)
        self.big_tasks = template.big_tasks  # read only
        self.tail_waiting = False  # a worker holds the last big task until the others end
        self.ready_big = sum(_big(entry[2]) for entry in self.ready)  # big tasks ready
        self.step_tasks = template.step_tasks  # read only
        self.live_bytes = 0

    # -- called with self.cond held ------------------------------------------------------
    def take(self, lookahead: int = 4, small_only: bool = False) -> Task | None:
        """The most urgent ready task, preferring one whose output no other worker is
        writing (so accumulation rarely needs a partial computed aside); with
        ``small_only`` the most urgent one below ``WIDE_TASK_FLOPS`` (None if none is)."""
        if small_only:
            big = []
            while self.ready and _big(self.ready[0][2]):
                big.append(heapq.heappop(self.ready))
            task = heapq.heappop(self.ready)[2] if self.ready else None
            for entry in big:
                heapq.heappush(self.ready, entry)
            return self._taken(task) if task is not None else None
        skipped = []
        task = None
        while self.ready and len(skipped) < lookahead:
            entry = heapq.heappop(self.ready)
            if self.in_flight.get(entry[2].output, 0) == 0:
                task = entry[2]
                break
            skipped.append(entry)
        if task is None:
            task = skipped.pop(0)[2] if skipped else heapq.heappop(self.ready)[2]
        for entry in skipped:
            heapq.heappush(self.ready, entry)
        return self._taken(task)

    def _taken(self, task: Task) -> Task:
        self.in_flight[task.output] = self.in_flight.get(task.output, 0) + 1
        big = _big(task)
        self.running_big += big
        self.ready_big -= big
        if big:
            self.big_taken += 1
            self.big_started[task.id] = (time.perf_counter(), task.weighted_flops)
        return task

    def others_end_soon(self, task: Task, seconds_per_flop: float) -> bool:
        """Whether the other big tasks running now are expected to end within
        :data:`TAIL_WAIT_SHARE` of ``task``'s own time, at ``seconds_per_flop`` (the calling
        worker's last big task's rate)."""
        now = time.perf_counter()
        own = task.weighted_flops * seconds_per_flop
        return all(start + flops * seconds_per_flop - now < TAIL_WAIT_SHARE * own
                   for tid, (start, flops) in self.big_started.items() if tid != task.id)

    def _complete_chunk(self, ref: ChunkRef) -> None:
        for consumer in self.waiting.pop(ref, ()):
            self.pending[consumer.id] -= 1
            if self.pending[consumer.id] == 0:
                heapq.heappush(self.ready, (consumer.priority, consumer.id, consumer))
                self.ready_big += _big(consumer)

    def release(self, ref: ChunkRef) -> None:
        """Forget a retained chunk the sink has taken, unless a task still reads it."""
        if self.uses.get(ref, 0) == 0 and ref in self.values:
            self.live_bytes -= self.values.pop(ref).nbytes

    def finish(self, task: Task, started: float, ended: float, new_bytes: int) -> bool:
        """Record a finished task; True when it completed its output chunk."""
        record_task(self.stats, task.output.step, started, ended,
                    bytes_in=sum(self.values[r].nbytes for r in task.inputs),
                    bytes_read=getattr(task.kernel, "bytes_read", 0))
        self.live_bytes += new_bytes
        self.running_big -= _big(task)
        self.big_started.pop(task.id, None)
        self.in_flight[task.output] -= 1
        self.remaining[task.output] -= 1
        completed = self.remaining[task.output] == 0
        if completed:
            self._complete_chunk(task.output)
        for ref in task.inputs:
            self.uses[ref] -= 1
            if self.uses[ref] == 0 and ref.step not in self.graph.retain:
                self.live_bytes -= self.values.pop(ref).nbytes
        self.stats.peak_live_bytes = max(self.stats.peak_live_bytes, self.live_bytes)
        self.done_tasks += 1  # RunState.task_done, inline: a call less per task
        if self.progress is not None:
            self.progress(self.done_tasks, self.total_tasks)
        self.cond.notify_all()
        return completed


# A task this big (estimated FLOPs) of a step too narrow to occupy every worker runs with all
# the workers' torch threads (~0.2 ms of one core: smaller kernels gain nothing from threads).
WIDE_TASK_FLOPS = 20_000_000
# The last big task of a run's round (none other ready) waits for the big tasks beside it and
# then runs with every worker's threads when they are expected to end within this share of its
# own time: on two workers it then ends after wait + ~0.55-0.6 of its one-thread time (a
# two-thread product shares its packed panels but not perfectly), instead of after all of it
# while the other worker idles (3072^3 on 1024 tiles: 9 tasks, 5 rounds on 2 one-thread lanes).
TAIL_WAIT_SHARE = 0.35
# A tail task run wide that was not this much faster than its worker's one-thread rate turns
# the rule off for its graph (``graph.programs["lanes-tail-off"]``): on a host whose cores are
# busy with other work a two-thread product waits for a descheduled thread (2-core VM under
# other load: the 9th tile of 3072^3 took 74-83 ms on two threads, 44 ms alone on one).
TAIL_MIN_SPEEDUP = 1.3
def _big(task: Task) -> bool:
    """Whether ``task`` is long enough (~0.2 ms on one core) to gain from more threads."""
    return task.weighted_flops >= WIDE_TASK_FLOPS


EXECUTOR_MODES = ("auto", "threads", "serial")


class Executor:
    """One CPU's run of a ``TaskGraph`` through the engine (:func:`tensorql.exec.engine.run`):
    on ``workers`` threads with ``intra_op_threads`` torch threads each (``mode="threads"``,
    the lanes strategy), or on the calling thread in one precomputed order
    (``mode="serial"``, :mod:`tensorql.exec.serial`); ``mode="auto"`` leaves the choice to
    the engine's policy (:func:`tensorql.exec.engine.runs_serially`)."""

    def __init__(self, workers: int = 1, intra_op_threads: int = 1, mode: str = "auto") -> None:
        if mode not in EXECUTOR_MODES:
            raise ValueError(f"executor mode {mode!r}: one of {', '.join(EXECUTOR_MODES)}")
        self.workers = max(1, int(workers))
        self.intra_op_threads = max(1, int(intra_op_threads))
        self.mode = mode

    def run(self, graph: TaskGraph, progress: ProgressCallback | None = None,
            sink: ChunkSink | None = None,
            destination: ChunkDestination | None = None,
            keep_outputs: bool = True) -> RunResult:
        """Run every task of ``graph`` (arguments as :func:`tensorql.exec.engine.run`)."""
        from tensorql.exec import engine

        config = engine.EngineConfig.cpu(self.workers, self.intra_op_threads)
        strategy = {"auto": None, "threads": "lanes", "serial": "serial"}[self.mode]
        return engine.run(graph, config, strategy=strategy, progress=progress, sink=sink,
                          destination=destination, keep_outputs=keep_outputs)

    def runs_serially(self, graph: TaskGraph) -> bool:
        """Whether :meth:`run` runs ``graph`` in the serial strategy (see
        :func:`tensorql.exec.engine.runs_serially`)."""
        from tensorql.exec import engine

        if self.mode != "auto":
            return self.mode == "serial"
        return engine.runs_serially(graph, self.workers)


class Lanes:
    """The engine's lanes strategy on one CPU: ``workers`` threads, ``intra_op_threads``
    torch threads each, take ready tasks straight from the graph (no memory plan)."""

    def __init__(self, workers: int = 1, intra_op_threads: int = 1) -> None:
        self.workers = max(1, int(workers))
        self.intra_op_threads = max(1, int(intra_op_threads))
        self.all_threads = self.intra_op_threads * self.workers

    def run(self, graph: TaskGraph, progress: ProgressCallback | None = None,
            sink: ChunkSink | None = None,
            destination: ChunkDestination | None = None,
            keep_outputs: bool = True) -> RunResult:
        """Run every task of ``graph`` on the worker threads.

        ``progress(done, total)`` is called after each task; ``sink(ref, chunk)`` is called on a
        worker thread as each chunk of a retained step completes (e.g. to copy it into a dense
        result while other tasks still run). ``destination(ref)`` may name a preallocated
        tensor for a retained chunk (a view of a dense result): its tasks then write there
        directly, and the chunk handed to ``sink`` is that tensor. With ``keep_outputs=False``
        a retained chunk is released once ``sink`` has taken it (the run streams its result
        and ``outputs`` holds only chunks the sink never saw).
        """
        state = _Run(graph, progress, sink, destination, keep_outputs)
        state.stats.workers = self.workers
        previous_threads = torch.get_num_threads()
        torch.set_num_threads(self.intra_op_threads)
        start = time.perf_counter()
        try:
            self._run_inline(state)
            threads = [threading.Thread(target=self._work, args=(state,), daemon=True,
                                        name=f"tensorql-worker-{n}")
                       for n in range(min(self.workers, max(1, len(graph.tasks))))]
            for thread in threads:
                thread.start()
            try:
                for thread in threads:
                    thread.join()
            except BaseException as err:  # an interrupt here: the workers stop at their
                with state.cond:  # next task, and it comes through once they have
                    state.fail(err, None)
                    state.cond.notify_all()
                for thread in threads:
                    thread.join()
                raise
        finally:
            torch.set_num_threads(previous_threads)
        state.stats.wall_s = time.perf_counter() - start
        state.stats.rebase(start)
        if state.error is not None:
            state.raise_task_failure()
        state.check_all_done()
        outputs = {ref: v for ref, v in state.values.items() if ref.step in graph.retain}
        return RunResult(outputs=outputs, stats=state.stats)

    @staticmethod
    def _run_inline(state: _Run) -> None:
        """Run the ready tasks whose kernel says ``inline`` (a slice of an in-memory
        constant: a view, no work) here and now, before the workers start: they would cost a
        scheduling round trip each (a one-token LLaMA step has 187 of them in 535 tasks)."""
        values = state.values
        live = 0
        for task in state.views:
            value = values[task.output] = task.kernel.run((), None)
            live += value.nbytes
        if state.views:
            now = time.perf_counter()
            for step, count in state.view_steps:
                record_task(state.stats, step, now, now, tasks=count)
            state.live_bytes += live
            state.stats.peak_live_bytes = max(state.stats.peak_live_bytes, live)
            if state.progress is not None:
                state.progress(state.done_tasks, state.total_tasks)
        with state.cond:  # no worker runs yet: the lock is taken once, not per task
            for task in state.inline:
                state.in_flight[task.output] = state.in_flight.get(task.output, 0) + 1
                state.running_big += _big(task)  # finish() counts it back down
                now = time.perf_counter()
                new_bytes = _execute(state, task)
                completed = state.finish(task, now, now, new_bytes)
                if completed and state.sink is not None and \
                        task.output.step in state.graph.retain:
                    state.sink(task.output, state.values[task.output])

    def _tail(self, state: _Run, task: Task, rate: float) -> bool:
        """Whether ``task`` (just taken) is the last big task of the run: big, every other
        big task of the graph taken (none ready now is not enough: loads still to run make
        more ready), others running that end soon (:meth:`_Run.others_end_soon` at this
        worker's ``rate``), no other worker already waiting; called with ``state.cond``."""
        return (self.all_threads > self.intra_op_threads and rate > 0.0 and _big(task)
                and state.big_taken == state.big_tasks
                and not state.graph.programs.get("lanes-tail-off")
                and state.ready_big == 0 and 1 < state.running_big < 1 + self.workers
                and not state.wide and not state.tail_waiting
                and state.others_end_soon(task, rate))

    @staticmethod
    def _wait_for_tail(state: _Run, task: Task, rate: float) -> bool:
        """Hold ``task`` until the other big tasks end (the idle workers' threads then go to
        it: True), or give up and run it on this worker's share (False) when another big
        task is taken or becomes ready meanwhile, or after :data:`TAIL_WAIT_SHARE` of its
        expected time; called with ``state.cond``."""
        taken = state.big_taken
        deadline = time.perf_counter() + TAIL_WAIT_SHARE * task.weighted_flops * rate
        state.tail_waiting = True
        try:
            while (state.error is None and state.running_big > 1 and state.ready_big == 0
                   and state.big_taken == taken):
                left = deadline - time.perf_counter()
                if left <= 0:
                    return False
                state.cond.wait(left)
        finally:
            state.tail_waiting = False
        return (state.error is None and state.running_big == 1 and state.ready_big == 0
                and state.big_taken == taken)

    def _work(self, state: _Run) -> None:
        total = len(state.graph.tasks)
        rate = 0.0  # seconds per weighted FLOP of this worker's last big task (0: none yet)
        # this thread's own torch threads (a new thread starts from the process default);
        # setting them reaches MKL for the whole process, so not while a task runs wide
        with state.cond:
            while state.wide and state.error is None:
                state.cond.wait()
            torch.set_num_threads(self.intra_op_threads)
        while True:
            with state.cond:
                while True:
                    if state.error is not None or state.done_tasks >= total:
                        return
                    task = state.take(small_only=state.wide) if state.ready else None
                    if task is not None:
                        break
                    state.cond.wait()
                # a big task of a step with fewer tasks than workers (a chain of contractions,
                # one task each, as in a tensor network or a transformer layer) taken while no
                # other big task runs or waits would leave the other workers idle or on small
                # tasks: it gets every worker's torch threads, and until it ends the others
                # take only small tasks. torch's thread count reaches MKL as one setting for
                # the whole process, so a product started on another worker meanwhile would
                # run on the wide task's threads too (seen on a LLaMA block's training step:
                # wide products no faster than on one thread, the step ~3 ms longer than
                # with none)
                wide = (self.all_threads > self.intra_op_threads and _big(task)
                        and state.running_big == 1 and state.ready_big == 0
                        and state.step_tasks[task.output.step] < self.workers)
                tail = (not wide and self._tail(state, task, rate)
                        and self._wait_for_tail(state, task, rate))
                wide = wide or tail
                if wide:
                    state.wide = True
                    state.stats.wide_tasks += 1
            if wide:  # otherwise the worker keeps its share (set as it started)
                torch.set_num_threads(self.all_threads)
            started = time.perf_counter()
            try:
                new_bytes = _execute(state, task)
            except BaseException as err:  # noqa: BLE001 - reported to the caller
                with state.cond:
                    state.fail(err, task)
                    state.cond.notify_all()
                return
            finally:
                if wide:  # back to its share before any other worker starts a product
                    torch.set_num_threads(self.intra_op_threads)
            ended = time.perf_counter()
            if _big(task) and not wide and task.weighted_flops:
                rate = (ended - started) / task.weighted_flops
            if tail and task.weighted_flops * rate < TAIL_MIN_SPEEDUP * (ended - started):
                state.graph.programs["lanes-tail-off"] = True  # no gain here: not again
            with state.cond:
                if wide:
                    state.wide = False
                try:  # reports progress: the caller's callback may raise
                    completed = state.finish(task, started, ended, new_bytes)
                except BaseException as err:  # noqa: BLE001 - reported to the caller
                    state.fail(err, task)
                    state.cond.notify_all()
                    return
            if completed and state.sink is not None and task.output.step in state.graph.retain:
                try:
                    state.sink(task.output, state.values[task.output])
                except BaseException as err:  # noqa: BLE001 - reported to the caller
                    with state.cond:
                        state.fail(err, task)
                        state.cond.notify_all()
                    return
                if not state.keep_outputs:
                    with state.cond:
                        state.release(task.output)


def _first(state: _Run, task: Task, inputs: list[torch.Tensor]) -> torch.Tensor:
    """The first contribution to ``task.output``, into its destination when the run has one."""
    dest = None  # RunState.destination_for, inline: a call less per task
    if state.destination is not None and task.output.step in state.graph.retain:
        dest = state.destination(task.output)
    return first_contribution(task.kernel, inputs, dest)


def _execute(state: _Run, task: Task) -> int:
    """Run one task; returns the bytes newly allocated for its output chunk."""
    inputs = [state.values[ref] for ref in task.inputs]
    ref = task.output
    lock = state.slot_locks.get(ref)
    if lock is None:
        value = _first(state, task, inputs)
        state.values[ref] = value
        return value.nbytes
    if lock.acquire(blocking=False):
        try:
            acc = state.values.get(ref)
            value = _first(state, task, inputs) if acc is None else task.kernel.run(inputs, acc)
            state.values[ref] = value
            return value.nbytes if acc is None else 0
        finally:
            lock.release()
    partial = task.kernel.run(inputs, None)
    with lock:
        acc = state.values.get(ref)
        state.values[ref] = partial if acc is None else task.kernel.combine(acc, partial)
        return partial.nbytes if acc is None else 0


__all__ = ["ChunkDestination", "ChunkSink", "Executor", "Lanes", "RunResult", "RunStats",
           "StepStats"]
