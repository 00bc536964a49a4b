"""The engine's streams strategy: device ops run as soon as their own inputs are ready.

:class:`Runtime` lowers a ``TaskGraph`` with :func:`~tensorql.exec.memplan.plan_program` (ops
on devices, evictions and reloads decided at plan time under each device's ``memory_limit``),
then drives it from completion events (:class:`StreamRun`): each finished op releases its
successors into a ready queue per device lane (compute, h2d, d2h, d2d), ordered by
critical-path length. There is no barrier between operators, and copies overlap kernels
because lanes are independent. Live bytes per device are tracked and checked against the
budget (ExecutionError if ever exceeded). Each kind of op is one :class:`OpKind` record in
:data:`OP_KINDS` (what runs on the lane, what its completion records).

``Runtime.run(graph, progress, sink)`` goes through the engine
(:func:`tensorql.exec.engine.run`) and returns the same ``RunResult`` as every strategy; its
``stats`` is a :class:`RuntimeStats` with per-device figures.

>>> import torch
>>> from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph
>>> class Const:
...     def __init__(self, v): self.v = v
...     def run(self, inputs, acc): return torch.full((4,), self.v)
...     def combine(self, acc, partial): return acc.add_(partial)
>>> class Add:
...     def run(self, inputs, acc):
...         return inputs[0].clone() if acc is None else acc.add_(inputs[0])
...     def combine(self, acc, partial): return acc.add_(partial)
>>> a, b, c = ChunkRef(0, (0,)), ChunkRef(0, (1,)), ChunkRef(1, ())
>>> g = TaskGraph(tasks=(Task(0, (), a, Const(1.0)), Task(1, (), b, Const(2.0)),
...                      Task(2, (a,), c, Add(), 2.0), Task(3, (b,), c, Add(), 3.0)),
...               retain=frozenset({1}), chunk_bytes={a: 16, b: 16, c: 16})
>>> result = Runtime("cpu", memory_limit=32).run(g)
>>> result.outputs[c].tolist(), result.stats.devices[0].peak_bytes <= 32
([3.0, 3.0, 3.0, 3.0], True)
"""

from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorql.errors import ExecutionError, PlanError, TensorQLError
from tensorql.exec.devices import Completion, Device, resolve_devices
from tensorql.exec.hostpool import HostTier, PinnedPool, shared_pool
from tensorql.exec.memplan import Op, Program, plan_program
from tensorql.exec.progress import ProgressCallback
from tensorql.exec.run_state import RunState
from tensorql.exec.run_types import (
    ChunkDestination,
    ChunkSink,
    RunResult,
    RunStats,
    StepStats,
    first_contribution,
    record_task,
)
from tensorql.exec.taskgraph import ChunkRef, TaskGraph
from tensorql.units import format_bytes

log = logging.getLogger(__name__)

COPY_LANES = ("h2d", "d2h", "d2d")


@dataclass
class DeviceStats:
    """Measured figures of one device in one run (times in seconds from the run's start)."""

    name: str
    budget: int | None = None
    busy_s: float = 0.0
    copy_s: float = 0.0
    overlap_s: float = 0.0
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    bytes_d2d: int = 0
    peak_bytes: int = 0
    planned_peak_bytes: int = 0
    evictions: int = 0
    reloads: int = 0
    ops: int = 0
    # source chunks found in the device's memory already (a slice of a device tensor):
    # completed on the coordinator, no copy, no lane, no event
    resident_loads: int = 0
    resident_bytes: int = 0

    def describe(self, cpu_like: bool) -> str:
        into = "host->mem" if cpu_like else "H2D"
        out = "mem->host" if cpu_like else "D2H"
        budget = format_bytes(self.budget) if self.budget is not None else "unlimited"
        text = (f"{self.name}: busy {self.busy_s * 1e3:.1f} ms, copies {self.copy_s * 1e3:.1f} ms"
                f" (overlapped with compute {self.overlap_s * 1e3:.1f} ms), "
                f"{into} {format_bytes(self.bytes_h2d)}, {out} {format_bytes(self.bytes_d2h)}")
        if self.bytes_d2d:
            text += f", peer {format_bytes(self.bytes_d2d)}"
        if self.resident_bytes:
            text += f", found in device memory {format_bytes(self.resident_bytes)}"
        return text + (f", peak {format_bytes(self.peak_bytes)} of {budget} "
                       f"(planned {format_bytes(self.planned_peak_bytes)}), "
                       f"evictions {self.evictions}, reloads {self.reloads}")


@dataclass
class TimelineEvent:
    device: str
    lane: str
    kind: str
    label: str
    start: float
    end: float
    ref: Any = None  # the op's chunk (ChunkRef: its step and key)


