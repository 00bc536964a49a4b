"""The operation graph the optimizer partitions, read off the logical plan.

The optimizer does not lower the einsum graph a second time: it walks the logical plan that
:func:`tensorql.logical.lower.lower` produced (so its contraction order is the lowering's, the
one :mod:`tensorql.logical.path` chose) and makes one :class:`OpNode` per physical step:

* ``Scan`` -> a ``source`` / ``constant`` node;
* ``Aggregate(Join)`` (or a ``Join`` alone) -> an ``einsum`` node over the joined relations;
* ``Map`` -> a ``map`` node;
* ``Reshape`` -> a ``reshape`` node over its output labels and the input's (``in0``, ...),
  kept in one piece: its input is gathered whole on the device that reshapes it;
* ``Softmax`` -> a ``softmax`` node whose axis is never cut (``whole``);
* ``Pointwise`` (a fused chain of maps and joins) -> a ``pointwise`` node: elementwise over
  its output labels, one operand per outside input (with its labels: a broadcast one has
  fewer), priced at one op per element per fused op;
* ``Attention`` -> an ``attention`` node over the output labels then the keys and the
  contracted head dims, which -- with the value head dims -- are never cut: the fused kernel
  needs whole rows of keys; batch, heads and queries may be cut;
* ``Rekey`` only retiles, and the partition stage picks its own pieces, so it is looked through.

Every :class:`OpNode` lists its labels with the output labels first, then the aggregated ones,
and is named as its step is on one device (``Aggregate sum over [j]``, ``Map relu``);
labels are the logical plan's, so a dimension keeps its name from EXPLAIN's logical section to
its partitioning. A dim of size 1 broadcast against a larger size has a private label ``i@n``.

>>> import torch
>>> from tensorql.grid import ChunkGrid
>>> from tensorql.einsum.graph import Constant, EinsumOp
>>> def const(*shape):
...     return Constant(shape=shape, dtype="float32", value=torch.ones(shape),
...                     grid=ChunkGrid(shape, shape))
>>> g = OpGraph.build(EinsumOp.build("ij,jk,kl->il", [const(4, 6), const(6, 4), const(4, 6)]))
>>> [(n.kind, n.labels, n.out_labels) for n in g.nodes if n.kind == "einsum"]
[('einsum', ('i', 'k', 'j'), ('i', 'k')), ('einsum', ('i', 'l', 'k'), ('i', 'l'))]
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from tensorql.algebra import AggName, JoinName, agg_record, is_update
from tensorql.dtypes import itemsize
from tensorql.einsum.graph import Node
from tensorql.errors import PlanError
from tensorql.logical.lower import lower
from tensorql.logical.plan import (
    Aggregate,
    Attention,
    Join,
    LogicalNode,
    Map,
    Pointwise,
    Rekey,
    Reshape,
    Scan,
    Softmax,
    contraction_joins,
    walk,
)


@dataclass(frozen=True)
class Edge:
    """Operand of an op: the producing node and the op's label for each of its axes."""

    producer: int
    axes: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class OpNode:
    """One operation (or stored tensor) of the optimizer's graph.

    ``labels`` are the output labels (in output axis order) followed by aggregated labels;
    ``sizes`` gives each label's size in the same order.
    """

    index: int
    kind: str  # "source" | "constant" | "einsum" | "map" | "reshape" | "softmax"
    # | "pointwise" | "attention"
    labels: tuple[str, ...]
    sizes: tuple[int, ...]
    n_out: int
    inputs: tuple[Edge, ...]
    dtype: str
    name: str
    join: str = JoinName.MUL
    agg: str = AggName.SUM
    fn: str = ""
    scalar: float | None = None
    logical: LogicalNode | None = None  # the logical node this step computes
    whole: tuple[str, ...] = ()  # labels never cut into pieces (a softmax's axis; a reshape)
    everywhere: bool = False  # a source/constant every device can load (see loaded_where_read)

    @property
    def out_labels(self) -> tuple[str, ...]:
        return self.labels[: self.n_out]

    @property
    def work(self) -> int:
        """Operations per element of a task's index space (its labels' extents multiplied):
        one per operand for a join, one per fused op of a pointwise chain, two (a multiply
        and an add) for attention; none for loads and reshapes (copies)."""
        if self.kind == "pointwise":
            return len(self.logical.ops)
        if self.kind == "attention":
            return 2
        return max(1, len(self.inputs)) if self.kind in ("einsum", "map", "softmax") else 0

    def flops(self, lens: np.ndarray) -> np.ndarray:
        """The FLOPs of tasks whose labels' extents are the rows of ``lens``: ``work`` per
        element of the index space, but for attention 2 per multiply-add of its two
        products, ``2 * N*S*T * (E + V)`` (the figure the single-device step reports)."""
        if self.kind != "attention":
            return np.prod(lens, axis=1) * self.work
        lab = self.logical.labels
        at = [[self.labels.index(x) for x in group]
              for group in (lab.n + lab.s + lab.t, lab.e, lab.v_only)]
        base, e, v = (np.prod(lens[:, cols], axis=1) for cols in at)
        return 2 * base * (e + v)

    @property
    def chunk_target(self) -> dict[str, int] | None:
        """The tile along each label that a piece of this operation is cut into in the
        physical plan (its logical step's tiles; a label read as a diagonal stays whole; a
        label not named stays whole), or None where pieces run whole (a reshape, a scan
        of no logical node)."""
        if self.logical is None or self.kind == "reshape":
            return None
        logical = self.logical.input if isinstance(self.logical, Aggregate) else self.logical
        rel = logical.relation
        target = dict(zip(rel.labels, rel.grid.tile))
        for edge in self.inputs:  # a diagonal reads blocks of its pieces whole
            for lab in edge.axes:
                if edge.axes.count(lab) > 1:
                    target[lab] = 1 << 62
        return target

    @property
    def loaded_where_read(self) -> bool:
        """A stored tensor or constant that every device can load itself (the ranks of a
        torch.distributed job each hold the inputs): each device loads the regions its
        operations read, so reading it moves no bytes between devices, whatever its pieces.
        Otherwise a stored tensor's pieces are at rest on their devices and others' reads of
        them are sent."""
        return self.everywhere

    @property
    def agg_labels(self) -> tuple[str, ...]:
        return self.labels[self.n_out:]

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.sizes[: self.n_out]

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)


