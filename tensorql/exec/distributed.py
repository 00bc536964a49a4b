"""Ranks of a ``torch.distributed`` job as devices of one runtime.

Every rank compiles the same query into the same plan for all ``N = world x local`` devices of
the job and lowers it to the same memory plan. A rank runs only the ops placed on its own
devices. The cross-rank transfers of one step travel together, one ``all_to_all_single`` of the job
per round (an exchange, :mod:`tensorql.exec.exchanges`), issued by every rank in one order;
any other chunk sent from a device of one rank to a device of another becomes a
``torch.distributed`` send on the holder's rank and a receive on the reader's (gloo for host
tensors, NCCL for GPU ones). NCCL ignores tags and pairs point-to-point calls by the order
they are issued in, so every rank issues its sends and receives in one order the whole job
agrees on (:func:`p2p_order`, from the plan every rank builds alike), each when it is ready and
all before it are issued; the calls are asynchronous, and each is awaited on a parked thread
(:mod:`tensorql.exec.threads`), like any other op with dependencies: what waits for a chunk
becomes ready when it has arrived -- on a GPU, once the stream that received it has finished,
so that it is safe on whichever stream reads it. Every buffer handed to torch.distributed is
on the rank's communication device (:func:`communication_device`): a GPU's chunks where it
has one, host copies moved there first. The result chunks are
then all-gathered (each rank sends those it computed to every other, see
:func:`share_results`), so a script runs unchanged on all.

A rank that stops answering makes a transfer wait until the process group's timeout; the
error names the peer rank.

>>> RankLayout(rank=1, world=2, local=2).devices_of(1)
[2, 3]
"""

from __future__ import annotations

import atexit
import math
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import tensorql.cuda_api as cuda_api
from tensorql.devices import DeviceSet
from tensorql.errors import DistributedError, ExecutionError
from tensorql.exec.devices import Completion, CPUDevice, Device, resolve_devices
from tensorql.exec.devices.base import Post
from tensorql.exec.exchanges import Exchange, plan_exchanges
from tensorql.exec.memplan import Op
from tensorql.exec.run_types import ChunkSink, ProgressCallback, RunResult
from tensorql.exec.runtime import OpKind, Runtime, StreamRun, op_kinds
from tensorql.exec.taskgraph import ChunkRef, TaskGraph
from tensorql.exec.threads import PARKED
from tensorql.optimizer.topology import Topology
from tensorql.units import format_bytes


@dataclass(frozen=True)
class RankLayout:
    """Which devices of the job belong to which rank: ``local`` consecutive devices each."""

    rank: int
    world: int
    local: int = 1

    @property
    def devices(self) -> int:
        return self.world * self.local

    def rank_of(self, device: int) -> int:
        return device // self.local

    def devices_of(self, rank: int) -> list[int]:
        return list(range(rank * self.local, (rank + 1) * self.local))

    def is_local(self, device: int) -> bool:
        return self.rank_of(device) == self.rank


@dataclass(frozen=True)
class CallBytes:
    """Bytes one rank passed to one kind of torch.distributed call in a run."""

    call: str
    sent: int
    received: int


@dataclass(frozen=True)
class RankStats:
    """What one rank measured in a distributed run, for EXPLAIN ANALYZE on rank 0.

    Bytes are those of the tensors the rank passed to torch.distributed: ``sent_bytes`` /
    ``received_bytes`` for the plan's transfers (by call in ``calls``: ``all_to_all_single``
    for exchanges, ``send`` for point-to-point transfers), ``broadcast_bytes`` for the result
    chunks it computed, sent to every other rank (their bytes times world - 1).

    >>> RankStats(1, 0.5, 0.25, 0.2, 2048, 1024, 4096, 8192).describe().split(", ")[:4]
    ['rank 1: wall 500.0 ms', 'busy 250.0 ms', 'copies 200.0 ms', 'sent 2.0 KiB (transfers)']
    >>> calls = (CallBytes("all_to_all_single", 2048, 1024),)
    >>> RankStats(1, 0.5, 0.25, 0.2, 2048, 1024, 4096, 8192, calls).describe().split(", ")[3]
    'sent 2.0 KiB (transfers: all_to_all_single 2.0 KiB sent / 1.0 KiB received)'
    """

    rank: int
    wall_s: float
    busy_s: float
    copy_s: float
    sent_bytes: int
    received_bytes: int
    broadcast_bytes: int
    peak_bytes: int
    calls: tuple[CallBytes, ...] = ()

    def describe(self) -> str:
        by_call = "; ".join(f"{c.call} {format_bytes(c.sent)} sent / "
                            f"{format_bytes(c.received)} received" for c in self.calls)
        return (f"rank {self.rank}: wall {self.wall_s * 1e3:.1f} ms, busy "
                f"{self.busy_s * 1e3:.1f} ms, copies {self.copy_s * 1e3:.1f} ms, sent "
                f"{format_bytes(self.sent_bytes)} "
                f"(transfers{': ' + by_call if by_call else ''}), received "
                f"{format_bytes(self.received_bytes)}, {format_bytes(self.broadcast_bytes)} "
                f"(result chunks shared), peak "
                f"{format_bytes(self.peak_bytes)}")


def gather_rank_stats(stats: Any, layout: RankLayout, sent: int, received: int,
                      broadcast_bytes: int, group: Any = None,
                      calls: tuple[CallBytes, ...] = ()) -> list[RankStats]:
    """Every rank's :class:`RankStats` of this run, on every rank (an all-gather)."""
    local = [d for d, kind in zip(stats.devices, stats.device_kinds) if kind != "remote"]
    mine = RankStats(layout.rank, stats.wall_s, sum(d.busy_s for d in local),
                     sum(d.copy_s for d in local), sent, received, broadcast_bytes,
                     max((d.peak_bytes for d in local), default=0), tuple(calls))
    out: list[Any] = [None] * layout.world
    torch.distributed.all_gather_object(out, mine, group=group)
    return out


class RemoteDevice(Device):
    """A device of another rank: this rank never runs work on it."""

    kind = "remote"
    remote = True

    def __init__(self, name: str) -> None:
        super().__init__(name, {"compute": 1, "h2d": 1, "d2h": 1, "d2d": 1})

    def open(self, post: Post) -> None:
        pass

    def close(self) -> None:
        pass

    def submit(self, lane: str, op_id: int, fn: Callable[[], Any], cost: float = 0.0) -> None:
        raise ExecutionError(f"{self.name} belongs to another rank")  # pragma: no cover


