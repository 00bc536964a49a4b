"""Tensors as relations and back: element rows ``(label..., val)`` <-> dense tensors.

A relation used as an EINSUM operand is a sparse tensor with relational meaning: one integer
column per label plus ``val``; an absent row does not join. It is densified with the semiring's
zero in absent cells (:func:`absent_value`: 0 for sum of products, +inf for (min,+), -inf for
(max,+)) plus a mask of the cells that have rows; duplicate coordinates combine with the
aggregation (they are two rows that both join).

>>> import torch
>>> rows = tensor_rows(torch.tensor([[1.0, 0.0], [0.0, 2.0]]), ("i", "j"))
>>> rows.column_names, rows.num_rows
(['i', 'j', 'val'], 4)
>>> rows_to_dense(rows.filter(rows["val"].to_numpy() != 0), ("i", "j"), (2, 2)).tolist()
[[1.0, 0.0], [0.0, 2.0]]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from tensorql.algebra import agg_record, join_record
from tensorql.errors import MemoryLimitError, ShapeError
from tensorql.options import available_memory_bytes
from tensorql.units import format_bytes

__all__ = ["DenseRelation", "absent_value", "densify", "filled_dtype", "label_columns",
           "order_columns", "rows_to_dense", "tensor_rows", "validate_indices", "value_dtype"]



def agg_identity(agg: str) -> float:
    """The aggregation's identity (what an empty group yields), from the algebra registry."""
    return agg_record(agg).identity


def absent_value(join: str, agg: str, operands: int) -> float | None:
    """What an absent row stands for: the aggregation's identity for a lone operand, else the
    semiring's zero; None when ``(join, agg)`` has no zero (an absent row could not be left
    out by any fill value), or when the lone operand's join is a function applied to each row
    (a one-parameter lambda: it would map the fill of an absent cell to something, and be
    applied to duplicates after they combine, not to each row).

    >>> absent_value("add", "min", 2), absent_value("mul", "sum", 2), absent_value("mul", "max", 1)
    (inf, 0.0, -inf)
    >>> absent_value("mul", "max", 2) is None
    True
    """
    if operands == 1:
        return None if join_record(join).arity == 1 else agg_record(agg).identity
    # the semiring's zero, which the join maps to the aggregation's identity whatever the
    # other operands hold
    return join_record(join).zero(agg)


@dataclass(frozen=True)
class DenseRelation:
    """A relation operand made dense: ``values`` (absent cells hold the fill) and ``present``
    (True where at least one row exists)."""

    values: torch.Tensor
    present: torch.Tensor


def order_columns(table: pa.Table, labels: Sequence[str]) -> list[str]:
    """The table's label columns in the order of ``labels``: matched by name when the names
    are exactly the labels, else by position (ShapeError when the counts differ)."""
    columns = label_columns(table)
    if len(columns) != len(labels):
        raise ShapeError(f"operand has {len(columns)} label column(s) {columns} but the "
                         f"equation gives it {len(labels)} label(s) {''.join(labels)!r}")
    lowered = [c.lower() for c in columns]
    if len(set(labels)) == len(labels) and sorted(lowered) == sorted(labels):
        by_label = {c.lower(): c for c in columns}
        return [by_label[label] for label in labels]
    return columns


def validate_indices(table: pa.Table, columns: Sequence[str]) -> list[int]:
    """Check that label columns hold non-negative integers without NULLs; the largest index of
    each (-1 for an empty relation)."""
    highest = []
    for name in columns:
        col = table.column(name)
        if not pa.types.is_integer(col.type):
            raise ShapeError(f"column {name!r} holds {col.type} values, but label columns must "
                             "be integers (cast them, e.g. i::BIGINT)")
        if col.null_count:
            raise ShapeError(f"column {name!r} has NULL indices")
        if len(col) == 0:
            highest.append(-1)
            continue
        low, high = pc.min(col).as_py(), pc.max(col).as_py()
        if low < 0:
            raise ShapeError(f"column {name!r} has index {low}: indices start at 0")
        highest.append(int(high))
    return highest


