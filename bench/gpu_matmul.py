"""Chunked bf16 matmul on tensorql's runtime vs one ``torch.matmul``, same GPU, same run.

Goal (issue 29, item 7): the runtime's throughput on a 16384^3 bf16 matmul (tiles 8192, result
chunks left on the device, like ``torch.matmul``'s) >= 0.95x ``torch.matmul``'s. Both are timed
with CUDA events after a warm-up, the median of ``--repeat`` (>= 5) samples each. The result is
checked block by block against the exact product (fp32 on the same GPU, TF32 off); a wrong
result or a missed goal exits 1. ``--json`` writes the record (bench/gpu_common.py).

    python bench/gpu_matmul.py [--json out.json]    # CUDA: 16384^3 bf16, tiles 8192
    python bench/gpu_matmul.py --device cpu         # smoke: 256^3 fp32 on the CPU, goal not applied
    python bench/gpu_matmul.py --split-k            # the plan before the whole-K rule (A/B)

Without CUDA (and without --device cpu) it exits 2 with a message saying so.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
from gpu_common import Record, SumOfSquares, check, cuda_unavailable, goal, guarded, median_seconds

from tensorql.exec.runtime import Runtime
from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph
from tensorql.options import Options
from tensorql.physical.builder import ContributionSeries, WholeK
from tensorql.physical.kernels import ConstChunk, ContractChunk
from tensorql.pipeline.planning import whole_k_bytes

GOAL = 0.95  # runtime throughput / torch.matmul throughput


def tiled_matmul_graph(a: torch.Tensor, b: torch.Tensor, tile: int,
                       whole_k: float | None = None) -> TaskGraph:
    """``a @ b`` as chunk tasks over ``tile``-sized blocks (inputs are sliced, not copied):
    one task per block product, or, with ``whole_k`` (the physical planner's rule,
    :func:`tensorql.pipeline.planning.whole_k_bytes`: bytes up to which an output block's
    products run as one product over the whole K), one task per output block as the planner
    makes it (:class:`tensorql.physical.builder.WholeK`)."""
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
    whole = WholeK.of(whole_k, kernel, {"i": bi, "k": bk, "j": bj})
    series = ContributionSeries(kernel, None, 1, whole)
    for i, j, kk in itertools.product(range(bi), range(bj), range(bk)):
        out = ChunkRef(2, (i, j))
        rows = min(tile, n - i * tile)
        cols = min(tile, m - j * tile)
        inner = min(tile, k - kk * tile)
        inputs = [ChunkRef(0, (i, kk)), ChunkRef(1, (kk, j))]
        sizes[out] = rows * cols * size
        if whole is None:
            tasks.append(Task(tid, tuple(inputs), out, kernel, priority=float(tid),
                              flops=2 * rows * cols * inner))
            tid += 1
        else:
            series.add(out.key, None, inputs, 2 * rows * cols * inner,
                       sizes[inputs[0]] + sizes[inputs[1]])
    for key, _, inputs, task_kernel, flops in (series.tasks() if whole is not None else ()):
        tasks.append(Task(tid, tuple(inputs), ChunkRef(2, key), task_kernel,
                          priority=float(tid), flops=flops))
        tid += 1
    return TaskGraph(tuple(tasks), retain=frozenset({2}), chunk_bytes=sizes,
                     step_names={0: "Scan A", 1: "Scan B", 2: "Aggregate sum over [k]"})


def blockwise_error(outputs, exact: torch.Tensor, tile: int) -> float:
    """Relative error of the result chunks ``outputs`` (ChunkRef(2, (i, j)) -> block) against
    ``exact``, block by block on ``exact``'s device; a missing block counts as wrong."""
    acc = SumOfSquares()
    rows, cols = -(-exact.shape[0] // tile), -(-exact.shape[1] // tile)
    for i, j in itertools.product(range(rows), range(cols)):
        ref = exact[i * tile:(i + 1) * tile, j * tile:(j + 1) * tile]
        got = outputs.get(ChunkRef(2, (i, j)))
        acc.add(got if got is not None else torch.zeros(0), ref)
    return acc.value()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--n", type=int, default=None, help="matrix size (n x n x n)")
    p.add_argument("--tile", type=int, default=None)
    p.add_argument("--repeat", type=int, default=9, help="timed samples (median; >= 5)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--split-k", action="store_true",
                   help="one task per block product (the plan before the whole-K rule)")
    p.add_argument("--json", help="write the record here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        return cuda_unavailable("gpu_matmul")
    cuda = args.device == "cuda"
    n = args.n or (16384 if cuda else 256)
    tile = args.tile or (8192 if cuda else 128)
    dtype = torch.bfloat16 if cuda else torch.float32
    dev = "cuda:0" if cuda else "cpu"
    smoke = not cuda
    repeat = max(5, args.repeat)
    record = Record("gpu_matmul", dev, smoke, config={
        "n": n, "tile": tile, "dtype": str(dtype), "workers": args.workers, "repeat": repeat,
        "split_k": args.split_k,
        "timing": "CUDA events + device synchronize, 1 warm-up, median" if cuda
        else "wall clock, 1 warm-up, median"})
    whole_k = None if args.split_k else whole_k_bytes(Options(devices=dev))
    return guarded(record, args.json, lambda: measure(record, dev, n, tile, dtype, repeat,
                                                      args.workers, whole_k))


def measure(record: Record, dev: str, n: int, tile: int, dtype: torch.dtype, repeat: int,
            workers: int, whole_k: float | None = None) -> None:
    """Time torch.matmul and the runtime, check the runtime's blocks; fills ``record``."""
    torch.backends.cuda.matmul.allow_tf32 = False  # the exact reference is plain fp32
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
    runtime = Runtime(dev, None, workers=workers, results_on_device=True)
    graph = tiled_matmul_graph(a, b, tile, whole_k)
    flops = 2 * n ** 3
    holder = {}

    def run_torch():
        holder["torch"] = torch.matmul(a, b)

    def run_chunked():
        holder["runtime"] = runtime.run(graph)

    print(f"device={dev} n={n} tile={tile} dtype={dtype} workers={workers} "
          f"{'one product over K per block' if whole_k is not None else 'K split'}",
          flush=True)
    t_torch, s_torch = median_seconds(run_torch, dev, repeat)
    record.figures.update({"torch_ms": t_torch * 1e3, "torch_tflops": flops / t_torch / 1e12})
    record.samples["torch_s"] = s_torch
    print(f"torch.matmul: {t_torch * 1e3:.2f} ms  {flops / t_torch / 1e12:.1f} TFLOP/s",
          flush=True)
    t_rt, s_rt = median_seconds(run_chunked, dev, repeat)
    ratio = t_torch / t_rt
    record.figures.update({"runtime_ms": t_rt * 1e3, "runtime_tflops": flops / t_rt / 1e12,
                           "runtime_over_torch_throughput": ratio})
    record.samples["runtime_s"] = s_rt
    print(f"runtime     : {t_rt * 1e3:.2f} ms  {flops / t_rt / 1e12:.1f} TFLOP/s "
          "(result chunks left on the device, like torch.matmul)")
    print(f"ratio runtime/torch throughput: {ratio:.3f}  (goal >= {GOAL})", flush=True)
    goal(record, "runtime/torch.matmul throughput", ratio, ">=", GOAL)
    exact = torch.matmul(a.float(), b.float())
    err = blockwise_error(holder["runtime"].outputs, exact, tile)
    err_torch = SumOfSquares()
    err_torch.add(holder["torch"], exact)
    record.figures.update({"runtime_rel_error": err, "torch_rel_error": err_torch.value()})
    print(f"max relative error vs exact fp32: runtime {err:.2e}, torch.matmul "
          f"{err_torch.value():.2e}")
    check(record, "runtime result vs exact fp32 product", err,
          1e-2 if dtype == torch.bfloat16 else 1e-4)


if __name__ == "__main__":
    sys.exit(main())
