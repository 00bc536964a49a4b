"""tq.grad through max / min / prod aggregations against torch.autograd: winners found with
3+ operands, second derivatives of prod at zeros, prod over a row holding inf."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import tensorql as tq

JOINS = {"mul": torch.mul, "add": torch.add}
AGGS = {"max": torch.amax, "min": torch.amin}


def torch_grads(arrays, fn, create_graph=False):
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    return ts, torch.autograd.grad(fn(*ts), ts, create_graph=create_graph)


@pytest.mark.parametrize("join", sorted(JOINS))
@pytest.mark.parametrize("agg", sorted(AGGS))
def test_extreme_aggregation_of_three_operands_finds_its_winners(db, join, agg):
    """Values whose joins differ in the last bit by association order (0.1 * 0.7 * 0.3):
    the winners must be found all the same (they were not: count 0, NaN gradients)."""
    arrays = [np.array([0.1, 0.7, 0.3]), np.array([0.2, 0.6, 0.9, 0.4]), np.array([0.3, -5.0])]
    xs = [db.from_numpy(f"s24_{k}", a) for k, a in enumerate(arrays)]
    weight = np.random.default_rng(0).uniform(-1.0, 1.0, size=(3, 4))
    out = tq.einsum("l,j,i->lj", *xs, join=join, agg=agg)
    ours = tq.grad((out * db.constant(weight)).sum(), xs)
    f = JOINS[join]

    def ref(a, b, c):
        joined = f(f(a[:, None, None], b[None, :, None]), c[None, None, :])
        return (AGGS[agg](joined, dim=2) * torch.tensor(weight)).sum()

    _, theirs = torch_grads(arrays, ref)
    for g, t in zip(ours, theirs):
        np.testing.assert_allclose(g.numpy(), t.numpy(), rtol=1e-12, atol=1e-15)


# (equation, sizes by label): 2 and 3 operands, the aggregated labels in any of them
RANDOM_CASES = [("ij,jk->i", (3, 4, 5)), ("i,j,k->ij", (4, 5, 2)), ("i,j,k->jk", (4, 5, 2)),
                ("ij,jk,kl->il", (4, 5, 2, 3)), ("ij,j,k->ik", (4, 5, 2))]


def broadcast(t, labels, every):
    """``t`` (dims ``labels``) viewed over ``every`` (size 1 where it lacks a label)."""
    order = sorted(labels, key=every.index)
    t = t.permute([labels.index(lab) for lab in order])
    return t.reshape([t.shape[order.index(lab)] if lab in order else 1 for lab in every])


@pytest.mark.parametrize("join", sorted(JOINS))
@pytest.mark.parametrize("agg", sorted(AGGS))
def test_extreme_aggregation_random_with_ties(db, join, agg):
    """Continuous random values (joins that differ by association order in the last bit,
    no exact ties), then multiples of 1/4 (exact in any order, many ties: torch shares the
    gradient evenly among tied winners)."""
    for n, ((equation, sizes), ties) in enumerate(itertools.product(RANDOM_CASES, [0, 1])):
        inputs, output = equation.split("->")
        terms = inputs.split(",")
        every = "".join(dict.fromkeys(inputs.replace(",", "")))
        size = dict(zip(every, sizes))
        rng = np.random.default_rng(n)
        shapes = [[size[lab] for lab in t] for t in terms]
        # magnitudes over four decades: sums round differently in another order
        arrays = [rng.uniform(-1.0, 1.0, size=s) * 10.0 ** rng.uniform(-2, 2, size=s)
                  for s in shapes]
        if ties:
            arrays = [np.round(a * 4) / 4 for a in arrays]
        xs = [db.from_numpy(f"r24_{k}", a, replace=True) for k, a in enumerate(arrays)]
        out = tq.einsum(equation, *xs, join=join, agg=agg)
        weight = rng.uniform(-1.0, 1.0, size=out.shape)
        ours = tq.grad((out * db.constant(weight)).sum(), xs)

        def ref(*ts, terms=terms, every=every, output=output, weight=weight):
            joined = broadcast(ts[0], terms[0], every)
            for t, labels in zip(ts[1:], terms[1:]):
                joined = JOINS[join](joined, broadcast(t, labels, every))
            dims = tuple(k for k, lab in enumerate(every) if lab not in output)
            return (AGGS[agg](joined, dim=dims) * torch.tensor(weight)).sum()

        _, theirs = torch_grads(arrays, ref)
        for g, t in zip(ours, theirs):
            np.testing.assert_allclose(g.numpy(), t.numpy(), rtol=1e-12, atol=1e-15,
                                       err_msg=equation)


def test_adam_step_on_a_max_aggregation_matches_torch(db):
    """One Adam step on a 3-operand max-aggregated loss: the weights stay finite, as
    torch.optim.Adam's."""
    u, v, c = np.array([0.1, 0.7, 0.3]), np.array([0.2, 0.6, 0.9, 0.4]), np.array([0.3, -5.0])
    db.store_many({"u24": u, "v24": v})
    const = db.from_numpy("c24", c)
    opt = tq.optim.Adam(db, ["u24", "v24"], lr=0.01, name="adam24")
    opt.step(tq.einsum("l,j,i->lj", db.tensor("u24"), db.tensor("v24"), const, agg="max").sum())
    tu, tv = torch.tensor(u, requires_grad=True), torch.tensor(v, requires_grad=True)
    topt = torch.optim.Adam([tu, tv], lr=0.01)
    joined = tu[:, None, None] * tv[None, :, None] * torch.tensor(c)[None, None, :]
    joined.amax(dim=2).sum().backward()
    topt.step()
    np.testing.assert_allclose(db.tensor("u24").numpy(), tu.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(db.tensor("v24").numpy(), tv.detach().numpy(), rtol=1e-12)


PROD_ROWS = np.array([
    [0.5, 2.0, 3.0, -1.5],   # no zero
    [0.0, 2.0, 3.0, -1.5],   # one zero
    [0.0, 2.0, 0.0, -1.5],   # two zeros
    [0.0, 0.0, 0.0, 4.0],    # three zeros
])


def test_prod_second_derivatives_at_zeros_match_torch(db):
    """d/dx (grad prod(x) . r) for rows with 0, 1, 2 and 3 zeros and several r, against
    torch.autograd with create_graph=True (the zero had a gradient path through the
    product of the others: H r was wrong where r touched a zero)."""
    x = db.from_numpy("p24", PROD_ROWS)
    (g,) = tq.grad(x.prod(axis=1).sum(), [x])
    t = torch.tensor(PROD_ROWS, requires_grad=True)
    (tg,) = torch.autograd.grad(t.prod(dim=1).sum(), t, create_graph=True)
    np.testing.assert_allclose(g.numpy(), tg.detach().numpy(), rtol=1e-12)
    rng = np.random.default_rng(7)
    directions = [np.eye(4)[k][None, :].repeat(4, axis=0) for k in range(4)]
    directions.append(rng.uniform(-1.0, 1.0, size=(4, 4)))
    for r in directions:
        (h,) = tq.grad((g * db.constant(r)).sum(), [x])
        (th,) = torch.autograd.grad((tg * torch.tensor(r)).sum(), t, retain_graph=True)
        np.testing.assert_allclose(h.numpy(), th.numpy(), rtol=1e-12, atol=1e-15)


def test_prod_of_a_full_reduction_second_derivative(db):
    """The repro's case: prod of [0, 2, 3] differentiated twice (H r with r = e0)."""
    x = db.from_numpy("q24", np.array([0.0, 2.0, 3.0]))
    (g,) = tq.grad(x.prod(), [x])
    (h,) = tq.grad((g * db.constant(np.array([1.0, 0.0, 0.0]))).sum(), [x])
    t = torch.tensor([0.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    (tg,) = torch.autograd.grad(t.prod(), t, create_graph=True)
    (th,) = torch.autograd.grad(tg[0], t)
    np.testing.assert_allclose(g.numpy(), tg.detach().numpy())
    np.testing.assert_allclose(h.numpy(), th.numpy())


def test_prod_over_a_row_holding_inf_matches_torch(db):
    """A row holding inf (and no zero anywhere, torch's result / input path): the finite
    elements get inf, the inf itself inf / inf = NaN, other rows are untouched (an inf
    times the 0 of the zero branch made the whole row NaN)."""
    a = np.array([[np.inf, 2.0, 0.5], [3.0, 2.0, -1.0], [-np.inf, 4.0, 1.0]])
    x = db.from_numpy("i24", a)
    weight = np.array([1.0, -2.0, 0.5])
    (g,) = tq.grad((x.prod(axis=1) * db.constant(weight)).sum(), [x])
    t = torch.tensor(a, requires_grad=True)
    (tg,) = torch.autograd.grad((t.prod(dim=1) * torch.tensor(weight)).sum(), t)
    np.testing.assert_array_equal(g.numpy(), tg.numpy())  # NaN where torch's is NaN
