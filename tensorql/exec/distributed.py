"""Ranks of a ``torch.distributed`` job as devices of one runtime.

Every rank compiles the same query into the same plan for all ``N = world x local`` devices of
the job and lowers it to the same memory plan. A rank runs only the ops placed on its own
devices; a chunk sent from a device of one rank to a device of another becomes a
``torch.distributed`` send on the holder's rank and a receive on the reader's (gloo on CPU,
NCCL on GPU), tagged with the op's id so that transfers never pair up wrongly. Transfers run
on transfer threads (kept between transfers), like any other op with dependencies: a receive
completes when the chunk has arrived, and what waits for it becomes ready then. Every result
chunk is then broadcast by the rank that computed it, so a script runs unchanged on all.

A rank that stops answering makes a transfer wait until the process group's timeout; the
error names the peer rank.

>>> RankLayout(rank=1, world=2, local=2).devices_of(1)
[2, 3]
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tensorql.errors import ExecutionError, TensorQLError
from tensorql.exec.devices import Completion, Device, resolve_devices
from tensorql.exec.devices.base import Post
from tensorql.exec.memplan import Op
from tensorql.exec.run_types import ChunkSink, ProgressCallback, RunResult
from tensorql.exec.runtime import Runtime, _Run
from tensorql.exec.taskgraph import ChunkRef, TaskGraph
from tensorql.units import format_bytes


class DistributedError(TensorQLError):
    """A distributed run failed: a peer rank died or stopped answering, or ranks disagree."""


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
class RankStats:
    """What one rank measured in a distributed run, for EXPLAIN ANALYZE on rank 0.

    Bytes are those of the tensors the rank passed to torch.distributed, by call:
    ``transfers`` (point-to-point sends of the plan's copies), ``broadcast`` (the result
    chunks it computed, broadcast to the other ranks: their bytes times world - 1).

    >>> RankStats(1, 0.5, 0.25, 0.2, 2048, 1024, 4096, 8192).describe().split(", ")[:4]
    ['rank 1: wall 500.0 ms', 'busy 250.0 ms', 'copies 200.0 ms', 'sent 2.0 KiB (transfers)']
    """

    rank: int
    wall_s: float
    busy_s: float
    copy_s: float
    sent_bytes: int
    received_bytes: int
    broadcast_bytes: int
    peak_bytes: int

    def describe(self) -> str:
        return (f"rank {self.rank}: wall {self.wall_s * 1e3:.1f} ms, busy "
                f"{self.busy_s * 1e3:.1f} ms, copies {self.copy_s * 1e3:.1f} ms, sent "
                f"{format_bytes(self.sent_bytes)} (transfers), received "
                f"{format_bytes(self.received_bytes)}, {format_bytes(self.broadcast_bytes)} "
                f"(result chunks broadcast), peak "
                f"{format_bytes(self.peak_bytes)}")


def gather_rank_stats(stats: Any, layout: RankLayout, sent: int, received: int,
                      broadcast_bytes: int, group: Any = None) -> list[RankStats]:
    """Every rank's :class:`RankStats` of this run, on every rank (an all-gather)."""
    local = [d for d, kind in zip(stats.devices, stats.device_kinds) if kind != "remote"]
    mine = RankStats(layout.rank, stats.wall_s, sum(d.busy_s for d in local),
                     sum(d.copy_s for d in local), sent, received, broadcast_bytes,
                     max((d.peak_bytes for d in local), default=0))
    out: list[Any] = [None] * layout.world
    torch.distributed.all_gather_object(out, mine, group=group)
    return out


class RemoteDevice(Device):
    """A device of another rank: this rank never runs work on it."""

    kind = "remote"

    def __init__(self, name: str) -> None:
        super().__init__(name, {"compute": 1, "h2d": 1, "d2h": 1, "d2d": 1})

    def open(self, post: Post) -> None:
        pass

    def close(self) -> None:
        pass

    def submit(self, lane: str, op_id: int, fn: Callable[[], Any], cost: float = 0.0) -> None:
        raise ExecutionError(f"{self.name} belongs to another rank")  # pragma: no cover


class TransferThreads:
    """Threads that run blocking transfers, kept for the next one: a transfer waits on its
    peer, so each runs on a thread of its own -- but starting a thread per transfer cost
    ~0.3 ms of latency each on a 2-core machine, so finished threads wait for the next.

    >>> pool = TransferThreads()
    >>> done = threading.Event()
    >>> pool.start(done.set)
    >>> done.wait(5)
    True
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[tuple[threading.Event, list]] = []

    def start(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on an idle thread, or on a new one when none is idle."""
        with self._lock:
            slot = self._idle.pop() if self._idle else None
        if slot is None:
            wake, job = threading.Event(), [(fn, args)]
            threading.Thread(target=self._serve, args=(wake, job), daemon=True,
                             name="tensorql-transfer").start()
            return
        wake, job = slot
        job.append((fn, args))
        wake.set()

    def _serve(self, wake: threading.Event, job: list) -> None:
        while True:
            fn, args = job.pop()
            fn(*args)
            del fn, args  # an idle thread holds nothing of the run it served
            wake.clear()
            with self._lock:
                self._idle.append((wake, job))
            if not wake.wait(IDLE_TRANSFER_THREAD_S):
                with self._lock:  # retire, unless a job was handed over meanwhile
                    if (wake, job) in self._idle:
                        self._idle.remove((wake, job))
                        return
                wake.wait()


