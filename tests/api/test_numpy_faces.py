"""Tensors as numpy users expect them: comparisons, ``**`` with a tensor, ``astype``,
``where``, ``argmax``/``argmin``, int8/uint8 end to end, and one error class per cause --
each checked against numpy on seeded random inputs, on one and on two devices."""

from __future__ import annotations

import numpy as np
import pytest

import tensorql as tq


@pytest.fixture(params=[1, 2], ids=["1dev", "2dev"])
def db(request):
    with tq.connect(devices=request.param, workers=2) as session:
        yield session


def _arrays(seed=0, shape=(6, 5)):
    rng = np.random.default_rng(seed)
    a = rng.integers(-3, 4, shape).astype(np.float32)  # small integers: ties and equality
    b = rng.integers(-3, 4, shape).astype(np.float32)
    return a, b


@pytest.mark.parametrize("op, fn", [
    ("lt", np.less), ("le", np.less_equal), ("gt", np.greater), ("ge", np.greater_equal),
    ("eq", np.equal), ("ne", np.not_equal)])
def test_comparisons_match_numpy(db, op, fn):
    a, b = _arrays(1)
    x, y = db.from_numpy("x", a, tile=(2, 2)), db.from_numpy("y", b, tile=(2, 2))
    tensor_op = {"lt": x.__lt__, "le": x.__le__, "gt": x.__gt__, "ge": x.__ge__,
                 "eq": x.eq, "ne": x.ne}[op]
    got = tensor_op(y)
    assert got.dtype == "bool"
    np.testing.assert_array_equal(got.numpy(), fn(a, b))
    np.testing.assert_array_equal(tensor_op(0.0).numpy(), fn(a, 0.0))  # a scalar
    np.testing.assert_array_equal(tensor_op(b[0]).numpy(), fn(a, b[0]))  # broadcast row
    # a comparison counted along an axis, as np.sum(a < b, axis=1)
    counted = tq.einsum("ij,ij->i", x, y, join=op)
    np.testing.assert_array_equal(counted.numpy(), fn(a, b).sum(axis=1))


def test_power_with_tensor_exponents(db):
    rng = np.random.default_rng(2)
    a = rng.uniform(0.5, 2.0, (4, 6)).astype(np.float64)
    e = rng.uniform(-2.0, 3.0, (4, 6)).astype(np.float64)
    x, y = db.from_numpy("x", a, tile=(2, 3)), db.from_numpy("e", e, tile=(2, 3))
    np.testing.assert_allclose((x ** y).numpy(), a ** e, rtol=1e-12)
    np.testing.assert_allclose((x ** e[0]).numpy(), a ** e[0], rtol=1e-12)
    np.testing.assert_allclose((2.0 ** x).numpy(), 2.0 ** a, rtol=1e-12)
    np.testing.assert_allclose((x ** 3).numpy(), a ** 3, rtol=1e-12)


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int32", "int64", "float32", "float64",
                                   "bool"])
def test_astype_matches_numpy(db, dtype):
    rng = np.random.default_rng(3)
    a = rng.uniform(0, 100, (5, 4))
    x = db.from_numpy("x", a, tile=(2, 2))
    got = x.astype(dtype)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.numpy(), a.astype(dtype))


def test_where_matches_numpy(db):
    a, b = _arrays(4)
    x, y = db.from_numpy("x", a, tile=(3, 2)), db.from_numpy("y", b, tile=(3, 2))
    np.testing.assert_array_equal(tq.where(x > y, x, y).numpy(), np.where(a > b, a, b))
    np.testing.assert_array_equal(tq.where(x > 0, x, 0.0).numpy(), np.where(a > 0, a, 0.0))
    # the branch not taken may hold inf or nan: it is not computed with
    logs = tq.where(x > 0, x.log(), -1.0).numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        want = np.where(a > 0, np.log(a), -1.0)
    np.testing.assert_allclose(logs, want, rtol=1e-6)
    with pytest.raises(tq.ShapeError, match="could not be broadcast"):
        tq.where(x > 0, x, np.ones(4, np.float32))


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_argmax_argmin_match_numpy_with_ties(db, axis):
    a, _ = _arrays(5, (7, 6))  # small integers: many ties, numpy takes the first
    x = db.from_numpy("x", a, tile=(3, 4))
    np.testing.assert_array_equal(x.argmax(axis=axis).numpy(), a.argmax(axis=axis))
    np.testing.assert_array_equal(x.argmin(axis=axis).numpy(), a.argmin(axis=axis))
    assert x.argmax(axis=axis).dtype == "int64"
    v = db.from_numpy("v", a[0], tile=(4,))
    assert int(v.argmax()) == a[0].argmax()
    assert int(x.argmax()) == a.argmax() and int(x.argmin()) == a.argmin()  # flattened
    b = db.from_numpy("b", np.stack([a, a[::-1]]), tile=(1, 3, 4))
    assert int(b.argmax()) == np.stack([a, a[::-1]]).argmax()


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
def test_small_integers_end_to_end(dtype, tmp_path):
    """Stored in a DuckDB file, read back, multiplied (sums accumulate in int64 as torch's
    do), compared and cast."""
    rng = np.random.default_rng(6)
    a = rng.integers(0, 100, (8, 6)).astype(dtype)
    b = rng.integers(0, 100, (6, 4)).astype(dtype)
    path = str(tmp_path / "small.duckdb")
    with tq.connect(path) as db:
        x, y = db.from_numpy("x", a, tile=(4, 3)), db.from_numpy("y", b, tile=(3, 2))
        assert x.dtype == dtype
    with tq.connect(path, read_only=True) as db:
        x, y = db.tensor("x"), db.tensor("y")
        np.testing.assert_array_equal(x.numpy(), a)
        got = (x @ y).numpy()
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, a.astype(np.int64) @ b.astype(np.int64))
        np.testing.assert_array_equal((x > 50).numpy(), a > 50)
        np.testing.assert_array_equal(x.sum(axis=0).numpy(), a.sum(axis=0, dtype=np.int64))


def test_an_unsupported_dtype_is_a_dtype_error_not_a_shape_error(db):
    with pytest.raises(tq.DTypeError, match="unsupported dtype") as err:
        db.from_numpy("s", np.ones(3, np.uint16))
    assert not isinstance(err.value, tq.ShapeError)
    with pytest.raises(tq.DTypeError):
        db.from_numpy("c", np.ones(3, np.complex64))
    with pytest.raises(tq.DTypeError):
        db.constant(np.ones(3)).astype("complex128")
    with pytest.raises(tq.ShapeError, match="takes 3 operands"):
        tq.einsum("i,i->i", np.ones(3), np.ones(3), join="where")
    assert db.tensors() == []
