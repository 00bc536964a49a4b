"""The one physical builder: :func:`build` turns a logical plan and its partitioning into
steps of tasks (a :class:`~tensorql.physical.planner.PhysicalPlan`); this is the only module
that makes :class:`~tensorql.exec.taskgraph.Task` objects.

**One device** (no partition plan): one step per logical node, one task per chunk job.
``Aggregate(Join(...))`` is one step: each combination of the joined labels' blocks
contributes a partial aggregate to its output chunk, and the contributions to one output chunk
run in series as one task (:class:`ContributionSeries`). The logical rewrite rules'
``Pointwise`` and ``Attention`` nodes run their fused kernels, one task per output chunk.
Estimates (FLOPs, bytes in and out) are kept per step for EXPLAIN.

**Several devices** (a :class:`~tensorql.optimizer.plan.PartitionPlan`): every task on the
device the optimizer chose. A partitioned operation's chunks are its pieces, cut into the
logical plan's tiles (``PartitionPlan.chunk_layout``), one task per piece combination, placed
by the plan's layout. Data moves between devices only through the runtime's copies, and only
the bytes the cost model predicts:

* a task reading a producer's piece held by another device gets it sent whole (once per
  device) when it needs all of it;
* when it needs part of a remote piece, a **slice** task on the producer's device cuts that
  part first, and only the slice is sent; an **assemble** task on the reader's device puts the
  region together from local pieces and received slices (a repartition is thus slice +
  all-to-all + concatenate, never a regather onto one owner);
* a device holding **partial aggregates** of an output piece it does not own folds them
  locally, and a **reduce** task on the owner folds in the one partial it receives; in a
  **reduce-scatter** (``Layout.scatter``) every contributor owns a part of the piece: it cuts
  the parts it does not own out of its partial and sends each to its owner, and folds the
  ones it receives into its own part;
* stored pieces are read by the device that holds them (each reads only its own chunks);
  where every device can load the inputs itself (``OpNode.loaded_where_read``: the ranks of
  a torch.distributed job), a stored tensor or constant is never sent: each device loads the
  regions its tasks read, once each, and its pieces as such only when it is a result.

The builder reads the partitioning only through the partition plan's surface (layouts,
chunk layouts, device reads, piece extents and region sources), never the cost model.

>>> import numpy as np, torch, tensorql as tq
>>> from tensorql.einsum.graph import Constant, EinsumOp
>>> from tensorql.grid import ChunkGrid
>>> from tensorql.logical.lower import lower
>>> from tensorql.optimizer import optimize
>>> a = Constant(shape=(4, 4), dtype="float32", value=torch.ones(4, 4),
...              grid=ChunkGrid((4, 4), (2, 2)))
>>> one = build(lower(EinsumOp.build("ij,jk->ik", [a, a])), store=None)
>>> [(s.name, len(s.tasks)) for s in one.steps]
[('Scan <constant>', 4), ('Aggregate sum over [j]', 4)]
>>> db = tq.connect()
>>> x = db.from_numpy("x", np.arange(12.0).reshape(3, 4))
>>> plan = optimize(x @ x.T, devices=3)
>>> physical = build(plan.graph.logical, plan, db.chunk_store)
>>> sorted({t.device for s in physical.steps for t in s.tasks})
[0, 1, 2]
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import numpy as np
from tensorql_kernels.elementwise import OUT_MAPS

from tensorql.algebra import AggName, JoinName
from tensorql.dtypes import itemsize
from tensorql.exec.taskgraph import ChunkRef, Task
from tensorql.grid import ChunkGrid, Key, regrid_pieces
from tensorql.logical.plan import (
    Aggregate,
    Attention,
    Join,
    LogicalNode,
    Map,
    Pointwise,
    Rekey,
    Reshape,
    Scan,
    Softmax,
    TensorRelation,
    contraction_joins,
    walk,
)
from tensorql.optimizer.plan import Layout, PartitionPlan
from tensorql.physical.attention import attention_kernel
from tensorql.physical.kernels import (
    ConstChunk,
    ContractChunk,
    ContractEpilogue,
    ContractSeries,
    ContractWhole,
    FoldPartial,
    LoadChunk,
    LoadPiece,
    MapChunk,
    RekeyChunk,
    ReshapeChunk,
    SliceChunk,
    SoftmaxChunk,
    pointwise_kernel,
)
from tensorql.physical.planner import PhysicalPlan, Step
from tensorql.storage.chunk_store import ChunkStore, PlanReads


def build(root: LogicalNode, partition: PartitionPlan | None = None,
          store: ChunkStore | None = None, *, also: tuple[LogicalNode, ...] = (),
          max_temp_elems: int = 1 << 24, fuse_bytes: int | None = None,
          min_tasks: int = 4, sub_tiles: bool = True,
          fired: tuple[str, ...] = (), whole_k: float | None = None) -> PhysicalPlan:
    """The physical plan of logical plan ``root`` (and of ``also``, further results sharing
    its steps where their graphs do) as ``partition`` cuts and places it (None: one device;
    a partition plan carries its own logical plan, ``root`` must be it).

    Contributions to one output chunk are grouped into series (:class:`ContributionSeries`)
    of at most ``fuse_bytes`` of inputs (None: no bound), keeping at least ``min_tasks``
    tasks a step (a device, when partitioned). With ``sub_tiles`` a partitioned operation's
    pieces are cut into the logical plan's tiles (same bytes moved). ``fired``: the logical
    rewrite rules that made ``root`` (for EXPLAIN). The plan's load tasks read ``store``
    through its :class:`~tensorql.storage.chunk_store.PlanReads` (``plan.reads``), which
    pins the version of each stored tensor per run. ``whole_k`` (one device; None: never):
    the input bytes up to which a product's contributions to one output chunk run as one
    product over the whole contracted label (:class:`WholeK`, chosen by
    :func:`tensorql.pipeline.planning.whole_k_bytes`)."""
    reads = PlanReads(store) if store is not None else None
    if partition is not None:
        if partition.graph.logical is not root:
            raise ValueError("the partition plan is of another logical plan")
        return dataclasses.replace(
            _partitioned(partition, reads, max_temp_elems, sub_tiles, fuse_bytes, min_tasks,
                         fired), reads=reads)
    builder = _OneDevice(reads, max_temp_elems, fuse_bytes, min_tasks, whole_k)
    nodes = walk(root, *also)
    builder.read_once = _read_once(nodes, (root, *also))
    joins = contraction_joins(nodes, (root, *also))
    for node in nodes:
        if id(node) not in joins:
            builder.add(node)
    for node in nodes:  # a Join fused into its Aggregate answers for the same step
        if isinstance(node, Aggregate) and id(node.input) in joins:
            builder.step_of[id(node.input)] = builder.step_of[id(node)]
    steps = builder.finish()
    return PhysicalPlan(root=root, steps=steps, step_of=builder.step_of, also=tuple(also),
                        rules_fired=tuple(fired), reads=reads)


def operation_kernel(node: LogicalNode, max_temp_elems: int = 1 << 24):
    """The kernel every task of ``node``'s step runs, whatever the shape of its chunk -- a
    chunk of the logical grid on one device, a piece (or a chunk of one) on several: the
    same kernels on one device and many. (Scans, retilings and reshapes read or copy
    chunks by their keys and shapes, so their kernels are made per task.)

    >>> from tensorql.grid import ChunkGrid
    >>> rel = TensorRelation(("i",), ChunkGrid((4,), (2,)), "float32")
    >>> type(operation_kernel(Map(rel, input=Scan(rel, source="A"), fn="exp"))).__name__
    'MapChunk'
    """
    return _KERNELS[type(node)](node, max_temp_elems)


def _contraction_kernel(join: Join, aggregate: Aggregate | None,
                        max_temp_elems: int) -> ContractChunk:
    out = (aggregate or join).relation
    return ContractChunk(in_labels=join.input_labels, out_labels=out.labels, join=join.join,
                         agg=aggregate.agg if aggregate is not None else AggName.SUM,
                         dtype=out.dtype, max_temp_elems=max_temp_elems)


_KERNELS = {
    Map: lambda node, temp: MapChunk(node.fn, node.scalar, node.relation.dtype),
    Softmax: lambda node, temp: SoftmaxChunk.of(node),
    Pointwise: pointwise_kernel,
    Attention: lambda node, temp: attention_kernel(node),
    Aggregate: lambda node, temp: _contraction_kernel(node.input, node, temp),
    Join: lambda node, temp: _contraction_kernel(node, None, temp),
}


@dataclass(frozen=True)
class WholeK:
    """The rule's verdict for one product step: run each output chunk's contributions as one
    product over the whole contracted label they tile (:class:`ContractWhole`), when their
    inputs are at most ``max_bytes`` (the copies that put the tiles together are temporaries
    of that size); ``axes``: per operand, the dim of that label (None: not in the operand).
    """

    max_bytes: float
    axes: tuple[int | None, ...]

    @classmethod
    def of(cls, max_bytes: float | None, kernel: ContractChunk,
           blocks: dict[str, int]) -> WholeK | None:
        """The verdict for ``kernel`` over a grid of ``blocks`` per label, given the bytes
        the device may spend on the copies (None: the device gains nothing by it). Only a
        step whose contributions tile exactly one contracted label qualifies (several would
        be a grid of tiles to put together; products that broadcast are not matmuls).

        >>> k = ContractChunk((("i", "j"), ("j", "k")), ("i", "k"))
        >>> WholeK.of(1e9, k, {"i": 2, "j": 4, "k": 2})
        WholeK(max_bytes=1000000000.0, axes=(1, 0))
        >>> WholeK.of(None, k, {"i": 2, "j": 4, "k": 2}) is None
        True
        >>> WholeK.of(1e9, k, {"i": 2, "j": 1, "k": 2}) is None  # nothing to put together
        True
        """
        if max_bytes is None or kernel._broadcast is not None:
            return None
        contracted = [label for label, n in blocks.items()
                      if n > 1 and label not in kernel.out_labels]
        if len(contracted) != 1:
            return None
        (label,) = contracted
        return cls(max_bytes, tuple(labels.index(label) if label in labels else None
                                    for labels in kernel.in_labels))


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

    def __init__(self, kernel: ContractChunk, fuse_bytes: int | None, min_tasks: int,
                 whole: WholeK | None = None) -> None:
        self.kernel = kernel
        self.fuse_bytes = fuse_bytes
        self.min_tasks = max(1, min_tasks)
        self.whole = whole
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
            if len(parts) > 1 and self.whole is not None \
                    and sum(p[2] for p in parts) <= self.whole.max_bytes:
                yield self._whole_task(key, device, parts)
                continue
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

    def _whole_task(self, key: tuple, device: int | None, parts: list):
        assert self.whole is not None
        inputs = [r for refs, _, _ in parts for r in refs]
        kernel = ContractWhole(self.kernel, len(parts[0][0]), self.whole.axes)
        return key, device, inputs, kernel, sum(f for _, f, _ in parts)

    def _task(self, key: tuple, device: int | None, run: list):
        inputs = [r for refs, _, _ in run for r in refs]
        kernel = (self.kernel if len(run) == 1
                  else ContractSeries(self.kernel, len(run[0][0])))
        return key, device, inputs, kernel, sum(f for _, f, _ in run)


# maps folded into the product making their input (ContractEpilogue): activations with an
# in-place form, on floating chunks
EPILOGUE_MAPS = frozenset({"relu", "silu", "sigmoid", "tanh"}) & OUT_MAPS
_FLOAT_DTYPES = frozenset({"float32", "float64", "bfloat16", "float16"})


def _is_product(node: Aggregate) -> bool:
    """Whether ``node`` sums a product of two relations (a matrix product, a contraction)."""
    join = node.input
    return node.agg == AggName.SUM and isinstance(join, Join) and join.join == JoinName.MUL \
        and len(join.sources) == 2


def _read_once(nodes: list[LogicalNode], results: tuple[LogicalNode, ...]) -> frozenset[int]:
    """The ids of the nodes exactly one node reads and that are no result of the plan."""
    count: dict[int, int] = {}
    for node in nodes:
        for child in node.inputs:
            count[id(child)] = count.get(id(child), 0) + 1
    done = {id(r) for r in results}
    return frozenset(k for k, n in count.items() if n == 1 and k not in done)


class _OneDevice:
    """The steps of a plan on one device: one step per logical node, its tasks the chunks of
    the node's grid (an Aggregate with the Join it reads as one step)."""

    def __init__(self, store: PlanReads | None, max_temp_elems: int,
                 fuse_bytes: int | None = None, min_tasks: int = 4,
                 whole_k: float | None = None) -> None:
        self.store = store
        self.max_temp_elems = max_temp_elems
        self.fuse_bytes = fuse_bytes
        self.min_tasks = min_tasks
        self.whole_k = whole_k
        self.steps: list[Step] = []
        self.step_of: dict[int, int] = {}
        self.next_task = 0
        self.read_once: frozenset[int] = frozenset()  # maps fold into such products only

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
            if self._epilogue(node):
                return
            step = self._map(sid, node)
        elif isinstance(node, Rekey):
            step = self._rekey(sid, node)
        elif isinstance(node, Reshape):
            step = self._reshape(sid, node)
        elif isinstance(node, Softmax):
            step = self._softmax(sid, node)
        elif isinstance(node, Pointwise):
            step = self._fused(sid, node)
        elif isinstance(node, Attention):
            step = self._attention(sid, node)
        elif isinstance(node, Aggregate):
            step = self._contract(sid, node.input, node)
        elif isinstance(node, Join):
            step = self._contract(sid, node, None)
        else:  # pragma: no cover - every logical node kind is handled above
            raise TypeError(type(node).__name__)
        self.steps.append(step)
        self.step_of[id(node)] = sid

    def _epilogue(self, node: Map) -> bool:
        """Fold activation ``node`` into the step of the product it reads, as the epilogue of
        each of its tasks (:class:`~tensorql.physical.kernels.ContractEpilogue`), when that
        contraction is read by ``node`` alone, makes each output chunk in one task, and
        ``node`` keeps its grid and dtype with an in-place form; True when folded."""
        source = node.input
        sid = self.step_of.get(id(source))
        if not (isinstance(source, Aggregate) and sid is not None and id(source) in
                self.read_once and node.fn in EPILOGUE_MAPS and _is_product(source)
                and node.relation.grid == source.relation.grid
                and node.relation.dtype == source.relation.dtype
                and node.relation.dtype in _FLOAT_DTYPES):
            return False
        step = self.steps[sid]
        if step.node is not source or step.output is not None or not all(
                isinstance(t.kernel, (ContractChunk, ContractSeries, ContractWhole))
                for t in step.tasks) \
                or len({t.output for t in step.tasks}) != len(step.tasks):
            return False
        grid = node.relation.grid
        tasks = tuple(dataclasses.replace(
            t, kernel=ContractEpilogue(t.kernel, node.fn, node.scalar, node.relation.dtype),
            flops=t.flops + math.prod(grid.chunk_shape(t.output.key))) for t in step.tasks)
        join = source.input
        assert isinstance(join, Join)
        name = f"{node.title} <- {step.name} <- Join {join.join} on [{', '.join(join.on)}]"
        self.steps[sid] = Step(sid, name, (*step.nodes, node), tasks,
                               step.est_flops + math.prod(node.relation.shape),
                               step.est_bytes_in, step.est_bytes_out)
        self.step_of[id(node)] = sid
        return True

    def _fused(self, sid: int, node: Pointwise) -> Step:
        """One step computing a chain of pointwise ops chunk by chunk in one task each,
        reading only the chunks of the chain's outside inputs."""
        kernel = operation_kernel(node, self.max_temp_elems)
        rel = node.relation
        tasks = []
        bytes_in = 0
        for key in rel.grid.keys():
            block = dict(zip(rel.labels, key))
            inputs = []
            for child, labels in zip(node.sources, node.source_labels):
                child_key = tuple(block[lab] for lab in labels)
                inputs.append(self._ref(child, child_key))
                bytes_in += (math.prod(child.relation.grid.chunk_shape(child_key))
                             * itemsize(child.relation.dtype))
            tasks.append(self._new_task(inputs, ChunkRef(sid, key), kernel,
                                        math.prod(rel.grid.chunk_shape(key)) * len(node.ops)))
        flops = math.prod(rel.shape) * len(node.ops)
        return Step(sid, node.title, (node,), tuple(tasks), flops, bytes_in, rel.nbytes)

    def _attention(self, sid: int, node: Attention) -> Step:
        """One step computing an attention chain, one task per output chunk reading the
        chunks of q, k, v (and the mask) it needs (see :mod:`tensorql.physical.attention`)."""
        labels = node.labels
        key_label = labels.t[0]
        k = node.sources[1]
        kernel = dataclasses.replace(operation_kernel(node, self.max_temp_elems),
                                     key_blocks=k.relation.grid.blocks[labels.k.index(key_label)])
        out = node.relation
        positions = k.relation.shape[labels.k.index(key_label)]
        q = node.sources[0]
        tasks, bytes_in, flops = [], 0, 0
        for key in out.grid.keys():
            block = dict(zip(out.labels, key))
            inputs = []
            for n, (source, src_labels) in enumerate(zip(node.sources, labels.sources)):
                # q's chunk, then every chunk along the keys of k, v and the mask
                for kb in range(1 if n == 0 else kernel.key_blocks):
                    source_key = tuple(kb if label == key_label and n > 0
                                       else block.get(label, 0) for label in src_labels)
                    inputs.append(self._ref(source, source_key))
                    bytes_in += (math.prod(source.relation.grid.chunk_shape(source_key))
                                 * itemsize(source.relation.dtype))
            q_key = tuple(block.get(label, 0) for label in labels.q)
            task_flops = 2 * positions * (math.prod(q.relation.grid.chunk_shape(q_key))
                                          + math.prod(out.grid.chunk_shape(key)))
            flops += task_flops
            tasks.append(self._new_task(inputs, ChunkRef(sid, key), kernel, task_flops))
        return Step(sid, node.title, (node,), tuple(tasks), flops, bytes_in, out.nbytes)

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
                                   node.relation.dtype, tuple(grid.shape))
            tasks.append(self._new_task((), ChunkRef(sid, key), kernel))
        return Step(sid, node.title, (node,), tuple(tasks), 0, node.relation.nbytes,
                    node.relation.nbytes)

    def _map(self, sid: int, node: Map) -> Step:
        kernel = operation_kernel(node, self.max_temp_elems)
        grid = node.relation.grid
        tasks = tuple(self._new_task((self._ref(node.input, key),), ChunkRef(sid, key), kernel,
                                     math.prod(grid.chunk_shape(key)))
                      for key in grid.keys())
        n = math.prod(node.relation.shape)
        return Step(sid, node.title, (node,), tasks, n, node.input.relation.nbytes,
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
        return Step(sid, node.title, (node,), tuple(tasks), 0,
                    bytes_in * size, node.relation.nbytes)

    def _softmax(self, sid: int, node: Softmax) -> Step:
        rel = node.relation
        kernel = operation_kernel(node, self.max_temp_elems)
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
        kernel = operation_kernel(aggregate or join, self.max_temp_elems)
        joint = join.relation
        blocks = {lab: joint.grid.blocks[n] for n, lab in enumerate(joint.labels)}
        labels = list(blocks)
        tasks = []
        bytes_in = 0
        in_grids = [src.relation.grid for src in join.sources]
        series = ContributionSeries(kernel, self.fuse_bytes, self.min_tasks,
                                    WholeK.of(self.whole_k, kernel, blocks))
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
            name = join.title
            nodes: tuple[LogicalNode, ...] = (join,)
        else:
            name = aggregate.title
            nodes = (join, aggregate)
        return Step(sid, name, nodes, tuple(tasks), flops, bytes_in, out_rel.nbytes)


class _Steps:
    """Step ids and tasks of the plan being built."""

    def __init__(self) -> None:
        self.tasks: dict[int, list[Task]] = {}
        self.names: dict[int, str] = {}
        self.relations: dict[int, TensorRelation] = {}
        self.flops: dict[int, int] = {}
        self.sizes: dict[ChunkRef, int] = {}
        self.meta: dict[ChunkRef, tuple[tuple[int, ...], str]] = {}
        self.next_task = 0

    def new_step(self, name: str, relation: TensorRelation) -> int:
        sid = len(self.names)
        self.names[sid] = name
        self.relations[sid] = relation
        self.tasks[sid] = []
        self.flops[sid] = 0
        return sid

    def add(self, sid: int, inputs, key, kernel, device: int, flops: int = 0,
            shape: tuple[int, ...] | None = None, dtype: str | None = None) -> ChunkRef:
        ref = ChunkRef(sid, tuple(int(k) for k in key))
        if shape is not None:
            self.sizes[ref] = math.prod(shape) * itemsize(dtype)
            self.meta[ref] = (tuple(int(n) for n in shape), dtype)
        self.tasks[sid].append(Task(id=self.next_task, inputs=tuple(inputs), output=ref,
                                    kernel=kernel, priority=float(self.next_task), flops=flops,
                                    device=device))
        self.next_task += 1
        self.flops[sid] += flops
        return ref


def _relation(labels, sizes, lay: Layout, dtype) -> TensorRelation:
    """The relation a node's chunks make up: its output labels tiled like the layout."""
    lens = lay.outputs.lens
    tiles = tuple(int(t) for t in lens.max(axis=0)) if len(lens) else ()
    return TensorRelation(tuple(labels), ChunkGrid(tuple(sizes), tiles), dtype)


def _chunked(plan: PartitionPlan, node, sub_tiles: bool) -> Layout:
    """The node's pieces, each cut into chunks no larger than the logical plan's tiles (the
    stored tiles for a scan), so that a device works in cache-sized tasks that start as their
    own chunks arrive, and a stored piece is read chunk by chunk, without reassembly."""
    target = node.chunk_target  # None: a reshape is one piece whose input region is the
    # whole input
    if not sub_tiles or target is None:
        return plan.layout(node.index)
    return plan.chunk_layout(node.index, target)


def _partitioned(plan: PartitionPlan, store: PlanReads | None, max_temp_elems: int,
                 sub_tiles: bool, fuse_bytes: int | None, min_tasks: int,
                 fired: tuple[str, ...]) -> PhysicalPlan:
    """The physical plan running ``plan`` on its devices (see the module doc)."""
    graph = plan.graph
    steps = _Steps()
    layouts = {node.index: _chunked(plan, node, sub_tiles) for node in graph.nodes}
    step_of_node: dict[int, int] = {}
    reads = _Reads(steps, graph, layouts, step_of_node,
                   plan.reads([layouts[n.index] for n in graph.nodes]), store)
    results = {graph.root, *graph.also}
    readers: dict[int, int] = {}
    for node in graph.nodes:
        for edge in node.inputs:
            readers[edge.producer] = readers.get(edge.producer, 0) + 1
    for node in graph.nodes:
        lay = layouts[node.index]
        folded = _partitioned_epilogue(node, graph, layouts, steps, step_of_node,
                                       results, readers)
        if folded is not None:
            step_of_node[node.index] = folded
            continue
        rel = _relation(node.out_labels, node.out_shape, lay, node.dtype)
        sid = steps.new_step(node.name, rel)
        step_of_node[node.index] = sid
        owners = lay.owners()
        if node.kind in ("source", "constant"):
            if node.loaded_where_read and node.index not in results:
                continue  # each reader loads its regions (_Reads.ref)
            for t in range(len(lay.device)):
                lo = tuple(int(x) for x in lay.starts[t])
                hi = tuple(int(a + b) for a, b in zip(lay.starts[t], lay.lens[t]))
                steps.add(sid, (), lay.index[t], _load_kernel(store, node, lo, hi),
                          int(lay.device[t]))
            continue
        # a reshape is one piece (its input gathered whole); any other operation's tasks run
        # the kernel its step runs on one device (an attention task: every key of its region
        # in one chunk)
        kernel = (ReshapeChunk(tuple(node.out_shape)) if node.kind == "reshape"
                  else operation_kernel(node.logical, max_temp_elems))
        partial_sid = None
        series = ContributionSeries(kernel, fuse_bytes, min_tasks)
        for t in range(len(lay.device)):
            dev = int(lay.device[t])
            refs = [reads.ref(node, k, lay, t) for k in range(len(node.inputs))]
            piece = tuple(int(x) for x in lay.index[t, : node.n_out])
            flops = int(node.flops(lay.lens[t:t + 1])[0])
            in_bytes = sum(math.prod(int(lay.lens[t, node.labels.index(a)]) for a in e.axes)
                           for e in node.inputs) * itemsize(node.dtype)
            if lay.scatter is None and owners[piece] == dev:
                series.add((sid, piece, None), dev, refs, flops, in_bytes)
                continue
            if partial_sid is None:
                partial_sid = steps.new_step(f"partials of {node.name}", rel)
            shape = tuple(int(n) for n in lay.lens[t, : node.n_out])
            series.add((partial_sid, (dev, *piece), shape), dev, refs, flops, in_bytes)
        for (task_sid, key, shape), dev, inputs, task_kernel, flops in series.tasks():
            steps.add(task_sid, inputs, key, task_kernel, dev, flops, shape=shape,
                      dtype=node.dtype if shape is not None else None)
        if lay.scatter is not None:
            _reduce_scatter(steps, node, lay, sid, partial_sid, kernel)
        else:
            for src, dst, piece in lay.partial_sends():
                steps.add(sid, (ChunkRef(partial_sid, (src, *piece)),), piece,
                          FoldPartial(node.agg, kernel), dst)
    return _assemble(plan, steps, step_of_node[graph.root],
                     tuple(step_of_node[n] for n in graph.also), fired)


def _partitioned_epilogue(node, graph, layouts: dict[int, Layout], steps: _Steps,
                          step_of_node: dict[int, int], results: set[int],
                          readers: dict[int, int]) -> int | None:
    """Fold activation map ``node`` into the tasks of the product it reads, as on one device
    (:meth:`_OneDevice._epilogue`): when the product is read by ``node`` alone and is no
    result (``node`` may be one), each of its output chunks is made by one task on its owner
    (no partials), and ``node``'s pieces are those chunks, on the same devices. Returns the
    product's step (now ``node``'s too), or None when not folded. The MLP on two CPU devices:
    ``relu(X @ W1)`` no longer reads and writes each device's 2048 x 2048 piece again in a
    task of its own."""
    if not (node.kind == "map" and node.fn in EPILOGUE_MAPS and node.dtype in _FLOAT_DTYPES
            and len(node.inputs) == 1):
        return None
    edge = node.inputs[0]
    product = graph.nodes[edge.producer]
    if not (product.kind == "einsum" and product.join == JoinName.MUL
            and product.agg == AggName.SUM and len(product.inputs) == 2
            and product.dtype == node.dtype and product.index not in results
            and readers.get(product.index) == 1 and tuple(edge.axes) == node.out_labels
            and product.index in step_of_node):
        return None
    psid = step_of_node[product.index]
    tasks = steps.tasks[psid]
    made = {t.output.key: t for t in tasks}
    if len(made) != len(tasks) or not all(
            isinstance(t.kernel, (ContractChunk, ContractSeries, ContractWhole))
            for t in tasks):
        return None
    lay, play = layouts[node.index], layouts[product.index]
    extents = play.extents()
    n = node.n_out
    if len(lay.device) != len(made):
        return None
    for t in range(len(lay.device)):
        lo = tuple(int(x) for x in lay.starts[t, :n])
        hi = tuple(int(a + b) for a, b in zip(lay.starts[t, :n], lay.lens[t, :n]))
        sources = play.sources_of(lo, hi)
        if len(sources) != 1 or extents[sources[0][0]] != (lo, hi):
            return None
        task = made.get(sources[0][0])
        if task is None or task.device != int(lay.device[t]):
            return None
    extra = 0
    for i, t in enumerate(tasks):
        elems = math.prod(b - a for a, b in zip(*extents[t.output.key]))
        extra += elems
        tasks[i] = dataclasses.replace(
            t, kernel=ContractEpilogue(t.kernel, node.fn, node.scalar, node.dtype),
            flops=t.flops + elems)
    steps.flops[psid] += extra
    steps.names[psid] = f"{node.name} <- {steps.names[psid]}"
    return psid


def _reduce_scatter(steps: _Steps, node, lay: Layout, sid: int, partial_sid: int,
                    kernel: ContractChunk) -> None:
    """The folds of a reduce-scatter: every device holding a partial of a task piece sends
    each part of it that another device owns (cut out on the holder: only the part travels)
    and folds its own part straight from its partial."""
    n_out = node.n_out
    s, f = lay.scatter
    holders: dict[tuple[int, ...], list[int]] = {}
    piece_lo: dict[tuple[int, ...], np.ndarray] = {}
    for t in range(len(lay.device)):
        piece = tuple(int(x) for x in lay.index[t, :n_out])
        piece_lo.setdefault(piece, lay.starts[t, :n_out])
        if int(lay.device[t]) not in holders.setdefault(piece, []):
            holders[piece].append(int(lay.device[t]))
    out = lay.outputs
    cut_sid = None
    for q, part in enumerate(out.keys()):
        owner = int(out.device[q])
        piece = part[:s] + (part[s] // f,) + part[s + 1:]
        lo = out.starts[q] - piece_lo[piece]
        within = tuple(slice(int(a), int(a + n)) for a, n in zip(lo, out.lens[q]))
        shape = tuple(int(n) for n in out.lens[q])
        for holder in holders[piece]:
            partial = ChunkRef(partial_sid, (holder, *piece))
            if holder == owner:
                steps.add(sid, (partial,), part, FoldPartial(node.agg, kernel, within), owner)
                continue
            if cut_sid is None:
                cut_sid = steps.new_step(f"reduce-scatter parts of {node.name}",
                                         steps.relations[sid])
            cut = steps.add(cut_sid, (partial,), (holder, *part), SliceChunk(within), holder,
                            shape=shape, dtype=node.dtype)
            steps.add(sid, (cut,), part, FoldPartial(node.agg, kernel), owner)


def _load_kernel(store: PlanReads | None, node, lo: tuple[int, ...],
                 hi: tuple[int, ...]) -> ConstChunk | LoadPiece:
    """The kernel reading region ``[lo, hi)`` of a scan node: a view of a constant, or the
    region of a stored tensor (through the store's cache)."""
    if node.kind == "constant":
        return ConstChunk(node.logical.constant, tuple(slice(a, b) for a, b in zip(lo, hi)))
    return LoadPiece.of_region(store, node.logical, lo, hi)


class _Reads:
    """The chunk a task reads for one operand: the producer's piece itself, or a region put
    together on the task's device from its own pieces, whole pieces it is sent, and slices cut
    by their holders (see :meth:`~tensorql.optimizer.plan.PartitionPlan.reads`). Regions,
    whole pieces and slices are shared by every operation on the device reading the same
    producer."""

    def __init__(self, steps: _Steps, graph, layouts: dict[int, Layout],
                 step_of_node: dict[int, int], reads: dict,
                 store: PlanReads | None = None) -> None:
        self.store = store
        self.loads: dict[tuple, ChunkRef] = {}
        self.steps = steps
        self.graph = graph
        self.layouts = layouts
        self.step_of_node = step_of_node
        self.reads = reads
        self.extents = {}
        self.assembled: dict[tuple, ChunkRef] = {}
        self.slices: dict[tuple, ChunkRef] = {}
        self.assemble_sid: dict[int, int] = {}
        self.slice_sid: dict[int, int] = {}

    def ref(self, node, k: int, lay: Layout, t: int) -> ChunkRef:
        edge = node.inputs[k]
        producer = self.layouts[edge.producer]
        if edge.producer not in self.extents:
            self.extents[edge.producer] = producer.extents()
        extents = self.extents[edge.producer]
        axes = [node.labels.index(a) for a in edge.axes]
        dev = int(lay.device[t])
        lo = tuple(int(x) for x in lay.starts[t, axes])
        hi = tuple(int(a + b) for a, b in zip(lay.starts[t, axes], lay.lens[t, axes]))
        pstep = self.step_of_node[edge.producer]
        if self.graph.nodes[edge.producer].loaded_where_read:
            return self._load(edge.producer, pstep, dev, lo, hi)
        sources = producer.sources_of(lo, hi)
        if len(sources) == 1 and extents[sources[0][0]] == (lo, hi):
            return ChunkRef(pstep, sources[0][0])  # exactly one piece
        key = (edge.producer, dev, lo, hi)
        if key in self.assembled:
            return self.assembled[key]
        whole = self.reads[(edge.producer, dev)].whole
        inputs, parts = [], []
        for piece, owner, olo, ohi in sources:
            plo = extents[piece][0]
            src = tuple(slice(a - p, b - p) for a, b, p in zip(olo, ohi, plo))
            dst = tuple(slice(a - r, b - r) for a, b, r in zip(olo, ohi, lo))
            if owner == dev or piece in whole:  # held here, or sent here whole anyway
                inputs.append(ChunkRef(pstep, piece))
                parts.append((src, dst))
            else:
                inputs.append(self._slice(edge.producer, pstep, piece, owner, dev, olo, ohi,
                                          src))
                parts.append((tuple(slice(None) for _ in src), dst))
        node_p = self.graph.nodes[edge.producer]
        if edge.producer not in self.assemble_sid:
            self.assemble_sid[edge.producer] = self.steps.new_step(
                f"assemble regions of {node_p.name}", self.steps.relations[pstep])
        shape = tuple(b - a for a, b in zip(lo, hi))
        ref = self.steps.add(self.assemble_sid[edge.producer], inputs,
                             (dev, len(self.assembled)), RekeyChunk(shape, tuple(parts)), dev,
                             shape=shape, dtype=node_p.dtype)
        self.assembled[key] = ref
        return ref

    def _load(self, producer: int, pstep: int, dev: int, lo, hi) -> ChunkRef:
        """Region ``[lo, hi)`` of a stored tensor or constant, loaded on ``dev`` (once)."""
        key = (producer, dev, lo, hi)
        if key not in self.loads:
            node = self.graph.nodes[producer]
            self.loads[key] = self.steps.add(
                pstep, (), (dev, len(self.loads)), _load_kernel(self.store, node, lo, hi), dev,
                shape=tuple(b - a for a, b in zip(lo, hi)), dtype=node.dtype)
        return self.loads[key]

    def _slice(self, producer: int, pstep: int, piece, owner: int, dev: int, olo, ohi,
               src) -> ChunkRef:
        key = (producer, dev, piece, olo, ohi)
        if key not in self.slices:
            node_p = self.graph.nodes[producer]
            if producer not in self.slice_sid:
                self.slice_sid[producer] = self.steps.new_step(
                    f"slices of {node_p.name}", self.steps.relations[pstep])
            self.slices[key] = self.steps.add(
                self.slice_sid[producer], (ChunkRef(pstep, piece),), (dev, len(self.slices)),
                SliceChunk(src), owner, shape=tuple(b - a for a, b in zip(olo, ohi)),
                dtype=node_p.dtype)
        return self.slices[key]


def _assemble(plan: PartitionPlan, steps: _Steps, root_sid: int,
              also_sids: tuple[int, ...] = (), fired: tuple[str, ...] = ()) -> PhysicalPlan:
    out = []
    for sid, name in steps.names.items():
        rel = steps.relations[sid]
        tasks = tuple(steps.tasks[sid])
        out.append(Step(sid, name, (), tasks, steps.flops[sid], 0, rel.nbytes, output=rel))
    return PhysicalPlan(root=plan.graph.logical, steps=tuple(out), step_of={},
                        result_id=root_sid, partition=plan, chunk_sizes=steps.sizes,
                        chunk_meta=steps.meta, also_ids=also_sids, rules_fired=fired)


__all__ = ["ContributionSeries", "WholeK", "build"]
