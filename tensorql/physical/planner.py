"""Lower a logical plan to a task graph: one step per logical node, one task per chunk job.

``Aggregate(Join(...))`` fuses into one step: each combination of the joined labels' blocks
contributes a partial aggregate to its output chunk, and the contributions to one output chunk
run in series as one task (:class:`ContributionSeries`; below, 4 output chunks of 2
contributions each). Estimates (FLOPs, bytes in and out) are kept per step for EXPLAIN.

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

import itertools
import math
from dataclasses import dataclass, field

from tensorql.algebra import AggName, is_update
from tensorql.dtypes import itemsize
from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph
from tensorql.grid import Key, regrid_pieces
from tensorql.logical.plan import (
    Aggregate,
    Join,
    LogicalNode,
    Map,
    Rekey,
    Reshape,
    Scan,
    Softmax,
    TensorRelation,
    walk,
)
from tensorql.optimizer.plan import PartitionPlan
from tensorql.physical.attention import AttentionGroup, attention_groups
from tensorql.physical.kernels import (
    ConstChunk,
    ContractChunk,
    ContractSeries,
    FusedArg,
    FusedOp,
    FusedPointwise,
    LoadChunk,
    LoadPiece,
    MapChunk,
    RekeyChunk,
    ReshapeChunk,
    SoftmaxChunk,
)
from tensorql.storage.chunk_store import ChunkStore


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
    # the task graph, made once on first use (a query run again reuses it, and with it the
    # memory plans the runtime keeps on it)
    _graph_memo: list[TaskGraph] = field(default_factory=list, init=False, compare=False,
                                         repr=False)

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
              fuse_pointwise: bool = True, fuse_attention: bool = True) -> PhysicalPlan:
        """The plan of ``root`` (and of ``also``, further results sharing its steps where
        their graphs do); contributions to one output chunk are grouped into series
        (see :class:`ContributionSeries`) of at most ``fuse_bytes`` of inputs, keeping at
        least ``min_tasks`` tasks a step where there are that many contributions. Chains of
        pointwise steps run as one step (``fuse_pointwise``), and so do attention chains,
        softmax(q . k + mask) . v (``fuse_attention``, :mod:`tensorql.physical.attention`)."""
        builder = _Builder(store, max_temp_elems, fuse_bytes, min_tasks)
        nodes = walk(root, *also)
        attention = attention_groups(nodes, (root, *also)) if fuse_attention else {}
        in_attention = {id(m) for group in attention.values() for m in group.members[:-1]}
        fused = {id(n.input) for n in nodes if isinstance(n, Aggregate)
                 and isinstance(n.input, Join)} - {id(n) for n in (root, *also)}
        groups = (pointwise_groups(nodes, (root, *also), fused | in_attention)
                  if fuse_pointwise else {})
        members = {id(m) for group in groups.values() for m in group[:-1]} | in_attention
        for node in nodes:
            if id(node) in attention:
                builder.add_attention(attention[id(node)])
            elif id(node) in groups:
                builder.add_fused(groups[id(node)])
            elif id(node) not in fused and id(node) not in members:
                builder.add(node)
        # a Join fused into its Aggregate answers for the same step
        for node in nodes:
            if isinstance(node, Aggregate) and id(node.input) in fused \
                    and id(node) not in in_attention:
                builder.step_of[id(node.input)] = builder.step_of[id(node)]
        for group in groups.values():  # a fused member answers for its group's step
            for member in group[:-1]:
                builder.step_of[id(member)] = builder.step_of[id(group[-1])]
        for chain in attention.values():  # so does a member of an attention chain
            for member in chain.members[:-1]:
                builder.step_of[id(member)] = builder.step_of[id(chain.members[-1])]
        steps = builder.finish()
        return cls(root=root, steps=steps, step_of=builder.step_of, also=tuple(also))


def _pointwise(node: LogicalNode, joins_in_aggregates: set[int]) -> bool:
    """A map, or a join with no aggregation over it and no diagonal (repeated label)."""
    if isinstance(node, Map):
        return True
    return (isinstance(node, Join) and id(node) not in joins_in_aggregates
            and not is_update(node.join)  # stacks its slots: not blocked by rows
            and all(len(set(labels)) == len(labels) for labels in node.input_labels))


def _labels_in(consumer: LogicalNode, k: int) -> tuple[str, ...]:
    """The labels ``consumer`` gives its input ``k``'s dims."""
    return consumer.relation.labels if isinstance(consumer, Map) else consumer.input_labels[k]


