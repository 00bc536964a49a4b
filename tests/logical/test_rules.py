"""The logical rewrite rules: a plain tuple of one-module rules, each returning the very node
it was given when nothing matches (so the rules are idempotent), never fusing a node that
something else reads; EXPLAIN names the rules that fired, in the logical stage and the
physical header; the rewritten plan computes what the plan as lowered does (oracle: numpy)."""

from __future__ import annotations

import importlib

import numpy as np

import tensorql as tq
from tensorql.logical.lower import lower, lower_many
from tensorql.logical.plan import Attention, Pointwise, walk
from tensorql.logical.rules import RULES, rewrite
from tensorql.models import attention
from tensorql.pipeline import CompiledGroup


def test_rules_are_a_plain_tuple_of_documented_one_module_functions():
    assert isinstance(RULES, tuple) and len(RULES) >= 2
    for rule in RULES:
        module = importlib.import_module(rule.__module__)
        assert module.NAME == rule.__name__
        assert ">>>" in (module.__doc__ or "")  # a doctest each


def test_no_match_returns_the_same_node_and_rules_are_idempotent():
    db = tq.connect()
    a = db.from_numpy("a", np.ones((4, 6), np.float32))
    b = db.from_numpy("b", np.ones((6, 3), np.float32))
    plain = lower((a @ b).node)
    assert all(rule(plain) is plain for rule in RULES)
    assert rewrite([plain]).fired == ()
    fused = rewrite([lower(((a * 2.0).exp() - a).relu().node)])
    assert fused.fired == ("fuse_pointwise",)
    again = rewrite(list(fused.roots))
    assert again.roots[0] is fused.roots[0] and again.fired == ()


def test_a_node_read_twice_is_not_fused_away():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 5)).astype(np.float32)
    db = tq.connect()
    a = db.from_numpy("a", x)
    e = a.exp()
    expr = (e.relu() + e * 2.0)  # e is read by two maps: it stays a step of its own
    root = rewrite([lower(expr.node)]).roots[0]
    chains = [n for n in walk(root) if isinstance(n, Pointwise)]
    assert chains and all(len(c.ops) >= 2 for c in chains)
    assert any(n for n in walk(root) if getattr(n, "fn", None) == "exp")
    np.testing.assert_allclose(expr.numpy(), np.maximum(np.exp(x), 0) + np.exp(x) * 2,
                               rtol=1e-6)


def test_explain_names_the_rules_that_fired():
    db = tq.connect()
    w = attention(db, batch=1, seq=8, d_model=16, heads=2, head_dim=8, seed=2)
    logical = w.output.explain(stage="logical")
    assert "[rule match_attention]" in logical
    physical = w.output.explain(stage="physical")
    assert "rewrite rules: match_attention" in physical
    root = w.output.compile().physical.root
    assert any(isinstance(n, Attention) for n in walk(root))
    np.testing.assert_allclose(w.output.numpy(), w.reference(), rtol=1e-4, atol=1e-5)


def test_several_results_are_rewritten_together():
    db = tq.connect()
    a = db.from_numpy("a", np.arange(12, dtype=np.float32).reshape(3, 4))
    shared = a.exp()
    first, second = (shared * 2.0).relu(), shared.sum(axis=1)
    done = rewrite(lower_many([first.node, second.node]))
    assert len(done.roots) == 2
    # shared has two readers (one of them outside any chain): it is not fused into first,
    # whose scale and relu are
    nodes = walk(*done.roots)
    assert not any(isinstance(n, Pointwise) and any(op.fn == "exp" for op in n.ops)
                   for n in nodes)
    assert isinstance(done.roots[0], Pointwise)
    group = CompiledGroup.compile([first.node, second.node], db)
    got = group.run()
    x = np.exp(np.arange(12, dtype=np.float32).reshape(3, 4))
    np.testing.assert_allclose(got[0].numpy(), np.maximum(x * 2, 0), rtol=1e-6)
    np.testing.assert_allclose(got[1].numpy(), x.sum(axis=1), rtol=1e-6)


def _scalar_rule_fired(expr) -> bool:
    return "scalar_out_of_sum" in rewrite([lower(expr.node)]).fired


def test_a_scalar_factor_moves_past_its_contraction():
    """``(Y / s) @ C``, ``(s * Y) @ C``, ``(Y * s) @ C`` and ``C @ (Y / s)`` for ``s`` of no
    dims become ``(Y @ C) <op> s``: the rule fires, applying it again changes nothing, and
    the results are numpy's."""
    rng = np.random.default_rng(11)
    y, c = (rng.standard_normal(shape).astype(np.float32) for shape in ((12, 8), (8, 5)))
    w = rng.standard_normal((3, 12)).astype(np.float32)
    db = tq.connect(devices="cpu")
    Y = db.from_numpy("y", y, tile=(4, 4))
    C = db.from_numpy("c", c, tile=(4, 5))
    W = db.from_numpy("w", w, tile=(3, 4))
    m = y.astype(np.float64).max()
    cases = [((Y / Y.max()) @ C, (y / m) @ c),
             ((Y.max() * Y) @ C, (m * y) @ c),
             ((Y * Y.max()) @ C, (y * m) @ c),
             (W @ (Y / Y.max()), w @ (y / m))]
    for expr, want in cases:
        done = rewrite([lower(expr.node)])
        assert "scalar_out_of_sum" in done.fired
        again = rewrite(list(done.roots), rules=[r for r in RULES
                                                 if r.__name__ == "scalar_out_of_sum"])
        assert again.fired == ()
        np.testing.assert_allclose(expr.numpy(), want, rtol=1e-5, atol=1e-6)


def test_a_scaled_operand_read_elsewhere_or_a_non_scalar_divisor_is_left_alone():
    rng = np.random.default_rng(12)
    y, z, c = (rng.standard_normal(shape).astype(np.float32)
               for shape in ((6, 4), (6, 4), (4, 3)))
    db = tq.connect(devices="cpu")
    Y, Z, C = db.from_numpy("y", y), db.from_numpy("z", z), db.from_numpy("c", c)
    scaled = Y / Y.max()
    read_twice = (scaled @ C).sum() + scaled.sum()  # the scaled Y is itself needed
    m = y.astype(np.float64).max()
    for expr, want in [((Y / Z) @ C, (y / z) @ c),                  # not a scalar
                       ((Y.max() / Y) @ C, (m / y) @ c),            # the scalar over Y
                       (read_twice, ((y / m) @ c).sum() + (y / m).sum())]:
        assert not _scalar_rule_fired(expr)
        np.testing.assert_allclose(expr.numpy(), want, rtol=1e-5, atol=1e-5)