_SURELY_FITS_BYTES = 64 << 20  # a dense tensor this small is not checked against the system


def check_fits_in_memory(nbytes: int, shape: Sequence[int]) -> None:
    """MemoryLimitError, before allocating, when a dense tensor of ``nbytes`` (``shape``)
    is more than the memory this machine has available: densified rows with a large index
    (a position, so a large tensor) would otherwise be an allocation failure from torch or,
    where the system overcommits, a process swapping or killed while the zeros are written.

    >>> check_fits_in_memory(1 << 20, (1 << 18,))
    >>> try:
    ...     check_fits_in_memory(1 << 60, (1 << 57,))
    ... except MemoryLimitError as err:
    ...     print(str(err)[:71])
    a dense tensor of shape (144115188075855872,) takes 1048576.0 TiB, more
    """
    if nbytes <= _SURELY_FITS_BYTES:  # the common case: no /proc read on a query's path
        return
    available = available_memory_bytes()
    if nbytes > available:
        raise MemoryLimitError(
            f"a dense tensor of shape {tuple(int(n) for n in shape)} takes "
            f"{format_bytes(nbytes)}, more than the memory this machine has available "
            f"({format_bytes(available)}); give smaller sizes := or filter the rows (indices "
            "are positions, so a large index makes a large tensor)")


def densify(table: pa.Table, columns: Sequence[str], shape: Sequence[int], *, fill: float,
            agg: str, max_bytes: int | None) -> DenseRelation:
    """The relation as a dense tensor of ``shape`` with ``fill`` where no row exists and
    duplicates combined by ``agg``; refused with a ShapeError beyond ``max_bytes``.

    >>> t = pa.table({"i": [0, 2, 2], "val": [1.0, 5.0, 3.0]})
    >>> d = densify(t, ["i"], [4], fill=math.inf, agg="min", max_bytes=None)
    >>> d.values.tolist(), d.present.tolist()
    ([1.0, inf, 3.0, inf], [True, False, True, False])
    """
    val_name = next(n for n in table.column_names if n.lower() == "val")
    dtype = filled_dtype(table.column(val_name), fill)
    cells = math.prod(shape)
    need = cells * (torch.empty((), dtype=dtype).element_size() + 1)
    if max_bytes is not None and need > max_bytes:
        raise ShapeError(f"the relation operand would take {format_bytes(need)} once "
                         f"densified (shape {tuple(shape)}, {table.num_rows} row(s)), more "
                         f"than the limit of {format_bytes(max_bytes)} "
                         "(Options.relation_dense_bytes / "
                         "memory_limit); filter it, give smaller sizes := {...}, or store it "
                         "as a tensor")
    check_fits_in_memory(need, shape)
    val = table.column(val_name)
    if val.null_count:
        table = table.filter(pc.is_valid(val))
        val = table.column(val_name)
    validate_indices(table, columns)
    flat = np.zeros(table.num_rows, dtype=np.int64)
    for name, size in zip(columns, shape):
        idx = table.column(name).to_numpy().astype(np.int64, copy=False)
        if idx.size and idx.max() >= size:
            raise ShapeError(f"column {name!r} has index {int(idx.max())} outside "
                             f"0..{size - 1} (label size {size})")
        flat = flat * size + idx
    if not (pa.types.is_floating(val.type) or pa.types.is_integer(val.type)
            or pa.types.is_boolean(val.type)):
        val = val.cast(pa.float64())
    values = torch.from_numpy(np.array(val.to_numpy(zero_copy_only=False))).to(dtype)
    out = torch.full((cells,), fill, dtype=dtype)
    present = torch.zeros(cells, dtype=torch.bool)
    if values.numel():
        index = torch.from_numpy(flat)
        _scatter(out, index, values, agg)
        present[index] = True
    return DenseRelation(values=out.reshape(tuple(shape)),
                         present=present.reshape(tuple(shape)))


