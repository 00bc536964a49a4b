"""``tq.einsum``: the extended einsum as a lazy expression.

>>> import numpy as np, tensorql as tq
>>> db = tq.connect()
>>> a = db.from_numpy("a", np.array([[1.0, 5.0], [2.0, 0.0]]))
>>> tq.einsum("ij,jk->ik", a, a, join="add", agg="max").numpy().tolist()  # (max,+) semiring
[[7.0, 6.0], [3.0, 7.0]]
>>> tq.einsum(a, [0, 1], a, [1, 2], [0, 2]).numpy().tolist()  # numpy's interleaved form
[[11.0, 5.0], [2.0, 10.0]]
>>> import torch
>>> tq.einsum("ij,jk->ik", a, a, join=lambda x, y: x * torch.exp(-y), agg="max").numpy().round(3)
array([[0.677, 5.   ],
       [0.736, 0.013]])
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tensorql.algebra import AggName, JoinName, resolve_agg, resolve_join
from tensorql.api.tensor import Tensor
from tensorql.einsum.graph import EinsumOp
from tensorql.einsum.spec import interleaved_equation
from tensorql.errors import DTypeError, ParseError, ShapeError


def einsum(equation: Any, *operands: Any, join: Any = JoinName.MUL,
           agg: Any = AggName.SUM) -> Tensor:
    """``out = AGG over aggregated labels of JOIN(operands...)``, lazily.

    Operands are tensorql Tensors, numpy arrays or torch tensors (at least one must be a
    tensorql Tensor, or a default in-memory session is used). ``join`` is one of mul, add,
    sub, div, max, min, pow, the comparisons lt le gt ge eq ne, where (three operands), a
    join registered with :func:`tq.register_join <tensorql.algebra.register_join>`, or any
    elementwise torch function of the operands (``join=lambda a, b: a * torch.exp(b)``: its
    arity is the number of operands; gradients through it come from torch's autograd);
    ``agg`` one of sum, max, min, prod or one registered with ``tq.register_agg`` (names in
    any case). A label is any character opt_einsum accepts; numpy's interleaved form
    ``einsum(A, [0, 1], B, [1, 2], [0, 2])`` works too.
    """
    agg = resolve_agg(agg)
    if not isinstance(equation, str):
        equation, operands = _from_interleaved((equation, *operands))
    if not operands:
        raise ShapeError(f"einsum {equation!r} needs at least one operand")
    # a name in any case, or the user's elementwise function of as many tensors as operands
    # (a built-in such as torch.exp shows no signature to count them from)
    join = resolve_join(join, arity=len(operands))
    db = next((op.db for op in operands if isinstance(op, Tensor)), None)
    if db is None:
        db = _default_db()
    tensors = [_operand(db, n, op) for n, op in enumerate(operands)]
    for n, t in enumerate(tensors):
        if t.db is not db:
            raise ShapeError(f"operand {n} belongs to another database")
    node = EinsumOp.build(equation, [t.node for t in tensors], join=join, agg=agg)
    return Tensor(node, db)


def _from_interleaved(args: tuple[Any, ...]) -> tuple[str, tuple[Any, ...]]:
    """``(A, [0, 1], B, [1, 2], [0, 2])`` -> ``("ab,bc->ac", (A, B))``. A subscript list is a
    list or tuple, or (as numpy takes it) a 1-d integer array; anything else where one goes
    (an array of values, a tensor) is a ParseError naming the argument's position.

    >>> import numpy as np
    >>> _from_interleaved((np.ones(2), np.array([0]), [0]))[0]
    'a->a'
    >>> _from_interleaved((np.ones((2, 3)), [0], np.ones(3)))
    Traceback (most recent call last):
    ...
    tensorql.errors.ParseError: interleaved einsum: argument 2 (the output's subscript list) ...
    """
    operands = args[0::2][: len(args) // 2]
    subscripts = [_subscript_list(args[n], n, f"operand {n // 2}'s subscript list")
                  for n in range(1, 2 * len(operands), 2)]
    output = (_subscript_list(args[-1], len(args) - 1, "the output's subscript list")
              if len(args) % 2 else None)
    return interleaved_equation(subscripts, output), tuple(operands)


def _subscript_list(value: Any, position: int, role: str) -> Any:
    if isinstance(value, (list, tuple)):
        return value
    dtype = getattr(value, "dtype", None)
    if isinstance(value, np.ndarray) and value.ndim == 1 and dtype.kind in "iu":
        return value.tolist()  # numpy takes a 1-d integer array as a subscript list
    raise ParseError(f"interleaved einsum: argument {position} ({role}) must be a list of "
                     f"subscripts (ints or ...), got {_describe(value)}; the form is "
                     "einsum(A, [0, 1], B, [1, 2], [0, 2]) with operands and subscript lists "
                     "alternating and an optional output list last")


def _describe(value: Any) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"{type(value).__module__}.{type(value).__name__} of shape {tuple(shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"
def _operand(db: Any, n: int, value: Any) -> Tensor:
    """Operand ``n`` as a Tensor (a literal becomes a constant); errors name the operand."""
    if isinstance(value, Tensor):
        return value
    try:
        return db.constant(value)
    except (ShapeError, DTypeError) as err:
        raise type(err)(f"operand {n}: {err}") from None


_DEFAULT = None


def _default_db():
    global _DEFAULT
    if _DEFAULT is None:
        from tensorql.api.database import connect

        _DEFAULT = connect(store=__import__("tensorql.storage.memory_store", fromlist=["x"])
                           .MemoryChunkStore())
    return _DEFAULT
