"""Rule ``fuse_pointwise``: a chain of maps and joins with no aggregation, each reading its
producer chunk for chunk, becomes one :class:`~tensorql.logical.plan.Pointwise` node, computed
chunk by chunk in one pass over memory (one task per chunk instead of one per op and chunk).

A map or join whose only reader is another pointwise node over the same chunks (the same
labels, none broadcast, tiled alike) joins its reader's chain; a join that feeds an
aggregation is left to it (the pair is one contraction), and so are optimizer updates (they
stack their slots) and diagonals.

>>> from tensorql.grid import ChunkGrid
>>> from tensorql.logical.plan import Map, Scan, TensorRelation, explain_logical
>>> rel = TensorRelation(("i", "j"), ChunkGrid((4, 6), (2, 6)), "float32")
>>> x = Scan(rel, source="x")
>>> plan = Map(rel, input=Map(rel, input=x, fn="exp"), fn="relu")
>>> print(explain_logical(fuse_pointwise(plan)))
Pointwise relu <- exp [rule fuse_pointwise]  (i,j) 4x6 float32 grid 2x1 of 2x6
└─ Scan x  (i,j) 4x6 float32 grid 2x1 of 2x6
>>> fuse_pointwise(x) is x
True
"""

from __future__ import annotations

from tensorql.algebra import is_update
from tensorql.logical.plan import (
    Aggregate,
    Join,
    LogicalNode,
    Map,
    Pointwise,
    PointwiseOp,
    walk,
)
from tensorql.logical.rules.common import readers as readers_of
from tensorql.logical.rules.common import rebuild, results_of

NAME = "fuse_pointwise"


def fuse_pointwise(root: LogicalNode) -> LogicalNode:
    """``root`` with every chain of two or more pointwise nodes fused (see the module doc);
    ``root`` itself when there is none."""
    nodes = walk(root)
    roots = results_of(root)
    in_aggregates = {id(n.input) for n in nodes if isinstance(n, Aggregate)
                     and isinstance(n.input, Join)} - {id(n) for n in roots}
    groups = pointwise_groups(nodes, roots, in_aggregates, readers_of(nodes, root))
    members = frozenset(id(m) for group in groups.values() for m in group[:-1])
    return rebuild(root, {top: _maker(group) for top, group in groups.items()}, members)


def _pointwise(node: LogicalNode, joins_in_aggregates: set[int]) -> bool:
    """A map, or a join with no aggregation over it and no diagonal (repeated label)."""
    if isinstance(node, Map):
        return True
    return (isinstance(node, Join) and id(node) not in joins_in_aggregates
            and not is_update(node.join)  # stacks its slots: not blocked by rows
            and all(len(set(labels)) == len(labels) for labels in node.input_labels))


def labels_in(consumer: LogicalNode, k: int) -> tuple[str, ...]:
    """The labels ``consumer`` (a map or join) gives its input ``k``'s dims."""
    return consumer.relation.labels if isinstance(consumer, Map) else consumer.input_labels[k]


def _aligned(consumer: LogicalNode, k: int, producer: LogicalNode) -> bool:
    """Whether each chunk of ``producer`` is exactly what one chunk of ``consumer`` reads
    (the same labels, none broadcast, tiled alike)."""
    labels, rel = labels_in(consumer, k), consumer.relation
    if sorted(labels) != sorted(rel.labels):
        return False
    grid = rel.grid
    shape = tuple(grid.shape[rel.labels.index(lab)] for lab in labels)
    tile = tuple(grid.tile[rel.labels.index(lab)] for lab in labels)
    return producer.relation.grid.shape == shape and producer.relation.grid.tile == tile


def pointwise_groups(nodes: list[LogicalNode], roots: tuple[LogicalNode, ...],
                     joins_in_aggregates: set[int], readers: dict[int, list[int]]
                     ) -> dict[int, list[LogicalNode]]:
    """Chains of pointwise nodes to fuse, by the id of each chain's last node: its members
    in dependency order (last node last); chains of two or more."""
    results = {id(r) for r in roots}
    into: dict[int, int] = {}  # producer -> the consumer it is fused into
    for node in nodes:
        if not _pointwise(node, joins_in_aggregates):
            continue
        for k, child in enumerate(node.inputs):
            if (_pointwise(child, joins_in_aggregates) and id(child) not in results
                    and set(readers.get(id(child), ())) == {id(node)}
                    and _aligned(node, k, child)):
                into[id(child)] = id(node)
    consumers = set(into.values())
    groups: dict[int, list[LogicalNode]] = {}
    for node in nodes:
        if id(node) in into or id(node) in consumers:
            top = id(node)
            while top in into:
                top = into[top]
            groups.setdefault(top, []).append(node)
    return groups


def _maker(group: list[LogicalNode]):
    """The function making the :class:`Pointwise` node of ``group`` from the rebuilt nodes:
    every member's labels renamed to the last one's (a producer's chunks are its reader's,
    so the renaming is one-to-one), outside inputs in order of first use."""
    top = group[-1]
    position = {id(n): k for k, n in enumerate(group)}
    rename: dict[int, dict[str, str]] = {id(top): {lab: lab for lab in top.relation.labels}}
    for node in reversed(group):
        for k, child in enumerate(node.inputs):
            if id(child) in position:
                names = rename[id(node)]
                rename[id(child)] = {own: names[lab] for own, lab in
                                     zip(child.relation.labels, labels_in(node, k))}
    externals: list[LogicalNode] = []
    labels: list[tuple[str, ...]] = []
    ops: list[PointwiseOp] = []
    for node in group:
        args = []
        for k, child in enumerate(node.inputs):
            if id(child) in position:
                args.append(-position[id(child)] - 1)
                continue
            args.append(len(externals))
            externals.append(child)
            labels.append(tuple(rename[id(node)][lab] for lab in labels_in(node, k)))
        if isinstance(node, Map):
            ops.append(PointwiseOp(node.fn, tuple(args), node.relation, scalar=node.scalar))
        else:
            ops.append(PointwiseOp(node.join, tuple(args), node.relation,
                                   input_labels=node.input_labels))

    def make(memo: dict[int, LogicalNode]) -> LogicalNode:
        return Pointwise(top.relation, sources=tuple(memo[id(x)] for x in externals),
                         source_labels=tuple(labels), ops=tuple(ops), rule=NAME)

    return make
