"""Logical plan nodes: a tensor-relational algebra over chunked tensors.

A tensor tiled into blocks is a relation ``key -> chunk`` (:class:`TensorRelation`). An einsum
becomes ``Join``s on the shared labels' keys (each pair of matching chunks runs the same einsum
on chunk shapes) and an ``Aggregate`` over the keys of aggregated labels. ``Rekey`` retiles a
relation so that a label is tiled alike in every operand; ``Map`` applies an elementwise
function chunk by chunk; ``Reshape`` reshapes chunk by chunk (after a ``Rekey`` that makes
that possible); ``Softmax`` normalises along a label each chunk holds whole; ``Scan`` reads
a stored tensor or an in-memory constant. The rewrite rules (:mod:`tensorql.logical.rules`)
add two kinds: ``Pointwise`` (a chain of maps and joins computed chunk by chunk in one pass)
and ``Attention`` (``softmax(q . k + mask) . v`` as one operation).

Plans are frozen and compared by identity: a shared subplan is one node.

>>> from tensorql.grid import ChunkGrid
>>> r = TensorRelation(labels=("i", "j"), grid=ChunkGrid((4, 6), (2, 3)), dtype="float32")
>>> r.shape, r.tile_of("j"), r.nbytes
((4, 6), 3, 96)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

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
    # the field holding the inputs: "input" (one), "sources" (a tuple), None (a leaf)
    _inputs_field: ClassVar[str | None] = None

    @property
    def inputs(self) -> tuple[LogicalNode, ...]:
        return ()

    def with_inputs(self, inputs: tuple[LogicalNode, ...]) -> LogicalNode:
        """This node reading ``inputs`` instead: itself when they are its own (a rewrite
        returns the same object for "no change"), else a new node."""
        if len(inputs) == len(self.inputs) and all(a is b for a, b in zip(inputs, self.inputs)):
            return self
        if self._inputs_field == "input":
            return dataclasses.replace(self, input=inputs[0])
        return dataclasses.replace(self, **{self._inputs_field: tuple(inputs)})


@dataclass(frozen=True, eq=False)
class Scan(LogicalNode):
    """Read a stored tensor (``source`` is its name) or a constant (``constant`` set)."""

    source: str = ""
    constant: torch.Tensor | None = None
    # a region of the stored tensor: where it starts, and the stored tensor's own grid
    offset: tuple[int, ...] | None = None
    stored_grid: ChunkGrid | None = None

    @property
    def title(self) -> str:
        """The step's name in plans, e.g. ``Scan A``."""
        return f"Scan {self.source}"


@dataclass(frozen=True, eq=False)
class Rekey(LogicalNode):
    """Retile ``input`` into ``relation.grid`` (same data, different chunk keys)."""

    _inputs_field: ClassVar[str | None] = "input"

    input: LogicalNode | None = None

    @property
    def inputs(self) -> tuple[LogicalNode, ...]:
        return (self.input,)

    @property
    def title(self) -> str:
        """The step's name in plans, e.g. ``Rekey to tiles (4, 6)``."""
        return f"Rekey to tiles {self.relation.grid.tile}"


@dataclass(frozen=True, eq=False)
class Join(LogicalNode):
    """Join 1 or 2 relations on shared label keys; each match runs ``join`` on its chunks.

    ``input_labels[n]`` names the dims of input ``n`` (a repeated label is a diagonal).
    The relation's labels are every distinct label of the inputs.
    """

    _inputs_field: ClassVar[str | None] = "sources"

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

    @property
    def title(self) -> str:
        """The step's name in plans (a join with no aggregation over it), e.g. ``Join mul on
        [j]``, or ``Project (i,j)->(j,i)`` for one input."""
        if len(self.sources) >= 2:
            return f"Join {self.join} on [{', '.join(self.on)}]"
        return (f"Project ({','.join(self.input_labels[0])})->"
                f"({','.join(self.relation.labels)})")


@dataclass(frozen=True, eq=False)
class Aggregate(LogicalNode):
    """Group ``input`` by ``relation.labels`` and reduce the labels ``over`` with ``agg``."""

    _inputs_field: ClassVar[str | None] = "input"

    input: LogicalNode | None = None
    over: tuple[str, ...] = ()
    agg: str = AggName.SUM

    @property
    def inputs(self) -> tuple[LogicalNode, ...]:
        return (self.input,)

    @property
    def title(self) -> str:
        """The step's name in plans, e.g. ``Aggregate sum over [j]``."""
        return f"Aggregate {self.agg} over [{', '.join(self.over)}]"


@dataclass(frozen=True, eq=False)
class Map(LogicalNode):
    """Apply elementwise ``fn`` (with ``scalar`` for scalar maps) to every chunk."""

    _inputs_field: ClassVar[str | None] = "input"

    input: LogicalNode | None = None
    fn: str = ""
    scalar: float | None = None

    @property
    def inputs(self) -> tuple[LogicalNode, ...]:
        return (self.input,)

    @property
    def title(self) -> str:
        """The step's name in plans, e.g. ``Map relu``."""
        return f"Map {self.fn}"


@dataclass(frozen=True, eq=False)
class Reshape(LogicalNode):
    """``input``'s elements in row-major order, in ``relation``'s shape, chunk by chunk: the
    input is tiled so that each of its chunks, reshaped, is one output chunk (see
    :mod:`tensorql.logical.reshape`)."""

    _inputs_field: ClassVar[str | None] = "input"

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

    _inputs_field: ClassVar[str | None] = "input"

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


