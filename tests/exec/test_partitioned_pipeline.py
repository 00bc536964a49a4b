"""The optimizer's partitioning is what runs: ``tq.connect(devices=N)`` places every task on the
device the plan chose, moves data only by real copies, and those copies move exactly the bytes
the cost model predicts, per device pair."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensorql as tq
from tensorql.models import attention, llama, llama_block, mlp


def _workload(db, name):
    if name == "mlp":
        return mlp(db, batch=10, d_model=12, d_ff=20)
    if name == "attention":
        return attention(db, batch=2, seq=6, d_model=12, heads=3, head_dim=4)
    if name == "llama_block":
        return llama_block(db, batch=2, seq=6, d_model=12, heads=3, head_dim=4, d_ff=20)
    return llama(db, layers=2, batch=1, seq=5, d_model=8, heads=2, head_dim=4, d_ff=12,
                 materialize=True)


def _check_run(expr, want, n, rtol=1e-4, atol=1e-4):
    query = expr.compile()
    assert query.partition is not None and query.partition.devices == n
    result = query.run(dense=True)
    np.testing.assert_allclose(result.dense().numpy(), want, rtol=rtol, atol=atol)
    predicted = query.partition.pair_bytes()
    measured = np.array(result.stats.moved)
    np.testing.assert_array_equal(measured, predicted)
    assert measured.sum() == query.partition.cost.bytes_moved
    assert all(measured[d, d] == 0 for d in range(n))
    placed = {t.device for s in query.physical.steps for t in s.tasks}
    assert placed <= set(range(n))
    return query, result


@pytest.mark.parametrize("name", ["mlp", "attention", "llama_block", "llama2"])
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_workloads_run_as_partitioned(name, n):
    with tq.connect(devices=n, workers=2) as db:
        w = _workload(db, name)
        _check_run(w.output, w.reference(), n)


@pytest.mark.parametrize("strategy", ["data", "model"])
def test_strategies_are_what_runs(strategy):
    with tq.connect(devices=4, workers=2, strategy=strategy) as db:
        w = _workload(db, "llama_block")
        query, _ = _check_run(w.output, w.reference(), 4)
        assert query.partition.strategy == strategy


def test_semirings_and_broadcast_partitioned():
    rng = np.random.default_rng(3)
    for n in (2, 3, 5):
        with tq.connect(devices=n, workers=2) as db:
            a = db.from_numpy("pa", rng.standard_normal((5, 7)).astype(np.float32), tile=(2, 3))
            b = db.from_numpy("pb", rng.standard_normal((7, 1)).astype(np.float32))
            c = db.from_numpy("pc", rng.standard_normal((1, 4)).astype(np.float32))
            na, nb, nc = a.numpy(), b.numpy(), c.numpy()
            cases = [
                (tq.einsum("ij,jk->ik", a, b * c, join="add", agg="max"),
                 (na[:, :, None] + (nb * nc)[None]).max(axis=1)),
                (tq.einsum("ii->i", tq.einsum("ij,kj->ik", a, a)), np.einsum("ij,ij->i", na, na)),
                ((a - a.max(axis=1, keepdims=True)).exp().sum(axis=0),
                 np.exp(na - na.max(axis=1, keepdims=True)).sum(axis=0)),
            ]
            for expr, want in cases:
                _check_run(expr, want, n, rtol=1e-5, atol=1e-5)


def test_partial_aggregates_reduced_on_owner():
    # only the aggregated label can be split: partial sums travel to the output's owner
    rng = np.random.default_rng(0)
    with tq.connect(devices=4, workers=2) as db:
        v = db.from_numpy("v", rng.standard_normal((1, 64)).astype(np.float32))
        query, result = _check_run(tq.einsum("ij,ij->i", v, v), (v.numpy() ** 2).sum(1), 4)
        op = query.partition.ops[-1]
        assert op.pieces == (1, 4)
        assert query.partition.cost.bytes_moved == op.partial_bytes + sum(
            m.bytes for m in op.inputs)
        assert "partials of" in " ".join(s.name for s in query.physical.steps)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("join,agg", [("mul", "sum"), ("add", "max")])
def test_partial_aggregates_reduce_scattered(n, join, agg):
    """Splitting only the contracted label, each device ends up owning a part of the output:
    every device sends the parts it does not own (cut out first, so only they travel) and
    folds the ones it receives -- not every partial onto one device."""
    rng = np.random.default_rng(11)
    with tq.connect(devices=n, workers=2) as db:
        x = db.from_numpy("rx", rng.standard_normal((12, 96)).astype(np.float32))
        w = db.from_numpy("rw", rng.standard_normal((96, 24)).astype(np.float32))
        a, b = x.numpy()[:, :, None], w.numpy()[None]
        want = (a * b).sum(1) if join == "mul" else (a + b).max(1)
        query, result = _check_run(tq.einsum("ij,jk->ik", x, w, join=join, agg=agg),
                                   want, n)
        op = query.partition.ops[-1]
        assert op.pieces == (1, 1, n) and op.scatter == (0, n)
        assert op.out_pieces == (n, 1)
        assert "reduce-scatter" in query.partition.explain()
        # each device receives the n - 1 parts of the others: balanced, not one column
        moved = np.array(result.stats.moved)
        part = 12 // n * 24 * 4
        assert [int(moved[:, d].sum()) for d in range(n)] == [(n - 1) * part] * n
        owners = {t.device for t in query.physical.result_step.tasks}
        assert owners == set(range(n))


ops = st.sampled_from([("mul", "sum"), ("add", "max"), ("add", "min"), ("max", "max"),
                       ("mul", "max"), ("sub", "sum")])


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 7), min_size=4, max_size=4), pair=ops,
       n=st.sampled_from([2, 3, 4, 8]), seed=st.integers(0, 2**16))
def test_random_einsum_graphs_match_torch(sizes, pair, n, seed):
    """A random two-level graph: an extended einsum feeding a map and a second einsum."""
    i, j, k, m = sizes
    join, agg = pair
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(i, j, generator=gen, dtype=torch.float64)
    y = torch.randn(j, k, generator=gen, dtype=torch.float64)
    z = torch.randn(k, m, generator=gen, dtype=torch.float64)
    with tq.connect(devices=n, workers=2) as db:
        tx, ty, tz = (db.from_torch(name, t) for name, t in (("x", x), ("y", y), ("z", z)))
        first = tq.einsum("ij,jk->ik", tx, ty, join=join, agg=agg)
        expr = tq.einsum("ik,km->im", first.relu(), tz)
        want = torch.relu(_torch_extended(x, y, join, agg)) @ z
        _check_run(expr, want.numpy(), n, rtol=1e-9, atol=1e-9)


def _torch_extended(x, y, join, agg):
    a, b = x[:, :, None], y[None]
    joined = {"mul": a * b, "add": a + b, "sub": a - b, "max": torch.maximum(a, b)}[join]
    return {"sum": joined.sum(1), "max": joined.amax(1), "min": joined.amin(1)}[agg]


def test_same_order_in_lowering_and_optimizer():
    """The optimizer's operations are the lowering's steps, in the lowering's order."""
    from tensorql.logical.plan import Aggregate, Join, walk

    rng = np.random.default_rng(1)
    with tq.connect(devices=2) as db:
        names = "abcde"
        shapes = [(4, 30), (30, 2), (2, 40), (40, 3), (3, 5)]
        ts = [db.from_numpy(nm, rng.standard_normal(s).astype(np.float32))
              for nm, s in zip(names, shapes)]
        query = tq.einsum("ab,bc,cd,de,ef->af", *ts).compile()
        lowered = [n for n in walk(query.logical) if isinstance(n, Aggregate)
                   or (isinstance(n, Join) and not any(
                       isinstance(m, Aggregate) and m.input is n for m in walk(query.logical)))]
        planned = [n.logical for n in query.partition.graph.nodes if n.kind == "einsum"]
        assert planned == lowered
        assert [s.name for s in query.physical.steps if s.name.startswith("Aggregate")][:4] == \
            [n.name for n in query.partition.graph.nodes if n.kind == "einsum"]


