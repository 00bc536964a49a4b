"""The ``tensorql sql`` / ``tensorql explain`` commands on a database file."""

from __future__ import annotations

import io

import numpy as np

import tensorql as tq
from tensorql.cli import main


def test_sql_and_explain_commands(tmp_path, capsys, monkeypatch):
    path = str(tmp_path / "work.duckdb")
    with tq.connect(path) as db:
        db.from_numpy("A", np.arange(6, dtype=np.float32).reshape(2, 3))
    assert main(["sql", "SELECT * FROM EINSUM('ij->i', A)", "--db", path]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["i", "|", "val"] and "12" in out
    assert main(["sql", "SELECT * FROM EINSUM('ij->ij', A)", "--db", path,
                 "--max-rows", "3"]) == 0
    assert "shape (2, 3) float32" in capsys.readouterr().out
    assert main(["explain", "SELECT * FROM EINSUM('ij->i', A)", "--db", path,
                 "--analyze"]) == 0
    assert "measured: wall" in capsys.readouterr().out
    script = tmp_path / "s.sql"
    script.write_text("CREATE TENSOR S AS SELECT * FROM EINSUM('ij->j', A);\n"
                      "SELECT * FROM EINSUM('j->', S);\n")
    assert main(["sql", "--file", str(script), "--db", path]) == 0
    assert "15" in capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO("DROP TENSOR S"))
    assert main(["sql", "-", "--db", path]) == 0
    assert "DROP TENSOR S" in capsys.readouterr().out
    assert main(["sql", "SELECT * FROM EINSUM('ij->i', nope)", "--db", path]) == 1
    err = capsys.readouterr().err
    assert "unknown tensor 'nope'" in err and "line 1, column 31" in err


def test_progress_bar_on_stderr_when_asked(tmp_path, capsys):
    path = str(tmp_path / "work.duckdb")
    with tq.connect(path) as db:
        db.from_numpy("A", np.ones((64, 64), np.float32), tile=(16, 16))
    query = "SELECT sum(val) AS s FROM EINSUM('ij,jk->ik', A, A)"
    assert main(["sql", query, "--db", path, "--progress"]) == 0
    captured = capsys.readouterr()
    assert "262144" in captured.out
    # the plain bar says "(100%)", tqdm's (installed with transformers) "100%|"
    assert "einsum ij,jk->ik" in captured.err and "100%" in captured.err
    assert main(["sql", query, "--db", path, "--no-progress"]) == 0
    assert "tasks" not in capsys.readouterr().err


def test_progress_option_draws_a_bar_from_python(capsys):
    with tq.connect(progress=True) as db:
        a = db.from_numpy("A", np.ones((32, 32), np.float32), tile=(8, 8))
        assert float((a @ a).numpy().sum()) == 32.0 ** 3
    assert "/" in capsys.readouterr().err