@dataclass
class RuntimeStats(RunStats):
    """``RunStats`` plus per-device figures, the memory plan and (optionally) a timeline."""

    devices: list[DeviceStats] = field(default_factory=list)
    device_kinds: list[str] = field(default_factory=list)
    program: Program | None = None
    timeline: list[TimelineEvent] = field(default_factory=list)
    pinned_bytes: int = 0
    spilled_bytes: int = 0  # host copies beyond the pinned pool (host memory or DuckDB)
    host_budget: int | None = None  # plain host memory the host tier may hold
    host_peak_bytes: int = 0
    spill_written_bytes: int = 0  # the DuckDB tier: chunk bytes written, read back
    spill_read_bytes: int = 0
    spill_chunks: int = 0
    spill_reads_ahead: int = 0  # read back by the prefetcher ahead of the load
    spill_reads_on_demand: int = 0
    moved: list[list[int]] = field(default_factory=list)  # bytes copied [src][dst] device
    # bytes device src wrote back to the host that device dst loaded from there [src][dst]:
    # chunks crossing devices through the host under a memory limit (not in ``moved``)
    moved_via_host: list[list[int]] = field(default_factory=list)
    # of ``moved`` and ``moved_via_host``, the bytes the memory limit made cross again: a
    # chunk copied to a device a second time (it dropped it) or back to its own device
    moved_again: int = 0
    # one record per rank of a distributed run (a RankStats each), gathered after it
    ranks: list[Any] = field(default_factory=list)
    # a rank's bytes handed to torch.distributed for the plan's transfers (by call in calls)
    sent_bytes: int = 0
    received_bytes: int = 0
    calls: tuple[Any, ...] = ()

    @property
    def bytes_moved(self) -> int:
        """Bytes the run copied from one device to another directly."""
        return sum(map(sum, self.moved))

    @property
    def bytes_moved_via_host(self) -> int:
        """Bytes that crossed devices through the host (written back by one device, loaded
        by another)."""
        return sum(map(sum, self.moved_via_host))

    @property
    def bytes_moved_as_planned(self) -> int:
        """The partition plan's bytes as the run moved them: directly or through the host,
        less what the memory limit made cross again. Equals ``plan.cost.bytes_moved``.

        >>> s = RuntimeStats(moved=[[0, 8], [0, 0]], moved_via_host=[[0, 0], [4, 0]],
        ...                  moved_again=2)
        >>> s.bytes_moved, s.bytes_moved_via_host, s.bytes_moved_as_planned
        (8, 4, 10)
        """
        return self.bytes_moved + self.bytes_moved_via_host - self.moved_again

    def moved_lines(self) -> list[str]:
        """How the bytes between devices went, for EXPLAIN ANALYZE (none without any)."""
        direct, via_host = self.bytes_moved, self.bytes_moved_via_host
        if not (direct or via_host):
            return []
        text = (f"  between devices: {format_bytes(direct)} sent directly, "
                f"{format_bytes(via_host)} through the host")
        if self.moved_again:
            text += f", {format_bytes(self.moved_again)} of them again after evictions"
        return [text + f"; {format_bytes(self.bytes_moved_as_planned)} as planned"]

    def tier_lines(self) -> list[str]:
        """The host and DuckDB tiers' figures for EXPLAIN ANALYZE (none when unused)."""
        if not (self.pinned_bytes or self.spilled_bytes):
            return []
        budget = (format_bytes(self.host_budget) if self.host_budget is not None
                  else "unlimited")
        lines = [f"  host tier: {format_bytes(self.pinned_bytes)} written to the pinned pool, "
                 f"{format_bytes(self.spilled_bytes)} beyond it; host memory peak "
                 f"{format_bytes(self.host_peak_bytes)} of {budget}"]
        if self.spill_written_bytes or self.spill_read_bytes:
            reads = self.spill_reads_ahead + self.spill_reads_on_demand
            lines.append(f"  DuckDB tier: {format_bytes(self.spill_written_bytes)} spilled "
                         f"({self.spill_chunks} chunk(s)), "
                         f"{format_bytes(self.spill_read_bytes)} reloaded "
                         f"({self.spill_reads_ahead} of {reads} read(s) ahead of use)")
        return lines

    def device_lines(self) -> list[str]:
        """Text lines for EXPLAIN ANALYZE, one per device."""
        lines = []
        for dev, kind in zip(self.devices, self.device_kinds):
            if kind != "remote":  # another rank's device: its figures are in ``ranks``
                lines.append("  " + dev.describe(cpu_like=kind != "cuda"))
        lines.extend(self.moved_lines())
        lines.extend(self.tier_lines())
        if self.ranks:
            lines.append("ranks (bytes handed to torch.distributed):")
            lines += ["  " + rank.describe() for rank in self.ranks]
        return lines


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


