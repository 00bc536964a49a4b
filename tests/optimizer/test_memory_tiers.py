"""Issue 33, point 2: the host offload and the DuckDB spill tier enter a plan's time estimate
when its memory limit forces them (cost.tier_bytes), checked against a hand count of what
each step of a one-device plan holds."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tensorql as tq
from tensorql.optimizer.topology import MACHINES, Topology


def _chain(db):
    """x @ w1 -> relu -> @ w2 over 64 x 64 float32 tensors (16 KiB each)."""
    rng = np.random.default_rng(7)
    t = {name: db.from_numpy(f"tier_{name}", rng.standard_normal((64, 64)).astype(np.float32))
         for name in ("x", "w1", "w2")}
    return (t["x"] @ t["w1"]).relu() @ t["w2"]


def _held_by_step(plan) -> list[int]:
    """Bytes one device holds after each step, counted from the graph alone: a tensor lives
    from the step that makes it (a stored one: its first reader) to its last reader, the
    result to the end."""
    graph = plan.graph
    steps = len(graph.nodes)
    held = [0] * steps
    for node in graph.nodes:
        readers = [c.index for c in graph.nodes if any(e.producer == node.index
                                                      for e in c.inputs)]
        if not readers and node.index != graph.root:
            continue
        first = min(readers) if not node.inputs else node.index
        last = steps - 1 if node.index == graph.root else max(readers)
        size = int(np.prod(node.sizes[:len(node.labels) - len(node.agg_labels)])) \
            * node.itemsize
        for t in range(first, last + 1):
            held[t] += size
    return held


@pytest.fixture
def db():
    con = tq.connect()
    yield con
    con.close()


def test_no_limit_no_tiers(db):
    plan = tq.optimize(_chain(db), devices=2, topology="1x2")
    assert plan.estimate.tier_s == 0
    assert [name for name, _ in plan.estimate.level_bytes] == ["intra", "inter"]
    assert "host" not in plan.explain()


@pytest.mark.parametrize("limit_kib, host_kib", [(40, 1 << 20), (40, 8), (20, 8)])
def test_limit_forces_host_offload_and_spill(db, limit_kib, host_kib):
    topo = dataclasses.replace(Topology.flat(1, "cpu-gloo"), host_memory=host_kib << 10)
    plan = tq.optimize(_chain(db), devices=1, memory_limit=limit_kib << 10, topology=topo)
    held = _held_by_step(plan)
    over = max(0, max(held) - (limit_kib << 10))
    spill = max(0, over - (host_kib << 10))
    est = plan.estimate
    assert over > 0  # the limit is below what the plan holds at its fullest step
    assert est.bytes_at("host") == 2 * over
    assert est.bytes_at("duckdb") == 2 * spill
    gloo = MACHINES["cpu-gloo"]
    expect = 2 * over / gloo.host_bandwidth + 2 * spill / gloo.spill_bandwidth
    assert est.tier_s == pytest.approx(expect, rel=1e-12)
    assert est.total_s == pytest.approx(est.compute_s + est.transfer_s + expect, rel=1e-12)
    assert est.bytes_at("intra") + est.bytes_at("inter") == plan.cost.bytes_moved
    line = plan.explain().splitlines()[2]
    assert line.startswith("traffic by level:") and "memory tiers" in line
    assert ("duckdb" in line) == bool(spill)


def test_tiers_shown_without_a_topology(db):
    """A plan given no topology shows the tiers' traffic when its limit forces them."""
    expr = _chain(db)
    plan = tq.optimize(expr, devices=1, memory_limit="20KiB")
    assert plan.estimate.bytes_at("host") > 0
    assert any(line.startswith("traffic by level:") and "host" in line
               for line in plan.explain().splitlines())
    free = tq.optimize(expr, devices=1, memory_limit="1MiB")
    assert free.estimate.tier_s == 0 and "traffic by level" not in free.explain()


def test_spill_is_per_node(db):
    """Two nodes of one device: each node's host holds its own device's evictions."""
    base = Topology.nodes(2, 1, "cpu-gloo")
    expr = _chain(db)
    roomy = tq.optimize(expr, devices=2, memory_limit="20KiB", topology=base)
    tight = tq.optimize(expr, devices=2, memory_limit="20KiB",
                        topology=dataclasses.replace(base, host_memory=1024))
    assert roomy.estimate.bytes_at("host") > 0 and roomy.estimate.bytes_at("duckdb") == 0
    assert tight.estimate.bytes_at("duckdb") > 0
    assert tight.estimate.tier_s > roomy.estimate.tier_s
