"""CPU device: worker threads are the compute lane, one thread each serves the copy lanes.

Device memory and host memory are the same RAM, so copies share tensors; a ``memory_limit``
still bounds the *budgeted working set*, and moves in and out of it are counted as the
host<->device-memory bytes of EXPLAIN ANALYZE.

>>> dev = CPUDevice("cpu:0", workers=2)
>>> dev.lanes["compute"], dev.kind
(2, 'cpu')
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from tensorql.exec.devices.base import Device, LaneThreads, Post


class CPUDevice(Device):
    kind = "cpu"

    def __init__(self, name: str = "cpu:0", workers: int = 1) -> None:
        super().__init__(name, {"compute": max(1, workers), "h2d": 1, "d2h": 1, "d2d": 1})
        self._lanes: dict[str, LaneThreads] = {}

    def open(self, post: Post) -> None:
        self._lanes = {lane: LaneThreads(f"{self.name}-{lane}", n, contextlib.nullcontext, post)
                       for lane, n in self.lanes.items()}

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.close()
        self._lanes = {}

    def submit(self, lane: str, op_id: int, fn: Callable[[], Any], cost: float = 0.0) -> None:
        self._lanes[lane].submit(op_id, fn)
