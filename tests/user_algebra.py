"""Random extended einsums and random elementwise functions for the user-defined join and
aggregation tests: one small expression grammar rendered three ways -- a torch function (the
join given to tensorql and the autograd oracle), a numpy function (the value oracle) and a
DuckDB lambda (the SQL face) -- and a numpy definition of the extended einsum with any join.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from tensorql.einsum.spec import EinsumSpec

PARAMS = "abc"
UNARY = ("exp", "neg", "abs", "tanh", "sqrt")
BINARY = ("+", "-", "*", "max", "min", "div")


@dataclass(frozen=True)
class Expr:
    """A node of the grammar: a parameter, a constant, or an operator over sub-expressions."""

    op: str
    args: tuple[Expr, ...] = ()
    value: float | str = 0.0

    def torch(self, env: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._eval(env, torch_ops)

    def numpy(self, env: dict[str, np.ndarray]) -> np.ndarray:
        return self._eval(env, numpy_ops)

    def _eval(self, env, ops):
        if self.op == "param":
            return env[self.value]
        if self.op == "const":
            return self.value
        return ops[self.op](*[arg._eval(env, ops) for arg in self.args])

    def sql(self) -> str:
        if self.op == "param":
            return str(self.value)
        if self.op == "const":
            return repr(self.value)
        x = [arg.sql() for arg in self.args]
        if self.op in ("+", "-", "*"):
            return f"({x[0]} {self.op} {x[1]})"
        if self.op == "neg":
            return f"(-{x[0]})"
        if self.op == "max":
            return f"greatest({x[0]}, {x[1]})"
        if self.op == "min":
            return f"least({x[0]}, {x[1]})"
        if self.op == "div":
            return f"({x[0]} / (abs({x[1]}) + 1.0))"
        if self.op == "sqrt":
            return f"sqrt(abs({x[0]}) + 0.25)"
        return f"{self.op}({x[0]})"


def _t(x):
    """A constant of the grammar as a float64 tensor (tensors as they are)."""
    return x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float64)


torch_ops = {
    "exp": lambda x: torch.exp(_t(x)), "neg": lambda x: torch.neg(_t(x)),
    "abs": lambda x: torch.abs(_t(x)), "tanh": lambda x: torch.tanh(_t(x)),
    "sqrt": lambda x: torch.sqrt(torch.abs(_t(x)) + 0.25),
    "+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y,
    "max": lambda x, y: torch.maximum(_t(x), _t(y)),
    "min": lambda x, y: torch.minimum(_t(x), _t(y)),
    "div": lambda x, y: x / (torch.abs(_t(y)) + 1.0),
}
numpy_ops = {
    "exp": np.exp, "neg": np.negative, "abs": np.abs, "tanh": np.tanh,
    "sqrt": lambda x: np.sqrt(np.abs(x) + 0.25),
    "+": np.add, "-": np.subtract, "*": np.multiply, "max": np.maximum, "min": np.minimum,
    "div": lambda x, y: x / (np.abs(y) + 1.0),
}


def random_expr(r: random.Random, arity: int, depth: int = 2) -> Expr:
    """A random expression over the first ``arity`` parameters, each used at least once."""
    params = [Expr("param", value=p) for p in PARAMS[:arity]]

    def grow(d: int) -> Expr:
        if d == 0 or r.random() < 0.3:
            if r.random() < 0.15:
                return Expr("const", value=r.choice((0.5, 2.0)))
            return r.choice(params)
        if r.random() < 0.35:
            return Expr(r.choice(UNARY), (grow(d - 1),))
        return Expr(r.choice(BINARY), (grow(d - 1), grow(d - 1)))

    expr = grow(depth)
    for p in params:  # every operand takes part
        if f"'{p.value}'" not in repr(expr):
            expr = Expr(r.choice(("+", "*", "max")), (expr, p))
    return expr


def torch_fn(expr: Expr, arity: int):
    """``expr`` as a torch function of ``arity`` positional tensors."""
    if arity == 1:
        return lambda a: expr.torch({"a": a})
    if arity == 2:
        return lambda a, b: expr.torch({"a": a, "b": b})
    return lambda a, b, c: expr.torch({"a": a, "b": b, "c": c})


def numpy_fn(expr: Expr):
    return lambda *xs: expr.numpy(dict(zip(PARAMS, xs)))


def random_spec(r: random.Random, operands: int) -> tuple[str, list[tuple[int, ...]]]:
    """A random equation over ``operands`` operands (distinct labels within each, 1..3 of
    them from 'ijkl', sizes 1..4) and the operands' shapes."""
    sizes = {lab: r.randint(1, 4) for lab in "ijkl"}
    terms = ["".join(r.sample("ijkl", r.randint(1, 3))) for _ in range(operands)]
    used = list(dict.fromkeys("".join(terms)))
    out = r.sample(used, r.randint(0, len(used)))
    shapes = [tuple(sizes[lab] for lab in term) for term in terms]
    return ",".join(terms) + "->" + "".join(out), shapes


def broadcast_views(equation: str, arrays, xp=np):
    """Each operand as a view over all labels (output labels first), sizes 1 where absent;
    the joint shape; the number of output labels."""
    spec = EinsumSpec.parse(equation, [tuple(a.shape) for a in arrays])
    joint = list(spec.output) + list(spec.aggregated)
    views = []
    for array, labels in zip(arrays, spec.inputs):
        order = sorted(range(len(labels)), key=lambda d: joint.index(labels[d]))
        view = array.transpose(order) if xp is np else array.permute(order)
        views.append(view.reshape([spec.sizes[lab] if lab in labels else 1 for lab in joint]))
    return views, [spec.sizes[lab] for lab in joint], len(spec.output)


def numpy_extended(equation: str, arrays, join, reduce) -> np.ndarray:
    """``out = reduce over aggregated labels of join(operands broadcast)``; ``reduce(x,
    axes)`` gets the aggregated axes (the trailing ones)."""
    views, shape, n_out = broadcast_views(equation, arrays)
    value = np.broadcast_to(join(*views), shape)
    axes = tuple(range(n_out, len(shape)))
    return reduce(value, axes) if axes else np.array(value)


def torch_extended(equation: str, tensors, join, agg: str):
    views, shape, n_out = broadcast_views(equation, tensors, xp=torch)
    value = join(*views).expand(shape)
    axes = tuple(range(n_out, len(shape)))
    if not axes:
        return value
    return {"sum": lambda: value.sum(dim=axes), "max": lambda: value.amax(dim=axes),
            "min": lambda: value.amin(dim=axes)}[agg]()


NUMPY_AGG = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}
