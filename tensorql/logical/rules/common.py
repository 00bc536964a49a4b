"""What the rewrite rules share: a plan's results and readers, and rebuilding a plan with some
nodes replaced (every other node kept, or made anew only where an input changed).

>>> from tensorql.grid import ChunkGrid
>>> from tensorql.logical.plan import Map, Scan, TensorRelation
>>> rel = TensorRelation(("i",), ChunkGrid((4,), (4,)), "float32")
>>> a, b = Scan(rel, source="A"), Scan(rel, source="B")
>>> top = Map(rel, input=Map(rel, input=a, fn="exp"), fn="relu")
>>> new = rebuild(top, {id(a): lambda memo: b})
>>> new is top, new.input.input is b, rebuild(top, {}) is top
(False, True, True)
"""

from __future__ import annotations

from collections.abc import Callable

from tensorql.logical.plan import LogicalNode, Results, walk

Made = Callable[[dict[int, LogicalNode]], LogicalNode]


def results_of(root: LogicalNode) -> tuple[LogicalNode, ...]:
    """The results a plan computes: ``root``, or each of a :class:`Results`."""
    return root.sources if isinstance(root, Results) else (root,)


def readers(nodes: list[LogicalNode], root: LogicalNode) -> dict[int, list[int]]:
    """For each node (by id), the ids of the nodes reading it (a result is also read by the
    caller, whose id is 0)."""
    out: dict[int, list[int]] = {}
    for node in nodes:
        for child in node.inputs:
            out.setdefault(id(child), []).append(id(node))
    if not isinstance(root, Results):
        out.setdefault(id(root), []).append(0)
    return out


def rebuild(root: LogicalNode, made: dict[int, Made],
            dropped: frozenset[int] = frozenset()) -> LogicalNode:
    """``root`` with each node whose id is in ``made`` replaced by what its function returns
    (given the rebuilt nodes so far, by old id); nodes in ``dropped`` (inside a replacement)
    are not rebuilt. Returns ``root`` itself when nothing changed."""
    if not made:
        return root
    memo: dict[int, LogicalNode] = {}
    for node in walk(root):
        if id(node) in made:
            memo[id(node)] = made[id(node)](memo)
        elif id(node) not in dropped:
            memo[id(node)] = node.with_inputs(tuple(memo[id(c)] for c in node.inputs))
    return memo[id(root)]


def rebuild_matching(root: LogicalNode, match: Callable[[LogicalNode], object | None],
                     make: Callable[[LogicalNode, object], Made]) -> LogicalNode:
    """``root`` with every node for which ``match`` finds something (not None) replaced by
    ``make(node, found)``'s function (as :func:`rebuild` takes it); ``root`` itself when
    ``match`` finds nothing. The walk-match-rebuild of a rule that rewrites nodes one by one."""
    made = {}
    for node in walk(root):
        found = match(node)
        if found is not None:
            made[id(node)] = make(node, found)
    return rebuild(root, made)
