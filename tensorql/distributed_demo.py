"""The demo across processes: a LLaMA block run by K local ranks on torch.distributed.

    tensorql distributed-demo [--ranks 2] [--seq 64] [--d-model 256]

launches ``python -m torch.distributed.run --nproc-per-node K -m tensorql.distributed_demo``
(torchrun: gloo, one torch thread per rank). Every rank builds the same seeded block and runs
it with ``tq.connect(distributed=True)``; rank 0 prints EXPLAIN ANALYZE (the partitioning,
each device's tasks, and each rank's wall time, busy time, bytes sent and received through
torch.distributed and peak memory) and checks the result against plain torch. Exits 1 if
the result disagrees, 2 if a rank fails.

>>> build_parser().parse_args(["--ranks", "3"]).ranks
3
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence

from tensorql.units import positive_int


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tensorql distributed-demo",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=positive_int, default=2, help="local processes (default: 2)")
    ap.add_argument("--seq", type=positive_int, default=64, help="sequence length (default: 64)")
    ap.add_argument("--d-model", type=positive_int, default=256, help="model width (default: 256)")
    return ap


def rank_main(argv: Sequence[str]) -> int:
    """One rank's part (run under torchrun)."""
    import numpy as np
    import torch

    import tensorql as tq
    from tensorql.models import llama_block

    args = build_parser().parse_args(list(argv))
    torch.set_num_threads(1)
    heads = max(1, args.d_model // 64)
    with tq.connect(distributed=True, workers=1) as db:
        w = llama_block(db, batch=1, seq=args.seq, d_model=args.d_model, heads=heads,
                        head_dim=args.d_model // heads, d_ff=int(args.d_model * 8 / 3))
        text = w.output.explain(analyze=True)
        got = w.output.numpy()
        err = float(np.abs(got - np.asarray(w.reference())).max())
        if int(os.environ.get("RANK", "0")) == 0:
            print(text)
            print(f"max abs difference against torch: {err:.2e}")
    return 0 if err < 1e-3 else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Launch ``--ranks`` local processes with torchrun; their exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.ranks < 1:
        print("tensorql distributed-demo: --ranks must be >= 1", file=sys.stderr)
        return 2
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(args.ranks), "-m",
                           "tensorql.distributed_demo", "--rank-main", *argv], env=env)
    return done.returncode if done.returncode in (0, 1) else 2


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
        sys.exit(rank_main(sys.argv[2:]))
    sys.exit(main())
