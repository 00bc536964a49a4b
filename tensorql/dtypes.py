"""The dtypes tensorql stores and computes with, and their torch / numpy counterparts.

Canonical names are strings (``"float32"``); bfloat16 has no numpy dtype, so numpy views of it
use raw ``uint16`` bits.

>>> canonical_dtype("f4"), canonical_dtype(torch.bfloat16)
('float32', 'bfloat16')
>>> itemsize("float16")
2
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tensorql.errors import DTypeError

SUPPORTED = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32",
             "int64", "bool")

_TORCH = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,  # numpy's uint8 + int8
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_FROM_TORCH = {v: k for k, v in _TORCH.items()}
_ITEMSIZE = {k: torch.empty((), dtype=v).element_size() for k, v in _TORCH.items()}


def canonical_dtype(dtype: Any) -> str:
    """The canonical name of a numpy / torch dtype or dtype string; DTypeError if unsupported."""
    if isinstance(dtype, torch.dtype):
        name = _FROM_TORCH.get(dtype)
    elif isinstance(dtype, str) and dtype in _TORCH:
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except (TypeError, ValueError):  # not a dtype (numpy's ValueError: an object with
            name = None  # a ``.dtype`` attribute numpy cannot read, e.g. a Tensor)
    if name not in _TORCH:
        raise DTypeError(
            f"unsupported dtype {dtype!r}; supported: {', '.join(SUPPORTED)}"
        )
    return name


class DTypeName(str):
    """A dtype's canonical name (a ``str``, hashing as one) that also equals numpy's and
    torch's spellings of the same dtype, so numpy habits hold on a tensor's ``.dtype``.

    >>> import numpy as np, torch
    >>> name = DTypeName("float32")
    >>> name == "float32", name == np.float32, name == np.dtype("float32"), name == torch.float32
    (True, True, True, True)
    >>> name == np.float64, name != np.float64, {name: 1}["float32"], np.dtype(name)
    (False, True, 1, dtype('float32'))
    >>> DTypeName("bfloat16") == torch.bfloat16
    True
    """

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return str.__eq__(self, other)
        try:
            return str.__eq__(self, canonical_dtype(other))
        except (DTypeError, TypeError):
            return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = str.__hash__


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a canonical name (a dict look-up for a canonical name: kernels ask
    for it on every call, a decoded token's ~200 small kernels among them).

    >>> torch_dtype("float32"), torch_dtype(np.float64)
    (torch.float32, torch.float64)
    """
    found = _TORCH.get(name) if isinstance(name, str) else None
    return found if found is not None else _TORCH[canonical_dtype(name)]


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype used to hold ``name`` (uint16 bits for bfloat16)."""
    name = canonical_dtype(name)
    return np.dtype("uint16") if name == "bfloat16" else np.dtype(name)


def itemsize(name: str) -> int:
    """Bytes per element."""
    return _ITEMSIZE[canonical_dtype(name)]


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy array sharing ``t``'s memory (bfloat16 comes back as float32, a copy)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.float().numpy()
    return t.numpy()
