"""A task graph run again and again, lowered once into a flat tape of calls.

A plan run token after token -- a LLaMA decoder's step: ~330 tasks, ~200 kernels of
10-500 us each -- spends as long in Python choosing and feeding its kernels as in them: the
serial strategy's loop (:mod:`tensorql.exec.serial`) reads each task's slots, runs its
kernel object, whose kernel works out again which torch call its operands need (labels to a
matrix product, strides to BLAS), and records figures. The tape does all of that once, for
a graph of one CPU device run serially with fixed shapes (every plan is: shapes are planned):

* the graph is run once in the serial order (:class:`~tensorql.exec.serial.SerialSchedule`),
  every chunk kept: each chunk's tensor is from then on its **buffer**, written in place by
  every later run (``out=``), so every tensor a kernel reads is the same object each run;
* each task becomes zero-argument calls bound to those tensors: the kernel's ``bind(inputs,
  out)`` when it has one (a sequence of calls, or None: e.g. ``ContractChunk`` binds
  ``torch.mm(left, right, out=...)`` on views of its operands worked out once), else its
  ``run_into(inputs, out)`` (or ``out.copy_(run(inputs, None))``); a further contribution to
  a chunk is its ``run(inputs, acc)``, in place;
* a task whose chunk is a view of its input (a reshape, a retile that keeps the tile) is
  no call at all: the view of the input's buffer stays valid (a kernel returns the same view
  of inputs of the same layout);
* a retained chunk whose destination (``destination(ref)``, a tile of the caller's dense
  result) is memory of one of the graph's sources -- an output computed in place over the
  constant it replaces, a training step's weight update (:mod:`tensorql.physical.in_place`)
  -- is computed there, not into a buffer of the tape's: its call writes the caller's memory
  each run (the destination must be the same memory at each replay, else the tape is lowered
  again) and nothing is copied out;
* sources -- constants (a ``storage_key()``: the address of their storage, checked before
  each run) and store reads (run again, the tensor they hand back compared with the one
  recorded) -- are the inputs. A constant written in place (a KV cache, a token's
  embedding) is read as it is then; one whose storage was replaced, or a store chunk read
  afresh, makes the tape stale, and the run lowers it again (:func:`run_tape`).

A run is then ``for call in calls: call()``: no scheduling, no slots, no per-task records.
The buffers hold every chunk the graph computes at once (no chunk is freed), so a graph whose
chunks add up to more than :data:`TAPE_MAX_BYTES` is run serially instead. The results are the
buffers of the retained chunks: a run hands them to the sink, which copies them out (they are
overwritten by the next run). The engine's ``tape`` strategy runs it
(``engine.run(graph, config, strategy="tape")``; ``CompiledGroup.run(strategy="tape")``).

>>> import torch
>>> from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph
>>> class Const:
...     def __init__(self, v): self.v = v
...     def storage_key(self): return self.v.data_ptr()
...     def run(self, inputs, acc): return self.v
>>> class Double:
...     calls = 0
...     def run(self, inputs, acc):
...         Double.calls += 1
...         return inputs[0] * 2
...     def bind(self, inputs, out):
...         return (lambda: torch.mul(inputs[0], 2, out=out),)
>>> x = torch.ones(3)
>>> a, b = ChunkRef(0, ()), ChunkRef(1, ())
>>> graph = TaskGraph(tasks=(Task(0, (), a, Const(x)), Task(1, (a,), b, Double())),
...                   retain=frozenset({1}))
>>> run_tape(graph).outputs[b].tolist(), Double.calls  # lowered: the kernel ran once
([2.0, 2.0, 2.0], 1)
>>> _ = x.fill_(5.0)  # written in place: the same storage, read as it is now
>>> run_tape(graph).outputs[b].tolist(), Double.calls  # replayed: the bound call only
([10.0, 10.0, 10.0], 1)
>>> Tape.of(graph).counts
TapeCounts(calls=1, bound=1, generic=0, accumulate=0, views=0, sources=1)
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorql.errors import ExecutionError, TensorQLError
from tensorql.exec.run_types import (
    ChunkDestination,
    ChunkSink,
    ProgressCallback,
    RunResult,
    RunStats,
    StepStats,
    first_contribution,
    task_failure,
)
from tensorql.exec.serial import SerialSchedule, SerialTask
from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph

__all__ = ["AUTO_TAPES_TOTAL_BYTES", "AUTO_TAPE_MAX_BYTES", "AUTO_TAPE_MAX_SOURCE_BYTES",
           "REPLAYED", "TAPE_MAX_BYTES", "Tape",
           "TapeCounts", "fits", "run_tape", "run_tape_if_free", "suits"]

# The most bytes of buffers a tape keeps (every chunk the graph computes, all at once): a
# graph whose chunks add up to more runs in the serial strategy, which frees each chunk
# after its last reader. A decoded LLaMA token's chunks are ~1 MiB (its weights are inputs).
TAPE_MAX_BYTES = 64 << 20
# A graph the engine's policy runs from a tape by itself (:func:`suits`, not asked for by
# name) keeps at most this many bytes of buffers, and all such tapes together at most
# AUTO_TAPES_TOTAL_BYTES: beyond it the oldest is dropped (lowered again when run again).
# Its calls hold on to its sources' tensors too (stored chunks a store's cache could
# otherwise drop): at most AUTO_TAPE_MAX_SOURCE_BYTES of them, and they count against
# AUTO_TAPES_TOTAL_BYTES with the buffers.
AUTO_TAPE_MAX_BYTES = 16 << 20
AUTO_TAPE_MAX_SOURCE_BYTES = 64 << 20
AUTO_TAPES_TOTAL_BYTES = 256 << 20
# ``graph.programs[REPLAYED]`` set: the graph's owner runs it again and again with its results
# computed in place (an optimizer's step, :meth:`tensorql.api.optim.Optimizer.step`): the
# policy runs it from a tape within TAPE_MAX_BYTES of buffers (its results in place are the
# owner's memory, not the tape's), its kernels' in-place writes being what every run does
REPLAYED = "replayed"
# a tape found stale this often (a source read afresh every run, e.g. a store whose cache
# does not keep its chunks) is no longer chosen by the policy: each run would lower it again
STALE_LIMIT = 2

Call = Callable[[], Any]


@dataclass(frozen=True)
class TapeCounts:
    """What a tape is made of: ``calls`` run each time (``bound`` of them from a kernel's
    own ``bind``, ``generic`` its ``run_into``/``run``, ``accumulate`` further contributions
    to a chunk), and the tasks that are no call: ``views`` of an input's buffer and
    ``sources`` (constants, store reads)."""

    calls: int
    bound: int
    generic: int
    accumulate: int
    views: int
    sources: int


@dataclass(frozen=True)
class _Source:
    """A task reading nothing: checked before each run (see :meth:`Tape.current`)."""

    task: Task
    key: Any  # its storage_key() when recorded, or None: run again and compared
    value: torch.Tensor  # the tensor it gave when recorded


@dataclass(frozen=True)
class Tape:
    """A graph's tasks as bound calls over buffers kept between runs (see the module)."""

    calls: tuple[Call, ...]
    owners: tuple[Task, ...]  # the task of each call, for errors
    sources: tuple[_Source, ...]
    outputs: tuple[tuple[ChunkRef, torch.Tensor], ...]  # the retained chunks' buffers
    counts: TapeCounts
    nbytes: int  # bytes of the buffers the tape allocated
    call_steps: tuple[int, ...] = ()  # the step of each call's task
    # per step: (tasks, bytes in, bytes read) -- fixed, as every run's shapes are
    step_totals: tuple[tuple[int, int, int, int], ...] = ()
    source_bytes: int = 0  # bytes of the sources' tensors the tape's calls hold on to
    # the retained chunks computed straight into their destination (memory of a source:
    # an output written in place), with that destination's layout
    destinations: tuple[tuple[ChunkRef, tuple], ...] = ()
    source_storages: frozenset[int] = frozenset()  # the storages of the sources' tensors

    @classmethod
    def of(cls, graph: TaskGraph) -> Tape:
        """The tape kept with ``graph`` (KeyError before :func:`run_tape` lowered it)."""
        return graph.programs["tape"]

    @classmethod
    def lower(cls, graph: TaskGraph, stats: RunStats | None = None,
              destination: ChunkDestination | None = None) -> Tape:
        """Run ``graph`` once in the serial order and bind every task to the tensors of that
        run (its values are the tape's outputs; with ``stats``, each step's figures go into
        ``stats.steps``). A retained chunk whose ``destination`` is memory of a source (an
        output computed in place) is computed there and bound to it. ExecutionError when a
        task fails."""
        schedule = SerialSchedule.of(graph)
        values: list[Any] = [None] * schedule.slots
        sources: list[_Source] = []
        calls: list[Call] = []
        owners: list[Task] = []
        bound = generic = accumulate = views = nbytes = 0

        def add(task: Task, new: Sequence[Call]) -> None:
            calls.extend(new)
            owners.extend([task] * len(new))

        totals: dict[int, list[int]] = {}  # step -> [tasks, bytes in, bytes read]
        for slot, task in schedule.inline:
            values[slot] = task.kernel.run((), None)
            sources.append(_source(task, values[slot]))
            totals.setdefault(task.output.step, [0, 0, 0])[0] += 1
        storages = {_storage(v) for v in values if v is not None}
        sourced = {_storage(x.value) for x in sources}  # the sources' storages so far
        in_place: dict[ChunkRef, tuple] = {}  # a result computed into its destination: where
        for entry in schedule.tasks:
            task, kernel = entry.task, entry.task.kernel
            inputs = [values[i] for i in entry.inputs]
            total = totals.setdefault(task.output.step, [0, 0, 0])
            total[0] += 1
            total[1] += sum([x.nbytes for x in inputs])
            total[2] += entry.bytes_read
            started = time.perf_counter()
            try:
                if not entry.first:  # a further contribution, folded into the buffer
                    call = _accumulate(kernel, inputs, values[entry.output])
                    call()
                    add(task, (call,))
                    accumulate += 1
                    _timed(stats, task, started)
                    continue
                dest = _in_place_destination(destination, entry, sourced)
                if dest is not None:
                    value = first_contribution(kernel, inputs, dest)
                    if not _same_layout(value, dest):  # the kernel made its own: copied in
                        value = dest.copy_(value)
                else:
                    value = kernel.run(inputs, None)
            except TensorQLError:
                raise
            except Exception as err:
                raise task_failure(graph, task, err) from err
            if dest is not None:  # the caller's memory, written by a call each run
                in_place[task.output] = _layout(dest)
                add(task, (_generic(kernel, inputs, dest),))
                generic += 1
            elif not task.inputs and entry.completes:
                sources.append(_source(task, value))
                sourced.add(_storage(value))
            elif entry.completes and _aliases(value, inputs):
                views += 1  # a view of an input's buffer: valid as long as that is
            else:
                if _storage(value) in storages:  # not its own (a view of a source, of
                    value = value.clone()  # a chunk accumulated into): a buffer of its own
                nbytes += value.nbytes
                own = getattr(kernel, "bind", None)
                new = own(inputs, value) if own is not None else None
                if new is None:
                    add(task, (_generic(kernel, inputs, value),))
                    generic += 1
                else:
                    add(task, tuple(new))
                    bound += 1
            values[entry.output] = value
            storages.add(_storage(value))
            _timed(stats, task, started)
        outputs = tuple((entry.task.output, values[entry.output]) for entry in schedule.tasks
                        if entry.retained and entry.completes)
        if stats is not None:
            for step, (tasks, bytes_in, bytes_read) in totals.items():
                st = stats.steps.setdefault(step, StepStats())
                st.tasks, st.bytes_in, st.bytes_read = tasks, bytes_in, bytes_read
        counts = TapeCounts(len(calls), bound, generic, accumulate, views, len(sources))
        held = {_storage(x.value): x.value.untyped_storage().nbytes() for x in sources}
        return cls(tuple(calls), tuple(owners), tuple(sources), outputs, counts, nbytes,
                   tuple(task.output.step for task in owners),
                   tuple((step, *figures) for step, figures in totals.items()),
                   sum(held.values()), tuple(in_place.items()), frozenset(held))

    def current(self, destination: ChunkDestination | None = None) -> bool:
        """Whether every source still gives the tensor it gave when the tape was made
        (:meth:`sources_current`) and every result goes where the tape computes it
        (:meth:`destinations_current`)."""
        return self.destinations_current(destination) and self.sources_current()

    def destinations_current(self, destination: ChunkDestination | None) -> bool:
        """Whether each result the tape computes into its destination has that very
        destination again, and no other result's destination is now memory of a source
        (a result to be computed in place, which the tape would copy out instead)."""
        bound = dict(self.destinations)
        for ref, layout in self.destinations:
            dest = destination(ref) if destination is not None else None
            if dest is None or _layout(dest) != layout:
                return False
        if destination is not None:
            for ref, _ in self.outputs:
                if ref not in bound:
                    dest = destination(ref)
                    if dest is not None and _storage(dest) in self.source_storages:
                        return False
        return True

    def sources_current(self) -> bool:
        """Whether every source still gives the tensor it gave when the tape was made: a
        constant the same storage (its ``storage_key()``; written in place is fine), any
        other source (a store read, run again) the very tensor, or one of the same storage
        and layout."""
        for source in self.sources:
            kernel = source.task.kernel
            if source.key is not None:
                if kernel.storage_key() != source.key:
                    return False
                continue
            try:
                value = kernel.run((), None)
            except Exception:  # noqa: BLE001 - lowered again, where it fails with its task named
                return False
            if value is not source.value and not _same_layout(value, source.value):
                return False
        return True

    def replay(self, stats: RunStats | None = None) -> None:
        """Run every call once, in order (the sources as they are now); with ``stats``, each
        step's figures (as the serial strategy records them, its time from its calls) go
        into ``stats.steps``."""
        k = 0
        perf = time.perf_counter
        marks = [0.0] * (len(self.calls) + 1)
        marks[0] = perf()
        try:
            for k, call in enumerate(self.calls):  # noqa: B007 (k names a failure)
                call()
                marks[k + 1] = perf()
        except TensorQLError:
            raise
        except Exception as err:
            task = self.owners[k]
            raise ExecutionError(f"tape call {k} of {len(self.calls)} (task {task.id}, step "
                                 f"{task.output.step}, chunk {task.output.key}) failed: "
                                 f"{type(err).__name__}: {err}") from err
        if stats is not None:
            self.record(stats, marks)

    def record(self, stats: RunStats, marks: Sequence[float]) -> None:
        """Each step's figures from the times ``marks`` of a replay (call k ran from
        ``marks[k]`` to ``marks[k + 1]``); a step of no call (sources, views) took none."""
        steps = stats.steps
        for step, tasks, bytes_in, bytes_read in self.step_totals:
            steps[step] = StepStats(tasks=tasks, bytes_in=bytes_in, bytes_read=bytes_read,
                                    first_start=marks[0], last_end=marks[0])
        for k, step in enumerate(self.call_steps):
            st = steps[step]
            if st.busy_s == 0.0:
                st.first_start = marks[k]
            st.busy_s += marks[k + 1] - marks[k]
            st.last_end = marks[k + 1]