class DistributedRuntime:
    """The engine's rank strategy for one rank: the streams strategy's runtime on every
    device of the job (this rank's, and a :class:`RemoteDevice` for each other rank's), the
    job's memory plan, this rank's ops, transfers between ranks through ``torch.distributed``
    (``group`` or the default process group)."""

    def __init__(self, layout: RankLayout, local_devices: Any = "cpu",
                 memory_limit: int | None = None, *, workers: int = 1,
                 intra_op_threads: int = 1, group: Any = None,
                 exchange: str = "collective", exchange_group: Any = None,
                 **kw: Any) -> None:
        if exchange not in EXCHANGE_MODES:
            raise ExecutionError(f"exchange={exchange!r}: expected one of "
                                 f"{', '.join(EXCHANGE_MODES)}")
        local = resolve_devices(local_devices, workers)
        if len(local) != layout.local:
            raise ExecutionError(f"{len(local)} local devices but the layout says "
                                 f"{layout.local} per rank")
        if len(local) == 1 and isinstance(local[0], CPUDevice) and local[0].lanes["compute"] == 1:
            # the rank's only worker: its ops run on this coordinating thread
            local[0].inline = True
        devices: list[Device] = []
        for g in range(layout.devices):
            if layout.is_local(g):
                dev = local[g - layout.rank * layout.local]
                dev.name = f"rank{layout.rank}:{dev.name}"
                devices.append(dev)
            else:
                devices.append(RemoteDevice(f"rank{layout.rank_of(g)}:dev{g}"))
        # each device's host memory is its rank's
        self.runtime = Runtime(devices, memory_limit, workers=workers,
                               intra_op_threads=intra_op_threads,
                               host_domains=[layout.rank_of(d) for d in range(layout.devices)],
                               **kw)
        self.layout = layout
        self.group = group
        self.exchange = exchange
        self.exchange_group = exchange_group if exchange_group is not None else group
        # every buffer handed to torch.distributed: on the rank's GPU for NCCL, else host
        self.collective_device = communication_device(
            [(d.kind, d.torch_device) for d in local])

    def exchanges(self, graph: TaskGraph, program: Any) -> tuple[Exchange, ...]:
        """The collectives the cross-rank transfers of ``program`` are grouped into (none
        with ``exchange="p2p"``), found once per plan."""
        if self.exchange != "collective" or self.layout.world < 2:
            return ()
        local = [d for d in self.runtime.devices if not d.remote]
        if len({d.torch_device for d in local}) > 1 and \
                any(d.torch_device.type != "cpu" for d in local):
            return ()  # one collective buffer per rank: GPUs of one rank send on their own
        key = ("exchanges", self.layout, id(program))
        if key not in graph.programs:
            # under a memory limit an exchange moves one chunk a rank each way: no buffer
            # beyond the plan's receives
            budgeted = any(b is not None for b in self.runtime.budgets())
            graph.programs[key] = plan_exchanges(
                program.ops, self.layout.rank_of, one_chunk_each=budgeted,
                dtype_of=lambda op: graph.chunk_meta[op.ref][1])
        return graph.programs[key]

    def run(self, graph: TaskGraph, progress: ProgressCallback | None = None,
            sink: ChunkSink | None = None, destination: Any = None) -> RunResult:
        """The engine's rank strategy: the streams strategy over the job's memory plan, with
        this rank's part (:class:`RankPart`) as a component of its run state; what the rank
        handed to torch.distributed is in the result's stats. ``destination``: as the streams
        strategy's -- the tiles of the dense results its own result chunks are computed into
        (then shared from there, :func:`share_results`, with no copy into place)."""
        part = RankPart(self)
        result = self.runtime.run_streams(graph, progress, sink, destination, rank=part)
        self.sent_bytes, self.received_bytes = part.sent_bytes, part.received_bytes
        self.bytes_by_call = dict(part.bytes_by_call)
        stats: Any = result.stats
        stats.sent_bytes, stats.received_bytes = part.sent_bytes, part.received_bytes
        stats.calls = tuple(part.bytes_by_call.values())
        return result


def communication_device(devices: Any) -> torch.device:
    """Where a rank's buffers for torch.distributed are: its first GPU when it has one (NCCL
    carries them), else the host (gloo). ``devices``: the rank's devices, a
    :class:`~tensorql.devices.DeviceSet` or ``(kind, torch device)`` pairs. Every rank of a
    job must find the same kind of device (the plans they compare include it).

    >>> communication_device(DeviceSet.parse(2))
    device(type='cpu')
    >>> communication_device([("cpu", torch.device("cpu")), ("cuda", torch.device("cuda", 1))])
    device(type='cuda', index=1)
    """
    if isinstance(devices, DeviceSet):
        api = cuda_api.current()
        devices = [(s.kind, api.torch_device(s.index) if s.kind == "cuda" else None)
                   for s in devices.specs]
    return next((where for kind, where in devices if kind == "cuda"), torch.device("cpu"))


def arrived(chunk: torch.Tensor) -> torch.Tensor:
    """``chunk`` once the work that wrote it on this thread's stream is done: after an NCCL
    call's ``wait()``, which only makes the calling thread's current stream wait for NCCL's,
    the host waits for that stream (an event recorded on it), so the chunk is safe on any
    stream that reads it next. A host tensor is returned as it is.

    >>> arrived(torch.ones(2))
    tensor([1., 1.])
    """
    if chunk.device.type != "cpu":
        api = cuda_api.current()
        done = api.event()
        done.record(api.current_stream(chunk.device))
        done.synchronize()
    return chunk


def p2p_order(ops: Any, exchanges: tuple[Exchange, ...],
              rank_of: Callable[[int], int]) -> tuple[int, ...]:
    """The job's point-to-point transfers (sends between ranks outside every exchange), by
    op id, in the order every rank issues its own: NCCL ignores tags and pairs a rank's
    sends and receives with its peer's by issue order, so both sides of each transfer must
    issue them alike. It is a topological order of the plan with each exchange taken as one
    node (an exchange's transfers complete together) and the exchanges in their issue order,
    ties broken by op id: a rank waiting, in this order, for a transfer to become ready never
    waits for one it has held back, nor for an exchange that waits on one.

    Op 3 waits (through ops 1 and 2) for the exchange of ops 0 and 6, and op 6 for op 5: op 3
    is issued after op 5, though its id is smaller (by id, a rank would hold op 5 back behind
    op 3, which waits for it):

    >>> from tensorql.exec.memplan import Op
    >>> from tensorql.exec.taskgraph import ChunkRef
    >>> def op(i, kind, src, dst, deps=()):
    ...     return Op(i, kind, dst, ChunkRef(i, ()), deps, 8, "d2d", src_device=src)
    >>> ops = [op(0, "send", 0, 1), op(1, "compute", 1, 1, (0,)), op(2, "compute", 1, 1, (1,)),
    ...        op(3, "send", 1, 0, (2,)), op(4, "send", 0, 1), op(5, "send", 1, 0, (4,)),
    ...        op(6, "send", 1, 0, (5,))]
    >>> p2p_order(ops, (Exchange(0, 0, (0, 6)),), rank_of=lambda d: d)
    (4, 5, 3)
    """
    import heapq

    n = len(ops)
    node_of = list(range(n))
    for ex in exchanges:
        for i in ex.ops:
            node_of[i] = n + ex.index
    first = list(range(n)) + [min(ex.ops) for ex in exchanges]
    successors: list[set[int]] = [set() for _ in range(n + len(exchanges))]
    for op in ops:
        for dep in op.deps:
            if node_of[dep] != node_of[op.id]:
                successors[node_of[dep]].add(node_of[op.id])
    for a, b in zip(exchanges, exchanges[1:]):  # exchanges are issued in their order
        successors[n + a.index].add(n + b.index)
    waiting = [0] * len(successors)
    for succ in successors:
        for t in succ:
            waiting[t] += 1
    ready = [(first[v], v) for v in range(len(successors)) if waiting[v] == 0 and
             (v >= n or node_of[v] == v)]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, v = heapq.heappop(ready)
        if v < n and ops[v].kind == "send" and ops[v].src_device is not None and \
                rank_of(ops[v].src_device) != rank_of(ops[v].device):
            order.append(v)
        for t in successors[v]:
            waiting[t] -= 1
            if waiting[t] == 0:
                heapq.heappush(ready, (first[t], t))
    return tuple(order)


