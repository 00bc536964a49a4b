"""Issue 32's numbered bugs and the pass-through on the SQL face, each with DuckDB (or numpy)
as the oracle where there is one."""

from __future__ import annotations

import numpy as np
import pytest

import tensorql as tq
from tensorql.sql.errors import SQLShapeError


@pytest.fixture
def db():
    with tq.connect() as session:
        session.from_numpy("m", np.ones((3, 3)))
        session.connection.execute("CREATE TABLE e (i BIGINT, j BIGINT, w DOUBLE)")
        session.connection.execute("INSERT INTO e VALUES (0, 1, 2.0)")
        yield session


@pytest.mark.parametrize("query", [
    "SELECT * FROM EINSUM('ij,jk->ik', e, e, sizes := {'i': 3, 'j': 3, 'k': 3})",
    "SELECT * FROM EINSUM('ij,jk->ik', e, m, sizes := {'i': 3})",
    "SELECT * FROM EINSUM('ij,jk->ik', m, e)",
    "SELECT * FROM EINSUM('ij,jk->ik', e, m)",
])
def test_relation_without_val_names_the_operand(db, query):
    with pytest.raises(SQLShapeError, match="needs a 'val' column; got columns") as caught:
        db.sql(query)
    assert caught.value.position == query.index(" e") + 1  # the caret is at the operand


@pytest.mark.parametrize("query", [
    "SELECT * FROM EINSUM('" + "ij" * 500_000 + "', m)",
    "SELECT * FROM EINSUM('ij->i', nope" + "x" * 1_000_000 + ")",
    "SELECT 1 +" + " " * 1_000_000 + "FROM",
    "SELECT '" + "y" * 1_000_000 + "' FROM nowhere",
])
def test_sql_error_messages_bound_a_huge_statement(db, query):
    with pytest.raises(tq.TensorQLError) as caught:
        db.sql(query)
    lines = str(caught.value).splitlines()
    assert len(str(caught.value)) < 2_000, str(caught.value)[:300]
    caret = [n for n, line in enumerate(lines) if line.strip() == "^"]
    if caret:  # the caret still points into the excerpt of the line above it
        assert len(lines[caret[0] - 1]) > lines[caret[0]].index("^")
