"""The ``tensorql`` command: a shell like DuckDB's, SQL with EINSUM, EXPLAIN, the demos.

    tensorql [work.duckdb]                                # an interactive shell on a terminal
    tensorql work.duckdb -c "SELECT * FROM EINSUM('ij,jk->ik', A, B)" [--mode csv]
    tensorql work.duckdb < script.sql                     # stdin not a terminal: run it
    tensorql sql "SELECT * FROM EINSUM('ij,jk->ik', A, B)" --db work.duckdb
    tensorql sql --file script.sql --db work.duckdb      # or: ... | tensorql sql -
    tensorql explain "SELECT * FROM EINSUM('ij,jk->ik', A, B)" --db work.duckdb [--analyze]
    tensorql explain --format json|dot|mermaid "SELECT ..." --db work.duckdb  # as graphs
    tensorql demo [--help]
    tensorql distributed-demo [--ranks K] [--help]
    tensorql train-demo [--steps N] [--db FILE] [--help]
    tensorql --version

The shell (and ``-c``, and a script on stdin) prints every statement's result in the output
mode (``--mode`` or ``.mode``: box, csv, json, markdown, line; see ``tensorql.sql.render``):
a box is cut to the terminal's width (``COLUMNS``), long values and BLOBs elided with "…",
its columns headed by DuckDB's type names; a statement that changes things (CREATE, INSERT,
DROP, ...) prints nothing, as in DuckDB's shell. Statements end with ``;`` and may span
lines; dot commands: ``.help``, ``.mode [MODE]``, ``.tables``, ``.quit`` / ``.exit``. The
interactive shell keeps a ``readline`` history in ``~/.tensorql_history``.

``tensorql sql`` prints the last statement's result as a box of rows, at most ``--max-rows``
of them with a footer counting the rest. Exit status: 0 on success, 1 when a statement fails
(the error is printed, no traceback; a script from ``-c`` or stdin stops there), 2 for bad
command-line usage or an unreadable ``--file``. A database file that did not exist before a
failed command is not left behind. ``--version`` and ``--help`` import neither torch nor
DuckDB (``import tensorql`` loads its modules on first use), so they answer at once.

>>> main(["sql", "SELECT 40 + 2 AS answer"])
┌────────┐
│ answer │
│ int32  │
├────────┤
│     42 │
└────────┘
0
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from tensorql.errors import TensorQLError

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


class _UsageError(Exception):
    """A problem with the command line itself (exit status 2)."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tensorql")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "unknown"


def _read_query(args: argparse.Namespace) -> str:
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as fh:
                return fh.read()
        except OSError as err:
            raise _UsageError(f"cannot read --file {args.file}: {err.strerror}") from None
        except UnicodeDecodeError as err:
            raise _UsageError(f"cannot read --file {args.file}: not UTF-8 text (byte "
                              f"{err.start})") from None
    if args.query in (None, "-"):
        try:
            return sys.stdin.read()
        except UnicodeDecodeError as err:
            raise _UsageError(f"cannot read the SQL from stdin: not UTF-8 text ({err.reason} "
                              f"at byte {err.start})") from None
    return args.query


def _connect(args: argparse.Namespace):
    import tensorql as tq

    settings = {"backend": args.backend} if getattr(args, "backend", None) else {}
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    settings["progress"] = progress
    return tq.connect(args.db, **settings)


def _cmd_sql(args: argparse.Namespace, explain: bool = False) -> int:
    script = _read_query(args)
    with _connect(args) as db:
        if explain and args.format != "text":
            from tensorql.sql.statements import explain_graphs

            print(explain_graphs(db, script, args.format, analyze=args.analyze))
        elif explain:
            from tensorql.sql.session import explain_each

            results = explain_each(db, script, analyze=args.analyze)
            print("\n\n".join(r.render(args.max_rows) for r in results))
        else:
            print(db.sql(script).render(args.max_rows))
    return EXIT_OK


