"""The ``tensorql`` command.

    tensorql demo            run the main job (see tensorql.demo)
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="tensorql", description="tensorql command line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the demo workload and check it against torch",
                   add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from tensorql import demo

        return demo.main(rest)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
