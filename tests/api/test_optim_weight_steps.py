"""Each weight counts its own updates, as torch.optim's per-parameter ``state["step"]``: a
weight some losses skip gets Adam's bias corrections for its own count -- also across a
checkpoint and a resume in a new session."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq

SCHEDULE = [True, False, False, True, True, False, True]  # steps whose loss reads B


def _data():
    rng = np.random.default_rng(3)
    return rng.standard_normal((4, 3)), rng.standard_normal(3), rng.standard_normal((5, 4))


def _torch_reference(kind: str) -> tuple[np.ndarray, np.ndarray]:
    w0, b0, x = _data()
    tw, tb = torch.tensor(w0, requires_grad=True), torch.tensor(b0, requires_grad=True)
    optimizer = {"adam": lambda: torch.optim.Adam([tw, tb], lr=0.1, weight_decay=0.01),
                 "adamw": lambda: torch.optim.AdamW([tw, tb], lr=0.1)}[kind]()
    xt = torch.tensor(x)
    for reads_b in SCHEDULE:
        optimizer.zero_grad(set_to_none=True)  # B's grad stays None when the loss skips it
        out = xt @ tw + tb if reads_b else xt @ tw
        (out ** 2).sum().backward()
        optimizer.step()
    return tw.detach().numpy(), tb.detach().numpy()


def _make(db, kind):
    cls = {"adam": tq.optim.Adam, "adamw": tq.optim.AdamW}[kind]
    extra = {"weight_decay": 0.01} if kind == "adam" else {}
    return cls(db, ["W", "B"], lr=0.1, **extra)


def _losses(db, opt):
    p = opt.params()
    x = db.constant(_data()[2])
    return ((x @ p["W"] + p["B"]) ** 2).sum(), ((x @ p["W"]) ** 2).sum()


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_a_weight_skipped_by_some_losses_matches_torch(kind):
    w0, b0, _ = _data()
    db = tq.connect()
    db.from_numpy("W", w0)
    db.from_numpy("B", b0)
    opt = _make(db, kind)
    with_b, without_b = _losses(db, opt)
    for reads_b in SCHEDULE:
        opt.step(with_b if reads_b else without_b)
    assert opt.step_count == len(SCHEDULE)
    assert opt.weight_steps == {"W": len(SCHEDULE), "B": sum(SCHEDULE)}
    tw, tb = _torch_reference(kind)
    np.testing.assert_allclose(db.tensor("W").numpy(), tw, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(db.tensor("B").numpy(), tb, rtol=1e-12, atol=1e-13)


def test_update_counts_survive_a_resume(tmp_path):
    path = str(tmp_path / "train.duckdb")
    w0, b0, _ = _data()
    db = tq.connect(path)
    db.from_numpy("W", w0)
    db.from_numpy("B", b0)
    opt = _make(db, "adam")
    with_b, without_b = _losses(db, opt)
    for reads_b in SCHEDULE[:3]:
        opt.step(with_b if reads_b else without_b)
    db.close()
    db = tq.connect(path)
    np.testing.assert_array_equal(db.tensor("adam.weight_steps").numpy(), [3, 1])
    opt = _make(db, "adam")
    assert opt.step_count == 3 and opt.weight_steps == {"W": 3, "B": 1}
    with_b, without_b = _losses(db, opt)
    for reads_b in SCHEDULE[3:]:
        opt.step(with_b if reads_b else without_b)
    tw, tb = _torch_reference("adam")
    np.testing.assert_allclose(db.tensor("W").numpy(), tw, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(db.tensor("B").numpy(), tb, rtol=1e-12, atol=1e-13)


def test_a_checkpoint_without_counts_resumes_every_weight_at_the_step_count():
    db = tq.connect()
    db.store_many({"W": np.ones((4, 3)), "B": np.ones(3), "adam.step": np.array(4)})
    assert _make(db, "adam").weight_steps == {"W": 4, "B": 4}


@pytest.mark.parametrize("counts", [np.array([5, 1]), np.array([1.0, 2.0]), np.array([1]),
                                    np.array([-1, 0])], ids=["past-step", "float", "short",
                                                             "negative"])
def test_bad_stored_counts_are_option_errors(counts):
    db = tq.connect()
    trained = np.frombuffer(b"W\0B\0", dtype=np.uint8).copy()
    db.store_many({"W": np.ones((4, 3)), "B": np.ones(3), "adam.step": np.array(4),
                   "adam.params": trained, "adam.weight_steps": counts})
    with pytest.raises(tq.OptionError, match="adam.weight_steps"):
        _make(db, "adam")