EXCHANGE_MODES = ("collective", "p2p")
EXCHANGE_LANE = (-1, "exchange")  # in-flight key of the exchanges a rank has issued


@dataclass
class _ExchangeSides:
    """This rank's side of one exchange: what it sends to and receives from each rank."""

    sends: list[list[Op]]
    receives: list[list[Op]]

    @property
    def mine(self) -> list[Op]:
        return [op for ops in self.sends + self.receives for op in ops]


@dataclass(frozen=True)
class _RankView:
    """One rank's share of a job's memory plan: which ops are its own, whom each of them
    releases on this rank, how many of its own ops each waits for (-1: another rank's op),
    and its sides of the exchanges."""

    successors: tuple[tuple[int, ...], ...]
    ndeps: tuple[int, ...]
    others: int
    exchanges: tuple[Exchange, ...]
    sides: tuple[_ExchangeSides, ...]
    exchange_of: dict[int, int]
    kinds: tuple[OpKind, ...]  # by op: a transfer between ranks is a kind of its own
    p2p: tuple[int, ...] = ()  # its point-to-point transfers, in the job's issue order


class RankPart:
    """One rank's part of a run, a component of the streams strategy's run state: the ops on
    its devices and its side of every transfer -- grouped into exchanges (one
    ``all_to_all_single`` each, issued in the plan's exchange order) where
    :func:`~tensorql.exec.exchanges.plan_exchanges` found them, else a send or a receive of
    its own. Its transfers are kinds of op of their own (:data:`CROSS_RANK_SEND`,
    :data:`EXCHANGED_SEND`) in the rank's view of the plan."""

    def __init__(self, rt: DistributedRuntime) -> None:
        self.rt = rt
        self.layout = rt.layout
        self.sent_bytes = 0
        self.received_bytes = 0
        self.bytes_by_call: dict[str, CallBytes] = {}
        self.transfers_ready: set[int] = set()  # ready point-to-point transfers, not issued
        self.next_exchange = 0
        self.next_p2p = 0

    def attach(self, run: StreamRun) -> None:
        """Make ``run`` this rank's: its successors, readiness counts and op kinds from the
        rank's view; every rank issues every exchange, even one it has no part in, so the
        run is done once its ops AND its exchanges are."""
        view = self._view(run)
        run.succ = view.successors
        run.ndeps = list(view.ndeps)
        run.kinds = view.kinds
        run.done_ops += view.others - len(view.exchanges)
        self.exchanges, self.sides, self.exchange_of = view.exchanges, view.sides, \
            view.exchange_of
        self.p2p = view.p2p
        self.unready = [len(side.mine) for side in self.sides]  # own transfers not ready

    def _view(self, run: StreamRun) -> _RankView:
        """This rank's share of the program, worked out once per plan and layout: a query
        run again finds it in the graph's cache (it walks every op of the job)."""
        key = ("rank view", self.layout, id(run.program))
        view = run.graph.programs.get(key)
        if view is None:
            ops = run.ops
            mine = tuple(self._is_mine(op) for op in ops)
            # what other ranks do is not waited for here: data arrival is
            successors = tuple(tuple(s for s in succ if mine[s])
                               for succ in run.program.successors)
            ndeps = tuple(sum(1 for d in op.deps if mine[d]) if mine[op.id] else -1
                          for op in ops)
            exchanges = self.rt.exchanges(run.graph, run.program)
            sides = tuple(self._sides(ex, ops) for ex in exchanges)
            exchange_of = {op.id: ex.index for ex, side in zip(exchanges, sides)
                           for op in side.mine}
            kinds = tuple(
                (EXCHANGED_SEND if op.id in exchange_of else CROSS_RANK_SEND)
                if self._cross_rank(op) else kind
                for op, kind in zip(ops, op_kinds(run.graph, run.program)))
            p2p = tuple(i for i in p2p_order(ops, exchanges, self.layout.rank_of)
                        if mine[i])
            view = _RankView(successors, ndeps, mine.count(False), exchanges, sides,
                             exchange_of, kinds, p2p)
            run.graph.programs[key] = view
        return view

    def _is_mine(self, op: Op) -> bool:
        if self.layout.is_local(op.device):
            return True
        return op.kind == "send" and self.layout.is_local(op.src_device)

    def _cross_rank(self, op: Op) -> bool:
        return op.kind == "send" and self.layout.rank_of(op.src_device) != \
            self.layout.rank_of(op.device)

    def _sides(self, ex: Exchange, ops: tuple[Op, ...]) -> _ExchangeSides:
        world, rank_of, me = self.layout.world, self.layout.rank_of, self.layout.rank
        side = _ExchangeSides([[] for _ in range(world)], [[] for _ in range(world)])
        for i in ex.ops:  # by op id: the order both sides concatenate and split in
            op = ops[i]
            if rank_of(op.src_device) == me:
                side.sends[rank_of(op.device)].append(op)
            elif rank_of(op.device) == me:
                side.receives[rank_of(op.src_device)].append(op)
        return side

    def _count(self, call: str, sent: int = 0, received: int = 0) -> None:
        old = self.bytes_by_call.get(call, CallBytes(call, 0, 0))
        self.bytes_by_call[call] = CallBytes(call, old.sent + sent, old.received + received)
        self.sent_bytes += sent
        self.received_bytes += received

    def dispatch(self, run: StreamRun) -> None:
        """Transfers between ranks start outside the lanes' slots (a receive waits on a
        peer, and queueing transfers behind the lanes' work could make two ranks wait on each
        other), in the job's order: a point-to-point transfer is issued once it is ready and
        every one before it in :func:`p2p_order` is issued (NCCL pairs sends and receives by
        issue order); a transfer of an exchange waits for the rest of this rank's side of it,
        and exchanges are issued in their order once their side is ready."""
        while self.next_p2p < len(self.p2p) and run.error is None and \
                self.p2p[self.next_p2p] in self.transfers_ready:
            self.transfers_ready.discard(self.p2p[self.next_p2p])
            run.submit(run.ops[self.p2p[self.next_p2p]])
            self.next_p2p += 1
        while self.next_exchange < len(self.exchanges) and run.error is None \
                and self.unready[self.next_exchange] == 0:
            self._issue(run, self.exchanges[self.next_exchange])
            self.next_exchange += 1

    def _issue(self, run: StreamRun, ex: Exchange) -> None:
        """Start this rank's side of ``ex``: one ``all_to_all_single`` whose split for each
        rank is what this rank sends it (its own split is empty), awaited on a transfer
        thread. The chunks received land in one buffer, each a view of it; a rank sending
        one chunk passes it as it is (under a memory limit every exchange sends and receives
        at most one chunk a rank, so nothing is allocated beyond the plan's receives)."""
        from tensorql.dtypes import torch_dtype

        side = self.sides[ex.index]
        dtype = torch_dtype(run.graph.chunk_meta[run.ops[ex.ops[0]].ref][1])
        where = self.rt.collective_device
        parts = [self._outgoing(run, op, where) for ops in side.sends for op in ops]
        if len(parts) == 1 and parts[0].is_contiguous():
            send = parts[0].view(-1)
        elif parts:
            send = torch.cat([p.reshape(-1) for p in parts])
        else:
            send = torch.empty(0, dtype=dtype, device=where)
        in_splits = [sum(self._numel(run, op) for op in ops) for ops in side.sends]
        out_splits = [sum(self._numel(run, op) for op in ops) for ops in side.receives]
        received = torch.empty(sum(out_splits), dtype=dtype, device=where)
        for ops in side.receives:
            for op in ops:
                run.allocate(op)
        run.inflight[EXCHANGE_LANE] = run.inflight.get(EXCHANGE_LANE, 0) + 1
        started = time.perf_counter()
        try:
            work = torch.distributed.all_to_all_single(
                received, send, out_splits, in_splits, group=self.rt.exchange_group,
                async_op=True)
        except BaseException as err:  # noqa: BLE001 - reported to the coordinator
            self._exchange_done(run, ex, None, received, started, err)
            return
        # ``send`` is kept alive until the collective is done
        PARKED.start("tensorql-transfer", self._exchange_done, run, ex, work, received,
                     started, None, send)

    @staticmethod
    def _outgoing(run: StreamRun, op: Op, where: torch.device) -> torch.Tensor:
        """The chunk a send of this rank passes, on ``where`` (the rank's communication
        device): a chunk written back to the host under a memory limit is moved there
        first, as NCCL takes GPU tensors only and ``torch.cat`` one device."""
        chunk = run.host.get(op.ref) if op.from_host else run.values[op.src_device][op.ref]
        return chunk if chunk.device == where else chunk.to(where)

    def _wire_device(self, run: StreamRun, device: int) -> torch.device:
        """Where a point-to-point transfer's buffer is on this rank's ``device``: on the
        device itself if it is a GPU, else on the rank's communication device -- so a
        transfer's two sides use one backend (gloo for host tensors, NCCL for GPU ones)."""
        dev = run.devices[device]
        return dev.torch_device if dev.kind == "cuda" else self.rt.collective_device

    @staticmethod
    def _numel(run: StreamRun, op: Op) -> int:
        return math.prod(run.graph.chunk_meta[op.ref][0])

    def _exchange_done(self, run: StreamRun, ex: Exchange, work: Any, received: torch.Tensor,
                       started: float, error: BaseException | None = None,
                       sent: torch.Tensor | None = None) -> None:
        if error is None:
            try:
                work.wait()
                arrived(received)  # NCCL: wait() orders this thread's stream only
            except BaseException as err:  # noqa: BLE001 - reported to the coordinator
                error = err
        if error is not None:
            error = collective_failed(
                self.layout, "the exchange of " + ", ".join(
                    run.graph.step_name(s) for s in ex.steps) + " (all_to_all_single)", error)
        run.events.put(Completion(-1 - ex.index, started, time.perf_counter(), received,
                                  error))

    def collective_done(self, run: StreamRun, c: Completion) -> None:
        """An exchange finished (its completion's id is ``-1 - index``): its chunks land,
        and its ops and the exchange itself are done."""
        ex = self.exchanges[-1 - c.op_id]
        run.inflight[EXCHANGE_LANE] -= 1
        if c.error is not None:
            run.fail(c.error, None)
            return
        if run.error is not None:
            return
        side = self.sides[ex.index]
        offset = 0
        for ops in side.receives:
            for op in ops:
                n = self._numel(run, op)
                shape = run.graph.chunk_meta[op.ref][0]
                run.values[op.device][op.ref] = c.value[offset:offset + n].view(shape)
                offset += n
                run.stats.devices[op.device].bytes_d2d += op.nbytes
                run.stats.devices[op.device].ops += 1
                self._count("all_to_all_single", received=op.nbytes)
        for ops in side.sends:
            for op in ops:
                run.stats.moved[op.src_device][op.device] += op.nbytes
                self._count("all_to_all_single", sent=op.nbytes)
                if op.from_host:
                    run.host_load_done(op)
        run.done_ops += 1  # the exchange itself
        for op in side.mine:
            run.done_ops += 1
            for nxt in run.release(op):
                run.make_ready(nxt)

    def start_transfer(self, run: StreamRun, op: Op) -> None:
        """Issue a send of its own between this rank and another (asynchronous, on this
        thread, in the job's order: see :meth:`dispatch`), awaited on a parked thread."""
        key = (op.device, op.lane)  # counted in flight (the coordinator waits for it)
        run.inflight[key] = run.inflight.get(key, 0) + 1
        receiving = self.layout.is_local(op.device)
        peer = self.layout.rank_of(op.src_device if receiving else op.device)
        started = time.perf_counter()
        work, buffer = None, None
        if receiving:
            run.allocate(op)
        try:
            if receiving:
                from tensorql.dtypes import torch_dtype

                shape, dtype = run.graph.chunk_meta[op.ref]
                buffer = torch.empty(shape, dtype=torch_dtype(dtype),
                                     device=self._wire_device(run, op.device))
                work = torch.distributed.irecv(buffer, src=peer, tag=op.id,
                                               group=self.rt.group)
            else:
                buffer = self._outgoing(run, op, self._wire_device(run, op.src_device))
                buffer = buffer.contiguous()
                work = torch.distributed.isend(buffer, dst=peer, tag=op.id, group=self.rt.group)
        except BaseException as err:  # noqa: BLE001 - reported to the coordinator
            run.events.put(Completion(op.id, started, time.perf_counter(), None,
                                      self._transfer_failed(receiving, peer, err)))
            return
        PARKED.start("tensorql-transfer", self._transfer, run, op, receiving, peer, work,
                     buffer, started)

    def _transfer(self, run: StreamRun, op: Op, receiving: bool, peer: int, work: Any,
                  buffer: torch.Tensor, started: float) -> None:
        """Await one transfer; a received chunk is handed over once it has arrived (on its
        device, where the stream that received it has finished)."""
        value: Any = None
        error = None
        try:
            work.wait()
            if receiving:
                arrived(buffer)
                target = run.devices[op.device].torch_device
                value = buffer if buffer.device == target else arrived(buffer.to(target))
            else:
                value = buffer.nbytes
        except BaseException as err:  # noqa: BLE001 - reported to the coordinator
            error = self._transfer_failed(receiving, peer, err)
        run.events.put(Completion(op.id, started, time.perf_counter(), value, error))

    def _transfer_failed(self, receiving: bool, peer: int,
                         err: BaseException) -> DistributedError:
        return DistributedError(
            f"rank {self.layout.rank}: {'receiving from' if receiving else 'sending to'} "
            f"rank {peer} failed ({type(err).__name__}: {err}); rank {peer} died or "
            "stopped answering within the timeout")

    def transfer_done(self, run: StreamRun, op: Op, c: Completion) -> bool:
        if not self.layout.is_local(op.device):  # the sender's side: nothing lands here
            self._count("send/recv", sent=int(c.value))
            run.stats.moved[op.src_device][op.device] += int(c.value)
            if op.from_host:
                run.host_load_done(op)
            return False
        self._count("send/recv", received=op.nbytes)
        run.values[op.device][op.ref] = c.value
        run.stats.devices[op.device].bytes_d2d += op.nbytes
        run.stats.devices[op.device].ops += 1
        return False