@dataclass(frozen=True)
class PointwiseOp:
    """One op of a :class:`Pointwise` chain: a map (``input_labels`` empty; ``fn`` with
    ``scalar``) or a join with no aggregation (``fn`` the join, ``input_labels`` its
    operands' labels), producing ``relation``; each of ``args`` is an outside input of the
    chain (``k >= 0``) or the result of op ``-k - 1``."""

    fn: str
    args: tuple[int, ...]
    relation: TensorRelation
    scalar: float | None = None
    input_labels: tuple[tuple[str, ...], ...] = ()

    @property
    def is_map(self) -> bool:
        return not self.input_labels


@dataclass(frozen=True, eq=False)
class Pointwise(LogicalNode):
    """A chain of maps and joins (no aggregation) computed chunk by chunk in one pass (rule
    :mod:`~tensorql.logical.rules.pointwise`): ``ops`` in dependency order, the last one's
    result is this node's; ``source_labels[k]`` names the dims of outside input ``k`` with
    this node's labels (a broadcast input has fewer)."""

    _inputs_field: ClassVar[str | None] = "sources"

    sources: tuple[LogicalNode, ...] = ()
    source_labels: tuple[tuple[str, ...], ...] = ()
    ops: tuple[PointwiseOp, ...] = ()
    rule: str = "fuse_pointwise"

    @property
    def inputs(self) -> tuple[LogicalNode, ...]:
        return self.sources

    @property
    def row_dim(self) -> int | None:
        """The dim cut into row blocks as a chunk is computed (the first tiled longer than
        1: a leading batch dim of 1 would leave one block), None for a scalar."""
        longer = [d for d, n in enumerate(self.relation.grid.tile) if n > 1]
        return longer[0] if longer else None

    @property
    def title(self) -> str:
        """The step's name in plans, e.g. ``Pointwise relu <- add`` (last op first)."""
        return "Pointwise " + " <- ".join(op.fn for op in reversed(self.ops))


@dataclass(frozen=True)
class AttentionLabels:
    """The labels of an attention chain (all in the chain's last product's names): of q, k,
    v, the mask (None: no mask) and the output; ``n`` the batch/head labels q, k and v share,
    ``s`` the query-only ones, ``e`` the contracted head dims, ``t`` the softmax (key)
    label, ``v_only`` the value-only dims."""

    q: tuple[str, ...]
    k: tuple[str, ...]
    v: tuple[str, ...]
    mask: tuple[str, ...] | None
    out: tuple[str, ...]
    n: tuple[str, ...]
    s: tuple[str, ...]
    e: tuple[str, ...]
    t: tuple[str, ...]
    v_only: tuple[str, ...]

    @property
    def sources(self) -> tuple[tuple[str, ...], ...]:
        """The labels of each source: q, k, v, then the mask if any."""
        return (self.q, self.k, self.v) + ((self.mask,) if self.mask is not None else ())


@dataclass(frozen=True, eq=False)
class Attention(LogicalNode):
    """``softmax(scale * q . k + mask) . v`` along ``labels.t`` as one operation (rule
    :mod:`~tensorql.logical.rules.attention`); ``sources`` are q, k, v and the mask, tiled
    as the fused step reads them (a chunk of q per output chunk, every chunk along the keys
    of k, v and the mask)."""

    _inputs_field: ClassVar[str | None] = "sources"

    sources: tuple[LogicalNode, ...] = ()
    labels: AttentionLabels | None = None
    scale: float = 1.0
    rule: str = "match_attention"

    @property
    def inputs(self) -> tuple[LogicalNode, ...]:
        return self.sources

    @property
    def title(self) -> str:
        """The step's name in plans, e.g. ``Attention softmax over [t] with mask``."""
        return f"Attention softmax over [{self.labels.t[0]}]" + (
            " with mask" if self.labels.mask is not None else "")


@dataclass(frozen=True, eq=False)
class Results(LogicalNode):
    """Several results planned together (a training step's loss, weights and slots): the
    rewrite rules see them as one graph; never a step of its own."""

    _inputs_field: ClassVar[str | None] = "sources"

    sources: tuple[LogicalNode, ...] = ()

    @property
    def inputs(self) -> tuple[LogicalNode, ...]:
        return self.sources


def contraction_joins(nodes: list[LogicalNode], roots: tuple[LogicalNode, ...] = ()
                      ) -> set[int]:
    """The ids of the joins among ``nodes`` that are one contraction with the ``Aggregate``
    reading them (one step, one partitioned operation), results excepted. The one place
    this pairing is decided (the partition stage and the physical builder read it).

    >>> from tensorql.grid import ChunkGrid
    >>> rel = TensorRelation(("i",), ChunkGrid((4,), (4,)), "float32")
    >>> a = Scan(rel, source="A")
    >>> join = Join(rel, sources=(a, a), input_labels=(("i",), ("i",)))
    >>> total = Aggregate(TensorRelation((), ChunkGrid((), ()), "float32"), input=join,
    ...                   over=("i",))
    >>> contraction_joins(walk(total)) == {id(join)}, contraction_joins(walk(total), (join,))
    (True, set())
    """
    results = {id(r) for r in roots}
    return {id(n.input) for n in nodes if isinstance(n, Aggregate)
            and isinstance(n.input, Join) and id(n.input) not in results}


def walk(*roots: LogicalNode) -> list[LogicalNode]:
    """Every node reachable from ``roots`` once, inputs before users."""
    return inputs_first(*roots)


def node_title(node: LogicalNode) -> str:
    """A logical node's name in plans (EXPLAIN's text and its graphs), e.g.
    ``Aggregate sum over [j]``."""
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
    if isinstance(node, (Pointwise, Attention)):
        return f"{node.title} [rule {node.rule}]"
    return type(node).__name__


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
    head = node_title

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
