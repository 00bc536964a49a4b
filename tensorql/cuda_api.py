"""Everything tensorql asks of ``torch.cuda``, behind one small interface.

The CUDA device class, the host pool, device detection and the distributed exchange reach the
GPU only through :func:`current` (streams, events, pinned host memory, device-memory queries,
the size of cuBLAS's workspaces), never through ``torch.cuda`` directly. On a machine with a
GPU that is :class:`TorchCuda`, a thin pass-through. Tests install a recording fake with
:func:`use` (``tests/fake_cuda.py``): the CUDA device class's own code then runs in CPU CI
with the ``meta`` device standing in for device memory, so a kernel that allocates on the
wrong device, mixes devices or syncs to the host fails there, before a GPU is at hand.

>>> api = current()
>>> isinstance(api, TorchCuda), api.is_available() == torch.cuda.is_available()
(True, True)
>>> class Absent(TorchCuda):
...     def is_available(self):
...         return False
>>> with use(Absent()):
...     current().is_available()
False
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

import torch


class TorchCuda:
    """The real thing: each method is the ``torch.cuda`` call of the same name."""

    name = "torch.cuda"

    # -- presence ---------------------------------------------------------------------------
    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def torch_device(self, index: int) -> torch.device:
        """Where chunks of CUDA device ``index`` live for torch."""
        return torch.device("cuda", index)

    def set_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def device_of(self, tensor: torch.Tensor) -> int | None:
        """The index of the CUDA device holding ``tensor``, None for host memory."""
        return tensor.device.index if tensor.is_cuda else None

    # -- streams and events -------------------------------------------------------------------
    def stream(self, device: torch.device, label: str = "") -> Any:
        """A new stream on ``device``; ``label`` says what it is for ("compute", "h2d",
        "d2h", "d2d": a fake checks copies against it; torch ignores it)."""
        return torch.cuda.Stream(device)

    def stream_context(self, stream: Any) -> Any:
        """A context manager making ``stream`` the current one."""
        return torch.cuda.stream(stream)

    def current_stream(self, device: torch.device | None = None) -> Any:
        return torch.cuda.current_stream(device)

    def event(self, enable_timing: bool = False, blocking: bool = False) -> Any:
        """A new event; ``blocking``: its ``synchronize`` sleeps instead of spinning."""
        return torch.cuda.Event(enable_timing=enable_timing, blocking=blocking)

    def synchronize(self, device: torch.device | None = None) -> None:
        torch.cuda.synchronize(device)

    # -- memory -------------------------------------------------------------------------------
    def total_memory(self, device: torch.device) -> int:
        return int(torch.cuda.get_device_properties(device).total_memory)

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        """(free, total) bytes of ``device`` as the driver sees them."""
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)

    def memory_allocated(self, device: torch.device) -> int:
        return int(torch.cuda.memory_allocated(device))

    def memory_reserved(self, device: torch.device) -> int:
        return int(torch.cuda.memory_reserved(device))

    def max_memory_allocated(self, device: torch.device) -> int:
        return int(torch.cuda.max_memory_allocated(device))

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of page-locked host memory (one allocation)."""
        return torch.empty(int(nbytes), dtype=torch.uint8, pin_memory=True)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in page-locked host memory (an H2D copy from it is async)."""
        return tensor.is_pinned()

    def blas_workspace_bytes(self, device: torch.device) -> int:
        """Bytes of the workspace cuBLAS takes per (handle, stream) pair on ``device``.

        As documented for PyTorch (CUDA semantics, "cuBLAS workspaces"): one workspace per
        combination of handle and stream that ran a cuBLAS kernel, kept until the process
        clears them, sized by ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE:COUNT`` pairs in KiB)
        or else torch's default (``:4096:2:16:8`` = 8 MiB + 128 KiB; 32 MiB on compute
        capability 9.0 and later, where torch's default is ``:4096:8``), plus cuBLASLt's
        ``CUBLASLT_WORKSPACE_SIZE`` (KiB, default 1 MiB) in case torch keeps that apart."""
        major = torch.cuda.get_device_capability(device)[0]
        return blas_workspace_from_env(os.environ, major)


def blas_workspace_from_env(env: Any, capability_major: int) -> int:
    """Bytes of one cuBLAS (+ cuBLASLt) workspace for these environment variables.

    >>> blas_workspace_from_env({}, 9) >> 20, blas_workspace_from_env({}, 8) >> 10
    (33, 9344)
    >>> blas_workspace_from_env({"CUBLAS_WORKSPACE_CONFIG": ":16:8",
    ...                          "CUBLASLT_WORKSPACE_SIZE": "0"}, 9)
    131072
    """
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    pairs = re.findall(r":(\d+):(\d+)", config or "")
    if pairs:
        cublas = sum(int(size) * int(count) for size, count in pairs) << 10
    else:
        cublas = (4096 * 8 << 10) if capability_major >= 9 else (4096 * 2 + 16 * 8) << 10
    lt = env.get("CUBLASLT_WORKSPACE_SIZE", "1024")
    return cublas + (int(lt) << 10 if lt.strip().isdigit() else 1 << 20)


_default = TorchCuda()
_installed: list[Any] = []
_cache_lock = threading.Lock()


def cache_of(api: Any) -> dict[Any, Any]:
    """A dict kept on ``api`` itself for what is made once per interface (a device's streams,
    the pinned pool), so it lives exactly as long as ``api`` (a test's fake is collected with
    everything made for it).

    >>> api = TorchCuda()
    >>> cache_of(api) is cache_of(api), cache_of(api) is cache_of(TorchCuda())
    (True, False)
    """
    with _cache_lock:
        found = getattr(api, "_tensorql_cache", None)
        if found is None:
            found = {}
            api._tensorql_cache = found
        return found


def current() -> Any:
    """The interface in force: the innermost :func:`use`, else :class:`TorchCuda`."""
    return _installed[-1] if _installed else _default


@contextlib.contextmanager
def use(api: Any) -> Iterator[Any]:
    """Install ``api`` (a fake in tests) for the whole process while the block runs.

    Process-wide rather than per thread: the runtime's lane threads must see it too."""
    _installed.append(api)
    try:
        yield api
    finally:
        _installed.remove(api)
        release(api)


def release(api: Any) -> None:
    """Stop what was made for ``api`` that runs threads (the lanes of its devices, see
    :func:`tensorql.exec.devices.cuda.device_lanes`): an interface that goes out of use (a
    test's fake) leaves no thread behind. The real interface's lanes live with the process."""
    with _cache_lock:
        made = list(getattr(api, "_tensorql_cache", {}).values())
    for value in made:
        for item in (value.values() if isinstance(value, dict) else [value]):
            stop = getattr(item, "stop", None)
            if callable(stop):
                stop()
