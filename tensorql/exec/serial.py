"""The engine's serial mode: a task graph run on the calling thread, in one order computed
once per graph.

A graph of many short tasks -- a LLaMA decoder's token is ~500 tasks of 10-300 us, each
waiting on the last few -- gains little from worker threads: they would rarely find two
tasks to run side by side, and handing every task through a shared ready queue (a lock, a
heap, a wake-up, a hashed chunk key or three) costs about as much as a small kernel. Here
the order, each task's input and output slots and the chunks it reads for the last time are
worked out once and kept with the graph (:class:`SerialSchedule`), so a query run again --
token after token -- is one loop over a list. The kernels, the statistics, the destinations
and the sink are those of the threaded mode (:mod:`tensorql.exec.executor`), which picks
this mode (see ``Executor.run``).

>>> import torch
>>> class Const:
...     def __init__(self, v): self.v = v
...     def run(self, inputs, acc):
...         return torch.tensor(self.v) if acc is None else acc.add_(self.v)
>>> class Add:
...     def run(self, inputs, acc): return inputs[0] + inputs[1]
>>> a, b, c = ChunkRef(0, ()), ChunkRef(1, ()), ChunkRef(2, ())
>>> graph = TaskGraph(tasks=(Task(0, (), a, Const(1.0)), Task(1, (), a, Const(2.0)),
...                          Task(2, (), b, Const(4.0)), Task(3, (a, b), c, Add())),
...                   retain=frozenset({2}))
>>> [t.task.id for t in SerialSchedule.of(graph).tasks]
[0, 1, 2, 3]
>>> run_serial(graph).outputs[c].item()
7.0
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import torch

from tensorql.errors import ExecutionError, TensorQLError
from tensorql.exec.run_state import RunState
from tensorql.exec.run_types import (
    ChunkDestination,
    ChunkSink,
    ProgressCallback,
    RunResult,
    RunStats,
    StepStats,
    first_contribution,
    record_task,
)
from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph


@dataclass(frozen=True)
class SerialTask:
    """One task in the serial order, with its chunks as slots of the run's value list."""

    task: Task
    inputs: tuple[int, ...]  # the slots of task.inputs
    output: int  # the slot of task.output
    first: bool  # the first contribution to its output chunk in this order
    completes: bool  # the last contribution: the chunk is whole after it
    retained: bool  # its output is a result of the run
    frees: tuple[int, ...]  # slots not retained that no later task reads
    frees_retained: tuple[int, ...]  # retained slots no later task reads (streamed runs)
    bytes_read: int = 0  # what its kernel reads from rest (``kernel.bytes_read``), per run


@dataclass(frozen=True)
class SerialSchedule:
    """The order a graph's tasks run in serially: by priority among the ready ones (what one
    worker of the threaded mode would take), each chunk freed after its last reader."""

    tasks: tuple[SerialTask, ...]
    slots: int
    # the slices of in-memory constants (a kernel that says ``inline``: a view, no work) no
    # other task contributes to and the run does not return, as (slot, task): put in their
    # slots before the loop, not run as tasks of it (a decoded token has ~120 in ~330)
    inline: tuple[tuple[int, Task], ...] = ()

    @classmethod
    def of(cls, graph: TaskGraph) -> SerialSchedule:
        """The schedule of ``graph``, computed on first use and kept with it."""
        cached = graph.programs.get("serial-schedule")
        if cached is None:
            cached = graph.programs["serial-schedule"] = cls._build(graph)
        return cached

    @classmethod
    def _build(cls, graph: TaskGraph) -> SerialSchedule:
        contributions = graph.dependencies().contributions
        everything = _order(graph)
        inline = [task for task in everything
                  if getattr(task.kernel, "inline", False) and not task.inputs
                  and contributions[task.output] == 1 and task.output.step not in graph.retain]
        inline_ids = {task.id for task in inline}
        order = [task for task in everything if task.id not in inline_ids]
        slot: dict[ChunkRef, int] = {}
        for task in (*inline, *order):
            for ref in (*task.inputs, task.output):
                slot.setdefault(ref, len(slot))
        # the position of the last task touching each chunk (its last reader, or its
        # last contribution when nothing reads it after that)
        last_touch: dict[ChunkRef, int] = {}
        for position, task in enumerate(order):
            for ref in (*task.inputs, task.output):
                last_touch[ref] = position
        frees_at: dict[int, list[ChunkRef]] = {}
        for ref, position in last_touch.items():
            frees_at.setdefault(position, []).append(ref)
        seen: dict[ChunkRef, int] = {}
        tasks = []
        for position, task in enumerate(order):
            out = task.output
            seen[out] = seen.get(out, 0) + 1
            done_here = frees_at.get(position, ())
            tasks.append(SerialTask(
                task=task, inputs=tuple(slot[ref] for ref in task.inputs), output=slot[out],
                first=seen[out] == 1, completes=seen[out] == contributions[out],
                retained=out.step in graph.retain,
                frees=tuple(slot[ref] for ref in done_here if ref.step not in graph.retain),
                frees_retained=tuple(slot[ref] for ref in done_here
                                     if ref.step in graph.retain),
                bytes_read=getattr(task.kernel, "bytes_read", 0)))
        return cls(tuple(tasks), len(slot), tuple((slot[t.output], t) for t in inline))


