"""The memory plan: Belady evictions, the budget proof under any order, PlanError."""

from __future__ import annotations

import random

import pytest
from runtime_helpers import chunk, matmul_graph

from tensorql.errors import PlanError
from tensorql.exec.memplan import plan_program


def _replay(program, order_seed: int) -> list[int]:
    """Run the ops in a random order that respects dependencies; peak live bytes per device."""
    rng = random.Random(order_seed)
    ndeps = [len(op.deps) for op in program.ops]
    succ = [[] for _ in program.ops]
    for op in program.ops:
        for d in op.deps:
            succ[d].append(op.id)
    ready = [op.id for op in program.ops if not op.deps]
    live = [0] * len(program.devices)
    peak = [0] * len(program.devices)
    started = set()
    running: list[int] = []
    while ready or running:
        # start a random number of ready ops, then finish a random running one
        rng.shuffle(ready)
        for _ in range(rng.randint(1, max(1, len(ready)))):
            if not ready:
                break
            op = program.ops[ready.pop()]
            started.add(op.id)
            if op.kind in ("load", "send", "alloc"):
                live[op.device] += op.nbytes
                peak[op.device] = max(peak[op.device], live[op.device])
            running.append(op.id)
        rng.shuffle(running)
        op = program.ops[running.pop()]
        if op.kind == "free":
            live[op.device] -= op.nbytes
        for s in succ[op.id]:
            ndeps[s] -= 1
            if ndeps[s] == 0:
                ready.append(s)
    assert len(started) == len(program.ops)
    return peak


@pytest.mark.parametrize("chunks", [3, 4, 6, 10])
def test_peak_within_budget_in_any_order(chunks):
    _, graph, _, _ = matmul_graph(n=128, tile=32)
    budget = chunks * chunk(graph)
    program = plan_program(graph, 1, [budget])
    assert program.devices[0].peak_bytes <= budget
    for seed in range(5):
        assert _replay(program, seed)[0] <= budget


def test_small_budget_evicts_and_reloads():
    _, graph, _, _ = matmul_graph(n=128, tile=32)
    tight = plan_program(graph, 1, [3 * chunk(graph)])
    loose = plan_program(graph, 1, [None])
    assert tight.devices[0].evictions > 0
    assert loose.devices[0].evictions == 0
    assert tight.devices[0].bytes_h2d > loose.devices[0].bytes_h2d  # reloads


def test_partial_aggregates_are_written_back_and_reloaded():
    # k-outer order: every output chunk is a partial aggregate for a long time
    _, graph, _, _ = matmul_graph(n=128, tile=32)
    from dataclasses import replace

    tasks = tuple(replace(t, priority=(t.inputs[0].key[1] * 100 + t.id) if t.inputs else -1)
                  for t in graph.tasks)
    graph = replace(graph, tasks=tasks)
    program = plan_program(graph, 1, [4 * chunk(graph)])
    kinds = [(op.kind, op.keep_host) for op in program.ops]
    assert program.devices[0].writebacks > 0
    assert ("load", False) in kinds  # a partial comes back to be added to


def test_budget_below_one_task_is_a_plan_error():
    _, graph, _, _ = matmul_graph(n=64, tile=32)
    with pytest.raises(PlanError, match="memory_limit too small.*needs 24.0 KiB"):
        plan_program(graph, 1, [2 * chunk(graph)])


def test_budget_needs_sizes():
    _, graph, _, _ = matmul_graph(n=64, tile=32)
    from dataclasses import replace

    with pytest.raises(PlanError, match="chunk sizes"):
        plan_program(replace(graph, chunk_bytes={}), 1, [1 << 20])


def test_two_devices_share_the_work_within_budgets():
    _, graph, _, _ = matmul_graph(n=128, tile=32)
    budget = 4 * chunk(graph)
    program = plan_program(graph, 2, [budget, budget])
    per_device = [sum(op.kind == "compute" for op in program.ops if op.device == d)
                  for d in (0, 1)]
    assert min(per_device) > 0
    for seed in range(3):
        assert max(_replay(program, seed)) <= budget


