"""EXPLAIN's stages: the text of each stage of a compiled query, by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tensorql.einsum.graph import explain_graph
from tensorql.errors import OptionError
from tensorql.exec.engine import EngineConfig
from tensorql.logical.plan import explain_logical
from tensorql.physical.explain import render_plan

if TYPE_CHECKING:
    from tensorql.pipeline.compile import CompiledQuery


class UnknownStageError(OptionError):
    """An EXPLAIN stage name that does not exist."""


def _explain_partition(query: CompiledQuery) -> str:
    if query.partition is None:
        return (f"partitioning: one device ({', '.join(query.db.options.device_set.names)})"
                ", nothing to partition")
    return query.partition.explain()


def _explain_memory(query: CompiledQuery) -> str:
    options = query.db.options
    program = EngineConfig.of(options).build_runtime().plan(query.physical.task_graph())
    kinds: dict[str, int] = {}
    for op in program.ops:
        kinds[op.kind] = kinds.get(op.kind, 0) + 1
    counts = ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items()))
    return f"{program.explain()}\nops: {counts}"


STAGES: dict[str, Callable[[CompiledQuery], str]] = {
    "einsum": lambda q: explain_graph(q.node),
    "logical": lambda q: explain_logical(q.physical.root),  # after the rewrite rules
    "partition": _explain_partition,
    "physical": lambda q: render_plan(q.physical, None, title=f"EXPLAIN {q.title}"),
    "memory": _explain_memory,
}