def _cmd_demo(rest: list[str]) -> int:
    try:
        from tensorql import demo  # type: ignore[attr-defined]
    except ImportError:
        print("tensorql demo is not available in this build", file=sys.stderr)
        return EXIT_ERROR
    try:
        return int(demo.main(rest) or 0)
    except SystemExit as done:  # its --help and usage errors
        return int(done.code or 0)
    except TensorQLError as err:  # a database it cannot open, ...: one line, as sql's
        print(f"error: {err}", file=sys.stderr)
        return EXIT_ERROR


MAX_ROWS_CAP = 2**62  # a larger --max-rows shows every row as well (and fits a C long)


def _max_rows(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return min(value, MAX_ROWS_CAP)


def _parser() -> argparse.ArgumentParser:
    from tensorql.pipeline import BACKENDS

    ap = argparse.ArgumentParser(prog="tensorql", description="A relational query engine over "
                                 "tensor blocks: SQL (DuckDB's dialect) with EINSUM.")
    ap.add_argument("--version", action="version", version=f"tensorql {_version()}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in ("sql", "explain"):
        help_text = COMMANDS[name]
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("query", nargs="?", help="the SQL text; '-' or nothing reads stdin")
        p.add_argument("--file", "-f", help="read the statements from this file")
        p.add_argument("--db", default=None,
                       help="DuckDB database file, created if missing (default: in memory)")
        p.add_argument("--backend", choices=sorted(BACKENDS), default=None,
                       help="execution backend for EINSUM (default: native)")
        p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="draw a progress bar on stderr while tensor queries run "
                            "(default: when stderr is a terminal)")
        p.add_argument("--max-rows", type=_max_rows, default=40, metavar="N",
                       help="print at most N rows of a result (default: 40)")
        if name == "explain":
            p.add_argument("--analyze", action="store_true",
                           help="run the statements and add measured times and bytes")
            p.add_argument("--format", choices=EXPLAIN_FORMATS, default="text",
                           help="text (default), or each EINSUM's plan as a graph: json "
                                "(one document, schema tensorql.explain/1), dot (Graphviz) "
                                "or mermaid")
    for name in ("demo", "distributed-demo", "train-demo"):
        sub.add_parser(name, help=COMMANDS[name], add_help=False)
    return ap


# -- the shell ---------------------------------------------------------------------------
EXPLAIN_FORMATS = ("text", "json", "dot", "mermaid")  # text and tensorql.physical.plan_graph's
# FORMATS (not imported: --help must start at once)
MODES = ("box", "csv", "json", "markdown", "line")  # tensorql.sql.render.MODES (not imported:
# it needs pyarrow, and --help must start at once)
COMMANDS = {
    "sql": "run SQL statements and print the last one's result",
    "explain": "EXPLAIN every statement (none of them runs, except what --analyze measures)",
    "demo": "run the demo workload and check it against torch (its --help lists its options)",
    "distributed-demo": "run a LLaMA block on K local torch.distributed ranks and print rank "
                        "0's EXPLAIN ANALYZE (--help lists its options)",
    "train-demo": "train an MLP on scikit-learn's digits with tensorql (autodiff + Adam, "
                  "checkpoints in the store) next to PyTorch (--help lists its options)",
}
# the first word of a statement that changes things: DuckDB's shell prints nothing for it
_QUIET = frozenset("CREATE DROP ALTER INSERT UPDATE DELETE SET RESET ATTACH DETACH USE LOAD "
                   "INSTALL BEGIN COMMIT ROLLBACK ABORT CHECKPOINT FORCE VACUUM COPY EXPORT "
                   "IMPORT TRUNCATE COMMENT START END".split())
SHELL_HELP = """\
.help             this text
.mode [MODE]      the output mode: box, csv, json, markdown, line (no MODE: say which)
.tables           the tables, views and tensors of the database
.quit, .exit      leave the shell (so does end of input: Ctrl-D)
Statements end with ';' and may span lines (DuckDB's SQL, EINSUM, CREATE/DROP TENSOR, EXPLAIN)."""


_DOLLAR_QUOTE = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)?\$")


