"""The operation graph the optimizer partitions: every einsum with at most two operands.

An einsum of three or more operands is split into pairwise steps (the contraction order of
:mod:`tensorql.optimizer.order` for the semirings; a left fold otherwise, as the lowering does).
Every :class:`OpNode` lists its labels with the output labels first, then the aggregated ones;
a dim of size 1 broadcast against a larger size gets a private size-1 label ``i@n``.

>>> import torch
>>> from tensorql.grid import ChunkGrid
>>> from tensorql.einsum.graph import Constant, EinsumOp
>>> a = Constant(shape=(4, 6), dtype="float32", value=torch.ones(4, 6),
...              grid=ChunkGrid((4, 6), (4, 6)))
>>> g = OpGraph.build(EinsumOp.build("ij,jk,kl->il", [a, a.__class__(
...     shape=(6, 4), dtype="float32", value=torch.ones(6, 4), grid=ChunkGrid((6, 4), (6, 4))),
...     a]))
>>> [(n.kind, n.labels, n.out_labels) for n in g.nodes][2:]
[('einsum', ('i', 'k', 'j'), ('i', 'k')), ('einsum', ('i', 'l', 'k'), ('i', 'l'))]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tensorql.dtypes import itemsize
from tensorql.einsum.graph import Constant, EinsumOp, MapOp, Node, Source, topological_order
from tensorql.errors import PlanError
from tensorql.logical.path import contraction_path


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
    kind: str  # "source" | "constant" | "einsum" | "map"
    labels: tuple[str, ...]
    sizes: tuple[int, ...]
    n_out: int
    inputs: tuple[Edge, ...]
    dtype: str
    name: str
    join: str = "mul"
    agg: str = "sum"
    fn: str = ""
    scalar: float | None = None
    node: Node | None = None  # the einsum-graph node for sources, constants and final steps

    @property
    def out_labels(self) -> tuple[str, ...]:
        return self.labels[: self.n_out]

    @property
    def agg_labels(self) -> tuple[str, ...]:
        return self.labels[self.n_out:]

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.sizes[: self.n_out]

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    def size_of(self, label: str) -> int:
        return self.sizes[self.labels.index(label)]


@dataclass(frozen=True, eq=False)
class OpGraph:
    """Nodes in topological order; ``root`` is the index of the result."""

    nodes: tuple[OpNode, ...]
    root: int

    @property
    def consumers(self) -> dict[int, list[tuple[int, int]]]:
        """Producer index -> [(consumer index, operand position)]."""
        out: dict[int, list[tuple[int, int]]] = {n.index: [] for n in self.nodes}
        for node in self.nodes:
            for k, edge in enumerate(node.inputs):
                out[edge.producer].append((node.index, k))
        return out

    @classmethod
    def build(cls, root: Node) -> OpGraph:
        builder = _Builder()
        for node in topological_order(root):
            builder.add(node)
        return cls(nodes=tuple(builder.nodes), root=builder.index_of[id(root)])


def _positional(ndim: int) -> tuple[str, ...]:
    return tuple(f"a{k}" for k in range(ndim))


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[OpNode] = []
        self.index_of: dict[int, int] = {}

    def _append(self, **fields) -> int:
        index = len(self.nodes)
        self.nodes.append(OpNode(index=index, **fields))
        return index

    def add(self, node: Node) -> None:
        if isinstance(node, (Source, Constant)):
            labels = _positional(node.ndim)
            kind = "source" if isinstance(node, Source) else "constant"
            name = node.describe()
            idx = self._append(kind=kind, labels=labels, sizes=tuple(node.shape),
                               n_out=node.ndim, inputs=(), dtype=node.dtype, name=name, node=node)
        elif isinstance(node, MapOp):
            labels = _positional(node.ndim)
            edge = Edge(self.index_of[id(node.operand)], labels)
            idx = self._append(kind="map", labels=labels, sizes=tuple(node.shape),
                               n_out=node.ndim, inputs=(edge,), dtype=node.dtype,
                               name=node.describe(), fn=node.fn, scalar=node.scalar, node=node)
        elif isinstance(node, EinsumOp):
            idx = self._einsum(node)
        else:
            raise PlanError(f"the optimizer cannot plan node {type(node).__name__}")
        self.index_of[id(node)] = idx

    def _step(self, op: EinsumOp, operands: Sequence[tuple[int, tuple[str, ...]]],
              out: tuple[str, ...], sizes: dict[str, int], final: bool) -> int:
        joint = tuple(dict.fromkeys(lab for _, labels in operands for lab in labels))
        agg = tuple(lab for lab in joint if lab not in out)
        labels = tuple(out) + agg
        name = op.describe() if final else f"{op.describe()} (step {''.join(out) or '-'})"
        return self._append(kind="einsum", labels=labels,
                            sizes=tuple(sizes[lab] for lab in labels), n_out=len(out),
                            inputs=tuple(Edge(p, lab) for p, lab in operands),
                            dtype=op.dtype, name=name, join=op.spec.join, agg=op.spec.agg,
                            node=op if final else None)

    def _einsum(self, op: EinsumOp) -> int:
        spec = op.spec
        sizes = dict(spec.sizes)
        operands: list[tuple[int, tuple[str, ...]]] = []
        for n, (labels, squeeze, child) in enumerate(zip(spec.inputs, spec.squeezed,
                                                         op.operands)):
            named = tuple(f"{lab}@{n}" if sq else lab for lab, sq in zip(labels, squeeze))
            for lab, sq in zip(labels, squeeze):
                if sq:
                    sizes[f"{lab}@{n}"] = 1
            operands.append((self.index_of[id(child)], named))
        output = tuple(spec.output)
        if len(operands) <= 2:
            return self._step(op, operands, output, sizes, True)
        if spec.is_semiring:
            itemsize_ = itemsize(op.dtype)
            path = contraction_path([lab for _, lab in operands], output, sizes,
                                    itemsize=itemsize_)
            current = list(operands)
            for position, pair in enumerate(path):
                picked = [current[k] for k in sorted(pair)]
                current = [o for k, o in enumerate(current) if k not in pair]
                if position == len(path) - 1 and not current:
                    return self._step(op, picked, output, sizes, True)
                needed = {lab for _, labels in current for lab in labels} | set(output)
                kept = tuple(lab for lab in dict.fromkeys(
                    lab for _, labels in picked for lab in labels) if lab in needed)
                current.append((self._step(op, picked, kept, sizes, False), kept))
            ((last, labels),) = current
            return self._step(op, [(last, labels)], output, sizes, True)
        result = operands[0]
        for n in range(1, len(operands) - 1):  # left fold keeps every label until the end
            joint = tuple(dict.fromkeys(result[1] + operands[n][1]))
            result = (self._step(op, [result, operands[n]], joint, sizes, False), joint)
        return self._step(op, [result, operands[-1]], output, sizes, True)
