"""Devices the runtime runs on: ``cpu`` (threads), ``cuda`` (streams), ``null`` (tests).

:data:`DEVICE_CLASSES` maps each kind of :data:`tensorql.devices.DEVICE_KINDS` to the
function that builds its device object; :func:`resolve_devices` builds a
:class:`~tensorql.devices.DeviceSet` (or a ``devices`` option value) through it:

>>> [d.name for d in resolve_devices("cpu", workers=2)]
['cpu:0']
>>> [d.name for d in resolve_devices(["cpu:0", "cpu:1"], workers=4)], \\
...     resolve_devices(["cpu:0", "cpu:1"], workers=4)[0].lanes["compute"]
(['cpu:0', 'cpu:1'], 2)
>>> [d.name for d in resolve_devices("null:2")]
['null:0', 'null:1']
>>> sorted(DEVICE_CLASSES)
['cpu', 'cuda', 'null']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tensorql.devices import DeviceSet, DeviceSpec
from tensorql.errors import OptionError
from tensorql.exec.devices.base import Completion, Device, LaneThreads, ThreadedDevice
from tensorql.exec.devices.cpu import CPUDevice
from tensorql.exec.devices.null import NullDevice, SimClock

__all__ = ["DEVICE_CLASSES", "Completion", "CPUDevice", "Device", "LaneThreads", "NullDevice",
           "SimClock", "ThreadedDevice", "resolve_devices"]


@dataclass
class BuildContext:
    """What the devices of one set share as they are built: the CPU workers each CPU device
    gets, and one virtual clock for the null devices."""

    cpu_workers: int
    clock: SimClock


def _cpu(spec: DeviceSpec, ctx: BuildContext) -> Device:
    return CPUDevice(spec.name, workers=ctx.cpu_workers)


def _cuda(spec: DeviceSpec, ctx: BuildContext) -> Device:
    import tensorql.cuda_api as cuda_api
    from tensorql.exec.devices.cuda import CUDADevice

    if not cuda_api.current().is_available():
        raise OptionError(f"device {spec.name!r} needs CUDA, which is not available")
    return CUDADevice(spec.name)


def _null(spec: DeviceSpec, ctx: BuildContext) -> Device:
    return NullDevice(spec.name, clock=ctx.clock)


#: the device class of each kind, as a builder of one device from its spec
DEVICE_CLASSES: dict[str, Callable[[DeviceSpec, BuildContext], Device]] = {
    "cpu": _cpu, "cuda": _cuda, "null": _null,
}


def resolve_devices(spec: Any = "auto", workers: int = 1) -> list[Device]:
    """Device objects for a :class:`~tensorql.devices.DeviceSet` (or a ``devices`` option
    value, parsed here); CPU devices share ``workers`` threads."""
    devices = spec if isinstance(spec, DeviceSet) else DeviceSet.parse(spec)
    ctx = BuildContext(cpu_workers=max(1, workers // max(1, devices.count_of("cpu"))),
                       clock=SimClock())
    return [DEVICE_CLASSES[s.kind](s, ctx) for s in devices.specs]
