"""Graph leaves made from in-memory values: a ``Constant`` node with an automatic tile.

Both faces (the Python API and SQL) turn arrays into constants the same way.

>>> import numpy as np
>>> node = constant_node(np.ones((3, 2)))
>>> node.shape, node.dtype, node.grid.tile
((3, 2), 'float64', (3, 2))
>>> constant_node([[1.5, 2.0]]).dtype  # Python floats become float32, as in torch
'float32'

"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tensorql.dtypes import canonical_dtype
from tensorql.einsum.graph import Constant
from tensorql.grid import ChunkGrid, auto_tile

__all__ = ["constant_node"]


def constant_node(value: Any, tile_target_elems: int = 1 << 20) -> Constant:
    """A ``Constant`` holding ``value`` (torch tensor, numpy array or Python scalars/lists).

    Python floats become float32 (as in torch); numpy arrays keep their dtype. Read-only numpy
    arrays are copied, so torch never sees a non-writable buffer.
    """
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu()
    else:
        array = np.asarray(value)
        if array.dtype == np.float64 and not isinstance(value, np.ndarray):
            array = array.astype(np.float32)  # Python floats become float32, like torch
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = array.copy(order="C")
        data = torch.from_numpy(array)
    dtype = canonical_dtype(data.dtype)
    grid = ChunkGrid(tuple(data.shape), auto_tile(data.shape, tile_target_elems))
    return Constant(shape=tuple(data.shape), dtype=dtype, value=data, grid=grid)
