"""Keep the C allocator from handing chunk-sized buffers back to the kernel after each use.

glibc's ``malloc`` serves a request of 128 KiB or more (the threshold adapts, up to 32 MiB)
with a fresh ``mmap`` and gives it back with ``munmap`` when freed, so every new chunk
(a kernel's output: 4 MiB for 1M float32) costs page faults and the kernel zeroing its pages
-- measured at a quarter of a training step's time on the 2-core CI machine. Raising the
mmap threshold to its maximum (32 MiB) and the trim threshold keeps freed chunk memory in the
process for the next chunk, as the allocators PyTorch recommends for CPU work (jemalloc,
tcmalloc) do. One arena (``M_ARENA_MAX`` 1) keeps that memory where every thread finds it:
each worker thread otherwise gets an arena of its own made of 64 MiB heaps, and glibc unmaps
such a heap as soon as it is empty, whatever the trim threshold -- measured on a 2-core
machine, an MLP training step faulted in 38 MiB of fresh pages a step (9,800 faults; 1,300
with one arena) and ran 1.20x torch's time against 1.07x. Threads that made an arena before
the tuning (torch's own, when it ran multi-threaded work before tensorql started) keep
theirs. It changes how memory is reused, never what is computed.

Applied once, when ``tensorql`` (any module of it) is imported, before DuckDB's threads and
the executor's make arenas; ``TENSORQL_MALLOC_TUNING=0`` leaves the allocator alone.
Elsewhere than glibc it does nothing.

A query's dense result is new memory by nature (the caller keeps it), so a big one is mapped
on transparent huge pages (:func:`empty_result`).

>>> isinstance(tune_malloc(), bool)
True
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import os
import threading

import torch

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 32 << 20   # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD_BYTES = 512 << 20  # freed memory kept before it is returned to the system
HUGE_RESULT_BYTES = 32 << 20  # a dense result this big or bigger goes on huge pages

_lock = threading.Lock()
_done: list[bool] = []


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
    """A new CPU tensor for a query's dense result. One of ``HUGE_RESULT_BYTES`` or more is
    an anonymous mapping advised onto transparent huge pages (``MADV_HUGEPAGE``; Linux's
    default THP mode, "madvise", gives them only so): writing it then faults in one 2 MiB
    page where 4 KiB pages took 512 faults -- the 64 MiB logits of a 512-token prompt are
    written in ~12 ms instead of ~31 ms on this repository's 2-core AMD host. Elsewhere (or
    with ``TENSORQL_MALLOC_TUNING=0``) it is ``torch.empty``. The mapping lives as long as
    the tensor (and any numpy array over it).

    >>> big = empty_result((64, 1 << 17), torch.float32)  # 32 MiB
    >>> big.shape, big.dtype, big.is_contiguous()
    (torch.Size([64, 131072]), torch.float32, True)
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_RESULT_BYTES or _tuning_off() or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
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
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and \
        bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)) and \
        bool(mallopt(M_ARENA_MAX, 1))
