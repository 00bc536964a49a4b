"""User-defined aggregations (``tq.register_agg``) against numpy, on one device and on three:
a fold of a binary function (absmax, logsumexp), a torch reduction (an L2 norm), and one that
is not associative (kept whole: never cut into partials); bad functions are clear errors."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorql as tq
from tests.user_algebra import numpy_extended, numpy_fn, random_expr, random_spec, torch_fn

ABSMAX = tq.register_agg("t_absmax", lambda a, b: torch.maximum(a.abs(), b.abs()),
                         identity=0.0)
LSE = tq.register_agg("t_lse", torch.logaddexp, identity=-math.inf)
L2 = tq.register_agg("t_l2", reduce=lambda x, dim: torch.linalg.vector_norm(x, dim=dim),
                     identity=0.0)
PAIRAVG = tq.register_agg("t_pairavg", lambda a, b: (a + b) / 2, identity=0.0,
                          associative=False)


def _fold_in_order(x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """The left fold ``(acc + v) / 2`` from 0 over the aggregated axes in row-major order."""
    flat = x.reshape(*x.shape[: len(x.shape) - len(axes)], -1)
    acc = np.zeros(flat.shape[:-1])
    for k in range(flat.shape[-1]):
        acc = (acc + flat[..., k]) / 2
    return acc


NUMPY = {
    ABSMAX: lambda x, axes: np.abs(x).max(axis=axes, initial=0.0),
    LSE: lambda x, axes: np.log(np.exp(x).sum(axis=axes)),
    L2: lambda x, axes: np.sqrt((x * x).sum(axis=axes)),
    PAIRAVG: _fold_in_order,
}



@pytest.mark.parametrize("agg", [ABSMAX, LSE, L2, PAIRAVG])
def test_each_user_agg_against_numpy_on_one_and_three_devices(db1, db3, agg):
    rng = np.random.default_rng(5)
    a, b = rng.uniform(-1.5, 1.5, (5, 7)), rng.uniform(-1.5, 1.5, (7, 6))
    for db in (db1, db3):
        A = db.from_numpy("aa", a, tile=(2, 2), replace=True)
        B = db.from_numpy("ab", b, tile=(2, 2), replace=True)
        got = tq.einsum("ij,jk->ik", A, B, agg=agg).numpy()
        want = numpy_extended("ij,jk->ik", [a, b], np.multiply, NUMPY[agg])
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
        whole = tq.einsum("ij->", A, agg=agg).numpy()  # every label aggregated
        np.testing.assert_allclose(whole, NUMPY[agg](a, (0, 1)), rtol=1e-9, atol=1e-12)


def test_a_non_associative_agg_is_never_cut(db3):
    A = db3.from_numpy("na", np.ones((4, 16)), tile=(2, 2), replace=True)
    plan = tq.einsum("ij->i", A, agg=PAIRAVG).explain(stage="partition")
    assert "Aggregate t_pairavg over [j]  pieces i:" in plan and " j:1 " in plan, plan
    x = np.random.default_rng(2).uniform(0, 1, (4, 16))
    X = db3.from_numpy("nx", x, tile=(1, 2), replace=True)
    np.testing.assert_allclose(tq.einsum("ij->i", X, agg=PAIRAVG).numpy(),
                               _fold_in_order(x, (1,)), rtol=1e-12)


@settings(max_examples=15, derandomize=True, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_random_specs_lambdas_and_user_aggs(db1, db3, seed):
    r = random.Random(seed)
    arity = r.choice((1, 2, 3))
    equation, shapes = random_spec(r, arity)
    expr = random_expr(r, arity)
    agg = r.choice(sorted(NUMPY))
    for db in (db1, db3):
        arrays = [np.random.default_rng(r.randint(0, 2**31)).uniform(0.5, 1.5, s)
                  for s in shapes]
        tensors = [db.from_numpy(f"r{k}", x, tile=tuple(max(1, min(2, n)) for n in x.shape),
                                 replace=True) for k, x in enumerate(arrays)]
        got = tq.einsum(equation, *tensors, join=torch_fn(expr, arity), agg=agg).numpy()
        want = numpy_extended(equation, arrays, numpy_fn(expr), NUMPY[agg])
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12,
                                   err_msg=f"{equation} join={expr.sql()} agg={agg}")


def test_bad_aggregations_are_clear_errors(db1):
    with pytest.raises(tq.AggFunctionError, match="commutative"):
        tq.register_agg("t_minus", lambda a, b: a - b, identity=0.0)
    with pytest.raises(tq.AggFunctionError, match="not associative"):
        tq.register_agg("t_avg_assoc", lambda a, b: (a + b) / 2, identity=0.0)
    with pytest.raises(tq.AggFunctionError, match="elementwise"):
        tq.register_agg("t_total", lambda a, b: (a + b).sum(), identity=0.0)
    with pytest.raises(tq.AggFunctionError, match="two operands"):
        tq.register_agg("t_unary", lambda a: a, identity=0.0)
    with pytest.raises(tq.AggFunctionError, match="raised"):
        tq.register_agg("t_raises", lambda a, b: math.fsum([a, b]), identity=0.0)
    with pytest.raises(tq.AggFunctionError, match="in place"):
        tq.register_agg("t_inplace", lambda a, b: a.add_(b), identity=0.0)
    with pytest.raises(tq.AggFunctionError, match="built in"):
        tq.register_agg("sum", torch.add, identity=0.0)
    with pytest.raises(tq.AggFunctionError, match="identity"):
        tq.register_agg("t_noid", torch.add, identity=None)
    with pytest.raises(tq.AggFunctionError, match="reduce"):
        tq.register_agg("t_badreduce", reduce=lambda x, dim: x, identity=0.0)
    A = db1.from_numpy("ua", np.ones((2, 2)), replace=True)
    with pytest.raises(tq.UnknownOperatorError, match="unknown agg 'nope'.*t_absmax"):
        tq.einsum("ij->i", A, agg="nope")
    with pytest.raises(tq.GradientError, match="t_absmax"):
        tq.grad(tq.einsum("ij->", A, agg=ABSMAX), [A])
