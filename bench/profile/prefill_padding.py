"""A prompt of a new length padded into a planned prefill against one re-bound to its own
plan, in one process: the bench model's prefill (``bench/llama.py``: ~100M parameters, fp32)
planned for ``--seq`` tokens and warmed, then ``--rounds`` rounds each running, in a seeded
random order, a new length padded into that plan (``Llama.prefill(1, n)``), another new length
re-bound (``pad=False``) and the planned length itself (the cached figure). Not a bench (no
record, no goal): the measurement behind issue 31's account of the new-length prefill.

    python bench/profile/prefill_padding.py [--rounds 10] [--seq 512] [--workers 2]

Every call is a length not seen before (``--seq`` - 1, - 2, ...) but for the cached one;
printed: median, IQR and range per form in ms, and the model's last re-bind time (what a
padded prompt's extra positions are weighed against: ``Llama._padding_host``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # prefill_breakdown
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for llama.py
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    import llama
    from prefill_breakdown import warm_prefill

    ours, planned = warm_prefill(args.workers, args.seq)
    vocab = ours.shape.vocab
    # one re-bind first, so the model has measured what a plan costs
    ours.prefill(1, args.seq // 2, pad=False).logits(llama.prompt(vocab, args.seq // 2, 0))
    times: dict[str, list[float]] = {"padded": [], "re-bound": [], "cached": []}
    rng = np.random.default_rng(0)
    length = args.seq - 1
    for call in range(args.rounds):
        for form in rng.permutation(list(times)):
            n = args.seq if form == "cached" else length
            ids = llama.prompt(vocab, n, 100 + call)
            start = time.perf_counter()
            if form == "cached":
                planned.logits(ids)
            else:
                prefill = ours.prefill(1, n, pad=form == "padded")
                prefill.logits(ids)
                if (prefill.padded_to is not None) != (form == "padded"):
                    print(f"length {n}: padded_to {prefill.padded_to}, wanted {form}")
                    return 1
                length -= 1
            times[form].append(time.perf_counter() - start)
    for form, seconds in times.items():
        ms = sorted(s * 1e3 for s in seconds)
        q1, _, q3 = statistics.quantiles(ms, n=4)
        print(f"{form:9s} median {statistics.median(ms):6.1f} ms  IQR {q1:.1f}-{q3:.1f}  "
              f"range {ms[0]:.1f}-{ms[-1]:.1f}")
    print(f"last re-bind {ours._replan_seconds * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