def _cross_rank_queue(run: StreamRun, op: Op) -> None:
    run.rank.transfers_ready.add(op.id)  # issued at a dispatch, in the job's order


def _exchanged_queue(run: StreamRun, op: Op) -> None:
    run.rank.unready[run.rank.exchange_of[op.id]] -= 1  # its exchange waits for the rest


#: a send between ranks of its own: torch.distributed send on one side, recv on the other
CROSS_RANK_SEND = OpKind(
    "send between ranks", queue=_cross_rank_queue,
    submit=lambda run, op: run.rank.start_transfer(run, op),
    complete=lambda run, op, c: run.rank.transfer_done(run, op, c))
#: a send between ranks that travels in an exchange: issued and completed with it
EXCHANGED_SEND = OpKind("send in an exchange", queue=_exchanged_queue)


def collective_failed(layout: RankLayout, what: str, err: BaseException) -> DistributedError:
    """The error of a collective that failed, naming the rank(s) at fault where the job's
    store tells (:func:`unanswering_ranks`): a rank whose process is gone died; a rank that
    did not report the failure too stopped answering. Without the store (a job of one host
    whose rank 0 died, or no default group) every other rank is named.

    >>> err = collective_failed(RankLayout(0, 3), "the exchange", RuntimeError("timed out"))
    >>> print(str(err).replace("; ", "\\n"))
    rank 0: the exchange failed (timed out)
    one of ranks 1, 2 died or stopped answering within the timeout
    """
    first = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
    found = unanswering_ranks(layout)
    if not found:
        suspects = [r for r in range(layout.world) if r != layout.rank]
        named = (f"rank {suspects[0]}" if len(suspects) == 1 else
                 f"one of ranks {', '.join(map(str, suspects))}")
        blame = f"{named} died or stopped answering within the timeout"
    else:
        blame = "; ".join(found.describe())
    return DistributedError(f"rank {layout.rank}: {what} failed ({first}); {blame}")


