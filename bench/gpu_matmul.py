"""Chunked bf16 matmul on the event-driven runtime vs one ``torch.matmul``, same run.

Target (issue 6, a): runtime throughput >= 0.9x torch.matmul at 16384^3 on one GPU.

    python bench/gpu_matmul.py                 # CUDA: 16384^3 bf16, tiles 8192
    python bench/gpu_matmul.py --device cpu    # smoke mode: tiny sizes on CPU devices

Without CUDA (and without --device cpu) it exits with a message saying so.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch

from tensorql.exec.runtime import Runtime
from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph
from tensorql.physical.kernels import ConstChunk, ContractChunk


def tiled_matmul_graph(a: torch.Tensor, b: torch.Tensor, tile: int) -> TaskGraph:
    """``a @ b`` as chunk tasks over ``tile``-sized blocks (inputs are sliced, not copied)."""
    n, k = a.shape
    m = b.shape[1]
    bi, bk, bj = -(-n // tile), -(-k // tile), -(-m // tile)
    dtype = {torch.bfloat16: "bfloat16", torch.float32: "float32",
             torch.float64: "float64"}[a.dtype]
    size = a.element_size()
    tasks, sizes, tid = [], {}, 0

    def block(x, r, c):
        return x[r * tile:(r + 1) * tile, c * tile:(c + 1) * tile]

    for name, x, rows, cols in (("A", a, bi, bk), ("B", b, bk, bj)):
        step = 0 if name == "A" else 1
        for r, c in itertools.product(range(rows), range(cols)):
            ref = ChunkRef(step, (r, c))
            chunk = block(x, r, c)
            tasks.append(Task(tid, (), ref, ConstChunk(chunk), priority=-1.0))
            sizes[ref] = chunk.numel() * size
            tid += 1
    kernel = ContractChunk(in_labels=(("i", "k"), ("k", "j")), out_labels=("i", "j"),
                           dtype=dtype)
    for i, j, kk in itertools.product(range(bi), range(bj), range(bk)):
        out = ChunkRef(2, (i, j))
        rows = min(tile, n - i * tile)
        cols = min(tile, m - j * tile)
        inner = min(tile, k - kk * tile)
        tasks.append(Task(tid, (ChunkRef(0, (i, kk)), ChunkRef(1, (kk, j))), out, kernel,
                          priority=float(tid), flops=2 * rows * cols * inner))
        sizes[out] = rows * cols * size
        tid += 1
    return TaskGraph(tuple(tasks), retain=frozenset({2}), chunk_bytes=sizes,
                     step_names={0: "Scan A", 1: "Scan B", 2: "Aggregate sum over [k]"})


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--n", type=int, default=None, help="matrix size (n x n x n)")
    p.add_argument("--tile", type=int, default=None)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_matmul: CUDA is not available on this machine; nothing measured. "
              "Run with --device cpu for a CPU smoke test.", file=sys.stderr)
        return 2
    cuda = args.device == "cuda"
    n = args.n or (16384 if cuda else 512)
    tile = args.tile or (8192 if cuda else 128)
    dtype = torch.bfloat16 if cuda else torch.float32
    dev = "cuda:0" if cuda else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
    runtime = Runtime("cuda:0" if cuda else "cpu", None, workers=2, results_on_device=True)
    graph = tiled_matmul_graph(a, b, tile)
    flops = 2 * n ** 3

    def best(fn) -> float:
        fn()  # warm-up
        _sync(args.device)
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            fn()
            _sync(args.device)
            times.append(time.perf_counter() - start)
        return min(times)

    t_torch = best(lambda: torch.matmul(a, b))
    holder = {}

    def run_chunked():
        holder["result"] = runtime.run(graph)

    t_rt = best(run_chunked)
    # correctness on a corner block
    ref = torch.matmul(a[:tile], b[:, :tile]).float()
    got = holder["result"].outputs[ChunkRef(2, (0, 0))].float()
    err = (got - ref.cpu()).abs().max().item() / max(1e-6, ref.abs().max().item())
    print(f"device={args.device} n={n} tile={tile} dtype={dtype}")
    print(f"torch.matmul: {t_torch * 1e3:.2f} ms  {flops / t_torch / 1e12:.2f} TFLOP/s")
    print(f"runtime     : {t_rt * 1e3:.2f} ms  {flops / t_rt / 1e12:.2f} TFLOP/s "
          "(result chunks left on the device, like torch.matmul)")
    print(f"ratio runtime/torch throughput: {t_torch / t_rt:.3f}  (target >= 0.9)")
    print(f"max relative error of block (0,0): {err:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
