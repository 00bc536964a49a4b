"""The physical plan of a partitioned query: every task on the device the optimizer chose.

:func:`build_partitioned` (the one builder's entry for a partition plan,
:func:`tensorql.physical.builder.build`) turns a
:class:`~tensorql.optimizer.plan.PartitionPlan` into a
:class:`~tensorql.physical.planner.PhysicalPlan` whose tasks carry ``device``; what the
builder does with the pieces, transfers and partial aggregates is told in that module.

>>> import numpy as np, tensorql as tq
>>> from tensorql.optimizer import optimize
>>> db = tq.connect()
>>> x = db.from_numpy("x", np.arange(12.0).reshape(3, 4))
>>> plan = optimize(x @ x.T, devices=3)
>>> physical = build_partitioned(plan, db.chunk_store)
>>> sorted({t.device for s in physical.steps for t in s.tasks})
[0, 1, 2]
"""

from __future__ import annotations

from tensorql.optimizer.plan import PartitionPlan
from tensorql.physical.builder import build
from tensorql.physical.kernels import FoldPartial, LoadPiece, SliceChunk
from tensorql.physical.planner import PhysicalPlan
from tensorql.storage.chunk_store import ChunkStore


def build_partitioned(plan: PartitionPlan, store: ChunkStore | None,
                      max_temp_elems: int = 1 << 24, sub_tiles: bool = True,
                      fuse_bytes: int | None = None, min_tasks: int = 2,
                      fired: tuple[str, ...] = ()) -> PhysicalPlan:
    """The physical plan running ``plan`` on its devices (see the module docstring); with
    ``sub_tiles`` each piece is cut into the logical plan's tiles (same bytes moved).

    The contributions of one device to one output chunk (the tiles of a contracted label)
    run as one task (:class:`~tensorql.physical.kernels.ContractSeries`) while its inputs
    total at most ``fuse_bytes`` (None: no bound), keeping ``min_tasks`` tasks a device (see
    :class:`~tensorql.physical.builder.ContributionSeries`). ``fired``: the logical rewrite
    rules that made the plan partitioned (for EXPLAIN)."""
    return build(plan.graph.logical, plan, store, max_temp_elems=max_temp_elems,
                 sub_tiles=sub_tiles, fuse_bytes=fuse_bytes, min_tasks=min_tasks, fired=fired)


__all__ = ["FoldPartial", "LoadPiece", "SliceChunk", "build_partitioned"]
