"""CPU that threads other than the query's take while a LLaMA prefill runs: the bench model's
cached prefill (``bench/llama.py``: 512 tokens, ~100M parameters, fp32, 2 one-thread workers)
called ``--runs`` times in a process whose torch threads are 2 (as the bench's processes
are), and for each call the CPU time of the process's live threads that are neither the
caller nor the run's workers (``/proc/self/task``: OpenMP team threads, DuckDB's, ...)
between the call's start and end. Not a bench (no record, no goal): the measurement behind
the prompt's embeddings being gathered on one thread (``one_torch_thread`` in
``tensorql/exec/threads.py``).

    python bench/profile/prefill_other_threads.py [--runs 8] [--two-thread-gather]

``--two-thread-gather`` times the earlier behaviour: the gather on the caller's two threads,
after which libgomp's second thread spins for its next job beside the workers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for llama.py
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository


def thread_cpu(exclude: set[int]) -> dict[int, float]:
    """CPU seconds of each live thread of this process whose id is not in ``exclude``
    (Linux ``/proc/self/task/<tid>/schedstat``: nanoseconds on a CPU); empty elsewhere.

    >>> all(seconds >= 0 for seconds in thread_cpu(set()).values())
    True
    """
    out: dict[int, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in map(int, tids):
        if tid in exclude:
            continue
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
    return out


def others_during(call) -> float:
    """CPU seconds the process's other live threads (not this one, not threads started
    during ``call``) took while ``call()`` ran."""
    me = threading.get_native_id()
    before = thread_cpu({me})
    call()
    after = thread_cpu({me})
    return sum(after[tid] - before[tid] for tid in before if tid in after)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--two-thread-gather", action="store_true",
                        help="gather the embeddings on the caller's two threads (before)")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    import llama

    import tensorql as tq
    from tensorql.exec import threads
    from tensorql.models import Llama

    if args.two_thread_gather:
        threads.one_torch_thread = contextlib.nullcontext
    model = llama.hf_model(False)
    db = tq.connect(workers=2, intra_op_threads=1)
    ours = Llama.from_transformers(db, model)
    del model
    prefill = ours.prefill(1, 512)
    for call in range(3):  # the plan, the packed weights, the allocator's pools
        prefill.logits(llama.prompt(ours.shape.vocab, 512, call))
    others, walls = [], []
    for call in range(args.runs):
        time.sleep(0.05)  # as between the bench's calls: no spinner left from the last one
        ids = llama.prompt(ours.shape.vocab, 512, 100 + call)
        start = time.perf_counter()
        others.append(others_during(lambda ids=ids: prefill.logits(ids)))
        walls.append(time.perf_counter() - start)
    how = "two threads" if args.two_thread_gather else "one thread"
    print(f"prefill of 512 tokens, embeddings gathered on {how}, {args.runs} calls: other "
          f"threads' CPU during a call, ms: {[round(s * 1e3, 1) for s in others]} (median "
          f"{statistics.median(others) * 1e3:.1f}); call wall median "
          f"{statistics.median(walls) * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
