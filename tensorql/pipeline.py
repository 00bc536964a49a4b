"""The query pipeline below both faces: compile an einsum graph, run it, explain it.

Python (``tensorql.api``) and SQL (``tensorql.sql``) both hand a graph node to
:meth:`CompiledQuery.compile` and call ``run`` / ``explain`` on the result; neither knows how
the stages are chained. Execution backends sit in a registry (:data:`BACKENDS`): ``native``
(the event-driven runtime on the session's devices) and ``duckdb`` (the plan as one SQL query
inside DuckDB).

>>> import torch, tensorql as tq
>>> db = tq.connect()
>>> a = db.from_torch("a", torch.ones(3, 4), tile=(2, 2))
>>> q = CompiledQuery.compile(tq.einsum("ij->i", a).node, db)
>>> q.run().dense().tolist()
[4.0, 4.0, 4.0]
>>> sorted(BACKENDS)
['duckdb', 'native']
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tensorql.dtypes import itemsize, torch_dtype
from tensorql.einsum.graph import Node, explain_graph
from tensorql.errors import ExecutionError, MemoryLimitError, OptionError, PlanError, ShapeError
from tensorql.exec.distributed import (
    DistributedRuntime,
    check_same_plan,
    exchange_group,
    gather_rank_stats,
    join_process_group,
    share_results,
)
from tensorql.exec.host_malloc import empty_result, heap_only
from tensorql.exec.memplan import largest_task_bytes
from tensorql.exec.progress import progress_bar
from tensorql.exec.run_types import ProgressCallback, RunStats
from tensorql.exec.runtime import Runtime, executor_for
from tensorql.grid import Key
from tensorql.logical.lower import contraction_paths, lower, lower_many
from tensorql.logical.plan import LogicalNode, explain_logical, walk
from tensorql.optimizer.plan import PartitionPlan, optimize
from tensorql.optimizer.search import InfeasiblePlanError
from tensorql.options import Options, available_memory_bytes, device_names
from tensorql.physical.explain import render_plan
from tensorql.physical.partitioned import build_partitioned
from tensorql.physical.planner import PhysicalPlan
from tensorql.physical.result import QueryResult
from tensorql.storage.chunk_store import ChunkStore
from tensorql.units import format_bytes


class Session(Protocol):
    """What the pipeline needs of a session (``tensorql.Database`` is one)."""

    @property
    def chunk_store(self) -> ChunkStore: ...

    @property
    def options(self) -> Options: ...

    @property
    def connection(self) -> Any: ...


class UnknownBackendError(OptionError):
    """A backend name that is not in the registry."""


class ExecutionBackend(Protocol):
    """Runs and explains a compiled query."""

    def run(self, query: CompiledQuery, progress: ProgressCallback | None,
            dense: bool) -> QueryResult: ...

    def explain(self, query: CompiledQuery, analyze: bool) -> tuple[str, QueryResult | None]:
        """The plan text; with ``analyze`` the query runs and its result comes back too."""
        ...


@dataclass(frozen=True)
class CompiledQuery:
    """A planned expression, ready to run or explain on its ``backend``."""

    node: Node
    logical: LogicalNode
    physical: PhysicalPlan
    db: Session
    backend: str = "native"
    partition: PartitionPlan | None = None

    @classmethod
    def compile(cls, node: Node, db: Session, backend: str | None = None) -> CompiledQuery:
        """Lower ``node`` once, partition it when the session has several devices (that
        partitioning is what runs), and build the physical plan."""
        options = db.options
        name = backend or options.backend
        get_backend(name)
        logical = lower(node)
        check_task_count(logical)
        partition, physical = _physical_plan([logical], db, partitioned=name == "native")
        return cls(node=node, logical=logical, physical=physical, db=db, backend=name,
                   partition=partition)

    @property
    def title(self) -> str:
        shape = "x".join(map(str, self.node.shape)) or "scalar"
        return f"{self.node.describe()} -> {shape} {self.node.dtype}"

    def run(self, progress: ProgressCallback | None = None, dense: bool = False) -> QueryResult:
        """Execute the plan; with ``dense=True`` result chunks are written into one dense
        tensor as they complete. With no ``progress`` callback and ``Options.progress`` set
        (``tensorql sql --progress``), a progress bar is drawn on stderr. A dense result
        that cannot fit in the process's memory raises MemoryLimitError before anything runs."""
        if dense:
            check_dense_fits(self.physical.result_step.relation, self.db.options)
        with heap_only():
            return get_backend(self.backend).run(self, progress, dense)

    def stream(self, sink: Callable[[Key, torch.Tensor], None],
               progress: ProgressCallback | None = None) -> None:
        """Run the plan handing each result chunk to ``sink(key, chunk)`` as it completes;
        the run keeps no result chunk once the sink has it (``db.store`` writes them through).
        Backends other than ``native`` compute the whole result, then hand it over."""
        with heap_only():
            self._stream(sink, progress)

    def _stream(self, sink: Callable[[Key, torch.Tensor], None],
                progress: ProgressCallback | None) -> None:
        if self.backend != "native":
            for key, chunk in self.run(progress=progress).iter_chunks():
                sink(key, chunk)
            return
        options = self.db.options
        if progress is None and options.progress:
            with progress_bar(self.node.describe()) as bar:
                return self._stream(sink, bar)
        if any(d.startswith("null") for d in device_names(options.devices)):
            raise ExecutionError(f"devices={options.devices!r}: null devices compute no values, "
                                 "so there is no result to stream")
        if options.distributed:  # every rank takes part; each gets the whole result
            for key, chunk in _run_distributed(self, progress).iter_chunks():
                sink(key, chunk)
            return None
        sid = self.physical.result_step.id
        sent: set[Key] = set()

        def result_sink(ref, chunk):
            if ref.step == sid and ref.key not in sent:
                sent.add(ref.key)
                sink(ref.key, chunk)

        result = executor_for(options).run(self.physical.task_graph(), progress=progress,
                                           sink=result_sink, keep_outputs=False)
        for ref, chunk in result.outputs.items():  # chunks no task completed (none normally)
            if ref.step == sid and chunk is not None and ref.key not in sent:
                sink(ref.key, chunk)
        return None

    def explain(self, analyze: bool = False, stage: str | None = None) -> str:
        """The plan as text. ``stage`` picks one stage of the chain (see :data:`STAGES`):
        ``einsum`` (the graph as written), ``logical`` (the relational rewrite), ``partition``
        (pieces and placement per operation), ``physical`` (steps and tasks), ``memory`` (the
        runtime's memory plan); by default the physical plan and, on several devices, the
        partitioning -- with ``analyze`` the query runs and measured figures are added."""
        if stage is None:
            return self.explain_and_result(analyze)[0]
        if stage not in STAGES:
            raise UnknownStageError(f"unknown EXPLAIN stage {stage!r}; choose one of "
                                    f"{', '.join(STAGES)}")
        if analyze:
            raise OptionError("EXPLAIN ANALYZE shows the whole plan; leave stage unset")
        return STAGES[stage](self)

    def explain_and_result(self, analyze: bool = False) -> tuple[str, QueryResult | None]:
        """The EXPLAIN text and, with ``analyze``, the result of the run it measured."""
        return get_backend(self.backend).explain(self, analyze)