class Runtime:
    """Runs task graphs on ``devices`` under a per-device ``memory_limit`` (bytes or None).

    ``devices`` is a ``devices`` option value ("cpu", "cuda", ["cpu:0", "cpu:1"], "null", ...)
    or a list of :class:`~tensorql.exec.devices.Device`. ``reserve_bytes`` of the limit is kept
    back for kernel workspaces and temporaries (default: none on CPU; on a GPU the cuBLAS
    workspace of each compute stream plus 1/16 of the limit, at most 512 MiB).
    ``host_pool_bytes`` is the least size of the process's pinned pool GPUs copy through
    (default :func:`~tensorql.exec.hostpool.default_pool_bytes`); beyond it host copies are
    plain host memory, at most ``host_budget`` bytes of it when ``spill_store`` (a
    :class:`~tensorql.storage.spill.SpillSpace`) takes the rest into DuckDB.
    ``timeline=True`` records every op for :func:`tensorql.exec.timeline.timeline_html`.
    ``results_on_device=True`` (no limit) leaves result chunks in device memory instead of
    copying them to the host. ``direct=True`` lets a run on one CPU with no limit skip the
    memory plan (see :meth:`run`). ``device_cache`` (``Options.device_cache``: "auto", bytes,
    None or 0 for none): what each device with memory of its own keeps of the stored chunks
    runs load, across runs (:mod:`tensorql.exec.device_cache`), within what each run's memory
    plan leaves of ``memory_limit``.
    """

    def __init__(self, devices: Any = "cpu", memory_limit: int | None = None, *,
                 workers: int = 1, intra_op_threads: int = 1, prefetch: int = 2,
                 reserve_bytes: int | None = None, host_pool_bytes: int | None = None,
                 spill_store: Any = None, host_budget: int | None = None,
                 timeline: bool = False,
                 results_on_device: bool = False, direct: bool = False,
                 host_domains: Sequence[int] | None = None,
                 device_cache: Any = None) -> None:
        if isinstance(devices, (list, tuple)) and devices and isinstance(devices[0], Device):
            self.devices: list[Device] = list(devices)
        else:
            self.devices = resolve_devices(devices, workers)
        self.memory_limit = memory_limit
        self.intra_op_threads = max(1, int(intra_op_threads))
        self.prefetch = prefetch
        self.reserve_bytes = reserve_bytes
        self.host_pool_bytes = host_pool_bytes
        self.spill_store = spill_store
        self.host_budget = host_budget
        self.timeline = timeline
        self.results_on_device = results_on_device
        self.device_cache = device_cache
        self._host_domains = tuple(host_domains) if host_domains is not None else None
        self._pool: PinnedPool | None = None
        self.workers = sum(d.lanes.get("compute", 1) for d in self.devices)
        # the fast path: one CPU, nothing to budget, nothing to record per op
        self.direct = direct and (len(self.devices) == 1 and self.devices[0].host_memory
                                  and memory_limit is None and not timeline
                                  and not results_on_device)

    def budgets(self) -> list[int | None]:
        """The chunk budget of each device: memory_limit less the reserve."""
        if self.memory_limit is None:
            return [None] * len(self.devices)
        out = []
        for dev in self.devices:
            reserve = (self.reserve_bytes if self.reserve_bytes is not None
                       else dev.default_reserve(self.memory_limit))
            if reserve and reserve >= self.memory_limit:
                raise PlanError(
                    f"memory_limit {format_bytes(self.memory_limit)} of {dev.name} leaves "
                    f"nothing for chunks: {format_bytes(reserve)} of it is kept for kernel "
                    "workspaces and temporaries (cuBLAS keeps a workspace per compute "
                    f"stream); give a memory_limit above {format_bytes(reserve)}")
            out.append(max(0, self.memory_limit - reserve))
        return out

    def cache_bytes(self, dev: Device, room: int | None = None) -> int:
        """Bytes of ``dev``'s memory kept for device copies of stored chunks across runs
        (0 for a device without memory of its own): "auto" 1/4 of the memory limit, or of
        the device's memory; at most ``room``, what the run's memory plan leaves of the
        device's chunk budget (its budget less its planned peak), so that the copies kept
        and the run's chunks together stay within ``memory_limit``."""
        setting = self.device_cache
        if not setting or getattr(dev, "resident_cache", None) is None:
            return 0
        if setting == "auto":
            total = self.memory_limit if self.memory_limit is not None else dev.capacity()
            wanted = (total or 0) // 4
        else:
            wanted = int(setting)
        return max(0, wanted if room is None else min(wanted, room))

    def plan(self, graph: TaskGraph) -> Program:
        """The op program and memory plan for ``graph`` (PlanError if infeasible), made once
        per graph and device set: a query run again reuses it."""
        budgets = self.budgets()
        domains = self.host_domains()
        concurrency = tuple(d.concurrent_tasks for d in self.devices)
        key = (tuple(d.name for d in self.devices), tuple(budgets), self.prefetch,
               self.results_on_device, domains, self.host_budget, concurrency)
        program = graph.programs.get(key)
        if program is None:
            program = plan_program(graph, len(self.devices), budgets, prefetch=self.prefetch,
                                   results_on_device=self.results_on_device,
                                   host_domains=domains, host_budget=self.host_budget,
                                   concurrency=concurrency)
            graph.programs[key] = program
        return program

    def host_domains(self) -> tuple[int, ...] | None:
        """Each device's host memory, when they are not all this process's (None): a rank's
        devices of a distributed job (a chunk one rank wrote back is sent from there, a
        ``from_host`` send, never loaded by another rank)."""
        return self._host_domains

    def pool(self) -> PinnedPool | None:
        """The pinned host pool when a device copies through it: the process's one pool
        (:func:`~tensorql.exec.hostpool.shared_pool`, allocated at its first use and kept),
        not one per runtime, hence not one per query."""
        if self._pool is None and any(d.uses_pinned_host for d in self.devices):
            self._pool = shared_pool(self.host_pool_bytes)
        return self._pool

    def run(self, graph: TaskGraph, progress: ProgressCallback | None = None,
            sink: ChunkSink | None = None,
            destination: ChunkDestination | None = None,
            keep_outputs: bool = True) -> RunResult:
        """Run ``graph`` through the engine (:func:`tensorql.exec.engine.run`): with
        ``direct`` on one CPU device with no memory limit (and no timeline asked for) the
        engine's policy picks the serial or the lanes strategy; otherwise the streams
        strategy (:meth:`run_streams`) runs the memory plan's ops."""
        from tensorql.exec import engine

        return engine.run(graph, engine.EngineConfig.of_runtime(self),
                          strategy=None if self.direct else "streams", progress=progress,
                          sink=sink, destination=destination, keep_outputs=keep_outputs)

    def run_streams(self, graph: TaskGraph, progress: ProgressCallback | None = None,
                    sink: ChunkSink | None = None,
                    destination: ChunkDestination | None = None,
                    keep_outputs: bool = True, rank: Any = None) -> RunResult:
        """The streams strategy: the memory plan's ops run on the devices' lanes from
        completion events; result chunks reach a dense result via ``sink`` (and, with no
        memory limit, are computed straight into ``destination`` on a CPU device). With
        ``keep_outputs=False`` a result chunk is released once ``sink`` has taken it (a
        streamed run keeps none). ``rank``: a rank's part of a distributed job
        (:mod:`tensorql.exec.distributed`)."""
        program = self.plan(graph)
        previous = torch.get_num_threads()
        torch.set_num_threads(self.intra_op_threads)
        try:
            # a budgeted chunk is never a view of the result
            run = StreamRun(self, graph, program, progress, sink,
                            destination if self.memory_limit is None else None, keep_outputs,
                            rank=rank, result_destination=destination)
            return run.execute()
        finally:
            torch.set_num_threads(previous)


