"""Attention chains, softmax(q . k [+ mask]) . v, run as one fused step: results match torch
with and without a mask, with grouped-query heads, a mask that varies per batch row, and
queries cut into several chunks; chains whose intermediates are read elsewhere, or a
log-softmax, are left as separate steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq
import tensorql.logical.lower as lower_module
import tensorql.physical.attention as attention_module
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


def _causal(s, t):
    return np.triu(np.full((s, t), -1e9, dtype=np.float32), t - s + 1)


def _reference(q, k, v, mask):
    scores = torch.einsum("bhse,bhte->bhst", *map(torch.from_numpy, (q, k)))
    return torch.softmax(scores + torch.from_numpy(mask), -1) @ torch.from_numpy(v)


def test_keys_in_several_chunks_are_one_step_and_hidden_blocks_are_left_out():
    """Keys, values and mask cut along the keys (as a prompt cut into row blocks makes them):
    still one fused step, each task reading every key block; under a causal mask a query
    block skips the key blocks after it, and the result is the same."""
    rng = np.random.default_rng(14)
    db = tq.connect()
    b, h, s, e = 1, 2, 96, 8
    q, k, v = _data(rng, b, h, s, e), _data(rng, b, h, s, e), _data(rng, b, h, s, e)
    tile = (1, 1, 32, e)
    scores = einsum("bhse,bhte->bhst", db.constant(q, tile=tile), db.constant(k, tile=tile))
    scores = scores + db.constant(_causal(s, s), tile=(32, 32))
    out = einsum("bhst,bhte->bhse", scores.softmax(-1), db.constant(v, tile=tile))
    plan = out.compile().physical
    assert not any(step.name.startswith("Softmax") for step in plan.steps)
    (fused,) = [step for step in plan.steps if step.name.startswith("Attention")]
    assert len(fused.tasks) == b * h * 3
    kernel = fused.tasks[0].kernel
    assert kernel.key_blocks == 3 and len(fused.tasks[0].inputs) == 1 + 3 * 3
    masks = [torch.from_numpy(_causal(s, s)[32 * n:32 * n + 32, 32 * m:32 * m + 32])
             for n in range(3) for m in range(3)]
    assert [kernel._seen(masks[3 * n:3 * n + 3]) for n in range(3)] == [[0], [0, 1], [0, 1, 2]]
    torch.testing.assert_close(out.torch(), _reference(q, k, v, _causal(s, s)),
                               rtol=1e-5, atol=1e-5)


def test_a_query_row_hidden_everywhere_keeps_every_key_block():
    """A query row masked out entirely gets torch's answer (the mean of the values, every key
    weighing alike), so no key block may be left out of its chunk."""
    rng = np.random.default_rng(15)
    db = tq.connect()
    b, h, s, e = 1, 1, 64, 4
    q, k, v = _data(rng, b, h, s, e), _data(rng, b, h, s, e), _data(rng, b, h, s, e)
    mask = _causal(s, s)
    mask[3, :] = -1e9  # row 3 sees nothing
    tile = (1, 1, 32, e)
    scores = einsum("bhse,bhte->bhst", db.constant(q, tile=tile), db.constant(k, tile=tile))
    scores = scores + db.constant(mask, tile=(32, 32))
    out = einsum("bhst,bhte->bhse", scores.softmax(-1), db.constant(v, tile=tile))
    (fused,) = [step for step in out.compile().physical.steps
                if step.name.startswith("Attention")]
    kernel = fused.tasks[0].kernel
    assert kernel._seen([torch.from_numpy(mask[:32, :32]),
                         torch.from_numpy(mask[:32, 32:])]) == [0, 1]
    torch.testing.assert_close(out.torch(), _reference(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_queries_on_other_tiles_than_the_output_are_retiled_into_the_step(monkeypatch):
    """The output's query blocks (set by the softmax's tiles, here cut to chunks of at most
    1024 elements) differ from q's: q is cut to the output's blocks first (a Rekey step) and
    the chain still runs fused."""
    monkeypatch.setattr(lower_module, "SOFTMAX_CHUNK_ELEMS", 1024)
    rng = np.random.default_rng(16)
    db = tq.connect()
    b, h, s, e = 1, 2, 64, 8
    q, k, v = _data(rng, b, h, s, e), _data(rng, b, h, s, e), _data(rng, b, h, s, e)
    queries = db.constant(q, tile=(1, 1, 64, e)) * 2.0  # computed: retiled by a copy
    scores = einsum("bhse,bhte->bhst", queries, db.constant(k, tile=(1, 1, 16, e)))
    probs = (scores + db.constant(_causal(s, s), tile=(16, 64))).softmax(-1)
    out = einsum("bhst,bhte->bhse", probs, db.constant(v, tile=(1, 1, 16, e)))
    steps = out.compile().physical.steps
    fused = [step for step in steps if step.name.startswith("Attention")]
    assert len(fused) == 1 and not any(step.name.startswith("Softmax") for step in steps)
    assert len(fused[0].tasks) == b * h * (s // 16)  # the output's query blocks
    q_ref = fused[0].tasks[0].inputs[0]
    assert steps[q_ref.step].name.startswith("Rekey")
    torch.testing.assert_close(out.torch(), _reference(2 * q, k, v, _causal(s, s)),
                               rtol=1e-5, atol=1e-5)


def test_query_runs_attend_to_the_keys_they_see_and_a_written_mask_is_read_again(monkeypatch):
    """A chunk of more than SUB_ROWS query positions under a causal mask attends in runs of
    SUB_ROWS positions, each over the keys up to its last query (key_ends): the same result
    as torch's. A run with a query that sees nothing keeps every key. The mask's layout is
    kept between runs of the plan and worked out again once the mask is written in place."""
    rng = np.random.default_rng(17)
    db = tq.connect()
    b, h, s, e = 1, 2, 3 * attention_module.SUB_ROWS, 8
    q, k, v = _data(rng, b, h, s, e), _data(rng, b, h, s, e), _data(rng, b, h, s, e)
    mask = _causal(s, s)
    assert attention_module.key_ends(torch.from_numpy(mask)) == (64, 128, 192)
    hidden = mask.copy()
    hidden[70, :] = -1e9  # a query of the second run sees nothing: that run keeps every key
    assert attention_module.key_ends(torch.from_numpy(hidden)) == (64, 192, 192)
    assert attention_module.key_ends(torch.zeros(s, s)) is None
    mask_const = db.constant(mask)
    scores = einsum("bhse,bhte->bhst", db.constant(q), db.constant(k)) + mask_const
    out = einsum("bhst,bhte->bhse", scores.softmax(-1), db.constant(v))
    compiled = out.compile()
    (fused,) = [step for step in compiled.physical.steps if step.name.startswith("Attention")]
    assert len(fused.tasks) == 1  # one chunk of every position: the runs are within the task
    keys_read = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(query, key, value, **kwargs):
        keys_read.append(key.shape[2])
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    torch.testing.assert_close(compiled.run().dense(), _reference(q, k, v, mask),
                               rtol=1e-5, atol=1e-5)
    assert keys_read == [64, 128, 192]
    mask_const.node.value.copy_(torch.from_numpy(hidden))  # written in place: read again
    torch.testing.assert_close(compiled.run().dense(), _reference(q, k, v, hidden),
                               rtol=1e-5, atol=1e-5)
    assert keys_read[3:] == [64, 192, 192]


def test_a_mask_made_under_inference_mode_is_read_every_run():
    """An inference tensor has no version counter: its layout is not kept (worked out every
    run), and a query over it runs under torch.inference_mode."""
    rng = np.random.default_rng(18)
    b, h, s, e = 1, 1, 2 * attention_module.SUB_ROWS, 4
    q, k, v = _data(rng, b, h, s, e), _data(rng, b, h, s, e), _data(rng, b, h, s, e)
    with torch.inference_mode():
        db = tq.connect()
        mask = torch.from_numpy(_causal(s, s))
        assert mask.is_inference()
        scores = einsum("bhse,bhte->bhst", db.constant(q), db.constant(k)) + db.constant(mask)
        out = einsum("bhst,bhte->bhse", scores.softmax(-1), db.constant(v))
        got = out.torch()
    torch.testing.assert_close(got, _reference(q, k, v, _causal(s, s)), rtol=1e-5, atol=1e-5)
