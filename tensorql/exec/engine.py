"""The engine: one ``run`` of a task graph, with a scheduling strategy chosen per graph.

Every run -- a query, a group of queries, a streamed store, a rank of a torch.distributed
job -- comes here. The program is the :class:`~tensorql.exec.taskgraph.TaskGraph`; each
strategy keeps what it prepares from it with the graph (``graph.programs``: the serial order,
the lanes' starting state, the memory plan's ops), so a query run again prepares nothing.
The strategies share one run state (:class:`~tensorql.exec.run_state.RunState`: sink,
destination, progress, figures, failure):

- ``serial`` -- on the calling thread, in one order worked out once
  (:func:`~tensorql.exec.serial.run_serial`);
- ``lanes`` -- worker threads take ready tasks straight from the graph
  (:class:`~tensorql.exec.executor.Lanes`);
- ``streams`` -- the memory plan's ops on the devices' lanes, driven by completion events
  (:meth:`~tensorql.exec.runtime.Runtime.run_streams`);
- ``rank`` -- the streams of one rank of a distributed job, its transfers through
  torch.distributed (:class:`~tensorql.exec.distributed.DistributedRuntime`);
- ``tape`` -- the serial order lowered once into bound kernel calls over buffers kept
  between runs (:func:`~tensorql.exec.tape.run_tape`), for a plan run again and again (a
  decoder's token asks for it by name); on anything but one CPU with no memory limit the
  policy's strategy.

:func:`choose_strategy` is the policy: a rank runs ``rank``; one CPU device with no memory
limit (and no timeline) runs ``serial`` or ``lanes`` by the graph
(:func:`runs_serially`), and a serial graph run again from its tape where it suits
(:func:`~tensorql.exec.tape.suits`: pure kernels, small buffers -- a tensor network's warm
call); anything else runs ``streams``.

>>> import torch
>>> from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph
>>> class Const:
...     def __init__(self, v): self.v = v
...     def run(self, inputs, acc): return torch.tensor(self.v) if acc is None else acc + self.v
...     def combine(self, acc, partial): return acc + partial
>>> g = TaskGraph(tasks=(Task(0, (), ChunkRef(0, ()), Const(1.0)),
...                      Task(1, (), ChunkRef(0, ()), Const(2.0))), retain=frozenset({0}))
>>> config = EngineConfig.cpu(workers=2)
>>> choose_strategy(g, config)
'serial'
>>> [run(g, config, strategy=s).outputs[ChunkRef(0, ())].item() for s in STRATEGIES
...  if s != "rank"]
[3.0, 3.0, 3.0, 3.0]
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tensorql.devices import DeviceSet
from tensorql.errors import ExecutionError, ProgressCallbackError
from tensorql.exec.distributed import DistributedRuntime, RankLayout
from tensorql.exec.executor import Lanes
from tensorql.exec.run_types import ChunkDestination, ChunkSink, ProgressCallback, RunResult
from tensorql.exec.runtime import Runtime
from tensorql.exec.serial import run_serial
from tensorql.exec.tape import fits, run_tape_if_free, suits
from tensorql.exec.taskgraph import TaskGraph

log = logging.getLogger(__name__)

__all__ = ["STRATEGIES", "EngineConfig", "RankJob", "Strategy", "UnknownStrategyError",
           "choose_strategy", "narrow_share", "run", "runs_serially"]


class UnknownStrategyError(ExecutionError):
    """A strategy name that is not in :data:`STRATEGIES`."""


@dataclass(frozen=True)
class RankJob:
    """This process's place in a torch.distributed job, and how its chunks travel."""

    layout: RankLayout
    exchange: str = "collective"
    exchange_group: Any = field(default=None, compare=False)
    device: Any = None  # where its buffers for torch.distributed are (None: the host)