@dataclass(frozen=True, eq=False)
class OpGraph:
    """Nodes in topological order; ``root`` is the index of the result."""

    nodes: tuple[OpNode, ...]
    root: int
    logical: LogicalNode | None = None
    also: tuple[int, ...] = ()  # further results of a multi-output plan (a training step)

    @functools.cached_property
    def consumers(self) -> dict[int, list[tuple[int, int]]]:
        """Producer index -> [(consumer index, operand position)]."""
        out: dict[int, list[tuple[int, int]]] = {n.index: [] for n in self.nodes}
        for node in self.nodes:
            for k, edge in enumerate(node.inputs):
                out[edge.producer].append((node.index, k))
        return out

    @classmethod
    def build(cls, root: Node | LogicalNode, also: tuple[LogicalNode, ...] = (),
              sources_everywhere: bool = False) -> OpGraph:
        """The graph of a logical plan (an einsum-graph node is lowered first); ``also``:
        further results planned with it (their shared operations once);
        ``sources_everywhere``: every device can load the stored tensors and constants
        itself (:attr:`OpNode.loaded_where_read`)."""
        logical = root if isinstance(root, LogicalNode) else lower(root)
        builder = _Builder(sources_everywhere)
        nodes = walk(logical, *also)
        fused = contraction_joins(nodes, (logical, *also))
        for node in nodes:
            if id(node) not in fused:  # a Join is planned with the Aggregate it feeds
                builder.add(node)
        return cls(nodes=tuple(builder.nodes), root=builder.index_of[id(logical)],
                   logical=logical, also=tuple(builder.index_of[id(n)] for n in also))


