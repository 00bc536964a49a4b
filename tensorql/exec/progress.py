"""Progress reporting for long runs: a callback for Python, a bar for the CLI.

Every executor calls ``progress(done, total)`` after each task of the task graph. In Python pass
any callable, e.g. ``C.numpy(progress=lambda done, total: ...)``. A command-line tool wraps a run
in :func:`progress_bar`, which draws with tqdm or rich when installed, else a plain stderr line
(redrawn at most ``min_interval`` seconds apart):

>>> import io
>>> out = io.StringIO()
>>> with progress_bar("matmul", stream=out, backend="plain", min_interval=0) as cb:
...     for n in range(1, 5):
...         cb(n, 4)
>>> out.getvalue().splitlines()[-1].strip()
'matmul: 4/4 tasks (100%)'
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO

ProgressCallback = Callable[[int, int], None]


def available_backend() -> str:
    """'tqdm' or 'rich' when importable, else 'plain'."""
    for name in ("tqdm", "rich"):
        try:
            __import__(name)
        except ImportError:
            continue
        return name
    return "plain"


class _Plain:
    def __init__(self, label: str, stream: IO[str], min_interval: float,
                 unit: str = "task") -> None:
        self.label, self.stream, self.min_interval = label, stream, min_interval
        self.unit = unit
        self.last = 0.0
        self.started = time.perf_counter()
        self.lock = threading.Lock()
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        with self.lock:
            if done < total and now - self.last < self.min_interval:
                return
            self.last = now
            pct = 100.0 * done / total if total else 100.0
            eta = ""
            if 0 < done < total:
                eta = f" eta {(now - self.started) * (total - done) / done:.1f}s"
            self.stream.write(f"\r{self.label}: {done}/{total} {self.unit}s ({pct:.0f}%){eta}   ")
            self.stream.flush()
            self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()


@contextlib.contextmanager
def progress_bar(label: str = "running", *, stream: IO[str] | None = None,
                 backend: str | None = None, min_interval: float = 0.1,
                 unit: str = "task") -> Iterator[ProgressCallback]:
    """A ``progress(done, total)`` callback drawing a bar for the duration of the block.

    ``backend``: "tqdm" | "rich" | "plain" (default: the first one installed); ``unit`` names
    what is counted ("task" for a run, "chunk" for a store).
    """
    stream = stream if stream is not None else sys.stderr
    backend = backend or available_backend()
    if backend == "tqdm":
        from tqdm import tqdm

        bar = tqdm(total=0, desc=label, unit=unit, file=stream)
        lock = threading.Lock()

        def update(done: int, total: int) -> None:
            with lock:
                if bar.total != total:
                    bar.total = total
                bar.n = done
                bar.refresh()

        try:
            yield update
        finally:
            bar.close()
    elif backend == "rich":
        from rich.progress import Progress

        with Progress(transient=False) as prog:
            task = prog.add_task(label, total=None)
            yield lambda done, total: prog.update(task, completed=done, total=total)
    else:
        plain = _Plain(label, stream, min_interval, unit)
        try:
            yield plain
        finally:
            plain.close()
