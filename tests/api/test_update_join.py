"""The ``adam`` / ``adamw`` joins: an optimizer's whole update of a weight as one einsum."""

import numpy as np
import pytest
import tensorql_kernels.optimizer_update as updates
import torch
from tensorql_kernels.optimizer_update import optimizer_update, update_join

import tensorql as tq
from tensorql.errors import TensorQLError

EQUATION = "ij,ij,ij,ij,s,,,,,,->sij"


def _state(rng, shape=(6, 5)):
    g, w, m = (torch.tensor(rng.normal(size=shape)) for _ in range(3))
    v = torch.tensor(rng.random(shape))
    return g, w, m, v


def _torch_update(join, g, w, m, v, lr, betas, eps, wd, steps):
    """torch.optim's single-tensor Adam/AdamW from the same state, ``steps`` times."""
    p = torch.nn.Parameter(w.clone())
    cls = torch.optim.AdamW if join == "adamw" else torch.optim.Adam
    opt = cls([p], lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    opt.state[p] = {"step": torch.tensor(float(steps - 1)), "exp_avg": m.clone(),
                    "exp_avg_sq": v.clone()}
    p.grad = g.clone()
    opt.step()
    return p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]


@pytest.mark.parametrize("join,wd", [("adam", 0.0), ("adam", 0.01), ("adamw", 0.05)])
@pytest.mark.parametrize("devices", [1, 2, 3])
def test_update_join_matches_torch_optim(join, wd, devices):
    rng = np.random.default_rng(7)
    g, w, m, v = _state(rng)
    lr, betas, eps, step = 0.01, (0.85, 0.99), 1e-8, 4
    expected = _torch_update(join, g, w, m, v, lr, betas, eps, wd, step)
    with tq.connect(devices=devices) as db:
        scalars = [db.constant(torch.tensor(x, dtype=torch.float64))
                   for x in (lr, *betas, eps, wd, float(step))]
        out = tq.einsum(EQUATION, *(db.constant(t) for t in (g, w, m, v)),
                        db.constant(torch.arange(3.0, dtype=torch.float64)), *scalars,
                        join=join)
        got = out.torch()
    assert got.shape == (3, 6, 5)
    for k in range(3):
        torch.testing.assert_close(got[k], expected[k], rtol=1e-12, atol=1e-14)


def test_chunks_with_part_of_the_slots_and_strided_outputs():
    """Any chunking is correct: a chunk with slots [1, 2] only, and a result block that is
    not contiguous as a whole (its three slots are)."""
    rng = np.random.default_rng(8)
    g, w, m, v = _state(rng, (4, 3))
    scalars = [torch.tensor(x, dtype=torch.float64) for x in (0.1, 0.9, 0.999, 1e-8, 0.0, 2.0)]
    whole = optimizer_update("adam", [g, w, m, v, torch.arange(3.0), *scalars])
    part = optimizer_update("adam", [g, w, m, v, torch.tensor([1.0, 2.0]), *scalars])
    torch.testing.assert_close(part, whole[1:])
    big = torch.zeros(3, 8, 3, dtype=torch.float64)
    optimizer_update("adam", [g, w, m, v, torch.arange(3.0), *scalars], big[:, 4:])
    torch.testing.assert_close(big[:, 4:], whole)
    assert big[:, :4].abs().sum() == 0
    wide = torch.zeros(3, 4, 6, dtype=torch.float64)  # a column block: slots strided
    optimizer_update("adam", [g, w, m, v, torch.arange(3.0), *scalars], wide[:, :, 3:])
    torch.testing.assert_close(wide[:, :, 3:], whole)
    assert wide[:, :, :3].abs().sum() == 0
    tall = [torch.tensor(np.random.default_rng(11).normal(size=(70_000, 2))) for _ in range(4)]
    tall[3] = tall[3].abs()
    wide = torch.zeros(3, 70_000, 4, dtype=torch.float64)  # more rows than one scratch block
    optimizer_update("adam", [*tall, torch.arange(3.0), *scalars], wide[:, :, 1:3])
    torch.testing.assert_close(wide[:, :, 1:3],
                               optimizer_update("adam", [*tall, torch.arange(3.0), *scalars]))
    # inputs are not modified
    torch.testing.assert_close(w, _state(np.random.default_rng(8), (4, 3))[1])


