"""The cost model: FLOPs of the busiest device, bytes moved between devices, peak bytes.

A partition vector gives every label of an operation a number of pieces. A label of size ``n``
in ``p`` pieces is cut like a chunk grid: tiles of ``ceil(n / p)`` (the last one shorter), so a
partitioned operation's pieces *are* the chunks of its physical step. Only counts that make
exactly ``p`` non-empty pieces are candidates. The op runs one task per piece combination
(``M`` tasks); task ``r`` (row-major over the labels, output labels first, aggregated last)
runs on device ``r * N // M``. An output piece is *owned* by the device of its task whose
aggregated pieces are all 0. ``M`` is normally the device count ``N``; when no piece fits a
``memory_limit``, the search also offers ``2N``, ``4N``, ... pieces (several tasks a device).

Bytes moved have two parts:

* **operand regions** -- a device reads, for every operand, the region each of its tasks
  selects; every byte of it held by another device moves, once per device (tasks of one device
  reading the same region share the copy, and so do operations reading the same producer);
* **partial aggregates** -- a device holding a partial of an output piece it does not own
  (it ran tasks with aggregated pieces != 0) folds its own partials together and sends one
  partial to the owner: ``(devices contributing - 1) x piece bytes`` per output piece;
* or, for a **reduce-scatter** layout (``Layout.scatter``), every contributor owns a part of
  the output piece: an output label's pieces are cut ``f`` times finer (``f`` = the
  aggregated pieces), part ``b`` owned by the device of the task with aggregated rank ``b``,
  and each contributor sends the parts it does not own -- the same bytes as a reduce onto
  one owner, spread over every contributor's links and folds, and the output comes out
  cut into ``N`` pieces a consumer can use where they are.

The search sums per-edge figures (:func:`transition_matrix`, :class:`NodeTable`), which count
a producer read by several operations once per operation: an upper bound it minimises. The
chosen plan's ``bytes_moved`` is then counted exactly, per device pair, by :func:`pair_bytes`:
the bytes the physical plan's copies move.

FLOPs of a task are ``prod(piece sizes) x operands`` (one join and one agg op per joined
element, as the physical planner estimates); ``Cost.flops`` is the busiest device's total.
``peak_bytes`` is the largest working set of one task: its operand regions plus its output.

>>> Cost(flops=10, bytes_moved=4, peak_bytes=8) + Cost(flops=1, bytes_moved=1, peak_bytes=9)
Cost(flops=11, bytes_moved=5, peak_bytes=9)
>>> piece_bounds(10, 4), splits(6, 4)
((0, 3, 6, 9, 10), False)
>>> candidates((4, 6, 1), 6)[:3]
((1, 6, 1), (2, 3, 1))
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from tensorql.optimizer.graph import Edge, OpGraph, OpNode
from tensorql.optimizer.topology import Topology


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
    """Boundaries of ``p`` pieces of ``range(n)`` cut like a chunk grid of tile ceil(n/p)."""
    tile = -(-n // p)
    return tuple(min(k * tile, n) for k in range(p + 1))


def splits(n: int, p: int) -> bool:
    """True when tiles of ``ceil(n / p)`` cut ``range(n)`` into exactly ``p`` pieces."""
    return 1 <= p <= n and (p - 1) * -(-n // p) < n


@lru_cache(maxsize=4096)
def candidates(sizes: tuple[int, ...], pieces: int) -> tuple[tuple[int, ...], ...]:
    """Partition vectors with ``prod == pieces`` whose every count :func:`splits` its label
    (lexicographic order). When none exists, those with the largest product below instead."""
    found: list[tuple[int, ...]] = []

    def extend(prefix: tuple[int, ...], left: int) -> None:
        d = len(prefix)
        if d == len(sizes):
            found.append(prefix)
            return
        if sizes[d] == 0:  # an empty label is one (empty) piece
            extend(prefix + (1,), left)
            return
        for p in range(1, min(sizes[d], left) + 1):
            if splits(sizes[d], p):
                extend(prefix + (p,), left // p)

    extend((), pieces)
    best = max(math.prod(c) for c in found)
    return tuple(sorted(c for c in found if math.prod(c) == best))


@dataclass(frozen=True, eq=False)
class OutputPieces:
    """The output pieces of a :class:`Layout`: index, start and length along every output
    label, and the owning device, of each piece (arrays over the pieces)."""

    index: np.ndarray    # (P, n_out)
    starts: np.ndarray   # (P, n_out)
    lens: np.ndarray     # (P, n_out)
    device: np.ndarray   # (P,)

    def keys(self) -> list[tuple[int, ...]]:
        """Every piece's index as a tuple of ints, in order (made once; do not modify)."""
        return self._keys

    @functools.cached_property
    def _keys(self) -> list[tuple[int, ...]]:
        return [tuple(int(x) for x in row) for row in self.index]


def output_pieces(pieces: Sequence[int], n_out: int,
                  scatter: tuple[int, int] | None) -> tuple[int, ...]:
    """Pieces of every output label of an operation cut in ``pieces`` (output labels first):
    a reduce-scatter ``(s, f)`` cuts label ``s`` ``f`` times finer.

    >>> output_pieces((1, 2, 4), 2, None), output_pieces((1, 2, 4), 2, (0, 4))
    ((1, 2), (4, 2))
    """
    out = list(pieces[:n_out])
    if scatter is not None:
        out[scatter[0]] *= scatter[1]
    return tuple(out)


