"""One device's physical plans, step by step, compared with a golden record: a change to the
one builder (:func:`tensorql.physical.builder.build`) that changes a one-device task graph --
its steps, their tasks, kernels, inputs, FLOPs, estimates or load priorities -- shows as a
diff here.

The record (``fixtures/one_device_plans.json``) holds per step its name, task count, kernel
types, inputs and FLOPs in the clear, and a digest of every task's details (output key, the
chunks it reads, its kernel's plain fields, FLOPs, priority). Rewrite it after an intended
change with ``pytest tests/test_one_device_plans.py --update-golden`` and review the diff.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from collections import Counter

import numpy as np
import pytest

import tensorql as tq
from tensorql.models import Llama
from tensorql.models.llama import LlamaShape
from tensorql.pipeline import CompiledGroup, CompiledQuery

GOLDEN = pathlib.Path(__file__).parent / "fixtures" / "one_device_plans.json"
_PLAIN = (str, int, float, bool, type(None))


def _plain(value):
    """A kernel field as JSON: plain values and tuples of them; dataclasses by their plain
    fields; anything else (tensors, stores, functions) by its type name."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, slice):
        return [value.start, value.stop, value.step]
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [type(value).__name__] + [
            [f.name, _plain(getattr(value, f.name))] for f in dataclasses.fields(value)]
    return type(value).__name__


def _ref(ref) -> list:
    return [ref.step, list(ref.key)]


def signature(physical) -> list[dict]:
    """Per step: name, task count, kernel types, inputs, FLOPs, estimates and a digest of
    every task's details."""
    out = []
    for step in physical.steps:
        tasks = [[_ref(t.output), [_ref(r) for r in t.inputs], _plain(t.kernel), t.flops,
                  t.priority, t.device] for t in step.tasks]
        digest = hashlib.sha256(json.dumps(tasks).encode()).hexdigest()[:16]
        kinds = Counter(type(t.kernel).__name__ for t in step.tasks)
        out.append({"name": step.name, "tasks": len(step.tasks),
                    "kernels": sorted(kinds.items()),
                    "inputs": sum(len(t.inputs) for t in step.tasks),
                    "flops": sum(t.flops for t in step.tasks),
                    "est": [step.est_flops, step.est_bytes_in, step.est_bytes_out],
                    "digest": digest})
    return out


def _query(node, db):
    return CompiledQuery.compile(node, db).physical


def _mlp_bias(db):
    x = db.from_numpy("X", np.ones((16, 8), np.float32))
    w1 = db.from_numpy("W1", np.ones((8, 32), np.float32), tile=(8, 16))
    b1 = db.from_numpy("b1", np.ones((32,), np.float32))
    w2 = db.from_numpy("W2", np.ones((32, 8), np.float32))
    return _query(((x @ w1 + b1).relu() @ w2).node, db)


def _chain_uneven(db):
    a = db.from_numpy("A", np.ones((12, 30), np.float32), tile=(4, 7))
    b = db.from_numpy("B", np.ones((30, 10), np.float32), tile=(15, 3))
    c = db.from_numpy("C", np.ones((10, 20), np.float32), tile=(4, 6))
    d = db.from_numpy("D", np.ones((20, 6), np.float32), tile=(5, 6))
    return _query(tq.einsum("ij,jk,kl,lm->im", a, b, c, d).node, db)


def _softmax(db):
    s = db.from_numpy("S", np.ones((4, 12), np.float32), tile=(2, 6))
    return _query(s.softmax(axis=1).node, db)


def _reshape(db):
    r = db.from_numpy("R", np.arange(48.0, dtype=np.float32).reshape(4, 12), tile=(2, 6))
    return _query((r.reshape(4, 3, 4).exp()).node, db)


def _attention(db):
    rng = np.random.default_rng(0)
    q = db.from_numpy("Q", rng.normal(size=(2, 8, 4)).astype(np.float32), tile=(1, 4, 4))
    k = db.from_numpy("K", rng.normal(size=(2, 12, 4)).astype(np.float32), tile=(1, 6, 4))
    v = db.from_numpy("V", rng.normal(size=(2, 12, 4)).astype(np.float32), tile=(1, 6, 4))
    mask = db.from_numpy("M", np.zeros((8, 12), np.float32))
    probs = (tq.einsum("bse,bte->bst", q, k) + mask).softmax(-1)
    return _query(tq.einsum("bst,bte->bse", probs, v).node, db)


_SHAPE = LlamaShape(vocab=31, d_model=16, d_ff=24, layers=2, heads=4, kv_heads=2, head_dim=4)


def _llama_block(db):
    model = Llama.random(db, _SHAPE, seed=0)
    x = model.embed(np.array([[1, 2, 3, 4, 5]]))
    return _query(model.block(x, 0, list(range(5))).node, db)


def _llama_prefill(db):
    model = Llama.random(db, _SHAPE, seed=0)
    return model.prefill(batch=1, seq=6).output.compile().physical


def _llama_decode(db):
    from tensorql.models import KVCache

    model = Llama.random(db, _SHAPE, seed=0)
    _, cache = model.step([[1, 2, 3]], KVCache(()))
    return model.decoder(cache, max_length=8).query.physical


def _adam_step(db):
    rng = np.random.default_rng(0)
    db.store_many({"x": rng.normal(size=(12, 5)), "y": rng.normal(size=(12, 3)),
                   "w": rng.normal(size=(5, 3)), "b": rng.normal(size=(3,))})
    err = db.tensor("x") @ db.tensor("w") + db.tensor("b") - db.tensor("y")
    opt = tq.optim.Adam(db, ["w", "b"], lr=0.05, weight_decay=0.01)
    return opt._plan((err * err).mean()).physical


def _group(db):
    a = db.from_numpy("A", np.ones((6, 8), np.float32), tile=(3, 4))
    b = db.from_numpy("B", np.ones((8, 4), np.float32), tile=(4, 4))
    h = a @ b
    return CompiledGroup.compile([h.node, h.relu().node, (h * h).sum(axis=0).node],
                                 db).physical


PLANS = {"mlp_bias": _mlp_bias, "chain_uneven": _chain_uneven, "softmax": _softmax,
         "reshape": _reshape, "attention": _attention, "llama_block": _llama_block,
         "llama_prefill": _llama_prefill, "llama_decode": _llama_decode,
         "adam_step": _adam_step, "group": _group}
SETTINGS = {"workers": 2}


def signatures() -> dict[str, list[dict]]:
    """Every plan's signature (built on one device, two workers)."""
    out = {}
    for name, make in PLANS.items():
        with tq.connect(**SETTINGS) as db:
            physical = make(db)
            assert physical.partition is None
            out[name] = signature(physical)
    return out


def test_one_device_plans_match_golden(request):
    got = json.loads(json.dumps(signatures()))
    if request.config.getoption("--update-golden"):
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
    assert GOLDEN.exists(), f"no golden file {GOLDEN.name}; run with --update-golden"
    want = json.loads(GOLDEN.read_text())
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], name


@pytest.mark.parametrize("name", ["attention", "llama_block", "mlp_bias"])
def test_golden_plans_have_the_fused_kernels(name):
    """The record covers what it claims: fused attention, fused pointwise chains, series."""
    want = json.loads(GOLDEN.read_text())[name]
    kinds = {kind for step in want for kind, _ in step["kernels"]}
    expected = {"attention": "AttentionChunk", "llama_block": "FusedPointwise",
                "mlp_bias": "FusedPointwise"}[name]
    assert expected in kinds
