"""CUDA device: compute streams, dedicated H2D, D2H and peer-copy streams, completion events.

Each lane has one launching thread that runs the lane's work on its streams in turn (the
``compute`` lane has ``compute_streams`` of them, each copy lane one) and records a CUDA event
after each op; it does not wait for it. One waiter thread per stream waits on that stream's
events in the order they were recorded (a stream completes its work in order) and posts each
op's :class:`~tensorql.exec.devices.base.Completion` once its event has completed. So the
host never blocks a launch on the GPU: a lane keeps up to ``lanes[lane] + lookahead`` ops in
flight (the runtime's dispatch depth), and the GPU runs them back to back.

Why that is safe: the runtime makes an op ready only after the completions of the ops it
depends on were posted, that is after the host saw their events complete; work launched after
that on any stream is ordered after them. A chunk's memory is freed (its tensor dropped) only
by a ``free`` op, which depends on every op that used the chunk, so a block the caching
allocator hands out again is never still read by a kernel of another stream.

The streams of a device are made once per process (:func:`device_streams`) and reused by every
run, so the cuBLAS workspaces torch keeps per (handle, stream) pair stay
``compute_streams`` many instead of growing with every query. So are the lanes' threads
(:func:`device_lanes`): a run hands each op its own ``post`` with the work, so runs share a
device's lanes, and a query does not start and join nine threads (on the first H100 runs the
runtime's fixed cost per run was ~4-5 ms; on a loaded 2-core host starting the threads alone
took ~13 ms a run).
:meth:`CUDADevice.default_reserve` keeps those workspaces and a share for kernel temporaries
out of the chunk budget.

It reaches the GPU only through :func:`tensorql.cuda_api.current` (the real ``torch.cuda``, or
the recording fake of the tests). Needs CUDA; constructing one without it raises ExecutionError.

>>> CUDADevice.kind, reserve_for(1 << 30, compute_streams=2, workspace=32 << 20) >> 20
('cuda', 128)
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import tensorql.cuda_api as cuda_api
from tensorql.devices import CUDA_COMPUTE_STREAMS
from tensorql.errors import ExecutionError
from tensorql.exec.device_cache import DeviceCache
from tensorql.exec.devices.base import Completion, Post, ThreadedDevice

#: ready ops a lane of a CUDA device is handed beyond its streams: launched, not yet done
CUDA_LOOKAHEAD = 6

_streams_lock = threading.Lock()
_lanes_lock = threading.Lock()  # the outer lock: device_streams takes _streams_lock inside it


def device_streams(api: Any, device: torch.device, lane: str, count: int) -> list[Any]:
    """The ``count`` streams of ``lane`` on ``device``, made once per process (per ``api``)."""
    with _streams_lock:
        streams = cuda_api.cache_of(api).setdefault(("streams", str(device), lane), [])
        while len(streams) < count:
            streams.append(api.stream(device, label=lane))
        return streams[:count]


def device_lanes(api: Any, device: torch.device, name: str,
                 lanes: dict[str, int]) -> dict[str, _Lane]:
    """The lanes of ``device`` (``lane -> streams``), their threads started once per process
    (per ``api``) and reused by every run: a new set only when one of them stopped."""
    key = ("lanes", str(device), tuple(sorted(lanes.items())), os.getpid())
    cache = cuda_api.cache_of(api)
    with _lanes_lock:  # one set per key even when two runs open the device at once
        found = cache.get(key)
        if found is None or not all(lane.alive() for lane in found.values()):
            found = cache[key] = {lane: _Lane(f"{name}-{lane}", api, device,
                                              device_streams(api, device, lane, n))
                                  for lane, n in lanes.items()}
        return found


def reserve_for(budget: int, compute_streams: int, workspace: int) -> int:
    """Bytes of a device's ``memory_limit`` kept out of the chunk budget: the cuBLAS workspace
    of each compute stream, plus 1/16 of the limit (at most 512 MiB) for the temporaries of
    the kernel the compute lane is launching (one at a time: one launching thread)."""
    return compute_streams * workspace + kernel_temp_bytes(budget)


def kernel_temp_bytes(budget: int) -> int:
    """The share of a device's ``memory_limit`` kept for the temporaries of the one kernel
    being launched: 1/16 of it, at most 512 MiB.

    >>> kernel_temp_bytes(1 << 30) >> 20, kernel_temp_bytes(64 << 30) >> 20
    (64, 512)
    """
    return min(budget // 16, 512 << 20)


class _Pending:
    __slots__ = ("error", "end", "op_id", "post", "start", "started", "value")

    def __init__(self, op_id: int, started: float, start: Any, end: Any, value: Any,
                 error: BaseException | None, post: Post) -> None:
        self.op_id, self.started, self.start, self.end = op_id, started, start, end
        self.value, self.error, self.post = value, error, post


class _Lane:
    """One lane of a CUDA device: its launching thread and a waiter thread per stream, kept
    for the process (:func:`device_lanes`); each op comes with the ``post`` of its run."""

    def __init__(self, name: str, api: Any, device: torch.device, streams: list[Any]) -> None:
        self.api, self.device, self.streams = api, device, streams
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        # (start, end) event pairs whose waiter is done with them: re-recorded by later ops
        # of any run instead of making two events per op
        self.spare_events: queue.SimpleQueue = queue.SimpleQueue()
        self.waits: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in streams]
        self.threads = [threading.Thread(target=self._launch, daemon=True,
                                         name=f"tensorql-{name}")]
        self.threads += [threading.Thread(target=self._wait, args=(w,), daemon=True,
                                          name=f"tensorql-{name}-wait-{i}")
                         for i, w in enumerate(self.waits)]
        for thread in self.threads:
            thread.start()

    def submit(self, op_id: int, fn: Callable[[], Any], post: Post) -> None:
        self.queue.put((op_id, fn, post))

    def alive(self) -> bool:
        return all(thread.is_alive() for thread in self.threads)

    def _launch(self) -> None:
        api = self.api
        turn = 0
        try:
            api.set_device(self.device)
        except BaseException:  # noqa: BLE001 - each op reports it below
            pass
        while True:
            item = self.queue.get()
            if item is None:
                for w in self.waits:
                    w.put(None)
                return
            k = turn % len(self.streams)
            turn += 1
            self.waits[k].put(self._run(item, self.streams[k]))
            # the thread outlives the run: keep nothing of it (the op's closure holds the
            # run's chunks) while it waits for the next op
            item = None

    def _run(self, item: tuple[int, Callable[[], Any], Post], stream: Any) -> _Pending:
        """Launch one op on ``stream`` between a start and an end event."""
        op_id, fn, post = item
        api = self.api
        started = time.perf_counter()
        try:
            try:
                start, end = self.spare_events.get_nowait()
            except queue.Empty:
                start = api.event(enable_timing=True)
                end = api.event(enable_timing=True, blocking=True)  # its waiter sleeps
            with api.stream_context(stream):
                start.record(stream)
                value = fn()
                end.record(stream)
        except BaseException as err:  # noqa: BLE001 - reported to the runtime
            return _Pending(op_id, started, None, None, None, err, post)
        return _Pending(op_id, started, start, end, value, None, post)

    def _wait(self, waits: queue.SimpleQueue) -> None:
        while True:
            item = waits.get()
            if item is None:
                return
            device_s, error = None, item.error
            if error is None:
                try:
                    item.end.synchronize()  # this waiter only: the launcher has moved on
                    device_s = item.start.elapsed_time(item.end) / 1e3
                    self.spare_events.put((item.start, item.end))  # both complete: reusable
                except BaseException as err:  # noqa: BLE001 - reported to the runtime
                    error = err
            item.post(Completion(item.op_id, item.started, time.perf_counter(),
                                 item.value if error is None else None, error, device_s))
            item = error = None  # the op's chunk is the run's now: hold no reference to it

    def stop(self) -> None:
        """End the lane's threads (after its queued work)."""
        self.queue.put(None)
        for thread in self.threads:
            thread.join(timeout=30)


