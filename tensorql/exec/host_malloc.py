"""Keep the C allocator from handing chunk-sized buffers back to the kernel after each use.

glibc's ``malloc`` serves a request of 128 KiB or more (the threshold adapts, up to 32 MiB)
with a fresh ``mmap`` and gives it back with ``munmap`` when freed, so every new chunk
(a kernel's output: 4 MiB for 1M float32) costs page faults and the kernel zeroing its pages
-- measured at a quarter of a training step's time on the 2-core CI machine. Raising the
mmap threshold to its maximum (32 MiB) and the trim threshold keeps freed chunk memory in the
process for the next chunk, as the allocators PyTorch recommends for CPU work (jemalloc,
tcmalloc) do; and while tensorql runs a query (:func:`heap_only`) no request is mapped on
its own, however big (``M_MMAP_MAX`` 0): an einsum_benchmark lattice whose intermediates
are 43 MiB each faulted in ~45,000 pages a run, 160 ms, and runs in ~85 ms with none. Only
then: outside queries, a big request that free heap memory cannot serve is mapped as glibc
does by default. One arena (``M_ARENA_MAX`` 1) keeps that memory where every thread finds it:
each worker thread otherwise gets an arena of its own made of 64 MiB heaps, and glibc unmaps
such a heap as soon as it is empty, whatever the trim threshold -- measured on a 2-core
machine, an MLP training step faulted in 38 MiB of fresh pages a step (9,800 faults; 1,300
with one arena) and ran 1.20x torch's time against 1.07x. Threads that made an arena before
the tuning (torch's own, when it ran multi-threaded work before tensorql started) keep
theirs. It changes how memory is reused, never what is computed. What the process keeps is
bounded: free memory at the top of the heap beyond ``TRIM_THRESHOLD_BYTES`` goes back at
once, and after each query :func:`release_free_memory` gives back the free pages anywhere in
the heap once more than ``RETAINED_FREE_BYTES`` are free -- and while a result streams into a
store (``CompiledQuery.stream``), as it goes, once more than ``STREAM_RETAINED_FREE_BYTES`` are:
the chunks the store has written are freed between DuckDB's own allocations, where the heap
cannot shrink (a 6 GiB store held 0.5-0.9 GiB of such free memory until it ended).

Applied once, when ``tensorql`` (any module of it) is imported, before DuckDB's threads and
the executor's make arenas; ``TENSORQL_MALLOC_TUNING=0`` leaves the allocator alone.
Elsewhere than glibc it does nothing.

A query's dense result is new memory by nature (the caller keeps it): one of up to
``HEAP_RESULT_MAX_BYTES`` is memory kept for the next result (a mapping from a pool of freed
results' from ``POOLED_RESULT_MIN_BYTES`` on, the heap below: the pages the last result freed
serve the next), a bigger one is mapped on transparent huge pages (:func:`empty_result`).

>>> isinstance(tune_malloc(), bool)
True
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import math
import mmap
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING

from tensorql.errors import MemoryLimitError
from tensorql.units import format_bytes

if TYPE_CHECKING:  # torch is imported where a tensor is made: `tensorql --version` needs none
    import torch

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 32 << 20   # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD_BYTES = 512 << 20  # freed memory kept before it is returned to the system
RETAINED_FREE_BYTES = 1 << 30  # free heap memory kept across queries (release_free_memory)
GLIBC_MMAP_MAX = 65536  # glibc's default M_MMAP_MAX, restored after a query
RELEASE_CHECK_S = 1.0  # after short queries, the heap's free memory is looked at once a second
LONG_QUERY_S = 0.1  # a query this long has it looked at when it ends, whatever the time since
HEAP_RESULT_MAX_BYTES = 256 << 20  # a dense result up to this size is kept for the next one
POOLED_RESULT_MIN_BYTES = 4 << 20  # ... from this size on in a mapping of its own (the pool)
RESULT_POOL_MAX_BYTES = 512 << 20  # freed results' mappings kept for the next results
STREAM_RETAINED_FREE_BYTES = 128 << 20  # free heap memory kept while a result streams out

_lock = threading.Lock()
_done: list[bool] = []
_libc: list = []
_runs = [0]  # queries running now (heap_only)
_last_check = [float("-inf")]  # when release_free_memory last looked at the heap


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33 and later): heap statistics in size_t fields."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def tune_malloc() -> bool:
    """Set the thresholds once per process; whether they are set (False: not glibc, or
    turned off by ``TENSORQL_MALLOC_TUNING=0``)."""
    with _lock:
        if not _done:
            _done.append(_apply())
        return _done[0]


def _tuning_off() -> bool:
    return os.environ.get("TENSORQL_MALLOC_TUNING", "1").strip().lower() in ("0", "false",
                                                                            "no", "off")


def empty_result(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor for a query's dense result.

    Up to ``HEAP_RESULT_MAX_BYTES`` it is memory the process keeps for the next result: a
    query run again -- a served prompt's 64 MiB logits, a repeated product's 36 MiB -- writes
    its result into the pages the last result freed. From ``POOLED_RESULT_MIN_BYTES`` on it
    is an anonymous mapping of its own that goes back to a pool when the tensor (and every
    array over it) is freed (at most ``RESULT_POOL_MAX_BYTES`` kept; the smallest kept one
    that fits serves, :func:`_pooled`); smaller ones come from the heap, as a query's chunks
    do (:func:`heap_only`). The heap alone did not keep them reliably: a freed 64 MiB result
    lies inside the heap, the next run's small allocations split it, and the next result
    then extended the heap by 64 MiB of fresh pages -- in 2 to 4 runs of 12 (2-core Intel
    Xeon, 2026-11-28). A fresh mapping costs a fault a page, and more on a VM that hands
    its guests' free memory back to the host (virtio-balloon free page reporting, as on this
    repository's 2-core hosts): there pages freed a few seconds before are gone from the host
    and fault in anew -- 36 MiB written in 6-106 ms on fresh huge pages after a 3 s pause
    against 3.4-4.2 ms in kept heap pages (2-core AMD host, 2026-11-28).

    Beyond that it is an anonymous mapping advised onto transparent huge pages
    (``MADV_HUGEPAGE``; Linux's default THP mode, "madvise", gives them only so), given back
    to the system when the tensor (and any numpy array over it) is freed: a 2 GiB result is
    not kept; writing it faults in one 2 MiB page where 4 KiB pages took 512 faults (64 MiB
    in ~12 ms instead of ~31 ms). Elsewhere (or with ``TENSORQL_MALLOC_TUNING=0``) it is
    ``torch.empty``.

    >>> import torch
    >>> kept = empty_result((64, 1 << 17), torch.float32)  # 32 MiB: from the heap
    >>> kept.shape, kept.dtype, kept.is_contiguous()
    (torch.Size([64, 131072]), torch.float32, True)
    """
    import torch

    nbytes = math.prod(shape) * dtype.itemsize
    try:
        if POOLED_RESULT_MIN_BYTES <= nbytes <= HEAP_RESULT_MAX_BYTES and _libc:
            return _pooled(nbytes, dtype).view(shape)
        if nbytes <= HEAP_RESULT_MAX_BYTES:
            with heap_only():  # (nothing more than torch.empty where the tuning is not applied)
                return torch.empty(shape, dtype=dtype)
        if _tuning_off() or not hasattr(mmap, "MADV_HUGEPAGE"):
            return torch.empty(shape, dtype=dtype)
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, RuntimeError, MemoryError) as err:  # ENOMEM; torch's "can't allocate"
        raise MemoryLimitError(
            f"the dense result, {format_bytes(nbytes)} of shape {tuple(shape)}, cannot be "
            f"allocated on this host ({type(err).__name__}: {err}); read it in chunks "
            "(db.store it, then db.iter_chunks) or free memory") from None
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # huge pages unsupported here: still a valid zeroed mapping
        pass
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


