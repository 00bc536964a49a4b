"""Issue 32: DLPack both ways, ``db.from_arrow`` / ``db.from_pandas``, and ``repr`` /
``_repr_html_`` with values for small results -- against numpy, torch, pyarrow and pandas."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch

import tensorql as tq


def test_dlpack_out_to_torch_and_numpy(db):
    a = np.arange(12.0).reshape(3, 4)
    t = db.from_numpy("A", a, tile=(2, 2)) * 2.0
    assert t.__dlpack_device__() == (1, 0)  # kDLCPU
    np.testing.assert_array_equal(torch.from_dlpack(t).numpy(), a * 2.0)
    np.testing.assert_array_equal(np.from_dlpack(t), a * 2.0)


@pytest.mark.parametrize("make", [
    lambda: torch.arange(24, dtype=torch.float32).reshape(2, 3, 4),
    lambda: np.arange(10, dtype=np.int16),
    lambda: torch.arange(6, dtype=torch.float64).reshape(2, 3).T,  # strided, not contiguous
    lambda: np.ones((2, 2), dtype=np.bool_),
])
def test_from_dlpack_stores_any_dlpack_tensor(db, make):
    source = make()
    want = source.numpy() if isinstance(source, torch.Tensor) else source
    stored = tq.from_dlpack(db, "T", source, tile=(1,) * want.ndim)
    assert stored.shape == want.shape and stored.np_dtype == want.dtype
    np.testing.assert_array_equal(db.tensor("T").numpy(), want)
    again = db.from_dlpack("T", source, replace=True)
    np.testing.assert_array_equal(again.numpy(), want)


def test_from_dlpack_takes_a_tensor_of_another_database(db):
    with tq.connect() as other:
        lazy = other.from_numpy("x", np.arange(4.0)).exp()
        copied = tq.from_dlpack(db, "y", lazy)
        np.testing.assert_allclose(copied.numpy(), np.exp(np.arange(4.0)))
    with pytest.raises(tq.UnsupportedError, match="does not export DLPack"):
        tq.from_dlpack(db, "z", [1, 2, 3])


def test_dlpack_requests_the_values_cannot_meet_are_dlpack_errors(db):
    """A fuzzer's finds: ``__dlpack__`` asked for a stream or a device the CPU values are not
    on raised torch's AssertionError / NotImplementedError; an object claiming a CUDA device
    raised torch's AssertionError in ``tq.from_dlpack``, and a session that is not one an
    AttributeError. Each is now a TensorQLError (a BufferError for the exporter, as the
    protocol asks), and nothing is stored."""
    t = db.from_numpy("A", np.arange(4.0)) * 2.0
    for request in ({"stream": 1}, {"dl_device": (2, 0)}):
        with pytest.raises(tq.DLPackError, match="cannot be exported as asked") as info:
            t.__dlpack__(**request)
        assert isinstance(info.value, BufferError)
    np.testing.assert_array_equal(torch.from_dlpack(t).numpy(), np.arange(4.0) * 2.0)

    class ClaimsCuda:
        def __dlpack_device__(self):
            return (2, 0)  # kDLCUDA

        def __dlpack__(self, *args, **kwargs):
            return torch.ones(3).__dlpack__()

    with pytest.raises(tq.UnsupportedError, match="torch cannot import this ClaimsCuda"):
        tq.from_dlpack(db, "T", ClaimsCuda())
    with pytest.raises(tq.UnsupportedError, match="the session to store in"):
        tq.from_dlpack(None, "T", torch.ones(3))
    assert db.tensors() == ["A"]


def test_from_arrow_arrays_tables_and_tensors(db):
    np.testing.assert_array_equal(db.from_arrow("a", pa.array([1.5, -2.0])).numpy(),
                                  np.array([1.5, -2.0]))
    chunked = pa.chunked_array([[1, 2], [3]], type=pa.int32())
    got = db.from_arrow("c", chunked)
    assert got.dtype == "int32" and got.numpy().tolist() == [1, 2, 3]
    table = pa.table({"x": pa.array([1, 2, 3], pa.int64()), "y": [0.5, 1.5, 2.5],
                      "b": [True, False, True]})
    want = np.stack([np.array([1, 2, 3]), np.array([0.5, 1.5, 2.5]),
                     np.array([True, False, True])], axis=1)
    t = db.from_arrow("t", table)
    assert t.shape == (3, 3) and t.np_dtype == want.dtype == np.float64
    np.testing.assert_array_equal(t.numpy(), want)
    np.testing.assert_array_equal(db.from_arrow("rb", table.to_batches()[0]).numpy(), want)
    cube = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    np.testing.assert_array_equal(db.from_arrow("pt", pa.Tensor.from_numpy(cube)).numpy(), cube)
    fixed = pa.FixedShapeTensorArray.from_numpy_ndarray(cube)
    np.testing.assert_array_equal(db.from_arrow("ft", fixed).numpy(), cube)


def test_from_arrow_refuses_what_is_not_a_tensor(db):
    with pytest.raises(tq.DTypeError, match="column 's' is string, not numeric"):
        db.from_arrow("bad", pa.table({"x": [1.0], "s": ["a"]}))
    with pytest.raises(tq.UnsupportedError, match="column 'x' holds 1 null"):
        db.from_arrow("bad", pa.table({"x": [1.0, None]}))
    with pytest.raises(tq.UnsupportedError, match="from_arrow takes"):
        db.from_arrow("bad", [1, 2])
    assert "bad" not in db.tensors()


def test_from_pandas_numeric_frames_and_series(db):
    frame = pd.DataFrame({"a": [1, 2, 3], "b": [0.25, 0.5, 0.75], "c": np.array([1, 0, 1],
                                                                                 np.int8)})
    t = db.from_pandas("F", frame)
    assert t.shape == frame.shape and t.np_dtype == frame.to_numpy().dtype
    np.testing.assert_array_equal(t.numpy(), frame.to_numpy())
    ints = pd.DataFrame({"a": np.arange(4, dtype=np.int32), "b": np.arange(4, dtype=np.int32)})
    assert db.from_pandas("I", ints).dtype == "int32"
    s = pd.Series([3.0, 1.0, 2.0])
    np.testing.assert_array_equal(db.from_pandas("S", s).numpy(), s.to_numpy())
    nullable = pd.DataFrame({"n": pd.array([1, 2], dtype="Int64")})
    np.testing.assert_array_equal(db.from_pandas("N", nullable).numpy(), [[1], [2]])


def test_from_pandas_refuses_text_and_missing_values(db):
    with pytest.raises(tq.DTypeError, match="column 'name' is (object|str), not numeric"):
        db.from_pandas("bad", pd.DataFrame({"x": [1.0], "name": ["a"]}))
    with pytest.raises(tq.UnsupportedError, match="column 'n' holds missing values"):
        db.from_pandas("bad", pd.DataFrame({"n": pd.array([1, None], dtype="Int64")}))
    assert "bad" not in db.tensors()


def test_repr_shows_values_of_small_results_only(db):
    small = db.from_numpy("s", np.array([[1.0, 2.0], [3.0, 4.0]])) + 1.0
    text = repr(small)
    assert text.startswith("<tensorql.Tensor") and repr(np.array([[2.0, 3.0], [4.0, 5.0]])) \
        in text
    big = db.from_numpy("b", np.zeros((40, 40)))
    assert "array(" not in repr(big) and "shape=(40, 40)" in repr(big)
    # a small result of a large input is not computed for a repr
    reduced = db.from_numpy("r", np.zeros((1200, 1000), dtype=np.float32)).sum()
    assert "array(" not in repr(reduced)
    html = small._repr_html_()
    assert html.startswith("<div>") and "<pre>array([[2., 3.]," in html
    assert "<pre>" not in big._repr_html_()


def test_repr_of_a_failing_query_does_not_raise(db):
    x = db.from_numpy("x", np.ones(3))
    db.drop("x")
    assert "array(" not in repr(x * 2.0)


def test_repr_does_not_compute_a_long_graph(db):
    x = db.from_numpy("x", np.ones(3))
    for _ in range(70):
        x = x + 1.0
    assert "array(" not in repr(x) and x.numpy().tolist() == [71.0, 71.0, 71.0]


def test_from_dlpack_of_a_numpy_view_with_negative_strides(db):
    """Found by fuzzing (s9): torch's DLPack import of np.arange(3.0)[::-1] aborted the whole
    process (c10::Error thrown past its C boundary); numpy arrays go in as from_numpy's."""
    a = np.arange(6.0).reshape(2, 3)[::-1, ::-2]
    np.testing.assert_array_equal(tq.from_dlpack(db, "n", a).numpy(), a)
    np.testing.assert_array_equal(db.from_dlpack("m", np.arange(3.0)[::-1]).numpy(), [2, 1, 0])


def test_from_dlpack_of_what_torch_cannot_import_is_named(db):
    class Exporter:  # a __dlpack__ that refuses, as numpy's does for datetimes
        def __dlpack__(self, **kwargs):
            raise BufferError("no DLPack for this dtype")

        def __dlpack_device__(self):
            return (1, 0)

    with pytest.raises(tq.UnsupportedError, match="torch cannot import this Exporter"):
        tq.from_dlpack(db, "x", Exporter())
    assert db.tensors() == []
