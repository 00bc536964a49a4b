"""The ``devices`` option, parsed once into a :class:`DeviceSet`: the one reader of that option.

A device spec is a kind from :data:`DEVICE_KINDS` (``cpu``, ``cuda``, ``null``) and an index.
Every other module asks the set (``count``, ``computes_values``, ``all_cpu``, ``uses_cuda``,
``names``) instead of testing names as strings; the engine maps each kind to its device class
through the registry of :mod:`tensorql.exec.devices`.

>>> ds = DeviceSet.parse("null:2")
>>> ds.names, ds.count, ds.computes_values, ds.all_cpu
(('null:0', 'null:1'), 2, False, False)
>>> DeviceSet.parse(3).names, DeviceSet.parse(3).all_cpu
(('cpu:0', 'cpu:1', 'cpu:2'), True)
>>> DeviceSet.parse("cpu:0, cpu:1").kinds
('cpu', 'cpu')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tensorql.errors import OptionError


@dataclass(frozen=True)
class DeviceKind:
    """What a kind of device is, as far as planning and the pipeline care.

    ``computes_values`` is False for a device that only schedules (the null device's virtual
    time); ``accelerator`` for one with memory of its own that chunks are copied into."""

    name: str
    computes_values: bool = True
    accelerator: bool = False


#: every kind of device the ``devices`` option may name, by name
DEVICE_KINDS: dict[str, DeviceKind] = {
    "cpu": DeviceKind("cpu"),
    "cuda": DeviceKind("cuda", accelerator=True),
    "null": DeviceKind("null", computes_values=False),
}

_DEVICES_HINT = ("devices is 'auto', 'cpu', 'cuda', an int N (N CPU devices), 'null[:N]' "
                 "(scheduler tests only), 'cuda:0,cuda:1' or a list like ['cuda:0', 'cuda:1']")


@dataclass(frozen=True)
class DeviceSpec:
    """One device a ``devices`` option names: its kind and index.

    >>> DeviceSpec("cuda", 1).name
    'cuda:1'
    """

    kind: str
    index: int = 0

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.index}"

    @property
    def info(self) -> DeviceKind:
        return DEVICE_KINDS[self.kind]


@dataclass(frozen=True)
class DeviceSet:
    """The devices of a session, in order, parsed once from the ``devices`` option (``spec``,
    kept as given for messages). Bad specs raise :class:`~tensorql.errors.OptionError`."""

    specs: tuple[DeviceSpec, ...]
    spec: Any = "auto"

    @classmethod
    def parse(cls, spec: Any) -> DeviceSet:
        """The devices ``spec`` names ("auto" resolves to the machine's GPUs, else one CPU)."""
        return cls(tuple(_spec_of(name) for name in _names(spec)), spec)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(s.kind for s in self.specs)

    @property
    def count(self) -> int:
        return len(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    @property
    def computes_values(self) -> bool:
        """False when any device only schedules (null): there are no values to return."""
        return all(s.info.computes_values for s in self.specs)

    @property
    def all_cpu(self) -> bool:
        return all(s.kind == "cpu" for s in self.specs)

    @property
    def uses_cuda(self) -> bool:
        return any(s.kind == "cuda" for s in self.specs)

    def count_of(self, kind: str) -> int:
        """How many devices of ``kind`` the set has.

        >>> DeviceSet.parse(["cpu:0", "cpu:1"]).count_of("cpu")
        2
        """
        return sum(1 for s in self.specs if s.kind == kind)


def device_names(spec: Any) -> tuple[str, ...]:
    """The names of the devices ``spec`` names (compatibility: ``DeviceSet.parse(spec).names``).

    >>> device_names(3)
    ('cpu:0', 'cpu:1', 'cpu:2')
    >>> device_names("cpu"), device_names("cuda:0, cuda:1"), device_names("null:2")
    (('cpu:0',), ('cuda:0', 'cuda:1'), ('null:0', 'null:1'))
    """
    return DeviceSet.parse(spec).names


def _spec_of(name: str) -> DeviceSpec:
    kind, _, index = name.partition(":")
    return DeviceSpec(kind, int(index) if index else 0)


def _names(spec: Any) -> tuple[str, ...]:
    """The names ``spec`` stands for, checked against :data:`DEVICE_KINDS`."""
    import tensorql.cuda_api as cuda_api

    cuda = cuda_api.current()
    if spec is None or spec == "auto":
        if cuda.is_available():
            return tuple(f"cuda:{i}" for i in range(cuda.device_count()))
        return ("cpu:0",)
    if isinstance(spec, bool):
        raise OptionError(f"cannot read devices={spec!r}; {_DEVICES_HINT}")
    if isinstance(spec, int) or (isinstance(spec, str) and spec.strip().isdigit()):
        count = int(spec)
        if count < 1:
            raise OptionError(f"devices={spec!r} names no device; {_DEVICES_HINT}")
        return tuple(f"cpu:{i}" for i in range(count))
    if isinstance(spec, str):
        text = spec.strip()
        if text == "cpu":
            return ("cpu:0",)
        if text == "cuda":
            if not cuda.is_available():
                raise OptionError("devices='cuda' but no CUDA device is available; "
                                  "use devices='cpu' or 'auto'")
            return tuple(f"cuda:{i}" for i in range(cuda.device_count()))
        if text.startswith("null"):  # null[:N]: N devices of virtual time
            count = text.split(":", 1)[1] if ":" in text else "1"
            if not count.isdigit() or int(count) < 1:
                raise OptionError(f"cannot read devices={spec!r}; {_DEVICES_HINT}")
            return tuple(f"null:{i}" for i in range(int(count)))
        names = tuple(part.strip() for part in text.split(",") if part.strip())
    elif isinstance(spec, (list, tuple)):
        names = tuple(str(part).strip() for part in spec)
    else:
        raise OptionError(f"cannot read devices={spec!r}; {_DEVICES_HINT}")
    if not names:
        raise OptionError(f"devices={spec!r} names no device; {_DEVICES_HINT}")
    for name in names:
        kind, _, index = name.partition(":")
        if kind not in DEVICE_KINDS or (index and not index.isdigit()):
            raise OptionError(f"unknown device {name!r} in devices={spec!r}; {_DEVICES_HINT}")
    if len(set(names)) != len(names):
        raise OptionError(f"devices={spec!r} names a device twice")
    return names


__all__ = ["DEVICE_KINDS", "DeviceKind", "DeviceSet", "DeviceSpec", "device_names"]
