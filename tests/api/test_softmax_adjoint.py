"""softmax's and log_softmax's adjoints broadcast their row sums back by label: no size-1
label is summed over, so the subtraction fuses with the pointwise ops around it (the
attention's ``y * (g - sum(g * y)) * scale`` is one chain); gradients are torch's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq


@pytest.mark.parametrize("axis", [-1, 0, 1])
@pytest.mark.parametrize("log", [False, True])
def test_softmax_gradients_match_torch(db, axis, log):
    rng = np.random.default_rng(21)
    values = rng.normal(size=(3, 5, 7)) * 2.0
    weight = rng.uniform(-1.0, 1.0, size=values.shape)
    x = db.from_numpy("x", values, replace=True)
    c = db.constant(torch.from_numpy(weight))
    y = x.log_softmax(axis=axis) if log else x.softmax(axis=axis)
    (g,) = tq.grad((y * c).sum(), [x])
    tx = torch.tensor(values, requires_grad=True)
    ty = torch.log_softmax(tx, dim=axis) if log else torch.softmax(tx, dim=axis)
    (expected,) = torch.autograd.grad((ty * torch.from_numpy(weight)).sum(), [tx])
    np.testing.assert_allclose(g.numpy(), expected.numpy(), rtol=1e-10, atol=1e-13)


def test_attention_softmax_gradient_is_one_pointwise_chain(db):
    """Scores ``(b, h, s, t)`` scaled, softmaxed over t, times v: the gradient of the scores
    subtracts the row sums inside the fused chain (no kept size-1 label, ``t@1``, summed)."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.normal(size=(1, 2, 6, 4)) for _ in range(3))
    Q, K, V = (db.from_numpy(n, a) for n, a in zip("qkv", (q, k, v)))
    p = (tq.einsum("bhse,bhte->bhst", Q, K) * 0.5).softmax(axis=-1)
    out = tq.einsum("bhst,bhte->bhse", p, V)
    gq, gk, gv = tq.grad((out * out).sum(), [Q, K, V])
    plan = gq.explain(stage="logical")
    assert "@1" not in plan
    assert any(line.strip().lstrip("│├└─ ").startswith("Pointwise") and "sub" in line
               for line in plan.splitlines())
    tq_, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    tp = torch.softmax(torch.einsum("bhse,bhte->bhst", tq_, tk) * 0.5, dim=-1)
    tout = torch.einsum("bhst,bhte->bhse", tp, tv)
    theirs = torch.autograd.grad((tout * tout).sum(), [tq_, tk, tv])
    for a, b in zip((gq, gk, gv), theirs):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("log", [False, True])
def test_softmax_gradient_of_a_vector(db, log):
    """One axis: the row sum is 0-d, broadcast back over the vector."""
    rng = np.random.default_rng(8)
    values, weight = rng.normal(size=7), rng.normal(size=7)
    x = db.from_numpy("v", values)
    y = x.log_softmax(axis=0) if log else x.softmax(axis=0)
    (g,) = tq.grad((y * db.constant(torch.from_numpy(weight))).sum(), [x])
    tx = torch.tensor(values, requires_grad=True)
    ty = torch.log_softmax(tx, dim=0) if log else torch.softmax(tx, dim=0)
    (expected,) = torch.autograd.grad((ty * torch.from_numpy(weight)).sum(), [tx])
    np.testing.assert_allclose(g.numpy(), expected.numpy(), rtol=1e-12, atol=1e-15)
