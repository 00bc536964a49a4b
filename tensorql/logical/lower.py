"""Lower an einsum graph to a logical plan of Scans, Rekeys, Joins, Aggregates, Maps and
Reshapes.

Each einsum becomes pairwise steps ``Aggregate(Join(left, right))``. For the semirings (join
distributes over agg, e.g. mul/sum or add/max) the pairwise order comes from
:mod:`tensorql.logical.path` (the one place a contraction order is chosen) and a
label is aggregated as soon as no remaining operand needs it; otherwise operands are joined
left to right and every aggregated label is reduced at the end, which is what the extended
einsum means for them.

A label is tiled alike in every operand of a step: the first operand carrying it sets the tile,
and other operands are retiled (``Rekey``) to match. A dim of size 1 broadcast against a larger
size gets a private size-1 label (it joins nothing and aggregates to itself).

>>> from tensorql.grid import ChunkGrid, auto_tile
>>> from tensorql.einsum.graph import EinsumOp, Source
>>> a = Source(shape=(4, 6), dtype="float32", name="A", grid=ChunkGrid((4, 6), (2, 3)))
>>> b = Source(shape=(6, 2), dtype="float32", name="B", grid=ChunkGrid((6, 2), (3, 2)))
>>> plan = lower(EinsumOp.build("ij,jk->ik", [a, b]))
>>> type(plan).__name__, plan.over, plan.relation.grid.tile
('Aggregate', ('j',), (2, 2))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from tensorql.algebra import agg_record, join_record
from tensorql.dtypes import itemsize, torch_dtype
from tensorql.einsum.graph import (
    Constant,
    EinsumOp,
    MapOp,
    Node,
    ReshapeOp,
    SoftmaxOp,
    Source,
    topological_order,
)
from tensorql.errors import PlanError
from tensorql.grid import ChunkGrid, auto_tile
from tensorql.logical.path import PathInfo, contraction_path, describe_path
from tensorql.logical.plan import (
    Aggregate,
    Join,
    LogicalNode,
    Map,
    Rekey,
    Reshape,
    Scan,
    Softmax,
    TensorRelation,
)
from tensorql.logical.reshape import reshape_layout

Operand = tuple[LogicalNode, tuple[str, ...]]


def lower(root: Node) -> LogicalNode:
    """The logical plan computing ``root`` (shared subgraphs stay shared)."""
    return lower_many([root])[0]


def lower_many(roots: Sequence[Node]) -> list[LogicalNode]:
    """Logical plans of several roots, sharing every common subgraph."""
    done: dict[int, LogicalNode] = {}
    for node in topological_order(*roots):
        done[id(node)] = _lower_node(node, done)
    return [done[id(r)] for r in roots]


def _positional(ndim: int) -> tuple[str, ...]:
    return tuple(f"d{k}" for k in range(ndim))


def _lower_node(node: Node, done: dict[int, LogicalNode]) -> LogicalNode:
    if isinstance(node, Source):
        if node.offset is not None:  # a region: the stored tiles, over the region's shape
            grid = ChunkGrid(node.shape, tuple(min(t, max(1, n)) for t, n in
                                               zip(node.grid.tile, node.shape)))
            return Scan(relation=TensorRelation(_positional(node.ndim), grid, node.dtype),
                        source=node.name, offset=node.offset, stored_grid=node.grid)
        return Scan(relation=TensorRelation(_positional(node.ndim), node.grid, node.dtype),
                    source=node.name)
    if isinstance(node, Constant):
        return Scan(relation=TensorRelation(_positional(node.ndim), node.grid, node.dtype),
                    source="<constant>", constant=node.value)
    if isinstance(node, MapOp):
        child = done[id(node.operand)]
        rel = TensorRelation(child.relation.labels, child.relation.grid, node.dtype)
        return Map(relation=rel, input=child, fn=node.fn, scalar=node.scalar)
    if isinstance(node, EinsumOp):
        if any(0 in n.shape for n in node.operands):
            return _empty_einsum(node)
        return _lower_einsum(node, [done[id(n)] for n in node.operands])
    if isinstance(node, ReshapeOp):
        return _lower_reshape(node, done[id(node.operand)])
    if isinstance(node, SoftmaxOp):
        return _lower_softmax(node, done[id(node.operand)])
    raise PlanError(f"cannot plan node {type(node).__name__}")


def _lower_reshape(node: ReshapeOp, child: LogicalNode) -> LogicalNode:
    """``Reshape(Rekey(child))``: the input retiled so that every chunk of it, reshaped, is one
    output chunk (:func:`tensorql.logical.reshape.reshape_layout`)."""
    if 0 in node.shape:  # no elements: nothing to reshape
        return _constant_scan(torch.empty(node.shape, dtype=torch_dtype(node.dtype)), node.dtype)
    lay = reshape_layout(child.relation.grid, node.shape)
    labels = child.relation.labels
    if lay.input_grid != child.relation.grid:
        child = Rekey(relation=TensorRelation(labels, lay.input_grid, child.relation.dtype),
                      input=child)
    rel = TensorRelation(_positional(node.ndim), lay.output_grid, node.dtype)
    return Reshape(relation=rel, input=child, layout=lay)


SOFTMAX_CHUNK_ELEMS = 1 << 21  # 8 MiB of float32


def _lower_softmax(node: SoftmaxOp, child: LogicalNode) -> LogicalNode:
    """``Softmax(child)``, the child retiled so that each chunk holds the whole axis."""
    rel = child.relation
    if 0 in node.shape:  # no elements: nothing to normalise
        return _constant_scan(torch.empty(node.shape, dtype=torch_dtype(node.dtype)), node.dtype)
    tile = list(rel.grid.tile)
    # the other dims keep their tiles while chunks stay within SOFTMAX_CHUNK_ELEMS (or as big
    # as before): an attention's rows of keys made whole keep its query blocks
    target = max(math.prod(tile), rel.shape[node.axis], SOFTMAX_CHUNK_ELEMS)
    tile[node.axis] = rel.shape[node.axis]
    while math.prod(tile) > target:
        widest = max((d for d in range(len(tile)) if d != node.axis), key=lambda d: tile[d])
        tile[widest] = -(-tile[widest] // 2)
    if tuple(tile) != rel.grid.tile:
        child = Rekey(relation=TensorRelation(rel.labels, ChunkGrid(rel.shape, tuple(tile)),
                                              rel.dtype), input=child)
    return Softmax(relation=TensorRelation(rel.labels, child.relation.grid, node.dtype),
                   input=child, label=rel.labels[node.axis], log=node.log)


def _empty_einsum(op: EinsumOp) -> LogicalNode:
    """An einsum with a zero-size operand, as numpy computes it: no elements when the output
    has a zero-size dimension, else the aggregation's identity everywhere (nothing
    contributes to any cell)."""
    dtype = torch_dtype(op.dtype)
    fill = agg_record(op.spec.agg).identity
    if not dtype.is_floating_point and math.isinf(fill):
        info = torch.iinfo(dtype) if dtype != torch.bool else None
        fill = (info.min if fill < 0 else info.max) if info else fill > 0
    return _constant_scan(torch.full(op.shape, fill, dtype=dtype), op.dtype)


def _constant_scan(value: torch.Tensor, dtype: str) -> Scan:
    """A scan of an in-memory ``value`` on automatic tiles."""
    grid = ChunkGrid(tuple(value.shape), auto_tile(value.shape))
    return Scan(relation=TensorRelation(_positional(value.ndim), grid, dtype),
                source="<constant>", constant=value)


def _operands(op: EinsumOp,
              children: list[LogicalNode]) -> tuple[list[Operand], dict[str, int]]:
    """Each operand (retiled) with its labels, and the tile of every label."""
    spec = op.spec
    labels = [
        tuple(f"{lab}@{n}" if sq else lab for lab, sq in zip(op_labels, squeeze))
        for n, (op_labels, squeeze) in enumerate(zip(spec.inputs, spec.squeezed))
    ]
    tiles = _choose_tiles(children, labels)
    if not agg_record(spec.agg).associative:  # its partials cannot be combined: one tile
        tiles.update({lab: spec.sizes[lab] for lab in spec.aggregated})
    return [(retile(child, lab, tiles), lab) for child, lab in zip(children, labels)], tiles


def contraction_paths(root: Node) -> list[tuple[EinsumOp, PathInfo]]:
    """The :class:`PathInfo` of every n-ary (> 2 operands) semiring einsum under ``root``:
    the order its lowering uses (searched once: the path cache answers here).

    >>> a = Source(shape=(8, 2), dtype="float32", name="A", grid=ChunkGrid((8, 2), (8, 2)))
    >>> b = Source(shape=(2, 8), dtype="float32", name="B", grid=ChunkGrid((2, 8), (2, 8)))
    >>> ((op, info),) = contraction_paths(EinsumOp.build("ij,jk,kl->il", [a, b, a]))
    >>> info.path, info.flops, info.naive_flops
    (((1, 2), (0, 1)), 128, 1024)
    """
    done: dict[int, LogicalNode] = {}
    found = []
    for node in topological_order(root):
        done[id(node)] = _lower_node(node, done)
        if isinstance(node, EinsumOp) and len(node.operands) > 2 and node.spec.is_semiring:
            operands, tiles = _operands(node, [done[id(n)] for n in node.operands])
            inputs = [labels for _, labels in operands]
            sizes = _sizes(operands)
            path = contraction_path(inputs, node.spec.output, sizes, tiles, itemsize(node.dtype))
            found.append((node, describe_path(path, inputs, node.spec.output, sizes)))
    return found


def _lower_einsum(op: EinsumOp, children: list[LogicalNode]) -> LogicalNode:
    spec = op.spec
    operands, tiles = _operands(op, children)
    if len(operands) > 2 and spec.is_semiring:
        return _contract_by_path(operands, spec.output, spec.join, spec.agg, tiles, op.dtype)
    if join_record(spec.join).nary:  # n-ary (where, an update, a user's): one step over all
        return _step(operands, spec.output, spec.join, spec.agg, tiles, op.dtype)
    result = operands[0]
    for n in range(1, len(operands) - 1):  # left fold keeps every label until the end
        joint = tuple(dict.fromkeys(result[1] + operands[n][1]))
        result = (_step([result, operands[n]], joint, spec.join, spec.agg, tiles, op.dtype),
                  joint)
    final = [result] if len(operands) == 1 else [result, operands[-1]]
    return _step(final, spec.output, spec.join, spec.agg, tiles, op.dtype)


def _choose_tiles(children: list[LogicalNode], labels: list[tuple[str, ...]]) -> dict[str, int]:
    tiles: dict[str, int] = {}
    for child, lab in zip(children, labels):
        for label, tile in zip(lab, child.relation.grid.tile):
            tiles.setdefault(label, tile)
    return tiles


def retile(child: LogicalNode, labels: tuple[str, ...], tiles: dict[str, int]) -> LogicalNode:
    """``child`` (its dims named ``labels``) on tiles ``tiles[label]``: itself when already
    so, a constant's scan on the new tiles, else a ``Rekey``."""
    wanted = tuple(tiles[lab] for lab in labels)
    grid = child.relation.grid
    if ChunkGrid(grid.shape, wanted) == grid:
        return child
    if isinstance(child, Scan) and child.constant is not None:
        # a constant's chunks are views of it taken at run time: scan it in the new tiles
        # rather than copying the old ones into them
        return dataclasses.replace(child, relation=TensorRelation(
            child.relation.labels, ChunkGrid(grid.shape, wanted), child.relation.dtype))
    rel = TensorRelation(labels, ChunkGrid(grid.shape, wanted), child.relation.dtype)
    return Rekey(relation=rel, input=child)


