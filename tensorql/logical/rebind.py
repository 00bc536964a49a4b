"""Re-binding a planned logical plan to another extent of one dimension size (a prompt's
length): every dim of the old extent gets the new one, on as many chunks as before, and the
in-memory constants that carry it are swapped for the caller's new ones -- what a server's
prompt of a new length needs instead of lowering and rewriting the same graph again.

The plan keeps its structure (the same nodes, the same rules fired, the same chunk keys), so
what the rules decided about it holds for the new extent too; a dimension is recognised by
its size only, so the re-binding is refused (None) wherever that is ambiguous: a stored
tensor or a constant the caller did not give has a dim of the old extent, a reshape touches
it, or the new extent cannot be cut into as many chunks.

>>> import torch
>>> from tensorql.grid import ChunkGrid
>>> from tensorql.logical.plan import Aggregate, Join, Scan, TensorRelation, explain_logical
>>> x = torch.ones(8, 3)
>>> scan = Scan(TensorRelation(("s", "d"), ChunkGrid((8, 3), (4, 3)), "float32"),
...             source="<constant>", constant=x)
>>> w = Scan(TensorRelation(("d",), ChunkGrid((3,), (3,)), "float32"), source="W")
>>> join = Join(TensorRelation(("s", "d"), ChunkGrid((8, 3), (4, 3)), "float32"),
...             sources=(scan, w), input_labels=(("s", "d"), ("d",)))
>>> plan = Aggregate(TensorRelation(("s",), ChunkGrid((8,), (4,)), "float32"), input=join,
...                  over=("d",))
>>> new = rebind_extent((plan,), 8, 7, {id(x): torch.ones(7, 3)})
>>> print(explain_logical(new[0]))
Aggregate sum over [d]  (s) 7 float32 grid 2 of 4
└─ Join mul on [d] (s,d),(d)  (s,d) 7x3 float32 grid 2x1 of 4x3
   ├─ Scan <constant>  (s,d) 7x3 float32 grid 2x1 of 4x3
   └─ Scan W  (d) 3 float32 grid 1 of 3
>>> rebind_extent((plan,), 3, 5, {}) is None  # W's dim is 3 too: ambiguous
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from tensorql.grid import ChunkGrid
from tensorql.logical.plan import (
    Aggregate,
    Attention,
    Join,
    LogicalNode,
    Map,
    Pointwise,
    Rekey,
    Reshape,
    Results,
    Scan,
    Softmax,
    TensorRelation,
    walk,
)


class _Refused(Exception):
    """The plan cannot be re-bound (an ambiguous or uncuttable dim): the caller plans anew."""


@dataclasses.dataclass(frozen=True)
class _Extent:
    """The old extent, the new one, and the new tile of each old tile (same chunk count);
    each grid and relation re-bound once (a plan's nodes share them)."""

    old: int
    new: int
    _grids: dict[tuple, ChunkGrid] = dataclasses.field(default_factory=dict)
    # by id, the old relation kept beside the new one (so that its id stays its own)
    _relations: dict[int, tuple[TensorRelation, TensorRelation]] = dataclasses.field(
        default_factory=dict)

    def tile(self, tile: int) -> int:
        """The new tile for an old one: the same where the new extent still makes as many
        chunks (a shorter prompt keeps its full blocks, only the last one shorter -- their
        products reuse the packed weights kept for the old row count as they are), else
        the extent cut evenly into that many.

        >>> _Extent(512, 500).tile(256), _Extent(512, 520).tile(256)
        (256, 260)
        """
        blocks = -(-self.old // tile)
        if -(-self.new // tile) == blocks:
            return tile
        new_tile = -(-self.new // blocks)
        if -(-self.new // new_tile) != blocks:
            raise _Refused(f"{self.new} does not cut into {blocks} chunks")
        return new_tile

    def grid(self, grid: ChunkGrid) -> ChunkGrid:
        if self.old not in grid.shape:
            return grid
        key = (grid.shape, grid.tile)
        new = self._grids.get(key)
        if new is None:
            shape = tuple(self.new if n == self.old else n for n in grid.shape)
            tile = tuple(self.tile(t) if n == self.old else t
                         for n, t in zip(grid.shape, grid.tile))
            new = self._grids[key] = ChunkGrid(shape, tile)
        return new

    def relation(self, rel: TensorRelation) -> TensorRelation:
        seen = self._relations.get(id(rel))
        if seen is not None:
            return seen[1]
        grid = self.grid(rel.grid)
        new = rel if grid is rel.grid else TensorRelation(rel.labels, grid, rel.dtype)
        self._relations[id(rel)] = (rel, new)
        return new


Rebind = Callable[[LogicalNode, TensorRelation, tuple[LogicalNode, ...], _Extent,
                   Mapping[int, torch.Tensor]], LogicalNode]


def _inputs(node: LogicalNode, inputs: tuple[LogicalNode, ...]) -> dict:
    field = node._inputs_field
    if field is None:
        return {}
    return {field: inputs[0]} if field == "input" else {field: inputs}


def _plain(node, rel, inputs, extent, constants):
    if rel is node.relation and all(a is b for a, b in zip(inputs, node.inputs)):
        return node
    return dataclasses.replace(node, relation=rel, **_inputs(node, inputs))


def _scan(node, rel, inputs, extent, constants):
    if node.constant is None or id(node.constant) not in constants:
        if extent.old in node.relation.shape:  # a stored tensor's or another constant's dim
            raise _Refused(f"{node.title} has a dim of {extent.old}")
        return node
    value = constants[id(node.constant)]
    if tuple(value.shape) != rel.shape or node.offset is not None:
        raise _Refused(f"a constant of shape {tuple(value.shape)} given for {rel.shape}")
    return dataclasses.replace(node, relation=rel, constant=value)


def _reshape(node, rel, inputs, extent, constants):
    if rel is not node.relation or inputs[0].relation is not node.input.relation:
        raise _Refused("a reshape touches the re-bound extent")
    return _plain(node, rel, inputs, extent, constants)


def _pointwise(node, rel, inputs, extent, constants):
    ops = tuple(dataclasses.replace(op, relation=extent.relation(op.relation))
                for op in node.ops)
    return dataclasses.replace(node, relation=rel, sources=inputs, ops=ops)


#: how each kind of logical node is re-bound; a kind not here refuses the re-binding
REBINDERS: dict[type, Rebind] = {
    Scan: _scan, Reshape: _reshape, Pointwise: _pointwise, Rekey: _plain, Join: _plain,
    Aggregate: _plain, Map: _plain, Softmax: _plain, Attention: _plain, Results: _plain,
}


def rebind_extent(roots: tuple[LogicalNode, ...], old: int, new: int,
                  constants: Mapping[int, torch.Tensor]) -> tuple[LogicalNode, ...] | None:
    """``roots`` (a rewritten logical plan) with every dim of extent ``old`` made ``new``,
    each on as many chunks as before, and each constant scan whose tensor's id is a key of
    ``constants`` reading the tensor given there (of the new shape) instead; None when that
    cannot be done unambiguously (see the module docstring). One walk of the plan."""
    extent = _Extent(old, new)
    done: dict[int, LogicalNode] = {}
    try:
        for node in walk(*roots):
            rebinder = REBINDERS.get(type(node))
            if rebinder is None:
                return None
            inputs = tuple(done[id(child)] for child in node.inputs)
            done[id(node)] = rebinder(node, extent.relation(node.relation), inputs, extent,
                                      constants)
    except _Refused:
        return None
    return tuple(done[id(root)] for root in roots)
