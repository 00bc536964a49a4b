"""Search over partition vectors: dynamic programming over a tree cover of the DAG.

A :class:`Problem` holds, for every node, its candidate partition vectors with their own costs
(:class:`~tensorql.optimizer.cost.NodeTable`) and, for every edge, the matrix of bytes moved
for each (producer, consumer) candidate pair. A plan's bytes moved is then exactly
``sum(own) + sum(edge matrices)``, which the strategies minimise:

* ``auto`` -- DP over a tree cover (shared nodes are cut out as roots of their own trees, both
  frozen at their own optimum as in EinDecomp and left open to their consumers), each result
  and the ``data`` / ``model`` plans then improved by coordinate descent on the exact total;
  the cheapest wins, so ``auto`` is never worse than the baselines;
* ``data`` -- every node carrying the batch label (the result's leading label) puts as many
  pieces on it as it can; the rest is left to the DP;
* ``model`` -- Megatron-style: every node carrying hidden/head labels (labels of weights, that
  is of tensors contracted with the activations, except the labels of the result and of the
  batch-carrying inputs) puts as many pieces on them as it can; the rest is left to the DP;
* ``exhaustive`` -- every combination (small graphs only).

>>> sorted(STRATEGIES)
['auto', 'data', 'exhaustive', 'model']
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tensorql.errors import PlanError
from tensorql.optimizer.cost import (
    NodeTable,
    assembly_peak,
    build_table,
    candidates,
    node_key,
    partial_seconds,
    read_bytes,
    read_pairs,
    transition_matrix,
    transition_priced,
)
from tensorql.optimizer.graph import OpGraph
from tensorql.optimizer.topology import Topology, TopologyError
from tensorql.units import format_bytes

EXHAUSTIVE_LIMIT = 20_000


class UnknownStrategyError(PlanError, KeyError):
    """A strategy name the optimizer does not know."""

    def __str__(self) -> str:
        return str(self.args[0])


class InfeasiblePlanError(PlanError):
    """No partitioning fits the per-device memory limit. From ``tq.optimize``, ``minimum`` is
    a memory limit that plans (None when none was found) and ``smallest`` says whether it is
    the smallest one; raised inside the search, ``minimum`` is a lower bound.

    >>> err = InfeasiblePlanError("too small", minimum=32, smallest=True)
    >>> err.minimum, err.smallest
    (32, True)
    """

    def __init__(self, message: str, minimum: int | None = None,
                 smallest: bool = False) -> None:
        super().__init__(message)
        self.minimum = minimum
        self.smallest = smallest


class SearchTooLargeError(PlanError):
    """The exhaustive strategy was asked for a graph with too many combinations."""


@dataclass(frozen=True, eq=False)
class Problem:
    """Candidates, own costs and edge matrices of one graph for ``devices`` devices.

    On a flat topology (the default) a cost is bytes moved. On a :class:`Topology` of
    several nodes the edge matrices and own costs (``own``: each node's partial aggregates)
    are the estimated seconds of each exchange (:func:`~tensorql.optimizer.cost.
    transition_seconds`) in *cost units* of ``1 / topology.unit_rate`` seconds -- the time
    the whole job's fastest links take for a byte, so a unit is a byte on one node -- rounded
    to integers; ``moved`` keeps every edge's bytes for the plan's report. The search
    minimises costs, whichever they are.
    """

    graph: OpGraph
    devices: int
    tables: tuple[NodeTable, ...]
    allowed: tuple[np.ndarray, ...]          # per node: bool mask over its candidates
    edges: tuple[tuple[int, int, int, np.ndarray], ...]  # (producer, consumer, k, matrix)
    memo: dict = field(default_factory=dict, compare=False, repr=False)
    # per edge: the bytes one task needs to assemble the operand (producer x consumer
    # candidates, see assembly_peak); set under a memory limit
    assembly: tuple[np.ndarray, ...] = ()
    topology: Topology | None = None        # None: flat (costs are bytes)
    own: tuple[np.ndarray, ...] = ()        # priced partial aggregates per node (topology)
    moved: tuple[np.ndarray, ...] = ()      # bytes of every edge, when ``edges`` are priced

    @classmethod
    def build(cls, graph: OpGraph, devices: int, memory_limit: int | None = None,
              cache: dict | None = None, task_limit: int | None = None,
              topology: Topology | None = None,
              guide: Sequence[frozenset | None] | None = None) -> Problem:
        """The problem of ``graph`` on ``devices`` devices: each node's pieces cut until
        one fits ``memory_limit`` (see :func:`_fitting_table`), and every task of the
        physical plan -- the node's own, and those assembling its operands -- within
        ``task_limit`` (default ``memory_limit``): candidates whose own tasks do not fit are
        not allowed, and a pair of producer and consumer candidates whose assembling does
        not is priced out (:data:`UNFIT`), so the search avoids it where any plan can.
        ``guide`` (no memory limit): per node, the partition vectors it may take (None: all),
        see :func:`build_problem`."""
        cache = {} if cache is None else cache
        task_limit = memory_limit if task_limit is None else task_limit
        if topology is not None and topology.devices != devices:
            raise TopologyError(f"topology {topology.describe()} has {topology.devices} "
                                f"devices, the problem {devices}")
        if topology is not None and (topology.is_flat or devices == 1):
            topology = None  # one node: every pair alike, bytes rank plans as time does
        if guide is not None and memory_limit is not None:
            raise PlanError("a guided problem is planned without a memory limit")
        keys, tables = [], []
        for node in graph.nodes:
            if guide is not None and guide[node.index] is not None:
                key, table = _table(graph, node, devices, devices, cache, guide[node.index])
            else:
                key, table = _fitting_table(graph, node, devices, memory_limit, cache)
            keys.append(key)
            tables.append(table)
        allowed = []
        for table in tables:
            ok = np.ones(len(table.cands), dtype=bool)
            if task_limit is not None:
                ok = table.task_peak <= task_limit
            allowed.append(ok)
        edges, assembly, raw = [], [], []
        for node in graph.nodes:
            for k, edge in enumerate(node.inputs):
                producer = graph.nodes[edge.producer]
                free = producer.loaded_where_read
                key = ("edge", keys[edge.producer], keys[node.index], k, free)
                tkey = ("priced", topology, key)
                if key not in cache and free:  # every reader loads it itself
                    cache[key] = np.zeros((len(tables[edge.producer].cands),
                                           len(tables[node.index].cands)), dtype=np.int64)
                elif topology is not None and not free and tkey not in cache:
                    # bytes per node and level: priced, and summed for the byte matrix
                    seconds, nbytes = transition_priced(tables[edge.producer],
                                                        tables[node.index], node, edge,
                                                        producer.itemsize, topology)
                    cache[tkey] = _units(seconds, topology)
                    cache.setdefault(key, nbytes)
                elif key not in cache:
                    cache[key] = transition_matrix(
                        tables[edge.producer], tables[node.index], node, edge,
                        producer.itemsize, devices)
                moved = cache[key]
                raw.append(moved)
                if topology is not None:
                    moved = cache[tkey] if not free else moved  # nothing moves: 0 either way
                if task_limit is not None:
                    akey = ("assembly", key, _targets(producer), _targets(node))
                    if akey not in cache:
                        cache[akey] = assembly_peak(tables[edge.producer], tables[node.index],
                                                    producer, node, edge)
                    assembly.append(cache[akey])
                    moved = moved + np.where(cache[akey] > task_limit, UNFIT, 0)
                edges.append((edge.producer, node.index, k, moved))
        own: list[np.ndarray] = []
        if topology is not None:
            for node, key, table in zip(graph.nodes, keys, tables):
                okey = ("priced own", topology, key)
                if okey not in cache:
                    cache[okey] = _units(partial_seconds(table, node, topology), topology)
                own.append(cache[okey])
        return cls(graph, devices, tuple(tables), tuple(allowed), tuple(edges),
                   assembly=tuple(assembly), topology=topology, own=tuple(own),
                   moved=tuple(raw) if topology is not None else ())

    def need(self, choice: tuple[int, ...]) -> int:
        """The most bytes one task of the physical plan of ``choice`` needs at once (a
        bound: an operation's own tasks, and those assembling its operands' regions)."""
        own = max((int(t.task_peak[c]) for t, c in zip(self.tables, choice)), default=0)
        return max([own] + [int(a[choice[p], choice[c]])
                            for (p, c, _, _), a in zip(self.edges, self.assembly)])

    # -- evaluation ---------------------------------------------------------------------
    def own_cost(self, node: int) -> np.ndarray:
        """Node ``node``'s own cost per candidate for the search (see :func:`own_cost`)."""
        if self.own:  # read only: computed once a node
            key = ("own cost", node)
            if key not in self.memo:
                self.memo[key] = own_cost(self.tables[node], self.own[node])
            return self.memo[key]
        return _own(self.tables[node])  # read only: cached on the (shared) table

    def own_total(self, choice: tuple[int, ...]) -> int:
        """The own costs (partial aggregates) of a choice."""
        if self.own:
            return sum(int(o[c]) for o, c in zip(self.own, choice))
        return sum(int(t.partial_bytes[c]) for t, c in zip(self.tables, choice))

    def edge_bytes(self) -> list[np.ndarray]:
        """Bytes moved through every edge (aligned with ``edges``), whatever the costs."""
        return list(self.moved) if self.moved else [m for _, _, _, m in self.edges]

    def total(self, choice: tuple[int, ...]) -> int:
        """Exact cost of a choice (a candidate index per node): bytes moved, or cost units
        on a topology, counting each edge on its own (see :meth:`exact_total`)."""
        own = self.own_total(choice)
        return own + sum(int(m[choice[p], choice[c]]) for p, c, _, m in self.edges)

    def exact_total(self, choice: tuple[int, ...]) -> int:
        """Bytes the chosen plan really moves: a device reads a producer's piece once however
        many operations need it. Only producers read by several operations differ from the
        per-edge sum (within one operation a device never needs a piece both whole and in
        part), so only they are recounted (:func:`~tensorql.optimizer.cost.read_bytes`)."""
        total = self.total(choice)
        layouts = keys = None
        for p, edges in self.shared_edges.items():
            # identical layers share tables and edge matrices: key on those, not on indices
            key = (id(self.tables[p]), choice[p],
                   tuple(sorted((id(m), choice[c]) for c, m in edges)))
            if key not in self.memo:
                if layouts is None:
                    layouts = [t.layouts[k] for t, k in zip(self.tables, choice)]
                per_edge = sum(int(m[choice[p], choice[c]]) for c, m in edges)
                if self.topology is None:
                    if keys is None:
                        keys = [(id(t), k) for t, k in zip(self.tables, choice)]
                    exact = read_bytes(self.graph, layouts, p, self.memo, keys)
                else:  # the reads of p priced as one exchange
                    exact = int(_units(self.topology.transfer_seconds(
                        read_pairs(self.graph, layouts, p, self.devices)), self.topology))
                self.memo[key] = exact - per_edge
            total += self.memo[key]
        return total

    def partials(self, choice: tuple[int, ...]) -> int:
        """Bytes of partial aggregates a choice sends."""
        return sum(int(t.partial_bytes[c]) for t, c in zip(self.tables, choice))

    def reduced(self, choice: tuple[int, ...]) -> int:
        """Bytes of partial aggregates a choice sends to one owner per piece (no scatter)."""
        return sum(int(t.partial_bytes[c]) for t, c in zip(self.tables, choice)
                   if not t.scattered[c])

    @functools.cached_property
    def shared_edges(self) -> dict[int, list[tuple[int, np.ndarray]]]:
        """Producers read by several operations -> [(consumer, edge matrix)]."""
        out: dict[int, list[tuple[int, np.ndarray]]] = {}
        for p, c, _, m in self.edges:
            if not self.graph.nodes[p].loaded_where_read:  # those move nothing
                out.setdefault(p, []).append((c, m))
        return {p: e for p, e in out.items() if len(e) > 1}

    @property
    def dp_edges(self) -> tuple[dict[int, list[tuple[int, np.ndarray]]], dict[int, int]]:
        """Per node its in-edges (producer, matrix transposed as float: a row per consumer
        candidate, :meth:`by_consumer`) and its out-degree, made once (problems restricted
        from one share them: the edges are the same); read only."""
        got = self.memo.get(("dp edges",))
        if got is None or got[0] is not self.edges:
            nodes = self.graph.nodes
            in_edges: dict[int, list[tuple[int, np.ndarray]]] = {n.index: [] for n in nodes}
            out_degree = {n.index: 0 for n in nodes}
            for p, c, _, m in self.edges:
                in_edges[c].append((p, self.by_consumer(m)))
                out_degree[p] += 1
            got = self.memo[("dp edges",)] = (self.edges, (in_edges, out_degree))
        return got[1]

    @property
    def touching(self) -> dict[int, list[tuple[int, int, np.ndarray]]]:
        """Per node the edges touching it, ``(other node, 0 if it is the consumer else 1,
        matrix)``, made once (as :attr:`dp_edges`); read only."""
        got = self.memo.get(("touching",))
        if got is None or got[0] is not self.edges:
            touching: dict[int, list[tuple[int, int, np.ndarray]]] = {
                n.index: [] for n in self.graph.nodes}
            for p, c, _, m in self.edges:
                touching[c].append((p, 0, m))   # node is the consumer: row fixed by producer
                touching[p].append((c, 1, m))   # node is the producer: column fixed by consumer
            got = self.memo[("touching",)] = (self.edges, touching)
        return got[1]

    def by_consumer(self, matrix: np.ndarray) -> np.ndarray:
        """An edge matrix (producer x consumer candidates) transposed into contiguous rows,
        one per consumer candidate, as float64 (what adding a float vector makes of it),
        made once a matrix (identical layers share them); read only. :func:`tree_dp` finds
        each consumer candidate's best producer along a row: a minimum over the contiguous
        axis, 1.4-3x quicker than down the columns for the 332 x 332 to 1000 x 1000
        matrices of an 80-layer plan on 256 devices.

        >>> import types
        >>> m = np.arange(6).reshape(2, 3)
        >>> Problem.by_consumer(types.SimpleNamespace(memo={}), m).tolist()
        [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
        """
        key = ("by consumer", id(matrix))
        got = self.memo.get(key)
        if got is None or got[0] is not matrix:
            got = self.memo[key] = (matrix, np.ascontiguousarray(matrix.T, dtype=float))
        return got[1]

    def restrict(self, masks: list[np.ndarray | None]) -> Problem:
        allowed = tuple(a & m if m is not None and (a & m).any() else a
                        for a, m in zip(self.allowed, masks))
        return dataclasses.replace(self, allowed=allowed)


MAX_PIECES_PER_DEVICE = 64
UNFIT = 1 << 48  # the price of a pair of candidates whose assembling tasks exceed the limit


def _units(seconds: np.ndarray | float, topology: Topology) -> np.ndarray:
    """Seconds as the search's integer cost units (``1 / topology.unit_rate`` s each)."""
    return np.rint(np.asarray(seconds) * topology.unit_rate).astype(np.int64)


def _targets(node) -> tuple | None:
    """A node's chunk tiles as a cache key (they are not in its table's key)."""
    target = node.chunk_target
    return None if target is None else tuple(sorted(target.items()))


def _vectors(node, pieces: int) -> tuple[tuple[int, ...], ...]:
    """The partition vectors of ``pieces`` pieces a node may take: its labels in ``whole``
    (a softmax's axis, every label of a reshape) never cut."""
    keep = {node.labels.index(lab) for lab in node.whole}
    return candidates(tuple(1 if d in keep else n for d, n in enumerate(node.sizes)), pieces)


def _table(graph: OpGraph, node, devices: int, pieces: int, cache: dict,
           only: frozenset | None = None):
    """The node's table (cached under its :func:`node_key`), over the vectors in ``only``
    when given (they are part of the key then)."""
    key = node_key(graph, node, devices, pieces)
    if only is not None:
        key = (*key, tuple(sorted(only)))
    if ("node", key) not in cache:
        allowed = _vectors(node, pieces) if node.whole else None
        if only is not None:
            allowed = tuple(sorted(only))
        cache[("node", key)] = build_table(graph, node, devices, allowed=allowed,
                                           pieces=pieces, layouts=cache.setdefault(
                                               ("layouts",), {}))
    return key, cache[("node", key)]


def _fitting_table(graph: OpGraph, node, devices: int, memory_limit: int | None, cache: dict):
    """The node's table with ``devices`` pieces, or with 2x, 4x, ... pieces (several tasks a
    device) when no piece of fewer fits ``memory_limit``; InfeasiblePlanError when even the
    finest split does not fit, its ``minimum`` a lower bound of any limit that plans the
    graph (the least task of the node that needs most in its finest split)."""
    factor = 1
    key, table = _table(graph, node, devices, devices, cache)
    while memory_limit is not None and not (table.task_peak <= memory_limit).any():
        made = int(np.prod(table.cands[0])) if len(table.cands[0]) else 1
        if factor >= MAX_PIECES_PER_DEVICE or made < devices * factor:
            need = max(_smallest_peak(graph, n, devices, cache) for n in graph.nodes)
            raise InfeasiblePlanError(
                f"no partitioning of {node.name!r} (labels {','.join(node.labels)}, sizes "
                f"{node.sizes}) fits memory_limit={memory_limit} bytes "
                f"({format_bytes(memory_limit)}) on {devices} devices, "
                f"even cut into {made} pieces; no memory_limit below {need} bytes "
                f"({format_bytes(need)}) can plan this query", minimum=need)
        factor *= 2
        key, table = _table(graph, node, devices, devices * factor, cache)
    return key, table


def _smallest_peak(graph: OpGraph, node, devices: int, cache: dict) -> int:
    """The least working set of one task of ``node`` over every split the search offers."""
    best = None
    factor = 1
    while True:
        _, table = _table(graph, node, devices, devices * factor, cache)
        low = int(table.task_peak.min())
        best = low if best is None else min(best, low)
        made = int(np.prod(table.cands[0])) if len(table.cands[0]) else 1
        if factor >= MAX_PIECES_PER_DEVICE or made < devices * factor:
            return best
        factor *= 2


def own_cost(table: NodeTable, priced: np.ndarray | None = None) -> np.ndarray:
    """A node's own bytes (partial aggregates) for the search, a hair heavier than bytes
    moved by edges: between equal totals the plan without partials wins, since folding
    partials is extra work (a matmul split by rows rather than by its sum), and of plans
    with partials a reduce-scatter wins over a reduce onto one owner (the same bytes, spread
    over every contributor's links and folds). ``priced``: the partials' cost on a
    topology instead of their bytes."""
    weight = np.where(table.scattered, 1.0 + 1e-9, 1.0 + 2e-9)
    base = table.partial_bytes if priced is None else priced
    return base.astype(float) * weight


def _own(table: NodeTable) -> np.ndarray:
    """:func:`own_cost` of a table, computed once (identical layers share tables); read
    only."""
    got = table.__dict__.get("_own_cost")
    if got is None:
        got = table.__dict__["_own_cost"] = own_cost(table)
    return got


# -- dynamic programming over a tree cover ------------------------------------------------
def tree_dp(problem: Problem, freeze_shared: bool) -> tuple[int, ...]:
    """A choice per node from DP over trees; shared nodes root their own trees."""
    graph = problem.graph
    in_edges, out_degree = problem.dp_edges
    inf = np.inf
    value: dict[int, np.ndarray] = {}
    best_in: dict[int, list[tuple[int, np.ndarray]]] = {}
    frozen: dict[int, int] = {}
    choice: dict[int, int] = {}
    live: dict[int, np.ndarray | None] = {}  # a node's finite candidates, when not all
    buffer = np.empty(0)  # the sums of an edge, reused (large ones are fresh pages each time)

    def assign(node: int, cand: int) -> None:
        stack = [(node, cand)]
        while stack:
            n, c = stack.pop()
            if n in choice:
                continue
            choice[n] = c
            for p, arg in best_in[n]:
                if p not in frozen and p not in choice:
                    stack.append((p, int(arg[c])))

    for node in graph.nodes:
        n = node.index
        v = np.where(problem.allowed[n], problem.own_cost(n), inf)
        best_in[n] = []
        for p, m in in_edges[n]:  # m: a row per candidate of n, a column per p's
            if p in frozen:  # the producer's candidate is fixed: its column of the rows
                v = v + m[:, frozen[p]]
                best_in[n].append((p, np.full(m.shape[0], frozen[p])))
                continue
            vin = value[p]
            rows = live[p]
            if rows is None:
                if m.size > len(buffer):
                    buffer = np.empty(m.size)
                total = np.add(vin[None, :], m, out=buffer[:m.size].reshape(m.shape))
                arg = np.argmin(total, axis=1)
            else:  # only the producer's finite candidates can be picked: the first minimum
                total = vin[rows][None, :] + m[:, rows]   # over them is the first over all
                arg = np.argmin(total, axis=1)
            v = v + total[np.arange(total.shape[0]), arg]
            best_in[n].append((p, arg if rows is None else rows[arg]))
        value[n] = v
        finite = np.isfinite(v)
        live[n] = None if finite.all() or not finite.any() else np.flatnonzero(finite)
        if freeze_shared and out_degree[n] > 1:
            frozen[n] = int(np.argmin(v))
            assign(n, frozen[n])
    for result in (graph.root, *graph.also):
        assign(result, int(np.argmin(value[result])))
    for node in reversed(graph.nodes):  # nodes off every tree (unused outputs), if any
        if node.index not in choice:
            assign(node.index, int(np.argmin(value[node.index])))
    return tuple(choice[n.index] for n in graph.nodes)


def refine(problem: Problem, choice: tuple[int, ...], passes: int = 6) -> tuple[int, ...]:
    """Coordinate descent: change one node's candidate at a time while the total drops.

    A node is looked at again only once a neighbour has changed since it was last looked
    at: its cost vector is the same otherwise, so it would keep its candidate (the result is
    that of visiting every node every pass)."""
    graph = problem.graph
    touching = problem.touching
    current = list(choice)
    stale = [True] * len(graph.nodes)   # a neighbour changed since the node was looked at
    for _ in range(passes):
        improved = False
        for node in graph.nodes:
            n = node.index
            if not stale[n]:
                continue
            stale[n] = False
            cost = problem.own_cost(n).copy()
            for other, role, m in touching[n]:
                cost += m[current[other], :] if role == 0 else m[:, current[other]]
            cost[~problem.allowed[n]] = np.inf
            best = int(np.argmin(cost))
            if cost[best] < cost[current[n]]:
                current[n] = best
                improved = True
                for other, _, _ in touching[n]:
                    stale[other] = True
        if not improved:
            break
    return tuple(current)


# -- label classes for the baselines ------------------------------------------------------
_CLASSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def label_classes(graph: OpGraph) -> dict[tuple[int, str], int]:
    """Union-find of (node, label) pairs that are the same dimension across edges (found
    once per graph; read only)."""
    if graph not in _CLASSES:
        _CLASSES[graph] = _label_classes(graph)
    return _CLASSES[graph]


def _label_classes(graph: OpGraph) -> dict[tuple[int, str], int]:
    parent: dict[tuple[int, str], tuple[int, str]] = {}

    def find(x):
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for node in graph.nodes:
        for lab in node.labels:
            find((node.index, lab))
        for edge in node.inputs:
            prod = graph.nodes[edge.producer]
            for axis, lab in enumerate(edge.axes):
                if not lab.count("@"):
                    parent[find((edge.producer, prod.out_labels[axis]))] = find((node.index, lab))
    roots = {}
    return {key: roots.setdefault(find(key), len(roots)) for key in list(parent)}


def _masks(problem: Problem, wanted: Callable[[int, str], bool]) -> list[np.ndarray | None]:
    masks: list[np.ndarray | None] = []
    for node, table in zip(problem.graph.nodes, problem.tables):
        cols = [k for k, lab in enumerate(node.labels) if wanted(node.index, lab)]
        if not cols:
            masks.append(None)
            continue
        on = np.prod(table.cands[:, cols], axis=1)
        on = np.where(problem.allowed[node.index], on, 0)
        masks.append(on == on.max())
    return masks


def data_classes(graph: OpGraph, classes: dict[tuple[int, str], int]) -> set[int]:
    """The batch label's class (the result's leading label): none for a scalar result."""
    root = graph.nodes[graph.root]
    return {classes[(root.index, root.out_labels[0])]} if root.out_labels else set()


def data_masks(problem: Problem) -> list[np.ndarray | None]:
    graph = problem.graph
    classes = label_classes(graph)
    batch = data_classes(graph, classes)
    if not batch:
        return [None] * len(graph.nodes)
    return _masks(problem, lambda n, lab: classes.get((n, lab)) in batch)


def model_classes(graph: OpGraph) -> set[int]:
    """Hidden/head label classes: labels of weights (tensors contracted with activations) that
    are neither the result's labels nor labels of the batch-carrying inputs."""
    classes = label_classes(graph)
    root = graph.nodes[graph.root]
    batch = classes[(root.index, root.out_labels[0])] if root.out_labels else -1
    carries_batch: dict[int, bool] = {}
    for node in graph.nodes:
        carries_batch[node.index] = any(classes.get((node.index, lab)) == batch
                                        for lab in node.out_labels)
    weights: set[int] = set()
    for node in graph.nodes:
        if node.kind != "einsum" or len(node.inputs) != 2 or not node.agg_labels:
            continue
        for k, edge in enumerate(node.inputs):
            other = node.inputs[1 - k]
            shared_agg = set(edge.axes) & set(other.axes) & set(node.agg_labels)
            if not carries_batch[edge.producer] and carries_batch[other.producer] and shared_agg:
                weights.update(classes[(node.index, lab)] for lab in edge.axes
                               if (node.index, lab) in classes)
    result = {classes[(root.index, lab)] for lab in root.out_labels}
    inputs = {classes[(n.index, lab)] for n in graph.nodes
              if not n.inputs and carries_batch[n.index] for lab in n.labels}
    return weights - result - inputs - {batch}


def model_masks(problem: Problem) -> list[np.ndarray | None]:
    classes = label_classes(problem.graph)
    wanted = model_classes(problem.graph)
    return _masks(problem, lambda n, lab: classes.get((n, lab)) in wanted)


# -- strategies ---------------------------------------------------------------------------
def _dp_best(problem: Problem) -> tuple[int, ...]:
    options = [refine(problem, tree_dp(problem, freeze)) for freeze in (True, False)]
    return min(options, key=problem.total)


def search_data(problem: Problem) -> tuple[int, ...]:
    return _dp_best(problem.restrict(data_masks(problem)))


def search_model(problem: Problem) -> tuple[int, ...]:
    return _dp_best(problem.restrict(model_masks(problem)))


def auto_options(problem: Problem) -> list[tuple[int, ...]]:
    """The choices ``auto`` picks from: the DP results and the two baselines, and each of them
    refined."""
    seeds = list(dict.fromkeys([tree_dp(problem, True), tree_dp(problem, False),
                                search_data(problem), search_model(problem)]))
    return list(dict.fromkeys([*seeds, *(refine(problem, s) for s in seeds)]))


def search_auto(problem: Problem) -> tuple[int, ...]:
    """The DP results and the two baselines, refined; the one that moves fewest bytes counted
    exactly wins, so auto is never worse than data or model."""
    return min(auto_options(problem), key=lambda c: (problem.exact_total(c),
                                                     problem.partials(c), problem.reduced(c),
                                                     problem.total(c)))


def search_exhaustive(problem: Problem) -> tuple[int, ...]:
    """Every combination of candidates; sources read by one operand are placed optimally."""
    graph = problem.graph
    out_edges: dict[int, list] = {n.index: [] for n in graph.nodes}
    for p, c, _, m in problem.edges:
        out_edges[p].append((c, m))
    free = [n.index for n in graph.nodes if n.inputs or len(out_edges[n.index]) != 1]
    leaves = [n.index for n in graph.nodes if not n.inputs and len(out_edges[n.index]) == 1]
    options = [np.flatnonzero(problem.allowed[n]) for n in free]
    count = math.prod(len(o) for o in options)
    if count > EXHAUSTIVE_LIMIT:
        raise SearchTooLargeError(
            f"exhaustive search would try {count} combinations over {len(free)} nodes, more "
            f"than the bound {EXHAUSTIVE_LIMIT}; use strategy='auto' for graphs this size")
    leaf_best = {}
    for leaf in leaves:
        (consumer, m), = out_edges[leaf]
        masked = np.where(problem.allowed[leaf][:, None], m, np.inf)
        leaf_best[leaf] = (consumer, np.argmin(masked, axis=0))
    best: tuple[int, tuple[int, ...]] | None = None
    for combo in itertools.product(*options):
        choice = [0] * len(graph.nodes)
        for n, c in zip(free, combo):
            choice[n] = int(c)
        for leaf, (consumer, arg) in leaf_best.items():
            choice[leaf] = int(arg[choice[consumer]])
        total = problem.total(tuple(choice))
        if best is None or total < best[0]:
            best = (total, tuple(choice))
    assert best is not None
    return best[1]


# -- coarse to fine: planning for many devices --------------------------------------------
FINE_ABOVE = 64  # device counts above this are planned coarse to fine
FINE_STEP = 4    # each level plans for this many times the devices of the level before


def levels(devices: int) -> tuple[int, ...]:
    """The device counts planned in turn for ``devices``: the count itself up to
    :data:`FINE_ABOVE`; above, divided by :data:`FINE_STEP` while it divides and the count
    stays above :data:`FINE_ABOVE` (a full search there), then multiplied back level by level.
    (Starting from 16 devices instead was both slower and worse on the 70B-shaped graph:
    15 s and 2,175 GiB at 256 devices against 9 s and 2,167 GiB.)

    >>> levels(8), levels(64), levels(256), levels(1024), levels(96), levels(65)
    ((8,), (64,), (64, 256), (64, 256, 1024), (24, 96), (65,))
    """
    out = [devices]
    while out[0] > FINE_ABOVE and out[0] % FINE_STEP == 0:
        out.insert(0, out[0] // FINE_STEP)
    return tuple(out)


@functools.lru_cache(maxsize=1 << 12)
def _refining(vectors: tuple[tuple[int, ...], ...], coarse: frozenset) -> frozenset | None:
    """The ``vectors`` that cut each label into a multiple of the pieces of one of the
    ``coarse`` vectors (None when none does)."""
    fine = [v for v in vectors if any(all(f % c == 0 for f, c in zip(v, cv)) for cv in coarse)]
    return frozenset(fine) if fine else None


def _refinements(node, devices: int, coarse: set[tuple[int, ...]]) -> frozenset | None:
    """The node's vectors for ``devices`` that refine one of the ``coarse`` vectors (None:
    all of them, when none does)."""
    return _refining(_vectors(node, devices), frozenset(coarse))


def _baseline_vectors(graph: OpGraph, node, devices: int,
                      wanted: Callable[[int, str], bool]) -> frozenset:
    """The node's vectors for ``devices`` with the most pieces on the labels ``wanted``
    picks (what the data / model masks keep); none when no such label is cut at all."""
    cols = tuple(k for k, lab in enumerate(node.labels) if wanted(node.index, lab))
    return _most_on(_vectors(node, devices), cols) if cols else frozenset()


@functools.lru_cache(maxsize=1 << 12)
def _most_on(vectors: tuple[tuple[int, ...], ...], cols: tuple[int, ...]) -> frozenset:
    """The ``vectors`` with the most pieces on the labels at ``cols``; none unless some cut
    them."""
    on = [math.prod(v[k] for k in cols) for v in vectors]
    best = max(on)
    return frozenset(v for v, x in zip(vectors, on) if x == best) if best > 1 else frozenset()


def build_problem(graph: OpGraph, devices: int, cache: dict | None = None,
                  **final: object) -> Problem:
    """The problem the search solves for ``devices`` devices (no memory limit): every
    partition vector up to :data:`FINE_ABOVE` devices; above, planned coarse to fine
    (:func:`levels`): each level's problem offers a node only the vectors refining the
    pieces it takes in one of the previous level's ``auto`` options (:func:`auto_options`:
    the DP results and the data / model baselines, refined) and the vectors the data / model
    baselines want at this level, so the baselines stay what they are and ``auto`` is still
    never worse than either. A refining vector cuts every label into a multiple of the
    coarse pieces: the search goes on from where the coarse plan stands. Keyword arguments
    (``final``: a topology of ``devices`` devices) go to the last level's
    :meth:`Problem.build`; the coarser levels are planned by bytes.

    >>> import numpy as np, tensorql as tq
    >>> db = tq.connect()
    >>> x = db.from_numpy("x", np.ones((256, 512), dtype=np.float32))
    >>> w = db.from_numpy("w", np.ones((512, 256), dtype=np.float32))
    >>> graph = OpGraph.build((x @ w).node)
    >>> fine, full = build_problem(graph, 256), Problem.build(graph, 256)
    >>> [len(t.cands) for t in fine.tables], [len(t.cands) for t in full.tables]
    ([8, 6, 53], [9, 9, 159])
    """
    cache = {} if cache is None else cache
    steps = levels(devices)
    guide: list[frozenset | None] | None = None
    classes = label_classes(graph)
    data = data_classes(graph, classes)
    model = model_classes(graph)
    for n in steps:
        if guide is not None:
            for node in graph.nodes:
                extra = (_baseline_vectors(graph, node, n, lambda i, lab: classes.get(
                    (i, lab)) in data) | _baseline_vectors(graph, node, n, lambda i, lab:
                                                          classes.get((i, lab)) in model))
                if guide[node.index] is not None:
                    guide[node.index] = guide[node.index] | extra
        if n == devices:
            return Problem.build(graph, n, None, cache=cache, guide=guide, **final)
        problem = Problem.build(graph, n, None, cache=cache, guide=guide)
        chosen: list[set[tuple[int, ...]]] = [set() for _ in graph.nodes]
        for choice in auto_options(problem):
            for node, table, c in zip(graph.nodes, problem.tables, choice):
                chosen[node.index].add(tuple(int(x) for x in table.cands[c]))
        guide = [_refinements(node, n * FINE_STEP, chosen[node.index])
                 for node in graph.nodes]
    raise AssertionError("unreachable")  # the last level returns


STRATEGIES: dict[str, Callable[[Problem], tuple[int, ...]]] = {
    "auto": search_auto,
    "data": search_data,
    "model": search_model,
    "exhaustive": search_exhaustive,
}


def get_strategy(name: str) -> Callable[[Problem], tuple[int, ...]]:
    """The search function of strategy ``name``; UnknownStrategyError lists the valid ones."""
    try:
        return STRATEGIES[name]
    except (KeyError, TypeError):
        raise UnknownStrategyError(
            f"unknown strategy {name!r}; choose one of {', '.join(sorted(STRATEGIES))}"
        ) from None
