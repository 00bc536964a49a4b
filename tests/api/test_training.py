"""Training: optimizers against torch.optim, one query per step, the digits MLP against the
identical PyTorch model, atomic checkpoints and resuming after kill -9."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import tensorql as tq

ROOT = Path(__file__).resolve().parents[2]


def _problem(db, rng):
    x = rng.normal(size=(12, 5))
    y = rng.normal(size=(12, 3))
    w = rng.normal(size=(5, 3))
    b = rng.normal(size=(3,))
    db.store_many({"x": x, "y": y, "w": w, "b": b})
    return x, y, w, b


def _tq_loss(db):
    err = db.tensor("x") @ db.tensor("w") + db.tensor("b") - db.tensor("y")
    return (err * err).mean()


def _torch_loss(x, y, w, b):
    err = torch.tensor(x) @ w + b - torch.tensor(y)
    return (err * err).mean()


OPTIMIZERS = {
    "sgd": (lambda db: tq.optim.SGD(db, ["w", "b"], lr=0.1),
            lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "sgd-momentum": (lambda db: tq.optim.SGD(db, ["w", "b"], lr=0.05, momentum=0.9,
                                             weight_decay=0.01),
                     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01)),
    "sgd-nesterov": (lambda db: tq.optim.SGD(db, ["w", "b"], lr=0.05, momentum=0.9,
                                             nesterov=True),
                     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True)),
    "adam": (lambda db: tq.optim.Adam(db, ["w", "b"], lr=0.05, weight_decay=0.01),
             lambda ps: torch.optim.Adam(ps, lr=0.05, weight_decay=0.01, foreach=False)),
    "adamw": (lambda db: tq.optim.AdamW(db, ["w", "b"], lr=0.05, betas=(0.8, 0.99)),
              lambda ps: torch.optim.AdamW(ps, lr=0.05, betas=(0.8, 0.99), foreach=False)),
}


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizers_match_torch(name, devices, rng):
    ours, theirs = OPTIMIZERS[name]
    with tq.connect(devices=devices) as db:
        x, y, w0, b0 = _problem(db, rng)
        opt = ours(db)
        loss = _tq_loss(db)
        losses = [opt.step(loss) for _ in range(6)]
        w = torch.tensor(w0, requires_grad=True)
        b = torch.tensor(b0, requires_grad=True)
        topt = theirs([w, b])
        expected = []
        for _ in range(6):
            topt.zero_grad()
            value = _torch_loss(x, y, w, b)
            value.backward()
            topt.step()
            expected.append(float(value.detach()))
        np.testing.assert_allclose(losses, expected, rtol=1e-10)
        np.testing.assert_allclose(db.tensor("w").numpy(), w.detach().numpy(), rtol=1e-9,
                                   atol=1e-12)
        np.testing.assert_allclose(db.tensor("b").numpy(), b.detach().numpy(), rtol=1e-9,
                                   atol=1e-12)
        assert int(db.tensor(f"{opt.name}.step").numpy()) == 6


def test_one_query_per_step_shares_the_forward_pass(db, rng):
    _problem(db, rng)
    opt = tq.optim.Adam(db, ["w", "b"], lr=0.01)
    loss = _tq_loss(db)
    text = opt.explain(loss)
    # the loss, and per weight ONE fused update stacking the new weight, m and v
    assert text.startswith("EXPLAIN 3 outputs")
    assert text.count("join=adam") >= 2
    assert text.count("Scan x") == 1  # the forward pass is planned once for all outputs
    analyzed = opt.explain(loss, analyze=True)
    assert "measured: wall" in analyzed


def test_compute_and_store_many(db, rng):
    a = db.from_numpy("a", rng.normal(size=(6, 4)), tile=(2, 2))
    h = (a @ a.T).relu()
    total, doubled = db.compute(h.sum(), h * 2.0)
    reference = np.maximum(a.numpy() @ a.numpy().T, 0)
    np.testing.assert_allclose(float(total), reference.sum())
    np.testing.assert_allclose(doubled.numpy(), 2 * reference)
    stored = db.store_many({"s": h.sum(), "d": h * 2.0})
    assert [t.shape for t in stored] == [(), (6, 6)]
    with pytest.raises(tq.StorageError, match="already exists"):
        db.store_many({"new": h, "s": h.sum()})
    assert "new" not in db.tensors()


def test_store_many_is_all_or_nothing(tmp_path, rng):
    with tq.connect(str(tmp_path / "w.duckdb")) as db:
        db.store_many({"p": np.zeros(3), "q": np.zeros(3)})
        db.sql("CREATE TABLE clash (x INTEGER)")
        # "p" is staged, then "clash" fails (a DuckDB table has the name): nothing changes
        with pytest.raises(tq.StorageError, match="clash"):
            db.store_many({"p": np.ones(3), "clash": np.ones(2)}, replace=True)
        assert db.tensor("p").numpy().tolist() == [0.0, 0.0, 0.0]
        assert sorted(db.tensors()) == ["p", "q"]
        tables = db.sql("SELECT count(*) FROM duckdb_tables() WHERE table_name LIKE "
                        "'tq_chunks_%'").fetchall()[0][0]
        assert tables == 2  # the staged chunk table was dropped


def test_digits_mlp_matches_pytorch():
    from tensorql.train_demo import train_tensorql, train_torch

    ours = train_tensorql(200, checkpoint_every=50)
    theirs = train_torch(200)
    gap = max(abs(a - b) for a, b in zip(ours.losses, theirs.losses))
    assert len(ours.losses) == 200
    assert gap <= 1e-4, gap
    assert ours.accuracy >= 0.95
    assert ours.losses[-1] < 0.05


_RUN = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r})
    import tensorql as tq
    from tensorql.storage import duckdb_store
    from tensorql.train_demo import train_tensorql

    kill_at = int(sys.argv[2])
    if kill_at:
        original = duckdb_store.DuckDBChunkStore._stage
        staged = []

        def stage(self, con, meta, chunks, table):
            original(self, con, meta, chunks, table)
            staged.append(meta.name)
            if len(staged) == kill_at:  # in the middle of writing a checkpoint
                os.kill(os.getpid(), signal.SIGKILL)

        duckdb_store.DuckDBChunkStore._stage = stage
    train_tensorql(int(sys.argv[3]), hidden=16, db_path=sys.argv[1], checkpoint_every=4,
                   deterministic=True)
""")


