"""The cost model: FLOPs of the busiest device, bytes moved between devices, peak bytes.

A partition vector gives every label of an operation a number of pieces; a label of size ``n``
in ``p`` pieces has pieces ``[k*n//p, (k+1)*n//p)`` (sizes differ by at most one). The op runs
one task per combination of pieces. Placement is fixed by a single rule, so that the model and
the partitioned executor count exactly the same transfers:

* a tensor (or op) cut into ``M`` pieces (row-major rank ``r`` over its labels, output labels
  first, aggregated labels last) puts piece/task ``r`` on device ``r * N // M``;
* so the output chunk of an op lives where its task with every aggregated piece index 0 runs.

Bytes moved then have three parts, all counted in :func:`transition_matrix` and
:class:`NodeTable`:

* **input replication / repartition** -- each task reads, for every operand, the region its
  pieces select; every byte of it held by another device moves (a producer partitioned like
  the consumer moves only the replicas; a different partitioning moves the overlaps);
* **partial aggregates** -- a task whose aggregated pieces are not all 0 sends its partial
  output chunk to the chunk's owner, ``(A - 1) x output bytes`` for ``A`` aggregated pieces.

FLOPs of a task are ``prod(piece sizes) x operands`` (one join and one agg op per joined
element, as the physical planner estimates); ``Cost.flops`` is the busiest device's total.
``peak_bytes`` is the largest working set of one task: its operand regions plus its output.

>>> Cost(flops=10, bytes_moved=4, peak_bytes=8) + Cost(flops=1, bytes_moved=1, peak_bytes=9)
Cost(flops=11, bytes_moved=5, peak_bytes=9)
>>> piece_bounds(10, 4)
(0, 2, 5, 7, 10)
>>> candidates((4, 6, 1), 6)[:3]
((1, 6, 1), (2, 3, 1), (3, 2, 1))
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from tensorql.optimizer.graph import Edge, OpGraph, OpNode


@dataclass(frozen=True)
class Cost:
    """What a partitioning costs: busiest device's FLOPs, bytes moved, peak bytes per device."""

    flops: int
    bytes_moved: int
    peak_bytes: int

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes_moved + other.bytes_moved,
                    max(self.peak_bytes, other.peak_bytes))


