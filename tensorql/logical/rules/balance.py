"""Rule ``balance_lanes``: a large matrix product whose output chunks do not divide evenly
among a device's worker lanes has its row label cut finer, so that they do.

Why: on one CPU device each output chunk of a product is one task (its contributions folded
in series), and a worker lane runs one task at a time on one core. A 3072^3 product on the
automatic 1024 tiles is 9 tasks: two lanes run 5 and 4, and the last round leaves one core
idle -- the makespan is 5 tasks where the work is 4.5 (11 % over the floor; measured on a
2-core Xeon: 403 ms against torch's two-thread ``mm`` at 363). Cut the left operand's row
tile in two and the product is 18 tasks, 9 a lane. A cut tile of a stored (or constant)
operand is a view of its chunk (a row band of a row-major chunk is contiguous): no bytes are
copied, and every output element is the same sum of the same products in the same order as
before, so the result is unchanged bit for bit.

It fires on a result of the plan (its tiles are nobody else's) that is an ``Aggregate sum``
over a two-input ``Join mul`` whose left input is a scan (stored or constant), when

* the output's chunk count ``n`` leaves ``ceil(n / lanes) * lanes / n - 1`` above
  :data:`IMBALANCE` (a round of the lanes short of work at the end),
* the left operand has a row label (an output label the right operand lacks) whose tile
  cuts into ``f = lanes / gcd(n, lanes)`` equal parts of at least :data:`MIN_ROWS` rows,
* each task of the cut plan still does :data:`MIN_TASK_FLOPS` or more (small products keep
  their tiles: there per-task overhead, not balance, is what counts).

>>> from tensorql.grid import ChunkGrid
>>> from tensorql.logical.plan import Scan, TensorRelation, explain_logical
>>> def rel(labels, shape, tile):
...     return TensorRelation(labels, ChunkGrid(shape, tile), "float32")
>>> a = Scan(rel(("d0", "d1"), (3072, 3072), (1024, 1024)), "A")
>>> b = Scan(rel(("d0", "d1"), (3072, 3072), (1024, 1024)), "B")
>>> prod = Join(rel(("i", "j", "k"), (3072,) * 3, (1024,) * 3), sources=(a, b),
...             input_labels=(("i", "j"), ("j", "k")), join="mul")
>>> top = Aggregate(rel(("i", "k"), (3072, 3072), (1024, 1024)), input=prod, over=("j",))
>>> print(explain_logical(balance_lanes(2)(top)))
Aggregate sum over [j]  (i,k) 3072x3072 float32 grid 6x3 of 512x1024
└─ Join mul on [j] (i,j),(j,k)  (i,j,k) 3072x3072x3072 float32 grid 6x3x3 of 512x1024x1024
   ├─ Scan A  (d0,d1) 3072x3072 float32 grid 6x3 of 512x1024
   └─ Scan B  (d0,d1) 3072x3072 float32 grid 3x3 of 1024x1024
>>> balance_lanes(3)(top) is top  # 9 chunks: 3 a lane already
True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from tensorql.algebra import AggName, JoinName
from tensorql.grid import ChunkGrid
from tensorql.logical.plan import Aggregate, Join, LogicalNode, Scan, TensorRelation
from tensorql.logical.rules.common import rebuild, results_of

NAME = "balance_lanes"
# the share of a round of the lanes that may go idle at the end before the rule cuts
IMBALANCE = 0.05
# the fewest rows a cut tile keeps (a packed weight's product wants 16 rows or more)
MIN_ROWS = 16
# the least work (multiply-adds counted as two) a task of the cut plan does: ~1 ms on a core
MIN_TASK_FLOPS = 1 << 27


def balance_lanes(lanes: int) -> Callable[[LogicalNode], LogicalNode]:
    """The rule cutting the row tiles of large products for ``lanes`` worker lanes (see the
    module doc); with one lane it never fires."""

    def rule(root: LogicalNode) -> LogicalNode:
        if lanes <= 1:
            return root
        made = {}
        dropped: set[int] = set()
        for node in results_of(root):
            plan = _cut(node, lanes)
            if plan is not None:
                made[id(node)] = plan
                dropped.add(id(node.input))
        return rebuild(root, made, frozenset(dropped)) if made else root

    rule.__name__ = NAME
    return rule


def _cut(node: LogicalNode, lanes: int):
    """The maker of ``node`` with its row tile cut, or None when the rule does not apply."""
    if not (isinstance(node, Aggregate) and node.agg == AggName.SUM and node.over):
        return None
    prod = node.input
    if not (isinstance(prod, Join) and prod.join == JoinName.MUL and len(prod.sources) == 2):
        return None
    left, right = prod.sources
    if not isinstance(left, Scan) or left is right:
        return None
    n = node.relation.grid.num_chunks
    rounds = -(-n // lanes)
    if n == 0 or rounds * lanes / n - 1 <= IMBALANCE:
        return None
    parts = lanes // math.gcd(n, lanes)
    left_labels, right_labels = prod.input_labels
    out_labels = node.relation.labels
    for dim, label in enumerate(left_labels):
        if label not in out_labels or label in right_labels or left_labels.count(label) > 1:
            continue
        tile = left.relation.grid.tile[dim]
        if tile % parts or tile // parts < MIN_ROWS:
            continue
        flops = 2 * math.prod(prod.relation.shape)
        if flops // (n * parts) < MIN_TASK_FLOPS:
            return None
        return _maker(node, prod, left, label, dim, tile // parts)
    return None


def _retiled(rel: TensorRelation, label: str, tile: int) -> TensorRelation:
    grid = rel.grid
    tiles = tuple(tile if lab == label else t for lab, t in zip(rel.labels, grid.tile))
    return TensorRelation(rel.labels, ChunkGrid(grid.shape, tiles), rel.dtype)


def _maker(node: Aggregate, prod: Join, left: Scan, label: str, dim: int, tile: int):
    """The function making the product with ``label`` (dim ``dim`` of the scan ``left``) on
    tiles of ``tile``: the scan reads row bands of its chunks, as a region scan does."""
    grid = left.relation.grid
    tiles = tuple(tile if d == dim else t for d, t in enumerate(grid.tile))
    relation = TensorRelation(left.relation.labels, ChunkGrid(grid.shape, tiles),
                              left.relation.dtype)
    if left.constant is not None:  # a constant's chunks are views taken at run time
        scan = dataclasses.replace(left, relation=relation)
    else:  # a stored tensor read by regions of its own grid
        scan = dataclasses.replace(left, relation=relation,
                                   offset=left.offset or (0,) * grid.ndim,
                                   stored_grid=left.stored_grid or grid)

    def make(memo: dict[int, LogicalNode]) -> LogicalNode:
        right = memo[id(prod.sources[1])]
        join = Join(_retiled(prod.relation, label, tile), sources=(scan, right),
                    input_labels=prod.input_labels, join=JoinName.MUL)
        return Aggregate(_retiled(node.relation, label, tile), input=join, over=node.over,
                         agg=AggName.SUM)

    return make


__all__ = ["IMBALANCE", "MIN_ROWS", "MIN_TASK_FLOPS", "NAME", "balance_lanes"]
