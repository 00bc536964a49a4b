"""Matrix products against stored weights packed once (oneDNN's blocked layout).

A product ``x @ W`` where ``W`` is a chunk of a stored tensor -- one the chunk store decoded
and caches, which never changes (a replace writes new chunks) and which it hands out as the
same tensor run after run -- is computed with oneDNN's linear on a copy of ``W`` packed into
its blocked layout once, kept while the chunk lives. MKL's ``sgemm`` packs its right operand
afresh on every call, which for a few hundred rows costs a good part of the product: on a
2-core AMD EPYC host, one thread, 64 x 1024 x 2816 ran at 83 GFLOP/s with ``torch.mm`` and 108
with the packed weight, 256 x 1024 x 2816 at 99 and 110, 1024 x 2048 x 2048 at 100 and 113.

Only chunks the store registered with :func:`mark_immutable` are packed (a tensor a user or
a kernel may write in place is not), also when the tensor's version counter says it was
written; the first product with a chunk packs it, so a query computes the same bits every
run. Products of fewer than :data:`MIN_ROWS` rows (a decoded token's), and products too small
for the packed call to pay for itself (:data:`MIN_MACS`), keep ``torch.mm``.
A packed copy is as large as its chunk and is dropped with it: the packed copies of a
session are at most as large as its chunk cache.

Whether to pack depends on the host (:func:`choose`, its verdict in :data:`RULE`). MKL's
``sgemm`` runs its own tuned kernels only on Intel CPUs: on the AMD host above it lost to the
packed product at every shape, while on a 2-core Intel Xeon (Sapphire Rapids, AVX-512, MKL
2024.2) it won at every shape, one thread: 64 x 1024 x 2816 at 106 GFLOP/s against 88 packed,
512 x 768 x 3072 at 122 against 109, 1024 x 3072 x 1024 at 127 against 115. So by default
(``TENSORQL_PACKED_WEIGHTS`` unset or ``auto``) weights are packed unless torch's BLAS is MKL
on a ``GenuineIntel`` CPU; ``TENSORQL_PACKED_WEIGHTS=1`` packs wherever oneDNN exists, ``0``
never packs.

>>> import torch
>>> w, x = torch.randn(256, 256), torch.randn(256, 256)  # MIN_MACS multiply-adds
>>> mark_immutable(w)
>>> bool(torch.allclose(matmul(x, w), x @ w, atol=1e-3)), (packed_bytes() >= w.nbytes) == ENABLED
(True, True)
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

import torch

_SETTINGS = {"1": True, "on": True, "true": True, "0": False, "off": False, "false": False,
             "auto": None, "": None}


def choose(setting: str | None, vendor: str | None, blas_is_mkl: bool, onednn: bool
           ) -> tuple[bool, str]:
    """Whether products pack stored weights, and why: ``setting`` is
    ``TENSORQL_PACKED_WEIGHTS`` (``1``/``on``, ``0``/``off``, ``auto`` or unset), ``vendor``
    the CPU's ``vendor_id``.

    >>> choose(None, "GenuineIntel", True, True)
    (False, "off: torch's BLAS is MKL on an Intel CPU, faster than the packed product (auto)")
    >>> choose(None, "AuthenticAMD", True, True)[0], choose("1", "GenuineIntel", True, True)[0]
    (True, True)
    """
    wanted = _SETTINGS.get((setting or "").strip().lower(), None)
    if wanted is False:
        return False, "off (TENSORQL_PACKED_WEIGHTS=0)"
    if not onednn:
        return False, "off: this torch has no oneDNN"
    if wanted:
        return True, "on (TENSORQL_PACKED_WEIGHTS=1)"
    if blas_is_mkl and vendor == "GenuineIntel":
        return False, ("off: torch's BLAS is MKL on an Intel CPU, faster than the packed "
                       "product (auto)")
    return True, f"on: torch's BLAS is not MKL on an Intel CPU ({vendor or 'vendor unknown'}; auto)"


def cpu_vendor() -> str | None:
    """The CPU's ``vendor_id`` from /proc/cpuinfo (``GenuineIntel``, ``AuthenticAMD``), or
    None where there is none to read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


AVAILABLE = torch.backends.mkldnn.is_available()  # oneDNN's packed ops exist (tests use them)
ENABLED, RULE = choose(os.environ.get("TENSORQL_PACKED_WEIGHTS"), cpu_vendor(),
                       torch.backends.mkl.is_available(), AVAILABLE)
# fewer rows: a matrix-vector product, bound by reading the weight, where the packed product
# was not reliably faster (one row, one thread: 768 x 768 45 against 48 us, 768 x 8000 568
# against 622 us)
MIN_ROWS = 16
# fewer multiply-adds (rows x inner x columns): a small product, where oneDNN's linear costs a
# fixed ~0.15-0.2 ms more than ``torch.mm`` when it runs among MKL's products (one thread, AMD
# EPYC, each call after 20 products of 768 x 64 x 768: 576 x 64 x 4 241 against 68 us,
# 576 x 64 x 64 321 against 162 us; alone, called back to back, it was 48 against 70 us). An
# MPS's two 576 x 64 x 4 products against stored ends cost it 1.7 ms a call. The products
# packing was measured to win (a projection of 64 x 1024 x 2816, 185M) are far above.
MIN_MACS = 1 << 24
# oneDNN's linear has no ``out``: a packed product into a given tensor (a tile of a dense
# result) goes through a scratch of at most this many bytes, row block by row block, so no
# product-sized temporary is made (a 64 MiB tile of a 2 GiB .numpy() result made one per
# worker: 1.11x the result at peak) and the scratch stays in cache for its copy
OUT_BLOCK_BYTES = 8 << 20

