"""Lower a task graph to device ops and plan every device's memory under a budget.

The event-driven runtime does not run ``Task`` objects directly: :func:`plan_program` turns them
into ``Op`` records, one per unit of work on one device lane:

* ``load``    -- bring a chunk into device memory: from rest (re-run its source task, e.g. a
  store read) or from the host tier (a copy written back earlier); lane ``h2d``;
* ``send``    -- copy a complete chunk from another device (lane ``d2d``);
* ``alloc``   -- reserve device memory for a chunk computed on the device;
* ``compute`` -- run one chunk task (a kernel, or a partial-aggregate contribution);
* ``d2h``     -- write a device chunk back to the host tier (an eviction of a dirty chunk, or a
  result); lane ``d2h``;
* ``free``    -- drop a device copy (after its last use, or as an eviction);
* ``fetch``   -- read a source chunk that is itself a result straight into the host tier.

The plan simulates one sequential order (tasks by ``Task.priority``) and decides evictions in
it with Belady's rule: when a chunk must come in and the budget is full, the resident chunk used
furthest in the future leaves (written back first only when the device copy is the only valid
one). Loads for the next ``prefetch`` tasks are issued right after the current task, evicting
only chunks whose next use is later still, so at run time they overlap the tasks before them.

**Why the budget holds in any order.** Per device, allocations (``load``/``send``/``alloc``) and
frees (``free``) are numbered in simulated order; frees form a chain (each depends on the
previous). An allocation ``k`` depends on the first free ``j`` such that the bytes of
allocations ``1..k`` minus frees ``1..j`` fit the budget. At run time, whatever has started,
live bytes <= bytes of allocations up to the latest started one ``m`` minus frees ``1..j(m)``
<= budget. The simulated order satisfies every dependency, so the graph is acyclic.

>>> import torch
>>> from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph
>>> a, b, c = ChunkRef(0, (0,)), ChunkRef(0, (1,)), ChunkRef(1, ())
>>> g = TaskGraph(tasks=(Task(0, (), a, None), Task(1, (), b, None),
...                      Task(2, (a,), c, None, 2.0), Task(3, (b,), c, None, 3.0)),
...               retain=frozenset({1}), chunk_bytes={a: 100, b: 100, c: 10})
>>> prog = plan_program(g, n_devices=1, budgets=[110])
>>> [op.kind for op in prog.ops]
['load', 'alloc', 'compute', 'free', 'load', 'compute', 'd2h', 'free', 'free']
>>> prog.devices[0].peak_bytes <= 110
True
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tensorql.errors import PlanError
from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph
from tensorql.units import format_bytes

LANES = ("compute", "h2d", "d2h", "d2d", "none")


_HINT = ("; store the operands with smaller chunks (from_numpy(..., tile=(256, 256)) or "
         "Options.tile_target_elems) or raise memory_limit")


@dataclass(frozen=True)
class Op:
    """One unit of work on one device lane; ``deps`` are op ids that must complete first."""

    id: int
    kind: str
    device: int
    ref: ChunkRef
    deps: tuple[int, ...]
    nbytes: int = 0
    lane: str = "none"
    task: Task | None = None
    src_device: int | None = None
    from_rest: bool = False
    from_host: bool = False  # a send of the host copy ``src_device``'s process wrote back
    # a copy from another device (a send, or a load of the host copy ``src_device`` wrote
    # back) that brings a chunk to a device a second time, or back to the one that computed
    # it: traffic the memory limit adds, not in the partition plan (see ``_Planner.arrive``)
    again: bool = False
    keep_host: bool = True
    evict: bool = False
    cost: float = 0.0
    order: int = 0

    def describe(self) -> str:
        what = f"{self.kind} s{self.ref.step}{list(self.ref.key)} @dev{self.device}"
        if self.kind == "load":
            what += " from rest" if self.from_rest else " from host"
            if self.src_device is not None and not self.from_rest:
                what += f" (written back by dev{self.src_device})"
        if self.kind == "send":
            what += f" from dev{self.src_device}" + ("'s host" if self.from_host else "")
        return what + (" again" if self.again else "")


@dataclass(frozen=True)
class DevicePlan:
    """Planned figures of one device."""

    index: int
    budget: int | None
    peak_bytes: int
    evictions: int
    writebacks: int
    bytes_h2d: int
    bytes_d2h: int
    bytes_d2d: int


@dataclass(frozen=True)
class HostPlan:
    """Planned figures of the host tier: the most bytes of host copies held at once with no
    budget (``peak_bytes``), and under ``budget`` the bytes that go to DuckDB (the spill
    tier) and come back from it, with the rule the host tier follows at run time
    (:class:`~tensorql.exec.hostpool.HostTier`: the copies read again furthest in the
    future leave first)."""

    budget: int | None
    peak_bytes: int
    spill_bytes: int = 0
    reload_bytes: int = 0

    def describe(self) -> str:
        """One line for the memory plan's summary.

        >>> HostPlan(None, 3 << 20).describe()
        'host tier peak=3.0 MiB (unlimited)'
        """
        from tensorql.units import format_bytes

        budget = format_bytes(self.budget) if self.budget is not None else "unlimited"
        text = f"host tier peak={format_bytes(self.peak_bytes)} ({budget})"
        if self.spill_bytes:
            text += (f"; DuckDB tier spill={format_bytes(self.spill_bytes)} "
                     f"reload={format_bytes(self.reload_bytes)}")
        return text


@dataclass(frozen=True)
class Program:
    """The ops of a run in simulated order, with per-device plans and ranks for the runtime.

    ``rank[op.id]`` is the op's critical-path length (the cost of the longest chain of ops it
    starts); the runtime runs ready ops with the longest chain first.
    """

    ops: tuple[Op, ...]
    devices: tuple[DevicePlan, ...]
    retain: frozenset[int]
    rank: tuple[float, ...]
    graph_tasks: int
    host_loads: dict[ChunkRef, int] = field(default_factory=dict, compare=False)
    host: HostPlan | None = None

    def explain(self) -> str:
        """A short text summary of the memory plan.

        >>> plan = Program((), (DevicePlan(0, 100, 60, 1, 1, 10, 20, 0),), frozenset(), (), 0)
        >>> for part in plan.explain().split(" evictions"): print(part)
        memory plan: dev0 budget=100 B planned peak=60 B
        =1 (1 written back) h2d=10 B d2h=20 B
        """
        from tensorql.units import format_bytes

        parts = []
        for d in self.devices:
            budget = format_bytes(d.budget) if d.budget is not None else "unlimited"
            text = (f"dev{d.index} budget={budget} planned peak={format_bytes(d.peak_bytes)} "
                    f"evictions={d.evictions} ({d.writebacks} written back) "
                    f"h2d={format_bytes(d.bytes_h2d)} d2h={format_bytes(d.bytes_d2h)}")
            if d.bytes_d2d:
                text += f" d2d={format_bytes(d.bytes_d2d)}"
            parts.append(text)
        if self.host is not None and self.host.spill_bytes:  # (the budget is the machine's
            parts.append(self.host.describe())                # otherwise: not shown)
        return "memory plan: " + "; ".join(parts)

    @functools.cached_property
    def successors(self) -> tuple[tuple[int, ...], ...]:
        """For each op, the ops that wait for it (found once per program, not per run).

        >>> a = Op(0, "alloc", 0, ChunkRef(1, (0,)), (), 4, "none")
        >>> b = Op(1, "free", 0, ChunkRef(1, (0,)), (0,), 4, "none")
        >>> Program((a, b), (), frozenset(), (0.0, 0.0), 0).successors
        ((1,), ())
        """
        succ: list[list[int]] = [[] for _ in self.ops]
        for op in self.ops:
            for dep in op.deps:
                succ[dep].append(op.id)
        return tuple(tuple(s) for s in succ)

    @functools.cached_property
    def dep_counts(self) -> tuple[int, ...]:
        """How many ops each op waits for."""
        return tuple(len(op.deps) for op in self.ops)

    @functools.cached_property
    def host_reads(self) -> tuple[tuple[int, ChunkRef], ...]:
        """The reads of host copies (a ``load`` from the host, a ``send`` of a host copy), in
        plan order: the order the host tier keeps chunks in memory and prefetches spilled
        ones by (:class:`~tensorql.exec.hostpool.HostTier`)."""
        return tuple((op.id, op.ref) for op in self.ops
                     if (op.kind == "load" and not op.from_rest)
                     or (op.kind == "send" and op.from_host))

    @functools.cached_property
    def result_copies(self) -> tuple[Op, ...]:
        """The ops that leave a chunk on the host for good (``d2h`` or ``fetch``, not an
        eviction): a run's results are among their chunks."""
        return tuple(op for op in self.ops if op.kind in ("d2h", "fetch") and not op.evict)


