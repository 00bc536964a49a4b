"""Rule ``whole_rows_for_wide_weights``: a product of activations with a stored weight many
times their size, the weight cut into many chunks along the labels it gives the output,
takes the activations whole along the labels only they have (their rows), so that each chunk
of the weight is read by one task instead of once per block of rows.

Why: a prompt's hidden states are cut into one block of positions per worker (a LLaMA
prefill: 2 blocks of 256), and every product inherits that cut. For a weight much larger than
the activations -- the LM head, 32000 x 768 (94 MiB) against 512 x 768 (1.5 MiB) -- every
block of rows then streams the whole weight through the cache once more: 2 x 24 tasks of
256 x 768 x 1334 read 188 MiB of weight where 24 tasks of 512 rows read 94. Two threads
running the 48 tasks took 7 % more CPU time than running the 24 (oneDNN's packed product,
this repository's 2-core AMD host, median of 30). The weight's chunks alone still give every
worker tasks (at least :data:`MIN_WEIGHT_CHUNKS` of them), and the activations are copied
into whole rows once (a ``Rekey``; a constant's scan just takes the new tiles).

It fires on ``Aggregate sum`` over a two-input ``Join mul`` one of whose inputs is a scan of
a stored tensor (the weight) with at least :data:`MIN_WEIGHT_RATIO` times the elements of the
other input, when that weight is cut into at least :data:`MIN_WEIGHT_CHUNKS` chunks along
the labels it shares with the output, the other input is cut along a label the weight does
not have, and a chunk of the other input and of the product's output with those labels
whole stay within :data:`MAX_CHUNK_ELEMS` elements.

>>> from tensorql.grid import ChunkGrid
>>> from tensorql.logical.plan import Scan, TensorRelation, explain_logical
>>> def rel(labels, shape, tile):
...     return TensorRelation(labels, ChunkGrid(shape, tile), "float32")
>>> x = Scan(rel(("s", "d"), (8, 4), (4, 4)), "X")  # activations in 2 row blocks
>>> w = Scan(rel(("v", "d"), (512, 4), (32, 4)), "W")  # a weight of 16 chunks, 64x larger
>>> prod = Join(rel(("s", "v", "d"), (8, 512, 4), (4, 32, 4)), sources=(x, w),
...             input_labels=(("s", "d"), ("v", "d")), join="mul")
>>> top = Aggregate(rel(("s", "v"), (8, 512), (4, 32)), input=prod, over=("d",), agg="sum")
>>> print(explain_logical(whole_rows_for_wide_weights(top)))
Aggregate sum over [d]  (s,v) 8x512 float32 grid 1x16 of 8x32
└─ Join mul on [d] (s,d),(v,d)  (s,v,d) 8x512x4 float32 grid 1x16x1 of 8x32x4
   ├─ Rekey to tiles (8, 4)  (s,d) 8x4 float32 grid 1x1 of 8x4
   │  └─ Scan X  (s,d) 8x4 float32 grid 2x1 of 4x4
   └─ Scan W  (v,d) 512x4 float32 grid 16x1 of 32x4
>>> again = whole_rows_for_wide_weights(top)
>>> whole_rows_for_wide_weights(again) is again  # rows whole already: no change
True
"""

from __future__ import annotations

import dataclasses
import math

from tensorql.algebra import AggName, JoinName
from tensorql.grid import ChunkGrid
from tensorql.logical.lower import retile
from tensorql.logical.plan import Aggregate, Join, LogicalNode, Results, Scan, TensorRelation, walk
from tensorql.logical.rules.common import readers, rebuild_matching

NAME = "whole_rows_for_wide_weights"
MIN_WEIGHT_CHUNKS = 8  # the weight's chunks along the output's labels: tasks for the workers
MIN_WEIGHT_RATIO = 8  # the weight's elements over the activations'
MAX_CHUNK_ELEMS = 1 << 22  # a chunk of the activations or of the output, rows whole (16 MiB)


def whole_rows_for_wide_weights(root: LogicalNode) -> LogicalNode:
    """``root`` with every product of activations and a much larger, finely cut stored weight
    taking the activations in whole rows (see the module doc); ``root`` itself when there is
    none. A product whose result another step reads is copied back to its old tiles for
    that reader (a ``Rekey``): the readers were planned on those."""
    nodes = list(walk(root))
    results = {id(n) for n in nodes if isinstance(n, Results)} | {0}
    read_by = readers(nodes, root)
    inner = {id(n) for n in nodes if set(read_by.get(id(n), ())) - results}
    return rebuild_matching(
        root, _whole_row_tiles,
        lambda node, tiles: _maker(node, tiles, keep_grid=id(node) in inner))


def _whole_row_tiles(node: LogicalNode) -> dict[str, int] | None:
    """The product's tiles with the activations' own labels whole, by label; None when the
    rule does not apply to ``node`` (see the module doc)."""
    if not (isinstance(node, Aggregate) and node.agg == AggName.SUM
            and isinstance(node.input, Join) and node.input.join == JoinName.MUL
            and len(node.input.sources) == 2):
        return None
    join = node.input
    elems = [math.prod(src.relation.shape) for src in join.sources]
    wide = [n for n, src in enumerate(join.sources)
            if isinstance(src, Scan) and src.constant is None
            and elems[n] >= MIN_WEIGHT_RATIO * elems[1 - n]]
    if not wide:
        return None
    weight_labels = join.input_labels[wide[0]]
    sizes = dict(zip(join.relation.labels, join.relation.shape))
    tiles = dict(zip(join.relation.labels, join.relation.grid.tile))
    rows = [lab for lab in join.input_labels[1 - wide[0]] if lab not in weight_labels]
    if not any(tiles[lab] < sizes[lab] for lab in rows):
        return None  # no row label cut: nothing to do
    out = node.relation.labels
    chunks = math.prod(-(-sizes[lab] // tiles[lab]) for lab in weight_labels if lab in out)
    if chunks < MIN_WEIGHT_CHUNKS:
        return None
    new = dict(tiles) | {lab: sizes[lab] for lab in rows}
    act_labels = join.input_labels[1 - wide[0]]
    if max(math.prod(new[lab] for lab in out),
           math.prod(new[lab] for lab in act_labels)) > MAX_CHUNK_ELEMS:
        return None  # chunks too large for the workers' caches and a memory plan
    return new


def _maker(node: Aggregate, tiles: dict[str, int], keep_grid: bool):
    def make(memo: dict[int, LogicalNode]) -> LogicalNode:
        join = node.input
        assert isinstance(join, Join)

        def regrid(rel: TensorRelation) -> TensorRelation:
            return TensorRelation(rel.labels, ChunkGrid(rel.shape, tuple(
                tiles[lab] for lab in rel.labels)), rel.dtype)

        sources = tuple(retile(memo[id(child)], labels, tiles)
                        for child, labels in zip(join.sources, join.input_labels))
        product = dataclasses.replace(join, relation=regrid(join.relation), sources=sources)
        new = dataclasses.replace(node, relation=regrid(node.relation), input=product)
        if not keep_grid:
            return new
        old = dict(zip(node.relation.labels, node.relation.grid.tile))
        return retile(new, node.relation.labels, old)
    return make