def _apply() -> bool:
    if _tuning_off():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and \
        bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)) and \
        bool(mallopt(M_ARENA_MAX, 1))
    if done:
        _libc.append(libc)
    return done


@contextlib.contextmanager
def heap_only():
    """While a query runs: every allocation from the heap, however big (``M_MMAP_MAX`` 0),
    so the chunks it frees serve the next ones -- and the next run's -- without fresh
    pages; glibc's default is restored when no query runs any more (queries may run on
    several threads at once), then :func:`release_free_memory` -- at once after a query of
    ``LONG_QUERY_S`` or more (the big ones, whose freed memory matters), at most once a
    second after short ones (the check would weigh on a 30 ms decoder token). Does nothing
    where the tuning is not applied.

    >>> with heap_only():
    ...     pass
    """
    if not _libc:
        yield
        return
    with _lock:
        if _runs[0] == 0:
            _libc[0].mallopt(M_MMAP_MAX, 0)
        _runs[0] += 1
    started = time.monotonic()
    try:
        yield
    finally:
        with _lock:
            _runs[0] -= 1
            if _runs[0] == 0:
                _libc[0].mallopt(M_MMAP_MAX, GLIBC_MMAP_MAX)
        long_query = time.monotonic() - started >= LONG_QUERY_S
        release_free_memory(every=0.0 if long_query else RELEASE_CHECK_S)


