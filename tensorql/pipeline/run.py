"""Running a plan: the one place the pipeline calls the engine (:func:`execute`), and the
dense results a run computes its result chunks straight into (:class:`DenseResults`, after
:func:`check_dense_fits` says they fit in the process's memory).

Every run of a compiled query or group -- a dense result, a stream of result chunks into a
store, EXPLAIN ANALYZE -- comes here, so the checks a run needs are made once: null devices
compute no values, a progress bar when the session asks for one, and a rank of a
torch.distributed job (its part, then every result chunk on every rank) rather than a local
run.

>>> import torch, tensorql as tq
>>> db = tq.connect()
>>> q = tq.einsum("ij->i", db.constant(torch.ones(3, 4))).compile()
>>> writer = DenseResults([q.physical.result_step])
>>> _ = execute(q.physical, db.options, sink=writer.sink, destination=writer.destination)
>>> writer.tensors[0].tolist()
[4.0, 4.0, 4.0]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from tensorql.dtypes import itemsize, torch_dtype
from tensorql.errors import ExecutionError, MemoryLimitError, ShapeError
from tensorql.exec import engine
from tensorql.exec.host_malloc import empty_result
from tensorql.exec.progress import progress_bar
from tensorql.exec.run_types import ChunkDestination, ChunkSink, ProgressCallback, RunResult
from tensorql.optimizer.plan import PartitionPlan
from tensorql.options import Options, available_memory_bytes
from tensorql.physical.planner import PhysicalPlan
from tensorql.pipeline.distributed import rank_job, share_rank_results
from tensorql.units import format_bytes

__all__ = ["DenseResults", "check_dense_fits", "execute"]


def session_spill(db: Any, options: Options) -> Any:
    """The session's spill space (``db.spill_space``) when ``options`` set a ``memory_limit``,
    the only runs that keep a host tier and may spill below it; else None (nothing opened)."""
    return db.spill_space if options.memory_limit is not None else None


def execute(physical: PhysicalPlan, options: Options, *, values: str | None = "return",
            progress: ProgressCallback | None = None, sink: ChunkSink | None = None,
            destination: ChunkDestination | None = None, keep_outputs: bool = True,
            partition: PartitionPlan | None = None, title: str | None = None,
            rank_stats: bool = False, timeline: bool = False, spill: Any = None,
            strategy: str | None = None) -> RunResult:
    """Run ``physical``'s task graph on the session's devices through the engine.

    ``values`` says what the caller does with the values the run computes ("return",
    "stream"); on null devices, which compute none, that is an ExecutionError
    (``values=None``: the caller wants the schedule only). With ``title`` and
    ``Options.progress`` set, a progress bar is drawn unless a ``progress`` callback is
    given. ``sink``, ``destination`` and
    ``keep_outputs`` as :func:`tensorql.exec.engine.run`. In a distributed session the
    run is this rank's part (``partition`` and the plan are checked to be every rank's);
    each rank then holds every result chunk, and with ``rank_stats`` every rank's figures.
    ``timeline`` records every op's start and end in ``stats.timeline`` (one process).
    ``spill``: the session's :class:`~tensorql.storage.spill.SpillSpace` (``db.spill_space``):
    under a memory limit, host copies beyond :meth:`Options.host_tier_bytes` go to DuckDB.
    ``strategy`` names the engine's strategy for a local run (None: its policy's; "tape"
    for a plan run again and again, see :mod:`tensorql.exec.tape`).
    """
    if values is not None and not options.device_set.computes_values:
        raise ExecutionError(
            f"devices={options.devices!r}: null devices run the scheduler only and compute "
            f"no values, so there is no result to {values}; use explain(analyze=True) for "
            "the schedule, or devices='cpu' / N for values")
    if progress is None and options.progress and title is not None:
        with progress_bar(title) as bar:
            return execute(physical, options, values=values, progress=bar, sink=sink,
                           destination=destination, keep_outputs=keep_outputs,
                           partition=partition, rank_stats=rank_stats, timeline=timeline,
                           spill=spill)
    if not options.distributed:
        dense = (sum(math.prod(s.relation.shape) * itemsize(s.relation.dtype)
                     for s in physical.output_steps) if destination is not None else 0)
        config = engine.EngineConfig.of(options, timeline=timeline, spill=spill,
                                        dense_bytes=dense)
        with physical.pinned():  # one version of each stored tensor for the whole run
            return engine.run(physical.task_graph(), config, strategy=strategy,
                              progress=progress, sink=sink, destination=destination,
                              keep_outputs=keep_outputs)
    # every rank takes part (the rank strategy); each then gets the whole result
    job = rank_job(physical, partition, options)
    if destination is None:
        destination = DenseResults(physical.output_steps).destination
    with physical.pinned():  # the rank's own result chunks computed into their tiles
        result = engine.run(physical.task_graph(), engine.EngineConfig.of(options, rank=job),
                            progress=progress, destination=destination)
    return share_rank_results(physical, result, job, sink, destination, keep_outputs,
                              rank_stats)


def result_chunks(physical: PhysicalPlan, result: RunResult) -> dict[Any, Any]:
    """The chunks of ``physical``'s result step a run kept, by key."""
    sid = physical.result_step.id
    return {ref.key: value for ref, value in result.outputs.items() if ref.step == sid}


