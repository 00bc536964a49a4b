"""``tq.optimize``: the partition plan of an expression for N devices, and its EXPLAIN.

>>> import numpy as np, tensorql as tq
>>> db = tq.connect()
>>> x = db.from_numpy("x", np.ones((8, 4), dtype=np.float32))
>>> w = db.from_numpy("w", np.ones((4, 6), dtype=np.float32))
>>> plan = tq.optimize(x @ w, devices=2)
>>> plan.cost
Cost(flops=192, bytes_moved=96, peak_bytes=256)
>>> print(plan.explain().splitlines()[0])
partitioning for 2 devices (strategy auto): 96 B moved, busiest device 192 FLOP, peak 256 B
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorql.devices import MAX_DEVICES
from tensorql.einsum.graph import Node
from tensorql.errors import PlanError, as_flag
from tensorql.logical.plan import LogicalNode
from tensorql.optimizer.cost import (
    Cost,
    DeviceReads,
    Layout,
    device_reads,
    layout,
    output_pieces,
    pair_bytes,
    refine,
    sub_tile,
    tier_bytes,
    tier_seconds,
)
from tensorql.optimizer.graph import OpGraph
from tensorql.optimizer.search import (
    InfeasiblePlanError,
    Problem,
    build_problem,
    get_strategy,
)
from tensorql.optimizer.topology import LEVELS, TIERS, Topology
from tensorql.options import parse_bytes
from tensorql.units import format_bytes, format_flops


@dataclass(frozen=True)
class InputMove:
    """Bytes moved into an operation for one operand, and why."""

    producer: str
    bytes: int
    reason: str


@dataclass(frozen=True)
class OpPartition:
    """The partitioning chosen for one node of the optimizer's graph."""

    index: int
    name: str
    kind: str
    labels: tuple[str, ...]
    sizes: tuple[int, ...]
    pieces: tuple[int, ...]
    flops_per_device: int
    inputs: tuple[InputMove, ...]
    partial_bytes: int
    peak_bytes: int
    n_agg: int = 0
    order: tuple[int, ...] = ()  # placement order of the labels (empty: their own order)
    scatter: tuple[int, int] | None = None  # (output label, parts): partials reduce-scattered

    @property
    def bytes_moved(self) -> int:
        return self.partial_bytes + sum(m.bytes for m in self.inputs)

    @property
    def vector(self) -> str:
        """The partition vector as ``label:pieces`` pairs."""
        return " ".join(f"{lab}:{p}" for lab, p in zip(self.labels, self.pieces)) or "scalar"

    @property
    def out_pieces(self) -> tuple[int, ...]:
        """Pieces of every output label (a reduce-scatter cuts one of them finer)."""
        return output_pieces(self.pieces, len(self.labels) - self.n_agg, self.scatter)


@dataclass(frozen=True)
class TimeEstimate:
    """A plan's estimated time on its topology, and its bytes on each link level.

    ``compute_s``: every operation's busiest device at the topology's FLOP rate, one
    operation after another; ``transfer_s``: every exchange (an operand's repartition, a
    producer read by several operations, partial aggregates) priced by
    :meth:`~tensorql.optimizer.topology.Topology.transfer_seconds`, one after another;
    ``tier_s``: what a memory limit forces through the memory tiers (chunks evicted to the
    host and read back, those beyond the host's memory through the DuckDB spill tier:
    :func:`~tensorql.optimizer.cost.tier_bytes`), 0 without; ``total_s`` adds them (no
    overlap of kernels and transfers is counted: a bound). ``level_bytes``: the link levels'
    bytes (``intra``, ``inter``), then the tiers' where a limit forces any (``host``: over
    every device's host link, ``duckdb``: through every node's spill tier; both ways).

    >>> TimeEstimate(0.5, 0.25, (("intra", 10), ("inter", 2))).total_s
    0.75
    >>> TimeEstimate(0.5, 0.25, (("intra", 10), ("host", 4)), tier_s=1.0).total_s
    1.75
    """

    compute_s: float
    transfer_s: float
    level_bytes: tuple[tuple[str, int], ...]
    tier_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.compute_s + self.transfer_s + self.tier_s

    def bytes_at(self, level: str) -> int:
        """Bytes moved over links of ``level`` (``intra``, ``inter``) or through a memory
        tier (``host``, ``duckdb``; 0 unless a memory limit forces it)."""
        return dict(self.level_bytes).get(level, 0)

    def describe(self) -> str:
        """One line: bytes per level, then the time estimate and its parts."""
        levels = ", ".join(f"{name} {format_bytes(b)}" for name, b in self.level_bytes)
        tiers = f" + memory tiers {_seconds(self.tier_s)}" if self.tier_s else ""
        return (f"traffic by level: {levels}; estimated time {_seconds(self.total_s)} "
                f"(compute {_seconds(self.compute_s)} + transfers "
                f"{_seconds(self.transfer_s)}{tiers}, no overlap counted)")


