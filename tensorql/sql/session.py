"""``run_sql``: the SQL face's entry point (``Database.sql`` calls it).

The work is split by job: :mod:`tensorql.sql.statements` runs statements,
:mod:`tensorql.sql.operands` turns EINSUM calls into einsum-graph nodes,
:mod:`tensorql.sql.rewriting` rewrites sqlglot trees and :mod:`tensorql.sql.result` is what a
statement returns.

>>> import tensorql as tq
>>> run_sql(tq.connect(), "SELECT 40 + 2 AS answer").fetchall()
[(42,)]
"""

from __future__ import annotations

from typing import Any

from tensorql.pipeline import get_backend
from tensorql.sql.result import SQLResult, format_table
from tensorql.sql.statements import ScriptRunner, explain_each

__all__ = ["SQLResult", "explain_each", "format_table", "run_sql"]


def run_sql(session: Any, script: str, backend: str | None = None,
            params: Any = None, frames: Any = None) -> SQLResult:
    """Run every statement of ``script`` on ``session``; the result of the last one.
    ``params`` (a sequence for ``?``/``$1`` or a dict for ``$name``) binds DuckDB parameters
    of a single plain statement; ``frames`` (``tensorql.sql.replacement.Registered``): the
    caller's frames registered for the script."""
    if backend is not None:
        get_backend(backend)  # UnknownBackendError names the registered ones
    return ScriptRunner(session, script, backend, params, frames).run()
