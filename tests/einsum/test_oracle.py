"""Oracle tests: tensorql's chunked einsum against numpy.einsum and a numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensorql as tq
from tests.reference import extended_einsum

LABELS = "abcdef"


@st.composite
def einsum_problems(draw, max_operands=5, allow_broadcast=True):
    sizes = {lab: draw(st.integers(1, 5)) for lab in LABELS}
    n_ops = draw(st.integers(1, max_operands))
    operands = []
    for _ in range(n_ops):
        ndim = draw(st.integers(0, 3))
        labels = draw(st.lists(st.sampled_from(LABELS), min_size=ndim, max_size=ndim))
        operands.append("".join(labels))
    used = sorted(set("".join(operands)))
    out = draw(st.permutations(used)) if used else []
    out_len = draw(st.integers(0, len(out)))
    output = "".join(out[:out_len])
    shapes = []
    for labels in operands:
        shape = []
        for lab in labels:
            broadcast = (allow_broadcast and labels.count(lab) == 1
                         and draw(st.integers(0, 5)) == 0)
            shape.append(1 if broadcast else sizes[lab])
        shapes.append(tuple(shape))
    tiles = [tuple(draw(st.integers(1, max(1, n))) for n in shape) for shape in shapes]
    seed = draw(st.integers(0, 2**31 - 1))
    return ",".join(operands) + "->" + output, shapes, tiles, seed


def _store(db, shapes, tiles, seed, positive=False):
    rng = np.random.default_rng(seed)
    arrays, tensors = [], []
    for n, (shape, tile) in enumerate(zip(shapes, tiles)):
        a = rng.uniform(0.5, 1.5, size=shape) if positive else rng.standard_normal(shape)
        arrays.append(a)
        tensors.append(db.from_numpy(f"t{n}", a, tile=tile if shape else None))
    return arrays, tensors


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(einsum_problems())
def test_matches_numpy_einsum(problem):
    equation, shapes, tiles, seed = problem
    with tq.connect(workers=2) as db:
        arrays, tensors = _store(db, shapes, tiles, seed)
        expected = np.einsum(equation, *arrays)
        got = tq.einsum(equation, *tensors).numpy()
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("join", ["mul", "add", "sub", "div", "max", "min"])
@pytest.mark.parametrize("agg", ["sum", "max", "min", "prod"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=einsum_problems(max_operands=3))
def test_semirings_match_reference(join, agg, problem):
    equation, shapes, tiles, seed = problem
    with tq.connect(workers=2) as db:
        arrays, tensors = _store(db, shapes, tiles, seed, positive=True)
        expected = extended_einsum(equation, *arrays, join=join, agg=agg)
        got = tq.einsum(equation, *tensors, join=join, agg=agg).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("equation, shapes", [
    ("ii->i", [(5, 5)]),
    ("ii->", [(5, 5)]),
    ("iij->ji", [(4, 4, 3)]),
    ("ij->", [(7, 9)]),
    ("ij,ij->", [(6, 4), (6, 4)]),
    ("...ij,...jk->...ik", [(3, 5, 4), (4, 2)]),
    ("...ij,...jk->...ik", [(2, 1, 5, 4), (3, 4, 2)]),
    ("ij,jk", [(5, 6), (6, 7)]),
    ("i,j->ij", [(5,), (7,)]),
    ("ij,jk,kl,lm->im", [(5, 6), (6, 7), (7, 8), (8, 3)]),
    ("bij,bjk->bik", [(3, 5, 6), (3, 6, 4)]),
    (",ij->ij", [(), (3, 4)]),
])
@pytest.mark.parametrize("tile", [1, 2, 3, 64])
def test_named_cases(db, rng, equation, shapes, tile):
    arrays = [rng.standard_normal(s) for s in shapes]
    tensors = [db.from_numpy(f"x{n}", a, tile=tuple(min(tile, d) for d in a.shape))
               for n, a in enumerate(arrays)]
    np.testing.assert_allclose(tq.einsum(equation, *tensors).numpy(),
                               np.einsum(equation, *arrays), rtol=1e-9, atol=1e-9)


def test_float32_tiles_not_dividing(db, rng):
    a = rng.standard_normal((37, 23)).astype(np.float32)
    b = rng.standard_normal((23, 41)).astype(np.float32)
    A = db.from_numpy("A", a, tile=(8, 5))
    B = db.from_numpy("B", b, tile=(7, 11))
    got = tq.einsum("ij,jk->ik", A, B).numpy()
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, a @ b, rtol=1e-4, atol=1e-4)


def test_integer_and_bool_dtypes(db):
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    A = db.from_numpy("A", a, tile=(2, 3))
    np.testing.assert_array_equal(tq.einsum("ij->j", A).numpy(), a.sum(0))
    m = db.from_numpy("m", a % 2 == 0, tile=(2, 2))
    assert tq.einsum("ij->", m, agg="max").numpy().item() is True or \
        tq.einsum("ij->", m, agg="max").numpy().item() == 1


def test_shared_subexpression_runs_once(db, rng):
    a = rng.standard_normal((8, 8))
    A = db.from_numpy("A", a, tile=(4, 4))
    S = A @ A
    T = tq.einsum("ij,ij->ij", S, S)
    plan = T.compile().physical
    assert sum(1 for s in plan.steps if s.name.startswith("Aggregate")) == 1
    np.testing.assert_allclose(T.numpy(), (a @ a) ** 2, rtol=1e-9)
