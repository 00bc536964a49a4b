"""Lazy tensors: operators build an einsum graph; nothing runs until a result is asked for.

>>> import numpy as np, tensorql as tq
>>> db = tq.connect()
>>> x = db.from_numpy("x", np.arange(6.0).reshape(2, 3))
>>> y = (x * 2 + 1).sum(axis=1)          # still lazy
>>> y.shape, y.numpy().tolist()
((2,), [9.0, 27.0])
"""

from __future__ import annotations

import html
import math
import numbers
import operator
import string
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tensorql.algebra import AggName as _A
from tensorql.algebra import JoinName as _J
from tensorql.algebra import join_record
from tensorql.dtypes import DTypeName, canonical_dtype, to_numpy, torch_dtype
from tensorql.einsum.graph import INTEGRAL_DTYPES as _INTEGRAL
from tensorql.einsum.graph import EinsumOp, MapOp, Node, ReshapeOp, SoftmaxOp, Source
from tensorql.errors import (
    AmbiguousTruthError,
    DLPackError,
    DTypeError,
    IndexingError,
    OptionError,
    ShapeError,
    UnsupportedError,
    as_flag,
)

if TYPE_CHECKING:
    from tensorql.api.database import Database
    from tensorql.pipeline import CompiledQuery

_LETTERS = string.ascii_lowercase + string.ascii_uppercase
REPR_ELEMENTS = 1000  # repr shows the values of results this small ...
REPR_INPUT_ELEMENTS = 1 << 20  # ... computed from inputs this small (in all)
CUMSUM_MATRIX_ELEMENTS = 1 << 24  # cumsum's triangular matrix (n x n) up to this size


REPR_NODES = 64  # ... by a graph of at most this many steps


