"""The physical plan of a partitioned query: every task on the device the optimizer chose.

:func:`build_partitioned` (the one builder's entry for a partition plan,
:func:`tensorql.physical.builder.build`) turns a
:class:`~tensorql.optimizer.plan.PartitionPlan` into a
:class:`~tensorql.physical.planner.PhysicalPlan` whose tasks carry ``device``. A partitioned
operation's chunks are its pieces (the cost model cuts pieces like a chunk grid), one task per
piece combination, placed by the plan's layout. Data moves between devices only through the
runtime's copies, and only the bytes the cost model predicts:

* a task reading a producer's piece held by another device gets it sent whole (once per
  device) when it needs all of it;
* when it needs part of a remote piece, a **slice** task on the producer's device cuts that
  part first, and only the slice is sent; an **assemble** task on the reader's device puts the
  region together from local pieces and received slices (a repartition is thus slice +
  all-to-all + concatenate, never a regather onto one owner);
* a device holding **partial aggregates** of an output piece it does not own folds them
  locally, and a **reduce** task on the owner folds in the one partial it receives; in a
  **reduce-scatter** (``Layout.scatter``) every contributor owns a part of the piece: it cuts
  the parts it does not own out of its partial and sends each to its owner, and folds the
  ones it receives into its own part;
* stored pieces are read by the device that holds them (each reads only its own chunks);
  where every device can load the inputs itself (``OpNode.loaded_where_read``: the ranks of
  a torch.distributed job), a stored tensor or constant is never sent: each device loads the
  regions its tasks read, once each, and its pieces as such only when it is a result.

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
