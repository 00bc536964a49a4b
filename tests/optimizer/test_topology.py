"""The device topology: its object, its prices against exact byte counts, and the plans it
makes the search choose (issue 33: planning for a cluster)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tensorql as tq
from tensorql.exec.distributed import RankLayout, derive_topology, job_topology
from tensorql.models.workloads import attention, llama, mlp
from tensorql.optimizer.cost import (
    build_table,
    pair_bytes,
    partial_seconds,
    transition_levels,
    transition_matrix,
    transition_seconds,
)
from tensorql.optimizer.graph import OpGraph
from tensorql.optimizer.topology import MACHINES, Topology, TopologyError
from tensorql.options import Options

# the acceptance topology: 2 nodes of 8 devices, the inter-node link 10x slower
CLUSTER = Topology.nodes(2, 8, intra_bandwidth=250e9, inter_bandwidth=25e9)


@pytest.fixture
def db():
    with tq.connect(workers=2) as database:
        yield database


# -- the object ------------------------------------------------------------------------------
def test_constructors_and_levels():
    t = Topology.nodes(2, 4, machine="dgx-h100")
    assert t.devices == 8 and t.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert (t.intra_bandwidth, t.inter_bandwidth) == (450e9, 50e9)
    assert [t.level(0, d) for d in (0, 3, 4)] == ["device", "intra", "inter"]
    assert Topology.flat(5).is_flat and not t.is_flat
    odd = Topology.from_groups([[0, 3], [1, 2, 4]])
    assert odd.node_of(3) == 0 and odd.level(1, 4) == "intra" and odd.level(0, 1) == "inter"
    assert Topology.parse("2x4:dgx-h100", 8) == t
    assert Topology.parse("dgx-a100", 16) == Topology.nodes(2, 8, "dgx-a100")
    assert Topology.parse(t) is t and Topology.parse(None, 3) == Topology.flat(3)
    assert set(MACHINES) >= {"dgx-a100", "dgx-h100", "pcie-ethernet", "cpu-gloo"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.groups = ()  # type: ignore[misc]


@pytest.mark.parametrize("bad, match", [
    (lambda: Topology.from_groups([[0, 1], [1, 2]]), "once each"),
    (lambda: Topology.from_groups([[0], [2]]), "once each"),
    (lambda: Topology.nodes(2, 2, inter_bandwidth=0), "inter_bandwidth"),
    (lambda: Topology.nodes(2, 2, machine="tpu"), "unknown machine 'tpu'.*dgx-a100"),
    (lambda: Topology.parse("2x4", 6), "8 devices, the plan 6"),
    (lambda: Topology.parse("dgx-a100", 12), "not whole nodes of 8"),
    (lambda: Topology.parse(3.5, 4), "must be a Topology"),
])
def test_bad_topologies_name_the_problem(bad, match):
    with pytest.raises(TopologyError, match=match) as info:
        bad()
    assert isinstance(info.value, tq.TensorQLError)


def test_prices_by_slowest_link_and_busiest_node():
    t = Topology.nodes(2, 2, intra_bandwidth=100.0, inter_bandwidth=10.0)
    pair = np.zeros((4, 4))
    pair[0, 1] = 200                      # inside node 0: 200 B over 2 links of 100 B/s
    assert t.transfer_seconds(pair) == pytest.approx(1.0)
    pair[0, 2] = 40                       # node 1 receives 40 B over 2 NICs of 10 B/s
    assert t.transfer_seconds(pair) == pytest.approx(2.0)
    pair[3, 1] = 40                       # node 0 now also receives 40 B from node 1
    assert t.transfer_seconds(pair) == pytest.approx(1.0 + 2.0)
    assert t.level_bytes(pair.astype(np.int64)) == {"intra": 200, "inter": 80}
    # flat: bytes over every device's link, whichever pair moves them
    flat = Topology.flat(4, "dgx-h100")
    assert flat.transfer_seconds(pair) * flat.unit_rate == pytest.approx(pair.sum())


# -- the prices against exact byte counts ----------------------------------------------------
@pytest.mark.parametrize("topo", [Topology.nodes(2, 2, intra_bandwidth=8e9, inter_bandwidth=1e9),
                                  Topology.from_groups([[0, 3], [1, 2]], inter_bandwidth=5e9),
                                  Topology.nodes(2, 3)])
def test_transition_seconds_equal_pricing_the_exact_pairs(db, topo):
    n = topo.devices
    x = db.from_numpy("x", np.ones((12, 6), dtype=np.float32))
    y = x.exp()  # each of the source's placements against each of the map's
    graph = OpGraph.build(y.node)
    assert len(graph.nodes) == 2
    src, node = graph.nodes
    tp = build_table(graph, src, n)
    tc = build_table(graph, node, n)
    got = transition_seconds(tp, tc, node, node.inputs[0], src.itemsize, topo)
    assert got.shape == (len(tp.cands), len(tc.cands))
    for q in range(len(tp.cands)):
        for c in range(len(tc.cands)):
            want = topo.transfer_seconds(pair_bytes(graph, [tp.layouts[q], tc.layouts[c]], n))
            assert got[q, c] == pytest.approx(want, rel=1e-12, abs=1e-18), (q, c)


@pytest.mark.parametrize("topo", [Topology.nodes(2, 3),
                                  Topology.from_groups([[0, 5], [1, 2, 3, 4]])])
def test_bytes_per_level_sum_to_the_byte_matrix(db, topo):
    """Every edge of a block's graph: the bytes per node and level add up to the byte
    matrix the flat search uses (with a topology the search keeps that sum as its bytes)."""
    expr = llama(db, layers=1, batch=2, seq=6, d_model=12, heads=3, head_dim=4, d_ff=18,
                 materialize=False).output
    graph = OpGraph.build(expr.node)
    tables = [build_table(graph, node, 6) for node in graph.nodes]
    checked = 0
    for node in graph.nodes:
        for edge in node.inputs:
            prod = graph.nodes[edge.producer]
            args = (tables[edge.producer], tables[node.index], node, edge, prod.itemsize)
            intra, inter = transition_levels(*args, topo)
            want = transition_matrix(*args, 6)
            np.testing.assert_array_equal((intra + inter).sum(axis=2), want)
            assert intra.shape[2] == len(topo.groups) and (inter >= 0).all()
            checked += 1
    assert checked > 20


def test_partial_seconds_price_the_partial_sends(db):
    topo = Topology.nodes(2, 2, intra_bandwidth=4e9, inter_bandwidth=1e9)
    a = db.from_numpy("a", np.ones((4, 8), dtype=np.float32))
    b = db.from_numpy("b", np.ones((8, 6), dtype=np.float32))
    graph = OpGraph.build((a @ b).node)
    mm = graph.nodes[graph.root]
    table = build_table(graph, mm, 4)
    got = partial_seconds(table, mm, topo)
    for c, lay in enumerate(table.layouts):
        pair = np.zeros((4, 4))
        elems = dict(zip(lay.outputs.keys(), np.prod(lay.outputs.lens, axis=1)))
        for s, d, piece in lay.partial_sends():
            pair[s, d] += elems[piece] * 4
        assert got[c] == pytest.approx(topo.transfer_seconds(pair))
    assert got.max() > 0  # some candidate splits the sum


# -- flat: the plan is today's ---------------------------------------------------------------
def _graphs(db):
    a = db.from_numpy("a", np.random.default_rng(0).random((16, 12), dtype=np.float32))
    b = db.from_numpy("b", np.random.default_rng(1).random((12, 8), dtype=np.float32))
    yield "chain", (a @ b).relu() @ b.T
    yield "mlp", mlp(db, batch=16, d_model=32, d_ff=64, materialize=False).output
    yield "attention", attention(db, batch=2, seq=16, d_model=32, heads=4,
                                 materialize=False).output
    yield "llama", llama(db, layers=1, batch=1, seq=8, d_model=16, heads=2, head_dim=8,
                         d_ff=32, materialize=False).output


@pytest.mark.parametrize("devices", [2, 4, 6])
def test_flat_topology_plans_as_without_one(db, devices):
    for name, expr in _graphs(db):
        plain = tq.optimize(expr, devices=devices)
        flat = tq.optimize(expr, devices=devices, topology=Topology.flat(devices, "dgx-h100"))
        assert flat.ops == plain.ops and flat.cost == plain.cost, name
        assert flat.estimate.bytes_at("inter") == 0
        assert flat.estimate.bytes_at("intra") == plain.cost.bytes_moved, name
        assert plain.topology is None and "topology" not in plain.explain()


# -- the acceptance test: 2 nodes x 8 devices, inter-node 10x slower -------------------------
HEADS, SEQ, D_FF = 8, 32, 384


def _block(db):
    return llama(db, layers=1, batch=2, seq=SEQ, d_model=128, heads=HEADS, head_dim=16,
                 d_ff=D_FF, materialize=False).output


@pytest.fixture(scope="module")
def cluster():
    """The block's plan on CLUSTER and planned flat (once for the tests below)."""
    with tq.connect(workers=2) as database:
        expr = _block(database)
        yield tq.optimize(expr, devices=16, topology=CLUSTER), tq.optimize(expr, devices=16)