def _input_elements(node: Node) -> int:
    """The elements of every stored tensor and constant ``node`` reads (each once); a
    graph of more than ``REPR_NODES`` steps counts as too large to compute for a repr."""
    seen: dict[int, int] = {}
    stack = [node]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        if len(seen) >= REPR_NODES:
            return REPR_INPUT_ELEMENTS + 1
        inputs = current.inputs
        seen[id(current)] = 0 if inputs else math.prod(current.shape)
        stack.extend(inputs)
    return sum(seen.values())


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
        """The dtype's name ("float32"), equal to numpy's and torch's spellings of it too
        (``t.dtype == np.float32``, ``np.dtype(t.dtype)``; :class:`tensorql.dtypes.DTypeName`).
        """
        return DTypeName(self.node.dtype)

    @property
    def ndim(self) -> int:
        return self.node.ndim

    @property
    def np_dtype(self) -> np.dtype:
        """The dtype as a numpy dtype object (``.dtype`` is its name, a string); bfloat16,
        which numpy lacks, is float32 -- what :meth:`numpy` returns.

        >>> import numpy as np, tensorql as tq
        >>> x = tq.connect().constant(np.arange(3, dtype=np.int16))
        >>> x.np_dtype, x.np_dtype == np.int16, x.dtype
        (dtype('int16'), True, 'int16')
        """
        return np.dtype("float32" if self.dtype == "bfloat16" else self.dtype)

    @property
    def size(self) -> int:
        """The number of elements (numpy's ``size``)."""
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element (of the stored dtype; bfloat16: 2)."""
        return torch_dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        """Bytes the dense values take (numpy's ``nbytes``; torch's ``nbytes`` too)."""
        return self.size * self.itemsize

    def __repr__(self) -> str:
        """The values, as numpy prints them, when the result is small and cheap to compute
        (at most ``REPR_ELEMENTS`` elements, from inputs of at most ``REPR_INPUT_ELEMENTS``
        elements in all, by at most ``REPR_NODES`` steps); else the shape and dtype only.
        Never raises for a failed run.

        >>> import numpy as np, tensorql as tq
        >>> tq.connect().constant(np.array([1.5, 2.0])) * 2
        <tensorql.Tensor map scale(2) shape=(2,) dtype=float64
        array([3., 4.])>
        """
        head = f"<tensorql.Tensor {self.node.describe()} shape={self.shape} dtype={self.dtype}"
        values = self._small_values()
        return head + ">" if values is None else f"{head}\n{values!r}>"

    def _small_values(self) -> np.ndarray | None:
        """The values for ``repr`` when cheap (see ``__repr__``), else None."""
        if self.size > REPR_ELEMENTS or _input_elements(self.node) > REPR_INPUT_ELEMENTS:
            return None
        try:
            return self.numpy()
        except Exception:  # noqa: BLE001 - a repr must not fail; the run's error shows on use
            return None

    def _repr_html_(self) -> str:
        """For notebooks: the shape and dtype, and the values when small (as ``repr``)."""
        head = html.escape(f"tensorql.Tensor {self.node.describe()} shape={self.shape} "
                           f"dtype={self.dtype}")
        values = self._small_values()
        body = "" if values is None else f"<pre>{html.escape(repr(values))}</pre>"
        return f"<div><b>{head}</b>{body}</div>"

    def item(self) -> Any:
        """The value of a one-element tensor as a Python number (numpy's ``item()``)."""
        return self._scalar("a Python scalar")

    def tolist(self) -> Any:
        """The values as nested Python lists (numpy's ``tolist``; computes them)."""
        return self.numpy().tolist()

    def __len__(self) -> int:
        if not self.shape:
            raise UnsupportedError("len() of a 0-d tensor")
        return self.shape[0]

    def __iter__(self) -> Iterator[Tensor]:
        """The rows along the first axis, as numpy iterates (a 0-d tensor has none to give:
        UnsupportedError, a TypeError, as numpy's)."""
        if not self.shape:
            raise UnsupportedError("iteration over a 0-d tensor")
        return (self[i] for i in range(self.shape[0]))

    def __contains__(self, value: Any) -> bool:
        """``value in t``: whether some element equals ``value`` (numpy's ``in``; computes).
        Without it Python would iterate the rows and compare them by identity (``==``)."""
        return bool(self.eq(value).any())

    def __copy__(self) -> Tensor:
        return Tensor(self.node, self.db)  # the same expression of the same session

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickle and copy.deepcopy: the session (its store, locks, worker pool) is not data
        raise UnsupportedError("a tensorql Tensor cannot be pickled or deep-copied: it is a "
                               "lazy expression of its session; store it there "
                               "(db.store(name, t)) or take its values with .numpy()")

    def __bool__(self) -> bool:
        """The truth of a one-element tensor's value (it is computed); more elements, or none,
        are ambiguous, as in numpy.

        >>> import numpy as np, tensorql as tq
        >>> db = tq.connect()
        >>> bool(db.constant(np.array([2.0]))), bool(db.constant(np.array(0)))
        (True, False)
        >>> bool(db.constant(np.array([1.0, 2.0])))
        Traceback (most recent call last):
        ...
        tensorql.errors.AmbiguousTruthError: the truth value of a tensor with more than one ...
        """
        size = math.prod(self.shape)
        if size != 1:
            which = "more than one element" if size else "no elements"
            raise AmbiguousTruthError(f"the truth value of a tensor with {which} is ambiguous "
                                      f"(shape {self.shape}); use .any() or .all(), or "
                                      "compare one element")
        return bool(self.numpy().reshape(()).item())

    # -- running -----------------------------------------------------------------------
    def compile(self) -> CompiledQuery:
        """The planned query (cached until the database's stored tensors or options change).

        The session keeps the plans of the queries it compiled by their graph's structure
        (:mod:`tensorql.pipeline.query_cache`): the same expression written again over the
        same stored tensors -- a new Tensor each time -- reuses its plan.

        >>> import numpy as np, tensorql as tq
        >>> db = tq.connect()
        >>> a = db.from_numpy("a", np.ones((2, 3), dtype=np.float32))
        >>> tq.einsum("ij->i", a).compile() is tq.einsum("ij->i", a).compile()
        True
        """
        from tensorql.logical.path import PATH_CACHE
        from tensorql.pipeline import CompiledQuery
        from tensorql.pipeline.query_cache import query_key

        stamp = (self.db.generation, self.db.options, PATH_CACHE.epoch)
        cached = getattr(self, "_compiled", None)
        if cached is None or cached[0] != stamp:
            shared = self.db.query_cache
            key = query_key(self.node)
            compiled = shared.get(key, stamp)
            if compiled is None:
                compiled = CompiledQuery.compile(self.node, self.db)
                shared.put(key, stamp, compiled)
            cached = (stamp, compiled)
            self._compiled = cached
        return cached[1]

    def torch(self, progress: Any = None) -> torch.Tensor:
        """Compute and return a dense torch tensor."""
        return self.compile().run(progress=progress, dense=True).dense()

    def numpy(self, progress: Any = None) -> np.ndarray:
        """Compute and return a dense numpy array (bfloat16 comes back as float32)."""
        return to_numpy(self.torch(progress=progress))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if dtype is not None:
            try:
                dtype = np.dtype(dtype)
            except (TypeError, ValueError, UnicodeError):
                raise DTypeError(f"__array__: {dtype!r:.60} is not a numpy dtype") from None
        out = self.numpy()
        return out.astype(dtype) if dtype is not None else out

    def __dlpack__(self, **kwargs: Any) -> Any:
        """The computed values as a DLPack capsule (``torch.as_tensor(t)``,
        ``torch.from_dlpack(t)``, ``np.from_dlpack(t)`` call this).

        >>> import numpy as np, torch, tensorql as tq
        >>> torch.as_tensor(tq.connect().constant(np.array([1.0, 2.0]))).tolist()
        [1.0, 2.0]
        """
        values = self._dlpack_values()
        try:
            return values.__dlpack__(**kwargs)
        except (AssertionError, BufferError, NotImplementedError, RuntimeError, TypeError,
                ValueError) as err:  # torch's answers to a stream, device or version it lacks
            shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
            raise DLPackError(f"__dlpack__({shown}): the values are a {values.dtype} tensor on "
                              f"{values.device}, which cannot be exported as asked: "
                              f"{type(err).__name__}: {err}") from None

    def __dlpack_device__(self) -> tuple[Any, int]:
        return self._dlpack_values(keep=True).__dlpack_device__()

    def _dlpack_values(self, keep: bool = False) -> torch.Tensor:
        """The dense values for one DLPack exchange: ``__dlpack_device__`` computes and keeps
        them, the ``__dlpack__`` that follows takes them (no second run)."""
        stamp = (self.db.generation, self.db.options)
        pending = self.__dict__.pop("_dlpack_pending", None)
        values = pending[1] if pending is not None and pending[0] == stamp else None
        if values is None:
            values = self.torch().contiguous()
        if keep:
            self._dlpack_pending = (stamp, values)
        return values

    def explain(self, analyze: bool = False, stage: str | None = None,
                format: str = "text", trace: str | None = None) -> str:
        """The plan as text; ``analyze=True`` runs it and adds measured figures. ``stage``
        shows one stage of the chain: "einsum", "logical", "partition", "physical" or
        "memory" (see ``tensorql.pipeline.STAGES``). ``format="json" | "dot" | "mermaid"``
        draws the physical plan (or ``stage="logical"``'s) as a graph; ``trace="run.json"``
        (with ``analyze``) writes the run's timeline as Chrome-trace JSON for Perfetto.

        >>> import json, numpy as np, tensorql as tq
        >>> A = tq.connect().from_numpy("A", np.ones((4, 6), np.float32), tile=(2, 3))
        >>> doc = json.loads(tq.einsum("ij->i", A).explain(format="json"))
        >>> doc["schema"], [n["name"] for n in doc["nodes"]]
        ('tensorql.plan/1', ['Scan A', 'Aggregate sum over [j]'])
        """
        return self.compile().explain(analyze=analyze, stage=stage, format=format,
                                      trace=trace)

    # -- building blocks -----------------------------------------------------------------
    def _wrap(self, node: Node) -> Tensor:
        return Tensor(node, self.db)

    def _operand(self, other: Any) -> Tensor:
        if isinstance(other, Tensor):
            if other.db is not self.db:
                raise UnsupportedError(_TWO_SESSIONS)
            return other
        return self.db.constant(other)

    def _elementwise(self, other: Any, join: str, reverse: bool = False) -> Tensor:
        promoted, other = self._bool_as_int8(_python_number(other), join)
        if promoted is not self:
            return promoted._elementwise(other, join, reverse)
        if isinstance(other, int) and not isinstance(other, bool) \
                and self.dtype.startswith(("int", "uint")):
            bounds = np.iinfo(np.dtype(self.dtype))
            if not bounds.min <= other <= bounds.max:  # numpy refuses it for every operator
                raise DTypeError(f"the Python integer {other} is out of bounds for this "
                                 f"{self.dtype} tensor ({bounds.min}..{bounds.max}); cast "
                                 f"first, e.g. x.astype('int64')")
        maps = join_record(join).scalar_maps
        if maps is not None and isinstance(other, (int, float)) and not isinstance(other, bool) \
                and self.dtype != "bool":
            # one map of self (see the algebra registry); a bool tensor goes through the join,
            # whose promotion makes it a number first (bool + 3 is 3, as torch's and numpy's;
            # torch's maps kept the bool dtype or refused to subtract from a bool)
            fn, scalar = maps[1 if reverse else 0]
            try:
                value = scalar(other)
            except (ZeroDivisionError, OverflowError):  # x / 0: the join gives inf and nan
                value = None
            if value is not None and (math.isfinite(value) or not math.isfinite(other)):
                return self._map(fn, value)
        other_t = self._scalar_operand(other)
        left, right = (other_t, self) if reverse else (self, other_t)
        return broadcast_binary(left, right, join)

    def _bool_as_int8(self, other: Any, join: str) -> tuple[Tensor, Any]:
        """``self`` and ``other`` as int8 where both are bool and ``join`` is floor division,
        remainder or power (torch has none of these for bool; numpy gives int8), else as they
        are.

        >>> import numpy as np, tensorql as tq
        >>> b = tq.connect().constant(np.array([True, False]))
        >>> (b // True).dtype, (b % b).dtype, (b ** True).numpy().tolist()
        ('int8', 'int8', [1, 0])
        """
        if join not in _BOOL_AS_INT8 or self.dtype != "bool" or not _is_bool(other):
            return self, other
        if isinstance(other, Tensor):
            other = other.astype("int8")
        elif isinstance(other, torch.Tensor):
            other = other.to(torch.int8)
        else:
            other = np.asarray(other).astype(np.int8)
        return self.astype("int8"), other

    def _scalar_operand(self, other: Any) -> Tensor:
        """``other`` as an operand of an elementwise op with this tensor: a Python number of
        this tensor's kind (an int with an integer tensor that holds it, an int or a float
        with a floating one) in this tensor's dtype, as numpy and torch treat a Python
        scalar -- ``int32 // 2`` stays int32, ``float16 % 1.5`` float16 -- and anything
        else as :meth:`_operand` makes it.

        >>> import numpy as np, tensorql as tq
        >>> x = tq.connect().constant(np.array([7, -7], np.int32))
        >>> (x // 2).dtype, (x % 3).numpy().dtype, (x // 2.0).dtype
        ('int32', dtype('int32'), 'float32')
        """
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            dtype = self.dtype
            if dtype.startswith(("float", "bfloat")) or (
                    isinstance(other, int) and dtype.startswith(("int", "uint"))
                    and np.iinfo(np.dtype(dtype)).min <= other <= np.iinfo(np.dtype(dtype)).max):
                return self.db.constant(torch.tensor(other, dtype=torch_dtype(dtype)))
        return self._operand(other)

    def _map(self, fn: str, scalar: float | None = None) -> Tensor:
        return self._wrap(MapOp.build(fn, self.node, scalar))

    def __add__(self, other: Any) -> Tensor:
        return self._elementwise(other, _J.ADD)

    def __radd__(self, other: Any) -> Tensor:
        return self._elementwise(other, _J.ADD, reverse=True)

    def __sub__(self, other: Any) -> Tensor:
        return self._elementwise(other, _J.SUB)

    def __rsub__(self, other: Any) -> Tensor:
        return self._elementwise(other, _J.SUB, reverse=True)

    def __mul__(self, other: Any) -> Tensor:
        return self._elementwise(other, _J.MUL)

    def __rmul__(self, other: Any) -> Tensor:
        return self._elementwise(other, _J.MUL, reverse=True)

    def __truediv__(self, other: Any) -> Tensor:
        return self._elementwise(other, _J.DIV)

    def __rtruediv__(self, other: Any) -> Tensor:
        return self._elementwise(other, _J.DIV, reverse=True)

    def __floordiv__(self, other: Any) -> Tensor:
        """``self // other``: numpy's floor division (toward -inf; an integer // 0 is 0)."""
        return self._elementwise(other, _J.FLOORDIV)

    def __rfloordiv__(self, other: Any) -> Tensor:
        return self._elementwise(other, _J.FLOORDIV, reverse=True)

    def __mod__(self, other: Any) -> Tensor:
        """``self % other``: numpy's remainder, with the sign of the divisor.

        >>> import numpy as np, tensorql as tq
        >>> x = tq.connect().constant(np.array([7, -7]))
        >>> (x // 2).tolist(), (x % 3).tolist(), (x % -3).tolist()
        ([3, -4], [1, 2], [-2, -1])
        """
        return self._elementwise(other, _J.MOD)

    def __rmod__(self, other: Any) -> Tensor:
        return self._elementwise(other, _J.MOD, reverse=True)

    def __neg__(self) -> Tensor:
        return self._map("neg")

    def __abs__(self) -> Tensor:
        return self.abs()

    def __pow__(self, exponent: Any) -> Tensor:
        """``self ** exponent``: a number (a map), or a tensor / array broadcast against
        ``self`` (the ``pow`` join)."""
        base, exponent = self._bool_as_int8(_python_number(exponent), _J.POW)
        if base is not self:
            return base ** exponent
        if self.dtype == "bool" and isinstance(exponent, int) and not isinstance(exponent,
                                                                                  bool):
            return self.astype("int64") ** exponent  # numpy: bool ** int is int64
        if isinstance(exponent, (int, float)) and not isinstance(exponent, bool):
            # a float exponent makes an integer tensor float32, as torch does: not square's
            if exponent == 2 and (isinstance(exponent, int) or self.dtype not in _INTEGRAL):
                return self._map("square")
            if isinstance(exponent, int) and self.dtype in _INTEGRAL and self.dtype != "bool":
                if exponent < 0:
                    raise UnsupportedError(f"{self.dtype} ** {exponent}: integers to negative "
                                           "integer powers are not allowed (as numpy's and "
                                           "torch's); convert first, e.g. "
                                           "x.astype('float64') ** -1")
            else:
                exponent = float(exponent)  # an int one stays exact in the integer dtype
            return self._map("pow", exponent)
        return broadcast_binary(self, self._operand(exponent), _J.POW)

    def __rpow__(self, base: Any) -> Tensor:
        exponent, base = self._bool_as_int8(_python_number(base), _J.POW)
        return broadcast_binary(exponent._scalar_operand(base), exponent, _J.POW)

    # comparisons, elementwise as numpy's (bool results); ``==`` and ``!=`` keep Python's
    # identity meaning (tensors are used as keys), elementwise equality is ``eq`` / ``ne``
    def _compare(self, other: Any, join: str) -> Tensor:
        return broadcast_binary(self, self._operand(other), join)

    def __lt__(self, other: Any) -> Tensor:
        return self._compare(other, _J.LT)

    def __le__(self, other: Any) -> Tensor:
        return self._compare(other, _J.LE)

    def __gt__(self, other: Any) -> Tensor:
        return self._compare(other, _J.GT)

    def __ge__(self, other: Any) -> Tensor:
        return self._compare(other, _J.GE)

    def eq(self, other: Any) -> Tensor:
        """Elementwise ``self == other`` (bool), as ``numpy.equal`` / ``torch.eq``."""
        return self._compare(other, _J.EQ)

    def ne(self, other: Any) -> Tensor:
        """Elementwise ``self != other`` (bool), as ``numpy.not_equal`` / ``torch.ne``."""
        return self._compare(other, _J.NE)

    # logical operators on masks, as numpy's on bool arrays: ``&`` is and (the min of two
    # bools), ``|`` or (their max), ``^`` xor (ne), ``~`` not (eq False); numpy's bitwise
    # integer forms are not offered
    def _logical(self, other: Any, join: str, symbol: str, reverse: bool = False) -> Tensor:
        """``self <symbol> other`` for bool tensors (or Python / numpy bools).

        >>> import numpy as np, tensorql as tq
        >>> x = tq.connect().constant(np.array([1.0, 2.0, 3.0]))
        >>> ((x > 1) & (x < 3)).tolist(), ((x < 2) | (x > 2)).tolist(), (~(x > 1)).tolist()
        ([False, True, False], [True, False, True], [True, False, False])
        """
        operand = self._operand(other)
        if self.dtype != "bool" or operand.dtype != "bool":
            left, right = (operand, self) if reverse else (self, operand)
            raise DTypeError(f"{left.dtype} {symbol} {right.dtype}: {symbol!r} combines bool "
                             "tensors (masks) only; compare first, e.g. (x > 0) & (y < 1); "
                             "bitwise operators on integers are not supported")
        left, right = (operand, self) if reverse else (self, operand)
        return broadcast_binary(left, right, join)

    def __and__(self, other: Any) -> Tensor:
        return self._logical(other, _J.MIN, "&")

    def __rand__(self, other: Any) -> Tensor:
        return self._logical(other, _J.MIN, "&", reverse=True)

    def __or__(self, other: Any) -> Tensor:
        return self._logical(other, _J.MAX, "|")

    def __ror__(self, other: Any) -> Tensor:
        return self._logical(other, _J.MAX, "|", reverse=True)

    def __xor__(self, other: Any) -> Tensor:
        return self._logical(other, _J.NE, "^")

    def __rxor__(self, other: Any) -> Tensor:
        return self._logical(other, _J.NE, "^", reverse=True)

    def __invert__(self) -> Tensor:
        """``~mask``: logical not of a bool tensor (numpy's ``~`` on bool arrays)."""
        if self.dtype != "bool":
            raise DTypeError(f"~ of a {self.dtype} tensor: '~' negates bool tensors (masks) "
                             "only; bitwise not of integers is not supported")
        return self._compare(False, _J.EQ)

    def __getitem__(self, index: Any) -> Tensor:
        """Basic numpy indexing: ints, slices (any step, negative and open ends as numpy),
        ``...`` and ``None``. On a stored tensor the region the index spans is read from only
        the stored chunks it overlaps; a step other than 1, or an index of a computed
        expression, is then a selection: one einsum with a 0/1 matrix per indexed dimension.

        >>> import numpy as np, tensorql as tq
        >>> db = tq.connect()
        >>> a = db.from_numpy("a", np.arange(20.0).reshape(4, 5), tile=(2, 2))
        >>> a[1:3, -2:].numpy().tolist(), a[2].numpy().tolist(), a[..., 0].shape
        ([[8.0, 9.0], [13.0, 14.0]], [10.0, 11.0, 12.0, 13.0, 14.0], (4,))
        >>> (a * 2)[::3, ::-2].numpy().tolist()
        [[8.0, 4.0, 0.0], [38.0, 34.0, 30.0]]

        One array may index too (numpy's advanced indexing, as a gather: the same 0/1-matrix
        selection): an integer array (any shape, negatives count from the end) or a boolean
        mask of one dimension, or a boolean mask of the tensor's whole shape (the selected
        elements in row-major order). A lazy tensor used as an index is computed first.

        >>> a[[3, 0, -1], 1].numpy().tolist(), a[:, np.array([1, 0, 1, 0, 0]) > 0].shape
        ([16.0, 1.0, 16.0], (4, 2))
        >>> a[a > 17.5].numpy().tolist()
        [18.0, 19.0]
        """
        flat = _whole_mask(index, self.shape)
        if flat is not None:
            return self.reshape(-1)[flat]
        items = list(index) if isinstance(index, tuple) else [index]
        items = [_index_array(item) for item in items]
        if sum(isinstance(item, np.ndarray) for item in items) > 1:
            raise UnsupportedError("indexing with more than one array (numpy broadcasts them "
                                   "together) is not supported: index one dimension with an "
                                   "array at a time, e.g. t[rows][:, cols]")
        if sum(item is Ellipsis for item in items) > 1:
            raise IndexingError("an index can only have a single ellipsis ('...')")
        used = sum(1 for item in items if item is not None and item is not Ellipsis)
        if used > self.ndim:
            raise IndexingError(f"too many indices for a tensor of {self.ndim} dimension(s): "
                             f"{used} were given")
        adjacent = _advanced_adjacent(items)  # (a '...' between, even of no dims, parts them)
        at = next((k for k, item in enumerate(items) if item is Ellipsis), len(items))
        items[at:at + 1] = [slice(None)] * (self.ndim - used)  # '...' or the unindexed rest
        picks: list[range] = []  # per dim, the positions it keeps
        shape = []  # the result's shape
        dim = 0
        array_dims = range(0)  # where the array's dims are in ``shape``
        for item in items:
            if item is None:
                shape.append(1)
                continue
            n = self.shape[dim]
            if isinstance(item, slice):
                try:
                    picks.append(range(*item.indices(n)))
                except (TypeError, ValueError) as err:  # a zero step, bounds not integers
                    raise IndexingError(f"slice {item!r} on dimension {dim}: {err}") from None
                shape.append(len(picks[-1]))
            elif isinstance(item, numbers.Integral) and not isinstance(item, bool):
                k = int(item) + (n if item < 0 else 0)
                if not 0 <= k < n:
                    raise IndexingError(f"index {int(item)} is out of bounds for dimension "
                                     f"{dim} of size {n}")
                picks.append(range(k, k + 1))
            elif isinstance(item, np.ndarray):
                positions = _array_positions(item, dim, n)
                picks.append(positions.tolist())
                dims = positions.shape if item.dtype != np.bool_ else (len(positions),)
                array_dims = range(len(shape), len(shape) + len(dims))
                shape.extend(dims)
            else:
                raise UnsupportedError(f"index {item!r} of dimension {dim}: only ints, "
                                       "slices, '...', None, an integer array or a boolean "
                                       "mask are supported")
            dim += 1
        kept = [np.asarray(p, dtype=np.int64).reshape(-1).tolist() for p in picks]
        out = self
        if isinstance(self.node, Source):  # read the region the index spans, then select in it
            starts = [min(p) if p else 0 for p in kept]
            out = self._region(kept)
            kept = [[i - start for i in p] for p, start in zip(kept, starts)]
        out = out._select(kept)
        out = out if tuple(shape) == out.shape else out.reshape(shape)
        if array_dims and not adjacent:  # numpy puts the array's dims first
            rest = [d for d in range(len(shape)) if d not in array_dims]
            out = out.transpose(*array_dims, *rest)
        return out

    def _region(self, picks: list[list[int]]) -> Tensor:
        """The stored region spanning ``picks`` (read from only the chunks it overlaps)."""
        node = self.node
        starts = [min(p) if len(p) else 0 for p in picks]
        sizes = [max(p) - min(p) + 1 if len(p) else 0 for p in picks]
        if tuple(sizes) == self.shape:
            return self
        base = node.offset or (0,) * len(starts)
        return self._wrap(Source(shape=tuple(sizes), dtype=node.dtype, name=node.name,
                                 grid=node.grid,
                                 offset=tuple(b + s for b, s in zip(base, starts))))

    def _select(self, picks: list[list[int]]) -> Tensor:
        """Keep positions ``picks[d]`` of each dim ``d`` (in that order): the identity where a
        dim keeps everything, else, dim by dim, an einsum joining a (kept x size) boolean
        matrix with the values by ``where`` (the picked value, else 0) and summing over the
        size: exactly one value of each sum is picked, so a NaN or inf elsewhere in the dim
        never reaches it (a product with a 0/1 matrix made 0 * inf a NaN).

        >>> import numpy as np, tensorql as tq
        >>> x = tq.connect().constant(np.array([[1.0, 2.0], [np.nan, np.inf]]))
        >>> (x * 1)[0].numpy().tolist(), (x * 1)[1].numpy().tolist()
        ([1.0, 2.0], [nan, inf])
        """
        from tensorql.api.einsum import einsum

        picked = self
        labels = _LETTERS[: self.ndim]
        for d, (p, n) in enumerate(zip(picks, self.shape)):
            if p == list(range(n)):
                continue
            if len(p) * n > 1 << 24:
                raise UnsupportedError(f"selecting {len(p)} of {n} positions of dimension {d} "
                                       "of a computed tensor needs a boolean matrix of "
                                       f"{len(p) * n} elements; store the expression first "
                                       "(db.store) and index the stored tensor")
            matrix = np.zeros((len(p), n), dtype=np.bool_)
            matrix[np.arange(len(p)), np.asarray(p, dtype=np.int64)] = True
            kept = _LETTERS[self.ndim]
            out = labels[:d] + kept + labels[d + 1:]
            zero = self.db.constant(torch.zeros((), dtype=torch_dtype(self.dtype)))
            picked = einsum(f"{kept}{labels[d]},{labels},->{out}",
                            self.db.constant(torch.from_numpy(matrix)), picked, zero,
                            join=_J.WHERE)
            if picked.dtype != self.dtype:  # bools summed as int64
                picked = picked.astype(self.dtype)
        return picked

    def astype(self, dtype: Any) -> Tensor:
        """The values converted to ``dtype`` (numpy's and torch's conversion rules).

        >>> import numpy as np, tensorql as tq
        >>> x = tq.connect().constant(np.array([1.7, -2.2]))
        >>> x.astype("int32").numpy().tolist(), x.astype(np.float32).dtype
        ([1, -2], 'float32')
        """
        return self._wrap(MapOp.build("cast", self.node, dtype=canonical_dtype(dtype)))

    def argmax(self, axis: int | None = None, out: Any = None, *,
               keepdims: bool = False) -> Tensor:
        """Index of the largest value along ``axis`` (the first one on ties, as numpy);
        ``keepdims`` keeps the reduced axis (every axis for ``axis=None``) with size 1.

        >>> import numpy as np, tensorql as tq
        >>> x = tq.connect().constant(np.array([[1.0, 5.0, 5.0], [7.0, 2.0, 0.0]]))
        >>> x.argmax(axis=1).tolist(), x.argmax(axis=1, keepdims=True).shape, x.argmax().item()
        ([1, 0], (2, 1), 3)
        """
        _no_numpy_extras("argmax", None, out)
        return self._keep_arg_dims(self._arg_extreme(axis, _A.MAX), axis, keepdims)

    def argmin(self, axis: int | None = None, out: Any = None, *,
               keepdims: bool = False) -> Tensor:
        """Index of the smallest value along ``axis`` (the first one on ties, as numpy);
        ``keepdims`` as in :meth:`argmax`."""
        _no_numpy_extras("argmin", None, out)
        return self._keep_arg_dims(self._arg_extreme(axis, _A.MIN), axis, keepdims)

    def _keep_arg_dims(self, index: Tensor, axis: int | None, keepdims: Any) -> Tensor:
        if not as_flag(keepdims, "keepdims"):
            return index
        if axis is None:
            return index.reshape((1,) * self.ndim)
        shape = list(self.shape)
        shape[_one_axis(axis, self.ndim)] = 1
        return index.reshape(tuple(shape))

    def _arg_extreme(self, axis: int | None, agg: str) -> Tensor:
        if axis is None and self.ndim > 1:  # numpy's index into the flattened tensor
            return self._flat_arg_extreme(agg)
        if axis is None:
            if self.ndim == 0:  # numpy's: the one element's flat index
                return self.db.constant(np.array(0, dtype=np.int64))
            axis = 0
        axis = _one_axis(axis, self.ndim)
        self._no_empty_reduction(f"arg{agg}", axis)
        extreme = self._reduce(axis, agg, keepdims=True)
        n = self.shape[axis]
        index = np.arange(n, dtype=np.int64).reshape([n if d == axis else 1
                                                      for d in range(self.ndim)])
        hits = self._first_nan_wins(where(self.eq(extreme), index, n), index)
        return hits._reduce(axis, _A.MIN, keepdims=False)

    def _flat_arg_extreme(self, agg: str) -> Tensor:
        """The row-major flat index of the first extreme value (numpy's ``argmax()``): the
        flat index of every element is a broadcast sum of one index vector per dim, so no
        tensor of the input's size is made up front.

        >>> import numpy as np, tensorql as tq
        >>> x = tq.connect().constant(np.array([[1.0, 7.0], [7.0, 0.0]]))
        >>> int(x.argmax()), int(x.argmin())
        (1, 3)
        """
        size = math.prod(self.shape)
        if size == 0:
            raise ShapeError(f"arg{agg} of an empty tensor")
        stride, vectors = 1, []
        for d in reversed(range(self.ndim)):
            n = self.shape[d]
            vectors.append(self._operand((np.arange(n, dtype=np.int64) * stride).reshape(
                [n if k == d else 1 for k in range(self.ndim)])))
            stride *= n
        flat = broadcast_join(vectors, _J.ADD) if len(vectors) > 1 else vectors[0]
        extreme = self._reduce(None, agg, keepdims=True)
        hits = self._first_nan_wins(where(self.eq(extreme), flat, size), flat)
        return hits._reduce(None, _A.MIN, keepdims=False)

    def _first_nan_wins(self, hits: Tensor, index: Tensor | np.ndarray) -> Tensor:
        """``hits`` (an element's index where it is the extreme, else a bound) with every NaN's
        index put in: max/min propagate NaN, so a row holding one has NaN as its extreme, which
        equals nothing, and the first NaN is the answer (as numpy and torch).

        >>> import numpy as np, tensorql as tq
        >>> x = tq.connect().constant(np.array([1.0, np.nan, 3.0, np.nan]))
        >>> int(x.argmax()), int(x.argmin())
        (1, 1)
        """
        if not self.dtype.startswith(("float", "bfloat")):
            return hits  # integers and bools hold no NaN
        return where(self.ne(self), index, hits)

    def __matmul__(self, other: Any) -> Tensor:
        return matmul(self, self._operand(other))

    def __rmatmul__(self, other: Any) -> Tensor:
        return matmul(self._operand(other), self)

    def maximum(self, other: Any) -> Tensor:
        return self._elementwise(other, _J.MAX)

    def minimum(self, other: Any) -> Tensor:
        return self._elementwise(other, _J.MIN)

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
        """The absolute values; a bool tensor's are itself (numpy's; torch has no bool abs)."""
        return self if self.dtype == "bool" else self._map("abs")

    # -- reductions and layout -------------------------------------------------------------
    def _reduce(self, axis: int | Sequence[int] | None, agg: str, keepdims: bool) -> Tensor:
        axes = _normalize_axes(axis, self.ndim)
        keepdims = as_flag(keepdims, "keepdims")
        labels = _LETTERS[: self.ndim]
        out = "".join(lab for d, lab in enumerate(labels) if d not in axes)
        result = self._wrap(EinsumOp.build(f"{labels}->{out}", [self.node], agg=agg))
        if keepdims:
            shape = tuple(1 if d in axes else n for d, n in enumerate(self.shape))
            result = result.reshape(shape)
        return result

    def sum(self, axis: int | Sequence[int] | None = None, dtype: Any = None, out: Any = None,
            keepdims: bool = False) -> Tensor:
        """Sum over ``axis`` (all axes by default); numpy's signature, so ``np.sum(t)`` works
        (``dtype`` and ``out`` must be None)."""
        _no_numpy_extras(_A.SUM, dtype, out)
        return _widened(self._reduce(axis, _A.SUM, keepdims))

    def max(self, axis: int | Sequence[int] | None = None, out: Any = None,
            keepdims: bool = False) -> Tensor:
        _no_numpy_extras(_A.MAX, None, out)
        self._no_empty_reduction(_A.MAX, axis)
        return self._reduce(axis, _A.MAX, keepdims)

    def min(self, axis: int | Sequence[int] | None = None, out: Any = None,
            keepdims: bool = False) -> Tensor:
        _no_numpy_extras(_A.MIN, None, out)
        self._no_empty_reduction(_A.MIN, axis)
        return self._reduce(axis, _A.MIN, keepdims)

    def _no_empty_reduction(self, what: str, axis: Any) -> None:
        """ShapeError when ``what`` (max, min, argmax, argmin: no identity) would reduce a
        dimension of size 0, as numpy's and torch's refuse (the einsum's aggregation would
        give its identity, -inf or +inf, or an index past the end).

        >>> import numpy as np, tensorql as tq
        >>> tq.connect().constant(np.zeros((2, 0))).max(axis=1)
        Traceback (most recent call last):
        ...
        tensorql.errors.ShapeError: max over dimension 1 of size 0 (shape (2, 0)): an empty ...
        """
        for d in _normalize_axes(axis, self.ndim):
            if self.shape[d] == 0:
                raise ShapeError(f"{what} over dimension {d} of size 0 (shape {self.shape}): "
                                 "an empty reduction has no value (numpy: zero-size array "
                                 "to a reduction operation which has no identity)")

    def prod(self, axis: int | Sequence[int] | None = None, dtype: Any = None, out: Any = None,
             keepdims: bool = False) -> Tensor:
        _no_numpy_extras(_A.PROD, dtype, out)
        return _widened(self._reduce(axis, _A.PROD, keepdims))

    def mean(self, axis: int | Sequence[int] | None = None, dtype: Any = None, out: Any = None,
             keepdims: bool = False) -> Tensor:
        """The mean over ``axis``: numpy's, in float64 for integer or bool input (a sum in
        int64 wrapped), and summed in float32 for float16 / bfloat16 input, as numpy and torch
        sum them, then rounded back (60000 and 60000 in float16 summed to inf).

        >>> import numpy as np, tensorql as tq
        >>> db = tq.connect()
        >>> big = db.constant(np.array([2**62, 2**62], np.int64)).mean()
        >>> float(big.numpy()), big.dtype
        (4.611686018427388e+18, 'float64')
        >>> half = db.constant(np.array([60000, 60000], np.float16)).mean()
        >>> float(half.numpy()), half.dtype
        (60000.0, 'float16')
        """
        _no_numpy_extras("mean", dtype, out)
        axes = _normalize_axes(axis, self.ndim)
        count = math.prod(self.shape[d] for d in axes)  # 0: an empty mean is NaN, as numpy's
        x = self
        if self.dtype in _INTEGRAL:
            x = self.astype("float64")
        elif self.dtype in ("float16", "bfloat16"):
            x = self.astype("float32")
        mean = x._reduce(axis, _A.SUM, keepdims) * (1.0 / count if count else math.nan)
        return mean.astype(self.dtype) if x is not self and self.dtype not in _INTEGRAL \
            else mean

    def var(self, axis: int | Sequence[int] | None = None, dtype: Any = None, out: Any = None,
            ddof: float = 0, keepdims: bool = False) -> Tensor:
        """The variance over ``axis`` (numpy's: ``sum((x - mean)**2) / (n - ddof)``), as two
        reductions and elementwise maps.

        >>> import numpy as np, tensorql as tq
        >>> x = tq.connect().constant(np.array([[1.0, 2.0, 4.0], [3.0, 3.0, 3.0]]))
        >>> a = x.numpy()
        >>> np.allclose(x.var(axis=1), [14 / 9, 0.0]), np.allclose(x.std(ddof=1), a.std(ddof=1))
        (True, True)
        """
        _no_numpy_extras("var", dtype, out)
        if not isinstance(ddof, numbers.Real):
            raise OptionError(f"ddof must be a number, got {ddof!r}")
        axes = _normalize_axes(axis, self.ndim)
        count = math.prod(self.shape[d] for d in axes)
        x = self if self.dtype.startswith(("float", "bfloat")) else self.astype("float64")
        centered = x - x.mean(axis=axes, keepdims=True)
        squares = (centered * centered)._reduce(axes, _A.SUM, keepdims)
        return squares / float(max(count - ddof, 0))  # ddof >= count: inf or NaN, as numpy

    def std(self, axis: int | Sequence[int] | None = None, dtype: Any = None, out: Any = None,
            ddof: float = 0, keepdims: bool = False) -> Tensor:
        """The standard deviation over ``axis``: the square root of :meth:`var`. A constant
        row's gradient is 0, as torch's ``std`` gives it, where the square root's derivative
        at 0 is infinite: 1 stands in for a variance of 0 under the root, and the 0 is put
        back after.

        >>> import numpy as np, tensorql as tq
        >>> x = tq.connect().constant(np.array([[1.0, 1.0], [1.0, 3.0]]))
        >>> [g.tolist() for g in tq.grad(x.std(axis=1).sum(), [x])]
        [[[0.0, 0.0], [-0.5, 0.5]]]
        """
        _no_numpy_extras("std", dtype, out)
        variance = self.var(axis, ddof=ddof, keepdims=keepdims)
        constant = variance.eq(0).astype(variance.dtype)  # a comparison: no gradient path
        return (variance + constant).sqrt() * (1 - constant)

    def any(self, axis: int | Sequence[int] | None = None, out: Any = None,
            keepdims: bool = False) -> Tensor:
        """Whether any element over ``axis`` is nonzero (numpy's ``any``; NaN counts as
        true): the max of ``self != 0``.

        >>> import numpy as np, tensorql as tq
        >>> x = tq.connect().constant(np.array([[0.0, 2.0], [0.0, 0.0]]))
        >>> x.any(axis=1).tolist(), bool(x.any()), bool(x.all())
        ([True, False], True, False)
        """
        _no_numpy_extras("any", None, out)
        return self._truth()._reduce(axis, _A.MAX, keepdims)

    def all(self, axis: int | Sequence[int] | None = None, out: Any = None,
            keepdims: bool = False) -> Tensor:
        """Whether every element over ``axis`` is nonzero (numpy's ``all``): the min of
        ``self != 0``."""
        _no_numpy_extras("all", None, out)
        return self._truth()._reduce(axis, _A.MIN, keepdims)

    def _truth(self) -> Tensor:
        return self if self.dtype == "bool" else self.ne(0)

    def clip(self, min: Any = None, max: Any = None, out: Any = None) -> Tensor:  # noqa: A002
        """The values limited to [``min``, ``max``] (numpy's ``clip``; either may be None,
        each a number or a broadcastable tensor): ``minimum(maximum(x, min), max)``.

        >>> import numpy as np, tensorql as tq
        >>> tq.connect().constant(np.array([-2.0, 0.5, 3.0])).clip(0, 1).tolist()
        [0.0, 0.5, 1.0]
        """
        _no_numpy_extras("clip", None, out)
        if min is None and max is None:
            raise UnsupportedError("clip: give min, max or both (numpy: one must be given)")
        result = self if min is None else self.maximum(min)
        return result if max is None else result.minimum(max)

    def cumsum(self, axis: int | None = None, dtype: Any = None, out: Any = None) -> Tensor:
        """Running sums along ``axis`` (numpy's ``cumsum``; ``axis=None`` runs over the
        flattened tensor), as one einsum with an upper-triangular 0/1 matrix
        (``cumsum(x)[j] = sum_i where(i <= j, x[i], 0)``): UnsupportedError when that matrix
        would have more than ``CUMSUM_MATRIX_ELEMENTS`` elements.

        >>> import numpy as np, tensorql as tq
        >>> tq.connect().constant(np.array([[1, 2], [3, 4]])).cumsum(axis=0).tolist()
        [[1, 2], [4, 6]]
        >>> tq.connect().constant(np.array([1.0, 2.0, np.inf, 1.0])).cumsum().tolist()
        [1.0, 3.0, inf, inf]
        """
        _no_numpy_extras("cumsum", dtype, out)
        if axis is None:
            return self.reshape(-1).cumsum(0) if self.ndim != 1 else self.cumsum(0)
        axis = _one_axis(axis, self.ndim)
        n = self.shape[axis]
        if n * n > CUMSUM_MATRIX_ELEMENTS:
            raise UnsupportedError(f"cumsum along dimension {axis} of size {n}: its "
                                   f"triangular matrix would have {n * n:,} elements (at most "
                                   f"{CUMSUM_MATRIX_ELEMENTS:,}); store the tensor in pieces "
                                   "along that dimension or compute it with torch.cumsum")
        x = self.astype("int64") if self.dtype == "bool" else self
        tri = np.triu(np.ones((n, n), dtype=np.bool_))  # tri[i, j]: x[i] counts in out[j]
        labels = _LETTERS[: self.ndim]
        fresh = _LETTERS[self.ndim]
        out_labels = labels.replace(labels[axis], fresh)
        zero = self.db.constant(torch.zeros((), dtype=torch_dtype(x.dtype)))
        from tensorql.api.einsum import einsum

        # ``where`` (x[i] if i <= j, else 0), not a product with the 0/1 matrix: an inf or
        # NaN after position j stays out of out[j] (0 * inf was a NaN in every earlier sum)
        return einsum(f"{labels[axis]}{fresh},{labels},->{out_labels}",
                      self.db.constant(torch.from_numpy(tri)), x, zero, join=_J.WHERE)

    def squeeze(self, axis: int | Sequence[int] | None = None) -> Tensor:
        """The tensor without size-1 dims (those of ``axis``; all by default), as numpy.

        >>> import numpy as np, tensorql as tq
        >>> tq.connect().constant(np.zeros((1, 3, 1))).squeeze().shape
        (3,)
        """
        axes = _normalize_axes(axis, self.ndim) if axis is not None else \
            tuple(d for d, n in enumerate(self.shape) if n == 1)
        wide = [d for d in axes if self.shape[d] != 1]
        if wide:
            raise ShapeError(f"cannot squeeze dimension {wide[0]} of size "
                             f"{self.shape[wide[0]]} (shape {self.shape}): only size-1 "
                             "dimensions can be removed")
        return self.reshape(tuple(n for d, n in enumerate(self.shape) if d not in axes))

    def __float__(self) -> float:
        return float(self._scalar("float"))

    def __int__(self) -> int:
        return int(self._scalar("int"))

    def _scalar(self, what: str) -> Any:
        if math.prod(self.shape) != 1:
            raise ShapeError(f"only a one-element tensor converts to {what}; this one has "
                             f"shape {self.shape}")
        return self.numpy().reshape(()).item()

    def log_softmax(self, axis: int = -1) -> Tensor:
        """x - max - log(sum(exp(x - max))) along ``axis`` (stable, as torch's): one step
        whose chunks hold the whole axis."""
        axis = _one_axis(axis, self.ndim)
        return self._wrap(SoftmaxOp.build(self.node, axis, log=True))

    def softmax(self, axis: int = -1) -> Tensor:
        """exp(x - max) / sum(exp(x - max)) along ``axis`` (stable, as torch's): one step
        whose chunks hold the whole axis.

        >>> import numpy as np, tensorql as tq
        >>> db = tq.connect()
        >>> db.from_numpy("S", np.log(np.array([[1.0, 3.0]]))).softmax(-1).numpy().tolist()
        [[0.25, 0.75]]
        """
        axis = _one_axis(axis, self.ndim)
        return self._wrap(SoftmaxOp.build(self.node, axis))

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

    def reshape(self, *shape: int | Sequence[int]) -> Tensor:
        """The elements in row-major order in a new ``shape`` (as numpy: a tuple or the sizes
        as arguments, one of them may be -1). Lazy: inserting or removing size-1 dims is an
        einsum; any other reshape is a chunk-local ``Reshape`` step after retiling its input
        so that each chunk maps to one output chunk.

        >>> import numpy as np, tensorql as tq
        >>> db = tq.connect()
        >>> a = db.from_numpy("A", np.arange(12.0).reshape(3, 4))
        >>> a.reshape(2, -1).numpy().tolist()
        [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]]
        """
        shape = _reshape_target(shape, self.shape)
        if shape == self.shape:
            return self
        if [n for n in shape if n != 1] != [n for n in self.shape if n != 1]:
            return self._wrap(ReshapeOp.build(self.node, shape))
        src = _LETTERS[: self.ndim]
        big = [lab for lab, n in zip(src, self.shape) if n != 1]
        fresh = iter(_LETTERS[self.ndim:])
        kept = iter(big)
        out = "".join(next(kept) if n != 1 else next(fresh) for n in shape)
        # over size-1 dims only: max is the identity and, unlike a sum, keeps bools and
        # small integers their dtype
        squeeze_sum = EinsumOp.build(f"{src}->{''.join(big)}", [self.node], agg=_A.MAX)
        if len(shape) == len(big):
            return self._wrap(squeeze_sum)
        ones = self.db.constant(np.ones([1] * (len(shape) - len(big)),
                                        dtype=np.float32)).node
        one_labels = "".join(c for c, n in zip(out, shape) if n == 1 and c not in big)
        return self._wrap(EinsumOp.build(f"{''.join(big)},{one_labels}->{out}",
                                         [squeeze_sum, _cast_const(ones, self.dtype, self.db)]))

    def flatten(self) -> Tensor:
        """The elements as one dim, in row-major order (numpy's ``flatten``)."""
        return self.reshape(-1)


_BOOL_AS_INT8 = (_J.FLOORDIV, _J.MOD, _J.POW)


def _is_bool(value: Any) -> bool:
    """Whether ``value`` is a bool: a Python or numpy one, or an array or tensor of bools."""
    if isinstance(value, (bool, np.bool_)):
        return True
    return str(getattr(value, "dtype", "")).removeprefix("torch.") == "bool"


def _python_number(value: Any) -> Any:
    """A numpy scalar (``np.float32(2.5)``, ``np.int64(3)``) as the Python number it holds, so
    it promotes as a Python scalar does (a float with an integer tensor gives a floating
    result); anything else as it is.

    >>> _python_number(np.float32(2.5)), _python_number(np.int8(3)), _python_number("x")
    (2.5, 3, 'x')
    """
    if isinstance(value, np.generic) and not isinstance(value, np.bool_):
        if isinstance(value, np.integer):
            return int(value)
        if isinstance(value, np.floating):
            return float(value)
    return value


def _advanced_adjacent(items: list[Any]) -> bool:
    """Whether the advanced items of an index with an array (the array and every integer,
    which numpy then counts as advanced too) stand next to each other: numpy puts their dims
    where they stand if so, else first (``a[0, :, [1, 2]]`` of a (2, 3, 4) array is 2 x 3).

    >>> _advanced_adjacent([0, np.array([1, 2]), slice(None)])
    True
    >>> _advanced_adjacent([0, slice(None), np.array([1, 2])])
    False
    >>> _advanced_adjacent([0, ..., np.array([1, 2])])  # even where '...' stands for no dim
    False
    """
    at = [k for k, item in enumerate(items) if isinstance(item, np.ndarray)
          or (isinstance(item, numbers.Integral) and not isinstance(item, bool))]
    return not at or at[-1] - at[0] + 1 == len(at)


def _index_array(item: Any) -> Any:
    """An index item that is an array (a list, numpy array, torch or tensorql tensor: a lazy
    one is computed) as a numpy array of integers or bools; any other item as is."""
    if isinstance(item, Tensor):
        item = item.numpy()
    elif isinstance(item, torch.Tensor):
        item = item.detach().cpu().numpy()
    elif isinstance(item, list):
        try:
            item = np.asarray(item) if item else np.zeros(0, dtype=np.int64)
        except ValueError:  # a ragged list: numpy refuses it as an index too
            raise IndexingError(f"an index list must be rectangular, got {item!r:.80}") \
                from None
    elif isinstance(item, np.generic) and not isinstance(item, np.bool_):
        return item
    if not isinstance(item, np.ndarray):
        return item
    if item.dtype != np.bool_ and not np.issubdtype(item.dtype, np.integer):
        raise UnsupportedError(f"an index array must hold integers or bools, not {item.dtype} "
                               "(as in numpy)")
    if item.ndim == 0 and item.dtype != np.bool_:
        return int(item)  # a 0-d integer array indexes as its integer does (numpy's rule)
    return item


def _array_positions(item: np.ndarray, dim: int, n: int) -> np.ndarray:
    """The positions of dimension ``dim`` (of size ``n``) that an integer array (negatives
    from the end; its shape kept) or a one-dimensional boolean mask picks."""
    if item.dtype == np.bool_:
        if item.ndim != 1 or item.shape[0] != n:
            raise IndexingError(f"boolean index of shape {item.shape} does not match dimension "
                             f"{dim} of size {n}: a mask indexes one dimension (shape ({n},)) "
                             "or the whole tensor")
        return np.flatnonzero(item)
    positions = item.astype(np.int64) + np.where(item < 0, n, 0)
    bad = (positions < 0) | (positions >= n)
    if bad.any():
        raise IndexingError(f"index {int(item[bad].flat[0])} is out of bounds for dimension {dim} "
                         f"of size {n}")
    return positions


def _whole_mask(index: Any, shape: tuple[int, ...]) -> np.ndarray | None:
    """The flat positions a boolean mask of the whole ``shape`` (of at least 2 dims) selects,
    None for any other index."""
    if not isinstance(index, (np.ndarray, list, torch.Tensor, Tensor)) or len(shape) < 2:
        return None
    item = _index_array(index)
    if not isinstance(item, np.ndarray) or item.dtype != np.bool_ or item.ndim < 2:
        return None  # (a 0-d integer array is its integer)
    if item.shape != shape:
        raise UnsupportedError(f"a boolean mask of shape {item.shape} for a tensor of shape "
                               f"{shape}: a mask covers one dimension or the whole tensor")
    return np.flatnonzero(item)


def _reshape_target(args: tuple, current: tuple[int, ...]) -> tuple[int, ...]:
    """numpy's reshape arguments (a tuple, or sizes; one -1 inferred) as a shape; ShapeError
    naming the sizes when they do not fit."""
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = tuple(args[0])
    try:
        shape = [operator.index(n) for n in args]
    except TypeError:
        raise ShapeError(f"reshape takes whole-number sizes, got {args}") from None
    total = math.prod(current)
    unknown = [k for k, n in enumerate(shape) if n == -1]
    if len(unknown) > 1 or any(n < -1 for n in shape):
        raise ShapeError(f"cannot reshape {current} to {tuple(shape)}: sizes are >= 0, with "
                         "at most one -1")
    if unknown:
        known = math.prod(n for n in shape if n != -1)
        if known == 0 or total % known:
            raise ShapeError(f"cannot reshape {current} ({total} elements) to {tuple(shape)}")
        shape[unknown[0]] = total // known
    if math.prod(shape) != total:
        raise ShapeError(f"cannot reshape {current} ({total} elements) to {tuple(shape)} "
                         f"({math.prod(shape)} elements)")
    return tuple(shape)


def _no_numpy_extras(name: str, dtype: Any, out: Any) -> None:
    """numpy passes ``dtype`` / ``out`` to reductions; tensorql has neither."""
    if out is not None:
        raise UnsupportedError(f"{name}: out= is not supported (tensors are lazy; use the "
                               "returned tensor)")
    if dtype is not None:
        raise UnsupportedError(f"{name}: dtype= is not supported")


def _cast_const(node: Node, dtype: str, db: Database) -> Node:
    return db.constant(node.value.to(torch_dtype(dtype))).node


def _normalize_axes(axis: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, numbers.Integral) and not isinstance(axis, bool):
        axes: tuple = (int(axis),)
    elif isinstance(axis, (tuple, list)) and all(
            isinstance(a, numbers.Integral) and not isinstance(a, bool) for a in axis):
        axes = tuple(int(a) for a in axis)
    else:
        raise UnsupportedError(f"axis must be an integer or a tuple of integers, got {axis!r}")
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ShapeError(f"axis {a} is out of range for a {ndim}-d tensor")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ShapeError(f"repeated axis in {axis}")
    return tuple(out)


def _one_axis(axis: Any, ndim: int) -> int:
    """The one axis an operation along an axis (softmax, argmax, ...) takes, normalised."""
    axes = _normalize_axes(axis, ndim)
    if len(axes) != 1:
        raise ShapeError(f"this operation takes one axis, got {axis!r}"
                         + (" (a 0-d tensor has none)" if ndim == 0 else ""))
    return axes[0]


def broadcast_binary(left: Tensor, right: Tensor, join: str) -> Tensor:
    """``left JOIN right`` elementwise with numpy broadcasting, as one einsum."""
    return broadcast_join([left, right], join)


def broadcast_join(operands: Sequence[Tensor], join: str) -> Tensor:
    """``JOIN`` of ``operands`` elementwise with numpy broadcasting, as one einsum."""
    ndim = max(t.ndim for t in operands)
    labels = _LETTERS[:ndim]
    for dim in range(1, ndim + 1):
        sizes = {t.shape[-dim] for t in operands if dim <= t.ndim} - {1}
        if len(sizes) > 1:
            shapes = " and ".join(str(t.shape) for t in operands)
            raise ShapeError(f"operands could not be broadcast together with shapes {shapes} "
                             f"(dim -{dim}: sizes {sorted(sizes)})")
    eq = ",".join(labels[ndim - t.ndim:] for t in operands) + f"->{labels}"
    return operands[0]._wrap(EinsumOp.build(eq, [t.node for t in operands], join=join))


def _widened(result: Tensor) -> Tensor:
    """A sum or product in int64 where it reduced nothing (a 0-d tensor, ``axis=()``), as it
    is where it reduced something: numpy accumulates bools and small integers so."""
    if result.dtype in ("bool", "int8", "uint8", "int16", "int32"):
        return result.astype("int64")
    return result


_TWO_SESSIONS = ("cannot combine tensors of two different databases (sessions of tq.connect): "
                 "compute one and bring it into the other, e.g. db.from_numpy(name, t.numpy())")


def where(condition: Any, x: Any, y: Any) -> Tensor:
    """``x`` where ``condition`` holds, else ``y``, with numpy broadcasting (numpy.where).

    >>> import numpy as np, tensorql as tq
    >>> a = tq.connect().constant(np.array([-1.0, 2.0]))
    >>> tq.where(a > 0, a, 0.0).numpy().tolist()
    [0.0, 2.0]
    """
    anchor = next((v for v in (condition, x, y) if isinstance(v, Tensor)), None)
    if anchor is None:
        raise UnsupportedError("where needs at least one tensorql Tensor among its arguments")
    # condition is checked against anchor, x and y against value below: tensors of two
    # sessions would each pass, and the graph (which names stored tensors, not sessions)
    # would read them all in anchor's
    if any(isinstance(v, Tensor) and v.db is not anchor.db for v in (condition, x, y)):
        raise UnsupportedError(_TWO_SESSIONS)
    # a Python number beside a tensor value takes its dtype (numpy's weak scalar)
    value = next((v for v in (x, y) if isinstance(v, Tensor)), anchor)
    operands = [anchor._operand(condition), value._scalar_operand(_python_number(x)),
                value._scalar_operand(_python_number(y))]
    return broadcast_join(operands, _J.WHERE)


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


def substitute(expr: Tensor, replacements: dict[str, Any]) -> Tensor:
    """``expr`` with each stored tensor named in ``replacements`` replaced by the expression
    given for it -- e.g. a frozen weight by itself plus a trainable low-rank update (LoRA).

    >>> import numpy as np, tensorql as tq
    >>> db = tq.connect()
    >>> w = db.from_numpy("w", np.ones(3))
    >>> y = (w * 2.0).sum()
    >>> float(tq.substitute(y, {"w": w + 1.0}))
    12.0
    """
    from tensorql.einsum.graph import substitute as substitute_nodes

    if not isinstance(expr, Tensor):
        raise UnsupportedError(f"substitute: expr must be a tensorql Tensor, got "
                               f"{type(expr).__name__}")
    if not isinstance(replacements, dict):
        raise UnsupportedError("substitute: replacements must be a dict of stored tensor name "
                               f"-> expression, got {type(replacements).__name__}")
    nodes = {name: expr._operand(value).node for name, value in replacements.items()}
    return expr._wrap(substitute_nodes(expr.node, nodes))
