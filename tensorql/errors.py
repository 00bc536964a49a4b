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

import numbers
import re

ECHO_LIMIT = 200  # characters of an echoed spec, name or statement line an error repeats

_LONG_QUOTED = re.compile("'[^'\\n]{N,}'|\"[^\"\\n]{N,}\"".replace("N", str(ECHO_LIMIT + 1)))


def bounded(text: str, limit: int = ECHO_LIMIT) -> str:
    """``text`` if at most ``limit`` characters, else its start and how long it was.

    >>> bounded("ij,jk"), bounded("ab" * 150)[-30:]
    ('ij,jk', 'abababababab… (300 characters)')
    """
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def bound_quoted(message: str) -> str:
    """``message`` with every quoted span (an echoed ``{value!r}``) longer than
    :data:`ECHO_LIMIT` cut to its start and its length, so a 1 MB spec is not repeated.

    >>> bound_quoted("unknown join 'mul'")
    "unknown join 'mul'"
    >>> bound_quoted("unknown join '" + "x" * 500 + "'")[-24:]
    "xxxxx… (500 characters)'"
    """
    if len(message) <= ECHO_LIMIT:
        return message
    return _LONG_QUOTED.sub(lambda m: m[0][0] + bounded(m[0][1:-1]) + m[0][-1], message)


def excerpt(line: str, column: int, width: int = ECHO_LIMIT // 2) -> tuple[str, int]:
    """``(shown, caret column)``: ``line`` cut to ``width`` characters either side of 1-based
    ``column`` (with ``…`` where cut), and where the caret goes in what is shown.

    >>> excerpt("SELECT 1", 8)
    ('SELECT 1', 8)
    >>> shown, at = excerpt("x" * 500 + "!" + "y" * 500, 501, width=5)
    >>> shown, shown[at - 1]
    ('…xxxxx!yyyyy… (1001 characters)', '!')
    """
    if len(line) <= 2 * width:
        return line, column
    start = max(0, column - 1 - width)
    end = min(len(line), column + width)
    head = "…" if start else ""
    tail = f"… ({len(line)} characters)" if end < len(line) or start else ""
    return head + line[start:end] + tail, column - start + len(head)


class TensorQLError(Exception):
    """Base class of every error tensorql raises. A message echoing a long value (a 1 MB
    equation, a name) keeps its start and says how long it was (:func:`bound_quoted`).
    """

    def __init__(self, *args: object) -> None:
        if args and isinstance(args[0], str):
            args = (bound_quoted(args[0]), *args[1:])
        super().__init__(*args)


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
        line_text, column = excerpt(line_text, self.column or 1)
        caret = " " * (column - 1) + "^"
        return f"{self.message} at {where}\n  {line_text}\n  {caret}"


class ShapeError(TensorQLError):
    """Shapes or label sizes do not agree (names the label and operands involved)."""


class AmbiguousTruthError(ShapeError, ValueError):
    """``bool()`` of a tensor of more than one element (or none), as numpy's ValueError."""


class IndexingError(ShapeError, IndexError):
    """An index a tensor cannot take (out of bounds, too many, a mask of the wrong shape); an
    ``IndexError`` too, as numpy's, so iteration by index stops at the end."""


class PlanError(TensorQLError):
    """A plan could not be built: an unknown strategy, an infeasible memory limit, ..."""


class ExecutionError(TensorQLError):
    """A chunk task failed while running; names the plan node and chunk key."""


class ProgressCallbackError(ExecutionError):
    """The ``progress`` callback a run was given raised: the run stopped there (nothing is
    stored); the callback's own exception is the ``__cause__``."""


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


def as_flag(value: object, what: str) -> bool:
    """``value`` of a yes/no argument ``what`` as a bool: a bool, numpy's bool, an integer
    or None (no); anything else -- an array, whose truth is ambiguous, a string -- is an
    OptionError naming the argument.

    >>> as_flag(1, "keepdims"), as_flag(None, "analyze")
    (True, False)
    >>> as_flag("yes", "keepdims")
    Traceback (most recent call last):
    ...
    tensorql.errors.OptionError: keepdims must be True or False, got 'yes'
    """
    if value is None:
        return False
    if isinstance(value, (bool, numbers.Integral)) or type(value).__name__ == "bool_":
        return bool(value)
    raise OptionError(f"{what} must be True or False, got {value!r}")


def as_count(value: object, what: str) -> int:
    """``value`` of a row-count argument ``what`` as a non-negative int; a count past any
    table's size is capped (``2**70`` rows means all of them); anything but a whole number
    (a bool, a string, a float) is an OptionError naming the argument.

    >>> as_count(3, "size"), as_count(2**70, "max_rows"), as_count(-1, "size")
    (3, 9223372036854775807, 0)
    >>> as_count("x", "size")
    Traceback (most recent call last):
    ...
    tensorql.errors.OptionError: size must be a whole number of rows, got 'x'
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OptionError(f"{what} must be a whole number of rows, got {value!r:.60}")
    return min(max(0, int(value)), (1 << 63) - 1)


class DistributedError(TensorQLError):
    """A distributed run failed: a peer rank died or stopped answering, ranks disagree, or a
    rank's devices cannot work (two local ranks on one GPU)."""


class UnsupportedError(TensorQLError, TypeError):
    """An operation or argument tensorql does not support (e.g. numpy's ``out=``)."""


class DLPackError(TensorQLError, BufferError):
    """A DLPack exchange tensorql cannot make (a stream or a device the values are not on, a
    version it does not speak); a ``BufferError``, as the DLPack protocol asks of a producer
    that cannot export what was asked."""


class DTypeError(TensorQLError, TypeError):
    """A dtype tensorql does not hold (names it and the supported ones); not a shape problem."""

