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
    ("errors", "devices", "options", "units", "dtypes", "grid", "dag", "algebra",
     "cuda_api"),
    ("einsum",),
    ("logical",),
    ("storage",),
    ("optimizer",),
    ("exec",),
    ("physical",),
    ("backend",),
    ("pipeline",),  # a package: compile, planning, backends, distributed, stages
    ("sql",),
    ("api",),
    ("models",),
    ("demo", "distributed_demo", "train_demo", "cli", "optim", "__main__", "__init__"),
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


def _code_of(path: pathlib.Path) -> str:
    """``path``'s source without its docstrings and comments (the code that runs)."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                and isinstance(first.value.value, str):
            body[0] = ast.Pass()
    return ast.unparse(tree)


def test_devices_parsed_once():
    """The ``devices`` option is read in one module (tensorql/devices.py, the DeviceSet);
    everything else asks the set, never a device name as a string."""
    found = []
    for unit, path in _sources():
        if path == ROOT / "tensorql" / "devices.py":
            continue
        code = _code_of(path)
        for needle in ("device_names(", "startswith('null", "startswith('cpu",
                       "startswith('cuda", "DeviceSet.parse("):
            if needle in code and not (needle == "DeviceSet.parse(" and unit in ("options",
                                                                               "exec")):
                found.append(f"{path.relative_to(ROOT)}: {needle}")
    assert not found, "\n".join(found)


# the strategies' run entries: only the engine (tensorql/exec/engine.py) calls them, apart from
# the one way each strategy's own module builds its run state
_STRATEGY_ENTRIES = {"Runtime", "Executor", "Lanes", "DistributedRuntime", "run_serial",
                     "run_streams", "StreamRun", "executor_for"}
_ALLOWED = {("exec/runtime.py", "StreamRun"), ("exec/distributed.py", "run_streams"),
            ("exec/distributed.py", "Runtime")}


def _calls(path: pathlib.Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else \
                func.attr if isinstance(func, ast.Attribute) else None
            if name is not None:
                out.append((node.lineno, name))
    return out


def test_one_engine_entry_point():
    """Every run goes through ``tensorql.exec.engine.run``: no module but the engine starts
    a strategy (builds a runtime, an executor, the lanes, a rank's runtime, calls the serial
    loop), and the pipeline calls the engine from one module (tensorql/pipeline/run.py)."""
    found = []
    for unit, path in _sources():
        rel = path.relative_to(ROOT / "tensorql").as_posix() if unit != "tensorql_kernels" \
            else path.name
        source = path.read_text()
        for line, name in _calls(path):
            if name in _STRATEGY_ENTRIES and rel != "exec/engine.py" \
                    and (rel, name) not in _ALLOWED:
                found.append(f"{rel}:{line} calls {name}")
        if unit not in ("exec",) and rel != "pipeline/run.py" and \
                ("engine.run(" in source or "from tensorql.exec.engine import run" in source):
            found.append(f"{rel} runs the engine (only pipeline/run.py does)")
    assert not found, "\n".join(found)


def test_one_module_builds_physical_tasks():
    """Physical tasks are made in one place, the one builder (``tensorql/physical/builder.py``):
    one device and many are the same code path's two inputs, not two planners."""
    makers = set()
    for _, path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if name == "Task":
                    makers.add(str(path.relative_to(ROOT)))
    assert makers == {"tensorql/physical/builder.py"}
