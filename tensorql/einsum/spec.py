"""Extended einsum specifications: parse, validate and infer label sizes.

One operation is ``out[o] = AGG_{a} JOIN(in1[..], in2[..], ...)``: labels are either output
labels or aggregated labels, JOIN folds the operands left to right with an elementwise
function, AGG reduces the aggregated labels.

>>> spec = EinsumSpec.parse("ij,jk->ik", [(2, 3), (3, 4)])
>>> spec.inputs, spec.output, spec.aggregated, spec.sizes
((('i', 'j'), ('j', 'k')), ('i', 'k'), ('j',), {'i': 2, 'j': 3, 'k': 4})
>>> EinsumSpec.parse("ii->i", [(3, 3)]).inputs
(('i', 'i'),)
>>> EinsumSpec.parse("...j,j->...", [(5, 2, 3), (3,)]).output
('…0', '…1')

Any character opt_einsum accepts is a label (every symbol ``opt_einsum.get_symbol`` makes), so
an einsum may have any number of labels; numpy's interleaved form is converted by
:func:`interleaved_equation`:

>>> EinsumSpec.parse("aÀ,Àb->ab", [(2, 3), (3, 4)]).aggregated
('À',)
>>> interleaved_equation([[0, 1], [1, 2]], [0, 2])
'ab,bc->ac'
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from tensorql.algebra import (
    BUILTIN_AGGS,
    BUILTIN_JOINS,
    COMPARISON_JOINS,
    AggName,
    JoinName,
    UnknownOperatorError,
    check_operators,
    is_update,
    join_record,
)
from tensorql.errors import ParseError, ShapeError

__all__ = ["AGGS", "COMPARISON_JOINS", "ELLIPSIS_PREFIX", "JOINS", "EinsumSpec",
           "UnknownOperatorError", "check_operators", "interleaved_equation", "operand_labels"]

# The built-in joins offered by name in Python and SQL (the optimizer updates, also built in,
# are not offered in SQL) and the built-in aggregations; every fact about them, and the
# user's own, is in the algebra registry (tensorql.algebra).
JOINS = tuple(name for name in BUILTIN_JOINS if not is_update(name))
AGGS = BUILTIN_AGGS

ELLIPSIS_PREFIX = "…"
# Characters with a meaning in an equation; every other non-space character is a label.
RESERVED = frozenset(",->.…")


@dataclass(frozen=True)
class EinsumSpec:
    """A validated extended einsum over concrete operand shapes.

    ``inputs`` holds each operand's labels (ellipsis expanded into labels ``…0``, ``…1``, ...);
    ``squeezed`` marks dims of size 1 broadcast against a larger size (the operand does not
    carry that label); ``sizes`` is every label's size.
    """

    equation: str
    inputs: tuple[tuple[str, ...], ...]
    output: tuple[str, ...]
    sizes: dict[str, int] = field(hash=False, compare=False)
    squeezed: tuple[tuple[bool, ...], ...] = ()
    join: str = JoinName.MUL
    agg: str = AggName.SUM

    @property
    def aggregated(self) -> tuple[str, ...]:
        """Labels absent from the output, in order of first appearance."""
        seen: list[str] = []
        for labels in self.inputs:
            for label in labels:
                if label not in self.output and label not in seen:
                    seen.append(label)
        return tuple(seen)

    @property
    def output_shape(self) -> tuple[int, ...]:
        return tuple(self.sizes[label] for label in self.output)

    @property
    def is_semiring(self) -> bool:
        """True when labels may be aggregated early and operands reordered."""
        return join_record(self.join).distributes(self.agg)

    @classmethod
    def parse(
        cls,
        equation: str,
        shapes: Sequence[Sequence[int]],
        join: str = JoinName.MUL,
        agg: str = AggName.SUM,
    ) -> EinsumSpec:
        """Parse ``equation`` against operand ``shapes``; ParseError / ShapeError on bad input.

        A spec is immutable, so the same equation over the same shapes (a query written again,
        e.g. a tensor network of 120 operands in a loop) gets the spec parsed the first time
        (:data:`PARSE_CACHE_SIZE` kept); the operators are checked on every call (a join may
        have been registered since).

        >>> a = EinsumSpec.parse("ij,jk->ik", [(2, 3), (3, 4)])
        >>> a is EinsumSpec.parse("ij,jk->ik", [[2, 3], (3, 4)]), a.output_shape
        (True, (2, 4))
        """
        check_operators(join, agg)
        try:
            shape_key = tuple(map(tuple, shapes))
        except TypeError:  # (None, a number, a list of numbers)
            raise ShapeError(f"EinsumSpec.parse: shapes must be one sequence of sizes per "
                             f"operand, got {shapes!r:.60}") from None
        try:
            key = (equation, shape_key, join, agg)
            hash(key)
        except TypeError:  # an unhashable shape or equation: parsed (and refused) as it is
            return cls._parse(equation, shapes, join, agg)
        return _parse_cached(cls, *key)

    @classmethod
    def _parse(cls, equation: str, shapes: Sequence[Sequence[int]], join: str,
               agg: str) -> EinsumSpec:
        raw_inputs, raw_output = _split(equation)
        if len(raw_inputs) != len(shapes):
            raise ShapeError(
                f"equation {equation!r} names {len(raw_inputs)} operand(s) but "
                f"{len(shapes)} were given"
            )
        inputs: list[tuple[str, ...]] = []
        ell_ndim = 0
        for n, ((labels, has_ell, pos), shape) in enumerate(zip(raw_inputs, shapes)):
            if has_ell:
                extra = len(shape) - (len(labels) - 1)
                if extra < 0:
                    raise ShapeError(
                        f"operand {n} has {len(shape)} dims but equation {equation!r} names "
                        f"{len(labels) - 1} labels for it (at position {pos})"
                    )
                ell_ndim = max(ell_ndim, extra)
            elif len(labels) != len(shape):
                raise ShapeError(
                    f"operand {n} has {len(shape)} dim(s) {tuple(shape)} but equation "
                    f"{equation!r} gives it {len(labels)} label(s) {''.join(labels)!r} "
                    f"(at position {pos})"
                )
        ell_labels = tuple(f"{ELLIPSIS_PREFIX}{k}" for k in range(ell_ndim))
        for (labels, has_ell, _), shape in zip(raw_inputs, shapes):
            if has_ell:
                head, tail = labels[: labels.index("...")], labels[labels.index("...") + 1:]
                extra = len(shape) - len(head) - len(tail)
                inputs.append(tuple(head) + ell_labels[ell_ndim - extra:] + tuple(tail))
            else:
                inputs.append(tuple(labels))
        sizes, squeezed = _infer_sizes(equation, inputs, shapes)
        output = _output_labels(equation, raw_output, inputs, ell_labels)
        return cls(
            equation=equation, inputs=tuple(inputs), output=output, sizes=sizes,
            squeezed=squeezed, join=join, agg=agg,
        )


#: parsed specs kept by (equation, shapes, join, agg)
PARSE_CACHE_SIZE = 256


@functools.lru_cache(maxsize=PARSE_CACHE_SIZE)
def _parse_cached(cls: type[EinsumSpec], equation: str, shapes: tuple[tuple[int, ...], ...],
                  join: str, agg: str) -> EinsumSpec:
    return cls._parse(equation, shapes, join, agg)


def operand_labels(equation: str) -> list[tuple[list[str], bool, int]]:
    """Each operand's labels as written ('...' one item), whether it has one, its position.

    >>> operand_labels("ab,bÀ->aÀ")
    [(['a', 'b'], False, 0), (['b', 'À'], False, 3)]
    """
    return _split(equation)[0]


def _split(equation: str):
    """Operands as (labels incl. '...', has_ellipsis, position) and the output part or None."""
    if not isinstance(equation, str):
        raise ParseError(f"einsum equation must be a string, got {type(equation).__name__}")
    if equation.count("->") > 1:
        raise ParseError("equation has more than one '->'", text=equation,
                         position=equation.index("->", equation.index("->") + 2))
    lhs, arrow, rhs = equation.partition("->")
    operands = []
    start = 0
    for part in lhs.split(","):
        operands.append((_labels(equation, part, start), start))
        start += len(part) + 1
    inputs = [(labels, "..." in labels, pos) for labels, pos in operands]
    output = _labels(equation, rhs, len(lhs) + 2) if arrow else None
    return inputs, output


def _labels(equation: str, part: str, offset: int) -> list[str]:
    labels: list[str] = []
    i = 0
    while i < len(part):
        ch = part[i]
        if ch == " ":
            i += 1
            continue
        if part.startswith("...", i):
            if "..." in labels:
                raise ParseError("ellipsis '...' appears twice in one operand",
                                 text=equation, position=offset + i)
            labels.append("...")
            i += 3
            continue
        if ch in RESERVED or ch.isspace() or not ch.isprintable():
            what = "'.' must be part of '...'" if ch == "." else f"unexpected character {ch!r}"
            raise ParseError(f"{what}; a label is any one printable character other than "
                             "',', '-', '>', '.', '…' and spaces", text=equation,
                             position=offset + i)
        labels.append(ch)
        i += 1
    return labels


def _infer_sizes(equation, inputs, shapes):
    sizes: dict[str, int] = {}
    where: dict[str, int] = {}
    for n, (labels, shape) in enumerate(zip(inputs, shapes)):
        for label, size in zip(labels, shape):
            size = int(size)
            if size < 0:
                raise ShapeError(f"operand {n}: label {label!r} has size {size}; "
                                 "sizes must be >= 0")
            old = sizes.get(label)
            if old is None or old == 1:
                sizes[label] = size
                where.setdefault(label, n)
                if old == 1:
                    where[label] = n
            elif size not in (1, old):
                raise ShapeError(
                    f"label {label!r} has size {old} in operand {where[label]} but size {size} "
                    f"in operand {n} (equation {equation!r})"
                )
    squeezed = []
    for labels, shape in zip(inputs, shapes):
        seen: dict[str, int] = {}
        flags = []
        for label, size in zip(labels, shape):
            if label in seen and shape[seen[label]] != size:
                raise ShapeError(
                    f"label {label!r} repeats within one operand with sizes "
                    f"{shape[seen[label]]} and {size} (equation {equation!r})"
                )
            seen.setdefault(label, len(flags))
            flags.append(int(size) == 1 and sizes[label] > 1)
        squeezed.append(tuple(flags))
    return sizes, tuple(squeezed)


def _output_labels(equation, raw_output, inputs, ell_labels) -> tuple[str, ...]:
    present = {label for labels in inputs for label in labels}
    if raw_output is None:  # implicit: ellipsis dims, then labels seen once, sorted
        counts: dict[str, int] = {}
        for labels in inputs:
            for label in labels:
                counts[label] = counts.get(label, 0) + 1
        singles = sorted(lab for lab, c in counts.items()
                         if c == 1 and not lab.startswith(ELLIPSIS_PREFIX))
        return tuple(lab for lab in ell_labels if lab in present) + tuple(singles)
    out: list[str] = []
    arrow_end = equation.index("->") + 2
    pos = arrow_end
    for label in raw_output:
        pos = equation.index(label, pos)
        if label == "...":
            out.extend(lab for lab in ell_labels if lab in present)
        elif label in out:
            raise ParseError(f"output label {label!r} appears twice", text=equation,
                             position=pos)
        elif label not in present:
            raise ParseError(f"output label {label!r} does not appear in any operand",
                             text=equation, position=pos)
        else:
            out.append(label)
        pos += len(label)
    return tuple(out)


# Integer labels below this are opt_einsum's symbol of that number (``chr(n + 140)`` past 51,
# so short of the surrogates at 0xD800); a larger one (10**9: no character) is numbered with
# the others in sorted order, as other symbols are.
_DIRECT_SYMBOLS = 0xD800 - 140


def interleaved_equation(subscripts: Sequence[Sequence[Hashable]],
                         output: Sequence[Hashable] | None = None) -> str:
    """The equation of numpy's interleaved form ``einsum(A, [0, 1], B, [1, 2], [0, 2])``.

    Non-negative integers become ``opt_einsum.get_symbol(n)`` (0 -> 'a', 52 -> 'À'), as numpy
    and opt_einsum name them; other hashable, sortable symbols (strings, ...) are numbered in
    sorted order like opt_einsum does; ``...`` (Ellipsis) stays an ellipsis.

    >>> interleaved_equation([[0, ..., 60]], [..., 60])
    'a...È->...È'
    >>> interleaved_equation([["x", "y"], ["y", "z"]])
    'ab,bc'
    >>> interleaved_equation([[10**9, 0]], [0])
    'ba->a'
    """
    from opt_einsum import get_symbol

    every = [sym for subs in [*subscripts, () if output is None else output]
             for sym in _sublist(subs)]
    symbols = {sym for sym in every if sym is not Ellipsis}
    if all(isinstance(sym, int) and not isinstance(sym, bool) and 0 <= sym < _DIRECT_SYMBOLS
           for sym in symbols):
        names = {sym: get_symbol(sym) for sym in symbols}
    else:
        try:
            ordered = sorted(symbols)
        except TypeError:
            raise ParseError("interleaved einsum subscripts must be all non-negative integers or "
                             "mutually sortable symbols (and ...); got "
                             f"{sorted(map(repr, symbols))}") from None
        names = {sym: get_symbol(n) for n, sym in enumerate(ordered)}

    def text(subs: Sequence[Hashable]) -> str:
        return "".join("..." if sym is Ellipsis else names[sym] for sym in _sublist(subs))

    equation = ",".join(text(subs) for subs in subscripts)
    return equation if output is None else f"{equation}->{text(output)}"


def _sublist(subs: object) -> list[Hashable]:
    if isinstance(subs, (str, bytes)) or not isinstance(subs, Sequence):
        raise ParseError(f"interleaved einsum expects a list of subscripts after each operand, "
                         f"got {type(subs).__name__} {subs!r}")
    for sym in subs:
        if sym is not Ellipsis and not isinstance(sym, Hashable):
            raise ParseError(f"interleaved einsum subscript {sym!r} is not hashable")
    return list(subs)
