"""ChunkGrid's fast path for grids already canonical (Python int shapes and tiles, each tile
within its dim) keeps every answer of the checked path: numpy integers become ints, tiles
larger than their dim are clamped, zero-size dims get tile 1, bad tiles still raise, and
chunk shapes (short last blocks included) match numpy's slicing of the dense tensor."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tensorql.errors import ShapeError
from tensorql.grid import ChunkGrid


def test_non_canonical_grids_are_still_converted_and_checked():
    grid = ChunkGrid((np.int64(5), 4), (np.int32(2), 9))
    assert grid.shape == (5, 4) and grid.tile == (2, 4)
    assert all(type(v) is int for v in grid.shape + grid.tile)
    assert ChunkGrid((0, 3), (4, 3)).tile == (1, 3)
    with pytest.raises(ShapeError):
        ChunkGrid((4,), (0,))
    with pytest.raises(ShapeError):
        ChunkGrid((4, 4), (2,))
    with pytest.raises(ShapeError):
        ChunkGrid((-1,), (1,))


@pytest.mark.parametrize("shape,tile", [((7, 5), (3, 5)), ((8,), (8,)), ((5, 6, 7), (2, 4, 7)),
                                        ((1, 9), (1, 2))])
def test_chunk_shapes_match_the_dense_slices(shape, tile):
    grid = ChunkGrid(shape, tile)
    dense = np.zeros(shape)
    for key in itertools.product(*(range(b) for b in grid.blocks)):
        assert grid.chunk_shape(key) == dense[grid.slices(key)].shape