def test_update_join_errors_and_no_gradient(db):
    rng = np.random.default_rng(9)
    g, w, m, v = (db.constant(t) for t in _state(rng))
    slots = db.constant(torch.arange(3.0, dtype=torch.float64))
    s = [db.constant(torch.tensor(0.5, dtype=torch.float64))] * 6
    with pytest.raises(TensorQLError, match="same labels"):
        tq.einsum("ij,ji,ij,ij,s,,,,,,->sij", g, w.T, m, v, slots, *s, join="adam")
    with pytest.raises(TensorQLError, match="takes 11 operands"):
        tq.einsum("ij,ij,ij,ij,s->sij", g, w, m, v, slots, join="adam")
    with pytest.raises(TensorQLError, match="slot"):
        tq.einsum("ij,ij,ij,ij,s,,,,,,->ijs", g, w, m, v, slots, *s, join="adam")
    out = tq.einsum(EQUATION, g, w, m, v, slots, *s, join="adam")
    with pytest.raises(TensorQLError, match="no gradient"):
        tq.grad(out.sum(), [w])


def test_update_join_is_not_an_sql_join(db):
    db.from_numpy("a", np.ones((2, 2)))
    db.from_numpy("b", np.ones((2, 2)))
    with pytest.raises(TensorQLError, match="adam"):
        db.sql("SELECT * FROM EINSUM('ij,ij->ij', a, b, join := 'adam')")


