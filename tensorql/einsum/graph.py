"""The einsum graph: what a lazy tensor expression is before it is planned.

Nodes are immutable and compared by identity, so a shared subexpression is one node and is
computed once. ``Source`` is a stored tensor, ``Constant`` an in-memory literal, ``EinsumOp`` one
extended einsum over other nodes, ``MapOp`` an elementwise function.

>>> from tensorql.grid import ChunkGrid
>>> a = Source(name="A", shape=(2, 3), dtype="float32", grid=ChunkGrid((2, 3), (2, 3)))
>>> op = EinsumOp.build("ij->i", [a], agg="max")
>>> op.shape, op.dtype
((2,), 'float32')
>>> [n.describe() for n in topological_order(op)]
['scan A', 'einsum ij->i agg=max']
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tensorql_kernels.elementwise import FLOAT_MAPS, MAP_FUNCTIONS, SCALAR_MAPS
from tensorql_kernels.optimizer_update import SLOTS, check_update_labels

from tensorql.algebra import (
    BOOL,
    CONDITION,
    FLOATING,
    NUMERIC,
    UPDATE,
    AggName,
    JoinFunctionError,
    JoinName,
    join_dtype,
    join_record,
)
from tensorql.algebra import agg_record as _agg_record
from tensorql.dag import inputs_first
from tensorql.dtypes import canonical_dtype, torch_dtype
from tensorql.einsum.spec import EinsumSpec
from tensorql.errors import ShapeError
from tensorql.grid import ChunkGrid


@dataclass(frozen=True, eq=False)
class Node:
    """A tensor-valued node: its shape and dtype are known before anything runs."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def inputs(self) -> tuple[Node, ...]:
        return ()

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class Source(Node):
    """A tensor stored under ``name`` with chunk grid ``grid``; with ``offset`` set, the
    region of it starting there with this node's ``shape`` (a slice: ``grid`` stays the
    stored tensor's, and only the stored chunks the region overlaps are read)."""

    name: str = ""
    grid: ChunkGrid | None = None
    offset: tuple[int, ...] | None = None

    def describe(self) -> str:
        if self.offset is None:
            return f"scan {self.name}"
        region = ",".join(f"{o}:{o + n}" for o, n in zip(self.offset, self.shape))
        return f"scan {self.name}[{region}]"


@dataclass(frozen=True, eq=False)
class Constant(Node):
    """An in-memory literal (a numpy array or torch tensor used in an expression)."""

    value: torch.Tensor | None = None
    grid: ChunkGrid | None = None

    def describe(self) -> str:
        return f"constant {tuple(self.shape)}"


@dataclass(frozen=True, eq=False)
class EinsumOp(Node):
    """One extended einsum over ``operands``."""

    spec: EinsumSpec | None = None
    operands: tuple[Node, ...] = ()

    @property
    def inputs(self) -> tuple[Node, ...]:
        return self.operands

    @classmethod
    def build(cls, equation: str, operands: Sequence[Node], join: str = JoinName.MUL,
              agg: str = AggName.SUM) -> EinsumOp:
        spec = EinsumSpec.parse(equation, [n.shape for n in operands], join=join, agg=agg)
        record = join_record(join)
        if join == JoinName.WHERE and len(operands) != 3:
            raise ShapeError(f"join {join!r} takes 3 operands (condition, value where true, "
                             f"value where false), got {len(operands)}")
        if record.arity is not None and len(operands) != record.arity:
            error = JoinFunctionError if record.user else ShapeError
            raise error(f"join {join!r} takes {record.arity} operand(s), got {len(operands)}")
        if record.update:
            wrong = check_update_labels(spec.inputs, spec.output, record.rule)
            if wrong is not None or spec.sizes.get(spec.output[0]) != SLOTS:
                raise ShapeError(f"join {join!r} {wrong or 'needs 3 slots'}: "
                                 f"{equation!r} (see tensorql_kernels.optimizer_update)")
        return cls(shape=spec.output_shape, dtype=result_dtype(spec, operands), spec=spec,
                   operands=tuple(operands))

    def describe(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in (("join", self.spec.join),
                                                  ("agg", self.spec.agg))
                        if v not in (JoinName.MUL, AggName.SUM))
        return f"einsum {self.spec.equation}{extra}"


