"""The contraction order of n-ary einsums: chosen once, here, for lowering and optimizer alike.

opt_einsum searches the paths (``optimal`` for a few operands, ``dp`` and ``greedy`` beyond);
every path it proposes is then scored by :func:`path_cost`, which adds to the FLOPs the bytes a
chunked engine moves: each pairwise step reads every operand once per block combination of the
labels that operand lacks, and writes its intermediate once. The cheapest path wins and comes
back as a :class:`PathInfo` (like opt_einsum's): naive vs chosen FLOPs, largest intermediate
and one row per pairwise step.

>>> sizes = {"i": 64, "j": 8, "k": 64, "l": 8}
>>> contraction_path([("i", "j"), ("j", "k"), ("k", "l")], ("i", "l"), sizes)
[(1, 2), (0, 1)]
>>> info = plan_path([("i", "j"), ("j", "k"), ("k", "l")], ("i", "l"), sizes)
>>> info.naive_flops, info.flops, info.largest_intermediate
(524288, 8192, 64)
>>> print(info.explain())  # doctest: +ELLIPSIS
path: 2 pairwise steps, 8.19 KFLOP (naive 524.29 KFLOP, 64.0x less), largest ...
  step 0: (j,k) * (k,l) -> (j,l)  4.10 KFLOP
  step 1: (i,j) * (j,l) -> (i,l)  4.10 KFLOP
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import opt_einsum

# One byte moved counts as this many FLOPs when paths are compared.
BYTE_WEIGHT = 4.0


def _symbols(inputs: Sequence[Sequence[str]], output: Sequence[str]) -> dict[str, str]:
    symbols: dict[str, str] = {}
    for labels in list(inputs) + [output]:
        for lab in labels:
            symbols.setdefault(lab, opt_einsum.get_symbol(len(symbols)))
    return symbols


def path_cost(path: Sequence[Sequence[int]], inputs: Sequence[Sequence[str]],
              output: Sequence[str], sizes: Mapping[str, int],
              tiles: Mapping[str, int] | None = None, itemsize: int = 4) -> float:
    """FLOPs plus ``BYTE_WEIGHT`` x chunk bytes read and written along ``path``.

    ``tiles`` gives each label's chunk tile (default: labels are whole, one block each).

    >>> path_cost([(0, 1)], [("i", "j"), ("j", "k")], ("i", "k"), {"i": 2, "j": 3, "k": 4})
    464.0
    """
    tiles = tiles or {}
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
    """Pairwise contraction order (opt_einsum's path format) with the lowest chunk-aware cost."""
    if len(inputs) < 2:
        return [tuple(range(len(inputs)))]
    symbols = _symbols(inputs, output)
    equation = ",".join("".join(symbols[lab] for lab in labels) for labels in inputs)
    equation += "->" + "".join(symbols[lab] for lab in output)
    shapes = [tuple(sizes[lab] for lab in labels) for labels in inputs]
    optimizers: list[object] = ["greedy", opt_einsum.DynamicProgramming(minimize="flops"),
                                opt_einsum.DynamicProgramming(minimize="combo")]
    if len(inputs) <= 5:
        optimizers.insert(0, "optimal")
    best: tuple[float, list[tuple[int, ...]]] | None = None
    for optimizer in optimizers:
        path, _ = opt_einsum.contract_path(equation, *shapes, shapes=True, optimize=optimizer)
        path = [tuple(pair) for pair in path]
        cost = path_cost(path, inputs, output, sizes, tiles, itemsize)
        if best is None or cost < best[0]:
            best = (cost, path)
    assert best is not None
    return best[1]


@dataclass(frozen=True)
class PathStep:
    """One pairwise step of a path: the operands' labels, the labels kept, its FLOPs."""

    operands: tuple[tuple[str, ...], ...]
    result: tuple[str, ...]
    flops: int


@dataclass(frozen=True)
class PathInfo:
    """A contraction order a person can read (after opt_einsum's ``PathInfo``).

    ``path`` is in opt_einsum's format (pairs of positions in the shrinking operand list);
    ``flops`` counts one multiply-add per joined element of every step, ``naive_flops`` the
    same for contracting every operand at once.
    """

    path: tuple[tuple[int, ...], ...]
    steps: tuple[PathStep, ...]
    naive_flops: int
    flops: int
    largest_intermediate: int

    def explain(self) -> str:
        from tensorql.units import format_flops

        speedup = self.naive_flops / self.flops if self.flops else 1.0
        lines = [f"path: {len(self.steps)} pairwise steps, {format_flops(self.flops)} "
                 f"(naive {format_flops(self.naive_flops)}, {speedup:.1f}x less), largest "
                 f"intermediate {self.largest_intermediate} elements"]
        for n, step in enumerate(self.steps):
            ops = " * ".join("(" + ",".join(labels) + ")" for labels in step.operands)
            lines.append(f"  step {n}: {ops} -> ({','.join(step.result)})  "
                         f"{format_flops(step.flops)}")
        return "\n".join(lines)


def plan_path(inputs: Sequence[Sequence[str]], output: Sequence[str],
              sizes: Mapping[str, int], tiles: Mapping[str, int] | None = None,
              itemsize: int = 4) -> PathInfo:
    """The chosen contraction order of an n-ary einsum as a :class:`PathInfo`."""
    path = contraction_path(inputs, output, sizes, tiles, itemsize)
    return describe_path(path, inputs, output, sizes)


def describe_path(path: Sequence[Sequence[int]], inputs: Sequence[Sequence[str]],
                  output: Sequence[str], sizes: Mapping[str, int]) -> PathInfo:
    """The :class:`PathInfo` of a given ``path``."""
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
        steps.append(PathStep(tuple(picked), kept, math.prod(sizes[lab] for lab in joint)))
        current.append(kept)
    every = dict.fromkeys(lab for labels in inputs for lab in labels)
    naive = math.prod(sizes[lab] for lab in every) * max(1, len(inputs) - 1)
    largest = max((math.prod(sizes[lab] for lab in s.result) for s in steps[:-1]), default=0)
    return PathInfo(tuple(tuple(p) for p in path), tuple(steps), naive,
                    sum(s.flops for s in steps), largest)