def _timed(stats: RunStats | None, task: Task, started: float) -> None:
    """Count the time since ``started`` to ``task``'s step (a lowering run's figures)."""
    if stats is None:
        return
    ended = time.perf_counter()
    st = stats.steps.setdefault(task.output.step, StepStats(first_start=started))
    st.busy_s += ended - started
    st.first_start = min(st.first_start, started)
    st.last_end = ended


def _source(task: Task, value: torch.Tensor) -> _Source:
    key_of = getattr(task.kernel, "storage_key", None)
    return _Source(task, key_of() if key_of is not None else None, value)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _aliases(value: torch.Tensor, inputs: Sequence[torch.Tensor]) -> bool:
    """Whether ``value`` shares memory with one of ``inputs`` (a view of it)."""
    ptr = _storage(value)
    return any(_storage(x) == ptr for x in inputs)


def _layout(t: torch.Tensor) -> tuple:
    """Where ``t``'s elements are: its address, shape, strides and dtype."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _in_place_destination(destination: ChunkDestination | None, entry: SerialTask,
                          sourced: set[int]) -> torch.Tensor | None:
    """The destination of ``entry``'s chunk when the tape computes it there: the chunk's
    first contribution, retained, its destination memory of one of the sources read so far
    (their storages ``sourced``: an output written over the constant it replaces, fixed
    memory, so the call may write it each run). None otherwise (the chunk gets a buffer of
    the tape's own, copied out to its destination after each run)."""
    if destination is None or not entry.first or not entry.retained:
        return None
    dest = destination(entry.task.output)
    return dest if dest is not None and _storage(dest) in sourced else None


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return _layout(a) == _layout(b)


def _generic(kernel: Any, inputs: list[torch.Tensor], out: torch.Tensor) -> Call:
    """The first contribution through the kernel's own entry points, into ``out``."""
    run_into = getattr(kernel, "run_into", None)
    if run_into is not None:
        def call() -> None:
            value = run_into(inputs, out)
            if value is not out:
                out.copy_(value)
        return call

    def copy() -> None:
        out.copy_(kernel.run(inputs, None))
    return copy


def _accumulate(kernel: Any, inputs: list[torch.Tensor], acc: torch.Tensor) -> Call:
    """A further contribution folded into ``acc`` (in place, as kernels fold; one that
    returns a new tensor instead is copied in)."""
    def call() -> None:
        value = kernel.run(inputs, acc)
        if value is not acc:
            acc.copy_(value)
    return call


def _estimated_bytes(graph: TaskGraph, sources: bool = False) -> int | None:
    """The bytes of the chunks ``graph``'s non-source tasks write (with ``sources``, those
    its sources give too), when the planner gave every size (None when it did not). A
    graph its owner replays (:data:`REPLAYED`) has its results computed in place, in the
    owner's memory: they are not counted."""
    sizes = graph.chunk_bytes
    written = {task.output for task in graph.tasks if task.inputs or sources}
    if graph.programs.get(REPLAYED):
        written = {ref for ref in written if ref.step not in graph.retain}
    if not all(ref in sizes for ref in written):
        return None
    return sum(sizes[ref] for ref in written)


def fits(graph: TaskGraph) -> bool:
    """Whether ``graph``'s tape would keep at most :data:`TAPE_MAX_BYTES` of buffers (its
    chunks' sizes as planned; a graph that does not give them is taken to fit). The engine
    runs a graph that does not in the serial strategy instead.

    >>> a = ChunkRef(0, ())
    >>> fits(TaskGraph(tasks=(Task(0, (a,), a, None),), chunk_bytes={a: TAPE_MAX_BYTES + 1}))
    False
    """
    if "tape" in graph.programs:
        return True
    estimate = graph.programs.get("tape-bytes")
    if estimate is None:
        estimate = graph.programs["tape-bytes"] = _estimated_bytes(graph) or 0
    return estimate <= TAPE_MAX_BYTES


def suits(graph: TaskGraph) -> bool:
    """Whether the engine's policy runs ``graph`` -- one it runs serially -- from its tape
    rather than in the serial strategy: a plan run again (its serial order is kept with it:
    the first run was serial), every kernel of it ``replayable`` (its call has no effect
    beyond its result, so replaying it into a kept buffer is the same run), its buffers
    within :data:`AUTO_TAPE_MAX_BYTES` and its sources within
    :data:`AUTO_TAPE_MAX_SOURCE_BYTES`, and its tape not found stale :data:`STALE_LIMIT`
    times (sources read afresh every run). A tensor network's warm call: 240 tasks of
    ~50 us, where the serial loop's Python is a fifth of the time. A graph its owner
    replays (:data:`REPLAYED`: an optimizer's step) needs only its buffers within
    :data:`TAPE_MAX_BYTES`, its results in place not counted.

    >>> from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph
    >>> class Pure:
    ...     replayable = True
    >>> g = TaskGraph(tasks=(Task(0, (), ChunkRef(0, ()), Pure()),),
    ...               chunk_bytes={ChunkRef(0, ()): 4})
    >>> suits(g)  # its first run: serial
    False
    >>> _ = SerialSchedule.of(g)  # what the serial run keeps with the graph
    >>> suits(g)
    True
    """
    programs = graph.programs
    if programs.get("tape-stale", 0) >= STALE_LIMIT:
        return False
    if "tape" in programs:
        return True
    if "serial-schedule" not in programs:
        return False
    chosen = programs.get("tape-auto")
    if chosen is None:
        written, read = _estimated_bytes(graph), _estimated_bytes(graph, sources=True)
        if programs.get(REPLAYED):  # its owner's: in-place writes and sources are its own
            chosen = written is not None and written <= TAPE_MAX_BYTES
        else:
            chosen = (written is not None and written <= AUTO_TAPE_MAX_BYTES
                      and read is not None and read - written <= AUTO_TAPE_MAX_SOURCE_BYTES
                      and all(getattr(task.kernel, "replayable", False)
                              for task in graph.tasks))
        programs["tape-auto"] = chosen
    return chosen


def run_tape(graph: TaskGraph, progress: ProgressCallback | None = None,
             sink: ChunkSink | None = None, keep_outputs: bool = True,
             threads: int | None = None,
             destination: ChunkDestination | None = None) -> RunResult:
    """The engine's ``tape`` strategy: ``graph``'s tape (lowered on the first run, and again
    when a source changed, see :meth:`Tape.current`) run once on this thread, with
    ``threads`` torch threads when given; arguments and result as
    :func:`tensorql.exec.engine.run` (``destination``: a result computed in place over a
    source is computed into it, see the module; the sink copies every other result out of
    its buffer, and ``outputs`` are copies), each step's figures in ``stats.steps`` as a
    serial run records them. For graphs that :func:`fits`. A tape's buffers serve one run
    at a time: a run of the same graph on another thread waits for them (the engine runs it
    serially meanwhile instead, :func:`run_tape_if_free`)."""
    result = run_tape_if_free(graph, progress, sink, keep_outputs, threads, wait=True,
                              destination=destination)
    assert result is not None  # waited for the tape
    return result


def run_tape_if_free(graph: TaskGraph, progress: ProgressCallback | None = None,
                     sink: ChunkSink | None = None, keep_outputs: bool = True,
                     threads: int | None = None, wait: bool = False,
                     destination: ChunkDestination | None = None) -> RunResult | None:
    """:func:`run_tape`, or None -- nothing run -- when another thread's run holds the
    tape's buffers now (unless ``wait``: then it waits for them). The engine then runs the
    graph serially."""
    lock = graph.programs.setdefault("tape-lock", threading.Lock())
    if not lock.acquire(blocking=wait):  # its buffers are another thread's run's now
        return None
    try:
        return _run_tape(graph, progress, sink, keep_outputs, threads, destination)
    finally:
        lock.release()


def _run_tape(graph: TaskGraph, progress: ProgressCallback | None, sink: ChunkSink | None,
              keep_outputs: bool, threads: int | None,
              destination: ChunkDestination | None = None) -> RunResult:
    tape = graph.programs.get("tape")
    stats = RunStats(tasks=len(graph.tasks), serial=True)
    previous = torch.get_num_threads()
    if threads is not None and threads != previous:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    try:
        placed = tape is not None and tape.destinations_current(destination)
        if placed and tape.sources_current():
            tape.replay(stats)
        else:
            if placed:  # a source read afresh (results sent elsewhere are the caller's
                # choice, an EXPLAIN ANALYZE into fresh buffers between training steps)
                graph.programs["tape-stale"] = graph.programs.get("tape-stale", 0) + 1
            tape = graph.programs["tape"] = Tape.lower(graph, stats, destination)
            if graph.programs.get("tape-auto"):
                _keep_within_budget(graph, tape.nbytes + tape.source_bytes)
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)
    stats.peak_live_bytes = tape.nbytes
    outputs: dict[ChunkRef, torch.Tensor] = {}
    # a caller that asked for the tape reads each result from its buffer before the next
    # run; one the policy chose it for may not (a streamed store's writer thread still
    # encoding a chunk when another thread's run of the plan writes the buffer): a copy.
    # A result computed into its destination is the caller's own memory: never copied.
    private = bool(graph.programs.get("tape-auto"))
    in_place = {ref for ref, _ in tape.destinations}
    for ref, value in tape.outputs:
        own = ref in in_place
        copy = value.clone() if not own and (private or keep_outputs) else value
        if sink is not None:
            sink(ref, copy if private and not own else value)
        if keep_outputs:
            outputs[ref] = copy
    stats.wall_s = time.perf_counter() - start
    stats.rebase(start)
    if progress is not None:
        progress(len(graph.tasks), len(graph.tasks))
    return RunResult(outputs=outputs, stats=stats)


# the tapes the policy chose (:func:`suits`), oldest first: id(graph) -> (graph, bytes)
_AUTO_TAPES: OrderedDict[int, tuple[weakref.ref, int]] = OrderedDict()
_AUTO_TAPES_LOCK = threading.Lock()


def _keep_within_budget(graph: TaskGraph, nbytes: int) -> None:
    """Count ``graph``'s new tape (``nbytes``: its buffers and the sources its calls hold)
    against :data:`AUTO_TAPES_TOTAL_BYTES`, dropping the
    oldest other tapes the policy chose (their graphs lower them again when run again)."""
    with _AUTO_TAPES_LOCK:
        _AUTO_TAPES.pop(id(graph), None)
        _AUTO_TAPES[id(graph)] = (weakref.ref(graph), nbytes)
        total = 0
        for key, (ref, size) in reversed(list(_AUTO_TAPES.items())):
            kept = ref()
            if kept is None or "tape" not in kept.programs:
                del _AUTO_TAPES[key]
            elif total + size > AUTO_TAPES_TOTAL_BYTES and kept is not graph:
                kept.programs.pop("tape", None)
                del _AUTO_TAPES[key]
            else:
                total += size