def _order(graph: TaskGraph) -> list[Task]:
    """The tasks in the order one worker takes them: the most urgent ready task first."""
    deps = graph.dependencies()
    remaining = dict(deps.contributions)
    pending = dict(deps.pending)
    ready = [(task.priority, task.id, task) for task in deps.sources]
    heapq.heapify(ready)
    order = []
    while ready:
        task = heapq.heappop(ready)[2]
        order.append(task)
        remaining[task.output] -= 1
        if remaining[task.output] == 0:
            for reader in deps.readers.get(task.output, ()):
                pending[reader.id] -= 1
                if pending[reader.id] == 0:
                    heapq.heappush(ready, (reader.priority, reader.id, reader))
    if len(order) != len(graph.tasks):
        raise ExecutionError(
            f"deadlock: {len(graph.tasks) - len(order)} task(s) never became ready")
    return order


def run_serial(graph: TaskGraph, progress: ProgressCallback | None = None,
               sink: ChunkSink | None = None, destination: ChunkDestination | None = None,
               keep_outputs: bool = True, threads: int | None = None) -> RunResult:
    """The engine's serial strategy: every task of ``graph`` on this thread (with
    ``threads`` torch threads for the kernels, when given); arguments and result as
    :func:`tensorql.exec.engine.run`. The loop reads the run state's fields into locals:
    a task costs one pass of it and nothing more."""
    schedule = SerialSchedule.of(graph)
    state = RunState(graph, progress, sink, destination, keep_outputs,
                     RunStats(tasks=len(graph.tasks), serial=True))
    stats = state.stats
    steps = stats.steps
    values: list[torch.Tensor | None] = [None] * schedule.slots
    total, live, peak = len(schedule.tasks), 0, 0
    previous = torch.get_num_threads()
    if threads is not None and threads != previous:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    entry: SerialTask | None = None
    try:
        for i, task in schedule.inline:
            value = values[i] = task.kernel.run((), None)
            live += value.nbytes
            record_task(stats, task.output.step, start, start)
        for done, entry in enumerate(schedule.tasks, start=len(schedule.inline) + 1):
            task = entry.task
            inputs = [values[i] for i in entry.inputs]
            started = time.perf_counter()
            if entry.first:
                dest = destination(task.output) if (destination is not None
                                                    and entry.retained) else None
                value = first_contribution(task.kernel, inputs, dest)
                live += value.nbytes
            else:
                value = task.kernel.run(inputs, values[entry.output])
            ended = time.perf_counter()
            values[entry.output] = value
            # record_task's figures, inline (a tensor network's warm call is ~240 tasks of
            # a few us of Python each): in this order a step's first task starts first and
            # each task ends after the ones before it
            st = steps.get(task.output.step)
            if st is None:
                st = steps[task.output.step] = StepStats(first_start=started)
            st.tasks += 1
            st.busy_s += ended - started
            st.last_end = ended
            if inputs:
                st.bytes_in += sum([x.nbytes for x in inputs])
            st.bytes_read += entry.bytes_read
            del inputs
            peak = max(peak, live)
            if entry.completes and entry.retained and sink is not None:
                sink(task.output, value)
            del value
            for i in entry.frees:
                live -= values[i].nbytes
                values[i] = None
            if not keep_outputs:
                for i in entry.frees_retained:
                    live -= values[i].nbytes
                    values[i] = None
            if progress is not None:
                progress(done, total)
        state.done_tasks = total
    except TensorQLError:
        raise
    except Exception as err:
        state.fail(err, entry.task if entry is not None else None)
        state.raise_task_failure()
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)
    stats.wall_s = time.perf_counter() - start
    stats.peak_live_bytes = peak
    stats.rebase(start)
    outputs = {entry.task.output: values[entry.output] for entry in schedule.tasks
               if entry.retained and entry.completes and values[entry.output] is not None}
    return RunResult(outputs=outputs, stats=stats)


__all__ = ["SerialSchedule", "SerialTask", "run_serial"]
