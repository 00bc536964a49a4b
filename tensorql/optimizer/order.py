"""Contraction order for n-ary einsums, chosen with a chunk-aware cost.

opt_einsum searches the paths (``optimal`` for a few operands, ``dp`` and ``greedy`` beyond);
every path it proposes is then scored by :func:`path_cost`, which adds to the FLOPs the bytes a
chunked engine moves: each pairwise step reads every operand once per block combination of the
labels that operand lacks, and writes its intermediate once. The cheapest path wins.

>>> sizes = {"i": 64, "j": 8, "k": 64, "l": 8}
>>> contraction_path([("i", "j"), ("j", "k"), ("k", "l")], ("i", "l"), sizes)
[(1, 2), (0, 1)]
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

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
