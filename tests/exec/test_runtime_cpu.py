"""The event-driven runtime on CPU devices under small memory limits: exact results, evictions,
reloads and tracked peak within the budget."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from runtime_helpers import chunk, dense, matmul_graph

import tensorql as tq
from tensorql.errors import ExecutionError
from tensorql.exec.runtime import Runtime, RuntimeStats
from tensorql.exec.timeline import timeline_html
from tensorql.storage.spill import SpillSpace


@pytest.mark.parametrize("chunks", [3, 5, 9])
def test_matmul_exact_under_small_limit(chunks):
    q, graph, a, b = matmul_graph(n=128, tile=32)
    budget = chunks * chunk(graph)
    result = Runtime("cpu", budget, workers=2).run(graph)
    torch.testing.assert_close(dense(q, result.outputs), torch.from_numpy(a @ b))
    dev = result.stats.devices[0]
    assert dev.peak_bytes <= budget
    assert dev.evictions > 0 and dev.reloads > 0
    assert dev.bytes_h2d > 2 * 128 * 128 * 8  # inputs were read in more than once


def test_two_cpu_devices_each_within_budget():
    q, graph, a, b = matmul_graph(n=128, tile=32)
    budget = 4 * chunk(graph)
    result = Runtime(["cpu:0", "cpu:1"], budget, workers=2).run(graph)
    torch.testing.assert_close(dense(q, result.outputs), torch.from_numpy(a @ b))
    assert [d.name for d in result.stats.devices] == ["cpu:0", "cpu:1"]
    for dev in result.stats.devices:
        assert 0 < dev.peak_bytes <= budget
        assert dev.ops > 0


def test_partials_written_back_and_reloaded_stay_exact():
    q, graph, a, b = matmul_graph(n=128, tile=32)
    tasks = tuple(dataclasses.replace(t, priority=(t.inputs[0].key[1] * 100 + t.id)
                                      if t.inputs else -1) for t in graph.tasks)
    graph = dataclasses.replace(graph, tasks=tasks)
    budget = 4 * chunk(graph)
    space = SpillSpace()
    runtime = Runtime("cpu", budget, workers=2, spill_store=space, host_budget=chunk(graph))
    result = runtime.run(graph)
    space.close()
    assert result.stats.program.devices[0].writebacks > 0
    torch.testing.assert_close(dense(q, result.outputs), torch.from_numpy(a @ b))
    assert result.stats.devices[0].peak_bytes <= budget
    assert result.stats.spill_written_bytes > 0  # went through the DuckDB tier
    assert result.stats.spill_read_bytes > 0


def test_api_connect_memory_limit_chain_of_operators(rng):
    x = rng.standard_normal((96, 64)).astype(np.float32)
    w = rng.standard_normal((64, 80)).astype(np.float32)
    v = rng.standard_normal((80, 48)).astype(np.float32)
    limit = 6 * 32 * 32 * 4
    with tq.connect(devices=["cpu:0", "cpu:1"], memory_limit=limit, workers=2) as db:
        X = db.from_numpy("X", x, tile=(32, 32))
        W = db.from_numpy("W", w, tile=(32, 32))
        V = db.from_numpy("V", v, tile=(32, 32))
        H = ((X @ W).relu() @ V).softmax(axis=1)
        got = H.numpy()
        text = H.explain(analyze=True)
    ref = torch.softmax(torch.relu(torch.from_numpy(x) @ torch.from_numpy(w))
                        @ torch.from_numpy(v), dim=1).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    assert "devices:" in text and "cpu:1:" in text and "evictions" in text


def test_max_plus_semiring_under_limit(rng):
    a = rng.integers(-9, 9, (64, 64)).astype(np.float32)
    b = rng.integers(-9, 9, (64, 64)).astype(np.float32)
    with tq.connect(devices="cpu", memory_limit=3 * 16 * 16 * 4, workers=2) as db:
        A, B = db.from_numpy("A", a, tile=(16, 16)), db.from_numpy("B", b, tile=(16, 16))
        got = tq.einsum("ij,jk->ik", A, B, join="add", agg="max").numpy()
    np.testing.assert_array_equal(got, (a[:, :, None] + b[None, :, :]).max(axis=1))


def test_progress_callback_through_numpy(rng):
    a = rng.standard_normal((64, 64)).astype(np.float32)
    seen = []
    with tq.connect(devices="cpu", memory_limit=4 * 16 * 16 * 4, workers=2) as db:
        A = db.from_numpy("A", a, tile=(16, 16))
        (A @ A).numpy(progress=lambda done, total: seen.append((done, total)))
    total = seen[-1][1]
    assert seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_sink_receives_every_result_chunk():
    q, graph, a, b = matmul_graph(n=64, tile=32)
    got = {}
    Runtime("cpu", 4 * chunk(graph)).run(graph, sink=lambda ref, c: got.__setitem__(ref, c))
    assert len(got) == 4
    torch.testing.assert_close(dense(q, got), torch.from_numpy(a @ b))


def test_runtime_asserts_the_budget():
    _, graph, _, _ = matmul_graph(n=64, tile=32)
    runtime = Runtime("cpu", 6 * chunk(graph))
    program = runtime.plan(graph)
    lying = dataclasses.replace(program, devices=tuple(
        dataclasses.replace(d, budget=chunk(graph)) for d in program.devices))
    runtime.plan = lambda g: lying  # a plan whose budget the ops do not respect
    with pytest.raises(ExecutionError, match="exceed the budget"):
        runtime.run(graph)


class _Boom:
    """A kernel that fails."""

    def run(self, inputs, acc):
        raise RuntimeError("kaboom")


def _failing(graph):
    """``graph`` with every product's kernel failing."""
    return dataclasses.replace(graph, tasks=tuple(
        dataclasses.replace(t, kernel=_Boom()) if t.inputs else t for t in graph.tasks))


