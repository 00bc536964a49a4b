"""General reshape (issue 16): ``Tensor.reshape`` of any compatible shape is a lazy ``Reshape``
step, chunk-local after one retiling of its input, on one device, on N devices (the reshape is
one piece that gathers its input, and the copies move what the plan predicts), on the DuckDB
backend, and under autodiff."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensorql as tq
from tensorql.grid import ChunkGrid
from tensorql.logical.reshape import reshape_groups, reshape_layout


@st.composite
def reshapes(draw):
    """A shape, a tile for it and another shape of the same size (sizes factored afresh)."""
    factors = draw(st.lists(st.sampled_from([1, 2, 2, 3, 5]), min_size=1, max_size=6))
    total = math.prod(factors)

    def split(items):
        items = list(draw(st.permutations(items)))
        cuts = sorted(draw(st.sets(st.integers(1, max(1, len(items) - 1)), max_size=3)))
        parts, start = [], 0
        for cut in [*cuts, len(items)]:
            if cut > start:
                parts.append(math.prod(items[start:cut]))
                start = cut
        return tuple(parts) or (1,)

    shape, target = split(factors), split(factors)
    assert math.prod(shape) == math.prod(target) == total
    tile = tuple(draw(st.integers(1, n)) for n in shape)
    return shape, tile, target


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reshapes(), st.sampled_from([1, 2, 3]))
def test_reshape_matches_numpy(case, devices):
    shape, tile, target = case
    x = np.random.default_rng(len(shape)).standard_normal(shape)
    with tq.connect(devices=devices) as db:
        a = db.from_numpy("A", x, tile=tile)
        got = ((a * 2).reshape(target) + 1).compile().run(dense=True)
        np.testing.assert_allclose(got.dense().numpy(), (2 * x).reshape(target) + 1,
                                   rtol=1e-12)


@pytest.mark.parametrize("devices", [2, 3, 4])
def test_partitioned_reshape_moves_what_the_plan_predicts(devices):
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((16, 24)), rng.standard_normal((48, 6))
    with tq.connect(devices=devices) as db:
        a = db.from_numpy("A", x, tile=(4, 8))
        b = db.from_numpy("W", w, tile=(16, 6))
        expr = tq.einsum("ij,jk->ik", a.relu().reshape(8, 48), b)
        query = expr.compile()
        result = query.run(dense=True)
        np.testing.assert_allclose(result.dense().numpy(),
                                   np.maximum(x, 0).reshape(8, 48) @ w, rtol=1e-10)
        measured = np.array(result.stats.moved)
        np.testing.assert_array_equal(measured, query.partition.pair_bytes())
        assert "Reshape to 8x48" in query.explain()


def test_reshape_is_chunk_local_after_one_retiling():
    with tq.connect() as db:
        a = db.from_numpy("A", np.arange(96.0).reshape(8, 12), tile=(2, 12))
        text = a.reshape(4, 2, 12).explain()
        assert "Reshape to 4x2x12" in text and "Rekey" not in text  # tiles already fit
        plan = a.reshape(12, 8).explain()
        assert "Reshape to 12x8" in plan and "Rekey to tiles (2, 12)" not in plan
        np.testing.assert_array_equal(a.reshape(12, 8).numpy(),
                                      np.arange(96.0).reshape(12, 8))


def test_reshape_layouts_map_one_input_chunk_to_one_output_chunk():
    lay = reshape_layout(ChunkGrid((64, 48), (16, 16)), (32, 96))
    assert lay.input_grid.tile == (4, 48) and lay.output_grid.tile == (2, 96)  # ~ 16x16
    keys = [lay.output_key(k) for k in lay.input_grid.keys()]
    assert sorted(keys) == sorted(lay.output_grid.keys())  # a bijection
    assert all(lay.input_key(lay.output_key(k)) == k for k in lay.input_grid.keys())
    assert [(g.inputs, g.outputs) for g in reshape_groups((2, 1, 6), (12,))] == \
        [((0, 1, 2), (0,))]


def test_reshape_on_the_duckdb_backend():
    x = np.arange(120.0).reshape(6, 20)
    with tq.connect(backend="duckdb") as db:
        a = db.from_numpy("A", x, tile=(4, 8))
        for target in [(120,), (2, 3, 20), (20, 6), (5, 2, 12)]:
            np.testing.assert_array_equal((a.reshape(target) + 1).numpy(),
                                          x.reshape(target) + 1)


def test_gradients_flow_through_reshape():
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((6, 20)), rng.standard_normal((40, 5))
    with tq.connect() as db:
        a, b = db.from_numpy("A", x, tile=(4, 8)), db.from_numpy("W", w)
        loss = (tq.einsum("ij,jk->ik", a.reshape(3, 40), b).relu() ** 2).sum()
        ga, gb = tq.grad(loss, [a, b])
        xt = torch.tensor(x, requires_grad=True)
        wt = torch.tensor(w, requires_grad=True)
        ((xt.reshape(3, 40) @ wt).relu() ** 2).sum().backward()
        np.testing.assert_allclose(ga.numpy(), xt.grad.numpy(), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(gb.numpy(), wt.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_reshape_arguments_as_numpy_takes_them():
    x = np.arange(24.0)
    with tq.connect() as db:
        a = db.from_numpy("A", x)
        assert a.reshape(2, -1, 3).shape == (2, 4, 3)
        assert a.reshape((4, 6)).shape == (4, 6) and a.reshape([-1]).shape == (24,)
        assert a.reshape(4, 6).flatten().shape == (24,)
        np.testing.assert_array_equal(a.reshape(4, 6).T.reshape(-1).numpy(),
                                      x.reshape(4, 6).T.reshape(-1))
        empty = db.from_numpy("E", np.zeros((0, 4)))
        assert empty.reshape(2, 0, 2).numpy().shape == (2, 0, 2)
        scalar = a.sum().reshape(1, 1)
        assert scalar.numpy().tolist() == [[276.0]]
        for bad in [(5, 5), (-1, -1), (7, -1), (-2, 12)]:
            with pytest.raises(tq.ShapeError, match="cannot reshape"):
                a.reshape(bad)
        with pytest.raises(tq.ShapeError, match="whole-number"):
            a.reshape(2.5, 2)
