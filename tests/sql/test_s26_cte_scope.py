"""Which CTE a name means: DuckDB's binding, also for EINSUM operands and CTEs hoisted
around a query tensorql runs on its own (tensorql/sql/rewriting.py: scope_of, with_ctes).

In a WITH clause a CTE sees only the CTEs written before it (not itself, not later ones); a
nested WITH shadows an outer one. Every answer is checked against plain DuckDB running the
same SQL with each ``EINSUM('i->i', N)`` replaced by ``N`` (a table holding the tensor's
element rows ``(i, val)`` where tensorql holds the tensor)."""

from __future__ import annotations

import random
import re

import duckdb
import numpy as np
import pytest
from sqlglot import exp

import tensorql as tq
from tensorql.sql.dialect import Einsum, parse_script
from tensorql.sql.rewriting import scope_of, with_ctes

TENSORS = {"A": [1.0, 2.0, 3.0], "B": [10.0, 20.0, 30.0], "X": [100.0, 200.0, 300.0]}
TABLES = {"Ta": [1.5, 2.5, 3.5], "Tb": [15.0, 25.0, 35.0], "Tx": [150.0, 250.0, 350.0]}


def _values(values: list[float]) -> str:
    rows = ", ".join(f"({i}, {v}::DOUBLE)" for i, v in enumerate(values))
    return f"SELECT * FROM (VALUES {rows}) t(i, val)"


@pytest.fixture(scope="module")
def db():
    with tq.connect(workers=1) as session:
        for name, values in TENSORS.items():
            session.from_numpy(name, np.array(values))
        for name, values in TABLES.items():
            session.sql(f"CREATE TABLE {name} AS {_values(values)}")
        session.sql("CREATE TABLE y AS SELECT 0 AS i, 1000.0 AS val")  # a table, not a tensor
        yield session


@pytest.fixture(scope="module")
def plain():
    """Plain DuckDB: a table of element rows (i, val) for each tensor."""
    con = duckdb.connect()
    for name, values in {**TENSORS, **TABLES}.items():
        con.execute(f"CREATE TABLE {name} AS {_values(values)}")
    con.execute("CREATE TABLE y AS SELECT 0 AS i, 1000.0 AS val")
    yield con
    con.close()


def _without_einsum(sql: str) -> str:
    return re.sub(r"EINSUM\('i->i', (\w+)\)", r"\1", sql)


def _rows(rows: list) -> list:
    return sorted(tuple(round(float(v), 6) for v in row) for row in rows)


def _same(db, plain, sql: str) -> list:
    got = _rows(db.sql(sql).fetchall())
    want = _rows(plain.sql(_without_einsum(sql)).fetchall())
    assert got == want, sql
    return got


def test_a_later_cte_is_not_seen(db, plain):
    # c's operand A is the tensor: the CTE a, written after c (identifiers match whatever
    # their case), once took its place
    got = _same(db, plain, "WITH c AS (SELECT * FROM EINSUM('i->i', A)), a AS (SELECT 0 AS i, "
                           "100.0 AS val) SELECT sum(val) AS s FROM c")
    assert got == [(6.0,)]


def test_a_later_cte_is_not_seen_by_a_fused_einsum(db, plain):
    # the EINSUM over c fuses c's EINSUM: its operand a is still the tensor
    got = _same(db, plain, "WITH c AS (SELECT * FROM EINSUM('i->i', a)), A AS (SELECT 0 AS i, "
                           "100.0 AS val) SELECT * FROM EINSUM('i->i', c)")
    assert got == [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]


def test_a_cte_named_like_its_operand_reads_the_tensor(db, plain):
    # once refused as a CTE "referring to itself": in plain SQL the inner A is the table
    got = _same(db, plain, "WITH A AS (SELECT * FROM EINSUM('i->i', A)) "
                           "SELECT sum(val) AS s FROM a")
    assert got == [(6.0,)]


def test_a_shadowing_nested_cte_keeps_its_scope(db, plain):
    # the inner x reads the CTE y, which reads the OUTER x: hoisted into one WITH, the inner x
    # once came before y, which then read the table y (or failed)
    sql = ("WITH x AS (SELECT 0 AS i, 1.0 AS val), y AS (SELECT i, val * 10 AS val FROM x) "
           "SELECT * FROM (WITH x AS (SELECT i, val + 5 AS val FROM y) "
           "SELECT * FROM EINSUM('i->i', x))")
    assert _same(db, plain, sql) == [(0.0, 15.0)]


@pytest.mark.parametrize("sql", [
    # WITH RECURSIVE shows later CTEs no more than WITH does
    "WITH RECURSIVE c AS (SELECT * FROM EINSUM('i->i', A)), a AS (SELECT 0 AS i, 100.0 AS val) "
    "SELECT sum(val) AS s FROM c",
    # hoisted next to the recursive r into one WITH RECURSIVE, ta would read itself, not
    # the table Ta, after its UNION ALL: it is renamed
    "WITH RECURSIVE r AS (SELECT 0 AS i, 1.0 AS val UNION ALL SELECT i + 1, val * 2 FROM r "
    "WHERE i < 2) SELECT * FROM (WITH ta AS (SELECT * FROM r WHERE i = 0 UNION ALL "
    "SELECT i, val FROM ta WHERE i > 0) SELECT * FROM EINSUM('i->i', ta))",
])
def test_with_recursive_binds_as_in_duckdb(db, plain, sql):
    _same(db, plain, sql)


