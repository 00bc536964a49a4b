"""The physical plan of a query: the optimizer's partitioning on several devices, one
device's plan otherwise, within the session's memory limit."""

from __future__ import annotations

import logging
import math
from typing import Any, Protocol

from tensorql.errors import PlanError
from tensorql.logical.plan import LogicalNode, walk
from tensorql.logical.rules import Rewritten, rewrite
from tensorql.optimizer.plan import PartitionPlan, optimize
from tensorql.options import Options
from tensorql.physical.builder import build
from tensorql.physical.planner import PhysicalPlan
from tensorql.pipeline.distributed import job_devices, planning_topology
from tensorql.storage.chunk_store import ChunkStore


class Session(Protocol):
    """What the pipeline needs of a session (``tensorql.Database`` is one)."""

    @property
    def chunk_store(self) -> ChunkStore: ...

    @property
    def options(self) -> Options: ...

    @property
    def connection(self) -> Any: ...


log = logging.getLogger(__name__)


def physical_plan(roots: list[LogicalNode], db: Session, partitioned: bool = True
                   ) -> tuple[PartitionPlan | None, PhysicalPlan]:
    """The physical plan of ``roots`` (one result, or several sharing their common steps):
    the optimizer's partitioning when the session has several devices, else one device's.
    The logical rewrite rules (:mod:`tensorql.logical.rules`) are applied here, once."""
    done, partitionable = checked_rewrite(roots)
    return plan_rewritten(done, db, partitioned=partitioned and partitionable)


def checked_rewrite(roots: list[LogicalNode]) -> tuple[Rewritten, bool]:
    """``roots`` after the logical rewrite rules, once the task count is checked
    (:func:`check_task_count`), and whether the plan may be partitioned (an empty tensor
    anywhere: nothing to partition, and no piece to place)."""
    for root in roots:
        check_task_count(root)
    empty = any(0 in n.relation.shape for n in walk(*roots))
    done = rewrite(roots)
    if done.fired:
        log.debug("rewrite rules fired: %s", ", ".join(done.fired))
    return done, not empty


