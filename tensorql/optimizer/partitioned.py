"""Run a :class:`PartitionPlan` on N devices and count the bytes that cross between them.

Every node of the plan is tiled by its pieces (the chunk grid's blocks *are* the pieces): one
task per piece combination, placed by the cost model's rule (task ``r`` of ``M`` on device
``r * N // M``; an output chunk lives with its task whose aggregated pieces are all 0). A task
reads an operand piece directly when the producer made exactly that piece; otherwise a rekey
task on the reader's device assembles the region from the producer's pieces. Tasks run on the
ordinary :class:`~tensorql.exec.executor.Executor` (its threads stand in for the devices)
with kernels from :mod:`tensorql.physical.kernels`, each wrapped by :class:`Placed`, which
counts at run time the bytes of every input it reads from another device and of every
partial aggregate it sends to the output chunk's owner.

>>> import numpy as np, tensorql as tq
>>> db = tq.connect()
>>> x = db.from_numpy("x", np.arange(12.0).reshape(3, 4))
>>> plan = tq.optimize(x @ x.T, devices=3)
>>> run = execute(plan, db.chunk_store)
>>> bool(np.allclose(run.value.numpy(), (x @ x.T).numpy()))
True
>>> run.bytes_moved == plan.cost.bytes_moved
True
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tensorql.dtypes import torch_dtype
from tensorql.exec.executor import Executor, RunStats
from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph
from tensorql.grid import ChunkGrid
from tensorql.optimizer.cost import device_of, piece_bounds
from tensorql.optimizer.plan import PartitionPlan
from tensorql.physical.kernels import ConstChunk, ContractChunk, MapChunk, RekeyChunk
from tensorql.storage.chunk_store import ChunkStore


class TransferCounter:
    """Thread-safe tally of bytes sent from one device to another."""

    def __init__(self, devices: int) -> None:
        self.devices = devices
        self.matrix = [[0] * devices for _ in range(devices)]
        self._lock = threading.Lock()

    def add(self, src: int, dst: int, nbytes: int) -> None:
        with self._lock:
            self.matrix[src][dst] += int(nbytes)

    @property
    def total(self) -> int:
        return sum(map(sum, self.matrix))


@dataclass(frozen=True, eq=False)
class Placed:
    """A kernel run on ``device``: counts remote input bytes and partials sent to ``owner``.

    ``sources[n]`` is the device holding input ``n`` (``-1``: the chunk store, not counted);
    ``slices[n]`` the part of it the kernel uses (None: all of it).
    """

    inner: object
    device: int
    owner: int
    sources: tuple[int, ...]
    counter: TransferCounter
    slices: tuple[tuple[slice, ...] | None, ...] = ()

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        for n, (chunk, src) in enumerate(zip(inputs, self.sources)):
            if src >= 0 and src != self.device:
                part = chunk[self.slices[n]] if self.slices and self.slices[n] else chunk
                self.counter.add(src, self.device, part.nbytes)
        if self.owner == self.device:
            return self.inner.run(inputs, acc)
        partial = self.inner.run(inputs, None)
        self.counter.add(self.device, self.owner, partial.nbytes)
        return partial if acc is None else self.inner.combine(acc, partial)

    def combine(self, acc: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        return self.inner.combine(acc, partial)


@dataclass(frozen=True, eq=False)
class LoadPiece:
    """Assemble one piece ``[lo, hi)`` of a stored tensor from the chunks it overlaps."""

    store: ChunkStore
    name: str
    grid: ChunkGrid
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    dtype: str

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty(tuple(b - a for a, b in zip(self.lo, self.hi)),
                          dtype=torch_dtype(self.dtype))
        spans = [range(lo // t, (hi - 1) // t + 1)
                 for lo, hi, t in zip(self.lo, self.hi, self.grid.tile)]
        for key in itertools.product(*spans):
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


@dataclass(frozen=True)
class _Pieces:
    """A node's output pieces: bounds per axis and the owner device of each piece key."""

    step: int
    bounds: tuple[tuple[int, ...], ...]
    owner: dict[tuple[int, ...], int]


@dataclass(frozen=True, eq=False)
class PartitionedGraph:
    """The task graph of a partitioned plan, where each task runs and where chunks live."""

    graph: TaskGraph
    placement: dict[int, int]
    counter: TransferCounter
    result: _Pieces
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, eq=False)
class PartitionedRun:
    """The dense result, bytes counted between devices (``moved[src][dst]``) and run stats."""

    value: torch.Tensor
    bytes_moved: int
    moved: tuple[tuple[int, ...], ...]
    stats: RunStats = field(repr=False)
    tasks_per_device: tuple[int, ...] = ()