def statement_complete(text: str) -> bool:
    """Whether ``text`` ends with a ``;`` outside quotes and comments (the shell then runs it).

    >>> [statement_complete(s) for s in ("SELECT 1", "SELECT ';'", "SELECT 1; -- done")]
    [False, False, True]
    >>> [statement_complete(s) for s in ("SELECT $$a;", "SELECT $x$a;$x$;", "SELECT $1;")]
    [False, True, True]
    """
    quote, ended, i = "", False, 0
    while i < len(text):
        ch = text[i]
        dollar = _DOLLAR_QUOTE.match(text, i) if ch == "$" and not quote else None
        if quote:
            if ch == quote:
                quote = ""
        elif dollar:  # a dollar-quoted string runs to the same $tag$
            close = text.find(dollar.group(), dollar.end())
            if close < 0:
                return False
            i, ended = close + len(dollar.group()), False
            continue
        elif ch in "'\"":
            quote, ended = ch, False
        elif text.startswith("--", i):
            newline = text.find("\n", i)
            i = len(text) if newline < 0 else newline
            continue
        elif text.startswith("/*", i):
            close = text.find("*/", i + 2)
            if close < 0:
                return False
            i = close + 2
            continue
        elif ch == ";":
            ended = True
        elif not ch.isspace():
            ended = False
        i += 1
    return ended and not quote


def _first_word(text: str) -> str:
    words = text.lstrip(" \t\n(").split(None, 1)
    return words[0].upper() if words else ""


