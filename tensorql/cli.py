"""The ``tensorql`` command: run SQL with EINSUM, explain it, or run the demo.

    tensorql sql "SELECT * FROM EINSUM('ij,jk->ik', A, B)" --db work.duckdb
    tensorql sql --file script.sql --db work.duckdb      # or: ... | tensorql sql -
    tensorql explain "SELECT * FROM EINSUM('ij,jk->ik', A, B)" --db work.duckdb [--analyze]
    tensorql demo [--help]
    tensorql distributed-demo [--ranks K] [--help]
    tensorql train-demo [--steps N] [--db FILE] [--help]
    tensorql --version

Results print as a box of rows (like DuckDB's shell), at most ``--max-rows`` of them with a
footer counting the rest. Exit status: 0 on success, 1 when a statement fails (the error is
printed, no traceback), 2 for bad command-line usage or an unreadable ``--file``. A database
file that did not exist before a failed command is not left behind.

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
import os
import sys
from collections.abc import Sequence

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
    if args.query in (None, "-"):
        return sys.stdin.read()
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
        if explain:
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


def _max_rows(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _parser() -> argparse.ArgumentParser:
    from tensorql.pipeline import BACKENDS

    ap = argparse.ArgumentParser(prog="tensorql", description="A relational query engine over "
                                 "tensor blocks: SQL (DuckDB's dialect) with EINSUM.")
    ap.add_argument("--version", action="version", version=f"tensorql {_version()}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in (("sql", "run SQL statements and print the last one's result"),
                            ("explain", "EXPLAIN every statement (none of them runs, except "
                                        "what --analyze measures)")):
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
    sub.add_parser("demo", help="run the demo workload and check it against torch "
                   "(tensorql demo --help lists its options)", add_help=False)
    sub.add_parser("distributed-demo", help="run a LLaMA block on K local torch.distributed "
                   "ranks and print rank 0's EXPLAIN ANALYZE (--help lists its options)",
                   add_help=False)
    sub.add_parser("train-demo", help="train an MLP on scikit-learn's digits with tensorql "
                   "(autodiff + Adam, checkpoints in the store) next to PyTorch "
                   "(--help lists its options)", add_help=False)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tensorql`` command; the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
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
        for path in (args.db, f"{args.db}.wal"):
            if os.path.exists(path):
                os.remove(path)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
