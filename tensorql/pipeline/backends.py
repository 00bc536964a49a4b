"""Execution backends in a registry: ``native`` (the engine on the session's devices)
and ``duckdb`` (the plan as one SQL query inside DuckDB), each declaring what it supports
(:class:`Capabilities`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tensorql.dtypes import itemsize
from tensorql.einsum.graph import Node
from tensorql.errors import OptionError, UnsupportedError
from tensorql.exec.engine import EngineConfig, choose_strategy
from tensorql.exec.run_types import ProgressCallback
from tensorql.exec.timeline import write_trace
from tensorql.logical.lower import contraction_paths
from tensorql.physical.explain import render_plan
from tensorql.physical.result import QueryResult
from tensorql.pipeline.run import DenseResults, execute, result_chunks, session_spill

if TYPE_CHECKING:
    from tensorql.pipeline.compile import CompiledQuery


class UnknownBackendError(OptionError):
    """A backend name that is not in the registry."""


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports, declared once; the pipeline asks this instead of testing the
    backend's name.

    ``multi_output``: a group of expressions runs as one plan (a shared subgraph computed
    once); ``streaming``: result chunks reach a sink as they complete (else the whole result
    is computed, then handed over); ``partitioned``: on several devices the optimizer's
    partitioning is what runs (else the plan is one device's).

    >>> get_backend("duckdb").supports.streaming, get_backend("native").supports.streaming
    (False, True)
    """

    multi_output: bool = False
    streaming: bool = False
    partitioned: bool = False


class ExecutionBackend(Protocol):
    """Runs and explains a compiled query; ``supports`` says what else it can do."""

    supports: Capabilities

    def run(self, query: CompiledQuery, progress: ProgressCallback | None,
            dense: bool) -> QueryResult: ...

    def explain(self, query: CompiledQuery, analyze: bool,
                trace: str | None = None) -> tuple[str, QueryResult | None]:
        """The plan text; with ``analyze`` the query runs and its result comes back too
        (``trace``: a file to write the run's timeline to, as Chrome-trace JSON)."""
        ...


class NativeBackend:
    """The engine on the session's devices (:func:`tensorql.pipeline.run.execute`)."""

    supports = Capabilities(multi_output=True, streaming=True, partitioned=True)

    def run(self, query: CompiledQuery, progress: ProgressCallback | None,
            dense: bool, rank_stats: bool = False, timeline: bool = False) -> QueryResult:
        """Run the query; in a distributed session every rank's figures are gathered too
        when ``rank_stats`` (EXPLAIN ANALYZE: a collective every rank joins). ``timeline``
        records every op's start and end (``stats.timeline``)."""
        options = query.db.options
        writer = DenseResults([query.physical.result_step]) if dense else None
        result = execute(query.physical, options, values="return" if dense else None,
                         progress=progress, sink=writer.sink if writer else None,
                         destination=writer.destination if writer else None,
                         keep_outputs=not dense, partition=query.partition,
                         title=query.node.describe(), rank_stats=rank_stats,
                         timeline=timeline, spill=session_spill(query.db, options))
        return QueryResult(plan=query.physical, chunks=result_chunks(query.physical, result),
                           stats=result.stats,
                           assembled=writer.tensors[0] if writer else None,
                           computed=options.device_set.computes_values)

    def explain(self, query: CompiledQuery, analyze: bool,
                trace: str | None = None) -> tuple[str, QueryResult | None]:
        values = query.db.options.device_set.computes_values
        if trace is not None and query.db.options.distributed:
            raise UnsupportedError("a run's trace (explain(trace=...)) covers one process; "
                                   "run it outside torch.distributed")
        result = None
        if analyze:
            result = self.run(query, None, dense=values, rank_stats=True,
                              timeline=trace is not None)
            if trace is not None:
                write_trace(trace, result.stats, {s.id: s.name for s in query.physical.steps})
        else:
            check_memory_plan(query, dense=values)
        title = f"EXPLAIN{' ANALYZE' if analyze else ''} {query.title}"
        text = render_plan(query.physical, result.stats if result else None, title=title)
        if query.partition is not None:
            text += "\n" + query.partition.explain()
        return _with_paths(text, query.node), result


def check_memory_plan(query: CompiledQuery, dense: bool = True) -> None:
    """Raise the PlanError a run of ``query`` would raise when its memory plan is infeasible
    (a ``memory_limit`` too small for a task's chunks), so that EXPLAIN fails where the run
    fails. A local run the engine schedules with the memory plan (the streams strategy: a
    memory limit, several devices, a GPU) makes that plan here, as a ``dense`` run would
    (the runtime caches it on the task graph, so the run then reuses it); a run with nothing
    to budget, or a torch.distributed rank's, plans nothing here."""
    options = query.db.options
    if options.distributed:
        return
    physical = query.physical
    dense_bytes = (sum(math.prod(s.relation.shape) * itemsize(s.relation.dtype)
                       for s in physical.output_steps) if dense else 0)
    config = EngineConfig.of(options, spill=session_spill(query.db, options),
                             dense_bytes=dense_bytes)
    graph = physical.task_graph()
    if choose_strategy(graph, config) == "streams":
        config.build_runtime().plan(graph)


def _with_paths(text: str, node: Node) -> str:
    """``text`` followed by the contraction path of each n-ary einsum (opt_einsum-style)."""
    sections = [f"contraction of einsum {op.spec.equation}:\n{info.explain()}"
                for op, info in contraction_paths(node)]
    return "\n".join([text, *sections])


class DuckDBBackend:
    """Joins and GROUP BY inside DuckDB, chunk kernels as Arrow UDFs: one expression a
    query, the whole result at once, one device's plan."""

    supports = Capabilities()

    def run(self, query: CompiledQuery, progress: ProgressCallback | None,
            dense: bool) -> QueryResult:
        from tensorql.backend.duckdb_sql import run_compiled

        return run_compiled(query, dense=dense)

    def explain(self, query: CompiledQuery, analyze: bool,
                trace: str | None = None) -> tuple[str, QueryResult | None]:
        from tensorql.backend.duckdb_sql import explain_compiled

        if trace is not None:
            raise UnsupportedError("a run's trace (explain(trace=...)) is recorded by the "
                                   "native backend's runtime; the duckdb backend runs the "
                                   "query inside DuckDB")
        text, dense = explain_compiled(query, analyze=analyze)
        result = None
        if dense is not None:
            result = QueryResult(plan=query.physical, chunks={}, stats=None,  # type: ignore
                                 assembled=dense)
        return text, result


BACKENDS: dict[str, ExecutionBackend] = {"native": NativeBackend(), "duckdb": DuckDBBackend()}


def get_backend(name: str) -> ExecutionBackend:
    """The registered backend ``name``; UnknownBackendError lists the valid names."""
    try:
        return BACKENDS[name]
    except (KeyError, TypeError):
        raise UnknownBackendError(
            f"unknown backend {name!r}; choose one of {', '.join(sorted(BACKENDS))}") from None


def register_backend(name: str, backend: ExecutionBackend) -> None:
    """Add an execution backend under ``name`` (replacing one of that name)."""
    BACKENDS[name] = backend
