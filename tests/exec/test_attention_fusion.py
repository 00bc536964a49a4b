"""Attention chains, softmax(q . k [+ mask]) . v, run as one fused step: results match torch
with and without a mask, with grouped-query heads, a mask that varies per batch row, and
queries cut into several chunks; chains whose intermediates are read elsewhere, or a
log-softmax, are left as separate steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq
from tensorql.api.einsum import einsum
from tensorql.models import attention, llama_block


def _step_names(expr):
    return [step.name for step in expr.compile().physical.steps]


def _data(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("masked", [False, True])
def test_grouped_query_attention_matches_torch(masked):
    rng = np.random.default_rng(11)
    db = tq.connect()
    b, s, t, kv, g, e = 2, 6, 6, 2, 3, 4
    q, k, v = _data(rng, b, s, kv, g, e), _data(rng, b, t, kv, e), _data(rng, b, t, kv, e)
    mask = np.triu(np.full((s, t), -1e9, dtype=np.float32), 1)
    scores = einsum("bskge,btke->bkgst", db.constant(q), db.constant(k))
    if masked:
        scores = scores + db.constant(mask)
    out = einsum("bkgst,btke->bskge", scores.softmax(-1), db.constant(v))
    assert any(name.startswith("Attention softmax over") for name in _step_names(out))
    assert not any(name.startswith("Softmax") for name in _step_names(out))
    want_scores = torch.einsum("bskge,btke->bkgst", *map(torch.from_numpy, (q, k)))
    if masked:
        want_scores = want_scores + torch.from_numpy(mask)
    want = torch.einsum("bkgst,btke->bskge", want_scores.softmax(-1), torch.from_numpy(v))
    torch.testing.assert_close(out.torch(), want, rtol=1e-5, atol=1e-5)


def test_a_mask_per_batch_row_and_queries_in_several_chunks():
    rng = np.random.default_rng(12)
    db = tq.connect(tile_target_elems=4096)
    b, s, t, h, e = 2, 128, 64, 2, 64
    q = db.from_numpy("q", _data(rng, b, h, s, e), tile=(1, 1, 32, e))
    k = db.from_numpy("k", _data(rng, b, h, t, e), tile=(1, 1, t, e))
    v = db.from_numpy("v", _data(rng, b, h, t, e), tile=(1, 1, t, e))
    pad = np.zeros((b, h, s, t), dtype=np.float32)
    pad[1, :, :, 40:] = -1e9  # the second row's last keys are padding
    mask = db.from_numpy("mask", pad, tile=(1, 1, 32, t))
    scores = einsum("bhse,bhte->bhst", q, k) + mask
    out = einsum("bhst,bhte->bhse", scores.softmax(-1), v)
    plan = out.compile().physical
    fused = [step for step in plan.steps if step.name.startswith("Attention")]
    assert len(fused) == 1 and len(fused[0].tasks) == b * h * (s // 32)
    qt, kt, vt = (torch.from_numpy(np.asarray(x.numpy())) for x in (q, k, v))
    want = torch.softmax(qt @ kt.transpose(-1, -2) + torch.from_numpy(pad), -1) @ vt
    torch.testing.assert_close(out.torch(), want, rtol=1e-5, atol=1e-5)


def test_workloads_fuse_and_match_their_references():
    db = tq.connect()
    for work in (attention(db, batch=2, seq=8, d_model=12, heads=3, head_dim=4),
                 llama_block(db, batch=2, seq=8, d_model=12, heads=3, head_dim=4, d_ff=20)):
        assert any(n.startswith("Attention") for n in _step_names(work.output))
        np.testing.assert_allclose(work.output.numpy(), np.asarray(work.reference()),
                                   rtol=1e-4, atol=1e-4)


def test_chains_that_must_stay_apart_are_not_fused():
    rng = np.random.default_rng(13)
    db = tq.connect()
    q, k, v = (db.constant(_data(rng, 4, 5)) for _ in range(3))
    probs = einsum("se,te->st", q, k).softmax(-1)
    both = einsum("st,te->se", probs, v) + einsum("st->s", probs)[:, None]  # probs read twice
    assert not any(n.startswith("Attention") for n in _step_names(both))
    logsm = einsum("st,te->se", einsum("se,te->st", q, k).log_softmax(-1), v)
    assert not any(n.startswith("Attention") for n in _step_names(logsm))
    want = (torch.softmax(q.torch() @ k.torch().T, -1) @ v.torch()
            + torch.softmax(q.torch() @ k.torch().T, -1).sum(-1, keepdim=True))
    torch.testing.assert_close(both.torch(), want, rtol=1e-5, atol=1e-5)
