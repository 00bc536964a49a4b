"""Logical plan nodes: a tensor-relational algebra over chunked tensors.

A tensor tiled into blocks is a relation ``key -> chunk`` (:class:`TensorRelation`). An einsum
becomes ``Join``s on the shared labels' keys (each pair of matching chunks runs the same einsum
on chunk shapes) and an ``Aggregate`` over the keys of aggregated labels. ``Rekey`` retiles a
relation so that a label is tiled alike in every operand; ``Map`` applies an elementwise
function chunk by chunk; ``Reshape`` reshapes chunk by chunk (after a ``Rekey`` that makes
that possible); ``Softmax`` normalises along a label each chunk holds whole; ``Scan`` reads
a stored tensor or an in-memory constant.

Plans are frozen and compared by identity: a shared subplan is one node.

>>> from tensorql.grid import ChunkGrid
>>> r = TensorRelation(labels=("i", "j"), grid=ChunkGrid((4, 6), (2, 3)), dtype="float32")
>>> r.shape, r.tile_of("j"), r.nbytes
((4, 6), 3, 96)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tensorql.algebra import AggName, JoinName
from tensorql.dag import inputs_first
from tensorql.dtypes import itemsize
from tensorql.grid import ChunkGrid
from tensorql.logical.reshape import ReshapeLayout


@dataclass(frozen=True)
class TensorRelation:
    """A chunked tensor seen as a relation: label names of its dims, grid and dtype."""

    labels: tuple[str, ...]
    grid: ChunkGrid
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.grid.shape

    @property
    def ndim(self) -> int:
        return len(self.labels)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    def tile_of(self, label: str) -> int:
        return self.grid.tile[self.labels.index(label)]

    def describe(self) -> str:
        labels = ",".join(self.labels)
        shape = "x".join(map(str, self.shape)) or "scalar"
        blocks = "x".join(map(str, self.grid.blocks)) or "1"
        tiles = "x".join(map(str, self.grid.tile)) or "-"
        return f"({labels}) {shape} {self.dtype} grid {blocks} of {tiles}"


@dataclass(frozen=True, eq=False)
class LogicalNode:
    relation: TensorRelation

    @property
    def inputs(self) -> tuple[LogicalNode, ...]:
        return ()


@dataclass(frozen=True, eq=False)
class Scan(LogicalNode):
    """Read a stored tensor (``source`` is its name) or a constant (``constant`` set)."""

    source: str = ""
    constant: torch.Tensor | None = None
    # a region of the stored tensor: where it starts, and the stored tensor's own grid
    offset: tuple[int, ...] | None = None
    stored_grid: ChunkGrid | None = None


@dataclass(frozen=True, eq=False)
class Rekey(LogicalNode):
    """Retile ``input`` into ``relation.grid`` (same data, different chunk keys)."""

    input: LogicalNode | None = None

    @property
    def inputs(self) -> tuple[LogicalNode, ...]:
        return (self.input,)


@dataclass(frozen=True, eq=False)
class Join(LogicalNode):
    """Join 1 or 2 relations on shared label keys; each match runs ``join`` on its chunks.

    ``input_labels[n]`` names the dims of input ``n`` (a repeated label is a diagonal).
    The relation's labels are every distinct label of the inputs.
    """

    sources: tuple[LogicalNode, ...] = ()
    input_labels: tuple[tuple[str, ...], ...] = ()
    join: str = JoinName.MUL

    @property
    def inputs(self) -> tuple[LogicalNode, ...]:
        return self.sources

    @property
    def on(self) -> tuple[str, ...]:
        """Labels two or more inputs share: the join keys."""
        seen = [lab for labels in self.input_labels for lab in dict.fromkeys(labels)]
        return tuple(lab for lab in dict.fromkeys(seen) if seen.count(lab) > 1)


@dataclass(frozen=True, eq=False)
class Aggregate(LogicalNode):
    """Group ``input`` by ``relation.labels`` and reduce the labels ``over`` with ``agg``."""

    input: LogicalNode | None = None
    over: tuple[str, ...] = ()
    agg: str = AggName.SUM

    @property
    def inputs(self) -> tuple[LogicalNode, ...]:
        return (self.input,)


@dataclass(frozen=True, eq=False)
class Map(LogicalNode):
    """Apply elementwise ``fn`` (with ``scalar`` for scalar maps) to every chunk."""

    input: LogicalNode | None = None
    fn: str = ""
    scalar: float | None = None

    @property
    def inputs(self) -> tuple[LogicalNode, ...]:
        return (self.input,)


@dataclass(frozen=True, eq=False)
class Reshape(LogicalNode):
    """``input``'s elements in row-major order, in ``relation``'s shape, chunk by chunk: the
    input is tiled so that each of its chunks, reshaped, is one output chunk (see
    :mod:`tensorql.logical.reshape`)."""

    input: LogicalNode | None = None
    layout: ReshapeLayout | None = None  # the input's grid, the output's and the key mapping

    @property
    def inputs(self) -> tuple[LogicalNode, ...]:
        return (self.input,)

    @property
    def title(self) -> str:
        """The step's name in plans, e.g. ``Reshape to 4x6``."""
        return f"Reshape to {'x'.join(map(str, self.relation.shape)) or 'scalar'}"


