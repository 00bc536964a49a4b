"""The executor's torch threads per task: a big task of a step too narrow to occupy every
worker (a chain of one-chunk contractions) gets every worker's threads when no other big task
runs or is ready, and no other big task starts beside it; the tasks of a wide step keep their
share."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import tensorql as tq
import tensorql.exec.engine as engine
import tensorql.exec.executor as executor


def _threads_by_step(monkeypatch, expr):
    seen: dict[int, set[int]] = {}
    original = executor._first

    def record(state, task, inputs):
        seen.setdefault(task.output.step, set()).add(torch.get_num_threads())
        return original(state, task, inputs)

    monkeypatch.setattr(executor, "_first", record)
    query = expr.compile()
    result = query.run(dense=True)
    return query, result, seen


def test_a_chain_of_big_one_chunk_products_runs_serially_on_every_thread(monkeypatch):
    """All its work is in steps of one task: the workers could not share it out, so it runs
    on the calling thread, every task with every worker's torch threads."""
    import tensorql.exec.serial as serial

    seen: list[int] = []
    original = serial.first_contribution

    def record(kernel, inputs, dest):
        seen.append(torch.get_num_threads())
        return original(kernel, inputs, dest)

    monkeypatch.setattr(serial, "first_contribution", record)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((320, 320)).astype(np.float32)
    previous = torch.get_num_threads()
    with tq.connect(devices="cpu", workers=2, intra_op_threads=1) as db:
        a = db.from_numpy("A", x, tile=(320, 320))  # one chunk: each product is one task
        result = ((a @ a) @ a).compile().run(dense=True)
        np.testing.assert_allclose(result.dense().numpy(), (x @ x) @ x, rtol=1e-3, atol=1e-2)
        assert result.stats.serial and seen and set(seen) == {2}
    assert torch.get_num_threads() == previous  # restored after the run


def test_a_wide_graph_keeps_its_workers():
    x = np.random.default_rng(1).standard_normal((512, 512)).astype(np.float32)
    with tq.connect(devices="cpu", workers=2, intra_op_threads=1) as db:
        a = db.from_numpy("A", x, tile=(128, 128))  # 16 output chunks a step
        result = (a @ a).compile().run(dense=True)
        assert not result.stats.serial


@pytest.fixture
def threaded(monkeypatch):
    """Narrow graphs on the workers too (what the wide-task rule is for)."""
    monkeypatch.setattr(engine, "SERIAL_NARROW_SHARE", 2.0)


def test_a_chain_of_big_one_chunk_products_uses_every_thread(monkeypatch, threaded):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((320, 320)).astype(np.float32)
    previous = torch.get_num_threads()
    with tq.connect(devices="cpu", workers=2, intra_op_threads=1) as db:
        a = db.from_numpy("A", x, tile=(320, 320))  # one chunk: each product is one task
        query, result, seen = _threads_by_step(monkeypatch, (a @ a) @ a)
        np.testing.assert_allclose(result.dense().numpy(), (x @ x) @ x, rtol=1e-3, atol=1e-2)
        products = [s.id for s in query.physical.steps if "Aggregate" in s.name]
        assert products and all(seen[sid] == {2} for sid in products)
    assert torch.get_num_threads() == previous  # restored after the run


def test_tasks_of_a_wide_step_keep_their_share(monkeypatch):
    x = np.random.default_rng(1).standard_normal((512, 512)).astype(np.float32)
    with tq.connect(devices="cpu", workers=2, intra_op_threads=1) as db:
        a = db.from_numpy("A", x, tile=(128, 128))  # 16 output chunks: a wide step
        query, result, seen = _threads_by_step(monkeypatch, a @ a)
        np.testing.assert_allclose(result.dense().numpy(), x @ x, rtol=1e-3, atol=1e-2)
        (product,) = [s.id for s in query.physical.steps if "Aggregate" in s.name]
        assert seen[product] == {1}


