"""A training step's own cost beside its kernels (issue 31): ``bench/train.py``'s MLP step
back to back in this process, the engine's strategy (a tape from the second step on, the
updates in place: ``tensorql.exec.tape.REPLAYED``) against the serial strategy, and torch's
fused-Adam step. At the tiny size the step is all Python and dispatch; at the default size
the difference is that same cost beside ~33 ms of kernels. Not a bench (no record, no goal).

    python bench/profile/step_overhead.py [--sizes tiny,default] [--steps 200] [--rounds 5]

Prints the median over ``--rounds`` of the mean step in ms of ``--steps`` steps run back to
back (no pause: an idle gap costs every side more than this, see ``after_idle.py``), the
contenders' rounds alternating.

On the 2-core Intel Xeon VM (2026-11-28, session 20), two runs: tiny 0.94 / 0.90 ms (tape),
1.53 / 1.44 (serial), 0.40 / 0.40 (torch); default 36.3 / 32.7, 35.4 / 33.7, 34.0 / 30.4.

>>> CONTENDERS
('tq (engine)', 'tq serial', 'torch fused')
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONTENDERS = ("tq (engine)", "tq serial", "torch fused")


def _steps(size: str):
    sys.path.insert(0, os.path.dirname(HERE))  # bench/, for train.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository
    import train

    return {"tq (engine)": train.standing_factory("tq_mlp", size=size, threads=2,
                                                  strategy=None),
            "tq serial": train.standing_factory("tq_mlp", size=size, threads=2,
                                                strategy="serial"),
            "torch fused": train.standing_factory("torch_mlp", size=size, form="torch fused")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,default")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    for size in args.sizes.split(","):
        steps = _steps(size)
        count = args.steps if size == "tiny" else max(10, args.steps // 20)
        for step in steps.values():
            for _ in range(10):
                step()
        means: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(args.rounds):
            for name, step in steps.items():
                start = time.perf_counter()
                for _ in range(count):
                    step()
                means[name].append((time.perf_counter() - start) / count * 1e3)
        print(f"{size}: " + ", ".join(f"{name} {statistics.median(v):.2f} ms"
                                       for name, v in means.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