def _cut_inside_nodes(plan, op, label, topo) -> bool:
    """Every node's devices run tasks of at least two pieces of ``label``."""
    lay = plan.layout(op.index)
    k = op.labels.index(label)
    for members in topo.groups:
        here = np.isin(lay.device, members)
        if len(np.unique(lay.index[here, k])) < 2:
            return False
    return True


def _inter_share(plan, topo):
    levels = topo.level_bytes(plan.pair_bytes())
    return levels["inter"] / plan.cost.bytes_moved


def test_cluster_plan_keeps_traffic_in_nodes(cluster):
    plan, flat = cluster
    # less than 1/8 of the bytes cross nodes; planned flat, nearly half of them would
    assert _inter_share(plan, CLUSTER) < 1 / 8
    assert _inter_share(flat, CLUSTER) > 1 / 3
    assert plan.estimate.bytes_at("inter") + plan.estimate.bytes_at("intra") \
        == plan.cost.bytes_moved
    # the attention's core (scores, softmax, weighted values: two labels of the sequence)
    # is cut by heads inside each node, and every FFN operation by d_ff inside each node
    # (the elementwise steps between scores and softmax may cut them otherwise)
    core = [op for op in plan.ops if (op.kind == "softmax" or op.n_agg)
            and list(op.sizes).count(SEQ) == 2 and HEADS in op.sizes]
    ffn = [op for op in plan.ops if op.kind not in ("source", "constant") and D_FF in op.sizes]
    assert len(core) >= 3 and len(ffn) >= 4
    for op in core:
        assert _cut_inside_nodes(plan, op, op.labels[op.sizes.index(HEADS)], CLUSTER), op.vector
    for op in ffn:
        assert _cut_inside_nodes(plan, op, op.labels[op.sizes.index(D_FF)], CLUSTER), op.vector
    # on the topology, the plan's transfers take less time than the flat plan's would
    assert plan.estimate.transfer_s < CLUSTER.transfer_seconds(flat.pair_bytes())
    text = plan.explain()
    assert "topology: 2 nodes x 8 devices (dgx-a100): intra 250.0 GB/s, inter 25.0 GB/s" in text
    assert "traffic by level: intra " in text and "estimated time " in text


