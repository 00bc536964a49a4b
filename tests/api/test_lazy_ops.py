"""Lazy tensor operators against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq


@pytest.fixture
def xy(db, rng):
    x = rng.standard_normal((6, 5)).astype(np.float32)
    y = rng.standard_normal((5, 7)).astype(np.float32)
    return x, y, db.from_numpy("x", x, tile=(4, 2)), db.from_numpy("y", y, tile=(3, 3))


def close(got, expected, tol=1e-5):
    np.testing.assert_allclose(got, np.asarray(expected), rtol=tol, atol=tol)


def test_matmul_and_transpose(xy):
    x, y, X, Y = xy
    close((X @ Y).numpy(), torch.tensor(x) @ torch.tensor(y))
    close(X.T.numpy(), x.T)
    close((Y.T @ X.T).numpy(), (x @ y).T)


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_broadcast_binary(db, rng, op):
    a = rng.uniform(1, 2, (4, 1, 3)).astype(np.float32)
    b = rng.uniform(1, 2, (5, 1)).astype(np.float32)
    A, B = db.from_numpy("a", a, tile=(3, 1, 2)), db.from_numpy("b", b, tile=(2, 1))
    fn = getattr(torch, op)
    expected = fn(torch.tensor(a), torch.tensor(b))
    got = {"add": A + B, "sub": A - B, "mul": A * B, "div": A / B}[op].numpy()
    assert got.shape == tuple(expected.shape)
    close(got, expected)


def test_scalars_and_numpy_operands(xy):
    x, _, X, _ = xy
    close((2 * X + 1).numpy(), 2 * x + 1)
    close((1 - X).numpy(), 1 - x)
    close((1 / (X * X + 1)).numpy(), 1 / (x * x + 1))
    close((X / 4).numpy(), x / 4)
    close((X + np.arange(5, dtype=np.float32)).numpy(), x + np.arange(5))
    close((-X).numpy(), -x)
    close((X ** 2).numpy(), x ** 2)


def test_unary_maps(xy):
    x, _, X, _ = xy
    t = torch.tensor(x)
    close(X.exp().numpy(), t.exp())
    close(X.relu().numpy(), t.relu())
    close(X.tanh().numpy(), t.tanh())
    close(X.sigmoid().numpy(), t.sigmoid())
    close(X.silu().numpy(), torch.nn.functional.silu(t))
    close(X.abs().sqrt().numpy(), t.abs().sqrt())


@pytest.mark.parametrize("axis", [None, 0, 1, (0, 1), -1])
def test_reductions(xy, axis):
    x, _, X, _ = xy
    t = torch.tensor(x)
    dims = axis if axis is not None else (0, 1)
    close(X.sum(axis).numpy(), t.sum(dim=dims))
    close(X.max(axis).numpy(), t.amax(dim=dims))
    close(X.min(axis).numpy(), t.amin(dim=dims))
    close(X.mean(axis).numpy(), t.mean(dim=dims))


def test_keepdims(xy):
    x, _, X, _ = xy
    got = X.sum(1, keepdims=True)
    assert got.shape == (6, 1)
    close(got.numpy(), x.sum(1, keepdims=True))
    close((X - X.max(1, keepdims=True)).numpy(), x - x.max(1, keepdims=True))


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_softmax(xy, axis):
    x, _, X, _ = xy
    close(X.softmax(axis).numpy(), torch.softmax(torch.tensor(x), dim=axis))


def test_batched_matmul_broadcast(db, rng):
    a = rng.standard_normal((3, 4, 5)).astype(np.float32)
    b = rng.standard_normal((5, 2)).astype(np.float32)
    v = rng.standard_normal(5).astype(np.float32)
    A, B, V = (db.from_numpy("a", a, tile=(2, 3, 2)), db.from_numpy("b", b),
               db.from_numpy("v", v, tile=(2,)))
    close((A @ B).numpy(), a @ b)
    close((A @ V).numpy(), a @ v)
    close((V @ B).numpy(), v @ b)


def test_mlp_and_attention_against_torch(db, rng):
    x = rng.standard_normal((16, 8)).astype(np.float32)
    w1 = rng.standard_normal((8, 32)).astype(np.float32) * 0.3
    w2 = rng.standard_normal((32, 8)).astype(np.float32) * 0.3
    X, W1, W2 = (db.from_numpy(n, a, tile=(5, 5) if a.ndim == 2 else None)
                 for n, a in (("x", x), ("w1", w1), ("w2", w2)))
    tx, tw1, tw2 = map(torch.tensor, (x, w1, w2))
    close(((X @ W1).relu() @ W2).numpy(), torch.relu(tx @ tw1) @ tw2, 1e-4)
    q = k = v = X
    scores = tq.einsum("qd,kd->qk", q, k) * (1 / np.sqrt(8))
    out = scores.softmax(-1) @ v
    ref = torch.softmax(tx @ tx.T / np.sqrt(8), -1) @ tx
    close(out.numpy(), ref, 1e-4)


def test_nothing_runs_until_asked(db, monkeypatch):
    X = db.from_numpy("x", np.ones((4, 4), dtype=np.float32), tile=(2, 2))
    calls = []
    from tensorql.exec import engine

    original = engine.run  # the engine's one entry point: every run passes through it
    monkeypatch.setattr(engine, "run", lambda *a, **k: calls.append(1) or original(*a, **k))
    expr = ((X @ X).relu() + 1).softmax(0)
    assert calls == [] and expr.shape == (4, 4)
    expr.numpy()
    assert calls == [1]


def test_explain_is_deterministic_and_analyze_measures(xy):
    _, _, X, Y = xy
    expr = (X @ Y).relu()
    text = expr.explain()
    assert text == expr.explain()
    assert "Aggregate sum over [j] <- Join mul on [j]" in text
    assert "Map relu" in text and "Scan x" in text and "grid 2x3 of 4x3" in text
    assert "measured" not in text
    analyzed = expr.explain(analyze=True)
    assert "measured: wall" in analyzed and "busy=" in analyzed and "read=" in analyzed


def test_store_persists_results(db, xy):
    x, y, X, Y = xy
    stored = db.store("xy", X @ Y)
    assert "xy" in db.tensors()
    close(stored.numpy(), x @ y)
    close(db.tensor("xy").numpy(), x @ y)


def test_progress_callback(xy):
    _, _, X, Y = xy
    seen = []
    (X @ Y).numpy(progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1]


def test_results_never_alias_stored_chunks(db):
    X = db.from_numpy("x", np.ones((2, 2), dtype=np.float32))
    got = X.torch()
    got += 5
    np.testing.assert_array_equal(X.numpy(), np.ones((2, 2)))


def test_plan_cache_follows_stored_tensors(db):
    db.from_numpy("x", np.ones((4, 4), dtype=np.float32), tile=(2, 2))
    expr = db.tensor("x").sum()
    assert expr.compile() is expr.compile()
    first = expr.compile()
    db.from_numpy("other", np.ones(3))
    assert expr.compile() is not first
    assert expr.numpy() == 16.0


def test_storing_reports_progress_per_chunk(rng):
    import io

    from tensorql.exec import progress as progress_module

    calls = []
    a = rng.standard_normal((10, 7)).astype(np.float32)
    with tq.connect() as db:
        db.from_numpy("a", a, tile=(4, 3), progress=lambda done, total: calls.append((done, total)))
        assert calls == [(n, 9) for n in range(1, 10)]
        calls.clear()
        db.from_torch("t", torch.from_numpy(a), tile=(5, 7),
                      progress=lambda done, total: calls.append((done, total)))
        assert calls == [(1, 2), (2, 2)]
    out = io.StringIO()
    with tq.connect(progress=True) as db, \
            progress_module.progress_bar("x", stream=out, backend="plain", min_interval=0) as cb:
        cb(1, 2)
        db.from_numpy("a", a, tile=(4, 3))  # draws its own bar on stderr; must not fail
        np.testing.assert_array_equal(db.tensor("a").numpy(), a)
    assert "1/2 tasks" in out.getvalue()
    buf = io.StringIO()
    with progress_module.progress_bar("storing a", stream=buf, backend="plain", unit="chunk",
                                      min_interval=0) as cb:
        cb(3, 9)
    assert "storing a: 3/9 chunks" in buf.getvalue()


def test_a_constant_is_scanned_in_the_tiles_its_reader_wants(db):
    """A constant's chunks are views taken at run time, so the plan reads it in the tiles
    of the operand it meets instead of copying its chunks into them (no Rekey step)."""
    a = db.from_numpy("a", np.arange(48.0).reshape(6, 8), tile=(3, 4))
    c = db.constant(torch.arange(80.0, dtype=torch.float64).reshape(8, 10))
    expr = a @ c
    text = expr.explain()
    assert "Rekey" not in text and "Scan <constant>  (d0,d1) 8x10 float64 grid 2x1 of 4x10" in text
    np.testing.assert_array_equal(expr.numpy(), np.arange(48.0).reshape(6, 8)
                                  @ np.arange(80.0).reshape(8, 10))


def test_a_constant_in_tiles_of_ones_own_choosing(db):
    """``db.constant(value, tile=...)``: its chunks are the given tiles (cut to the shape),
    and a product over it runs one task per chunk of them."""
    x = np.arange(24.0, dtype=np.float32).reshape(4, 6)
    c = db.constant(x, tile=(2, 100))
    assert c.node.grid.tile == (2, 6) and c.node.grid.blocks == (2, 1)
    expr = c * 2.0
    assert len(expr.compile().physical.steps[-1].tasks) == 2
    np.testing.assert_array_equal(expr.numpy(), x * 2.0)