def _scatter(out: torch.Tensor, index: torch.Tensor, values: torch.Tensor, agg: str) -> None:
    """Fold ``values`` into ``out[index]`` with the aggregation (duplicates combine): torch's
    ``scatter_reduce`` where it has the aggregation, else the aggregation's binary function
    applied in rounds, one value per cell each.

    >>> out = torch.zeros(2)
    >>> _scatter(out, torch.tensor([1, 1, 0]), torch.tensor([2.0, 3.0, 4.0]), "sum")
    >>> out.tolist()
    [4.0, 5.0]
    """
    record = agg_record(agg)
    if record.scatter is not None:
        out.scatter_reduce_(0, index, values, reduce=record.scatter, include_self=True)
        return
    order = torch.argsort(index, stable=True)
    index, values = index[order], values[order]
    starts = torch.ones_like(index, dtype=torch.bool)
    starts[1:] = index[1:] != index[:-1]
    first = torch.cummax(torch.where(starts, torch.arange(len(index)), 0), dim=0).values
    rank = torch.arange(len(index)) - first
    for r in range(int(rank.max()) + 1 if len(rank) else 0):
        pick = rank == r
        out[index[pick]] = record.combine(out[index[pick]], values[pick])


def filled_dtype(column: pa.ChunkedArray | pa.Array, fill: float | None) -> torch.dtype:
    """The dtype a relation's ``val`` column takes as an operand: its own (see
    :func:`value_dtype`), but float64 for booleans and for integers where absent cells hold
    +-inf (``fill``; None: no fill).

    >>> filled_dtype(pa.array([1, 2]), math.inf), filled_dtype(pa.array([1, 2]), 0.0)
    (torch.float64, torch.int64)
    """
    dtype = value_dtype(column)
    if dtype == torch.bool or (fill is not None and math.isinf(fill)
                               and not dtype.is_floating_point):
        return torch.float64
    return dtype


