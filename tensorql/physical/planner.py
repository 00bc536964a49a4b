"""The physical plan's records: :class:`PhysicalPlan` (steps in dependency order, made into a
task graph for the runtime) and :class:`Step`. The one builder that makes them is
:mod:`tensorql.physical.builder`; ``PhysicalPlan.build`` is its one-device entry (below, 4
output chunks of 2 contributions each, each a task of the product step).

>>> from tensorql.grid import ChunkGrid
>>> from tensorql.einsum.graph import EinsumOp, Constant
>>> import torch
>>> a = Constant(shape=(4, 4), dtype="float32", value=torch.ones(4, 4),
...              grid=ChunkGrid((4, 4), (2, 2)))
>>> from tensorql.logical.lower import lower
>>> plan = PhysicalPlan.build(lower(EinsumOp.build("ij,jk->ik", [a, a])), store=None)
>>> [(s.name, len(s.tasks)) for s in plan.steps]
[('Scan <constant>', 4), ('Aggregate sum over [j]', 4)]
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from tensorql.dtypes import itemsize
from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph
from tensorql.logical.plan import LogicalNode, TensorRelation
from tensorql.logical.rules import RULES, Rule, rewrite
from tensorql.logical.rules.attention import match_attention
from tensorql.logical.rules.pointwise import fuse_pointwise as fuse_pointwise_rule
from tensorql.optimizer.plan import PartitionPlan
from tensorql.storage.chunk_store import ChunkStore, PlanReads


@dataclass(frozen=True)
class Step:
    """One physical step: the logical nodes it runs and its tasks, with estimates."""

    id: int
    name: str
    nodes: tuple[LogicalNode, ...]
    tasks: tuple[Task, ...]
    est_flops: int
    est_bytes_in: int
    est_bytes_out: int
    output: TensorRelation | None = None  # set when no logical node carries it

    @property
    def node(self) -> LogicalNode:
        """The logical node whose result this step produces."""
        return self.nodes[-1]

    @property
    def relation(self) -> TensorRelation:
        """The relation (labels, chunk grid, dtype) this step's chunks make up."""
        return self.output if self.output is not None else self.nodes[-1].relation


@dataclass(frozen=True)
class PhysicalPlan:
    """Steps in dependency order; ``step_of`` maps a logical node (by id) to its step."""

    root: LogicalNode
    steps: tuple[Step, ...]
    step_of: dict[int, int]
    result_id: int | None = None          # the result's step when step_of does not say
    partition: PartitionPlan | None = None  # set for a plan partitioned across devices
    chunk_sizes: dict[ChunkRef, int] | None = None  # bytes of chunks without a grid
    chunk_meta: dict[ChunkRef, tuple[tuple[int, ...], str]] | None = None  # their shapes
    also: tuple[LogicalNode, ...] = ()  # further results of a multi-output plan
    also_ids: tuple[int, ...] = ()        # their steps when step_of does not say
    rules_fired: tuple[str, ...] = ()     # the logical rewrite rules that changed the plan
    # what its load tasks read stored tensors through (None: it reads none from a store)
    reads: PlanReads | None = field(default=None, compare=False, repr=False)
    # the task graph, made once on first use (a query run again reuses it, and with it the
    # memory plans the runtime keeps on it)
    _graph_memo: list[TaskGraph] = field(default_factory=list, init=False, compare=False,
                                         repr=False)
    _names_memo: list[tuple[str, ...]] = field(default_factory=list, init=False,
                                               compare=False, repr=False)

    @property
    def result_step(self) -> Step:
        if self.result_id is not None:
            return self.steps[self.result_id]
        return self.steps[self.step_of[id(self.root)]]

    @property
    def output_steps(self) -> tuple[Step, ...]:
        """The step of each result: the root's, then each of ``also`` (a multi-output plan:
        a training step's loss, new weights and optimizer state, computed together)."""
        if self.also_ids:
            return (self.result_step,) + tuple(self.steps[i] for i in self.also_ids)
        return (self.result_step,) + tuple(self.steps[self.step_of[id(n)]] for n in self.also)

    @property
    def devices(self) -> int:
        """How many devices the plan's tasks are placed on (1 when not partitioned)."""
        return self.partition.devices if self.partition is not None else 1

    @property
    def est_flops(self) -> int:
        return sum(s.est_flops for s in self.steps)

    def task_graph(self) -> TaskGraph:
        """The tasks of every step, with each chunk's size (for the runtime's memory plan);
        made once per plan."""
        if not self._graph_memo:
            self._graph_memo.append(self._make_task_graph())
        return self._graph_memo[0]

    @property
    def stored_names(self) -> tuple[str, ...]:
        """The stored tensors the plan's load tasks read, sorted."""
        from tensorql.physical.kernels import LoadChunk, LoadPiece

        return tuple(sorted({task.kernel.name for task in self.task_graph().tasks
                             if isinstance(task.kernel, (LoadChunk, LoadPiece))}))

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        """Around a run: the version of each stored tensor the plan reads is pinned when the
        run begins, and every chunk the run loads is of that version (a tensor replaced by
        another thread meanwhile is read whole, old or new; see
        :class:`~tensorql.storage.chunk_store.PlanReads`)."""
        if self.reads is None:
            yield
            return
        if not self._names_memo:
            self._names_memo.append(self.stored_names)
        with self.reads.run(self._names_memo[0]):
            yield

    def _make_task_graph(self) -> TaskGraph:
        sizes: dict[ChunkRef, int] = dict(self.chunk_sizes or {})
        meta = dict(self.chunk_meta or {})
        for step in self.steps:
            rel = step.relation
            size = itemsize(rel.dtype)
            for task in step.tasks:
                if task.output not in sizes:
                    shape = rel.grid.chunk_shape(task.output.key)
                    sizes[task.output] = math.prod(shape) * size
                    meta[task.output] = (shape, rel.dtype)
        return TaskGraph(
            tasks=tuple(t for s in self.steps for t in s.tasks),
            retain=frozenset(s.id for s in self.output_steps),
            step_names={s.id: s.name for s in self.steps},
            chunk_bytes=sizes,
            chunk_meta=meta,
        )

    @classmethod
    def build(cls, root: LogicalNode, store: ChunkStore | None,
              max_temp_elems: int = 1 << 24, fuse_bytes: int | None = None,
              min_tasks: int = 4, also: tuple[LogicalNode, ...] = (),
              fuse_pointwise: bool = True, fuse_attention: bool = True,
              rules: tuple[Rule, ...] | None = None,
              fired: tuple[str, ...] = ()) -> PhysicalPlan:
        """The one-device plan of ``root`` (and of ``also``) by the one builder
        (:func:`tensorql.physical.builder.build`), after the logical rewrite rules
        (:mod:`tensorql.logical.rules`: chains of pointwise steps run as one step,
        ``fuse_pointwise``; so do attention chains, softmax(q . k + mask) . v,
        ``fuse_attention``) unless ``rules`` says which (``()``: the plan was rewritten
        already, by the rules ``fired``)."""
        from tensorql.physical.builder import build

        if rules is None:
            rules = tuple(rule for rule in RULES
                          if (rule is not match_attention or fuse_attention)
                          and (rule is not fuse_pointwise_rule or fuse_pointwise))
        if rules:
            done = rewrite([root, *also], rules)
            root, also, fired = done.roots[0], done.roots[1:], fired + done.fired
        return build(root, None, store, also=tuple(also), max_temp_elems=max_temp_elems,
                     fuse_bytes=fuse_bytes, min_tasks=min_tasks, fired=fired)
