"""The devices' topology: nodes of devices, and the bandwidth of each link level.

A :class:`Topology` groups a plan's ``N`` devices into *nodes* (machines). Two devices of one
node talk over the node's fabric (NVLink, PCIe: the ``intra`` level), two devices of
different nodes over the network (InfiniBand, Ethernet: the ``inter`` level). Each device has
one link of each level, of the level's bandwidth (bytes per second, one direction), so a node
of ``k`` devices receives at ``k x intra_bandwidth`` from its own devices and at
``k x inter_bandwidth`` from other nodes (one NIC per device, as on DGX machines).

The cost model (:meth:`Topology.transfer_seconds`) prices one exchange -- the bytes every
device pair moves in one step, an (N, N) matrix -- by the slowest link each byte crosses and
by the busiest node: every node receives its intra-node bytes over its devices' intra links
and its inter-node bytes over their NICs, one after the other, and the exchange takes as
long as the busiest node needs. On a flat topology (one node) that is ``bytes / (N x
bandwidth)``: proportional to the bytes, so a flat topology ranks plans exactly as bytes do.

Machines come from a registry (:data:`MACHINES`) of nominal figures; bandwidths can be
given instead. ``Topology.flat(n)`` is one node of ``n`` devices (the planner's behaviour
when no topology is given).

>>> t = Topology.nodes(2, 4, machine="dgx-a100")
>>> t.devices, t.node_of(5), t.level(0, 3), t.level(0, 4), t.level(2, 2)
(8, 1, 'intra', 'inter', 'device')
>>> import numpy as np
>>> pair = np.zeros((8, 8), dtype=np.int64); pair[0, 1] = 300; pair[0, 4] = 100
>>> t.level_bytes(pair)
{'intra': 300, 'inter': 100}
>>> Topology.parse("2x4", 8) == Topology.nodes(2, 4)
True
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorql.errors import OptionError

LEVELS = ("intra", "inter")
#: The memory tiers a memory limit can force, after the link levels: a device's chunks
#: evicted to its host's memory and read back (``host``), and those beyond the host's memory
#: spilled to the DuckDB tier and read back (``duckdb``).
TIERS = ("host", "duckdb")

#: The DuckDB spill tier's rate, bytes/s each way, for every machine: the slower direction
#: of a chunk's BLOB round trip measured on the project's 2-core VM (docs/storage.md: reads
#: at 437 MB/s, writes at 1,926 MB/s) -- a spill is its CPU per byte on the node's host.
SPILL_BANDWIDTH = 0.4e9


class TopologyError(OptionError):
    """A topology that does not describe the plan's devices (a device missing or twice, a
    count that does not match, an unknown machine, a bandwidth that is not positive)."""


@dataclass(frozen=True)
class Machine:
    """Nominal figures of one kind of node: devices, per-device link bandwidths (bytes/s,
    one direction) inside the node and to other nodes, and a device's FLOP rate."""

    name: str
    devices_per_node: int
    intra_bandwidth: float
    inter_bandwidth: float
    device_flops: float
    note: str
    host_bandwidth: float = 32e9     # a device's link to its host's memory (offload), B/s
    host_memory: int = 1 << 40       # a node's host memory for evicted chunks, bytes
    spill_bandwidth: float = SPILL_BANDWIDTH  # a node's DuckDB spill tier, B/s a direction


