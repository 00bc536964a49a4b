"""Reverse-mode autodiff of the einsum graph: gradients are lazy einsum graphs too.

``grad(loss, [W1, W2])`` walks the graph from ``loss`` back to the tensors asked for and
builds, for each, an expression of extended einsums and maps -- so a gradient is lowered,
partitioned, explained and run like any other query (and a training step is just another
graph).

>>> import numpy as np, tensorql as tq
>>> db = tq.connect()
>>> w = db.from_numpy("w", np.array([1.0, 2.0, 3.0]))
>>> x = db.from_numpy("x", np.array([[1.0, 0.0, 2.0], [0.5, 1.0, 1.0]]))
>>> loss = ((x @ w) ** 2).sum()
>>> (g,) = tq.grad(loss, [w])
>>> g.numpy().tolist()                 # 2 * x.T @ (x @ w)
[19.5, 11.0, 39.0]

The rules, per node (``g`` the adjoint of the node's value):

- einsum with join ``mul`` and agg ``sum``: the adjoint of an operand is one einsum of ``g``
  with the other operands (the classic rule; no intermediate over all labels is built);
- any other (join, agg): the adjoint of the joined values over all labels is ``g`` broadcast
  (sum), ``g`` routed to the extremum with ties sharing it evenly (max / min, as ``torch.amax``
  / ``torch.amin``), or ``g`` times the product of the other values (prod, zeros handled: a
  single zero gets the product of the rest, several zeros give 0, as ``torch.prod``); then the
  join, folded left to right, is differentiated operand by operand (``max`` / ``min`` joins
  split ties in half as ``torch.maximum``; ``pow`` follows ``torch.pow``'s masking at zero);
  comparisons and the condition of ``where`` carry no gradient (their values are bool);
- maps: the derivative of each function (relu's is 0 at 0, as torch's).

Broadcast (size-1) dims are summed back to size 1 and repeated labels (``ii``) put the
gradient on the diagonal. Integer and bool values carry no gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from opt_einsum import get_symbol

from tensorql.algebra import BUILTIN_AGGS, derivative_join, join_record
from tensorql.algebra import AggName as _A
from tensorql.algebra import JoinName as _J
from tensorql.api.tensor import Tensor, broadcast_binary, where
from tensorql.dtypes import torch_dtype
from tensorql.einsum.graph import (
    EinsumOp,
    MapOp,
    Node,
    ReshapeOp,
    SoftmaxOp,
    Source,
    topological_order,
)
from tensorql.errors import DTypeError, ShapeError, TensorQLError, UnsupportedError

__all__ = ["grad"]

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


class GradientError(TensorQLError, ValueError):
    """A gradient that cannot be taken: an input the output does not depend on, or an output
    that is not a single value and no ``grad_output`` was given."""


def grad(output: Tensor, inputs: Sequence[Tensor], grad_output: Any = None,
         allow_unused: bool = False) -> list[Tensor]:
    """The gradients of ``output`` with respect to each of ``inputs``, as lazy tensors.

    ``output`` must hold one value (a loss) unless ``grad_output`` -- the adjoint of the
    output, an array or tensor of its shape -- is given (a vector-Jacobian product, as
    ``torch.autograd.grad``'s ``grad_outputs``). An input the output does not depend on raises
    GradientError, or with ``allow_unused=True`` gets a zero gradient. Inputs may be stored
    tensors (``db.tensor(name)`` stands for every read of that tensor in the graph),
    constants or any intermediate expression of the graph.

    >>> import numpy as np, tensorql as tq
    >>> db = tq.connect()
    >>> a = db.from_numpy("a", np.array([[1.0, -2.0], [3.0, 0.5]]))
    >>> ga, = tq.grad(a.relu().max(axis=1).sum(), [a])
    >>> ga.numpy().tolist()
    [[1.0, 0.0], [1.0, 0.0]]
    """
    if not isinstance(output, Tensor):
        raise GradientError(f"grad: the output must be a tensorql Tensor, got "
                            f"{type(output).__name__}")
    if isinstance(inputs, Tensor):  # one tensor, as torch.autograd.grad takes it (not its rows)
        inputs = [inputs]
    try:
        inputs = list(inputs)
    except TypeError:
        raise GradientError(f"grad: inputs must be a list of tensors, got "
                            f"{type(inputs).__name__}") from None
    for n, t in enumerate(inputs):
        if not isinstance(t, Tensor):
            raise GradientError(f"grad: input {n} is a {type(t).__name__}, not a tensorql "
                                "Tensor")
        if t.db is not output.db:
            raise GradientError(f"grad: input {n} belongs to another database")
        if t.dtype not in FLOAT_DTYPES:
            raise DTypeError(f"grad: input {n} has dtype {t.dtype}; only floating tensors "
                             "have gradients")
    if output.dtype not in FLOAT_DTYPES:
        raise DTypeError(f"grad: the output has dtype {output.dtype}; only a floating output "
                         "can be differentiated")
    db = output.db
    seed = _seed(output, grad_output)
    # a stored tensor is one input however many scan nodes read it (db.tensor("W") twice)
    # (and a whole stored tensor also gets the gradients of its regions read by indexing)
    scans = [node for node in topological_order(output.node) if isinstance(node, Source)]
    targets = {n: ([t.node] if not isinstance(t.node, Source) else
                   [s for s in scans if _covers(t.node, s)] or [t.node])
               for n, t in enumerate(inputs)}
    adjoints = _backward(output.node, seed,
                         {id(node) for nodes in targets.values() for node in nodes}, db)
    grads = []
    for n, t in enumerate(inputs):
        parts = [_into(t.node, node, adjoints[id(node)])
                 for node in targets[n] if id(node) in adjoints]
        g = None
        for part in parts:
            g = part if g is None else g + part
        if g is None:
            if not allow_unused:
                raise GradientError(f"grad: the output does not depend on input {n} "
                                    f"({t.node.describe()}); pass allow_unused=True for a "
                                    "zero gradient")
            g = _constant(db, np.zeros(t.shape), t.dtype)
        grads.append(g)
    return grads


def _covers(wanted: Source, scan: Source) -> bool:
    """Whether ``scan`` reads (part of) the stored tensor or region ``wanted`` stands for."""
    if scan.name != wanted.name:
        return False
    if wanted.offset is None:
        return True
    return scan.offset == wanted.offset and scan.shape == wanted.shape


def _into(wanted: Node, scan: Node, g: Tensor) -> Tensor:
    """The adjoint of region ``scan`` placed in the shape of ``wanted`` (zeros elsewhere):
    one einsum with a 0/1 selection matrix per dimension."""
    if not isinstance(scan, Source) or not isinstance(wanted, Source) \
            or scan.offset is None or wanted.offset is not None:
        return g
    full = wanted.shape
    letters = [get_symbol(k) for k in range(2 * len(full))]
    small, big = "".join(letters[:len(full)]), "".join(letters[len(full):])
    operands, terms = [g], [small]
    for d, (start, n) in enumerate(zip(scan.offset, full)):
        size = scan.shape[d]
        operands.append(_constant(g.db, np.eye(n)[start:start + size], g.dtype))
        terms.append(small[d] + big[d])
    from tensorql.api.einsum import einsum

    return einsum(",".join(terms) + "->" + big, *operands)


def _seed(output: Tensor, grad_output: Any) -> Tensor:
    if grad_output is None:
        if math.prod(output.shape) != 1:
            raise GradientError(f"grad: the output has shape {output.shape}; differentiate a "
                                "single value (e.g. .sum()) or pass grad_output")
        return _constant(output.db, np.ones(output.shape), output.dtype)
    seed = output._operand(grad_output)
    if seed.shape != output.shape:
        raise ShapeError(f"grad: grad_output has shape {seed.shape} but the output has shape "
                         f"{output.shape}")
    return seed if seed.dtype == output.dtype else seed.astype(output.dtype)


def _constant(db: Any, value: Any, dtype: str) -> Tensor:
    return db.constant(torch.as_tensor(np.asarray(value)).to(torch_dtype(dtype)))


def _backward(root: Node, seed: Tensor, wanted: set[int], db: Any) -> dict[int, Tensor]:
    """Adjoints (by node id) of every node on a path from a ``wanted`` node to ``root``."""
    order = topological_order(root)
    on_path: set[int] = set()
    for node in order:  # inputs first: a node is on a path when it or an input is
        if node.dtype in FLOAT_DTYPES and (id(node) in wanted
                                           or any(id(i) in on_path for i in node.inputs)):
            on_path.add(id(node))
    pending: dict[int, list[Tensor]] = {id(root): [seed]} if id(root) in on_path else {}
    adjoints: dict[int, Tensor] = {}
    for node in reversed(order):
        parts = pending.pop(id(node), None)
        if parts is None:
            continue
        g = parts[0]
        for part in parts[1:]:
            g = g + part
        adjoints[id(node)] = g
        needs = [k for k, i in enumerate(node.inputs) if id(i) in on_path]
        if not needs:
            continue
        if isinstance(node, EinsumOp):
            found = _einsum_adjoints(node, g, needs, db)
        elif isinstance(node, MapOp):
            found = {0: _map_adjoint(node, g, db)}
        elif isinstance(node, ReshapeOp):  # the same elements, in the operand's shape
            found = {0: g.reshape(node.operand.shape)}
        elif isinstance(node, SoftmaxOp):
            found = {0: _softmax_adjoint(node, g, db)}
        else:  # pragma: no cover - leaves have no inputs
            found = {}
        for k, part in found.items():
            if part is not None:
                pending.setdefault(id(node.inputs[k]), []).append(part)
    return {k: v for k, v in adjoints.items() if k in wanted}


# -- einsums ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Factor:
    """A tensor whose dims carry ``labels`` (one character each), one term of a product."""

    tensor: Tensor
    labels: str


@dataclass(frozen=True)
class _Einsum:
    """An einsum node with its labels renamed to single characters."""

    node: EinsumOp
    operands: tuple[Factor, ...]
    output: str
    every: str              # all labels, in order of first appearance
    sizes: dict[str, int]
    squeezed: tuple[tuple[bool, ...], ...]
    db: Any

    @classmethod
    def of(cls, node: EinsumOp, db: Any) -> _Einsum:
        spec = node.spec
        names: dict[str, str] = {}
        for labels in spec.inputs:
            for label in labels:
                names.setdefault(label, get_symbol(len(names)))
        operands = tuple(Factor(Tensor(x, db), "".join(names[lab] for lab in labels))
                         for x, labels in zip(node.operands, spec.inputs))
        return cls(node=node, operands=operands,
                   output="".join(names[lab] for lab in spec.output),
                   every="".join(names.values()),
                   sizes={names[lab]: n for lab, n in spec.sizes.items()},
                   squeezed=spec.squeezed, db=db)

    @property
    def dtype(self) -> str:
        return self.node.dtype

    def fresh(self, used: str) -> str:
        """A label not among ``self.every`` nor ``used``."""
        k = len(self.every)
        while get_symbol(k) in used:
            k += 1
        return get_symbol(k)

    def const(self, value: Any) -> Tensor:
        return _constant(self.db, value, self.dtype)

    def full_labels(self, factor: Factor) -> set[str]:
        """The labels a factor carries at their full size (not broadcast from size 1)."""
        return {lab for lab, n in zip(factor.labels, factor.tensor.shape)
                if n == self.sizes[lab]}

    def einsum(self, factors: Sequence[Factor], out: str, join: str = _J.MUL,
               agg: str = _A.SUM) -> Tensor:
        from tensorql.api.einsum import einsum

        equation = ",".join(f.labels for f in factors) + "->" + out
        return einsum(equation, *[f.tensor for f in factors], join=join, agg=agg)

    def contract(self, factors: Sequence[Factor], keep: str, scale: float = 1.0) -> Tensor:
        """The product of ``factors`` (each broadcast over all labels) summed over every label
        not in ``keep``; a label no factor carries at full size counts its size."""
        full: set[str] = set()
        for f in factors:
            full |= self.full_labels(f)
        terms = list(factors)
        for lab in keep:
            if lab not in full:
                terms.append(Factor(self.const(np.ones(self.sizes[lab])), lab))
        count = math.prod(self.sizes[lab] for lab in self.every
                          if lab not in full and lab not in keep)
        if len(terms) == 1 and terms[0].labels == keep:
            result = terms[0].tensor
        elif not terms:
            result = self.const(np.ones(()))
        else:
            result = self.einsum(terms, keep)
        factor = scale * count
        return result if factor == 1 else result * float(factor)

    def to_operand(self, k: int, factors: Sequence[Factor], scale: float = 1.0) -> Tensor:
        """The adjoint of operand ``k``: ``factors`` contracted onto its labels, then shaped
        as the operand (size-1 dims where it was broadcast, values on the diagonal of a
        repeated label)."""
        labels, squeezed = self.operands[k].labels, self.squeezed[k]
        keep = "".join(dict.fromkeys(lab for lab, sq in zip(labels, squeezed) if not sq))
        result = self.contract(factors, keep, scale)
        dtype = self.node.operands[k].dtype
        if keep != labels:
            result = self._shape_as(k, result, keep)
        return result if result.dtype == dtype else result.astype(dtype)

    def _shape_as(self, k: int, result: Tensor, keep: str) -> Tensor:
        """``result`` over ``keep`` shaped as operand ``k``: size-1 dims where it was
        broadcast, values on the diagonal of a repeated label."""
        labels, squeezed = self.operands[k].labels, self.squeezed[k]
        terms, out, seen, used = [Factor(result, keep)], "", set(), labels
        for lab, sq in zip(labels, squeezed):
            if sq:
                extra = self.fresh(used)
                terms.append(Factor(self.const(np.ones(1)), extra))
            elif lab in seen:
                extra = self.fresh(used)
                terms.append(Factor(self.const(np.eye(self.sizes[lab])), lab + extra))
            else:
                seen.add(lab)
                extra = lab
            used += extra
            out += extra
        return self.einsum(terms, out)


def _unique(labels: str) -> str:
    return "".join(dict.fromkeys(labels))


def _einsum_adjoints(node: EinsumOp, g: Tensor, needs: list[int],
                     db: Any) -> dict[int, Tensor]:
    e = _Einsum.of(node, db)
    spec = node.spec
    grads: dict[int, Tensor] = {}
    out = Factor(g, e.output)
    if join_record(spec.join).update:
        raise UnsupportedError(f"no gradient flows through an optimizer's update "
                               f"(join {spec.join!r})")
    if spec.join == _J.MUL and spec.agg == _A.SUM:  # the classic rule, one einsum per operand
        for k in needs:
            others = [f for j, f in enumerate(e.operands) if j != k]
            grads[k] = e.to_operand(k, [out, *others])
        return grads
    if spec.agg not in BUILTIN_AGGS and spec.aggregated:
        raise GradientError(f"no gradient through the user's aggregation {spec.agg!r} (only "
                            f"through {', '.join(BUILTIN_AGGS)})")
    adjoint = _aggregate_adjoint(e, out)  # of the joined values, over all labels
    if join_record(spec.join).user:  # one call of the user's function: its partials
        for k in needs:
            partial = e.einsum(e.operands, e.every, join=_derivative(spec.join, k))
            grads[k] = e.to_operand(k, [*adjoint, Factor(partial, e.every)])
        return grads
    if spec.join == _J.WHERE:  # the adjoint where the branch is taken, 0 elsewhere
        cond = e.operands[0]
        true = cond.tensor.astype(e.dtype)
        picks = {1: Partial(gate=Factor(true.eq(0.0), cond.labels)),
                 2: Partial(gate=Factor(true.ne(0.0), cond.labels))}
        for k in needs:
            if k in picks:
                grads[k] = e.to_operand(k, picks[k].applied(e, adjoint))
        return grads
    if len(e.operands) == 1:
        return {0: e.to_operand(0, adjoint)}
    # the join folded left to right: prefix[j] = JOIN(x0 .. xj) over the labels seen so far
    prefix = [e.operands[0]]
    for j in range(1, len(e.operands)):
        labels = _unique(prefix[-1].labels + e.operands[j].labels)
        if j == len(e.operands) - 1 and not spec.aggregated:
            prefix.append(Factor(Tensor(node, db), e.output))  # the node itself
        else:
            prefix.append(Factor(e.einsum([prefix[-1], e.operands[j]], labels, join=spec.join),
                                 labels))
    scale = 1.0
    for j in range(len(e.operands) - 1, 0, -1):
        partials = _join_partials(e, spec.join, prefix[j - 1], e.operands[j], prefix[j])
        if j in needs:
            grads[j] = e.to_operand(j, partials.by_b.applied(e, adjoint),
                                    scale * partials.by_b.scale)
        adjoint = partials.by_a.applied(e, adjoint)
        scale *= partials.by_a.scale
    if 0 in needs:
        grads[0] = e.to_operand(0, adjoint, scale)
    return grads


def _derivative(join: str, k: int) -> str:
    """The join of d JOIN / d operand ``k`` (the user's adjoint, or ``torch.func``'s), tried on
    a small float64 probe first so a function torch cannot differentiate is a GradientError
    here, not a failure while the gradient runs."""
    name = derivative_join(join, k)
    record = join_record(join)
    probe = [torch.linspace(0.5, 1.5, 3, dtype=torch.float64)] * (record.arity or 2)
    try:
        value = join_record(name).apply(probe)
    except Exception as err:  # the user's function (or adjoint)
        raise GradientError(f"no gradient through join {join!r}: its derivative by operand "
                            f"{k} failed ({type(err).__name__}: {err})") from err
    if not isinstance(value, torch.Tensor) or value.shape != probe[0].shape:
        raise GradientError(f"no gradient through join {join!r}: its adjoint for operand {k} "
                            "is not an elementwise tensor")
    return name


def _joined(e: _Einsum) -> Factor:
    """The joined values over every label (before aggregation)."""
    if not e.node.spec.aggregated:
        return Factor(Tensor(e.node, e.db), e.output)
    return Factor(e.einsum(e.operands, e.every, join=e.node.spec.join), e.every)


def _aggregate_adjoint(e: _Einsum, out: Factor) -> list[Factor]:
    """Factors whose product is the adjoint of the joined values (over all labels)."""
    spec = e.node.spec
    if not spec.aggregated or spec.agg == _A.SUM:
        return [out]
    z = _joined(e)
    if spec.agg in (_A.MAX, _A.MIN):  # ties share the gradient evenly (torch.amax / amin)
        # the winners are found against the extremum of this z, not the node's value: z joins
        # the operands in another order than the forward's contraction, so with 3+ operands
        # its values may differ from the forward's in the last bit and match none of them
        extreme = Factor(e.einsum([z], e.output, agg=spec.agg), e.output)
        hit = Factor(e.einsum([z, extreme], e.every, join=_J.EQ).astype(e.dtype), e.every)
        count = e.einsum([hit], e.output)
        return [out, hit, Factor(count._map("rdiv", 1.0), e.output)]
    # prod: d/dz_i is the product of the others. P, the product of the nonzero values, has no
    # path to a zero (where, not z + [z == 0], so a gradient of this gradient is right); the
    # zeros enter through S, their sum (0, but with a path to each zero), so that:
    #   no zero: P / z_i;  one zero: P at it, P / z_i * S elsewhere;
    #   two zeros: P * (S - z_i), the other zero, at them, 0 elsewhere;  more: 0
    # (each branch is picked by where: an inf in a branch not taken is not multiplied by 0)
    every, output = e.every, e.output
    is_zero = Factor(z.tensor.eq(0.0), every)
    nonzero = Factor(where(is_zero.tensor, 1.0, z.tensor), every)
    product = Factor(e.einsum([nonzero], output, agg=_A.PROD), output)
    zeros = e.einsum([Factor(is_zero.tensor.astype(e.dtype), every)], output)
    zero_sum = Factor(e.einsum([Factor(where(is_zero.tensor, z.tensor, 0.0), every)], output),
                      output)
    one, nothing = Factor(e.const(np.ones(())), ""), Factor(e.const(np.zeros(())), "")

    def count_is(n: int) -> Factor:
        return Factor(zeros.eq(float(n)), output)

    def pick(cond: Factor, a: Factor, b: Factor, labels: str) -> Factor:
        return Factor(e.einsum([cond, a, b], labels, join=_J.WHERE), labels)

    other_zeros = Factor(e.einsum([zero_sum, z], every, join=_J.SUB), every)
    at_nonzero = e.einsum([product, Factor(nonzero.tensor._map("rdiv", 1.0), every),
                           pick(count_is(0), one,
                                pick(count_is(1), zero_sum, nothing, output), output)], every)
    at_zero = e.einsum([product, pick(count_is(1), one,
                                      pick(count_is(2), other_zeros, nothing, every), every)],
                       every)
    return [out, pick(is_zero, Factor(at_zero, every), Factor(at_nonzero, every), every)]


@dataclass(frozen=True)
class Partial:
    """A local derivative as a product: ``scale`` times the product of ``factors``; 0 --
    the adjoint dropped, not multiplied by 0, so an inf or NaN there does not become NaN --
    where ``gate`` holds (the branch of a ``where``, ``maximum`` or ``minimum`` not taken)."""

    factors: tuple[Factor, ...] = ()
    scale: float = 1.0
    gate: Factor | None = None

    def applied(self, e: _Einsum, adjoint: Sequence[Factor]) -> list[Factor]:
        """The factors of ``adjoint`` times this derivative (as one gated factor when
        gated)."""
        factors = [*adjoint, *self.factors]  # (the adjoint has a factor at least)
        if self.gate is None:
            return factors
        carried = "".join(lab for lab in e.every if any(lab in f.labels for f in factors))
        labels = "".join(lab for lab in e.every if lab in carried or lab in self.gate.labels)
        value = Factor(e.einsum(factors, carried), carried)
        return [Factor(_zero_where(e, [self.gate], value, labels), labels)]


@dataclass(frozen=True)
class JoinPartials:
    """The derivatives of one step of a join's fold, ``out = JOIN(a, b)``, by ``a`` and ``b``."""

    by_a: Partial
    by_b: Partial


def _join_partials(e: _Einsum, join: str, a: Factor, b: Factor,
                   out: Factor) -> JoinPartials:
    """d JOIN(a, b) / da and / db (the local derivatives of one step of the fold; ``out`` is
    its value), by the built-in join's rule in :data:`PARTIALS`."""
    rule = PARTIALS.get(join)
    if rule is None:  # pragma: no cover - bool joins carry no gradient
        raise GradientError(f"no gradient for join {join!r}")
    return rule(e, a, b, out)


def _add_partials(e: _Einsum, a: Factor, b: Factor, out: Factor) -> JoinPartials:
    return JoinPartials(Partial(), Partial())


def _sub_partials(e: _Einsum, a: Factor, b: Factor, out: Factor) -> JoinPartials:
    return JoinPartials(Partial(), Partial(scale=-1.0))


def _mul_partials(e: _Einsum, a: Factor, b: Factor, out: Factor) -> JoinPartials:
    return JoinPartials(Partial((b,)), Partial((a,)))


def _div_partials(e: _Einsum, a: Factor, b: Factor, out: Factor) -> JoinPartials:
    inverse = Factor(b.tensor._map("rdiv", 1.0), b.labels)
    return JoinPartials(Partial((inverse,)), Partial((out, inverse), -1.0))


def _floordiv_partials(e: _Einsum, a: Factor, b: Factor, out: Factor) -> JoinPartials:
    """``a // b`` is piecewise constant: 0 by either (where it is differentiable)."""
    return JoinPartials(Partial(scale=0.0), Partial(scale=0.0))


def _mod_partials(e: _Einsum, a: Factor, b: Factor, out: Factor) -> JoinPartials:
    """``a % b = a - b * floor(a / b)``: 1 by ``a``, ``-floor(a / b)`` by ``b`` (torch's
    ``remainder`` rule)."""
    quotient = Factor(e.einsum([a, b], out.labels, join=_J.FLOORDIV), out.labels)
    return JoinPartials(Partial(), Partial((quotient,), -1.0))


def _extreme_partials(wins: str):
    """torch.maximum / minimum (``wins``: gt / lt): the winner takes it, a tie gives each
    half, a NaN (no winner, no tie) each all of it, as torch's; the loser's adjoint is
    dropped (gated), not multiplied by 0."""
    def partials(e: _Einsum, a: Factor, b: Factor, out: Factor) -> JoinPartials:
        labels = out.labels
        tie = e.einsum([a, b], labels, join=_J.EQ).astype(e.dtype) * 0.5
        a_wins = e.einsum([a, b], labels, join=wins)
        b_wins = e.einsum([b, a], labels, join=wins)
        by_a = 1.0 - b_wins.astype(e.dtype) - tie
        by_b = 1.0 - a_wins.astype(e.dtype) - tie
        return JoinPartials(Partial((Factor(by_a, labels),), gate=Factor(b_wins, labels)),
                            Partial((Factor(by_b, labels),), gate=Factor(a_wins, labels)))

    return partials


def _pow_partials(e: _Einsum, a: Factor, b: Factor, out: Factor) -> JoinPartials:
    """As torch.pow: 0 where the exponent is 0 / where 0 ** (b >= 0)."""
    labels = out.labels
    lower = Factor(b.tensor - 1.0, b.labels)
    da = e.einsum([b, Factor(e.einsum([a, lower], labels, join=_J.POW), labels)], labels)
    da = _zero_where(e, [Factor(b.tensor.eq(0.0), b.labels)], da, labels)
    db_ = e.einsum([out, Factor(a.tensor.log(), a.labels)], labels)
    db_ = _zero_where(e, [Factor(a.tensor.eq(0.0), a.labels),
                          Factor(b.tensor >= 0.0, b.labels)], db_, labels)
    return JoinPartials(Partial((Factor(da, labels),)), Partial((Factor(db_, labels),)))


def _silu_grad_partials(e: _Einsum, a: Factor, b: Factor, out: Factor) -> JoinPartials:
    """``silu_grad(g, x) = g * silu'(x)``: ``silu'(x)`` by ``g``, ``g * silu''(x)`` by ``x``
    (``silu'(x) = s (1 + x (1 - s))``, ``silu''(x) = s (1 - s) (2 + x (1 - 2 s))``, ``s`` the
    sigmoid of ``x``): a gradient of a gradient through SiLU."""
    x = b.tensor
    s = x.sigmoid()
    first = s * (x * (1.0 - s) + 1.0)
    second = s * (1.0 - s) * (x * (1.0 - s * 2.0) + 2.0)
    return JoinPartials(Partial((Factor(first, b.labels),)),
                        Partial((a, Factor(second, b.labels))))


def _relu_grad_partials(e: _Einsum, a: Factor, b: Factor, out: Factor) -> JoinPartials:
    """``relu_grad(g, y)`` is ``g`` where ``y > 0``, else 0: that mask by ``g``, 0 by ``y``
    (piecewise constant in it)."""
    mask = (b.tensor > 0.0).astype(e.dtype)
    return JoinPartials(Partial((Factor(mask, b.labels),)), Partial(scale=0.0))


# the built-in joins' adjoints (one step of the fold); a user's join has its own adjoint or
# autograd's (tensorql.algebra.derivative_join), comparisons and where's condition none
PARTIALS = {
    _J.ADD: _add_partials,
    _J.SUB: _sub_partials,
    _J.MUL: _mul_partials,
    _J.DIV: _div_partials,
    _J.MAX: _extreme_partials(_J.GT),
    _J.MIN: _extreme_partials(_J.LT),
    _J.POW: _pow_partials,
    _J.FLOORDIV: _floordiv_partials,
    _J.MOD: _mod_partials,
    _J.SILU_GRAD: _silu_grad_partials,
    _J.RELU_GRAD: _relu_grad_partials,
}


def _zero_where(e: _Einsum, conditions: list[Factor], value: Tensor | Factor,
                labels: str) -> Tensor:
    """0 where every one of ``conditions`` holds, else ``value`` (a tensor over ``labels``,
    or a factor broadcast to them), so a NaN or inf of ``value`` there is dropped, not
    multiplied by 0."""
    cond = conditions[0] if len(conditions) == 1 else \
        Factor(e.einsum(conditions, labels, join=_J.MIN), labels)  # min of bools: and
    zero = Factor(e.const(np.zeros(())), "")
    value = value if isinstance(value, Factor) else Factor(value, labels)
    return e.einsum([cond, zero, value], labels, join=_J.WHERE)


def _labels(n: int) -> str:
    """``n`` distinct one-character labels.

    >>> _labels(3)
    'abc'
    """
    return "".join(get_symbol(k) for k in range(n))


# -- maps ------------------------------------------------------------------------------------
def _softmax_adjoint(node: SoftmaxOp, g: Tensor, db: Any) -> Tensor:
    """softmax: ``y * (g - sum(g * y))``; log_softmax: ``g - exp(y) * sum(g)`` (sums along
    the axis, broadcast back)."""
    from tensorql.api.einsum import einsum

    y = Tensor(node, db)
    # the sums broadcast back by label, not as a kept size-1 dim: a kept dim is a size-1
    # label the join sums over, which kept it out of the pointwise chain it feeds (the
    # attention's softmax gradient, y * (g - s) * scale, ran its subtraction as a pass of
    # its own over the probabilities)
    every = _labels(y.ndim)
    axis = node.axis % y.ndim
    rows = every[:axis] + every[axis + 1:]
    back = f"{every},{rows}->{every}"
    if node.log:
        return g - einsum(back, y.exp(), g.sum(axis=axis))
    return y * einsum(back, g, (g * y).sum(axis=axis), join=_J.SUB)


def _map_adjoint(node: MapOp, g: Tensor, db: Any) -> Tensor | None:
    x, out, dtype = Tensor(node.operand, db), Tensor(node, db), node.dtype
    fn, c = node.fn, node.scalar

    def step(cond: Tensor) -> Tensor:
        return cond.astype(dtype)

    if fn == "cast":
        return g.astype(x.dtype)
    if fn in ("shift",):
        return g
    if fn in ("neg", "rsub"):
        return -g
    if fn == "scale":
        return g * float(c)
    if fn == "exp":
        return g * out
    if fn == "log":
        return g / x
    if fn == "relu":  # relu(x) > 0 exactly where x > 0: read the output, as torch's
        # threshold_backward does (one kernel, the join relu_grad), so that x is read once
        # (its producer, a bias add, fuses with the relu instead of staying a step of its own)
        return broadcast_binary(g, out, _J.RELU_GRAD)
    if fn == "abs":
        return g * (step(x > 0.0) - step(x < 0.0))
    if fn == "sqrt":
        return (g / out) * 0.5
    if fn == "rsqrt":
        return g * (out * out * out) * -0.5
    if fn == "square":
        return g * x * 2.0
    if fn == "tanh":
        return g * (1.0 - out * out)
    if fn == "sigmoid":
        return g * out * (1.0 - out)
    if fn == "silu":  # one kernel, aten's silu_backward (see _silu_grad_partials)
        return broadcast_binary(g, x if x.dtype == dtype else x.astype(dtype), _J.SILU_GRAD)
    if fn == "rdiv":
        return -(g * out / x)
    if fn == "pow":
        if c == 0:
            return g * 0.0
        return g * x._map("pow", float(c) - 1.0) * float(c)
    if fn in ("maximum", "minimum"):  # g where x is kept (dropped, not times 0: an inf of
        # g there would be NaN)
        kept = x >= float(c) if fn == "maximum" else x <= float(c)
        return where(kept, g, 0.0)
    raise GradientError(f"no gradient for map {fn!r}")
