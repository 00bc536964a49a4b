"""Rule ``contiguous_update`` (issue 31): an update join whose gradient comes out in column
blocks is tiled in blocks of whole rows, so the fused Adam kernel updates each chunk of the
weight and its moments in one call over contiguous memory (it updated a column block row by
row: one call per row, ~8x slower), in place, with torch's fused Adam's results."""

from __future__ import annotations

import numpy as np
import pytest
import tensorql_kernels.optimizer_update as update
import torch

import tensorql as tq
from tensorql.logical.plan import Join, Rekey, walk
from tensorql.logical.rules.update import contiguous, contiguous_update

STEPS = 3
# W1 of a two-layer MLP whose W2 (above the automatic tiles' 2^20 elements these sessions aim
# at) is scanned in row blocks: dH1 = dY @ W2.T comes out in column blocks, and so does W1's
# gradient X.T @ dH1
SHAPE = (64, 2048)
W2 = (2048, 640)
TILE_TARGET = 1 << 20


def _problem(db):
    rng = np.random.default_rng(11)
    arrays = {"x": rng.normal(size=(8, SHAPE[0])).astype(np.float32),
              "w1": (rng.normal(size=SHAPE) * 0.05).astype(np.float32),
              "b1": (rng.normal(size=(SHAPE[1],)) * 0.05).astype(np.float32),
              "w2": (rng.normal(size=W2) * 0.05).astype(np.float32)}
    db.store_many(arrays)
    h = (db.tensor("x") @ db.tensor("w1") + db.tensor("b1")).relu()
    y = h @ db.tensor("w2")
    return arrays, (y * y).mean()


NAMES = ["w1", "b1", "w2"]


def _torch(arrays, steps):
    w = {k: torch.tensor(arrays[k], requires_grad=True) for k in NAMES}
    opt = torch.optim.Adam(list(w.values()), lr=0.01, fused=True)
    x = torch.tensor(arrays["x"])
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        y = torch.relu(x @ w["w1"] + w["b1"]) @ w["w2"]
        loss = (y * y).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().numpy() for k, v in w.items()}, losses


class _Calls:
    """Counts the fused update kernel's calls and the tensors each updates."""

    def __init__(self, fused):
        self.fused, self.calls, self.tensors = fused, 0, 0

    def __call__(self, params, *args, **kwargs):
        self.calls += 1
        self.tensors += len(params)
        return self.fused(params, *args, **kwargs)


@pytest.mark.skipif(update._FUSED[update.JoinName.ADAM] is None,
                    reason="this torch has no torch._fused_adam_")
def test_column_block_gradient_updates_in_row_blocks_in_place(monkeypatch):
    calls = _Calls(update._FUSED[update.JoinName.ADAM])
    monkeypatch.setitem(update._FUSED, update.JoinName.ADAM, calls)
    with tq.connect(workers=2, tile_target_elems=TILE_TARGET) as db:
        arrays, loss = _problem(db)
        opt = tq.optim.Adam(db, NAMES, lr=0.01)
        losses = [opt.step(loss)]
        group = opt._plan(loss)
        assert group.in_place == {1, 2, 3}
        assert "contiguous_update" in group.physical.rules_fired
        (w_step,) = [s for s in group.physical.steps if s.relation.shape == (3, *SHAPE)]
        assert contiguous(SHAPE, w_step.relation.grid.tile[1:])
        assert len(w_step.tasks) == 2  # as many chunks as before, for the two workers
        where = {n: opt.values[n].data_ptr() for n in opt.names}
        calls.calls = calls.tensors = 0
        losses += [opt.step(loss) for _ in range(STEPS - 1)]
        assert {n: opt.values[n].data_ptr() for n in opt.names} == where  # in place
        # one call per chunk of each update, each over one contiguous tensor (row by row, the
        # weight's two column blocks were 2 x 64 tensors a step)
        per_step = sum(len(s.tasks) for s in group.physical.steps
                       if s.relation.shape in ((3, *SHAPE), (3, SHAPE[1]), (3, *W2)))
        assert calls.calls == calls.tensors == per_step * (STEPS - 1)
        got = {n: opt.values[n].numpy().copy() for n in opt.names}
    want, want_losses = _torch(arrays, STEPS)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for n in got:
        np.testing.assert_allclose(got[n], want[n], rtol=1e-5, atol=1e-7)


def test_the_rule_retiles_the_gradient_and_leaves_row_blocks_alone():
    with tq.connect(tile_target_elems=TILE_TARGET) as db:
        _, loss = _problem(db)
        opt = tq.optim.Adam(db, NAMES, lr=0.01)
        physical = opt._plan(loss).physical
    nodes = walk(physical.root, *physical.also)
    updates = [n for n in nodes if isinstance(n, Join) and n.relation.shape == (3, *SHAPE)]
    assert updates and all(contiguous(SHAPE, u.relation.grid.tile[1:]) for u in updates)
    # the gradient, computed in column blocks, reaches the update through one Rekey
    assert any(isinstance(src, Rekey) for u in updates for src in u.sources)
    for u in updates:  # row blocks already: the rule leaves the update as it is
        assert contiguous_update(u) is u
