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

import torch

from tensorql.exec.devices.base import Post, ThreadedDevice


class CPUDevice(ThreadedDevice):
    kind = "cpu"
    lookahead = 1

    def __init__(self, name: str = "cpu:0", workers: int = 1) -> None:
        super().__init__(name, {"compute": max(1, workers), "h2d": 1, "d2h": 1, "d2d": 1})

    def open(self, post: Post) -> None:
        self._start_lanes(post, contextlib.nullcontext)

    def from_peer(self, value: torch.Tensor) -> torch.Tensor:
        """A copy of another device's chunk in this device's memory."""
        return value.to("cpu", copy=True)
