"""Graph builders shared by the runtime tests."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

import tensorql as tq
from tensorql.exec.taskgraph import TaskGraph
from tensorql.physical.planner import PhysicalPlan


def matmul_graph(n: int = 128, tile: int = 32, seed: int = 0):
    """A tiled ``A @ B`` task graph with its inputs (float64 for exact comparisons)."""
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    db = tq.connect(devices="cpu", workers=2)
    A, B = db.from_numpy("A", a, tile=(tile, tile)), db.from_numpy("B", b, tile=(tile, tile))
    q = (A @ B).compile()
    # one task per pair of tiles (no series): the memory plan's tests want many small tasks
    q = replace(q, physical=PhysicalPlan.build(q.logical, db.chunk_store, fuse_bytes=0))
    return q, q.physical.task_graph(), a, b


def dense(q, outputs) -> torch.Tensor:
    sid = q.physical.result_step.id
    rel = q.physical.result_step.relation
    out = torch.empty(rel.shape, dtype=torch.float64)
    for ref, chunk in outputs.items():
        if ref.step == sid:
            out[rel.grid.slices(ref.key)] = chunk
    return out


def chunk(graph: TaskGraph) -> int:
    return max(graph.chunk_bytes.values())
