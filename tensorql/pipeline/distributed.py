"""The distributed driver: one rank's part of a query in a torch.distributed job."""

from __future__ import annotations

from typing import Any

from tensorql.exec import engine  # RankJob: the rank strategy's job
from tensorql.exec.distributed import (
    check_same_plan,
    communication_device,
    exchange_group,
    gather_rank_stats,
    job_topology,
    join_process_group,
    share_results,
)
from tensorql.exec.run_types import ChunkDestination, ChunkSink, RunResult
from tensorql.exec.taskgraph import ChunkRef
from tensorql.optimizer.plan import PartitionPlan
from tensorql.options import Options
from tensorql.physical.explain import render_plan
from tensorql.physical.planner import PhysicalPlan


def job_devices(options: Options) -> int:
    """How many devices a query is planned for: the session's, times the ranks of the
    torch.distributed job when the session is one rank of it."""
    local = options.device_set.count
    if not options.distributed:
        return local
    return join_process_group(local, options.distributed_timeout_s, options.device_set).devices


def planning_topology(options: Options) -> Any:
    """The topology a query is planned for: ``Options.topology`` when given; in a
    torch.distributed job otherwise the job's (its ranks on one host form a node, at the
    figures of the "cpu-gloo" machine or, on GPUs, of the default machine); else None (one
    node)."""
    if options.topology is not None or not options.distributed:
        return options.topology
    layout = join_process_group(options.device_set.count, options.distributed_timeout_s,
                                options.device_set)
    return job_topology(layout, "dgx-a100" if options.device_set.uses_cuda else "cpu-gloo")


def rank_job(physical: PhysicalPlan, partition: PartitionPlan | None,
             options: Options) -> engine.RankJob:
    """This process's rank of the job, once every rank is checked to have the same plan (a
    mismatch would pair transfers wrongly and hang)."""
    import hashlib

    layout = join_process_group(options.device_set.count, options.distributed_timeout_s,
                                options.device_set)
    graph = physical.task_graph()
    device = communication_device(options.device_set)
    checked = ("plan checked across ranks", layout)
    if checked not in graph.programs:  # once per plan and job: the plan does not change
        # the kind of device the ranks' buffers are on too: NCCL on one, gloo on another
        # would never pair up
        text = render_plan(physical, None) + (partition.explain() if partition else "") + \
            f"exchange={options.distributed_exchange} buffers={device.type}"
        check_same_plan(hashlib.sha256(text.encode()).hexdigest(), layout)
        graph.programs[checked] = True
    return engine.RankJob(layout, options.distributed_exchange, exchange_group(layout), device)


def share_rank_results(physical: PhysicalPlan, result: RunResult, job: engine.RankJob,
                       sink: ChunkSink | None, destination: ChunkDestination,
                       keep_outputs: bool = True, rank_stats: bool = False) -> RunResult:
    """After a rank's part of a run: the result chunks all-gathered (each rank sends those
    it computed to every other) into ``destination`` (a tile of each result's dense tensor),
    handed to ``sink`` and, with ``keep_outputs``, returned, so each rank has the whole
    result; with ``rank_stats`` every rank's figures are gathered too."""
    graph = physical.task_graph()
    stats: Any = result.stats
    shared = share_results(graph, result.outputs, job.layout, destination, device=job.device)
    if rank_stats:  # EXPLAIN ANALYZE, run by every rank alike: each rank's figures
        stats.ranks = gather_rank_stats(stats, job.layout, stats.sent_bytes,
                                        stats.received_bytes, shared, calls=stats.calls)
    outputs = {}
    for step in physical.output_steps:  # on every rank
        for key in step.relation.grid.keys():
            ref = ChunkRef(step.id, key)
            chunk = destination(ref)
            if sink is not None:
                sink(ref, chunk)
            if keep_outputs:
                outputs[ref] = chunk
    return RunResult(outputs=outputs, stats=result.stats)