_PROCESS_KEY = "tensorql/process/"  # + rank: "<host> <pid>", set as the rank joins
_FAILED_KEY = "tensorql/failed/"  # + rank: the time.time() a collective of it failed
# [(a weak reference to the default group, rank)] this process announced itself in. Module
# state refers to torch.distributed's groups weakly (see :func:`_held`): a group tensorql kept
# alive outlived destroy_process_group and was torn down with gloo's threads at interpreter
# exit, where a gloo thread that needs the GIL aborts the process (:func:`leave_process_group`)
_ANNOUNCED: list[Any] = []


@dataclass(frozen=True)
class Unanswering:
    """Who a failed collective waited for: ranks whose process is gone (``dead``), ranks
    alive on this host that did not reach the failure too (``stalled``), ranks elsewhere
    that did not (``silent``), and whether the job's store itself was unreachable."""

    dead: tuple[int, ...] = ()
    stalled: tuple[int, ...] = ()
    silent: tuple[int, ...] = ()
    store_lost: bool = False

    def __bool__(self) -> bool:
        return bool(self.dead or self.stalled or self.silent or self.store_lost)

    def describe(self) -> list[str]:
        """One clause per kind of fault.

        >>> Unanswering(dead=(1,), stalled=(2, 3)).describe()
        ['rank 1 died (its process is gone)', 'ranks 2, 3 stopped answering (alive, they \
did not reach this collective within the timeout)']
        """
        def ranks(group: tuple[int, ...]) -> str:
            return (f"rank {group[0]}" if len(group) == 1 else
                    f"ranks {', '.join(map(str, group))}")

        clauses = []
        if self.dead:
            clauses.append(f"{ranks(self.dead)} died (its process is gone)" if len(self.dead) == 1
                           else f"{ranks(self.dead)} died (their processes are gone)")
        if self.stalled:
            they = "it" if len(self.stalled) == 1 else "they"
            clauses.append(f"{ranks(self.stalled)} stopped answering (alive, {they} did not "
                           "reach this collective within the timeout)")
        if self.silent:
            clauses.append(f"{ranks(self.silent)} died or stopped answering (no failure "
                           "reported by it within the timeout)")
        if self.store_lost:
            clauses.append("rank 0 died or stopped answering (the job's store it holds does "
                           "not answer)")
        return clauses


