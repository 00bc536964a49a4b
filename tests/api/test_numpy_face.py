"""Tensors behave as numpy/torch users expect (issue 16): numpy reductions, scalars,
log_softmax, case-insensitive join/agg names; results checked against numpy/torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq


@pytest.fixture
def x(db, rng):
    data = rng.standard_normal((5, 7)).astype(np.float32)
    return data, db.from_numpy("X", data, tile=(2, 3))


def test_numpy_reductions_take_tensorql_tensors(x):
    data, t = x
    assert np.isclose(float(np.sum(t)), data.sum(), rtol=1e-5)
    assert np.allclose(np.asarray(np.max(t, axis=0)), data.max(0))
    assert np.allclose(np.asarray(np.mean(t, axis=1, keepdims=True)),
                       data.mean(1, keepdims=True), atol=1e-6)
    assert np.allclose(np.asarray(t), data)
    with pytest.raises(tq.UnsupportedError, match="out="):
        np.sum(t, out=np.zeros(()))
    with pytest.raises(tq.UnsupportedError):
        t.sum(dtype=np.float64)
    with pytest.raises(tq.ShapeError, match="one-element"):
        float(t)


def test_log_softmax_matches_torch(x):
    data, t = x
    for axis in (0, -1):
        expected = torch.log_softmax(torch.from_numpy(data), dim=axis).numpy()
        assert np.allclose(t.log_softmax(axis).numpy(), expected, atol=1e-5)


def test_join_and_agg_names_are_case_insensitive(x):
    data, t = x
    got = tq.einsum("ij,kj->ik", t, t, join="ADD", agg="Max").numpy()
    assert np.allclose(got, (data[:, None, :] + data[None, :, :]).max(-1))
