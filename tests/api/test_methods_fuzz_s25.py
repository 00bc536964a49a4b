"""Tensor methods against numpy, from fuzzing (session 25): integer and half-precision means,
argmax/argmin keepdims, out-of-range Python integers with every operator."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq


@pytest.fixture
def db():
    return tq.connect()


@pytest.mark.parametrize("values, axis", [
    (np.array([2**62, 2**62], np.int64), None),
    (np.array([[2**62, 2**62, 1], [-3, 4, 9]], np.int64), 1),
    (np.array([[1, 2], [3, 4]], np.int8), 0),
    (np.array([True, False, True]), None),
    (np.array([[200, 100], [255, 3]], np.uint8), (0, 1)),
])
@pytest.mark.parametrize("keepdims", [False, True])
def test_an_integer_mean_is_numpy_s_float64(db, values, axis, keepdims):
    got = db.constant(values).mean(axis=axis, keepdims=keepdims)
    expected = values.mean(axis=axis, keepdims=keepdims)
    assert got.dtype == "float64"
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-15)


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_a_half_precision_mean_sums_in_float32(db, dtype):
    values = np.array([[60000, 60000, -1000, 5], [1, 2, 3, 4]], np.float32)
    torch_dtype = torch.float16 if dtype is np.float16 else torch.bfloat16
    x = db.constant(torch.tensor(values, dtype=torch_dtype))
    got = x.mean(axis=1).torch()
    expected = torch.tensor(values, dtype=torch_dtype).mean(dim=1)  # float32 inside, as numpy
    assert got.dtype == torch_dtype
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert torch.isfinite(x.mean().torch())


def test_the_gradient_of_a_half_precision_mean(db):
    w = db.constant(torch.full((4,), 3.0, dtype=torch.float16))
    (g,) = tq.grad(w.mean(), [w])
    assert g.dtype == "float16"
    np.testing.assert_array_equal(g.numpy(), np.full(4, 0.25, np.float16))


@pytest.mark.parametrize("axis", [None, 0, 1, -1])
@pytest.mark.parametrize("name", ["argmax", "argmin"])
def test_argmax_and_argmin_keepdims(db, name, axis):
    a = np.array([[1.0, 5.0, 5.0], [7.0, -2.0, 0.0]])
    got = getattr(db.constant(a), name)(axis=axis, keepdims=True)
    expected = getattr(a, name)(axis=axis, keepdims=True)
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize("build", [lambda x: x // 1000, lambda x: x % 300, lambda x: 1000 - x,
                                   lambda x: x * -129, lambda x: x + 128],
                         ids=["floordiv", "mod", "rsub", "mul", "add"])
def test_an_out_of_range_python_integer_is_refused_by_every_operator(db, build):
    x = db.constant(np.array([7, -5], np.int8))
    with pytest.raises(tq.DTypeError, match="out of bounds for this int8"):
        build(x)
    np.testing.assert_array_equal((x < 1000).numpy(), [True, True])  # comparisons compare
