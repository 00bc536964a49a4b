"""Chunk payloads as BLOBs: the C-contiguous bytes of a chunk, batched into Arrow arrays.

BLOB was chosen over LIST and fixed-size ARRAY columns by measurement (docs/storage.md):
ARRAY is capped at 100,000 elements in DuckDB 2.0 and LIST ingests ~9x slower.

>>> import numpy as np
>>> arr = encode_payloads([np.arange(3, dtype=np.float32), np.ones(2, dtype=np.float32)])
>>> [c.tolist() for c in decode_payloads(arr, "float32", [(3,), (2,)])]
[[0.0, 1.0, 2.0], [1.0, 1.0]]
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import torch

from tensorql.dtypes import itemsize, numpy_dtype, torch_dtype

_VIEW_AS = {"bfloat16": np.dtype(np.int16)}


def chunk_bytes(chunk: np.ndarray | torch.Tensor) -> np.ndarray:
    """The chunk's bytes as a flat uint8 array (no copy when already contiguous)."""
    if isinstance(chunk, torch.Tensor):
        # (a negative or conjugate view's bit resolved: numpy reads the raw storage)
        chunk = chunk.detach().cpu().resolve_neg().resolve_conj().contiguous()
        if chunk.dtype == torch.bfloat16:
            chunk = chunk.view(torch.int16)
        chunk = chunk.numpy()
    chunk = np.asarray(chunk)
    if not chunk.flags.c_contiguous:
        chunk = chunk.copy(order="C")
    return chunk.reshape(-1).view(np.uint8)


def encode_payloads(chunks: Sequence[np.ndarray | torch.Tensor]) -> pa.LargeBinaryArray:
    """One Arrow large-binary array holding every chunk's bytes (one copy, no Python loop
    over elements)."""
    parts = [chunk_bytes(c) for c in chunks]
    sizes = np.fromiter((p.size for p in parts), dtype=np.int64, count=len(parts))
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    data = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    return pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), len(parts), [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )


def _binary_parts(column: pa.Array | pa.ChunkedArray):
    """(offsets, data buffer) of each Arrow chunk of a binary column."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    for arr in chunks:
        width = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
        offsets = np.frombuffer(arr.buffers()[1], dtype=width)[arr.offset:arr.offset + len(arr) + 1]
        yield offsets, arr.buffers()[2]


def view_bytes(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A torch tensor of ``dtype`` and ``shape`` viewing the flat uint8 array ``raw`` (no copy;
    the memory may be read-only: tensorql never writes into input chunks)."""
    tdtype = torch_dtype(dtype)
    if raw.size == 0:
        return torch.empty(shape, dtype=tdtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers are fine here
        flat = torch.from_numpy(raw.view(_VIEW_AS.get(dtype, numpy_dtype(dtype))))
    if dtype == "bfloat16":
        flat = flat.view(torch.bfloat16)
    return flat.reshape(shape)


def decode_payloads(column: pa.Array | pa.ChunkedArray, dtype: str,
                    shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Torch tensors viewing the Arrow buffers of ``column`` (zero-copy, read-only memory:
    tensorql never writes into input chunks)."""
    out: list[torch.Tensor] = []
    size = itemsize(dtype)
    tdtype = torch_dtype(dtype)
    shape_iter = iter(shapes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers are fine here
        for offsets, data in _binary_parts(column):
            for start, stop in zip(offsets[:-1], offsets[1:]):
                shape = next(shape_iter)
                count = int(stop - start) // size
                if count == 0:
                    out.append(torch.empty(shape, dtype=tdtype))
                    continue
                raw = np.frombuffer(data, dtype=np.uint8, count=count * size,
                                    offset=int(start))
                flat = torch.from_numpy(raw.view(_VIEW_AS.get(dtype, numpy_dtype(dtype))))
                if dtype == "bfloat16":
                    flat = flat.view(torch.bfloat16)
                out.append(flat.reshape(shape))
    return out


def decode_values(column: pa.Array | pa.ChunkedArray, dtype: str) -> pa.Array:
    """A list array of each payload's values (for the element views); halfs widen to float."""
    values_dtype = numpy_dtype(dtype)
    lists = []
    for offsets, data in _binary_parts(column):
        raw = np.frombuffer(data, dtype=np.uint8)[offsets[0]:offsets[-1]]
        if dtype == "bfloat16":
            vals = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif dtype == "float16":
            vals = raw.view(np.float16).astype(np.float32)
        else:
            vals = raw.view(values_dtype)
        width = values_dtype.itemsize if dtype not in ("bfloat16", "float16") else 2
        starts = ((offsets - offsets[0]) // width).astype(np.int32)
        lists.append(pa.ListArray.from_arrays(pa.array(starts), pa.array(vals)))
    if len(lists) == 1:
        return lists[0]
    return pa.concat_arrays(lists)
