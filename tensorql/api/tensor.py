"""Lazy tensors: operators build an einsum graph; nothing runs until a result is asked for.

>>> import numpy as np, tensorql as tq
>>> db = tq.connect()
>>> x = db.from_numpy("x", np.arange(6.0).reshape(2, 3))
>>> y = (x * 2 + 1).sum(axis=1)          # still lazy
>>> y.shape, y.numpy().tolist()
((2,), [9.0, 27.0])
"""

from __future__ import annotations

import numbers
import string
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tensorql.dtypes import to_numpy
from tensorql.einsum.graph import EinsumOp, MapOp, Node
from tensorql.errors import ShapeError, TensorQLError

if TYPE_CHECKING:
    from tensorql.api.database import Database
    from tensorql.pipeline import CompiledQuery

_LETTERS = string.ascii_lowercase + string.ascii_uppercase


class Tensor:
    """A lazy tensor: a node of the einsum graph bound to the database that will run it."""

    __array_priority__ = 1000  # numpy defers to our operators

    def __init__(self, node: Node, db: Database) -> None:
        self.node = node
        self.db = db

    # -- description -----------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.node.shape

    @property
    def dtype(self) -> str:
        return self.node.dtype

    @property
    def ndim(self) -> int:
        return self.node.ndim

    def __repr__(self) -> str:
        return f"<tensorql.Tensor {self.node.describe()} shape={self.shape} dtype={self.dtype}>"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    # -- running -----------------------------------------------------------------------
    def compile(self) -> CompiledQuery:
        """The planned query (cached until the database's stored tensors or options change)."""
        from tensorql.pipeline import CompiledQuery

        stamp = (self.db.generation, self.db.options)
        cached = getattr(self, "_compiled", None)
        if cached is None or cached[0] != stamp:
            cached = (stamp, CompiledQuery.compile(self.node, self.db))
            self._compiled = cached
        return cached[1]

    def torch(self, progress: Any = None) -> torch.Tensor:
        """Compute and return a dense torch tensor."""
        return self.compile().run(progress=progress, dense=True).dense()

    def numpy(self, progress: Any = None) -> np.ndarray:
        """Compute and return a dense numpy array (bfloat16 comes back as float32)."""
        return to_numpy(self.torch(progress=progress))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.numpy()
        return out.astype(dtype) if dtype is not None else out

    def explain(self, analyze: bool = False, stage: str | None = None) -> str:
        """The plan as text; ``analyze=True`` runs it and adds measured figures. ``stage``
        shows one stage of the chain: "einsum", "logical", "partition", "physical" or
        "memory" (see ``tensorql.pipeline.STAGES``)."""
        return self.compile().explain(analyze=analyze, stage=stage)

    # -- building blocks -----------------------------------------------------------------
    def _wrap(self, node: Node) -> Tensor:
        return Tensor(node, self.db)

    def _operand(self, other: Any) -> Tensor:
        if isinstance(other, Tensor):
            if other.db is not self.db:
                raise TensorQLError("cannot combine tensors of two different databases")
            return other
        return self.db.constant(other)

    def _elementwise(self, other: Any, join: str, reverse: bool = False) -> Tensor:
        if isinstance(other, numbers.Number) and not isinstance(other, bool):
            value = other
            if join == "add":
                return self._map("shift", value)
            if join == "mul":
                return self._map("scale", value)
            if join == "sub":
                return self._map("rsub", value) if reverse else self._map("shift", -value)
            if join == "div":
                return self._map("rdiv", value) if reverse else self._map("scale", 1.0 / value)
            if join in ("max", "min"):
                return self._map("maximum" if join == "max" else "minimum", value)
        other_t = self._operand(other)
        left, right = (other_t, self) if reverse else (self, other_t)
        return broadcast_binary(left, right, join)

    def _map(self, fn: str, scalar: float | None = None) -> Tensor:
        return self._wrap(MapOp.build(fn, self.node, scalar))

    def __add__(self, other: Any) -> Tensor:
        return self._elementwise(other, "add")

    def __radd__(self, other: Any) -> Tensor:
        return self._elementwise(other, "add", reverse=True)

    def __sub__(self, other: Any) -> Tensor:
        return self._elementwise(other, "sub")

    def __rsub__(self, other: Any) -> Tensor:
        return self._elementwise(other, "sub", reverse=True)

    def __mul__(self, other: Any) -> Tensor:
        return self._elementwise(other, "mul")

    def __rmul__(self, other: Any) -> Tensor:
        return self._elementwise(other, "mul", reverse=True)

    def __truediv__(self, other: Any) -> Tensor:
        return self._elementwise(other, "div")

    def __rtruediv__(self, other: Any) -> Tensor:
        return self._elementwise(other, "div", reverse=True)

    def __neg__(self) -> Tensor:
        return self._map("neg")

    def __pow__(self, exponent: float) -> Tensor:
        if not isinstance(exponent, numbers.Number):
            raise ShapeError("only scalar exponents are supported")
        return self._map("square") if exponent == 2 else self._map("pow", float(exponent))

    def __matmul__(self, other: Any) -> Tensor:
        return matmul(self, self._operand(other))

    def __rmatmul__(self, other: Any) -> Tensor:
        return matmul(self._operand(other), self)

    def maximum(self, other: Any) -> Tensor:
        return self._elementwise(other, "max")

    def minimum(self, other: Any) -> Tensor:
        return self._elementwise(other, "min")

    def exp(self) -> Tensor:
        return self._map("exp")

    def log(self) -> Tensor:
        return self._map("log")

    def relu(self) -> Tensor:
        return self._map("relu")

    def sqrt(self) -> Tensor:
        return self._map("sqrt")

    def rsqrt(self) -> Tensor:
        return self._map("rsqrt")

    def tanh(self) -> Tensor:
        return self._map("tanh")

    def sigmoid(self) -> Tensor:
        return self._map("sigmoid")

    def silu(self) -> Tensor:
        return self._map("silu")

    def abs(self) -> Tensor:
        return self._map("abs")

    # -- reductions and layout -------------------------------------------------------------
    def _reduce(self, axis: int | Sequence[int] | None, agg: str, keepdims: bool) -> Tensor:
        axes = _normalize_axes(axis, self.ndim)
        labels = _LETTERS[: self.ndim]
        out = "".join(lab for d, lab in enumerate(labels) if d not in axes)
        result = self._wrap(EinsumOp.build(f"{labels}->{out}", [self.node], agg=agg))
        if keepdims:
            shape = tuple(1 if d in axes else n for d, n in enumerate(self.shape))
            result = result.reshape(shape)
        return result

    def sum(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return self._reduce(axis, "sum", keepdims)

    def max(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return self._reduce(axis, "max", keepdims)

    def min(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return self._reduce(axis, "min", keepdims)

    def prod(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return self._reduce(axis, "prod", keepdims)

    def mean(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        axes = _normalize_axes(axis, self.ndim)
        count = 1
        for d in axes:
            count *= self.shape[d]
        return self._reduce(axis, "sum", keepdims) * (1.0 / count)

    def softmax(self, axis: int = -1) -> Tensor:
        """exp(x - max) / sum(exp(x - max)) along ``axis``, as four einsums and a map."""
        (axis,) = _normalize_axes(axis, self.ndim)
        labels = _LETTERS[: self.ndim]
        kept = labels.replace(labels[axis], "")
        peak = EinsumOp.build(f"{labels}->{kept}", [self.node], agg="max")
        shifted = EinsumOp.build(f"{labels},{kept}->{labels}", [self.node, peak], join="sub")
        exps = MapOp.build("exp", shifted)
        total = EinsumOp.build(f"{labels}->{kept}", [exps], agg="sum")
        return self._wrap(EinsumOp.build(f"{labels},{kept}->{labels}", [exps, total],
                                         join="div"))

    def transpose(self, *axes: int) -> Tensor:
        if not axes:
            axes = tuple(reversed(range(self.ndim)))
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        if sorted(_normalize_axes(axes, self.ndim)) != list(range(self.ndim)) or \
                len(axes) != self.ndim:
            raise ShapeError(f"axes {axes} are not a permutation of {self.ndim} dims")
        labels = _LETTERS[: self.ndim]
        out = "".join(labels[a % self.ndim] for a in axes)
        return self._wrap(EinsumOp.build(f"{labels}->{out}", [self.node]))

    @property
    def T(self) -> Tensor:  # noqa: N802 - numpy's name
        return self.transpose()

    def reshape(self, shape: Sequence[int]) -> Tensor:
        """Only inserting or removing size-1 dims is lazy; other reshapes are not supported."""
        shape = tuple(int(n) for n in shape)
        if [n for n in shape if n != 1] != [n for n in self.shape if n != 1]:
            raise ShapeError(f"cannot reshape {self.shape} to {shape}: only size-1 dims "
                             "may be added or removed")
        if shape == self.shape:
            return self
        src = _LETTERS[: self.ndim]
        big = [lab for lab, n in zip(src, self.shape) if n != 1]
        fresh = iter(_LETTERS[self.ndim:])
        kept = iter(big)
        out = "".join(next(kept) if n != 1 else next(fresh) for n in shape)
        squeeze_sum = EinsumOp.build(f"{src}->{''.join(big)}", [self.node])
        if len(shape) == len(big):
            return self._wrap(squeeze_sum)
        ones = self.db.constant(np.ones([1] * (len(shape) - len(big)),
                                        dtype=np.float32)).node
        one_labels = "".join(c for c, n in zip(out, shape) if n == 1 and c not in big)
        return self._wrap(EinsumOp.build(f"{''.join(big)},{one_labels}->{out}",
                                         [squeeze_sum, _cast_const(ones, self.dtype, self.db)]))


def _cast_const(node: Node, dtype: str, db: Database) -> Node:
    from tensorql.dtypes import torch_dtype

    return db.constant(node.value.to(torch_dtype(dtype))).node


def _normalize_axes(axis: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, numbers.Integral) else tuple(axis)
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ShapeError(f"axis {a} is out of range for a {ndim}-d tensor")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ShapeError(f"repeated axis in {axis}")
    return tuple(out)


def broadcast_binary(left: Tensor, right: Tensor, join: str) -> Tensor:
    """``left JOIN right`` elementwise with numpy broadcasting, as one einsum."""
    ndim = max(left.ndim, right.ndim)
    labels = _LETTERS[:ndim]
    for dim in range(1, ndim + 1):
        a = left.shape[-dim] if dim <= left.ndim else 1
        b = right.shape[-dim] if dim <= right.ndim else 1
        if a != b and 1 not in (a, b):
            raise ShapeError(f"operands could not be broadcast together with shapes "
                             f"{left.shape} and {right.shape} (dim -{dim}: {a} vs {b})")
    eq = f"{labels[ndim - left.ndim:]},{labels[ndim - right.ndim:]}->{labels}"
    return left._wrap(EinsumOp.build(eq, [left.node, right.node], join=join))


def matmul(left: Tensor, right: Tensor) -> Tensor:
    """numpy ``matmul`` semantics (1-d operands, batch broadcasting) as one einsum."""
    if left.ndim == 0 or right.ndim == 0:
        raise ShapeError("matmul needs operands of at least 1 dimension")
    a = "...ij" if left.ndim >= 2 else "j"
    b = "...jk" if right.ndim >= 2 else "j"
    out = "..." if (left.ndim > 2 or right.ndim > 2) else ""
    out += ("i" if left.ndim >= 2 else "") + ("k" if right.ndim >= 2 else "")
    a = a if left.ndim > 2 or a == "j" else "ij"
    b = b if right.ndim > 2 or b == "j" else "jk"
    if left.shape[-1] != right.shape[-2 if right.ndim >= 2 else -1]:
        raise ShapeError(f"matmul: {left.shape} @ {right.shape}: inner sizes "
                         f"{left.shape[-1]} and {right.shape[-2 if right.ndim >= 2 else -1]} "
                         "differ")
    return left._wrap(EinsumOp.build(f"{a},{b}->{out}", [left.node, right.node]))
