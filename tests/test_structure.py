"""Structure checks on the source: the algebra registry is the one place operator names live.

Every join and aggregation is a record of ``tensorql_kernels.algebra`` (re-exported by
``tensorql.algebra``); a module that needs one refers to it through ``JoinName`` / ``AggName``
or reads its record -- it never spells the name as a string, so a name (or a new operator)
is added, changed or removed in one place. Docstrings (and the doctests in them) and
``__all__`` entries (Python identifiers, not operator names) are not scanned.
"""

from __future__ import annotations

import ast
import pathlib
from collections import Counter

import pytest
from tensorql_kernels.algebra import BUILTIN_AGGS, BUILTIN_JOINS

ROOT = pathlib.Path(__file__).resolve().parents[1]
REGISTRY = ("kernels/algebra.py",)

# String literals equal to an operator name that are NOT operator names, with how often each
# file may spell them (so a new operator-name literal in the same file still fails).
ALLOWED: dict[tuple[str, str], int] = {
    ("kernels/elementwise.py", "pow"): 1,   # the map x ** c (tensorql_kernels.elementwise)
    ("tensorql/api/tensor.py", "pow"): 1,   # the same map, for a scalar exponent
    ("tensorql/api/autodiff.py", "pow"): 2,  # its derivative (the map again)
    ("tensorql/api/optim.py", "adam"): 1,   # Adam's default name (prefix of its state)
    ("tensorql/api/optim.py", "adamw"): 1,  # AdamW's likewise
    ("tensorql/__init__.py", "where"): 1,   # tq.where, a public name imported on first use
}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _all_entries(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                found |= {id(c) for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
    return found


def operator_literals(path: pathlib.Path, names: set[str]) -> list[tuple[int, str]]:
    """``(line, literal)`` of every string constant in ``path`` equal to one of ``names``,
    docstrings and ``__all__`` entries left out."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _docstrings(tree) | _all_entries(tree)
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value in names and id(node) not in skip]


def _sources() -> list[pathlib.Path]:
    paths = sorted((ROOT / "tensorql").rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py"))
    return [p for p in paths if str(p.relative_to(ROOT)) not in REGISTRY]


def test_no_module_outside_the_registry_spells_an_operator_name():
    names = set(BUILTIN_JOINS) | set(BUILTIN_AGGS)
    wrong = []
    for path in _sources():
        rel = str(path.relative_to(ROOT))
        found = operator_literals(path, names)
        counts = Counter(value for _, value in found)
        for line, value in found:
            if counts[value] > ALLOWED.get((rel, value), 0):
                wrong.append(f"{rel}:{line} spells {value!r}")
    assert not wrong, ("use tensorql.algebra's JoinName / AggName (or the record) instead:\n"
                       + "\n".join(wrong))


def test_the_allow_list_is_not_stale():
    names = set(BUILTIN_JOINS) | set(BUILTIN_AGGS)
    for (rel, value), count in ALLOWED.items():
        found = [v for _, v in operator_literals(ROOT / rel, names) if v == value]
        assert len(found) == count, f"{rel}: {value!r} spelt {len(found)} times, allowed {count}"


def test_the_scan_sees_operator_names(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('"""A docstring naming sum."""\n__all__ = ["where"]\n'
                     'x = f(join="mul")\n')
    assert operator_literals(probe, {"sum", "mul", "where"}) == [(3, "mul")]


@pytest.mark.parametrize("devices, most", [("cpu", 16), (2, 20)])
def test_a_query_passes_each_stage_once(devices, most):
    """``tq.einsum("ij,jk->ik", A, B).numpy()`` -- docs/architecture.md's hand trace --
    enters each stage once: lowering, the rewrite rules, the one builder and the engine each
    run once, and the modules it passes through (leaf records and helpers aside, see
    tests/stage_trace.py) are at most ``most + 1``: under 17 hops on one device, under 21 on
    two (the partition stage is added; the session's query cache, looked up before a query
    is compiled, is one hop of each). The query here runs a plan the cache had (the same
    query over another stored tensor, after a warm-up): on one device its second run is
    lowered into the engine's tape (``exec/tape.py``, in the serial order), one hop more
    than a first run's 15."""
    import numpy as np
    from stage_trace import ENTRIES, stage_modules

    import tensorql as tq

    with tq.connect(devices=devices) as db:
        a = db.from_numpy("A", np.ones((64, 32), np.float32))
        b = db.from_numpy("B", np.ones((32, 16), np.float32))
        tq.einsum("ij,jk->ik", a, b).numpy()  # imports and caches warm
        c = db.from_numpy("C", np.full((64, 32), 2.0, np.float32))
        out: list = []
        order, calls = stage_modules(lambda: out.append(tq.einsum("ij,jk->ik", c, b).numpy()))
    np.testing.assert_allclose(out[0], np.full((64, 16), 64.0))
    assert calls == {entry: 1 for entry in ENTRIES}, calls
    assert len(order) - 1 <= most, order
    assert ("optimizer" in order) == (devices != "cpu")