def piece_bounds(n: int, p: int) -> tuple[int, ...]:
    """Boundaries of ``p`` balanced pieces of ``range(n)``."""
    return tuple((k * n) // p for k in range(p + 1))


@lru_cache(maxsize=4096)
def candidates(sizes: tuple[int, ...], devices: int) -> tuple[tuple[int, ...], ...]:
    """Partition vectors with ``prod == devices`` and no empty piece (lexicographic order).

    When the sizes cannot make ``devices`` pieces, those with the largest product instead.
    """
    found: list[tuple[int, ...]] = []

    def extend(prefix: tuple[int, ...], left: int) -> None:
        d = len(prefix)
        if d == len(sizes):
            found.append(prefix)
            return
        for p in range(1, min(sizes[d], left) + 1):
            extend(prefix + (p,), left // p)

    extend((), devices)
    best = max(math.prod(c) for c in found)
    return tuple(sorted(c for c in found if math.prod(c) == best))


def device_of(rank: int, pieces: int, devices: int) -> int:
    """The device of piece/task ``rank`` of ``pieces``."""
    return rank * devices // pieces


@dataclass(frozen=True, eq=False)
class NodeTable:
    """Per-candidate figures of one node, in arrays over its candidates ``cands`` (K, L).

    ``tasks[c]`` lists the piece index of every task (row-major), ``task_dev[c]`` its device;
    ``piece_lo/hi[c, d]`` the output piece device ``d`` owns (``has_piece[c, d]`` if any);
    ``partial_bytes``, ``flops_dev`` (K, N) and ``peak`` are the node's own costs.
    """

    cands: np.ndarray
    lens: list[np.ndarray]          # per candidate: (M, L) piece lengths of each task
    starts: list[np.ndarray]        # per candidate: (M, L) piece starts of each task
    task_dev: list[np.ndarray]      # per candidate: (M,)
    piece_lo: np.ndarray            # (K, N, n_out)
    piece_hi: np.ndarray
    has_piece: np.ndarray           # (K, N)
    partial_bytes: np.ndarray       # (K,)
    flops_dev: np.ndarray           # (K, N)
    peak: np.ndarray                # (K,)


def node_key(graph: OpGraph, node: OpNode, devices: int) -> tuple:
    """What a node's table depends on (equal keys share tables across identical layers)."""
    ins = tuple((tuple(node.labels.index(a) for a in e.axes),
                 graph.nodes[e.producer].itemsize) for e in node.inputs)
    return (node.kind == "einsum" or node.kind == "map", node.sizes, node.n_out, ins,
            node.itemsize, devices)


def build_table(graph: OpGraph, node: OpNode, devices: int,
                allowed: Sequence[tuple[int, ...]] | None = None) -> NodeTable:
    """The :class:`NodeTable` of ``node`` over ``allowed`` candidates (default: all)."""
    chosen = allowed if allowed is not None else candidates(node.sizes, devices)
    cands = np.array(chosen, dtype=np.int64).reshape(len(chosen), len(node.sizes))
    n_out = node.n_out
    bounds = [[np.array(piece_bounds(n, p)) for p in range(1, min(n, devices) + 1)]
              for n in node.sizes]
    K, N = len(cands), devices
    lens, starts, devs = [], [], []
    piece_lo = np.zeros((K, N, n_out), dtype=np.int64)
    piece_hi = np.zeros((K, N, n_out), dtype=np.int64)
    has_piece = np.zeros((K, N), dtype=bool)
    partial = np.zeros(K, dtype=np.int64)
    flops = np.zeros((K, N), dtype=np.int64)
    peak = np.zeros(K, dtype=np.int64)
    in_items = [graph.nodes[e.producer].itemsize for e in node.inputs]
    in_axes = [[node.labels.index(a) for a in e.axes] for e in node.inputs]
    work = max(1, len(node.inputs)) if node.kind in ("einsum", "map") else 0
    for c, cand in enumerate(cands):
        combos = list(itertools.product(*(range(p) for p in cand)))
        idx = np.array(combos, dtype=np.int64).reshape(len(combos), len(cand))
        m = len(idx)
        st = np.zeros_like(idx)
        ln = np.zeros_like(idx)
        for lab, p in enumerate(cand):
            b = bounds[lab][p - 1]
            st[:, lab] = b[idx[:, lab]]
            ln[:, lab] = b[idx[:, lab] + 1] - b[idx[:, lab]]
        dev = np.arange(m, dtype=np.int64) * N // m
        lens.append(ln)
        starts.append(st)
        devs.append(dev)
        rep = np.all(idx[:, n_out:] == 0, axis=1)
        piece_lo[c, dev[rep]] = st[rep, :n_out]
        piece_hi[c, dev[rep]] = st[rep, :n_out] + ln[rep, :n_out]
        has_piece[c, dev[rep]] = True
        out_elems = np.prod(ln[:, :n_out], axis=1)
        partial[c] = int(out_elems[~rep].sum()) * node.itemsize
        np.add.at(flops[c], dev, np.prod(ln, axis=1) * work)
        working = out_elems * node.itemsize
        for axes, item in zip(in_axes, in_items):
            working = working + np.prod(ln[:, axes], axis=1) * item
        peak[c] = int(working.max())
    return NodeTable(cands, lens, starts, devs, piece_lo, piece_hi, has_piece, partial,
                     flops, peak)


def transition_matrix(producer: NodeTable, consumer: NodeTable, consumer_node: OpNode,
                      edge: Edge, itemsize: int, devices: int) -> np.ndarray:
    """Bytes moved into ``consumer``'s tasks for operand ``edge``: (K_producer, K_consumer).

    Entry ``[q, p]`` sums, over the consumer's tasks, the bytes of the operand region the task
    reads minus the part of it held by the task's own device.
    """
    axes = [consumer_node.labels.index(a) for a in edge.axes]
    kc = len(consumer.cands)
    m = max(len(d) for d in consumer.task_dev)
    r = len(axes)
    lo = np.zeros((kc, m, r), dtype=np.int64)
    hi = np.zeros((kc, m, r), dtype=np.int64)
    dev = np.zeros((kc, m), dtype=np.int64)
    mask = np.zeros((kc, m), dtype=bool)
    for c in range(kc):
        n = len(consumer.task_dev[c])
        lo[c, :n] = consumer.starts[c][:, axes]
        hi[c, :n] = consumer.starts[c][:, axes] + consumer.lens[c][:, axes]
        dev[c, :n] = consumer.task_dev[c]
        mask[c, :n] = True
    region = np.prod(hi - lo, axis=2) * mask                          # (kc, m)
    plo = producer.piece_lo[:, dev]                                    # (kp, kc, m, r)
    phi = producer.piece_hi[:, dev]
    has = producer.has_piece[:, dev] & mask[None]                      # (kp, kc, m)
    overlap = np.clip(np.minimum(hi[None], phi) - np.maximum(lo[None], plo), 0, None)
    local = np.prod(overlap, axis=3) * has
    return (region.sum(axis=1)[None, :] - local.sum(axis=2)) * itemsize
