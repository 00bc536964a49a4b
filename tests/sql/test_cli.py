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


# -- the shell (tensorql [DATABASE] [-c SQL] [--mode MODE]) ------------------------------
def test_c_prints_every_statement_in_a_box_with_duckdb_types(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    path = str(tmp_path / "work.duckdb")
    with tq.connect(path) as db:
        db.from_numpy("A", np.arange(6, dtype=np.float32).reshape(2, 3))
    script = ("CREATE TABLE t(i INT, s VARCHAR, b BLOB, d DOUBLE, f FLOAT);\n"
              "INSERT INTO t VALUES (1, repeat('xy', 30), '\\xAA\\xBBabc'::BLOB, 1.5, 0.1),"
              " (2, NULL, NULL, NULL, NULL);\n"
              "SELECT * FROM t; SELECT * FROM EINSUM('ij->i', A);\n"
              "CREATE TENSOR S AS SELECT * FROM EINSUM('ij->j', A); DROP TABLE t")
    assert main([path, "-c", script]) == 0
    assert capsys.readouterr().out == (
        "┌─────────┬─────────────────┬─────────────┬────────┬───────┐\n"
        "│    i    │        s        │      b      │   d    │   f   │\n"
        "│ INTEGER │     VARCHAR     │     BLOB    │ DOUBLE │ FLOAT │\n"
        "├─────────┼─────────────────┼─────────────┼────────┼───────┤\n"
        "│       1 │ xyxyxyxyxyxyxy… │ \\xAA\\xBBabc │    1.5 │   0.1 │\n"
        "│       2 │ NULL            │ NULL        │   NULL │  NULL │\n"
        "└─────────┴─────────────────┴─────────────┴────────┴───────┘\n"
        "┌────────┬───────┐\n"
        "│   i    │  val  │\n"
        "│ BIGINT │ FLOAT │\n"
        "├────────┼───────┤\n"
        "│      0 │   3.0 │\n"
        "│      1 │  12.0 │\n"
        "└────────┴───────┘\n")  # CREATE, INSERT, CREATE TENSOR and DROP print nothing
    with tq.connect(path) as db:
        assert "S" in db.tensors()


def test_box_is_cut_to_the_terminal_width(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "50")
    columns = ", ".join(f"range + {k} AS column_{k}" for k in range(20))
    assert main(["-c", f"SELECT {columns} FROM range(100)", "--max-rows", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 50 for line in lines)
    assert lines[1].split("│")[1].strip() == "column_0" and "column_19" in lines[1]
    assert "│ … │" in lines[1] and lines[-1] == "  100 rows (3 shown)  20 columns (3 shown)"
    assert len(lines) == 9  # top, names, types, rule, 3 rows, bottom, footer
    monkeypatch.setenv("COLUMNS", "300")
    assert main(["-c", f"SELECT {columns} FROM range(2)"]) == 0
    assert "column_10" in capsys.readouterr().out  # wide enough: every column


def test_output_modes(capsys):
    query = "SELECT range::INT AS i, 'a,' || range AS s, NULL AS n FROM range(2)"
    expected = {
        "csv": 'i,s,n\n0,"a,0",\n1,"a,1",\n',
        "json": '[{"i":0,"s":"a,0","n":null},\n{"i":1,"s":"a,1","n":null}]\n',
        "markdown": "|  i  |  s  |  n   |\n|----:|-----|------|\n|   0 | a,0 | NULL |\n"
                    "|   1 | a,1 | NULL |\n",
        "line": "i = 0\ns = a,0\nn = NULL\n\ni = 1\ns = a,1\nn = NULL\n",
    }
    for mode, text in expected.items():
        assert main(["-c", query, "--mode", mode]) == 0
        assert capsys.readouterr().out == text, mode
    from tensorql.cli import MODES
    from tensorql.sql.render import MODES as RENDERERS

    assert set(MODES) == set(RENDERERS)


def test_script_on_stdin_with_dot_commands_stops_at_an_error(tmp_path, capsys, monkeypatch):
    fresh = tmp_path / "fresh.duckdb"
    monkeypatch.setattr("sys.stdin", io.StringIO(
        "CREATE TABLE t AS SELECT 1 AS x;\n.tables\n.mode csv\nSELECT x,\n  x + 1 AS y\n"
        "FROM t;\nSELECT nope;\nSELECT 3 AS never;\n"))
    assert main([str(fresh)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "t\nx,y\n1,2\n" and "never" not in captured.out
    assert '"nope" was not found' in captured.err and "Traceback" not in captured.err
    assert not fresh.exists()  # a failed script leaves no new database file
    monkeypatch.setattr("sys.stdin", io.StringIO("SELECT 7 AS seven\n"))  # no final ';'
    assert main(["--mode", "csv"]) == 0
    assert capsys.readouterr().out == "seven\n7\n"
    assert main(["-c", ".mode nope"]) == 1
    assert "unknown mode 'nope'" in capsys.readouterr().err


def test_statement_complete_ignores_semicolons_in_quotes_and_comments():
    from tensorql.cli import statement_complete

    assert statement_complete("SELECT 1;") and statement_complete("SELECT 1;\n-- end\n")
    assert not statement_complete("SELECT ';'") and not statement_complete("SELECT 1; /* ;")
    assert not statement_complete('SELECT 1 AS "a;b"') and statement_complete("SELECT 1 /* ; */;")


def _run_python(code: str) -> str:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    return done.stdout


def test_version_and_help_import_neither_torch_nor_duckdb():
    out = _run_python(
        "import sys, tensorql.cli\n"
        "assert tensorql.cli.main(['--version']) == 0\n"
        "assert tensorql.cli.main(['--help']) == 0\n"
        "heavy = {'torch', 'duckdb', 'pyarrow', 'numpy'} & set(sys.modules)\n"
        "assert not heavy, heavy\n")
    assert out.startswith("tensorql ") and "-c SQL" in out and "train-demo" in out


def test_interactive_shell_in_a_pseudo_terminal(tmp_path):
    import os
    import pty
    import select
    import subprocess
    import sys
    import time

    main_fd, child_fd = pty.openpty()
    env = {**os.environ, "HOME": str(tmp_path), "COLUMNS": "80", "TERM": "dumb"}
    proc = subprocess.Popen([sys.executable, "-m", "tensorql.cli", str(tmp_path / "w.duckdb")],
                            stdin=child_fd, stdout=child_fd, stderr=child_fd, env=env,
                            close_fds=True)
    os.close(child_fd)
    seen = b""

    def expect(marker: str, timeout: float = 60.0) -> str:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while marker.encode() not in seen:
            left = deadline - time.monotonic()
            assert left > 0, f"no {marker!r} in {seen.decode(errors='replace')!r}"
            if select.select([main_fd], [], [], left)[0]:
                try:
                    seen += os.read(main_fd, 4096)
                except OSError:  # the child closed the terminal
                    break
        assert marker.encode() in seen, seen
        text, _, rest = seen.decode().partition(marker)
        seen = rest.encode()
        return text

    try:
        expect("D ")  # the prompt
        os.write(main_fd, b"SELECT 40\n")
        expect("· ")  # a statement goes on until ';'
        os.write(main_fd, b"  + 2 AS answer;\n")
        expect("│      42 │")
        os.write(main_fd, b".mode line\nSELECT 'x' AS letter;\n")
        expect("letter = x")
        os.write(main_fd, b"SELECT nope;\n")  # an error: reported, the shell goes on
        expect("not found")
        os.write(main_fd, b"CREATE TABLE t AS SELECT 1 AS x;\n.tables\n")
        expect("\nt\r\n")
        os.write(main_fd, b".quit\n")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(main_fd)
    assert (tmp_path / ".tensorql_history").exists()


def test_explain_formats_draw_each_einsum_plan(tmp_path, capsys):
    """``tensorql explain --format json|dot|mermaid``: each EINSUM's plan as the tensor's
    ``explain(format=...)`` draws it; DuckDB's part of a statement as its EXPLAIN text."""
    import json
    import re

    path = str(tmp_path / "work.duckdb")
    with tq.connect(path) as db:
        a = db.from_numpy("A", np.arange(24, dtype=np.float32).reshape(4, 6), tile=(2, 3))
        expected = json.loads(tq.einsum("ij->i", a).explain(format="json"))
    script = ("SELECT * FROM EINSUM('ij->i', A);\n"
              "SELECT count(*) AS n FROM EINSUM('ij,kj->ik', A, A) WHERE val > 0;\n"
              "SELECT 1 AS one")
    assert main(["explain", "--format", "json", script, "--db", path]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "tensorql.explain/1" and len(doc["statements"]) == 3
    first, second, third = doc["statements"]
    assert first["sql"] == "SELECT * FROM EINSUM('ij->i', A)" and first["duckdb"] == []
    [plan] = first["einsum"]
    assert plan["call"].startswith("EINSUM('ij->i', A)")
    for key in ("schema", "stage", "nodes", "edges", "outputs"):
        assert plan["plan"][key] == expected[key]
    assert len(second["einsum"]) == 1 and len(second["duckdb"]) == 1
    assert "WHERE val > 0" in second["duckdb"][0]["sql"]
    assert second["einsum"][0]["plan"]["nodes"][0]["name"] == "Scan A"
    assert third["einsum"] == [] and third["duckdb"][0]["sql"] == "SELECT 1 AS one"
    assert "PROJECTION" in third["duckdb"][0]["plan"].upper()

    assert main(["explain", "--format", "dot", script, "--db", path]) == 0
    dot = capsys.readouterr().out
    assert dot.count('digraph "tensorql physical plan" {') == 2
    assert all(line.startswith(("//", "digraph", "  ", "}")) for line in dot.splitlines()
               if line), dot  # DuckDB's plans are comment lines: the text stays DOT
    assert re.search(r"^  s\d+ -> s\d+;$", dot, re.M)

    assert main(["explain", "--format", "mermaid", "SELECT * FROM EINSUM('ij->i', A)",
                 "--db", path, "--analyze"]) == 0
    mermaid = capsys.readouterr().out
    lines = mermaid.splitlines()
    assert lines[:2] == ["%% SELECT * FROM EINSUM('ij->i', A)",
                         "%% EINSUM('ij->i', A) -> (i, val)"]
    assert lines[2] == "flowchart BT" and "s0 --> s1" in mermaid

    assert main(["explain", "--format", "svg", "SELECT 1", "--db", path]) == 2
    assert "invalid choice: 'svg'" in capsys.readouterr().err


def test_a_file_that_is_not_utf8_and_a_huge_max_rows_are_no_tracebacks(tmp_path, capsys):
    """Found by fuzzing (s9): --file of bytes that are not UTF-8 raised UnicodeDecodeError,
    --max-rows 99999999999999999999 pyarrow's OverflowError (it now shows every row)."""
    script = tmp_path / "bin.sql"
    script.write_bytes(b"SELECT 1;\n\xff\xfeSELECT 2;\n")
    assert main(["sql", "--file", str(script)]) == 2
    err = capsys.readouterr().err
    assert "not UTF-8 text (byte 10)" in err and "Traceback" not in err
    for argv in (["-c", "SELECT 1 AS x"], ["sql", "SELECT 1 AS x"]):
        assert main([*argv, "--max-rows", "99999999999999999999"]) == 0
        out = capsys.readouterr().out
        assert "│ x " in out or "x" in out.splitlines()[1]


def test_shell_survives_an_aborted_transaction_and_reads_dollar_quotes(capsys):
    """``.tables`` in a transaction an error aborted is an error line, not a traceback; a
    ``;`` inside a ``$$`` string does not end the statement."""
    from tensorql.cli import Shell

    with tq.connect() as db:
        out = io.StringIO()
        shell = Shell(db, out=out, interactive=True)
        for line in ("CREATE TABLE t (x INT);", "BEGIN;", "INSERT INTO t VALUES ('zz');",
                     ".tables", "ROLLBACK;", ".tables", "SELECT $$a;", "b$$ AS s;"):
            shell.feed(line)
        assert "Current transaction is aborted" in capsys.readouterr().err
        lines = out.getvalue().splitlines()
        assert "t" in lines and any("a;\\nb" in line for line in lines)


def test_a_mistyped_command_is_not_a_new_database_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["demoo", "-c", "SELECT 1"]) == 2
    assert "did you mean demo?" in capsys.readouterr().err
    assert not (tmp_path / "demoo").exists()
    assert main(["./demoo", "-c", "SELECT 1"]) == 0  # asked for by a path: created
    assert (tmp_path / "demoo").exists()
