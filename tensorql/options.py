"""One ``Options`` object holds every setting of a session and reads the ``TENSORQL_*``
environment variables that configure one (:meth:`Options.from_env`). Two process-wide switches
are read where they act, before any session exists: ``TENSORQL_MALLOC_TUNING``
(``tensorql.exec.host_malloc``, applied when tensorql is imported) and
``TENSORQL_PACKED_WEIGHTS`` (``tensorql_kernels.packed_weights``, the bottom layer, which
cannot import this module).

>>> Options(workers=2).workers
2
>>> parse_bytes("1.5GiB")
1610612736
"""

from __future__ import annotations

import difflib
import functools
import math
import numbers
import os
import re
from dataclasses import dataclass, fields, replace
from fractions import Fraction
from typing import Any

from tensorql.devices import DeviceSet, device_names
from tensorql.errors import OptionError

# device_names: compatibility
__all__ = ["MAX_BYTES", "DeviceSet", "Options", "device_names", "parse_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


#: the largest memory size kept: a signed 64-bit byte count (8 EiB, more than any machine
#: has); a larger figure means as much (int64 arithmetic and DuckDB take no more)
MAX_BYTES = (1 << 63) - 1


def parse_bytes(value: int | str | None) -> int | None:
    """Bytes from an int or a string like ``"20GiB"``, ``"512 MB"``; None stays None. A
    size must be at least one byte; one beyond :data:`MAX_BYTES` is that.

    >>> parse_bytes("1.5GB"), parse_bytes(" 10 MiB "), parse_bytes("9" * 30) == MAX_BYTES
    (1500000000, 10485760, True)
    >>> parse_bytes("0B")
    Traceback (most recent call last):
    ...
    tensorql.errors.OptionError: memory size must be positive, got '0B'
    """
    size = _size(value)
    if size is not None and size <= 0:
        raise OptionError(f"memory size must be positive, got {value!r}")
    return size


def _size(value: int | str | None) -> int | None:
    """:func:`parse_bytes` without its check of 0 or less (at most :data:`MAX_BYTES`); any
    integer type is a byte count (``np.int64(1 << 26)``, as a size computed with numpy is)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, str, type(None))):
        raise OptionError(f"cannot read memory size {value!r}; write e.g. 512MiB, 20GiB or a "
                          "byte count")
    if value is None or isinstance(value, int):
        return value if value is None else min(value, MAX_BYTES)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise OptionError(
            f"cannot read memory size {value!r}; write e.g. 512MiB, 20GiB or a byte count"
        )
    # exact ("9" * 400 was float('inf') and an OverflowError)
    return min(int(Fraction(m.group(1)) * _UNITS[m.group(2).lower()]), MAX_BYTES)


MAX_THREADS = 4096  # more threads than any machine has: a typo, refused (torch overflows)
#: the smallest automatic tile target a memory_limit lowers the devices' to (4 MiB of float32)
MIN_TILE_TARGET_ELEMS = 1 << 20


def _count(name: str, value: Any) -> int:
    """A thread count: an integer in [0, MAX_THREADS] (0: the default)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or \
            not 0 <= value <= MAX_THREADS:
        raise OptionError(f"{name} must be an integer from 0 (the default) to {MAX_THREADS}, "
                          f"got {value!r}")
    return int(value)


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise OptionError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _positive_or_none(name: str, value: Any) -> int | None:
    """A positive integer, or None (chosen later: the devices' tile target)."""
    return None if value is None else _positive(name, value)


def _memory_size(name: str, value: Any) -> int | None:
    """:func:`parse_bytes` with ``name`` -- the option, or its ``TENSORQL_*`` variable -- in
    its errors.

    >>> _memory_size("TENSORQL_MEMORY_LIMIT", "0")
    Traceback (most recent call last):
    ...
    tensorql.errors.OptionError: TENSORQL_MEMORY_LIMIT: memory size must be positive, got '0'
    """
    try:
        return parse_bytes(value)
    except OptionError as err:
        raise OptionError(f"{name}: {err}") from None


def _device_cache(name: str, value: Any) -> int | str:
    """``device_cache``: "auto", 0 (None, "0" or "off": no cache) or a memory size."""
    if not isinstance(value, (type(None), bool, int, float, str)):
        raise OptionError(f"{name} must be 'auto', 0 / 'off' or a memory size such as "
                          f"'2GiB', got {value!r:.60}")
    if value in (None, 0, "0", "off"):
        return 0
    if value == "auto":
        return value
    size = _memory_size(name, value)
    assert size is not None  # None was taken above
    return size


# the memory sizes with checks of their own (in Options.__post_init__); Options.from_env runs
# the same checks on their TENSORQL_* variables, so that an error names the variable
_MEMORY_SIZES = {
    "memory_limit": _memory_size, "device_cache": _device_cache,
    "store_memory_limit": _memory_size, "relation_dense_bytes": _memory_size,
    "process_memory_limit": _memory_size,
}


def _bytes_or_zero(name: str, value: Any) -> int:
    """A byte count that may be 0 (nothing kept): an int >= 0 or a size like "64MiB"."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)
    try:
        parsed = _size(value)
    except OptionError as err:
        raise OptionError(f"{name}: {err}") from None
    if parsed is None or parsed < 0:
        raise OptionError(f"{name} must be a byte count (0 or more), got {value!r}")
    return parsed


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, bool) or (isinstance(value, numbers.Integral) and value in (0, 1)):
        return bool(value)
    raise OptionError(f"{name} must be True or False, got {value!r}")


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            not math.isfinite(value) or value <= 0:
        raise OptionError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def _name(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise OptionError(f"{name} must be a non-empty string, got {value!r}")
    return value


# how each setting is checked and normalised when a session's Options are made (the memory
# sizes that may be None, devices, topology and device_cache have checks of their own below)
_CHECKS = {
    "workers": _count, "intra_op_threads": _count, "tile_target_elems": _positive_or_none,
    "kernel_temp_bytes": _bytes_or_zero, "chunk_cache_bytes": _bytes_or_zero,
    "progress": _flag, "distributed": _flag, "deterministic": _flag,
    "distributed_timeout_s": _seconds, "strategy": _name,
}


def _default_workers(distributed: bool = False) -> int:
    """The cores this process may use; in a torch.distributed job, its share of them: the
    cores divided by ``LOCAL_WORLD_SIZE`` (the ranks torchrun starts on this machine), so
    that K local ranks do not each start as many threads as there are cores (on 2 cores, two
    ranks of two threads each ran a LLaMA block 5x slower than two of one thread)."""
    cores = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                else (os.cpu_count() or 1))
    if distributed:
        try:
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        except ValueError:
            local_ranks = 1
        cores = max(1, cores // max(1, local_ranks))
    return cores


@dataclass(frozen=True)
class Options:
    """Every tunable of a tensorql session.

    Attributes:
        workers: worker threads running chunk tasks (default: the usable cores; in a
            torch.distributed session, the cores divided by ``LOCAL_WORLD_SIZE``, the ranks
            torchrun runs on this machine).
        intra_op_threads: torch threads inside one chunk kernel (default: those cores //
            workers).
        devices: "auto" | "cpu" | "cuda" | N (N CPU devices) | "cuda:0,cuda:1" | a list
            such as ["cuda:0", "cuda:1"] | "null[:N]" (scheduler tests); parsed once into
            :attr:`device_set`. With several devices the optimizer partitions every
            operation across them and that partitioning is what runs. In a distributed
            session "auto" and "cuda" are this rank's share of the machine's GPUs (cuda:
            LOCAL_RANK with one GPU a rank); with more local ranks than GPUs "auto" is the
            CPU and "cuda" a DistributedError (NCCL cannot run two ranks on one GPU).
        strategy: the optimizer's partitioning strategy on several devices (auto, data,
            model, exhaustive).
        memory_limit: bytes each device may hold (None: unlimited).
        topology: how the devices are grouped into nodes, for the optimizer's cost model
            (``tensorql.optimizer.topology``): a ``Topology``, a machine name such as
            "dgx-h100" (whole nodes of it), or "NODESxPER[:machine]" such as "2x8"; read by
            the planner, which raises TopologyError (an OptionError) when it does not fit
            the devices. None: one node, except in a torch.distributed job, whose ranks on
            one host form a node (host names gathered from the ranks).
        tile_target_elems: element count auto-tiling aims at per chunk (None: the devices'
            choice, :attr:`~tensorql.devices.DeviceSet.tile_target_elems` -- 2^22 on CPUs,
            2^24 on GPUs -- lowered under a ``memory_limit`` to at most 1/128 of it, never
            below 2^20).
        kernel_temp_bytes: cap on temporaries a non-matmul chunk kernel materialises.
        chunk_cache_bytes: decoded chunks the DuckDB store keeps in memory (LRU).
        store_memory_limit: DuckDB's memory limit for a file-backed store (bytes or "1GiB";
            None: DuckDB's default of 80% of RAM). It bounds what a large write keeps resident;
            bigger SQL joins spill to ``<file>.tmp``. In-memory stores are never limited.
        backend: a name in the pipeline's backend registry: "native" (the executor) or
            "duckdb" (SQL backend); checked when a session opens.
        progress: show a progress bar on stderr for long runs and stores (the CLI sets it).
        relation_dense_bytes: the most memory a relation operand of SQL's EINSUM may take
            once densified (bytes or "256MiB"; ``memory_limit`` lowers it); beyond it the query
            is refused with a ShapeError instead of allocating.
        distributed: run as one rank of a torch.distributed job (launched with torchrun):
            ``devices`` are then this rank's devices, and the job's devices are every rank's.
        distributed_timeout_s: how long a rank waits for a peer before the run fails with a
            DistributedError naming it (default 120 s).
        distributed_exchange: how a distributed run moves chunks between ranks:
            "collective" (default) groups the transfers of one step (a repartition's slices,
            partial aggregates, pieces read elsewhere) coming from two or more ranks into
            ``all_to_all`` collectives of the job, one per round of at most a chunk for each
            pair of ranks; "p2p" sends every chunk on its own.
        process_memory_limit: the one figure bounding the process's own memory: device
            budgets of CPU devices (``memory_limit`` each) + the chunk cache + DuckDB's memory
            + a dense result read with ``.numpy()``/``.torch()``. None (the default): 80% of
            the machine's physical memory. When given, the chunk cache is capped at 1/8 of it
            and DuckDB's memory at 1/4; a dense result that cannot fit in what is left (or in
            the memory the system has available) fails up front with MemoryLimitError.
        deterministic: bit-identical results run after run (as
            ``torch.use_deterministic_algorithms``): every contribution to an output chunk is
            accumulated by one task in a fixed order, and tasks run on one worker thread
            whose kernels use every core (``intra_op_threads``); concurrent chunk kernels
            were seen to round differently from run to run. Costs the overlap of tasks.
            Training resumed from a checkpoint then ends with identical weights. Two limits:
            on several devices, the partial sums other devices send for one output chunk
            are folded in the order they arrive (a product split along its summed label
            across devices can differ in the last bits between runs: use one device where
            bits must repeat); and since an output chunk's contributions are one task, a
            ``memory_limit`` must hold all of one chunk's inputs at once (smaller tiles do
            not lower that for a reduction over a whole tensor).
        device_cache: bytes of each GPU's memory that keep the device copies of stored
            chunks the session's queries load, across queries (LRU; a copy of a tensor
            stored again since is dropped, so a ``store()`` of new values is always seen):
            a second query reading the same weights copies none of them again. "auto" (the
            default): 1/4 of ``memory_limit``, or of the GPU's memory without one; 0 or
            None: off. Under ``memory_limit`` each run first shrinks it to what its memory
            plan leaves of the budget, so copies kept and the run's chunks fit the limit
            together. CPU devices have no such cache (their chunk cache is the store's).
    """

    workers: int = 0
    intra_op_threads: int = 0
    devices: Any = "auto"
    strategy: str = "auto"
    memory_limit: int | None = None
    topology: Any = None
    tile_target_elems: int | None = None
    kernel_temp_bytes: int = 64 << 20
    chunk_cache_bytes: int = 1 << 30
    store_memory_limit: int | None = 1 << 30
    backend: str = "native"
    progress: bool = False
    relation_dense_bytes: int | None = 256 << 20
    distributed: bool = False
    distributed_timeout_s: float = 120.0
    distributed_exchange: str = "collective"
    process_memory_limit: int | None = None
    deterministic: bool = False
    device_cache: Any = "auto"

    def __post_init__(self) -> None:
        # None: chosen by the devices below, once they are parsed (and again by ``with_``)
        auto_tiles = self.tile_target_elems is None
        object.__setattr__(self, "_auto_tiles", auto_tiles)
        for name, check in _CHECKS.items():
            object.__setattr__(self, name, check(name, getattr(self, name)))
        if self.deterministic:
            object.__setattr__(self, "workers", 1)
        if self.workers <= 0:
            object.__setattr__(self, "workers", _default_workers(self.distributed))
        if self.intra_op_threads <= 0:
            object.__setattr__(
                self, "intra_op_threads",
                max(1, _default_workers(self.distributed) // self.workers)
            )
        object.__setattr__(self, "memory_limit", _memory_size("memory_limit", self.memory_limit))
        object.__setattr__(self, "device_cache", _device_cache("device_cache", self.device_cache))
        # parsed once, here (OptionError now rather than at the first query)
        object.__setattr__(self, "_device_set",
                           DeviceSet.parse(self.devices, distributed=self.distributed))
        if auto_tiles:
            object.__setattr__(self, "tile_target_elems", self._device_tile_target())
        object.__setattr__(self, "store_memory_limit",
                           _memory_size("store_memory_limit", self.store_memory_limit))
        object.__setattr__(self, "relation_dense_bytes",
                           _memory_size("relation_dense_bytes", self.relation_dense_bytes))
        total = _memory_size("process_memory_limit", self.process_memory_limit)
        object.__setattr__(self, "process_memory_limit", total)
        if total is not None:  # the one figure: the cache and DuckDB take their shares of it
            object.__setattr__(self, "chunk_cache_bytes", min(self.chunk_cache_bytes, total // 8))
            object.__setattr__(self, "store_memory_limit",
                               min(self.store_memory_limit or total, max(1, total // 4)))
        if not isinstance(self.distributed_exchange, str) or \
                self.distributed_exchange not in ("collective", "p2p"):
            raise OptionError(f"distributed_exchange={self.distributed_exchange!r}: expected "
                              "'collective' or 'p2p'")
        if not isinstance(self.backend, str) or not self.backend:
            raise OptionError(f"backend must be a name such as 'native' or 'duckdb', "
                              f"got {self.backend!r}")

    @classmethod
    def from_env(cls, **overrides: Any) -> Options:
        """Options from ``TENSORQL_<FIELD>`` environment variables, then ``overrides``."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = os.environ.get(f"TENSORQL_{f.name.upper()}")
            if raw is None:
                continue
            if f.name in ("workers", "intra_op_threads", "tile_target_elems",
                          "kernel_temp_bytes", "chunk_cache_bytes"):
                try:
                    values[f.name] = int(raw)
                except ValueError as err:
                    raise OptionError(f"TENSORQL_{f.name.upper()}={raw!r} is not an integer") \
                        from err
            elif f.name in ("progress", "distributed", "deterministic"):
                values[f.name] = raw.lower() in ("1", "true", "yes", "on")
            elif f.name == "distributed_timeout_s":
                try:
                    values[f.name] = float(raw)
                except ValueError as err:
                    raise OptionError(f"TENSORQL_{f.name.upper()}={raw!r} is not a number") \
                        from err
            else:
                if f.name in _MEMORY_SIZES:  # checked here, so that its error names it
                    _MEMORY_SIZES[f.name](f"TENSORQL_{f.name.upper()}", raw)
                values[f.name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise OptionError(f"unknown option(s): {', '.join(sorted(unknown))}")
        return cls(**values)

    def _device_tile_target(self) -> int:
        """The devices' tile target (:attr:`DeviceSet.tile_target_elems`), under a
        ``memory_limit`` at most 1/128 of it in float32 elements but never below 2^20
        (a GPU's 2^24 at 2 GiB, a CPU's 2^22 at 2 GiB; 2^21 at 1 GiB).

        >>> Options(devices="cpu").tile_target_elems == 1 << 22
        True
        >>> Options(devices="cpu", memory_limit=1 << 30).tile_target_elems == 1 << 21
        True
        """
        target = self._device_set.tile_target_elems  # type: ignore[attr-defined]
        if self.memory_limit is not None:
            target = max(MIN_TILE_TARGET_ELEMS, min(target, self.memory_limit // (4 * 128)))
        return int(target)

    @property
    def task_lanes(self) -> int:
        """The tasks the session's devices run side by side (what planning splits a step
        into at least, :meth:`~tensorql.devices.DeviceSet.task_lanes`): the ``workers`` on
        CPUs, the compute streams on GPUs.

        >>> Options(devices="cpu", workers=3).task_lanes
        3
        """
        return self.device_set.task_lanes(self.workers)

    def with_(self, **changes: Any) -> Options:
        """These options with ``changes``; a new ``workers`` without ``intra_op_threads``
        re-derives the torch threads a kernel gets (cores // workers).

        >>> Options(workers=2).with_(workers=1).intra_op_threads == max(1, _default_workers())
        True
        """
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            hints = [difflib.get_close_matches(name, known, n=1) for name in unknown]
            said = ", ".join(f"{name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                             for name, hint in zip(unknown, hints))
            raise OptionError(f"unknown option(s): {said}; the options are "
                              f"{', '.join(sorted(known))}")
        if "workers" in changes and "intra_op_threads" not in changes:
            changes = {**changes, "intra_op_threads": 0}
        if self._auto_tiles and "tile_target_elems" not in changes:  # type: ignore[attr-defined]
            changes = {**changes, "tile_target_elems": None}  # the new devices' choice
        return replace(self, **changes)

    @property
    def device_set(self) -> DeviceSet:
        """The devices, parsed once from ``devices`` (:class:`~tensorql.devices.DeviceSet`).

        >>> Options(devices=2).device_set.names
        ('cpu:0', 'cpu:1')
        """
        return self._device_set  # type: ignore[attr-defined, no-any-return]

    @property
    def process_memory_bytes(self) -> int:
        """The process's memory figure: ``process_memory_limit``, else 80% of physical RAM.

        >>> Options(process_memory_limit="8GiB").process_memory_bytes
        8589934592
        """
        if self.process_memory_limit is not None:
            return self.process_memory_limit
        return int(physical_memory_bytes() * 0.8)

    def dense_result_budget(self, system: bool = True) -> int:
        """Bytes a dense result may take: the process figure less the chunk cache, DuckDB's
        memory and the CPU devices' budgets -- at least 1/16 of the figure, as the host tier
        (a memory_limit per CPU device at or above the figure, memory_limit="20GiB" on a
        host of 24 GiB, left 0 bytes: even a 24-byte result was a MemoryLimitError) -- and
        (unless ``system=False``) never more than the system has available.

        >>> Options(process_memory_limit="8GiB").dense_result_budget() <= 6 * 2**30  # 8 - 1 - 1
        True
        >>> Options(process_memory_limit="8GiB", devices="cpu",
        ...         memory_limit="20GiB").dense_result_budget(system=False) >> 20
        512
        """
        cpu_devices = self.device_set.count_of("cpu")
        reserved = (self.chunk_cache_bytes + (self.store_memory_limit or 0)
                    + cpu_devices * (self.memory_limit or 0))
        budget = max(self.process_memory_bytes // 16, self.process_memory_bytes - reserved)
        return min(budget, available_memory_bytes()) if system else budget

    @property
    def spill_memory_bytes(self) -> int:
        """DuckDB's memory in the session's spill database (the DuckDB tier, a database of
        its own): a quarter of ``store_memory_limit``, within 32-256 MiB.

        >>> Options(process_memory_limit="512MiB").spill_memory_bytes >> 20
        32
        """
        share = (self.store_memory_limit or (1 << 30)) // 4
        return max(32 << 20, min(256 << 20, share))

    def host_tier_bytes(self, dense_bytes: int = 0) -> int:
        """Bytes of chunk copies a run's host tier may keep in host memory (beyond a GPU's
        pinned pool); the rest goes to DuckDB, the spill tier. On CPU devices, where device
        memory is host memory, it is what the process figure leaves once the chunk cache,
        DuckDB's memory (the store's and the spill database's), the CPU devices' budgets and
        the run's dense results (``dense_bytes``) have their shares; at least 1/16 of the
        figure.

        >>> opts = Options(devices="cpu", memory_limit="1GiB", process_memory_limit="4GiB")
        >>> from tensorql.units import format_bytes
        >>> format_bytes(opts.host_tier_bytes()), format_bytes(opts.host_tier_bytes(1 << 30))
        ('1.2 GiB', '256.0 MiB')
        """
        total = self.process_memory_bytes
        left = (self.dense_result_budget(system=False) - self.spill_memory_bytes
                - max(0, int(dense_bytes)))
        return max(total // 16, left)


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@functools.lru_cache(maxsize=1)
def physical_memory_bytes() -> int:
    """The machine's physical memory (``/proc/meminfo`` MemTotal, else sysconf; read once)."""
    total = _meminfo("MemTotal")
    if total is None:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total


def available_memory_bytes() -> int:
    """Memory the system can give without swapping (MemAvailable; else physical memory)."""
    available = _meminfo("MemAvailable")
    return available if available is not None else physical_memory_bytes()
