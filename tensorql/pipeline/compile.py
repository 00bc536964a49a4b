"""Compiling: the stage chain from an einsum graph node to a physical plan, and the compiled
query (or group of queries) that runs and explains it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from tensorql.einsum.graph import Node
from tensorql.errors import OptionError, PlanError, as_flag
from tensorql.exec.host_malloc import STREAM_RETAINED_FREE_BYTES, heap_only, release_free_memory
from tensorql.exec.run_types import ProgressCallback, RunStats
from tensorql.exec.timeline import check_trace_path
from tensorql.grid import Key
from tensorql.logical.lower import lower, lower_many
from tensorql.logical.plan import LogicalNode
from tensorql.logical.rebind import rebind_extent
from tensorql.logical.rules import Rewritten
from tensorql.optimizer.plan import PartitionPlan
from tensorql.physical.explain import render_plan
from tensorql.physical.in_place import order_in_place
from tensorql.physical.plan_graph import FORMATS as PLAN_FORMATS
from tensorql.physical.plan_graph import logical_json, plan_json, render_doc
from tensorql.physical.planner import PhysicalPlan
from tensorql.physical.result import QueryResult
from tensorql.pipeline.backends import get_backend
from tensorql.pipeline.planning import Session, checked_rewrite, physical_plan, plan_rewritten
from tensorql.pipeline.run import DenseResults, check_dense_fits, execute, session_spill
from tensorql.pipeline.stages import STAGES, UnknownStageError

STREAM_RELEASE_S = 0.05  # while a result streams out, free heap memory is looked at this often


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
        supports = get_backend(name).supports
        logical = lower(node)
        partition, physical = physical_plan([logical], db, partitioned=supports.partitioned)
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
        if not get_backend(self.backend).supports.streaming:
            for key, chunk in self.run(progress=progress).iter_chunks():
                sink(key, chunk)
            return
        sid = self.physical.result_step.id
        sent: set[Key] = set()

        def result_sink(ref, chunk):
            if ref.step == sid and ref.key not in sent:
                sent.add(ref.key)
                sink(ref.key, chunk)
                # the chunks the store has written are free heap memory, scattered between
                # DuckDB's blocks where the heap cannot shrink: given back as the run goes
                release_free_memory(keep=STREAM_RETAINED_FREE_BYTES, every=STREAM_RELEASE_S)

        result = execute(self.physical, self.db.options, values="stream",
                         progress=progress, sink=result_sink, keep_outputs=False,
                         partition=self.partition, title=self.node.describe(),
                         spill=session_spill(self.db, self.db.options))
        for ref, chunk in result.outputs.items():  # chunks no task completed (none normally)
            if ref.step == sid and chunk is not None and ref.key not in sent:
                sink(ref.key, chunk)
        return None

    def explain(self, analyze: bool = False, stage: str | None = None,
                format: str = "text", trace: str | None = None) -> str:
        """The plan as text. ``stage`` picks one stage of the chain (see :data:`STAGES`):
        ``einsum`` (the graph as written), ``logical`` (the relational rewrite), ``partition``
        (pieces and placement per operation), ``physical`` (steps and tasks), ``memory`` (the
        runtime's memory plan); by default the physical plan and, on several devices, the
        partitioning -- with ``analyze`` the query runs and measured figures are added.

        ``format`` "json", "dot" or "mermaid" gives the physical (or, with
        ``stage="logical"``, the logical) plan as a graph instead (see
        :mod:`tensorql.physical.plan_graph` for the JSON schema). ``trace`` (with
        ``analyze``) writes the run's timeline to that file as Chrome-trace JSON, for
        Perfetto or chrome://tracing: an event per task (see
        :func:`tensorql.exec.timeline.chrome_trace`)."""
        analyze = as_flag(analyze, "explain(analyze=...)")
        if not (isinstance(format, str) and (format == "text" or format in PLAN_FORMATS)):
            raise OptionError(f"unknown EXPLAIN format {format!r}; choose one of text, "
                              f"{', '.join(PLAN_FORMATS)}")
        if trace is not None and not analyze:
            raise OptionError("explain(trace=...) records a run: pass analyze=True too")
        if trace is not None:
            check_trace_path(trace)
        if stage is not None and (not isinstance(stage, str) or stage not in STAGES):
            raise UnknownStageError(f"unknown EXPLAIN stage {stage!r}; choose one of "
                                    f"{', '.join(STAGES)}")
        if stage is not None and analyze:
            raise OptionError("EXPLAIN ANALYZE shows the whole plan; leave stage unset")
        if format != "text":
            if stage == "logical":
                doc = logical_json((self.physical.root, *self.physical.also), title=self.title,
                                   rules_fired=self.physical.rules_fired)
            elif stage in (None, "physical"):
                doc = self.plan_doc(self._explained(analyze, trace)[1] if analyze else None)
            else:
                raise OptionError(f"EXPLAIN format {format!r} draws the logical or the "
                                  f"physical plan; stage {stage!r} is text only")
            return render_doc(doc, format)
        if stage is None:
            return self._explained(analyze, trace)[0]
        return STAGES[stage](self)

    def plan_doc(self, result: QueryResult | None = None) -> dict:
        """The physical plan as a JSON-ready graph document
        (:func:`tensorql.physical.plan_graph.plan_json`), with the figures ``result``'s run
        measured when given."""
        stats = result.stats if result is not None else None
        return plan_json(self.physical, stats, title=self.title)

    def _explained(self, analyze: bool, trace: str | None) -> tuple[str, QueryResult | None]:
        if trace is None:
            return self.explain_and_result(analyze)
        return get_backend(self.backend).explain(self, analyze, trace=trace)

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
    # the outputs that may be computed into the storage of the constants they replace
    # (``compile(in_place=...)``: the plan orders them after every reader of those)
    in_place: frozenset[int] = frozenset()
    # the logical plan after the rewrite rules, kept where it can be re-bound to another
    # extent (one device, not in place: :meth:`with_extent`)
    rewritten: Rewritten | None = field(default=None, compare=False, repr=False)
    last_stats: list[RunStats] = field(default_factory=list, compare=False, repr=False)

    @classmethod
    def compile(cls, nodes: list[Node], db: Session,
                in_place: dict[int, Sequence[torch.Tensor]] | None = None) -> CompiledGroup:
        """Plan ``nodes`` as one query. ``in_place`` names outputs (by index) that the caller
        would compute into the storage of the given in-memory constants the plan reads (an
        optimizer's new weights and moments over the old): where the plan can order each
        such output after every other reader of those constants (one CPU device), it does,
        and :attr:`in_place` lists them; ``run(out=...)`` may then pass that storage."""
        options = db.options
        if not nodes:
            raise PlanError("a group of queries needs at least one expression")
        if not get_backend(options.backend).supports.multi_output or options.distributed:
            return cls(nodes=tuple(nodes), db=db,
                       queries=tuple(CompiledQuery.compile(n, db) for n in nodes))
        rewritten, partitionable = checked_rewrite(lower_many(nodes))
        # on N devices: the whole group partitioned
        partition, physical = plan_rewritten(rewritten, db, partitioned=partitionable)
        done: frozenset[int] = frozenset()
        if in_place and options.device_set.count == 1 and options.device_set.all_cpu:
            physical, done = order_in_place(physical, in_place)
        return cls(nodes=tuple(nodes), db=db, physical=physical, in_place=done,
                   rewritten=rewritten if partition is None and not in_place else None)

    def with_extent(self, old: int, new: int,
                    constants: Mapping[int, torch.Tensor]) -> CompiledGroup | None:
        """This group planned again for inputs in which every dim of extent ``old`` is
        ``new`` (a prompt of another length): its rewritten logical plan re-bound
        (:func:`~tensorql.logical.rebind.rebind_extent`: the constants whose tensors' ids
        are keys of ``constants`` read the new tensors given there) and built into a
        physical plan -- no lowering and no rewrite rules. None where that cannot be done
        (a partitioned plan, an in-place one, or an ambiguous extent): compile anew then.
        :attr:`nodes` stay the expressions the group was compiled from (their titles name
        the old extent).

        >>> import torch, tensorql as tq
        >>> db = tq.connect()
        >>> w = db.from_torch("w", torch.ones(3, 2))
        >>> x = db.constant(torch.ones(5, 3))
        >>> group = CompiledGroup.compile([tq.einsum("sd,df->sf", x, w).node], db)
        >>> other = group.with_extent(5, 4, {id(x.node.value): torch.full((4, 3), 2.0)})
        >>> other.run()[0].tolist()
        [[6.0, 6.0], [6.0, 6.0], [6.0, 6.0], [6.0, 6.0]]
        """
        if self.rewritten is None:
            return None
        roots = rebind_extent(self.rewritten.roots, old, new, constants)
        if roots is None:
            return None
        rewritten = Rewritten(roots, self.rewritten.fired)
        partition, physical = plan_rewritten(rewritten, self.db, partitioned=False)
        return CompiledGroup(nodes=self.nodes, db=self.db, physical=physical,
                             rewritten=rewritten)

    def run(self, progress: ProgressCallback | None = None,
            out: Sequence[torch.Tensor | None] | None = None,
            strategy: str | None = None) -> list[torch.Tensor]:
        """Every output as a dense tensor, in the order given. ``out`` may give, per output,
        a contiguous tensor of its shape and dtype to compute it into (None: a fresh one),
        e.g. a buffer the caller no longer needs; other backends ignore it. ``strategy``:
        the engine's strategy (None: its policy's), e.g. "tape" for a group run again and
        again with the same shapes (a decoder's token: :mod:`tensorql.exec.tape`)."""
        if self.physical is None:
            return [q.run(progress=progress, dense=True).dense() for q in self.queries]
        options = self.db.options
        steps = self.physical.output_steps
        for step in steps:
            check_dense_fits(step.relation, options)
        writer = DenseResults(steps, out)
        self.last_stats.clear()
        result = execute(self.physical, options, values="return", progress=progress,
                         sink=writer.sink, destination=writer.destination, keep_outputs=False,
                         spill=session_spill(self.db, self.db.options), strategy=strategy)
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
