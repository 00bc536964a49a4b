"""The scheduler on null devices: dependency order, critical-path priorities, overlap of
copies with compute in virtual time, no real compute."""

from __future__ import annotations

import pytest
from runtime_helpers import chunk, matmul_graph

from tensorql.exec.devices import NullDevice, SimClock
from tensorql.exec.runtime import Runtime
from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph


class Never:
    """A kernel that must not run on a null device."""

    def run(self, inputs, acc):
        raise AssertionError("null devices run nothing")


def _null(n=1, **kw):
    clock = SimClock()
    return [NullDevice(f"null:{i}", clock=clock, **kw) for i in range(n)]


def test_issue_order_respects_dependencies():
    _, graph, _, _ = matmul_graph(n=128, tile=32)
    devices = _null(2, lanes={"compute": 2, "h2d": 1, "d2h": 1, "d2d": 1})
    runtime = Runtime(devices, 5 * chunk(graph))
    result = runtime.run(graph)
    program = result.stats.program
    issued = {op_id: n for n, op_id in enumerate(
        op for d in devices for _, op in d.log)}  # per device logs
    by_device = {d.name: [op for _, op in d.log] for d in devices}
    for ops in by_device.values():
        position = {op: n for n, op in enumerate(ops)}
        for op_id in ops:
            for dep in program.ops[op_id].deps:
                if dep in position:
                    assert position[dep] < position[op_id]
    assert len(issued) == sum(op.lane != "none" for op in program.ops)
    assert all(d.peak_bytes <= 5 * chunk(graph) for d in result.stats.devices)


def test_null_device_runs_no_kernels():
    _, graph, _, _ = matmul_graph(n=64, tile=32)
    import dataclasses

    graph = dataclasses.replace(graph, tasks=tuple(
        dataclasses.replace(t, kernel=Never()) for t in graph.tasks))
    result = Runtime(_null(), None).run(graph)
    assert result.stats.devices[0].ops > 0


def test_critical_path_runs_first():
    # one long chain (c0 -> c1 -> ... -> c5) and six independent single tasks, all ready at
    # the start; with one compute slot, the chain head must be issued first even though the
    # planner priorities say otherwise.
    tasks, sizes = [], {}
    tid = 0
    for n in range(6):  # independent tasks, best planner priority
        ref = ChunkRef(0, (n,))
        tasks.append(Task(tid, (), ref, Never(), priority=float(n), flops=10))
        sizes[ref] = 8
        tid += 1
    prev = None
    for n in range(6):
        ref = ChunkRef(1, (n,))
        tasks.append(Task(tid, (prev,) if prev else (), ref, Never(), priority=100.0 + n,
                          flops=10))
        sizes[ref] = 8
        prev, tid = ref, tid + 1
    # make every task a compute task: give the independent ones and the chain head 2 writers
    extra = [Task(tid + i, (), t.output, Never(), priority=t.priority, flops=10)
             for i, t in enumerate(tasks) if not t.inputs]
    graph = TaskGraph(tuple(tasks + extra), retain=frozenset({0, 1}), chunk_bytes=sizes)
    devices = _null()
    Runtime(devices, None).run(graph)
    first_compute = next(op for lane, op in devices[0].log if lane == "compute")
    result_program = Runtime(_null(), None).plan(graph)
    assert result_program.ops[first_compute].ref.step == 1  # the chain's head


def test_copies_overlap_compute_in_virtual_time():
    _, graph, _, _ = matmul_graph(n=256, tile=32)
    speed = {"compute": 2e4, "h2d": 1e5, "d2h": 1e5, "d2d": 1e5}
    devices = _null(speed=speed)
    result = Runtime(devices, 12 * chunk(graph)).run(graph)
    dev = result.stats.devices[0]
    assert dev.evictions > 0
    assert dev.overlap_s > 0.5 * min(dev.copy_s, dev.busy_s)
    assert result.stats.wall_s < dev.busy_s + dev.copy_s
    # the runtime keeps compute busy: wall within 15% of the lower bound
    assert result.stats.wall_s <= 1.15 * max(dev.busy_s, dev.copy_s)


@pytest.mark.parametrize("prefetch", [0, 4])
def test_prefetch_never_slower(prefetch):
    _, graph, _, _ = matmul_graph(n=128, tile=32)
    speed = {"compute": 2e4, "h2d": 1e5, "d2h": 1e5, "d2d": 1e5}
    walls = {}
    for p in (0, prefetch):
        walls[p] = Runtime(_null(speed=speed), 8 * chunk(graph), prefetch=p).run(
            graph).stats.wall_s
    assert walls[prefetch] <= walls[0] * 1.001
