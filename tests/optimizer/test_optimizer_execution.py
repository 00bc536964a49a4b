"""Partitioned execution: results match torch, counted bytes equal the model's prediction."""

from __future__ import annotations

import numpy as np
import pytest
from tensorql.optimizer.partitioned import build, execute

import tensorql as tq
from tensorql.models import attention, llama, llama_block, mlp


@pytest.fixture(scope="module")
def db():
    with tq.connect(workers=2) as database:
        yield database


def _workload(db, name):
    if name == "mlp":
        return mlp(db, batch=10, d_model=12, d_ff=20)
    if name == "attention":
        return attention(db, batch=2, seq=6, d_model=12, heads=3, head_dim=4)
    if name == "llama_block":
        return llama_block(db, batch=2, seq=6, d_model=12, heads=3, head_dim=4, d_ff=20)
    return llama(db, layers=2, batch=1, seq=5, d_model=8, heads=2, head_dim=4, d_ff=12,
                 materialize=True)


@pytest.mark.parametrize("name", ["mlp", "attention", "llama_block", "llama2"])
@pytest.mark.parametrize("n", [2, 3, 4, 6, 8, 16])
def test_partitioned_matches_reference_and_prediction(db, name, n):
    w = _workload(db, name)
    ref = w.reference()
    for strategy in ("auto", "data", "model"):
        plan = tq.optimize(w.output, devices=n, strategy=strategy)
        run = execute(plan, db.chunk_store)
        np.testing.assert_allclose(run.value.numpy(), ref, rtol=1e-4, atol=1e-4)
        assert run.bytes_moved == plan.cost.bytes_moved, (strategy, plan.explain())
        assert sum(run.tasks_per_device) > 0 and len(run.tasks_per_device) == n


def test_every_task_has_a_device(db):
    w = _workload(db, "mlp")
    built = build(tq.optimize(w.output, devices=3), db.chunk_store)
    assert set(built.placement) == {t.id for t in built.graph.tasks}
    assert set(built.placement.values()) == {0, 1, 2}


def test_transfer_matrix_has_no_self_transfers(db):
    w = _workload(db, "attention")
    run = execute(tq.optimize(w.output, devices=4, strategy="model"), db.chunk_store)
    assert all(run.moved[d][d] == 0 for d in range(4))
    assert sum(map(sum, run.moved)) == run.bytes_moved > 0


def test_semirings_and_broadcast_partitioned(db):
    rng = np.random.default_rng(3)
    a = db.from_numpy("pa", rng.standard_normal((5, 7)).astype(np.float32), tile=(2, 3))
    b = db.from_numpy("pb", rng.standard_normal((7, 1)).astype(np.float32))
    c = db.from_numpy("pc", rng.standard_normal((1, 4)).astype(np.float32))
    exprs = [tq.einsum("ij,jk->ik", a, b * c, join="add", agg="max"),
             tq.einsum("ij,jk,kl->il", a, b, c, join="sub"),
             tq.einsum("ii->i", tq.einsum("ij,kj->ik", a, a)),
             (a - a.max(axis=1, keepdims=True)).exp().sum(axis=0)]
    for expr in exprs:
        want = expr.numpy()
        for n in (2, 3, 5):
            plan = tq.optimize(expr, devices=n)
            run = execute(plan, db.chunk_store)
            np.testing.assert_allclose(run.value.numpy(), want, rtol=1e-5, atol=1e-5)
            assert run.bytes_moved == plan.cost.bytes_moved
