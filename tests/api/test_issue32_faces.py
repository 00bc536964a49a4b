"""Issue 32's numbered bugs on the Python face, each against numpy or torch as the oracle."""

from __future__ import annotations

import numpy as np
import pytest

import tensorql as tq


def test_numpy_float64_scalar_operand_keeps_float64():
    x = np.arange(3, dtype=np.float32)
    got = tq.einsum("i,->i", x, np.float64(0.1)).numpy()
    want = np.einsum("i,->i", x, np.float64(0.1))
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    scalar = tq.einsum("->", np.float64(2.0))
    assert scalar.dtype == "float64"
    assert scalar.numpy() == np.float64(2.0)
    # a 0-d float64 array keeps its dtype too; a Python float stays float32 (as in torch)
    assert tq.einsum("->", np.array(0.1)).numpy() == np.float64(0.1)
    assert tq.einsum("->", 0.5).dtype == "float32"
