"""Running a plan: the one place the pipeline calls the engine (:func:`execute`).

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

from typing import Any

from tensorql.errors import ExecutionError
from tensorql.exec import engine
from tensorql.exec.progress import progress_bar
from tensorql.exec.run_types import ChunkDestination, ChunkSink, ProgressCallback, RunResult
from tensorql.optimizer.plan import PartitionPlan
from tensorql.options import Options
from tensorql.physical.planner import PhysicalPlan
from tensorql.pipeline.distributed import rank_job, share_rank_results
from tensorql.pipeline.results import DenseResults

__all__ = ["DenseResults", "execute"]


def execute(physical: PhysicalPlan, options: Options, *, values: str | None = "return",
            progress: ProgressCallback | None = None, sink: ChunkSink | None = None,
            destination: ChunkDestination | None = None, keep_outputs: bool = True,
            partition: PartitionPlan | None = None, title: str | None = None,
            rank_stats: bool = False) -> RunResult:
    """Run ``physical``'s task graph on the session's devices through the engine.

    ``values`` says what the caller does with the values the run computes ("return",
    "stream"); on null devices, which compute none, that is an ExecutionError
    (``values=None``: the caller wants the schedule only). With ``title`` and
    ``Options.progress`` set, a progress bar is drawn unless a ``progress`` callback is
    given. ``sink``, ``destination`` and
    ``keep_outputs`` as :func:`tensorql.exec.engine.run`. In a distributed session the
    run is this rank's part (``partition`` and the plan are checked to be every rank's);
    each rank then holds every result chunk, and with ``rank_stats`` every rank's figures.
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
                           partition=partition, rank_stats=rank_stats)
    if not options.distributed:
        return engine.run(physical.task_graph(), engine.EngineConfig.of(options),
                          progress=progress, sink=sink, destination=destination,
                          keep_outputs=keep_outputs)
    # every rank takes part (the rank strategy); each then gets the whole result
    job = rank_job(physical, partition, options)
    result = engine.run(physical.task_graph(), engine.EngineConfig.of(options, rank=job),
                        progress=progress)
    return share_rank_results(physical, result, job, sink, destination, keep_outputs,
                              rank_stats)


def result_chunks(physical: PhysicalPlan, result: RunResult) -> dict[Any, Any]:
    """The chunks of ``physical``'s result step a run kept, by key."""
    sid = physical.result_step.id
    return {ref.key: value for ref, value in result.outputs.items() if ref.step == sid}
