"""Walking a DAG of nodes that name their inputs (``node.inputs``): einsum graphs, logical plans.

>>> class N:
...     def __init__(self, name, *inputs): self.name, self.inputs = name, inputs
>>> a = N("a"); b = N("b", a); c = N("c", a, b)
>>> [n.name for n in inputs_first(c)]
['a', 'b', 'c']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar


class HasInputs(Protocol):
    @property
    def inputs(self) -> Sequence[HasInputs]: ...


NodeT = TypeVar("NodeT", bound=HasInputs)


def inputs_first(*roots: NodeT) -> list[NodeT]:
    """Every node reachable from ``roots`` once, inputs before users (depth first, in the order
    the roots and each node's inputs are given; no recursion, so deep graphs are fine)."""
    order: list[NodeT] = []
    seen: set[int] = set()
    stack: list[tuple[NodeT, bool]] = [(r, False) for r in reversed(roots)]
    while stack:
        node, expanded = stack.pop()
        if id(node) in seen:
            continue
        if expanded:
            seen.add(id(node))
            order.append(node)
            continue
        stack.append((node, True))
        stack.extend((child, False) for child in reversed(node.inputs)  # type: ignore[misc]
                     if id(child) not in seen)
    return order