@dataclass(frozen=True)
class EngineConfig:
    """What a run needs of the session: the devices (parsed once), the memory limit, the
    threads. ``runtime``: devices already built (a test's null devices, a runtime whose
    memory plan is given) for the streams strategy; ``rank``: a rank's job. ``spill``: the
    session's :class:`~tensorql.storage.spill.SpillSpace`, where host copies beyond
    ``host_budget`` bytes of host memory go (the DuckDB tier)."""

    devices: DeviceSet
    memory_limit: int | None = None
    workers: int = 1
    intra_op_threads: int = 1
    timeline: bool = False
    direct: bool = True  # may a run of one CPU with no limit skip the memory plan
    runtime: Runtime | None = field(default=None, compare=False)
    rank: RankJob | None = None
    spill: Any = field(default=None, compare=False)
    host_budget: int | None = None
    device_cache: Any = None  # Options.device_cache: "auto", bytes, or None/0 (off)

    @classmethod
    def of(cls, options: Any, *, timeline: bool = False, rank: RankJob | None = None,
           spill: Any = None, dense_bytes: int = 0) -> EngineConfig:
        """The engine a session's ``Options`` call for. Under a memory limit the memory plan
        counts on a host tier of :meth:`~tensorql.options.Options.host_tier_bytes` (less
        ``dense_bytes``, the run's dense results); with a ``spill`` space the host tier
        holds no more in host memory and spills the rest to DuckDB."""
        budget = (options.host_tier_bytes(dense_bytes)
                  if spill is not None or options.memory_limit is not None else None)
        return cls(options.device_set, options.memory_limit, options.workers,
                   options.intra_op_threads, timeline, rank=rank, spill=spill,
                   host_budget=budget, device_cache=options.device_cache)

    @classmethod
    def cpu(cls, workers: int = 1, intra_op_threads: int = 1) -> EngineConfig:
        """One CPU of ``workers`` threads, no memory limit."""
        return cls(_ONE_CPU, None, max(1, int(workers)), max(1, int(intra_op_threads)))

    @classmethod
    def of_runtime(cls, rt: Runtime) -> EngineConfig:
        """A runtime's devices and settings (its ``direct`` flag says whether the policy may
        skip the memory plan)."""
        return cls(_ONE_CPU, rt.memory_limit, rt.workers, rt.intra_op_threads, rt.timeline,
                   direct=rt.direct, runtime=rt)

    @property
    def runs_direct(self) -> bool:
        """Whether the graph may run straight from the task graph (serial or lanes): one CPU
        device, nothing to budget, nothing to record per op."""
        if self.runtime is not None:
            return self.direct and self.runtime.direct
        return (self.direct and self.devices.count == 1 and self.devices.all_cpu
                and self.memory_limit is None and not self.timeline)

    def build_runtime(self) -> Runtime:
        """The streams strategy's runtime on these devices (the given one, if any)."""
        if self.runtime is not None:
            return self.runtime
        return Runtime(self.devices, self.memory_limit, workers=self.workers,
                       intra_op_threads=self.intra_op_threads, timeline=self.timeline,
                       spill_store=self.spill, host_budget=self.host_budget,
                       device_cache=self.device_cache)


_ONE_CPU = DeviceSet.parse("cpu")

RunFn = Callable[[TaskGraph, EngineConfig, "ProgressCallback | None", "ChunkSink | None",
                  "ChunkDestination | None", bool], RunResult]


@dataclass(frozen=True)
class Strategy:
    """A way of scheduling one run: its name, what it does, and the function that runs it."""

    name: str
    summary: str
    run: RunFn


def _serial(graph: TaskGraph, config: EngineConfig, progress: ProgressCallback | None,
            sink: ChunkSink | None, destination: ChunkDestination | None,
            keep_outputs: bool) -> RunResult:
    return run_serial(graph, progress, sink, destination, keep_outputs,
                      threads=config.workers * config.intra_op_threads)


def _tape(graph: TaskGraph, config: EngineConfig, progress: ProgressCallback | None,
          sink: ChunkSink | None, destination: ChunkDestination | None,
          keep_outputs: bool) -> RunResult:
    if not config.runs_direct or config.rank is not None:  # one CPU, nothing budgeted only
        chosen = STRATEGIES[choose_strategy(graph, config)]
        return chosen.run(graph, config, progress, sink, destination, keep_outputs)
    threads = config.workers * config.intra_op_threads
    if fits(graph):  # else its buffers would hold too much at once: freed as it goes
        result = run_tape_if_free(graph, progress, sink, keep_outputs, threads,
                                  destination=destination)
        if result is not None:  # None: another thread's run of the graph holds its buffers
            return result
    return run_serial(graph, progress, sink, destination, keep_outputs, threads=threads)