def _aligned(consumer: LogicalNode, k: int, producer: LogicalNode) -> bool:
    """Whether each chunk of ``producer`` is exactly what one chunk of ``consumer`` reads
    (the same labels, none broadcast, tiled alike)."""
    labels, rel = _labels_in(consumer, k), consumer.relation
    if sorted(labels) != sorted(rel.labels):
        return False
    grid = rel.grid
    shape = tuple(grid.shape[rel.labels.index(lab)] for lab in labels)
    tile = tuple(grid.tile[rel.labels.index(lab)] for lab in labels)
    return producer.relation.grid.shape == shape and producer.relation.grid.tile == tile


def pointwise_groups(nodes: list[LogicalNode], roots: tuple[LogicalNode, ...],
                     joins_in_aggregates: set[int]) -> dict[int, list[LogicalNode]]:
    """Chains of pointwise steps to fuse: a map or join whose only reader is another
    pointwise step over the same chunks is computed inside that reader's task (see
    :class:`~tensorql.physical.kernels.FusedPointwise`). Returns, by the id of each group's
    last node, its members in dependency order (last node last); groups of two or more."""
    readers: dict[int, set[int]] = {}
    for node in nodes:
        for child in node.inputs:
            readers.setdefault(id(child), set()).add(id(node))
    results = {id(r) for r in roots}
    into: dict[int, int] = {}  # producer -> the consumer it is fused into
    for node in nodes:
        if not _pointwise(node, joins_in_aggregates):
            continue
        for k, child in enumerate(node.inputs):
            if (_pointwise(child, joins_in_aggregates) and id(child) not in results
                    and readers.get(id(child)) == {id(node)} and _aligned(node, k, child)):
                into[id(child)] = id(node)
    consumers = set(into.values())
    groups: dict[int, list[LogicalNode]] = {}
    for node in nodes:
        if id(node) in into or id(node) in consumers:
            top = id(node)
            while top in into:
                top = into[top]
            groups.setdefault(top, []).append(node)
    return groups