class Shell:
    """Runs statements and dot commands against ``db`` and prints each result in ``mode``.

    Lines come from :meth:`feed`; a statement runs once a line completes it. Interactive
    (a terminal), an error is printed and the shell goes on; otherwise (``-c``, a script on
    stdin) the first error stops it, and :attr:`status` is 1."""

    def __init__(self, db: Any, mode: str = "box", max_rows: int = 40,
                 out: TextIO | None = None, interactive: bool = False) -> None:
        self.db, self.mode, self.max_rows = db, mode, max_rows
        self.out = out or sys.stdout
        self.interactive = interactive
        self.buffer: list[str] = []
        self.status = EXIT_OK
        self.done = False

    @property
    def prompt(self) -> str:
        return "· " if self.buffer else "D "

    def feed(self, line: str) -> None:
        """Take one line of input: a dot command (at a statement's start) or SQL."""
        if not self.buffer and line.strip().startswith("."):
            self.dot(line.strip())
            return
        if not self.buffer and not line.strip():
            return
        self.buffer.append(line)
        text = "\n".join(self.buffer)
        if statement_complete(text):
            self.buffer = []
            self.run(text)

    def finish(self) -> None:
        """End of input: run what is left (a last statement without ``;``)."""
        text = "\n".join(self.buffer).strip()
        self.buffer = []
        if text and not self.done:
            self.run(text)

    def run(self, script: str) -> bool:
        """Run the statements of ``script``, printing each result; whether all ran."""
        from tensorql.sql.dialect import split_script

        try:
            for st in split_script(script):
                self.show(st.text, self.db.sql(st.text))
        except Exception as err:  # noqa: BLE001 - the shell reports and goes on
            if not isinstance(err, TensorQLError) and not self.interactive:
                raise
            print(f"error: {err}", file=sys.stderr)
            self._failed()
            return False
        return True

    def show(self, statement: str, result: Any) -> None:
        """Print one statement's result (nothing for one that changes things)."""
        quiet = _first_word(statement) in _QUIET
        if result.text is not None:
            if not quiet and result.text:
                print(result.text, file=self.out)
            return
        if quiet and result.columns in (["Count"], ["Success"]):
            return
        from tensorql.sql.render import Rows, duckdb_types, render

        if self.mode == "box" and result.tensor is not None:
            table, total = result._tensor_head(self.max_rows)
        else:
            table, total = result.arrow(), None
        rows = Rows(table, duckdb_types(table), total)
        width = shutil.get_terminal_size().columns
        text = render(rows, self.mode, width=width, max_rows=self.max_rows)
        if text:
            print(text, file=self.out)

    def dot(self, line: str) -> None:
        command, _, arg = line.partition(" ")
        arg = arg.strip()
        if command in (".quit", ".exit"):
            self.done = True
        elif command == ".help":
            print(SHELL_HELP, file=self.out)
        elif command == ".mode":
            if not arg:
                print(f"current output mode: {self.mode}", file=self.out)
            elif arg in MODES:
                self.mode = arg
            else:
                self._dot_error(f"unknown mode {arg!r}; choose one of {', '.join(MODES)}")
        elif command == ".tables":
            import duckdb

            tensors = self.db.tensors()
            hidden = {f"{t}__chunks" for t in tensors}
            try:
                names = {r[0] for r in self.db.connection.sql("SHOW TABLES").fetchall()}
            except duckdb.Error as err:  # e.g. a transaction an error aborted
                self._dot_error(f"DuckDB: {str(err).splitlines()[0]}")
                return
            listed = sorted((names - hidden) | set(tensors))
            if listed:
                print("  ".join(listed), file=self.out)
        else:
            self._dot_error(f"unknown command {command!r}; .help lists them")

    def _dot_error(self, message: str) -> None:
        print(f"error: {message}", file=sys.stderr)
        self._failed()

    def _failed(self) -> None:
        """A statement or command failed: a script stops with status 1, a terminal goes on."""
        if not self.interactive:
            self.status, self.done = EXIT_ERROR, True

    def loop(self, lines: Any) -> int:
        """Feed ``lines`` until they end or ``.quit``; the exit status."""
        for line in lines:
            self.feed(line.rstrip("\n"))
            if self.done:
                break
        self.finish()
        return self.status

    def interact(self) -> int:
        """Read statements from the terminal (``readline`` editing and history) until
        ``.quit`` or end of input."""
        history = os.path.join(os.path.expanduser("~"), ".tensorql_history")
        try:
            import readline
        except ImportError:  # pragma: no cover - no readline on this platform
            readline = None
        if readline is not None:
            try:
                readline.read_history_file(history)
            except OSError:
                pass
        print(f"tensorql {_version()} (DuckDB's SQL with EINSUM). Enter \".help\" for "
              "usage hints.", file=self.out)
        try:
            while not self.done:
                try:
                    line = input(self.prompt)
                except KeyboardInterrupt:
                    print(file=self.out)
                    self.buffer = []
                    continue
                except EOFError:
                    print(file=self.out)
                    break
                try:
                    self.feed(line)
                except KeyboardInterrupt:  # Ctrl-C while a statement runs: back to the prompt
                    print("interrupted", file=sys.stderr)
                    self.buffer = []
        finally:
            if readline is not None:
                try:
                    readline.write_history_file(history)
                except OSError:
                    pass
        return self.status


def _shell_parser() -> argparse.ArgumentParser:
    import textwrap

    commands = "\n".join(textwrap.fill(text, 88, initial_indent=f"  {name:<18}",
                                        subsequent_indent=" " * 20)
                          for name, text in COMMANDS.items())
    ap = argparse.ArgumentParser(
        prog="tensorql", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="tensorql [DATABASE] [-c SQL] [--mode MODE] [options]\n"
              "       tensorql COMMAND ... (tensorql COMMAND --help)",
        description="A relational query engine over tensor blocks: SQL (DuckDB's dialect) "
                    "with EINSUM. Without -c, on a terminal: an interactive shell; with "
                    "stdin not a terminal: run the statements it gives.",
        epilog=f"commands:\n{commands}")
    ap.add_argument("database", nargs="?", default=None,
                    help="DuckDB database file, created if missing (default: in memory)")
    ap.add_argument("-c", dest="sql", metavar="SQL", default=None,
                    help="run these statements, print each result, and exit")
    ap.add_argument("--mode", choices=MODES, default="box",
                    help="output mode (default: box, cut to the terminal's width)")
    ap.add_argument("--max-rows", type=_max_rows, default=40, metavar="N",
                    help="print at most N rows of a result in a box (default: 40)")
    ap.add_argument("--backend", default=None,
                    help="execution backend for EINSUM: native (default) or duckdb")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="draw a progress bar on stderr while tensor queries run "
                         "(default: when stderr is a terminal)")
    ap.add_argument("--version", action="version", version=f"tensorql {_version()}")
    return ap


