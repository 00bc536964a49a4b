"""How two threads share this host: two one-thread lanes against one product on two threads
(issue 31: on the 2-core AMD VM, tensorql's lanes and torch's two-thread products do the same
work at one thread, so which of the two ways uses two threads better decides the MLP's
training step and matmul 3072^3). Not a bench (no record, no goal): a measurement for a quiet
host.

    python bench/profile/corun.py [--repeat 15] [--shapes 256x2048x2048,1024x1024x1024]

For each product ``M x K x N`` (float32), in one process, the forms interleaved, best and
median wall time of ``--repeat`` rounds:

* ``1 thread``: the whole product on one thread;
* ``2 lanes``: its two column halves side by side on two threads of one torch thread each
  (what tensorql's lanes do with two tile products);
* ``2 threads``: the whole product on two torch threads (what torch's step does);

each with MKL's ``torch.mm``, with oneDNN's linear on a packed right operand, and with the
host's packing of ``kernels/packed_weights.py`` (``host``: MKL's packed sgemm on an Intel CPU
with MKL, oneDNN's elsewhere; a new result each call, as tensorql's products against stored
weights make). ``lanes/1t`` is the throughput two lanes reach
against one thread alone: ~2 where the two CPUs are two cores, ~1.2 where they share one
core's FMA units (SMT siblings, or a hypervisor's equivalent). ``2t/lanes`` above 1 means a
two-thread product beats two one-thread lanes on this host (tensorql's serial strategy runs
every kernel on both threads; the lanes, one thread a kernel).

On a host whose cores are busy with other work the figures say nothing: a two-thread product
waits for a descheduled thread, and the lanes lose a core's share.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
from tensorql_kernels import packed_weights


def forms(m: int, k: int, n: int) -> dict[str, object]:
    """The timed forms of one ``m x k x n`` product: name -> a call of no arguments."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    out = torch.empty(m, n)
    halves = [(b[:, :n // 2].contiguous(), out[:, :n // 2]),
              (b[:, n // 2:].contiguous(), out[:, n // 2:])]
    linear = torch.ops.mkldnn._linear_pointwise
    packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), m)
    packed_halves = [torch.ops.mkldnn._reorder_linear_weight(h.t().contiguous(), m)
                     for h, _ in halves]

    def mkl(right, dest):
        torch.mm(a, right, out=dest)

    def dnn(right, dest):
        dest.copy_(linear(a, right, None, "none", [], ""))

    def alone(fn, right):
        def run():
            torch.set_num_threads(1)
            fn(right, out)
        return run

    def lanes(fn, rights):
        def run():
            def lane(right, dest):
                torch.set_num_threads(1)
                fn(right, dest)
            threads = [threading.Thread(target=lane, args=(r, d))
                       for r, (_, d) in zip(rights, halves)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        return run

    def both(fn, right):
        def run():
            torch.set_num_threads(2)
            fn(right, out)
        return run

    def host(right, dest):  # a new result, as tensorql's products against weights make
        packed_weights.matmul(a, right)

    for right in (b, *(h for h, _ in halves)):
        packed_weights.mark_immutable(right)
    return {"mkl 1 thread": alone(mkl, b), "mkl 2 lanes": lanes(mkl, [h for h, _ in halves]),
            "mkl 2 threads": both(mkl, b), "packed 1 thread": alone(dnn, packed),
            "packed 2 lanes": lanes(dnn, packed_halves), "packed 2 threads": both(dnn, packed),
            "host 1 thread": alone(host, b), "host 2 lanes": lanes(host, [h for h, _ in halves]),
            "host 2 threads": both(host, b)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--shapes", default="256x2048x2048,1024x1024x1024,1024x3072x3072")
    args = parser.parse_args(argv)
    for shape in args.shapes.split(","):
        m, k, n = (int(x) for x in shape.split("x"))
        runs = forms(m, k, n)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for run in runs.values():
            run()  # warm-up: oneDNN's kernels made, pools started
        for rep in range(args.repeat):
            order = list(runs) if rep % 2 == 0 else list(runs)[::-1]
            for name in order:
                start = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - start)
        flops = 2 * m * k * n
        print(f"{shape}:")
        for name, ts in times.items():
            print(f"  {name:17s} best {min(ts) * 1e3:7.2f} ms ({flops / min(ts) / 1e9:5.0f} "
                  f"GFLOP/s)  median {statistics.median(ts) * 1e3:7.2f} ms")
        for kind in ("mkl", "packed", "host"):
            one, two, lanes = (statistics.median(times[f"{kind} {f}"])
                               for f in ("1 thread", "2 threads", "2 lanes"))
            print(f"  {kind}: lanes/1t {one / lanes:.2f}x, 2 threads/1t {one / two:.2f}x, "
                  f"2t/lanes {lanes / two:.2f}")
    torch.set_num_threads(2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