IDLE_TRANSFER_THREAD_S = 60.0  # an idle transfer thread ends after this long


class DistributedRuntime(Runtime):
    """The runtime of one rank: the job's memory plan, this rank's ops, transfers between
    ranks through ``torch.distributed`` (``group`` or the default process group)."""

    def __init__(self, layout: RankLayout, local_devices: Any = "cpu",
                 memory_limit: int | None = None, *, workers: int = 1,
                 intra_op_threads: int = 1, group: Any = None, **kw: Any) -> None:
        local = resolve_devices(local_devices, workers)
        if len(local) != layout.local:
            raise ExecutionError(f"{len(local)} local devices but the layout says "
                                 f"{layout.local} per rank")
        devices: list[Device] = []
        for g in range(layout.devices):
            if layout.is_local(g):
                dev = local[g - layout.rank * layout.local]
                dev.name = f"rank{layout.rank}:{dev.name}"
                devices.append(dev)
            else:
                devices.append(RemoteDevice(f"rank{layout.rank_of(g)}:dev{g}"))
        super().__init__(devices, memory_limit, workers=workers,
                         intra_op_threads=intra_op_threads, **kw)
        self.layout = layout
        self.group = group
        self.transfer_threads = TransferThreads()

    def run(self, graph: TaskGraph, progress: ProgressCallback | None = None,
            sink: ChunkSink | None = None, destination: Any = None) -> RunResult:
        program = self.plan(graph)
        previous = torch.get_num_threads()
        torch.set_num_threads(self.intra_op_threads)
        run = _RankRun(self, graph, program, progress, sink)
        try:
            result = run.execute()
        finally:
            torch.set_num_threads(previous)
        self.sent_bytes, self.received_bytes = run.sent_bytes, run.received_bytes
        return result


class _RankRun(_Run):
    """One rank's part of a run: the ops on its devices and its side of every transfer."""

    def __init__(self, rt: DistributedRuntime, *args: Any) -> None:
        super().__init__(rt, *args)
        self.layout = rt.layout
        self.mine = [self._is_mine(op) for op in self.ops]
        for op in self.ops:  # what other ranks do is not waited for here: data arrival is
            self.succ[op.id] = [s for s in self.succ[op.id] if self.mine[s]]
            if not self.mine[op.id]:
                self.ndeps[op.id] = -1
                self.done_ops += 1
        for op in self.ops:
            if self.mine[op.id]:
                self.ndeps[op.id] = sum(1 for d in op.deps if self.mine[d])
        self.sent_bytes = 0
        self.received_bytes = 0

    def _is_mine(self, op: Op) -> bool:
        if self.layout.is_local(op.device):
            return True
        return op.kind == "send" and self.layout.is_local(op.src_device)

    def _cross_rank(self, op: Op) -> bool:
        return op.kind == "send" and self.layout.rank_of(op.src_device) != \
            self.layout.rank_of(op.device)

    def _dispatch(self) -> None:
        """Transfers between ranks start as soon as they are ready, outside the lanes' slots:
        a receive waits on a peer, and queueing transfers behind one another could make two
        ranks wait on each other."""
        for heap in self.ready.values():
            if any(self._cross_rank(self.ops[entry[1]]) for entry in heap):
                kept = []
                for entry in heap:
                    op = self.ops[entry[1]]
                    if self._cross_rank(op):
                        self._submit(op)
                    else:
                        kept.append(entry)
                heap[:] = kept
                heapq.heapify(heap)
        super()._dispatch()

    def _submit(self, op: Op) -> None:
        if not self._cross_rank(op):
            super()._submit(op)
            return
        key = (op.device, op.lane)  # counted in flight (the coordinator waits for it)
        self.inflight[key] = self.inflight.get(key, 0) + 1
        receiving = self.layout.is_local(op.device)
        if receiving:
            self._allocate(op)
        self.rt.transfer_threads.start(self._transfer, op, receiving)

    def _transfer(self, op: Op, receiving: bool) -> None:
        started = time.perf_counter()
        value, error = None, None
        peer = self.layout.rank_of(op.src_device if receiving else op.device)
        try:
            if receiving:
                shape, dtype = self.graph.chunk_meta[op.ref]
                from tensorql.dtypes import torch_dtype

                value = torch.empty(shape, dtype=torch_dtype(dtype))
                torch.distributed.recv(value, src=peer, tag=op.id, group=self.rt.group)
            else:
                chunk = self.values[op.src_device][op.ref].contiguous()
                torch.distributed.send(chunk, dst=peer, tag=op.id, group=self.rt.group)
                value = chunk.nbytes
        except BaseException as err:  # noqa: BLE001 - reported to the coordinator
            error = DistributedError(
                f"rank {self.layout.rank}: {'receiving from' if receiving else 'sending to'} "
                f"rank {peer} failed ({type(err).__name__}: {err}); rank {peer} died or "
                "stopped answering within the timeout")
        self.events.put(Completion(op.id, started, time.perf_counter(), value, error))

    def _complete(self, op: Op, c: Completion) -> None:
        if self._cross_rank(op) and not self.layout.is_local(op.device):
            self.sent_bytes += int(c.value)
            self.stats.moved[op.src_device][op.device] += int(c.value)
            return  # the sender's side: nothing lands here
        if self._cross_rank(op):
            self.received_bytes += op.nbytes
            self.values[op.device][op.ref] = c.value
            self.stats.devices[op.device].bytes_d2d += op.nbytes
            self.stats.devices[op.device].ops += 1
            return
        super()._complete(op, c)