@dataclass(frozen=True, eq=False)
class MapOp(Node):
    """Elementwise ``fn`` (with ``scalar`` for the scalar maps) over ``operand``."""

    fn: str = ""
    operand: Node | None = None
    scalar: float | None = None

    @property
    def inputs(self) -> tuple[Node, ...]:
        return (self.operand,)

    @classmethod
    def build(cls, fn: str, operand: Node, scalar: float | None = None,
              dtype: str | None = None) -> MapOp:
        """The map node; ``dtype`` (the ``cast`` map's target) overrides the result dtype."""
        target = dtype
        if fn not in MAP_FUNCTIONS:
            raise ShapeError(f"unknown map {fn!r}; choose one of {', '.join(MAP_FUNCTIONS)}")
        if (fn in SCALAR_MAPS) != (scalar is not None):
            raise ShapeError(f"map {fn!r} {'needs' if fn in SCALAR_MAPS else 'takes no'} scalar")
        dtype = operand.dtype
        if fn in FLOAT_MAPS and dtype in INTEGRAL_DTYPES:
            dtype = "float32"
        elif scalar is not None and isinstance(scalar, float) and dtype in INTEGRAL_DTYPES:
            dtype = "float32"
        if fn == "cast":
            if target is None:
                raise ShapeError("map 'cast' needs the dtype to convert to")
            dtype = canonical_dtype(target)
        return cls(shape=operand.shape, dtype=dtype, fn=fn, operand=operand, scalar=scalar)

    def describe(self) -> str:
        return f"map {self.fn}" + (f"({self.scalar:g})" if self.scalar is not None else "")


@dataclass(frozen=True, eq=False)
class ReshapeOp(Node):
    """``operand``'s elements in row-major order, in ``shape`` (numpy's ``reshape``)."""

    operand: Node | None = None

    @property
    def inputs(self) -> tuple[Node, ...]:
        return (self.operand,)

    @classmethod
    def build(cls, operand: Node, shape: Sequence[int]) -> ReshapeOp:
        """The reshape node; ShapeError when the sizes differ."""
        shape = tuple(int(n) for n in shape)
        if math.prod(shape) != math.prod(operand.shape) or any(n < 0 for n in shape):
            raise ShapeError(f"cannot reshape {operand.shape} ({math.prod(operand.shape)} "
                             f"elements) to {shape} ({math.prod(shape)} elements)")
        return cls(shape=shape, dtype=operand.dtype, operand=operand)

    def describe(self) -> str:
        return f"reshape {'x'.join(map(str, self.shape)) or 'scalar'}"


@dataclass(frozen=True, eq=False)
class SoftmaxOp(Node):
    """``softmax`` (or ``log_softmax`` with ``log``) of ``operand`` along dim ``axis``:
    ``exp(x - max) / sum(exp(x - max))``, one numerically stable kernel per chunk holding the
    whole axis."""

    operand: Node | None = None
    axis: int = -1
    log: bool = False

    @property
    def inputs(self) -> tuple[Node, ...]:
        return (self.operand,)

    @classmethod
    def build(cls, operand: Node, axis: int, log: bool = False) -> SoftmaxOp:
        """The node; ShapeError for an axis out of range."""
        if not -operand.ndim <= axis < max(1, operand.ndim) or operand.ndim == 0:
            raise ShapeError(f"axis {axis} is out of range for a {operand.ndim}-d tensor")
        dtype = operand.dtype if operand.dtype not in INTEGRAL_DTYPES else "float32"
        return cls(shape=operand.shape, dtype=dtype, operand=operand,
                   axis=axis % operand.ndim, log=log)

    def describe(self) -> str:
        return f"{'log_softmax' if self.log else 'softmax'} axis {self.axis}"


INTEGRAL_DTYPES = ("bool", "int8", "uint8", "int16", "int32", "int64")


def result_dtype(spec: EinsumSpec, operands: Sequence[Node]) -> str:
    """The dtype an einsum yields, following torch's promotion rules (and the join's dtype
    rule in the algebra registry)."""
    join = join_record(spec.join)
    if join.dtype_rule == UPDATE:  # the weight's: lr and step may be wider
        return canonical_dtype(torch_dtype(operands[1].dtype))
    if join.dtype_rule == CONDITION:  # the condition's dtype does not count
        operands = operands[1:]
    dtype = torch_dtype(operands[0].dtype)
    for node in operands[1:]:
        dtype = torch.promote_types(dtype, torch_dtype(node.dtype))
    if join.dtype_rule == BOOL and len(spec.inputs) > 1:
        dtype = torch.bool
    if join.dtype_rule == FLOATING and not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    if dtype == torch.bool and len(operands) > 1 and join.dtype_rule == NUMERIC:
        dtype = torch.int64
    if join.user:
        dtype = join_dtype(join, [torch_dtype(node.dtype) for node in operands])
    if dtype in (torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32) \
            and spec.aggregated and _agg_record(spec.agg).widens:
        dtype = torch.int64  # sums accumulate in int64, as torch.sum does (no silent wrap)
    return canonical_dtype(dtype)


def topological_order(*roots: Node) -> list[Node]:
    """Every node reachable from ``roots``, inputs before users, each once."""
    return inputs_first(*roots)