def test_estimate_parts(cluster):
    plan, _ = cluster
    est = plan.estimate
    flops = sum(op.flops_per_device for op in plan.ops)
    assert est.compute_s == pytest.approx(flops / CLUSTER.device_flops)
    # transfers: at least every byte over the fastest links, at most every byte over the
    # slowest and through one node
    low = plan.cost.bytes_moved / (16 * CLUSTER.intra_bandwidth)
    high = plan.cost.bytes_moved / CLUSTER.inter_bandwidth
    assert low <= est.transfer_s <= high
    assert est.total_s == est.compute_s + est.transfer_s


# -- plumbing: Options, the pipeline, a torch.distributed job --------------------------------
def test_options_topology_reaches_the_plan():
    with tq.connect(devices=4, topology="2x2:dgx-h100", workers=2) as db:
        x = db.from_numpy("x", np.arange(64, dtype=np.float32).reshape(8, 8))
        text = (x @ x.T).explain()
        assert "topology: 2 nodes x 2 devices (dgx-h100)" in text
        np.testing.assert_allclose((x @ x.T).numpy(), (np.arange(64.0).reshape(8, 8) @
                                                       np.arange(64.0).reshape(8, 8).T))
    with tq.connect(devices=4, topology="2x4", workers=2) as db:
        x = db.from_numpy("x", np.ones((8, 8), dtype=np.float32))
        with pytest.raises(TopologyError, match="8 devices, the plan 4"):
            (x @ x).numpy()


def test_options_from_env(monkeypatch):
    monkeypatch.setenv("TENSORQL_TOPOLOGY", "2x8:dgx-h100")
    assert Options.from_env().topology == "2x8:dgx-h100"


def test_a_job_derives_its_topology():
    # host names decide: the ranks of one host are one node
    assert derive_topology(RankLayout(0, 4), ["n1", "n2", "n1", "n2"]).groups == ((0, 2), (1, 3))
    two = derive_topology(RankLayout(1, 2, local=3), ["h", "h"], machine="dgx-h100")
    assert two.is_flat and two.devices == 6 and two.machine == "dgx-h100"
    # else LOCAL_WORLD_SIZE (torchrun numbers ranks machine by machine)
    env = {"LOCAL_WORLD_SIZE": "2"}
    assert derive_topology(RankLayout(0, 4), environ=env) == Topology.nodes(2, 2, "cpu-gloo")
    assert derive_topology(RankLayout(0, 4), environ={}).is_flat
    assert derive_topology(RankLayout(0, 4), environ={"LOCAL_WORLD_SIZE": "3"}).is_flat
    assert job_topology(RankLayout(0, 1)).is_flat  # no process group: one node