@dataclass
class _Interval:
    """A chunk's stay in one device's memory."""

    alloc: int
    nbytes: int
    users: list[int]
    dirty: bool = False


class _Device:
    def __init__(self, index: int, budget: int | None, room: int | None = None) -> None:
        self.index = index
        self.budget = budget  # what the allocations' dependencies keep live bytes within
        # what the simulated order keeps resident (<= budget): the rest is headroom in which
        # other tasks run beside the simulated one (:func:`plan_room`)
        self.room = budget if room is None else room
        self.resident: dict[ChunkRef, _Interval] = {}
        self.last_free: dict[ChunkRef, int] = {}  # each chunk's latest free op here
        self.live = 0
        self.peak = 0
        self.alloc_total = 0
        self.freed: list[int] = [0]  # prefix sums of freed bytes, by free number
        self.free_ops: list[int] = []
        self.evictions = self.writebacks = 0
        self.h2d = self.d2h = self.d2d = 0
        self.uses: dict[ChunkRef, list[int]] = {}  # sim positions using a chunk here
        self.use_ptr: dict[ChunkRef, int] = {}


class _Planner:
    def __init__(self, graph: TaskGraph, n_devices: int, budgets: Sequence[int | None],
                 prefetch: int, sizes: dict[ChunkRef, int],
                 results_on_device: bool = False,
                 host_domains: Sequence[int] | None = None,
                 concurrency: Sequence[int] | None = None) -> None:
        self.graph = graph
        # which host memory each device writes back to: one for the devices of a process
        self.domain = list(host_domains) if host_domains is not None else [0] * n_devices
        self.results_on_device = results_on_device
        self.sizes = sizes
        self.prefetch = prefetch
        self.ops: list[Op] = []
        largest = largest_task_bytes(graph, sizes) if any(
            b is not None for b in budgets) else 0
        self.devs = [_Device(i, budgets[i], plan_room(budgets[i], largest,
                                                      concurrency[i] if concurrency else 1))
                     for i in range(n_devices)]
        contributions = graph.contributions()
        self.contributions = contributions
        self.lanes = max(concurrency) if concurrency else 1  # workers of the busiest device
        # data at rest is loaded onto whichever device reads it, unless its task is pinned to a
        # device (a partitioned plan places every piece): then it is computed there
        self.source: dict[ChunkRef, Task] = {
            t.output: t for t in graph.tasks
            if t.is_source and contributions[t.output] == 1 and t.device is None}
        self.tasks = [t for t in graph.tasks if t.output not in self.source]
        self.remaining = {ref: n for ref, n in contributions.items() if ref not in self.source}
        self.writers: dict[ChunkRef, list[int]] = {}
        self.host_valid: set[ChunkRef] = set()
        self.host_d2h: dict[ChunkRef, int] = {}
        self.host_writer: dict[ChunkRef, int] = {}  # the device whose write-back it is
        self.host_loads: dict[ChunkRef, int] = {}
        self.owner: dict[ChunkRef, int] = {}
        self.arrived: set[tuple[ChunkRef, int]] = set()  # chunks copied in from elsewhere

    # -- sizes, order, placement ------------------------------------------------------
    def size(self, ref: ChunkRef) -> int:
        return self.sizes.get(ref, 0)

    def budget_binds(self) -> bool:
        """Whether the chunks the tasks compute outgrow the devices' budgets together (then
        :meth:`order` runs consumers as soon as they can, so intermediates are used and freed
        while they are still resident instead of going to the host tier and back)."""
        if any(d.budget is None for d in self.devs):
            return False
        computed = sum(self.size(t.output) for t in self.tasks)
        return computed > sum(d.budget or 0 for d in self.devs)

    def order(self) -> list[Task]:
        """A topological order of the non-source tasks, by (priority, id) among ready ones.

        When the budget binds (:meth:`budget_binds`) the order is memory-aware, depth first:
        a task made ready by the latest completion runs before older ready ones (ties by
        priority), so the product of a chunk task is consumed while resident. In ``(A @ B) @
        C`` under a small budget each tile of ``A @ B`` then feeds its partial product with
        ``C`` at once and never spills; in priority order every tile of ``A @ B`` would be
        made before any is used (dask's scheduler orders by the same rule). Among the tasks
        one completion makes ready, those whose other inputs were made last go first
        (:func:`_recency`): when a reduction over a whole intermediate releases all its
        consumers at once, the tiles still resident are used before the evicted ones come
        back. When the device runs several tasks at once (``concurrency``), such a batch is
        dealt out over as many accumulations as it has workers (:meth:`_batch_keys`): the
        consumers feeding two different partial sums alternate, so two chains of
        contributions (each serial: they add into one chunk) run side by side within the
        plan's room, instead of one row's chain after another with a worker idle.
        """
        depth_first = self.budget_binds()
        waiting: dict[ChunkRef, list[Task]] = {}
        pending: dict[int, int] = {}
        ready: list[tuple[int, tuple, float, int, Task]] = []
        for t in self.tasks:
            deps = {r for r in t.inputs if r not in self.source}
            pending[t.id] = len(deps)
            for r in deps:
                waiting.setdefault(r, []).append(t)
            if not deps:
                ready.append((0, (), t.priority, t.id, t))
        heapq.heapify(ready)
        remaining = dict(self.remaining)
        finished: dict[ChunkRef, int] = {}  # when each computed chunk was complete
        out: list[Task] = []
        while ready:
            *_, t = heapq.heappop(ready)
            out.append(t)
            remaining[t.output] -= 1
            if remaining[t.output] == 0:
                finished[t.output] = len(out)
                generation = -len(out) if depth_first else 0
                batch = []
                for c in waiting.pop(t.output, ()):
                    pending[c.id] -= 1
                    if pending[c.id] == 0:
                        batch.append(c)
                for key, c in self._batch_keys(batch, finished, waiting, depth_first):
                    heapq.heappush(ready, (generation, key, c.priority, c.id, c))
        if len(out) != len(self.tasks):
            missing = sorted({r for t in self.tasks for r in t.inputs
                              if r not in self.remaining and r not in self.source},
                             key=lambda r: (r.step, r.key))
            if missing:
                raise PlanError(f"a task reads chunk {missing[0]} that no task writes")
            raise PlanError("the task graph has a cycle")
        return out

    def _batch_keys(self, batch: list[Task], finished: dict[ChunkRef, int],
                    waiting: dict[ChunkRef, list[Task]], depth_first: bool
                    ) -> list[tuple[tuple, Task]]:
        """Keys for the tasks one completion made ready together (see :meth:`order`), with
        each task: by :func:`_recency`, and with ``self.lanes`` workers per device the
        tasks are grouped by the accumulation their consumers add to (a chunk of several
        contributions; else the task's own output) and the groups, in order of their most
        recent task, taken ``lanes`` at a time with their tasks alternating."""
        if not depth_first:
            return [((), c) for c in batch]
        keyed = sorted(((_recency(c, finished), c.priority, c.id), c) for c in batch)
        lanes = self.lanes
        if lanes <= 1 or len(batch) <= 1:
            return [((k[0],), c) for k, c in keyed]
        groups: dict[object, int] = {}
        ranks: dict[int, int] = {}
        out = []
        for k, c in keyed:
            chain = frozenset(u.output for u in waiting.get(c.output, ())
                              if self.contributions.get(u.output, 1) > 1) or c.output
            g = groups.setdefault(chain, len(groups))
            rank = ranks[g] = ranks.get(g, -1) + 1
            out.append(((g // lanes, rank, g % lanes, k[0]), c))
        return out

    def place(self, order: list[Task]) -> list[int]:
        """A device per task: every contribution to a chunk on the chunk's owner; owners chosen
        by least load so far, preferring the device holding most of the inputs."""
        n = len(self.devs)
        load = [0.0] * n
        placed = []
        for t in order:
            dev = t.device if t.device is not None else self.owner.get(t.output)
            if dev is None:
                if n == 1:
                    dev = 0
                else:
                    votes = [0] * n
                    for r in t.inputs:
                        if r in self.owner:
                            votes[self.owner[r]] += self.size(r)
                    dev = min(range(n), key=lambda d: (load[d] - 0.25 * votes[d], d))
            if not 0 <= dev < n:
                raise PlanError(f"task {t.id} is pinned to device {dev}, but the run has {n}")
            self.owner.setdefault(t.output, dev)
            load[dev] += _task_cost(t, self.sizes)
            placed.append(dev)
        return placed

    # -- op emission --------------------------------------------------------------------
    def emit(self, kind: str, dev: int, ref: ChunkRef, deps, **kw) -> Op:
        op = Op(id=len(self.ops), kind=kind, device=dev, ref=ref,
                deps=tuple(sorted({d for d in deps if d is not None})), order=len(self.ops),
                **kw)
        self.ops.append(op)
        return op

    def _alloc_dep(self, d: _Device, nbytes: int) -> int | None:
        """The free an allocation of ``nbytes`` (after all earlier ones) must wait for."""
        d.alloc_total += nbytes
        if d.budget is None:
            return None
        need = d.alloc_total - d.budget  # bytes that must have been freed
        if need <= 0:
            return None
        # smallest j with freed[j] >= need; frees are chained, so waiting on free j suffices
        lo, hi = 1, len(d.freed) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if d.freed[mid] >= need:
                hi = mid
            else:
                lo = mid + 1
        assert d.freed[lo] >= need, "memory simulation out of step"
        return d.free_ops[lo - 1]

    def _next_use(self, d: _Device, ref: ChunkRef, pos: int) -> float:
        uses = d.uses.get(ref, ())
        i = d.use_ptr.get(ref, 0)
        while i < len(uses) and uses[i] <= pos:
            i += 1
        d.use_ptr[ref] = i
        return uses[i] if i < len(uses) else math.inf

    def free(self, d: _Device, ref: ChunkRef, evict: bool = False,
             writeback: bool = False) -> None:
        iv = d.resident.pop(ref)
        deps = list(iv.users) + [iv.alloc]
        if writeback:
            wb = self.emit("d2h", d.index, ref, deps, nbytes=iv.nbytes, lane="d2h", evict=evict)
            d.d2h += iv.nbytes
            self.host_valid.add(ref)
            self.host_d2h[ref] = wb.id
            self.host_writer[ref] = d.index
            deps.append(wb.id)
            d.writebacks += evict
        if d.free_ops:
            deps.append(d.free_ops[-1])  # frees form a chain (see the module docstring)
        op = self.emit("free", d.index, ref, deps, nbytes=iv.nbytes, evict=evict)
        d.free_ops.append(op.id)
        d.last_free[ref] = op.id
        d.freed.append(d.freed[-1] + iv.nbytes)
        d.live -= iv.nbytes
        d.evictions += evict

    def make_room(self, d: _Device, nbytes: int, pinned: set[ChunkRef], pos: int,
                  what: str, sooner_than: float | None = None) -> bool:
        """Evict (furthest next use first) until ``nbytes`` fit. With ``sooner_than`` (a
        prefetch), only chunks next used after that position may go; returns False when that
        is not enough, having evicted nothing."""
        if d.room is None or d.live + nbytes <= d.room:
            return True
        victims = sorted((r for r in d.resident if r not in pinned),
                         key=lambda r: (self._next_use(d, r, pos), not d.resident[r].dirty,
                                        r.step, r.key), reverse=True)
        if sooner_than is not None:
            victims = [r for r in victims if self._next_use(d, r, pos) > sooner_than]
            if d.live + nbytes - sum(d.resident[r].nbytes for r in victims) > d.room:
                return False
        for victim in victims:
            if d.live + nbytes <= d.room:
                break
            iv = d.resident[victim]
            needed_later = (self._next_use(d, victim, pos) < math.inf
                            or self._used_elsewhere(victim, d.index, pos)
                            or (victim.step in self.graph.retain
                                and victim not in self.host_valid)
                            or self.remaining.get(victim, 0) > 0)
            self.free(d, victim, evict=True, writeback=iv.dirty and needed_later)
        if d.live + nbytes > d.room:
            raise PlanError(
                f"memory_limit too small on device {d.index}: {what} needs "
                f"{format_bytes(nbytes + d.live)} resident at once, the budget is "
                f"{format_bytes(d.room)}{_HINT}")
        return True

    def _used_elsewhere(self, ref: ChunkRef, dev: int, pos: int) -> bool:
        return any(self._next_use(o, ref, pos) < math.inf for o in self.devs if o.index != dev)

    def bring(self, d: _Device, ref: ChunkRef, pinned: set[ChunkRef], pos: int,
              what: str, output: bool) -> None:
        """Make ``ref`` resident on ``d`` (load, send or alloc)."""
        if ref in d.resident:
            return
        nbytes = self.size(ref)
        self.make_room(d, nbytes, pinned, pos, what)
        mem = self._alloc_dep(d, nbytes)
        # a chunk brought back after a free of it here waits for that free: the runtime holds
        # a device's chunks by name, so a late free of the old copy would drop the new one
        # (frees are chained: waiting on the later of the two frees waits on both). The
        # memory dependency alone implied it only when the simulated order kept the whole
        # budget full; with room for other workers (:func:`plan_room`) it did not.
        again = d.last_free.get(ref)
        if again is not None and (mem is None or again > mem):
            mem = again
        d.live += nbytes
        d.peak = max(d.peak, d.live)
        if ref in self.source:
            op = self.emit("load", d.index, ref, [mem], nbytes=nbytes, lane="h2d",
                           task=self.source[ref], from_rest=True)
            d.h2d += nbytes
            dirty = False
        elif output and ref not in self.host_valid:
            op = self.emit("alloc", d.index, ref, [mem], nbytes=nbytes)
            dirty = True
        elif not output and (src := self._holder(ref, d.index)) is not None:
            op = self.emit("send", d.index, ref, [mem, src.resident[ref].alloc,
                                                  *self.writers.get(ref, ())],
                           nbytes=nbytes, lane="d2d", src_device=src.index,
                           again=self.arrive(ref, d.index))
            src.resident[ref].users.append(op.id)
            d.d2d += nbytes
            dirty = False
            self._release_after_send(src, ref, d, pos)
        else:
            if ref not in self.host_valid:  # pragma: no cover - guarded by the order
                raise PlanError(f"chunk {ref} is needed on device {d.index} but is nowhere")
            take = output  # a partial aggregate comes back to be added to: move it
            writer = self.host_writer.get(ref, d.index)
            if self.domain[writer] != self.domain[d.index]:
                # written back to another process's host memory: that process sends it
                op = self.emit("send", d.index, ref, [mem, self.host_d2h.get(ref)],
                               nbytes=nbytes, lane="d2d", src_device=writer, from_host=True,
                               keep_host=not take, again=self.arrive(ref, d.index))
                d.d2d += nbytes
            else:  # another device's write-back crosses devices through the host
                crossing = writer != d.index
                op = self.emit("load", d.index, ref, [mem, self.host_d2h.get(ref)],
                               nbytes=nbytes, lane="h2d", keep_host=not take,
                               src_device=writer if crossing else None,
                               again=crossing and self.arrive(ref, d.index))
                d.h2d += nbytes
            self.host_loads[ref] = self.host_loads.get(ref, 0) + 1
            if take:
                self.host_valid.discard(ref)
            dirty = take
        d.resident[ref] = _Interval(op.id, nbytes, [], dirty)

    def arrive(self, ref: ChunkRef, dev: int) -> bool:
        """Record that ``ref`` is copied onto ``dev`` from another device (directly or
        through the host); True when that copy is beyond the partition plan's, which moves
        each chunk once to each device reading it that did not compute it: ``dev`` had it
        copied in before (and dropped it under the budget), or computed it."""
        again = (ref, dev) in self.arrived or self.owner.get(ref) == dev
        self.arrived.add((ref, dev))
        return again

    def _release_after_send(self, src: _Device, ref: ChunkRef, dst: _Device, pos: int) -> None:
        """Free ``ref`` on ``src`` once ``src`` no longer uses it and no device but ``dst``,
        which has just been sent it, will read it."""
        if ref not in src.resident or self._next_use(src, ref, pos - 1) < math.inf:
            return
        if self.remaining.get(ref, 0) > 0 or (ref.step in self.graph.retain
                                               and ref not in self.host_valid):
            return
        for other in self.devs:
            if other.index not in (src.index, dst.index) and \
                    self._next_use(other, ref, pos - 1) < math.inf:
                return
        self.free(src, ref)

    def _holder(self, ref: ChunkRef, dev: int) -> _Device | None:
        """A device holding ``ref`` to send it from: the one that computed it when it still
        does (the plan's transfers are from owners), else any other."""
        if self.remaining.get(ref, 0) > 0:
            return None
        owner = self.owner.get(ref)
        if owner is not None and owner != dev and ref in self.devs[owner].resident:
            return self.devs[owner]
        for o in self.devs:
            if o.index != dev and ref in o.resident:
                return o
        return None

    # -- the simulation -----------------------------------------------------------------
    def run(self) -> Program:
        order = self.order()
        placed = self.place(order)
        for pos, (t, dev) in enumerate(zip(order, placed)):
            d = self.devs[dev]
            for ref in dict.fromkeys((*t.inputs, t.output)):
                d.uses.setdefault(ref, []).append(pos)
        for pos, (t, dev) in enumerate(zip(order, placed)):
            d = self.devs[dev]
            need = list(dict.fromkeys((*t.inputs, t.output)))
            pinned = set(need)
            what = f"task {t.id} ({self.graph.step_name(t.output.step)}, chunk {t.output.key})"
            total = sum(self.size(r) for r in need)
            if d.budget is not None and total > d.budget:
                raise PlanError(
                    f"memory_limit too small on device {dev}: {what} needs "
                    f"{format_bytes(total)} resident at once (inputs and output), the budget "
                    f"is {format_bytes(d.budget)}{_HINT}")
            for ref in need:
                self.bring(d, ref, pinned, pos, what, output=ref == t.output)
            deps = [d.resident[r].alloc for r in need]
            for ref in t.inputs:
                deps.extend(self.writers.get(ref, ()))
            op = self.emit("compute", dev, t.output, deps, lane="compute", task=t,
                           cost=_task_cost(t, self.sizes))
            for ref in need:
                d.resident[ref].users.append(op.id)
            d.resident[t.output].dirty = True
            self.host_valid.discard(t.output)
            self.writers.setdefault(t.output, []).append(op.id)
            self.remaining[t.output] -= 1
            if self.remaining[t.output] == 0 and t.output.step in self.graph.retain \
                    and not self.results_on_device:
                iv = d.resident[t.output]
                wb = self.emit("d2h", dev, t.output, [*iv.users, iv.alloc],
                               nbytes=iv.nbytes, lane="d2h")
                d.d2h += iv.nbytes
                iv.users.append(wb.id)
                iv.dirty = False
                self.host_valid.add(t.output)
                self.host_d2h[t.output] = wb.id
                self.host_writer[t.output] = dev
            for ref in need:
                if self.results_on_device and ref.step in self.graph.retain:
                    continue  # results stay where they are
                if ref in d.resident and self._next_use(d, ref, pos) == math.inf and \
                        self.remaining.get(ref, 0) == 0:
                    later = self._used_elsewhere(ref, dev, pos)
                    if later and self.owner.get(ref, d.index) == d.index:
                        # other devices will be sent it, as the partition plan says: freed
                        # after the last send or, when the budget needs the room first,
                        # evicted (written back; it is next used nowhere here, so it goes
                        # before any chunk this device reads again)
                        continue
                    self.free(d, ref, writeback=d.resident[ref].dirty and later)
            self.prefetch_for(order, placed, pos)
        for ref, task in self.source.items():  # results read straight from rest
            if ref.step in self.graph.retain:
                self.emit("fetch", 0, ref, [], lane="h2d", task=task, from_rest=True)
        for d in self.devs:  # whatever is still resident (e.g. read only by other devices)
            for ref in list(d.resident):
                if not (self.results_on_device and ref.step in self.graph.retain):
                    self.free(d, ref)
        ops = tuple(self.ops)
        return Program(
            ops=ops,
            devices=tuple(DevicePlan(d.index, d.budget, d.peak, d.evictions, d.writebacks,
                                     d.h2d, d.d2h, d.d2d) for d in self.devs),
            retain=self.graph.retain,
            rank=_critical_path(ops),
            graph_tasks=len(self.graph.tasks),
            host_loads=self.host_loads,
        )

    def prefetch_for(self, order: list[Task], placed: list[int], pos: int) -> None:
        """Issue loads for the inputs of the next ``prefetch`` tasks now, so they run while
        earlier tasks compute. A prefetch may evict only chunks next used later than the
        prefetched one (Belady's rule still holds), never the next tasks' chunks."""
        end = min(len(order), pos + 1 + self.prefetch)
        for ahead in range(pos + 1, end):
            t, d = order[ahead], self.devs[placed[ahead]]
            pinned = {r for k in range(pos + 1, ahead + 1) if placed[k] == d.index
                      for r in (*order[k].inputs, order[k].output)}
            for ref in t.inputs:
                if ref in d.resident or self.remaining.get(ref, 0) > 0:
                    continue
                if ref not in self.source and ref not in self.host_valid \
                        and self._holder(ref, d.index) is None:
                    continue
                if not self.make_room(d, self.size(ref), pinned, pos, "prefetch",
                                      sooner_than=ahead):
                    return
                self.bring(d, ref, pinned, pos, "prefetch", output=False)


def _recency(task: Task, finished: dict[ChunkRef, int]) -> tuple[int, ...]:
    """How recently ``task``'s computed inputs were made, as a key that puts the task whose
    inputs are the newest first: the completion positions of its inputs, latest first,
    negated. Among tasks made ready by the same completion (a reduction's last contribution
    releases every task that waits for it) the memory-aware order then runs first those whose
    other inputs were made last -- the ones still resident -- instead of those made first,
    which a binding budget has already evicted.

    >>> from tensorql.exec.taskgraph import ChunkRef, Task
    >>> y0, y1, m = ChunkRef(0, (0,)), ChunkRef(0, (1,)), ChunkRef(1, ())
    >>> done = {y0: 1, y1: 2, m: 3}
    >>> _recency(Task(5, (y0, m), ChunkRef(2, (0,)), None), done)
    (-3, -1)
    >>> _recency(Task(6, (y1, m), ChunkRef(2, (1,)), None), done) < _
    True
    """
    return tuple(sorted(-finished[r] for r in set(task.inputs) if r in finished))


def _task_cost(task: Task, sizes: dict[ChunkRef, int]) -> float:
    """A task's relative cost: its FLOPs when known, else the bytes it reads (one per FLOP)."""
    return float(task.flops) if task.flops else float(
        sum(sizes.get(r, 1) for r in task.inputs) + 1)


def _critical_path(ops: tuple[Op, ...], copy_weight: float = 1.0) -> tuple[float, ...]:
    """Longest cost path from each op to the end (ops are topologically ordered by id)."""
    succ: list[list[int]] = [[] for _ in ops]
    for op in ops:
        for dep in op.deps:
            succ[dep].append(op.id)
    rank = [0.0] * len(ops)
    for op in reversed(ops):
        own = op.cost if op.kind == "compute" else copy_weight * op.nbytes \
            if op.lane != "none" else 0.0
        rank[op.id] = own + max((rank[s] for s in succ[op.id]), default=0.0)
    return tuple(rank)


def largest_task_bytes(graph: TaskGraph, sizes: dict[ChunkRef, int] | None = None) -> int:
    """Bytes the largest task needs resident at once: its distinct inputs and its output (no
    memory limit can be smaller). Tasks without inputs that are not pinned are loaded where
    they are read, so only their output counts where it is read.

    >>> from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph
    >>> a, b = ChunkRef(0, ()), ChunkRef(1, ())
    >>> largest_task_bytes(TaskGraph((Task(0, (), a, None), Task(1, (a,), b, None)),
    ...                              chunk_bytes={a: 40, b: 8}))
    48
    """
    sizes = graph.chunk_bytes if sizes is None else sizes
    return max((sum(sizes.get(r, 0) for r in {*t.inputs, t.output}) for t in graph.tasks),
               default=0)


def plan_room(budget: int | None, largest: int, concurrency: int = 1) -> int | None:
    """What the simulated order of a device may keep resident under ``budget`` when
    ``concurrency`` tasks run on it at once, ``largest`` being the most bytes one task holds
    (inputs and output): the budget less room for ``concurrency - 1`` more such tasks, at
    least half the budget and at least ``largest`` (never more than the budget).

    The dependencies still allow the whole budget (allocation *k* waits for the first free
    that brings the bytes allocated so far within it), so they leave that headroom to the
    tasks beside the simulated one. Planned at the full budget, a binding budget is full
    after every task of the simulated order: each allocation then waits for the free just
    before it, that is for the task before it, and the tasks run one at a time whatever the
    threads (``(A @ B) @ C`` at 144 MiB on two workers: one kernel at a time, a chain of all
    128 products).

    >>> plan_room(144, 32, 2), plan_room(144, 32, 1), plan_room(64, 40, 2), plan_room(None, 8, 2)
    (112, 144, 40, None)
    """
    if budget is None:
        return None
    headroom = max(0, concurrency - 1) * largest
    return min(budget, max(budget - headroom, budget // 2, largest))


def plan_program(graph: TaskGraph, n_devices: int = 1,
                 budgets: Sequence[int | None] | None = None, prefetch: int = 2,
                 sizes: dict[ChunkRef, int] | None = None,
                 results_on_device: bool = False,
                 host_domains: Sequence[int] | None = None,
                 host_budget: int | None = None,
                 concurrency: Sequence[int] | None = None) -> Program:
    """Lower ``graph`` to ops on ``n_devices`` devices, each holding at most its budget.

    ``sizes`` defaults to ``graph.chunk_bytes``; a budget needs every chunk's size (PlanError
    otherwise). Raises PlanError when one task alone needs more than its device's budget.
    ``results_on_device`` leaves retained chunks in device memory (no budget allowed).
    ``host_domains`` gives each device's host memory (the rank of a torch.distributed job;
    default: one host for all): a chunk written back to one host and needed by a device of
    another is a ``send`` from the host copy (``from_host``), not a load. ``host_budget``:
    the host tier's bytes of host memory, beyond which copies spill to DuckDB
    (:class:`HostPlan`, in ``Program.host``). ``concurrency``: how many tasks each device
    runs at once (its compute threads; default one): under a budget the simulated order
    keeps room for the others (:func:`plan_room`).
    """
    if results_on_device and budgets and any(b is not None for b in budgets):
        raise PlanError("results_on_device needs an unlimited budget")
    budgets = list(budgets) if budgets is not None else [None] * n_devices
    if len(budgets) != n_devices:
        raise PlanError(f"{len(budgets)} budgets for {n_devices} devices")
    sizes = dict(graph.chunk_bytes if sizes is None else sizes)
    if any(b is not None for b in budgets):
        missing = [t.output for t in graph.tasks if t.output not in sizes]
        if missing:
            raise PlanError(f"a memory_limit needs chunk sizes; chunk {missing[0]} has none")
    if host_domains is not None and len(host_domains) != n_devices:
        raise PlanError(f"{len(host_domains)} host domains for {n_devices} devices")
    if concurrency is not None and len(concurrency) != n_devices:
        raise PlanError(f"{len(concurrency)} concurrency figures for {n_devices} devices")
    program = _Planner(graph, n_devices, budgets, prefetch, sizes, results_on_device,
                       host_domains, concurrency).run()
    return replace(program, host=plan_host_tier(program, sizes, host_budget))


def plan_host_tier(program: Program, sizes: dict[ChunkRef, int],
                   budget: int | None = None) -> HostPlan:
    """The host tier through ``program``'s ops in plan order: a write-back enters it, a read
    that takes the copy or is its last leaves it; over ``budget``, the copies read again
    furthest in the future (the incoming one included) go to DuckDB, and one is read back
    from there when a read needs it.

    >>> from tensorql.exec.taskgraph import ChunkRef
    >>> a, b = ChunkRef(0, (0,)), ChunkRef(0, (1,))
    >>> ops = (Op(0, "d2h", 0, a, (), 8, "d2h", evict=True),
    ...        Op(1, "d2h", 0, b, (), 8, "d2h", evict=True),
    ...        Op(2, "load", 0, b, (1,), 8, "h2d"), Op(3, "load", 0, a, (0,), 8, "h2d"))
    >>> prog = Program(ops, (), frozenset(), (0.0,) * 4, 0, host_loads={a: 1, b: 1})
    >>> plan_host_tier(prog, {a: 8, b: 8}, budget=8)
    HostPlan(budget=8, peak_bytes=16, spill_bytes=8, reload_bytes=8)
    """
    reads: dict[ChunkRef, list[int]] = {}
    for k, (_, ref) in enumerate(program.host_reads):
        reads.setdefault(ref, []).append(k)
    position = {op_id: k for k, (op_id, _) in enumerate(program.host_reads)}
    held: dict[ChunkRef, int] = {}  # in host memory
    spilled: set[ChunkRef] = set()  # with a copy in DuckDB
    total = peak = in_memory = spill = reload = 0

    def next_read(ref: ChunkRef) -> float:
        left = reads.get(ref)
        return left[0] if left else math.inf

    def make_room(ref: ChunkRef, nbytes: int) -> bool:
        """Room for ``ref``; False when ``ref`` itself goes to DuckDB."""
        nonlocal in_memory, spill
        if budget is None:
            return True
        for victim in sorted([*held, ref], key=next_read, reverse=True):
            if in_memory + nbytes <= budget:
                return True
            if victim == ref:
                return False
            in_memory -= held.pop(victim)
            if victim not in spilled:
                spilled.add(victim)
                spill += sizes.get(victim, 0)
        return in_memory + nbytes <= budget

    for op in program.ops:
        ref = op.ref
        if op.kind == "d2h" and (op.evict or program.host_loads.get(ref, 0) > 0):
            nbytes = sizes.get(ref, op.nbytes)
            total += nbytes
            peak = max(peak, total)
            spilled.discard(ref)
            if make_room(ref, nbytes):
                held[ref] = nbytes
                in_memory += nbytes
            else:
                spilled.add(ref)
                spill += nbytes
        elif op.id in position:
            left = reads.get(ref, [])
            if left:
                left.pop(0)
            if ref not in held and ref in spilled:
                reload += sizes.get(ref, op.nbytes)
            if not op.keep_host or not left:
                total -= sizes.get(ref, op.nbytes)
                in_memory -= held.pop(ref, 0)
                spilled.discard(ref)
    return HostPlan(budget, peak, spill, reload)
