"""A training step run again and again on the lanes (an MLP with Adam, as ``bench/train.py``
runs it): what each step costs in the executor, counted, and its results against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq
from tensorql.exec import engine, executor
from tensorql.physical.kernels import ConstChunk

SIZES = (128, 192, 512, 512, 10)  # batch, in, hidden, hidden, classes


def _data():
    batch, d_in, h1, h2, classes = SIZES
    rng = np.random.default_rng(7)
    x = rng.random((batch, d_in))  # float64: the comparison with torch is then exact to
    onehot = np.eye(classes)[rng.integers(0, classes, batch)]  # ~1e-12, order aside
    torch.manual_seed(7)
    layers = [torch.nn.Linear(a, b, dtype=torch.float64)
              for a, b in ((d_in, h1), (h1, h2), (h2, classes))]
    start = {}
    for k, layer in enumerate(layers, start=1):
        start[f"W{k}"] = layer.weight.detach().T.contiguous().numpy()
        start[f"b{k}"] = layer.bias.detach().numpy().copy()
    return x, onehot, start


def _loss(w, xs, ys, log_softmax):
    h = (xs @ w["W1"] + w["b1"]).relu()
    h = (h @ w["W2"] + w["b2"]).relu()
    return -(ys * log_softmax(h @ w["W3"] + w["b3"])).sum() * (1.0 / SIZES[0])


@pytest.fixture
def counted(monkeypatch):
    """Per run of the lanes: the tasks a worker (or the caller) finished one by one."""
    runs: list[int] = []
    finish = executor._Run.finish
    start = executor.Lanes.run

    def counting_finish(self, *args, **kwargs):
        runs[-1] += 1
        return finish(self, *args, **kwargs)

    def counting_run(self, *args, **kwargs):
        runs.append(0)
        return start(self, *args, **kwargs)

    monkeypatch.setattr(executor._Run, "finish", counting_finish)
    monkeypatch.setattr(executor.Lanes, "run", counting_run)
    return runs


def _torch_steps(x, onehot, start, steps: int):
    w = {k: torch.tensor(v, requires_grad=True) for k, v in start.items()}
    opt = torch.optim.Adam(list(w.values()), lr=1e-2, foreach=False)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        value = _loss(w, torch.from_numpy(x), torch.from_numpy(onehot),
                      lambda t: torch.log_softmax(t, dim=1))
        value.backward()
        opt.step()
        losses.append(float(value.detach()))
    return losses, {k: v.detach() for k, v in w.items()}


def test_an_mlp_step_on_the_lanes_matches_torch_and_slices_its_weights_without_tasks(
        counted, monkeypatch):
    from tensorql.pipeline import compile as compiling

    plans = []
    compile_group = compiling.CompiledGroup.compile.__func__

    def counting_compile(cls, *args, **kwargs):
        plans.append(1)
        return compile_group(cls, *args, **kwargs)

    monkeypatch.setattr(compiling.CompiledGroup, "compile", classmethod(counting_compile))
    x, onehot, start = _data()
    with tq.connect(workers=2, intra_op_threads=1, tile_target_elems=1 << 16) as db:
        db.store_many({"x": x, "onehot": onehot, **start})
        opt = tq.optim.Adam(db, list(start), lr=1e-2, checkpoint_every=10 ** 9)
        loss = _loss({k: db.tensor(k) for k in start}, db.tensor("x"), db.tensor("onehot"),
                     lambda t: t.log_softmax(axis=1))
        plans.clear()  # what storing the data planned
        ours = [opt.step(loss) for _ in range(3)]
        group = opt._plan(loss)
        assert len(plans) == 1  # forward, backward and update planned once for every step
        graph = group.physical.task_graph()
        assert graph.programs["executor-template"] is not None  # and prepared once
        config = engine.EngineConfig.of(db.options)
        assert engine.choose_strategy(graph, config) == "lanes"
        views = [t for t in graph.tasks if isinstance(t.kernel, ConstChunk)
                 and t.output.step not in graph.retain]
        # the weights' and Adam slots' slices are taken before the workers start, with no
        # per-task bookkeeping: each step finishes only the tasks that compute something
        assert len(views) >= 20
        assert counted == [len(graph.tasks) - len(views)] * 3
        assert graph.programs["executor-template"].views == tuple(views)
        weights = {k: opt.values[k].clone() for k in start}

    theirs, w = _torch_steps(x, onehot, start, 3)
    np.testing.assert_allclose(ours, theirs, rtol=1e-10)
    for k in start:
        torch.testing.assert_close(weights[k], w[k], rtol=1e-9, atol=1e-10)


def test_an_optimizer_runs_its_step_in_the_strategy_it_names(counted):
    x, onehot, start = _data()
    with tq.connect(workers=2, intra_op_threads=1, tile_target_elems=1 << 16) as db:
        db.store_many({"x": x, "onehot": onehot, **start})
        opt = tq.optim.Adam(db, list(start), lr=1e-2, checkpoint_every=10 ** 9)
        opt.strategy = "serial"
        loss = _loss({k: db.tensor(k) for k in start}, db.tensor("x"), db.tensor("onehot"),
                     lambda t: t.log_softmax(axis=1))
        ours = [opt.step(loss) for _ in range(2)]
        assert counted == []  # never on the lanes
        assert opt._plan(loss).last_stats[0].serial
        opt.strategy = "lanes"
        ours.append(opt.step(loss))
        assert len(counted) == 1
        weights = {k: opt.values[k].clone() for k in start}
    theirs, w = _torch_steps(x, onehot, start, 3)
    np.testing.assert_allclose(ours, theirs, rtol=1e-10)
    for k in start:
        torch.testing.assert_close(weights[k], w[k], rtol=1e-9, atol=1e-10)


def test_a_graph_of_constant_slices_only_completes():
    c = torch.arange(6.0).reshape(2, 3)
    refs = [executor.ChunkRef(0, (k,)) for k in range(2)]
    graph = executor.TaskGraph(tasks=tuple(
        executor.Task(k, (), refs[k], ConstChunk(c, (slice(k, k + 1),))) for k in range(2)))
    result = executor.Executor(workers=2, mode="threads").run(graph)
    assert result.outputs == {} and result.stats.steps[0].tasks == 2
