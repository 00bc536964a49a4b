"""The LLaMA model's surface under misuse and concurrency: a cache, a shape or a stored model
that is not this model's is a ShapeError naming it (were raw KeyError / IndexError /
RuntimeError, or a silently different model); concurrent generate calls each get their own
prompt's tokens (a shared prompt query's embeddings were overwritten)."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import torch

import tensorql as tq
from tensorql.models import KVCache, Llama
from tensorql.models.llama import LlamaShape

SHAPE = LlamaShape(vocab=23, d_model=16, d_ff=24, layers=2, heads=4, kv_heads=2, head_dim=4)


def test_concurrent_generate_calls_each_get_their_own_prompts_tokens():
    model = Llama.random(tq.connect(), SHAPE, seed=0)
    prompts = [list(np.random.default_rng(k).integers(0, SHAPE.vocab, 8)) for k in range(4)]
    want = [model.generate(p, 4) for p in prompts]
    jobs = [k for _ in range(5) for k in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda k: model.generate(prompts[k], 4), jobs))
    assert got == [want[k] for k in jobs]


def test_a_cache_of_another_model_is_a_shape_error():
    db = tq.connect()
    model = Llama.random(db, SHAPE, seed=0)
    other = Llama.random(db, LlamaShape(vocab=23, d_model=16, d_ff=24, layers=1, heads=4,
                                        kv_heads=2, head_dim=4), seed=1, prefix="other_")
    wide = Llama.random(db, LlamaShape(vocab=23, d_model=16, d_ff=24, layers=2, heads=4,
                                       kv_heads=4, head_dim=4), seed=2, prefix="wide_")
    ids = [[1, 2, 3]]
    _, one_layer = other.step(ids, KVCache(()))
    _, four_heads = wide.step(ids, KVCache(()))
    _, two_prompts = model.step([[1, 2, 3], [4, 5, 6]], KVCache(()))
    for cache, match in ((one_layer, "1 layers, this model 2"),
                         (four_heads, r"layer 0 is \(2, 1, 3, 4, 4\)")):
        with pytest.raises(tq.ShapeError, match=match):
            model.decoder(cache, 8)
        with pytest.raises(tq.ShapeError, match=match):
            model.step([[4]], cache)
    with pytest.raises(tq.ShapeError, match="holds 2 prompts, the tokens 1"):
        model.step([[4]], two_prompts)


def test_a_shape_that_is_not_the_stored_models_is_a_shape_error():
    db = tq.connect()
    Llama.random(db, SHAPE, seed=0, prefix="a_")
    wrong = LlamaShape(vocab=29, d_model=16, d_ff=24, layers=2, heads=4, kv_heads=2, head_dim=4)
    with pytest.raises(tq.ShapeError, match="stored weight 'a_embed' is"):
        Llama(db, wrong, "a_")
    assert Llama(db, SHAPE, "a_").logits([[1, 2]]).shape == (1, 2, 23)


@pytest.mark.parametrize("sizes, match", [
    (dict(heads=3, kv_heads=2), "do not share"),
    (dict(kv_heads=0), "kv_heads must be a positive integer"),
    (dict(d_ff=-1), "d_ff must be a positive integer"),
    (dict(layers=1.5), "layers must be an integer"),
])
def test_an_impossible_shape_is_a_shape_error(sizes, match):
    base = dict(vocab=17, d_model=8, d_ff=12, layers=1, heads=2, kv_heads=1, head_dim=4)
    with pytest.raises(tq.ShapeError, match=match):
        LlamaShape(**(base | sizes))


@pytest.mark.parametrize("call, match", [
    (lambda m: m.generate([1.5, 2.0], 2), "integer array"),
    (lambda m: m.generate([[1, 2], [3, 4]], 2), "one prompt"),
    (lambda m: m.generate([1, 2], 2.5), "max_new_tokens"),
    (lambda m: m.generate([1, 2], -1), "max_new_tokens"),
    (lambda m: m.logits([[1, 2], [3]]), "different lengths"),
    (lambda m: m.prefill(1, 2.5), "integers batch and seq"),
])
def test_bad_arguments_are_shape_errors(call, match):
    model = Llama.random(tq.connect(), SHAPE, seed=0)
    with pytest.raises(tq.ShapeError, match=match):
        call(model)


def test_a_model_of_no_layers_generates_as_transformers():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=23, hidden_size=16, intermediate_size=24,
                                      num_hidden_layers=0, num_attention_heads=4,
                                      num_key_value_heads=2)
    theirs = transformers.LlamaForCausalLM(config).eval()
    ours = Llama.from_transformers(tq.connect(), theirs)
    prompt = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        want = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                               max_new_tokens=3, min_new_tokens=3, pad_token_id=0)
    assert ours.generate([1, 2, 3], 3) == want[0].tolist()
