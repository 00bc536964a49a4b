"""The result of running a physical plan: its chunks and the measured run.

>>> import torch, tensorql as tq
>>> db = tq.connect()
>>> a = db.from_torch("a", torch.ones(3, 4), tile=(2, 2))
>>> result = tq.einsum("ij->i", a).compile().run()
>>> sorted(result.chunks), result.dense().tolist()
([(0,), (1,)], [4.0, 4.0, 4.0])
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tensorql.dtypes import torch_dtype
from tensorql.errors import ExecutionError
from tensorql.exec.host_malloc import empty_result
from tensorql.exec.run_types import RunStats
from tensorql.grid import ChunkGrid, Key
from tensorql.physical.planner import PhysicalPlan


def assemble(grid: ChunkGrid, dtype: str, chunks: dict[Key, torch.Tensor]) -> torch.Tensor:
    """One dense tensor of ``grid``'s shape from its chunks by key."""
    out = empty_result(grid.shape, torch_dtype(dtype))
    for key, chunk in chunks.items():
        out[grid.slices(key)] = chunk
    return out


@dataclass(frozen=True)
class QueryResult:
    """The chunks of a computed tensor and the measured run."""

    plan: PhysicalPlan
    chunks: dict[Key, torch.Tensor]
    stats: RunStats
    assembled: torch.Tensor | None = None
    computed: bool = True  # False after a run on null devices: there are no values

    def _check_computed(self) -> None:
        if not self.computed:
            raise ExecutionError("this run was on null devices, which compute no values; "
                                 "there is no result to read")

    def dense(self) -> torch.Tensor:
        """The whole result as one tensor (assembled during the run when it was asked for)."""
        self._check_computed()
        if self.assembled is not None:
            return self.assembled
        rel = self.plan.result_step.relation
        return assemble(rel.grid, rel.dtype, self.chunks)

    def iter_chunks(self) -> Iterator[tuple[Key, torch.Tensor]]:
        self._check_computed()
        rel = self.plan.result_step.relation
        for key in rel.grid.keys():
            yield key, self.chunks[key]