def test_prefetch_issues_loads_ahead():
    _, graph, _, _ = matmul_graph(n=128, tile=32)
    eager = plan_program(graph, 1, [8 * chunk(graph)], prefetch=4)
    lazy = plan_program(graph, 1, [8 * chunk(graph)], prefetch=0)

    def mean_lead(p):
        """How many ops, on average, a load is issued before its first reader."""
        first_reader = {}
        for op in p.ops:
            for dep in op.deps:
                if p.ops[dep].kind == "load" and op.kind == "compute":
                    first_reader.setdefault(dep, op.id)
        return sum(r - ld for ld, r in first_reader.items()) / len(first_reader)

    assert mean_lead(eager) > mean_lead(lazy) + 1


def _producer_consumer_graph(n: int = 4):
    """Sources s_i, producers p_i = f(s_i) of 100 bytes, consumers c_i = g(p_i) of 10 bytes
    (retained), numbered so that priority order makes every p_i before any c_i."""
    from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph

    src = [ChunkRef(0, (i,)) for i in range(n)]
    prod = [ChunkRef(1, (i,)) for i in range(n)]
    cons = [ChunkRef(2, (i,)) for i in range(n)]
    tasks = [Task(i, (), src[i], None, float(i)) for i in range(n)]
    tasks += [Task(n + i, (src[i],), prod[i], None, float(n + i)) for i in range(n)]
    tasks += [Task(2 * n + i, (prod[i],), cons[i], None, float(2 * n + i)) for i in range(n)]
    sizes = {**{r: 10 for r in src}, **{r: 100 for r in prod}, **{r: 10 for r in cons}}
    return TaskGraph(tasks=tuple(tasks), retain=frozenset({2}), chunk_bytes=sizes), prod, cons


def _computed_order(program) -> list:
    return [op.ref for op in program.ops if op.kind == "compute"]


def test_a_binding_budget_orders_consumers_first_and_nothing_is_written_back():
    graph, prod, cons = _producer_consumer_graph()
    program = plan_program(graph, budgets=[130])  # 4 x 100 bytes of products do not fit
    assert _computed_order(program) == [r for pair in zip(prod, cons) for r in pair]
    evictions = [op for op in program.ops if op.kind == "d2h" and op.evict]
    assert evictions == [] and program.devices[0].peak_bytes <= 130


def test_without_a_binding_budget_the_order_is_the_tasks_priority():
    graph, prod, cons = _producer_consumer_graph()
    for budgets in ([None], [10_000]):
        assert _computed_order(plan_program(graph, budgets=budgets)) == [*prod, *cons]


def _chain_graph(limit_tiles: int = 9):
    """``(A @ B) @ C`` stored in tiles, under a memory limit of ``limit_tiles`` tiles of
    ``A @ B`` (the out-of-core bench's shape, scaled down: its 144 MiB are nine 16 MiB tiles)."""
    import numpy as np

    import tensorql as tq

    n, k, t = 1024, 64, 128
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(s, dtype=np.float32) for s in ((n, k), (k, n), (n, k)))
    limit = limit_tiles * t * t * 4
    db = tq.connect(devices="cpu", workers=2, memory_limit=limit)
    A, B = db.from_numpy("A", a, tile=(t, k)), db.from_numpy("B", b, tile=(k, t))
    C = db.from_numpy("C", c, tile=(t, k))
    expr = (A @ B) @ C
    want = (a.astype(np.float64) @ b) @ c
    return db, expr, expr.compile().physical.task_graph(), limit, want


def test_a_binding_budget_leaves_room_for_every_worker():
    """Planned at the full budget, the simulated order fills it after every task, so each
    allocation waits for the task before it: one kernel at a time on two workers. With room
    kept for a second task (plan_room), the longest chain of dependent work is about half the
    work, the budget still holds in any order, and the result is exact."""
    import numpy as np

    from tensorql.exec.memplan import plan_room
    from tensorql.exec.runtime import Runtime

    db, expr, graph, limit, want = _chain_graph()
    work = sum(t.flops or 0 for t in graph.tasks)
    serial = plan_program(graph, budgets=[limit], concurrency=[1])
    paired = plan_program(graph, budgets=[limit], concurrency=[2])
    assert max(serial.rank) > 0.75 * work  # the old plan: a chain of nearly every product
    assert max(paired.rank) < 0.55 * work
    assert paired.devices[0].peak_bytes <= plan_room(limit, max(
        sum(graph.chunk_bytes[r] for r in {*t.inputs, t.output}) for t in graph.tasks), 2)
    for seed in range(3):
        assert _replay(paired, seed)[0] <= limit
    # a CPU device of two workers plans for two tasks at once
    assert Runtime("cpu", memory_limit=limit, workers=2).plan(graph).ops == paired.ops
    got = expr.numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    db.close()