def test_kill_during_training_resumes_to_the_same_weights(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_RUN.format(root=str(ROOT)))

    def run(db: Path, kill_at: int, steps: int) -> int:
        done = subprocess.run([sys.executable, str(script), str(db), str(kill_at), str(steps)],
                              capture_output=True, text=True, timeout=600)
        return done.returncode

    straight = tmp_path / "straight.duckdb"
    assert run(straight, 0, 20) == 0
    broken = tmp_path / "broken.duckdb"
    # the first store holds the data and weights (6 tensors); each checkpoint 13 more: the
    # kill lands inside the third checkpoint, after step 12
    assert run(broken, 6 + 13 * 2 + 5, 20) == -signal.SIGKILL
    with tq.connect(str(broken)) as db:
        assert int(db.tensor("adam.step").numpy()) == 8  # the last committed checkpoint
    assert run(broken, 0, 20) == 0
    with tq.connect(str(straight)) as a, tq.connect(str(broken)) as b:
        for name in ("W1", "b1", "W2", "b2", "adam.m.W1", "adam.v.b2", "adam.step"):
            np.testing.assert_array_equal(a.tensor(name).numpy(), b.tensor(name).numpy(),
                                          err_msg=name)


def test_llama_block_gradients_match_torch():
    from tensorql.models import llama_block

    with tq.connect() as db:
        work = llama_block(db, batch=1, seq=6, d_model=16, heads=2, head_dim=8, d_ff=24,
                           prefix="b_")
        names = sorted(n for n in work.arrays if n.startswith("b_l0_"))
        out = work.output
        loss = (out * out).mean()
        ours = tq.grad(loss, [db.tensor(n) for n in names])
        leaves = {n: torch.tensor(work.arrays[n], requires_grad=True) for n in names}
        ref = work.reference_with(leaves)
        theirs = torch.autograd.grad((ref * ref).mean(), [leaves[n] for n in names])
        for n, a, b in zip(names, ours, theirs):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=2e-3, atol=2e-6,
                                       err_msg=n)


def test_lora_step_on_a_llama_block():
    """Freeze the block, train a rank-2 update of its query projection: W + A @ B."""
    from tensorql.models import llama_block

    with tq.connect() as db:
        work = llama_block(db, batch=1, seq=6, d_model=16, heads=2, head_dim=8, d_ff=24,
                           prefix="b_")
        rng = np.random.default_rng(0)
        db.store_many({"lora_a": rng.normal(size=(16, 2)).astype(np.float32) * 0.1,
                       "lora_b": np.zeros((2, 2, 8), np.float32)})
        frozen = {n: db.tensor(n).numpy() for n in work.arrays}
        wq = db.tensor("b_l0_wq")
        adapted = wq + tq.einsum("dr,rhe->dhe", db.tensor("lora_a"), db.tensor("lora_b"))
        out = tq.substitute(work.output, {"b_l0_wq": adapted})
        target = db.constant(np.zeros(out.shape, np.float32))
        loss = ((out - target) ** 2).mean()
        opt = tq.optim.Adam(db, ["lora_a", "lora_b"], lr=0.01)
        losses = [opt.step(loss) for _ in range(5)]
        assert losses[-1] < losses[0]
        assert np.abs(db.tensor("lora_b").numpy()).max() > 0  # the adapter learned
        for n, value in frozen.items():  # and nothing else moved
            np.testing.assert_array_equal(db.tensor(n).numpy(), value)


@pytest.mark.parametrize("devices", [2, 4])
def test_training_step_is_one_partitioned_plan(devices, rng):
    """On several devices the whole step (loss, weights, slots) is one partitioning."""
    weights = {}
    for n in (1, devices):
        with tq.connect(devices=n) as db:
            db.store_many({"x": np.random.default_rng(3).normal(size=(32, 16)),
                           "w1": np.random.default_rng(4).normal(size=(16, 24)) * 0.2,
                           "w2": np.random.default_rng(5).normal(size=(24, 4)) * 0.2})
            loss = (((db.tensor("x") @ db.tensor("w1")).relu() @ db.tensor("w2")) ** 2).mean()
            opt = tq.optim.Adam(db, ["w1", "w2"], lr=0.01)
            text = opt.explain(loss)
            if n > 1:
                assert f"chunk tasks on {n} devices" in text
                assert "EXPLAIN 3 outputs" in text  # the loss and one fused update a weight
            for _ in range(3):
                opt.step(loss)
            weights[n] = [db.tensor(k).numpy() for k in ("w1", "w2")]
    for a, b in zip(weights[1], weights[devices]):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
