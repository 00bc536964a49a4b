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
    assert out.splitlines()[1].split() == ["│", "i", "│", "val", "│"] and "12" in out
    assert main(["sql", "SELECT * FROM EINSUM('ij->ij', A)", "--db", path,
                 "--max-rows", "3"]) == 0
    out = capsys.readouterr().out
    assert "6 rows (3 shown)" in out and len([x for x in out.splitlines() if "│" in x]) == 5
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


def test_explain_file_explains_every_statement_and_runs_none(tmp_path, capsys):
    path = str(tmp_path / "work.duckdb")
    with tq.connect(path) as db:
        db.from_numpy("A", np.ones((2, 3), np.float32))
    script = tmp_path / "s.sql"
    script.write_text("SELECT * FROM EINSUM('ij->i', A);\nCREATE TABLE made (x INT);\n"
                      "CREATE TENSOR T AS SELECT * FROM EINSUM('ij->j', A);\n")
    assert main(["explain", "--file", str(script), "--db", path]) == 0
    out = capsys.readouterr().out
    assert out.count("EXPLAIN") >= 1 and "Scan A" in out and "Create Table" in out
    with tq.connect(path) as db:
        assert db.tensors() == ["A"]
        assert not db.connection.sql("SELECT * FROM duckdb_tables() "
                                     "WHERE table_name = 'made'").fetchall()


def test_user_errors_exit_without_traceback(tmp_path, capsys):
    missing = tmp_path / "missing.sql"
    assert main(["sql", "--file", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "cannot read --file" in err and "No such file" in err and "Traceback" not in err
    fresh = tmp_path / "fresh.duckdb"
    assert main(["sql", "SELECT * FROM EINSUM('ij->i', A)", "--db", str(fresh)]) == 1
    assert "unknown tensor 'A'" in capsys.readouterr().err
    assert not fresh.exists()  # a failed command leaves no new database file
    assert main(["sql", "SELECT 1", "--max-rows", "-1"]) == 2
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("tensorql ")


def test_every_option_has_help_text(capsys):
    from tensorql.cli import _parser

    for action in _parser()._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, action.dest
    for command in ("sql", "explain"):
        assert main([command, "--help"]) == 0
        text = capsys.readouterr().out
        assert "--max-rows N" in text and "--backend" in text
    assert main(["demo", "--help"]) == 0  # the demo's own parser answers
    text = capsys.readouterr().out
    assert "checked against plain torch." in text and "hidden width" in text


def test_max_rows_limits_the_rows_printed(capsys):
    assert main(["sql", "SELECT range AS i FROM range(100)", "--max-rows", "5"]) == 0
    out = capsys.readouterr().out
    assert "100 rows (5 shown)" in out and "│     4 │" in out and "│     5 │" not in out
