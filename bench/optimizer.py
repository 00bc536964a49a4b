"""Optimizer benchmark: planning time of a 32-layer LLaMA-7B-shaped graph, and bytes moved by
the auto / data / model strategies at N = 8 for each workload.

Run: ``.venv/bin/python bench/optimizer.py`` (prints a Markdown section for docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

import tensorql as tq
from tensorql.exec.memplan import plan_program
from tensorql.models import attention, llama, llama_block, mlp
from tensorql.optimizer.graph import OpGraph
from tensorql.physical.partitioned import build_partitioned
from tensorql.units import format_bytes


def plan_time(devices: int, repeats: int = 3) -> tuple[float, float, int, tq.PartitionPlan]:
    """Median seconds to build + plan (fresh caches each time), graph build alone, op count."""
    times, graph_times = [], []
    plan = None
    for _ in range(repeats):
        db = tq.connect()
        start = time.perf_counter()
        w = llama(db, layers=32)  # LLaMA-7B: d 4096, 32 heads x 128, d_ff 11008, seq 2048
        built = time.perf_counter()
        plan = tq.optimize(w.output, devices=devices)
        times.append(time.perf_counter() - built)
        graph_times.append(built - start)
    assert plan is not None
    return statistics.median(times), statistics.median(graph_times), len(plan.ops), plan


def memory_row(limit: int = 1 << 30, devices: int = 8) -> str:
    """32 LLaMA-7B layers on 8 devices with a per-device limit below their share of the
    weights: the plan forms and the memory plan's peak per device stays under the limit."""
    db = tq.connect()
    w = llama(db, layers=32)
    start = time.perf_counter()
    plan = tq.optimize(w.output, devices=devices, memory_limit=limit)
    # piece-level tasks (no sub-tiling): the memory plan's bound holds there, and cutting
    # pieces into smaller chunks only lowers what one task holds (219k tasks otherwise)
    graph = build_partitioned(plan, None, sub_tiles=False).task_graph()
    program = plan_program(graph, devices, [limit] * devices)
    seconds = time.perf_counter() - start
    weights = sum(int(np.prod(n.sizes)) * n.itemsize for n in plan.graph.nodes
                  if n.kind == "source")
    peak = max(d.peak_bytes for d in program.devices)
    assert peak <= limit, (peak, limit)
    return (f"| {devices} | {format_bytes(limit)} | {format_bytes(weights // devices)} | "
            f"{len(graph.tasks)} | {format_bytes(peak)} | {seconds:.1f} |")


def main() -> None:
    print("32 LLaMA-7B layers under a memory_limit below their share of the weights "
          "(optimize + physical plan + memory plan):\n")
    print("| devices | memory_limit | weights per device | tasks | memory-plan peak per device "
          "| seconds |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(memory_row())
    print()
    rows = []
    for n in (8, 16):
        seconds, build_s, ops, plan = plan_time(n)
        rows.append(f"| {n} | {ops} | {build_s:.2f} | {seconds:.2f} | "
                    f"{format_bytes(plan.cost.bytes_moved)} |")
    print("Planning a 32-layer LLaMA-7B-shaped graph (batch 1, seq 2048), strategy auto:\n")
    print("| devices | graph nodes | build graph s | optimize s | bytes moved |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    db = tq.connect()
    workloads = {
        "MLP 256x4096x11008": mlp(db, batch=256, d_model=4096, d_ff=11008, materialize=False),
        "attention b4 s512 d4096 h32": attention(db, batch=4, seq=512, d_model=4096, heads=32,
                                                 head_dim=128, materialize=False),
        "LLaMA-7B block b1 s2048": llama_block(db, batch=1, seq=2048, d_model=4096, heads=32,
                                               head_dim=128, d_ff=11008, materialize=False),
        "LLaMA-7B 32 layers b1 s2048": llama(db, layers=32),
    }
    print("\nBytes moved at N = 8 (exact count of the plan; equals what its copies move):\n")
    print("| workload | auto | data | model | data/auto | model/auto |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, w in workloads.items():
        graph_size = len(OpGraph.build(w.output.node).nodes)
        cache: dict = {}
        moved = {s: tq.optimize(w.output, devices=8, strategy=s, cache=cache).cost.bytes_moved
                 for s in ("auto", "data", "model")}
        print(f"| {name} ({graph_size} nodes) | {format_bytes(moved['auto'])} | "
              f"{format_bytes(moved['data'])} | {format_bytes(moved['model'])} | "
              f"{moved['data'] / max(1, moved['auto']):.2f} | "
              f"{moved['model'] / max(1, moved['auto']):.2f} |")


if __name__ == "__main__":
    main()
