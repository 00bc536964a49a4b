"""The lanes' tail rule, A/B (issue 31: matmul 3072^3 on 1024 tiles is 9 tasks on 2 one-thread
lanes). Not a bench (no record, no goal): a paired comparison for a quiet host.

    python bench/profile/lanes_tail.py [--n 3072] [--pairs 15] [--threads 2]

Runs the compiled product alternately with the rule (``executor.TAIL_WAIT_SHARE`` as shipped:
the run's last big task waits for the ones beside it and runs with every worker's threads;
``TAIL_MIN_SPEEDUP`` set to 0 here, so that a tail that gained nothing does not turn the rule
off for the graph)
and without it (the last task alone on one thread while the other lane idles), in one process,
the order flipped every pair; prints each arm's median, the median of the paired ratios, how
many tasks ran wide, and torch's own ``mm`` on ``--threads`` threads in the same process (a
reference only: the bench times torch in a process of its own). Packed weights follow
``TENSORQL_PACKED_WEIGHTS``.

On a host whose cores are shared the comparison is worthless either way: a two-thread
product waits for a descheduled thread (loaded 2-core VM, load 5-6: the rule read 1.00-1.07
of no rule, and torch's two-thread ``mm`` slower than two one-thread lanes).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3072)
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import tensorql as tq
    import tensorql.exec.executor as executor

    shipped = executor.TAIL_WAIT_SHARE
    executor.TAIL_MIN_SPEEDUP = 0.0  # the rule in every run (never turned off for the graph)
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((args.n, args.n), dtype=np.float32) for _ in range(2))
    db = tq.connect(devices="cpu", workers=args.threads, intra_op_threads=1)
    query = (db.from_numpy("A", a) @ db.from_numpy("B", b)).compile()
    want = torch.from_numpy(a).double() @ torch.from_numpy(b).double()
    times: dict[str, list[float]] = {"rule": [], "none": [], "torch": []}
    wide = []
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)

    def arm(name: str) -> None:
        if name == "torch":
            previous = torch.get_num_threads()
            torch.set_num_threads(args.threads)
            start = time.perf_counter()
            torch.mm(ta, tb)
            times[name].append(time.perf_counter() - start)
            torch.set_num_threads(previous)
            return
        executor.TAIL_WAIT_SHARE = shipped if name == "rule" else float("-inf")
        start = time.perf_counter()
        result = query.run(dense=True)
        times[name].append(time.perf_counter() - start)
        if name == "rule":
            wide.append(result.stats.wide_tasks)
        got = result.dense().double()
        err = float((got - want).abs().max() / want.abs().max())
        assert err < 1e-5, f"{name}: relative error {err:.1e}"

    for name in ("rule", "none", "torch"):  # warm-up
        arm(name)
    for name in times:
        times[name].clear()
    wide.clear()
    for i in range(args.pairs):
        for name in (("rule", "none", "torch") if i % 2 == 0 else ("torch", "none", "rule")):
            arm(name)
    executor.TAIL_WAIT_SHARE = shipped
    ratio = statistics.median(x / y for x, y in zip(times["rule"], times["none"]))
    print(f"{args.n}^3 on {args.threads} lanes, {args.pairs} pairs: "
          + ", ".join(f"{k} {statistics.median(v) * 1e3:.1f} ms" for k, v in times.items())
          + f"; rule/none paired median {ratio:.3f}; wide tasks per run {sorted(set(wide))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