def _job_store() -> Any:
    """The default process group's store (the rendezvous ``TCPStore``), or None."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no group, or a torch without it: nothing to ask
        return None


def announce_process(layout: RankLayout) -> None:
    """Publish this rank's host and process id in the job's store, once per group, so that
    a failed collective on another rank can tell a dead rank from a stalled one."""
    import os
    import socket

    import torch.distributed as dist

    if layout.world < 2 or not dist.is_initialized():
        return
    group = dist.distributed_c10d._get_default_group()
    if _ANNOUNCED and _held(_ANNOUNCED[0][0]) is group and _ANNOUNCED[0][1] == layout.rank:
        return
    store = _job_store()
    if store is None:
        return
    try:
        store.set(f"{_PROCESS_KEY}{layout.rank}", f"{socket.gethostname()} {os.getpid()}")
    except Exception:  # noqa: BLE001 - only the error messages lose their precision
        return
    _ANNOUNCED[:] = [(weakref.ref(group), layout.rank)]


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie, exited but not yet reaped
    by its parent, does not).

    >>> import os
    >>> _process_alive(os.getpid())
    True
    """
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def unanswering_ranks(layout: RankLayout, grace_s: float | None = None) -> Unanswering | None:
    """Which ranks a failed collective of this rank waited for, from the job's store: this
    rank records its failure; a rank whose process (announced as it joined) is gone on this
    host died; otherwise the ranks that do not record a failure within ``grace_s`` (default:
    the job's timeout, 1 to 5 s, as the others time out a little earlier or later) stopped
    answering. None without a store to ask.

    >>> unanswering_ranks(RankLayout(0, 1)) is None  # no process group
    True
    """
    import datetime
    import socket

    store = _job_store()
    if store is None or layout.world < 2:
        return None
    others = [r for r in range(layout.world) if r != layout.rank]
    job_timeout = store.timeout.total_seconds()
    grace = grace_s if grace_s is not None else min(5.0, max(1.0, job_timeout))
    window = job_timeout + grace  # a failure recorded this recently is of the same episode
    host = socket.gethostname()
    processes: dict[int, tuple[bool, int]] = {}
    reported: set[int] = set()  # ranks seen recording a failure of this episode
    try:
        store.set_timeout(datetime.timedelta(seconds=max(1.0, grace)))
        try:
            store.set(f"{_FAILED_KEY}{layout.rank}", repr(time.time()))
            for r in others:
                key = f"{_PROCESS_KEY}{r}"
                if store.check([key]):
                    where, pid = store.get(key).decode().rsplit(" ", 1)
                    processes[r] = (where == host, int(pid))
            dead = tuple(r for r, (local, pid) in processes.items()
                         if local and not _process_alive(pid))
            if dead:
                return Unanswering(dead=dead)
            deadline = time.monotonic() + grace
            while True:
                now = time.time()
                for r in others:  # one by one: what was read stands if the store goes
                    if r not in reported and _failed_since(store, r, now - window):
                        reported.add(r)
                if len(reported) == len(others) or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        finally:
            try:
                store.set_timeout(datetime.timedelta(seconds=job_timeout))
            except Exception:  # noqa: BLE001 - the store went with its host: see below
                pass
    except Exception:  # noqa: BLE001 - the store went with its host
        if 0 not in reported:
            return Unanswering(store_lost=layout.rank != 0)
        # rank 0 reported this failure too, then ended (its error raised) and took the store
        # with it: that is no fault of rank 0's; the ranks not seen reporting are still named
    missing = [r for r in others if r not in reported]
    stalled = tuple(r for r in missing if processes.get(r, (False, 0))[0])
    return Unanswering(stalled=stalled, silent=tuple(r for r in missing if r not in stalled))


def _failed_since(store: Any, rank: int, since: float) -> bool:
    key = f"{_FAILED_KEY}{rank}"
    return bool(store.check([key])) and float(store.get(key).decode()) >= since


def _result_owners(graph: TaskGraph, layout: RankLayout) -> tuple[tuple[ChunkRef, ...], ...]:
    """Who computed each retained chunk of a plan: item r are rank r's, in the order every
    rank lays them out (found once per plan and layout)."""
    key = ("result owners", layout)
    owners = graph.programs.get(key)
    if owners is None:
        where = {t.output: t.device for t in graph.tasks}
        by_rank: list[list[ChunkRef]] = [[] for _ in range(layout.world)]
        for ref in sorted({t.output for t in graph.tasks if t.output.step in graph.retain},
                          key=lambda r: (r.step, r.key)):
            # an unplaced task (a job of one device: nothing was partitioned) ran on rank 0
            by_rank[layout.rank_of(where[ref]) if where[ref] is not None else 0].append(ref)
        owners = tuple(tuple(refs) for refs in by_rank)
        graph.programs[key] = owners
    return owners


