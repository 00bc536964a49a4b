"""softmax / log_softmax as one step (``SoftmaxOp`` -> logical ``Softmax``): each chunk holds
the whole axis (the input is retiled so), one torch kernel per chunk; on N devices the axis is
never cut; the DuckDB backend runs the same kernel; gradients match torch.autograd."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensorql as tq
from tensorql.einsum.graph import SoftmaxOp, Source
from tensorql.grid import ChunkGrid
from tensorql.logical.lower import SOFTMAX_CHUNK_ELEMS, lower


@st.composite
def softmax_cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    tile = tuple(draw(st.integers(1, n)) for n in shape)
    axis = draw(st.integers(-ndim, ndim - 1))
    return shape, tile, axis, draw(st.booleans()), draw(st.sampled_from([1, 2, 3]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(softmax_cases())
def test_softmax_matches_torch(case):
    shape, tile, axis, log, devices = case
    x = np.random.default_rng(sum(shape)).standard_normal(shape) * 4
    with tq.connect(devices=devices) as db:
        a = db.from_numpy("A", x, tile=tile)
        got = (a.log_softmax(axis) if log else a.softmax(axis)).numpy()
    fn = torch.log_softmax if log else torch.softmax
    np.testing.assert_allclose(got, fn(torch.tensor(x), axis).numpy(), rtol=1e-12, atol=1e-12)


def test_softmax_is_one_step_holding_the_whole_axis():
    x = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)
    with tq.connect() as db:
        a = db.from_numpy("A", x, tile=(16, 16))
        text = a.softmax(1).explain()
        # rows made whole, row blocks kept: 16x48 chunks are within SOFTMAX_CHUNK_ELEMS
        assert "Softmax over [d1]" in text and "grid 4x1 of 16x48" in text
        assert "Aggregate" not in text
        masked = np.triu(np.full((64, 48), -1e9, np.float32), 1)
        m = db.from_numpy("M", masked, tile=(16, 16))
        got = (a + m).softmax(-1).numpy()
        np.testing.assert_allclose(got, torch.softmax(torch.tensor(x + masked), -1).numpy(),
                                   rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("devices", [2, 4])
def test_partitioned_softmax_never_cuts_its_axis(devices):
    x = np.random.default_rng(1).standard_normal((12, 20))
    with tq.connect(devices=devices) as db:
        a = db.from_numpy("A", x, tile=(3, 5))
        query = a.softmax(1).compile()
        result = query.run(dense=True)
        np.testing.assert_allclose(result.dense().numpy(),
                                   torch.softmax(torch.tensor(x), 1).numpy(), rtol=1e-12)
        (op,) = [o for o in query.partition.ops if o.kind == "softmax"]
        assert dict(zip(op.labels, op.pieces))["d1"] == 1
        np.testing.assert_array_equal(np.array(result.stats.moved),
                                      query.partition.pair_bytes())


def test_softmax_on_the_duckdb_backend_and_of_integers():
    x = np.arange(24, dtype=np.int64).reshape(4, 6) % 5
    with tq.connect(backend="duckdb") as db:
        a = db.from_numpy("A", x, tile=(2, 4))
        got = a.softmax(1)
        assert got.dtype == "float32"
        np.testing.assert_allclose(got.numpy(), torch.softmax(torch.tensor(x).float(), 1),
                                   rtol=1e-6)
        np.testing.assert_allclose(a.log_softmax(0).numpy(),
                                   torch.log_softmax(torch.tensor(x).float(), 0), rtol=1e-6)
        with pytest.raises(tq.ShapeError, match="out of range"):
            a.softmax(2)


@pytest.mark.parametrize("devices", [1, 2])
def test_softmax_gradients_match_autograd(devices):
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((6, 20)), rng.standard_normal((20, 5))
    with tq.connect(devices=devices) as db:
        a, b = db.from_numpy("A", x, tile=(4, 8)), db.from_numpy("W", w)
        loss = ((a @ b).softmax(-1) * 3).sum() + ((a @ b).log_softmax(0) ** 2).sum()
        ga, gb = tq.grad(loss, [a, b])
        xt = torch.tensor(x, requires_grad=True)
        wt = torch.tensor(w, requires_grad=True)
        (((xt @ wt).softmax(-1) * 3).sum() + ((xt @ wt).log_softmax(0) ** 2).sum()).backward()
        np.testing.assert_allclose(ga.numpy(), xt.grad.numpy(), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(gb.numpy(), wt.grad.numpy(), rtol=1e-9, atol=1e-12)


def test_softmax_chunks_stay_within_the_larger_of_before_and_the_cap():
    """Whole rows of a big axis: the row blocks halve until a chunk holds at most
    SOFTMAX_CHUNK_ELEMS elements, or as many as before when they held more."""
    rows, axis = 4096, 2048
    stored = Source(shape=(rows, axis), dtype="float32", name="A",
                    grid=ChunkGrid((rows, axis), (2048, 256)))
    plan = lower(SoftmaxOp(shape=(rows, axis), dtype="float32", operand=stored, axis=1))
    assert plan.relation.grid.tile == (SOFTMAX_CHUNK_ELEMS // axis, axis)
    bigger = Source(shape=(rows, axis), dtype="float32", name="B",
                    grid=ChunkGrid((rows, axis), (2048, 1024)))  # 2M elements a chunk
    plan = lower(SoftmaxOp(shape=(rows, axis), dtype="float32", operand=bigger, axis=1))
    assert plan.relation.grid.tile == (1024, axis)