def _relation(labels: Sequence[str], sizes: dict[str, int], tiles: dict[str, int],
              dtype: str) -> TensorRelation:
    labels = tuple(labels)
    grid = ChunkGrid(tuple(sizes[lab] for lab in labels), tuple(tiles[lab] for lab in labels))
    return TensorRelation(labels, grid, dtype)


def _sizes(operands: Sequence[Operand]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for node, labels in operands:
        sizes.update(zip(labels, node.relation.shape))
    return sizes


def _step(operands: Sequence[Operand], out: Sequence[str], join: str, agg: str,
          tiles: dict[str, int], dtype: str) -> LogicalNode:
    """``Aggregate(Join(operands))`` keeping labels ``out`` (in that order)."""
    out = tuple(out)
    sizes = _sizes(operands)
    joint = tuple(dict.fromkeys(lab for _, labels in operands for lab in labels))
    over = tuple(lab for lab in joint if lab not in out)
    if (len(operands) == 1 and not over and operands[0][1] == out
            and operands[0][0].relation.dtype == dtype and not join_record(join).nary):
        return operands[0][0]  # the identity: nothing to do (a user's unary join is not)
    join_labels = out if not over else out + over
    joined = Join(
        relation=_relation(join_labels, sizes, tiles, dtype),
        sources=tuple(node for node, _ in operands),
        input_labels=tuple(labels for _, labels in operands),
        join=join,
    )
    if not over:
        return joined
    return Aggregate(relation=_relation(out, sizes, tiles, dtype), input=joined, over=over,
                     agg=agg)


def _contract_by_path(operands: list[Operand], output: tuple[str, ...], join: str, agg: str,
                      tiles: dict[str, int], dtype: str) -> LogicalNode:
    """Pairwise steps in the order :mod:`tensorql.logical.path` chooses (chunk-aware)."""
    sizes = _sizes(operands)
    path = contraction_path([labels for _, labels in operands], output, sizes, tiles,
                            itemsize(dtype))
    current = list(operands)
    for position, pair in enumerate(path):
        picked = [current[k] for k in sorted(pair)]
        current = [op for k, op in enumerate(current) if k not in pair]
        if position == len(path) - 1 and not current:
            return _step(picked, output, join, agg, tiles, dtype)
        needed = {lab for _, labels in current for lab in labels} | set(output)
        kept = tuple(lab for lab in dict.fromkeys(
            lab for _, labels in picked for lab in labels) if lab in needed)
        current.append((_step(picked, kept, join, agg, tiles, dtype), kept))
    (node, labels), = current
    return _step([(node, labels)], output, join, agg, tiles, dtype)