def test_with_ctes_renames_a_cte_that_would_hide_another():
    tree = parse_script("WITH x AS (SELECT 1 AS v), y AS (SELECT v FROM x) SELECT * FROM "
                        "(WITH x AS (SELECT v FROM y) SELECT * FROM x)")[0].expression
    inner_read = tree.find(exp.Subquery).this.args["from_"].this
    query = with_ctes(parse_script("SELECT * FROM x")[0].expression, scope_of(inner_read))
    plain = duckdb.connect()
    assert plain.sql(query.sql(dialect="duckdb")).fetchall() == [(1,)]
    names = [cte.alias_or_name for cte in query.args["with_"].expressions]
    assert names[1:] == ["y", "x"] and names[0].startswith("__tq_cte_")


def test_scope_of_sees_earlier_ctes_only():
    tree = parse_script("WITH p AS (SELECT 1), q AS (SELECT * FROM EINSUM('i->i', r)), "
                        "r AS (SELECT 2) SELECT * FROM EINSUM('i->i', q)")[0].expression
    inner, outer = _einsums(tree)
    assert {k: v is not None for k, v in scope_of(inner).items()} == \
        {"p": True, "q": False, "r": False}
    assert {k: v is not None for k, v in scope_of(outer).items()} == \
        {"p": True, "q": True, "r": True}


def _einsums(tree):
    """The EINSUM in the CTE q and the one in the query, in that order."""
    found = list(tree.find_all(Einsum))
    in_cte = [e for e in found if e.find_ancestor(exp.CTE) is not None]
    in_query = [e for e in found if e.find_ancestor(exp.CTE) is None]
    return in_cte[0], in_query[0]


# -- random layouts ------------------------------------------------------------------------

def _spell(rng: random.Random, name: str) -> str:
    return rng.choice([name.lower(), name.upper(), name.capitalize()])


# CTE names, each also a table (tensorql and plain DuckDB alike): tensorql cannot read a
# tensor without EINSUM, so a name read as a table must be a table whatever it binds to
POOL = ["ta", "tb", "tx"]


def _source(rng: random.Random) -> str:
    """An EINSUM operand: a CTE or table of the pool, or a tensor (never a CTE name)."""
    return _spell(rng, rng.choice(POOL + ["a", "x"]))


def _body(rng: random.Random, depth: int = 0) -> str:
    """A query with rows (i, val), i in 0..2 once each."""
    k = rng.randint(1, 3)
    kind = rng.randrange(4 if depth == 0 else 3)
    if kind == 0:
        return f"SELECT * FROM EINSUM('i->i', {_source(rng)})"
    if kind == 1:
        return f"SELECT i, val * {k} + {k} AS val FROM {_spell(rng, rng.choice(POOL))}"
    if kind == 2:
        return f"SELECT i, val + {k} AS val FROM EINSUM('i->i', {_source(rng)})"
    inner = _spell(rng, rng.choice(POOL))  # a nested WITH, its CTE maybe shadowing
    read = rng.choice([f"EINSUM('i->i', {_source(rng)})", _spell(rng, rng.choice(POOL))])
    return (f"SELECT * FROM (WITH {inner} AS ({_body(rng, depth + 1)}) "
            f"SELECT i, val - {k} AS val FROM {read})")


def _layout(seed: int) -> str:
    """A random statement: 2 to 4 CTEs (names cased at random, EINSUM anywhere, nested WITHs
    shadowing outer CTEs), then a query reading them."""
    rng = random.Random(seed)
    ctes = [(_spell(rng, rng.choice(POOL)), _body(rng)) for _ in range(rng.randint(2, 4))]
    seen: set[str] = set()
    unique = []
    for name, body in ctes:  # DuckDB refuses a name twice in one WITH
        if name.lower() not in seen:
            seen.add(name.lower())
            unique.append((name, body))
    while len(unique) < 2:
        name = next(n for n in POOL if n not in seen)
        seen.add(name)
        unique.append((name, _body(rng)))
    head = "WITH " + ", ".join(f"{name} AS ({body})" for name, body in unique)
    main = rng.choice([
        f"SELECT i, sum(val) AS val FROM {_spell(rng, rng.choice(POOL))} GROUP BY i",
        f"SELECT * FROM EINSUM('i->i', {_source(rng)})",
        f"SELECT i, val FROM ({_body(rng)})"])
    return f"{head} {main}"


def test_random_cte_layouts_bind_as_in_duckdb(db, plain):
    wrong = []
    for seed in range(40):
        sql = _layout(seed)
        want = _rows(plain.sql(_without_einsum(sql)).fetchall())
        try:
            got = _rows(db.sql(sql).fetchall())
        except tq.TensorQLError as err:
            got = str(err).splitlines()[0]
        if got != want:
            wrong.append((seed, sql, got, want))
    assert wrong == []
