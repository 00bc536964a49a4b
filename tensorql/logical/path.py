"""The contraction order of n-ary einsums: chosen once, here, for lowering and optimizer alike.

opt_einsum searches the paths (``optimal`` for a few operands, ``dp`` and ``greedy`` beyond;
greedy paths refined by cotengra's subtree reconfiguration for larger networks);
every path it proposes is then scored by :func:`path_cost`, which adds to the FLOPs the bytes a
chunked engine moves: each pairwise step reads every operand once per block combination of the
labels that operand lacks, and writes its intermediate once. The cheapest path wins and comes
back as a :class:`PathInfo` (like opt_einsum's): naive vs chosen FLOPs, largest intermediate
and one row per pairwise step.

>>> sizes = {"i": 64, "j": 8, "k": 64, "l": 8}
>>> contraction_path([("i", "j"), ("j", "k"), ("k", "l")], ("i", "l"), sizes)
[(1, 2), (0, 1)]
>>> info = plan_path([("i", "j"), ("j", "k"), ("k", "l")], ("i", "l"), sizes)
>>> info.naive_flops, info.flops, info.multiply_adds, info.largest_intermediate
(1048576, 16384, 8192, 64)
>>> print(info.explain())  # doctest: +ELLIPSIS
path: 2 pairwise steps, 16.38 KFLOP (naive 1.05 MFLOP, 64.0x less), largest ...
  step 0: (j,k) * (k,l) -> (j,l)  8.19 KFLOP
  step 1: (i,j) * (j,l) -> (i,l)  8.19 KFLOP
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import opt_einsum
from cachetools import LRUCache

# One byte moved counts as this many FLOPs when paths are compared: 16, so that an fp32
# element read or written weighs 64 FLOPs -- cotengra's ``combo`` factor. At 4 the fewest-FLOPs
# path won on the bench's random network although a path writing a third of its intermediates
# ran 3x faster on opt_einsum's kernels (and on tensorql's).
BYTE_WEIGHT = 16.0


def _symbols(inputs: Sequence[Sequence[str]], output: Sequence[str]) -> dict[str, str]:
    symbols: dict[str, str] = {}
    for labels in list(inputs) + [output]:
        for lab in labels:
            symbols.setdefault(lab, opt_einsum.get_symbol(len(symbols)))
    return symbols


def _one_character_labels(inputs: Sequence[Sequence[str]], output: Sequence[str],
                          sizes: Mapping[str, int]):
    """``inputs``, ``output`` and ``sizes`` with every label a single character (opt_einsum's
    symbols, :func:`_symbols`): cotengra's path finders take no others, and a plan's labels
    may be longer (a broadcast dim's ``d@4``, an ellipsis's dims). A path, by operand
    positions, is the same under either.

    >>> _one_character_labels([("i", "d@1")], ("d@1",), {"i": 2, "d@1": 3})
    ([('a', 'b')], ('b',), {'a': 2, 'b': 3})
    """
    symbols = _symbols(inputs, output)
    return ([tuple(symbols[lab] for lab in labels) for labels in inputs],
            tuple(symbols[lab] for lab in output),
            {symbols[lab]: int(n) for lab, n in sizes.items() if lab in symbols})


def path_cost(path: Sequence[Sequence[int]], inputs: Sequence[Sequence[str]],
              output: Sequence[str], sizes: Mapping[str, int],
              tiles: Mapping[str, int] | None = None, itemsize: int = 4) -> float:
    """FLOPs plus ``BYTE_WEIGHT`` x chunk bytes read and written along ``path``.

    ``tiles`` gives each label's chunk tile (default: labels are whole, one block each).

    >>> path_cost([(0, 1)], [("i", "j"), ("j", "k")], ("i", "k"), {"i": 2, "j": 3, "k": 4})
    1712.0
    """
    tiles = tiles or {}
    sizes = {lab: int(n) for lab, n in sizes.items()}
    blocks = {lab: -(-n // max(1, min(n, tiles.get(lab, n)))) for lab, n in sizes.items()}
    current = [tuple(labels) for labels in inputs]
    total = 0.0
    for position, pair in enumerate(path):
        picked = [current[k] for k in sorted(pair)]
        current = [lab for k, lab in enumerate(current) if k not in pair]
        joint = tuple(dict.fromkeys(lab for labels in picked for lab in labels))
        if position == len(path) - 1 and not current:
            kept = tuple(output)
        else:
            needed = {lab for labels in current for lab in labels} | set(output)
            kept = tuple(lab for lab in joint if lab in needed)
        total += math.prod(sizes[lab] for lab in joint) * len(picked)
        for labels in picked:
            rereads = math.prod(blocks[lab] for lab in joint if lab not in labels)
            total += BYTE_WEIGHT * itemsize * rereads * math.prod(sizes[lab] for lab in labels)
        total += BYTE_WEIGHT * itemsize * math.prod(sizes[lab] for lab in kept)
        current.append(kept)
    return total


def contraction_path(inputs: Sequence[Sequence[str]], output: Sequence[str],
                     sizes: Mapping[str, int], tiles: Mapping[str, int] | None = None,
                     itemsize: int = 4) -> list[tuple[int, ...]]:
    """Pairwise contraction order (opt_einsum's path format) with the lowest chunk-aware cost.

    Searched once per (labels, sizes, tiles, itemsize): repeated queries of the same shape
    reuse the path from :data:`PATH_CACHE`.
    """
    if len(inputs) < 2:
        return [tuple(range(len(inputs)))]
    key = PathKey.of(inputs, output, sizes, tiles, itemsize)
    return list(PATH_CACHE.get(key))


@dataclass(frozen=True)
class PathKey:
    """What a path depends on: every operand's labels, the output, label sizes and tiles."""

    inputs: tuple[tuple[str, ...], ...]
    output: tuple[str, ...]
    sizes: tuple[tuple[str, int], ...]
    tiles: tuple[tuple[str, int], ...]
    itemsize: int

    @classmethod
    def of(cls, inputs: Sequence[Sequence[str]], output: Sequence[str],
           sizes: Mapping[str, int], tiles: Mapping[str, int] | None, itemsize: int) -> PathKey:
        used = dict.fromkeys(lab for labels in [*inputs, output] for lab in labels)
        tiles = tiles or {}
        return cls(tuple(tuple(labels) for labels in inputs), tuple(output),
                   tuple((lab, int(sizes[lab])) for lab in used),
                   tuple((lab, int(tiles[lab])) for lab in used if lab in tiles), itemsize)


class PathCache:
    """Searched paths by :class:`PathKey`, least recently used dropped beyond ``capacity``.

    >>> cache = PathCache(capacity=4)
    >>> key = PathKey.of([("i", "j"), ("j", "k")], ("i", "k"), {"i": 2, "j": 3, "k": 4}, None, 4)
    >>> cache.get(key), cache.get(key), cache.hits, cache.misses
    (((0, 1),), ((0, 1),), 1, 1)
    """

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self.epoch = 0  # bumped by clear(): plans built from the cleared paths are stale
        self._paths: LRUCache[PathKey, tuple[tuple[int, ...], ...]] = LRUCache(capacity)

    def get(self, key: PathKey) -> tuple[tuple[int, ...], ...]:
        path = self._paths.get(key)
        if path is not None:
            self.hits += 1
            return path
        self.misses += 1
        path = tuple(search_path(key.inputs, key.output, dict(key.sizes), dict(key.tiles),
                                 key.itemsize))
        self._paths[key] = path  # the least recently used goes beyond ``capacity``
        return path

    def clear(self) -> None:
        self._paths.clear()
        self.hits = self.misses = 0
        self.epoch += 1


PATH_CACHE = PathCache()

# Exact search (opt_einsum "optimal") up to this many operands, dynamic programming up to the
# next bound; beyond it greedy paths refined by subtree reconfiguration (:func:`refined_path`).
OPTIMAL_MAX_OPERANDS = 5
DP_MAX_OPERANDS = 10
# The refinement: seeded random-greedy trials, then the best path's subtrees re-contracted
# optimally (cotengra), subtrees of 6 leaves until no pass helps, and separately of 8 (each
# can get stuck where the other does not), for at most SEARCH_FRACTION x the greedy path's
# run time at ASSUMED_FLOPS_PER_S, within [MIN_SEARCH_S, MAX_SEARCH_S]. The refinement
# normally stops on its own well before (einsum_benchmark's lattice, tree, MPS: 0.14-0.33 s,
# 7-17 passes); the floor is a second so that a loaded machine does not cut it short and
# hand a different path to the same query (0.2 s did, in one full test run of four).
RANDOM_GREEDY_TRIALS = 8
RECONFIGURE_SIZES = (6, 8)
SEARCH_FRACTION = 1.0
ASSUMED_FLOPS_PER_S = 1e10
MIN_SEARCH_S = 1.0
MAX_SEARCH_S = 2.0


def search_path(inputs: Sequence[Sequence[str]], output: Sequence[str],
                sizes: Mapping[str, int], tiles: Mapping[str, int] | None = None,
                itemsize: int = 4) -> list[tuple[int, ...]]:
    """Search the paths (no cache): the cheapest by :func:`path_cost` among the candidates.

    >>> search_path([("i", "j"), ("j", "k")], ("i", "k"), {"i": 2, "j": 3, "k": 4})
    [(0, 1)]
    """
    if len(inputs) < 2:
        return [tuple(range(len(inputs)))]
    symbols = _symbols(inputs, output)
    equation = ",".join("".join(symbols[lab] for lab in labels) for labels in inputs)
    equation += "->" + "".join(symbols[lab] for lab in output)
    shapes = [tuple(sizes[lab] for lab in labels) for labels in inputs]
    optimizers: list[object] = ["greedy"]
    chain = len(inputs) > OPTIMAL_MAX_OPERANDS and is_matrix_chain(inputs, output) and \
        len(inputs) <= CHAIN_DP_MAX_OPERANDS
    if len(inputs) <= OPTIMAL_MAX_OPERANDS:
        optimizers.append("optimal")
    elif not chain and (len(inputs) <= DP_MAX_OPERANDS or is_chain(inputs)):
        optimizers += [opt_einsum.DynamicProgramming(minimize="flops"),
                       opt_einsum.DynamicProgramming(minimize="combo")]
    candidates = []
    for optimizer in optimizers:
        path, _ = opt_einsum.contract_path(equation, *shapes, shapes=True, optimize=optimizer)
        candidates.append([tuple(pair) for pair in path])
    if chain:
        candidates.append(chain_path(inputs, output, sizes))
    if len(inputs) > OPTIMAL_MAX_OPERANDS and not is_chain(inputs):  # dp is exact on chains
        greedy = describe_path(candidates[0], inputs, output, sizes).multiply_adds
        budget = SEARCH_FRACTION * greedy / ASSUMED_FLOPS_PER_S
        fewest = refined_path(inputs, output, sizes, candidates[0],
                              min(MAX_SEARCH_S, max(MIN_SEARCH_S, budget)))
        candidates.append(fewest)
        candidates += traffic_refined_paths(inputs, output, sizes, fewest)
    costs = [path_cost(path, inputs, output, sizes, tiles, itemsize) for path in candidates]
    return candidates[costs.index(min(costs))]


# a matrix chain of up to this many operands gets the interval dynamic programme of
# :func:`chain_path` (O(n^3) splits, ~10 ms for 40), longer ones opt_einsum's
CHAIN_DP_MAX_OPERANDS = 64


def opt_einsum_greedy(inputs: Sequence[Sequence[str]], output: Sequence[str],
                      sizes: Mapping[str, int]) -> list[tuple[int, ...]]:
    """opt_einsum's greedy path (the first candidate of :func:`search_path`).

    >>> opt_einsum_greedy([("i", "j"), ("j", "k"), ("k", "l")], ("i", "l"),
    ...                   {"i": 64, "j": 8, "k": 64, "l": 8})
    [(1, 2), (0, 1)]
    """
    path = opt_einsum.paths.greedy([set(labels) for labels in inputs], set(output),
                                   {lab: int(n) for lab, n in sizes.items()})
    return [tuple(pair) for pair in path]


def is_matrix_chain(inputs: Sequence[Sequence[str]], output: Sequence[str]) -> bool:
    """A product of matrices: a chain (:func:`is_chain`) of 2-label operands whose output is
    the two labels left open at its ends -- where :func:`chain_path` is the classic optimal
    programme (other chains, with legs of their own or kept bonds, keep opt_einsum's).

    >>> is_matrix_chain([("i", "j"), ("j", "k"), ("k", "l")], ("i", "l"))
    True
    >>> is_matrix_chain([("i", "j"), ("j", "k"), ("k", "l")], ("i", "k", "l"))
    False
    """
    counts: dict[str, int] = {}
    for labels in inputs:
        for lab in labels:
            counts[lab] = counts.get(lab, 0) + 1
    return (all(len(labels) == 2 and len(set(labels)) == 2 for labels in inputs)
            and len(output) == 2 and all(counts.get(lab) == 1 for lab in output)
            and sum(1 for c in counts.values() if c == 1) == 2 and is_chain(inputs))


def chain_path(inputs: Sequence[Sequence[str]], output: Sequence[str],
               sizes: Mapping[str, int]) -> list[tuple[int, ...]]:
    """The fewest-FLOPs path of a matrix chain (:func:`is_matrix_chain`) by the interval
    programme: the best split of every run of consecutive operands, each merge costing the
    product of the sizes of the labels of both sides (twice that when it sums a label, as
    opt_einsum counts). For a chain it finds what opt_einsum's
    general ``DynamicProgramming`` finds, ~10x sooner (40 matrices: ~130 ms of two of those
    searches, per query planned, against ~10 ms).

    >>> chain_path([("i", "j"), ("j", "k"), ("k", "l")], ("i", "l"),
    ...            {"i": 64, "j": 8, "k": 64, "l": 8})
    [(1, 2), (0, 1)]
    """
    from opt_einsum.paths import ssa_to_linear

    holders: dict[str, list[int]] = {}
    for n, labels in enumerate(inputs):
        for lab in labels:
            holders.setdefault(lab, []).append(n)
    neighbours: dict[int, set[int]] = {n: set() for n in range(len(inputs))}
    for ops in holders.values():
        if len(ops) == 2:
            neighbours[ops[0]].add(ops[1])
            neighbours[ops[1]].add(ops[0])
    order = [min(n for n, near in neighbours.items() if len(near) <= 1)]
    while len(order) < len(inputs):
        order.append(next(m for m in neighbours[order[-1]] if m not in order[-2:]))
    n = len(order)
    keep = set(output)
    labels = [set(inputs[i]) for i in order]
    shared = [labels[p] & labels[p + 1] for p in range(n - 1)]

    def size(labs: set[str]) -> int:
        return math.prod(sizes[lab] for lab in labs)

    # the tensor a run i..j of the chain is: its labels in the output or held outside it (an
    # operand's own summed labels are summed first, on its own, as opt_einsum does)
    result: dict[tuple[int, int], set[str]] = {}
    for i in range(n):
        union: set[str] = set()
        for j in range(i, n):
            union |= labels[j]
            outside = (shared[i - 1] if i > 0 else set()) | (shared[j] if j < n - 1 else set())
            result[i, j] = {lab for lab in union if lab in keep or lab in outside}
    extent = {span: size(labs) for span, labs in result.items()}
    cost: dict[tuple[int, int], int] = {(i, i): 0 for i in range(n)}
    split: dict[tuple[int, int], int] = {}
    for length in range(2, n + 1):
        for i in range(n - length + 1):
            j = i + length - 1
            best = None
            for k in range(i, j):
                both = extent[i, k] * extent[k + 1, j] // size(result[i, k] & result[k + 1, j])
                # opt_einsum's count: a multiply and an add per point when labels are summed
                summed = len(result[i, k] | result[k + 1, j]) > len(result[i, j])
                total = cost[i, k] + cost[k + 1, j] + both * (2 if summed else 1)
                if best is None or total < best:
                    best, split[i, j] = total, k
            cost[i, j] = best
    ssa: list[tuple[int, ...]] = []
    leaf = {}
    for p in range(n):
        leaf[p] = order[p]
        if result[p, p] != labels[p]:  # labels of its own to sum first
            ssa.append((order[p],))
            leaf[p] = n + len(ssa) - 1

    def build(i: int, j: int) -> int:
        if i == j:
            return leaf[i]
        left, right = build(i, split[i, j]), build(split[i, j] + 1, j)
        ssa.append((left, right))
        return n + len(ssa) - 1

    build(0, n - 1)
    return [tuple(pair) for pair in ssa_to_linear(ssa)]


def is_chain(inputs: Sequence[Sequence[str]]) -> bool:
    """True when operands sharing labels form a simple path (matrix chains, MPS-like
    trains): dynamic programming over its intervals is cheap there at any length.

    >>> is_chain([("i", "j"), ("j", "k"), ("k", "l")]), is_chain([("i", "j"), ("i", "k"),
    ...                                                            ("i", "l")])
    (True, False)
    """
    holders: dict[str, set[int]] = {}
    for n, labels in enumerate(inputs):
        for lab in labels:
            holders.setdefault(lab, set()).add(n)
    edges = {frozenset(ops) for ops in holders.values() if len(ops) == 2}
    if any(len(ops) > 2 for ops in holders.values()) or len(edges) != len(inputs) - 1:
        return False
    degree = [0] * len(inputs)
    for edge in edges:
        for n in edge:
            degree[n] += 1
    return max(degree, default=0) <= 2 and min(degree, default=0) >= 1


def refined_path(inputs: Sequence[Sequence[str]], output: Sequence[str],
                 sizes: Mapping[str, int], greedy: Sequence[Sequence[int]] | None = None,
                 max_time: float = MAX_SEARCH_S) -> list[tuple[int, ...]]:
    """The fewest-FLOPs path found by refining greedy paths: ``greedy`` (opt_einsum's) and
    the best of :data:`RANDOM_GREEDY_TRIALS` seeded Boltzmann-greedy
    trials (cotengra's ``path_basic``, in Rust when ``cotengrust`` is installed), each refined
    by subtree reconfiguration -- every subtree of 6 leaves re-contracted optimally, pass after
    pass while the FLOPs drop, and separately of 8 -- within ``max_time`` seconds. Seeded: a
    network gets the same path on every run unless the time runs out.

    >>> refined_path([("i", "j"), ("j", "k"), ("k", "l")], ("i", "l"),
    ...              {"i": 64, "j": 8, "k": 64, "l": 8})
    [(1, 2), (0, 1)]
    """
    import time
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cotengra notes optional optimisers it lacks
        import cotengra
        from cotengra.pathfinders.path_basic import get_optimize_random_greedy_track_flops

    deadline = time.perf_counter() + max_time
    inputs, output, sizes = _one_character_labels(inputs, output, sizes)

    def flops(path) -> int:
        return describe_path(path, inputs, output, sizes).flops

    starts = []
    try:
        trial, _ = get_optimize_random_greedy_track_flops()(inputs, output, sizes,
                                                            ntrials=RANDOM_GREEDY_TRIALS, seed=0)
        starts.append([tuple(p) for p in trial])
    except BaseException as err:  # cotengrust panics (a BaseException) on some stars of
        if type(err).__name__ != "PanicException":  # ~90 operands: refine greedy alone
            raise
    if greedy is None and not starts:
        greedy = opt_einsum.paths.greedy([set(labels) for labels in inputs], set(output), sizes)
    if greedy is not None:
        starts.append([tuple(p) for p in greedy])
    best = min(starts, key=flops)
    best_flops = flops(best)
    for start, size in itertools.product(sorted(starts, key=flops), RECONFIGURE_SIZES):
        tree = cotengra.ContractionTree.from_path(inputs, output, sizes, path=start)
        cost = flops(start)
        while time.perf_counter() < deadline:
            better = tree.subtree_reconfigure(subtree_size=size, minimize="flops")
            path = [tuple(p) for p in better.get_path()]
            if flops(path) >= cost:
                break
            tree, cost = better, flops(path)
            if cost < best_flops:
                best, best_flops = path, cost
    return best


def traffic_refined_paths(inputs: Sequence[Sequence[str]], output: Sequence[str],
                          sizes: Mapping[str, int], start: Sequence[Sequence[int]],
                          max_time: float | None = None) -> list[list[tuple[int, ...]]]:
    """``start`` re-contracted for less memory traffic: subtree reconfiguration (subtrees of
    :data:`TRAFFIC_SUBTREE` leaves) minimising cotengra's ``combo`` (FLOPs + 64 x elements
    written) and, separately, ``write`` (elements written), pass after pass while
    :func:`path_cost` drops (at most :data:`TRAFFIC_PASSES` passes, within ``max_time``
    seconds, default :data:`TRAFFIC_MAX_S`). The fewest-FLOPs path can write intermediates
    several times larger than a path with a few more FLOPs (the bench's 3x3x3 lattice: 11.2 M
    elements against 3.7 M, and 3x the time on opt_einsum's own kernels); :func:`path_cost`
    decides. Seeded by ``start`` and deterministic unless the time runs out.

    >>> sizes = {"i": 64, "j": 8, "k": 64, "l": 8}
    >>> traffic_refined_paths([("i", "j"), ("j", "k"), ("k", "l")], ("i", "l"), sizes,
    ...                       [(1, 2), (0, 1)])
    [[(1, 2), (0, 1)], [(1, 2), (0, 1)]]
    """
    import time
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cotengra notes optional optimisers it lacks
        import cotengra

    deadline = time.perf_counter() + (TRAFFIC_MAX_S if max_time is None else max_time)
    inputs, output, sizes = _one_character_labels(inputs, output, sizes)
    start = [tuple(p) for p in start]
    found = []
    for minimize in ("combo", "write"):
        tree = cotengra.ContractionTree.from_path(inputs, tuple(output), sizes, path=start)
        best, cost = start, path_cost(start, inputs, output, sizes)
        for _ in range(TRAFFIC_PASSES):
            if time.perf_counter() > deadline:
                break
            tree = tree.subtree_reconfigure(subtree_size=TRAFFIC_SUBTREE, minimize=minimize)
            path = [tuple(p) for p in tree.get_path()]
            new_cost = path_cost(path, inputs, output, sizes)
            if new_cost >= cost:  # a pass that only reshuffles equal paths ends the search
                break
            best, cost = path, new_cost
        found.append(best)
    return found


# subtrees of this many leaves re-contracted for traffic (8 found nothing better than 6 on the
# bench's networks at twice the time)
TRAFFIC_SUBTREE = 6
# traffic-minimising reconfiguration stops after this many seconds (the MPS of 120 tensors
# ran 8 passes of ~0.06 s each that only reshuffled equal paths before passes stopped at no gain)
TRAFFIC_MAX_S = 0.5
# passes of traffic-minimising reconfiguration at most (each pass ~5-20 ms on 40 operands)
TRAFFIC_PASSES = 8


@dataclass(frozen=True)
class PathStep:
    """One pairwise step of a path: the operands' labels, the labels kept, its FLOPs (two,
    a multiply and an add, per element of the joined labels)."""

    operands: tuple[tuple[str, ...], ...]
    result: tuple[str, ...]
    flops: int


@dataclass(frozen=True)
class PathInfo:
    """A contraction order a person can read (after opt_einsum's ``PathInfo``).

    ``path`` is in opt_einsum's format (pairs of positions in the shrinking operand list);
    ``flops`` counts two FLOPs (a multiply and an add) per joined element of every step --
    what the physical plan's estimates and :func:`path_cost` count, so EXPLAIN's figures
    agree -- and ``naive_flops`` the same for contracting every operand at once;
    ``multiply_adds`` is half of ``flops`` (the count opt_einsum and cotengra report).
    """

    path: tuple[tuple[int, ...], ...]
    steps: tuple[PathStep, ...]
    naive_flops: int
    flops: int
    largest_intermediate: int

    @property
    def multiply_adds(self) -> int:
        """The multiply-adds of the path's steps (``flops`` counts two FLOPs each)."""
        return self.flops // 2

    def explain(self) -> str:
        from tensorql.units import format_flops

        lines = [f"path: {len(self.steps)} pairwise steps, {format_flops(self.flops)} "
                 f"(naive {format_flops(self.naive_flops)}, {self.speedup()} less), largest "
                 f"intermediate {self.largest_intermediate} elements"]
        for n, step in enumerate(self.steps):
            ops = " * ".join("(" + ",".join(labels) + ")" for labels in step.operands)
            lines.append(f"  step {n}: {ops} -> ({','.join(step.result)})  "
                         f"{format_flops(step.flops)}")
        return "\n".join(lines)

    def speedup(self) -> str:
        """How many times fewer FLOPs the path takes than the naive contraction, from exact
        ints (a ratio past a float's range prints in scientific notation).

        >>> PathInfo((), (), naive_flops=2 * 10 ** 400, flops=4, largest_intermediate=1).speedup()
        '5.00e+399x'
        >>> PathInfo((), (), naive_flops=524288, flops=8192, largest_intermediate=1).speedup()
        '64.0x'
        """
        from tensorql.units import scientific

        if not self.flops:
            return "1.0x"
        whole = self.naive_flops // self.flops
        if whole < 10 ** 15:
            return f"{self.naive_flops / self.flops:.1f}x"
        return f"{scientific(whole)}x"


def plan_path(inputs: Sequence[Sequence[str]], output: Sequence[str],
              sizes: Mapping[str, int], tiles: Mapping[str, int] | None = None,
              itemsize: int = 4) -> PathInfo:
    """The chosen contraction order of an n-ary einsum as a :class:`PathInfo`."""
    path = contraction_path(inputs, output, sizes, tiles, itemsize)
    return describe_path(path, inputs, output, sizes)


def describe_path(path: Sequence[Sequence[int]], inputs: Sequence[Sequence[str]],
                  output: Sequence[str], sizes: Mapping[str, int]) -> PathInfo:
    """The :class:`PathInfo` of a given ``path``."""
    sizes = {lab: int(n) for lab, n in sizes.items()}  # Python ints: no overflow
    current = [tuple(labels) for labels in inputs]
    steps = []
    for position, pair in enumerate(path):
        picked = [current[k] for k in sorted(pair)]
        current = [lab for k, lab in enumerate(current) if k not in pair]
        joint = tuple(dict.fromkeys(lab for labels in picked for lab in labels))
        if position == len(path) - 1 and not current:
            kept = tuple(output)
        else:
            needed = {lab for labels in current for lab in labels} | set(output)
            kept = tuple(lab for lab in joint if lab in needed)
        steps.append(PathStep(tuple(picked), kept, 2 * math.prod(sizes[lab] for lab in joint)))
        current.append(kept)
    every = dict.fromkeys(lab for labels in inputs for lab in labels)
    naive = 2 * math.prod(sizes[lab] for lab in every) * max(1, len(inputs) - 1)
    largest = max((math.prod(sizes[lab] for lab in s.result) for s in steps[:-1]), default=0)
    return PathInfo(tuple(tuple(p) for p in path), tuple(steps), naive,
                    sum(s.flops for s in steps), largest)
