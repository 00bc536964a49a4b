"""Offload: a matmul whose working set is 3x the memory_limit, on tensorql's runtime.

Goal (issue 29, item 7): the runtime's wall time within 1.05x of the lower bound
``max(compute, minimum traffic / measured H2D bandwidth)``, where

* compute is ``torch.matmul`` of the whole product with everything resident on the device,
* minimum traffic is each input read once and the output written once (3 n^2 elements),
* the H2D bandwidth is measured here with a pinned host-to-device copy (CUDA events),

and the runtime's peak device memory (``torch.cuda.max_memory_allocated`` growth over the run)
within the limit. Also measured, for comparison: a hand-written double-buffered loop under the
same budget (:func:`double_buffered`: a panel of A's rows resident, B's tiles copied on a copy
stream while the previous one is multiplied, result tiles copied back on a third stream). Each
side writes the result into its own host tiles, pinned and allocated before the clock. Both
results are checked against ``torch.matmul`` on the device (relative error); a wrong result or
a missed goal exits 1. Timings: CUDA events after a warm-up, median of ``--repeat`` samples.

    python bench/gpu_offload.py [--json out.json]  # CUDA: 32768^2 bf16 operands, tiles 4096
    python bench/gpu_offload.py --device cpu       # smoke: 256^2 fp32 on the CPU, goals not applied

Without CUDA (and without --device cpu) it exits 2 with a message saying so.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
from dataclasses import dataclass, replace

import torch
from gpu_common import Record, check, cuda_unavailable, goal, guarded, is_cuda, median_seconds, sync
from gpu_matmul import blockwise_error, tiled_matmul_graph

from tensorql.exec.runtime import Runtime
from tensorql.physical.kernels import ConstChunk

GOAL_BOUND = 1.05  # runtime wall / lower bound


def min_traffic_bytes(n: int, k: int, m: int, element_size: int) -> int:
    """Bytes an (n x k) @ (k x m) product must move at least: each input read once, the
    output written once.

    >>> min_traffic_bytes(32768, 32768, 32768, 2) / 2**30
    6.0
    """
    return (n * k + k * m + n * m) * element_size


def lower_bound(compute_s: float, traffic_bytes: int, bandwidth: float) -> float:
    """``max(compute, traffic / bandwidth)``: no schedule beats either.

    >>> lower_bound(0.1, 6 * 2**30, 50e9) > 0.1
    True
    """
    return max(compute_s, traffic_bytes / bandwidth)


def panel_rows(row_tiles: int, k_tiles: int, budget_tiles: int) -> int:
    """Rows of A's tiles the baseline keeps resident: the most that divide ``row_tiles`` and
    fit the budget beside two B buffers and two sets of result tiles (at least 1).

    >>> panel_rows(8, 8, 64)  # 4 rows: 32 A tiles + 2 B buffers + 2 x 4 results = 42 <= 64
    4
    """
    fits = [r for r in range(1, row_tiles + 1)
            if row_tiles % r == 0 and r * k_tiles + 2 + 2 * r <= budget_tiles]
    return max(fits, default=1)


@dataclass
class BaselineStats:
    rows_per_panel: int
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    device_tiles: int = 0


class _Lanes:
    """Streams and events on CUDA; on the CPU every method is a no-op (copies are plain)."""

    def __init__(self, device: str) -> None:
        self.cuda = is_cuda(device)
        self.compute = torch.cuda.current_stream(device) if self.cuda else None
        self.copy_in = torch.cuda.Stream(device) if self.cuda else None
        self.copy_out = torch.cuda.Stream(device) if self.cuda else None

    def on(self, stream):
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def record(self, stream):
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream, event) -> None:
        if self.cuda and event is not None:
            stream.wait_event(event)


def double_buffered(a_blocks, b_blocks, out_blocks, device: str, budget_bytes: int,
                    stats: BaselineStats | None = None) -> BaselineStats:
    """``out = A @ B`` over host tiles under ``budget_bytes`` of device memory: a panel of
    ``panel_rows`` rows of A's tiles is loaded once; for each column j of B and each k, the
    tile B[k][j] is copied on the copy stream into one of two buffers while the compute stream
    multiplies the other into the panel's result tiles; finished result tiles go back to the
    host on a third stream (two sets alternate). Every copy is ordered by events, nothing
    waits on the host until the end."""
    rows, ks, cols = len(a_blocks), len(a_blocks[0]), len(b_blocks[0])
    tile_bytes = a_blocks[0][0].numel() * a_blocks[0][0].element_size()
    r = panel_rows(rows, ks, max(1, budget_bytes // tile_bytes))
    stats = stats or BaselineStats(r)
    stats.rows_per_panel = r
    lanes = _Lanes(device)
    like = a_blocks[0][0]

    def empty():
        return torch.empty(like.shape, dtype=like.dtype, device=device)

    a_dev = [[empty() for _ in range(ks)] for _ in range(r)]
    b_buf, b_free = [empty(), empty()], [None, None]
    acc, acc_free = [[empty() for _ in range(r)] for _ in range(2)], [None, None]
    stats.device_tiles = r * ks + 2 + 2 * r
    panel_free, step, sets = None, 0, 0
    for p in range(0, rows, r):
        a_ready = [None] * ks
        for j in range(cols):
            s = sets % 2
            lanes.wait(lanes.compute, acc_free[s])  # its last copy back has finished
            for k in range(ks):
                slot = step % 2
                with lanes.on(lanes.copy_in):
                    if j == 0:  # this panel's A tiles of column k, once per panel
                        lanes.wait(lanes.copy_in, panel_free)
                        for ii in range(r):
                            a_dev[ii][k].copy_(a_blocks[p + ii][k], non_blocking=True)
                            stats.bytes_h2d += tile_bytes
                        a_ready[k] = lanes.record(lanes.copy_in)
                    lanes.wait(lanes.copy_in, b_free[slot])
                    b_buf[slot].copy_(b_blocks[k][j], non_blocking=True)
                    stats.bytes_h2d += tile_bytes
                    b_ready = lanes.record(lanes.copy_in)
                if j == 0:
                    lanes.wait(lanes.compute, a_ready[k])
                lanes.wait(lanes.compute, b_ready)
                for ii in range(r):
                    if k == 0:
                        torch.mm(a_dev[ii][k], b_buf[slot], out=acc[s][ii])
                    else:
                        acc[s][ii].addmm_(a_dev[ii][k], b_buf[slot])
                b_free[slot] = lanes.record(lanes.compute)
                step += 1
            done = lanes.record(lanes.compute)
            with lanes.on(lanes.copy_out):
                lanes.wait(lanes.copy_out, done)
                for ii in range(r):
                    out_blocks[p + ii][j].copy_(acc[s][ii], non_blocking=True)
                    stats.bytes_d2h += tile_bytes
                acc_free[s] = lanes.record(lanes.copy_out)
            sets += 1
        panel_free = lanes.record(lanes.compute)
    sync(device)
    return stats


def copy_bandwidth(nbytes: int, device: str, to_device: bool, repeat: int = 5) -> float:
    """Bytes/s of one pinned host<->device copy of ``nbytes`` (median of ``repeat``, CUDA
    events); on the CPU, of a plain memory copy."""
    cuda = is_cuda(device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src, dst = (host, dev) if to_device else (dev, host)
    seconds, _ = median_seconds(lambda: dst.copy_(src, non_blocking=cuda), device, repeat)
    return nbytes / seconds


def host_tiles(n: int, tile: int, dtype, device: str, seed: int, pin: bool):
    """An (n x n) random matrix as a grid of contiguous host tiles (made on ``device``, pinned
    on CUDA), so a tile is copied as one block."""
    gen = torch.Generator(device=device).manual_seed(seed)
    nb = n // tile
    grid = []
    for _ in range(nb):
        row = []
        for _ in range(nb):
            t = torch.randn(tile, tile, dtype=dtype, device=device, generator=gen)
            host = torch.empty(tile, tile, dtype=dtype, pin_memory=pin)
            host.copy_(t)
            row.append(host)
        grid.append(row)
    return grid


def assemble(blocks, device: str) -> torch.Tensor:
    return torch.cat([torch.cat([b.to(device) for b in row], dim=1) for row in blocks], dim=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--tile", type=int, default=None)
    p.add_argument("--repeat", type=int, default=5, help="timed samples (median; >= 5)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--json", help="write the record here")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        return cuda_unavailable("gpu_offload")
    n = args.n or (32768 if cuda else 256)
    tile = args.tile or (4096 if cuda else 64)
    if n % tile:
        p.error(f"--n {n} must be a multiple of --tile {tile}")
    dtype = torch.bfloat16 if cuda else torch.float32
    device = "cuda:0" if cuda else "cpu"
    repeat = max(5, args.repeat)
    element = torch.tensor([], dtype=dtype).element_size()
    working_set = 3 * n * n * element
    limit = working_set // 3
    record = Record("gpu_offload", device, not cuda, config={
        "n": n, "tile": tile, "dtype": str(dtype), "workers": args.workers, "repeat": repeat,
        "working_set_bytes": working_set, "memory_limit_bytes": limit,
        "timing": "CUDA events + device synchronize, 1 warm-up, median" if cuda
        else "wall clock, 1 warm-up, median"})
    return guarded(record, args.json, lambda: measure(record, device, n, tile, dtype, repeat,
                                                      args.workers))


def measure(record: Record, device: str, n: int, tile: int, dtype: torch.dtype, repeat: int,
            workers: int) -> None:
    """Bandwidth, compute alone, the runtime and the baseline, each checked; fills
    ``record`` as it goes (so a failure late keeps the figures measured before it)."""
    cuda = is_cuda(device)
    element = torch.tensor([], dtype=dtype).element_size()
    limit = n * n * element  # working set (A, B, C) / 3
    nb = n // tile
    gib = 2 ** 30
    fig = record.figures
    print(f"device={device} n={n} tile={tile} dtype={dtype} working set "
          f"{3 * limit / gib:.2f} GiB = 3x memory_limit {limit / gib:.3f} GiB", flush=True)

    # inputs at rest on the host as contiguous tiles (pinned on a GPU)
    a_blocks = host_tiles(n, tile, dtype, device, 0, cuda)
    b_blocks = host_tiles(n, tile, dtype, device, 1, cuda)
    h2d = copy_bandwidth(min(1 << 30, limit), device, to_device=True)
    d2h = copy_bandwidth(min(1 << 30, limit), device, to_device=False)
    traffic = min_traffic_bytes(n, n, n, element)
    fig.update({"h2d_bandwidth_gbs": h2d / 1e9, "d2h_bandwidth_gbs": d2h / 1e9,
                "min_traffic_bytes": traffic, "pcie_bound_ms": traffic / h2d * 1e3})

    # compute alone, everything resident: torch.matmul; it is also the reference
    a_dev, b_dev = assemble(a_blocks, device), assemble(b_blocks, device)
    holder = {}

    def run_compute():
        holder["reference"] = torch.matmul(a_dev, b_dev)

    compute, compute_s = median_seconds(run_compute, device, repeat)
    ref = holder.pop("reference")
    a_dev = b_dev = None  # 4 GiB back before the runtime runs
    if cuda:
        torch.cuda.empty_cache()
    bound = lower_bound(compute, traffic, h2d)
    fig.update({"compute_torch_matmul_ms": compute * 1e3, "lower_bound_ms": bound * 1e3})
    record.samples["compute_s"] = compute_s
    print(f"pinned copies: H2D {h2d / 1e9:.1f} GB/s, D2H {d2h / 1e9:.1f} GB/s; minimum traffic "
          f"{traffic / gib:.2f} GiB -> {traffic / h2d * 1e3:.1f} ms; compute alone "
          f"(torch.matmul, resident) {compute * 1e3:.1f} ms; lower bound {bound * 1e3:.1f} ms",
          flush=True)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4

    # the runtime, under memory_limit = working set / 3
    meta = torch.empty(n, n, dtype=dtype, device="meta")
    graph = tiled_matmul_graph(meta, meta, tile)
    tasks = tuple(replace(t, kernel=ConstChunk((a_blocks if t.output.step == 0 else b_blocks)
                                               [t.output.key[0]][t.output.key[1]]))
                  if not t.inputs else t for t in graph.tasks)
    graph = replace(graph, tasks=tasks)
    runtime = Runtime(device, limit, workers=workers, host_pool_bytes=2 * limit)
    # like the baseline, the runtime writes the result into host tiles allocated (pinned)
    # before the clock: its D2H lane copies each result chunk straight into its tile
    # (``destination``, a streamed run keeping no outputs), where a run keeping outputs
    # would clone 2 GiB out of the pinned pool into fresh memory after its last op
    rt_blocks = [[torch.empty(tile, tile, dtype=dtype, pin_memory=cuda) for _ in range(nb)]
                 for _ in range(nb)]

    def into(ref):
        return rt_blocks[ref.key[0]][ref.key[1]] if ref.step == 2 else None

    def sink(ref, value):  # a device without memory of its own hands the chunk over here
        tile_out = rt_blocks[ref.key[0]][ref.key[1]]
        if value.data_ptr() != tile_out.data_ptr():
            tile_out.copy_(value)

    def run_runtime():
        holder["runtime"] = runtime.run(graph, sink=sink, destination=into,
                                        keep_outputs=False)

    sync(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0  # before the runtime's first run
    run_runtime()  # warm-up: kernels, plan, pinned pool
    sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    wall, wall_s = median_seconds(run_runtime, device, repeat, warmup=0)
    dev_stats = holder["runtime"].stats.devices[0]
    peak = (torch.cuda.max_memory_allocated(device) - base if cuda
            else dev_stats.peak_bytes)
    ratio = wall / bound
    fig.update({
        "runtime_ms": wall * 1e3, "runtime_over_bound": ratio,
        "runtime_peak_device_bytes": peak, "runtime_bytes_h2d": dev_stats.bytes_h2d,
        "runtime_bytes_d2h": dev_stats.bytes_d2h, "runtime_evictions": dev_stats.evictions,
        "runtime_reloads": dev_stats.reloads, "runtime_overlap_ms": dev_stats.overlap_s * 1e3})
    record.samples["runtime_s"] = wall_s
    print(f"runtime wall {wall * 1e3:.1f} ms = {ratio:.3f}x the lower bound "
          f"(goal <= {GOAL_BOUND}); moved H2D {dev_stats.bytes_h2d / gib:.2f} GiB, D2H "
          f"{dev_stats.bytes_d2h / gib:.2f} GiB; evictions {dev_stats.evictions}, reloads "
          f"{dev_stats.reloads}; peak device memory {peak / 2**20:.1f} MiB vs limit "
          f"{limit / 2**20:.1f} MiB", flush=True)
    goal(record, "runtime wall / max(compute, min traffic / H2D bandwidth)", ratio, "<=",
         GOAL_BOUND)
    goal(record, "runtime peak device memory / memory_limit", peak / limit, "<=", 1.0)
    holder.pop("runtime")
    err = blockwise_error(_as_outputs(rt_blocks), ref, tile)
    fig["runtime_rel_error"] = err
    check(record, "runtime result vs torch.matmul", err, tol)

    # the double-buffered baseline under the same budget
    out_blocks = [[torch.empty(tile, tile, dtype=dtype, pin_memory=cuda) for _ in range(nb)]
                  for _ in range(nb)]
    sync(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    stats = BaselineStats(0)

    def run_baseline():
        stats.bytes_h2d = stats.bytes_d2h = 0
        double_buffered(a_blocks, b_blocks, out_blocks, device, limit, stats)

    t_base, base_s = median_seconds(run_baseline, device, repeat)
    base_peak = torch.cuda.max_memory_allocated(device) - base if cuda else (
        stats.device_tiles * tile * tile * element)
    base_err = blockwise_error(_as_outputs(out_blocks), ref, tile)
    fig.update({
        "baseline_ms": t_base * 1e3, "baseline_over_bound": t_base / bound,
        "baseline_rows_per_panel": stats.rows_per_panel,
        "baseline_bytes_h2d": stats.bytes_h2d, "baseline_bytes_d2h": stats.bytes_d2h,
        "baseline_peak_device_bytes": base_peak, "runtime_speedup_over_baseline": t_base / wall,
        "baseline_rel_error": base_err})
    record.samples["baseline_s"] = base_s
    print(f"double-buffered baseline {t_base * 1e3:.1f} ms = {t_base / bound:.3f}x the bound "
          f"({stats.rows_per_panel} rows of A per panel, H2D {stats.bytes_h2d / gib:.2f} GiB, "
          f"D2H {stats.bytes_d2h / gib:.2f} GiB, peak {base_peak / 2**20:.1f} MiB); speed-up "
          f"of the runtime over it {t_base / wall:.2f}x")
    check(record, "baseline result vs torch.matmul", base_err, tol)


def _as_outputs(blocks):
    from tensorql.exec.taskgraph import ChunkRef

    return {ChunkRef(2, (i, j)): blocks[i][j]
            for i, j in itertools.product(range(len(blocks)), range(len(blocks[0])))}


if __name__ == "__main__":
    sys.exit(main())