# freed results' mappings, smallest first, and the bytes they hold (see _pooled)
_pool: list[mmap.mmap] = []
_pool_bytes = [0]


def _pooled(nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of ``nbytes`` over a mapping from the pool (the smallest kept one that
    fits, at most twice the size) or a new one; the mapping goes back to the pool when the
    tensor and every view or array over it are freed (``weakref.finalize`` on the buffer
    the tensor holds), while the pool holds less than ``RESULT_POOL_MAX_BYTES``.

    >>> import torch
    >>> first = _pooled(1 << 20, torch.float32)
    >>> where = first.data_ptr()
    >>> del first
    >>> _pooled(1 << 20, torch.float32).data_ptr() == where  # the freed mapping serves
    True
    """
    import torch

    with _lock:
        found = next((m for m in _pool if nbytes <= len(m) <= 2 * nbytes), None)
        if found is not None:
            _pool.remove(found)
            _pool_bytes[0] -= len(found)
    if found is None:
        found = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = (ctypes.c_char * nbytes).from_buffer(found)
    weakref.finalize(buffer, _give_back, found)
    return torch.frombuffer(buffer, dtype=dtype)


def _give_back(mapping: mmap.mmap) -> None:
    """Keep a freed result's mapping for the next result, or let it go (unmapped) where the
    pool is full."""
    with _lock:
        if _pool_bytes[0] + len(mapping) <= RESULT_POOL_MAX_BYTES:
            _pool.append(mapping)
            _pool.sort(key=len)
            _pool_bytes[0] += len(mapping)


def free_heap_bytes() -> int | None:
    """Bytes free in the C heap (glibc's ``mallinfo2().fordblks``), or None where unknown."""
    if not _libc or not hasattr(_libc[0], "mallinfo2"):
        return None
    mallinfo2 = _libc[0].mallinfo2
    mallinfo2.restype = _MallInfo2
    return int(mallinfo2().fordblks)


def release_free_memory(keep: int | None = None, every: float = RELEASE_CHECK_S) -> bool:
    """Give the free pages of the heap back to the system (``malloc_trim``) when more than
    ``keep`` bytes (default ``RETAINED_FREE_BYTES``) are free; whether it did. Called when a
    query ends, so the memory a big query freed is not held by the process for good, while
    a workload of repeated queries keeps its chunks' memory between runs. Counting the free
    bytes walks the heap's free lists (~0.6 ms with 10,000 free chunks), so it is done at
    most once in ``every`` seconds.

    >>> release_free_memory(keep=1 << 62, every=0)
    False
    """
    now = time.monotonic()
    if now - _last_check[0] < every:
        return False
    _last_check[0] = now
    free = free_heap_bytes()
    if free is None or free <= (RETAINED_FREE_BYTES if keep is None else keep):
        return False
    _libc[0].malloc_trim(0)
    return True
