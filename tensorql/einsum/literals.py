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

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tensorql.dtypes import canonical_dtype
from tensorql.einsum.graph import Constant
from tensorql.errors import ShapeError, UnsupportedError
from tensorql.grid import CPU_TILE_ELEMS, ChunkGrid, auto_tile

__all__ = ["constant_node", "literal_array"]

# torch dtypes numpy reads (bfloat16 and the 8-bit floats it does not)
_NUMPY_READABLE = frozenset({torch.float16, torch.float32, torch.float64, torch.int8,
                             torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
                             torch.complex64, torch.complex128})


def literal_array(value: Any) -> np.ndarray:
    """``value`` (a scalar, nested lists, an array) as a numpy array of a supported dtype;
    ShapeError for None, ragged lists and dtypes tensorql cannot compute with (str, object,
    datetime, ...).

    >>> literal_array(2.0).shape, literal_array([[1, 2], [3, 4]]).dtype.name
    ((), 'int64')
    >>> literal_array(np.ones(2, ">f4")).dtype.isnative
    True
    >>> literal_array([[1], [1, 2]])
    Traceback (most recent call last):
    ...
    tensorql.errors.ShapeError: cannot read [[1], [1, 2]] as an array: ragged nested sequences...
    """
    if value is None:
        raise ShapeError("None is not a tensor; pass an array, a number or a tensorql Tensor")
    if isinstance(value, torch.Tensor):  # its values (a parameter's too), on the host
        if value.dtype not in _NUMPY_READABLE:
            raise UnsupportedError(f"a torch tensor of {value.dtype} has no numpy form; "
                                   "pass it to from_torch (or constant) instead")
        value = value.detach().cpu()
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as err:
        raise ShapeError(f"cannot read {_short(value)} as an array: ragged nested sequences "
                         f"or mixed types ({err})") from None
    if array.dtype == object:
        raise ShapeError(f"cannot read {_short(value)} as an array of numbers: it holds "
                         "Python objects (None, strings or ragged sequences)")
    canonical_dtype(array.dtype)  # ShapeError names the unsupported dtype
    if not array.dtype.isnative:  # big-endian ('>f4'): torch takes native byte order only
        array = array.astype(array.dtype.newbyteorder("="))
    return array


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def constant_node(value: Any, tile_target_elems: int = CPU_TILE_ELEMS,
                  tile: Sequence[int] | None = None) -> Constant:
    """A ``Constant`` holding ``value`` (torch tensor, numpy array or Python scalars/lists),
    chunked on ``tile`` (default: automatic tiles of about ``tile_target_elems`` elements).

    Python floats become float32 (as in torch); numpy arrays and numpy scalars keep their dtype
    (``np.float64(0.1)`` stays float64, as numpy's promotion rules treat it). Read-only numpy
    arrays are copied, so torch never sees a non-writable buffer.

    >>> constant_node(np.zeros((4, 6)), tile=(2, 6)).grid.blocks
    (2, 1)
    >>> constant_node(np.float64(0.1)).dtype, constant_node(0.1).dtype
    ('float64', 'float32')
    >>> constant_node(np.ones((1, 3))[::-1]).value.stride()
    (3, 1)
    """
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            raise UnsupportedError("a tensor on the meta device has no values to compute with")
        if value.layout != torch.strided:
            raise UnsupportedError(f"a {str(value.layout)[6:]} tensor is not an operand as "
                                   "such; pass tensor.to_dense()")
        data = value.detach().cpu()
    else:
        array = literal_array(value)
        if array.dtype == np.float64 and not isinstance(value, (np.ndarray, np.generic)):
            array = array.astype(np.float32)  # Python floats become float32, like torch
        if not array.flags.writeable or not array.flags.c_contiguous \
                or any(stride < 0 for stride in array.strides):  # numpy calls a[::-1] of one
            array = array.copy(order="C")  # element C-contiguous; torch refuses its stride
        data = torch.from_numpy(array)
    dtype = canonical_dtype(data.dtype)
    if tile is None:
        tile = auto_tile(data.shape, tile_target_elems)
    elif len(tile) != data.ndim:
        raise ShapeError(f"tile {tuple(tile)} does not fit a constant of shape "
                         f"{tuple(data.shape)}: one tile size >= 1 per dimension")
    grid = ChunkGrid(tuple(data.shape), tuple(int(t) for t in tile))  # cut to the shape
    return Constant(shape=tuple(data.shape), dtype=dtype, value=data, grid=grid)
