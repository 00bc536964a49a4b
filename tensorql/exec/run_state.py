"""The state every strategy of the engine shares in one run (:mod:`tensorql.exec.engine`).

A run of any strategy -- serial, lanes, streams, a rank of a job -- has the same inputs and
the same duties: the task graph, where result chunks go (a ``sink``, a ``destination`` tile of
a dense result, whether the run keeps them: ``keep_outputs``), progress, the run's figures
(:class:`~tensorql.exec.run_types.RunStats`), the count of chunk tasks done and the first
failure. :class:`RunState` holds them and does those duties in one place; a strategy's own
state (readiness counts, chunk values, lanes) extends it.

>>> from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph
>>> g = TaskGraph(tasks=(Task(0, (), ChunkRef(0, ()), None),), retain=frozenset({0}))
>>> seen = []
>>> state = RunState(g, lambda done, total: seen.append((done, total)), None, None, True,
...                  RunStats(tasks=1))
>>> state.task_done(); seen
[(1, 1)]
>>> state.destination_for(ChunkRef(0, ())) is None
True
"""

from __future__ import annotations

from typing import Any

import torch

from tensorql.errors import ExecutionError, TensorQLError
from tensorql.exec.run_types import (
    ChunkDestination,
    ChunkSink,
    ProgressCallback,
    RunStats,
    task_failure,
)
from tensorql.exec.taskgraph import ChunkRef, TaskGraph

__all__ = ["RunState"]


class RunState:
    """The run's graph, its result handling, progress, figures and first failure."""

    def __init__(self, graph: TaskGraph, progress: ProgressCallback | None,
                 sink: ChunkSink | None, destination: ChunkDestination | None,
                 keep_outputs: bool, stats: RunStats) -> None:
        self.graph = graph
        self.progress = progress
        self.sink = sink
        self.destination = destination
        self.keep_outputs = keep_outputs
        self.stats = stats
        self.total_tasks = len(graph.tasks)
        self.done_tasks = 0
        self.error: BaseException | None = None
        self.failed: Any = None  # the task (or memory-plan op) that failed

    def fail(self, err: BaseException, where: Any) -> None:
        """Record ``err`` raised by ``where`` unless an earlier failure is recorded."""
        if self.error is None:
            self.error, self.failed = err, where

    def task_done(self) -> None:
        """Count one chunk task done and report progress."""
        self.done_tasks += 1
        if self.progress is not None:
            self.progress(self.done_tasks, self.total_tasks)

    def destination_for(self, ref: ChunkRef) -> torch.Tensor | None:
        """The preallocated tile a retained chunk is computed into, if the run has one."""
        if self.destination is None or ref.step not in self.graph.retain:
            return None
        return self.destination(ref)

    def raise_task_failure(self) -> None:
        """Raise the recorded failure of a chunk task: a TensorQLError as it is, anything
        else as an ExecutionError naming the task's step and chunk."""
        err = self.error
        assert err is not None
        if isinstance(err, TensorQLError) or not isinstance(err, Exception):
            raise err  # ours, or an interrupt (KeyboardInterrupt, SystemExit) as it came
        raise task_failure(self.graph, self.failed, err) from err

    def check_all_done(self) -> None:
        """ExecutionError unless every task ran (a graph whose tasks never became ready)."""
        if self.done_tasks != self.total_tasks:
            raise ExecutionError(f"deadlock: {self.total_tasks - self.done_tasks} task(s) "
                                 "never became ready")