def test_null_devices_refuse_to_return_values():
    with tq.connect(devices="null:2") as db:
        a = db.from_numpy("a", np.ones((4, 4), np.float32))
        with pytest.raises(tq.ExecutionError, match="null devices"):
            (a @ a).numpy()
        assert "devices:" in (a @ a).explain(analyze=True)


def test_devices_option_read_in_one_place():
    from tensorql.options import device_names

    assert device_names(8) == tuple(f"cpu:{i}" for i in range(8))
    assert device_names("2") == ("cpu:0", "cpu:1")
    for bad in (0, True, "gpu", ["cpu:0", "cpu:0"], 1.5):
        with pytest.raises(tq.OptionError):
            tq.connect(devices=bad)


def test_optimize_is_what_a_session_runs():
    with tq.connect(devices=4, workers=2) as db:
        w = mlp(db, batch=12, d_model=8, d_ff=16)
        session_plan = w.output.compile().partition
        assert tq.optimize(w.output, devices=4).explain() == session_plan.explain()
        assert tq.optimize(w.output, devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"]).cost == \
            session_plan.cost
        assert "partitioning for 4 devices" in w.output.explain()


def test_placement_follows_a_transposed_producer():
    """An operation reading its input transposed is placed label-swapped, so pieces that
    match stay where they are instead of being sent to the devices of a row-major rule."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 12)).astype(np.float32)
    with tq.connect(devices=4, workers=2) as db:
        t = db.from_numpy("t", x)
        m = rng.standard_normal((12, 12)).astype(np.float32)
        # (a product, not a map: a map and the transpose would fuse into one step)
        expr = tq.einsum("ij->ji", t @ db.from_numpy("m", m))
        query, _ = _check_run(expr, (x @ m).T, 4)
        assert query.partition.ops[-1].bytes_moved == 0
        # with both labels split 2 ways, only the label-swapped placement moves nothing
        from tensorql.optimizer.search import Problem

        problem = Problem.build(query.partition.graph, 4)
        (producer, consumer, _, matrix), = [e for e in problem.edges if e[1] == 3]
        prod_table, cons_table = problem.tables[producer], problem.tables[consumer]
        q = next(k for k, c in enumerate(prod_table.cands) if tuple(c) == (2, 2, 1))
        costs = {(tuple(c), o): int(matrix[q, k])
                 for k, (c, o) in enumerate(zip(cons_table.cands, cons_table.orders))}
        assert costs[((2, 2), (1, 0))] == 0 < costs[((2, 2), (0, 1))]


def test_placement_may_follow_any_transposed_operand():
    """Each operand read in another label order offers its own placement: the search can
    keep either operand's pieces where they are."""
    from tensorql.optimizer.search import Problem

    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 6, 8)).astype(np.float32)   # (b, a, c)
    y = rng.standard_normal((8, 6, 4)).astype(np.float32)   # (c, a, b)
    with tq.connect(devices=4, workers=2) as db:
        tx, ty = db.from_numpy("tx", x), db.from_numpy("ty", y)
        expr = tq.einsum("bac,cab->abc", tx.exp(), ty.exp(), join="add")
        want = np.exp(x).transpose(1, 0, 2) + np.exp(y).transpose(1, 2, 0)
        query, _ = _check_run(expr, want, 4, rtol=1e-5, atol=1e-5)
        tables = Problem.build(query.partition.graph, 4).tables
        assert {(1, 0, 2), (2, 0, 1)} <= set(tables[-1].orders)