class ContributionSeries:
    """Groups the contributions to each output chunk (on each device) into *series*: one task
    runs a series as consecutive products folded into one accumulator
    (:class:`~tensorql.physical.kernels.ContractSeries`) -- the same products as one task
    each, with one scheduling round trip instead of one per tile of the contracted labels,
    the accumulator hot in cache, and no two tasks racing for one chunk.

    A series holds at most ``fuse_bytes`` of inputs (None: no bound); where a device has
    fewer output chunks than ``min_tasks``, their contributions are cut into more series so
    that the device's threads still have ``min_tasks`` tasks to share.

    >>> series = ContributionSeries(ContractChunk((("i", "j"), ("j",)), ("i",)), None, 1)
    >>> for j in range(3):
    ...     series.add(("out", 0), device=0, refs=[f"a{j}", f"b{j}"], flops=8, in_bytes=64)
    >>> [(key, inputs, type(kernel).__name__, flops)
    ...  for key, _, inputs, kernel, flops in series.tasks()]
    [(('out', 0), ['a0', 'b0', 'a1', 'b1', 'a2', 'b2'], 'ContractSeries', 24)]
    """

    def __init__(self, kernel: ContractChunk, fuse_bytes: int | None, min_tasks: int) -> None:
        self.kernel = kernel
        self.fuse_bytes = fuse_bytes
        self.min_tasks = max(1, min_tasks)
        self.parts: dict[tuple, list[tuple[list, int, int]]] = {}

    def add(self, key: tuple, device: int | None, refs: list, flops: int, in_bytes: int) -> None:
        """One contribution to output chunk ``key`` on ``device``."""
        self.parts.setdefault((key, device), []).append((refs, flops, in_bytes))

    def tasks(self):
        """``(key, device, inputs, kernel, flops)`` of each series, in order of first use."""
        outputs: dict[int | None, int] = {}
        for _, device in self.parts:
            outputs[device] = outputs.get(device, 0) + 1
        for (key, device), parts in self.parts.items():
            cuts = -(-self.min_tasks // outputs[device])  # series wanted per output chunk
            longest = max(1, -(-len(parts) // cuts))
            run: list = []
            run_bytes = 0
            for part in parts:
                over = self.fuse_bytes is not None and run_bytes + part[2] > self.fuse_bytes
                if run and (len(run) >= longest or over):
                    yield self._task(key, device, run)
                    run, run_bytes = [], 0
                run.append(part)
                run_bytes += part[2]
            if run:
                yield self._task(key, device, run)

    def _task(self, key: tuple, device: int | None, run: list):
        inputs = [r for refs, _, _ in run for r in refs]
        kernel = (self.kernel if len(run) == 1
                  else ContractSeries(self.kernel, len(run[0][0])))
        return key, device, inputs, kernel, sum(f for _, f, _ in run)


def _pointwise_name(node: LogicalNode) -> str:
    if isinstance(node, Map):
        return node.fn
    return node.join


class _Builder:
    def __init__(self, store: ChunkStore | None, max_temp_elems: int,
                 fuse_bytes: int | None = None, min_tasks: int = 4) -> None:
        self.store = store
        self.max_temp_elems = max_temp_elems
        self.fuse_bytes = fuse_bytes
        self.min_tasks = min_tasks
        self.steps: list[Step] = []
        self.step_of: dict[int, int] = {}
        self.next_task = 0

    def _new_task(self, inputs, output, kernel, flops: int = 0) -> Task:
        task = Task(id=self.next_task, inputs=tuple(inputs), output=output, kernel=kernel,
                    priority=float(self.next_task), flops=flops)
        self.next_task += 1
        return task

    def _ref(self, node: LogicalNode, key: Key) -> ChunkRef:
        return ChunkRef(self.step_of[id(node)], tuple(key))

    def add(self, node: LogicalNode) -> None:
        sid = len(self.steps)
        if isinstance(node, Scan):
            step = self._scan(sid, node)
        elif isinstance(node, Map):
            step = self._map(sid, node)
        elif isinstance(node, Rekey):
            step = self._rekey(sid, node)
        elif isinstance(node, Reshape):
            step = self._reshape(sid, node)
        elif isinstance(node, Softmax):
            step = self._softmax(sid, node)
        elif isinstance(node, Aggregate):
            step = self._contract(sid, node.input, node)
        elif isinstance(node, Join):
            step = self._contract(sid, node, None)
        else:  # pragma: no cover - every logical node kind is handled above
            raise TypeError(type(node).__name__)
        self.steps.append(step)
        self.step_of[id(node)] = sid

    def add_fused(self, group: list[LogicalNode]) -> None:
        """One step computing a chain of pointwise nodes (``group``, last node last) chunk by
        chunk in one task each, reading only the chunks of the chain's outside inputs."""
        sid = len(self.steps)
        root = group[-1]
        position = {id(n): k for k, n in enumerate(group)}
        # the dim of each member's output cut into row blocks: the root's first dim longer
        # than 1 (a leading batch dim of 1 would leave one block)
        longer = [d for d, n in enumerate(root.relation.grid.tile) if n > 1]
        dim_of: dict[int, int | None] = {id(root): longer[0] if longer else None}
        for node in reversed(group):
            dim = dim_of[id(node)]
            for k, child in enumerate(node.inputs):
                if id(child) in position:
                    label = node.relation.labels[dim] if dim is not None else None
                    dim_of[id(child)] = (None if label is None
                                         else _labels_in(node, k).index(label))
        externals: list[tuple[LogicalNode, int, int]] = []  # (node, input k, op)
        ops = []
        for op_index, node in enumerate(group):
            dim = dim_of[id(node)]
            label = node.relation.labels[dim] if dim is not None else None
            args = []
            for k, child in enumerate(node.inputs):
                if id(child) in position:
                    args.append(FusedArg(-position[id(child)] - 1, None))
                    continue
                labels = _labels_in(node, k)
                args.append(FusedArg(len(externals),
                                     labels.index(label) if label in labels else None))
                externals.append((node, k, op_index))
            if isinstance(node, Map):
                kernel = MapChunk(node.fn, node.scalar, node.relation.dtype)
            else:
                kernel = ContractChunk(in_labels=node.input_labels,
                                       out_labels=node.relation.labels, join=node.join,
                                       dtype=node.relation.dtype,
                                       max_temp_elems=self.max_temp_elems)
            ops.append(FusedOp(kernel, tuple(args)))
        kernel = FusedPointwise(tuple(ops), dim_of[id(root)])
        tasks = []
        bytes_in = 0
        for key in root.relation.grid.keys():
            blocks = {id(root): dict(zip(root.relation.labels, key))}
            for node in reversed(group):
                for k, child in enumerate(node.inputs):
                    if id(child) in position:
                        labels = _labels_in(node, k)
                        blocks[id(child)] = dict(zip(child.relation.labels,
                                                     (blocks[id(node)][lab] for lab in labels)))
            inputs = []
            for node, k, _ in externals:
                child = node.inputs[k]
                block = blocks[id(node)]
                child_key = tuple(block[lab] for lab in _labels_in(node, k))
                inputs.append(self._ref(child, child_key))
                bytes_in += (math.prod(child.relation.grid.chunk_shape(child_key))
                             * itemsize(child.relation.dtype))
            tasks.append(self._new_task(inputs, ChunkRef(sid, key), kernel,
                                        math.prod(root.relation.grid.chunk_shape(key))
                                        * len(group)))
        names = " <- ".join(_pointwise_name(n) for n in reversed(group))
        flops = math.prod(root.relation.shape) * len(group)
        self.steps.append(Step(sid, f"Pointwise {names}", tuple(group), tuple(tasks), flops,
                               bytes_in, root.relation.nbytes))
        self.step_of[id(root)] = sid

    def add_attention(self, group: AttentionGroup) -> None:
        """One step computing an attention chain, one task per output chunk reading the
        chunks of q, k, v (and the mask) it needs (see :mod:`tensorql.physical.attention`).
        A source the chain reads on other tiles than its producer's comes first (a Rekey)."""
        for source in group.sources:
            if id(source) not in self.step_of:
                self.add(source)
        sid = len(self.steps)
        out = group.members[-1].relation
        key_label = group.kernel.t[0]
        positions = group.k.relation.shape[group.kernel.k.index(key_label)]
        tasks, bytes_in, flops = [], 0, 0
        for key in out.grid.keys():
            block = dict(zip(out.labels, key))
            inputs = []
            for n, (source, labels) in enumerate(zip(group.sources, group.kernel.input_labels)):
                # q's chunk, then every chunk along the keys of k, v and the mask
                for kb in range(1 if n == 0 else group.kernel.key_blocks):
                    source_key = tuple(kb if label == key_label and n > 0
                                       else block.get(label, 0) for label in labels)
                    inputs.append(self._ref(source, source_key))
                    bytes_in += (math.prod(source.relation.grid.chunk_shape(source_key))
                                 * itemsize(source.relation.dtype))
            q_key = tuple(block.get(label, 0) for label in group.kernel.q)
            task_flops = 2 * positions * (math.prod(group.q.relation.grid.chunk_shape(q_key))
                                          + math.prod(out.grid.chunk_shape(key)))
            flops += task_flops
            tasks.append(self._new_task(inputs, ChunkRef(sid, key), group.kernel, task_flops))
        name = f"Attention softmax over [{key_label}]" + (
            " with mask" if group.mask is not None else "")
        self.steps.append(Step(sid, name, group.members, tuple(tasks), flops, bytes_in,
                               out.nbytes))
        self.step_of[id(group.members[-1])] = sid

    def finish(self) -> tuple[Step, ...]:
        # Tasks without inputs (loads) run just before their first reader.
        first_use: dict[ChunkRef, float] = {}
        for step in self.steps:
            for task in step.tasks:
                for ref in task.inputs:
                    first_use[ref] = min(first_use.get(ref, task.priority), task.priority)
        steps = []
        for step in self.steps:
            tasks = tuple(
                Task(t.id, t.inputs, t.output, t.kernel, first_use.get(t.output, t.priority) - 0.5,
                     t.flops, t.device)
                if not t.inputs else t
                for t in step.tasks
            )
            steps.append(Step(step.id, step.name, step.nodes, tasks, step.est_flops,
                              step.est_bytes_in, step.est_bytes_out))
        return tuple(steps)

    def _scan(self, sid: int, node: Scan) -> Step:
        grid = node.relation.grid
        tasks = []
        for key in grid.keys():
            if node.constant is not None:
                kernel = ConstChunk(node.constant, tuple(grid.slices(key)))
            elif node.offset is not None:  # a region: only the stored chunks it overlaps
                lo = [sl.start for sl in grid.slices(key)]
                hi = [sl.stop for sl in grid.slices(key)]
                kernel = LoadPiece.of_region(self.store, node, lo, hi)
            else:
                kernel = LoadChunk(self.store, node.source, key, tuple(grid.chunk_shape(key)),
                                   node.relation.dtype)
            tasks.append(self._new_task((), ChunkRef(sid, key), kernel))
        return Step(sid, f"Scan {node.source}", (node,), tuple(tasks), 0, node.relation.nbytes,
                    node.relation.nbytes)

    def _map(self, sid: int, node: Map) -> Step:
        kernel = MapChunk(node.fn, node.scalar, node.relation.dtype)
        grid = node.relation.grid
        tasks = tuple(self._new_task((self._ref(node.input, key),), ChunkRef(sid, key), kernel,
                                     math.prod(grid.chunk_shape(key)))
                      for key in grid.keys())
        n = math.prod(node.relation.shape)
        return Step(sid, f"Map {node.fn}", (node,), tasks, n, node.input.relation.nbytes,
                    node.relation.nbytes)

    def _rekey(self, sid: int, node: Rekey) -> Step:
        old, new = node.input.relation.grid, node.relation.grid
        tasks = []
        bytes_in = 0
        for key in new.keys():
            regrid = regrid_pieces(old, new, key)
            inputs = [self._ref(node.input, piece.source_key) for piece in regrid]
            pieces = [(piece.source_slices, piece.target_slices) for piece in regrid]
            bytes_in += sum(math.prod(old.chunk_shape(r.key)) for r in inputs)
            tasks.append(self._new_task(inputs, ChunkRef(sid, key),
                                        RekeyChunk(new.chunk_shape(key), tuple(pieces))))
        size = itemsize(node.relation.dtype)
        return Step(sid, f"Rekey to tiles {new.tile}", (node,), tuple(tasks), 0,
                    bytes_in * size, node.relation.nbytes)

    def _softmax(self, sid: int, node: Softmax) -> Step:
        rel = node.relation
        kernel = SoftmaxChunk.of(node)
        tasks = tuple(self._new_task((self._ref(node.input, key),), ChunkRef(sid, key), kernel,
                                     5 * math.prod(rel.grid.chunk_shape(key)))
                      for key in rel.grid.keys())
        n = math.prod(rel.shape)
        return Step(sid, node.title, (node,), tasks, 5 * n, node.input.relation.nbytes,
                    rel.nbytes)

    def _reshape(self, sid: int, node: Reshape) -> Step:
        grid = node.relation.grid
        tasks = tuple(self._new_task((self._ref(node.input, node.layout.input_key(key)),),
                                     ChunkRef(sid, key), ReshapeChunk(grid.chunk_shape(key)))
                      for key in grid.keys())
        return Step(sid, node.title, (node,), tasks, 0, node.input.relation.nbytes,
                    node.relation.nbytes)

    def _contract(self, sid: int, join: Join, aggregate: Aggregate | None) -> Step:
        out_rel = (aggregate or join).relation
        agg = aggregate.agg if aggregate else AggName.SUM
        kernel_args = dict(in_labels=join.input_labels, out_labels=out_rel.labels,
                           join=join.join, agg=agg, dtype=out_rel.dtype,
                           max_temp_elems=self.max_temp_elems)
        kernel = ContractChunk(**kernel_args)
        joint = join.relation
        blocks = {lab: joint.grid.blocks[n] for n, lab in enumerate(joint.labels)}
        labels = list(blocks)
        tasks = []
        bytes_in = 0
        in_grids = [src.relation.grid for src in join.sources]
        series = ContributionSeries(kernel, self.fuse_bytes, self.min_tasks)
        for combo in itertools.product(*(range(blocks[lab]) for lab in labels)):
            block = dict(zip(labels, combo))
            inputs = []
            task_bytes = 0
            for src, lab_set, grid in zip(join.sources, join.input_labels, in_grids):
                key = tuple(block[lab] for lab in lab_set)
                inputs.append(self._ref(src, key))
                task_bytes += math.prod(grid.chunk_shape(key)) * itemsize(src.relation.dtype)
            bytes_in += task_bytes
            out_key = tuple(block[lab] for lab in out_rel.labels)
            task_flops = math.prod(joint.grid.chunk_shape(combo)) * len(join.sources)
            series.add(out_key, None, inputs, task_flops, task_bytes)
        for out_key, _, inputs, task_kernel, task_flops in series.tasks():
            tasks.append(self._new_task(inputs, ChunkRef(sid, out_key), task_kernel,
                                        task_flops))
        flops = math.prod(joint.shape) * len(join.sources)  # one join op + one agg op each
        if aggregate is None:
            n_in = len(join.sources)
            name = (f"Join {join.join} on [{', '.join(join.on)}]" if n_in >= 2
                    else f"Project ({','.join(join.input_labels[0])})->"
                         f"({','.join(join.relation.labels)})")
            nodes: tuple[LogicalNode, ...] = (join,)
        else:
            name = f"Aggregate {agg} over [{', '.join(aggregate.over)}]"
            nodes = (join, aggregate)
        return Step(sid, name, nodes, tuple(tasks), flops, bytes_in, out_rel.nbytes)
