"""``.pl()`` of a ``db.sql`` result and polars frames read by name in SQL, against DuckDB's own
``.pl()`` and numpy (polars is in the dev extras; tensorql itself does not need it)."""

from __future__ import annotations

import duckdb
import numpy as np
import pytest

# a dev extra: a machine without it (the GPU image) skips these, CI installs it
pl = pytest.importorskip("polars")

QUERY = ("SELECT range AS i, range / 2 AS x, 'r' || range AS s, range % 2 = 0 AS even, "
         "range::TINYINT AS t FROM range(7)")


def test_pl_of_a_plain_query_is_duckdbs(db):
    got, want = db.sql(QUERY).pl(), duckdb.sql(QUERY).pl()
    assert isinstance(got, pl.DataFrame)
    assert got.schema == want.schema and got.equals(want)


def test_pl_of_a_tensor_result_holds_its_element_rows(db):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    db.from_numpy("A", a, tile=(2, 2))
    frame = db.sql("SELECT * FROM EINSUM('ij->ij', A)").pl().sort("i", "j")
    assert frame.columns == ["i", "j", "val"]
    assert frame.schema["val"] == pl.Float32 and frame.schema["i"] == pl.Int64
    dense = np.zeros_like(a)
    dense[frame["i"].to_numpy(), frame["j"].to_numpy()] = frame["val"].to_numpy()
    np.testing.assert_array_equal(dense, a)
    sums = db.sql("SELECT i, val FROM EINSUM('ij->i', A) WHERE val > 10").pl()
    assert sums.sort("i").rows() == [(1, 22.0), (2, 38.0)]


def test_polars_frames_are_usable_by_name(db):
    db.from_numpy("A", np.arange(6, dtype=np.float32).reshape(2, 3))
    prices = pl.DataFrame({"k": [0, 1, 2], "p": [1.5, 2.5, 4.0]})  # noqa: F841 - by name
    lazy = pl.LazyFrame({"k": [0, 2], "q": [10, 3]})  # noqa: F841 - read by name in SQL
    got = db.sql("SELECT k, p * q AS cost FROM prices JOIN lazy USING (k) ORDER BY k")
    assert got.fetchall() == [(0, 15.0), (2, 12.0)]
    vec = pl.DataFrame({"j": [0, 1, 2], "val": [1.0, 10.0, 100.0]})  # noqa: F841
    r = db.sql("SELECT * FROM EINSUM('ij,j->i', A, (SELECT j, val FROM vec))")
    np.testing.assert_allclose(r.numpy(), np.arange(6.0).reshape(2, 3) @ [1.0, 10.0, 100.0])
