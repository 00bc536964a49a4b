"""Optimizer benchmark: planning time of a 32-layer LLaMA-7B-shaped graph, and bytes moved by
the auto / data / model strategies at N = 8 for each workload.

Run: ``.venv/bin/python bench/optimizer.py [--tiny] [--repeat 7]`` (``--tiny``: 2 layers, the
smoke run of tests/test_benches.py).

Planning time is measured with **fresh caches for real**: before every repeat the contraction
path cache (``PATH_CACHE``) and every ``functools.lru_cache`` of ``tensorql.optimizer`` and
``tensorql.logical`` are cleared (``clear_caches``), and a new session is opened; the median,
IQR and the first (cold-process) figure are printed. There is no peer here: the figures are
tensorql's own.

Checks (exit 1 when wrong, smoke or not): the memory plan's peak per device stays under the
``memory_limit`` it was planned for; ``auto`` moves no more bytes than ``data`` or ``model``
(it is seeded with both). Goal (full runs): 32 layers plan in < 2 s at N = 8 and N = 16.
Not measured here: the *measured* peak of running the plan (a 7B-shaped plan cannot run on
this host); ``tests/optimizer/test_optimizer_execution.py`` checks executed bytes against the
plan at small sizes.

Cluster rows (issue 33): an 80-layer LLaMA-70B-shaped graph (seq 4096, d_model 8192, 64 heads
x 128, d_ff 28672) planned for 8, 32, 64, 256 and 1,024 devices -- on a topology of 8 devices
a node where ``tq.optimize`` takes one, flat otherwise -- with the planning time of ``auto``
(fresh caches; ``data`` and ``model`` then reuse its cache) and, for auto / data / model, the
bytes moved (per link level and the estimated time where the plan has an estimate). Goals
(full runs): 256 devices plan in < 10 s and 1,024 in < 60 s; check (smoke too): ``auto`` is
no worse than ``data`` or ``model`` (estimated time on a topology, bytes when flat). The smoke
run plans a 2-layer small-shape graph at 8, 64 and 256 devices (coarse to fine above 64).
``--cluster-only`` runs these rows alone; ``--cluster-devices 8,256`` picks the counts.

``--vs-distributed [JSON ...]`` (issue 33, point 4) prints the optimizer's time estimate next to
the times ``bench/distributed.py`` measured on this host (its JSON files; by default
``bench/results/distributed.json`` and the 2-rank recheck under ``docs/bench-runs/``): for
each workload (mlp, block, mlp-dp, mlp-tp) and rank count K <= the cores the JSON recorded,
``tq.optimize`` of the query each rank runs -- the same strategy and ``memory_limit``, the
``mlp-tp`` weights stored in shards -- for K devices of the ``cpu-gloo`` machine with stored
tensors loaded where read (``sources_everywhere``, as in a distributed job), and the error of
``estimate.total_s`` against the measured median, and the FLOP rate a rank would need for
the estimate's compute to take the measured time. Nothing is timed or written.
"""

from __future__ import annotations

import argparse
import functools
import gc
import inspect
import os
import sys
import time

import numpy as np
from harness import Record, add_arguments, summarize

import tensorql as tq
from tensorql.exec.memplan import plan_program
from tensorql.models import attention, llama, llama_block, mlp
from tensorql.optimizer.graph import OpGraph
from tensorql.physical.partitioned import build_partitioned
from tensorql.units import format_bytes


def clear_caches() -> int:
    """Empty the path cache and every lru_cache of the optimizer and logical layers; returns
    how many caches were cleared."""
    from tensorql.logical.path import PATH_CACHE

    PATH_CACHE.clear()
    cleared = 1
    for name, module in list(sys.modules.items()):
        if not name.startswith(("tensorql.optimizer", "tensorql.logical")) or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, functools._lru_cache_wrapper):
                value.cache_clear()
                cleared += 1
    gc.collect()
    return cleared


def plan_time(devices: int, repeats: int, layers: int) -> tuple[dict, dict, int,
                                                                 tq.PartitionPlan, float]:
    """Summaries of the seconds to plan and to build the graph (fresh caches each time), the
    op count, the plan and the first (cold) planning time."""
    times, graph_times = [], []
    plan = None
    for _ in range(repeats):
        clear_caches()
        db = tq.connect()
        start = time.perf_counter()
        w = llama(db, layers=layers)  # LLaMA-7B: d 4096, 32 heads x 128, d_ff 11008, seq 2048
        built = time.perf_counter()
        plan = tq.optimize(w.output, devices=devices)
        times.append(time.perf_counter() - built)
        graph_times.append(built - start)
        db.close()
    assert plan is not None
    return summarize(times), summarize(graph_times), len(plan.ops), plan, times[0]