def test_a_big_one_chunk_elementwise_step_uses_every_thread(monkeypatch, threaded):
    x = np.random.default_rng(2).standard_normal((1024, 512)).astype(np.float32)
    with tq.connect(devices="cpu", workers=2, intra_op_threads=1) as db:
        a = db.from_numpy("A", x, tile=(1024, 512))  # one chunk of 512K elements
        query, result, seen = _threads_by_step(monkeypatch, (a * 2.0).exp())
        np.testing.assert_allclose(result.dense().numpy(), np.exp(2 * x), rtol=1e-6)
        (step,) = [s.id for s in query.physical.steps if s.tasks and "Scan" not in s.name]
        assert seen[step] == {2}


def _record_spans(monkeypatch) -> list[tuple[float, float, int, int]]:
    """Every task the executor runs from now on, as (start, end, torch threads, big?),
    appended to the list returned as tasks end."""
    spans: list[tuple[float, float, int, int]] = []
    lock = threading.Lock()
    original = executor._execute

    def timed(state, task):
        threads = torch.get_num_threads()
        start = time.perf_counter()
        out = original(state, task)
        with lock:
            spans.append((start, time.perf_counter(), threads, executor._big(task)))
        return out

    monkeypatch.setattr(executor, "_execute", timed)
    return spans


def test_no_other_big_task_runs_beside_one_with_every_thread(monkeypatch, threaded):
    """torch's thread count reaches MKL as one setting for the process: a product started on
    another worker while a task runs wide would share its threads, so while a task runs
    wide the other workers take only small tasks."""
    rng = np.random.default_rng(3)
    x, y = (rng.standard_normal((320, 320)).astype(np.float32) for _ in range(2))
    spans = _record_spans(monkeypatch)
    with tq.connect(devices="cpu", workers=2, intra_op_threads=1) as db:
        a = db.from_numpy("A", x, tile=(320, 320))
        b = db.from_numpy("B", y, tile=(320, 320))
        expr = ((a @ a) + (b @ b)) @ a  # two big products side by side, then one alone
        np.testing.assert_allclose(expr.numpy(), (x @ x + y @ y) @ x, rtol=1e-3, atol=1e-2)
    wide = [span for span in spans if span[2] == 2]
    assert wide  # at least the last product ran with both threads
    for start, end, _, _ in wide:
        beside = [s for s in spans if s[:2] != (start, end) and s[3]]
        assert all(e <= start or s >= end for s, e, _, _ in beside)


class _Sleep:
    """A task kernel that takes ``seconds`` (a sleep: no core used) and records the torch
    threads it ran with."""

    def __init__(self, seconds: float, seen: dict, key: str, scales: bool = False) -> None:
        self.seconds, self.seen, self.key, self.scales = seconds, seen, key, scales

    def run(self, inputs, acc):
        threads = torch.get_num_threads()
        self.seen[self.key] = threads
        time.sleep(self.seconds / threads if self.scales else self.seconds)
        return torch.zeros(1)


def _sleepers(spec: dict[str, float], scales: bool = False):
    """A graph of independent big tasks (one output chunk each), in ``spec``'s order of
    priority, each sleeping its seconds (divided by its torch threads with ``scales``)."""
    from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph

    seen: dict[str, int] = {}
    flops = 100 * executor.WIDE_TASK_FLOPS
    tasks = tuple(Task(n, (), ChunkRef(n, ()), _Sleep(s, seen, key, scales), priority=n,
                       flops=int(flops * s * 10))
                  for n, (key, s) in enumerate(spec.items()))
    return TaskGraph(tasks=tasks, retain=frozenset(range(len(tasks)))), seen


def test_the_last_big_task_of_a_round_gets_the_idle_workers_threads():
    """Three equal big tasks on two one-thread workers: the third would run alone on one
    thread while the other worker idles (3072^3 on 1024 tiles: 9 tasks on 2 lanes); it waits
    for the task beside it to end and runs with both workers' threads."""
    graph, seen = _sleepers({"a": 0.2, "b": 0.2, "c": 0.2}, scales=True)
    previous = torch.get_num_threads()
    lanes = executor.Executor(workers=2, intra_op_threads=1, mode="threads")
    for _ in range(2):  # twice: two threads made it faster, so the rule stays on
        seen.clear()
        result = lanes.run(graph)
        assert seen == {"a": 1, "b": 1, "c": 2}
        assert result.stats.wide_tasks == 1 and not result.stats.serial
    assert torch.get_num_threads() == previous