@dataclass(frozen=True, eq=False)
class Softmax(LogicalNode):
    """``softmax`` (``log_softmax`` with ``log``) of ``input`` along label ``label``, chunk by
    chunk: every chunk holds the whole of that label (its tile is the full size)."""

    input: LogicalNode | None = None
    label: str = ""
    log: bool = False

    @property
    def inputs(self) -> tuple[LogicalNode, ...]:
        return (self.input,)

    @property
    def title(self) -> str:
        """The step's name in plans, e.g. ``Softmax over [t]``."""
        return f"{'LogSoftmax' if self.log else 'Softmax'} over [{self.label}]"


def walk(*roots: LogicalNode) -> list[LogicalNode]:
    """Every node reachable from ``roots`` once, inputs before users."""
    return inputs_first(*roots)


def explain_logical(root: LogicalNode) -> str:
    """The logical plan as a tree (the EXPLAIN stage "logical"): relational operators over
    chunk relations, each with its labels, shape, dtype and chunk grid. A label keeps its name
    from here to the partitioning and the physical plan.

    >>> from tensorql.grid import ChunkGrid
    >>> scan = Scan(relation=TensorRelation(("i", "j"), ChunkGrid((4, 6), (2, 6)), "float32"),
    ...             source="A")
    >>> print(explain_logical(Map(relation=scan.relation, input=scan, fn="exp")))
    Map exp  (i,j) 4x6 float32 grid 2x1 of 2x6
    └─ Scan A  (i,j) 4x6 float32 grid 2x1 of 2x6
    """
    lines: list[str] = []
    seen: dict[int, int] = {}

    def head(node: LogicalNode) -> str:
        if isinstance(node, Scan):
            return f"Scan {node.source}"
        if isinstance(node, Rekey):
            return f"Rekey to tiles {node.relation.grid.tile}"
        if isinstance(node, Join):
            ins = ",".join("(" + ",".join(labels) + ")" for labels in node.input_labels)
            on = f" on [{', '.join(node.on)}]" if node.on else ""
            return f"Join {node.join}{on} {ins}"
        if isinstance(node, Aggregate):
            return f"Aggregate {node.agg} over [{', '.join(node.over)}]"
        if isinstance(node, Map):
            return f"Map {node.fn}" + (f"({node.scalar:g})" if node.scalar is not None else "")
        if isinstance(node, (Softmax, Reshape)):
            return node.title
        return type(node).__name__

    def render(node: LogicalNode, prefix: str, child_prefix: str) -> None:
        if id(node) in seen:
            lines.append(f"{prefix}{head(node)} (shared, #{seen[id(node)]} above)")
            return
        seen[id(node)] = len(seen)
        lines.append(f"{prefix}{head(node)}  {node.relation.describe()}")
        children = node.inputs
        for n, child in enumerate(children):
            last = n == len(children) - 1
            render(child, child_prefix + ("└─ " if last else "├─ "),
                   child_prefix + ("   " if last else "│  "))

    render(root, "", "")
    return "\n".join(lines)