@pytest.mark.parametrize("join,agg", [("mul", "sum"), ("add", "max")])
def test_contributions_to_a_chunk_run_as_one_task_per_device(join, agg):
    """A device's products over the tiles of a contracted label fold into its output chunk in
    one task (a series), with the same result and the same bytes moved as one task each."""
    rng = np.random.default_rng(11)
    a = rng.standard_normal((48, 40), dtype=np.float32)
    b = rng.standard_normal((40, 32), dtype=np.float32)
    with tq.connect(devices=2, workers=4) as db:  # two lanes a device: pieces are cut
        x = db.from_numpy("x", a, tile=(8, 8))
        y = db.from_numpy("y", b, tile=(8, 8))
        expr = tq.einsum("ij,jk->ik", x, y, join=join, agg=agg)
        want = torch.einsum("ij,jk->ik", torch.from_numpy(a), torch.from_numpy(b)).numpy() \
            if join == "mul" else (a[:, :, None] + b[None, :, :]).max(axis=1)
        query, _ = _check_run(expr, want, 2)
        series = [t for s in query.physical.steps for t in s.tasks
                  if type(t.kernel).__name__ == "ContractSeries"]
        assert series, "the contracted tiles were not grouped"
        outputs = [(t.output, t.device) for s in query.physical.steps for t in s.tasks
                   if type(t.kernel).__name__ in ("ContractSeries", "ContractChunk")]
        assert len(outputs) == len(set(outputs))  # one task per output chunk and device