@dataclass(frozen=True)
class OpKind:
    """How the streams strategy runs one kind of memory-plan op: one record per kind in
    :data:`OP_KINDS`, looked up once per op (no ladder of kind tests).

    ``bookkeeping`` runs an op of no lane (alloc, free) the moment it is ready; ``queue``
    takes a ready op of a lane (by default onto its lane's ready heap); ``submit`` hands it
    to its device; ``work`` is what runs on the lane; ``complete`` records a finished op and
    says whether it finished a chunk task of the graph. ``allocates``: its bytes count as
    live when it is submitted; ``exclusive``: two ops writing one chunk never run at once;
    ``by_bytes``: the null device's cost is its bytes (else its FLOPs); ``resident``: the
    op's value when the device holds it already (then it completes on the coordinator: no
    lane, no CUDA events, no thread hand-off), else None."""

    name: str
    work: Callable[[StreamRun, Op, Device], Callable[[], Any]] | None = None
    complete: Callable[[StreamRun, Op, Completion], bool] | None = None
    bookkeeping: Callable[[StreamRun, Op], None] | None = None
    queue: Callable[[StreamRun, Op], None] | None = None
    submit: Callable[[StreamRun, Op], None] | None = None
    allocates: bool = False
    exclusive: bool = False
    by_bytes: bool = True
    resident: Callable[[StreamRun, Op, Device], Any] | None = None


def _noop() -> None:
    return None


# -- alloc, free: bookkeeping, no lane ----------------------------------------------------
def _alloc(run: StreamRun, op: Op) -> None:
    run.allocate(op)


def _free(run: StreamRun, op: Op) -> None:
    run.values[op.device].pop(op.ref, None)
    run.live[op.device] -= op.nbytes
    if op.evict:
        run.stats.devices[op.device].evictions += 1


# -- compute ------------------------------------------------------------------------------
def _compute_work(run: StreamRun, op: Op, dev: Device) -> Callable[[], Any]:
    values = run.values[op.device]
    task = op.task
    dest = run.destination_of(op, dev)

    def compute() -> None:
        inputs = [values[r] for r in task.inputs]
        acc = values.get(op.ref)
        if acc is None and dest is not None:  # straight into the dense result
            values[op.ref] = first_contribution(task.kernel, inputs, dest)
            return
        value = task.kernel.run(inputs, acc)
        if not task.inputs:
            value = dev.to_device(value)
        else:
            dev.check_placement(value, task.kernel)
        values[op.ref] = value
    return compute


def _compute_done(run: StreamRun, op: Op, c: Completion) -> bool:
    start, end = run.timed(op, c)
    record_task(run.stats, op.ref.step, start, end,
                bytes_in=sum(run.graph.chunk_bytes.get(r, 0) for r in op.task.inputs),
                bytes_read=getattr(op.task.kernel, "bytes_read", 0)
                if not op.task.inputs else 0)
    return True


# -- load: from rest (a source task's read) or from the host tier --------------------------
def _load_work(run: StreamRun, op: Op, dev: Device) -> Callable[[], Any]:
    return lambda: run.load(op, dev)


def _load_resident(run: StreamRun, op: Op, dev: Device) -> Any:
    """A source chunk already in the memory of a device with memory of its own, else None:
    a slice of a tensor on that GPU (:class:`~tensorql.physical.kernels.ConstChunk` says
    ``inline``, a view taken at no cost), or a stored chunk the device kept from an earlier
    run (:mod:`tensorql.exec.device_cache`; a miss is kept when its load is done)."""
    holds = getattr(dev, "holds", None)
    if not op.from_rest or dev.host_memory or holds is None:
        return None
    kernel = op.task.kernel
    if getattr(kernel, "inline", False):
        value = kernel.run([], None)
        return value if isinstance(value, torch.Tensor) and holds(value) else None
    cache = run.caches[op.device]
    key_of = getattr(kernel, "cache_key", None)
    key = key_of() if cache is not None and key_of is not None else None
    if key is None:
        return None
    value = cache.get(key)
    if value is None:
        run.cache_misses[op.id] = key
    return value