class DenseResults:
    """Fresh dense tensors for the results of ``steps`` that a run computes its result
    chunks straight into (``destination``), copying only a chunk a kernel returned apart
    (``sink``); a stored chunk never leaks out by reference. ``tensors``: one per step.

    >>> import torch, tensorql as tq
    >>> q = tq.einsum("ij->i", tq.connect().constant(torch.ones(3, 4))).compile()
    >>> writer = DenseResults([q.physical.result_step])
    >>> writer.tensors[0].shape
    torch.Size([3])
    """

    def __init__(self, steps: Sequence[Any],
                 given: Sequence[torch.Tensor | None] | None = None) -> None:
        self._outs: dict[int, tuple[Any, torch.Tensor]] = {}
        for k, step in enumerate(steps):
            rel = step.relation
            dtype = torch_dtype(rel.dtype)
            buffer = given[k] if given is not None and k < len(given) else None
            if buffer is not None and (tuple(buffer.shape) != tuple(rel.shape)
                                       or buffer.dtype != dtype or not buffer.is_contiguous()
                                       or buffer.device.type != "cpu"):
                raise ShapeError(f"output {k}: the buffer given to compute it into is "
                                 f"{tuple(buffer.shape)} {buffer.dtype}, the result "
                                 f"{tuple(rel.shape)} {dtype} (contiguous, on the CPU)")
            if buffer is None:
                buffer = empty_result(rel.shape, dtype)
            self._outs.setdefault(step.id, (rel, buffer))
        self.tensors = [self._outs[step.id][1] for step in steps]

    def destination(self, ref: Any) -> torch.Tensor | None:
        if ref.step not in self._outs:
            return None
        rel, out = self._outs[ref.step]
        return out[rel.grid.slices(ref.key)]

    def sink(self, ref: Any, chunk: torch.Tensor) -> None:
        tile = self.destination(ref)
        if chunk.data_ptr() != tile.data_ptr() or chunk.stride() != tile.stride():
            tile.copy_(chunk)


SMALL_RESULT_BYTES = 16 << 20  # below this a result is checked against the process figure only


PYTHON_ADVICE = ("store it with db.store(name, expr) and read it chunk by chunk "
                 "(db.iter_chunks), or compute a slice of it")


def check_dense_fits(relation: Any, options: Options, advice: str = PYTHON_ADVICE) -> None:
    """MemoryLimitError, before any allocation, when a dense result of ``relation`` (shape and
    dtype) is larger than :meth:`Options.dense_result_budget`; the error ends with
    ``advice`` (what to do instead, in the caller's terms: Python's by default, SQL's from
    the SQL face).

    >>> from tensorql.grid import ChunkGrid
    >>> from tensorql.logical.plan import TensorRelation
    >>> big = TensorRelation(("i", "j"), ChunkGrid((2**20, 2**20), (4096, 4096)), "float32")
    >>> check_dense_fits(big, Options())
    Traceback (most recent call last):
    ...
    tensorql.errors.MemoryLimitError: the result is 4.0 TiB (1048576x1048576 float32) ...
    """
    nbytes = math.prod(relation.shape) * itemsize(relation.dtype)
    if nbytes <= SMALL_RESULT_BYTES and nbytes <= options.dense_result_budget(system=False):
        return  # a small result: not worth reading /proc/meminfo on every run of a query
    budget = options.dense_result_budget()
    if nbytes > budget:
        shape = "x".join(map(str, relation.shape))
        raise MemoryLimitError(
            f"the result is {format_bytes(nbytes)} ({shape} {relation.dtype}) but this process "
            f"may hold {format_bytes(budget)} more (Options.process_memory_limit "
            f"{format_bytes(options.process_memory_bytes)}, less the chunk cache, DuckDB's "
            f"memory and device budgets; {format_bytes(available_memory_bytes())} available "
            f"on the system); {advice}")
