"""Activation epilogues: a map with an in-place form (relu, silu, ...) over a contraction that
only it reads, whose output chunks are one task each, is folded into that contraction's tasks
(``ContractEpilogue``: no step, no task and no chunk of its own) on one device; the results
match numpy (float64); a product read elsewhere, a result, or one whose chunks take several
tasks keeps its map step; an epilogue never writes into an input its product handed back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq
from tensorql.physical.kernels import ContractChunk, ContractEpilogue, MapChunk


def _arrays(seed: int, *shapes):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s, dtype=np.float32) for s in shapes]


def _kernels(expr):
    steps = expr.compile().physical.steps
    return [type(t.kernel) for s in steps for t in s.tasks], steps


def test_relu_of_a_product_runs_in_the_products_tasks():
    x, w1, w2 = _arrays(0, (64, 32), (32, 48), (48, 16))
    db = tq.connect(workers=2, intra_op_threads=1, deterministic=True)
    X = db.from_numpy("x", x, tile=(32, 32))
    W1 = db.from_numpy("w1", w1, tile=(32, 16))
    W2 = db.from_numpy("w2", w2, tile=(16, 16))
    expr = (X @ W1).relu() @ W2
    kinds, steps = _kernels(expr)
    assert ContractEpilogue in kinds and MapChunk not in kinds
    assert len(steps) == 5  # 3 scans, the product with its relu, the second product
    assert any(s.name.startswith("Map relu <- ") for s in steps)
    want = np.maximum(x.astype(np.float64) @ w1, 0) @ w2
    np.testing.assert_allclose(expr.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn", ["relu", "silu", "sigmoid"])
def test_an_epilogue_on_the_result_writes_the_dense_output(fn):
    x, w = _arrays(1, (40, 24), (24, 36))
    db = tq.connect(workers=2, intra_op_threads=1, deterministic=True)
    X, W = db.from_numpy("x", x, tile=(20, 24)), db.from_numpy("w", w, tile=(24, 12))
    expr = getattr(X @ W, fn)()
    kinds, _ = _kernels(expr)
    assert ContractEpilogue in kinds and MapChunk not in kinds
    ref = torch.from_numpy(x.astype(np.float64) @ w)
    want = {"relu": torch.relu, "silu": torch.nn.functional.silu,
            "sigmoid": torch.sigmoid}[fn](ref).numpy()
    np.testing.assert_allclose(expr.numpy(), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(expr.torch().numpy(), want, rtol=1e-5, atol=1e-6)


def test_a_product_read_elsewhere_or_cut_into_several_tasks_keeps_its_map():
    x, w = _arrays(2, (32, 64), (64, 32))
    db = tq.connect(workers=2, intra_op_threads=1, deterministic=True)
    X, W = db.from_numpy("x", x, tile=(32, 32)), db.from_numpy("w", w, tile=(32, 32))
    prod = X @ W
    both = prod.relu() + prod  # the product is read by the map and by the sum
    kinds, _ = _kernels(both)
    assert ContractEpilogue not in kinds
    p = x.astype(np.float64) @ w
    np.testing.assert_allclose(both.numpy(), np.maximum(p, 0) + p, rtol=1e-5, atol=1e-5)
    relu, plain = db.compute(prod.relu(), prod)  # the product is a result as well
    np.testing.assert_allclose(relu.numpy(), np.maximum(p, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(plain.numpy(), p, rtol=1e-5, atol=1e-5)
    cut = tq.connect(workers=2, intra_op_threads=1)  # one output chunk: its sum is cut
    Xc, Wc = cut.from_numpy("x", x, tile=(32, 32)), cut.from_numpy("w", w, tile=(32, 32))
    kinds, _ = _kernels((Xc @ Wc).relu())
    assert ContractEpilogue not in kinds and MapChunk in kinds
    np.testing.assert_allclose((Xc @ Wc).relu().numpy(), np.maximum(p, 0), rtol=1e-5,
                               atol=1e-5)


class _HandsBackItsInput:
    """A fake product that returns its first input (a view), as a kernel may."""

    def run(self, inputs, acc):
        return inputs[0]

    def run_into(self, inputs, out):
        return inputs[0]


def test_an_epilogue_never_writes_into_an_input_and_binds_for_the_tape():
    x = torch.tensor([[-1.0, 2.0]])
    k = ContractEpilogue(_HandsBackItsInput(), "relu", None, "float32")
    assert k.run([x], None).tolist() == [[0.0, 2.0]] and x.tolist() == [[-1.0, 2.0]]
    out = torch.empty(1, 2)
    assert k.run_into([x], out).tolist() == [[0.0, 2.0]] and x.tolist() == [[-1.0, 2.0]]
    prod = ContractEpilogue(ContractChunk((("i", "j"), ("j", "k")), ("i", "k")), "relu",
                            None, "float32")
    a, b = torch.tensor([[1.0, -3.0]]), torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    calls = prod.bind([a, b], out)
    assert calls is not None
    for call in calls:
        call()
    assert out.tolist() == [[0.0, 4.0]]


@pytest.mark.parametrize("fn", ["relu", "silu"])
def test_an_activation_folds_into_the_product_on_each_device_of_a_partitioned_plan(fn):
    """The MLP on two CPU devices: each device's piece of ``X @ W1`` is made by one task on
    that device and read only by the activation, on the same device: the activation runs in
    that task (no step, no task and no chunk of its own); the result matches numpy."""
    x, w1, w2 = _arrays(5, (64, 32), (32, 128), (128, 16))
    db = tq.connect(workers=2, intra_op_threads=1, devices=2)
    X, W1, W2 = (db.from_numpy(n, a, tile=(32, 32)) for n, a in
                 (("x", x), ("w1", w1), ("w2", w2)))
    expr = getattr(X @ W1, fn)() @ W2
    steps = expr.compile().physical.steps
    kinds = [type(t.kernel) for s in steps for t in s.tasks]
    assert MapChunk not in kinds
    folded = [s for s in steps if s.name.startswith(f"Map {fn} <- ")]
    assert len(folded) == 1 and {t.device for t in folded[0].tasks} == {0, 1}
    assert all(isinstance(t.kernel, ContractEpilogue) for t in folded[0].tasks)
    hidden = torch.from_numpy(x.astype(np.float64) @ w1)
    act = {"relu": torch.relu, "silu": torch.nn.functional.silu}[fn](hidden).numpy()
    want = act @ w2
    np.testing.assert_allclose(expr.numpy(), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_a_partitioned_product_read_elsewhere_or_a_result_keeps_its_map():
    x, w = _arrays(6, (64, 32), (32, 64))
    db = tq.connect(workers=2, intra_op_threads=1, devices=2)
    X, W = db.from_numpy("x", x, tile=(32, 32)), db.from_numpy("w", w, tile=(32, 32))
    prod = X @ W
    both = prod.relu() + prod
    kinds = [type(t.kernel) for s in both.compile().physical.steps for t in s.tasks]
    assert ContractEpilogue not in kinds
    p = x.astype(np.float64) @ w
    np.testing.assert_allclose(both.numpy(), np.maximum(p, 0) + p, rtol=1e-5, atol=1e-5)
    relu, plain = db.compute(prod.relu(), prod)
    np.testing.assert_allclose(relu.numpy(), np.maximum(p, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(plain.numpy(), p, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("devices", [2, 3])
def test_a_partitioned_activation_that_is_the_result_runs_in_the_products_tasks(devices):
    x, w = _arrays(7, (64, 32), (32, 96))
    db = tq.connect(workers=2, intra_op_threads=1, devices=devices)
    X, W = db.from_numpy("x", x, tile=(32, 32)), db.from_numpy("w", w, tile=(32, 32))
    expr = (X @ W).silu()
    kinds = [type(t.kernel) for s in expr.compile().physical.steps for t in s.tasks]
    assert ContractEpilogue in kinds and MapChunk not in kinds
    want = torch.nn.functional.silu(torch.from_numpy(x.astype(np.float64) @ w)).numpy()
    scale = np.abs(want).max()
    np.testing.assert_allclose(expr.numpy(), want, rtol=1e-5, atol=1e-6 * scale)
    np.testing.assert_allclose(expr.torch().numpy(), want, rtol=1e-5, atol=1e-6 * scale)
