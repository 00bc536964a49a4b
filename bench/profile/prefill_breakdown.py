"""Where a LLaMA prefill's time goes: the bench model's cached prefill (``bench/llama.py``: 512
tokens, ~100M parameters, fp32) run ``--runs`` times on ``--workers`` one-thread workers, each
run's per-step statistics (``CompiledGroup.last_stats``) summed by kind of step. Not a bench
(no record, no goal): the measurement behind issue 31's prefill analysis.

    python bench/profile/prefill_breakdown.py [--runs 5] [--workers 2] [--seq 512]

Printed per kind (median over the runs): the busy milliseconds of its tasks (summed over the
workers), the GFLOP the plan estimates for it and the rate per core that gives, and its task
count; then the run's wall time, the busy time shared by the workers (busy / workers) and
the rest (wall - busy / workers: waits for dependencies, the run's own start and finish); the
products' GFLOP at one core's rate of the same oneDNN kernels run alone in this process
(``--calibrate``: a 256 x 768 x 2048 packed product) gives their floor on these workers.

Kinds, by the step's name: ``lm head`` (the last step, the logits' product), ``product``
(a sum over a contracted label of a join with a stored weight: projections, MLP), ``rotary``
(the product with the rotate-half matrix and the pointwise add of the rotated halves),
``attention``, ``norm`` (the sum of squares, its rsqrt and the scaling), ``residual`` (the
adds of the residual stream), ``activation`` (silu(gate) * up), ``other``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for llama.py
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository


def kind_of(name: str, last: bool) -> str:
    """The kind a step named ``name`` is counted under (see the module doc).

    >>> kind_of("Aggregate sum over [e] <- Join mul on [e]", False)
    'rotary'
    >>> kind_of("Pointwise mul <- silu", False), kind_of("Join add on [a, b, c]", False)
    ('activation', 'residual')
    """
    if last:
        return "lm head"
    if name.startswith("Attention"):
        return "attention"
    if name.startswith("Aggregate sum over [e]") or name.startswith("Pointwise add <- mul <- mul"):
        return "rotary"
    if "silu" in name:
        return "activation"
    if name.startswith("Join add"):
        return "residual"
    if "rsqrt" in name or name.startswith("Pointwise mul <- mul") or (
            name.startswith("Aggregate sum over [d] <- Join mul on [b, s, d]")):
        return "norm"
    if name.startswith("Aggregate sum"):
        return "product"
    return "other"


def warm_prefill(workers: int, seq: int):
    """The bench model (``bench/llama.py``) in a session of ``workers`` one-thread workers,
    and its cached prefill of ``seq`` tokens run three times (the plan, the packed weights,
    the allocator's pools): ``(model, prefill)``."""
    import llama

    import tensorql as tq
    from tensorql.models import Llama

    db = tq.connect(workers=workers, intra_op_threads=1)
    ours = Llama.from_transformers(db, llama.hf_model(False))
    prefill = ours.prefill(1, seq)
    for call in range(3):
        prefill.logits(llama.prompt(ours.shape.vocab, seq, call))
    return ours, prefill


def one_core_rate(repeat: int = 15) -> float:
    """GFLOP/s of one thread's packed oneDNN product 256 x 768 x 2048 (a prefill block's
    gate projection), best of ``repeat``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(256, 768, generator=gen), torch.randn(2048, 768, generator=gen)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(previous)
    return 2 * 256 * 768 * 2048 / best / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args(argv)
    import llama

    ours, prefill = warm_prefill(args.workers, args.seq)
    physical = prefill.query().physical
    last = physical.result_step.id
    kinds = {step.id: kind_of(step.name, step.id == last) for step in physical.steps}
    flops = defaultdict(float)
    tasks = defaultdict(int)
    for step in physical.steps:
        flops[kinds[step.id]] += step.est_flops
        tasks[kinds[step.id]] += len(step.tasks)
    busy = defaultdict(list)
    walls, shared = [], []
    for call in range(args.runs):
        prefill.logits(llama.prompt(ours.shape.vocab, args.seq, 100 + call))
        (stats,) = prefill.query().last_stats
        per_kind = defaultdict(float)
        for sid, step in stats.steps.items():
            per_kind[kinds[sid]] += step.busy_s
        for kind in flops:
            busy[kind].append(per_kind.get(kind, 0.0))
        walls.append(stats.wall_s)
        shared.append(sum(per_kind.values()) / stats.workers)
    rate = one_core_rate()
    print(f"prefill of {args.seq} tokens, {args.workers} one-thread workers, median of "
          f"{args.runs} runs; one core's packed product alone: {rate:.1f} GFLOP/s")
    print(f"{'kind':12s} {'busy ms':>9s} {'GFLOP':>8s} {'GFLOP/s/core':>13s} {'tasks':>6s}")
    for kind in sorted(flops, key=lambda k: -statistics.median(busy[k])):
        ms = statistics.median(busy[kind]) * 1e3
        gf = flops[kind] / 1e9
        per_core = gf / (ms / 1e3) if ms else float("nan")
        print(f"{kind:12s} {ms:9.1f} {gf:8.2f} {per_core:13.1f} {tasks[kind]:6d}")
    wall, share = statistics.median(walls) * 1e3, statistics.median(shared) * 1e3
    products = (flops["product"] + flops["lm head"]) / 1e9
    print(f"wall {wall:.1f} ms; busy / workers {share:.1f} ms; rest {wall - share:.1f} ms")
    print(f"products (projections, MLP, LM head) {products:.2f} GFLOP: at one core's rate "
          f"on {args.workers} workers {products / rate / args.workers * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