def _lanes(graph: TaskGraph, config: EngineConfig, progress: ProgressCallback | None,
           sink: ChunkSink | None, destination: ChunkDestination | None,
           keep_outputs: bool) -> RunResult:
    return Lanes(config.workers, config.intra_op_threads).run(
        graph, progress, sink, destination, keep_outputs)


def _streams(graph: TaskGraph, config: EngineConfig, progress: ProgressCallback | None,
             sink: ChunkSink | None, destination: ChunkDestination | None,
             keep_outputs: bool) -> RunResult:
    return config.build_runtime().run_streams(graph, progress, sink, destination, keep_outputs)


def _rank(graph: TaskGraph, config: EngineConfig, progress: ProgressCallback | None,
          sink: ChunkSink | None, destination: ChunkDestination | None,
          keep_outputs: bool) -> RunResult:
    job = config.rank
    if job is None:
        raise UnknownStrategyError("strategy 'rank' needs a rank of a torch.distributed job "
                                   "(EngineConfig.rank)")
    runtime = DistributedRuntime(job.layout, config.devices, config.memory_limit,
                                 workers=config.workers,
                                 intra_op_threads=config.intra_op_threads,
                                 exchange=job.exchange, exchange_group=job.exchange_group)
    return runtime.run(graph, progress=progress, sink=sink, destination=destination)


#: the scheduling strategies, by name
STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("serial", "on the calling thread, in one order worked out once", _serial),
    Strategy("lanes", "worker threads take ready tasks straight from the graph", _lanes),
    Strategy("streams", "the memory plan's ops on the devices' lanes, by completion events",
             _streams),
    Strategy("rank", "one rank's streams of a torch.distributed job", _rank),
    Strategy("tape", "the serial order lowered once into bound calls, for a plan run again "
             "and again", _tape),
)}


# -- the policy: which strategy runs a graph -------------------------------------------

# A graph whose tasks average fewer estimated FLOPs than this (~0.1 ms of one core) runs in
# the serial mode: a worker would spend about as long taking a task as running it.
SERIAL_TASK_FLOPS = 1_000_000
# A graph whose work is mostly in steps of fewer tasks than workers (``narrow_share``) runs in
# the serial mode too, each task on every worker's torch threads: its workers could not share
# that work out anyway, and a run on the calling thread uses the OpenMP threads torch already
# keeps there (see Executor.runs_serially).
SERIAL_NARROW_SHARE = 0.5


def narrow_share(graph: TaskGraph, workers: int) -> float:
    """The share of ``graph``'s (weighted) FLOPs in steps of fewer tasks than ``workers``:
    work the workers cannot share out task by task.

    >>> from tensorql.exec.taskgraph import ChunkRef, Task
    >>> g = TaskGraph(tasks=(Task(0, (), ChunkRef(0, (0,)), None, flops=30),
    ...                      Task(1, (), ChunkRef(1, (0,)), None, flops=10),
    ...                      Task(2, (), ChunkRef(1, (1,)), None, flops=10)))
    >>> narrow_share(g, 2)
    0.6
    """
    per_step: dict[int, list[int]] = {}
    for task in graph.tasks:
        entry = per_step.setdefault(task.output.step, [0, 0])
        entry[0] += 1
        entry[1] += task.weighted_flops
    total = sum(flops for _, flops in per_step.values())
    narrow = sum(flops for count, flops in per_step.values() if count < workers)
    return narrow / total if total else 1.0


