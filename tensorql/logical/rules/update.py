"""Rule ``contiguous_update``: an optimizer's update join (``adam``, ``adamw``: the new weight
and moments in one pass, :mod:`tensorql_kernels.optimizer_update`) is tiled in blocks of whole
rows, so that each chunk of the weight and of its moments is one contiguous run of memory.

Why: the update of a chunk is computed in place, in the storage of the weight and moments it
replaces (:mod:`tensorql.physical.in_place`), by torch's fused Adam kernel, which takes
contiguous tensors only. The update takes its tiles from its gradient, and a gradient whose
tiles cut a trailing dimension (an MLP's first weight, 784 x 2048: the product ``x.T @ dh``
comes out in column blocks of 784 x 1024) left every chunk a column block, updated row by row:
784 fused calls a chunk, ~8x the time of one call over the same elements (the MLP's training
step: 11 of its 98 ms of kernel time). In row blocks the weight, ``m`` and ``v`` are read in
place (a constant's chunks are views taken at run time: scanned in the new tiles, no copy) and
only the gradient is retiled, one copy of it (a ``Rekey``).

It fires on a ``Join`` whose join is an update, when a chunk of its weight is not contiguous
(:func:`contiguous`); the first dimension of the weight longer
than 1 is then cut into as many pieces as the update had chunks (at most its length, so the
workers still share the update out), every later dimension whole.

>>> import torch
>>> from tensorql.algebra import update_join
>>> from tensorql.grid import ChunkGrid
>>> from tensorql.logical.plan import Join, Scan, TensorRelation, explain_logical
>>> def rel(labels, shape, tile):
...     return TensorRelation(labels, ChunkGrid(shape, tile), "float32")
>>> g = Scan(rel(("a", "b"), (6, 8), (6, 4)), "g")  # a gradient in column blocks
>>> w, m, v = (Scan(rel(("a", "b"), (6, 8), (6, 4)), "<constant>", constant=torch.zeros(6, 8))
...            for _ in range(3))
>>> s = Scan(rel(("c",), (3,), (3,)), "<constant>", constant=torch.arange(3.0))
>>> lr, t = (Scan(TensorRelation((), ChunkGrid((), ()), "float32"), "<constant>",
...               constant=torch.tensor(1.0)) for _ in range(2))
>>> up = Join(rel(("c", "a", "b"), (3, 6, 8), (3, 6, 4)), sources=(g, w, m, v, s, lr, t),
...           input_labels=(("a", "b"),) * 4 + (("c",), (), ()),
...           join=update_join(False, 0.9, 0.999, 1e-8, 0.0))
>>> top, *operands = explain_logical(contiguous_update(up)).splitlines()
>>> top.split("  ")[-1]  # the update, in row blocks
'(c,a,b) 3x6x8 float32 grid 1x2x1 of 3x3x8'
>>> print(*operands, sep=chr(10))  # the gradient retiled, the constants scanned anew
├─ Rekey to tiles (3, 8)  (a,b) 6x8 float32 grid 2x1 of 3x8
│  └─ Scan g  (a,b) 6x8 float32 grid 1x2 of 6x4
├─ Scan <constant>  (a,b) 6x8 float32 grid 2x1 of 3x8
├─ Scan <constant>  (a,b) 6x8 float32 grid 2x1 of 3x8
├─ Scan <constant>  (a,b) 6x8 float32 grid 2x1 of 3x8
├─ Scan <constant>  (c) 3 float32 grid 1 of 3
├─ Scan <constant>  () scalar float32 grid 1 of -
└─ Scan <constant>  () scalar float32 grid 1 of -
>>> again = contiguous_update(contiguous_update(up))
>>> contiguous_update(again) is again  # row blocks already: no change
True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from tensorql.algebra import is_update
from tensorql.grid import ChunkGrid
from tensorql.logical.lower import retile
from tensorql.logical.plan import Join, LogicalNode, TensorRelation
from tensorql.logical.rules.common import rebuild_matching

NAME = "contiguous_update"


def contiguous_update(root: LogicalNode) -> LogicalNode:
    """``root`` with every update join whose weight chunks are not contiguous tiled in blocks
    of whole rows (see the module doc); ``root`` itself when there is none."""
    return rebuild_matching(root, _row_tile, _maker)


def contiguous(shape: Sequence[int], tile: Sequence[int]) -> bool:
    """Whether every chunk of a row-major tensor of ``shape`` cut in ``tile`` is one
    contiguous run of its memory: the dimensions after the last cut one are whole, and those
    before it are cut into single rows.

    >>> contiguous((784, 2048), (392, 2048)), contiguous((784, 2048), (784, 1024))
    (True, False)
    >>> contiguous((1, 8, 64), (1, 4, 64)), contiguous((4, 8, 64), (2, 4, 64))
    (True, False)
    """
    cuts = [d for d, (size, piece) in enumerate(zip(shape, tile)) if piece < size]
    return not cuts or all(piece == 1 for piece in tuple(tile)[:cuts[-1]])


def _row_tile(node: LogicalNode) -> tuple[int, ...] | None:
    """The update's new tile (its slot dim first, as it was), or None when ``node`` is not an
    update join or its weight's chunks are contiguous already."""
    if not (isinstance(node, Join) and is_update(node.join) and len(node.input_labels) > 1):
        return None
    grid = node.relation.grid
    shape, tile = grid.shape[1:], grid.tile[1:]  # the weight's dims, after the slot dim
    if contiguous(shape, tile):
        return None
    chunks = math.prod(-(-n // t) for n, t in zip(shape, tile))
    new = list(shape)
    lead = next((d for d, n in enumerate(shape) if n > 1), 0)
    new[lead] = -(-shape[lead] // min(chunks, shape[lead]))
    return (grid.tile[0], *new)


def _maker(node: Join, tile: tuple[int, ...]):
    def make(memo: dict[int, LogicalNode]) -> LogicalNode:
        rel = node.relation
        tiles = dict(zip(rel.labels, tile))
        sources = tuple(retile(memo[id(child)], labels, tiles)
                        for child, labels in zip(node.sources, node.input_labels))
        relation = TensorRelation(rel.labels, ChunkGrid(rel.shape, tile), rel.dtype)
        return dataclasses.replace(node, relation=relation, sources=sources)
    return make
