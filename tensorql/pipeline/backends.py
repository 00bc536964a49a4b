"""Execution backends in a registry: ``native`` (the engine on the session's devices)
and ``duckdb`` (the plan as one SQL query inside DuckDB)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from tensorql.einsum.graph import Node
from tensorql.errors import ExecutionError, OptionError
from tensorql.exec.progress import progress_bar
from tensorql.exec.run_types import ProgressCallback
from tensorql.exec.runtime import executor_for
from tensorql.logical.lower import contraction_paths
from tensorql.physical.explain import render_plan
from tensorql.physical.result import QueryResult
from tensorql.pipeline.distributed import run_distributed
from tensorql.pipeline.results import DenseResults

if TYPE_CHECKING:
    from tensorql.pipeline.compile import CompiledQuery


class UnknownBackendError(OptionError):
    """A backend name that is not in the registry."""


class ExecutionBackend(Protocol):
    """Runs and explains a compiled query."""

    def run(self, query: CompiledQuery, progress: ProgressCallback | None,
            dense: bool) -> QueryResult: ...

    def explain(self, query: CompiledQuery, analyze: bool) -> tuple[str, QueryResult | None]:
        """The plan text; with ``analyze`` the query runs and its result comes back too."""
        ...



class NativeBackend:
    """The engine's own executor on the session's devices."""

    def run(self, query: CompiledQuery, progress: ProgressCallback | None,
            dense: bool, rank_stats: bool = False) -> QueryResult:
        """Run the query; in a distributed session every rank's figures are gathered too
        when ``rank_stats`` (EXPLAIN ANALYZE: a collective every rank joins)."""
        options = query.db.options
        if progress is None and options.progress:
            with progress_bar(query.node.describe()) as bar:
                return self.run(query, bar, dense, rank_stats)
        null = not options.device_set.computes_values
        if null and dense:
            raise ExecutionError(
                f"devices={options.devices!r}: null devices run the scheduler only and compute "
                "no values, so there is no result to return; use explain(analyze=True) for the "
                "schedule, or devices='cpu' / N for values")
        if options.distributed:
            return run_distributed(query, progress, rank_stats)
        executor = executor_for(options)
        sid = query.physical.result_step.id
        writer = DenseResults([query.physical.result_step]) if dense else None
        result = executor.run(query.physical.task_graph(), progress=progress,
                              sink=writer.sink if writer else None,
                              destination=writer.destination if writer else None,
                              keep_outputs=not dense)
        chunks = {ref.key: value for ref, value in result.outputs.items() if ref.step == sid}
        return QueryResult(plan=query.physical, chunks=chunks, stats=result.stats,
                           assembled=writer.tensors[0] if writer else None, computed=not null)

    def explain(self, query: CompiledQuery, analyze: bool) -> tuple[str, QueryResult | None]:
        null = not query.db.options.device_set.computes_values
        result = self.run(query, None, dense=not null, rank_stats=True) if analyze else None
        title = f"EXPLAIN{' ANALYZE' if analyze else ''} {query.title}"
        text = render_plan(query.physical, result.stats if result else None, title=title)
        if query.partition is not None:
            text += "\n" + query.partition.explain()
        return _with_paths(text, query.node), result


def _with_paths(text: str, node: Node) -> str:
    """``text`` followed by the contraction path of each n-ary einsum (opt_einsum-style)."""
    sections = [f"contraction of einsum {op.spec.equation}:\n{info.explain()}"
                for op, info in contraction_paths(node)]
    return "\n".join([text, *sections])


class DuckDBBackend:
    """Joins and GROUP BY inside DuckDB, chunk kernels as Arrow UDFs."""

    def run(self, query: CompiledQuery, progress: ProgressCallback | None,
            dense: bool) -> QueryResult:
        from tensorql.backend.duckdb_sql import run_compiled

        return run_compiled(query)

    def explain(self, query: CompiledQuery, analyze: bool) -> tuple[str, QueryResult | None]:
        from tensorql.backend.duckdb_sql import explain_compiled

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
