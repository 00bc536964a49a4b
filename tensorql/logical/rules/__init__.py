"""Logical rewrite rules, applied once between lowering and partitioning.

Each rule is one module with one function ``LogicalNode -> LogicalNode`` that returns the
very node it was given for "no change" and new (frozen) nodes otherwise; :data:`RULES` is
the order they run in. What they make are logical nodes like any other (``Attention``,
``Pointwise``), so the partition stage cuts them and the physical builder runs them on one
device or many alike; EXPLAIN names the rules that fired.

>>> import torch
>>> from tensorql.einsum.graph import Constant, MapOp
>>> from tensorql.grid import ChunkGrid
>>> from tensorql.logical.lower import lower
>>> x = Constant(shape=(4, 4), dtype="float32", value=torch.ones(4, 4),
...              grid=ChunkGrid((4, 4), (2, 4)))
>>> done = rewrite([lower(MapOp.build("relu", MapOp.build("exp", x)))])
>>> done.fired, [type(r).__name__ for r in done.roots]
(('fuse_pointwise',), ['Pointwise'])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tensorql.logical.plan import LogicalNode, Results
from tensorql.logical.rules.attention import match_attention
from tensorql.logical.rules.pointwise import fuse_pointwise
from tensorql.logical.rules.scalar import scalar_out_of_sum
from tensorql.logical.rules.update import contiguous_update
from tensorql.logical.rules.weight_rows import whole_rows_for_wide_weights

Rule = Callable[[LogicalNode], LogicalNode]

# attention first: its chain's maps and joins are not pointwise chains of their own; a scalar
# factor leaves its contraction before the pointwise chains are cut; an update's gradient is
# retiled (contiguous_update) before the chains are cut too; a product's operands are
# retiled for a wide weight (whole_rows_for_wide_weights) last, the chains feeding it kept
RULES: tuple[Rule, ...] = (match_attention, scalar_out_of_sum, contiguous_update,
                           fuse_pointwise, whole_rows_for_wide_weights)


@dataclass(frozen=True)
class Rewritten:
    """The results of a plan after the rules, and the names of the rules that changed it."""

    roots: tuple[LogicalNode, ...]
    fired: tuple[str, ...]


def rewrite(roots: Sequence[LogicalNode], rules: Sequence[Rule] = RULES) -> Rewritten:
    """``roots`` (one result, or several planned together) after each of ``rules`` in turn."""
    root = roots[0] if len(roots) == 1 else Results(roots[0].relation, sources=tuple(roots))
    fired = []
    for rule in rules:
        new = rule(root)
        if new is not root:
            fired.append(rule.__name__)
            root = new
    done = root.sources if isinstance(root, Results) else (root,)
    return Rewritten(tuple(done), tuple(fired))


__all__ = ["RULES", "Rewritten", "contiguous_update", "fuse_pointwise", "match_attention",
           "rewrite", "scalar_out_of_sum", "whole_rows_for_wide_weights"]
