"""Where a training step's two threads go, kernel by kernel (issue 31: the LLaMA block's step
scales worse to two threads than torch's). Not a bench (no record, no goal): a profile for a
quiet host.

    python bench/profile/train_kernels.py [--case block|mlp] [--repeat 15] [--torch-only]

* tensorql: the bench's step (``bench/train.py``) is run once more with every kernel of its
  serial run rerun ``--repeat`` times at one and at two torch threads, alternating, the minimum
  of each kept (in-place updates run once and are not listed); the kernels are summed by kind
  (a product's labels, a fused chain's ops), sorted by what two threads lose against half
  the one-thread time. A step the engine runs on its lanes (the MLP) is run once more with
  every task recorded (its kernel, inputs, accumulator and destination), then every kernel
  is rerun alone the same way; beside the sums, the step's own wall time (median of
  ``--repeat`` steps): ``wall - one-thread sum / 2`` is what the lanes lose to idle workers,
  scheduling and two kernels sharing the memory bus, against kernels run alone and perfectly
  balanced (the updates run in place again, on the live weights: a profile, not a bench).
  ``TENSORQL_PACKED_WEIGHTS=0`` as the bench's Intel runs use it.
* torch: the bench's fused-Adam step under ``torch.profiler`` at one and at two threads, self
  CPU per op (on two threads an op's self CPU is its wall time on the calling thread).

On a host whose cores are shared the two-thread figures are worthless (a parallel region
waits for a descheduled thread: single pointwise ops read 8 ms); the one-thread ones hold.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import train  # noqa: E402  (bench/train.py)


def kind(kernel) -> str:
    """A kernel's kind: its type, a product's labels and join, a fused chain's ops."""
    from tensorql.physical import kernels as k

    if isinstance(kernel, k.ContractSeries):
        return "series of " + kind(kernel.kernel)
    if isinstance(kernel, k.ContractChunk):
        labels = ",".join("".join(lab) for lab in kernel.in_labels)
        return f"{labels}->{''.join(kernel.out_labels)} {kernel.join}/{kernel.agg}"
    if isinstance(kernel, k.FusedPointwise):
        return "fused " + " ".join(getattr(op.kernel, "fn", None) or op.kernel.join
                                   for op in kernel.ops)
    if isinstance(kernel, k.MapChunk):
        return f"map {kernel.fn}"
    return type(kernel).__name__


def tensorql_kernels(case: str, repeat: int) -> None:
    import tensorql.exec.serial as serial
    from tensorql.algebra import is_update

    rows: list[tuple[str, float, float]] = []
    active = [False]
    run_first = serial.first_contribution

    def timed(kernel, inputs, dest):
        # an update may write in place (run once); a source reads, it computes nothing
        if not active[0] or not inputs or is_update(getattr(kernel, "join", "")):
            return run_first(kernel, inputs, dest)
        result = []
        best = best_times(lambda: result.append(run_first(kernel, inputs, dest)), repeat)
        rows.append((kind(kernel), best[1], best[2]))
        return result[-1]

    step = getattr(train, f"tq_{case}")("default", 2)
    step()
    step()
    if lanes_kernels(step, repeat):
        return
    serial.first_contribution = timed
    active[0] = True
    try:
        step()
    finally:
        active[0] = False
        serial.first_contribution = run_first
    if not rows:
        print(f"tensorql {case}: no kernel ran serially (the lanes run each on one thread)")
        return
    total = by_kind(rows)
    one = sum(r[1] for r in rows)
    two = sum(r[2] for r in rows)
    print(f"tensorql {case}: {len(rows)} kernels, 1 thread {one * 1e3:.1f} ms, 2 threads "
          f"{two * 1e3:.1f} ms (x{one / two:.2f}); by kind, most lost first:")
    for name, (a, b, n) in sorted(total.items(), key=lambda kv: kv[1][0] / 2 - kv[1][1]):
        print(f"  {a * 1e3:7.2f} -> {b * 1e3:7.2f} ms  x{a / b:4.2f}  lost {(b - a / 2) * 1e3:5.2f}"
              f"  n={n:<3d} {name}")