def memory_row(limit: int = 1 << 30, devices: int = 8, layers: int = 32) -> tuple[list, bool]:
    """32 LLaMA-7B layers on 8 devices with a per-device limit below their share of the
    weights: the plan forms and the memory plan's peak per device stays under the limit."""
    clear_caches()
    db = tq.connect()
    w = llama(db, layers=layers)
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
    return ([devices, format_bytes(limit), format_bytes(weights // devices), len(graph.tasks),
             format_bytes(peak), seconds], peak <= limit)


CLUSTER_SHAPE = dict(layers=80, seq=4096, d_model=8192, heads=64, head_dim=128, d_ff=28672)
SMOKE_SHAPE = dict(layers=2, seq=256, d_model=512, heads=8, head_dim=64, d_ff=1376)
CLUSTER_DEVICES = (8, 32, 64, 256, 1024)
SMOKE_DEVICES = (8, 64, 256)
CLUSTER_GOALS = {256: 10.0, 1024: 60.0}  # planning seconds of auto
PER_NODE = 8


def cluster_topology(devices: int) -> dict:
    """``topology=`` for ``tq.optimize`` on nodes of :data:`PER_NODE` devices, where the
    optimizer takes a topology and the count fills whole nodes; {} (flat) otherwise."""
    if "topology" not in inspect.signature(tq.optimize).parameters or devices % PER_NODE:
        return {}
    return {"topology": f"{devices // PER_NODE}x{PER_NODE}"}


def _plan_figures(plan: tq.PartitionPlan) -> tuple[str, float | None]:
    """Bytes moved (per link level where the plan has them) and the estimated seconds."""
    estimate = getattr(plan, "estimate", None)
    if estimate is None:
        return format_bytes(plan.cost.bytes_moved), None
    levels = " / ".join(f"{name} {format_bytes(b)}" for name, b in estimate.level_bytes)
    return f"{format_bytes(plan.cost.bytes_moved)} ({levels})", estimate.total_s


def cluster_rows(record: Record, devices: tuple[int, ...], shape: dict, gated: bool) -> list:
    """One row per device count: planning seconds (wall and CPU) of auto, then bytes (and
    estimated seconds) of auto / data / model; records the goals and the auto check."""
    db = tq.connect()
    w = llama(db, **shape, prefix="c70b_")
    rows = []
    for n in devices:
        clear_caches()
        cache: dict = {}
        topo = cluster_topology(n)
        plans, seconds = {}, {}
        for strategy in ("auto", "data", "model"):
            start, cpu = time.perf_counter(), time.process_time()
            plans[strategy] = tq.optimize(w.output, devices=n, strategy=strategy, cache=cache,
                                          **topo)
            seconds[strategy] = (time.perf_counter() - start, time.process_time() - cpu)
        figures = {s: _plan_figures(p) for s, p in plans.items()}
        timed = all(f[1] is not None for f in figures.values())
        score = {s: (f[1] if timed else plans[s].cost.bytes_moved) for s, f in figures.items()}
        record.check(f"cluster N={n}: auto no worse than data or model "
                     f"({'estimated time' if timed else 'bytes moved'})",
                     score["auto"] <= min(score["data"], score["model"]) * (1 + 1e-9), score)
        wall, cpu = seconds["auto"]
        record.figure(f"cluster plan seconds N={n}", {"wall": wall, "cpu": cpu})
        if gated and n in CLUSTER_GOALS:
            record.goal(f"{shape['layers']} layers of the 70B shape plan in {wall:.1f} s < "
                        f"{CLUSTER_GOALS[n]:g} s at N = {n}", wall < CLUSTER_GOALS[n],
                        {"wall": wall, "cpu": cpu, "goal": CLUSTER_GOALS[n]})
        est = ["-" if figures[s][1] is None else f"{figures[s][1]:.3g} s"
               for s in ("auto", "data", "model")]
        rows.append([n, topo.get("topology", "flat"), round(wall, 2), round(cpu, 2),
                     figures["auto"][0], figures["data"][0], figures["model"][0], *est])
    db.close()
    return rows


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DISTRIBUTED_RUNS = tuple(os.path.join(_ROOT, p) for p in (
    "bench/results/distributed.json",
    "docs/bench-runs/2026-11-26-s4-distributed-ranks2-recheck.json"))


def _distributed_size(run: dict) -> str:
    """The workload size a distributed.py run used (from its command line)."""
    command = run.get("env", {}).get("command", "")
    return "tiny" if "--tiny" in command else "issue" if "--issue-size" in command else "default"


def distributed_estimate(name: str, size: str, ranks: int) -> tuple[tq.PartitionPlan, dict]:
    """The plan (and the sizes) of ``bench/distributed.py``'s workload ``name`` at ``size`` on
    ``ranks`` CPU ranks of one host, planned as each rank plans it."""
    import distributed as dist_bench

    from tensorql.optimizer.topology import Topology

    base, tp = name.split("-")[0], name.endswith("-tp")
    db = tq.connect()
    try:
        if base == "mlp":
            b, d, h = dist_bench.SIZES[size]["mlp"]
            w = mlp(db, batch=b, d_model=d, d_ff=h, prefix="mlp_")
        else:
            b, seq, d, heads, head_dim, ff = dist_bench.SIZES[size]["block"]
            w = llama_block(db, batch=b, seq=seq, d_model=d, heads=heads, head_dim=head_dim,
                            d_ff=ff, prefix="block_")
        expr = dist_bench._sharded_mlp(db, w.arrays, ranks) if tp else w.output
        limit = dist_bench.tp_memory_limit(*dist_bench.SIZES[size]["mlp"], ranks) if tp \
            else None
        plan = tq.optimize(expr, devices=ranks, strategy="data" if name.endswith("-dp")
                           else "auto", memory_limit=limit, sources_everywhere=True,
                           topology=Topology.flat(ranks, "cpu-gloo"))
    finally:
        db.close()
    return plan, {"limit": limit}


def vs_distributed(paths: list[str]) -> list[list]:
    """Rows of estimate against measurement for every (workload, K) of the runs in ``paths``
    (a later file's row replaces an earlier one's), K no more than the recorded cores."""
    import json

    measured: dict[tuple[str, int], tuple[float, float, str, str]] = {}
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        cores = int(run.get("env", {}).get("cores_usable") or 1)
        size = _distributed_size(run)
        for key, timing in run["timings"].items():
            name, _, k = key.partition(" ranks=")
            if int(k) > cores or "tq" not in timing:
                continue
            summary = timing["tq"]["summary"]
            measured[(name, int(k))] = (summary["median"], summary["iqr"], size, path)
    rows = []
    for (name, k), (median, iqr, size, path) in sorted(measured.items()):
        plan, _ = distributed_estimate(name, size, k)
        est = plan.estimate
        rows.append([name, size, k, round(median * 1e3, 2), round(iqr * 1e3, 2),
                     round(est.total_s * 1e3, 2), round(est.compute_s * 1e3, 2),
                     round((est.transfer_s + est.tier_s) * 1e3, 3),
                     f"{(est.total_s / median - 1) * 100:+.0f}%",
                     round(est.compute_s * plan.topology.device_flops / median / 1e9, 1),
                     path.rsplit("/", 1)[-1]])
    return rows


DISTRIBUTED_COLUMNS = ["workload", "size", "K", "measured ms", "IQR ms", "estimate ms",
                       "compute ms", "transfers+tiers ms", "error", "implied GFLOP/s", "run"]

CLUSTER_COLUMNS = ["devices", "topology", "plan auto s", "CPU s", "bytes auto", "bytes data",
                   "bytes model", "est. auto", "est. data", "est. model"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="2 layers, N in (2, 4) (smoke run)")
    parser.add_argument("--cluster-only", action="store_true",
                        help="only the 70B-shaped cluster rows")
    parser.add_argument("--cluster-devices", default=None,
                        help="device counts of the cluster rows, e.g. 8,256")
    parser.add_argument("--vs-distributed", nargs="*", default=None, metavar="JSON",
                        help="print the time estimate against bench/distributed.py's measured "
                        "times (its JSON files; default: the recorded 2-core runs)")
    add_arguments(parser, isolate=None)
    args = parser.parse_args(argv)
    if args.vs_distributed is not None:
        rows = vs_distributed(args.vs_distributed or list(DISTRIBUTED_RUNS))
        widths = [max(len(str(x)) for x in col) for col in zip(DISTRIBUTED_COLUMNS, *rows)]
        for row in [DISTRIBUTED_COLUMNS, *rows]:
            print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
        return 0
    layers = 2 if args.tiny else 32
    counts = (2, 4) if args.tiny else (8, 16)
    record = Record("optimizer", smoke=args.tiny, args=args, argv=argv)
    cluster = (tuple(int(x) for x in args.cluster_devices.split(",")) if args.cluster_devices
               else SMOKE_DEVICES if args.tiny else CLUSTER_DEVICES)
    shape = SMOKE_SHAPE if args.tiny else CLUSTER_SHAPE
    record.table("cluster", CLUSTER_COLUMNS, cluster_rows(record, cluster, shape, not args.tiny),
                 note=f"{shape['layers']} LLaMA layers (seq {shape['seq']}, d_model "
                 f"{shape['d_model']}, {shape['heads']} heads x {shape['head_dim']}, d_ff "
                 f"{shape['d_ff']}), batch 1: planning time of auto with fresh caches "
                 f"(wall and CPU seconds), then bytes moved and estimated time of each "
                 f"strategy; {PER_NODE} devices a node where the optimizer takes a topology.")
    from tables import render_table

    if args.cluster_only:
        print(render_table(record.data, "cluster").rsplit("\n\n", 1)[0], end="\n\n")
        return record.finish()
    limit = (512 << 20) if args.tiny else (1 << 30)
    row, fits = memory_row(limit, counts[0], layers)
    record.check(f"memory plan peak {row[4]} <= memory_limit {row[1]}", fits)
    mem_columns = ["devices", "memory_limit", "weights per device", "tasks",
                   "memory-plan peak per device", "seconds"]
    record.table("memory", mem_columns, [row], note=f"{layers} LLaMA-7B layers under a "
                 "memory_limit below their share of the weights (optimize + physical plan + "
                 "memory plan).")
    rows = []
    for n in counts:
        plan_s, build_s, ops, plan, cold = plan_time(n, args.repeat, layers)
        rows.append([n, ops, build_s["median"], plan_s["median"], plan_s["iqr"], cold,
                     format_bytes(plan.cost.bytes_moved)])
        record.figure(f"plan seconds N={n}", plan_s)
        if not args.tiny:
            record.goal(f"{layers} layers plan in {plan_s['median']:.2f} s < 2 s at N = {n}",
                        plan_s["median"] < 2)
    plan_columns = ["devices", "graph nodes", "build graph s", "optimize s", "IQR s",
                    "first (cold) s", "bytes moved"]
    record.table("planning", plan_columns, rows, note=f"Planning a {layers}-layer "
                 "LLaMA-7B-shaped graph (batch 1, seq 2048), strategy auto; fresh caches and "
                 "session every repeat.")
    db = tq.connect()
    d_ff = 1024 if args.tiny else 11008
    workloads = {
        f"MLP 256x4096x{d_ff}": mlp(db, batch=256, d_model=4096, d_ff=d_ff, materialize=False),
        "attention b4 s512 d4096 h32": attention(db, batch=4, seq=512, d_model=4096, heads=32,
                                                 head_dim=128, materialize=False),
        "LLaMA-7B block b1 s2048": llama_block(db, batch=1, seq=2048, d_model=4096, heads=32,
                                               head_dim=128, d_ff=11008, materialize=False),
        f"LLaMA-7B {layers} layers b1 s2048": llama(db, layers=layers),
    }
    if args.tiny:
        workloads.pop("LLaMA-7B block b1 s2048")
    moved_rows = []
    for name, w in workloads.items():
        graph_size = len(OpGraph.build(w.output.node).nodes)
        cache: dict = {}
        moved = {s: tq.optimize(w.output, devices=8, strategy=s, cache=cache).cost.bytes_moved
                 for s in ("auto", "data", "model")}
        record.check(f"{name}: auto moves no more than data or model",
                     moved["auto"] <= min(moved["data"], moved["model"]), moved)
        moved_rows.append([f"{name} ({graph_size} nodes)", format_bytes(moved["auto"]),
                           format_bytes(moved["data"]), format_bytes(moved["model"]),
                           moved["data"] / max(1, moved["auto"]),
                           moved["model"] / max(1, moved["auto"])])
    moved_columns = ["workload", "auto", "data", "model", "data/auto", "model/auto"]
    record.table("bytes", moved_columns, moved_rows, note="Bytes moved at N = 8 (exact count "
                 "of the plan; equals what its copies move).")
    for name in ("memory", "planning", "bytes", "cluster"):
        print(render_table(record.data, name).rsplit("\n\n", 1)[0], end="\n\n")
    return record.finish()


if __name__ == "__main__":
    sys.exit(main())
