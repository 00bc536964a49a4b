"""Adam's update computed in place on one CPU device (issue 31: the step copied every weight
and both moments into fresh buffers before the fused kernel updated them, which cost more
than the update): the plan orders each update after every other reader of what it
overwrites, the results equal torch's fused Adam step for step, and nothing else changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq
from tensorql.errors import ExecutionError
from tensorql.physical.in_place import AfterReaders

STEPS = 4


def _mlp(db, tile):
    """A two-layer MLP whose W2 is read by the gradient of the layer below (dH1 = dY @ W2.T):
    a reader that is not an ancestor of W2's update."""
    rng = np.random.default_rng(7)
    arrays = {"x": rng.normal(size=(32, 24)).astype(np.float32),
              "w1": (rng.normal(size=(24, 40)) * 0.2).astype(np.float32),
              "w2": (rng.normal(size=(40, 8)) * 0.2).astype(np.float32),
              "b1": (rng.normal(size=(40,)) * 0.1).astype(np.float32)}
    for name, value in arrays.items():
        db.from_numpy(name, value, tile=tile if name in ("w1", "w2") else None)
    # the bias is read by a broadcast add fused with the relu: a reader whose result is new
    h = (db.tensor("x") @ db.tensor("w1") + db.tensor("b1")).relu()
    loss = ((h @ db.tensor("w2")) ** 2).mean()
    return arrays, loss


def _torch_steps(arrays, steps, **adam):
    w = {k: torch.tensor(arrays[k], requires_grad=True) for k in ("w1", "w2", "b1")}
    opt = torch.optim.Adam(list(w.values()), fused=True, **adam)
    x = torch.tensor(arrays["x"])
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((torch.relu(x @ w["w1"] + w["b1"]) @ w["w2"]) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().numpy() for k, v in w.items()}, losses


def _assert_as_torch(arrays, steps, losses, got):
    """``losses`` and the final weights ``got`` equal torch's fused Adam's (lr 0.01)."""
    want, want_losses = _torch_steps(arrays, steps, lr=0.01)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for n in got:
        np.testing.assert_allclose(got[n], want[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tile", [None, (8, 16)], ids=["whole", "column-blocks"])
def test_in_place_steps_match_torch_fused_adam(tile):
    with tq.connect(workers=2) as db:
        arrays, loss = _mlp(db, tile)
        opt = tq.optim.Adam(db, ["w1", "w2", "b1"], lr=0.01)
        losses = [opt.step(loss)]
        group = opt._plan(loss)
        assert group.in_place == {1, 2, 3}
        kernels = [t.kernel for s in group.physical.steps for t in s.tasks]
        assert any(isinstance(k, AfterReaders) for k in kernels)  # W2 waits for dH1
        where = {n: opt.values[n].data_ptr() for n in opt.names}
        losses += [opt.step(loss) for _ in range(STEPS - 1)]
        # from the second step on, the weights are updated where they are
        assert {n: opt.values[n].data_ptr() for n in opt.names} == where
        got = {n: opt.values[n].numpy().copy() for n in opt.names}
    _assert_as_torch(arrays, STEPS, losses, got)


def test_explain_analyze_does_not_update_the_weights():
    with tq.connect(workers=2) as db:
        _, loss = _mlp(db, (8, 16))
        opt = tq.optim.Adam(db, ["w1", "w2"], lr=0.01)
        for _ in range(2):
            opt.step(loss)
        before = {n: opt.values[n].clone() for n in opt.names}
        text = opt.explain(loss, analyze=True)
        assert "EXPLAIN ANALYZE" in text
        for n, value in before.items():
            assert torch.equal(opt.values[n], value)


def test_a_step_failing_in_place_refuses_further_steps(monkeypatch):
    import tensorql_kernels.optimizer_update as update

    with tq.connect(workers=2) as db:
        _, loss = _mlp(db, None)
        opt = tq.optim.Adam(db, ["w1", "w2"], lr=0.01)
        opt.step(loss)

        def failing(*args, **kwargs):
            raise RuntimeError("injected")
        monkeypatch.setattr(update, "_update_in_place", failing)
        with pytest.raises(Exception, match="injected"):
            opt.step(loss)
        monkeypatch.undo()
        with pytest.raises(ExecutionError, match="partly updated"):
            opt.step(loss)
        # the stored weights are those of before the run (no checkpoint was due)
        stored = db.tensor("w1").numpy()
        assert np.isfinite(stored).all()


def test_two_devices_keep_the_double_buffered_step():
    with tq.connect(devices=2) as db:
        _, loss = _mlp(db, (8, 16))
        opt = tq.optim.Adam(db, ["w1", "w2"], lr=0.01)
        opt.step(loss)
        assert opt._plan(loss).in_place == frozenset()


def test_the_step_is_replayed_from_a_tape_with_the_updates_in_place(monkeypatch):
    from tensorql.exec.tape import REPLAYED, Tape

    lowered = []
    lower = Tape.lower.__func__
    monkeypatch.setattr(Tape, "lower", classmethod(
        lambda cls, *a, **k: lowered.append(1) or lower(cls, *a, **k)))
    steps = 6
    with tq.connect(workers=2) as db:
        arrays, loss = _mlp(db, None)
        opt = tq.optim.Adam(db, ["w1", "w2", "b1"], lr=0.01)
        losses = [opt.step(loss) for _ in range(2)]
        graph = opt._plan(loss).physical.task_graph()
        assert graph.programs.get(REPLAYED)
        where = {n: opt.values[n].data_ptr() for n in opt.names}
        losses += [opt.step(loss) for _ in range(steps - 2)]
        tape_ = Tape.of(graph)  # lowered once (the second step), replayed since
        assert len(lowered) == 1 and "tape-stale" not in graph.programs
        assert len(tape_.destinations) == 3  # each update into its weight and moments
        assert {n: opt.values[n].data_ptr() for n in opt.names} == where
        got = {n: opt.values[n].numpy().copy() for n in opt.names}
    _assert_as_torch(arrays, steps, losses, got)


def test_explain_analyze_between_replayed_steps_changes_no_step():
    steps = 6
    with tq.connect(workers=2) as db:
        arrays, loss = _mlp(db, None)
        opt = tq.optim.Adam(db, ["w1", "w2", "b1"], lr=0.01)
        losses = [opt.step(loss) for _ in range(3)]
        before = {n: opt.values[n].clone() for n in opt.names}
        assert "EXPLAIN ANALYZE" in opt.explain(loss, analyze=True)
        for n, value in before.items():
            assert torch.equal(opt.values[n], value)
        losses += [opt.step(loss) for _ in range(steps - 3)]
        # results sent elsewhere once do not count against the tape: replayed again after
        graph = opt._plan(loss).physical.task_graph()
        assert "tape-stale" not in graph.programs
        assert len(graph.programs["tape"].destinations) == 3
        got = {n: opt.values[n].numpy().copy() for n in opt.names}
    _assert_as_torch(arrays, steps, losses, got)


def test_an_optimizer_without_updates_in_place_is_not_replayed():
    from tensorql.exec.tape import REPLAYED

    with tq.connect(workers=2) as db:
        _, loss = _mlp(db, None)
        opt = tq.optim.SGD(db, ["w1", "w2"], lr=0.01)
        opt.step(loss)
        assert not opt._plan(loss).physical.task_graph().programs.get(REPLAYED)
