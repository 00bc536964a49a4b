"""Rule ``scalar_out_of_sum``: a scalar factor of a contraction's operand moves past the
contraction, ``sum_j (Y / s) X = (sum_j Y X) / s`` (and ``s * Y`` alike) for ``s`` a 0-d
relation (a tensor of no dims, e.g. ``max(Y)``).

Why: ``(Y / max(Y)) @ C`` cannot use a tile of ``Y`` before the maximum of all of it, so the
whole of ``Y`` is live at once (under a memory limit, what does not fit goes through the
spill tier and back). ``(Y @ C) / max(Y)`` uses each tile of ``Y`` twice while it is resident
-- its share of the maximum and its partial product with ``C`` -- and waits for the scalar only
to scale the (usually much smaller) product.

It fires on ``Aggregate sum`` over a two-input ``Join mul`` (a contraction) one of whose
inputs is a ``Join div (Y, s)`` or ``Join mul`` of ``Y`` and ``s``, with ``s`` of no dims, read
by that contraction only, and ``Y`` tiled and typed as the operand (its dims in the same
order), in float32 or float64. Exact in real arithmetic; in floating point the rounding of
the scaling differs (one rounding of each result element instead of one of each operand
element), and so does the range: the products are formed before the scaling, so they can
overflow to inf (or underflow to 0) where the query as written does not. float16 and bfloat16
reach their range at ordinary magnitudes (300 * 300 * 8 terms is past float16's 65504), so
for them the rule does not fire; at float32 and float64 it takes magnitudes near their limits
(1e19 and up at float32).

>>> import torch
>>> from tensorql.grid import ChunkGrid
>>> from tensorql.logical.plan import Scan, TensorRelation, explain_logical
>>> def rel(labels, shape, tile):
...     return TensorRelation(labels, ChunkGrid(shape, tile), "float32")
>>> y, c = Scan(rel(("a", "b"), (4, 4), (2, 2)), "Y"), Scan(rel(("a", "b"), (4, 2), (2, 2)), "C")
>>> s = Scan(TensorRelation((), ChunkGrid((), ()), "float32"), "s")
>>> d = Join(y.relation, sources=(y, s), input_labels=(("a", "b"), ()), join="div")
>>> prod = Join(rel(("i", "k", "j"), (4, 2, 4), (2, 2, 2)), sources=(d, c),
...             input_labels=(("i", "j"), ("j", "k")), join="mul")
>>> top = Aggregate(rel(("i", "k"), (4, 2), (2, 2)), input=prod, over=("j",), agg="sum")
>>> print(explain_logical(scalar_out_of_sum(top)))
Join div (i,k),()  (i,k) 4x2 float32 grid 2x1 of 2x2
├─ Aggregate sum over [j]  (i,k) 4x2 float32 grid 2x1 of 2x2
│  └─ Join mul on [j] (i,j),(j,k)  (i,k,j) 4x2x4 float32 grid 2x1x2 of 2x2x2
│     ├─ Scan Y  (a,b) 4x4 float32 grid 2x2 of 2x2
│     └─ Scan C  (a,b) 4x2 float32 grid 2x1 of 2x2
└─ Scan s  () scalar float32 grid 1 of -
>>> scalar_out_of_sum(d) is d
True
"""

from __future__ import annotations

from tensorql.algebra import AggName, JoinName
from tensorql.logical.plan import Aggregate, Join, LogicalNode, walk
from tensorql.logical.rules.common import readers as readers_of
from tensorql.logical.rules.common import rebuild, results_of

NAME = "scalar_out_of_sum"
_SCALED = (JoinName.DIV, JoinName.MUL)  # Y / s, Y * s, s * Y
_NARROW = ("float16", "bfloat16")  # the unscaled products overflow at ordinary magnitudes


def scalar_out_of_sum(root: LogicalNode) -> LogicalNode:
    """``root`` with every scalar factor of a contraction's operand moved past it (see the
    module doc); ``root`` itself when there is none."""
    nodes = walk(root)
    readers = readers_of(nodes, root)
    results = {id(r) for r in results_of(root)}
    made = {}
    dropped: set[int] = set()
    for node in nodes:
        found = _match(node, readers, results)
        if found is None:
            continue
        k, scaled, operand, scalar = found
        made[id(node)] = _maker(node, k, scaled, operand, scalar)
        dropped.update((id(node.input), id(scaled)))
    return rebuild(root, made, frozenset(dropped))


def _match(node: LogicalNode, readers: dict[int, list[int]], results: set[int]
           ) -> tuple[int, Join, LogicalNode, LogicalNode] | None:
    """``(k, scaled, Y, s)`` when ``node`` sums over a contraction whose input ``k`` is
    ``scaled``, ``Y`` times or over the scalar ``s``; else None."""
    if not (isinstance(node, Aggregate) and node.agg == AggName.SUM and node.over
            and node.relation.dtype not in _NARROW):
        return None
    prod = node.input
    if not (isinstance(prod, Join) and prod.join == JoinName.MUL and len(prod.sources) == 2
            and id(prod) not in results and readers.get(id(prod)) == [id(node)]):
        return None
    for k, scaled in enumerate(prod.sources):
        if not (isinstance(scaled, Join) and scaled.join in _SCALED
                and len(scaled.sources) == 2 and id(scaled) not in results
                and readers.get(id(scaled)) == [id(prod)]
                and prod.sources[1 - k] is not scaled):
            continue
        positions = (1,) if scaled.join == JoinName.DIV else (1, 0)
        for p in positions:  # p: where the scalar is
            scalar, operand = scaled.sources[p], scaled.sources[1 - p]
            if (scalar.relation.ndim == 0 and scaled.input_labels[p] == ()
                    and scaled.input_labels[1 - p] == scaled.relation.labels
                    and operand.relation.grid == scaled.relation.grid
                    and operand.relation.dtype == scaled.relation.dtype == node.relation.dtype):
                return k, scaled, operand, scalar
    return None


def _maker(node: Aggregate, k: int, scaled: Join, operand: LogicalNode, scalar: LogicalNode):
    """The function making ``(sum over the contraction of Y) <op> s`` from rebuilt nodes."""
    prod = node.input
    assert isinstance(prod, Join)

    def make(memo: dict[int, LogicalNode]) -> LogicalNode:
        sources = list(memo[id(x)] for x in prod.sources[:k] + prod.sources[k + 1:])
        sources.insert(k, memo[id(operand)])
        contraction = Aggregate(node.relation, input=Join(
            prod.relation, sources=tuple(sources), input_labels=prod.input_labels,
            join=JoinName.MUL), over=node.over, agg=AggName.SUM)
        return Join(node.relation, sources=(contraction, memo[id(scalar)]),
                    input_labels=(node.relation.labels, ()), join=scaled.join)

    return make
