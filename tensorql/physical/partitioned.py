"""The physical plan of a partitioned query: every task on the device the optimizer chose.

:func:`build_partitioned` turns a :class:`~tensorql.optimizer.plan.PartitionPlan` into a
:class:`~tensorql.physical.planner.PhysicalPlan` whose tasks carry ``device``. A partitioned
operation's chunks are its pieces (the cost model cuts pieces like a chunk grid), one task per
piece combination, placed by the plan's layout. Data moves between devices only through the
runtime's copies, and only the bytes the cost model predicts:

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

>>> import numpy as np, tensorql as tq
>>> from tensorql.optimizer import optimize
>>> db = tq.connect()
>>> x = db.from_numpy("x", np.arange(12.0).reshape(3, 4))
>>> plan = optimize(x @ x.T, devices=3)
>>> physical = build_partitioned(plan, db.chunk_store)
>>> sorted({t.device for s in physical.steps for t in s.tasks})
[0, 1, 2]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tensorql.dtypes import itemsize
from tensorql.exec.taskgraph import ChunkRef, Task
from tensorql.grid import ChunkGrid
from tensorql.logical.plan import Aggregate, TensorRelation
from tensorql.optimizer.cost import (
    Layout,
    device_reads,
    piece_extents,
    refine,
    region_sources,
    sub_tile,
)
from tensorql.optimizer.plan import PartitionPlan
from tensorql.physical.attention import attention_kernel
from tensorql.physical.kernels import (
    ConstChunk,
    ContractChunk,
    LoadPiece,
    MapChunk,
    RekeyChunk,
    ReshapeChunk,
    SoftmaxChunk,
    pointwise_kernel,
)
from tensorql.physical.planner import ContributionSeries, PhysicalPlan, Step
from tensorql.storage.chunk_store import ChunkStore


@dataclass(frozen=True, eq=False)
class SliceChunk:
    """Cut ``slices`` out of one chunk (on the device holding it, before it is sent)."""

    slices: tuple[slice, ...]

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        return inputs[0][self.slices].clone(memory_format=torch.contiguous_format)

    def combine(self, acc: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a slice is cut once")


@dataclass(frozen=True, eq=False)
class FoldPartial:
    """Fold a partial aggregate (received from another device, or the part ``slices`` of a
    partial held here) into its output chunk."""

    agg: str
    kernel: ContractChunk
    slices: tuple[slice, ...] | None = None

    def _part(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        return inputs[0] if self.slices is None else inputs[0][self.slices]

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        if acc is None:
            return self._part(inputs).clone(memory_format=torch.contiguous_format)
        return self.kernel.combine(acc, self._part(inputs))

    def run_into(self, inputs: Sequence[torch.Tensor], dest: torch.Tensor) -> torch.Tensor:
        """The first contribution, copied straight into ``dest`` (a tile of a dense result)."""
        part = self._part(inputs)
        if part.shape != dest.shape or part.dtype != dest.dtype:
            return self.run(inputs, None)
        return dest.copy_(part)

    def combine(self, acc: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        return self.kernel.combine(acc, partial)


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
    lay = plan.layout(node.index)
    if not sub_tiles or node.logical is None or node.kind == "reshape" or lay.scatter:
        return lay  # a reshape is one piece whose input region is the whole input; a
        # reduce-scatter's parts are cut from whole pieces
    logical = node.logical.input if isinstance(node.logical, Aggregate) else node.logical
    rel = logical.relation
    target = dict(zip(rel.labels, rel.grid.tile))
    for edge in node.inputs:  # a diagonal reads blocks of its pieces whole: keep those whole
        for lab in edge.axes:
            if edge.axes.count(lab) > 1:
                target[lab] = 1 << 62
    tiles = tuple(sub_tile(-(-n // p), target.get(lab, n))
                  for lab, n, p in zip(node.labels, node.sizes, lay.pieces))
    if tiles == tuple(-(-n // p) for n, p in zip(node.sizes, lay.pieces)):
        return lay
    return refine(lay, node.sizes, tiles, plan.devices)


def build_partitioned(plan: PartitionPlan, store: ChunkStore | None,
                      max_temp_elems: int = 1 << 24, sub_tiles: bool = True,
                      fuse_bytes: int | None = None, min_tasks: int = 2,
                      fired: tuple[str, ...] = ()) -> PhysicalPlan:
    """The physical plan running ``plan`` on its devices (see the module docstring); with
    ``sub_tiles`` each piece is cut into the logical plan's tiles (same bytes moved).

    The contributions of one device to one output chunk (the tiles of a contracted label)
    run as one task (:class:`ContractSeries`) while its inputs total at most ``fuse_bytes``
    (None: no bound), keeping ``min_tasks`` tasks a device (see
    :class:`~tensorql.physical.planner.ContributionSeries`). ``fired``: the logical rewrite
    rules that made the plan partitioned (for EXPLAIN)."""
    graph = plan.graph
    steps = _Steps()
    layouts = {node.index: _chunked(plan, node, sub_tiles) for node in graph.nodes}
    step_of_node: dict[int, int] = {}
    reads = _Reads(steps, graph, layouts, step_of_node,
                   device_reads(graph, [layouts[n.index] for n in graph.nodes]), store)
    results = {graph.root, *graph.also}
    for node in graph.nodes:
        lay = layouts[node.index]
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
        if node.kind == "map":
            kernel = MapChunk(node.fn, node.scalar, node.dtype)
        elif node.kind == "pointwise":
            kernel = pointwise_kernel(node.logical, max_temp_elems)
        elif node.kind == "attention":  # every key of a task's region in one chunk
            kernel = attention_kernel(node.logical)
        elif node.kind == "reshape":
            kernel = ReshapeChunk(tuple(node.out_shape))
        elif node.kind == "softmax":
            kernel = SoftmaxChunk(node.labels.index(node.whole[0]), node.fn == "log_softmax",
                                  node.dtype)
        else:
            kernel = ContractChunk(in_labels=tuple(e.axes for e in node.inputs),
                                   out_labels=node.out_labels, join=node.join, agg=node.agg,
                                   dtype=node.dtype, max_temp_elems=max_temp_elems)
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


def _load_kernel(store: ChunkStore | None, node, lo: tuple[int, ...],
                 hi: tuple[int, ...]) -> ConstChunk | LoadPiece:
    """The kernel reading region ``[lo, hi)`` of a scan node: a view of a constant, or the
    region of a stored tensor (through the store's cache)."""
    if node.kind == "constant":
        return ConstChunk(node.logical.constant, tuple(slice(a, b) for a, b in zip(lo, hi)))
    return LoadPiece.of_region(store, node.logical, lo, hi)


class _Reads:
    """The chunk a task reads for one operand: the producer's piece itself, or a region put
    together on the task's device from its own pieces, whole pieces it is sent, and slices cut
    by their holders (see :func:`~tensorql.optimizer.cost.device_reads`). Regions, whole pieces
    and slices are shared by every operation on the device reading the same producer."""

    def __init__(self, steps: _Steps, graph, layouts: dict[int, Layout],
                 step_of_node: dict[int, int], reads: dict,
                 store: ChunkStore | None = None) -> None:
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
            self.extents[edge.producer] = piece_extents(producer)
        extents = self.extents[edge.producer]
        axes = [node.labels.index(a) for a in edge.axes]
        dev = int(lay.device[t])
        lo = tuple(int(x) for x in lay.starts[t, axes])
        hi = tuple(int(a + b) for a, b in zip(lay.starts[t, axes], lay.lens[t, axes]))
        pstep = self.step_of_node[edge.producer]
        if self.graph.nodes[edge.producer].loaded_where_read:
            return self._load(edge.producer, pstep, dev, lo, hi)
        sources = region_sources(producer, lo, hi)
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


__all__ = ["FoldPartial", "LoadPiece", "SliceChunk", "build_partitioned"]
