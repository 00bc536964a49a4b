"""API bugs found by fuzzing (round s24), each checked against numpy or torch: tq.where across
sessions, integer/bool powers and bool floor division, the scalar_out_of_sum rewrite at
half precision, user functions writing inference-mode chunks, built-in torch functions as
joins, ``in`` and iteration, option errors naming their field, pickling a tensor."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

import tensorql as tq
from tensorql.algebra import resolve_join


@pytest.fixture
def db():
    with tq.connect(workers=2) as session:
        yield session


def test_where_refuses_tensors_of_another_session(db):
    with tq.connect() as other:
        cond = db.from_numpy("C", np.array([True, False, True]))
        db.from_numpy("X", np.array([100.0, 200.0, 300.0]))  # the same name in this session
        x = other.from_numpy("X", np.array([1.0, 2.0, 3.0]))
        y = other.from_numpy("Y", np.array([-1.0, -2.0, -3.0]))
        for args in [(cond, x, 0.0), (cond, x, y), (cond, 0.0, x)]:
            with pytest.raises(tq.TensorQLError, match="two different databases"):
                tq.where(*args)
        # one session's tensors still work, as numpy's where
        np.testing.assert_array_equal(tq.where(x > 1.5, x, y).numpy(),
                                      np.where([False, True, True], [1.0, 2.0, 3.0],
                                               [-1.0, -2.0, -3.0]))


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64, torch.bool])
def test_integer_and_bool_power_dtype_as_torch(db, dtype):
    t = torch.tensor([3, 300, -200, 0]).to(dtype)
    A = db.from_torch("A", t)
    for exponent in [2.0, 2, 3.0, 0.5]:  # 2.0 was squared in the integer dtype (wrapping)
        want = t ** exponent
        got = A ** exponent
        assert got.dtype == str(want.dtype).removeprefix("torch."), exponent
        torch.testing.assert_close(got.torch(), want, equal_nan=True)


@pytest.mark.parametrize("name", ["b // True", "b % True", "b ** True", "b // b", "b % b",
                                  "b ** b", "True // b", "True ** b", "b // False"])
def test_bool_floordiv_mod_pow_give_numpy_int8(db, name):
    values = np.array([True, False, True])
    with np.errstate(divide="ignore"):  # numpy's x // 0 is 0, with a warning
        want = eval(name, {"b": values})  # numpy's: int8
    got = eval(name, {"b": db.from_numpy("B", values)})
    assert got.dtype == want.dtype == np.int8
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scalar_out_of_sum_keeps_half_precision_in_range(db, dtype):
    h = torch.full((4, 8), 300.0, dtype=dtype)
    g = torch.full((8, 4), 300.0, dtype=dtype)
    s = torch.tensor(1000.0, dtype=dtype)
    if dtype == torch.bfloat16:  # bfloat16 reaches 3e38: its products must be larger
        h, g, s = h * 1e17, g * 1e17, s * 1e34
    e = (db.from_torch("H", h) / db.from_torch("S", s)) @ db.from_torch("G", g)
    assert "scalar_out_of_sum" not in e.explain()
    want = (h.double() / s.double()) @ g.double()
    got = e.torch()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=0.0)
    # float32 keeps the rewrite (its range is reached only near 1e19)
    y = np.random.default_rng(0).random((4, 8), dtype=np.float32)
    c = np.random.default_rng(1).random((8, 3), dtype=np.float32)
    Y, C = db.from_numpy("Y", y), db.from_numpy("C", c)
    e = (Y / Y.max()) @ C
    assert "scalar_out_of_sum" in e.explain()
    np.testing.assert_allclose(e.numpy(), (y / y.max()) @ c, rtol=1e-5)


def _writes_large(x, y):
    if x.numel() > 64:  # the registration probe's operands are smaller: only chunks
        x.add_(100.0)
    return x * y


def test_join_writing_inference_chunk_is_refused_and_store_intact(db):
    rng = np.random.default_rng(0)
    a, b = rng.random((16, 16)), rng.random((16, 16))
    A = db.from_numpy("A", a, tile=(16, 16))
    B = db.from_numpy("B", b, tile=(16, 16))
    with torch.inference_mode():
        with pytest.raises(tq.ExecutionError, match="wrote its operand 0 in place"):
            tq.einsum("ij,ij->ij", A, B, join=_writes_large).numpy()
        # a pure function still runs under inference mode, on the intact chunks
        got = tq.einsum("ij,ij->ij", A, B, join=lambda x, y: torch.exp(x) * y).numpy()
        np.testing.assert_allclose(got, np.exp(a) * b)
    np.testing.assert_array_equal(A.numpy(), a)
    np.testing.assert_array_equal(db.sql("SELECT * FROM EINSUM('ij->ij', A)",
                                         backend="duckdb").numpy(), a)


def test_agg_writing_its_operand_is_refused_and_store_intact(db):
    a = np.random.default_rng(1).random((16, 16))
    A = db.from_numpy("A", a, tile=(16, 16))

    def greedy_max(x, y):
        if x.numel() > 64:  # the probe's operands are 3x4
            x.add_(100.0)
        return torch.maximum(x, y)

    tq.register_agg("s24_greedy_max", greedy_max, identity=float("-inf"))
    for inference in (False, True):
        with torch.inference_mode(inference):
            with pytest.raises(tq.ExecutionError, match="in place"):
                tq.einsum("ij->i", A, agg="s24_greedy_max").numpy()
        np.testing.assert_array_equal(A.numpy(), a)


@pytest.mark.parametrize("fn", [torch.exp, torch.sigmoid, torch.abs, torch.tanh])
def test_builtin_unary_torch_function_as_join(db, fn):
    a = np.linspace(-2.0, 2.0, 6).reshape(2, 3)
    A = db.from_numpy("A", a)
    name = resolve_join(fn, arity=1)
    assert resolve_join(fn, arity=1) == name  # one name for the function and arity
    np.testing.assert_allclose(tq.einsum("ij->ij", A, join=name).numpy(),
                               fn(torch.tensor(a)).numpy())
    # two operands: the same builtin is registered once more, for that arity
    assert resolve_join(torch.logaddexp, arity=2) == resolve_join(torch.logaddexp, arity=2)


def test_contains_is_elementwise_equality(db):
    a = np.arange(6.0).reshape(2, 3)
    A = db.from_numpy("A", a)
    for value in [1.0, 5, 7.0, -0.0, np.float32(4.0), 2.5]:
        assert (value in A) == (value in a), value
    assert (np.array([3.0, 4.0, 5.0]) in A) == (np.array([3.0, 4.0, 5.0]) in a)


def test_iteration_gives_rows_and_refuses_0d(db):
    a = np.arange(6.0).reshape(2, 3)
    A = db.from_numpy("A", a)
    rows = list(A)
    assert len(rows) == 2
    for got, want in zip(rows, a):
        np.testing.assert_array_equal(got.numpy(), want)
    with pytest.raises(TypeError, match="0-d"):
        list(np.array(1.0))  # numpy's answer
    with pytest.raises(tq.UnsupportedError, match="iteration over a 0-d tensor"):
        list(A[0, 1])


@pytest.mark.parametrize("field", ["memory_limit", "process_memory_limit",
                                   "store_memory_limit", "relation_dense_bytes",
                                   "device_cache"])
def test_memory_size_errors_name_the_field(field):
    with pytest.raises(tq.OptionError, match=f"^{field}: cannot read memory size '-1GiB'"):
        tq.Options(**{field: "-1GiB"})
    with pytest.raises(tq.OptionError, match=f"^{field}: cannot read memory size 1.5"):
        tq.Options(**{field: 1.5})


@pytest.mark.parametrize("field", ["memory_limit", "store_memory_limit", "device_cache"])
def test_memory_size_env_errors_name_the_variable(monkeypatch, field):
    variable = f"TENSORQL_{field.upper()}"
    monkeypatch.setenv(variable, "12 parsecs")
    with pytest.raises(tq.OptionError, match=f"^{variable}: cannot read memory size"):
        tq.Options.from_env()
    monkeypatch.setenv(variable, "64MiB")
    assert getattr(tq.Options.from_env(), field) == 64 << 20


def test_memory_limit_env_zero_names_the_variable(monkeypatch):
    monkeypatch.setenv("TENSORQL_MEMORY_LIMIT", "0")
    with pytest.raises(tq.OptionError, match="^TENSORQL_MEMORY_LIMIT: memory size must be "
                                             "positive"):
        tq.Options.from_env()


def test_pickle_and_deepcopy_of_a_tensor_are_clear_errors(db):
    A = db.from_numpy("A", np.arange(6.0).reshape(2, 3))
    for expr in (A, A + 1):
        with pytest.raises(tq.UnsupportedError, match="lazy expression of its session"):
            copy.deepcopy(expr)
        with pytest.raises(tq.UnsupportedError, match="lazy expression of its session"):
            pickle.dumps(expr)
    # a shallow copy is the same expression of the same session
    shallow = copy.copy(A + 1)
    assert shallow.db is db
    np.testing.assert_array_equal(shallow.numpy(), np.arange(6.0).reshape(2, 3) + 1)


def test_an_unknown_strategy_is_refused_at_connect():
    with pytest.raises(tq.TensorQLError, match="unknown strategy 'bogus'"):
        tq.connect(strategy="bogus")
    assert tq.connect(strategy="data").options.strategy == "data"


def test_a_builtin_torch_function_of_one_operand_as_join():
    a = np.arange(6.0).reshape(2, 3)
    with tq.connect() as db:
        A = db.from_numpy("A", a)
        for fn in (torch.exp, torch.sigmoid, torch.abs):
            got = tq.einsum("ij->ij", A, join=fn).numpy()
            np.testing.assert_allclose(got, fn(torch.tensor(a)).numpy(), rtol=1e-12)


@pytest.mark.parametrize("ddof", [0, 1])
def test_std_of_a_constant_row_has_torch_s_zero_gradient(ddof):
    a = np.array([[1.0, 1.0, 1.0], [1.0, 2.0, 4.0], [0.0, 0.0, 0.0]])
    with tq.connect() as db:
        X = db.from_numpy("x", a)
        got = tq.grad(X.std(axis=1, ddof=ddof).sum(), [X])[0].numpy()
        np.testing.assert_allclose(X.std(axis=1, ddof=ddof).numpy(), a.std(axis=1, ddof=ddof),
                                   rtol=1e-12)
    t = torch.tensor(a, requires_grad=True)
    (want,) = torch.autograd.grad(t.std(dim=1, correction=ddof).sum(), t)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-12)
