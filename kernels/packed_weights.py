"""Matrix products against stored weights packed once (the BLAS's own blocked layout).

A product ``x @ W`` where ``W`` is a chunk of a stored tensor -- one the chunk store decoded
and caches, which never changes (a replace writes new chunks) and which it hands out as the
same tensor run after run -- is computed against a copy of ``W`` packed once, kept while the
chunk lives. A plain ``sgemm`` packs its right operand afresh on every call, which for a few
hundred rows costs a good part of the product.

Two packings, a registry of :class:`Packing` (:data:`PACKINGS`), the host's chosen by
:func:`choose` (:data:`BACKEND`, its reason in :data:`RULE`):

- ``onednn``: oneDNN's linear over its blocked layout (``mkldnn._reorder_linear_weight``).
  On a 2-core AMD EPYC host, one thread, 64 x 1024 x 2816 ran at 83 GFLOP/s with
  ``torch.mm`` and 108 packed, 256 x 1024 x 2816 at 99 and 110, 1024 x 2048 x 2048 at 100
  and 113. Where MKL is torch's BLAS on an Intel CPU, MKL's own product beat it at every
  shape (2-core Intel Xeon, Sapphire Rapids, AVX-512, MKL 2024.2: 64 x 1024 x 2816 106
  against 88).
- ``mkl``: MKL's packed ``sgemm`` (``cblas_sgemm_pack`` / ``cblas_sgemm_compute``, as
  torch's ``mkl._mkl_reorder_linear_weight`` / ``_mkl_linear`` call them; inductor's
  freezing packs linear weights the same way). On that Intel host, one thread each on both
  cores at once: 256 x 1024 x 2816 at 191-198 GFLOP/s a core against 166-173 for
  ``torch.mm``; 1024^3 at 185-193 against 180. A packed copy serves only the row count it
  was packed for (``Packing.per_rows``; torch's op checks it), so a chunk keeps one copy for
  each of the first :data:`MAX_ROW_COUNTS` row counts its products have; products of any
  other row count keep ``torch.mm``. MKL's buffer is declared 1.2-3.4x its weight, of which
  about the weight's size is touched (resident): :func:`packed_bytes` counts that. Only
products making a new tensor use it: into a tile of a result, or added to one, the scratch's
copy cost more than the packing saved, and ``torch.mm`` / ``addmm_`` write there directly.

By default (``TENSORQL_PACKED_WEIGHTS`` unset or ``auto``) the host gets ``mkl`` where
torch's BLAS is MKL on a ``GenuineIntel`` CPU, else ``onednn``; ``1``/``on`` the same,
``onednn`` or ``mkl`` that one, ``0`` none.

Only chunks the store registered with :func:`mark_immutable` are packed (a tensor a user or
a kernel may write in place is not), also when the tensor's version counter says it was
written; the first product with a chunk (and row count) packs it, so a query computes the
same bits every run. Products of fewer than :data:`MIN_ROWS` rows (a decoded token's), and
products too small for the packed call to pay for itself (:data:`MIN_MACS`), keep
``torch.mm``. The packed copies of a session are dropped with their chunks.

>>> import torch
>>> w, x = torch.randn(256, 256), torch.randn(256, 256)  # MIN_MACS multiply-adds
>>> mark_immutable(w)
>>> bool(torch.allclose(matmul(x, w), x @ w, atol=1e-3)), (packed_bytes() >= w.nbytes) == ENABLED
(True, True)
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Packing:
    """One way to pack a right operand ``(K, N)`` once and multiply by the packed copy.

    ``pack(right, rows)`` makes the copy for products of ``rows`` rows; ``product(left,
    packed, right)`` is ``left @ right`` with it, a new tensor; ``per_rows``: a copy serves
    only the row count it was packed for; ``in_place``: whether a product into a given tile
    (``out``) or added to one (``acc``) still pays with it, made in a scratch and copied or
    added (``torch.mm`` and ``addmm_`` write there directly); ``resident(packed,
    right_bytes)``: the bytes the copy of a right operand of ``right_bytes`` occupies."""

    name: str
    available: bool
    per_rows: bool
    in_place: bool
    pack: Callable[[torch.Tensor, int], Any]
    product: Callable[[torch.Tensor, Any, torch.Tensor], torch.Tensor]
    resident: Callable[[Any, int], int]


def _onednn_pack(right: torch.Tensor, rows: int) -> Any:
    return torch.ops.mkldnn._reorder_linear_weight(right.t().contiguous(), 64)


def _onednn_product(left: torch.Tensor, packed: Any, right: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(left, packed, None, "none", [], "")


def _mkl_pack(right: torch.Tensor, rows: int) -> Any:
    return torch.ops.mkl._mkl_reorder_linear_weight(right.t().contiguous(), rows)


def _mkl_product(left: torch.Tensor, packed: Any, right: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkl._mkl_linear(left, packed, right.t(), None, left.shape[0])


def _has_mkl_packing() -> bool:
    try:
        return torch.backends.mkl.is_available() and \
            torch.ops.mkl._mkl_reorder_linear_weight is not None
    except (AttributeError, RuntimeError):
        return False


PACKINGS: dict[str, Packing] = {
    # a tile's product through a scratch measured faster than MKL's own into the tile (AMD)
    "onednn": Packing("onednn", torch.backends.mkldnn.is_available(), False, True, _onednn_pack,
                      _onednn_product, lambda packed, right_bytes: packed.nbytes),
    # MKL declares 1.2-3.4x the weight; about the weight's bytes are touched (resident)
    # not in place: the scratch's copy or add cost more than packing saves (Intel Xeon, a
    # 3072^3 product in 1024-tiles, K split in three: 188 ms against 167 unpacked)
    "mkl": Packing("mkl", _has_mkl_packing(), True, False, _mkl_pack, _mkl_product,
                   lambda packed, right_bytes: right_bytes),
}

_SETTINGS = {"1": "host", "on": "host", "true": "host", "0": None, "off": None, "false": None,
             "auto": "auto", "": "auto", "onednn": "onednn", "mkl": "mkl"}


def choose(setting: str | None, vendor: str | None, blas_is_mkl: bool, onednn: bool,
           mkl_packing: bool = False) -> tuple[str | None, str]:
    """The packing products use (a name of :data:`PACKINGS`, or None) and why: ``setting``
    is ``TENSORQL_PACKED_WEIGHTS`` (``1``/``on``, ``0``/``off``, ``onednn``, ``mkl``,
    ``auto`` or unset), ``vendor`` the CPU's ``vendor_id``, ``mkl_packing`` whether torch
    has MKL's packed ``sgemm`` ops.

    >>> choose(None, "GenuineIntel", True, True, True)
    ('mkl', "mkl: torch's BLAS is MKL on an Intel CPU, its packed sgemm (auto)")
    >>> choose(None, "AuthenticAMD", True, True, True)[0], choose("0", "AuthenticAMD", True, True)
    ('onednn', (None, 'off (TENSORQL_PACKED_WEIGHTS=0)'))
    """
    wanted = _SETTINGS.get((setting or "").strip().lower(), "auto")
    if wanted is None:
        return None, "off (TENSORQL_PACKED_WEIGHTS=0)"
    have = {"onednn": onednn, "mkl": mkl_packing}
    if wanted in have:
        if have[wanted]:
            return wanted, f"{wanted} (TENSORQL_PACKED_WEIGHTS={wanted})"
        return None, f"off: this torch has no {wanted} packing (TENSORQL_PACKED_WEIGHTS={wanted})"
    why = "(TENSORQL_PACKED_WEIGHTS=1)" if wanted == "host" else "(auto)"
    if blas_is_mkl and vendor == "GenuineIntel":
        if mkl_packing:
            return "mkl", f"mkl: torch's BLAS is MKL on an Intel CPU, its packed sgemm {why}"
        if wanted == "auto":
            return None, ("off: torch's BLAS is MKL on an Intel CPU, faster than oneDNN's "
                          "packed product, and this torch has no MKL packing (auto)")
    if not onednn:
        return None, "off: this torch has no oneDNN"
    return "onednn", (f"onednn: torch's BLAS is not MKL on an Intel CPU "
                      f"({vendor or 'vendor unknown'}) {why}")


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


AVAILABLE = PACKINGS["onednn"].available  # oneDNN's packed ops exist (tests use them)
BACKEND, RULE = choose(os.environ.get("TENSORQL_PACKED_WEIGHTS"), cpu_vendor(),
                       torch.backends.mkl.is_available(), AVAILABLE, PACKINGS["mkl"].available)
ENABLED = BACKEND is not None
# a chunk keeps packed copies for this many row counts at most (a per_rows packing): a
# cached query's products have one or two (full row blocks and the last one); a prompt of a
# new length each call would otherwise pack its last block's weights afresh every call
MAX_ROW_COUNTS = 2
# the torch threads a copy is packed with (see with_pack_threads): the process's count when
# this module is first imported (torch's default: the machine's cores), before any lane
# sets its own
PACK_THREADS = torch.get_num_threads()
# a product of fewer rows than a kept per-rows copy serves, by at most this fraction of its
# own, uses that copy with its rows padded with zeros (the pad's rows computed and dropped):
# a prompt of a new length reuses its full row blocks' and LM head's copies of the last one
PAD_FRACTION = 1 / 8
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
# view key -> (weakref to the chunk, its version, {rows (None: any): packed copy})
_packed: dict[tuple, tuple[Any, int, dict]] = {}


def mark_immutable(chunk: torch.Tensor) -> None:
    """Declare ``chunk`` never written again (a stored tensor's decoded chunk): products
    may use a packed copy of it (or of a 2-D view of it) while it lives."""
    if not ENABLED or chunk.dtype != torch.float32 or chunk.device.type != "cpu":
        return
    root = _root(chunk)
    ident = id(root)
    with _lock:
        _immutable[ident] = weakref.ref(root, lambda _: _forget(ident))


def _wanted(left: torch.Tensor, right: torch.Tensor) -> bool:
    return ENABLED and left.dtype == torch.float32 and left.dim() == 2 and \
        left.shape[0] >= MIN_ROWS and right.dim() == 2 and right.dtype == torch.float32


def matmul(left: torch.Tensor, right: torch.Tensor, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``left @ right`` (2-D; into ``out`` when given), with a packed ``right`` when it is (a
    view of) an immutable chunk, ``left`` has :data:`MIN_ROWS` rows or more and the product
    :data:`MIN_MACS` multiply-adds or more."""
    if not (_wanted(left, right) and left.shape[0] * left.shape[1] * right.shape[1] >= MIN_MACS):
        return torch.mm(left, right) if out is None else torch.mm(left, right, out=out)
    if out is None:
        rows = left.shape[0]
        found = _packed_copy(right, rows, pad=True)
        if found is None:
            return torch.mm(left, right)
        packed, packed_rows = found
        if packed_rows == rows:
            return PACKINGS[BACKEND].product(left, packed, right)
        padded = torch.nn.functional.pad(left, (0, 0, 0, packed_rows - rows))
        return PACKINGS[BACKEND].product(padded, packed, right)[:rows]
    if not PACKINGS[BACKEND].in_place:
        return torch.mm(left, right, out=out)
    rows = block_rows(left.shape[0], out.shape[1] * out.element_size(), OUT_BLOCK_BYTES)
    for r0 in range(0, left.shape[0], rows):
        block = left[r0:r0 + rows]
        found = _packed_copy(right, block.shape[0])
        if found is None:
            torch.mm(block, right, out=out[r0:r0 + rows])
        else:
            out[r0:r0 + rows].copy_(PACKINGS[BACKEND].product(block, found[0], right))
    return out


# Row blocks of a blocked product are a multiple of this many rows where they can be: oneDNN's
# two-thread product of a block of 682 rows (8 MiB of a 3072-wide result) ran 299-306 ms for a
# 3072^3 product against 275-278 for blocks of 640 and 276-288 made at once (AMD EPYC, medians
# of 11, session 26)
BLOCK_ROW_ALIGN = 64


def block_rows(rows: int, row_bytes: int, budget: int) -> int:
    """The rows of each block when ``rows`` rows of ``row_bytes`` each are made in blocks of
    at most ``budget`` bytes (never fewer than :data:`MIN_ROWS` rows): as few blocks as the
    budget allows, of even size, a multiple of :data:`BLOCK_ROW_ALIGN` rows where that fits
    the budget at the cost of one block more at most (the last block may be shorter).

    >>> block_rows(3072, 3072 * 4, 8 << 20)  # not 682 rows: 640, 640, 640, 640, 512
    640
    >>> block_rows(1536, 1536 * 4, 8 << 20)  # two halves, not 1365 + 171
    768
    >>> block_rows(150, 48 * 4, 40 * 48 * 4)  # under 64 rows: even blocks of 38
    38
    """
    cap = max(MIN_ROWS, budget // max(1, row_bytes))
    if rows <= cap:
        return max(1, rows)
    count = -(-rows // cap)
    even = -(-rows // count)
    if even < BLOCK_ROW_ALIGN:
        return even
    up = -(-even // BLOCK_ROW_ALIGN) * BLOCK_ROW_ALIGN
    if up <= cap:
        return up
    down = even // BLOCK_ROW_ALIGN * BLOCK_ROW_ALIGN
    return down if -(-rows // down) <= count + 1 else even


# ``acc += left @ right`` with a packed ``right`` (a K-split product's second and later
# contributions) makes its product row block by row block in a scratch of at most this many
# bytes and adds each block, so the scratch stays in the core's cache (2 MiB L2 on the AMD
# host) between the product and the add.
ACC_BLOCK_BYTES = 1 << 20


def matmul_add(acc: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> bool:
    """``acc += left @ right`` with a packed ``right`` (as :func:`matmul` packs it): True
    when done so, False when ``right`` has no packed copy to use (the caller adds its own
    product, e.g. ``acc.addmm_(left, right)``). Neither packed product has an accumulating
    form that writes in place, so the product is made in row blocks of
    :data:`ACC_BLOCK_BYTES` and each is added to its rows of ``acc`` (any strides). Before,
    every contribution to a K-split product after the first ran MKL's ``addmm_``: two of
    each three of a 3072^3 product's 1024-tiles, unpacked.

    >>> import torch
    >>> w, x, acc = torch.randn(8, 4), torch.randn(32, 8), torch.ones(32, 4)
    >>> mark_immutable(w)
    >>> done = matmul_add(acc, x, w)
    >>> in_place = ENABLED and PACKINGS[BACKEND].in_place  # MKL's: False, the caller adds
    >>> done == in_place, bool(torch.allclose(acc, 1 + x @ w, atol=1e-5)) if done else True
    (True, True)
    """
    if not (_wanted(left, right) and acc.dtype == torch.float32
            and PACKINGS[BACKEND].in_place):
        return False
    rows = block_rows(left.shape[0], acc.shape[1] * acc.element_size(), ACC_BLOCK_BYTES)
    blocks = [(r0, left[r0:r0 + rows]) for r0 in range(0, left.shape[0], rows)]
    copies = [_packed_copy(right, block.shape[0]) for _, block in blocks]
    if any(found is None for found in copies):
        return False
    product = PACKINGS[BACKEND].product
    for (r0, block), (packed, _rows) in zip(blocks, copies):
        acc[r0:r0 + rows].add_(product(block, packed, right))
    return True


def packed_bytes() -> int:
    """Bytes the packed copies held now occupy (see :class:`Packing`'s ``resident``)."""
    with _lock:
        held = [(math.prod(key[1]) * 4, dict(entry[2])) for key, entry in _packed.items()
                if entry[0]() is not None]
    return sum(PACKINGS[name].resident(packed, right_bytes)
               for right_bytes, copies in held for (name, _rows), packed in copies.items())


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor ``t`` is a view of (torch keeps the first one), or ``t`` itself."""
    return t._base if t._base is not None else t


def _packed_copy(right: torch.Tensor, rows: int, pad: bool = False) -> tuple[Any, int] | None:
    """The packed copy of ``right`` for products of ``rows`` rows and the row count it
    serves, made now if need be; None when ``right`` is not (a view of) an immutable chunk,
    or when a per-rows packing already holds :data:`MAX_ROW_COUNTS` other row counts for it.
    ``pad``: a per-rows copy kept for up to :data:`PAD_FRACTION` more rows will do (the
    caller pads its rows with zeros) rather than a new copy."""
    packing = PACKINGS[BACKEND]
    base = _root(right)
    ident = id(base)
    rows_key = (packing.name, rows if packing.per_rows else None)
    with _lock:
        known = _immutable.get(ident)
        if known is None or known() is not base:
            return None
        key = (ident, tuple(right.shape), right.stride(), right.storage_offset())
        entry = _packed.get(key)
        if entry is not None and (entry[0]() is not base or entry[1] != base._version):
            entry = None  # written since it was packed: pack again
        if entry is not None:
            packed = entry[2].get(rows_key)
            if packed is not None:
                return packed, rows
            if pad and packing.per_rows:
                near = min((r for (name, r) in entry[2]
                            if name == packing.name and rows < r <= rows + rows * PAD_FRACTION),
                           default=None)
                if near is not None:
                    return entry[2][(packing.name, near)], near
            if len(entry[2]) >= MAX_ROW_COUNTS:
                return None
    packed = with_pack_threads(packing.pack, right, rows)
    with _lock:
        if known() is base:
            entry = _packed.get(key)
            if entry is None or entry[0]() is not base or entry[1] != base._version:
                entry = (known, base._version, {})
                _packed[key] = entry
            entry[2][rows_key] = packed
    return packed, rows


def with_pack_threads(pack: Callable[..., Any], *args: Any) -> Any:
    """``pack(*args)`` with torch's thread count at :data:`PACK_THREADS` (set for the call
    and put back): MKL lays a packed copy out for the threads it packs with, and a copy
    packed on one thread multiplies on one thread whatever the count afterwards -- so a
    copy packed by a one-thread lane would leave a task run on every thread (a lanes' wide
    or tail task, the serial strategy) on one (1024^3 on two threads, Intel Xeon: 184
    GFLOP/s with a copy packed on one thread, 381 with one packed on two; on one thread 187
    and 194). The count is torch's setting for the whole process, so a lane running beside
    may start a product on more threads while a copy is packed (once per weight and row
    count).

    >>> seen = []
    >>> before = torch.get_num_threads()
    >>> with_pack_threads(lambda: seen.append(torch.get_num_threads()))
    >>> seen == [PACK_THREADS], torch.get_num_threads() == before
    (True, True)
    """
    threads = torch.get_num_threads()
    if threads == PACK_THREADS:
        return pack(*args)
    torch.set_num_threads(PACK_THREADS)
    try:
        return pack(*args)
    finally:
        torch.set_num_threads(threads)


def _forget(ident: int) -> None:
    with _lock:
        _immutable.pop(ident, None)
        for key in [k for k in _packed if k[0] == ident]:
            del _packed[key]