def _device_cache(rt: Runtime, dev: Device, budget: int | None, peak: int) -> Any:
    """``dev``'s cache of stored chunks, sized for this run (shrunk first to what the run's
    memory plan leaves of the budget: ``budget`` less its planned ``peak``), or None."""
    if rt.device_cache and getattr(dev, "resident_cache", None) is not None:
        cache = dev.resident_cache()  # type: ignore[attr-defined]
        nbytes = rt.cache_bytes(dev, None if budget is None else max(0, budget - peak))
        cache.resize(nbytes)  # the copies beyond it go now, before the run allocates
        return cache if nbytes > 0 else None
    return None


def _load_done(run: StreamRun, op: Op, c: Completion) -> bool:
    start, end = run.timed(op, c)
    stats = run.stats.devices[op.device]
    if not run.devices[op.device].is_null:
        run.values[op.device][op.ref] = c.value
    if op.id in run.resident_ops:
        stats.resident_loads += 1
        stats.resident_bytes += op.nbytes
    else:
        stats.bytes_h2d += op.nbytes
        key = run.cache_misses.pop(op.id, None)
        if key is not None and isinstance(c.value, torch.Tensor):
            run.caches[op.device].put(key, c.value)  # the next run's load finds it
    if not op.from_rest:
        stats.reloads += 1
        if op.src_device is not None and op.src_device != op.device:  # another's write-back
            run.stats.moved_via_host[op.src_device][op.device] += op.nbytes
            run.stats.moved_again += op.nbytes if op.again else 0
        run.host_load_done(op)
        return False
    first = op.ref not in run.loaded_sources
    record_task(run.stats, op.ref.step, start, end,
                bytes_read=getattr(op.task.kernel, "bytes_read", 0), tasks=int(first))
    if not first:
        stats.reloads += 1
        return False
    run.loaded_sources.add(op.ref)
    return True


# -- send: a chunk from another device (or its host copy) ----------------------------------
def _send_work(run: StreamRun, op: Op, dev: Device) -> Callable[[], Any]:
    if op.from_host:  # pragma: no cover - several processes only
        return lambda: dev.to_device(run.host.get(op.ref))
    source = run.values[op.src_device]
    return lambda: dev.from_peer(source[op.ref])


def _send_done(run: StreamRun, op: Op, c: Completion) -> bool:
    run.timed(op, c)
    if not run.devices[op.device].is_null:
        run.values[op.device][op.ref] = c.value
    sent = c.value.nbytes if c.value is not None else op.nbytes
    run.stats.devices[op.device].bytes_d2d += sent
    run.stats.moved[op.src_device][op.device] += sent
    run.stats.moved_again += sent if op.again else 0
    if op.from_host:  # pragma: no cover - several processes only
        run.host_load_done(op)
    return False


# -- fetch: a source read straight into the host tier --------------------------------------
def _fetch_work(run: StreamRun, op: Op, dev: Device) -> Callable[[], Any]:
    return lambda: run.host.put(op.ref, op.task.kernel.run([], None),
                                fresh=run.sink is not None)


def _fetch_done(run: StreamRun, op: Op, c: Completion) -> bool:
    run.timed(op, c)
    step = run.stats.steps.setdefault(op.ref.step, StepStats())
    step.tasks += 1
    step.bytes_read += getattr(op.task.kernel, "bytes_read", 0)
    if run.sink is not None and run.host.has(op.ref):
        run.sink(op.ref, run.sunk(op.ref))
    return True


# -- d2h: a chunk written back to the host tier (a result, or an eviction) -----------------
def _d2h_work(run: StreamRun, op: Op, dev: Device) -> Callable[[], Any]:
    values = run.values[op.device]
    # a result its sink takes at once is not spilled before that
    fresh = (run.sink is not None and not op.evict and op.ref.step in run.graph.retain)

    tile = run.result_tile(op, dev)

    def d2h() -> torch.Tensor | None:
        value = values[op.ref]
        if tile is not None:  # straight into the dense result: no pinned slot, no clone
            return dev.to_host(value, tile)
        buf = run.host.buffer_for(op.ref, value) if dev.uses_pinned_host else None
        run.host.put(op.ref, dev.to_host(value, buf), fresh=fresh)
        return None
    return d2h


def _d2h_done(run: StreamRun, op: Op, c: Completion) -> bool:
    run.timed(op, c)
    run.stats.devices[op.device].bytes_d2h += op.nbytes
    if op.ref.step in run.graph.retain and not op.evict:
        if run.sink is not None and not run.devices[op.device].is_null:
            # a chunk the lane wrote into its tile of the result is there already
            run.sink(op.ref, c.value if c.value is not None else run.sunk(op.ref))
    return False


#: the kinds of op a memory plan holds (:mod:`tensorql.exec.memplan`), by name
OP_KINDS: dict[str, OpKind] = {
    "alloc": OpKind("alloc", bookkeeping=_alloc),
    "free": OpKind("free", bookkeeping=_free),
    "compute": OpKind("compute", _compute_work, _compute_done, exclusive=True, by_bytes=False),
    "load": OpKind("load", _load_work, _load_done, allocates=True, resident=_load_resident),
    "send": OpKind("send", _send_work, _send_done, allocates=True),
    "fetch": OpKind("fetch", _fetch_work, _fetch_done),
    "d2h": OpKind("d2h", _d2h_work, _d2h_done),
}


