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

import numbers
from dataclasses import dataclass
from typing import Any

from tensorql.errors import OptionError
from tensorql.grid import CPU_TILE_ELEMS


@dataclass(frozen=True)
class DeviceKind:
    """What a kind of device is, as far as planning and the pipeline care.

    ``computes_values`` is False for a device that only schedules (the null device's virtual
    time); ``accelerator`` for one with memory of its own that chunks are copied into;
    ``whole_k``: one product over the whole contracted label beats a series of products per
    tile of it folded into an accumulator (a GPU: one cuBLAS call at full occupancy that
    accumulates in float32 inside; a CPU's series keeps its accumulator in cache instead).
    ``tile_target_elems``: the chunk size automatic tiles aim at on this kind (a CPU's:
    16 MiB of float32, :data:`tensorql.grid.CPU_TILE_ELEMS`, so a layer's weight stays
    one chunk and its products one call each, while a big operand still spreads over the
    threads; a GPU's: 64 MiB, so each launch fills the device and a plan is tens of
    tasks where a CPU's is hundreds -- a LLaMA-7B layer's prefill was 945 tasks at 2^20).
    ``compute_lanes``: the tasks one such device runs side by side (a GPU's compute
    streams); 0 for a CPU (and the null device standing in for one), whose share of the
    session's ``workers`` it is."""

    name: str
    computes_values: bool = True
    accelerator: bool = False
    whole_k: bool = False
    tile_target_elems: int = CPU_TILE_ELEMS
    compute_lanes: int = 0


#: the compute streams of a CUDA device: kernels it runs side by side
CUDA_COMPUTE_STREAMS = 2


