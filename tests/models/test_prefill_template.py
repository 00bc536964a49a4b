"""A prefill of a new prompt length re-binds the model's last plan (its template) instead of
lowering and rewriting the graph again; transformers is the oracle of the logits."""

from __future__ import annotations

import collections
import importlib

import numpy as np
import pytest
import torch

import tensorql as tq
from tensorql.models import Llama

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=89, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
              num_attention_heads=6, num_key_value_heads=2, rope_theta=500000.0,
              max_position_embeddings=512)


def hf_model():
    torch.manual_seed(31)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    with torch.no_grad():  # larger than the default init, so logits differ visibly
        for param in model.parameters():
            if param.ndim > 1:
                param.normal_(0.0, 0.2)
    return model


def ids_of(batch: int, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CONFIG["vocab_size"], size=(batch, length))


def theirs(model, ids: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits


@pytest.fixture
def counts(monkeypatch):
    """Calls of the planning stages and graph walks, by name, while the test runs."""
    seen: collections.Counter = collections.Counter()

    def counted(where, name, label):
        module = importlib.import_module(where)
        inner = getattr(module, name)

        def wrapper(*args, **kwargs):
            seen[label] += 1
            return inner(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    counted("tensorql.pipeline.compile", "lower_many", "lower")
    counted("tensorql.pipeline.planning", "rewrite", "rewrite")
    counted("tensorql.pipeline.planning", "build", "build")
    counted("tensorql.logical.plan", "inputs_first", "logical walks")
    counted("tensorql.einsum.graph", "inputs_first", "graph walks")
    return seen


@pytest.mark.parametrize("workers,lengths", [(1, (9, 6, 13)), (2, (260, 257, 300))])
def test_a_new_prompt_length_reuses_the_template_and_gives_transformers_logits(
        counts, workers, lengths):
    model = hf_model()
    ours = Llama.from_transformers(tq.connect(workers=workers), model)
    first, *others = lengths
    fresh = ours.prefill(1, first)
    ids = ids_of(1, first, 0)
    assert (fresh.logits(ids) - theirs(model, ids)).abs().max() <= 1e-4
    assert not fresh.rebound
    assert counts["lower"] == counts["rewrite"] == counts["build"] == 1
    planned = dict(counts)
    for seed, length in enumerate(others, 1):
        counts.clear()
        prefill = ours.prefill(1, length)
        ids = ids_of(1, length, seed)
        got = prefill.logits(ids)
        assert got.shape == (1, length, CONFIG["vocab_size"])
        assert (got - theirs(model, ids)).abs().max() <= 1e-4
        assert prefill.rebound
        # no expression graph walked, nothing lowered or rewritten: the physical plan is
        # built from the template's logical plan re-bound in one walk
        assert counts["lower"] == counts["rewrite"] == counts["graph walks"] == 0
        assert counts["build"] == 1
        assert counts["logical walks"] <= planned["logical walks"] - 5
        again = ids_of(1, length, seed + 10)  # the same prefill, another prompt: no plan
        counts.clear()
        assert (prefill.logits(again) - theirs(model, again)).abs().max() <= 1e-4
        assert sum(counts.values()) == 0


def test_a_rebound_plan_has_the_blocks_of_its_template():
    model = hf_model()
    ours = Llama.from_transformers(tq.connect(workers=2), model)
    ours.prefill(1, 300).logits(ids_of(1, 300, 0))
    rebound = ours.prefill(1, 299)
    rebound.logits(ids_of(1, 299, 1))
    fresh = ours.logits(ids_of(1, 299, 1)).compile().physical
    assert rebound.rebound
    # the same tasks as planning length 299 from scratch: two blocks of positions
    assert (sorted(len(s.tasks) for s in rebound.query().physical.steps)
            == sorted(len(s.tasks) for s in fresh.steps))


def test_a_length_that_is_another_size_of_the_model_is_planned_from_scratch():
    model = hf_model()
    ours = Llama.from_transformers(tq.connect(), model)
    ours.prefill(1, CONFIG["hidden_size"]).logits(ids_of(1, CONFIG["hidden_size"], 0))
    # the template's length is d_model: its dims cannot be told apart -- planned anew
    other = ours.prefill(1, 11)
    ids = ids_of(1, 11, 1)
    assert (other.logits(ids) - theirs(model, ids)).abs().max() <= 1e-4
    assert not other.rebound
    # now the template is length 11's: 48 is re-bound to (only the template's own length
    # must be unambiguous); one position (no mask) and another batch are planned from their
    # expressions
    for batch, length, rebound in ((1, 48, True), (1, 1, False), (2, 7, False)):
        prefill = ours.prefill(batch, length)
        ids = ids_of(batch, length, length)
        assert (prefill.logits(ids) - theirs(model, ids)).abs().max() <= 1e-4
        assert prefill.rebound == rebound, (batch, length)


def test_a_store_change_plans_the_template_again():
    model = hf_model()
    db = tq.connect()
    ours = Llama.from_transformers(db, model)
    ours.prefill(1, 9).logits(ids_of(1, 9, 0))
    db.from_numpy("unrelated", np.zeros(3, dtype=np.float32))
    stale = ours.prefill(1, 7)
    ids = ids_of(1, 7, 1)
    assert (stale.logits(ids) - theirs(model, ids)).abs().max() <= 1e-4
    assert not stale.rebound  # the template was planned before the change
    after = ours.prefill(1, 5)
    ids = ids_of(1, 5, 2)
    assert (after.logits(ids) - theirs(model, ids)).abs().max() <= 1e-4
    assert after.rebound  # ... and length 7's plan is the template now


def test_a_rebound_prefill_under_a_memory_limit_streams_its_weights():
    model = hf_model()
    limit = sum(p.numel() * 4 for p in model.parameters()) // 2
    ours = Llama.from_transformers(tq.connect(memory_limit=limit, devices="cpu"), model)
    ours.prefill(1, 9).logits(ids_of(1, 9, 0))
    prefill = ours.prefill(1, 6)
    ids = ids_of(1, 6, 1)
    assert (prefill.logits(ids) - theirs(model, ids)).abs().max() <= 1e-4
    assert prefill.rebound


def test_a_shorter_prompt_runs_in_a_longer_planned_prefill_padded(counts, monkeypatch):
    model = hf_model()
    ours = Llama.from_transformers(tq.connect(workers=2), model)
    held = ours.prefill(1, 20)
    held.logits(ids_of(1, 20, 0))
    monkeypatch.setattr(ours, "_replan_seconds", 1e9)  # planning dearer than any padding
    for seed, length in enumerate((19, 15, 20), 1):
        counts.clear()
        prefill = ours.prefill(1, length)
        ids = ids_of(1, length, seed)
        got = prefill.logits(ids)
        assert got.shape == (1, length, CONFIG["vocab_size"])
        assert (got - theirs(model, ids)).abs().max() <= 1e-4
        # 20 is the held prefill's own length: a plan of its own, from the template
        assert prefill.padded_to == (None if length == 20 else 20)
        if length < 20:
            assert sum(counts.values()) == 0  # nothing planned
    for batch, length in ((1, 21), (2, 15)):  # longer, or another batch: planned
        prefill = ours.prefill(batch, length)
        ids = ids_of(batch, length, length)
        assert (prefill.logits(ids) - theirs(model, ids)).abs().max() <= 1e-4
        assert prefill.padded_to is None
    unpadded = ours.prefill(1, 19, pad=False)
    ids = ids_of(1, 19, 9)
    assert (unpadded.logits(ids) - theirs(model, ids)).abs().max() <= 1e-4
    assert unpadded.padded_to is None


def test_padding_is_chosen_when_the_extra_positions_cost_less_than_a_plan(monkeypatch):
    model = hf_model()
    ours = Llama.from_transformers(tq.connect(), model)
    short, long = ours.prefill(1, 16), ours.prefill(1, 24)
    short.logits(ids_of(1, 16, 0))
    long.logits(ids_of(1, 24, 0))
    assert ours.prefill(1, 12).padded_to is None  # nothing run yet
    # each run took 1 s, a plan 0.26 s: padding 4 of 16 positions (0.25 s) pays, 5 does not
    for length, host in ((15, 16), (12, 16), (11, None), (22, 24), (17, None)):
        short.run_seconds = long.run_seconds = 1.0  # (a run sets its own time)
        monkeypatch.setattr(ours, "_replan_seconds", 0.26)
        prefill = ours.prefill(1, length)
        ids = ids_of(1, length, length)
        assert (prefill.logits(ids) - theirs(model, ids)).abs().max() <= 1e-4
        assert prefill.padded_to == host, length
    # a store change: the hosts' plans are stale, nothing is padded into them
    ours.db.from_numpy("unrelated", np.zeros(3, dtype=np.float32))
    prefill = ours.prefill(1, 15)
    ids = ids_of(1, 15, 3)
    assert (prefill.logits(ids) - theirs(model, ids)).abs().max() <= 1e-4
    assert prefill.padded_to is None


def test_prompts_padded_into_one_prefill_from_several_threads():
    import concurrent.futures

    model = hf_model()
    ours = Llama.from_transformers(tq.connect(), model)
    host = ours.prefill(1, 12)
    host.logits(ids_of(1, 12, 0))
    ours._replan_seconds = 1e9
    jobs = [(length, seed) for seed in range(3) for length in (12, 11, 10)]

    def run(job):
        length, seed = job
        ids = ids_of(1, length, seed)
        return ours.prefill(1, length).logits(ids), theirs(model, ids)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        for got, want in pool.map(run, jobs):
            assert (got - want).abs().max() <= 1e-4
