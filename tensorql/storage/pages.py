"""Chunk payloads split into fixed-size BLOB pages, and joined back without copying.

A stored chunk is ``ceil(nbytes / page_bytes)`` rows (at least one), each holding up to
``page_bytes`` of the chunk's C-contiguous bytes. DuckDB keeps BLOBs of up to 4 KiB inline in
its column segments; longer ones go to overflow blocks that stay pinned in memory until a
checkpoint, which is why the page size is 4 KiB (docs/storage.md has the measurements).

>>> import numpy as np
>>> parts = [np.arange(6, dtype=np.uint8), np.arange(3, dtype=np.uint8)]
>>> pages = encode_pages(parts, page_bytes=4)
>>> pages.page_numbers.tolist(), pages.chunk_index.tolist()
([0, 1, 0], [0, 0, 1])
>>> join_pages(pages.payload).tolist()
[0, 1, 2, 3, 4, 5, 0, 1, 2]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

PAGE_BYTES = 4096


@dataclass(frozen=True)
class EncodedPages:
    """The page rows of a batch of chunks: one Arrow binary value per page.

    ``chunk_index[r]`` is the position (in the batch) of the chunk page ``r`` belongs to and
    ``page_numbers[r]`` its page number inside that chunk.
    """

    payload: pa.LargeBinaryArray
    page_numbers: np.ndarray
    chunk_index: np.ndarray


def page_counts(nbytes: np.ndarray, page_bytes: int = PAGE_BYTES) -> np.ndarray:
    """Pages per chunk of ``nbytes`` bytes: ``ceil(nbytes / page_bytes)``, at least 1."""
    return np.maximum(1, -(-np.asarray(nbytes, dtype=np.int64) // page_bytes))


def encode_pages(parts: Sequence[np.ndarray], page_bytes: int = PAGE_BYTES) -> EncodedPages:
    """Split each flat uint8 array of ``parts`` into pages (one copy: the concatenation of
    several parts; a single part's pages view its bytes, which must outlive the pages)."""
    sizes = np.fromiter((p.size for p in parts), dtype=np.int64, count=len(parts))
    counts = page_counts(sizes, page_bytes)
    starts = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    chunk_index = np.repeat(np.arange(len(parts), dtype=np.int64), counts)
    first_row = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(counts, out=first_row[1:])
    page_numbers = np.arange(int(first_row[-1]), dtype=np.int64) - first_row[chunk_index]
    offsets = np.empty(len(chunk_index) + 1, dtype=np.int64)
    offsets[:-1] = starts[chunk_index] + page_numbers * page_bytes
    offsets[-1] = starts[-1]
    # one chunk (a big chunk is a batch of its own) is viewed as it is: no copy of it
    data = parts[0] if len(parts) == 1 else (np.concatenate(parts) if len(parts)
                                             else np.zeros(0, np.uint8))
    payload = pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), len(chunk_index), [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    return EncodedPages(payload=payload, page_numbers=page_numbers.astype(np.int32),
                        chunk_index=chunk_index)


def _offsets_and_data(arr: pa.Array) -> tuple[np.ndarray, pa.Buffer]:
    width = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
    offsets = np.frombuffer(arr.buffers()[1], dtype=width)[arr.offset:arr.offset + len(arr) + 1]
    return offsets, arr.buffers()[2]


def join_pages(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The bytes of consecutive pages as one flat uint8 array.

    The values of one Arrow binary array lie back to back in its data buffer, so pages from
    one record batch join without copying; pages spread over several batches are concatenated.
    """
    arrays = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    pieces = []
    for arr in arrays:
        if len(arr) == 0:
            continue
        offsets, data = _offsets_and_data(arr)
        if data is None or offsets[-1] == offsets[0]:
            continue
        pieces.append(np.frombuffer(data, dtype=np.uint8)[offsets[0]:offsets[-1]])
    if len(pieces) == 1:
        return pieces[0]
    return np.concatenate(pieces) if pieces else np.zeros(0, np.uint8)


def join_page_lists(lists: pa.ListArray | pa.LargeListArray) -> pa.LargeBinaryArray:
    """One binary value per list of pages (a ``list(payload ORDER BY page)`` aggregate),
    built from the child's buffers without copying the bytes."""
    if isinstance(lists, pa.ChunkedArray):
        lists = pa.concat_arrays(lists.chunks) if lists.num_chunks != 1 else lists.chunk(0)
    child = lists.values
    child_offsets, data = _offsets_and_data(child)
    list_offsets = np.frombuffer(lists.buffers()[1],
                                 dtype=np.int64 if pa.types.is_large_list(lists.type)
                                 else np.int32)[lists.offset:lists.offset + len(lists) + 1]
    offsets = child_offsets[list_offsets].astype(np.int64)  # list offsets index the child
    if data is None:
        data = pa.py_buffer(b"")
    return pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), len(lists), [None, pa.py_buffer(offsets), data])