def share_results(graph: TaskGraph, outputs: dict[ChunkRef, torch.Tensor],
                  layout: RankLayout, place: Callable[[ChunkRef, torch.Tensor], None],
                  group: Any = None) -> int:
    """Every retained chunk on every rank: each is broadcast by the rank that computed it
    (one collective per chunk, in the same order on every rank) and handed to ``place``
    there and everywhere else. Returns the bytes this rank broadcast (chunk bytes times
    world - 1). Where ranks gathered the chunks on rank 0 and rank 0 broadcast the whole
    result, a chunk now crosses once, from its owner, and no rank waits for rank 0."""
    where = {t.output: t.device for t in graph.tasks}
    refs = sorted({t.output for t in graph.tasks if t.output.step in graph.retain},
                  key=lambda r: (r.step, r.key))
    from tensorql.dtypes import torch_dtype

    sent = 0
    for ref in refs:
        # an unplaced task (a job of one device: nothing was partitioned) ran on rank 0
        owner = layout.rank_of(where[ref]) if where[ref] is not None else 0
        if owner == layout.rank:
            buf = outputs[ref].contiguous()
            sent += buf.nbytes * (layout.world - 1)
        else:
            shape, dtype = graph.chunk_meta[ref]
            buf = torch.empty(shape, dtype=torch_dtype(dtype))
        if layout.world > 1:
            try:
                torch.distributed.broadcast(buf, src=owner, group=group)
            except RuntimeError as err:
                # a collective does not say which peer failed: name every other rank
                suspects = [r for r in range(layout.world) if r != layout.rank]
                named = (f"rank {suspects[0]}" if len(suspects) == 1 else
                         f"one of ranks {', '.join(map(str, suspects))}")
                first = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
                raise DistributedError(
                    f"rank {layout.rank}: the broadcast of a result chunk from rank {owner} "
                    f"failed ({first}); {named} died or stopped answering within the "
                    "timeout") from err
        place(ref, buf)
    return sent

def join_process_group(local_devices: int, timeout_s: float) -> RankLayout:
    """This process's place in the ``torch.distributed`` job, joining the default process
    group first when the script has not (``env://``: the ``MASTER_ADDR``, ``MASTER_PORT``,
    ``RANK`` and ``WORLD_SIZE`` variables torchrun sets; gloo on CPU, NCCL on CUDA)."""
    import datetime

    import torch.distributed as dist

    if not dist.is_available():
        raise DistributedError("this torch build has no torch.distributed")
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        except (ValueError, RuntimeError) as err:
            raise DistributedError(
                f"cannot join the torch.distributed job ({err}); launch the script with "
                "torchrun, or set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE") from err
    return RankLayout(rank=dist.get_rank(), world=dist.get_world_size(), local=local_devices)


def check_same_plan(fingerprint: str, layout: RankLayout, group: Any = None) -> None:
    """DistributedError unless every rank compiled the same plan (a mismatch would pair
    transfers wrongly and hang)."""
    import torch.distributed as dist

    prints: list[Any] = [None] * layout.world
    try:
        dist.all_gather_object(prints, fingerprint, group=group)
    except RuntimeError as err:
        raise DistributedError(f"rank {layout.rank}: comparing plans with the other ranks "
                               f"failed ({err}); a rank died or stopped answering") from err
    differ = [r for r, p in enumerate(prints) if p != prints[0]]
    if differ:
        raise DistributedError(
            f"ranks built different plans (rank 0: {prints[0][:12]}, ranks "
            f"{', '.join(map(str, differ))} differ): every rank must build the same expression "
            "over the same stored tensors and options")
