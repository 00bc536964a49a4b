"""SiLU's adjoint is one join, ``silu_grad`` (aten's ``silu_backward``): the gradient equals
torch.autograd's, its plan has one kernel where the formula spelt as maps and joins had a
sigmoid and six pointwise ops, and a gradient of the gradient goes through it too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq
from tensorql.algebra import JoinName
from tensorql.einsum.graph import EinsumOp, MapOp


def _nodes(tensor):
    seen, stack, out = set(), [tensor.node], []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        stack.extend(node.inputs)
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_silu_gradient_is_torchs(db, dtype):
    rng = np.random.default_rng(7)
    values = (rng.standard_normal((37, 29)) * 6.0).astype(dtype)  # saturated tails too
    values[0, :3] = (0.0, -80.0, 80.0)
    weight = rng.uniform(-1.0, 1.0, size=values.shape).astype(dtype)
    a = db.from_numpy("a", values, tile=(16, 8))
    (g,) = tq.grad((a.silu() * db.constant(torch.from_numpy(weight))).sum(), [a])
    ta = torch.tensor(values, requires_grad=True)
    (expected,) = torch.autograd.grad(
        (torch.nn.functional.silu(ta) * torch.from_numpy(weight)).sum(), [ta])
    # the same kernel on the same operands: equal to the last bit
    np.testing.assert_array_equal(g.numpy(), expected.numpy())
    joins = [n.spec.join for n in _nodes(g) if isinstance(n, EinsumOp)]
    assert joins.count(JoinName.SILU_GRAD) == 1
    assert not [n for n in _nodes(g) if isinstance(n, MapOp) and n.fn == "sigmoid"]


def test_silu_gradient_in_a_swiglu_step_is_one_fused_kernel(db):
    """The bench block's feed-forward: ``(silu(x @ w1) * (x @ w3)) @ w2``; the gradient of
    ``x @ w1`` is the product by ``x @ w3`` and silu_grad, fused as one pointwise chain."""
    rng = np.random.default_rng(3)
    arrays = {"x": rng.standard_normal((12, 8)), "w1": rng.standard_normal((8, 10)) * 0.5,
              "w3": rng.standard_normal((8, 10)) * 0.5, "w2": rng.standard_normal((10, 8))}
    t = {k: db.from_numpy(k, v) for k, v in arrays.items()}
    out = (t["x"] @ t["w1"]).silu() * (t["x"] @ t["w3"]) @ t["w2"]
    loss = (out * out).sum()
    ours = tq.grad(loss, [t["w1"], t["w3"], t["w2"]])
    tt = {k: torch.tensor(v, requires_grad=True) for k, v in arrays.items()}
    tout = (torch.nn.functional.silu(tt["x"] @ tt["w1"]) * (tt["x"] @ tt["w3"])) @ tt["w2"]
    ref = (tout * tout).sum()
    theirs = torch.autograd.grad(ref, [tt["w1"], tt["w3"], tt["w2"]])
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-12)
    plan = ours[0].explain(stage="logical")
    assert "Pointwise silu_grad <- mul" in plan and "sigmoid" not in plan


def test_gradient_of_the_silu_gradient(db):
    """``d/dx sum(w2 * d/dx sum(w1 * silu(x)))`` against torch's double backward: the
    partials of the join silu_grad (by the incoming gradient and by x)."""
    rng = np.random.default_rng(11)
    values = rng.standard_normal((5, 6)) * 3.0
    w1, w2 = rng.uniform(-1, 1, size=(2, 5, 6))
    x = db.from_numpy("x", values)
    c1, c2 = db.constant(torch.from_numpy(w1)), db.constant(torch.from_numpy(w2))
    (g,) = tq.grad((x.silu() * c1).sum(), [x])
    (gg,) = tq.grad((g * c2).sum(), [x])
    tx = torch.tensor(values, requires_grad=True)
    (tg,) = torch.autograd.grad((torch.nn.functional.silu(tx) * torch.from_numpy(w1)).sum(),
                                [tx], create_graph=True)
    (tgg,) = torch.autograd.grad((tg * torch.from_numpy(w2)).sum(), [tx])
    np.testing.assert_allclose(g.numpy(), tg.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(gg.numpy(), tgg.numpy(), rtol=1e-9, atol=1e-12)


def test_silu_grad_in_duckdb_sql():
    """The DuckDB backend spells the join as SQL: the same values as torch's kernel."""
    rng = np.random.default_rng(5)
    g, x = rng.standard_normal((6, 4)), rng.standard_normal((6, 4)) * 4.0
    with tq.connect(backend="duckdb") as db:
        G, X = db.from_numpy("g", g, tile=(3, 2)), db.from_numpy("x", x, tile=(3, 2))
        got = tq.einsum("ij,ij->ij", G, X, join=JoinName.SILU_GRAD).numpy()
    expected = torch.ops.aten.silu_backward(torch.from_numpy(g), torch.from_numpy(x))
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-12, atol=1e-15)
