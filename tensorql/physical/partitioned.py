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
  locally, and a **reduce** task on the owner folds in the one partial it receives;
* stored pieces are read by the device that holds them (each reads only its own chunks).

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

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tensorql.dtypes import itemsize, torch_dtype
from tensorql.exec.taskgraph import ChunkRef, Task
from tensorql.grid import ChunkGrid
from tensorql.logical.plan import TensorRelation
from tensorql.optimizer.cost import Layout, region_sources
from tensorql.optimizer.plan import PartitionPlan
from tensorql.physical.kernels import ConstChunk, ContractChunk, MapChunk, RekeyChunk
from tensorql.physical.planner import PhysicalPlan, Step
from tensorql.storage.chunk_store import ChunkStore


@dataclass(frozen=True, eq=False)
class LoadPiece:
    """Assemble one piece ``[lo, hi)`` of a stored tensor from the chunks it overlaps."""

    store: ChunkStore
    name: str
    grid: ChunkGrid
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    dtype: str

    @property
    def bytes_read(self) -> int:
        return math.prod(b - a for a, b in zip(self.lo, self.hi)) * itemsize(self.dtype)

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        spans = [range(lo // t, (hi - 1) // t + 1)
                 for lo, hi, t in zip(self.lo, self.hi, self.grid.tile)]
        keys = list(itertools.product(*spans))
        if len(keys) == 1 and self.grid.slices(keys[0]) == tuple(
                slice(a, b) for a, b in zip(self.lo, self.hi)):
            return self.store.read_chunk(self.name, keys[0])  # the piece is one stored chunk
        out = torch.empty(tuple(b - a for a, b in zip(self.lo, self.hi)),
                          dtype=torch_dtype(self.dtype))
        for key in keys:
            chunk = self.store.read_chunk(self.name, key)
            src, dst = [], []
            for d, b in enumerate(key):
                blo, bhi = self.grid.dim_extent(d, b)
                s, e = max(self.lo[d], blo), min(self.hi[d], bhi)
                src.append(slice(s - blo, e - blo))
                dst.append(slice(s - self.lo[d], e - self.lo[d]))
            out[tuple(dst)] = chunk[tuple(src)]
        return out

    def combine(self, acc: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a piece is loaded once")


@dataclass(frozen=True, eq=False)
class SliceChunk:
    """Cut ``slices`` out of one chunk (on the device holding it, before it is sent)."""

    slices: tuple[slice, ...]

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        return inputs[0][self.slices].contiguous().clone()

    def combine(self, acc: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a slice is cut once")


@dataclass(frozen=True, eq=False)
class FoldPartial:
    """Fold a partial aggregate received from another device into its output chunk."""

    agg: str
    kernel: ContractChunk

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        if acc is None:
            return inputs[0].clone()
        return self.kernel.combine(acc, inputs[0])

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
        self.next_task = 0

    def new_step(self, name: str, relation: TensorRelation) -> int:
        sid = len(self.names)
        self.names[sid] = name
        self.relations[sid] = relation
        self.tasks[sid] = []
        self.flops[sid] = 0
        return sid

    def add(self, sid: int, inputs, key, kernel, device: int, flops: int = 0,
            nbytes: int | None = None) -> ChunkRef:
        ref = ChunkRef(sid, tuple(int(k) for k in key))
        if nbytes is not None:
            self.sizes[ref] = nbytes
        self.tasks[sid].append(Task(id=self.next_task, inputs=tuple(inputs), output=ref,
                                    kernel=kernel, priority=float(self.next_task), flops=flops,
                                    device=device))
        self.next_task += 1
        self.flops[sid] += flops
        return ref


def _relation(labels, sizes, pieces, dtype) -> TensorRelation:
    tiles = tuple(-(-n // p) for n, p in zip(sizes, pieces))
    return TensorRelation(tuple(labels), ChunkGrid(tuple(sizes), tiles), dtype)


def build_partitioned(plan: PartitionPlan, store: ChunkStore | None,
                      max_temp_elems: int = 1 << 24) -> PhysicalPlan:
    """The physical plan running ``plan`` on its devices (see the module docstring)."""
    graph = plan.graph
    steps = _Steps()
    layouts: dict[int, Layout] = {}
    step_of_node: dict[int, int] = {}
    for node in graph.nodes:
        lay = plan.layout(node.index)
        layouts[node.index] = lay
        out_pieces = lay.pieces[: node.n_out]
        rel = _relation(node.out_labels, node.out_shape, out_pieces, node.dtype)
        sid = steps.new_step(node.name, rel)
        step_of_node[node.index] = sid
        owners = lay.owners()
        if node.kind in ("source", "constant"):
            scan = node.logical
            for t in range(len(lay.device)):
                lo = tuple(int(x) for x in lay.starts[t])
                hi = tuple(int(a + b) for a, b in zip(lay.starts[t], lay.lens[t]))
                if node.kind == "constant":
                    kernel = ConstChunk(scan.constant[tuple(slice(a, b) for a, b in zip(lo, hi))])
                else:
                    kernel = LoadPiece(store, scan.source, scan.relation.grid, lo, hi,
                                       node.dtype)
                steps.add(sid, (), lay.index[t], kernel, int(lay.device[t]))
            continue
        if node.kind == "map":
            kernel = MapChunk(node.fn, node.scalar, node.dtype)
        else:
            kernel = ContractChunk(in_labels=tuple(e.axes for e in node.inputs),
                                   out_labels=node.out_labels, join=node.join, agg=node.agg,
                                   dtype=node.dtype, max_temp_elems=max_temp_elems)
        readers = [_OperandReader(steps, graph, node, k, layouts[e.producer],
                                  step_of_node[e.producer])
                   for k, e in enumerate(node.inputs)]
        partial_sid = None
        work = max(1, len(node.inputs))
        for t in range(len(lay.device)):
            dev = int(lay.device[t])
            refs = [reader.ref(lay, t) for reader in readers]
            piece = tuple(int(x) for x in lay.index[t, : node.n_out])
            flops = int(np.prod(lay.lens[t])) * work
            if owners[piece] == dev:
                steps.add(sid, refs, piece, kernel, dev, flops)
                continue
            if partial_sid is None:
                partial_sid = steps.new_step(f"partials of {node.name}", rel)
            steps.add(partial_sid, refs, (dev, *piece), kernel, dev, flops,
                      nbytes=int(np.prod(lay.lens[t, : node.n_out])) * itemsize(node.dtype))
        for src, dst, piece in lay.partial_sends():
            steps.add(sid, (ChunkRef(partial_sid, (src, *piece)),), piece,
                      FoldPartial(node.agg, kernel), dst)
    return _assemble(plan, steps, step_of_node[graph.root])


class _OperandReader:
    """The chunk a task reads for one operand: the producer's piece itself, or a region put
    together on the task's device from local pieces and slices sent by their holders."""

    def __init__(self, steps: _Steps, graph, node, k: int, producer: Layout,
                 producer_step: int) -> None:
        self.steps = steps
        self.node = node
        self.edge = node.inputs[k]
        self.axes = [node.labels.index(a) for a in self.edge.axes]
        self.producer = producer
        self.producer_step = producer_step
        prod_node = graph.nodes[self.edge.producer]
        self.dtype = prod_node.dtype
        self.what = f"operand {k} of {node.name}"
        self.assembled: dict[tuple, ChunkRef] = {}
        self.slices: dict[tuple, ChunkRef] = {}
        self.assemble_sid: int | None = None
        self.slice_sid: int | None = None
        self.piece_bounds = {tuple(int(x) for x in producer.index[t, :producer.n_out]):
                             (producer.starts[t, :producer.n_out],
                              producer.starts[t, :producer.n_out]
                              + producer.lens[t, :producer.n_out])
                             for t in np.flatnonzero(producer.owner_mask)}

    def ref(self, lay: Layout, t: int) -> ChunkRef:
        dev = int(lay.device[t])
        lo = lay.starts[t, self.axes]
        hi = lo + lay.lens[t, self.axes]
        region = tuple(int(x) for x in lay.index[t, self.axes])
        sources = region_sources(self.producer, lo, hi)
        if len(sources) == 1:
            piece, _, olo, ohi = sources[0]
            plo, phi = self.piece_bounds[piece]
            if tuple(olo) == tuple(int(x) for x in plo) and \
                    tuple(ohi) == tuple(int(x) for x in phi) and \
                    tuple(olo) == tuple(int(x) for x in lo) and \
                    tuple(ohi) == tuple(int(x) for x in hi):
                return ChunkRef(self.producer_step, piece)  # exactly one piece
        key = (dev, *region)
        if key in self.assembled:
            return self.assembled[key]
        inputs, parts = [], []
        for piece, owner, olo, ohi in sources:
            plo, phi = self.piece_bounds[piece]
            src = tuple(slice(a - int(p), b - int(p)) for a, b, p in zip(olo, ohi, plo))
            dst = tuple(slice(a - int(r), b - int(r)) for a, b, r in zip(olo, ohi, lo))
            whole = tuple(olo) == tuple(int(x) for x in plo) and \
                tuple(ohi) == tuple(int(x) for x in phi)
            if owner == dev or whole:
                inputs.append(ChunkRef(self.producer_step, piece))
                parts.append((src, dst))
                continue
            inputs.append(self._slice(piece, owner, dev, region, src))
            parts.append((tuple(slice(None) for _ in src), dst))
        if self.assemble_sid is None:
            rel = self.steps.relations[self.producer_step]
            self.assemble_sid = self.steps.new_step(f"assemble {self.what}", rel)
        shape = tuple(int(b - a) for a, b in zip(lo, hi))
        ref = self.steps.add(self.assemble_sid, inputs, key, RekeyChunk(shape, tuple(parts)),
                             dev, nbytes=math.prod(shape) * itemsize(self.dtype))
        self.assembled[key] = ref
        return ref

    def _slice(self, piece, owner: int, dev: int, region, src) -> ChunkRef:
        key = (dev, *region, *piece)
        if key not in self.slices:
            if self.slice_sid is None:
                rel = self.steps.relations[self.producer_step]
                self.slice_sid = self.steps.new_step(f"slice for {self.what}", rel)
            nbytes = math.prod(s.stop - s.start for s in src) * itemsize(self.dtype)
            self.slices[key] = self.steps.add(
                self.slice_sid, (ChunkRef(self.producer_step, piece),), key,
                SliceChunk(src), owner, nbytes=nbytes)
        return self.slices[key]


def _assemble(plan: PartitionPlan, steps: _Steps, root_sid: int) -> PhysicalPlan:
    out = []
    for sid, name in steps.names.items():
        rel = steps.relations[sid]
        tasks = tuple(steps.tasks[sid])
        out.append(Step(sid, name, (), tasks, steps.flops[sid], 0, rel.nbytes, output=rel))
    return PhysicalPlan(root=plan.graph.logical, steps=tuple(out), step_of={},
                        result_id=root_sid, partition=plan, chunk_sizes=steps.sizes)


__all__ = ["FoldPartial", "LoadPiece", "SliceChunk", "build_partitioned"]
