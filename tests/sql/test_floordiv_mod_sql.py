"""Issue 32: the ``floordiv`` / ``mod`` joins (Python's ``//`` and ``%`` on tensors) over
relation operands in SQL, where DuckDB computes them, against numpy's values."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.mark.parametrize("join, fn", [("mod", np.remainder), ("floordiv", np.floor_divide)])
def test_floats_over_relation_rows_match_numpy(db, join, fn):
    num = np.array([7.0, -7.0, 7.5, -7.5, 0.0, 3.0, 5.3, -5.3, 1.0, 0.0, -2.0])
    den = np.array([2.0, 2.0, -2.0, -2.0, 3.0, 0.0, 0.7, 0.7, 0.1, 0.0, 0.0])
    db.sql("CREATE TABLE v AS SELECT unnest(range(11)) AS i, unnest(?) AS val", [num.tolist()])
    db.from_numpy("D", den)
    got = db.sql(f"SELECT * FROM EINSUM('i,i->i', v, D, join := '{join}')").numpy()
    with np.errstate(all="ignore"):
        want = fn(num, den)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert np.array_equal(np.isinf(got), np.isinf(want)) and np.array_equal(np.signbit(
        got[np.isinf(got)]), np.signbit(want[np.isinf(want)]))


@pytest.mark.parametrize("join, fn", [("mod", np.remainder), ("floordiv", np.floor_divide)])
def test_integers_over_relation_rows_match_numpy(db, join, fn):
    num = np.array([7, -7, 7, -7, 0, 3, 9, -9])
    den = np.array([2, 2, -2, -2, 3, 0, -4, 4])
    db.sql("CREATE TABLE w AS SELECT unnest(range(8)) AS i, unnest(?) AS val", [num.tolist()])
    db.from_numpy("E", den)
    got = db.sql(f"SELECT * FROM EINSUM('i,i->i', w, E, join := '{join}')").numpy()
    with np.errstate(all="ignore"):
        want = fn(num, den)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    rows = db.sql(f"SELECT i, val FROM EINSUM('i,i->i', w, E, join := '{join}') "
                  "WHERE i >= 6 ORDER BY i").fetchall()
    assert rows == [(6, int(want[6])), (7, int(want[7]))]
