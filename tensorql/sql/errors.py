"""Errors of SQL statements: each is a tensorql error class that also says where in the SQL.

Every class here has ``text`` (the whole script), ``position`` (0-based offset), ``line`` and
``column`` (1-based), and renders the offending line with a caret.

>>> err = SQLShapeError("label 'j' has size 3 here but 4 in operand 0",
...                     text="SELECT *\\nFROM EINSUM('ij,jk->ik', A, B)", position=36)
>>> (err.line, err.column)
(2, 28)
>>> print(err)
label 'j' has size 3 here but 4 in operand 0 at line 2, column 28
  FROM EINSUM('ij,jk->ik', A, B)
                             ^
"""

from __future__ import annotations

from tensorql.algebra import JoinFunctionError
from tensorql.einsum.spec import UnknownOperatorError
from tensorql.errors import (
    ExecutionError,
    ParseError,
    ShapeError,
    UnknownTensorError,
    excerpt,
)

__all__ = [
    "SQLExecutionError", "SQLJoinFunctionError", "SQLOperatorError", "SQLShapeError",
    "SQLUnknownTensorError",
    "located", "where",
]


def where(text: str | None, position: int | None) -> tuple[int | None, int | None, str]:
    """``(line, column, rendered suffix)`` of ``position`` in ``text``."""
    if text is None or position is None:
        return None, None, ""
    position = max(0, min(position, len(text)))
    before = text[:position]
    line = before.count("\n") + 1
    column = position - (before.rfind("\n") + 1) + 1
    line_text = text.splitlines()[line - 1] if text.splitlines() else ""
    line_text, at = excerpt(line_text, column)
    caret = " " * (at - 1) + "^"
    return line, column, f" at line {line}, column {column}\n  {line_text}\n  {caret}"


class _Located:
    text: str | None
    position: int | None
    line: int | None
    column: int | None

    def _place(self, message: str, text: str | None, position: int | None) -> str:
        self.message = message
        self.text, self.position = text, position
        self.line, self.column, suffix = where(text, position)
        return message + suffix


class SQLShapeError(_Located, ShapeError):
    """Label sizes, operand counts or operand columns do not agree (with the SQL position)."""

    def __init__(self, message: str, *, text: str | None = None,
                 position: int | None = None) -> None:
        super().__init__(self._place(message, text, position))


class SQLOperatorError(_Located, UnknownOperatorError):
    """An unknown ``join :=`` / ``agg :=`` name or an unknown named argument."""

    def __init__(self, message: str, *, text: str | None = None,
                 position: int | None = None) -> None:
        super().__init__(self._place(message, text, position))


class SQLJoinFunctionError(_Located, JoinFunctionError):
    """A ``join :=`` lambda that cannot be a join: a name that is not a parameter, a function
    outside the whitelist, a function that is not elementwise (with the SQL position)."""

    def __init__(self, message: str, *, text: str | None = None,
                 position: int | None = None) -> None:
        super().__init__(self._place(message, text, position))


class SQLExecutionError(_Located, ExecutionError):
    """DuckDB rejected or failed a statement (its message, and the position when known)."""

    def __init__(self, message: str, *, text: str | None = None,
                 position: int | None = None) -> None:
        super().__init__(self._place(message, text, position))


class SQLUnknownTensorError(_Located, UnknownTensorError):
    """An EINSUM operand names no stored tensor, CTE, table or view."""

    def __init__(self, name: str, known: list[str] | None = None, *, text: str | None = None,
                 position: int | None = None) -> None:
        UnknownTensorError.__init__(self, name, known)
        self.args = (self._place(str(self.args[0]), text, position),)


def located(err: Exception, text: str, position: int | None) -> Exception:
    """A positioned twin of a tensorql error raised while handling a SQL node."""
    if isinstance(err, (_Located, ParseError)):
        return err
    message = str(err)
    if isinstance(err, UnknownTensorError):
        return SQLUnknownTensorError(err.name, None, text=text, position=position)
    if isinstance(err, UnknownOperatorError):
        return SQLOperatorError(message, text=text, position=position)
    if isinstance(err, JoinFunctionError):
        return SQLJoinFunctionError(message, text=text, position=position)
    if isinstance(err, ShapeError):
        return SQLShapeError(message, text=text, position=position)
    if isinstance(err, ExecutionError):
        return SQLExecutionError(message, text=text, position=position)
    return err