def _shell_main(argv: list[str]) -> int:
    try:
        args = _shell_parser().parse_args(argv)
    except SystemExit as done:  # --help, --version, usage errors
        return int(done.code or 0)
    args.db = args.database
    fresh = args.db is not None and not os.path.exists(args.db)
    near = _near_command(args.db) if fresh else None
    if near is not None:  # `tensorql demoo`: a typo, not a new database file to create
        print(f"tensorql: error: unknown command {args.db!r} (did you mean {near}?); to "
              f"create a database file by that name, write ./{args.db}", file=sys.stderr)
        return EXIT_USAGE
    status = EXIT_ERROR
    try:
        with _connect(args) as db:
            interactive = args.sql is None and sys.stdin.isatty()
            shell = Shell(db, args.mode, args.max_rows, interactive=interactive)
            if args.sql is not None:
                status = shell.loop(args.sql.splitlines())
            elif interactive:
                status = shell.interact()
            else:
                status = shell.loop(sys.stdin)
    except TensorQLError as err:  # opening the database, an unknown --backend
        print(f"error: {err}", file=sys.stderr)
    if status != EXIT_OK and fresh:  # a failed command leaves no new database file behind
        _remove_new_database(args.db)
    return status


def _near_command(word: str) -> str | None:
    """The command ``word`` is a likely typo of (a bare word, no path or file suffix, close to
    a command's name), else None.

    >>> _near_command("demoo"), _near_command("expain"), _near_command("data.db")
    ('demo', 'explain', None)
    """
    if os.sep in word or "." in word or (os.altsep and os.altsep in word):
        return None
    close = difflib.get_close_matches(word.lower(), COMMANDS, n=1, cutoff=0.75)
    return close[0] if close else None


def _remove_new_database(path: str) -> None:
    for name in (path, f"{path}.wal"):
        if os.path.exists(name):
            os.remove(name)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tensorql`` command; the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        return _shell_main(argv)
    parser = _parser()
    try:
        args, rest = parser.parse_known_args(argv)
    except SystemExit as done:  # --help, --version, usage errors
        return int(done.code or 0)
    if args.command == "demo":  # its own options pass through
        return _cmd_demo(rest)
    if args.command in ("distributed-demo", "train-demo"):
        from tensorql import distributed_demo, train_demo

        demo = distributed_demo if args.command == "distributed-demo" else train_demo
        try:
            return demo.main(rest)
        except SystemExit as done:  # its --help and usage errors
            return int(done.code or 0)
        except TensorQLError as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_ERROR
    if rest:
        print(f"tensorql: error: unrecognized arguments: {' '.join(rest)}", file=sys.stderr)
        return EXIT_USAGE
    fresh = args.db is not None and not os.path.exists(args.db)
    try:
        return _cmd_sql(args, explain=args.command == "explain")
    except _UsageError as err:
        print(f"tensorql: error: {err}", file=sys.stderr)
        status = EXIT_USAGE
    except TensorQLError as err:
        print(f"error: {err}", file=sys.stderr)
        status = EXIT_ERROR
    if fresh:  # a failed command leaves no new database file behind
        _remove_new_database(args.db)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