def test_kernel_failure_names_the_step():
    _, graph, _, _ = matmul_graph(n=64, tile=32)
    with pytest.raises(ExecutionError, match="Aggregate sum.*kaboom"):
        Runtime("cpu", 4 * chunk(graph)).run(_failing(graph))


def test_stats_and_timeline():
    _, graph, _, _ = matmul_graph(n=64, tile=16)
    result = Runtime("cpu", 8 * chunk(graph), workers=2, timeline=True).run(graph)
    stats = result.stats
    assert isinstance(stats, RuntimeStats)
    assert stats.devices[0].busy_s > 0 and stats.wall_s > 0
    assert stats.devices[0].overlap_s <= min(stats.devices[0].busy_s, stats.devices[0].copy_s)
    html = timeline_html(stats)
    assert html.count("<rect") == len(stats.timeline) > 0


def test_unlimited_cpu_runs_the_engine_in_direct_mode(db):
    from tensorql.exec.engine import EngineConfig

    assert EngineConfig.of(db.options.with_(devices="cpu")).runs_direct
    assert not EngineConfig.of(db.options.with_(devices=["cpu:0", "cpu:1"])).runs_direct
    assert not EngineConfig.of(db.options.with_(devices="cpu", memory_limit="1GiB")).runs_direct


def test_results_on_device():
    q, graph, a, b = matmul_graph(n=64, tile=32)
    result = Runtime("cpu", None, results_on_device=True).run(graph)
    torch.testing.assert_close(dense(q, result.outputs), torch.from_numpy(a @ b))
    assert result.stats.devices[0].bytes_d2h == 0


def test_an_inline_device_runs_every_op_on_the_coordinating_thread():
    """A one-worker CPU device with ``inline=True`` (as a distributed rank's) runs the memory
    plan's ops where the runtime submits them: same result, no lane thread, and a failing
    kernel still names its step."""
    import threading

    from tensorql.exec.devices import CPUDevice

    q, graph, a, b = matmul_graph(n=128, tile=32)
    budget = 5 * chunk(graph)
    threads = set()

    class Recorded:
        def __init__(self, kernel):
            self.kernel = kernel

        def run(self, inputs, acc):
            threads.add(threading.get_ident())
            return self.kernel.run(inputs, acc)

    tasks = tuple(dataclasses.replace(t, kernel=Recorded(t.kernel)) for t in graph.tasks)
    result = Runtime([CPUDevice("cpu:0", inline=True)], budget).run(
        dataclasses.replace(graph, tasks=tasks))
    torch.testing.assert_close(dense(q, result.outputs), torch.from_numpy(a @ b))
    assert threads == {threading.get_ident()}
    assert result.stats.devices[0].evictions > 0  # the memory plan was followed
    with pytest.raises(ValueError, match="one worker"):
        CPUDevice("cpu:0", workers=2, inline=True)
    with pytest.raises(ExecutionError, match="Aggregate sum.*kaboom"):
        Runtime([CPUDevice("cpu:0", inline=True)], budget).run(_failing(graph))
