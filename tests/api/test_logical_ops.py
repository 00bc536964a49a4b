"""``& | ^ ~`` on bool tensors (masks) against numpy, on every executor, and their errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq

RNG_SEED = 7


@pytest.mark.parametrize("settings", [{}, {"devices": 2}, {"backend": "duckdb"}],
                         ids=["native", "devices2", "duckdb"])
def test_logical_operators_match_numpy(settings):
    rng = np.random.default_rng(RNG_SEED)
    a, b = rng.standard_normal((5, 4)), rng.standard_normal(4)
    db = tq.connect(**settings)
    A, B = db.from_numpy("a", a, tile=(2, 2)), db.from_numpy("b", b)
    ma, mb, na, nb = A > 0, B < 0.5, a > 0, b < 0.5
    pattern = np.array([True, False, True, False])
    cases = [(ma & mb, na & nb), (ma | mb, na | nb), (ma ^ mb, na ^ nb), (~ma, ~na),
             (ma & True, na & True), (False | ma, False | na), (True ^ mb, True ^ nb),
             (ma & pattern, na & pattern), (pattern | ma, pattern | na),
             (~(ma & ~mb), ~(na & ~nb))]
    for got, expected in cases:
        result = got.numpy()
        assert result.dtype == np.bool_
        np.testing.assert_array_equal(result, expected)
    masked = tq.where((A > 0) & (A < 1), A, 0.0).numpy()
    np.testing.assert_allclose(masked, np.where((a > 0) & (a < 1), a, 0.0))


def test_gradient_flows_around_a_combined_mask():
    rng = np.random.default_rng(RNG_SEED)
    a = rng.standard_normal((6, 3))
    db = tq.connect()
    A = db.from_numpy("a", a)
    loss = tq.where((A > -0.5) & ~(A > 0.8), A * A, A).sum()
    (grad,) = tq.grad(loss, [A])
    t = torch.tensor(a, requires_grad=True)
    torch.where((t > -0.5) & ~(t > 0.8), t * t, t).sum().backward()
    np.testing.assert_allclose(grad.numpy(), t.grad.numpy(), rtol=1e-12)


@pytest.mark.parametrize("build", [
    lambda x, m: x & m, lambda x, m: m | x, lambda x, m: ~x, lambda x, m: m ^ 1,
    lambda x, m: 3 & m, lambda x, m: x.astype("int64") & x.astype("int64"),
], ids=["float&bool", "bool|float", "~float", "bool^int", "int&bool", "int&int"])
def test_non_bool_operands_are_dtype_errors(build):
    db = tq.connect()
    x = db.from_numpy("x", np.arange(4.0))
    with pytest.raises(tq.DTypeError, match="bool tensors"):
        build(x, x > 1)
    assert db.tensors() == ["x"]