def op_kinds(graph: TaskGraph, program: Program) -> tuple[OpKind, ...]:
    """The kind record of each op of ``program`` (by op id), found once per plan."""
    key = ("op kinds", id(program))
    kinds = graph.programs.get(key)
    if kinds is None:
        try:
            kinds = tuple(OP_KINDS[op.kind] for op in program.ops)
        except KeyError as err:
            raise ExecutionError(f"unknown op kind {err.args[0]!r}; the memory plan's kinds "
                                 f"are {', '.join(OP_KINDS)}") from None
        graph.programs[key] = kinds
    return kinds


class StreamRun(RunState):
    """The streams strategy's state of one run: the engine's run state plus the memory plan's
    readiness counts, each device's chunk values and live bytes, the lanes' ready heaps and
    what is in flight. The coordinator loop runs on the caller's thread; a rank of a
    distributed job adds its part (``rank``: its view of the plan, its transfers between
    ranks) as a component, and its transfers are kinds of op of their own."""

    def __init__(self, rt: Runtime, graph: TaskGraph, program: Program,
                 progress: ProgressCallback | None, sink: ChunkSink | None,
                 destination: ChunkDestination | None = None, keep_outputs: bool = True,
                 rank: Any = None,
                 result_destination: ChunkDestination | None = None) -> None:
        self.devices = rt.devices
        # where the D2H lane writes a result chunk of a device with memory of its own
        self.result_destination = result_destination
        kinds = [d.kind for d in self.devices]
        super().__init__(graph, progress, sink, destination, keep_outputs,
                         RuntimeStats(tasks=len(graph.tasks), workers=rt.workers,
                                      program=program, device_kinds=kinds))
        self.rt, self.program = rt, program
        self.ops = program.ops
        self.events: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        null = [d for d in self.devices if d.is_null]
        self.clock = null[0].clock if null else None  # type: ignore[attr-defined]
        self.succ: Sequence[Sequence[int]] = program.successors
        self.ndeps = list(program.dep_counts)
        self.kinds: Sequence[OpKind] = op_kinds(graph, program)
        self.ready: dict[tuple[int, str], list[tuple[float, int]]] = {}
        self.inflight: dict[tuple[int, str], int] = {}
        self.busy_out: set[tuple[int, ChunkRef]] = set()
        self.values: list[dict[ChunkRef, Any]] = [{} for _ in self.devices]
        self.live = [0] * len(self.devices)
        self.budgets = [d.budget for d in program.devices]
        self.host = HostTier(rt.pool(), rt.spill_store, run_tag=f"{id(self):x}",
                             budget=rt.host_budget if rt.spill_store is not None else None,
                             loads=program.host_reads,
                             expect_spill=program.host is not None and program.host.spill_bytes > 0)
        self.host_loads = dict(program.host_loads)
        self.cleanup: dict[int, Callable[[], None]] = {}
        self.done_ops = 0
        self.loaded_sources: set[ChunkRef] = set()
        self.resident_ops: set[int] = set()  # loads found in the device's memory already
        # each device's copies of stored chunks kept across runs (None: it keeps none)
        self.caches = [_device_cache(rt, d, b.budget, b.peak_bytes)
                       for d, b in zip(self.devices, program.devices)]
        self.cache_misses: dict[int, Any] = {}  # load op -> the key its copy is kept under
        self.lane_times: dict[tuple[int, str], list[tuple[float, float]]] = {}
        self.stats.moved = [[0] * len(self.devices) for _ in self.devices]
        self.stats.moved_via_host = [[0] * len(self.devices) for _ in self.devices]
        self.stats.devices = [DeviceStats(d.name, budget=b.budget,
                                          planned_peak_bytes=b.peak_bytes)
                              for d, b in zip(self.devices, program.devices)]
        self.start = 0.0
        self.lock = threading.Lock()
        self.rank = rank
        if rank is not None:
            rank.attach(self)

    # -- the coordinator ------------------------------------------------------------------
    def execute(self) -> RunResult:
        for dev in self.devices:
            dev.open(self.events.put)
        self.start = time.perf_counter()
        try:
            self._count_unused_sources()
            # collected first: making one op ready may release others (zero-cost ops run at
            # once), which must not be made ready a second time
            for op in [op for op in self.ops if self.ndeps[op.id] == 0]:
                self.make_ready(op)
            while self.done_ops < len(self.ops) and self.error is None:
                self._dispatch()
                if self.done_ops >= len(self.ops):
                    break
                if not any(self.inflight.values()):
                    raise ExecutionError(f"deadlock: {len(self.ops) - self.done_ops} op(s) of "
                                         "the memory plan never became ready")
                self._handle(self._next_event())
            while self.error is not None and any(self.inflight.values()):
                self._handle(self._next_event())  # let in-flight work drain before raising
        finally:
            for dev in self.devices:
                dev.close()
        wall = (self.clock.now if self.clock is not None
                else time.perf_counter() - self.start)
        self.stats.wall_s = wall
        if self.error is not None:
            self.host.close()
            self._raise()
        self._finish_stats()
        outputs = {}
        for op in self.program.result_copies:
            if op.ref.step in self.graph.retain and op.ref not in outputs:
                outputs[op.ref] = (self.host.take_result(op.ref) if self.host.has(op.ref)
                                   else None)
        if self.rt.results_on_device:
            for values in self.values:
                outputs.update({r: v for r, v in values.items()
                                if r.step in self.graph.retain})
        self.host.close()
        if self.progress is not None and self.done_tasks < len(self.graph.tasks):
            self.progress(len(self.graph.tasks), len(self.graph.tasks))
        return RunResult(outputs=outputs, stats=self.stats)

    def _count_unused_sources(self) -> None:
        """Sources no op loads (each device reads its own regions) count as done tasks."""
        key = ("unused sources", id(self.program))
        unused = self.graph.programs.get(key)
        if unused is None:
            used = {op.ref for op in self.ops if op.from_rest}
            contributions = self.graph.contributions()
            unused = sum(1 for t in self.graph.tasks
                         if t.is_source and t.device is None and t.output not in used
                         and contributions[t.output] == 1)
            self.graph.programs[key] = unused
        self.done_tasks += unused

    def _next_event(self) -> Completion:
        if self.clock is not None and self.clock.pending():
            return self.clock.pop()
        return self.events.get()

    def _raise(self) -> None:
        op, err = self.failed, self.error
        if isinstance(err, TensorQLError) or not isinstance(err, Exception):
            raise err  # ours, or an interrupt (KeyboardInterrupt, SystemExit) as it came
        where = ""
        if op is not None:
            where = (f"{self.graph.step_name(op.ref.step)} failed on chunk {op.ref.key} "
                     f"({op.kind} on {self.devices[op.device].name})")
        raise ExecutionError(f"{where}: {type(err).__name__}: {err}") from err

    def make_ready(self, op: Op) -> None:
        """``op``'s inputs are ready: an op of a lane is queued (by its kind), an op of no
        lane (alloc, free) runs here and releases its successors in turn."""
        work = [op]
        while work:
            op = work.pop()
            kind = self.kinds[op.id]
            if op.lane != "none":
                (kind.queue or _queue_on_lane)(self, op)
                continue
            if kind.bookkeeping is not None:  # zero-cost bookkeeping ops run right here
                kind.bookkeeping(self, op)
            self.done_ops += 1
            work.extend(self.release(op))

    def release(self, op: Op) -> list[Op]:
        """The ops ``op`` was the last dependency of."""
        out = []
        for s in self.succ[op.id]:
            self.ndeps[s] -= 1
            if self.ndeps[s] == 0:
                out.append(self.ops[s])
        return out

    def allocate(self, op: Op) -> None:
        d = op.device
        self.live[d] += op.nbytes
        stats = self.stats.devices[d]
        stats.peak_bytes = max(stats.peak_bytes, self.live[d])
        budget = self.budgets[d]
        if budget is not None and self.live[d] > budget:
            raise ExecutionError(
                f"{self.devices[d].name}: {self.live[d]} live bytes exceed the budget of "
                f"{budget} ({op.describe()}); the memory plan was not followed")

    def _dispatch(self) -> None:
        if self.rank is not None:  # a rank's transfers start before the lanes' ops
            self.rank.dispatch(self)
        for key, heap in self.ready.items():
            dev_index, lane = key
            dev = self.devices[dev_index]
            slots = dev.lanes.get(lane, 1)
            # a lane may hold ``lookahead`` ready ops beyond what it runs at once, so its
            # threads go straight on to the next op instead of waiting for this loop
            depth = slots + dev.lookahead
            serial = slots == 1  # one thread runs the lane's ops in the order submitted
            aside = []
            while heap and self.inflight.get(key, 0) < depth:
                entry = heapq.heappop(heap)
                op = self.ops[entry[1]]
                if not serial and self.kinds[op.id].exclusive and \
                        (dev_index, op.ref) in self.busy_out:
                    aside.append(entry)  # another contribution to this chunk is running
                    continue
                self.submit(op)
            for entry in aside:
                heapq.heappush(heap, entry)

    def submit(self, op: Op) -> None:
        kind = self.kinds[op.id]
        if kind.submit is not None:
            kind.submit(self, op)
            return
        key = (op.device, op.lane)
        self.inflight[key] = self.inflight.get(key, 0) + 1
        if kind.allocates:
            self.allocate(op)
        if kind.exclusive:
            self.busy_out.add((op.device, op.ref))
        dev = self.devices[op.device]
        if kind.resident is not None and not dev.is_null:
            value = kind.resident(self, op, dev)
            if value is not None:  # in the device's memory already: done, on this thread
                self.resident_ops.add(op.id)
                now = time.perf_counter()
                self.events.put(Completion(op.id, now, now, value))
                return
        work = _noop if dev.is_null else kind.work(self, op, dev)  # type: ignore[misc]
        dev.submit(op.lane, op.id, work, float(op.nbytes) if kind.by_bytes else op.cost)

    def destination_of(self, op: Op, dev: Device) -> torch.Tensor | None:
        """The tile of the dense result a CPU device computes a result chunk into, if any."""
        if self.destination is None or not dev.host_memory or op.task.inputs == ():
            return None
        return self.destination_for(op.ref)

    def load(self, op: Op, dev: Device) -> torch.Tensor:
        if op.from_rest:
            host = op.task.kernel.run([], None)
            if host.device.type != "cpu":  # resident on a device already: no staging
                return dev.to_device(host)
            pool = self.host.pool if dev.uses_pinned_host else None
            if pool is not None and not dev.is_pinned(host):
                offset = pool.alloc(host.nbytes)
                if offset is not None:  # stage through the pinned pool: an async copy
                    staged = pool.view(offset, tuple(host.shape), host.dtype)
                    staged.copy_(host)
                    with self.lock:
                        self.cleanup[op.id] = lambda: pool.free(offset)
                    return dev.to_device(staged)
            return dev.to_device(host)
        return dev.to_device(self.host.get(op.ref))

    def _handle(self, c: Completion) -> None:
        if c.op_id < 0:  # a collective of a rank (ids below zero are the rank's own)
            self.rank.collective_done(self, c)
            return
        op = self.ops[c.op_id]
        kind = self.kinds[op.id]
        key = (op.device, op.lane)
        self.inflight[key] -= 1
        with self.lock:
            cleanup = self.cleanup.pop(op.id, None)
        if cleanup is not None:
            cleanup()
        if kind.exclusive:
            self.busy_out.discard((op.device, op.ref))
        if c.error is not None:
            self.fail(c.error, op)
            return
        if self.error is not None:
            return
        try:
            if kind.complete(self, op, c):  # type: ignore[misc]
                self.task_done()
        except BaseException as err:  # noqa: BLE001 - reported to the caller
            self.fail(err, op)
            return
        self.done_ops += 1
        for nxt in self.release(op):
            self.make_ready(nxt)

    def timed(self, op: Op, c: Completion) -> tuple[float, float]:
        """When a finished op ran (seconds from the run's start; the device's own measure
        where it has one), recorded for the lane's busy time and the timeline."""
        start = c.started - (0.0 if self.clock is not None else self.start)
        end = c.ended - (0.0 if self.clock is not None else self.start)
        if c.device_s is not None:  # the device's own measure of the work
            start = max(start, end - c.device_s)
        self.stats.devices[op.device].ops += 1
        self.lane_times.setdefault((op.device, op.lane), []).append((start, end))
        if self.rt.timeline:
            self.stats.timeline.append(TimelineEvent(
                self.devices[op.device].name, op.lane, op.kind, op.describe(), start, end,
                op.ref))
        return start, end

    def result_tile(self, op: Op, dev: Device) -> torch.Tensor | None:
        """The tile of the dense result a device with memory of its own writes a result
        chunk into on its D2H lane (one copy, off the coordinator's thread), instead of a
        pinned slot that the coordinator would clone and then copy into the tile: only for
        a run that keeps no outputs (a dense result) and a chunk no later op reloads."""
        if (self.result_destination is None or dev.host_memory or dev.is_null or op.evict
                or self.keep_outputs or op.ref.step not in self.graph.retain
                or self.host_loads.get(op.ref, 0) > 0):
            return None
        return self.result_destination(op.ref)

    def sunk(self, ref: ChunkRef) -> torch.Tensor:
        """The host copy of a result chunk for the sink; a streamed run (``keep_outputs``
        False) hands it over and keeps none, unless a later op loads it again."""
        if not self.keep_outputs and self.host_loads.get(ref, 0) <= 0:
            return self.host.take_result(ref)
        return self.host.get(ref)

    def host_load_done(self, op: Op) -> None:
        self.host.load_done(op.id)
        left = self.host_loads.get(op.ref, 0) - 1
        self.host_loads[op.ref] = left
        if not op.keep_host or (left <= 0 and op.ref.step not in self.graph.retain):
            self.host.drop(op.ref)

    def _finish_stats(self) -> None:
        for index, dev_stats in enumerate(self.stats.devices):
            compute = _union(self.lane_times.get((index, "compute"), []))
            copies = _union([iv for lane in COPY_LANES
                             for iv in self.lane_times.get((index, lane), [])])
            dev_stats.busy_s = _length(compute)
            dev_stats.copy_s = _length(copies)
            dev_stats.overlap_s = _intersection(compute, copies)
        self.stats.peak_live_bytes = max((d.peak_bytes for d in self.stats.devices), default=0)
        host = self.host
        self.stats.pinned_bytes = host.pinned_bytes
        self.stats.spilled_bytes = host.spilled_bytes
        self.stats.host_budget = host.budget
        self.stats.host_peak_bytes = host.peak_plain_bytes
        self.stats.spill_written_bytes = host.spill_written
        self.stats.spill_read_bytes = host.spill_read
        self.stats.spill_chunks = host.spill_chunks
        self.stats.spill_reads_ahead = host.ahead_used
        self.stats.spill_reads_on_demand = host.reads_on_demand
        if host.spill_written:
            log.info("DuckDB spill tier: %s spilled in %d chunk(s), %s reloaded (%d read(s) "
                     "ahead of use, %d on demand); host memory peak %s of %s",
                     format_bytes(host.spill_written), host.spill_chunks,
                     format_bytes(host.spill_read), host.ahead_used, host.reads_on_demand,
                     format_bytes(host.peak_plain_bytes), format_bytes(host.budget))
        evictions = sum(d.evictions for d in self.stats.devices)
        reloads = sum(d.reloads for d in self.stats.devices)
        spilled = format_bytes(self.stats.spilled_bytes)
        if evictions or reloads:
            log.info("memory limit: %d chunk(s) evicted from device memory, %d reloaded; %s of "
                     "host copies beyond the pinned pool", evictions, reloads, spilled)
        elif self.stats.spilled_bytes:
            log.debug("%s of host copies beyond the pinned pool", spilled)


def _queue_on_lane(run: StreamRun, op: Op) -> None:
    """Queue a ready op for its lane; the longest chain of work after it goes first."""
    heapq.heappush(run.ready.setdefault((op.device, op.lane), []),
                   (-run.program.rank[op.id], op.id))
