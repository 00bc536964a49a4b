"""The chunk cache holds what a plan reads of a stored tensor, no more (issue 31: a rank of a
tensor-parallel plan reading half of each of two stored chunks held both chunks whole, beside
copies of the halves -- 40 MiB of 32 MiB of weights, where its share was 16).

A region that is a whole chunk is that chunk; a region inside a chunk the cache holds is a
view of it; any other region is cut from chunks decoded without being cached, and only the
region is cached; a chunk cached after regions cut from it replaces them."""

from __future__ import annotations

import numpy as np
import pytest

from tensorql.grid import ChunkGrid
from tensorql.storage.chunk_store import TensorMeta
from tensorql.storage.duckdb_store import DuckDBChunkStore

SHAPE, TILE = (64, 32), (32, 32)  # two row chunks of 32 x 32 float32 (4 KiB each)
CHUNK_BYTES = 32 * 32 * 4


@pytest.fixture
def store():
    store = DuckDBChunkStore()
    values = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    grid = ChunkGrid(SHAPE, TILE)
    store.put_tensor(TensorMeta("w", SHAPE, "float32", grid),
                     ((k, values[grid.slices(k)]) for k in grid.keys()))
    store.cache._items.clear()  # nothing decoded yet
    yield store, values
    store.close()


def _held(store) -> int:
    """Bytes of distinct storage the chunk cache holds."""
    seen = {}
    for _, chunk in store.cache.items():
        storage = chunk.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def test_column_halves_of_two_chunks_hold_the_halves_only(store):
    store, values = store
    left = store.read_region("w", (0, 0), (64, 16))
    right = store.read_region("w", (0, 16), (64, 32))
    np.testing.assert_array_equal(left.numpy(), values[:, :16])
    np.testing.assert_array_equal(right.numpy(), values[:, 16:])
    assert _held(store) == 2 * CHUNK_BYTES  # the two halves, not the two chunks beside them
    again = store.read_region("w", (0, 0), (64, 16))
    assert again.data_ptr() == left.data_ptr()  # cut once, then served from the cache


def test_a_region_inside_a_cached_chunk_is_a_view_of_it(store):
    store, values = store
    chunk = store.read_region("w", (32, 0), (64, 32))  # chunk (1, 0), whole
    part = store.read_region("w", (40, 8), (48, 24))
    np.testing.assert_array_equal(part.numpy(), values[40:48, 8:24])
    assert part.untyped_storage().data_ptr() == chunk.untyped_storage().data_ptr()
    assert _held(store) == CHUNK_BYTES


def test_a_chunk_cached_after_a_region_of_it_replaces_the_region(store):
    store, values = store
    part = store.read_region("w", (0, 0), (16, 32))  # inside chunk (0, 0), not cached yet
    assert _held(store) == part.nbytes
    whole = store.read_region("w", (0, 0), (32, 32))
    np.testing.assert_array_equal(whole.numpy(), values[:32])
    assert _held(store) == CHUNK_BYTES  # the region copy went; the chunk serves it now
    view = store.read_region("w", (0, 0), (16, 32))
    assert view.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    np.testing.assert_array_equal(part.numpy(), view.numpy())


def test_check_key_accepts_the_grid_and_refuses_the_rest():
    """ChunkGrid.check_key (a loop since issue 31): every key of the grid comes back as a
    tuple of ints; a key of another length, a negative or past-the-end block is a ShapeError
    naming the blocks."""
    import numpy as np
    import pytest

    from tensorql.errors import ShapeError
    from tensorql.grid import ChunkGrid

    grid = ChunkGrid((5, 4, 3), (2, 4, 2))
    assert [grid.check_key(k) for k in grid.keys()] == list(grid.keys())
    assert grid.check_key(np.array([2, 0, 1])) == (2, 0, 1)
    assert type(grid.check_key([np.int64(1), 0, 0])[0]) is int
    for bad in [(3, 0, 0), (0, 1, 0), (0, 0, -1), (0, 0), (0, 0, 0, 0)]:
        with pytest.raises(ShapeError, match=r"outside grid blocks \(3, 1, 2\)"):
            grid.check_key(bad)
