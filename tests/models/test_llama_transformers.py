"""LLaMA from Hugging Face ``transformers`` as the oracle: logits and greedy generation.

Random-weight models are built from small ``LlamaConfig``s (nothing is downloaded).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq
from tensorql.models import Llama

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "mha": dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, rope_theta=10000.0),
    "gqa": dict(vocab_size=89, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
                num_attention_heads=6, num_key_value_heads=2, rope_theta=500000.0),
    "mqa_tied": dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=1, rope_theta=1000.0,
                     tie_word_embeddings=True, rms_norm_eps=1e-5),
}


def hf_model(name: str):
    torch.manual_seed(sum(map(ord, name)))
    config = transformers.LlamaConfig(**CONFIGS[name], max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger than the default init, so logits differ visibly
        for param in model.parameters():
            if param.ndim > 1:
                param.normal_(0.0, 0.2)
    return model


def prompt(name: str, length: int, vocab: int) -> list[int]:
    return np.random.default_rng(len(name)).integers(0, vocab, size=length).tolist()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(name):
    model = hf_model(name)
    ids = prompt(name, 9, model.config.vocab_size)
    ours = Llama.from_transformers(tq.connect(), model).logits([ids]).numpy()
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits.numpy()
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= 1e-4


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_generation_matches_transformers(name):
    model = hf_model(name)
    ids = prompt(name, 5, model.config.vocab_size)
    ours = Llama.from_transformers(tq.connect(), model).generate(ids, max_new_tokens=32)
    with torch.no_grad():
        theirs = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                min_new_tokens=32, pad_token_id=0)[0].tolist()
    assert ours == theirs


def test_generate_restarts_its_decoder_on_the_next_request_of_the_same_shape():
    """A second generate() of the same prompt length and max_new_tokens reuses the first
    one's prompt query and decoder (plans, buffers, weights) and still gives transformers'
    tokens; a change to the stored tensors, or another max_new_tokens, builds a new one."""
    model = hf_model("gqa")
    llama = Llama.from_transformers(tq.connect(), model)
    vocab = model.config.vocab_size
    first, second, third = (prompt(name, 7, vocab) for name in ("a", "bb", "ccc"))

    def theirs(ids, new=12):
        with torch.no_grad():
            return model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False,
                                  min_new_tokens=new, pad_token_id=0)[0].tolist()

    assert llama.generate(first, max_new_tokens=12) == theirs(first)
    decoder, prompt_query = llama._kept_decoder[3], llama._kept_prompt[3]
    assert llama.generate(second, max_new_tokens=12) == theirs(second)
    assert llama._kept_decoder[3] is decoder and decoder.position == 7 + 12 - 1
    assert llama._kept_prompt[3] is prompt_query  # the prompt's plan too
    assert llama.generate(third, max_new_tokens=9) == theirs(third, 9)
    assert llama._kept_decoder[3] is not decoder
    decoder = llama._kept_decoder[3]
    llama.db.from_numpy("unrelated", np.zeros(3, np.float32))  # the store changed
    assert llama.generate(first, max_new_tokens=9) == theirs(first, 9)
    assert llama._kept_decoder[3] is not decoder and llama._kept_prompt[3] is not prompt_query


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_logits_and_generation_under_half_the_weights_memory():
    model = hf_model("gqa")
    limit = weight_bytes(model) // 2
    db = tq.connect(memory_limit=limit, devices="cpu")
    ours = Llama.from_transformers(db, model)
    ids = prompt("gqa", 9, model.config.vocab_size)
    result = ours.logits([ids]).compile().run(dense=True)
    (device,) = result.stats.devices
    assert device.peak_bytes <= limit
    assert device.bytes_h2d >= weight_bytes(model)  # every weight streamed in from rest
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits.numpy()
        tokens = model.generate(torch.tensor([ids[:4]]), max_new_tokens=32, do_sample=False,
                                min_new_tokens=32, pad_token_id=0)[0].tolist()
    assert np.abs(result.dense().numpy() - theirs).max() <= 1e-4
    assert ours.generate(ids[:4], max_new_tokens=32) == tokens


def test_from_safetensors_file(tmp_path):
    from safetensors.torch import save_file

    model = hf_model("mha")
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    db = tq.connect(str(tmp_path / "weights.duckdb"))
    ours = Llama.from_safetensors(db, model.config, str(path))
    assert "llama_l0_wq" in db.tensors()
    ids = prompt("mha", 6, model.config.vocab_size)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits.numpy()
    assert np.abs(ours.logits([ids]).numpy() - theirs).max() <= 1e-4


def test_generation_query_has_an_explain():
    model = hf_model("gqa")
    ours = Llama.from_transformers(tq.connect(), model)
    text = ours.logits([[1, 2, 3]]).explain()
    assert text.startswith("EXPLAIN") and "scan llama_l0_wq" in text.lower()


def test_bad_token_ids_raise():
    ours = Llama.from_transformers(tq.connect(), hf_model("mha"))
    with pytest.raises(tq.TensorQLError, match="outside the vocabulary"):
        ours.logits([[1, 500]])
    with pytest.raises(tq.TensorQLError, match="integer"):
        ours.logits([[0.5, 1.0]])


def test_unsupported_config_is_refused():
    config = transformers.LlamaConfig(**CONFIGS["mha"], attention_bias=True)
    with pytest.raises(tq.TensorQLError, match="attention_bias"):
        Llama.from_state_dict(tq.connect(), config, {})


def test_a_bfloat16_safetensors_file_loads(tmp_path):
    """Real LLaMA checkpoints are bfloat16, which numpy has no type for: the file is read
    with torch's loader and the weights are those of the bfloat16 model."""
    from safetensors.torch import save_file

    model = hf_model("gqa").to(torch.bfloat16)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    ours = Llama.from_safetensors(tq.connect(), model.config, str(path))
    ids = prompt("gqa", 5, model.config.vocab_size)
    with torch.no_grad():
        theirs = model.float()(torch.tensor([ids])).logits.numpy()
    assert np.abs(ours.logits([ids]).numpy() - theirs).max() <= 1e-3


