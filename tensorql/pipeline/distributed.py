"""The distributed driver: one rank's part of a query in a torch.distributed job."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensorql.exec.distributed import (
    DistributedRuntime,
    check_same_plan,
    exchange_group,
    gather_rank_stats,
    join_process_group,
    share_results,
)
from tensorql.exec.run_types import ProgressCallback
from tensorql.options import Options
from tensorql.physical.explain import render_plan
from tensorql.physical.result import QueryResult
from tensorql.pipeline.results import DenseResults

if TYPE_CHECKING:
    from tensorql.pipeline.compile import CompiledQuery


def job_devices(options: Options) -> int:
    """How many devices a query is planned for: the session's, times the ranks of the
    torch.distributed job when the session is one rank of it."""
    local = options.device_set.count
    if not options.distributed:
        return local
    return join_process_group(local, options.distributed_timeout_s).devices


def run_distributed(query: CompiledQuery, progress: ProgressCallback | None,
                     rank_stats: bool = False) -> QueryResult:
    """One rank's part of the query: check every rank has the same plan, run this rank's
    tasks (transfers through torch.distributed); the result chunks are all-gathered (each
    rank sends those it computed to every other), so each rank returns the dense result."""
    import hashlib

    options = query.db.options
    layout = join_process_group(options.device_set.count,
                                options.distributed_timeout_s)
    graph = query.physical.task_graph()
    checked = ("plan checked across ranks", layout)
    if checked not in graph.programs:  # once per plan and job: the plan does not change
        text = render_plan(query.physical, None) + (query.partition.explain()
                                                    if query.partition else "") + \
            f"exchange={options.distributed_exchange}"
        check_same_plan(hashlib.sha256(text.encode()).hexdigest(), layout)
        graph.programs[checked] = True
    runtime = DistributedRuntime(layout, options.device_set, options.memory_limit,
                                 workers=options.workers,
                                 intra_op_threads=options.intra_op_threads,
                                 exchange=options.distributed_exchange,
                                 exchange_group=exchange_group(layout))
    result = runtime.run(graph, progress=progress)
    step = query.physical.result_step
    rel = step.relation
    dense = DenseResults([step])
    out = dense.tensors[0]
    shared = share_results(graph, result.outputs, layout, dense.destination)
    if rank_stats:  # EXPLAIN ANALYZE, run by every rank alike: each rank's figures
        result.stats.ranks = gather_rank_stats(
            result.stats, layout, runtime.sent_bytes, runtime.received_bytes, shared,
            calls=tuple(runtime.bytes_by_call.values()))
    chunks = {key: out[rel.grid.slices(key)] for key in rel.grid.keys()}  # on every rank
    return QueryResult(plan=query.physical, chunks=chunks, stats=result.stats, assembled=out)
