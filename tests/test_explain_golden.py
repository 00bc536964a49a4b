"""EXPLAIN at every stage, compared exactly with golden files: a change to lowering, the
optimizer, the physical planner or the memory plan shows as a plan diff.

Rewrite the files after an intended change with ``pytest tests/test_explain_golden.py
--update-golden`` and review the diff.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import tensorql as tq
from tensorql.pipeline import STAGES

GOLDEN = pathlib.Path(__file__).parent / "fixtures" / "explain"


def _matmul(db):
    a = db.from_numpy("A", np.ones((8, 6), np.float32), tile=(4, 3))
    b = db.from_numpy("B", np.ones((6, 4), np.float32), tile=(3, 4))
    return a @ b


def _chain(db):
    a = db.from_numpy("A", np.ones((8, 30), np.float32))
    b = db.from_numpy("B", np.ones((30, 2), np.float32), tile=(15, 2))
    c = db.from_numpy("C", np.ones((2, 20), np.float32))
    return tq.einsum("ij,jk,kl->il", a, b, c).relu()


def _mlp(db):
    x = db.from_numpy("X", np.ones((16, 8), np.float32))
    w1 = db.from_numpy("W1", np.ones((8, 32), np.float32))
    w2 = db.from_numpy("W2", np.ones((32, 8), np.float32))
    return (x @ w1).relu() @ w2


def _softmax(db):
    s = db.from_numpy("S", np.ones((4, 12), np.float32), tile=(2, 6))
    return s.softmax(axis=1)


def _mlp_bias(db):
    x = db.from_numpy("X", np.ones((16, 8), np.float32))
    w1 = db.from_numpy("W1", np.ones((8, 32), np.float32))
    b1 = db.from_numpy("b1", np.ones((32,), np.float32))
    w2 = db.from_numpy("W2", np.ones((32, 8), np.float32))
    return (x @ w1 + b1).relu() @ w2


QUERIES = {
    "matmul_1dev": (_matmul, {"devices": "cpu"}),  # the golden names cpu:0
    "chain_2dev": (_chain, {"devices": 2}),
    "mlp_4dev": (_mlp, {"devices": 4}),
    "softmax_3dev_limit": (_softmax, {"devices": 3, "memory_limit": 512}),
    "mlp_bias_2dev": (_mlp_bias, {"devices": 2}),  # a rewrite rule fires: Pointwise
}


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("query", list(QUERIES))
def test_explain_stage_matches_golden(query, stage, request):
    build, settings = QUERIES[query]
    with tq.connect(workers=2, **settings) as db:
        text = build(db).explain(stage=stage) + "\n"
    path = GOLDEN / f"{query}.{stage}.txt"
    if request.config.getoption("--update-golden"):
        path.write_text(text)
    assert path.exists(), f"no golden file {path.name}; run with --update-golden"
    assert text == path.read_text()


def test_unknown_stage_lists_the_stages(db):
    a = db.from_numpy("a", np.ones((2, 2), np.float32))
    with pytest.raises(tq.OptionError, match="einsum, logical, partition, physical, memory"):
        a.explain(stage="optimizer")