@pytest.mark.parametrize("change", [dict(num_key_value_heads=2), dict(head_dim=16),
                                    dict(num_attention_heads=8)])
def test_a_config_that_disagrees_with_the_weights_is_a_shape_error(change):
    model = hf_model("mha")
    config = transformers.LlamaConfig(**{**CONFIGS["mha"], **change})
    with pytest.raises(tq.ShapeError, match="self_attn"):
        Llama.from_state_dict(tq.connect(), config, model.state_dict())


def test_another_architecture_or_an_unused_weight_is_refused():
    """A Mistral with a sliding window, a Qwen2 (biases on its projections), or a LLaMA state
    dict carrying a weight this model would not compute: refused, not dropped."""
    mistral = transformers.MistralConfig(**CONFIGS["mha"], sliding_window=4)
    with pytest.raises(tq.ShapeError, match="mistral"):
        Llama.from_state_dict(tq.connect(), mistral, {})
    qwen = transformers.Qwen2Config(**CONFIGS["mha"])
    with pytest.raises(tq.ShapeError, match="qwen2"):
        Llama.from_state_dict(tq.connect(), qwen, {})
    model = hf_model("mha")
    state = dict(model.state_dict())
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    db = tq.connect()
    with pytest.raises(tq.ShapeError, match="q_proj.bias"):
        Llama.from_state_dict(db, model.config, state)
    assert not db.tensors()  # nothing stored


def test_a_mistral_without_a_sliding_window_and_a_config_mapping_load():
    torch.manual_seed(3)
    config = transformers.MistralConfig(**CONFIGS["gqa"], sliding_window=None)
    model = transformers.MistralForCausalLM(config).eval()
    ids = prompt("gqa", 7, config.vocab_size)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits.numpy()
    for given in (config, config.to_dict()):
        ours = Llama.from_state_dict(tq.connect(), given, model.state_dict())
        assert np.abs(ours.logits([ids]).numpy() - theirs).max() <= 1e-4


