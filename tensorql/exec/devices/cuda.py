"""CUDA device: a stream per compute thread, dedicated H2D, D2H and peer-copy streams.

Each lane thread launches its work on its own stream, records a CUDA event after it and waits
on that event before reporting completion, so the runtime reacts to real completion events while
the copy streams overlap the compute streams. Host buffers come from the runtime's pinned pool
(allocated once); ``to_device`` on a pinned tensor is an asynchronous copy.

It reaches the GPU only through :func:`tensorql.cuda_api.current` (the real ``torch.cuda``, or
the recording fake of the tests). Needs CUDA; constructing one without it raises ExecutionError.

>>> CUDADevice.kind, CUDADevice.default_reserve(None, 1 << 30) == 64 << 20
('cuda', True)
"""

from __future__ import annotations

from typing import Any

import torch

import tensorql.cuda_api as cuda_api
from tensorql.errors import ExecutionError
from tensorql.exec.devices.base import Post, ThreadedDevice


class _StreamContext:
    """Runs work on ``stream``; the handle is the start event, ``finish`` waits for the end."""

    def __init__(self, api: Any, device: torch.device, stream: Any) -> None:
        self.api = api
        self.device = device
        self.stream = stream
        self._ctx: Any = None
        self._start: Any = None

    def __enter__(self) -> _StreamContext:
        self.api.set_device(self.device)
        self._ctx = self.api.stream_context(self.stream)
        self._ctx.__enter__()
        self._start = self.api.event(enable_timing=True)
        self._start.record(self.stream)
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)

    def finish(self) -> float:
        end = self.api.event(enable_timing=True)
        end.record(self.stream)
        end.synchronize()
        return self._start.elapsed_time(end) / 1e3


class CUDADevice(ThreadedDevice):
    kind = "cuda"

    def __init__(self, name: str = "cuda:0", compute_streams: int = 2) -> None:
        self.api = cuda_api.current()
        if not self.api.is_available():
            raise ExecutionError(f"device {name!r} needs CUDA, but {self.api.name} has no "
                                 "device; use devices='cpu'")
        super().__init__(name, {"compute": compute_streams, "h2d": 1, "d2h": 1, "d2d": 1})
        _, _, index = name.partition(":")
        self.device = self.api.torch_device(int(index or 0))

    @property
    def torch_device(self) -> torch.device:
        return self.device

    def open(self, post: Post) -> None:
        def context_for() -> _StreamContext:
            return _StreamContext(self.api, self.device, self.api.stream(self.device))

        self._start_lanes(post, context_for, finish=lambda ctx: ctx.finish())

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=host.is_pinned())

    def to_host(self, value: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return value.to("cpu")
        out.copy_(value, non_blocking=True)
        return out

    def from_peer(self, value: torch.Tensor) -> torch.Tensor:
        return value.to(self.device, non_blocking=True)

    def capacity(self) -> int | None:
        return self.api.total_memory(self.device)

    @property
    def uses_pinned_host(self) -> bool:
        return True

    def default_reserve(self, budget: int) -> int:
        return min(budget // 16, 512 << 20)
