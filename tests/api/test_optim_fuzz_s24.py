"""Optimizer edge cases found by fuzzing, against torch.optim: a loss reading a weight through
indexing, weights the loss does not use, two optimizers under one name, a ``{name}.step``
that is not a step count, and SGD's nesterov option without momentum."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq

PAIRS = {
    "sgd": (lambda db, names: tq.optim.SGD(db, names, lr=0.1),
            lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "sgd-momentum": (lambda db, names: tq.optim.SGD(db, names, lr=0.05, momentum=0.9,
                                                    weight_decay=0.1),
                     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.1)),
    "adam": (lambda db, names: tq.optim.Adam(db, names, lr=0.05, weight_decay=0.1),
             lambda ps: torch.optim.Adam(ps, lr=0.05, weight_decay=0.1, foreach=False)),
    "adamw": (lambda db, names: tq.optim.AdamW(db, names, lr=0.05, weight_decay=0.5),
              lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.5, foreach=False)),
}


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_a_loss_reading_a_weight_through_indexing_trains_it_there(name):
    """W[1:, :1] and W[0] read regions of the stored weight: they were left reading the store
    (a zero gradient), so the weight was not trained where only they read it."""
    rng = np.random.default_rng(0)
    w0, v0 = rng.normal(size=(3, 2)), rng.normal(size=(4,))
    ours, theirs = PAIRS[name]
    db = tq.connect()
    db.store_many({"W": w0, "V": v0})
    W, V = db.tensor("W"), db.tensor("V")
    loss = ((W[1:, :1] ** 2).sum() + (W[0] * V[1:3]).sum() + (W * W).sum() * 0.01
            + (V[::2] ** 2).sum())
    opt = ours(db, ["W", "V"])
    tw, tv = (torch.tensor(a, requires_grad=True) for a in (w0, v0))
    topt = theirs([tw, tv])
    for _ in range(4):
        got = opt.step(loss)
        topt.zero_grad()
        want = ((tw[1:, :1] ** 2).sum() + (tw[0] * tv[1:3]).sum() + (tw * tw).sum() * 0.01
                + (tv[::2] ** 2).sum())
        want.backward()
        topt.step()
        np.testing.assert_allclose(got, want.item(), rtol=1e-10)
    np.testing.assert_allclose(db.tensor("W").numpy(), tw.detach().numpy(), rtol=1e-10)
    np.testing.assert_allclose(db.tensor("V").numpy(), tv.detach().numpy(), rtol=1e-10)


def test_substitute_replaces_the_regions_read_of_a_stored_tensor():
    """tq.substitute put the new expression in place of whole reads only: w[1:] still read
    the stored w."""
    db = tq.connect()
    w = db.from_numpy("w", np.array([1.0, 2.0, 3.0]))
    out = tq.substitute(w[1:].sum() + w[0] * 10, {"w": w * 2.0})
    assert float(out) == pytest.approx((4.0 + 6.0) + 2.0 * 10)


@pytest.mark.parametrize("name", ["sgd-momentum", "adam", "adamw"])  # plain SGD: no change
def test_a_weight_the_loss_does_not_use_is_left_as_torch_leaves_it(name):
    """torch.optim skips a parameter whose grad is None; weight decay, momentum and Adam's
    moments moved it here with a zero gradient."""
    rng = np.random.default_rng(1)
    x, w0, v0 = rng.normal(size=(4, 3)), rng.normal(size=(3, 2)), rng.normal(size=(3, 2))
    ours, theirs = PAIRS[name]
    db = tq.connect()
    db.store_many({"X": x, "W": w0, "V": v0})
    opt = ours(db, ["W", "V"])
    tw, tv = (torch.tensor(a, requires_grad=True) for a in (w0, v0))
    topt = theirs([tw, tv])
    # the loss reads V only through a comparison: no gradient path, as in torch
    loss = (db.tensor("X") @ db.tensor("W")).sum() \
        + (db.tensor("V") > 0).astype("float64").sum()
    for _ in range(3):
        opt.step(loss)
        topt.zero_grad()
        ((torch.tensor(x) @ tw).sum() + (tv > 0).double().sum()).backward()
        topt.step()
    np.testing.assert_allclose(db.tensor("W").numpy(), tw.detach().numpy(), rtol=1e-10)
    np.testing.assert_array_equal(db.tensor("V").numpy(), v0)
    for slot in opt.slots:  # its state untouched too
        assert not opt.state[(slot, "V")].any()
    # used again later: it trains from there
    opt.step((db.tensor("V") ** 2).sum())
    assert not np.array_equal(db.tensor("V").numpy(), v0)


def test_a_new_optimizer_over_other_weights_under_the_same_name_refuses_to_resume():
    """The second optimizer took the first one's step count (adam.step), so its bias
    corrections were wrong from its first step on."""
    rng = np.random.default_rng(2)
    x, w, v = rng.normal(size=(8, 3)), rng.normal(size=(3, 2)), rng.normal(size=(3, 2))
    db = tq.connect()
    db.store_many({"X": x, "W": w, "V": v})
    first = tq.optim.Adam(db, ["W"], lr=0.1)
    for _ in range(3):
        first.step((db.tensor("X") @ db.tensor("W")).sum())
    with pytest.raises(tq.TensorQLError, match=r"adam.*\['W'\].*name="):
        tq.optim.Adam(db, ["V"], lr=0.1)
    with pytest.raises(tq.TensorQLError, match="name="):  # a superset is other weights too
        tq.optim.Adam(db, ["W", "V"], lr=0.1)
    # under its own name it starts fresh and matches torch.optim.Adam
    second = tq.optim.Adam(db, ["V"], lr=0.1, name="adam2")
    assert second.step_count == 0
    second.step(((db.tensor("X") @ db.tensor("V")) ** 2).sum())
    tv = torch.tensor(v, requires_grad=True)
    topt = torch.optim.Adam([tv], lr=0.1)
    ((torch.tensor(x) @ tv) ** 2).sum().backward()
    topt.step()
    np.testing.assert_allclose(db.tensor("V").numpy(), tv.detach().numpy(), rtol=1e-10)
    # the same weights under the same name still resume
    again = tq.optim.Adam(db, ["W"], lr=0.1)
    assert again.step_count == 3
    np.testing.assert_array_equal(again.state[("m", "W")].numpy(),
                                  first.state[("m", "W")].numpy())


@pytest.mark.parametrize("stored", [np.zeros(4), np.array(2.5), np.array([[3]])])
def test_a_step_count_that_is_not_one_is_named(stored):
    """A user tensor named {name}.step that is not a 0-d integer gave a raw TypeError (or
    was truncated to an int)."""
    db = tq.connect()
    db.store_many({"W": np.ones((3, 2)), "model.step": stored})
    with pytest.raises(tq.TensorQLError, match=r"'model\.step'.*name="):
        tq.optim.SGD(db, ["W"], lr=0.1, name="model")


@pytest.mark.parametrize("momentum", [0.0, 0])
def test_nesterov_needs_momentum_as_torch_says(momentum):
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum"):
        torch.optim.SGD([torch.ones(3, requires_grad=True)], lr=0.1, nesterov=True,
                        momentum=momentum)
    db = tq.connect()
    db.store("W", np.ones(3))
    with pytest.raises(tq.OptionError, match="nesterov.*momentum"):
        tq.optim.SGD(db, ["W"], lr=0.1, nesterov=True, momentum=momentum)
    assert tq.optim.SGD(db, ["W"], lr=0.1, nesterov=True, momentum=0.5).nesterov


def test_a_weight_names_record_that_is_not_one_is_named():
    db = tq.connect()
    db.store_many({"W": np.ones((3, 2)), "model.step": np.array(2), "model.params": np.ones(3)})
    with pytest.raises(tq.TensorQLError, match=r"'model\.params'.*name="):
        tq.optim.SGD(db, ["W"], lr=0.1, name="model")


def test_a_loss_with_no_gradient_path_to_any_weight_is_refused():
    """It ran, updating every weight with a zero gradient (torch: backward() raises)."""
    db = tq.connect()
    db.store_many({"W": np.ones((3, 2)), "X": np.ones((3, 2))})
    opt = tq.optim.AdamW(db, ["W"], lr=0.1)
    with pytest.raises(tq.GradientError, match=r"no gradient path.*\['W'\]"):
        opt.step((db.tensor("X") * (db.tensor("W") > 0)).sum())
    np.testing.assert_array_equal(db.tensor("W").numpy(), np.ones((3, 2)))
