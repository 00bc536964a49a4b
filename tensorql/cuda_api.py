"""Everything tensorql asks of ``torch.cuda``, behind one small interface.

The CUDA device class, the host pool, device detection and the distributed exchange reach the
GPU only through :func:`current` (streams, events, pinned host memory, device-memory queries),
never through ``torch.cuda`` directly. On a machine with a GPU that is :class:`TorchCuda`, a thin
pass-through. Tests install a recording fake with :func:`use` (``tests/fake_cuda.py``): the CUDA
device class's own code then runs in CPU CI with the ``meta`` device standing in for device
memory, so a kernel that allocates on the wrong device, mixes devices or syncs to the host fails
there, before a GPU is at hand.

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

    # -- streams and events -------------------------------------------------------------------
    def stream(self, device: torch.device) -> Any:
        """A new stream on ``device``."""
        return torch.cuda.Stream(device)

    def stream_context(self, stream: Any) -> Any:
        """A context manager making ``stream`` the current one."""
        return torch.cuda.stream(stream)

    def current_stream(self, device: torch.device | None = None) -> Any:
        return torch.cuda.current_stream(device)

    def event(self, enable_timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=enable_timing)

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

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of page-locked host memory (one allocation)."""
        return torch.empty(int(nbytes), dtype=torch.uint8, pin_memory=True)


_default = TorchCuda()
_installed: list[Any] = []


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