def tensor_rows(tensor: torch.Tensor, labels: Sequence[str]) -> pa.Table:
    """One row per element of ``tensor``: int64 label columns in C order, then ``val``."""
    tensor = tensor.detach().cpu()
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.to(torch.float32)
    shape = tuple(tensor.shape)
    if len(labels) != len(shape):
        raise ShapeError(f"{len(labels)} label(s) {tuple(labels)} for a {len(shape)}-d tensor")
    columns: dict[str, pa.Array] = {}
    n = int(np.prod(shape, dtype=np.int64))
    flat = np.arange(n, dtype=np.int64)
    for d, label in enumerate(labels):
        stride = int(np.prod(shape[d + 1:], dtype=np.int64))
        columns[label] = pa.array((flat // stride) % shape[d])
    columns["val"] = pa.array(tensor.contiguous().reshape(-1).numpy())
    return pa.table(columns)


def label_columns(table: pa.Table) -> list[str]:
    """The columns of an element relation other than ``val`` (ShapeError if it has no val)."""
    names = table.column_names
    if not any(n.lower() == "val" for n in names):
        raise ShapeError(f"a tensor relation needs a 'val' column; got columns {names}")
    lowered = [n.lower() for n in names]
    twice = sorted({n for n in lowered if lowered.count(n) > 1})
    if twice:
        raise ShapeError(f"column {twice[0]!r} appears {lowered.count(twice[0])} times in "
                         f"{names}; give every label column and 'val' one distinct name")
    return [n for n in names if n.lower() != "val"]


def value_dtype(column: pa.ChunkedArray | pa.Array) -> torch.dtype:
    """The torch dtype a ``val`` column becomes (decimals become float64); ShapeError for a
    column that holds no numbers (text, dates, lists, intervals, ...) and for unsigned 64-bit
    values beyond int64."""
    kind = column.type
    if pa.types.is_uint64(kind) and len(column) and column.null_count < len(column) and \
            pc.max(column).as_py() > np.iinfo(np.int64).max:
        raise ShapeError(f"'val' holds the UBIGINT value {pc.max(column).as_py()}, beyond "
                         "int64; cast it to DOUBLE or keep values below 2**63")
    if not (pa.types.is_floating(kind) or pa.types.is_integer(kind)
            or pa.types.is_boolean(kind) or pa.types.is_decimal(kind)
            or pa.types.is_null(kind)):
        raise ShapeError(f"'val' holds {kind}, not numbers; a tensor's values must be "
                         "numeric (cast it, e.g. val::DOUBLE)")
    if pa.types.is_float32(kind) or pa.types.is_float16(kind):
        return torch.float32
    if pa.types.is_floating(kind):
        return torch.float64
    if pa.types.is_integer(kind):
        return torch.int64
    if pa.types.is_boolean(kind):
        return torch.bool
    return torch.float64


def rows_to_dense(table: pa.Table, labels: Sequence[str], shape: Sequence[int],
                  dtype: torch.dtype | None = None, max_bytes: int | None = None) -> torch.Tensor:
    """The dense tensor of an element relation whose label columns are ``labels`` (in the
    tensor's dim order); missing coordinates are zero, duplicates add up, null ``val`` rows are
    skipped. ShapeError for non-integer label columns, nulls in them or indices out of range;
    MemoryLimitError, before allocating, when the dense tensor would exceed ``max_bytes``."""
    val_name = next(n for n in table.column_names if n.lower() == "val")
    val = table.column(val_name)
    dtype = dtype or value_dtype(val)
    nbytes = math.prod(int(n) for n in shape) * torch.empty((), dtype=dtype).element_size()
    if max_bytes is not None and nbytes > max_bytes:
        raise MemoryLimitError(
            f"densifying this relation takes {format_bytes(nbytes)} (shape "
            f"{tuple(int(n) for n in shape)}) but this process may hold "
            f"{format_bytes(max_bytes)} (Options.process_memory_limit); give smaller "
            "sizes := or filter the rows (indices are positions, so a large index makes a "
            "large tensor)")
    if val.null_count:
        table = table.filter(pc.is_valid(val))
        val = table.column(val_name)
    index = []
    for label, size in zip(labels, shape):
        col = table.column(label)
        if not pa.types.is_integer(col.type):
            raise ShapeError(f"column {label!r} holds {col.type}, but label columns must be "
                             "integers")
        if col.null_count:
            raise ShapeError(f"column {label!r} has NULL indices")
        idx = np.array(col.to_numpy(), dtype=np.int64)  # writable: torch needs that
        if idx.size and (idx.min() < 0 or idx.max() >= size):
            bad = int(idx.min()) if idx.min() < 0 else int(idx.max())
            raise ShapeError(f"column {label!r} has index {bad} outside 0..{size - 1} "
                             f"(label size {size})")
        index.append(torch.from_numpy(idx))
    if pa.types.is_decimal(val.type) or not (pa.types.is_floating(val.type)
                                              or pa.types.is_integer(val.type)
                                              or pa.types.is_boolean(val.type)):
        val = val.cast(pa.float64())
    values = torch.from_numpy(np.array(val.to_numpy(zero_copy_only=False))).to(dtype)
    check_fits_in_memory(nbytes, shape)
    out = torch.zeros(tuple(shape), dtype=dtype)
    if not index:  # no label columns: a scalar, the rows added up
        return (values.any() if dtype == torch.bool else values.sum()).to(dtype) \
            if values.numel() else out
    if values.numel():
        if dtype == torch.bool or (dtype.is_floating_point and _distinct_cells(index, shape)):
            # one float row a cell: its bits as they are (0.0 + -0.0 would be 0.0); integers
            # come out the same added, with no uniqueness sort
            out.index_put_(tuple(index), values)
        else:
            out.index_put_(tuple(index), values, accumulate=True)
    return out


def _distinct_cells(index: Sequence[torch.Tensor], shape: Sequence[int]) -> bool:
    """Whether the rows' coordinates (``index``: one int64 tensor a dim) name distinct cells.

    >>> _distinct_cells([torch.tensor([0, 1, 1]), torch.tensor([2, 2, 0])], (2, 3))
    True
    >>> _distinct_cells([torch.tensor([0, 0]), torch.tensor([1, 1])], (2, 3))
    False
    """
    flat = torch.zeros_like(index[0])
    for idx, size in zip(index, shape):
        flat = flat * int(size) + idx
    return int(torch.unique(flat).numel()) == int(flat.numel())
