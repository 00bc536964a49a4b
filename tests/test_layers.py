"""Lower layers never import upper ones (checked on the source, lazy imports included).

The SQL face sits below the Python API: ``tensorql/sql`` builds einsum-graph nodes and runs them
through ``tensorql.pipeline``; ``Database.sql`` (api) calls into it. Everything imports strictly
downwards.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# bottom to top; units in one tuple are one layer
LAYERS: list[tuple[str, ...]] = [
    ("tensorql_kernels",),
    ("errors", "options", "units", "dtypes", "grid", "dag", "algebra"),
    ("einsum",),
    ("logical",),
    ("storage",),
    ("optimizer",),
    ("exec",),
    ("physical",),
    ("backend",),
    ("pipeline",),
    ("sql",),
    ("api",),
    ("models",),
    ("demo", "distributed_demo", "train_demo", "cli", "__init__"),
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def _unit_of_module(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "tensorql_kernels":
        return "tensorql_kernels"
    if parts[0] != "tensorql":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return found


def _sources() -> list[tuple[str, pathlib.Path]]:
    out = []
    for path in sorted((ROOT / "tensorql").rglob("*.py")):
        rel = path.relative_to(ROOT / "tensorql").parts
        out.append((rel[0] if len(rel) > 1 else rel[0].removesuffix(".py"), path))
    out += [("tensorql_kernels", p) for p in sorted((ROOT / "kernels").rglob("*.py"))]
    return out


def test_every_unit_has_a_layer():
    assert {unit for unit, _ in _sources()} <= set(RANK)


def test_no_upward_imports():
    upward = []
    for unit, path in _sources():
        for line, module in _imports(path):
            target = _unit_of_module(module)
            if target is not None and target != unit and RANK[target] > RANK[unit]:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({unit}) imports {module}")
    assert not upward, "\n".join(upward)
