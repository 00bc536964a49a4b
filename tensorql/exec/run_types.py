"""The records every run produces, whichever mode of the engine ran it.

``StepStats`` per plan step, ``RunStats`` per run (the runtime's ``RuntimeStats`` adds
per-device figures), ``RunResult`` the retained chunks with the stats; :func:`record_task`
is the one place a finished chunk task is added to a step's figures.

>>> stats = RunStats(tasks=1)
>>> _ = record_task(stats, step=0, started=0.5, ended=1.5, bytes_in=64, bytes_read=16)
>>> stats.steps[0].busy_s, stats.bytes_read, stats.steps[0].span_s
(1.0, 16, 1.0)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorql.errors import ExecutionError
from tensorql.exec.progress import ProgressCallback
from tensorql.exec.taskgraph import ChunkRef

__all__ = ["ChunkDestination", "ChunkSink", "ProgressCallback", "RunResult", "RunStats",
           "StepStats", "first_contribution", "record_task", "task_failure"]

ChunkSink = Callable[[ChunkRef, torch.Tensor], None]
# Where a retained chunk should be written: a preallocated tensor (e.g. a view of the dense
# result) or None for "allocate one". Kernels write their first contribution straight into it.
ChunkDestination = Callable[[ChunkRef], "torch.Tensor | None"]


@dataclass
class StepStats:
    """Measured figures of one plan step."""

    tasks: int = 0
    busy_s: float = 0.0
    bytes_in: int = 0
    bytes_read: int = 0
    first_start: float = float("inf")
    last_end: float = 0.0

    @property
    def span_s(self) -> float:
        return max(0.0, self.last_end - self.first_start) if self.tasks else 0.0


@dataclass
class RunStats:
    """Measured figures of one run."""

    wall_s: float = 0.0
    workers: int = 1
    serial: bool = False  # run in the engine's serial mode, on the calling thread
    wide_tasks: int = 0  # tasks that ran with every worker's torch threads (lanes strategy)
    tasks: int = 0
    peak_live_bytes: int = 0
    steps: dict[int, StepStats] = field(default_factory=dict)

    def rebase(self, start: float) -> None:
        """Make the steps' first start and last end offsets from ``start`` (the run's)."""
        for step in self.steps.values():
            step.first_start -= start
            step.last_end -= start

    @property
    def where(self) -> str:
        """How the run's tasks ran, for EXPLAIN ANALYZE: "2 worker(s)" (with how many tasks
        ran on every worker's threads) or "1 thread (serial)".

        >>> print(RunStats(workers=2, wide_tasks=1).where)
        2 worker(s), 1 task(s) on every worker's threads
        """
        if self.serial:
            return "1 thread (serial)"
        wide = f", {self.wide_tasks} task(s) on every worker's threads" if self.wide_tasks else ""
        return f"{self.workers} worker(s){wide}"

    @property
    def bytes_read(self) -> int:
        return sum(s.bytes_read for s in self.steps.values())

    @property
    def busy_s(self) -> float:
        return sum(s.busy_s for s in self.steps.values())


@dataclass
class RunResult:
    outputs: dict[ChunkRef, torch.Tensor]
    stats: RunStats


def record_task(stats: RunStats, step: int, started: float, ended: float, bytes_in: int = 0,
                bytes_read: int = 0, tasks: int = 1) -> StepStats:
    """Add one finished task (or a load from rest, ``tasks=0`` when already counted) to the
    figures of its ``step``."""
    st = stats.steps.setdefault(step, StepStats())
    st.tasks += tasks
    st.busy_s += ended - started
    st.first_start = min(st.first_start, started)
    st.last_end = max(st.last_end, ended)
    st.bytes_in += bytes_in
    st.bytes_read += bytes_read
    return st


def task_failure(graph: Any, task: Any, err: BaseException) -> ExecutionError:
    """The error a run raises when ``task`` of ``graph`` failed with ``err``: its step and
    chunk named (a TensorQLError the kernel raised is raised as it is, by the caller)."""
    return ExecutionError(f"{graph.step_name(task.output.step)} failed on chunk "
                          f"{task.output.key}: {type(err).__name__}: {err}")


def first_contribution(kernel: Any, inputs: list[torch.Tensor],
                       dest: torch.Tensor | None) -> torch.Tensor:
    """The first contribution to a chunk: written into ``dest`` (a preallocated tile of a dense
    result) when given -- by the kernel itself when it can write into a given tensor -- else a
    new tensor. A kernel whose value does not fit ``dest`` returns its own tensor (the run's
    sink then copies it).

    >>> class Ones:
    ...     def run(self, inputs, acc): return torch.ones(2)
    >>> out = torch.zeros(4)
    >>> first_contribution(Ones(), [], out[:2]).data_ptr() == out.data_ptr(), out.tolist()
    (True, [1.0, 1.0, 0.0, 0.0])
    """
    if dest is None:
        return kernel.run(inputs, None)
    run_into = getattr(kernel, "run_into", None)
    if run_into is not None:
        return run_into(inputs, dest)
    value = kernel.run(inputs, None)
    if value.shape != dest.shape or value.dtype != dest.dtype:
        return value
    return dest.copy_(value)