def test_a_tail_that_gained_nothing_on_two_threads_runs_on_one_next_time():
    """A host whose other core is busy elsewhere: the wide tail took as long as on one thread
    (less than ``TAIL_MIN_SPEEDUP`` faster), so the graph's next run keeps it on one."""
    graph, seen = _sleepers({"a": 0.2, "b": 0.2, "c": 0.2})
    lanes = executor.Executor(workers=2, intra_op_threads=1, mode="threads")
    assert lanes.run(graph).stats.wide_tasks == 1 and seen["c"] == 2
    assert graph.programs.get("lanes-tail-off")
    assert lanes.run(graph).stats.wide_tasks == 0 and seen == {"a": 1, "b": 1, "c": 1}


def test_a_last_task_keeps_its_share_while_the_other_worker_is_far_from_done():
    """The task beside it has most of its time left: waiting for it would cost more than a
    second thread gains, so the last task runs at once on its worker's one thread."""
    graph, seen = _sleepers({"long": 0.8, "b": 0.2, "c": 0.2})
    result = executor.Executor(workers=2, intra_op_threads=1, mode="threads").run(graph)
    assert seen == {"long": 1, "b": 1, "c": 1}
    assert result.stats.wide_tasks == 0


def test_a_worker_with_no_measured_task_does_not_wait():
    """Each worker's first task has no rate to foresee the others' end by: it starts at
    once on its share (two tasks, two workers: no tail to balance)."""
    graph, seen = _sleepers({"a": 0.2, "b": 0.2})
    result = executor.Executor(workers=2, intra_op_threads=1, mode="threads").run(graph)
    assert seen == {"a": 1, "b": 1} and result.stats.wide_tasks == 0


def test_an_odd_count_of_big_product_tiles_is_exact_and_never_wide_beside_another(monkeypatch):
    """9 output tiles of a matmul on 2 workers (real data, against numpy): whatever the tail
    does, the result is exact and no big task ever ran beside one with every thread."""
    rng = np.random.default_rng(4)
    x, y = (rng.standard_normal((768, 768)).astype(np.float32) for _ in range(2))
    recorded = _record_spans(monkeypatch)
    with tq.connect(devices="cpu", workers=2, intra_op_threads=1) as db:
        a = db.from_numpy("A", x, tile=(256, 256))  # 3 x 3 output tiles of 3 products each
        b = db.from_numpy("B", y, tile=(256, 256))
        for _ in range(3):
            result = (a @ b).compile().run(dense=True)
            np.testing.assert_allclose(result.dense().numpy(),
                                       x.astype(np.float64) @ y, rtol=1e-4, atol=1e-4)
            assert result.stats.wide_tasks <= 1
    spans = [span[:3] for span in recorded if span[3]]  # the big tasks
    assert len(spans) == 27
    for start, end, threads in spans:
        if threads == 2:
            assert all(e <= start or s >= end for s, e, _ in spans if (s, e) != (start, end))


def test_no_tail_while_a_big_task_is_still_to_become_ready():
    """None ready is not the end of the run: here ``d`` waits on a small load ``s`` when
    ``c`` is taken (``b`` beside it nearly done). ``c`` is not the last big task, so it runs
    on its share; before, the rule held it for ``b`` and ran it wide while ``d`` became
    ready behind it (3072^3 from the store: a product went wide in the first round)."""
    from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph

    seen: dict[str, int] = {}
    big = 100 * executor.WIDE_TASK_FLOPS
    spec = [("a", 0.2, big, ()), ("b", 0.25, big, ()), ("c", 0.2, big, ()),
            ("s", 0.05, 1, ()), ("d", 0.1, big, (3,))]
    tasks = tuple(Task(n, tuple(ChunkRef(i, ()) for i in deps), ChunkRef(n, ()),
                       _Sleep(sec, seen, key), priority=n, flops=int(flops * sec * 10))
                  for n, (key, sec, flops, deps) in enumerate(spec))
    graph = TaskGraph(tasks=tasks, retain=frozenset({0, 1, 2, 4}))
    executor.Executor(workers=2, intra_op_threads=1, mode="threads").run(graph)
    assert seen["a"] == seen["b"] == seen["c"] == 1
