"""The host tier: a pinned pool allocated once, host memory under a budget, DuckDB beyond.

Chunks written back from a GPU land in :class:`PinnedPool` buffers (one pinned allocation made
at the first use, carved up first-fit; nothing is pinned per transfer), so H2D/D2H copies run
asynchronously at full PCIe speed. Beyond the pool (on a CPU device: always) chunks are kept
in ordinary host memory, at most ``budget`` bytes of them; with a spill space
(:class:`~tensorql.storage.spill.SpillSpace`) the chunks beyond it go to DuckDB as pages
(:class:`HostTier`).

>>> pool = PinnedPool(4096, pin=False)
>>> a = pool.alloc(1000); b = pool.alloc(1000)
>>> (a, b, pool.alloc(4096))
(0, 1024, None)
>>> pool.free(a); pool.alloc(512)
0

A process keeps one pinned pool (:func:`shared_pool`): every runtime, hence every query of
every session, copies through it instead of pinning a buffer of its own.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

import tensorql.cuda_api as cuda_api
from tensorql.errors import ExecutionError
from tensorql.exec.taskgraph import ChunkRef
from tensorql.units import format_bytes

log = logging.getLogger(__name__)

_ALIGN = 512


class PinnedPool:
    """First-fit allocator over one (pinned) byte buffer; offsets are aligned to 512 bytes."""

    def __init__(self, capacity: int, pin: bool = True, api: Any = None) -> None:
        self.capacity = int(capacity)
        self.pin = pin
        self.api = api
        self._buffer: torch.Tensor | None = None
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (offset, size), sorted
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()
        self.in_use = 0
        self.peak = 0

    @property
    def buffer(self) -> torch.Tensor:
        if self._buffer is None:  # allocated once, at first use
            with self._lock:
                if self._buffer is None:
                    self._buffer = ((self.api or cuda_api.current()).pinned_empty(self.capacity)
                                    if self.pin
                                    else torch.empty(self.capacity, dtype=torch.uint8))
        return self._buffer

    def alloc(self, nbytes: int) -> int | None:
        size = max(_ALIGN, -(-int(nbytes) // _ALIGN) * _ALIGN)
        with self._lock:
            for n, (off, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        self._free.pop(n)
                    else:
                        self._free[n] = (off + size, free - size)
                    self._used[off] = size
                    self.in_use += size
                    self.peak = max(self.peak, self.in_use)
                    return off
        return None

    def free(self, offset: int) -> None:
        with self._lock:
            size = self._used.pop(offset)
            self.in_use -= size
            self._free.append((offset, size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for off, sz in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + sz)
                else:
                    merged.append((off, sz))
            self._free = merged

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.buffer[offset:offset + nbytes].view(dtype).view(shape)


#: the pinned pool's default size: 2 GiB, at most 1/16 of the machine's memory
DEFAULT_POOL_BYTES = 2 << 30

_pools_lock = threading.Lock()


def default_pool_bytes() -> int:
    """The shared pool's size when none is asked for: 2 GiB, at most 1/16 of physical memory
    (page-locked memory is taken from what the OS can page)."""
    from tensorql.options import physical_memory_bytes

    return max(64 << 20, min(DEFAULT_POOL_BYTES, physical_memory_bytes() // 16))


def shared_pool(capacity: int | None = None, api: Any = None) -> PinnedPool:
    """The process's pinned pool (one per :mod:`tensorql.cuda_api` in force), made at the first
    call and reused by every later one: of ``capacity`` bytes (default
    :func:`default_pool_bytes`). A call asking for more than the pool has gets a larger pool
    in its place while nothing is in the old one, else the pool as it is (chunks beyond it
    go to plain memory).

    >>> class Api:
    ...     def pinned_empty(self, n): return torch.empty(n, dtype=torch.uint8)
    >>> api = Api()
    >>> shared_pool(1 << 20, api) is shared_pool(4096, api), shared_pool(1 << 20, api).capacity
    (True, 1048576)
    """
    api = api if api is not None else cuda_api.current()
    want = int(capacity) if capacity is not None else default_pool_bytes()
    with _pools_lock:
        cache = cuda_api.cache_of(api)
        pool = cache.get("pinned pool")
        if pool is None or (pool.capacity < want and pool.in_use == 0):
            pool = cache["pinned pool"] = PinnedPool(want, pin=True, api=api)
        return pool


_NEVER = float("inf")


class HostTier:
    """Host copies of one run's chunks: pinned pool slots, else plain host memory, and -- with
    a ``budget`` (bytes of plain memory) and a ``spill`` space -- DuckDB beyond it.

    ``loads`` lists the memory plan's reads of host copies in plan order (op id, chunk). The
    tier uses it twice. When a chunk comes in and the budget is full, the chunks read again
    furthest in the future (never, first) go to DuckDB, the incoming one included (Belady's
    rule); a copy already in DuckDB is just dropped from memory. And a prefetch thread reads
    spilled chunks back in plan order, ahead of the loads that need them, as far as the
    budget has room: their reads overlap compute, and a load finds its chunk in memory.
    A chunk ``put`` with ``fresh=True`` (a result its sink has not yet taken) is never
    spilled before its first ``get``. With ``expect_spill`` (the memory plan says the run
    spills) a thread opens the run's spill table at once, overlapped with the run's first
    ops, so the first eviction does not wait for DuckDB to start (~0.1 s).

    >>> import torch
    >>> from tensorql.storage.spill import SpillSpace
    >>> a, b = ChunkRef(0, (0,)), ChunkRef(0, (1,))
    >>> space = SpillSpace()
    >>> tier = HostTier(spill=space, budget=64, loads=[(7, b), (9, a)])
    >>> tier.put(a, torch.ones(16)); tier.put(b, torch.zeros(16))  # a is read last: spilled
    >>> tier.spill_written, float(tier.get(a).sum()), tier.get(b).sum().item()
    (64, 16.0, 0.0)
    >>> tier.close(); space.close()
    """

    def __init__(self, pool: PinnedPool | None = None, spill: Any = None, run_tag: str = "run",
                 *, budget: int | None = None,
                 loads: Sequence[tuple[int, ChunkRef]] = (), lookahead: int = 16,
                 expect_spill: bool = False) -> None:
        self.pool = pool
        self.space = spill
        self.tag = run_tag
        self.budget = budget
        self.lookahead = lookahead
        self._data: dict[ChunkRef, torch.Tensor] = {}
        self._slots: dict[ChunkRef, int] = {}
        self._sizes: dict[ChunkRef, int] = {}
        # chunks with a copy in DuckDB: (id, shape, dtype); also in _data once read back
        self._spilled: dict[ChunkRef, tuple[int, tuple[int, ...], torch.dtype]] = {}
        self._fresh: set[ChunkRef] = set()
        self._reading: set[ChunkRef] = set()
        self._orphans: dict[ChunkRef, int] = {}  # dropped while read: their DuckDB ids
        self._ahead: set[ChunkRef] = set()  # read back by the prefetcher, not yet used
        # read on demand for the use now running (not kept): the prefetcher must not read
        # them again for that same use
        self._served: set[ChunkRef] = set()
        self._cond = threading.Condition()
        self._lock = self._cond  # one lock guards the tier's maps and figures
        self._put_lock = threading.Lock()  # one spill decision at a time
        self._order = [ref for _, ref in loads]
        self._position = {op_id: k for k, (op_id, _) in enumerate(loads)}
        self._done = [False] * len(self._order)
        self._cursor = 0
        self._uses: dict[ChunkRef, deque[int]] = {}
        for k, ref in enumerate(self._order):
            self._uses.setdefault(ref, deque()).append(k)
        self._pages: Any = None
        self._pages_lock = threading.Lock()
        self._prefetcher: threading.Thread | None = None
        self._opener: threading.Thread | None = None
        self._closed = False
        self.spilled_bytes = 0  # host copies beyond the pinned pool (plain memory or DuckDB)
        self.pinned_bytes = 0
        self.plain_bytes = 0  # plain host memory held now (or reserved for a read)
        self._pending = 0  # bytes of puts making room for themselves
        self.peak_plain_bytes = 0
        self.spill_written = self.spill_read = 0  # bytes to and from DuckDB
        self.spill_chunks = 0
        self.reads_ahead = self.reads_on_demand = self.ahead_used = 0
        self.over_budget = 0  # the most plain bytes ever held beyond the budget
        if expect_spill and spill is not None and budget is not None:
            self._opener = threading.Thread(target=self._open_early,
                                            name="tensorql-spill-open", daemon=True)
            self._opener.start()

    # -- the pinned pool -------------------------------------------------------------------
    def buffer_for(self, ref: ChunkRef, like: torch.Tensor) -> torch.Tensor | None:
        """A pinned buffer shaped like ``like`` for ``ref``, or None when the pool is full."""
        if self.pool is None:
            return None
        off = self.pool.alloc(like.nbytes)
        if off is None:
            return None
        with self._lock:
            self._slots[ref] = off
        return self.pool.view(off, tuple(like.shape), like.dtype)

    # -- plan order ------------------------------------------------------------------------
    def _next_use(self, ref: ChunkRef) -> float:
        if ref in self._fresh:
            return -1.0  # its sink takes it now
        uses = self._uses.get(ref)
        return float(uses[0]) if uses else _NEVER

    def load_done(self, op_id: int) -> None:
        """The memory plan's read ``op_id`` of a host copy has finished."""
        with self._cond:
            k = self._position.get(op_id)
            if k is None or self._done[k]:
                return
            self._done[k] = True
            self._served.discard(self._order[k])
            uses = self._uses.get(self._order[k])
            if uses:
                if uses[0] == k:
                    uses.popleft()
                else:
                    uses.remove(k)
            while self._cursor < len(self._done) and self._done[self._cursor]:
                self._cursor += 1
            self._cond.notify_all()

    # -- writing ---------------------------------------------------------------------------
    def _add_plain(self, nbytes: int) -> None:
        self.plain_bytes += nbytes
        self.peak_plain_bytes = max(self.peak_plain_bytes, self.plain_bytes)
        if self.budget is not None:
            self.over_budget = max(self.over_budget, self.plain_bytes - self.budget)

    def put(self, ref: ChunkRef, value: torch.Tensor, fresh: bool = False) -> None:
        nbytes = value.nbytes
        with self._lock:
            pinned = ref in self._slots
            self._sizes[ref] = nbytes
        if pinned:
            self.pinned_bytes += nbytes
            with self._lock:
                self._data[ref] = value
            return
        if ref in self._data or ref in self._spilled:
            self.drop(ref)  # a stale copy of a chunk written back again
        with self._lock:
            self._sizes[ref] = nbytes
        self.spilled_bytes += nbytes
        if self.budget is None or self.space is None:
            with self._lock:
                self._data[ref] = value
                self._add_plain(nbytes)
            return
        with self._put_lock:
            with self._lock:
                if fresh:
                    self._fresh.add(ref)
                victims, spill_this = self._choose(ref, nbytes)
                if not spill_this:  # the room victims leave is this chunk's, not a prefetch's
                    self._pending += nbytes
            for victim in victims:
                self._evict(victim)
            if spill_this:
                ident = self._write(ref, value)
                with self._cond:
                    self._spilled[ref] = (ident, tuple(value.shape), value.dtype)
                    self._cond.notify_all()
                return
            with self._cond:
                self._pending -= nbytes
                self._data[ref] = value
                self._add_plain(nbytes)
                self._cond.notify_all()

    def _choose(self, ref: ChunkRef, nbytes: int) -> tuple[list[ChunkRef], bool]:
        """What leaves memory for ``ref`` to come in: chunks (and whether ``ref`` itself goes
        to DuckDB instead), furthest next read first. Called holding the lock."""
        need = self.plain_bytes + nbytes - self.budget
        if need <= 0:
            return [], False
        candidates = [r for r in self._data
                      if r not in self._slots and r not in self._fresh
                      and r not in self._reading]
        candidates.append(ref)
        candidates.sort(key=self._next_use, reverse=True)
        victims: list[ChunkRef] = []
        freed = 0
        for r in candidates:
            if freed >= need:
                break
            if r == ref:
                if ref in self._fresh:
                    continue  # held for its sink; the others make what room they can
                return victims, True
            victims.append(r)
            freed += self._sizes[r]
        return victims, False

    def _open_pages(self) -> Any:
        with self._pages_lock:
            if self._pages is None and not self._closed:
                self._pages = self.space.open_run(self.tag)
            return self._pages

    def _open_early(self) -> None:
        try:
            pages = self._open_pages()
            if pages is not None:
                pages.prepare()
        except Exception as err:  # noqa: BLE001 - the first write opens it and reports
            log.warning("opening the spill table ahead of the first spill failed: %s", err)

    def _write(self, ref: ChunkRef, value: torch.Tensor) -> int:
        first = self.spill_chunks == 0
        pages = self._open_pages()
        if pages is None:
            raise ExecutionError(f"host tier of run {self.tag}: closed while spilling chunk "
                                 f"s{ref.step}{list(ref.key)}")
        if first:
            log.info("host tier over its budget of %s: spilling to DuckDB (%s)",
                     format_bytes(self.budget), pages.table)
        ident = pages.write(value)
        self.spill_written += value.nbytes
        self.spill_chunks += 1
        log.debug("spilled chunk s%d%s (%s) to DuckDB; next read at %s; host tier %s of %s",
                  ref.step, list(ref.key), format_bytes(value.nbytes),
                  self._next_use(ref), format_bytes(self.plain_bytes),
                  format_bytes(self.budget))
        self._start_prefetcher()
        return ident

    def _evict(self, ref: ChunkRef) -> None:
        with self._lock:
            value = self._data.get(ref)
            clean = ref in self._spilled
        if value is None:
            return
        ident = None if clean else self._write(ref, value)
        with self._cond:
            if self._data.get(ref) is not value:
                return  # dropped meanwhile
            if ident is not None:
                self._spilled[ref] = (ident, tuple(value.shape), value.dtype)
            del self._data[ref]
            self._ahead.discard(ref)
            self.plain_bytes -= self._sizes[ref]
            self._cond.notify_all()

    # -- reading ---------------------------------------------------------------------------
    def get(self, ref: ChunkRef) -> torch.Tensor:
        with self._cond:
            while ref in self._reading:
                self._cond.wait()
            self._fresh.discard(ref)
            value = self._data.get(ref)
            if value is not None:
                if ref in self._ahead:
                    self._ahead.discard(ref)
                    self.ahead_used += 1
                return value
            entry = self._spilled.get(ref)
            if entry is None:
                raise KeyError(ref)
            self._reading.add(ref)
        try:
            value = self._pages.read(entry[0], entry[1], entry[2])
        finally:
            with self._cond:
                self._reading.discard(ref)
                orphan = self._orphans.pop(ref, None)
                self._cond.notify_all()
            if orphan is not None:
                self._discard(orphan)
        with self._cond:
            self.spill_read += value.nbytes
            self.reads_on_demand += 1
            uses = self._uses.get(ref)
            if ref in self._spilled and uses is not None and len(uses) > 1 and \
                    self.plain_bytes + self._pending + value.nbytes <= self.budget:
                self._data[ref] = value  # read again later: keep it while there is room
                self._add_plain(value.nbytes)
            else:
                self._served.add(ref)
        return value

    def _start_prefetcher(self) -> None:
        if self._prefetcher is None and self._order:
            self._prefetcher = threading.Thread(target=self._prefetch_loop,
                                                name="tensorql-spill-prefetch", daemon=True)
            self._prefetcher.start()

    def _next_prefetch(self) -> ChunkRef | None:
        """The first spilled chunk of the next ``lookahead`` reads, if it fits the budget."""
        end = min(len(self._order), self._cursor + self.lookahead)
        for k in range(self._cursor, end):
            if self._done[k]:
                continue
            ref = self._order[k]
            if ref in self._data or ref in self._reading or ref not in self._spilled \
                    or ref in self._served:
                continue
            if self.plain_bytes + self._pending + self._sizes[ref] > self.budget:
                return None
            return ref
        return None

    def _prefetch_loop(self) -> None:
        while True:
            with self._cond:
                ref = None
                while not self._closed:
                    ref = self._next_prefetch()
                    if ref is not None:
                        break
                    self._cond.wait()
                if self._closed:
                    return
                entry = self._spilled[ref]
                nbytes = self._sizes[ref]
                self._reading.add(ref)
                self._add_plain(nbytes)  # reserved before the read
            value = None
            try:
                value = self._pages.read(entry[0], entry[1], entry[2])
            except Exception as err:  # noqa: BLE001 - the load reads it again and reports
                log.warning("prefetch of spilled chunk s%d%s failed: %s", ref.step,
                            list(ref.key), err)
            with self._cond:
                self._reading.discard(ref)
                if value is not None and ref in self._spilled and ref not in self._data:
                    self._data[ref] = value
                    self._ahead.add(ref)
                    self.spill_read += nbytes
                    self.reads_ahead += 1
                else:
                    self.plain_bytes -= nbytes
                discard = self._discard_after_read(ref)
                self._cond.notify_all()
            if discard is not None:
                self._discard(discard)

    def has(self, ref: ChunkRef) -> bool:
        with self._lock:
            return ref in self._data or ref in self._spilled

    def drop(self, ref: ChunkRef) -> None:
        with self._cond:
            value = self._data.pop(ref, None)
            off = self._slots.pop(ref, None)
            entry = self._spilled.pop(ref, None)
            if entry is not None and ref in self._reading:
                self._orphans[ref] = entry[0]  # its reader discards it once done
                entry = None
            self._fresh.discard(ref)
            self._ahead.discard(ref)
            self._served.discard(ref)
            if value is not None and off is None:
                self.plain_bytes -= self._sizes.get(ref, value.nbytes)
            self._cond.notify_all()
        if off is not None:
            self.pool.free(off)
        if entry is not None:
            self._discard(entry[0])

    def _discard(self, ident: int) -> None:
        """Drop a DuckDB copy no longer needed (not holding the lock): its blocks leave the
        spill database's memory and files now, instead of being written out again."""
        pages = self._pages
        if pages is None:
            return
        try:
            pages.discard(ident)
        except Exception as err:  # noqa: BLE001 - the run's close drops it anyway
            log.warning("dropping a spilled chunk's table failed: %s", err)

    def _discard_after_read(self, ref: ChunkRef) -> int | None:
        """The id of ``ref``'s DuckDB copy to discard now that it was read back (holding the
        lock): when its owner dropped it meanwhile, or when this read serves its last use in
        the plan -- then the copy in memory is the only one (an eviction writes it again)."""
        orphan = self._orphans.pop(ref, None)
        if orphan is not None:
            return orphan
        uses = self._uses.get(ref)
        if ref in self._data and ref in self._spilled and (not uses or len(uses) <= 1):
            return self._spilled.pop(ref)[0]
        return None

    def take_result(self, ref: ChunkRef) -> torch.Tensor:
        """The chunk as an ordinary tensor (copied out of the pinned pool), then dropped."""
        value = self.get(ref)
        with self._lock:
            pinned = ref in self._slots
        if pinned:
            value = value.clone()
        self.drop(ref)
        return value

    def close(self) -> None:
        """Stop the prefetcher, drop every copy and the run's spill table."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._prefetcher is not None:
            self._prefetcher.join()
        if self._opener is not None:
            self._opener.join()
        for ref in list(self._data) + list(self._spilled):
            self.drop(ref)
        with self._pages_lock:
            pages, self._pages = self._pages, None
        if pages is not None:
            pages.close()