MACHINES: dict[str, Machine] = {m.name: m for m in (
    Machine("dgx-a100", 8, 300e9, 25e9, 150e12,
            "8 A100 on NVLink 3 / NVSwitch (300 GB/s a direction), one 200 Gb/s HDR "
            "InfiniBand NIC per GPU (25 GB/s); PCIe 4 x16 to the host (32 GB/s), 1 TiB of "
            "host memory", 32e9, 1 << 40),
    Machine("dgx-h100", 8, 450e9, 50e9, 400e12,
            "8 H100 on NVLink 4 / NVSwitch (450 GB/s a direction), one 400 Gb/s NDR "
            "InfiniBand NIC per GPU (50 GB/s); PCIe 5 x16 to the host (64 GB/s), 2 TiB of "
            "host memory", 64e9, 2 << 40),
    Machine("pcie-ethernet", 4, 32e9, 3.125e9, 100e12,
            "4 GPUs on PCIe 5 x16 (32 GB/s) without NVLink, nodes on 25 Gb/s Ethernet; the "
            "same PCIe link to the host, 512 GiB of host memory", 32e9, 512 << 30),
    Machine("cpu-gloo", 1, 2e9, 1e9, 20e9,
            "CPU ranks of a gloo job: loopback TCP inside a host, 10 Gb/s Ethernet between "
            "hosts; FLOP rate of a few cores; a device's memory is host memory (an "
            "offload is a copy, 5 GB/s), 16 GiB a host", 5e9, 16 << 30),
)}
DEFAULT_MACHINE = "dgx-a100"


def machine(name: str) -> Machine:
    """The machine ``name`` of :data:`MACHINES`; TopologyError lists the known ones.

    >>> machine("dgx-h100").inter_bandwidth
    50000000000.0
    """
    try:
        return MACHINES[name]
    except (KeyError, TypeError):
        raise TopologyError(f"unknown machine {name!r}; choose one of "
                            f"{', '.join(sorted(MACHINES))}") from None


