"""Every fenced example in README.md and docs/ runs as written (issue 16, bug 5).

Blocks tagged ``python`` run in order in one namespace per file, ``sql`` blocks run as one
script each on a fresh in-memory database, ``sh`` blocks run under bash (``tensorql`` from this
environment on PATH) in a fresh directory — except ``make ...`` lines, which are the Makefile's
own targets (CI runs them). Untagged blocks and ``text`` blocks are diagrams or syntax
summaries, not examples.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import tensorql as tq

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(path: pathlib.Path) -> list[tuple[str, str, int]]:
    text = path.read_text()
    return [(m.group(1), m.group(2), text[:m.start()].count("\n") + 1)
            for m in FENCE.finditer(text)]


def test_every_fenced_block_has_a_known_kind():
    for path in DOCS:
        for lang, _, line in blocks(path):
            assert lang in ("", "text", "python", "sql", "sh"), f"{path.name}:{line} {lang}"


def _ids(kind):
    return [p.name for p in DOCS if any(lang == kind for lang, _, _ in blocks(p))]


@pytest.mark.parametrize("name", _ids("python"))
def test_python_examples_run(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for lang, code, line in blocks(ROOT / name if name == "README.md" else ROOT / "docs" / name):
        if lang != "python":
            continue
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, f"{name}:{line}", "exec"), namespace)  # noqa: S102


STANDALONE = ["training.md"]  # pages whose examples are copied one at a time


@pytest.mark.parametrize("name", STANDALONE)
def test_each_python_example_runs_alone(name, tmp_path, monkeypatch):
    """Each example of these pages runs in a fresh namespace (a reader copies one block)."""
    monkeypatch.chdir(tmp_path)
    for lang, code, line in blocks(ROOT / "docs" / name):
        if lang == "python":
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(code, f"{name}:{line}", "exec"), {"__name__": "__docs__"})  # noqa: S102


@pytest.mark.parametrize("name", _ids("sql"))
def test_sql_examples_run(name):
    path = ROOT / name if name == "README.md" else ROOT / "docs" / name
    for lang, code, line in blocks(path):
        if lang == "sql":
            with tq.connect(workers=2) as db:
                try:
                    db.sql(code)
                except tq.TensorQLError as err:
                    raise AssertionError(f"{name}:{line}: {err}") from None


@pytest.mark.parametrize("name", _ids("sh"))
def test_shell_examples_run(name, tmp_path):
    path = ROOT / name if name == "README.md" else ROOT / "docs" / name
    env = dict(os.environ, PATH=f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}")
    if shutil.which("tensorql", path=env["PATH"]) is None:  # a checkout not pip-installed
        bin_dir = tmp_path / "bin"  # (the GPU machine's image): the command as python -m
        bin_dir.mkdir()
        shim = bin_dir / "tensorql"
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tensorql "$@"\n')
        shim.chmod(0o755)
        env["PATH"] = f"{bin_dir}:{env['PATH']}"
    for lang, code, line in blocks(path):
        if lang != "sh":
            continue
        script = "\n".join(x for x in code.splitlines() if not x.startswith("make "))
        if not script.strip():
            continue
        done = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{name}:{line}\n{done.stdout}\n{done.stderr}"