_lock = threading.RLock()  # a weakref callback may run where the lock is held
_immutable: dict[int, Any] = {}  # id(tensor) -> weakref to it
_packed: dict[tuple, tuple[Any, int, Any]] = {}  # view key -> (weakref, version, packed)


def mark_immutable(chunk: torch.Tensor) -> None:
    """Declare ``chunk`` never written again (a stored tensor's decoded chunk): products
    may use a packed copy of it (or of a 2-D view of it) while it lives."""
    if not ENABLED or chunk.dtype != torch.float32 or chunk.device.type != "cpu":
        return
    root = _root(chunk)
    ident = id(root)
    with _lock:
        _immutable[ident] = weakref.ref(root, lambda _: _forget(ident))


def matmul(left: torch.Tensor, right: torch.Tensor, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``left @ right`` (2-D; into ``out`` when given), with a packed ``right`` when it is (a
    view of) an immutable chunk, ``left`` has :data:`MIN_ROWS` rows or more and the product
    :data:`MIN_MACS` multiply-adds or more."""
    packed = _packed_copy(right) if ENABLED and left.dtype == torch.float32 and \
        left.dim() == 2 and left.shape[0] >= MIN_ROWS and right.dim() == 2 and \
        right.dtype == torch.float32 and \
        left.shape[0] * left.shape[1] * right.shape[1] >= MIN_MACS else None
    if packed is None:
        return torch.mm(left, right) if out is None else torch.mm(left, right, out=out)
    if out is None:
        return torch.ops.mkldnn._linear_pointwise(left, packed, None, "none", [], "")
    rows = max(MIN_ROWS, OUT_BLOCK_BYTES // max(1, out.shape[1] * out.element_size()))
    for r0 in range(0, left.shape[0], rows):
        out[r0:r0 + rows].copy_(torch.ops.mkldnn._linear_pointwise(
            left[r0:r0 + rows], packed, None, "none", [], ""))
    return out


# ``acc += left @ right`` with a packed ``right`` (a K-split product's second and later
# contributions) makes its product row block by row block in a scratch of at most this many
# bytes and adds each block, so the scratch stays in the core's cache (2 MiB L2 on the AMD
# host) between the product and the add.
ACC_BLOCK_BYTES = 1 << 20


def matmul_add(acc: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> bool:
    """``acc += left @ right`` with a packed ``right`` (as :func:`matmul` packs it): True
    when done so, False when ``right`` has no packed copy to use (the caller adds its own
    product, e.g. ``acc.addmm_(left, right)``). oneDNN's linear has no accumulating form that
    writes in place, so the product is made in row blocks of :data:`ACC_BLOCK_BYTES` and each
    is added to its rows of ``acc`` (any strides). Before, every contribution to a K-split
    product after the first ran MKL's ``addmm_``: two of each three of a 3072^3 product's
    1024-tiles, unpacked.

    >>> import torch
    >>> w, x, acc = torch.randn(8, 4), torch.randn(32, 8), torch.ones(32, 4)
    >>> mark_immutable(w)
    >>> done = matmul_add(acc, x, w)
    >>> done == ENABLED, bool(torch.allclose(acc, 1 + x @ w, atol=1e-5)) if done else True
    (True, True)
    """
    if not (ENABLED and left.dtype == torch.float32 and left.dim() == 2
            and left.shape[0] >= MIN_ROWS and right.dim() == 2
            and right.dtype == torch.float32 and acc.dtype == torch.float32):
        return False
    packed = _packed_copy(right)
    if packed is None:
        return False
    rows = max(MIN_ROWS, ACC_BLOCK_BYTES // max(1, acc.shape[1] * acc.element_size()))
    for r0 in range(0, left.shape[0], rows):
        acc[r0:r0 + rows].add_(torch.ops.mkldnn._linear_pointwise(
            left[r0:r0 + rows], packed, None, "none", [], ""))
    return True


def packed_bytes() -> int:
    """Bytes of the packed copies held now."""
    with _lock:
        return sum(entry[2].nbytes for entry in _packed.values())


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor ``t`` is a view of (torch keeps the first one), or ``t`` itself."""
    return t._base if t._base is not None else t


def _packed_copy(right: torch.Tensor) -> Any:
    base = _root(right)
    ident = id(base)
    with _lock:
        known = _immutable.get(ident)
        if known is None or known() is not base:
            return None
        key = (ident, tuple(right.shape), right.stride(), right.storage_offset())
        entry = _packed.get(key)
        if entry is not None and entry[0]() is base and entry[1] == base._version:
            return entry[2]
    packed = torch.ops.mkldnn._reorder_linear_weight(right.t().contiguous(), 64)
    with _lock:
        if known() is base:
            _packed[key] = (known, base._version, packed)
    return packed


def _forget(ident: int) -> None:
    with _lock:
        _immutable.pop(ident, None)
        for key in [k for k in _packed if k[0] == ident]:
            del _packed[key]