def _seconds(s: float) -> str:
    """``1.5 s``, ``12.3 ms``, ``4.0 us``.

    >>> _seconds(1.5), _seconds(0.0123), _seconds(4e-6)
    ('1.500 s', '12.300 ms', '4.000 us')
    """
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.3f} us"


@dataclass(frozen=True)
class PartitionPlan:
    """How every operation of an expression is split across ``devices`` devices."""

    devices: int
    strategy: str
    ops: tuple[OpPartition, ...]
    cost: Cost
    memory_limit: int | None = None
    graph: OpGraph | None = field(default=None, compare=False, repr=False)
    # the topology it was planned for (None: flat, not shown by explain) and its estimate
    topology: Topology | None = field(default=None, compare=False, repr=False)
    estimate: TimeEstimate | None = field(default=None, compare=False, repr=False)

    def _index(self, index: Any) -> int:
        """``index`` as the number of one of this plan's operations; PlanError else."""
        if isinstance(index, bool) or not isinstance(index, numbers.Integral) or \
                not -len(self.ops) <= index < len(self.ops):
            raise PlanError(f"operation index {index!r:.40}: this plan has operations "
                            f"0..{len(self.ops) - 1}")
        return int(index) % len(self.ops)

    def layout(self, index: int) -> Layout:
        """Where every task of operation ``index`` runs (its pieces on this plan's devices)."""
        index = self._index(index)
        op, node = self.ops[index], self.graph.nodes[index]
        return layout(node.sizes, op.pieces, node.n_out, self.devices, op.order or None,
                      op.scatter)

    def chunk_layout(self, index: int, target: dict[str, int]) -> Layout:
        """Operation ``index``'s pieces, each cut into chunks of at most ``target`` elements
        along each label (the logical plan's tiles; a label not named stays whole in its
        piece), every chunk on its piece's device: the same bytes move between devices, in
        cache-sized tasks that start as their own chunks arrive. A reduce-scatter's parts are
        cut from whole pieces, so its layout stays as it is."""
        index = self._index(index)
        if not isinstance(target, dict):
            raise PlanError(f"chunk_layout: target must be a dict of label -> chunk size, got "
                            f"{type(target).__name__}")
        lay, node = self.layout(index), self.graph.nodes[index]
        if lay.scatter:
            return lay
        whole = tuple(-(-n // p) for n, p in zip(node.sizes, lay.pieces))
        tiles = tuple(sub_tile(t, target.get(lab, n))
                      for lab, n, t in zip(node.labels, node.sizes, whole))
        return lay if tiles == whole else refine(lay, node.sizes, tiles, self.devices)

    def reads(self, layouts: list[Layout]) -> dict[tuple[int, int], DeviceReads]:
        """What each device reads of each producer under ``layouts`` (one per operation):
        whole pieces and slices, ``(producer, device) -> DeviceReads``."""
        if not isinstance(layouts, (list, tuple)) or len(layouts) != len(self.ops) or \
                not all(isinstance(lay, Layout) for lay in layouts):
            raise PlanError(f"reads: layouts must be one Layout per operation "
                            f"({len(self.ops)}, e.g. [plan.layout(k) for k in "
                            f"range({len(self.ops)})]), got {type(layouts).__name__}")
        return device_reads(self.graph, layouts)

    def pair_bytes(self) -> np.ndarray:
        """Predicted bytes sent from device ``src`` to ``dst``: an (N, N) matrix whose sum is
        ``cost.bytes_moved``."""
        return pair_bytes(self.graph, [self.layout(op.index) for op in self.ops], self.devices)

    def explain(self) -> str:
        """Per operation: partition vector, FLOPs per device, bytes moved and why."""
        c = self.cost
        lines = [f"partitioning for {self.devices} devices (strategy {self.strategy}): "
                 f"{format_bytes(c.bytes_moved)} moved, busiest device {format_flops(c.flops)}, "
                 f"peak {format_bytes(c.peak_bytes)}"]
        if self.memory_limit is not None:
            lines[0] += f" (limit {format_bytes(self.memory_limit)})"
        if self.topology is not None and self.estimate is not None:
            lines.append(f"topology: {self.topology.describe()}")
            lines.append(self.estimate.describe())
        elif self.estimate is not None and self.estimate.tier_s:  # a limit forces tiers
            lines.append(self.estimate.describe())
        for op in self.ops:
            if op.kind in ("source", "constant"):
                lines.append(f"[{op.index}] {op.name}  pieces {op.vector}")
                continue
            placed = (f"  placed by {','.join(op.labels[k] for k in op.order)}"
                      if op.order else "")
            lines.append(f"[{op.index}] {op.name}  pieces {op.vector}{placed}  "
                         f"{format_flops(op.flops_per_device)}/device  "
                         f"moved {format_bytes(op.bytes_moved)}")
            for k, move in enumerate(op.inputs):
                lines.append(f"    operand {k} <- {move.producer}: {format_bytes(move.bytes)} "
                             f"({move.reason})")
            if op.partial_bytes:
                agg = [f"{lab}:{p}" for lab, p in zip(op.labels, op.pieces)
                       if p > 1 and lab in op.labels[len(op.labels) - op.n_agg:]]
                if op.scatter is not None:
                    lab = op.labels[op.scatter[0]]
                    how = (f"then a reduce-scatter: the output cut {lab}:"
                           f"{op.out_pieces[op.scatter[0]]}, each contributor owning a part")
                else:
                    how = "then a reduce onto each output piece's owner"
                lines.append(f"    partial aggregates: {format_bytes(op.partial_bytes)} "
                             f"(aggregated labels split {' '.join(agg)}; each device folds its "
                             f"own, {how})")
        return "\n".join(lines)


def device_count(devices: Any) -> int:
    """N from an integer (any ``numbers.Integral`` but a bool) or a list of device names;
    PlanError otherwise.

    >>> device_count(np.int64(4)), device_count(["cpu:0", "cpu:1"])
    (4, 2)
    """
    if isinstance(devices, bool):
        raise PlanError(f"devices must be a positive int or a list of devices, got {devices!r}")
    if isinstance(devices, numbers.Integral):  # a numpy integer too
        n = int(devices)
    elif isinstance(devices, (list, tuple)):
        n = len(devices)
    else:
        raise PlanError(f"devices must be a positive int or a list of devices, got {devices!r}")
    if n < 1:
        raise PlanError(f"devices must be at least 1, got {n}")
    if n > MAX_DEVICES:
        raise PlanError(f"devices={n} is more than the {MAX_DEVICES} devices the "
                        "optimizer plans for (its cost model keeps a devices x devices matrix "
                        "of bytes moved: 8 bytes per pair)")
    return n


def optimize(expr: Any, devices: Any = None, strategy: str = "auto",
             memory_limit: int | str | None = None, *, cache: dict | None = None,
             also: tuple[LogicalNode, ...] = (),
             sources_everywhere: bool = False, topology: Any = None) -> PartitionPlan:
    """Choose a partition vector for every operation of ``expr`` on ``devices`` devices.

    ``expr`` is a lazy Tensor, an einsum-graph node or a logical plan (the pipeline passes the
    plan it lowered, so the partitioning is of exactly the steps that run); ``strategy`` one of
    auto, data, model, exhaustive; ``memory_limit`` (bytes or "20GiB") bounds one task's working
    set (an operation is cut into more pieces than devices when that is what fits, and what
    stays resident beyond the limit is offloaded by the memory plan; InfeasiblePlanError names
    the smallest limit that plans when none fits). ``also`` (logical plans sharing nodes with
    ``expr``'s) are further results partitioned in the same search: a training step's loss,
    new weights and optimizer state. ``sources_everywhere``: every device can load the
    stored tensors and constants itself (the ranks of a torch.distributed job), so reading
    them moves nothing (:attr:`~tensorql.optimizer.graph.OpNode.loaded_where_read`).
    ``topology``: how the devices are grouped into nodes and the bandwidth of each link
    level (a :class:`~tensorql.optimizer.topology.Topology`, a machine name of
    :data:`~tensorql.optimizer.topology.MACHINES` or ``"NODESxPER[:machine]"``; None: one
    node, every device pair alike). On several nodes the search minimises the estimated
    time of the transfers rather than their bytes; ``devices`` defaults to the topology's
    (else 8).

    >>> import numpy as np, tensorql as tq
    >>> db = tq.connect()
    >>> x = db.from_numpy("x", np.ones((16, 8), dtype=np.float32))
    >>> plan = tq.optimize(x @ x.T, topology="2x2")
    >>> plan.devices, plan.estimate.bytes_at("inter") <= plan.cost.bytes_moved
    (4, True)
    """
    node: Node | LogicalNode = getattr(expr, "node", expr)
    if not isinstance(node, (Node, LogicalNode)):
        raise PlanError(f"optimize needs a tensorql Tensor, got {type(expr).__name__}")
    if devices is None:
        devices = 8 if topology is None else Topology.parse(topology).devices
    n_dev = device_count(devices)
    topo = None if topology is None else Topology.parse(topology, n_dev)
    search = get_strategy(strategy)
    limit = parse_bytes(memory_limit)
    if cache is not None and not isinstance(cache, dict):
        raise PlanError(f"optimize: cache must be a dict (kept between calls) or None, got "
                        f"{type(cache).__name__}")
    sources_everywhere = as_flag(sources_everywhere, "sources_everywhere")
    graph = OpGraph.build(node, also=tuple(also), sources_everywhere=sources_everywhere)
    cache = {} if cache is None else cache
    if limit is None:
        problem = build_problem(graph, n_dev, cache=cache, topology=topo)
        return make_plan(problem, search(problem), strategy, None, topo)
    within = _plan_within(graph, n_dev, search, limit, cache, topo)
    if within.plan is not None:
        return make_plan(*within.plan, strategy, limit, topo)
    raise _too_small(graph, n_dev, search, limit, cache, within, topo)


_MAX_STEPS = 32    # piece counts tried within one memory limit, each cut finer than the last
_MORE_STEPS = 2    # finer steps tried past the first plan that fits, for a cheaper one
_PROBES = 24       # limits tried in search of the smallest that plans, at most
_PROBE_STEPS = 96  # steps of those tries together, at most


@dataclass(frozen=True)
class _Within:
    """What :func:`_plan_within` found under one memory limit: the plan (a problem and its
    choice; None when none fits), the least bytes a plan tried needed (None when none was
    tried), a lower bound of any limit that plans (``floor``: a task that no piece count
    fits in less) and whether every finer piece count was tried (``complete``: not cut
    short by ``steps``); ``steps``: how many were searched."""

    plan: tuple[Problem, tuple[int, ...]] | None
    least: int | None = None
    floor: int | None = None
    complete: bool = True
    steps: int = 0


def _plan_within(graph: OpGraph, devices: int, search, limit: int, cache: dict,
                 topology: Topology | None = None, more: int = _MORE_STEPS,
                 steps: int = _MAX_STEPS) -> _Within:
    """The search's plan whose every task fits ``limit``, over a ladder of piece counts.

    Each node takes the fewest pieces (``N``, ``2N``, ... a device) of which one fits a
    *target* (:meth:`Problem.build`); the first target is ``limit``. When the plan found
    still has a task that does not fit (a region assembled from coarse pieces of its
    producer, say), the target drops just below the largest of the nodes' smallest tasks, so
    that node -- and only what must -- is cut finer, and the search runs again. The steps
    visit every assignment of piece counts a smaller limit starts from, in order, so a
    limit plans whenever a smaller one does (within ``steps`` steps; the search itself is
    exact on trees, a heuristic on DAGs). Once a plan that the limit made cut finer than
    ``devices`` pieces fits, ``more`` finer steps are tried too and the cheapest plan that
    fits wins (finer pieces can move fewer bytes); a plan of ``devices`` pieces a node that
    fits is the plan, as without a limit.

    >>> import numpy as np, tensorql as tq
    >>> from tensorql.optimizer.search import search_auto
    >>> db = tq.connect()
    >>> x = db.from_numpy("pw_x", np.ones((1, 8), np.float32))
    >>> y = db.from_numpy("pw_y", np.ones((8, 8), np.float32))
    >>> graph = OpGraph.build(tq.einsum("ca,ba->c", x, y).node)
    >>> [_plan_within(graph, 6, search_auto, lim, {}).plan is not None for lim in (16, 20, 24)]
    [False, True, True]
    """
    target, best, least, left = limit, None, None, more
    for step in range(steps):
        try:
            problem = Problem.build(graph, devices, target, cache=cache, task_limit=limit,
                                    topology=topology)
        except InfeasiblePlanError as err:  # some node fits in no finer pieces
            floor = err.minimum if target == limit else None
            return _Within(best and best[1:], least, floor, steps=step)
        choice = search(problem)
        need = problem.need(choice)
        if need <= limit:
            if best is None and not _cut_finer(problem):  # N pieces fit, as with no limit
                return _Within((problem, choice), least, steps=step + 1)
            cost = problem.exact_total(choice)
            if best is None or cost < best[0]:
                best = (cost, problem, choice)
        else:
            least = need if least is None else min(least, need)
        if best is not None:
            if left <= 0:
                return _Within(best[1:], least, steps=step + 1)
            left -= 1
        # just below the largest smallest task: the node(s) with it take finer pieces
        target = max((int(t.task_peak.min()) for t in problem.tables), default=0) - 1
        if target < 1:
            return _Within(best and best[1:], least, steps=step + 1)
    return _Within(best and best[1:], least, complete=best is not None, steps=steps)


def _cut_finer(problem: Problem) -> bool:
    """Whether some node of ``problem`` is offered more pieces than devices (a memory limit
    made its pieces finer).

    >>> import numpy as np, tensorql as tq
    >>> db = tq.connect()
    >>> x = db.from_numpy("cf_x", np.ones((8, 8), np.float32))
    >>> graph = OpGraph.build((x @ x).node)
    >>> _cut_finer(Problem.build(graph, 2)), _cut_finer(Problem.build(graph, 2, 64))
    (False, True)
    """
    return any(len(t.cands[0]) and int(np.prod(t.cands[0])) > problem.devices
               for t in problem.tables)


def _too_small(graph: OpGraph, devices: int, search, limit: int, cache: dict,
               within: _Within, topology: Topology | None = None) -> InfeasiblePlanError:
    """The error for a ``limit`` nothing fits, naming a memory limit that plans: the
    smallest when a bisection between ``limit`` and a limit found to plan closes within
    :data:`_PROBES` tries and :data:`_PROBE_STEPS` steps over complete ladders, else "a
    memory_limit of N bytes plans it".

    >>> import numpy as np, tensorql as tq
    >>> from tensorql.optimizer.search import search_auto
    >>> db = tq.connect()
    >>> x = db.from_numpy("ts_x", np.ones((1, 8), np.float32))
    >>> y = db.from_numpy("ts_y", np.ones((8, 8), np.float32))
    >>> graph = OpGraph.build(tq.einsum("ca,ba->c", x, y).node)
    >>> err = _too_small(graph, 6, search_auto, 12, {}, _Within(None, floor=16))
    >>> err.minimum, err.smallest
    (20, True)
    """
    below, exact = limit, within.complete  # ``below`` does not plan
    probe = max(limit + 1, within.floor or 0, within.least or 0)
    plans, tries, spent = None, 0, 0

    def attempt(candidate: int) -> _Within:
        nonlocal tries, spent
        tries += 1
        found = _plan_within(graph, devices, search, candidate, cache, topology, more=0,
                             steps=max(1, min(_MAX_STEPS, _PROBE_STEPS - spent)))
        spent += found.steps
        return found

    while plans is None and tries < _PROBES and spent < _PROBE_STEPS:
        found = attempt(probe)
        if found.plan is not None:
            plans = probe
        else:
            below, exact = probe, exact and found.complete
            probe = max(probe + 1, found.least or 0, 2 * probe)
    head = (f"memory_limit={limit} bytes ({format_bytes(limit)}) is too small for this query "
            f"on {devices} devices: no partitioning fits every task (inputs and output) in it")
    if plans is None:
        return InfeasiblePlanError(f"{head}; none up to {below} bytes ({format_bytes(below)}) "
                                   "plans it either", minimum=None)
    while plans - below > 1 and tries < _PROBES and spent < _PROBE_STEPS:
        middle = (below + plans) // 2
        found = attempt(middle)
        if found.plan is not None:
            plans = middle
        else:
            below, exact = middle, exact and found.complete
    if plans - below == 1 and exact:
        return InfeasiblePlanError(f"{head}; the smallest memory_limit that plans it is "
                                   f"{plans} bytes ({format_bytes(plans)})", minimum=plans,
                                   smallest=True)
    return InfeasiblePlanError(f"{head}; a memory_limit of {plans} bytes "
                               f"({format_bytes(plans)}) plans it (none of {below} bytes "
                               f"({format_bytes(below)}) or less does, as far as searched)",
                               minimum=plans)


def make_plan(problem: Problem, choice: tuple[int, ...], strategy: str,
              memory_limit: int | None, topology: Topology | None = None) -> PartitionPlan:
    """Freeze a search result into a :class:`PartitionPlan` with its exact cost and its
    :class:`TimeEstimate` on ``topology`` (None: flat)."""
    graph, tables = problem.graph, problem.tables
    moved: dict[tuple[int, int], int] = {}
    for (p, c, k, _), m in zip(problem.edges, problem.edge_bytes()):
        moved[(c, k)] = int(m[choice[p], choice[c]])
    ops = []
    device_flops = np.zeros(problem.devices, dtype=np.int64)
    peak = 0
    for node, table, cand in zip(graph.nodes, tables, choice):
        pieces = tuple(int(x) for x in table.cands[cand])
        order = table.orders[cand]
        scatter = table.layouts[cand].scatter
        device_flops += table.flops_dev[cand]
        peak = max(peak, int(table.peak[cand]))
        inputs = []
        for k, edge in enumerate(node.inputs):
            prod = graph.nodes[edge.producer]
            here = tuple(pieces[node.labels.index(a)] for a in edge.axes)
            there = tables[edge.producer].layouts[choice[edge.producer]].out_pieces
            replicas = int(np.prod([p for lab, p in zip(node.labels, pieces)
                                    if lab not in edge.axes]))
            if prod.loaded_where_read:
                reason = "loaded where read: each device reads its own regions of it"
            elif here == there and moved[(node.index, k)] == 0:
                reason = "already in place"
            elif here == there and replicas > 1:
                reason = (f"broadcast: pieces {_vec(edge.axes, here)} match; replicated to "
                          f"{replicas} tasks")
            elif here == there:
                reason = (f"send: pieces {_vec(edge.axes, here)} match but are held by other "
                          "devices (the axis order differs)")
            else:
                reason = (f"{collective(there, here)}: repartitioned from "
                          f"{_vec(edge.axes, there)} to {_vec(edge.axes, here)}, replicated to "
                          f"{replicas} task(s)")
            inputs.append(InputMove(f"[{edge.producer}] {prod.name}", moved[(node.index, k)],
                                    reason))
        op = OpPartition(index=node.index, name=node.name, kind=node.kind, labels=node.labels,
                         sizes=node.sizes, pieces=pieces,
                         flops_per_device=int(table.flops_dev[cand].max()),
                         inputs=tuple(inputs), partial_bytes=int(table.partial_bytes[cand]),
                         peak_bytes=int(table.peak[cand]), n_agg=len(node.agg_labels),
                         order=order if order != tuple(range(len(pieces))) else (),
                         scatter=scatter)
        ops.append(op)
    topo = Topology.flat(problem.devices) if topology is None else topology
    layouts = [t.layouts[k] for t, k in zip(tables, choice)]
    pairs = pair_bytes(graph, layouts, problem.devices)
    if problem.topology is None:
        exact = problem.exact_total(choice)
        transfer_s = exact / topo.unit_rate
    else:  # costs are priced: the bytes are counted pair by pair
        exact = int(pairs.sum())
        transfer_s = problem.exact_total(choice) / problem.topology.unit_rate
    levels = topo.level_bytes(pairs)
    compute_s = sum(float(t.flops_dev[k].max()) for t, k in zip(tables, choice)) \
        / topo.device_flops
    level_bytes = tuple((lv, levels[lv]) for lv in LEVELS)
    tier_s = 0.0
    if memory_limit is not None:  # what the limit forces through the host and DuckDB
        host, spill = tier_bytes(graph, layouts, memory_limit, topo)
        tier_s = tier_seconds(host, spill, topo)
        level_bytes += tuple((tier, int(b.sum())) for tier, b in zip(TIERS, (host, spill))
                             if b.any())
    estimate = TimeEstimate(compute_s, transfer_s, level_bytes, tier_s)
    cost = Cost(flops=int(device_flops.max()), bytes_moved=exact, peak_bytes=peak)
    return PartitionPlan(devices=problem.devices, strategy=strategy, ops=tuple(ops), cost=cost,
                         memory_limit=memory_limit, graph=graph, topology=topology,
                         estimate=estimate)


def collective(there: tuple[int, ...], here: tuple[int, ...]) -> str:
    """The collective a change of pieces amounts to (each consumer piece is a union of
    producer pieces: all-gather; a part of one: slice; otherwise all-to-all).

    >>> collective((4, 1), (1, 1)), collective((1, 2), (2, 2)), collective((2, 1), (1, 2))
    ('all-gather', 'slice', 'all-to-all')
    """
    if all(t % h == 0 for h, t in zip(here, there)):
        return "all-gather"
    if all(h % t == 0 for h, t in zip(here, there)):
        return "slice"
    return "all-to-all"


def _vec(labels, pieces) -> str:
    return "(" + " ".join(f"{lab}:{p}" for lab, p in zip(labels, pieces)) + ")"


def explain_partitioning(node: Any, devices: Any) -> str:
    """The EXPLAIN section "partitioning for N devices" (empty unless N > 1).

    ``devices`` is an int or a list of device names; anything else ("auto", "cpu") is one.

    >>> explain_partitioning(None, "auto")
    ''
    """
    try:
        n = device_count(devices)
    except PlanError:
        return ""
    if n <= 1:
        return ""
    try:
        return optimize(node, devices=n).explain()
    except PlanError as err:
        return f"partitioning for {n} devices: not available ({err})"
