"""Issue 32's numbered bugs on the Python face, each against numpy or torch as the oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

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


@pytest.mark.parametrize("name", ["argmax", "argmin"])
def test_arg_extreme_of_rows_holding_nan_is_the_first_nan(name):
    rng = np.random.default_rng(32)
    a = rng.standard_normal((5, 7))
    a[0, 3] = a[0, 5] = np.nan  # two NaNs: the first one wins
    a[2, 0] = np.nan
    a[4, 6] = np.nan
    x = tq.connect().constant(a)
    fn = getattr(np, name)
    for axis in (0, 1, -1):
        np.testing.assert_array_equal(getattr(x, name)(axis=axis).numpy(), fn(a, axis=axis))
    assert int(getattr(x, name)()) == fn(a)  # the flat index
    row = tq.connect().constant(a[1])  # a row without NaN: unchanged
    assert int(getattr(row, name)()) == fn(a[1])
    assert int(getattr(tq.connect().constant(a[0]), name)()) == fn(a[0]) == 3


def _torch_ones(n):
    import torch

    return torch.ones(n)


@pytest.mark.parametrize("make, position", [
    (lambda: (np.ones((2, 3)), [0], np.ones(3)), 2),  # an array where the output list goes
    (lambda: (np.ones((2, 3)), [0, 1], _torch_ones(3)), 2),  # a torch tensor there
    (lambda: (np.ones((2, 3)), [0, 1], np.ones(3), [1], np.ones(3)), 4),
    (lambda: (np.ones((2, 3)), np.ones(2), np.ones(3), [1]), 1),  # floats as a subscript list
])
def test_interleaved_form_with_an_array_for_subscripts_names_the_position(make, position):
    args = make()
    with pytest.raises(tq.ParseError, match=f"argument {position} ") as caught:
        tq.einsum(*args)
    assert "subscript" in str(caught.value)
    with pytest.raises(TypeError):  # numpy refuses the same call
        np.einsum(*[a.numpy() if hasattr(a, "numpy") else a for a in args])


def test_interleaved_form_takes_integer_arrays_as_subscripts_like_numpy():
    a, b = np.arange(6.0).reshape(2, 3), np.arange(3.0)
    got = tq.einsum(a, np.array([0, 1]), b, [1], np.array([0])).numpy()
    np.testing.assert_array_equal(got, np.einsum(a, np.array([0, 1]), b, [1], np.array([0])))


def test_explain_analyze_of_a_network_whose_naive_flops_pass_a_float():
    from opt_einsum import get_symbol

    from tensorql.logical.path import plan_path

    # a star of 104 (2 x 1000) operands: naive FLOPs 2 * 103 * 2 * 1000**104 > 1.8e308 (two
    # FLOPs, a multiply and an add, per joined element, as PathInfo counts them)
    n = 104
    labels = [("h", get_symbol(k + 10)) for k in range(n)]
    sizes = {"h": 2, **{lab: 1000 for _, lab in labels}}
    info = plan_path(labels, (), sizes)
    assert info.naive_flops == 2 * (n - 1) * 2 * 1000 ** n  # exact, as a Python int
    text = info.explain()
    assert "naive 4.12e+314 FLOP" in text and "e+" in text.split("x less")[0]
    db = tq.connect()
    ops = [db.constant(np.full((2, 1000), 0.5 ** (k % 3))) for k in range(n)]
    t = tq.einsum(",".join("".join(lab) for lab in labels) + "->", *ops)
    plan = t.explain(analyze=True)
    assert "naive 4.12e+314 FLOP" in plan
    want = sum(np.prod([np.full((2, 1000), 0.5 ** (k % 3)).sum(axis=1)[h] for k in range(n)])
               for h in range(2))
    np.testing.assert_allclose(float(t), want, rtol=1e-9)


def test_format_flops_and_bytes_of_numbers_beyond_a_float():
    from tensorql.units import format_bytes, format_flops

    assert format_flops(10 ** 400) == "1.00e+400 FLOP"
    assert format_flops(2 * 10 ** 12) == "2.00 TFLOP"  # unchanged below
    assert format_bytes(10 ** 400).endswith("TiB") and "e+" in format_bytes(10 ** 400)


@pytest.mark.parametrize("divisor", [0, 0.0, -0.0, np.float64(0.0)])
def test_division_by_zero_gives_inf_and_nan_like_numpy(divisor):
    a = np.array([[1.5, -2.0, 0.0], [np.inf, -0.0, 3.0]])
    x = tq.connect().constant(a)
    with np.errstate(divide="ignore", invalid="ignore"):
        want = a / divisor
        np.testing.assert_array_equal((x / divisor).numpy(), want)
        ints = np.array([3, -1, 0], dtype=np.int64)
        got = (tq.connect().constant(ints) / divisor).numpy()
        np.testing.assert_array_equal(got, ints / divisor)


def test_bool_of_a_tensor_is_numpys():
    db = tq.connect()
    for value in (np.array(0.0), np.array(2.5), np.array([0]), np.array([[3]]), np.array(True)):
        assert bool(db.constant(value)) is bool(value)
    with pytest.raises(ValueError, match="more than one element is ambiguous") as caught:
        bool(db.constant(np.array([1.0, 2.0])))
    assert isinstance(caught.value, tq.TensorQLError)
    with pytest.raises(ValueError):  # numpy refuses the same
        bool(np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="0-d"):
        len(db.constant(np.array(1.0)))  # as numpy: len() of a 0-d array is a TypeError
    with pytest.raises(TypeError):
        len(np.array(1.0))


@pytest.mark.parametrize("value", [np.array(2.5), np.arange(6.0).reshape(2, 3),
                                   np.array([1, 2], dtype=np.int32), np.array([True, False])])
def test_torch_as_tensor_and_np_asarray_of_a_tensor(value):
    import torch

    t = tq.connect().constant(value)
    got = torch.as_tensor(t)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.as_tensor(value).dtype
    np.testing.assert_array_equal(got.numpy(), value)
    np.testing.assert_array_equal(np.asarray(t), value)
    assert np.asarray(t).dtype == value.dtype
    assert np.asarray(t, dtype=np.float32).dtype == np.float32


@pytest.mark.parametrize("left, right", [("uint8", "int8"), ("int8", "uint8"),
                                         ("int16", "int8"), ("uint8", "int16")])
def test_mixed_small_integers_promote_like_numpy(left, right):
    rng = np.random.default_rng(6)
    a = rng.integers(0, 120, 8).astype(left)
    b = rng.integers(-100, 100, 8).astype(right) if right != "uint8" else \
        rng.integers(0, 250, 8).astype(right)
    db = tq.connect()
    x, y = db.constant(a), db.constant(b)
    for got, want in [((x + y).numpy(), a + b), ((x * y).numpy(), a * b),
                      ((x - y).numpy(), a - b)]:
        assert got.dtype == want.dtype == np.int16
        np.testing.assert_array_equal(got, want)
    total = tq.einsum("i,i->", x, y).numpy()
    assert total == np.einsum("i,i->", a.astype(np.int64), b.astype(np.int64))


def test_int16_tensors_store_and_read_back_in_sql():
    a = np.array([[-300, 7], [32000, -32768]], dtype=np.int16)
    with tq.connect() as db:
        t = db.from_numpy("s", a, tile=(1, 2))
        assert t.dtype == "int16"
        np.testing.assert_array_equal(t.numpy(), a)
        assert (t + t).dtype == "int16"
        rows = db.sql("SELECT d0, d1, val FROM s ORDER BY d0, d1").fetchall()
        assert rows == [(0, 0, -300), (0, 1, 7), (1, 0, 32000), (1, 1, -32768)]
        np.testing.assert_array_equal(db.sql("SELECT * FROM EINSUM('ij->j', s)").numpy(),
                                      a.astype(np.int64).sum(axis=0))


@pytest.mark.parametrize("call", [
    lambda a: tq.einsum("ij" + " " * 1_000_000 + "!->i", a),
    lambda a: tq.einsum("ij" * 500_000 + "->", a),
    lambda a: tq.einsum("ij->i", a, join="x" * 1_000_000),
    lambda a: a.db.tensor("n" * 1_000_000),
    lambda a: tq.einsum(a, ["x" * 1_000_000, 1]),
    lambda a: tq.einsum("i" + "j" * 1_000_000 + "k->ik", a, a),
], ids=["spaces", "labels", "join", "tensor", "interleaved", "operands"])
def test_error_messages_bound_a_huge_echoed_spec(call):
    a = tq.connect().constant(np.ones((2, 2)))
    with pytest.raises(tq.TensorQLError) as caught:
        call(a)
    text = str(caught.value)
    assert len(text) < 2_000, text[:300]
    assert "characters)" in text  # says how long the elided text was


def test_bounded_texts_keep_short_ones_and_say_how_long_long_ones_were():
    from tensorql.errors import ParseError, TensorQLError

    assert str(TensorQLError("unknown tensor 'abc'")) == "unknown tensor 'abc'"
    err = TensorQLError(f"equation {'ab' * 300!r} is wrong")
    assert str(err).startswith("equation 'abab") and "… (600 characters)'" in str(err)
    assert str(err).endswith(" is wrong")
    line = "x" * 5_000 + "!" + "y" * 5_000
    err = ParseError("unexpected '!'", text=line, position=5_000)
    rendered = str(err).splitlines()
    assert len(rendered[1]) < 300 and rendered[1].index("!") == rendered[2].index("^")


def test_dtype_equals_numpy_and_torch_spellings():
    """``.dtype`` stays the name (the contract's string) and equals numpy's and torch's
    spellings of it, as numpy habits expect (``t.dtype == np.float32``)."""
    with tq.connect() as db:
        x = db.from_numpy("x", np.arange(6, dtype=np.int16).reshape(2, 3))
        y = db.from_numpy("y", np.ones(3, dtype=np.float32))
        assert x.dtype == "int16" and x.dtype == np.int16 and x.dtype == np.dtype("int16")
        assert x.dtype == torch.int16 and x.dtype != np.int32 and x.dtype != "float32"
        assert np.dtype(x.dtype) == x.numpy().dtype and (x * 2).dtype == np.int16
        assert y.dtype == np.float32 and isinstance(y.dtype, str) and {y.dtype: 1}["float32"]
        assert (x + y).dtype == np.result_type(np.int16, np.float32)