def scatter_splits(n: int, p: int, f: int) -> bool:
    """True when each of the ``p`` pieces of a label of size ``n`` cuts into ``f`` parts that
    are exactly the pieces of a ``p * f`` split (so the finer output stays a chunk grid).

    >>> scatter_splits(8, 1, 2), scatter_splits(10, 2, 2), scatter_splits(12, 2, 3)
    (True, False, True)
    """
    if f < 2 or not splits(n, p * f):
        return False
    tile = -(-n // p)
    return tile % f == 0 and -(-n // (p * f)) == tile // f


@dataclass(frozen=True, eq=False)
class Layout:
    """The tasks of one candidate partition vector: piece index, start, length and device of
    every task (row-major), and the output pieces and their owners (:attr:`outputs`).

    Normally an output piece is a task's output region, owned by the device of its task whose
    aggregated pieces are all 0. With ``scatter = (s, f)`` (a reduce-scatter) output label
    ``s`` is cut ``f`` times finer than the tasks' pieces (``f`` = the aggregated pieces) and
    part ``b`` of each task piece is owned by the device of its task of aggregated rank ``b``.
    """

    pieces: tuple[int, ...]
    index: np.ndarray    # (M, L) piece index of each task along each label
    starts: np.ndarray   # (M, L)
    lens: np.ndarray     # (M, L)
    device: np.ndarray   # (M,)
    n_out: int
    order: tuple[int, ...] = ()  # label positions, most significant first, for placement
    scatter: tuple[int, int] | None = None  # (output label, parts) of a reduce-scatter

    @property
    def owner_mask(self) -> np.ndarray:
        """Tasks whose aggregated pieces are all 0 (one per task piece of the output)."""
        return np.all(self.index[:, self.n_out:] == 0, axis=1)

    @property
    def out_pieces(self) -> tuple[int, ...]:
        """Pieces of every output label (the scattered one ``f`` times finer)."""
        return output_pieces(self.pieces, self.n_out, self.scatter)

    @functools.cached_property
    def outputs(self) -> OutputPieces:
        """The output pieces and their owners."""
        n_out = self.n_out
        own = np.flatnonzero(self.owner_mask)
        idx, st = self.index[own, :n_out], self.starts[own, :n_out]
        ln, dev = self.lens[own, :n_out], self.device[own]
        if self.scatter is None:
            return OutputPieces(idx, st, ln, dev)
        s, f = self.scatter
        agg_rank = _rank(self.index[:, n_out:], self.pieces[n_out:],
                         tuple(range(len(self.pieces) - n_out)))
        piece_id = _rank(self.index[:, :n_out], self.pieces[:n_out], tuple(range(n_out)))
        device_of_part = np.zeros((max(1, math.prod(self.pieces[:n_out])), f), dtype=np.int64)
        device_of_part[piece_id, agg_rank] = self.device
        size = int((self.starts[:, s] + self.lens[:, s]).max()) if len(own) else 0
        bounds = np.array(piece_bounds(size, self.pieces[s] * f), dtype=np.int64)
        part = np.tile(np.arange(f, dtype=np.int64), len(own))
        rows_i, rows_s = np.repeat(idx, f, axis=0), np.repeat(st, f, axis=0)
        rows_l = np.repeat(ln, f, axis=0)
        g = rows_i[:, s] * f + part
        rows_i[:, s], rows_s[:, s], rows_l[:, s] = g, bounds[g], bounds[g + 1] - bounds[g]
        return OutputPieces(rows_i, rows_s, rows_l,
                            device_of_part[np.repeat(piece_id[own], f), part])

    def owners(self) -> dict[tuple[int, ...], int]:
        """Output piece index -> owning device."""
        out = self.outputs
        return dict(zip(out.keys(), (int(d) for d in out.device)))

    def parts_of(self, task: int) -> list[tuple[int, ...]]:
        """The output pieces task ``task``'s output region covers (one unless scattered)."""
        piece = tuple(int(x) for x in self.index[task, : self.n_out])
        if self.scatter is None:
            return [piece]
        s, f = self.scatter
        return [piece[:s] + (piece[s] * f + b,) + piece[s + 1:] for b in range(f)]

    def extents(self) -> dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]]:
        """Each output piece's region ``(lo, hi)`` (see :func:`piece_extents`)."""
        return piece_extents(self)

    def sources_of(self, lo: Sequence[int], hi: Sequence[int]
                   ) -> list[tuple[tuple[int, ...], int, tuple[int, ...], tuple[int, ...]]]:
        """The output pieces overlapping region ``[lo, hi)`` (see :func:`region_sources`)."""
        return region_sources(self, lo, hi)

    def partial_totals(self) -> tuple[int, int]:
        """How many partials are sent to an owner and their elements: the count and sum of
        :meth:`partial_sends`, computed array-wise."""
        n_out = self.n_out
        if n_out == len(self.pieces) or not len(self.device):
            return 0, 0
        if np.bincount(self.device).max() == 1:  # a task a device: no two sends coincide
            elems = np.prod(self.lens[:, :n_out], axis=1)
            if self.scatter is None:  # every task but a piece's owner sends its partial
                send = ~self.owner_mask
                return int(send.sum()), int(elems[send].sum())
            s, f = self.scatter  # every task sends the f - 1 parts it does not own
            rank = _rank(self.index[:, n_out:], self.pieces[n_out:],
                         tuple(range(len(self.pieces) - n_out)))
            size = int((self.starts[:, s] + self.lens[:, s]).max())
            bounds = np.array(piece_bounds(size, self.pieces[s] * f), dtype=np.int64)
            g = self.index[:, s] * f + rank
            mine = elems // np.maximum(self.lens[:, s], 1) * (bounds[g + 1] - bounds[g])
            return len(self.device) * (f - 1), int((elems - mine).sum())
        src, _, elems = self.partial_pairs  # several tasks a device: each part once
        return len(src), int(elems.sum())

    @functools.cached_property
    def partial_pairs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The partials sent to owners as arrays: sending device, owning device and elements
        of each (the sends of :meth:`partial_sends`, in another order)."""
        n_out = self.n_out
        empty = np.zeros(0, dtype=np.int64)
        if n_out == len(self.pieces) or not len(self.device):
            return empty, empty, empty
        shape = self.out_pieces
        out = self.outputs
        part_of = _rank(out.index, shape, tuple(range(n_out)))
        owner = np.zeros(max(1, math.prod(shape)), dtype=np.int64)
        elems = np.zeros_like(owner)
        owner[part_of] = out.device
        elems[part_of] = np.prod(out.lens, axis=1)
        if self.scatter is None:
            parts = _rank(self.index[:, :n_out], shape, tuple(range(n_out)))[:, None]
        else:
            s, f = self.scatter
            idx = np.repeat(self.index[:, None, :n_out], f, axis=1)     # (M, f, n_out)
            idx[:, :, s] = idx[:, :, s] * f + np.arange(f)
            parts = np.ravel_multi_index(tuple(np.moveaxis(idx, 2, 0)), shape)
        dev = np.broadcast_to(self.device[:, None], parts.shape)
        send = dev != owner[parts]
        pairs = dev[send] * len(owner) + parts[send]
        if np.bincount(self.device).max() > 1:  # several tasks a device: each part once
            pairs = np.unique(pairs)
        part = pairs % len(owner)
        return pairs // len(owner), owner[part], elems[part]

    def partial_sends(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """``(from device, to device, output piece)`` for every partial sent to an owner."""
        return list(self._partial_sends)

    @functools.cached_property
    def _partial_sends(self) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
        owners = self.owners()
        seen = set()
        out = []
        for t in range(len(self.device)):
            dev = int(self.device[t])
            for piece in self.parts_of(t):
                if dev != owners[piece] and (dev, piece) not in seen:
                    seen.add((dev, piece))
                    out.append((dev, owners[piece], piece))
        return tuple(out)


def layout(sizes: Sequence[int], pieces: Sequence[int], n_out: int, devices: int,
           order: Sequence[int] | None = None,
           scatter: tuple[int, int] | None = None) -> Layout:
    """The :class:`Layout` of ``pieces`` over labels of ``sizes`` on ``devices`` devices.

    Tasks are ranked row-major over the labels taken in ``order`` (default: the labels'
    own order) and task ``r`` of ``M`` runs on device ``r * N // M``; another order is
    another placement of the same pieces (a transposing operation can then keep its
    producer's pieces where they are). ``scatter`` makes it a reduce-scatter (see
    :class:`Layout`).

    >>> lay = layout((4, 6), (2, 2), 1, 4)
    >>> lay.device.tolist(), layout((4, 6), (2, 2), 1, 4, order=(1, 0)).device.tolist()
    ([0, 1, 2, 3], [0, 2, 1, 3])
    >>> rs = layout((4, 6), (1, 2), 1, 2, scatter=(0, 2))   # i:1 j:2, i cut in 2 parts
    >>> rs.owners(), rs.partial_sends()
    ({(0,): 0, (1,): 1}, [(0, 1, (1,)), (1, 0, (0,))])
    """
    combos = list(itertools.product(*(range(p) for p in pieces)))
    idx = np.array(combos, dtype=np.int64).reshape(len(combos), len(pieces))
    st = np.zeros_like(idx)
    ln = np.zeros_like(idx)
    for lab, (n, p) in enumerate(zip(sizes, pieces)):
        b = np.array(piece_bounds(n, p))
        st[:, lab] = b[idx[:, lab]]
        ln[:, lab] = b[idx[:, lab] + 1] - b[idx[:, lab]]
    m = len(idx)
    order = tuple(order) if order is not None else tuple(range(len(pieces)))
    rank = _rank(idx, tuple(int(p) for p in pieces), order)
    dev = rank * devices // m
    return Layout(tuple(int(p) for p in pieces), idx, st, ln, dev, n_out, order,
                  tuple(scatter) if scatter is not None else None)


def _rank(idx: np.ndarray, pieces: tuple[int, ...], order: tuple[int, ...]) -> np.ndarray:
    """Row-major rank of piece indices ``idx`` over the labels taken in ``order``."""
    if not pieces:
        return np.zeros(len(idx), dtype=np.int64)
    return np.asarray(np.ravel_multi_index(tuple(idx[:, order].T),
                                           tuple(pieces[k] for k in order)), dtype=np.int64)


def refine(lay: Layout, sizes: Sequence[int], tiles: Sequence[int], devices: int) -> Layout:
    """``lay`` with each piece cut further into chunks of ``tiles`` (each must divide its
    label's piece tile ``ceil(n / p)``): every chunk stays on its piece's device, so bytes moved
    between devices are the same, and a device's work comes in cache-sized tasks that can
    start as soon as their own chunks are in.

    >>> fine = refine(layout((8, 6), (2, 1), 1, 2), (8, 6), (2, 6), 2)
    >>> fine.pieces, fine.device.tolist()
    ((4, 1), [0, 0, 1, 1])
    """
    if lay.scatter is not None:
        raise ValueError("a reduce-scatter layout is run piece by piece, not refined")
    piece_tiles = [-(-n // p) for n, p in zip(sizes, lay.pieces)]
    for t, pt, n in zip(tiles, piece_tiles, sizes):
        if pt % t and t < n:
            raise ValueError(f"tile {t} does not divide the piece tile {pt}")
    blocks = [-(-n // t) for n, t in zip(sizes, tiles)]
    combos = list(itertools.product(*(range(b) for b in blocks)))
    idx = np.array(combos, dtype=np.int64).reshape(len(combos), len(blocks))
    tile_arr = np.array(tiles, dtype=np.int64).reshape(1, len(blocks))
    starts = idx * tile_arr
    lens = np.minimum(starts + tile_arr, np.array(sizes, dtype=np.int64)) - starts
    parent = starts // np.array(piece_tiles, dtype=np.int64)
    m = math.prod(lay.pieces)
    order = lay.order or tuple(range(len(blocks)))
    device = _rank(parent, lay.pieces, order) * devices // m
    return Layout(tuple(blocks), idx, starts, lens, device, lay.n_out, order)


def sub_tile(piece_tile: int, target: int) -> int:
    """The largest divisor of ``piece_tile`` that is at most ``target``; ``piece_tile`` itself
    when that divisor is no more than half of ``target`` (cutting finer would only add tasks).

    >>> sub_tile(1536, 512), sub_tile(1376, 512), sub_tile(7, 4), sub_tile(100, 500)
    (512, 344, 7, 100)
    """
    if target >= piece_tile:
        return piece_tile
    best = 1
    k = 1
    while k * k <= piece_tile:
        if piece_tile % k == 0:
            for d in (k, piece_tile // k):
                if d <= target:
                    best = max(best, d)
        k += 1
    return best if 2 * best > target else piece_tile


@dataclass(frozen=True, eq=False)
class NodeTable:
    """Per-candidate figures of one node, in arrays over its candidates ``cands`` (K, L).

    ``layouts[c]`` places candidate ``c``'s tasks; ``piece_lo/hi[c, d, s]`` is the ``s``-th
    output piece device ``d`` owns (``has_piece[c, d, s]`` if any); ``partial_bytes``,
    ``flops_dev`` (K, N) and ``peak`` are the node's own costs.
    """

    cands: np.ndarray
    layouts: list[Layout]
    orders: list[tuple[int, ...]]   # the placement order of each candidate
    piece_lo: np.ndarray            # (K, N, S, n_out)
    piece_hi: np.ndarray
    has_piece: np.ndarray           # (K, N, S)
    partial_bytes: np.ndarray       # (K,)
    flops_dev: np.ndarray           # (K, N)
    peak: np.ndarray                # (K,)
    fold_peak: np.ndarray | None = None  # (K,) bytes of a task folding partials (or 0)

    @functools.cached_property
    def task_peak(self) -> np.ndarray:
        """The most bytes any one task of the node's own steps needs at once: its working
        set (``peak``) or, where partial aggregates are folded, a partial and the part of
        the output it is folded into (a reduce-scatter also cuts parts out of a partial)."""
        return self.peak if self.fold_peak is None else np.maximum(self.peak, self.fold_peak)

    @functools.cached_property
    def scattered(self) -> np.ndarray:
        """Candidates that reduce-scatter their partial aggregates."""
        return np.array([lay.scatter is not None for lay in self.layouts], dtype=bool)


def node_key(graph: OpGraph, node: OpNode, devices: int, pieces: int | None = None) -> tuple:
    """What a node's table depends on (equal keys share tables across identical layers)."""
    ins = tuple((tuple(node.labels.index(a) for a in e.axes),
                 graph.nodes[e.producer].itemsize) for e in node.inputs)
    return (node.kind if node.kind in ("einsum", "map", "reshape", "softmax", "pointwise",
                                       "attention") else "leaf",
            tuple(node.labels.index(lab) for lab in node.whole), node.sizes, node.n_out, ins,
            node.itemsize, devices, pieces or devices, node.work)


def build_table(graph: OpGraph, node: OpNode, devices: int,
                allowed: Sequence[tuple[int, ...]] | None = None,
                pieces: int | None = None, layouts: dict | None = None) -> NodeTable:
    """The :class:`NodeTable` of ``node`` over ``allowed`` candidates (default: every vector of
    ``pieces`` pieces, ``devices`` by default). An aggregation whose aggregated labels are cut
    is also offered as a reduce-scatter along each output label that can be cut finer
    (:func:`scatter_options`). ``layouts``: a dict the layouts made are kept in and taken
    from (tables of one search share them: a layout depends on its arguments only)."""
    chosen = allowed if allowed is not None else candidates(node.sizes, pieces or devices)
    n_out = node.n_out
    plain = tuple(range(len(node.sizes)))
    flipped = operand_orders(node)
    options = []
    for cand in chosen:
        options.append((cand, plain, None))
        if sum(p > 1 for p in cand) > 1:
            options.extend((cand, order, None) for order in flipped)
        options.extend((cand, plain, sc) for sc in scatter_options(node, cand))
    cands = np.array([c for c, _, _ in options], dtype=np.int64).reshape(len(options),
                                                                         len(node.sizes))
    orders = [o for _, o, _ in options]
    K, N = len(cands), devices
    made = {} if layouts is None else layouts
    nkey = node_key(graph, node, devices, pieces)  # what a row depends on beside its layout
    layouts, rows = [], []
    in_items = [graph.nodes[e.producer].itemsize for e in node.inputs]
    in_axes = [[node.labels.index(a) for a in e.axes] for e in node.inputs]
    for cand, order, sc in options:
        key = (node.sizes, cand, n_out, N, order, sc)
        if key not in made:
            made[key] = layout(node.sizes, cand, n_out, N, order, sc)
        lay = made[key]
        layouts.append(lay)
        if ("row", key, nkey) not in made:
            made[("row", key, nkey)] = _table_row(node, lay, in_axes, in_items)
        rows.append(made[("row", key, nkey)])
    per_dev = max(int(row[1].max(initial=-1)) + 1 for row in rows)
    piece_lo = np.zeros((K, N, per_dev, n_out), dtype=np.int64)
    piece_hi = np.zeros((K, N, per_dev, n_out), dtype=np.int64)
    has_piece = np.zeros((K, N, per_dev), dtype=bool)
    partial = np.zeros(K, dtype=np.int64)
    flops = np.zeros((K, N), dtype=np.int64)
    peak = np.zeros(K, dtype=np.int64)
    fold = np.zeros(K, dtype=np.int64)
    for c, (d, slot, lo, hi, part, fold_c, flops_c, peak_c) in enumerate(rows):
        piece_lo[c, d, slot] = lo
        piece_hi[c, d, slot] = hi
        has_piece[c, d, slot] = True
        partial[c], fold[c], peak[c] = part, fold_c, peak_c
        flops[c, :len(flops_c)] = flops_c
    return NodeTable(cands, layouts, orders, piece_lo, piece_hi, has_piece, partial, flops,
                     peak, fold)


def _table_row(node: OpNode, lay: Layout, in_axes: list[list[int]], in_items: list[int]
               ) -> tuple:
    """One candidate's row of :func:`build_table`: its pieces' devices, slots, starts and
    ends (each device's pieces in order), partial bytes, fold bytes, FLOPs per device and
    peak working set (shared by every table offering the same layout of the same node)."""
    n_out = lay.n_out
    ln, dev = lay.lens, lay.device
    out = lay.outputs
    by_dev = np.argsort(out.device, kind="stable")   # each device's pieces in order
    d = out.device[by_dev]
    slot = np.arange(len(d)) - np.searchsorted(d, d)
    sends, elems = lay.partial_totals()
    fold = 2 * int(np.prod(ln[:, :n_out], axis=1).max()) * node.itemsize if sends else 0
    flops = np.zeros(int(dev.max(initial=-1)) + 1, dtype=np.int64)
    np.add.at(flops, dev, node.flops(ln))
    working = np.prod(ln[:, :n_out], axis=1) * node.itemsize
    for axes, item in zip(in_axes, in_items):
        working = working + np.prod(ln[:, axes], axis=1) * item
    return (d, slot, out.starts[by_dev], out.starts[by_dev] + out.lens[by_dev],
            elems * node.itemsize, fold, flops, int(working.max()))


def scatter_options(node: OpNode, cand: Sequence[int]) -> list[tuple[int, int]]:
    """The reduce-scatters of an aggregation partitioned by ``cand``: ``(s, f)`` for every
    output label ``s`` whose pieces cut ``f`` times finer, ``f`` the aggregated pieces (none
    when the aggregated labels are not cut, or the node is no aggregation).

    >>> from tensorql.optimizer.graph import OpNode
    >>> mm = OpNode(0, "einsum", ("i", "k", "j"), (8, 6, 4), 2, (), "float32", "mm")
    >>> scatter_options(mm, (1, 1, 2)), scatter_options(mm, (2, 1, 1))
    ([(0, 2), (1, 2)], [])
    """
    f = math.prod(cand[node.n_out:])
    if node.kind != "einsum" or f < 2:
        return []
    return [(s, f) for s in range(node.n_out)
            if node.labels[s] not in node.whole
            and scatter_splits(node.sizes[s], cand[s], f)]


def operand_orders(node: OpNode) -> list[tuple[int, ...]]:
    """Placement orders matching the operands this node reads in another order than its own
    (transposed): each such operand's label order first, then the rest. A placement in that
    order keeps the operand's pieces on the devices that hold them; none when every operand
    is read in order (the default placement already lines pieces up).

    >>> from tensorql.optimizer.graph import Edge, OpNode
    >>> node = OpNode(2, "map", ("a", "b", "c"), (4, 4, 4), 3,
    ...               (Edge(0, ("b", "a", "c")), Edge(1, ("c", "a", "b"))), "float32", "add")
    >>> operand_orders(node)
    [(1, 0, 2), (2, 0, 1)]
    """
    orders: list[tuple[int, ...]] = []
    for edge in node.inputs:
        pos = [node.labels.index(a) for a in edge.axes]
        if len(set(pos)) == len(pos) and pos != sorted(pos):
            rest = [k for k in range(len(node.labels)) if k not in pos]
            order = tuple(pos + rest)
            if order not in orders:
                orders.append(order)
    return orders


def first_reads(lay: Layout, axes: Sequence[int]) -> np.ndarray:
    """Mask of tasks that are the first on their device to read their region of an operand
    whose axes are the labels ``axes`` (later ones share that copy)."""
    if len(lay.device) < 2 or np.bincount(lay.device).max() == 1:  # a task a device
        return np.ones(len(lay.device), dtype=bool)
    keys = np.concatenate([lay.device[:, None], lay.index[:, list(axes)]], axis=1)
    _, first = np.unique(keys, axis=0, return_index=True)
    mask = np.zeros(len(lay.device), dtype=bool)
    mask[first] = True
    return mask


def _distinct(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first row of each distinct row of ``rows`` (2-D), and each row's distinct index.

    >>> _distinct(np.array([[1, 2], [3, 4], [1, 2]]))
    (array([0, 1]), array([0, 1, 0]))
    """
    seen: dict[bytes, int] = {}
    inverse = np.empty(len(rows), dtype=np.int64)
    first = []
    for i, row in enumerate(np.ascontiguousarray(rows)):
        j = seen.setdefault(row.tobytes(), len(seen))
        if j == len(first):
            first.append(i)
        inverse[i] = j
    return np.array(first, dtype=np.int64), inverse


def _read_maps(consumer: NodeTable, axes: Sequence[int]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The regions every consumer candidate's devices read of one operand (labels ``axes``),
    each device each region once: lo, hi (K', m, r), device and mask (K', m) of the distinct
    read maps, and the distinct map of every candidate (K,)."""
    kc = len(consumer.cands)
    m = max(len(lay.device) for lay in consumer.layouts)
    r = len(axes)
    lo = np.zeros((kc, m, r), dtype=np.int64)
    hi = np.zeros((kc, m, r), dtype=np.int64)
    dev = np.zeros((kc, m), dtype=np.int64)
    mask = np.zeros((kc, m), dtype=bool)
    for c, lay in enumerate(consumer.layouts):
        n = len(lay.device)
        lo[c, :n] = lay.starts[:, axes]
        hi[c, :n] = lay.starts[:, axes] + lay.lens[:, axes]
        dev[c, :n] = lay.device
        mask[c, :n] = first_reads(lay, axes)
    lo *= mask[:, :, None]
    hi *= mask[:, :, None]
    dev *= mask
    rows = np.concatenate([lo.reshape(kc, -1), hi.reshape(kc, -1), dev, mask], axis=1)
    first, inverse = _distinct(rows)
    return lo[first], hi[first], dev[first], mask[first], inverse


def _edge_maps(producer: NodeTable, consumer: NodeTable, consumer_node: OpNode, edge: Edge
               ) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """What :func:`transition_matrix` and :func:`_distinct_levels` both start from: the
    consumer's distinct read maps of operand ``edge`` (``lo, hi, dev, mask, cols``: see
    :func:`_read_maps`) and the producer's distinct holdings (``rows``: each candidate's
    distinct holding; ``plo, phi`` (kq, N, S, r) and ``has`` (kq, N, S) of each distinct one).
    Candidates placing the same pieces on the same devices share one."""
    axes = [consumer_node.labels.index(a) for a in edge.axes]
    reads = _read_maps(consumer, axes)
    kp = len(producer.cands)
    holds = np.concatenate([producer.piece_lo.reshape(kp, -1),
                            producer.piece_hi.reshape(kp, -1),
                            producer.has_piece.reshape(kp, -1)], axis=1)
    first, rows = _distinct(holds)
    return reads, (rows, producer.piece_lo[first], producer.piece_hi[first],
                   producer.has_piece[first])


def transition_matrix(producer: NodeTable, consumer: NodeTable, consumer_node: OpNode,
                      edge: Edge, itemsize: int, devices: int) -> np.ndarray:
    """Bytes moved into ``consumer``'s devices for operand ``edge``: (K_producer, K_consumer).

    Entry ``[q, p]`` sums, over the distinct regions each device reads, the bytes of the region
    minus the part of it held by that device. Candidates that place the same pieces on the
    same devices (a producer's owned pieces, a consumer's reads) share their row or column:
    each distinct one is computed once, in blocks that bound the memory used.
    """
    (lo, hi, dev, mask, cols), (rows, plo, phi, has) = _edge_maps(producer, consumer,
                                                                  consumer_node, edge)
    kq, kd, (_, m, r) = len(plo), len(lo), lo.shape
    region = (np.prod(hi - lo, axis=2) * mask).sum(axis=1)           # (kd,)
    local = np.zeros((kq, kd), dtype=np.int64)
    step = max(1, (1 << 22) // max(1, kd * m))
    for q0 in range(0, kq, step):
        q = slice(q0, q0 + step)
        for s in range(has.shape[2]):
            held = (has[q, :, s][:, dev] & mask).astype(np.int64)    # (kq, kd, m)
            for a in range(r):
                ov = np.minimum(hi[None, :, :, a], phi[q, :, s, a][:, dev])
                ov -= np.maximum(lo[None, :, :, a], plo[q, :, s, a][:, dev])
                np.maximum(ov, 0, out=ov)
                held *= ov
            local[q] += held.sum(axis=2)
    moved = (region[None, :] - local) * itemsize
    return moved[rows][:, cols]


def chunk_tiles(node: OpNode, lay: Layout) -> tuple[int, ...]:
    """The tile along each label that the physical plan cuts ``node``'s pieces under
    ``lay`` into (:meth:`~tensorql.optimizer.plan.PartitionPlan.chunk_layout`): the piece
    tile cut to the logical plan's tile (:attr:`OpNode.chunk_target`); a reduce-scatter and
    a reshape run piece by piece.

    >>> from tensorql.optimizer.graph import OpNode
    >>> node = OpNode(0, "map", ("i", "j"), (8, 6), 2, (), "float32", "m")
    >>> chunk_tiles(node, layout((8, 6), (2, 1), 2, 2))
    (4, 6)
    """
    whole = tuple(-(-n // p) for n, p in zip(node.sizes, lay.pieces))
    target = node.chunk_target
    if lay.scatter is not None or target is None:
        return whole
    return tuple(sub_tile(t, target.get(lab, n))
                 for lab, n, t in zip(node.labels, node.sizes, whole))


def assembly_peak(producer: NodeTable, consumer: NodeTable, producer_node: OpNode,
                  consumer_node: OpNode, edge: Edge) -> np.ndarray:
    """A bound on the bytes one task needs to put operand ``edge`` of a consumer task
    together, (K_producer, K_consumer). Where a consumer chunk's region is not exactly a
    chunk of the producer, an *assemble* task holds the region and the producer's chunks (or
    slices of them) overlapping it, and a *slice* task on a holder a chunk and the slice;
    both fit in the region plus the span of the producer's chunks overlapping it, bounded
    label by label (:func:`_axis_reads`); 0 where every region is a chunk of the producer.
    A producer every device loads itself is read region by region (0).

    >>> from tensorql.optimizer.graph import OpNode
    >>> a = OpNode(0, "source", ("i",), (8,), 1, (), "float32", "a")
    >>> m = OpNode(1, "map", ("i",), (8,), 1, (Edge(0, ("i",)),), "float32", "m")
    >>> ta = build_table(OpGraph((a,), 0), a, 2, allowed=[(1,), (2,)])
    >>> tm = build_table(OpGraph((a, m), 1), m, 2, allowed=[(1,), (2,)])
    >>> assembly_peak(ta, tm, a, m, m.inputs[0]).tolist()  # half of 32 B; whole of 2 halves
    [[0, 48], [64, 0]]
    """
    kp, kc = len(producer.cands), len(consumer.cands)
    out = np.zeros((kp, kc), dtype=np.int64)
    if producer_node.loaded_where_read:
        return out
    axes = [consumer_node.labels.index(a) for a in edge.axes]
    sizes = [consumer_node.sizes[k] for k in axes]
    ours = []
    for lay in consumer.layouts:
        tiles = chunk_tiles(consumer_node, lay)
        ours.append(tuple((lay.pieces[k], tiles[k]) for k in axes))
    theirs = []
    for lay in producer.layouts:
        tiles = chunk_tiles(producer_node, lay)[: producer_node.n_out]
        scattered = lay.scatter is not None
        theirs.append(tuple((p, n if scattered else t)
                            for p, t, n in zip(lay.out_pieces, tiles, sizes)))
    for q, prod in enumerate(theirs):
        for c, cons in enumerate(ours):
            reads = [_axis_reads(n, pc, tc, pp, tp)
                     for n, (pc, tc), (pp, tp) in zip(sizes, cons, prod)]
            if all(exact for exact, _, _ in reads):
                continue
            out[q, c] = (math.prod(r for _, r, _ in reads)
                         + math.prod(span for _, _, span in reads)) * producer_node.itemsize
    return out


@lru_cache(maxsize=1 << 14)
def _intervals(n: int, pieces: int, tile: int) -> tuple[tuple[int, int], ...]:
    """The chunks along a label of size ``n`` cut into ``pieces`` pieces, each piece into
    chunks of ``tile`` (the last one shorter): ``(start, stop)`` each."""
    bounds = piece_bounds(n, pieces)
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        out.extend((x, min(x + tile, hi)) for x in range(lo, hi, max(1, tile)))
    return tuple(out)


@lru_cache(maxsize=1 << 14)
def _axis_reads(n: int, pieces: int, tile: int, their_pieces: int,
                their_tile: int) -> tuple[bool, int, int]:
    """Along one label: whether every chunk of ours is one of theirs, our longest chunk, and
    the longest span of their chunks overlapping one of ours.

    >>> _axis_reads(8, 1, 8, 2, 4), _axis_reads(8, 2, 2, 1, 4)
    ((False, 8, 8), (False, 2, 4))
    """
    mine, other = _intervals(n, pieces, tile), _intervals(n, their_pieces, their_tile)
    known = set(other)
    exact = all(iv in known for iv in mine)
    starts = [a for a, _ in other]
    longest = span = 0
    for lo, hi in mine:
        longest = max(longest, hi - lo)
        first = bisect.bisect_right(starts, lo) - 1
        last = bisect.bisect_left(starts, hi) - 1
        span = max(span, other[last][1] - other[first][0])
    return exact, longest, span


def region_sources(producer: Layout, lo: Sequence[int], hi: Sequence[int]
                   ) -> list[tuple[tuple[int, ...], int, tuple[int, ...], tuple[int, ...]]]:
    """The producer's output pieces overlapping region ``[lo, hi)``: ``(piece index, owner,
    overlap lo, overlap hi)`` each."""
    out = []
    pieces = producer.outputs
    for q, key in enumerate(pieces.keys()):
        plo = pieces.starts[q]
        phi = plo + pieces.lens[q]
        olo = np.maximum(plo, lo)
        ohi = np.minimum(phi, hi)
        if np.all(ohi > olo):
            out.append((key, int(pieces.device[q]), tuple(int(x) for x in olo),
                        tuple(int(x) for x in ohi)))
    return out


@dataclass(frozen=True)
class DeviceReads:
    """What one device reads of one producer's output, over all its consumers: the pieces it
    needs whole, and slices ``(piece, lo, hi)`` of pieces it needs only part of."""

    whole: frozenset[tuple[int, ...]]
    slices: frozenset[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


def device_reads(graph: OpGraph, layouts: Sequence[Layout],
                 producers: Sequence[int] | None = None) -> dict[tuple[int, int], DeviceReads]:
    """``(producer index, device) -> DeviceReads`` for a chosen layout per node (only for
    ``producers`` when given).

    A region a task reads is cut along the producer's pieces; a part that covers a whole piece
    is a whole-piece read, else a slice. A device reads each piece or slice once, whichever
    operations need it, and a slice of a piece it reads whole anyway is cut from that copy.
    """
    wanted = None if producers is None else set(producers)
    readers = graph.nodes if wanted is None else [
        graph.nodes[c] for c in sorted({c for p in wanted for c, _ in graph.consumers[p]})]
    whole: dict[tuple[int, int], set] = {}
    parts: dict[tuple[int, int], set] = {}
    for node in readers:
        lay = layouts[node.index]
        for edge in node.inputs:
            if wanted is not None and edge.producer not in wanted:
                continue
            if graph.nodes[edge.producer].loaded_where_read:
                continue  # loaded by each reader itself
            prod = layouts[edge.producer]
            axes = [node.labels.index(a) for a in edge.axes]
            tasks = np.flatnonzero(first_reads(lay, axes))
            lo = lay.starts[tasks][:, axes]                               # (T, r)
            hi = lo + lay.lens[tasks][:, axes]
            plo = prod.outputs.starts                                     # (P, r)
            phi = plo + prod.outputs.lens
            olo = np.maximum(lo[:, None], plo[None])                      # (T, P, r)
            ohi = np.minimum(hi[:, None], phi[None])
            hit = np.all(ohi > olo, axis=2)
            full = hit & np.all((olo == plo[None]) & (ohi == phi[None]), axis=2)
            pieces = prod.outputs.keys()
            for ti, pi in zip(*np.nonzero(hit)):
                key = (edge.producer, int(lay.device[tasks[ti]]))
                if full[ti, pi]:
                    whole.setdefault(key, set()).add(pieces[pi])
                else:
                    parts.setdefault(key, set()).add(
                        (pieces[pi], tuple(int(x) for x in olo[ti, pi]),
                         tuple(int(x) for x in ohi[ti, pi])))
    out = {}
    for key in set(whole) | set(parts):
        w = frozenset(whole.get(key, ()))
        out[key] = DeviceReads(w, frozenset(p for p in parts.get(key, ()) if p[0] not in w))
    return out


def edge_reads(prod: Layout, lay: Layout, axes: Sequence[int]) -> tuple[frozenset, frozenset]:
    """What the devices of consumer layout ``lay`` read from other devices of producer layout
    ``prod`` through one operand whose labels are ``axes``: whole pieces ``(device, piece)``
    and slices ``(device, piece, lo, hi)``; each device reads each once."""
    plo = prod.outputs.starts                                             # (P, r)
    phi = plo + prod.outputs.lens
    owner_dev = prod.outputs.device
    tasks = np.flatnonzero(first_reads(lay, axes))
    lo = lay.starts[tasks][:, list(axes)]
    hi = lo + lay.lens[tasks][:, list(axes)]
    olo = np.maximum(lo[:, None], plo[None])                              # (T, P, r)
    ohi = np.minimum(hi[:, None], phi[None])
    hit = np.all(ohi > olo, axis=2)
    full = hit & np.all((olo == plo[None]) & (ohi == phi[None]), axis=2)
    dev = lay.device[tasks][:, None]
    remote = hit & (dev != owner_dev[None])
    whole = set()
    slices = set()
    for t, q in zip(*np.nonzero(remote)):
        if full[t, q]:
            whole.add((int(dev[t, 0]), int(q)))
        else:
            slices.add((int(dev[t, 0]), int(q), tuple(olo[t, q].tolist()),
                        tuple(ohi[t, q].tolist())))
    return frozenset(whole), frozenset(slices)


def _remote_reads(prod: Layout, lay: Layout, axes: Sequence[int]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """What the devices of consumer layout ``lay`` read from other devices of producer layout
    ``prod`` (see :func:`edge_reads`) as arrays: the pieces read whole, as ``device x P +
    piece`` (P pieces), and the slices of the others, rows ``(device, piece, lo..., hi...)``
    (R, 2 + 2r). Tested label by label, so only slices are cut out."""
    plo = prod.outputs.starts                                             # (P, r)
    phi = plo + prod.outputs.lens
    tasks = np.flatnonzero(first_reads(lay, axes))
    lo = lay.starts[tasks][:, list(axes)]
    hi = lo + lay.lens[tasks][:, list(axes)]
    dev = lay.device[tasks]
    hit = dev[:, None] != prod.outputs.device[None]                       # (T, P) remote
    full = hit.copy()
    for a in range(len(axes)):
        lo_a, hi_a, pl, ph = lo[:, None, a], hi[:, None, a], plo[None, :, a], phi[None, :, a]
        hit &= (hi_a > pl) & (ph > lo_a) & (hi_a > lo_a) & (ph > pl)  # min(hi) > max(lo)
        full &= (lo_a <= pl) & (hi_a >= ph)
    full &= hit
    t, q = np.nonzero(full)
    whole = dev[t] * len(plo) + q
    t, q = np.nonzero(hit & ~full)
    rows = np.concatenate([dev[t][:, None], q[:, None], np.maximum(lo[t], plo[q]),
                           np.minimum(hi[t], phi[q])], axis=1)
    return whole.astype(np.int64), rows.astype(np.int64)


def _unique_rows(rows: np.ndarray) -> np.ndarray:
    """The distinct rows of a 2-D integer array (sorted)."""
    if len(rows) < 2:
        return rows
    ordered = rows[np.lexsort(rows.T[::-1])]
    keep = np.ones(len(ordered), dtype=bool)
    keep[1:] = np.any(ordered[1:] != ordered[:-1], axis=1)
    return ordered[keep]


def read_bytes(graph: OpGraph, layouts: Sequence[Layout], producer: int,
               cache: dict | None = None, keys: Sequence[object] | None = None) -> int:
    """Bytes other devices read of ``producer``'s output, each piece or slice once a device
    (the sum of :func:`device_reads` for this producer). ``cache`` memoises per-operand reads
    under ``keys[node]`` (what identifies a node's layout, e.g. its table and choice)."""
    if graph.nodes[producer].loaded_where_read:
        return 0
    prod = layouts[producer]
    slices, wholes = [], []
    seen = set()
    for consumer, k in graph.consumers[producer]:
        node = graph.nodes[consumer]
        axes = tuple(node.labels.index(a) for a in node.inputs[k].axes)
        key = None if cache is None or keys is None else \
            ("remote reads", keys[producer], keys[consumer], axes)
        if key is not None and key in seen:
            continue  # the same reads as another consumer's: a device reads them once
        seen.add(key)
        if key is not None and key in cache:
            got = cache[key]
        else:
            got = _remote_reads(prod, layouts[consumer], axes)
            if key is not None:
                cache[key] = got
        wholes.append(got[0])
        slices.append(got[1])
    if not slices:
        return 0
    sizes = np.prod(prod.outputs.lens, axis=1)
    n = len(sizes)
    reads, whole = np.concatenate(slices), np.concatenate(wholes)
    devices = 1 + max(int(whole.max(initial=-1)) // max(1, n), int(reads[:, 0].max(initial=-1)))
    held = np.zeros(devices * n, dtype=bool)        # (device, piece) read whole
    held[whole] = True
    total = int(sizes[np.flatnonzero(held) % n].sum()) if n else 0
    parts = _unique_rows(reads[~held[reads[:, 0] * n + reads[:, 1]]])  # slices of the others
    r = (reads.shape[1] - 2) // 2
    total += int(np.prod(parts[:, 2 + r:] - parts[:, 2:2 + r], axis=1).sum())
    return total * graph.nodes[producer].itemsize


def piece_extents(lay: Layout) -> dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]]:
    """Output piece index -> (lo, hi) of that piece."""
    out = {}
    pieces = lay.outputs
    for q, key in enumerate(pieces.keys()):
        lo = pieces.starts[q]
        hi = lo + pieces.lens[q]
        out[key] = (tuple(int(x) for x in lo), tuple(int(x) for x in hi))
    return out


def _fingerprint(lay: Layout) -> tuple:
    """What determines a layout (equal for identical layers' layouts made apart): pieces,
    output labels, order, scatter, the labels' sizes and every task's device."""
    end = tuple(int(x) for x in lay.starts[-1] + lay.lens[-1]) if len(lay.device) else ()
    return (lay.pieces, lay.n_out, lay.order, lay.scatter, end, lay.device.tobytes())


def _read_sends(prod: Layout, readers: dict, devices: int, itemsize: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Owner, reader and bytes of every piece or slice the ``readers`` (``(id, axes) ->
    consumer layout``) read of ``prod`` from other devices, each once a device."""
    wholes, slices = [], []
    # a producer's layout keeps what each distinct reader reads of it (layouts are shared
    # by the tables of one search, and the exact recounts ask again for the same reads)
    memo = prod.__dict__.setdefault("_remote_memo", {})
    for (fingerprint, axes), lay in readers.items():
        if (fingerprint, axes) not in memo:
            memo[(fingerprint, axes)] = _remote_reads(prod, lay, axes)
        whole, rows = memo[(fingerprint, axes)]
        wholes.append(whole)
        slices.append(rows)
    sizes = np.prod(prod.outputs.lens, axis=1)
    n = len(sizes)
    owner = prod.outputs.device
    held = np.zeros(devices * n, dtype=bool)
    held[np.concatenate(wholes)] = True
    ids = np.flatnonzero(held)
    reads = np.concatenate(slices)
    parts = _unique_rows(reads[~held[reads[:, 0] * n + reads[:, 1]]])
    r = (reads.shape[1] - 2) // 2
    vol = np.prod(parts[:, 2 + r:] - parts[:, 2:2 + r], axis=1)
    return (np.concatenate([owner[ids % n], owner[parts[:, 1]]]),
            np.concatenate([ids // n, parts[:, 0]]),
            np.concatenate([sizes[ids % n], vol]) * itemsize)


def _readers(graph: OpGraph, layouts: Sequence[Layout], producer: int
             ) -> dict[tuple[tuple, tuple[int, ...]], Layout]:
    """The distinct ways ``producer``'s output is read: ``(consumer layout's fingerprint,
    operand axes) -> consumer layout`` (identical layers' readers made apart count once)."""
    readers = {}
    for consumer, k in graph.consumers[producer]:
        reader = graph.nodes[consumer]
        axes = tuple(reader.labels.index(a) for a in reader.inputs[k].axes)
        readers[(_fingerprint(layouts[consumer]), axes)] = layouts[consumer]
    return readers


def pair_bytes(graph: OpGraph, layouts: Sequence[Layout], devices: int) -> np.ndarray:
    """Bytes sent from device ``src`` to ``dst`` (an (N, N) matrix) by a chosen layout per node:
    every piece or slice a device reads from another device once (see :func:`device_reads`),
    and every partial aggregate sent to its owner. This is the prediction the physical plan's
    copies are checked against. Counted array-wise (:func:`_remote_reads`), each distinct
    consumer layout of a producer once."""
    moved = np.zeros((devices, devices), dtype=np.int64)
    # identical layers send alike: each distinct send is counted once, times its layers
    done: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    times: dict[tuple, int] = {}
    for producer, node in enumerate(graph.nodes):
        if node.loaded_where_read or not graph.consumers[producer]:
            continue
        prod = layouts[producer]
        readers = _readers(graph, layouts, producer)
        key = ("reads", _fingerprint(prod), node.itemsize, frozenset(readers))
        if key not in done:
            done[key] = _read_sends(prod, readers, devices, node.itemsize)
        times[key] = times.get(key, 0) + 1
    for node, lay in zip(graph.nodes, layouts):
        if node.kind == "einsum" and node.n_out < len(node.labels):
            key = ("partials", _fingerprint(lay), node.itemsize)
            if key not in done:
                src, dst, elems = lay.partial_pairs
                done[key] = (src, dst, elems * node.itemsize)
            times[key] = times.get(key, 0) + 1
    for key, count in times.items():
        src, dst, sent = done[key]
        np.add.at(moved, (src, dst), sent * count)
    return moved


# -- prices on a topology (tensorql.optimizer.topology) -----------------------------------
def _group_boxes(lo: np.ndarray, hi: np.ndarray, has: np.ndarray, members: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The pieces every group of devices owns, as few disjoint boxes: pieces ``lo, hi``
    (K, N, S, r) and ``has`` (K, N, S) of K candidates; ``members`` (G, W) the devices of
    each group (-1: none). Returns lo, hi (K, G, B, r), has (K, G, B) and the boxes each
    candidate needs (K,) -- the first of: the group's pieces in one box, in 2, 3, ... boxes of
    consecutive members (each a box), or its pieces one by one. A set of disjoint pieces is a
    box when its bounding box holds as many elements as they do.

    >>> lo = np.array([[[[0]], [[4]], [[8]], [[12]]]]); hi = lo + 4   # 4 devices, a piece each
    >>> box = _group_boxes(lo, hi, np.ones((1, 4, 1), dtype=bool), np.array([[0, 1], [3, 2]]))
    >>> box[0][0, :, 0, 0].tolist(), box[1][0, :, 0, 0].tolist(), box[3].tolist()
    ([0, 8], [8, 16], [1])
    """
    k, _, s, r = lo.shape
    g, w = members.shape
    valid = members >= 0
    at = np.where(valid, members, 0)
    plo, phi = lo[:, at], hi[:, at]                                    # (K, G, W, S, r)
    phas = has[:, at] & valid[None, :, :, None]
    levels = []                                                        # (boxes, lo, hi, has, ok)
    for parts in [p for p in range(1, w + 1) if w % p == 0 and p < w * s]:
        shape = (k, g, parts, (w // parts) * s)
        sub_lo, sub_hi = plo.reshape(shape + (r,)), phi.reshape(shape + (r,))
        sub_has = phas.reshape(shape)
        big = np.iinfo(np.int64).max
        blo = np.where(sub_has[..., None], sub_lo, big).min(axis=3)   # (K, G, parts, r)
        bhi = np.where(sub_has[..., None], sub_hi, -big).max(axis=3)
        bhas = sub_has.any(axis=3)
        blo, bhi = np.where(bhas[..., None], blo, 0), np.where(bhas[..., None], bhi, 0)
        held = (np.prod(sub_hi - sub_lo, axis=-1) * sub_has).sum(axis=3)
        ok = (held == np.prod(bhi - blo, axis=-1)).all(axis=2)          # (K, G)
        levels.append((parts, blo, bhi, bhas, ok))
    levels.append((w * s, plo.reshape(k, g, w * s, r), phi.reshape(k, g, w * s, r),
                   phas.reshape(k, g, w * s), np.ones((k, g), dtype=bool)))
    need = np.full((k, g), w * s, dtype=np.int64)
    for parts, _, _, _, ok in reversed(levels):
        need[ok] = parts
    width = int(need.max(initial=1))
    out_lo = np.zeros((k, g, width, r), dtype=np.int64)
    out_hi = np.zeros_like(out_lo)
    out_has = np.zeros((k, g, width), dtype=bool)
    for parts, blo, bhi, bhas, _ in levels:
        sel = need == parts
        if parts <= width and sel.any():
            out_lo[sel, :parts], out_hi[sel, :parts] = blo[sel], bhi[sel]
            out_has[sel, :parts] = bhas[sel]
    return out_lo, out_hi, out_has, need.max(axis=1, initial=1)


def _members(groups: Sequence[Sequence[int]]) -> np.ndarray:
    """The devices of each group, (G, W), padded with -1."""
    width = max(len(g) for g in groups)
    return np.array([list(g) + [-1] * (width - len(g)) for g in groups], dtype=np.int64)


def _held_in(lo: np.ndarray, hi: np.ndarray, blo: np.ndarray, bhi: np.ndarray,
             bhas: np.ndarray, unit: np.ndarray, dtype: type) -> np.ndarray:
    """Elements of every region ``[lo, hi)`` ((kd, m, r) each) inside the boxes of the group
    ``unit`` (kd, m) of its reader: boxes ``blo, bhi`` (q, U, B, r), ``bhas`` (q, U, B);
    returns (q, kd, m). Loops over boxes and axes on (q, kd, m) arrays. Read maps whose
    tasks sit on the same groups (most of them: a task a device, in one of a few orders)
    look their boxes up once, (q, m), broadcast over those maps; on an axis where every box
    holds every region's interval (the producer does not cut it) the overlap is the region's
    length, and where every region holds every box (the consumer does not cut it) the box's.

    >>> lo = np.array([[[0], [4]], [[0], [2]]]); hi = lo + 4   # 2 maps of 2 regions
    >>> blo = np.array([[[[0]], [[4]]]]); bhi = blo + 4        # a box [0, 4) and [4, 8)
    >>> _held_in(lo, hi, blo, bhi, np.ones((1, 2, 1), dtype=bool),
    ...          np.array([[0, 1], [0, 1]]), np.int64).tolist()
    [[[4, 4], [4, 2]]]
    """
    q, kd = blo.shape[0], unit.shape[0]
    modes = []  # per axis: "region" (its length), "box" (the box's) or "both" (overlap)
    for a in range(lo.shape[2]):
        held_lo, held_hi = blo[..., a][bhas], bhi[..., a][bhas]
        if not held_lo.size:
            modes.append("region")
        elif held_lo.max() <= lo[:, :, a].min() and held_hi.min() >= hi[:, :, a].max():
            modes.append("region")
        elif lo[:, :, a].max() <= held_lo.min() and hi[:, :, a].min() >= held_hi.max():
            modes.append("box")
        else:
            modes.append("both")
    length = (hi - lo).astype(dtype)
    fixed = np.ones(unit.shape, dtype=dtype)   # the region-length axes' product, (kd, m)
    for a, mode in enumerate(modes):
        if mode == "region":
            fixed *= length[:, :, a]
    first, which = _distinct(unit)
    rows = unit[first]
    acc = np.zeros((q,) + unit.shape, dtype=dtype)
    if len(rows) * 4 > kd:  # mostly distinct: each region's boxes looked up on its own
        for b in range(blo.shape[2]):
            held = bhas[:, :, b][:, unit].astype(dtype)
            for a, mode in enumerate(modes):
                if mode == "box":
                    held *= (bhi[:, :, b, a] - blo[:, :, b, a])[:, unit]
                elif mode == "both":
                    ov = np.minimum(hi[:, :, a], bhi[:, :, b, a][:, unit])
                    ov -= np.maximum(lo[:, :, a], blo[:, :, b, a][:, unit])
                    np.maximum(ov, 0, out=ov)
                    held *= ov
            acc += held
        acc *= fixed
        return acc
    for u, row in enumerate(rows):
        sel = slice(None) if len(rows) == 1 else np.flatnonzero(which == u)
        slo, shi = lo[sel], hi[sel]                                   # (s, m, r)
        shape = (q,) + slo.shape[:2]
        got = np.zeros(shape, dtype=dtype)
        ov, low = np.empty(shape, dtype=dtype), np.empty(shape, dtype=dtype)  # reused
        for b in range(blo.shape[2]):
            box = bhas[:, row, b].astype(dtype)                       # (q, m)
            for a, mode in enumerate(modes):
                if mode == "box":
                    box *= bhi[:, row, b, a] - blo[:, row, b, a]
            held = np.repeat(box[:, None, :], slo.shape[0], axis=1)
            for a, mode in enumerate(modes):
                if mode == "both":
                    np.minimum(shi[None, :, :, a], bhi[:, row, b, a][:, None, :], out=ov)
                    np.maximum(slo[None, :, :, a], blo[:, row, b, a][:, None, :], out=low)
                    ov -= low
                    np.maximum(ov, 0, out=ov)
                    held *= ov
            got += held
        got *= fixed[sel][None]
        if len(rows) == 1:
            acc = got
        else:
            acc[:, sel] = got
    return acc


def _distinct_levels(producer: NodeTable, consumer: NodeTable, consumer_node: OpNode,
                     edge: Edge, topo: Topology
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Elements every node receives for operand ``edge`` from its own devices and from other
    nodes, (kq, kd, G) each, for the distinct producer holdings (kq) and consumer read maps
    (kd); and the distinct holding of every producer candidate (K_p,) and read map of every
    consumer candidate (K_c,). A node's pieces are merged into boxes once per producer
    candidate (:func:`_group_boxes`), and so are a device's."""
    (lo, hi, dev, _, cols), (rows, plo, phi, has) = _edge_maps(producer, consumer,
                                                               consumer_node, edge)
    nlo, nhi, nhas, nwide = _group_boxes(plo, phi, has, _members(topo.groups))
    dlo, dhi, dhas, dwide = _group_boxes(plo, phi, has, np.arange(topo.devices)[:, None])
    kq, (kd, m, _) = len(plo), lo.shape
    groups = len(topo.groups)
    region = np.prod(hi - lo, axis=2)            # (kd, m); 0 where a device reads it again
    top = max(int(region.max(initial=0)), int(hi.max(initial=0)),
              int(phi.max(initial=0)))
    dtype = np.int32 if top < (1 << 31) else np.int64
    lo, hi = lo.astype(dtype), hi.astype(dtype)
    nlo, nhi, dlo, dhi = (x.astype(dtype) for x in (nlo, nhi, dlo, dhi))
    node = topo.node_array[dev]                                       # (kd, m)
    slot = np.arange(kd)[:, None] * groups + node                     # (kd, m)
    region_in = np.bincount(slot.ravel(), region.ravel().astype(float),
                            minlength=kd * groups).reshape(kd, groups)
    intra = np.zeros((kq, kd, groups), dtype=np.int64)
    inter = np.zeros((kq, kd, groups), dtype=np.int64)
    per = max(1, (1 << 22) // max(1, kd * m))
    for wn, wd in sorted(set(zip(nwide.tolist(), dwide.tolist()))):
        same = np.flatnonzero((nwide == wn) & (dwide == wd))
        for q0 in range(0, len(same), per):
            q = same[q0:q0 + per]
            near = _held_in(lo, hi, nlo[q][:, :, :wn], nhi[q][:, :, :wn], nhas[q][:, :, :wn],
                            node, dtype)
            local = _held_in(lo, hi, dlo[q][:, :, :wd], dhi[q][:, :, :wd], dhas[q][:, :, :wd],
                             dev, dtype)
            at = (np.arange(len(q))[:, None, None] * kd * groups + slot[None]).ravel()
            size = len(q) * kd * groups
            got_near = np.bincount(at, near.ravel().astype(float), minlength=size)
            got_local = np.bincount(at, local.ravel().astype(float), minlength=size)
            got_near = got_near.reshape(len(q), kd, groups)
            intra[q] = np.rint(got_near - got_local.reshape(len(q), kd, groups))
            inter[q] = np.rint(region_in[None] - got_near)
    return intra, inter, rows, cols


def transition_seconds(producer: NodeTable, consumer: NodeTable, consumer_node: OpNode,
                       edge: Edge, itemsize: int, topo: Topology) -> np.ndarray:
    """Seconds the exchange of operand ``edge`` takes on ``topo``, (K_producer, K_consumer):
    the bytes each node receives on each level (:func:`transition_levels`), priced by
    :meth:`Topology.node_seconds` (the busiest node's inbound links)."""
    return transition_priced(producer, consumer, consumer_node, edge, itemsize, topo)[0]


def transition_priced(producer: NodeTable, consumer: NodeTable, consumer_node: OpNode,
                      edge: Edge, itemsize: int, topo: Topology
                      ) -> tuple[np.ndarray, np.ndarray]:
    """The seconds of :func:`transition_seconds` and the bytes of :func:`transition_matrix`
    (their sum over levels and nodes), (K_producer, K_consumer) each: priced on the distinct
    placements, then spread to the candidates (the search's edge costs)."""
    intra, inter, rows, cols = _distinct_levels(producer, consumer, consumer_node, edge, topo)
    seconds = topo.node_seconds(intra * itemsize, inter * itemsize)
    moved = (intra.sum(axis=2) + inter.sum(axis=2)) * itemsize
    return seconds[rows][:, cols], moved[rows][:, cols]


def transition_levels(producer: NodeTable, consumer: NodeTable, consumer_node: OpNode,
                      edge: Edge, itemsize: int, topo: Topology
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Bytes every node receives for operand ``edge`` from its own devices and from other
    nodes, (K_producer, K_consumer, G) each: the bytes of :func:`transition_matrix` (their
    sum over both levels and the nodes), each device's split by where they come from.
    Candidates that place the operand alike (the producer's output pieces, the consumer's
    regions of it and their devices) are counted once (:func:`_distinct_levels`).

    >>> from tensorql.optimizer.graph import OpNode
    >>> a = OpNode(0, "source", ("i",), (8,), 1, (), "float32", "a")
    >>> m = OpNode(1, "map", ("i",), (8,), 1, (Edge(0, ("i",)),), "float32", "m")
    >>> ta = build_table(OpGraph((a,), 0), a, 4, allowed=[(1,)])  # all of it on device 0
    >>> tm = build_table(OpGraph((a, m), 1), m, 4, allowed=[(4,)])
    >>> intra, inter = transition_levels(ta, tm, m, m.inputs[0], 4, Topology.nodes(2, 2))
    >>> intra.tolist(), inter.tolist()  # device 1 reads 8 B in node 0, 2 and 3 16 B across
    ([[[8, 0]]], [[[0, 16]]])
    """
    intra, inter, rows, cols = _distinct_levels(producer, consumer, consumer_node, edge, topo)
    return intra[rows][:, cols] * itemsize, inter[rows][:, cols] * itemsize


def partial_seconds(table: NodeTable, node: OpNode, topo: Topology) -> np.ndarray:
    """Seconds every candidate's partial aggregates take to reach their owners on ``topo``
    (K,): the sends of :meth:`Layout.partial_sends` (as the arrays of
    :attr:`Layout.partial_pairs`), priced as one exchange."""
    out = np.zeros(len(table.cands))
    nodes = topo.node_array
    groups = len(topo.groups)
    sending = [c for c in np.flatnonzero(table.partial_bytes)  # the others send none
               if len(table.layouts[c].partial_pairs[0])]
    if not sending:
        return out
    pairs = [table.layouts[c].partial_pairs for c in sending]
    row = np.repeat(np.arange(len(sending)), [len(src) for src, _, _ in pairs])
    src, dst, elems = (np.concatenate(x) for x in zip(*pairs))
    nbytes = (elems * node.itemsize).astype(float)
    to = nodes[dst]
    same = nodes[src] == to  # a partial never goes to its own device
    slot = row * groups + to
    size = len(sending) * groups
    intra = np.bincount(slot[same], nbytes[same], minlength=size).reshape(-1, groups)
    inter = np.bincount(slot[~same], nbytes[~same], minlength=size).reshape(-1, groups)
    out[sending] = topo.node_seconds(intra, inter)
    return out


def read_pairs(graph: OpGraph, layouts: Sequence[Layout], producer: int,
               devices: int) -> np.ndarray:
    """Bytes other devices read of ``producer``'s output, per (owner, reader) pair: an
    (N, N) matrix whose sum is :func:`read_bytes` (counted array-wise, as
    :func:`pair_bytes` counts them)."""
    out = np.zeros((devices, devices), dtype=np.int64)
    node = graph.nodes[producer]
    if node.loaded_where_read or not graph.consumers[producer]:
        return out
    src, dst, sent = _read_sends(layouts[producer], _readers(graph, layouts, producer),
                                 devices, node.itemsize)
    np.add.at(out, (src, dst), sent)
    return out


# -- memory tiers a memory limit forces (host offload, the DuckDB spill tier) -------------
def resident_bytes(graph: OpGraph, layouts: Sequence[Layout], devices: int) -> np.ndarray:
    """Bytes every device holds after each operation, (N, steps): an operation's output
    pieces live on their owners from the operation (a stored source or constant: from its
    first reader) to its last reader, the results to the end; operands loaded where read
    hold nothing between operations. Operations run in the graph's order, one a step.

    >>> from tensorql.optimizer.graph import OpNode
    >>> a = OpNode(0, "source", ("i",), (8,), 1, (), "float32", "a")
    >>> m = OpNode(1, "map", ("i",), (8,), 1, (Edge(0, ("i",)),), "float32", "m")
    >>> g = OpGraph((a, m), 1)
    >>> lays = [layout((8,), (2,), 1, 2), layout((8,), (2,), 1, 2)]
    >>> resident_bytes(g, lays, 2).tolist()   # a (16 B a device) is loaded for m (16 B)
    [[0, 32], [0, 32]]
    """
    steps = len(graph.nodes)
    delta = np.zeros((devices, steps + 1), dtype=np.int64)
    consumers = graph.consumers
    results = {graph.root, *graph.also}
    for node, lay in zip(graph.nodes, layouts):
        readers = [c for c, _ in consumers.get(node.index, [])]
        if node.loaded_where_read or (not readers and node.index not in results):
            continue
        born = min(readers) if not node.inputs and readers else node.index
        dies = steps - 1 if node.index in results else max(readers)
        out = lay.outputs
        held = np.bincount(out.device, np.prod(out.lens, axis=1) * node.itemsize,
                           minlength=devices).astype(np.int64)
        delta[:, born] += held
        delta[:, dies + 1] -= held
    return np.cumsum(delta, axis=1)[:, :steps]


def tier_bytes(graph: OpGraph, layouts: Sequence[Layout], memory_limit: int,
               topo: Topology) -> tuple[np.ndarray, np.ndarray]:
    """What a plan held to ``memory_limit`` a device must move through the memory tiers, at
    least: each device's bytes over the limit at its fullest step (:func:`resident_bytes`)
    are evicted to its host and read back (twice those bytes over its host link), and each
    node's evictions beyond ``topo.host_memory`` at its fullest step go on to the DuckDB
    tier and come back (twice those bytes through the node's spill tier). Returns the host
    link's bytes per device (N,) and the DuckDB tier's per node (G,).

    >>> from tensorql.optimizer.graph import OpNode
    >>> a = OpNode(0, "source", ("i",), (8,), 1, (), "float32", "a")
    >>> m = OpNode(1, "map", ("i",), (8,), 1, (Edge(0, ("i",)),), "float32", "m")
    >>> g = OpGraph((a, m), 1)
    >>> lays = [layout((8,), (2,), 1, 2), layout((8,), (2,), 1, 2)]
    >>> import dataclasses
    >>> topo = dataclasses.replace(Topology.flat(2), host_memory=20)
    >>> [x.tolist() for x in tier_bytes(g, lays, 24, topo)]  # 8 B over a device, 16 a node
    [[16, 16], [0]]
    >>> [x.tolist() for x in tier_bytes(g, lays, 20, topo)]  # 12 over, 24 on the host: 4 spill
    [[24, 24], [8]]
    """
    resident = resident_bytes(graph, layouts, topo.devices)
    over = np.maximum(resident - memory_limit, 0)                      # (N, steps)
    host = 2 * over.max(axis=1, initial=0)
    node_over = np.zeros((len(topo.groups), over.shape[1]), dtype=np.int64)
    np.add.at(node_over, topo.node_array, over)
    spill = 2 * np.maximum(node_over.max(axis=1, initial=0) - topo.host_memory, 0)
    return host.astype(np.int64), spill.astype(np.int64)


def tier_seconds(host: np.ndarray, spill: np.ndarray, topo: Topology) -> float:
    """Seconds of the tiers' traffic of :func:`tier_bytes`: the busiest device's host link
    plus the busiest node's DuckDB tier (no overlap counted, as for the links).

    >>> topo = Topology.flat(2, "cpu-gloo")
    >>> tier_seconds(np.array([5e9, 0]), np.array([4e8]), topo)  # 1 s + 1 s
    2.0
    """
    link = float(host.max(initial=0)) / topo.host_bandwidth
    return link + float(spill.max(initial=0)) / topo.spill_bandwidth