@dataclass(frozen=True)
class Topology:
    """Devices grouped into nodes (``groups``: the device indices of each node), with the
    per-device bandwidth of each link level (bytes/s) and a device's FLOP rate; and the
    memory tiers a memory limit can force (:func:`~tensorql.optimizer.cost.tier_bytes`): a
    device's link to its host (``host_bandwidth``), a node's host memory for evicted chunks
    (``host_memory``) and its DuckDB spill tier's rate (``spill_bandwidth``).

    >>> Topology.flat(4).groups
    ((0, 1, 2, 3),)
    >>> Topology.from_groups([[0, 2], [1, 3]], intra_bandwidth=10e9).level(0, 2)
    'intra'
    """

    groups: tuple[tuple[int, ...], ...]
    intra_bandwidth: float = MACHINES[DEFAULT_MACHINE].intra_bandwidth
    inter_bandwidth: float = MACHINES[DEFAULT_MACHINE].inter_bandwidth
    device_flops: float = MACHINES[DEFAULT_MACHINE].device_flops
    machine: str = DEFAULT_MACHINE
    host_bandwidth: float = MACHINES[DEFAULT_MACHINE].host_bandwidth
    host_memory: int = MACHINES[DEFAULT_MACHINE].host_memory
    spill_bandwidth: float = MACHINES[DEFAULT_MACHINE].spill_bandwidth

    def __post_init__(self) -> None:
        groups = tuple(tuple(int(d) for d in g) for g in self.groups)
        object.__setattr__(self, "groups", groups)
        seen = sorted(d for g in groups for d in g)
        if not groups or any(not g for g in groups) or seen != list(range(len(seen))):
            raise TopologyError(f"topology groups {groups} must hold devices 0..N-1 once each, "
                                "in non-empty nodes")
        for name in ("intra_bandwidth", "inter_bandwidth", "device_flops", "host_bandwidth",
                     "host_memory", "spill_bandwidth"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise TopologyError(f"topology {name}={value!r} must be a positive number")

    # -- constructors -------------------------------------------------------------------
    @classmethod
    def flat(cls, n: int, machine: str = DEFAULT_MACHINE) -> Topology:
        """One node of ``n`` devices: every pair of devices alike (the planner's default)."""
        return cls.nodes(1, n, machine)

    @classmethod
    def nodes(cls, nodes: int, per_node: int, machine: str = DEFAULT_MACHINE, *,
              intra_bandwidth: float | None = None, inter_bandwidth: float | None = None,
              device_flops: float | None = None) -> Topology:
        """``nodes`` nodes of ``per_node`` consecutive devices each, with ``machine``'s
        figures (:data:`MACHINES`) unless given."""
        if nodes < 1 or per_node < 1:
            raise TopologyError(f"a topology needs at least one node of one device, got "
                                f"{nodes} x {per_node}")
        groups = tuple(tuple(range(k * per_node, (k + 1) * per_node)) for k in range(nodes))
        return cls.from_groups(groups, machine, intra_bandwidth=intra_bandwidth,
                               inter_bandwidth=inter_bandwidth, device_flops=device_flops)

    @classmethod
    def from_groups(cls, groups: Sequence[Sequence[int]], machine: str = DEFAULT_MACHINE, *,
                    intra_bandwidth: float | None = None, inter_bandwidth: float | None = None,
                    device_flops: float | None = None) -> Topology:
        """Nodes given as lists of device indices (every device once)."""
        m = globals()["machine"](machine)
        return cls(tuple(tuple(g) for g in groups),
                   m.intra_bandwidth if intra_bandwidth is None else intra_bandwidth,
                   m.inter_bandwidth if inter_bandwidth is None else inter_bandwidth,
                   m.device_flops if device_flops is None else device_flops, m.name,
                   host_bandwidth=m.host_bandwidth, host_memory=m.host_memory,
                   spill_bandwidth=m.spill_bandwidth)

    @classmethod
    def from_hosts(cls, hosts: Sequence[str], local_devices: int = 1,
                   machine: str = DEFAULT_MACHINE) -> Topology:
        """The topology of a job whose rank ``r`` runs on host ``hosts[r]`` with
        ``local_devices`` consecutive devices (rank r: devices r*local ... r*local+local-1):
        the ranks of one host form one node.

        >>> Topology.from_hosts(["a", "a", "b", "b"], 1).groups
        ((0, 1), (2, 3))
        """
        nodes: dict[str, list[int]] = {}
        for rank, host in enumerate(hosts):
            nodes.setdefault(host, []).extend(
                range(rank * local_devices, (rank + 1) * local_devices))
        return cls.from_groups(list(nodes.values()), machine)

    @classmethod
    def parse(cls, value: Any, devices: int | None = None) -> Topology:
        """A topology from what a user gave: a Topology, None (flat), a machine name (nodes
        of its size), or ``"NODESxPER[:machine]"``; TopologyError unless it has ``devices``
        devices (when given; a machine name alone is then one node).

        >>> Topology.parse("dgx-h100", 16).groups[1][:2], Topology.parse(None, 3).groups
        ((8, 9), ((0, 1, 2),))
        >>> Topology.parse("4x8:dgx-h100").devices
        32
        """
        if value is None and devices is None:
            raise TopologyError("a flat topology needs a device count")
        if value is None:
            topo = cls.flat(devices)
        elif isinstance(value, Topology):
            topo = value
        elif isinstance(value, str):
            m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*(?::\s*([\w.-]+))?\s*", value)
            if m:
                topo = cls.nodes(int(m.group(1)), int(m.group(2)),
                                 m.group(3) or DEFAULT_MACHINE)
            else:
                per = machine(value.strip()).devices_per_node
                devices = per if devices is None else devices
                if devices % per:
                    raise TopologyError(f"topology {value!r}: {devices} devices are not whole "
                                        f"nodes of {per}")
                topo = cls.nodes(devices // per, per, value.strip())
        else:
            raise TopologyError(f"topology must be a Topology, a machine name or 'NODESxPER', "
                                f"got {value!r}")
        if devices is not None and topo.devices != devices:
            raise TopologyError(f"topology {topo.describe()} has {topo.devices} devices, the "
                                f"plan {devices}")
        return topo

    # -- structure ----------------------------------------------------------------------
    @property
    def devices(self) -> int:
        return sum(len(g) for g in self.groups)

    @property
    def is_flat(self) -> bool:
        """One node: every device pair alike."""
        return len(self.groups) == 1

    @functools.cached_property
    def node_array(self) -> np.ndarray:
        """The node of every device, an (N,) array."""
        out = np.zeros(self.devices, dtype=np.int64)
        for k, g in enumerate(self.groups):
            out[list(g)] = k
        return out

    @functools.cached_property
    def node_sizes(self) -> np.ndarray:
        return np.array([len(g) for g in self.groups], dtype=np.int64)

    def node_of(self, device: int) -> int:
        return int(self.node_array[device])

    def level(self, src: int, dst: int) -> str:
        """The slowest link a transfer from ``src`` to ``dst`` crosses: ``device`` (none),
        ``intra`` or ``inter``."""
        if src == dst:
            return "device"
        return "intra" if self.node_of(src) == self.node_of(dst) else "inter"

    def describe(self) -> str:
        """One line: nodes, devices and the levels' bandwidths.

        >>> Topology.nodes(2, 8).describe()
        '2 nodes x 8 devices (dgx-a100): intra 300.0 GB/s, inter 25.0 GB/s a device'
        """
        sizes = {len(g) for g in self.groups}
        shape = (f"{len(self.groups)} node{'s' if len(self.groups) > 1 else ''} x "
                 f"{sizes.pop()} devices" if len(sizes) == 1 else
                 f"{len(self.groups)} nodes of {'/'.join(str(len(g)) for g in self.groups)} "
                 "devices")
        return (f"{shape} ({self.machine}): intra {self.intra_bandwidth / 1e9:.1f} GB/s, "
                f"inter {self.inter_bandwidth / 1e9:.1f} GB/s a device")

    # -- prices -------------------------------------------------------------------------
    def level_bytes(self, pair: np.ndarray) -> dict[str, int]:
        """Bytes of an (N, N) ``pair[src, dst]`` matrix on each link level."""
        same = self.node_array[:, None] == self.node_array[None, :]
        off = ~np.eye(self.devices, dtype=bool)
        return {"intra": int(pair[same & off].sum()), "inter": int(pair[~same].sum())}

    def node_seconds(self, intra_in: np.ndarray, inter_in: np.ndarray) -> np.ndarray:
        """Seconds of an exchange from the bytes each node receives on each level (last
        axis: the nodes): the busiest node's ``(intra / intra_bw + inter / inter_bw) / k``."""
        per = (intra_in / self.intra_bandwidth + inter_in / self.inter_bandwidth) \
            / self.node_sizes
        return per.max(axis=-1)

    def inbound(self, pair: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Bytes each node receives from its own devices and from other nodes: (G,), (G,)."""
        nodes = self.node_array
        same = nodes[:, None] == nodes[None, :]
        off = ~np.eye(self.devices, dtype=bool)
        received_intra = (pair * (same & off)).sum(axis=0)
        received_inter = (pair * ~same).sum(axis=0)
        g = len(self.groups)
        return (np.bincount(nodes, received_intra, minlength=g),
                np.bincount(nodes, received_inter, minlength=g))

    def transfer_seconds(self, pair: np.ndarray) -> float:
        """Seconds of one exchange moving ``pair[src, dst]`` bytes (see the module's text).

        >>> t = Topology.nodes(2, 2, intra_bandwidth=100.0, inter_bandwidth=10.0)
        >>> pair = np.zeros((4, 4)); pair[0, 1] = 200; pair[0, 2] = 20
        >>> t.transfer_seconds(pair)  # node 0: 200 B / 100 B/s / 2; node 1: 20 / 10 / 2
        1.0
        """
        if not np.any(pair):
            return 0.0
        intra, inter = self.inbound(pair)
        return float(self.node_seconds(intra, inter))

    @property
    def unit_rate(self) -> float:
        """Bytes a second that one cost unit of the search stands for: the whole job's
        fastest links, ``N x intra_bandwidth`` (on a flat topology a cost unit is a byte)."""
        return self.devices * self.intra_bandwidth