def runs_serially(graph: TaskGraph, workers: int) -> bool:
    """Whether the engine runs ``graph`` on one CPU of ``workers`` threads in the serial
    strategy (:mod:`tensorql.exec.serial`) on the calling thread rather than on its lanes:
    with one worker, or when the graph's tasks are short on average (estimated FLOPs below
    ``SERIAL_TASK_FLOPS`` a task: a LLaMA decoder's token, ~0.4 MFLOP), so that handing each
    to a worker would cost about what a second worker could gain, or when at least
    ``SERIAL_NARROW_SHARE`` of its work is in steps of fewer tasks than workers
    (:func:`narrow_share`: chains of one-chunk products, as in a tensor network or a
    transformer block's training step), which the workers could not share out: each task
    then runs on every worker's torch threads, on the calling thread, whose OpenMP threads
    torch keeps (a LLaMA block's training step 44-48 -> 42-44 ms, and no longer 6-8 ms slower
    right after a torch step; einsum_benchmark's tree 1.4x faster).

    >>> from tensorql.exec.taskgraph import ChunkRef, Task
    >>> tiny = TaskGraph(tasks=(Task(0, (), ChunkRef(0, ()), None, flops=1000),))
    >>> runs_serially(tiny, 2), runs_serially(tiny, 1)
    (True, True)
    """
    if workers == 1:
        return True
    mean = graph.programs.get("mean-task-flops")
    if mean is None:
        mean = sum(task.weighted_flops for task in graph.tasks) / max(1, len(graph.tasks))
        graph.programs["mean-task-flops"] = mean
    if mean < SERIAL_TASK_FLOPS:
        return True
    key = ("narrow-share", workers)
    share = graph.programs.get(key)
    if share is None:
        share = graph.programs[key] = narrow_share(graph, workers)
    return share >= SERIAL_NARROW_SHARE


def choose_strategy(graph: TaskGraph, config: EngineConfig) -> str:
    """The strategy the engine runs ``graph`` with under ``config`` (see the module)."""
    if config.rank is not None:
        return "rank"
    if not config.runs_direct:
        return "streams"
    if not runs_serially(graph, config.workers):
        return "lanes"
    return "tape" if suits(graph) else "serial"


def guarded_progress(progress: ProgressCallback | None) -> ProgressCallback | None:
    """``progress`` raising a :class:`~tensorql.errors.ProgressCallbackError` (its own
    exception the cause) in place of any exception of its own: each strategy stops a run at
    a TensorQLError and passes it on as it is, where another exception of a worker's would
    be taken for its task's failure (or, raised outside a task on a lanes worker, end that
    worker and leave the run waiting for it).

    >>> def stop(done, total):
    ...     raise KeyError("enough")
    >>> try:
    ...     guarded_progress(stop)(1, 2)
    ... except ProgressCallbackError as err:
    ...     print(err, "|", repr(err.__cause__))
    the progress callback raised KeyError: 'enough' (at 1 of 2 tasks) | KeyError('enough')
    """
    if progress is None:
        return None

    def report(done: int, total: int) -> None:
        try:
            progress(done, total)
        except Exception as err:
            raise ProgressCallbackError(f"the progress callback raised {type(err).__name__}: "
                                        f"{err} (at {done} of {total} tasks)") from err
    return report


def run(graph: TaskGraph, config: EngineConfig | Any, *, strategy: str | None = None,
        progress: ProgressCallback | None = None, sink: ChunkSink | None = None,
        destination: ChunkDestination | None = None, keep_outputs: bool = True) -> RunResult:
    """Run every task of ``graph`` under ``config`` (an :class:`EngineConfig` or a session's
    ``Options``) with ``strategy`` (default: :func:`choose_strategy`).

    ``progress(done, total)`` is called as tasks finish; ``sink(ref, chunk)`` as each chunk
    of a retained step completes (e.g. to copy it into a dense result while other tasks still
    run). ``destination(ref)`` may name a preallocated tensor for a retained chunk (a view of
    a dense result) that its tasks write into directly. With ``keep_outputs=False`` a
    retained chunk is released once ``sink`` has taken it (``outputs`` then holds only
    chunks the sink never saw)."""
    if not isinstance(config, EngineConfig):
        config = EngineConfig.of(config)
    progress = guarded_progress(progress)
    name = strategy if strategy is not None else choose_strategy(graph, config)
    if strategy is None and name == "tape" and progress is not None:
        name = "serial"  # progress as each task ends (a tape reports once, at its end)
    log.debug("engine strategy %s for %d tasks (%d worker(s), memory_limit %s)", name,
              len(graph.tasks), config.workers, config.memory_limit)
    chosen = STRATEGIES.get(name)
    if chosen is None:
        raise UnknownStrategyError(f"unknown strategy {name!r}; choose one of "
                                   f"{', '.join(STRATEGIES)}")
    return chosen.run(graph, config, progress, sink, destination, keep_outputs)
