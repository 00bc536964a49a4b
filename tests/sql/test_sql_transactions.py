"""A SQL transaction of the user's (BEGIN ... COMMIT / ROLLBACK) beside tensorql's own
writes. Found by fuzzing (s16): one failed statement inside BEGIN left every later statement,
ROLLBACK included, raising DuckDB's raw TransactionException (the session could not recover);
a tensor stored or dropped inside BEGIN was written in a transaction of its own, so ROLLBACK
did not undo it (and db.from_numpy raised a StorageError yet stored the tensor). Writes are now
refused while the user's transaction is open, and a transaction an error aborted can always
be rolled back."""

from __future__ import annotations

import numpy as np
import pytest

import tensorql as tq
from tensorql.sql.errors import SQLExecutionError


@pytest.fixture(params=["memory", "file"])
def session(request, tmp_path):
    path = None if request.param == "memory" else str(tmp_path / "t.duckdb")
    with tq.connect(path) as db:
        db.from_numpy("A", np.arange(6, dtype=np.float32).reshape(2, 3), tile=(1, 2))
        yield db


def test_tensor_writes_inside_a_users_transaction_are_refused_and_store_nothing(session):
    session.sql("BEGIN")
    a = np.ones((2, 2), np.float32)
    writes = {
        "from_numpy": lambda: session.from_numpy("Z", a),
        "store_many": lambda: session.store_many({"Q": session.tensor("A") * 2}),
        "store": lambda: session.store("S", session.tensor("A") * 2),
        "drop": lambda: session.drop("A"),
        "CREATE TENSOR": lambda: session.sql(
            "CREATE TENSOR F AS SELECT * FROM EINSUM('ij->ji', A)"),
        "DROP TENSOR": lambda: session.sql("DROP TENSOR A"),
    }
    for what, write in writes.items():
        with pytest.raises(tq.StorageError, match="a SQL transaction .BEGIN. is open") as info:
            write()
        assert "COMMIT or ROLLBACK first" in str(info.value), what
    # the transaction is still usable, sees the tensors, and ends as the user says
    assert session.sql("SELECT count(*) FROM A").fetchall() == [(6,)]
    session.sql("ROLLBACK")
    assert session.tensors() == ["A"]
    session.from_numpy("Z", a)
    session.sql("BEGIN; SELECT 1; COMMIT")
    assert session.sql_transaction_begun  # the next write asks the store, once
    session.sql("CREATE TENSOR F AS SELECT * FROM EINSUM('ij->ji', A)")
    assert not session.sql_transaction_begun
    assert session.tensors() == ["A", "F", "Z"]
    np.testing.assert_array_equal(session.tensor("F").numpy(),
                                  np.arange(6, dtype=np.float32).reshape(2, 3).T)


def test_a_transaction_an_error_aborted_can_be_rolled_back(session):
    session.sql("BEGIN")
    with pytest.raises(SQLExecutionError, match="Could not convert"):
        session.sql("SELECT 'x'::INT")
    with pytest.raises(SQLExecutionError, match="aborted by an earlier error: run ROLLBACK"):
        session.sql("SELECT 1")
    with pytest.raises(tq.StorageError, match="a SQL transaction"):
        session.from_numpy("Z", np.ones(2))
    session.sql("ROLLBACK")
    assert session.sql("SELECT count(*) FROM A").fetchall() == [(6,)]
    assert session.tensors() == ["A"]
    session.sql("BEGIN")  # a script that ends the aborted transaction itself runs too
    with pytest.raises(SQLExecutionError):
        session.sql("SELECT 'x'::INT")
    session.sql("ROLLBACK; SELECT 1")
    assert session.sql("SELECT 2").fetchall() == [(2,)]
