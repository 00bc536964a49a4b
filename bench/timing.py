"""Kept for scripts that still import it: the benches' method lives in ``bench/harness.py``.

>>> import time
>>> fast, slow = alternating_medians([lambda: None, lambda: time.sleep(0.002)], repeat=3)
>>> fast < slow
True
"""

from __future__ import annotations

from harness import alternating_medians, measure, summarize

__all__ = ["alternating_medians", "measure", "summarize"]
