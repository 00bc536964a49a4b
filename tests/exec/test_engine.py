"""The one engine: every strategy gives the same result as numpy; the policy picks the same
strategy the run paths picked before it; the memory plan's op kinds each have one record;
the devices option is parsed once into a DeviceSet built through a registry of kinds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_helpers import chunk, dense, matmul_graph

import tensorql as tq
from tensorql.devices import DEVICE_KINDS, DeviceSet, DeviceSpec
from tensorql.errors import OptionError
from tensorql.exec import engine
from tensorql.exec.devices import DEVICE_CLASSES, NullDevice, resolve_devices
from tensorql.exec.distributed import RankLayout
from tensorql.exec.runtime import OP_KINDS, Runtime
from tensorql.options import Options
from tensorql.pipeline import BACKENDS, Capabilities, get_backend


@pytest.mark.parametrize("strategy", ["serial", "lanes", "streams"])
def test_every_local_strategy_gives_numpys_result(strategy):
    q, graph, a, b = matmul_graph(n=96, tile=32, seed=3)
    config = engine.EngineConfig.cpu(workers=2)
    result = engine.run(graph, config, strategy=strategy)
    np.testing.assert_allclose(dense(q, result.outputs).numpy(), a @ b, rtol=1e-12)
    assert result.stats.serial == (strategy == "serial")
    assert sum(s.tasks for s in result.stats.steps.values()) == len(graph.tasks)


def test_streams_under_a_budget_into_a_sink_and_a_destination():
    q, graph, a, b = matmul_graph(n=96, tile=32, seed=4)
    rel = q.physical.result_step.relation
    out = torch.zeros(rel.shape, dtype=torch.float64)
    sid = q.physical.result_step.id

    def sink(ref, value):
        if ref.step == sid:
            out[rel.grid.slices(ref.key)] = value

    config = engine.EngineConfig(DeviceSet.parse("cpu"), memory_limit=6 * chunk(graph))
    assert engine.choose_strategy(graph, config) == "streams"
    result = engine.run(graph, config, sink=sink, keep_outputs=False)
    np.testing.assert_allclose(out.numpy(), a @ b, rtol=1e-12)
    assert result.stats.devices[0].peak_bytes <= 6 * chunk(graph)


def test_the_policy_picks_what_the_run_paths_picked():
    _, graph, _, _ = matmul_graph(n=64, tile=32)  # tiny tasks: a serial graph
    one_cpu = DeviceSet.parse("cpu")
    assert engine.choose_strategy(graph, engine.EngineConfig(one_cpu, workers=2)) == "serial"
    assert engine.choose_strategy(graph, engine.EngineConfig(one_cpu, workers=1)) == "serial"
    for config in (engine.EngineConfig(one_cpu, memory_limit=1 << 20, workers=2),
                   engine.EngineConfig(DeviceSet.parse(2), workers=2),
                   engine.EngineConfig(DeviceSet.parse("null"), workers=2),
                   engine.EngineConfig(one_cpu, workers=2, timeline=True)):
        assert engine.choose_strategy(graph, config) == "streams"
    rank = engine.RankJob(RankLayout(rank=0, world=2))
    assert engine.choose_strategy(graph, engine.EngineConfig(one_cpu, rank=rank)) == "rank"
    # a graph of big tasks in wide steps keeps its worker threads
    rng = np.random.default_rng(0)
    with tq.connect(devices="cpu", workers=2, intra_op_threads=1) as db:  # CPU threads
        x = db.from_numpy("A", rng.standard_normal((512, 512)).astype(np.float32),
                          tile=(128, 128))
        wide = (x @ x).compile().physical.task_graph()
        assert engine.choose_strategy(wide, engine.EngineConfig.of(db.options)) == "lanes"
    # a runtime built with devices of its own keeps them (the streams strategy runs them)
    rt = Runtime([NullDevice("null:0")], None)
    assert engine.EngineConfig.of_runtime(rt).build_runtime() is rt


def test_unknown_strategy_names_the_strategies():
    _, graph, _, _ = matmul_graph(n=32, tile=32)
    with pytest.raises(engine.UnknownStrategyError, match="serial, lanes, streams, rank"):
        engine.run(graph, engine.EngineConfig.cpu(), strategy="fast")
    with pytest.raises(engine.UnknownStrategyError, match="needs a rank"):
        engine.run(graph, engine.EngineConfig.cpu(), strategy="rank")


def test_every_op_kind_of_a_memory_plan_has_one_record():
    _, graph, _, _ = matmul_graph(n=128, tile=32)
    kinds = {op.kind for op in Runtime("cpu", 4 * chunk(graph)).plan(graph).ops}
    rng = np.random.default_rng(1)
    with tq.connect(devices=2) as db:  # a partitioned plan: chunks sent between devices
        x = db.from_numpy("A", rng.standard_normal((64, 64)), tile=(32, 32))
        partitioned = (x @ x).compile().physical.task_graph()
        kinds |= {op.kind for op in engine.EngineConfig.of(db.options).build_runtime()
                  .plan(partitioned).ops}
    assert {"alloc", "free", "compute", "load", "send", "d2h"} <= kinds <= set(OP_KINDS)
    for name, kind in OP_KINDS.items():
        assert kind.name == name
        assert (kind.bookkeeping is None) == (kind.work is not None)  # a lane, or none


def test_devices_are_parsed_once_into_a_set():
    options = Options(devices=["cpu:0", "cpu:1"])
    assert options.device_set is options.device_set  # parsed in __post_init__, kept
    ds = options.device_set
    assert (ds.names, ds.count, ds.all_cpu, ds.uses_cuda, ds.computes_values) == \
        (("cpu:0", "cpu:1"), 2, True, False, True)
    assert options.with_(devices="null:3").device_set == DeviceSet(
        tuple(DeviceSpec("null", i) for i in range(3)), "null:3")
    assert not DeviceSet.parse("null").computes_values
    assert set(DEVICE_CLASSES) == set(DEVICE_KINDS)  # a device class for every kind
    assert [d.name for d in resolve_devices(ds, workers=4)] == ["cpu:0", "cpu:1"]
    assert [d.lanes["compute"] for d in resolve_devices(ds, workers=4)] == [2, 2]


@pytest.mark.parametrize("spec, message", [
    ("tpu:0", "unknown device 'tpu:0'"), (0, "names no device"), ("null:0", "cannot read"),
    (True, "cannot read"), (["cpu:0", "cpu:0"], "names a device twice"), ("cuda:x", "unknown"),
])
def test_bad_devices_are_option_errors(spec, message):
    with pytest.raises(OptionError, match=message):
        Options(devices=spec)


def test_backends_declare_what_they_support():
    assert get_backend("native").supports == Capabilities(True, True, True)
    assert get_backend("duckdb").supports == Capabilities()
    assert all(isinstance(b.supports, Capabilities) for b in BACKENDS.values())
    # a backend that cannot stream still serves db.store: the whole result, then handed over
    rng = np.random.default_rng(5)
    a = rng.standard_normal((6, 5))
    with tq.connect(backend="duckdb") as db:
        A = db.from_numpy("A", a, tile=(3, 5))
        stored = db.store("C", A @ A.T)
        np.testing.assert_allclose(stored.numpy(), a @ a.T, rtol=1e-10)