#: every kind of device the ``devices`` option may name, by name
DEVICE_KINDS: dict[str, DeviceKind] = {
    "cpu": DeviceKind("cpu"),
    "cuda": DeviceKind("cuda", accelerator=True, whole_k=True, tile_target_elems=1 << 24,
                       compute_lanes=CUDA_COMPUTE_STREAMS),
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
    def parse(cls, spec: Any, distributed: bool = False, environ: Any = None) -> DeviceSet:
        """The devices ``spec`` names ("auto" resolves to the machine's GPUs, else one CPU).

        With ``distributed`` (one rank of a torch.distributed job) "auto" and "cuda" mean
        this rank's share of the machine's GPUs (:func:`rank_gpus`): never a GPU of another
        local rank."""
        if distributed and (spec is None or spec in ("auto", "cuda")):
            return cls(tuple(_spec_of(name) for name in _rank_names(spec, environ)), spec)
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

    @property
    def tile_target_elems(self) -> int:
        """The chunk size automatic tiles aim at on these devices: the smallest of their
        kinds' (:attr:`DeviceKind.tile_target_elems`), so a chunk suits every device.

        >>> DeviceSet.parse("cpu").tile_target_elems == 1 << 22
        True
        """
        return min((s.info.tile_target_elems for s in self.specs), default=CPU_TILE_ELEMS)

    def task_lanes(self, workers: int) -> int:
        """The tasks these devices run side by side: the sum of their compute lanes, a CPU
        device's being its share of the session's ``workers`` (a GPU's its compute streams,
        however many cores the host has: a 16-core H100 host planned 16 tasks a step for a
        GPU that runs 2).

        >>> DeviceSet.parse(["cpu:0", "cpu:1"]).task_lanes(4), DeviceSet.parse("cpu").task_lanes(3)
        (4, 3)
        """
        hosts = sum(1 for s in self.specs if not s.info.compute_lanes)  # CPU (or null)
        share = max(1, workers // hosts) if hosts else 0
        return max(1, sum(s.info.compute_lanes or share for s in self.specs))

    def count_of(self, kind: str) -> int:
        """How many devices of ``kind`` the set has.

        >>> DeviceSet.parse(["cpu:0", "cpu:1"]).count_of("cpu")
        2
        """
        return sum(1 for s in self.specs if s.kind == kind)

    def check_present(self) -> None:
        """Raise :class:`~tensorql.errors.OptionError` unless every device named here is on
        this machine (a session checks at connect, not at its first query; planning for
        devices elsewhere -- ``tq.optimize(expr, devices=["cuda:0", ...])`` -- needs none).

        >>> import tensorql.cuda_api as cuda_api
        >>> class NoGpu(cuda_api.TorchCuda):
        ...     def is_available(self):
        ...         return False
        >>> try:
        ...     with cuda_api.use(NoGpu()):
        ...         DeviceSet.parse("cuda:1").check_present()
        ... except OptionError as err:
        ...     print(err)
        devices='cuda:1' names 'cuda:1' but no CUDA device is available; use devices='cpu' or 'auto'
        """
        wanted = [s for s in self.specs if s.kind == "cuda"]
        if not wanted:
            return
        import tensorql.cuda_api as cuda_api

        cuda = cuda_api.current()
        if not cuda.is_available():
            raise OptionError(f"devices={self.spec!r} names {wanted[0].name!r} but no CUDA "
                              "device is available; use devices='cpu' or 'auto'")
        count = cuda.device_count()
        for s in wanted:
            if s.index >= count:
                raise OptionError(f"devices={self.spec!r} names {s.name!r} but this machine has "
                                  f"{count} CUDA device{'s' if count != 1 else ''} "
                                  f"(cuda:0 to cuda:{count - 1})")


def device_names(spec: Any) -> tuple[str, ...]:
    """The names of the devices ``spec`` names (compatibility: ``DeviceSet.parse(spec).names``).

    >>> device_names(3)
    ('cpu:0', 'cpu:1', 'cpu:2')
    >>> device_names("cpu"), device_names("cuda:0, cuda:1"), device_names("null:2")
    (('cpu:0',), ('cuda:0', 'cuda:1'), ('null:0', 'null:1'))
    """
    return DeviceSet.parse(spec).names


def local_place(environ: Any = None) -> tuple[int, int]:
    """This process's ``(LOCAL_RANK, LOCAL_WORLD_SIZE)``: its place among the ranks of a
    torch.distributed job that torchrun starts on this machine ((0, 1) when unset).

    >>> local_place({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}), local_place({})
    ((1, 2), (0, 1))
    """
    import os

    env = os.environ if environ is None else environ
    try:
        local_world = max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
        local_rank = int(env.get("LOCAL_RANK", "0"))
    except ValueError as err:
        raise OptionError(f"cannot read LOCAL_RANK / LOCAL_WORLD_SIZE ({err})") from err
    if not 0 <= local_rank < local_world:
        raise OptionError(f"LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world}")
    return local_rank, local_world


def rank_gpus(gpus: int, local_rank: int, local_world: int) -> tuple[int, ...]:
    """The GPUs (indices) a rank of a job uses when it has ``local_world`` ranks on a machine
    with ``gpus`` GPUs: an equal share each, ``gpus // local_world`` consecutive GPUs (one
    rank alone takes them all); none when there are more local ranks than GPUs, since NCCL
    cannot run two ranks on one GPU.

    >>> rank_gpus(2, 1, 2), rank_gpus(8, 1, 2), rank_gpus(4, 0, 1), rank_gpus(1, 0, 2)
    ((1,), (4, 5, 6, 7), (0, 1, 2, 3), ())
    """
    share = gpus // local_world
    return tuple(range(local_rank * share, (local_rank + 1) * share))


_WARNED: set[tuple[int, int]] = set()  # (local ranks, GPUs) whose CPU fallback was logged


def _rank_names(spec: Any, environ: Any = None) -> tuple[str, ...]:
    """A rank's devices for ``devices`` "auto" / "cuda": its share of the machine's GPUs
    (:func:`rank_gpus`). With more local ranks than GPUs, "auto" falls back to the CPU (gloo
    carries the transfers; the ``tensorql`` logger says why), and "cuda" is refused before
    NCCL is touched."""
    import logging

    import tensorql.cuda_api as cuda_api
    from tensorql.errors import DistributedError

    cuda = cuda_api.current()
    gpus = cuda.device_count() if cuda.is_available() else 0
    local_rank, local_world = local_place(environ)
    mine = rank_gpus(gpus, local_rank, local_world)
    if mine:
        return tuple(f"cuda:{i}" for i in mine)
    if spec == "cuda":
        raise DistributedError(
            f"devices='cuda' on local rank {local_rank} of {local_world} on this machine "
            f"(LOCAL_WORLD_SIZE), but {cuda.name} sees {gpus} GPU(s) and NCCL cannot run two "
            f"ranks on one GPU: start at most {max(gpus, 1)} rank(s) per machine (torchrun "
            "--nproc-per-node), or use devices='cpu' (gloo)")
    if gpus and (local_world, gpus) not in _WARNED:
        _WARNED.add((local_world, gpus))
        logging.getLogger(__name__).warning(
            "devices='auto': %d ranks on this machine but %d GPU(s); NCCL cannot run two "
            "ranks on one GPU, so each rank runs on the CPU (gloo). Start at most %d rank(s) "
            "per machine to use the GPUs.", local_world, gpus, gpus)
    return ("cpu:0",)


# The most devices a session or a plan is made for: the optimizer's cost model keeps a
# devices x devices matrix of bytes moved, 2 GiB at this many (and its auto search takes
# ~35 s on a 2-core host); beyond it a plan was a MemoryError of that matrix (1,000,000
# devices asked for 7.3 TiB) and devices=2**62 a list of names that filled the memory.
MAX_DEVICES = 16384


def _count(spec: Any, count: int) -> int:
    """``count`` devices if at least 1 and at most :data:`MAX_DEVICES`, else OptionError."""
    if count < 1:
        raise OptionError(f"devices={spec!r} names no device; {_DEVICES_HINT}")
    if count > MAX_DEVICES:
        raise OptionError(f"devices={spec!r} is more than the {MAX_DEVICES} devices tensorql "
                          "plans for (its cost model keeps a devices x devices matrix)")
    return count


def _spec_of(name: str) -> DeviceSpec:
    kind, _, index = name.partition(":")
    return DeviceSpec(kind, int(index) if index else 0)


def _names(spec: Any) -> tuple[str, ...]:
    """The names ``spec`` stands for, checked against :data:`DEVICE_KINDS`."""
    import tensorql.cuda_api as cuda_api

    cuda = cuda_api.current()
    if spec is None or (isinstance(spec, str) and spec == "auto"):  # not ==: an array's
        # comparison is elementwise
        if cuda.is_available():
            return tuple(f"cuda:{i}" for i in range(cuda.device_count()))
        return ("cpu:0",)
    if isinstance(spec, bool):
        raise OptionError(f"cannot read devices={spec!r}; {_DEVICES_HINT}")
    if isinstance(spec, numbers.Integral) or (isinstance(spec, str)
                                              and spec.strip().isdigit()):
        return tuple(f"cpu:{i}" for i in range(_count(spec, int(spec))))
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
            return tuple(f"null:{i}" for i in range(_count(spec, int(count))))
        names = tuple(part.strip() for part in text.split(",") if part.strip())
    elif isinstance(spec, (list, tuple)):
        names = tuple(str(part).strip() for part in spec)
    else:
        raise OptionError(f"cannot read devices={spec!r}; {_DEVICES_HINT}")
    _count(spec, len(names))
    for name in names:
        kind, _, index = name.partition(":")
        if kind not in DEVICE_KINDS or (index and not index.isdigit()):
            raise OptionError(f"unknown device {name!r} in devices={spec!r}; {_DEVICES_HINT}")
    if len(set(names)) != len(names):
        raise OptionError(f"devices={spec!r} names a device twice")
    return names


__all__ = ["DEVICE_KINDS", "MAX_DEVICES", "DeviceKind", "DeviceSet", "DeviceSpec", "device_names",
           "local_place", "rank_gpus"]