def plan_rewritten(done: Rewritten, db: Session, partitioned: bool = True
                   ) -> tuple[PartitionPlan | None, PhysicalPlan]:
    """:func:`physical_plan` of roots the rewrite rules have already made (``done``): the
    partitioning and the physical plan, with no lowering or rewriting (a plan re-bound to a
    new extent: :func:`tensorql.logical.rebind.rebind_extent`)."""
    options = db.options
    max_temp = max(1, options.kernel_temp_bytes // 4)
    # a local session plans for its own devices; a rank of a job for the job's
    count = job_devices(options) if options.distributed else options.device_set.count
    if count > 1 and partitioned:
        partition, physical = _partition(done.roots[0], db, count, max_temp,
                                         also=done.roots[1:], fired=done.fired)
        if log.isEnabledFor(logging.INFO):
            from tensorql.units import format_bytes as size  # only when it is logged
            from tensorql.units import format_flops

            cost = partition.cost
            log.info("partitioned for %d devices (strategy %s): %s moved between devices, "
                     "busiest device %s, peak %s per device%s", count, partition.strategy,
                     size(cost.bytes_moved), format_flops(cost.flops), size(cost.peak_bytes),
                     "" if options.memory_limit is None else
                     f" (memory_limit {size(options.memory_limit)})")
        return partition, physical
    return None, build(done.roots[0], None, db.chunk_store, max_temp_elems=max_temp,
                       **_series(options, options.memory_limit, 1), also=done.roots[1:],
                       fired=done.fired, whole_k=whole_k_bytes(options))


def _partition(logical: LogicalNode, db: Session, devices: int, max_temp: int,
               also: tuple[LogicalNode, ...] = (), fired: tuple[str, ...] = ()
               ) -> tuple[PartitionPlan, PhysicalPlan]:
    """The optimizer's partitioning and its physical plan. Under a ``memory_limit`` the
    optimizer chooses pieces whose every task (inputs and output, assembling a region from
    its pieces included) fits the limit, so the physical plan is built once;
    InfeasiblePlanError names the smallest limit that plans."""
    options = db.options
    limit = options.memory_limit
    # the ranks of a torch.distributed job each hold the inputs
    plan = optimize(logical, devices=devices, strategy=options.strategy, memory_limit=limit,
                    also=also, sources_everywhere=options.distributed,
                    topology=planning_topology(options))
    physical = build(logical, plan, db.chunk_store, max_temp_elems=max_temp,
                     sub_tiles=_sub_tiles(options, limit),
                     **_series(options, limit, devices), fired=fired)
    return plan, physical


def _series(options: Options, limit: int | None, devices: int) -> dict[str, Any]:
    """How contributions to one output chunk are grouped into tasks: by default in series
    of at most ``memory_limit // 4`` bytes of inputs and at least two tasks per lane of a
    device (a CPU's workers, a GPU's compute streams: :attr:`Options.task_lanes`); with
    ``Options.deterministic`` one task per output chunk (one accumulation order, so a run
    gives the same bits every time)."""
    if options.deterministic:
        return {"fuse_bytes": None, "min_tasks": 1}
    return {"fuse_bytes": _fuse_bytes(limit),
            "min_tasks": 2 * max(1, options.task_lanes // devices)}


def whole_k_bytes(options: Options) -> float | None:
    """The rule for products on one device: the input bytes up to which an output chunk's
    contributions run as ONE product over the whole contracted label (the tiles of each
    operand put together on the device: a view when they are slices of one tensor, else a
    ``torch.cat``), instead of a series of per-tile products folded into an accumulator
    (:class:`~tensorql.physical.builder.WholeK`); None: never.

    Only where the device's kind says one product beats a series (``DeviceKind.whole_k``:
    CUDA -- one cuBLAS call accumulates in float32 inside and runs at full occupancy; an H100
    reached 0.91 of ``torch.matmul`` that way against 0.81 summing 8192-tiles of K). The
    copies are a temporary of the kernel, so under a ``memory_limit`` they must fit the share
    the device keeps for kernel temporaries (1/16 of it, at most 512 MiB); beyond it, the
    series as before. With no limit, no bound.

    >>> from tensorql.options import Options
    >>> whole_k_bytes(Options(devices="cpu")) is None
    True
    """
    specs = options.device_set.specs
    if not specs or not all(spec.info.whole_k for spec in specs):
        return None
    limit = options.memory_limit
    if limit is None:
        return math.inf
    from tensorql.exec.devices.cuda import kernel_temp_bytes

    return float(kernel_temp_bytes(limit))


def _sub_tiles(options: Options, limit: int | None) -> bool:
    """Whether a device's piece of an operation is cut into the logical plan's tiles (tasks
    that start as their chunks arrive, within a memory limit, spread over a device's lanes)
    or left whole. On CPU devices of one lane each and no memory limit a piece is one task:
    one large product runs at the library's best speed, where a series of 512-tile products
    ran ~10-15% slower (a 2048x1024x4096 MLP on 2 CPU devices: 1.21x torch cut, 1.03x whole).
    """
    local = options.device_set  # this process's devices (a rank's, in a job)
    cpu = local.all_cpu
    return limit is not None or not cpu or options.workers // max(1, len(local)) > 1


def _fuse_bytes(memory_limit: int | None) -> int | None:
    """The input bytes one task may fold in series: a quarter of the memory limit."""
    return None if memory_limit is None else max(1, memory_limit // 4)


MANY_TASKS = 100_000  # beyond this many chunk tasks, per-task overhead (~100 µs) is seconds
TINY_TASK_ELEMS = 1 << 16  # ... and is what the run spends when tasks are this small


def check_task_count(logical: LogicalNode) -> None:
    """PlanError when tiles are so small that per-task overhead swamps the work: more than
    ``MANY_TASKS`` chunk tasks doing fewer than ``TINY_TASK_ELEMS`` element operations each
    (a 300x300 matmul with 1x1 tiles is 27 million tasks, minutes for 54 MFLOP).

    >>> import numpy as np, tensorql as tq
    >>> from tensorql.logical.lower import lower
    >>> db = tq.connect()
    >>> a = db.from_numpy("a", np.ones((300, 300), np.float32), tile=(1, 1))
    >>> check_task_count(lower((a @ a).node))
    Traceback (most recent call last):
    ...
    tensorql.errors.PlanError: this plan has 27,180,000 chunk tasks of ~1 element operations ...
    """
    from tensorql.logical.plan import walk

    tasks = work = 0
    smallest: tuple[int, ...] = ()
    for node in walk(logical):
        grid = node.relation.grid
        tasks += grid.num_chunks
        work += math.prod(grid.shape)
        if not smallest or math.prod(grid.tile) < math.prod(smallest):
            smallest = grid.tile
    if tasks > MANY_TASKS and work < tasks * TINY_TASK_ELEMS:
        raise PlanError(
            f"this plan has {tasks:,} chunk tasks of ~{work // tasks:,} element operations "
            f"each (tiles as small as {smallest}); at ~100 µs of overhead per task it would "
            f"spend ~{tasks * 1e-4:,.0f} s on overhead alone. Store the operands with larger "
            "tiles (tile=None picks them automatically) or rechunk them with db.store")