def build(plan: PartitionPlan, store: ChunkStore | None,
          max_temp_elems: int = 1 << 24) -> PartitionedGraph:
    """The :class:`PartitionedGraph` of ``plan`` (``store`` holds its stored tensors)."""
    graph = plan.graph
    n_dev = plan.devices
    counter = TransferCounter(n_dev)
    tasks: list[Task] = []
    placement: dict[int, int] = {}
    pieces: dict[int, _Pieces] = {}
    next_step = len(graph.nodes)

    def new_task(inputs, output, kernel, device) -> None:
        task = Task(id=len(tasks), inputs=tuple(inputs), output=output, kernel=kernel,
                    priority=float(len(tasks)))
        tasks.append(task)
        placement[task.id] = device

    for node in graph.nodes:
        cand = plan.ops[node.index].pieces
        bounds = tuple(piece_bounds(n, p) for n, p in zip(node.sizes, cand))
        m = math.prod(cand)
        owner: dict[tuple[int, ...], int] = {}
        for rank, idx in enumerate(itertools.product(*(range(p) for p in cand))):
            if all(i == 0 for i in idx[node.n_out:]):
                owner[idx[: node.n_out]] = device_of(rank, m, n_dev)
        pieces[node.index] = _Pieces(node.index, bounds[: node.n_out], owner)
        for rank, idx in enumerate(itertools.product(*(range(p) for p in cand))):
            device = device_of(rank, m, n_dev)
            lo = tuple(b[i] for b, i in zip(bounds, idx))
            hi = tuple(b[i + 1] for b, i in zip(bounds, idx))
            out_key = idx[: node.n_out]
            out_ref = ChunkRef(node.index, out_key)
            if node.kind in ("source", "constant"):
                sl = tuple(slice(a, b) for a, b in zip(lo, hi))
                if node.kind == "constant":
                    kernel = ConstChunk(node.node.value[sl])
                else:
                    src = node.node
                    kernel = LoadPiece(store, src.name, src.grid, lo, hi, node.dtype)
                new_task((), out_ref, Placed(kernel, device, device, (), counter), device)
                continue
            refs, sources = [], []
            for k, edge in enumerate(node.inputs):
                prod = pieces[edge.producer]
                axes = [node.labels.index(a) for a in edge.axes]
                rlo = [lo[a] for a in axes]
                rhi = [hi[a] for a in axes]
                spans = []
                for j, pb in enumerate(prod.bounds):
                    spans.append([b for b in range(len(pb) - 1)
                                  if pb[b] < rhi[j] and pb[b + 1] > rlo[j]])
                exact = all(len(s) == 1 and prod.bounds[j][s[0]] == rlo[j]
                            and prod.bounds[j][s[0] + 1] == rhi[j] for j, s in enumerate(spans))
                if exact:
                    key = tuple(s[0] for s in spans)
                    refs.append(ChunkRef(prod.step, key))
                    sources.append(prod.owner[key])
                    continue
                rekey_step = next_step + k
                in_refs, in_src, parts, src_slices = [], [], [], []
                for key in itertools.product(*spans):
                    s_sl, d_sl = [], []
                    for j, b in enumerate(key):
                        blo, bhi = prod.bounds[j][b], prod.bounds[j][b + 1]
                        s, e = max(rlo[j], blo), min(rhi[j], bhi)
                        s_sl.append(slice(s - blo, e - blo))
                        d_sl.append(slice(s - rlo[j], e - rlo[j]))
                    in_refs.append(ChunkRef(prod.step, key))
                    in_src.append(prod.owner[key])
                    parts.append((tuple(s_sl), tuple(d_sl)))
                    src_slices.append(tuple(s_sl))
                shape = tuple(b - a for a, b in zip(rlo, rhi))
                rekey = Placed(RekeyChunk(shape, tuple(parts)), device, device, tuple(in_src),
                               counter, tuple(src_slices))
                ref = ChunkRef(rekey_step, idx)
                new_task(in_refs, ref, rekey, device)
                refs.append(ref)
                sources.append(device)
            if node.kind == "map":
                kernel = MapChunk(node.fn, node.scalar, node.dtype)
            else:
                kernel = ContractChunk(in_labels=tuple(e.axes for e in node.inputs),
                                       out_labels=node.out_labels, join=node.join,
                                       agg=node.agg, dtype=node.dtype,
                                       max_temp_elems=max_temp_elems)
            new_task(refs, out_ref, Placed(kernel, device, owner[out_key], tuple(sources),
                                           counter), device)
        next_step += len(node.inputs)
    root = graph.nodes[graph.root]
    task_graph = TaskGraph(tasks=tuple(tasks), retain=frozenset({root.index}),
                           step_names={n.index: n.name for n in graph.nodes})
    return PartitionedGraph(task_graph, placement, counter, pieces[root.index],
                            root.out_shape, root.dtype)


def execute(plan: PartitionPlan, store: ChunkStore | None, workers: int | None = None
            ) -> PartitionedRun:
    """Run ``plan`` with one worker thread per device (or ``workers``); count bytes moved."""
    built = build(plan, store)
    executor = Executor(workers or plan.devices, 1)
    result = executor.run(built.graph)
    out = torch.empty(built.shape, dtype=torch_dtype(built.dtype))
    res = built.result
    for key in itertools.product(*(range(len(b) - 1) for b in res.bounds)):
        sl = tuple(slice(b[i], b[i + 1]) for b, i in zip(res.bounds, key))
        out[sl] = result.outputs[ChunkRef(res.step, key)]
    per_device = [0] * plan.devices
    for device in built.placement.values():
        per_device[device] += 1
    return PartitionedRun(value=out, bytes_moved=built.counter.total,
                          moved=tuple(tuple(r) for r in built.counter.matrix),
                          stats=result.stats, tasks_per_device=tuple(per_device))


__all__ = ["LoadPiece", "PartitionedGraph", "PartitionedRun", "Placed", "TransferCounter",
           "build", "execute"]
