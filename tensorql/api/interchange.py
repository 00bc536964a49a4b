"""Tensors in from other libraries: DLPack (any tensor that exports it: torch, numpy, JAX,
CuPy, another tensorql tensor), Arrow arrays and tables, pandas DataFrames.

Arrow and pandas hold columns; a tensor here is a numeric array without nulls: an Arrow
array or a pandas Series is one dimension, a table or DataFrame of numeric columns two
(rows x columns, in column order, numpy's common dtype of the columns), Arrow's
fixed-shape tensor arrays and ``pyarrow.Tensor`` keep their shape. Anything else is an
error naming the column and what to do.

>>> import pyarrow as pa, tensorql as tq
>>> db = tq.connect()
>>> db.from_arrow("t", pa.table({"x": [1.0, 2.0], "y": [3, 4]})).numpy().tolist()
[[1.0, 3.0], [2.0, 4.0]]
>>> import torch
>>> tq.from_dlpack(db, "d", torch.arange(3)).numpy().tolist()
[0, 1, 2]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tensorql.errors import DTypeError, UnsupportedError

if TYPE_CHECKING:
    from tensorql.api.database import Database
    from tensorql.api.tensor import Tensor

__all__ = ["arrow_to_numpy", "from_dlpack", "pandas_to_numpy"]


def from_dlpack(db: Database, name: str, tensor: Any, tile: Any = None, *,
                replace: bool = False) -> Tensor:
    """Store ``tensor``, any object exporting DLPack (``__dlpack__``: torch, numpy, JAX,
    CuPy, a tensorql tensor), under ``name`` in ``db``, without a copy on the way in (the
    store copies its chunks); UnsupportedError for an object that does not export it."""
    from tensorql.api.database import Database

    if not isinstance(db, Database):
        raise UnsupportedError(f"from_dlpack: the first argument is the session to store in "
                               f"(tq.connect()), not {type(db).__name__}")
    if not hasattr(tensor, "__dlpack__"):
        raise UnsupportedError(f"from_dlpack: {type(tensor).__name__} does not export DLPack "
                               "(it has no __dlpack__); use db.from_numpy / db.from_torch")
    if isinstance(tensor, np.ndarray):  # numpy's own way in: a view with negative strides
        return db.from_numpy(name, tensor, tile, replace=replace)  # aborted torch's import
    if isinstance(tensor, torch.Tensor):  # torch's own way in: its DLPack export drops a
        # negative view's bit (torch.conj(c).imag came back negated) and refuses a tensor
        # that requires grad
        return db.from_torch(name, tensor, tile, replace=replace)
    try:
        imported = torch.from_dlpack(tensor)
    except (AssertionError, BufferError, NotImplementedError, RuntimeError, TypeError,
            ValueError) as err:  # a dtype, layout or device torch cannot take
        raise UnsupportedError(f"from_dlpack: torch cannot import this "  # DLPack lacks
                               f"{type(tensor).__name__}: {err}") from None
    return db.from_torch(name, imported, tile, replace=replace)


def arrow_to_numpy(data: Any) -> np.ndarray:
    """The numeric Arrow ``data`` as a numpy array: an array or chunked array (1-D), a
    fixed-shape tensor array (its shape with the rows first), a ``pyarrow.Tensor``, a table
    or record batch of numeric columns (2-D: rows x columns).

    >>> import pyarrow as pa
    >>> arrow_to_numpy(pa.chunked_array([[1, 2], [3]])).tolist()
    [1, 2, 3]
    """
    import pyarrow as pa  # here, not at import: pyarrow's allocator set-up is not every user's

    if isinstance(data, pa.Tensor):
        return data.to_numpy()
    if isinstance(data, (pa.Table, pa.RecordBatch)):
        columns = [_column(data.column(k), data.column_names[k])
                   for k in range(data.num_columns)]
        if not columns:
            raise UnsupportedError("from_arrow: the table has no columns")
        return np.stack(columns, axis=1) if data.num_rows else \
            np.zeros((0, len(columns)), dtype=np.result_type(*columns))
    if isinstance(data, (pa.Array, pa.ChunkedArray)):
        return _column(data, None)
    raise UnsupportedError(f"from_arrow takes a pyarrow Array, ChunkedArray, Table, "
                           f"RecordBatch or Tensor, not {type(data).__name__}")


def _column(column: Any, name: str | None) -> np.ndarray:
    import pyarrow as pa

    what = "the array" if name is None else f"column {name!r}"
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if column.null_count:
        raise UnsupportedError(f"from_arrow: {what} holds {column.null_count} null(s); a "
                               "tensor has none: fill them first (pyarrow.compute.fill_null)")
    if isinstance(column.type, pa.FixedShapeTensorType):
        return column.to_numpy_ndarray()
    kind = column.type
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)
            or pa.types.is_boolean(kind)):
        raise DTypeError(f"from_arrow: {what} is {kind}, not numeric; a tensor holds "
                         "integers, floats or bools (select the numeric columns)")
    return column.to_numpy(zero_copy_only=False)


def pandas_to_numpy(frame: Any) -> np.ndarray:
    """A pandas DataFrame of numeric (or bool) columns as a 2-D array (rows x columns, numpy's
    common dtype), a Series as 1-D; DTypeError naming a column that is not numeric,
    UnsupportedError for missing values in a nullable column."""
    try:
        import pandas as pd
    except ImportError:  # then ``frame`` is no pandas object either
        pd = None
    if pd is None or not isinstance(frame, (pd.DataFrame, pd.Series)):
        raise UnsupportedError(f"from_pandas takes a pandas DataFrame or Series, not "
                               f"{type(frame).__name__} (use db.from_numpy for an array)")
    # by position: a repeated column name is two columns (frame[name] would be a frame)
    columns = [frame] if frame.ndim == 1 else [frame.iloc[:, k] for k in range(frame.shape[1])]
    for column in columns:
        what = "the Series" if frame.ndim == 1 else f"column {column.name!r}"
        kind = column.dtype
        as_numpy = kind if isinstance(kind, np.dtype) else getattr(kind, "numpy_dtype", None)
        if as_numpy is None or np.dtype(as_numpy).kind not in "biuf":
            raise DTypeError(f"from_pandas: {what} is {kind}, not numeric; a tensor holds "
                             "integers, floats or bools (select the numeric columns)")
        if not isinstance(kind, np.dtype) and bool(column.isna().any()):  # a nullable dtype
            raise UnsupportedError(f"from_pandas: {what} holds missing values; a tensor has "
                                   "none: fill them first (fillna)")
    if frame.ndim == 1:
        return np.asarray(frame.to_numpy(dtype=_numpy_kind(frame.dtype)))
    if not len(frame.columns):
        raise UnsupportedError("from_pandas: the DataFrame has no columns")
    common = np.result_type(*(_numpy_kind(kind) for kind in frame.dtypes))
    return np.ascontiguousarray(frame.to_numpy(dtype=common))


def _numpy_kind(kind: Any) -> np.dtype:
    """The numpy dtype of a pandas dtype (a nullable ``Int64`` is int64)."""
    return kind if isinstance(kind, np.dtype) else np.dtype(kind.numpy_dtype)