def share_results(graph: TaskGraph, outputs: dict[ChunkRef, torch.Tensor],
                  layout: RankLayout, destination: Callable[[ChunkRef], torch.Tensor],
                  group: Any = None, device: torch.device | None = None) -> int:
    """Every retained chunk on every rank, in its ``destination`` (a view of the dense
    result): an all-gather of the chunks each rank computed, as point-to-point pairs issued
    together (``batch_isend_irecv``): every rank sends each chunk it computed to each other
    rank as it is, and receives the others' straight into their place in the result when
    that region is contiguous (a block of rows) -- no buffer is packed or unpacked. On 4
    gloo ranks of a 2-core host, shares of 256 KiB / 6 MiB a rank took 2.5 / 32 ms so,
    3.2 / 39 ms as one packed ``all_to_all_single``, 4.7 / 38 ms with
    ``all_gather_into_tensor`` and 3.5 / 30 ms as a broadcast per chunk. The buffers are on
    ``device``, the rank's :func:`communication_device` (None: the host). Returns the bytes
    this rank sent (its chunks' bytes times world - 1)."""
    from torch.distributed import distributed_c10d as c10d  # P2POp takes torch's own

    from tensorql.dtypes import torch_dtype

    owners = _result_owners(graph, layout)
    me, world = layout.rank, layout.world
    for ref in owners[me]:
        place, value = destination(ref), outputs[ref]
        if not _same_view(place, value):  # a chunk computed straight into its place stays
            place.copy_(value)
    if world == 1 or not any(owners):
        return 0
    device = device if device is not None else torch.device("cpu")
    sent = 0
    p2p: list[Any] = []
    unpack: list[tuple[torch.Tensor, torch.Tensor]] = []  # (received, where it goes)
    for r, refs in enumerate(owners):
        for k, ref in enumerate(refs):
            tag = k  # the k-th chunk of rank r: both sides count alike
            if r == me:
                chunk = outputs[ref].to(device).contiguous()
                for peer in range(world):
                    if peer != me:
                        p2p.append(torch.distributed.P2POp(c10d.isend, chunk,
                                                           peer, group, tag))
                        sent += chunk.nbytes
                continue
            view = destination(ref)
            if view.is_contiguous() and view.device == device:
                buf = view
            else:
                shape, dtype = graph.chunk_meta[ref]
                buf = torch.empty(shape, dtype=torch_dtype(dtype), device=device)
                unpack.append((buf, view))
            p2p.append(torch.distributed.P2POp(c10d.irecv, buf, r, group, tag))
    try:
        for work in torch.distributed.batch_isend_irecv(p2p):
            work.wait()
        arrived(torch.empty(0, device=device))  # the received chunks, on any stream
    except RuntimeError as err:
        raise collective_failed(layout, "the all-gather of the result chunks", err) from err
    for buf, view in unpack:
        view.copy_(buf)
    return sent


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory (a chunk the run
    computed into its tile of the dense result, and that tile): copying one onto the other
    would rewrite it with itself (4 MiB a rank of a data-parallel MLP's step).

    >>> x = torch.zeros(4, 3)
    >>> _same_view(x[:2], x[:2]), _same_view(x[:2], x[2:]), _same_view(x[:2], x[:2].clone())
    (True, False, False)
    """
    return (a.device == b.device and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype)


# [(the default group it was made in, the group)], both weak references: torch's registry
# holds the groups until destroy_process_group, and only it
_EXCHANGE_GROUP: list[Any] = []


def _held(ref: Any) -> Any:
    """The group a weak reference of the module's state refers to, or None once it is gone.

    >>> class Group: pass
    >>> g = Group()
    >>> _held(weakref.ref(g)) is g
    True
    >>> _held(None) is None
    True
    """
    return ref() if ref is not None else None


def exchange_group(layout: RankLayout) -> Any:
    """The process group exchanges run in: every rank of the job, apart from the default
    group that carries point-to-point transfers and the results' all-gather (so a collective never
    queues behind a receive on another thread, as NCCL would). Made once per job, by every
    rank at the same point of its first distributed run; None for a job of one rank."""
    import torch.distributed as dist

    if layout.world < 2:
        return None
    default = dist.distributed_c10d._get_default_group()
    group = _held(_EXCHANGE_GROUP[0][1]) if _EXCHANGE_GROUP else None
    if group is None or _held(_EXCHANGE_GROUP[0][0]) is not default:
        group = dist.new_group(list(range(layout.world)))
        _EXCHANGE_GROUP[:] = [(weakref.ref(default), weakref.ref(group))]
    return group


def join_process_group(local_devices: int, timeout_s: float,
                       devices: DeviceSet | None = None) -> RankLayout:
    """This process's place in the ``torch.distributed`` job, joining the default process
    group first when the script has not (``env://``: the ``MASTER_ADDR``, ``MASTER_PORT``,
    ``RANK`` and ``WORLD_SIZE`` variables torchrun sets). ``devices``: this rank's (the
    session's): when they include a GPU the group is gloo for host tensors and NCCL for CUDA
    ones, and the rank's first GPU becomes its current device (NCCL's); on CPU devices it is
    gloo alone, so NCCL is never touched (None: NCCL too where the machine has a GPU)."""
    import datetime

    import torch.distributed as dist

    if not dist.is_available():
        raise DistributedError("this torch build has no torch.distributed")
    uses_cuda = devices.uses_cuda if devices is not None else cuda_api.current().is_available()
    if devices is not None and devices.uses_cuda:
        api = cuda_api.current()
        api.set_device(api.torch_device(devices.specs[devices.kinds.index("cuda")].index))
    if not dist.is_initialized():
        # each tensor's device picks: gloo for host chunks, NCCL for GPU ones
        backend = "cpu:gloo,cuda:nccl" if uses_cuda else "gloo"
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        except (ValueError, RuntimeError) as err:
            raise DistributedError(join_failed(err, timeout_s)) from err
        atexit.register(leave_process_group)  # tensorql joined it, so tensorql leaves it
    layout = RankLayout(rank=dist.get_rank(), world=dist.get_world_size(), local=local_devices)
    announce_process(layout)
    check_gpus_not_shared(layout, devices)
    return layout


def derive_topology(layout: RankLayout, hosts: Sequence[str] | None = None,
                    environ: Any = None, machine: str = "cpu-gloo") -> Topology:
    """The job's :class:`~tensorql.optimizer.topology.Topology`: the ranks on one host form a
    node. ``hosts`` (each rank's host name, as :func:`job_topology` gathers them) decide;
    without them ``LOCAL_WORLD_SIZE`` (the ranks torchrun starts on each machine; it numbers
    ranks machine by machine) does, and without either the job is one node.

    >>> derive_topology(RankLayout(0, 4), ["a", "a", "b", "b"]).groups
    ((0, 1), (2, 3))
    >>> derive_topology(RankLayout(0, 4, local=2), environ={"LOCAL_WORLD_SIZE": "2"}).groups
    ((0, 1, 2, 3), (4, 5, 6, 7))
    """
    import os

    if hosts is not None:
        return Topology.from_hosts(list(hosts), layout.local, machine)
    env = os.environ if environ is None else environ
    try:
        per = int(env.get("LOCAL_WORLD_SIZE", layout.world))
    except ValueError:
        per = layout.world
    if per < 1 or layout.world % per:
        per = layout.world
    return Topology.nodes(layout.world // per, per * layout.local, machine)


_JOB_HOSTS: list[Any] = []  # [(a weak reference to the default group, every rank's host)]


def job_topology(layout: RankLayout, machine: str = "cpu-gloo") -> Topology:
    """The job's topology (:func:`derive_topology`) from every rank's host name, as the
    ranks sent them to each other when they joined (:func:`check_gpus_not_shared`; no
    collective here, so a rank may plan alone), else from ``LOCAL_WORLD_SIZE``."""
    import torch.distributed as dist

    hosts = None
    if layout.world > 1 and dist.is_initialized() and _JOB_HOSTS \
            and _held(_JOB_HOSTS[0][0]) is dist.distributed_c10d._get_default_group():
        hosts = _JOB_HOSTS[0][1]
    return derive_topology(layout, hosts, machine=machine)


_GPUS_CHECKED: list[Any] = []  # [a weak reference to the group whose ranks' GPUs were compared]


def gpu_names(devices: DeviceSet | None, environ: Any = None) -> list[str]:
    """The GPUs ``devices`` use as the machine knows them: ``CUDA_VISIBLE_DEVICES``'s entry
    for each index where it is set.

    >>> gpu_names(DeviceSet.parse(["cpu:0", "cuda:1"]), {"CUDA_VISIBLE_DEVICES": "4,5"})
    ['5']
    """
    import os

    env = os.environ if environ is None else environ
    visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    indices = [s.index for s in devices.specs if s.kind == "cuda"] if devices is not None else []
    return [visible[i] if i < len(visible) else str(i) for i in indices]


def shared_gpus(places: list[tuple[str, list[str]]]) -> str | None:
    """Why two ranks would share a GPU, given each rank's (host, GPUs), or None.

    >>> shared_gpus([("a", ["0"]), ("b", ["0"])]) is None
    True
    >>> shared_gpus([("a", ["0"]), ("a", ["1"]), ("a", ["0"])])
    'ranks 0 and 2 both use GPU 0 of host a'
    """
    seen: dict[tuple[str, str], int] = {}
    for rank, (host, gpus) in enumerate(places):
        for gpu in gpus:
            if (host, gpu) in seen:
                return f"ranks {seen[host, gpu]} and {rank} both use GPU {gpu} of host {host}"
            seen[host, gpu] = rank
    return None


def check_gpus_not_shared(layout: RankLayout, devices: DeviceSet | None) -> None:
    """DistributedError, before NCCL is touched, when two ranks of the job would use one GPU
    (NCCL refuses them with "invalid usage"): ranks of one machine started by separate
    launchers each see ``LOCAL_WORLD_SIZE`` 1 and take the first GPU. Once per job: every
    rank sends its host and GPUs to every other (an all-gather, on the host)."""
    import socket

    import torch.distributed as dist

    if layout.world < 2 or not dist.is_initialized():
        return
    group = dist.distributed_c10d._get_default_group()
    if _GPUS_CHECKED and _held(_GPUS_CHECKED[0]) is group:
        return
    places: list[Any] = [None] * layout.world
    try:
        dist.all_gather_object(places, (socket.gethostname(), gpu_names(devices)))
    except RuntimeError as err:
        raise collective_failed(layout, "comparing GPUs with the other ranks", err) from err
    _GPUS_CHECKED[:] = [weakref.ref(group)]
    _JOB_HOSTS[:] = [(weakref.ref(group), [host for host, _ in places])]
    why = shared_gpus(places)
    if why is not None:
        raise DistributedError(
            f"rank {layout.rank}: {why}, and NCCL cannot run two ranks on one GPU: start the "
            "ranks of one machine with one torchrun (--nproc-per-node sets LOCAL_RANK and "
            "LOCAL_WORLD_SIZE, and each rank then takes its own GPU), or use devices='cpu'")


_JOB_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def join_failed(err: BaseException, timeout_s: float, environ: Any = None) -> str:
    """Why joining the job failed, with advice that fits how the script was started: under
    torchrun (``TORCHELASTIC_RUN_ID`` set) a rank did not join in time; with the variables
    set by hand, the same; without them, how to launch it.

    >>> print(join_failed(RuntimeError("Timed out ... 2/3 clients joined."), 5,
    ...                   {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "3"}))
    ... # doctest: +NORMALIZE_WHITESPACE
    rank 0: cannot join the torch.distributed job of 3 ranks within 5 s (Timed out ... 2/3
    clients joined.); the script runs under torchrun, so some rank did not start or did not
    reach tq.connect in time: check every node's torchrun (--nnodes, --nproc-per-node, the
    rendezvous endpoint) and the other ranks' logs, or raise distributed_timeout_s
    >>> join_failed(ValueError("no RANK"), 5, {"MASTER_ADDR": "h", "MASTER_PORT": "1"})[-62:]
    'launch the script with torchrun, or set RANK, WORLD_SIZE there'
    """
    import os

    env = os.environ if environ is None else environ
    first = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
    who = f"rank {env['RANK']}: " if "RANK" in env else ""
    size = f" of {env['WORLD_SIZE']} ranks" if "WORLD_SIZE" in env else ""
    head = (f"{who}cannot join the torch.distributed job{size} within {timeout_s:g} s "
            f"({first})")
    if "TORCHELASTIC_RUN_ID" in env:
        return (f"{head}; the script runs under torchrun, so some rank did not start or did "
                "not reach tq.connect in time: check every node's torchrun (--nnodes, "
                "--nproc-per-node, the rendezvous endpoint) and the other ranks' logs, or "
                "raise distributed_timeout_s")
    missing = [name for name in _JOB_VARIABLES if name not in env]
    if not missing:
        return (f"{head}; every rank 0..WORLD_SIZE-1 must start with the same MASTER_ADDR "
                "and MASTER_PORT and reach tq.connect in time: check the other ranks' logs, "
                "or raise distributed_timeout_s")
    return (f"{head}; launch the script with torchrun, or set {', '.join(missing)} there")


def leave_process_group(wait_s: float = 10.0) -> None:
    """Destroy the process group this process joined, while the interpreter is still whole.

    Registered at exit when :func:`join_process_group` made the group (a group the script
    made itself is the script's to destroy). Destroying frees the groups -- tensorql's own
    state refers to them weakly -- so gloo's threads, and rank 0's store server, end here. A
    group left to the interpreter's teardown is destroyed inside ``Py_Finalize``, where a gloo
    thread that needs the GIL (finishing a work whose future has a Python callback, or whose
    tensor was dropped by Python) is ended by ``pthread_exit``, and the process aborts
    ("terminate called without an active exception", SIGABRT) although its work finished.
    Destroying waits for the group's pending work; after a rank died that could wait long, so
    it runs on a thread given ``wait_s`` seconds: a process never hangs at exit.

    >>> leave_process_group()  # no group joined: nothing to do
    """
    import gc

    import torch.distributed as dist

    _EXCHANGE_GROUP.clear()
    _GPUS_CHECKED.clear()
    _JOB_HOSTS.clear()
    _ANNOUNCED.clear()
    if not (dist.is_available() and dist.is_initialized()):
        return

    def destroy() -> None:
        try:
            dist.destroy_process_group()
            gc.collect()  # a group held only by a reference cycle goes now, not at teardown
        except Exception:  # noqa: BLE001 - at exit there is no one left to tell
            pass

    leaving = threading.Thread(target=destroy, name="tensorql-leave-group", daemon=True)
    leaving.start()
    leaving.join(wait_s)


def check_same_plan(fingerprint: str, layout: RankLayout, group: Any = None) -> None:
    """DistributedError unless every rank compiled the same plan (a mismatch would pair
    transfers wrongly and hang)."""
    import torch.distributed as dist

    prints: list[Any] = [None] * layout.world
    try:
        dist.all_gather_object(prints, fingerprint, group=group)
    except RuntimeError as err:
        raise collective_failed(layout, "comparing plans with the other ranks", err) from err
    differ = [r for r, p in enumerate(prints) if p != prints[0]]
    if differ:
        raise DistributedError(
            f"ranks built different plans (rank 0: {prints[0][:12]}, ranks "
            f"{', '.join(map(str, differ))} differ): every rank must build the same expression "
            "over the same stored tensors and options")
