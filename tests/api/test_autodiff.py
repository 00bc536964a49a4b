"""tq.grad against torch.autograd: every join / agg pair, every map, composites, and random
extended-einsum graphs on 1, 2 and 4 devices (float64, 1e-5 relative)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorql as tq
from tests.reference import torch_extended_einsum

FOLD_JOINS = ("mul", "add", "sub", "div", "max", "min", "pow")
AGGS = ("sum", "max", "min", "prod")


def assert_grads_match(ours, theirs, rtol=1e-5):
    for n, (a, b) in enumerate(zip(ours, theirs)):
        a, b = np.asarray(a.numpy()), b.detach().numpy()
        scale = 1e-9 * (1.0 + float(np.abs(b).max(initial=0.0)))
        np.testing.assert_allclose(a, b, rtol=rtol, atol=scale, err_msg=f"gradient {n}")


def leaves(db, rng, shapes, low=0.5, high=1.5, tile=2):
    arrays = [rng.uniform(low, high, size=s) for s in shapes]
    tensors = [db.from_numpy(f"x{k}", a, tile=tuple(min(tile, max(1, n)) for n in a.shape),
                             replace=True)
               for k, a in enumerate(arrays)]
    return tensors, [torch.tensor(a, requires_grad=True) for a in arrays]


def check(db, rng, equation, shapes, join="mul", agg="sum", low=0.5, high=1.5):
    xs, ts = leaves(db, rng, shapes, low, high)
    out = tq.einsum(equation, *xs, join=join, agg=agg)
    ref = torch_extended_einsum(equation, *ts, join=join, agg=agg)
    weight = rng.uniform(-1.0, 1.0, size=ref.shape)
    ours = tq.grad(out, xs, grad_output=weight)
    theirs = torch.autograd.grad(ref, ts, grad_outputs=torch.tensor(weight))
    assert_grads_match(ours, theirs)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("join", FOLD_JOINS)
def test_every_join_and_agg(db, rng, join, agg):
    check(db, rng, "ij,jk->ik", [(3, 4), (4, 2)], join, agg)
    check(db, rng, "ij,j->ij", [(3, 4), (4,)], join, agg)


@pytest.mark.parametrize("join", FOLD_JOINS)
def test_three_operands_broadcasting_and_repeated_labels(db, rng, join):
    check(db, rng, "ij,jk,k->i", [(3, 4), (4, 2), (2,)], join, "sum")
    check(db, rng, "ij,1j->ij".replace("1", "k"), [(3, 4), (1, 4)], join, "max")
    check(db, rng, "ii,ij->j", [(3, 3), (3, 2)], join, "sum")
    check(db, rng, "iij->ij", [(3, 3, 2)], "mul", "prod")


def test_max_ties_share_the_gradient_evenly(db):
    a = db.from_numpy("a", np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]]))
    (g,) = tq.grad(a.max(axis=1).sum(), [a])
    ta = torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]], requires_grad=True)
    (expected,) = torch.autograd.grad(ta.amax(dim=1).sum(), [ta])
    np.testing.assert_allclose(g.numpy(), expected.numpy())


def test_prod_with_zeros(db):
    values = np.array([[0.0, 2.0, 3.0], [0.0, 0.0, 5.0], [1.0, 2.0, 4.0]])
    a = db.from_numpy("a", values)
    (g,) = tq.grad(a.prod(axis=1).sum(), [a])
    ta = torch.tensor(values, requires_grad=True)
    (expected,) = torch.autograd.grad(ta.prod(dim=1).sum(), [ta])
    np.testing.assert_allclose(g.numpy(), expected.numpy())


def test_where_and_comparisons_route_the_gradient(db, rng):
    values = rng.uniform(-1, 1, size=(4, 3))
    a = db.from_numpy("a", values)
    b = db.from_numpy("b", values * 2)
    loss = (tq.where(a > 0.0, a * a, b) * 3.0).sum()
    ga, gb = tq.grad(loss, [a, b])
    ta = torch.tensor(values, requires_grad=True)
    tb = torch.tensor(values * 2, requires_grad=True)
    ref = (torch.where(ta > 0, ta * ta, tb) * 3.0).sum()
    assert_grads_match([ga, gb], torch.autograd.grad(ref, [ta, tb]))


MAPS = {
    "exp": (lambda t: t.exp(), lambda t: t.exp()),
    "log": (lambda t: t.log(), lambda t: t.log()),
    "relu": (lambda t: (t - 1.0).relu(), lambda t: (t - 1.0).relu()),
    "neg": (lambda t: -t, lambda t: -t),
    "abs": (lambda t: (t - 1.0).abs(), lambda t: (t - 1.0).abs()),
    "sqrt": (lambda t: t.sqrt(), lambda t: t.sqrt()),
    "rsqrt": (lambda t: t.rsqrt(), lambda t: t.rsqrt()),
    "square": (lambda t: t ** 2, lambda t: t ** 2),
    "tanh": (lambda t: t.tanh(), lambda t: t.tanh()),
    "sigmoid": (lambda t: t.sigmoid(), lambda t: t.sigmoid()),
    "silu": (lambda t: t.silu(), lambda t: torch.nn.functional.silu(t)),
    "scale": (lambda t: t * 3.0, lambda t: t * 3.0),
    "shift": (lambda t: t + 3.0, lambda t: t + 3.0),
    "rsub": (lambda t: 3.0 - t, lambda t: 3.0 - t),
    "rdiv": (lambda t: 3.0 / t, lambda t: 3.0 / t),
    "pow": (lambda t: t ** 1.5, lambda t: t ** 1.5),
    "maximum": (lambda t: t.maximum(1.0), lambda t: t.clamp_min(1.0)),
    "minimum": (lambda t: t.minimum(1.0), lambda t: t.clamp_max(1.0)),
    "cast": (lambda t: t.astype("float32").astype("float64"),
             lambda t: t.float().double()),
    "softmax": (lambda t: t.softmax(axis=1), lambda t: t.softmax(dim=1)),
    "log_softmax": (lambda t: t.log_softmax(axis=0), lambda t: t.log_softmax(dim=0)),
    "mean": (lambda t: t.mean(axis=1, keepdims=True) * t,
             lambda t: t.mean(dim=1, keepdim=True) * t),
}


@pytest.mark.parametrize("name", sorted(MAPS))
def test_maps_and_composites(db, rng, name):
    ours_fn, torch_fn = MAPS[name]
    values = rng.uniform(0.2, 2.0, size=(3, 5))
    values[0, 0] = 1.0  # a tie for relu/abs/maximum/minimum at their kink
    a = db.from_numpy("a", values, tile=(2, 2))
    weight = rng.uniform(-1, 1, size=(3, 5))
    (g,) = tq.grad((ours_fn(a) * weight).sum(), [a])
    ta = torch.tensor(values, requires_grad=True)
    (expected,) = torch.autograd.grad((torch_fn(ta) * torch.tensor(weight)).sum(), [ta])
    rtol = 1e-6 if name == "cast" else 1e-5  # float32 in the middle
    np.testing.assert_allclose(g.numpy(), expected.numpy(), rtol=rtol, atol=1e-7)


def test_rmsnorm_attention_mlp(db, rng):
    """A transformer-ish composite: RMSNorm, softmax attention and a SiLU MLP."""
    n, d = 6, 4
    arrays = {k: rng.normal(size=s) * 0.5 for k, s in
              {"x": (n, d), "wq": (d, d), "wk": (d, d), "wv": (d, d), "w1": (d, 8),
               "w2": (8, d), "g": (d,)}.items()}
    ts = {k: torch.tensor(v, requires_grad=True) for k, v in arrays.items()}
    xs = {k: db.from_numpy(k, v, tile=tuple(min(3, s) for s in v.shape))
          for k, v in arrays.items()}

    def model(t, softmax, rsqrt, silu):
        h = t["x"] * rsqrt((t["x"] * t["x"]).mean(axis=1, keepdims=True) + 1e-6) * t["g"]
        q, k, v = h @ t["wq"], h @ t["wk"], h @ t["wv"]
        att = softmax((q @ k.T) * (1.0 / d ** 0.5)) @ v
        return (silu(att @ t["w1"]) @ t["w2"]).sum()

    loss = model(xs, lambda s: s.softmax(axis=-1), lambda s: s.rsqrt(), lambda s: s.silu())

    class _T(dict):  # torch spells mean's arguments differently
        pass

    def torch_model(t):
        h = t["x"] * torch.rsqrt((t["x"] * t["x"]).mean(dim=1, keepdim=True) + 1e-6) * t["g"]
        q, k, v = h @ t["wq"], h @ t["wk"], h @ t["wv"]
        att = torch.softmax((q @ k.T) * (1.0 / d ** 0.5), dim=-1) @ v
        return (torch.nn.functional.silu(att @ t["w1"]) @ t["w2"]).sum()

    names = sorted(arrays)
    ours = tq.grad(loss, [xs[k] for k in names])
    theirs = torch.autograd.grad(torch_model(ts), [ts[k] for k in names])
    assert_grads_match(ours, theirs)


def test_errors(db, rng):
    a = db.from_numpy("a", rng.uniform(size=(3, 2)))
    b = db.from_numpy("b", rng.uniform(size=(3, 2)))
    with pytest.raises(tq.GradientError, match="does not depend on input 1"):
        tq.grad(a.sum(), [a, b])
    (gb,) = tq.grad(a.sum(), [b], allow_unused=True)
    assert gb.numpy().tolist() == [[0.0, 0.0]] * 3
    with pytest.raises(tq.GradientError, match="shape \\(3, 2\\)"):
        tq.grad(a * 2.0, [a])
    n = db.from_numpy("n", np.arange(6).reshape(3, 2))
    with pytest.raises(tq.DTypeError, match="input 0 has dtype int64"):
        tq.grad(a.sum(), [n])
    with pytest.raises(tq.ShapeError, match="grad_output has shape"):
        tq.grad(a * 2.0, [a], grad_output=np.ones(3))


# -- random extended-einsum graphs -----------------------------------------------------------
SIZES = {"i": 3, "j": 2, "k": 4, "l": 3}
SAFE_MAPS = ("tanh", "sigmoid", "silu", "square", "scale", "shift", "neg", "relu", "abs")


def random_graph(seed: int):
    """A recipe: leaves (labels, with a size-1 dim sometimes) and steps of einsums and maps."""
    r = random.Random(seed)
    labels = list(SIZES)
    leaves_ = []
    for _ in range(r.randint(2, 3)):
        labs = "".join(r.sample(labels, r.randint(1, 3)))
        shape = [SIZES[c] for c in labs]
        if r.random() < 0.3:
            shape[r.randrange(len(shape))] = 1
        leaves_.append((labs, tuple(shape)))
    steps = []
    count = len(leaves_)
    for _ in range(r.randint(2, 4)):
        if r.random() < 0.35:
            steps.append(("map", recent(r, count), r.choice(SAFE_MAPS)))
        else:
            operands = [recent(r, count) for _ in range(r.randint(1, 3))]
            join = r.choice(FOLD_JOINS)
            agg = r.choice(AGGS)
            steps.append(("einsum", operands, join, agg, r.random(), r.random(),
                          r.random() < 0.3))
        count += 1
    return leaves_, steps


def recent(r: random.Random, count: int) -> int:
    """A node index, later nodes likelier (so steps build on each other)."""
    return max(r.randrange(count), r.randrange(count))


def run_graph(recipe, nodes, labels_of, ops):
    """Build the recipe with ``ops`` (tensorql or torch); returns the last node."""
    _, steps = recipe
    for step in steps:
        if step[0] == "map":
            _, k, fn = step
            nodes.append(ops["map"](nodes[k], fn))
            labels_of.append(labels_of[k])
            continue
        _, operands, join, agg, pick, order, diagonal = step
        ins = [labels_of[k] for k in operands]
        first = tuple(nodes[operands[0]].shape)
        if diagonal and "i" in ins[0] and "l" in ins[0] and \
                first[ins[0].index("i")] == first[ins[0].index("l")]:  # one size: ii
            ins[0] = ins[0].replace("l", "i")
        every = "".join(dict.fromkeys("".join(ins)))
        out = [c for c in every if (pick * 7 + every.index(c)) % 3 != 0] or [every[0]]
        if order > 0.5:
            out.reverse()
        args = [nodes[k] for k in operands]
        if join in ("pow", "div"):  # a positive base / denominator
            args = [ops["map"](args[0], "positive")] + [
                ops["map"](a, "positive") if join == "div" else a for a in args[1:]]
        if join == "pow":
            args = [args[0]] + [ops["map"](a, "tanh") for a in args[1:]]
        equation = ",".join(ins) + "->" + "".join(out)
        nodes.append(ops["einsum"](equation, args, join, agg))
        labels_of.append("".join(out))
    return nodes[-1]


def tq_ops(db):
    def apply(x, fn):
        if fn == "positive":
            return x.sigmoid() + 0.5
        if fn == "scale":
            return x * 0.7
        if fn == "shift":
            return x + 0.3
        if fn == "square":
            return x ** 2
        if fn == "neg":
            return -x
        return getattr(x, fn)()

    return {"map": apply,
            "einsum": lambda eq, args, join, agg: tq.einsum(eq, *args, join=join, agg=agg)}


def torch_ops():
    def apply(x, fn):
        return {"positive": lambda: torch.sigmoid(x) + 0.5, "scale": lambda: x * 0.7,
                "shift": lambda: x + 0.3, "square": lambda: x ** 2, "neg": lambda: -x,
                "relu": lambda: torch.relu(x), "abs": lambda: torch.abs(x),
                "tanh": lambda: torch.tanh(x), "sigmoid": lambda: torch.sigmoid(x),
                "silu": lambda: torch.nn.functional.silu(x)}[fn]()

    return {"map": apply, "einsum": lambda eq, args, join, agg:
            torch_extended_einsum(eq, *args, join=join, agg=agg)}


def check_random_graph(seed: int, devices: int) -> None:
    recipe = random_graph(seed)
    rng = np.random.default_rng(seed)
    arrays = [rng.uniform(-1.0, 1.0, size=shape) for _, shape in recipe[0]]
    with tq.connect(devices=devices, workers=2) as db:
        xs = [db.from_numpy(f"x{k}", a, tile=tuple(min(2, n) for n in a.shape))
              for k, a in enumerate(arrays)]
        labels = [labs for labs, _ in recipe[0]]
        out = run_graph(recipe, list(xs), list(labels), tq_ops(db))
        ts = [torch.tensor(a, requires_grad=True) for a in arrays]
        ref = run_graph(recipe, list(ts), list(labels), torch_ops())
        weight = rng.uniform(-1.0, 1.0, size=tuple(ref.shape))
        theirs = torch.autograd.grad(ref, ts, grad_outputs=torch.tensor(weight),
                                     allow_unused=True, materialize_grads=True)
        ours = tq.grad(out, xs, grad_output=weight, allow_unused=True)
        assert_grads_match(ours, theirs)


@settings(max_examples=100)
@given(st.integers(0, 10_000))
def test_random_graphs_one_device(seed):
    check_random_graph(seed, 1)


@settings(max_examples=25)
@given(st.integers(0, 10_000))
@pytest.mark.parametrize("devices", [2, 4])
def test_random_graphs_several_devices(devices, seed):
    check_random_graph(seed, devices)


def test_gradient_of_a_stored_tensor_read_by_indexing(db, rng):
    values = rng.normal(size=(5, 4))
    w = db.from_numpy("w", values, tile=(2, 2))
    loss = (w[1:4, :2] ** 2).sum() + w[0].sum() + (w * 0.5).sum()
    (g,) = tq.grad(loss, [db.tensor("w")])
    t = torch.tensor(values, requires_grad=True)
    ref = (t[1:4, :2] ** 2).sum() + t[0].sum() + (t * 0.5).sum()
    (expected,) = torch.autograd.grad(ref, [t])
    np.testing.assert_allclose(g.numpy(), expected.numpy(), rtol=1e-12)
    (region,) = tq.grad(loss, [w[1:4, :2]])  # a region itself is an input too
    np.testing.assert_allclose(region.numpy(), 2 * values[1:4, :2], rtol=1e-12)


def test_the_branch_not_taken_gets_no_gradient_even_an_infinite_one():
    """Gradient through where / clip / maximum into sqrt at 0 (an infinite adjoint): the
    branch not taken gets 0, as in torch.autograd (a 0/1 mask times inf was NaN)."""
    with tq.connect() as db:
        x = db.from_numpy("x_branch", np.array([-1.0, 4.0, 0.5]))
        xt = torch.tensor([-1.0, 4.0, 0.5], dtype=torch.float64, requires_grad=True)
        zero = torch.tensor(0.0, dtype=torch.float64)
        cases = [
            (lambda v: tq.where(v > 0, v, 0.0).sqrt().sum(),
             lambda v: torch.where(v > 0, v, zero).sqrt().sum()),
            (lambda v: v.clip(0, None).sqrt().sum(), lambda v: v.clamp(min=0).sqrt().sum()),
            (lambda v: v.maximum(0.0).sqrt().sum(), lambda v: v.maximum(zero).sqrt().sum()),
            (lambda v: (v * 2.0).minimum(v).sum(), lambda v: (v * 2.0).minimum(v).sum()),
            (lambda v: tq.where(v > 0, v * v, v).sum(),
             lambda v: torch.where(v > 0, v * v, v).sum()),
        ]
        for ours, theirs in cases:
            (got,) = tq.grad(ours(x), [x])
            (want,) = torch.autograd.grad(theirs(xt), [xt])
            np.testing.assert_allclose(got.numpy(), want.numpy())
        s = db.from_numpy("s_branch", np.array([[1.0, 2.0], [3.0, 4.0]]))
        mask = np.array([[True, False], [True, True]])
        w = np.array([[1.0, 2.0], [3.0, 5.0]])
        loss = (tq.where(db.constant(mask), s, -np.inf).softmax(-1) * db.constant(w)).sum()
        st = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64, requires_grad=True)
        ref = (torch.where(torch.from_numpy(mask), st, -torch.inf).softmax(-1)
               * torch.from_numpy(w)).sum()
        np.testing.assert_allclose(tq.grad(loss, [s])[0].numpy(),
                                   torch.autograd.grad(ref, [st])[0].numpy())
