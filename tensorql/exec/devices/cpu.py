"""CPU device: worker threads are the compute lane, one thread each serves the copy lanes.

Device memory and host memory are the same RAM, so host copies share tensors; a
``memory_limit`` still bounds the *budgeted working set*, and moves in and out of it are
counted as the host<->device-memory bytes of EXPLAIN ANALYZE. A chunk sent from another device
is copied (each device owns what it holds, as separate GPUs or processes would).

>>> dev = CPUDevice("cpu:0", workers=2)
>>> dev.lanes["compute"], dev.kind
(2, 'cpu')
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from tensorql.exec.devices.base import Completion, Post, ThreadedDevice


class CPUDevice(ThreadedDevice):
    """``inline=True`` (one worker only) runs the work of every lane on the thread that
    submits it -- the runtime's coordinator -- instead of handing each op to a lane thread
    and back: for a rank of a distributed job, whose one worker is its only compute, those
    two thread wake-ups an op cost more than many ops themselves on a host with more
    processes than cores (a LLaMA block on 4 ranks of a 2-core host: ~80 -> ~75 ms a run).
    Reads from the store then no longer overlap kernels; give the rank two workers for that.

    >>> import queue
    >>> done = queue.SimpleQueue()
    >>> dev = CPUDevice(inline=True)
    >>> dev.open(done.put); dev.submit("compute", 3, lambda: 2 + 2); dev.close()
    >>> c = done.get_nowait(); (c.op_id, c.value)
    (3, 4)
    """

    kind = "cpu"
    host_memory = True
    lookahead = 1

    def __init__(self, name: str = "cpu:0", workers: int = 1, *, inline: bool = False) -> None:
        super().__init__(name, {"compute": max(1, workers), "h2d": 1, "d2h": 1, "d2d": 1})
        if inline and self.lanes["compute"] != 1:
            raise ValueError("inline needs one worker")
        self.inline = inline
        self._post: Post | None = None

    @property
    def concurrent_tasks(self) -> int:
        """Its compute threads: each runs a task at once."""
        return self.lanes["compute"]

    def open(self, post: Post) -> None:
        self._post = post
        if not self.inline:
            self._start_lanes(post, contextlib.nullcontext)

    def close(self) -> None:
        super().close()
        self._post = None

    def submit(self, lane: str, op_id: int, fn: Callable[[], Any], cost: float = 0.0) -> None:
        if not self.inline:
            super().submit(lane, op_id, fn, cost)
            return
        assert self._post is not None, "submit before open"
        started = time.perf_counter()
        value, error = None, None
        try:
            value = fn()
        except BaseException as err:  # noqa: BLE001 - reported to the runtime
            error = err
        self._post(Completion(op_id, started, time.perf_counter(), value, error))

    def from_peer(self, value: torch.Tensor) -> torch.Tensor:
        """A copy of another device's chunk in this device's memory."""
        return value.to("cpu", copy=True)