@dataclass(frozen=True)
class CompiledGroup:
    """Several expressions planned and run as one query: a subgraph they share is computed
    once (a training step's forward pass feeds the loss and every gradient and update).

    The outputs are the results of one physical plan; on several devices the optimizer
    partitions every operation of the whole group in one search. (The ``duckdb`` backend and
    torch.distributed sessions run each output as its own query.)

    >>> import torch, tensorql as tq
    >>> db = tq.connect()
    >>> a = db.from_torch("a", torch.ones(3, 4), tile=(2, 2))
    >>> group = CompiledGroup.compile([tq.einsum("ij->i", a).node, (a * 2).node], db)
    >>> [t.tolist() for t in group.run()][0], len(group.physical.steps)
    ([4.0, 4.0, 4.0], 3)
    """

    nodes: tuple[Node, ...]
    db: Session
    physical: PhysicalPlan | None = None       # the one plan of every output (one device)
    queries: tuple[CompiledQuery, ...] = ()    # else a query per output
    last_stats: list[RunStats] = field(default_factory=list, compare=False, repr=False)

    @classmethod
    def compile(cls, nodes: list[Node], db: Session) -> CompiledGroup:
        options = db.options
        if not nodes:
            raise PlanError("a group of queries needs at least one expression")
        if options.backend != "native" or options.distributed:
            return cls(nodes=tuple(nodes), db=db,
                       queries=tuple(CompiledQuery.compile(n, db) for n in nodes))
        roots = lower_many(nodes)
        for root in roots:
            check_task_count(root)
        _, physical = _physical_plan(roots, db)  # on N devices: the whole group partitioned
        return cls(nodes=tuple(nodes), db=db, physical=physical)

    def run(self, progress: ProgressCallback | None = None,
            out: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """Every output as a dense tensor, in the order given. ``out`` may give, per output,
        a contiguous tensor of its shape and dtype to compute it into (None: a fresh one),
        e.g. a buffer the caller no longer needs; other backends ignore it."""
        if self.physical is None:
            return [q.run(progress=progress, dense=True).dense() for q in self.queries]
        db = self.db
        if any(d.startswith("null") for d in device_names(db.options.devices)):
            raise ExecutionError(f"devices={db.options.devices!r}: null devices compute no "
                                 "values, so there are no results to return")
        steps = self.physical.output_steps
        for step in steps:
            check_dense_fits(step.relation, db.options)
        writer = DenseResults(steps, out)
        self.last_stats.clear()
        result = executor_for(db.options).run(self.physical.task_graph(), progress=progress,
                                              sink=writer.sink, destination=writer.destination,
                                              keep_outputs=False)
        self.last_stats.append(result.stats)
        return writer.tensors

    def explain(self, analyze: bool = False,
                out: Sequence[torch.Tensor | None] | None = None) -> str:
        """The plan of the whole group (one plan on one device, else one per output); with
        ``analyze``, run as :meth:`run` would be with ``out``."""
        if self.physical is None:
            parts = [f"-- output {k} of {len(self.queries)} (run as a query of its own on "
                     "this backend)\n" + q.explain(analyze=analyze)
                     for k, q in enumerate(self.queries)]
            return "\n".join(parts)
        stats = None
        if analyze:
            self.run(out=out)
            stats = self.last_stats[0]
        names = ", ".join(f"[{k}] {n.describe()}" for k, n in enumerate(self.nodes))
        title = f"EXPLAIN{' ANALYZE' if analyze else ''} {len(self.nodes)} outputs: {names}"
        return render_plan(self.physical, stats, title=title)


class DenseResults:
    """Fresh dense tensors for the results of ``steps`` that a run computes its result
    chunks straight into (``destination``), copying only a chunk a kernel returned apart
    (``sink``); a stored chunk never leaks out by reference. ``tensors``: one per step.

    >>> import torch, tensorql as tq
    >>> q = tq.einsum("ij->i", tq.connect().constant(torch.ones(3, 4))).compile()
    >>> writer = DenseResults([q.physical.result_step])
    >>> writer.tensors[0].shape
    torch.Size([3])
    """

    def __init__(self, steps: Sequence[Any],
                 given: Sequence[torch.Tensor | None] | None = None) -> None:
        self._outs: dict[int, tuple[Any, torch.Tensor]] = {}
        for k, step in enumerate(steps):
            rel = step.relation
            dtype = torch_dtype(rel.dtype)
            buffer = given[k] if given is not None and k < len(given) else None
            if buffer is not None and (tuple(buffer.shape) != tuple(rel.shape)
                                       or buffer.dtype != dtype or not buffer.is_contiguous()
                                       or buffer.device.type != "cpu"):
                raise ShapeError(f"output {k}: the buffer given to compute it into is "
                                 f"{tuple(buffer.shape)} {buffer.dtype}, the result "
                                 f"{tuple(rel.shape)} {dtype} (contiguous, on the CPU)")
            if buffer is None:
                buffer = empty_result(rel.shape, dtype)
            self._outs.setdefault(step.id, (rel, buffer))
        self.tensors = [self._outs[step.id][1] for step in steps]

    def destination(self, ref: Any) -> torch.Tensor | None:
        if ref.step not in self._outs:
            return None
        rel, out = self._outs[ref.step]
        return out[rel.grid.slices(ref.key)]

    def sink(self, ref: Any, chunk: torch.Tensor) -> None:
        tile = self.destination(ref)
        if chunk.data_ptr() != tile.data_ptr() or chunk.stride() != tile.stride():
            tile.copy_(chunk)


def job_devices(options: Options) -> int:
    """How many devices a query is planned for: the session's, times the ranks of the
    torch.distributed job when the session is one rank of it."""
    local = len(device_names(options.devices))
    if not options.distributed:
        return local
    return join_process_group(local, options.distributed_timeout_s).devices


def _run_distributed(query: CompiledQuery, progress: ProgressCallback | None,
                     rank_stats: bool = False) -> QueryResult:
    """One rank's part of the query: check every rank has the same plan, run this rank's
    tasks (transfers through torch.distributed); the result chunks are all-gathered (each
    rank sends those it computed to every other), so each rank returns the dense result."""
    import hashlib

    options = query.db.options
    layout = join_process_group(len(device_names(options.devices)),
                                options.distributed_timeout_s)
    graph = query.physical.task_graph()
    checked = ("plan checked across ranks", layout)
    if checked not in graph.programs:  # once per plan and job: the plan does not change
        text = render_plan(query.physical, None) + (query.partition.explain()
                                                    if query.partition else "") + \
            f"exchange={options.distributed_exchange}"
        check_same_plan(hashlib.sha256(text.encode()).hexdigest(), layout)
        graph.programs[checked] = True
    runtime = DistributedRuntime(layout, options.devices, options.memory_limit,
                                 workers=options.workers,
                                 intra_op_threads=options.intra_op_threads,
                                 exchange=options.distributed_exchange,
                                 exchange_group=exchange_group(layout))
    result = runtime.run(graph, progress=progress)
    step = query.physical.result_step
    rel = step.relation
    dense = DenseResults([step])
    out = dense.tensors[0]
    shared = share_results(graph, result.outputs, layout, dense.destination)
    if rank_stats:  # EXPLAIN ANALYZE, run by every rank alike: each rank's figures
        result.stats.ranks = gather_rank_stats(
            result.stats, layout, runtime.sent_bytes, runtime.received_bytes, shared,
            calls=tuple(runtime.bytes_by_call.values()))
    chunks = {key: out[rel.grid.slices(key)] for key in rel.grid.keys()}  # on every rank
    return QueryResult(plan=query.physical, chunks=chunks, stats=result.stats, assembled=out)


def _physical_plan(roots: list[LogicalNode], db: Session, partitioned: bool = True
                   ) -> tuple[PartitionPlan | None, PhysicalPlan]:
    """The physical plan of ``roots`` (one result, or several sharing their common steps):
    the optimizer's partitioning when the session has several devices, else one device's."""
    options = db.options
    max_temp = max(1, options.kernel_temp_bytes // 4)
    count = job_devices(options)
    # an empty tensor anywhere: nothing to partition (and no piece to place)
    empty = any(0 in n.relation.shape for n in walk(*roots))
    if count > 1 and partitioned and not empty:
        return _partition(roots[0], db, count, max_temp, also=tuple(roots[1:]))
    return None, PhysicalPlan.build(roots[0], db.chunk_store, max_temp_elems=max_temp,
                                    **_series(options, options.memory_limit, 1),
                                    also=tuple(roots[1:]))


def _partition(logical: LogicalNode, db: Session, devices: int, max_temp: int,
               also: tuple[LogicalNode, ...] = ()) -> tuple[PartitionPlan, PhysicalPlan]:
    """The optimizer's partitioning and its physical plan. Under a ``memory_limit`` every
    task's chunks (inputs and output) must fit the limit: when a task of the plan does not
    (assembling a region needs its pieces too), the optimizer is asked again with a tighter
    limit, so that it cuts finer; InfeasiblePlanError names the smallest limit found."""
    options = db.options
    limit = options.memory_limit
    try:
        return _plan_within(logical, db, devices, max_temp, limit, also)
    except InfeasiblePlanError as err:
        if limit is None:
            raise
        minimum = err.minimum if err.minimum is not None and err.minimum > limit else None
        if minimum is None:
            raise
        for _ in range(8):  # find the limit the physical plan really needs
            try:
                _plan_within(logical, db, devices, max_temp, minimum, also)
                break
            except InfeasiblePlanError as again:
                minimum = max(minimum + 1, again.minimum or minimum * 2)
        raise InfeasiblePlanError(
            f"memory_limit={limit} bytes ({format_bytes(limit)}) is too small for this query "
            f"on {devices} devices: no partitioning fits every task (inputs and output) in "
            f"it; the smallest memory_limit that plans it is "
            f"{minimum} bytes ({format_bytes(minimum)})", minimum=minimum) from None


def _series(options: Options, limit: int | None, devices: int) -> dict[str, Any]:
    """How contributions to one output chunk are grouped into tasks: by default in series
    of at most ``memory_limit // 4`` bytes of inputs and at least two tasks per worker of a
    device; with ``Options.deterministic`` one task per output chunk (one accumulation
    order, so a run gives the same bits every time)."""
    if options.deterministic:
        return {"fuse_bytes": None, "min_tasks": 1}
    return {"fuse_bytes": _fuse_bytes(limit),
            "min_tasks": 2 * max(1, options.workers // devices)}


def _sub_tiles(options: Options, limit: int | None) -> bool:
    """Whether a device's piece of an operation is cut into the logical plan's tiles (tasks
    that start as their chunks arrive, within a memory limit, spread over a device's lanes)
    or left whole. On CPU devices of one lane each and no memory limit a piece is one task:
    one large product runs at the library's best speed, where a series of 512-tile products
    ran ~10-15% slower (a 2048x1024x4096 MLP on 2 CPU devices: 1.21x torch cut, 1.03x whole).
    """
    local = device_names(options.devices)  # this process's devices (a rank's, in a job)
    cpu = all(name.startswith("cpu") for name in local)
    return limit is not None or not cpu or options.workers // max(1, len(local)) > 1


def _fuse_bytes(memory_limit: int | None) -> int | None:
    """The input bytes one task may fold in series: a quarter of the memory limit."""
    return None if memory_limit is None else max(1, memory_limit // 4)


def _plan_within(logical: LogicalNode, db: Session, devices: int, max_temp: int,
                 limit: int | None, also: tuple[LogicalNode, ...] = ()
                 ) -> tuple[PartitionPlan, PhysicalPlan]:
    target = limit
    smallest = None
    for _ in range(6):
        try:
            # the ranks of a torch.distributed job each hold the inputs
            plan = optimize(logical, devices=devices, strategy=db.options.strategy,
                            memory_limit=target, also=also,
                            sources_everywhere=db.options.distributed)
        except InfeasiblePlanError:
            if smallest is None:
                raise
            break
        physical = build_partitioned(plan, db.chunk_store, max_temp_elems=max_temp,
                                     sub_tiles=_sub_tiles(db.options, limit),
                                     **_series(db.options, limit, devices))
        need = largest_task_bytes(physical.task_graph())
        smallest = need if smallest is None else min(smallest, need)
        if limit is None or need <= limit:
            return plan, physical
        target = max(1, target * limit // need)
    raise InfeasiblePlanError(
        f"its largest task needs {smallest} bytes of chunks at once", minimum=smallest)


class UnknownStageError(OptionError):
    """An EXPLAIN stage name that does not exist."""


def _explain_partition(query: CompiledQuery) -> str:
    if query.partition is None:
        return (f"partitioning: one device ({', '.join(device_names(query.db.options.devices))})"
                ", nothing to partition")
    return query.partition.explain()


def _explain_memory(query: CompiledQuery) -> str:
    options = query.db.options
    runtime = Runtime(options.devices, options.memory_limit, workers=options.workers,
                      intra_op_threads=options.intra_op_threads)
    program = runtime.plan(query.physical.task_graph())
    kinds: dict[str, int] = {}
    for op in program.ops:
        kinds[op.kind] = kinds.get(op.kind, 0) + 1
    counts = ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items()))
    return f"{program.explain()}\nops: {counts}"


STAGES: dict[str, Callable[[CompiledQuery], str]] = {
    "einsum": lambda q: explain_graph(q.node),
    "logical": lambda q: explain_logical(q.logical),
    "partition": _explain_partition,
    "physical": lambda q: render_plan(q.physical, None, title=f"EXPLAIN {q.title}"),
    "memory": _explain_memory,
}


class NativeBackend:
    """The engine's own executor on the session's devices."""

    def run(self, query: CompiledQuery, progress: ProgressCallback | None,
            dense: bool, rank_stats: bool = False) -> QueryResult:
        """Run the query; in a distributed session every rank's figures are gathered too
        when ``rank_stats`` (EXPLAIN ANALYZE: a collective every rank joins)."""
        options = query.db.options
        if progress is None and options.progress:
            with progress_bar(query.node.describe()) as bar:
                return self.run(query, bar, dense, rank_stats)
        devices = device_names(options.devices)
        null = any(d.startswith("null") for d in devices)
        if null and dense:
            raise ExecutionError(
                f"devices={options.devices!r}: null devices run the scheduler only and compute "
                "no values, so there is no result to return; use explain(analyze=True) for the "
                "schedule, or devices='cpu' / N for values")
        if options.distributed:
            return _run_distributed(query, progress, rank_stats)
        executor = executor_for(options)
        sid = query.physical.result_step.id
        writer = DenseResults([query.physical.result_step]) if dense else None
        result = executor.run(query.physical.task_graph(), progress=progress,
                              sink=writer.sink if writer else None,
                              destination=writer.destination if writer else None,
                              keep_outputs=not dense)
        chunks = {ref.key: value for ref, value in result.outputs.items() if ref.step == sid}
        return QueryResult(plan=query.physical, chunks=chunks, stats=result.stats,
                           assembled=writer.tensors[0] if writer else None, computed=not null)

    def explain(self, query: CompiledQuery, analyze: bool) -> tuple[str, QueryResult | None]:
        null = any(d.startswith("null") for d in device_names(query.db.options.devices))
        result = self.run(query, None, dense=not null, rank_stats=True) if analyze else None
        title = f"EXPLAIN{' ANALYZE' if analyze else ''} {query.title}"
        text = render_plan(query.physical, result.stats if result else None, title=title)
        if query.partition is not None:
            text += "\n" + query.partition.explain()
        return _with_paths(text, query.node), result


def _with_paths(text: str, node: Node) -> str:
    """``text`` followed by the contraction path of each n-ary einsum (opt_einsum-style)."""
    sections = [f"contraction of einsum {op.spec.equation}:\n{info.explain()}"
                for op, info in contraction_paths(node)]
    return "\n".join([text, *sections])


class DuckDBBackend:
    """Joins and GROUP BY inside DuckDB, chunk kernels as Arrow UDFs."""

    def run(self, query: CompiledQuery, progress: ProgressCallback | None,
            dense: bool) -> QueryResult:
        from tensorql.backend.duckdb_sql import run_compiled

        return run_compiled(query)

    def explain(self, query: CompiledQuery, analyze: bool) -> tuple[str, QueryResult | None]:
        from tensorql.backend.duckdb_sql import explain_compiled

        text, dense = explain_compiled(query, analyze=analyze)
        result = None
        if dense is not None:
            result = QueryResult(plan=query.physical, chunks={}, stats=None,  # type: ignore
                                 assembled=dense)
        return text, result


BACKENDS: dict[str, ExecutionBackend] = {"native": NativeBackend(), "duckdb": DuckDBBackend()}


def get_backend(name: str) -> ExecutionBackend:
    """The registered backend ``name``; UnknownBackendError lists the valid names."""
    try:
        return BACKENDS[name]
    except (KeyError, TypeError):
        raise UnknownBackendError(
            f"unknown backend {name!r}; choose one of {', '.join(sorted(BACKENDS))}") from None


def register_backend(name: str, backend: ExecutionBackend) -> None:
    """Add an execution backend under ``name`` (replacing one of that name)."""
    BACKENDS[name] = backend



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


SMALL_RESULT_BYTES = 16 << 20  # below this a result is checked against the process figure only


def check_dense_fits(relation: Any, options: Options) -> None:
    """MemoryLimitError, before any allocation, when a dense result of ``relation`` (shape and
    dtype) is larger than :meth:`Options.dense_result_budget`.

    >>> from tensorql.grid import ChunkGrid
    >>> from tensorql.logical.plan import TensorRelation
    >>> big = TensorRelation(("i", "j"), ChunkGrid((2**20, 2**20), (4096, 4096)), "float32")
    >>> check_dense_fits(big, Options())
    Traceback (most recent call last):
    ...
    tensorql.errors.MemoryLimitError: the result is 4.0 TiB (1048576x1048576 float32) ...
    """
    nbytes = math.prod(relation.shape) * itemsize(relation.dtype)
    if nbytes <= SMALL_RESULT_BYTES and nbytes <= options.dense_result_budget(system=False):
        return  # a small result: not worth reading /proc/meminfo on every run of a query
    budget = options.dense_result_budget()
    if nbytes > budget:
        shape = "x".join(map(str, relation.shape))
        raise MemoryLimitError(
            f"the result is {format_bytes(nbytes)} ({shape} {relation.dtype}) but this process "
            f"may hold {format_bytes(budget)} more (Options.process_memory_limit "
            f"{format_bytes(options.process_memory_bytes)}, less the chunk cache, DuckDB's "
            f"memory and device budgets; {format_bytes(available_memory_bytes())} available "
            "on the system); store it with db.store(name, expr) and read it chunk by chunk "
            "(db.iter_chunks), or compute a slice of it")
