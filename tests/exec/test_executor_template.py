"""A task graph run again (a decoder's token after token) starts from a template computed once
per graph; every run still starts fresh from it."""

from __future__ import annotations

import pytest
import torch

from tensorql.errors import ExecutionError
from tensorql.exec.executor import Executor
from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph


class _Const:
    def __init__(self, value: float) -> None:
        self.value = value

    def run(self, inputs, acc):
        return torch.tensor(self.value) if acc is None else acc.add_(self.value)


class _Sum:
    def run(self, inputs, acc):
        out = sum(inputs[1:], inputs[0].clone())
        return out if acc is None else acc.add_(out)

    def combine(self, acc, partial):
        return acc.add_(partial)


def test_runs_of_one_graph_share_a_template_and_start_fresh():
    a, b, c = ChunkRef(0, ()), ChunkRef(1, ()), ChunkRef(2, ())
    graph = TaskGraph(tasks=(Task(0, (), a, _Const(1.0)), Task(1, (), b, _Const(2.0)),
                             Task(2, (a, b), c, _Sum()), Task(3, (a,), c, _Sum())),
                      retain=frozenset({2}))
    first = Executor(workers=2, mode="threads").run(graph).outputs[c].item()
    template = graph.programs["executor-template"]
    second = Executor(workers=1, mode="threads").run(graph).outputs[c].item()
    assert first == second == 4.0
    assert graph.programs["executor-template"] is template
    assert template.pending == {0: 0, 1: 0, 2: 2, 3: 1}  # not consumed by the runs


def test_a_task_reading_an_unwritten_chunk_is_refused():
    graph = TaskGraph(tasks=(Task(0, (ChunkRef(9, ()),), ChunkRef(0, ()), _Sum()),))
    with pytest.raises(ExecutionError, match="reads chunk .* that no task writes"):
        Executor().run(graph)
