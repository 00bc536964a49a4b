"""cost.transition_levels (bytes every node receives per link level, array-wise) against a slow
per-pair reference written from the definition: for a producer and a consumer candidate, every
region a consumer device reads (each once a device), cut along the producer's output pieces,
and each overlap counted on the level between the piece's owner and the reader."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tensorql as tq
from tensorql.models.workloads import llama
from tensorql.optimizer.cost import (
    Layout,
    build_table,
    transition_levels,
    transition_matrix,
    transition_seconds,
)
from tensorql.optimizer.graph import OpGraph
from tensorql.optimizer.topology import Topology


def _reference_levels(prod: Layout, cons: Layout, axes: list[int], topo: Topology,
                      itemsize: int) -> tuple[np.ndarray, np.ndarray]:
    """Bytes each node receives from its own devices and from other nodes, (G,) each, for
    one producer and one consumer layout: pure Python, one region and one piece at a time."""
    node = [topo.node_of(d) for d in range(topo.devices)]
    out = prod.outputs
    pieces = [(tuple(int(x) for x in out.starts[p]),
               tuple(int(x) for x in out.starts[p] + out.lens[p]), int(out.device[p]))
              for p in range(len(out.device))]
    intra = np.zeros(len(topo.groups), dtype=np.int64)
    inter = np.zeros_like(intra)
    seen = set()
    for t in range(len(cons.device)):
        dev = int(cons.device[t])
        lo = tuple(int(cons.starts[t, a]) for a in axes)
        hi = tuple(int(cons.starts[t, a] + cons.lens[t, a]) for a in axes)
        if (dev, lo, hi) in seen:
            continue  # a device reads a region once, whichever of its tasks need it
        seen.add((dev, lo, hi))
        for plo, phi, owner in pieces:
            held = math.prod(max(0, min(h, ph) - max(lo_, pl))
                             for lo_, h, pl, ph in zip(lo, hi, plo, phi))
            if owner == dev or not held:
                continue
            if node[owner] == node[dev]:
                intra[node[dev]] += held
            else:
                inter[node[dev]] += held
    return intra * itemsize, inter * itemsize


def _cases(seed: int) -> tuple[OpGraph, int]:
    """A small LLaMA block of seeded random shape and a device count."""
    rng = np.random.default_rng(seed)
    heads = int(rng.integers(2, 4))
    db = tq.connect()
    expr = llama(db, layers=1, batch=int(rng.integers(1, 3)), seq=int(rng.choice([4, 6, 8])),
                 d_model=int(rng.choice([8, 12, 16])), heads=heads,
                 head_dim=int(rng.choice([2, 4])), d_ff=int(rng.choice([10, 12, 24])),
                 materialize=False, prefix=f"lv{seed}_").output
    graph = OpGraph.build(expr.node)
    db.close()
    return graph, rng


TOPOLOGIES = {
    "2x2": lambda: Topology.nodes(2, 2, intra_bandwidth=8e9, inter_bandwidth=1e9),
    "2x3": lambda: Topology.nodes(2, 3),
    "3x2": lambda: Topology.nodes(3, 2),
    "odd groups": lambda: Topology.from_groups([[0, 5], [1, 2, 3, 4]]),
    "interleaved": lambda: Topology.from_groups([[0, 2], [1, 3]]),
    "flat 4": lambda: Topology.flat(4),
}


@pytest.mark.parametrize("seed,name", list(enumerate(sorted(TOPOLOGIES))))
@pytest.mark.parametrize("per_device", [1, 2])
def test_transition_levels_equal_the_per_pair_definition(seed, name, per_device):
    """Every edge of a random small block, on nodes, on odd groups and flat (no topology:
    one node, nothing inter), one and two pieces a device (several tasks on one device, a
    device owning several pieces; reduce-scatter candidates included): the array-wise
    levels equal the reference on a seeded sample of candidate pairs, and sum to the byte
    matrix of the flat search."""
    topo = TOPOLOGIES[name]()
    n = topo.devices
    graph, rng = _cases(seed * 10 + per_device)
    tables = [build_table(graph, node, n, pieces=per_device * n) for node in graph.nodes]
    checked = pairs = 0
    for node in graph.nodes:
        for edge in node.inputs:
            prod = graph.nodes[edge.producer]
            if prod.loaded_where_read:
                continue
            tp, tc = tables[edge.producer], tables[node.index]
            args = (tp, tc, node, edge, prod.itemsize)
            intra, inter = transition_levels(*args, topo)
            assert intra.shape == inter.shape == (len(tp.cands), len(tc.cands), len(topo.groups))
            np.testing.assert_array_equal((intra + inter).sum(axis=2),
                                          transition_matrix(*args, n))
            seconds = transition_seconds(*args, topo)
            np.testing.assert_array_equal(seconds, topo.node_seconds(intra, inter))
            if topo.is_flat:
                assert not inter.any()
            axes = [node.labels.index(a) for a in edge.axes]
            sample = rng.choice(len(tp.cands) * len(tc.cands),
                                size=min(40, len(tp.cands) * len(tc.cands)), replace=False)
            for flat in sample:
                q, c = divmod(int(flat), len(tc.cands))
                want = _reference_levels(tp.layouts[q], tc.layouts[c], axes, topo,
                                         prod.itemsize)
                np.testing.assert_array_equal(intra[q, c], want[0], err_msg=f"{node.name} {q} {c}")
                np.testing.assert_array_equal(inter[q, c], want[1], err_msg=f"{node.name} {q} {c}")
                pairs += 1
            checked += 1
    assert checked > 15 and pairs > 300
    scattered = any(t.scattered.any() for t in tables)
    assert scattered  # the reduce-scatter layouts were among the candidates
