"""A prompt's rotary tables and causal mask are made once for all its layers
(``Llama._prompt_tables``): the same arrays for the same positions, made anew for others,
equal to ``rope_tables`` and the causal mask computed directly; logits of prompts of
alternating lengths equal those of a fresh model (no memo)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq
from tensorql.models import Llama
from tensorql.models.llama import MASK_VALUE, LlamaShape, query_rope_tables, rope_tables

SHAPE = LlamaShape(vocab=11, d_model=8, d_ff=12, layers=2, heads=2, kv_heads=1, head_dim=4)


def test_tables_are_made_once_per_positions_and_match_a_direct_computation():
    model = Llama.random(tq.connect(), SHAPE, seed=0)
    first = model._prompt_tables(range(5))
    assert model._prompt_tables([0, 1, 2, 3, 4]) is first
    tables, query, mask = first
    want = rope_tables(SHAPE, range(5))
    for got, ref in zip(tables + query, want + query_rope_tables(SHAPE, want)):
        np.testing.assert_array_equal(got, ref)
    expected = np.triu(np.full((5, 5), MASK_VALUE, np.float32), k=1)
    np.testing.assert_array_equal(mask, expected)
    other = model._prompt_tables(range(3))
    assert other is not first and other[2].shape == (3, 3)
    assert model._prompt_tables([0])[2] is None  # one position: nothing to mask


def test_logits_of_alternating_lengths_match_a_fresh_model():
    db = tq.connect()
    model = Llama.random(db, SHAPE, seed=1)
    rng = np.random.default_rng(2)
    for length in (4, 3, 4):
        ids = rng.integers(0, SHAPE.vocab, size=(1, length))
        fresh = Llama(db, SHAPE)  # the same stored weights, no tables made yet
        torch.testing.assert_close(model.logits(ids).torch(), fresh.logits(ids).torch(),
                                   rtol=0, atol=0)


def test_a_prompts_embeddings_are_gathered_on_one_thread(monkeypatch):
    """The gather runs right before the prefill's query: on two threads it would leave the
    second one spinning beside the query's workers (``one_torch_thread``). The logits are
    those of the model's own expression, and the caller's thread setting is restored."""
    model = Llama.random(tq.connect(workers=2), SHAPE, seed=3)
    prefill = model.prefill(1, 4)
    seen = []
    gather = torch.index_select

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return gather(*args, **kwargs)

    monkeypatch.setattr(torch, "index_select", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ids = [[1, 5, 2, 7]]
        got = prefill.logits(ids)
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    monkeypatch.undo()
    torch.testing.assert_close(got, model.logits(ids).torch(), atol=1e-5, rtol=1e-5)


def test_rotary_tables_are_transformers_own_at_long_positions():
    """numpy's float32 power rounded some frequencies one ulp from torch's: the angle error
    grew with the position, up to 1.2e-4 in cos at position 4096 (head_dim 64, theta 1e4)
    against transformers' tables, 4x transformers' own error on a long prompt's logits."""
    transformers = pytest.importorskip("transformers")
    positions = torch.arange(4096)[None]
    for theta, head_dim in ((10000.0, 64), (500000.0, 128), (100.0, 6)):
        config = transformers.LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2,
                                          head_dim=head_dim, rope_theta=theta,
                                          max_position_embeddings=4096)
        rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
        want_cos, want_sin = rotary(torch.zeros(1, 2, 4096, head_dim), positions)
        cos, sin = rope_tables(LlamaShape.from_config(config), range(4096))
        np.testing.assert_array_equal(cos, want_cos[0].numpy())
        np.testing.assert_array_equal(sin, want_sin[0].numpy())
