"""The engine's serial mode: the same results, figures and chunk lifetimes as the threaded
mode, on the calling thread, in one order computed once per graph."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import tensorql as tq
from tensorql.errors import ExecutionError
from tensorql.exec.executor import Executor
from tensorql.exec.serial import SerialSchedule, run_serial
from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph
from tensorql.models import attention, llama_block, mlp


class _Const:
    def __init__(self, value, nbytes_elems=1):
        self.value, self.n = value, nbytes_elems

    def run(self, inputs, acc):
        out = torch.full((self.n,), self.value)
        return out if acc is None else acc.add_(out)


class _Sum:
    def run(self, inputs, acc):
        out = sum(inputs)
        return out if acc is None else acc.add_(out)


@pytest.mark.parametrize("build", [mlp, attention, llama_block])
def test_serial_and_threaded_runs_agree(build):
    db = tq.connect(workers=2, tile_target_elems=4096)  # 64-wide tiles: many tasks
    sizes = {"d_model": 128, "d_ff": 192, "seq": 128, "heads": 2, "head_dim": 64}
    work = build(db, batch=128 if build is mlp else 1,
                 **{k: v for k, v in sizes.items() if k in build.__code__.co_varnames})
    graph = work.output.compile().physical.task_graph()
    serial = Executor(2, mode="serial").run(graph)
    threaded = Executor(2, mode="threads").run(graph)
    assert serial.outputs.keys() == threaded.outputs.keys()
    for ref, value in serial.outputs.items():
        torch.testing.assert_close(value, threaded.outputs[ref], rtol=1e-5, atol=1e-5)
    assert serial.stats.serial and not threaded.stats.serial
    assert serial.stats.tasks == threaded.stats.tasks == len(graph.tasks)
    for step, figures in threaded.stats.steps.items():
        assert serial.stats.steps[step].tasks == figures.tasks
        assert serial.stats.steps[step].bytes_in == figures.bytes_in
    assert serial.stats.bytes_read == threaded.stats.bytes_read
    assert len(graph.tasks) > 20


def test_contributions_accumulate_and_chunks_are_freed_after_their_last_reader():
    a, b, c, d = (ChunkRef(n, ()) for n in range(4))
    big = 1 << 14  # elements: 64 KiB a chunk
    graph = TaskGraph(tasks=(
        Task(0, (), a, _Const(1.0, big)), Task(1, (), a, _Const(2.0, big)),  # a = 3
        Task(2, (a,), b, _Sum()),  # b = 3, the last reader of a
        Task(3, (b, b), c, _Sum()),  # c = 6, the last reader of b
        Task(4, (c,), d, _Sum())), retain=frozenset({3}))
    schedule = SerialSchedule.of(graph)
    assert SerialSchedule.of(graph) is schedule  # kept with the graph
    firsts = [entry.first for entry in schedule.tasks]
    assert firsts == [True, False, True, True, True]
    result = run_serial(graph)
    assert result.outputs[d].eq(6.0).all() and set(result.outputs) == {d}
    # never more than two 64 KiB chunks alive (a chunk and the one made from it)
    assert result.stats.peak_live_bytes == 2 * big * 4


def test_a_streamed_run_hands_each_result_chunk_to_the_sink_and_keeps_none():
    refs = [ChunkRef(0, (k,)) for k in range(3)]
    graph = TaskGraph(tasks=tuple(Task(k, (), ref, _Const(float(k)))
                                  for k, ref in enumerate(refs)), retain=frozenset({0}))
    seen, calls = {}, []
    result = Executor(2, mode="serial").run(
        graph, keep_outputs=False, sink=lambda ref, chunk: seen.setdefault(ref, chunk.item()),
        progress=lambda done, total: calls.append((done, total)))
    assert seen == {ref: float(k) for k, ref in enumerate(refs)}
    assert result.outputs == {}
    assert calls == [(1, 3), (2, 3), (3, 3)]


def test_the_serial_mode_runs_on_the_calling_thread():
    threads = set()

    class Where:
        def run(self, inputs, acc):
            threads.add(threading.get_ident())
            return torch.zeros(1)

    graph = TaskGraph(tasks=tuple(Task(k, (), ChunkRef(k, ()), Where()) for k in range(4)),
                      retain=frozenset({3}))
    Executor(2, mode="serial").run(graph)
    assert threads == {threading.get_ident()}


def test_auto_picks_serial_for_short_tasks_and_threads_for_long_ones():
    def graph(flops):
        return TaskGraph(tasks=tuple(Task(k, (), ChunkRef(0, (k,)), _Const(1.0), flops=flops)
                                     for k in range(8)), retain=frozenset({0}))

    executor = Executor(workers=2)
    assert executor.runs_serially(graph(10_000))
    assert not executor.runs_serially(graph(50_000_000))
    assert Executor(workers=1).runs_serially(graph(50_000_000))
    assert not Executor(workers=2, mode="threads").runs_serially(graph(10))
    with pytest.raises(ValueError, match="executor mode"):
        Executor(mode="fast")


def test_a_graph_that_cannot_finish_is_refused():
    a, b = ChunkRef(0, ()), ChunkRef(1, ())
    cycle = TaskGraph(tasks=(Task(0, (b,), a, _Sum()), Task(1, (a,), b, _Sum())))
    with pytest.raises(ExecutionError, match="deadlock: 2 task"):
        run_serial(cycle)
    with pytest.raises(ExecutionError, match="reads chunk .* that no task writes"):
        run_serial(TaskGraph(tasks=(Task(0, (ChunkRef(9, ()),), a, _Sum()),)))


def test_explain_analyze_says_a_small_query_ran_serially():
    rng = np.random.default_rng(3)
    db = tq.connect(devices="cpu", workers=2)  # the CPU's serial path
    x = db.from_numpy("x", rng.standard_normal((8, 8)).astype(np.float32), tile=(4, 4))
    text = (x @ x).relu().explain(analyze=True)
    assert "on 1 thread (serial)" in text


def test_constant_slices_are_put_in_place_before_the_loop_and_still_counted():
    from tensorql.physical.kernels import ConstChunk

    a, b, c, d = (ChunkRef(n, ()) for n in range(4))
    weight = torch.arange(4.0)
    graph = TaskGraph(tasks=(
        Task(0, (), a, ConstChunk(weight)), Task(1, (), b, ConstChunk(weight, (slice(1, 3),))),
        Task(2, (), d, ConstChunk(weight)),  # a result of the run: kept in the loop
        Task(3, (a, a), c, _Sum())), retain=frozenset({2, 3}))
    schedule = SerialSchedule.of(graph)
    assert sorted(task.id for _, task in schedule.inline) == [0, 1]
    assert [entry.task.id for entry in schedule.tasks] == [2, 3]
    weight.mul_(10.0)  # updated in place between plan and run: the run reads it afresh
    result = run_serial(graph)
    assert result.outputs[c].tolist() == [0.0, 20.0, 40.0, 60.0]
    assert result.outputs[d].tolist() == [0.0, 10.0, 20.0, 30.0]
    assert b not in result.outputs and result.stats.tasks == 4
    assert {step: s.tasks for step, s in result.stats.steps.items()} == {0: 1, 1: 1, 2: 1, 3: 1}
