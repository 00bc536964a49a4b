"""What an idle gap costs the next training step (issue 31: the training MLP's ratio to torch's
fused Adam read 1.03-1.15 from run to run on the Intel host, its kernels equal to torch's
shape for shape). Not a bench (no record, no goal): a profile for a quiet host.

    python bench/profile/after_idle.py [--steps 30] [--pauses 0.02,0.16]

Each variant runs in a process of its own (allocator and thread state stay apart), its steps
``--pauses`` seconds apart -- the bench's harness leaves a contender's process idle ~0.16 s
between its steps while the others run -- and prints the median step in ms:

* ``tq``: ``bench/train.py``'s tensorql MLP step (the engine's strategy);
* ``torch``: its torch step with fused Adam;
* ``products``: the MLP step's six big products alone in plain torch, ``products+duckdb``
  the same in a process that also holds a tensorql session with a stored tensor (DuckDB's
  threads and allocator alive, idle): whatever the session's mere presence costs a product
  after an idle gap.

On the 2-core Intel Xeon VM (2026-11-28, session 20), three runs, ms at 0.02 / 0.16 s:
tq 36.7 / 43.7, 35.9 / 39.4, 36.6 / 46.7; torch 35.3 / 40.3, 34.6 / 39.1, 36.9 / 44.7;
products 33.8 / 38.8, 35.2 / 39.8, 37.9 / 44.8; products+duckdb 37.6 / 42.9, 33.0 / 38.8,
36.6 / 42.8. An idle gap costs every side 3-10 ms on its next step, the products alone as
much; the session's presence costs nothing this host's noise (+-5 ms from run to run) lets
through.

>>> VARIANTS
('tq', 'torch', 'products', 'products+duckdb')
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("tq", "torch", "products", "products+duckdb")


def _products():
    """The MLP step's six big products (784 -> 2048 -> 2048, batch 256) as one call."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(256, 784, generator=gen), torch.randn(256, 2048, generator=gen)
    w1, w2 = torch.randn(784, 2048, generator=gen), torch.randn(2048, 2048, generator=gen)

    def step():
        h = x @ w1
        _ = h @ w2, g @ w2.t(), h.t() @ g, x.t() @ g, g @ w2
    return step


def _step(variant: str):
    import torch

    torch.set_num_threads(2)
    sys.path.insert(0, os.path.dirname(HERE))  # bench/, for train.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository
    import train

    if variant == "tq":
        return train.standing_factory("tq_mlp", size="default", threads=2, strategy=None)
    if variant == "torch":
        return train.standing_factory("torch_mlp", size="default", form="torch fused")
    if variant == "products+duckdb":
        import numpy as np

        import tensorql as tq

        db = tq.connect(workers=2, intra_op_threads=1)
        db.store_many({"x": np.ones((256, 784), np.float32)})
        _step.session = db  # kept alive with its threads
    return _products()


def child(variant: str, steps: int, pauses: list[float]) -> None:
    step = _step(variant)
    for _ in range(5):
        step()
    medians = []
    for pause in pauses:
        times = []
        for _ in range(steps):
            time.sleep(pause)
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        medians.append(statistics.median(times))
    print(" ".join(f"{m:.1f}" for m in medians))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pauses", default="0.02,0.16")
    parser.add_argument("--child", choices=VARIANTS)
    args = parser.parse_args(argv)
    pauses = [float(p) for p in args.pauses.split(",")]
    if args.child:
        child(args.child, args.steps, pauses)
        return 0
    print(f"median step ms at pauses of {', '.join(f'{p} s' for p in pauses)}")
    for variant in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--child", variant, "--steps",
                              str(args.steps), "--pauses", args.pauses],
                             capture_output=True, text=True, check=True).stdout.split()
        print(f"{variant:18s} {' / '.join(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