def substitute(root: Node, leaves: dict[str, Node], nodes: dict[int, Node] | None = None
               ) -> Node:
    """``root``'s graph with every stored tensor named in ``leaves`` replaced by the node
    given for it (e.g. a weight read from the store by an in-memory copy being trained) -- a
    read of a region of it (indexing) by that region of the node, :func:`region` -- and every
    node whose id is in ``nodes`` by the node given there; nodes that do not depend on a
    replaced one are kept as they are.

    >>> from tensorql.grid import ChunkGrid
    >>> a = Source(name="A", shape=(2,), dtype="float32", grid=ChunkGrid((2,), (2,)))
    >>> b = Source(name="B", shape=(2,), dtype="float32", grid=ChunkGrid((2,), (2,)))
    >>> new = substitute(EinsumOp.build("i,i->", [a, a]), {"A": b})
    >>> [n.describe() for n in topological_order(new)]
    ['scan B', 'einsum i,i->']
    """
    return substitute_many([root], leaves, nodes)[0]


def substitute_many(roots: Sequence[Node], leaves: dict[str, Node],
                    nodes: dict[int, Node] | None = None) -> list[Node]:
    """:func:`substitute` on several roots at once: what they share stays shared."""
    import dataclasses

    done: dict[int, Node] = {}
    nodes = nodes or {}
    for node in topological_order(*roots):
        replacement = nodes.get(id(node))
        if replacement is None and isinstance(node, Source) and node.name in leaves:
            replacement = leaves[node.name]
            if node.offset is not None:  # a region read by indexing: that region of it
                if replacement.shape != node.grid.shape:
                    raise ShapeError(f"cannot put a {replacement.shape} {replacement.dtype} "
                                     f"tensor in place of stored {node.name!r} "
                                     f"({node.grid.shape} {node.dtype})")
                replacement = region(replacement, node.offset, node.shape)
        if replacement is not None:
            new = replacement
            if new.shape != node.shape or new.dtype != node.dtype:
                raise ShapeError(f"cannot put a {new.shape} {new.dtype} tensor in place of "
                                 f"{node.describe()} ({node.shape} {node.dtype})")
            done[id(node)] = new
        elif isinstance(node, EinsumOp) and any(done[id(i)] is not i for i in node.operands):
            done[id(node)] = dataclasses.replace(
                node, operands=tuple(done[id(i)] for i in node.operands))
        elif isinstance(node, (MapOp, ReshapeOp, SoftmaxOp)) \
                and done[id(node.operand)] is not node.operand:
            done[id(node)] = dataclasses.replace(node, operand=done[id(node.operand)])
        else:
            done[id(node)] = node
    return [done[id(root)] for root in roots]


def region(node: Node, offset: Sequence[int], shape: Sequence[int]) -> Node:
    """The region of ``node`` starting at ``offset`` with ``shape`` (a slice of a computed
    node, which has no stored chunks to read a region from): per dimension it cuts, an
    einsum joining a (kept x size) boolean matrix with the values by ``where`` (the picked
    value, else 0) and summing over the size, as indexing a computed tensor does; gradients
    flow through it to ``node``.

    >>> from tensorql.grid import ChunkGrid
    >>> a = Source(name="A", shape=(3, 2), dtype="float32", grid=ChunkGrid((3, 2), (3, 2)))
    >>> cut = region(a, (1, 0), (2, 2))
    >>> cut.shape, [n.describe() for n in topological_order(cut)][-1]
    ((2, 2), 'einsum ca,ab,->cb join=where')
    """
    from tensorql.einsum.literals import constant_node

    labels = "".join(chr(ord("a") + k) for k in range(node.ndim + 1))
    out = node
    for d, (start, size, n) in enumerate(zip(offset, shape, node.shape)):
        if (start, size) == (0, n):
            continue
        picks = torch.zeros((size, n), dtype=torch.bool)
        picks[torch.arange(size), torch.arange(start, start + size)] = True
        kept, dims = labels[node.ndim], labels[:node.ndim]
        zero = constant_node(torch.zeros((), dtype=torch_dtype(node.dtype)))
        out = EinsumOp.build(f"{kept}{dims[d]},{dims},->{dims[:d]}{kept}{dims[d + 1:]}",
                             [constant_node(picks), out, zero], join=JoinName.WHERE)
        if out.dtype != node.dtype:  # integers summed as int64
            out = MapOp.build("cast", out, dtype=node.dtype)
    return out


def explain_graph(root: Node) -> str:
    """The einsum graph as text, one node a line, inputs first (the EXPLAIN stage "einsum").

    >>> from tensorql.grid import ChunkGrid
    >>> a = Source(name="A", shape=(2, 3), dtype="float32", grid=ChunkGrid((2, 3), (2, 3)))
    >>> print(explain_graph(EinsumOp.build("ij,kj->ik", [a, a])))
    einsum graph: 2 nodes
    [0] scan A  2x3 float32
    [1] einsum ij,kj->ik  2x2 float32 <- [0], [0]
    """
    order = topological_order(root)
    index = {id(n): k for k, n in enumerate(order)}
    lines = [f"einsum graph: {len(order)} nodes"]
    for k, node in enumerate(order):
        shape = "x".join(map(str, node.shape)) or "scalar"
        text = f"[{k}] {node.describe()}  {shape} {node.dtype}"
        if node.inputs:
            text += " <- " + ", ".join(f"[{index[id(i)]}]" for i in node.inputs)
        lines.append(text)
    return "\n".join(lines)