@pytest.mark.parametrize("shape", [(), (7,), (70_000,), (300, 200), (3, 4, 5)])
def test_every_rank_and_blocks_of_rows(shape):
    """Scalars, vectors, and chunks larger than one block of rows match torch.optim."""
    rng = np.random.default_rng(10)
    g, w, m, v = _state(rng, shape)
    args = (0.02, (0.9, 0.999), 1e-8, 0.01, 3)
    expected = _torch_update("adamw", g, w, m, v, *args)
    scalars = [torch.tensor(x, dtype=torch.float64) for x in (0.02, 0.9, 0.999, 1e-8, 0.01, 3.0)]
    got = optimizer_update("adamw", [g, w, m, v, torch.arange(3.0), *scalars])
    for k in range(3):
        torch.testing.assert_close(got[k], expected[k], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("join,wd", [("adam", 0.0), ("adam", 0.01), ("adamw", 0.05)])
@pytest.mark.parametrize("devices", [1, 3])
def test_a_join_carrying_its_hyperparameters_matches_torch_optim(join, wd, devices):
    """The optimizers' form: beta1, beta2, eps and weight decay in the join, lr and step
    its only scalar operands."""
    rng = np.random.default_rng(7)
    g, w, m, v = _state(rng)
    lr, betas, eps, step = 0.01, (0.85, 0.99), 1e-8, 4
    expected = _torch_update(join, g, w, m, v, lr, betas, eps, wd, step)
    name = update_join(join == "adamw", *betas, eps, wd)
    assert name == f"{join}(beta1=0.85,beta2=0.99,eps=1e-08,weight_decay={wd!r})"
    with tq.connect(devices=devices) as db:
        scalars = [db.constant(torch.tensor(x, dtype=torch.float64)) for x in (lr, step)]
        out = tq.einsum("ij,ij,ij,ij,s,,->sij", *(db.constant(t) for t in (g, w, m, v)),
                        db.constant(torch.arange(3.0, dtype=torch.float64)), *scalars,
                        join=name)
        got = out.torch()
        with pytest.raises(TensorQLError, match=r"takes 7 operands, got 11"):
            tq.einsum(EQUATION, *(db.constant(t) for t in (g, w, m, v)),
                      db.constant(torch.arange(3.0, dtype=torch.float64)), *scalars * 3,
                      join=name)
    for k in range(3):
        torch.testing.assert_close(got[k], expected[k], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("join,wd", [("adam", 0.0), ("adam", 0.01), ("adamw", 0.05)])
@pytest.mark.parametrize("tensors", [False, True])
def test_the_update_in_torch_ops_matches_torch_optim(join, wd, tensors):
    """Where torch has no fused kernel: the formula in torch ops, with lr and step as
    numbers (read from host operands) or as 0-d tensors (as on a device)."""
    rng = np.random.default_rng(12)
    g, w, m, v = _state(rng, (7, 3))
    lr, betas, eps, step = 0.02, (0.9, 0.999), 1e-8, 5
    expected = _torch_update(join, g, w, m, v, lr, betas, eps, wd, step)
    p, m2, v2 = w.clone(), m.clone(), v.clone()
    def scalar(x: float):  # as the engine stages them: 0-d tensors of the weight's dtype
        return torch.tensor(x, dtype=w.dtype) if tensors else x

    updates._AdamStep(join == "adamw", *betas, eps, wd, lr=scalar(lr),
                      step=scalar(float(step)))._in_torch_ops(p, g, m2, v2)
    for got, want in zip((p, m2, v2), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_the_update_in_torch_ops_of_bfloat16_weights_keeps_its_bias_corrections():
    """lr and step as bfloat16 0-d tensors (the weight's dtype): the factors are computed in
    float32 (in bfloat16, beta2 = 0.999 is 1 and the bias correction 0: inf / nan)."""
    rng = np.random.default_rng(13)
    g, w, m, v = _state(rng, (5, 4))
    w = torch.zeros_like(w)  # the new weight is the step itself: bfloat16 resolves it
    expected = _torch_update("adam", g, w, m, v, 0.01, (0.9, 0.999), 1e-8, 0.0, 5)
    p, m2, v2 = (x.to(torch.bfloat16) for x in (w, m, v))
    updates._AdamStep(False, 0.9, 0.999, 1e-8, 0.0, lr=torch.tensor(0.01, dtype=p.dtype),
                      step=torch.tensor(5.0, dtype=p.dtype))._in_torch_ops(
        p, g.to(torch.bfloat16), m2, v2)
    for got, want in zip((p, m2, v2), expected):
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=1e-6)


def test_update_join_names_are_reserved():
    """A user's join cannot take a name of the update joins' form (the optimizers' join of
    those hyperparameters would be the user's function); the same values name the same
    join every time."""
    with pytest.raises(tq.JoinFunctionError, match="update joins"):
        tq.register_join("adamw(beta1=0.5,beta2=0.5,eps=0.0,weight_decay=0.0)", torch.add)
    assert update_join(True, 0.5, 0.5, 0.0, 0.0) == update_join(True, 0.5, 0.5, 0, 0)


@pytest.mark.parametrize("optimizer", ["Adam", "AdamW"])
def test_a_bfloat16_weight_steps_as_torch_optim_does(optimizer):
    """lr and step reach the update in float32 (the result in the weight's bfloat16), as
    torch.optim's fused Adam reads them: step 383 of lr 0.1003 gives its weights and moments
    bit for bit (in bfloat16, lr was 0.1001 and the step 384: 720 of the 4096 weights, each
    the step itself as they start at 0, came out a rounding off)."""
    rng = np.random.default_rng(14)
    w0 = torch.zeros(64, 64, dtype=torch.bfloat16)
    c, m0 = (torch.tensor(rng.normal(size=(64, 64)), dtype=torch.bfloat16) for _ in range(2))
    v0 = torch.tensor(rng.random((64, 64)), dtype=torch.bfloat16)
    with tq.connect() as db:
        db.from_torch("w", w0)
        opt = getattr(tq.optim, optimizer)(db, ["w"], lr=0.1003, checkpoint_every=1000)
        opt.step_count = 382
        opt.weight_steps["w"] = 382  # (each weight counts its own updates)
        opt.state[("m", "w")].copy_(m0)
        opt.state[("v", "w")].copy_(v0)
        w = opt.params()["w"]
        opt.step((w * db.constant(c)).sum())  # the gradient: c, exactly
        got = [opt.values["w"], opt.state[("m", "w")], opt.state[("v", "w")]]
    p = torch.nn.Parameter(w0.clone())
    ref = getattr(torch.optim, optimizer)([p], lr=0.1003, fused=True)
    ref.state[p] = {"step": torch.tensor(382.0), "exp_avg": m0.clone(),
                    "exp_avg_sq": v0.clone()}
    p.grad = c.clone()
    ref.step()
    want = [p.detach(), ref.state[p]["exp_avg"], ref.state[p]["exp_avg_sq"]]
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, rtol=0, atol=0)