def test_logits_and_generation_on_two_devices():
    model = hf_model("gqa")
    db = tq.connect(devices=2)
    ours = Llama.from_transformers(db, model)
    ids = prompt("gqa", 9, model.config.vocab_size)
    query = ours.logits([ids]).compile()
    assert query.partition is not None
    result = query.run(dense=True)
    assert all(device.ops > 0 for device in result.stats.devices)  # both devices worked
    assert len(result.stats.devices) == 2
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits.numpy()
    assert np.abs(result.dense().numpy() - theirs).max() <= 1e-4

    small = hf_model("mha")
    ours = Llama.from_transformers(tq.connect(devices=2), small)
    with torch.no_grad():
        tokens = small.generate(torch.tensor([ids[:4]]), max_new_tokens=32, do_sample=False,
                                min_new_tokens=32, pad_token_id=0)[0].tolist()
    assert ours.generate(ids[:4], max_new_tokens=32) == tokens


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decoder_matches_step_by_step_decoding(name):
    """The decoder's one cached plan gives the logits of a fresh step() per token."""
    from tensorql.models import KVCache

    model = hf_model(name)
    llama = Llama.from_transformers(tq.connect(), model)
    ids = prompt(name, 6, model.config.vocab_size)
    logits, cache = llama.step([ids], KVCache(()))
    decoder = llama.decoder(cache, max_length=12)
    plan = decoder.query
    for token in prompt(name + "x", 5, model.config.vocab_size):
        expected, cache = llama.step([[token]], cache)
        np.testing.assert_allclose(decoder.step([[token]]).numpy(), expected.numpy(),
                                   atol=1e-4)
    assert decoder.query is plan and decoder.position == 11
    decoder.step([[1]])
    with pytest.raises(tq.ShapeError, match="full"):
        decoder.step([[1]])
    with pytest.raises(tq.ShapeError, match="one token per batch row"):
        llama.decoder(cache, max_length=20).step([[1, 2]])


def test_decoder_under_a_memory_limit_streams_the_weights():
    from tensorql.models import KVCache

    model = hf_model("gqa")
    limit = weight_bytes(model) // 2
    free = Llama.from_transformers(tq.connect(), model)
    limited = Llama.from_transformers(tq.connect(memory_limit=limit, devices="cpu"), model)
    ids = prompt("gqa", 5, model.config.vocab_size)
    caches = [m.step([ids], KVCache(()))[1] for m in (free, limited)]
    a, b = free.decoder(caches[0], 8), limited.decoder(caches[1], 8)
    assert a.weights and not b.weights and b.table is None
    for token in (3, 7):
        np.testing.assert_allclose(a.step([[token]]).numpy(), b.step([[token]]).numpy(),
                                   atol=1e-5)


@pytest.mark.parametrize("limited", [False, True])
def test_a_prefill_plans_once_and_matches_transformers_prompt_after_prompt(limited):
    model = hf_model("gqa")
    db = tq.connect(memory_limit=weight_bytes(model) // 2 if limited else None, devices="cpu")
    ours = Llama.from_transformers(db, model)
    prefill = ours.prefill(batch=2, seq=7)
    rng = np.random.default_rng(5)
    plans = set()
    for _ in range(3):
        ids = rng.integers(0, model.config.vocab_size, size=(2, 7))
        with torch.no_grad():
            theirs = model(torch.from_numpy(ids)).logits
        assert (prefill.logits(ids) - theirs).abs().max() <= 1e-4
        plans.add(id(prefill.query()))
    assert len(plans) == 1  # one plan for every prompt of the shape
    db.from_numpy("unrelated", np.zeros(3, dtype=np.float32))  # the store changed: re-planned
    assert id(prefill.query()) not in plans
    with pytest.raises(tq.ShapeError, match=r"prompts of shape \(2, 7\)"):
        prefill.logits(ids[:, :5])
