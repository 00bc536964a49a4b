"""Offload: a matmul whose working set is 3x the memory_limit, on the event-driven runtime.

Prints, measured in the same run (issue 6, targets b and c):
  * wall time vs the lower bound max(compute time, bytes moved / measured pinned bandwidth)
    (target <= 1.15x), achieved H2D bandwidth (target >= 50 GB/s on a GPU) and peak device
    memory vs the limit (torch.cuda.max_memory_allocated on a GPU, tracked bytes on CPU);
  * speed-up over a synchronous move-compute-move baseline (target >= 1.5x).

    python bench/gpu_offload.py                 # CUDA: 32768^2 bf16 operands, tiles 4096
    python bench/gpu_offload.py --device cpu    # smoke mode on CPU devices (tiny sizes)

Without CUDA (and without --device cpu) it exits with a message saying so.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from gpu_matmul import tiled_matmul_graph

from tensorql.exec.runtime import Runtime


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def pinned_bandwidth(nbytes: int) -> float:
    """Bytes/s of one pinned host-to-device copy (the pinned buffer is made once, here)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - start)


def baseline(a_blocks, b_blocks, tile: int, device: str) -> float:
    """Synchronous move-compute-move: per output block, copy inputs in, multiply, copy out."""
    start = time.perf_counter()
    bi, bk = len(a_blocks), len(a_blocks[0])
    bj = len(b_blocks[0])
    for i in range(bi):
        for j in range(bj):
            acc = None
            for k in range(bk):
                x = a_blocks[i][k].to(device)
                y = b_blocks[k][j].to(device)
                acc = x @ y if acc is None else acc.addmm_(x, y)
                _sync(device != "cpu")
            acc.to("cpu")
            _sync(device != "cpu")
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--tile", type=int, default=None)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("gpu_offload: CUDA is not available on this machine; nothing measured. "
              "Run with --device cpu for a CPU smoke test.", file=sys.stderr)
        return 2
    n = args.n or (32768 if cuda else 1024)
    tile = args.tile or (4096 if cuda else 128)
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator().manual_seed(0)
    # inputs at rest on the host, tiled so every chunk is contiguous (pinned once on a GPU)
    a = torch.randn(n, n, dtype=dtype, generator=gen)
    b = torch.randn(n, n, dtype=dtype, generator=gen)
    nb = n // tile

    def blocks(x):
        return [[x[r * tile:(r + 1) * tile, c * tile:(c + 1) * tile].contiguous()
                 .pin_memory() if cuda else
                 x[r * tile:(r + 1) * tile, c * tile:(c + 1) * tile].contiguous()
                 for c in range(nb)] for r in range(nb)]

    a_blocks, b_blocks = blocks(a), blocks(b)
    working_set = 3 * n * n * a.element_size()
    limit = working_set // 3
    graph = tiled_matmul_graph(a, b, tile)
    # point the source tasks at the contiguous (pinned) blocks
    from dataclasses import replace

    from tensorql.physical.kernels import ConstChunk
    tasks = tuple(replace(t, kernel=ConstChunk((a_blocks if t.output.step == 0 else b_blocks)
                                               [t.output.key[0]][t.output.key[1]]))
                  if not t.inputs else t for t in graph.tasks)
    graph = replace(graph, tasks=tasks)
    device = "cuda:0" if cuda else "cpu"
    workers = 2
    runtime = Runtime(device, limit, workers=workers, host_pool_bytes=2 * limit)
    runtime.run(graph)  # warm-up (kernels, pinned pool)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result = runtime.run(graph)
    _sync(cuda)
    wall = time.perf_counter() - start
    dev = result.stats.devices[0]
    peak = torch.cuda.max_memory_allocated() if cuda else dev.peak_bytes
    # compute time alone: the same chunk kernels with everything resident, no limit
    resident = Runtime(device, None, workers=workers, results_on_device=True)
    if cuda:
        dev_graph = tiled_matmul_graph(a.to(device), b.to(device), tile)
    else:
        dev_graph = graph
    resident.run(dev_graph)
    _sync(cuda)
    t0 = time.perf_counter()
    resident.run(dev_graph)
    _sync(cuda)
    compute = time.perf_counter() - t0
    if cuda:
        del dev_graph
        torch.cuda.empty_cache()
    moved = dev.bytes_h2d + dev.bytes_d2h
    bw = pinned_bandwidth(min(1 << 30, limit)) if cuda else None
    bound = max(compute, moved / bw) if bw else compute
    t_base = baseline(a_blocks, b_blocks, tile, device if cuda else "cpu")
    h2d_rate = dev.bytes_h2d / dev.copy_s if dev.copy_s else float("nan")
    print(f"device={args.device} n={n} tile={tile} dtype={dtype} working set "
          f"{working_set / 2**30:.2f} GiB = 3x memory_limit {limit / 2**30:.3f} GiB")
    print(f"runtime wall {wall * 1e3:.1f} ms; compute alone {compute * 1e3:.1f} ms; moved "
          f"{moved / 2**30:.2f} GiB" + (f" at pinned {bw / 1e9:.1f} GB/s" if bw else ""))
    print(f"ratio wall / lower bound: {wall / bound:.3f}  (target <= 1.15)")
    print(f"achieved H2D: {h2d_rate / 1e9:.1f} GB/s over copy-lane time "
          f"(target >= 50 GB/s on a GPU; CPU devices share RAM, copies are zero-copy)")
    print(f"peak device memory {peak / 2**20:.1f} MiB vs limit {limit / 2**20:.1f} MiB: "
          f"{'OK' if peak <= limit else 'EXCEEDED'}; evictions {dev.evictions}, "
          f"reloads {dev.reloads}, copy/compute overlap {dev.overlap_s * 1e3:.1f} ms")
    print(f"synchronous move-compute-move baseline {t_base * 1e3:.1f} ms; "
          f"speed-up {t_base / wall:.2f}x  (target >= 1.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
