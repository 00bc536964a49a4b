"""Memory limits and the bytes between devices: what a run measures reconciles with the
partition plan under any ``memory_limit`` (directly, through the host, again after
evictions), feasibility is monotone in the limit, the refusal names a limit that plans, and
more memory does not make the chosen plan worse than one a smaller limit found."""

from __future__ import annotations

import numpy as np
import pytest

import tensorql as tq
from tensorql.optimizer import InfeasiblePlanError


def _queries(db):
    a = db.from_numpy("a", np.arange(7, dtype=np.float32))
    b = db.from_numpy("b", np.arange(11, dtype=np.float32))
    x = db.from_numpy("x", np.linspace(-1, 1, 120, dtype=np.float32).reshape(12, 10))
    w = db.from_numpy("w", np.linspace(0, 1, 60, dtype=np.float32).reshape(10, 6))
    xv, wv = x.numpy(), w.numpy()
    h = np.maximum(xv @ wv, 0) @ wv.T
    soft = np.exp(h - h.max(1, keepdims=True))
    return {"outer": (tq.einsum("a,b->a", a, b), np.arange(7) * 55.0),
            "mlp": (((x @ w).relu() @ w.T).softmax(1), soft / soft.sum(1, keepdims=True))}


# (devices, query, limit, tight): tight limits evict chunks that other devices read later
CASES = [(4, "outer", None, False), (4, "outer", 4096, False), (2, "outer", 64, True),
         (3, "mlp", None, False), (3, "mlp", 1 << 16, False), (3, "mlp", 256, True),
         (4, "mlp", 256, True)]


@pytest.mark.parametrize("devices,name,limit,tight", CASES)
def test_measured_bytes_between_devices_reconcile_with_the_plan(devices, name, limit, tight):
    with tq.connect(devices=devices, workers=1, memory_limit=limit) as db:
        expr, want = _queries(db)[name]
        query = expr.compile()
        result = query.run(dense=True)
        np.testing.assert_allclose(result.dense().numpy(), want, rtol=1e-4, atol=1e-5)
        stats, plan = result.stats, query.partition
        assert stats.bytes_moved_as_planned == plan.cost.bytes_moved
        evictions = sum(d.evictions for d in stats.devices)
        if not tight:  # a limit that does not bind sends device to device as planned
            np.testing.assert_array_equal(np.array(stats.moved), plan.pair_bytes())
            assert stats.bytes_moved_via_host == 0 and stats.moved_again == 0
            return
        assert evictions > 0 and stats.bytes_moved_via_host > 0
        assert np.trace(np.array(stats.moved_via_host)) == 0
        text = expr.explain(analyze=True)
        assert "through the host" in text and "as planned" in text


def test_a_generous_limit_moves_what_the_unlimited_run_moves():
    """The fuzzer's case: 4 devices, a limit far above need, 124 B planned, 20 B measured
    (the rest went through the host unseen); now all 124 B go device to device."""
    measured = {}
    for limit in (None, 4096):
        with tq.connect(devices=4, workers=1, memory_limit=limit) as db:
            query = _queries(db)["outer"][0].compile()
            stats = query.run(dense=True).stats
            assert query.partition.cost.bytes_moved == 124
            measured[limit] = np.array(stats.moved)
    np.testing.assert_array_equal(measured[None], measured[4096])
    assert measured[4096].sum() == 124


def test_a_write_back_crossing_processes_is_sent_from_the_writers_host():
    """Ranks of a torch.distributed job share no host memory: under a limit that evicts
    chunks other devices read, one host loads them (through the host, counted per pair),
    separate hosts send them from the writer's (``from_host``)."""
    from tensorql.exec.memplan import plan_program

    with tq.connect(devices=3, workers=1, memory_limit=256) as db:
        graph = _queries(db)["mlp"][0].compile().physical.task_graph()
    shared = plan_program(graph, 3, [256] * 3)
    ranks = plan_program(graph, 3, [256] * 3, host_domains=[0, 1, 2])
    crossing = [op for op in shared.ops if op.kind == "load" and op.src_device is not None]
    assert crossing and all(op.src_device != op.device for op in crossing)
    assert "written back by dev" in crossing[0].describe()
    for op in ranks.ops:
        assert not (op.kind == "load" and op.src_device is not None)
    assert sum(op.from_host for op in ranks.ops) == len(crossing)