class CUDADevice(ThreadedDevice):
    kind = "cuda"
    lookahead = CUDA_LOOKAHEAD

    def __init__(self, name: str = "cuda:0",
                 compute_streams: int = CUDA_COMPUTE_STREAMS) -> None:
        self.api = cuda_api.current()
        if not self.api.is_available():
            raise ExecutionError(f"device {name!r} needs CUDA, but {self.api.name} has no "
                                 "device; use devices='cpu'")
        super().__init__(name, {"compute": compute_streams, "h2d": 1, "d2h": 1, "d2d": 1})
        _, _, index = name.partition(":")
        self.index = int(index or 0)
        self.device = self.api.torch_device(self.index)
        self._lanes: dict[str, _Lane] = {}
        self._post: Post | None = None

    @property
    def torch_device(self) -> torch.device:
        return self.device

    def open(self, post: Post) -> None:
        self._post = post
        self._lanes = device_lanes(self.api, self.device, self.name, self.lanes)

    def close(self) -> None:
        """The run is over: the lanes stay for the next run (every op it submitted has
        posted its completion by now)."""
        self._lanes = {}

    def submit(self, lane: str, op_id: int, fn: Callable[[], Any], cost: float = 0.0) -> None:
        self._lanes[lane].submit(op_id, fn, self._post)

    def resident_cache(self) -> DeviceCache:
        """The device copies of stored chunks this device keeps across runs, one per device
        and process (per ``api``; :mod:`tensorql.exec.device_cache`)."""
        cache = cuda_api.cache_of(self.api)
        with _streams_lock:
            return cache.setdefault(("device cache", str(self.device)), DeviceCache())

    def holds(self, value: torch.Tensor) -> bool:
        """Whether ``value`` is already in this device's memory."""
        return self.api.device_of(value) == self.index

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` in this device's memory: itself when it is there already (a source
        chunk resident on the GPU is not copied), a peer copy from another GPU, else a copy
        from the host (asynchronous from pinned memory)."""
        where = self.api.device_of(host)
        if where == self.index:
            return host
        if where is not None:
            return self.from_peer(host)
        return host.to(self.device, non_blocking=self.api.is_pinned(host))

    def to_host(self, value: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``value`` copied to the host: into ``out`` when given, asynchronously when ``out``
        is pinned (a slot of the pinned pool), else a copy the D2H lane waits for (pageable
        memory, e.g. a tile of a dense result)."""
        if out is None:
            return value.to("cpu")
        out.copy_(value, non_blocking=self.api.is_pinned(out))
        return out

    def from_peer(self, value: torch.Tensor) -> torch.Tensor:
        """A copy of a chunk of another device (or of the host) made on this device's copy
        stream into memory of this device."""
        out = torch.empty(tuple(value.shape), dtype=value.dtype, device=self.device)
        out.copy_(value, non_blocking=True)
        return out

    def check_placement(self, value: Any, kernel: Any) -> None:
        if isinstance(value, torch.Tensor) and not self.holds(value):
            raise ExecutionError(f"{type(kernel).__name__} returned a chunk on {value.device}, "
                                 f"not in the memory of {self.name}: the kernel allocates its "
                                 "output without the inputs' device")

    def capacity(self) -> int | None:
        return self.api.total_memory(self.device)

    @property
    def uses_pinned_host(self) -> bool:
        return True

    def is_pinned(self, host: torch.Tensor) -> bool:
        return self.api.is_pinned(host)

    def default_reserve(self, budget: int) -> int:
        """Kept out of the chunk budget (see :func:`reserve_for`): cuBLAS workspaces of the
        compute streams and a share for kernel temporaries."""
        return reserve_for(budget, self.lanes["compute"],
                           self.api.blas_workspace_bytes(self.device))
