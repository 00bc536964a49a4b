"""relu's adjoint reads relu's output (issue 31): ``g * (relu(x) > 0)`` is the mask
``g * (x > 0)`` was (relu(x) > 0 exactly where x > 0), so the gradients are torch's, and the
pre-activation ``x @ W + b`` is read once: its bias add fuses with the relu in the training
step's plan instead of staying a step of its own."""

from __future__ import annotations

import numpy as np
import torch

import tensorql as tq


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