def _nonmono(db):
    x = db.from_numpy("nx", np.ones((1, 8), np.float32))
    y = db.from_numpy("ny", np.ones((8, 8), np.float32))
    return tq.einsum("ca,ba->c", x, y)


def _matmul(db):
    x = db.from_numpy("mx", np.ones((6, 5), np.float32))
    w = db.from_numpy("mw", np.ones((5, 4), np.float32))
    return (x @ w).relu().sum(axis=1)


def _chain(db):
    s = [db.from_numpy(f"c{k}", np.ones(shape, np.float32))
         for k, shape in enumerate([(3, 4), (4, 5), (5, 2)])]
    return tq.einsum("ij,jk,kl->il", *s)


@pytest.mark.parametrize("make,devices,limits", [
    (_nonmono, 6, range(8, 64, 2)), (_matmul, 3, range(8, 160, 4)),
    (_chain, 4, range(8, 120, 4))])
def test_feasibility_is_monotone_and_the_named_limit_plans(make, devices, limits):
    db = tq.connect()
    expr = make(db)
    planned, named = [], set()
    for limit in limits:
        try:
            plan = tq.optimize(expr, devices=devices, memory_limit=limit)
        except InfeasiblePlanError as err:
            planned.append(False)
            assert err.minimum is not None and err.minimum > limit
            named.add((err.minimum, err.smallest))
            continue
        planned.append(True)
        assert plan.cost.peak_bytes <= limit
    assert True in planned
    first = planned.index(True)
    assert all(planned[first:]), planned  # once a limit plans, every larger one does
    for minimum, smallest in named:
        tq.optimize(expr, devices=devices, memory_limit=minimum)
        if smallest:
            with pytest.raises(InfeasiblePlanError):
                tq.optimize(expr, devices=devices, memory_limit=minimum - 1)


def test_the_fuzzers_case_names_the_smallest_limit():
    db = tq.connect()
    expr = _nonmono(db)
    with pytest.raises(InfeasiblePlanError, match="smallest memory_limit that plans it is 20 "
                                                  "bytes") as err:
        tq.optimize(expr, devices=6, memory_limit=16)
    assert err.value.minimum == 20 and err.value.smallest
    assert tq.optimize(expr, devices=6, memory_limit=24).cost.peak_bytes <= 24


def test_more_memory_does_not_choose_a_plan_worse_than_a_smaller_limit_found():
    """The fuzzer's case 155: at limit 138 the plan moved 1,708 B, at 100 only 704 B (finer
    pieces were offered only once no coarser vector fit); a few finer steps past the first
    plan that fits are searched too and the cheaper plan kept (a bounded look: 276 B finds
    a plan cheaper than the unlimited one, not yet the 704 B of 100 B)."""
    db = tq.connect()

    def s(name, shape):
        return db.from_numpy(name, np.ones(shape, np.float32))

    expr = tq.einsum("ecb,dca,be,d->a", s("s1", (7, 13, 4)), s("s2", (11, 13, 2)),
                     s("s3", (4, 7)), s("s4", (11,)), join="add", agg="max")
    moved = {lim: tq.optimize(expr, devices=7, memory_limit=lim).cost.bytes_moved
             for lim in (None, 100, 138, 276)}
    assert moved[138] <= moved[100] and moved[276] <= moved[None]


def test_devices_may_be_any_integral_but_a_bool():
    db = tq.connect()
    expr = _matmul(db)
    assert tq.optimize(expr, devices=np.int64(4)).devices == 4
    assert tq.optimize(expr, devices=np.int32(2)).devices == 2
    with pytest.raises(tq.PlanError, match="positive int"):
        tq.optimize(expr, devices=True)
