"""Where the runtime's time goes on a GPU: op counts, lane busy time and the GPU's idle gaps.

``make gpu-check`` says whether a goal is met; this says why not. For the chunked matmul of
``bench/gpu_matmul.py`` it times the runtime at several tile sizes and worker counts beside
two floors built from plain torch calls on the same blocks (``blocks, fp32 sums``: one
``torch.mm`` per block product with the K partials summed in fp32, as the runtime's kernel
does; ``blocks, full K``: one ``torch.mm`` per output block over the whole K); for the
offload of ``bench/gpu_offload.py`` it runs the runtime with its timeline on and prints, per
lane and op kind, how many ops ran and how long they were busy, and how much of the wall the
compute lane was idle. Run it under ``py-spy record --gil`` to see the Python side.

    python bench/gpu_profile.py matmul offload     # on the GPU machine
    python bench/gpu_profile.py --device cpu       # smoke: small sizes on the CPU

>>> union_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)])
3.0
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import replace

import torch
from gpu_common import median_seconds, sync
from gpu_matmul import tiled_matmul_graph
from gpu_offload import host_tiles

from tensorql.exec.runtime import Runtime
from tensorql.options import Options
from tensorql.physical.kernels import ConstChunk
from tensorql.pipeline.planning import whole_k_bytes


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def lanes(result, wall: float) -> None:
    """Per (device, lane, kind): ops and busy ms; the compute lane's idle share of the wall."""
    events = result.stats.timeline
    groups: dict[tuple, list] = {}
    for e in events:
        groups.setdefault((e.device, e.lane, e.kind), []).append(e)
    for (dev, lane, kind), evs in sorted(groups.items()):
        busy = sum(e.end - e.start for e in evs)
        print(f"    {dev:8} {lane:8} {kind:12} ops {len(evs):5d}  busy {busy * 1e3:8.1f} ms  "
              f"mean {busy / len(evs) * 1e6:8.0f} us")
    compute = [(e.start, e.end) for e in events if e.lane == "compute"]
    if compute:
        busy = union_seconds(compute)
        print(f"    compute lane busy (union) {busy * 1e3:.1f} ms of wall {wall * 1e3:.1f} ms "
              f"= {busy / wall:.0%}; first start {min(s for s, _ in compute) * 1e3:.1f} ms")
    for d in result.stats.devices:
        print("    " + d.describe(False) + f", ops {d.ops}")


def matmul(device: str, cuda: bool) -> None:
    n = 16384 if cuda else 512
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    flops = 2 * n ** 3
    t_torch = median_seconds(lambda: torch.matmul(a, b), device)[0]
    print(f"== matmul n={n} {dtype}: torch.matmul {t_torch * 1e3:.2f} ms "
          f"({flops / t_torch / 1e12:.1f} TFLOP/s)", flush=True)
    for tile in ((16384, 8192, 4096) if cuda else (512, 256, 128)):
        nb = n // tile

        def fp32_sums(tile=tile, nb=nb):
            for i in range(nb):
                for j in range(nb):
                    acc = None
                    for k in range(nb):
                        p = torch.mm(a[i * tile:(i + 1) * tile, k * tile:(k + 1) * tile],
                                     b[k * tile:(k + 1) * tile, j * tile:(j + 1) * tile])
                        acc = p.float() if acc is None else acc.add_(p)
                    acc.to(dtype)

        def full_k(tile=tile, nb=nb):
            for i in range(nb):
                for j in range(nb):
                    torch.mm(a[i * tile:(i + 1) * tile], b[:, j * tile:(j + 1) * tile])

        for name, fn in (("blocks, fp32 sums", fp32_sums), ("blocks, full K", full_k)):
            t = median_seconds(fn, device)[0]
            print(f"  tile {tile:5d} floor {name:18}: {t * 1e3:7.2f} ms = "
                  f"{t_torch / t:.3f} of torch's throughput", flush=True)
        split = tiled_matmul_graph(a, b, tile)
        graph = tiled_matmul_graph(a, b, tile, whole_k_bytes(Options(devices=device)))
        for (plan, g), workers in itertools.product((("split K", split), ("planned", graph)),
                                                    (1, 2)):
            rt = Runtime(device, None, workers=workers, results_on_device=True)
            t = median_seconds(lambda rt=rt, g=g: rt.run(g), device)[0]
            print(f"  tile {tile:5d} runtime {plan:7} workers {workers}: {t * 1e3:7.2f} ms = "
                  f"{t_torch / t:.3f} of torch's throughput", flush=True)
        rt = Runtime(device, None, workers=2, results_on_device=True, timeline=True)
        rt.run(graph)
        sync(device)
        t0 = time.perf_counter()
        result = rt.run(graph)
        sync(device)
        lanes(result, time.perf_counter() - t0)


def offload(device: str, cuda: bool) -> None:
    n, tiles = (32768, (4096, 8192)) if cuda else (512, (128, 256))
    dtype = torch.bfloat16 if cuda else torch.float32
    element = torch.tensor([], dtype=dtype).element_size()
    limit = n * n * element
    for tile in tiles:
        a_blocks = host_tiles(n, tile, dtype, device, 0, cuda)
        b_blocks = host_tiles(n, tile, dtype, device, 1, cuda)
        meta = torch.empty(n, n, dtype=dtype, device="meta")
        graph = tiled_matmul_graph(meta, meta, tile)
        tasks = tuple(replace(t, kernel=ConstChunk((a_blocks if t.output.step == 0 else
                                                    b_blocks)[t.output.key[0]][t.output.key[1]]))
                      if not t.inputs else t for t in graph.tasks)
        graph = replace(graph, tasks=tasks)
        out = {}

        def into(ref, tile=tile, out=out):  # the result's host tiles, pinned before the clock
            if ref.step != 2:
                return None
            if ref not in out:
                out[ref] = torch.empty(tile, tile, dtype=dtype, pin_memory=cuda)
            return out[ref]

        def sink(ref, value, into=into):
            if value.data_ptr() != into(ref).data_ptr():
                into(ref).copy_(value)

        modes = {"outputs kept (cloned out of the pinned pool)": {},
                 "into pinned result tiles": dict(sink=sink, destination=into,
                                                  keep_outputs=False)}
        for (mode, kwargs), workers in itertools.product(modes.items(), (1, 2)):
            rt = Runtime(device, limit, workers=workers, host_pool_bytes=2 * limit,
                         timeline=True)
            rt.run(graph, **kwargs)
            sync(device)
            t0 = time.perf_counter()
            result = rt.run(graph, **kwargs)
            sync(device)
            wall = time.perf_counter() - t0
            print(f"== offload n={n} tile {tile} limit {limit >> 20} MiB, workers {workers}, "
                  f"results {mode}: wall {wall * 1e3:.1f} ms (the run's own clock "
                  f"{result.stats.wall_s * 1e3:.1f} ms: the rest is after its last op), "
                  f"tasks {len(graph.tasks)}", flush=True)
            lanes(result, wall)
            del result
            if cuda:
                torch.cuda.empty_cache()


WORKLOADS = {"matmul": matmul, "offload": offload}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workloads", nargs="*", help=f"any of {', '.join(WORKLOADS)} (default: all)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("gpu_profile: no CUDA device (use --device cpu for a smoke run)")
        return 2
    device = "cuda:0" if cuda else "cpu"
    for name in args.workloads or list(WORKLOADS):
        if name not in WORKLOADS:
            p.error(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}")
        WORKLOADS[name](device, cuda)
    return 0


if __name__ == "__main__":
    sys.exit(main())
