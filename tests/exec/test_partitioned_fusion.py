"""Fusion on several devices: the logical rewrite rules' Pointwise and Attention nodes are
partitioned like any operation, so an MLP with bias and activation and an attention block on
``devices=2`` run fused steps (named in EXPLAIN) and give one device's results."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq
from tensorql.models import attention, llama_block


def _fused_steps(expr) -> list[str]:
    return [s.name for s in expr.compile().physical.steps
            if s.name.startswith(("Pointwise", "Attention"))]


@pytest.mark.parametrize("devices", [2, 3])
def test_mlp_with_bias_and_activation_runs_fused(devices):
    rng = np.random.default_rng(5)
    x, w1 = rng.standard_normal((32, 48)), rng.standard_normal((48, 64))
    b1, w2, b2 = rng.standard_normal(64), rng.standard_normal((64, 24)), rng.standard_normal(24)
    arrays = [a.astype(np.float32) for a in (x, w1, b1, w2, b2)]
    want = np.maximum(arrays[0] @ arrays[1] + arrays[2], 0) @ arrays[3] + arrays[4]
    db = tq.connect(devices=devices)
    tx, tw1, tb1, tw2, tb2 = (db.from_numpy(n, a) for n, a in
                              zip(("x", "w1", "b1", "w2", "b2"), arrays))
    out = (tx @ tw1 + tb1).relu() @ tw2 + tb2
    assert "Pointwise relu <- add" in _fused_steps(out)
    text = out.explain()
    assert "Pointwise relu <- add" in text and "rewrite rules: fuse_pointwise" in text
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)
    one = tq.connect(devices="cpu")  # one device of the same kind as the partitioned run's
    ones = [one.from_numpy(n, a) for n, a in zip(("x", "w1", "b1", "w2", "b2"), arrays)]
    single = ((ones[0] @ ones[1] + ones[2]).relu() @ ones[3] + ones[4]).numpy()
    np.testing.assert_allclose(out.numpy(), single, rtol=1e-5, atol=1e-5)


def test_attention_block_runs_fused_on_two_devices():
    db = tq.connect(devices=2)
    w = attention(db, batch=2, seq=16, d_model=32, heads=2, head_dim=16, seed=3)
    steps = _fused_steps(w.output)
    assert any(name.startswith("Attention softmax over") for name in steps)
    text = w.output.explain()
    assert "Attention softmax over" in text and "match_attention" in text
    assert "Softmax" not in " ".join(s.name for s in w.output.compile().physical.steps)
    np.testing.assert_allclose(w.output.numpy(), w.reference(), rtol=1e-4, atol=1e-4)


def test_llama_block_runs_fused_on_two_devices_like_one():
    db = tq.connect(devices=2)
    w = llama_block(db, batch=1, seq=16, d_model=32, heads=2, head_dim=16, d_ff=48, seed=4)
    steps = _fused_steps(w.output)
    assert any(name.startswith("Attention") for name in steps)
    assert any(name.startswith("Pointwise") for name in steps)
    got = torch.from_numpy(w.output.numpy())
    torch.testing.assert_close(got, torch.from_numpy(w.reference()), rtol=1e-4, atol=1e-4)


def test_a_partitioned_attention_never_cuts_keys_or_head_dims():
    db = tq.connect(devices=4)
    w = attention(db, batch=2, seq=16, d_model=32, heads=2, head_dim=16, seed=3)
    plan = w.output.compile().partition
    op = next(op for op in plan.ops if op.kind == "attention")
    node = plan.graph.nodes[op.index]
    for label in node.whole:
        assert op.pieces[op.labels.index(label)] == 1
    np.testing.assert_allclose(w.output.numpy(), w.reference(), rtol=1e-4, atol=1e-4)
