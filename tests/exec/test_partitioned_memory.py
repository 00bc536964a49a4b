"""Memory-aware partitioning: under a per-device memory_limit below a model's share of the
weights the plan still forms (finer pieces, weights streamed from rest and freed after use),
the memory plan never exceeds the limit, and below the true minimum the error names it."""

from __future__ import annotations

import numpy as np
import pytest

import tensorql as tq
from tensorql.exec.memplan import largest_task_bytes, plan_program
from tensorql.models import llama, mlp
from tensorql.optimizer.search import InfeasiblePlanError
from tensorql.physical.builder import build
from tensorql.physical.partitioned import build_partitioned


def _weights(plan) -> int:
    return sum(int(np.prod(n.sizes)) * n.itemsize for n in plan.graph.nodes
               if n.kind == "source")


def test_llama_7b_layers_plan_below_their_share_of_weights():
    db = tq.connect()
    w = llama(db, layers=2)  # LLaMA-7B shapes: d 4096, 32 heads x 128, d_ff 11008, seq 2048
    limit = 150 << 20
    plan = tq.optimize(w.output, devices=8, memory_limit=limit)
    assert _weights(plan) / 8 > limit  # the share of the weights alone exceeds the limit
    graph = build_partitioned(plan, None, sub_tiles=False).task_graph()
    program = plan_program(graph, 8, [limit] * 8)
    assert all(d.peak_bytes <= limit for d in program.devices)
    assert max(d.peak_bytes for d in program.devices) > 0


def test_more_pieces_than_devices_when_a_piece_does_not_fit():
    db = tq.connect()
    w = mlp(db, batch=256, d_model=1024, d_ff=4096, materialize=False)
    free = tq.optimize(w.output, devices=2)
    tight = tq.optimize(w.output, devices=2, memory_limit=free.cost.peak_bytes // 3)
    assert tight.cost.peak_bytes <= free.cost.peak_bytes // 3
    assert any(np.prod(op.pieces) > 2 for op in tight.ops)


def test_runs_under_a_limit_and_names_the_minimum():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 48)).astype(np.float32)
    y = rng.standard_normal((48, 40)).astype(np.float32)
    want = np.maximum(x @ y, 0).sum(axis=1)
    with tq.connect(devices=2, workers=2, memory_limit=6 << 10) as db:
        a, b = db.from_numpy("a", x), db.from_numpy("b", y)
        query = (a @ b).relu().sum(axis=1).compile()
        result = query.run(dense=True)
        np.testing.assert_allclose(result.dense().numpy(), want, rtol=1e-4, atol=1e-3)
        assert all(d.peak_bytes <= 6 << 10 for d in result.stats.devices)
        assert largest_task_bytes(query.physical.task_graph()) <= 6 << 10
    with tq.connect(devices=2, workers=2, memory_limit=64) as db:
        a, b = db.from_numpy("a", x), db.from_numpy("b", y)
        with pytest.raises(InfeasiblePlanError, match="smallest memory_limit") as err:
            (a @ b).numpy()
        need = err.value.minimum
        assert need > 64 and f"the smallest memory_limit that plans it is {need} bytes" in \
            str(err.value)
    with tq.connect(devices=2, workers=2, memory_limit=need) as db:
        a, b = db.from_numpy("a", x), db.from_numpy("b", y)
        np.testing.assert_allclose((a @ b).numpy(), x @ y, rtol=1e-4, atol=1e-3)


def _limit_queries(db, rng):
    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    a = db.from_numpy("a", r(64, 48), tile=(16, 48))
    b = db.from_numpy("b", r(48, 40), tile=(48, 8))
    c = db.from_numpy("c", r(40, 24))
    bias = db.from_numpy("bias", r(40))
    q = db.from_numpy("q", r(2, 16, 8), tile=(1, 8, 8))
    k, v = db.from_numpy("k", r(2, 24, 8)), db.from_numpy("v", r(2, 24, 8))
    return {"mlp": (a @ b + bias).relu() @ c, "chain": (a @ b @ c).sum(axis=1),
            "softmax": (a @ b).softmax(-1),
            "attention": tq.einsum("bst,bte->bse",
                                   tq.einsum("bse,bte->bst", q, k).softmax(-1), v)}


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("limit", [1 << 10, 3 << 10, 12 << 10])
def test_the_optimizer_plans_every_task_within_the_limit(devices, limit, monkeypatch):
    """Whatever plan the optimizer returns under a memory_limit, every task of its physical
    plan (assembling regions, slices and folds included) fits the limit, and the physical
    plan is built once; where none fits, the named minimum plans."""
    from tensorql.pipeline import planning

    builds = []
    monkeypatch.setattr(planning, "build",
                        lambda *a, **k: builds.append(1) or build(*a, **k))
    for name in ("mlp", "chain", "softmax", "attention"):
        with tq.connect(devices=devices, workers=2, memory_limit=limit) as db:
            query = _limit_queries(db, np.random.default_rng(0))[name]
            builds.clear()
            try:
                compiled = query.compile()
            except InfeasiblePlanError as err:
                minimum = err.minimum
            else:
                assert largest_task_bytes(compiled.physical.task_graph()) <= limit, name
                assert len(builds) == 1
                continue
        assert minimum > limit
        with tq.connect(devices=devices, workers=2, memory_limit=minimum) as db:
            compiled = _limit_queries(db, np.random.default_rng(0))[name].compile()
            assert largest_task_bytes(compiled.physical.task_graph()) <= minimum, name
