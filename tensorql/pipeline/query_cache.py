"""Compiled queries kept per session, by the structure of their expression graph.

A query written again -- ``tq.einsum(equation, *stored)`` in a loop, a network contracted with
the same operands, a SQL statement repeated -- builds a new expression graph whose nodes are
new objects; without this cache each such call lowered, rewrote and planned it anew (for a
120-tensor network ~15 ms, more than its kernels). :func:`query_key` reads a graph as a
structural key: every node's kind and fields, its inputs as positions in the graph's
topological order, so that shared subexpressions stay shared in the key. Two graphs with
the same key plan to the same physical plan, whose task graph keeps its serial schedule and
memory plans (``TaskGraph.programs``): a repeated query runs its kernels and little else.

What a cached plan depends on besides the graph is checked on every look-up
(:meth:`QueryCache.get`): the session's stored tensors (``Database.generation``, bumped on
every change), its options, and the path cache's epoch (clearing ``PATH_CACHE`` -- to time a
path search -- drops the plans that were built from its paths). A graph holding an
in-memory literal (``Constant``: its values may change in place) has no key and is planned
every time, as before.

>>> from tensorql.grid import ChunkGrid
>>> from tensorql.einsum.graph import EinsumOp, Source
>>> a = Source(shape=(2, 3), dtype="float32", name="A", grid=ChunkGrid((2, 3), (2, 3)))
>>> b = Source(shape=(2, 3), dtype="float32", name="A", grid=ChunkGrid((2, 3), (2, 3)))
>>> query_key(EinsumOp.build("ij->i", [a])) == query_key(EinsumOp.build("ij->i", [b]))
True
>>> query_key(EinsumOp.build("ij->i", [a])) == query_key(EinsumOp.build("ij->j", [a]))
False
>>> cache = QueryCache(capacity=2)
>>> key = query_key(EinsumOp.build("ij->i", [a]))
>>> cache.get(key, stamp=1), cache.put(key, 1, "plan"), cache.get(key, stamp=1)
(None, None, 'plan')
>>> cache.get(key, stamp=2), len(cache)  # the session changed: everything is dropped
(None, 0)
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Hashable
from typing import Any

from cachetools import LRUCache

from tensorql.einsum.graph import Constant, Node, topological_order

#: plans kept per session (least recently used dropped beyond it)
QUERY_CACHE_CAPACITY = 64


def query_key(root: Node) -> tuple | None:
    """A hashable key equal for expression graphs that plan alike, or None when ``root``'s
    graph cannot be cached (it holds an in-memory literal, or an unhashable field).

    Every non-node field is keyed with its type too (``1``, ``1.0`` and ``True`` are equal in
    Python but may select different kernels or dtypes), floats by their bits (``-0.0`` is not
    ``0.0``).

    >>> from tensorql.grid import ChunkGrid
    >>> from tensorql.einsum.graph import EinsumOp, MapOp, Source
    >>> a = Source(shape=(2,), dtype="float32", name="A", grid=ChunkGrid((2,), (2,)))
    >>> query_key(MapOp.build("scale", a, 0.0)) == query_key(MapOp.build("scale", a, -0.0))
    False
    >>> shared = MapOp.build("exp", a)
    >>> twice = EinsumOp.build("i,i->i", [shared, shared])
    >>> apart = EinsumOp.build("i,i->i", [shared, MapOp.build("exp", a)])
    >>> query_key(twice) == query_key(apart)  # sharing is part of the structure
    False
    """
    position: dict[int, int] = {}
    entries: list[tuple] = []
    leaves = _LEAF_ENTRIES
    for node in topological_order(root):
        entry = leaves.get(node)
        if entry is None:
            if isinstance(node, Constant):
                return None
            kind = type(node)
            parts: list[Hashable] = [kind]
            leaf = True
            for name in _field_names(kind):
                value = _field_key(getattr(node, name), position)
                leaf = leaf and not (type(value) is tuple and value[0] in _NODE_TAGS)
                parts.append(value)
            entry = tuple(parts)
            try:
                hash(entry)
            except TypeError:
                return None
            if leaf:  # no input: its entry is the same in every graph it is part of
                leaves[node] = entry
        position[id(node)] = len(entries)
        entries.append(entry)
    return tuple(entries)


# A leaf's entry (a stored tensor's Source: its name, shape, grid, ...) by node object: the
# operands of a query written again are the same nodes (``db.tensor(...)``'s), so a key of a
# 120-operand network reads 120 kept entries instead of keying 600 fields. Nodes are frozen;
# the entry lives while its node does.
_LEAF_ENTRIES: weakref.WeakKeyDictionary[Node, tuple] = weakref.WeakKeyDictionary()
_NODE_TAGS = ("node", "nodes")


@functools.cache
def _field_names(kind: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(kind))


def _field_key(value: Any, position: dict[int, int]) -> Any:
    if isinstance(value, Node):
        return ("node", position[id(value)])
    if isinstance(value, tuple) and value and all(isinstance(v, Node) for v in value):
        return ("nodes", tuple(position[id(v)] for v in value))
    if isinstance(value, float):
        return (float, value.hex())
    return (type(value), value)


class QueryCache:
    """Compiled queries by :func:`query_key`, valid for one ``stamp`` (what else the plans
    depend on); a look-up with another stamp empties the cache. Thread-safe."""

    def __init__(self, capacity: int = QUERY_CACHE_CAPACITY) -> None:
        self._plans: LRUCache[tuple, Any] = LRUCache(capacity)
        self._stamp: Any = None
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple | None, stamp: Any) -> Any:
        """The plan kept for ``key`` under ``stamp``, or None."""
        if key is None:
            return None
        with self._lock:
            if stamp != self._stamp:
                self._plans.clear()
                self._stamp = stamp
            plan = self._plans.get(key)
            if plan is None:
                self.misses += 1
            else:
                self.hits += 1
            return plan

    def put(self, key: tuple | None, stamp: Any, plan: Any) -> None:
        """Keep ``plan`` for ``key``, if ``stamp`` is still the cache's."""
        if key is None:
            return
        with self._lock:
            if stamp == self._stamp:
                self._plans[key] = plan

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._plans)


__all__ = ["QUERY_CACHE_CAPACITY", "QueryCache", "query_key"]
