"""The ``Device`` interface every device implements, and the lane threads they share.

A device holds chunks and runs work on *lanes*: ``compute`` (kernels), ``h2d`` (host to device
copies), ``d2h`` (device to host) and ``d2d`` (from a peer device). The runtime hands a lane a
callable with :meth:`Device.submit`; the device runs it asynchronously and posts a
:class:`Completion` when the work has really finished (a CUDA event on a GPU, the thread's
return on a CPU). Lanes are independent, so copies overlap kernels.

>>> import queue
>>> events = queue.Queue()
>>> lane = LaneThreads("demo", 1, lambda: contextlib.nullcontext(), events.put)
>>> lane.submit(7, lambda: 6 * 7)
>>> c = events.get(timeout=5); lane.close()
>>> (c.op_id, c.value, c.error)
(7, 42, None)
"""

from __future__ import annotations

import abc
import contextlib  # noqa: F401 - used by the doctest
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

LANE_NAMES = ("compute", "h2d", "d2h", "d2d")


@dataclass
class Completion:
    """A finished unit of work: when it started and ended (seconds, runtime clock)."""

    op_id: int
    started: float
    ended: float
    value: Any = None
    error: BaseException | None = None
    device_s: float | None = None  # time measured on the device itself (CUDA events)


Post = Callable[[Completion], None]


class LaneThreads:
    """``n`` threads serving one lane's queue; each call runs inside ``context()``.

    They are started for each run and end with it, unlike the parked threads that wait on
    transfers (:mod:`tensorql.exec.threads`): a thread that ran torch kernels holds an OpenMP
    thread pool while it lives, and with such threads kept alive the process's own torch
    work ran ~20% slower afterwards (a LLaMA block's training step in torch, 39 -> 48 ms,
    measured on a 2-core host)."""

    def __init__(self, name: str, n: int, context: Callable[[], Any], post: Post,
                 finish: Callable[[Any], float | None] | None = None) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.post = post
        self.finish = finish
        self.threads = []
        for i in range(n):
            thread = threading.Thread(target=self._serve, args=(context(),), daemon=True,
                                      name=f"tensorql-{name}-{i}")
            thread.start()
            self.threads.append(thread)

    def submit(self, op_id: int, fn: Callable[[], Any]) -> None:
        self.queue.put((op_id, fn))

    def _serve(self, ctx: Any) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            op_id, fn = item
            started = time.perf_counter()
            value, error, device_s = None, None, None
            try:
                with ctx as handle:
                    value = fn()
                    if self.finish is not None:
                        device_s = self.finish(handle)
            except BaseException as err:  # noqa: BLE001 - reported to the runtime
                error = err
            self.post(Completion(op_id, started, time.perf_counter(), value, error, device_s))

    def close(self) -> None:
        for _ in self.threads:
            self.queue.put(None)
        for thread in self.threads:
            thread.join(timeout=10)


class Device(abc.ABC):
    """One place that holds chunks and runs work on lanes.

    ``name`` is like "cpu:0" or "cuda:1"; ``lanes`` maps lane name to how many units of work
    may be in flight on it at once.
    """

    kind: str = "abstract"
    is_null: bool = False
    #: its memory is the host's: a result chunk can be computed straight into a dense result
    host_memory: bool = False
    #: a device of another rank of a distributed job (this process runs nothing on it)
    remote: bool = False
    #: ready ops a lane may be handed beyond its threads (queued in order), so a thread that
    #: finishes one op starts the next without a round trip through the runtime's loop
    lookahead: int = 0

    def __init__(self, name: str, lanes: dict[str, int]) -> None:
        self.name = name
        self.lanes = dict(lanes)

    @abc.abstractmethod
    def open(self, post: Post) -> None:
        """Start the lanes; finished work is reported through ``post``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the lanes (after the run)."""

    @abc.abstractmethod
    def submit(self, lane: str, op_id: int, fn: Callable[[], Any], cost: float = 0.0) -> None:
        """Run ``fn`` on ``lane``; ``cost`` is an estimate only the null device uses."""

    # -- data movement, called from work running on the lanes -----------------------------
    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A copy of a host tensor in this device's memory (CPU devices share it)."""
        return host

    def to_host(self, value: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``value`` in host memory, written into ``out`` (a pinned buffer) when given."""
        if out is None:
            return value
        out.copy_(value)
        return out

    def from_peer(self, value: torch.Tensor) -> torch.Tensor:
        """A copy of another device's chunk in this device's memory."""
        return self.to_device(value.cpu()) if value.device.type != "cpu" else value

    def capacity(self) -> int | None:
        """Physical memory in bytes, when the device knows it."""
        return None

    def check_placement(self, value: Any, kernel: Any) -> None:
        """ExecutionError if a kernel's output chunk is not in this device's memory (a
        device with memory of its own checks; the host's memory holds anything)."""
        return None

    @property
    def torch_device(self) -> torch.device:
        """Where this device's chunks live for torch (and torch.distributed buffers)."""
        return torch.device("cpu")

    @property
    def uses_pinned_host(self) -> bool:
        return False

    @property
    def concurrent_tasks(self) -> int:
        """How many chunk tasks run on it side by side, for which the memory plan keeps room
        under a budget (:func:`~tensorql.exec.memplan.plan_room`): one by default (a GPU's
        kernel fills it; its second stream overlaps launches, not working sets)."""
        return 1

    def is_pinned(self, host: torch.Tensor) -> bool:
        """Whether a host tensor is page-locked (an H2D copy from it runs asynchronously)."""
        return False

    def default_reserve(self, budget: int) -> int:
        """Bytes of a memory_limit kept back for kernel temporaries."""
        return 0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} lanes={self.lanes}>"


class ThreadedDevice(Device):
    """A device whose lanes are :class:`LaneThreads` (CPU and CUDA devices): subclasses say
    how a lane thread sets up its context in :meth:`open` through :meth:`_start_lanes`."""

    def __init__(self, name: str, lanes: dict[str, int]) -> None:
        super().__init__(name, lanes)
        self._lanes: dict[str, LaneThreads] = {}

    def _start_lanes(self, post: Post, context: Callable[[], Any],
                     finish: Callable[[Any], float | None] | None = None) -> None:
        self._lanes = {lane: LaneThreads(f"{self.name}-{lane}", n, context, post, finish=finish)
                       for lane, n in self.lanes.items()}

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.close()
        self._lanes = {}

    def submit(self, lane: str, op_id: int, fn: Callable[[], Any], cost: float = 0.0) -> None:
        self._lanes[lane].submit(op_id, fn)
