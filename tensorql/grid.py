"""Chunk grids: how a dense tensor is tiled into keyed chunks.

A tensor of ``shape`` tiled by ``tile`` is a relation ``key -> chunk`` where ``key`` is the
tuple of block indices. Edge tiles that do not divide evenly are smaller.

>>> g = ChunkGrid(shape=(5, 4), tile=(2, 4))
>>> g.blocks, g.num_chunks
((3, 1), 3)
>>> g.chunk_shape((2, 0)), g.slices((2, 0))
((1, 4), (slice(4, 5, None), slice(0, 4, None)))
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tensorql.errors import ShapeError

Key = tuple[int, ...]


@dataclass(frozen=True)
class ChunkGrid:
    """The tiling of a tensor: full ``shape`` and the ``tile`` size of every dimension."""

    shape: tuple[int, ...]
    tile: tuple[int, ...]

    def __post_init__(self) -> None:
        shape, tile = self.shape, self.tile
        if type(shape) is tuple and type(tile) is tuple and len(shape) == len(tile) and all(
                type(n) is int and type(t) is int and 1 <= t <= n
                for n, t in zip(shape, tile)):
            return  # already canonical (every grid a plan makes): nothing to check or convert
        if len(self.shape) != len(self.tile):
            raise ShapeError(f"tile {self.tile} has {len(self.tile)} dims, shape {self.shape} "
                             f"has {len(self.shape)}")
        for dim, (n, t) in enumerate(zip(self.shape, self.tile)):
            if n < 0:
                raise ShapeError(f"dimension {dim} has size {n}; sizes must be >= 0")
            if t < 1 and n > 0:
                raise ShapeError(f"tile of dimension {dim} is {t}; tiles must be >= 1")
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        object.__setattr__(  # a zero-size dimension has no blocks, hence no chunks
            self, "tile", tuple(max(1, min(int(t), n)) for t, n in zip(self.tile, self.shape))
        )

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @functools.cached_property
    def blocks(self) -> tuple[int, ...]:
        """Number of blocks along each dimension (computed once per grid: building a
        physical plan asks each grid for it many times over -- a LLaMA prefill's 289 steps
        asked ~3,000 times, 15 % of re-planning it for a new prompt length)."""
        return tuple(-(-n // t) for n, t in zip(self.shape, self.tile))

    @property
    def num_chunks(self) -> int:
        return math.prod(self.blocks)

    def keys(self) -> Iterator[Key]:
        """Every chunk key, in row-major order (none when a dim has no blocks: checked
        first, as ``itertools.product`` would build the other dims' ranges in full)."""
        if 0 in self.blocks:
            return iter(())
        return itertools.product(*(range(b) for b in self.blocks))

    def dim_extent(self, dim: int, block: int) -> tuple[int, int]:
        """(start, stop) of ``block`` along ``dim``."""
        start = block * self.tile[dim]
        return start, min(start + self.tile[dim], self.shape[dim])

    def slices(self, key: Key) -> tuple[slice, ...]:
        """Slices of the dense tensor that chunk ``key`` covers."""
        return tuple(slice(*self.dim_extent(d, b)) for d, b in enumerate(key))

    def chunk_shape(self, key: Key) -> tuple[int, ...]:
        """The shape of chunk ``key`` (the last block of a dim may be short).

        >>> ChunkGrid((5, 4), (2, 4)).chunk_shape((2, 0))
        (1, 4)
        """
        if type(key) is not tuple:  # a list or other sequence: not a memo key
            return tuple(min(t, n - b * t) for b, t, n in zip(key, self.tile, self.shape))
        shape = self._chunk_shapes.get(key)  # memo: a plan asks for the same chunks again
        if shape is None:
            shape = self._chunk_shapes[key] = tuple(
                min(t, n - b * t) for b, t, n in zip(key, self.tile, self.shape))
        return shape

    @functools.cached_property
    def _chunk_shapes(self) -> dict[Key, tuple[int, ...]]:
        """:meth:`chunk_shape`'s memo, by key (a grid has as many entries as chunks asked)."""
        return {}

    def check_key(self, key: Sequence[int]) -> Key:
        """``key`` as a tuple of ints, ShapeError when it is outside the grid (a loop, not
        generators: every chunk a run loads from the store is checked).

        >>> ChunkGrid((4, 5), (2, 5)).check_key([1, 0])
        (1, 0)
        """
        key = tuple(map(int, key))
        if len(key) == len(self.shape):
            for k, n, t in zip(key, self.shape, self.tile):
                if not 0 <= k < -(-n // t):
                    break
            else:
                return key
        raise ShapeError(f"chunk key {key} is outside grid blocks {self.blocks}")


@dataclass(frozen=True)
class RegridPiece:
    """One overlap between a chunk of a new grid and a chunk of an old grid of the same shape:
    ``target[target_slices] = old_chunk(source_key)[source_slices]``."""

    source_key: Key
    source_slices: tuple[slice, ...]
    target_slices: tuple[slice, ...]


def regrid_pieces(old: ChunkGrid, new: ChunkGrid, key: Key) -> list[RegridPiece]:
    """The pieces of old chunks that make up chunk ``key`` of ``new`` (row-major order).

    >>> old, new = ChunkGrid((4, 4), (2, 4)), ChunkGrid((4, 4), (3, 3))
    >>> [(p.source_key, p.target_slices[0]) for p in regrid_pieces(old, new, (0, 0))]
    [((0, 0), slice(0, 2, None)), ((1, 0), slice(2, 3, None))]
    """
    if old.shape != new.shape:
        raise ShapeError(f"cannot regrid shape {old.shape} to {new.shape}")
    spans = []
    for dim, block in enumerate(key):
        lo, hi = new.dim_extent(dim, block)
        first, last = lo // old.tile[dim], (hi - 1) // old.tile[dim]
        spans.append([(b, lo, hi) for b in range(first, last + 1)])
    pieces = []
    for combo in itertools.product(*spans):
        src, dst = [], []
        for dim, (b, lo, hi) in enumerate(combo):
            blo, bhi = old.dim_extent(dim, b)
            start, stop = max(lo, blo), min(hi, bhi)
            src.append(slice(start - blo, stop - blo))
            dst.append(slice(start - lo, stop - lo))
        pieces.append(RegridPiece(tuple(b for b, _, _ in combo), tuple(src), tuple(dst)))
    return pieces


#: the chunk size (elements) automatic tiles aim at on a CPU: 16 MiB of float32. A layer's
#: 2048 x 2048 weight or a 1024 x 4096 one stays one chunk, so its products are one call
#: each where a target of 2^20 cut them in four (K-split products folded into an
#: accumulator, gradients retiled for the in-place update): an MLP training step (784 ->
#: 2048 -> 2048 -> 10, batch 256) ran ~12% faster on a 2-core Intel Xeon, the matmul
#: 3072^3 ~5% (tiles of 1536 where they were 1024), and a LLaMA prefill no slower.
CPU_TILE_ELEMS = 1 << 22


def auto_tile(shape: Sequence[int], target_elems: int = CPU_TILE_ELEMS,
              min_tile: int = 64) -> tuple:
    """The largest square-ish tile for ``shape`` whose chunks hold at most ``target_elems``.

    Dimensions are cut into equal pieces, one more piece at a time for the dimension whose
    tile is currently largest (the leading one first among equals), until the chunk fits:
    matrices get square-ish tiles that fit a contraction over either dimension (row stripes
    would make every matmul task a thin, slow product), and small dimensions stay whole.

    >>> auto_tile((8192, 8192)), auto_tile((3072, 3072)), auto_tile((2048, 2048))
    ((2048, 2048), (1536, 1536), (2048, 2048))
    >>> auto_tile((10, 7)), auto_tile((1 << 24,)), auto_tile((64, 1 << 20))
    ((10, 7), (4194304,), (64, 65536))
    >>> auto_tile((3072, 3072), target_elems=1 << 20)
    (1024, 1024)
    """
    shape = [int(n) for n in shape]
    pieces = [1] * len(shape)
    tile = list(shape)
    while math.prod(tile) > target_elems:
        d = max(range(len(tile)), key=lambda k: (tile[k], -k))
        if tile[d] <= min_tile:
            break
        pieces[d] += 1
        tile[d] = max(min_tile, -(-shape[d] // pieces[d]))
    return tuple(tile)
