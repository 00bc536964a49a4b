"""The ``tensorql`` command: run SQL with EINSUM, explain it, or run the demo.

    tensorql sql "SELECT * FROM EINSUM('ij,jk->ik', A, B)" --db work.duckdb
    tensorql sql --file script.sql --db work.duckdb      # or: ... | tensorql sql -
    tensorql explain "SELECT * FROM EINSUM('ij,jk->ik', A, B)" --db work.duckdb [--analyze]
    tensorql demo

Element rows print as a table; a tensor result with more than ``--max-rows`` elements prints as
a shape/dtype summary instead.

>>> main(["sql", "SELECT 40 + 2 AS answer"])
answer
------
    42
0
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tensorql.errors import TensorQLError


def _read_query(args: argparse.Namespace) -> str:
    if args.file:
        with open(args.file, encoding="utf-8") as fh:
            return fh.read()
    if args.query in (None, "-"):
        return sys.stdin.read()
    return args.query


def _render(result, max_rows: int) -> str:
    if result.text is not None:
        return result.text
    if result.tensor is not None and result.tensor.numel() > max_rows:
        t = result.tensor
        labels = ", ".join(result.labels)
        return (f"tensor ({labels}) shape {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
                f"; {t.numel()} elements (use --max-rows to print rows)")
    from tensorql.sql.session import format_table

    return format_table(result.arrow(), limit=max_rows)


def _connect(args: argparse.Namespace):
    import tensorql as tq

    settings = {"backend": args.backend} if getattr(args, "backend", None) else {}
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    settings["progress"] = progress
    return tq.connect(args.db, **settings)


def _cmd_sql(args: argparse.Namespace, explain: bool = False) -> int:
    query = _read_query(args).strip().rstrip(";")
    if explain:
        query = f"EXPLAIN {'ANALYZE ' if args.analyze else ''}{query}"
    with _connect(args) as db:
        print(_render(db.sql(query), args.max_rows))
    return 0


def _cmd_demo(rest: list[str]) -> int:
    try:
        from tensorql import demo  # type: ignore[attr-defined]
    except ImportError:
        print("tensorql demo is not available in this build", file=sys.stderr)
        return 1
    return int(demo.main(rest) or 0)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tensorql", description="A relational query engine over "
                                 "tensor blocks: SQL with EINSUM.")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, help_text in (("sql", "run SQL statements (the last one's result is printed)"),
                            ("explain", "EXPLAIN a statement")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("query", nargs="?", help="the SQL text; '-' or nothing reads stdin")
        p.add_argument("--file", "-f", help="read the statements from this file")
        p.add_argument("--db", default=None, help="DuckDB database file (default: in memory)")
        p.add_argument("--backend", choices=("native", "duckdb"), default=None)
        p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="draw a progress bar on stderr while tensor queries run "
                            "(default: when stderr is a terminal)")
        p.add_argument("--max-rows", type=int, default=40,
                       help="print at most this many rows (larger tensors are summarised)")
        if name == "explain":
            p.add_argument("--analyze", action="store_true", help="run it and add timings")
    sub.add_parser("demo", help="run the demo workload and check it against torch",
                   add_help=False)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tensorql`` command; the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":  # its own options pass through
        return _cmd_demo(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "sql":
            return _cmd_sql(args)
        return _cmd_sql(args, explain=True)
    except TensorQLError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