def test_series_stay_within_a_quarter_of_the_memory_limit():
    rng = np.random.default_rng(12)
    a = rng.standard_normal((64, 64), dtype=np.float32)
    with tq.connect(devices=2, workers=2, memory_limit="24KiB") as db:
        x = db.from_numpy("x", a, tile=(8, 8))
        query, _ = _check_run(x @ x, a @ a, 2)
        from tensorql.exec.memplan import largest_task_bytes

        graph = query.physical.task_graph()
        for task in graph.tasks:
            if type(task.kernel).__name__ == "ContractSeries":
                assert sum(graph.chunk_bytes[r] for r in task.inputs) <= 24 * 1024 // 4
        assert largest_task_bytes(graph) <= 24 * 1024


def test_result_chunks_are_computed_into_the_dense_result():
    """On CPU devices with no limit a result chunk's first product is written straight into
    its tile of the dense result: what reaches the sink is that tile, nothing is copied."""
    from tensorql.exec.runtime import Runtime

    rng = np.random.default_rng(13)
    a = rng.standard_normal((32, 32), dtype=np.float32)
    with tq.connect(devices=2, workers=4) as db:  # two lanes a device: pieces are cut
        x = db.from_numpy("x", a, tile=(8, 8))
        physical = (x @ x).compile().physical
        step = physical.result_step
        out = torch.empty(step.relation.shape)
        tiles = {}

        def destination(ref):
            return out[step.relation.grid.slices(ref.key)] if ref.step == step.id else None

        def sink(ref, chunk):
            tiles[ref.key] = chunk.data_ptr() == out[step.relation.grid.slices(ref.key)] \
                .data_ptr()

        Runtime(["cpu:0", "cpu:1"]).run(physical.task_graph(), sink=sink,
                                        destination=destination, keep_outputs=False)
        np.testing.assert_allclose(out.numpy(), a @ a, rtol=1e-4, atol=1e-4)
        assert len(tiles) == 16 and all(tiles.values())


@pytest.mark.parametrize("name", ["mlp", "llama_block"])
@pytest.mark.parametrize("n", [2, 4])
def test_inputs_every_device_holds_are_loaded_where_read(name, n):
    """Where every device can load the inputs itself (the ranks of a torch.distributed job),
    reading a stored tensor or constant moves nothing: the plan runs with each device loading
    its regions, the copies still move exactly the predicted bytes, and no more than when the
    inputs are partitioned at rest."""
    from tensorql.exec.runtime import Runtime
    from tensorql.optimizer import optimize
    from tensorql.physical.partitioned import build_partitioned

    with tq.connect(devices=n) as db:
        w = _workload(db, name)
        want = w.reference()
        want = want.numpy() if isinstance(want, torch.Tensor) else want
        logical = w.output.compile().physical.root
        at_rest = optimize(logical, devices=n)
        plan = optimize(logical, devices=n, sources_everywhere=True)
        assert plan.cost.bytes_moved <= at_rest.cost.bytes_moved
        for op in plan.ops:
            for move in op.inputs:
                if move.producer.split("] ", 1)[1].startswith("scan"):
                    assert move.bytes == 0 and "loaded where read" in move.reason
        physical = build_partitioned(plan, db.chunk_store)
        step = physical.result_step
        out = torch.empty(step.relation.shape)

        def sink(ref, chunk):
            out[step.relation.grid.slices(ref.key)] = chunk

        result = Runtime([f"cpu:{d}" for d in range(n)]).run(physical.task_graph(), sink=sink)
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(np.array(result.stats.moved), plan.pair_bytes())


def test_one_lane_cpu_devices_run_each_piece_as_one_task():
    """CPU devices of one lane each and no memory limit compute a piece of a product as one
    kernel (one large product is faster than a series of tile products); with a memory
    limit, or several lanes a device, pieces are cut into the logical plan's tiles."""
    rng = np.random.default_rng(14)
    a = rng.standard_normal((64, 64), dtype=np.float32)
    counts = {}
    for workers, limit in ((2, None), (4, None), (2, "1MiB")):
        with tq.connect(devices=2, workers=workers, memory_limit=limit) as db:
            x = db.from_numpy("x", a, tile=(16, 16))
            query, _ = _check_run(x @ x, a @ a, 2)
            counts[(workers, limit)] = sum(
                1 for s in query.physical.steps for t in s.tasks
                if type(t.kernel).__name__ in ("ContractSeries", "ContractChunk"))
    assert counts[(2, None)] == 2  # one task a device
    assert counts[(4, None)] > 2 and counts[(2, "1MiB")] > 2
