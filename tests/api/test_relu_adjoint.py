"""relu's adjoint reads relu's output (issue 31): ``g * (relu(x) > 0)`` is the mask
``g * (x > 0)`` was (relu(x) > 0 exactly where x > 0), so the gradients are torch's, and the
pre-activation ``x @ W + b`` is read once: its bias add fuses with the relu in the training
step's plan instead of staying a step of its own."""

from __future__ import annotations

import numpy as np
import torch

import tensorql as tq
from tensorql.algebra import JoinName


def _arrays():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(16, 12)).astype(np.float32)
    x[0, :] = 0.0  # rows whose pre-activation is the bias alone
    b = (rng.normal(size=(20,)) * 0.5).astype(np.float32)
    b[:3] = 0.0  # ... and exactly 0 where the bias is: relu's derivative there is 0
    return {"x": x, "w": (rng.normal(size=(12, 20)) * 0.3).astype(np.float32), "b": b,
            "v": rng.normal(size=(20, 4)).astype(np.float32)}


def test_relu_gradients_match_torch_with_zeros_at_the_kink():
    arrays = _arrays()
    with tq.connect() as db:
        t = {k: db.from_numpy(k, v) for k, v in arrays.items()}
        loss = (((t["x"] @ t["w"] + t["b"]).relu() @ t["v"]) ** 2).sum()
        got = [g.numpy() for g in tq.grad(loss, [t["w"], t["b"]])]
    w = torch.tensor(arrays["w"], requires_grad=True)
    b = torch.tensor(arrays["b"], requires_grad=True)
    y = torch.relu(torch.tensor(arrays["x"]) @ w + b) @ torch.tensor(arrays["v"])
    (y ** 2).sum().backward()
    np.testing.assert_allclose(got[0], w.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], b.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_the_bias_add_fuses_with_its_relu_in_a_training_step():
    arrays = _arrays()
    with tq.connect() as db:
        db.store_many(arrays)
        h = (db.tensor("x") @ db.tensor("w") + db.tensor("b")).relu()
        loss = ((h @ db.tensor("v")) ** 2).mean()
        opt = tq.optim.Adam(db, ["w", "b", "v"], lr=0.01)
        names = [step.name for step in opt._plan(loss).physical.steps]
    assert "Pointwise relu <- add" in names
    assert not any(name.startswith("Join add") for name in names)  # no add of its own


def test_relu_gradient_is_one_relu_grad_kernel_equal_to_torchs():
    """The adjoint is the join relu_grad (aten's threshold_backward, torch's own kernel for
    relu): no comparison, cast and product in the gradient's plan, and the values are
    torch's to the bit -- 0 at the kink, the gradient passed on where the input is NaN."""
    rng = np.random.default_rng(9)
    x = rng.normal(size=(33, 17)).astype(np.float32)
    x[0, :4] = (0.0, -0.0, np.nan, 1e-30)
    w = rng.normal(size=x.shape).astype(np.float32)
    with tq.connect() as db:
        a, c = db.from_numpy("a", x, tile=(16, 8)), db.from_numpy("c", w, tile=(16, 8))
        (g,) = tq.grad((a.relu() * c).sum(), [a])
        plan = g.explain(stage="logical")
        got = g.numpy()
    ta = torch.tensor(x, requires_grad=True)
    (expected,) = torch.autograd.grad((torch.relu(ta) * torch.from_numpy(w)).sum(), [ta])
    np.testing.assert_array_equal(got, expected.numpy())
    assert "relu_grad" in plan and " gt " not in plan and "cast" not in plan


def test_gradient_of_the_relu_gradient():
    """The partials of relu_grad: its mask by the incoming gradient, 0 by relu's output
    (torch's double backward of relu)."""
    rng = np.random.default_rng(4)
    x, w1, w2 = rng.normal(size=(3, 6, 5))
    with tq.connect() as db:
        a, c = db.from_numpy("a", x), db.from_numpy("c", w1)
        k = db.constant(torch.from_numpy(w2))
        (g,) = tq.grad((a.relu() * c).sum(), [a])
        ga, gc = tq.grad((g * k).sum(), [a, c])
        got = ga.numpy(), gc.numpy()
    ta, tc = torch.tensor(x, requires_grad=True), torch.tensor(w1, requires_grad=True)
    (tg,) = torch.autograd.grad((torch.relu(ta) * tc).sum(), [ta], create_graph=True)
    tga, tgc = torch.autograd.grad((tg * torch.from_numpy(w2)).sum(), [ta, tc],
                                   allow_unused=True)
    np.testing.assert_array_equal(got[0], np.zeros_like(x) if tga is None else tga.numpy())
    np.testing.assert_array_equal(got[1], tgc.numpy())


def test_relu_grad_in_duckdb_sql():
    g = np.array([[1.0, -2.0, 3.0, 4.0], [5.0, 6.0, -7.0, 8.0]])
    y = np.array([[0.0, 1.0, 2.0, -1.0], [np.nan, 0.5, 0.0, 3.0]])
    with tq.connect(backend="duckdb") as db:
        G, Y = db.from_numpy("g", g, tile=(1, 2)), db.from_numpy("y", y, tile=(1, 2))
        got = tq.einsum("ij,ij->ij", G, Y, join=JoinName.RELU_GRAD).numpy()
    expected = torch.ops.aten.threshold_backward(torch.from_numpy(g), torch.from_numpy(y), 0)
    np.testing.assert_array_equal(got, expected.numpy())
