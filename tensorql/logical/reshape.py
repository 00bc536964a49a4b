"""How a reshape maps chunks: groups of dims, the grids that make it chunk-local, key mapping.

A reshape keeps the elements' row-major order. Its dims fall into **groups**: runs of input
dims and output dims with equal products (``(6, 4) -> (2, 3, 4)`` has groups ``(6)->(2, 3)``
and ``(4)->(4)``); size-1 dims join the group of the dim before them. Within a group, a chunk
whose dims other than the group's first are whole is a contiguous run of the group's
row-major order. So when the input is tiled that way with a run length ``L`` a multiple of
both sides' trailing products, and the output likewise with the same ``L``, every output chunk
is exactly one input chunk reshaped: a reshape is a chunk-local operation after one retiling
of its input (:func:`reshape_grids`), and output chunk keys follow from input keys
(:meth:`ReshapeLayout.output_key`).

>>> lay = reshape_layout(ChunkGrid((6, 4), (2, 4)), (2, 3, 4))
>>> lay.input_grid.tile, lay.output_grid.tile
((3, 4), (1, 3, 4))
>>> lay.output_key((1, 0)), lay.input_key((1, 0, 0))
((1, 0, 0), (1, 0))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tensorql.errors import ShapeError
from tensorql.grid import ChunkGrid, Key


@dataclass(frozen=True)
class ReshapeGroup:
    """Input dims and output dims (consecutive, in order) whose sizes have one product."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


def reshape_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> tuple[ReshapeGroup, ...]:
    """The groups of a reshape between shapes of one size (no zero-size dims).

    >>> [(g.inputs, g.outputs) for g in reshape_groups((6, 4), (2, 3, 4))]
    [((0,), (0, 1)), ((1,), (2,))]
    >>> [(g.inputs, g.outputs) for g in reshape_groups((1, 6, 1), (3, 1, 2))]
    [((0, 1, 2), (0, 1, 2))]
    """
    if math.prod(in_shape) != math.prod(out_shape):
        raise ShapeError(f"cannot reshape {tuple(in_shape)} ({math.prod(in_shape)} elements) "
                         f"to {tuple(out_shape)} ({math.prod(out_shape)} elements)")
    big_in = [d for d, n in enumerate(in_shape) if n != 1]
    big_out = [d for d, n in enumerate(out_shape) if n != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(big_in):
        ins, outs = [big_in[i]], [big_out[j]]
        pa, pb = in_shape[big_in[i]], out_shape[big_out[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ins.append(big_in[i])
                pa *= in_shape[big_in[i]]
                i += 1
            else:
                outs.append(big_out[j])
                pb *= out_shape[big_out[j]]
                j += 1
        groups.append((ins, outs))
    if not groups:
        groups.append(([], []))
    for side, shape in ((0, in_shape), (1, out_shape)):
        for d, n in enumerate(shape):
            if n != 1:
                continue
            # the group holding the nearest dim before d, else the first group
            owner = 0
            for g, group in enumerate(groups):
                if any(e < d for e in group[side]):
                    owner = g
            groups[owner][side].append(d)
    return tuple(ReshapeGroup(tuple(sorted(ins)), tuple(sorted(outs))) for ins, outs in groups)


@dataclass(frozen=True)
class ReshapeLayout:
    """A reshape made chunk-local: the input is retiled to ``input_grid``, and chunk ``k`` of
    it, reshaped, is chunk :meth:`output_key` ``(k)`` of ``output_grid``."""

    groups: tuple[ReshapeGroup, ...]
    input_grid: ChunkGrid
    output_grid: ChunkGrid

    def output_key(self, key: Key) -> Key:
        """The output chunk made of input chunk ``key``."""
        out = [0] * self.output_grid.ndim
        for group in self.groups:
            if group.inputs and group.outputs:
                out[group.outputs[0]] = key[group.inputs[0]]
        return tuple(out)

    def input_key(self, key: Key) -> Key:
        """The input chunk output chunk ``key`` is made of."""
        out = [0] * self.input_grid.ndim
        for group in self.groups:
            if group.inputs and group.outputs:
                out[group.inputs[0]] = key[group.outputs[0]]
        return tuple(out)


def reshape_layout(grid: ChunkGrid, out_shape: Sequence[int]) -> ReshapeLayout:
    """The grids that make reshaping ``grid``'s tensor to ``out_shape`` chunk-local, with runs
    about as long as ``grid``'s chunks have in each group (at least the least common multiple
    of the group's trailing products: a transposing reshape such as ``(3, 5) -> (5, 3)`` is one
    chunk)."""
    out_shape = tuple(int(n) for n in out_shape)
    groups = reshape_groups(grid.shape, out_shape)
    in_tile, out_tile = list(grid.shape), list(out_shape)
    for group in groups:
        if not group.inputs or not group.outputs:
            continue
        total = math.prod(grid.shape[d] for d in group.inputs)
        rest_in = math.prod(grid.shape[d] for d in group.inputs[1:])
        rest_out = math.prod(out_shape[d] for d in group.outputs[1:])
        unit = math.lcm(rest_in, rest_out)
        have = math.prod(grid.tile[d] for d in group.inputs)
        run = min(total, max(unit, have // unit * unit))
        in_tile[group.inputs[0]] = run // rest_in
        out_tile[group.outputs[0]] = run // rest_out
    in_tile = [max(1, t) for t in in_tile]
    out_tile = [max(1, t) for t in out_tile]
    return ReshapeLayout(groups, ChunkGrid(grid.shape, tuple(in_tile)),
                         ChunkGrid(out_shape, tuple(out_tile)))


__all__ = ["ReshapeGroup", "ReshapeLayout", "reshape_groups", "reshape_layout"]
