"""Devices the runtime runs on: ``cpu`` (threads), ``cuda`` (streams), ``null`` (tests).

:func:`resolve_devices` turns the ``devices`` option into device objects:

>>> [d.name for d in resolve_devices("cpu", workers=2)]
['cpu:0']
>>> [d.name for d in resolve_devices(["cpu:0", "cpu:1"], workers=4)], \\
...     resolve_devices(["cpu:0", "cpu:1"], workers=4)[0].lanes["compute"]
(['cpu:0', 'cpu:1'], 2)
>>> [d.name for d in resolve_devices("null:2")]
['null:0', 'null:1']
"""

from __future__ import annotations

from typing import Any

import torch

from tensorql.errors import OptionError
from tensorql.exec.devices.base import Completion, Device, LaneThreads, ThreadedDevice
from tensorql.exec.devices.cpu import CPUDevice
from tensorql.exec.devices.null import NullDevice, SimClock
from tensorql.options import device_names

__all__ = ["Completion", "CPUDevice", "Device", "LaneThreads", "NullDevice", "SimClock",
           "ThreadedDevice",
           "resolve_devices"]

def resolve_devices(spec: Any = "auto", workers: int = 1) -> list[Device]:
    """Device objects for a ``devices`` option; CPU devices share ``workers`` threads."""
    names = device_names(spec)
    n_cpu = sum(n.startswith("cpu") for n in names)
    clock = SimClock()
    out: list[Device] = []
    for name in names:
        kind = name.split(":", 1)[0]
        if kind == "cpu":
            out.append(CPUDevice(name if ":" in name else "cpu:0",
                                 workers=max(1, workers // max(1, n_cpu))))
        elif kind == "cuda":
            from tensorql.exec.devices.cuda import CUDADevice

            if not torch.cuda.is_available():
                raise OptionError(f"device {name!r} needs CUDA, which is not available")
            out.append(CUDADevice(name if ":" in name else "cuda:0"))
        elif kind == "null":
            out.append(NullDevice(name, clock=clock))
    return out