def best_times(run, repeat: int) -> dict[int, float]:
    """The best time of ``run()`` at 1 and at 2 torch threads over ``repeat`` alternating
    rounds (torch left at 2 threads)."""
    best = {1: float("inf"), 2: float("inf")}
    for rep in range(repeat):
        for threads in ((1, 2) if rep % 2 == 0 else (2, 1)):
            torch.set_num_threads(threads)
            start = time.perf_counter()
            run()
            best[threads] = min(best[threads], time.perf_counter() - start)
    torch.set_num_threads(2)
    return best


def by_kind(rows: list[tuple[str, float, float]]) -> dict[str, list]:
    """Per kernel kind: [1-thread seconds, 2-thread seconds, count]."""
    total: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for name, one, two in rows:
        entry = total[name]
        entry[0] += one
        entry[1] += two
        entry[2] += 1
    return total


def lanes_kernels(step, repeat: int) -> bool:
    """The kernels of a step the engine runs on its lanes, rerun alone (see the module);
    False when the step ran no task on the lanes (a serial step)."""
    import statistics

    import tensorql.exec.executor as ex

    tasks: list[tuple] = []
    execute = ex._execute

    def recording(state, task):
        inputs = [state.values[ref] for ref in task.inputs]
        acc = state.values.get(task.output)
        dest = None
        if acc is None and state.destination is not None and \
                task.output.step in state.graph.retain:
            dest = state.destination(task.output)
        out = execute(state, task)
        tasks.append((task, inputs, acc, dest))
        return out

    ex._execute = recording
    try:
        step()
    finally:
        ex._execute = execute
    if not tasks:
        return False
    walls = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        walls.append(time.perf_counter() - start)
    rows = []
    for task, inputs, acc, dest in tasks:
        if acc is None:
            best = best_times(lambda k=task.kernel, i=inputs, d=dest:
                              ex.first_contribution(k, i, d), repeat)
        else:
            best = best_times(lambda k=task.kernel, i=inputs, a=acc: k.run(i, a), repeat)
        rows.append((kind(task.kernel), best[1], best[2]))
    one = sum(r[1] for r in rows)
    two = sum(r[2] for r in rows)
    wall = statistics.median(walls)
    print(f"tensorql step on the lanes: {len(rows)} tasks; step wall {wall * 1e3:.1f} ms "
          f"(median of {repeat}); kernels alone: 1 thread {one * 1e3:.1f} ms (/2 = "
          f"{one * 5e2:.1f}), 2 threads {two * 1e3:.1f} ms; wall - 1-thread sum/2 = "
          f"{(wall - one / 2) * 1e3:.1f} ms")
    total = by_kind(rows)
    print("  by kind, 1 thread -> 2 threads, longest first:")
    for name, (a, b, n) in sorted(total.items(), key=lambda kv: -kv[1][0]):
        print(f"  {a * 1e3:7.2f} -> {b * 1e3:7.2f} ms  n={n:<3d} {name}")
    return True


def torch_ops(case: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    if case == "mlp":
        step = train.torch_mlp("default", "torch fused")
    else:
        path = os.path.join(tempfile.mkdtemp(prefix="tq-train-kernels-"), "block.npz")
        train.block_arrays("default", path)
        step = train.torch_block("default", "torch fused", path)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for _ in range(3):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                step()
        print(f"torch fused {case}, {threads} thread(s), 5 steps:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=("block", "mlp"), default="block")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--torch-only", action="store_true")
    args = parser.parse_args(argv)
    if not args.torch_only:
        tensorql_kernels(args.case, args.repeat)
    torch_ops(args.case)
    return 0


if __name__ == "__main__":
    sys.exit(main())
