"""Compile a lazy expression (einsum graph → logical plan → physical plan) and run it.

>>> import torch, tensorql as tq
>>> db = tq.connect()
>>> a = db.from_torch("a", torch.ones(3, 4), tile=(2, 2))
>>> q = CompiledQuery.compile(tq.einsum("ij->i", a).node, db)
>>> q.run().dense().tolist()
[4.0, 4.0, 4.0]
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tensorql.dtypes import torch_dtype
from tensorql.einsum.graph import Node
from tensorql.exec.executor import ProgressCallback, RunStats
from tensorql.exec.runtime import executor_for
from tensorql.grid import Key
from tensorql.logical.lower import lower
from tensorql.logical.plan import LogicalNode
from tensorql.physical.explain import render_plan
from tensorql.physical.planner import PhysicalPlan

if TYPE_CHECKING:
    from tensorql.api.database import Database


@dataclass(frozen=True)
class QueryResult:
    """The chunks of a computed tensor and the measured run."""

    plan: PhysicalPlan
    chunks: dict[Key, torch.Tensor]
    stats: RunStats

    def dense(self) -> torch.Tensor:
        rel = self.plan.result_step.node.relation
        out = torch.empty(rel.shape, dtype=torch_dtype(rel.dtype))
        for key, chunk in self.chunks.items():
            out[rel.grid.slices(key)] = chunk
        return out

    def iter_chunks(self) -> Iterator[tuple[Key, torch.Tensor]]:
        rel = self.plan.result_step.node.relation
        for key in rel.grid.keys():
            yield key, self.chunks[key]


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

    def run(self, progress: ProgressCallback | None = None) -> QueryResult:
        options = self.db.options
        executor = executor_for(options)  # the event-driven runtime for devices/memory_limit
        result = executor.run(self.physical.task_graph(), progress=progress)
        sid = self.physical.result_step.id
        chunks = {ref.key: value for ref, value in result.outputs.items() if ref.step == sid}
        return QueryResult(plan=self.physical, chunks=chunks, stats=result.stats)

    def explain(self, analyze: bool = False) -> str:
        title = f"EXPLAIN{' ANALYZE' if analyze else ''} {self.node.describe()} -> " \
                f"{'x'.join(map(str, self.node.shape)) or 'scalar'} {self.node.dtype}"
        stats = self.run().stats if analyze else None
        return render_plan(self.physical, stats, title=title)
