"""Timing shared by the benchmarks.

>>> import time
>>> fast, slow = alternating_medians([lambda: None, lambda: time.sleep(0.01)], repeat=3)
>>> fast < slow
True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def alternating_medians(fns: Sequence[Callable[[], object]], repeat: int) -> list[float]:
    """Median seconds of each of ``fns``, run in turn ``repeat`` times (A, B, A, B, ...), so
    that a host whose speed drifts during the run weighs on every contender alike (timing
    one side's runs before the other's read ratios 10% apart from run to run on the 2-core
    VMs this repository is measured on)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, kept in zip(fns, times):
            start = time.perf_counter()
            fn()
            kept.append(time.perf_counter() - start)
    return [statistics.median(kept) for kept in times]
