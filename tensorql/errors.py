"""The exception family: every error tensorql raises derives from :class:`TensorQLError`.

Each error says what was wrong and where: the offending label, operand, character or SQL
position.

>>> try:
...     raise ParseError("unexpected character '!'", text="ij!", position=2)
... except TensorQLError as err:
...     print(err)
unexpected character '!' at position 2
  ij!
    ^
"""

from __future__ import annotations


class TensorQLError(Exception):
    """Base class of every error tensorql raises."""


class ParseError(TensorQLError):
    """A query or einsum equation could not be parsed.

    ``position`` is a 0-based character offset into ``text``; ``line`` and ``column`` are
    1-based and derived from it when not given.
    """

    def __init__(
        self,
        message: str,
        *,
        text: str | None = None,
        position: int | None = None,
        line: int | None = None,
        column: int | None = None,
    ) -> None:
        self.message = message
        self.text = text
        self.position = position
        if position is not None and text is not None and line is None:
            before = text[:position]
            line = before.count("\n") + 1
            column = position - (before.rfind("\n") + 1) + 1
        self.line = line
        self.column = column
        super().__init__(self._render())

    def _render(self) -> str:
        if self.text is None or self.position is None:
            if self.line is not None:
                return f"{self.message} at line {self.line}, column {self.column}"
            return self.message
        where = f"position {self.position}"
        if "\n" in self.text:
            where = f"line {self.line}, column {self.column}"
        line_text = self.text.splitlines()[self.line - 1] if self.line and self.text else ""
        caret = " " * ((self.column or 1) - 1) + "^"
        return f"{self.message} at {where}\n  {line_text}\n  {caret}"


class ShapeError(TensorQLError):
    """Shapes or label sizes do not agree (names the label and operands involved)."""


class AmbiguousTruthError(ShapeError, ValueError):
    """``bool()`` of a tensor of more than one element (or none), as numpy's ValueError."""


class PlanError(TensorQLError):
    """A plan could not be built: an unknown strategy, an infeasible memory limit, ..."""


class ExecutionError(TensorQLError):
    """A chunk task failed while running; names the plan node and chunk key."""


class MemoryLimitError(ExecutionError):
    """A result cannot fit in the memory the process may use; says how big it is and what
    to do instead (store it, read it chunk by chunk, compute a slice)."""


class StorageError(TensorQLError):
    """The chunk store could not read or write what was asked."""


class StaleTensorError(StorageError):
    """A stored tensor no longer has the layout a query was planned for: it was stored again
    with another shape, dtype or tiling after the expression was built (names the tensor)."""


class UnknownTensorError(StorageError, KeyError):
    """No stored tensor has the given name."""

    def __init__(self, name: str, known: list[str] | None = None) -> None:
        self.name = name
        hint = ""
        if known:
            shown = ", ".join(repr(k) for k in sorted(known)[:10])
            hint = f"; stored tensors: {shown}"
        super().__init__(f"unknown tensor {name!r}{hint}")

    def __str__(self) -> str:  # KeyError would add quotes around the message
        return str(self.args[0])


class OptionError(TensorQLError, ValueError):
    """A configuration value is invalid (names the option and the accepted values)."""


class UnsupportedError(TensorQLError, TypeError):
    """An operation or argument tensorql does not support (e.g. numpy's ``out=``)."""


class DTypeError(TensorQLError, TypeError):
    """A dtype tensorql does not hold (names it and the supported ones); not a shape problem."""

