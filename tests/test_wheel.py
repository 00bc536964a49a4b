"""The wheel: built from the source tree and installed into a fresh virtual environment, it
gives a working ``tensorql`` command (issue 32).

The wheel is built without build isolation (the running environment's setuptools; no
network) from a copy of the packaged files, so nothing is written into the checkout. The
fresh venv gets only the wheel (``--no-deps``); its dependencies (torch, DuckDB, ...) come
from the running environment's site-packages through a ``.pth`` line, which adds the
directory without running that environment's own ``.pth`` hooks (an editable install of
tensorql there stays out): the test checks that the command imports the installed copy.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(args: list, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env,
                          timeout=300, **kwargs)
    assert done.returncode == 0, f"{args}\n{done.stdout}\n{done.stderr}"
    return done


def test_wheel_installs_a_working_command(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("tensorql", "kernels", "sql"):
        shutil.copytree(ROOT / package, src / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--no-build-isolation",
          "--no-index", "-q", "-w", dist], cwd=tmp_path)
    wheels = sorted(dist.glob("tensorql-*.whl"))
    assert len(wheels) == 1 and wheels[0].name.endswith("-py3-none-any.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", venv])
    python = venv / "bin" / "python"
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
                   ).stdout.strip()
    deps = sysconfig.get_paths()["purelib"]  # torch, duckdb, ... of the running environment
    (pathlib.Path(purelib) / "tensorql_test_deps.pth").write_text(deps + "\n")
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheels[0]])

    where = _run([python, "-c", "import tensorql, tensorql_kernels; "
                  "print(tensorql.__file__); print(tensorql_kernels.__file__)"],
                 cwd=tmp_path).stdout.split()
    assert all(path.startswith(purelib) for path in where), where
    command = venv / "bin" / "tensorql"
    assert _run([command, "--version"], cwd=tmp_path).stdout == "tensorql 0.1.0\n"
    script = ("CREATE TENSOR v AS SELECT range AS i, range::FLOAT AS val FROM range(4);"
              "SELECT * FROM EINSUM('i->', v); SELECT 40 + 2 AS answer")
    out = _run([command, "work.duckdb", "-c", script, "--mode", "csv"], cwd=tmp_path).stdout
    assert out == "val\n6.0\nanswer\n42\n"