class _Builder:
    def __init__(self, sources_everywhere: bool = False) -> None:
        self.sources_everywhere = sources_everywhere
        self.nodes: list[OpNode] = []
        self.index_of: dict[int, int] = {}

    def _append(self, **fields) -> int:
        index = len(self.nodes)
        self.nodes.append(OpNode(index=index, **fields))
        return index

    def add(self, node: LogicalNode) -> None:
        rel = node.relation
        if isinstance(node, Rekey):  # looked through: the partition stage picks the pieces
            self.index_of[id(node)] = self.index_of[id(node.input)]
            return
        if isinstance(node, Scan):
            kind = "constant" if node.constant is not None else "source"
            idx = self._append(kind=kind, labels=rel.labels, sizes=rel.shape, n_out=rel.ndim,
                               inputs=(), dtype=rel.dtype, name=node.title, logical=node,
                               everywhere=self.sources_everywhere)
        elif isinstance(node, Map):
            edge = Edge(self.index_of[id(node.input)], rel.labels)
            idx = self._append(kind="map", labels=rel.labels, sizes=rel.shape, n_out=rel.ndim,
                               inputs=(edge,), dtype=rel.dtype, name=node.title, fn=node.fn,
                               scalar=node.scalar, logical=node)
        elif isinstance(node, Reshape):
            inner = tuple(f"in{k}" for k in range(node.input.relation.ndim))
            edge = Edge(self.index_of[id(node.input)], inner)
            idx = self._append(kind="reshape", labels=rel.labels + inner,
                               sizes=rel.shape + node.input.relation.shape, n_out=rel.ndim,
                               inputs=(edge,), dtype=rel.dtype,
                               name=node.title,
                               logical=node, whole=rel.labels + inner)
        elif isinstance(node, Softmax):
            edge = Edge(self.index_of[id(node.input)], rel.labels)
            fn = "log_softmax" if node.log else "softmax"
            idx = self._append(kind="softmax", labels=rel.labels, sizes=rel.shape,
                               n_out=rel.ndim, inputs=(edge,), dtype=rel.dtype,
                               name=node.title, fn=fn, logical=node,
                               whole=(node.label,))
        elif isinstance(node, Pointwise):
            edges = tuple(Edge(self.index_of[id(src)], labels)
                          for src, labels in zip(node.sources, node.source_labels))
            idx = self._append(kind="pointwise", labels=rel.labels, sizes=rel.shape,
                               n_out=rel.ndim, inputs=edges, dtype=rel.dtype, name=node.title,
                               logical=node)
        elif isinstance(node, Attention):
            idx = self._attention(node)
        elif isinstance(node, Aggregate) and isinstance(node.input, Join):
            idx = self._contraction(node.input, node)
        elif isinstance(node, Join):
            idx = self._contraction(node, None)
        else:
            raise PlanError(f"the optimizer cannot plan logical node {type(node).__name__}")
        self.index_of[id(node)] = idx

    def _attention(self, node: Attention) -> int:
        lab = node.labels
        size: dict[str, int] = {}
        for src, labels in zip(node.sources, lab.sources):
            size |= dict(zip(labels, src.relation.shape))
        labels = lab.out + lab.t + lab.e
        edges = tuple(Edge(self.index_of[id(src)], labels)
                      for src, labels in zip(node.sources, lab.sources))
        return self._append(kind="attention", labels=labels,
                            sizes=tuple(size[label] for label in labels), n_out=len(lab.out),
                            inputs=edges, dtype=node.relation.dtype, name=node.title,
                            logical=node, whole=lab.t + lab.e + lab.v_only)

    def _contraction(self, join: Join, aggregate: Aggregate | None) -> int:
        out = (aggregate or join).relation
        joint = join.relation
        size = dict(zip(joint.labels, joint.shape))
        over = aggregate.over if aggregate is not None else ()
        labels = tuple(out.labels) + tuple(over)
        inputs = tuple(Edge(self.index_of[id(src)], tuple(axes))
                       for src, axes in zip(join.sources, join.input_labels))
        name = (aggregate or join).title  # the step's name on one device too
        # an optimizer update computes its three slots in one pass: they stay together; the
        # labels of an aggregation that is not associative are never cut (no partials of it)
        whole = ((out.labels[0],) if is_update(join.join) else ()) + \
            (() if aggregate is None or agg_record(aggregate.agg).associative else tuple(over))
        return self._append(kind="einsum", labels=labels,
                            sizes=tuple(size[lab] for lab in labels), n_out=len(out.labels),
                            inputs=inputs, dtype=out.dtype, name=name, join=join.join,
                            agg=aggregate.agg if aggregate else AggName.SUM,
                            logical=aggregate if aggregate is not None else join, whole=whole)