def test_a_chunk_brought_back_waits_for_the_free_of_its_old_copy():
    """With room kept for a second worker, a chunk evicted and loaded again had a load that
    did not wait for the free of its old copy; the runtime holds a device's chunks by name, so
    that late free dropped the new copy (``KeyError`` in a compute: the GPU probe's offload
    on ``devices="cpu"``). Every free of a chunk is now ordered with every compute reading
    it on that device, and the run matches numpy."""
    import numpy as np

    import tensorql as tq
    from tensorql.exec import memplan

    programs = []
    original = memplan.plan_program

    def recording(*args, **kwargs):
        programs.append(original(*args, **kwargs))
        return programs[-1]

    n = 1024
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    import tensorql.exec.runtime as runtime

    saved = runtime.plan_program
    runtime.plan_program = recording
    try:
        with tq.connect(memory_limit="2MiB", workers=2, devices="cpu") as db:
            A = db.from_numpy("A", a, tile=(n // 4, n // 4))
            got = (A @ A).numpy()
    finally:
        runtime.plan_program = saved
    np.testing.assert_allclose(got, a.astype(np.float64) @ a, rtol=1e-4, atol=1e-3)
    assert programs
    for program in programs:
        ops = {op.id: op for op in program.ops}
        ancestors: dict[int, set[int]] = {}
        frees = [op for op in program.ops if op.kind == "free"]
        for op in program.ops:
            if op.kind != "compute":
                continue
            for ref in set(op.task.inputs):
                for free in frees:
                    if free.ref == ref and free.device == op.device:
                        assert free.id in _behind(ops, op.id, ancestors) or \
                            op.id in _behind(ops, free.id, ancestors), (
                            op.describe(), free.describe())


def _behind(ops: dict, i: int, memo: dict[int, set[int]]) -> set[int]:
    """The ids of every op op ``i`` depends on, directly or not (memoised)."""
    if i not in memo:
        seen, stack = set(), [i]
        while stack:
            for dep in ops[stack.pop()].deps:
                if dep not in seen:
                    seen.add(dep)
                    stack.append(dep)
        memo[i] = seen
    return memo[i]


def _whole_reduction_graph(n: int = 10, tile: int = 100):
    """``z_i = f(y_i, max(y))`` for ``y_i = g(a_i)``: no ``z_i`` can run before the maximum of
    every ``y_i``, so all of ``y`` is live at once (the out-of-core bench's ``spill`` shape).
    ``a_i`` are at rest (10 bytes), ``y_i`` ``tile`` bytes, the maximum and ``z_i`` 1 byte."""
    from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph

    a = [ChunkRef(0, (i,)) for i in range(n)]
    y = [ChunkRef(1, (i,)) for i in range(n)]
    m = ChunkRef(2, ())
    z = [ChunkRef(3, (i,)) for i in range(n)]
    tasks = [Task(i, (), a[i], None, float(i)) for i in range(n)]
    tasks += [Task(n + i, (a[i],), y[i], None, float(i)) for i in range(n)]
    tasks += [Task(2 * n + i, (y[i],), m, None, float(i)) for i in range(n)]
    tasks += [Task(3 * n + i, (y[i], m), z[i], None, float(i)) for i in range(n)]
    sizes = {**{r: 10 for r in a}, **{r: tile for r in y}, m: 1, **{r: 1 for r in z}}
    return TaskGraph(tasks=tuple(tasks), retain=frozenset({3}), chunk_bytes=sizes), y


@pytest.mark.parametrize(("budget", "host_budget"), [(350, 250), (250, 100), (560, 0)])
def test_a_whole_reduction_spills_only_what_no_tier_can_hold(budget, host_budget):
    """When the maximum of all of ``y`` completes, every tile is live: the device keeps what
    its budget holds beside the maximum (``(budget - 1) // tile`` tiles), the host tier what
    its budget holds, and only the rest must go to DuckDB. The consumers released by the
    maximum used to run in priority order (``z_0`` first), so the tiles made last -- the ones
    still resident -- were evicted to make room for ``y_0`` and spilled too (the bench's
    ``spill``: 1008 MiB spilled where its plan needs 928). Now the consumers of the tiles made
    last run first, and the plan spills exactly the minimum."""
    n, tile = 10, 100
    graph, y = _whole_reduction_graph(n, tile)
    program = plan_program(graph, budgets=[budget], host_budget=host_budget)
    on_device = (budget - 1) // tile  # beside the maximum (1 byte)
    in_host = host_budget // tile
    minimum = (n - on_device - in_host) * tile
    assert program.host.spill_bytes == minimum
    assert program.host.reload_bytes == minimum
    written_back = {op.ref for op in program.ops if op.kind == "d2h" and op.evict}
    assert written_back <= set(y) and len(written_back) == n - on_device
    for seed in range(3):
        assert _replay(program, seed)[0] <= budget


def _whole_reduction_rows_graph(rows: int = 4, cols: int = 4, tile: int = 100):
    """``out_i = sum_j f(y_ij, max(y))`` for ``y_ij = g(a_ij)``: the bench's ``spill`` shape
    with its rows: each ``out_i`` is a chain of ``cols`` contributions (they add into one
    chunk, one after another) that the maximum releases all at once."""
    from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph

    keys = [(i, j) for i in range(rows) for j in range(cols)]
    a = {k: ChunkRef(0, k) for k in keys}
    y = {k: ChunkRef(1, k) for k in keys}
    m = ChunkRef(2, ())
    e = {k: ChunkRef(3, k) for k in keys}
    out = {i: ChunkRef(4, (i,)) for i in range(rows)}
    tasks: list = []

    def add(inputs, output, flops):
        tasks.append(Task(len(tasks), inputs, output, None, float(len(tasks)), flops))

    for k in keys:
        add((), a[k], 0)
    for k in keys:
        add((a[k],), y[k], 10**8)
    for k in keys:
        add((y[k],), m, 10**6)
    for k in keys:
        add((y[k], m), e[k], 4 * 10**7)
    for (i, j) in keys:
        add((e[(i, j)],), out[i], 10**8)
    sizes = {**{r: 10 for r in a.values()}, **{r: tile for r in y.values()}, m: 1,
             **{r: tile for r in e.values()}, **{r: 10 for r in out.values()}}
    return TaskGraph(tasks=tuple(tasks), retain=frozenset({4}), chunk_bytes=sizes)


def test_two_workers_get_two_chains_of_contributions_side_by_side():
    """The maximum releases every consumer at once; each row's contributions add into one
    chunk, one after another. Taken row by row (the tiles still resident first), a second
    worker had only the cheap ``f`` tasks to run beside one row's chain (the bench's
    ``spill``: one kernel running for ~40 % of its second phase, in runs under load). With
    two workers the plan now alternates two rows' chains; with one it keeps row by row. Either
    way the plan spills the minimum for its room, and the budget holds in any order."""
    graph = _whole_reduction_rows_graph()
    plans = {n: plan_program(graph, budgets=[900], host_budget=200, concurrency=[n])
             for n in (1, 2)}
    rows = {n: [op.ref.key[0] for op in p.ops if op.kind == "compute" and op.ref.step == 4]
            for n, p in plans.items()}
    # one worker: each row's chain whole, the row made last (still resident) first
    assert rows[1] == [3] * 4 + [2] * 4 + [1] * 4 + [0] * 4
    # two workers: two rows' chains alternate
    assert rows[2] == [3, 2] * 4 + [1, 0] * 4
    # either way only what no tier holds spills: when the maximum completes, the device's
    # room (plan_room: less with room kept for the second worker) keeps the tiles beside it
    # and the first f's output, the host tier two, the rest go to DuckDB
    from tensorql.exec.memplan import largest_task_bytes, plan_room

    for n, plan in plans.items():
        room = plan_room(900, largest_task_bytes(graph), n)
        on_device = (room - 1 - 100) // 100
        assert plan.host.spill_bytes == (16 - on_device - 200 // 100) * 100
    for seed in range(3):
        assert _replay(plans[2], seed)[0] <= 900
