"""Compile a lazy expression (einsum graph → logical plan → physical plan) and run it.

>>> import torch, tensorql as tq
>>> db = tq.connect()
>>> a = db.from_torch("a", torch.ones(3, 4), tile=(2, 2))
>>> q = CompiledQuery.compile(tq.einsum("ij->i", a).node, db)
>>> q.run().dense().tolist()
[4.0, 4.0, 4.0]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tensorql.dtypes import torch_dtype
from tensorql.einsum.graph import Node
from tensorql.exec.executor import ProgressCallback
from tensorql.exec.progress import progress_bar
from tensorql.exec.runtime import executor_for
from tensorql.logical.lower import lower
from tensorql.logical.plan import LogicalNode
from tensorql.optimizer.plan import explain_partitioning
from tensorql.physical.explain import render_plan
from tensorql.physical.planner import PhysicalPlan
from tensorql.physical.result import QueryResult

if TYPE_CHECKING:
    from tensorql.api.database import Database


@dataclass(frozen=True)
class CompiledQuery:
    """A planned expression, ready to run or explain."""

    node: Node
    logical: LogicalNode
    physical: PhysicalPlan
    db: Database

    @classmethod
    def compile(cls, node: Node, db: Database) -> CompiledQuery:
        logical = lower(node)
        physical = PhysicalPlan.build(
            logical, db.chunk_store,
            max_temp_elems=max(1, db.options.kernel_temp_bytes // 4),
        )
        return cls(node=node, logical=logical, physical=physical, db=db)

    def run(self, progress: ProgressCallback | None = None, dense: bool = False) -> QueryResult:
        """Execute the plan; with ``dense=True`` worker threads copy each finished result chunk
        into one dense tensor while the rest of the plan still runs. With no ``progress`` callback
        and ``Options.progress`` set (``tensorql sql --progress``), a progress bar is drawn on
        stderr."""
        if progress is None and self.db.options.progress and self.db.options.backend != "duckdb":
            with progress_bar(self.node.describe()) as bar:
                return self.run(progress=bar, dense=dense)
        if self.db.options.backend == "duckdb":  # joins and GROUP BY inside DuckDB
            from tensorql.backend.duckdb_sql import run_compiled

            return run_compiled(self)
        options = self.db.options
        executor = executor_for(options)  # the event-driven runtime for devices/memory_limit
        rel = self.physical.result_step.node.relation
        sid = self.physical.result_step.id
        out = sink = destination = None
        if dense:  # always a fresh tensor: a stored chunk must never leak out by reference
            out = torch.empty(rel.shape, dtype=torch_dtype(rel.dtype))

            def destination(ref):  # result tiles are computed straight into ``out``
                return out[rel.grid.slices(ref.key)] if ref.step == sid else None

            def sink(ref, chunk):
                tile = out[rel.grid.slices(ref.key)]
                if chunk.data_ptr() != tile.data_ptr() or chunk.stride() != tile.stride():
                    tile.copy_(chunk)

        result = executor.run(self.physical.task_graph(), progress=progress, sink=sink,
                              destination=destination)
        chunks = {ref.key: value for ref, value in result.outputs.items() if ref.step == sid}
        return QueryResult(plan=self.physical, chunks=chunks, stats=result.stats, assembled=out)

    def explain(self, analyze: bool = False) -> str:
        if self.db.options.backend == "duckdb":
            from tensorql.backend.duckdb_sql import explain_compiled

            return explain_compiled(self, analyze=analyze)[0]
        title = f"EXPLAIN{' ANALYZE' if analyze else ''} {self.node.describe()} -> " \
                f"{'x'.join(map(str, self.node.shape)) or 'scalar'} {self.node.dtype}"
        stats = self.run().stats if analyze else None
        text = render_plan(self.physical, stats, title=title)
        section = explain_partitioning(self.node, self.db.options.devices)  # "" for 1 device
        return f"{text}\n{section}" if section else text
