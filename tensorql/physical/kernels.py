"""Task kernels: small frozen objects binding a chunk kernel to its arguments.

Each has ``run(inputs, acc)`` and ``combine(acc, partial)`` as the executor expects.

>>> import torch
>>> k = ContractChunk(in_labels=(("i", "j"), ("j", "k")), out_labels=("i", "k"))
>>> acc = k.run([torch.ones(2, 2), torch.ones(2, 2)], None)
>>> k.run([torch.ones(2, 2), torch.ones(2, 2)], acc)[0, 0].item()
4.0
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensorql_kernels.chunk_einsum import (
    BroadcastJoin,
    bind_contract_to,
    combine,
    contract_into,
    contract_to,
)
from tensorql_kernels.elementwise import apply_map, bind_map

from tensorql.algebra import BOOL, PROBE, UPDATE, AggName, JoinName, join_record
from tensorql.dtypes import itemsize, torch_dtype
from tensorql.errors import ShapeError, StaleTensorError
from tensorql.grid import ChunkGrid, Key
from tensorql.logical.plan import Pointwise, Softmax
from tensorql.storage.chunk_store import ChunkStore, PlanReads

# a call bound to its tensors (a kernel's ``bind``, for :mod:`tensorql.exec.tape`)
Bound = Callable[[], object]


class _NoCombine:
    def combine(self, acc: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        raise AssertionError(f"{type(self).__name__} writes each chunk once")


@dataclass(frozen=True, eq=False)
class LoadChunk(_NoCombine):
    """Read chunk ``key`` of stored tensor ``name``, planned as ``shape`` and ``dtype``: a
    chunk of another layout (the tensor stored again with another shape, dtype or tiling
    after the query was planned) is a :class:`StaleTensorError`, not a wrong result."""

    store: ChunkStore | PlanReads  # a plan's: its PlanReads (one version per run)
    name: str
    key: Key
    shape: tuple[int, ...]
    dtype: str
    stored_shape: tuple[int, ...] | None = None  # the whole tensor's, as planned
    replayable = True  # no effect beyond its result: a plan may replay it (exec.tape)

    @property
    def bytes_read(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    @functools.cached_property
    def _torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    def cache_key(self) -> tuple[Any, Any, Any] | None:
        """What identifies this chunk's bytes across runs (a device keeps its copy under it:
        :mod:`tensorql.exec.device_cache`): the store, the chunk, and the version of the
        tensor the run under way pinned; None where no version is known."""
        return _cache_key(self.store, self.name, ("chunk", self.key))

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        if self.stored_shape is not None:
            check_stored_shape(self.store, self.name, self.stored_shape)
        chunk = self.store.read_chunk(self.name, self.key)
        if chunk.shape != self.shape or chunk.dtype != self._torch_dtype:
            check_layout(self.name, f"chunk {self.key}", chunk, self.shape, self.dtype)
        return chunk


def _cache_key(store: ChunkStore | PlanReads, name: str, what: tuple
               ) -> tuple[Any, Any, Any] | None:
    """(store, (name, dtype, what), version handle) of a read of a pinned stored tensor."""
    if not isinstance(store, PlanReads):
        return None
    version = store.version_of(name)
    if version is None or version.handle is None:
        return None
    return (store.store, (name, version.meta.dtype, what), version.handle)


def check_stored_shape(store: ChunkStore | PlanReads, name: str, shape: Sequence[int]) -> None:
    """StaleTensorError unless the version of ``name`` the run under way pinned has the
    ``shape`` the plan was made for: a tensor stored again larger (or smaller), with chunks
    of the same tiling, would otherwise be read through the old grid -- part of the new
    values, in the old shape. Outside a run (no pinned version) nothing is checked."""
    version = store.version_of(name) if isinstance(store, PlanReads) else None
    if version is None or tuple(version.meta.shape) == tuple(shape):
        return
    raise StaleTensorError(
        f"stored tensor {name!r} changed since this query was planned: it is "
        f"{'x'.join(map(str, version.meta.shape)) or 'a scalar'} where the plan reads "
        f"{'x'.join(map(str, shape)) or 'a scalar'} (it was stored again with another shape); "
        f"build the expression again, e.g. from db.tensor({name!r})")


def check_layout(name: str, what: str, value: torch.Tensor, shape: Sequence[int],
                 dtype: str | None) -> None:
    """StaleTensorError unless ``value`` (``what`` of stored tensor ``name``) has ``shape``
    and ``dtype``.

    >>> try:
    ...     check_layout("x", "chunk (0, 0)", torch.zeros(2, 2), (2, 3), "float32")
    ... except StaleTensorError as err:
    ...     print(str(err)[:79])
    stored tensor 'x' changed since this query was planned: its chunk (0, 0) is 2x2
    """
    want = torch_dtype(dtype) if dtype is not None else value.dtype
    if tuple(value.shape) == tuple(shape) and value.dtype == want:
        return
    got_dtype = str(value.dtype).removeprefix("torch.")
    raise StaleTensorError(
        f"stored tensor {name!r} changed since this query was planned: its {what} is "
        f"{'x'.join(map(str, value.shape))} {got_dtype} where the plan reads "
        f"{'x'.join(map(str, shape))} {dtype or got_dtype} (it was stored again with another "
        f"shape, dtype or tiling); build the expression again, e.g. from db.tensor({name!r})")


@dataclass(frozen=True, eq=False)
class LoadPiece:
    """Assemble one piece ``[lo, hi)`` of a stored tensor from the chunks it overlaps."""

    store: ChunkStore | PlanReads  # a plan's: its PlanReads (one version per run)
    name: str
    grid: ChunkGrid
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    dtype: str

    @property
    def bytes_read(self) -> int:
        return math.prod(b - a for a, b in zip(self.lo, self.hi)) * itemsize(self.dtype)

    def cache_key(self) -> tuple[Any, Any, Any] | None:
        """As :meth:`LoadChunk.cache_key`, for the region."""
        return _cache_key(self.store, self.name, ("region", self.lo, self.hi))

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        check_stored_shape(self.store, self.name, self.grid.shape)
        try:
            region = self.store.read_region(self.name, self.lo, self.hi)
        except ShapeError as err:  # the tensor shrank: the region is off its grid
            raise StaleTensorError(
                f"stored tensor {self.name!r} changed since this query was planned: its "
                f"region {self.lo}..{self.hi} cannot be read ({err}); build the expression "
                f"again, e.g. from db.tensor({self.name!r})") from err
        check_layout(self.name, f"region {self.lo}..{self.hi}", region,
                     tuple(b - a for a, b in zip(self.lo, self.hi)), self.dtype)
        return region

    def combine(self, acc: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a piece is loaded once")

    @classmethod
    def of_region(cls, store: ChunkStore | PlanReads, scan, lo: Sequence[int],
                  hi: Sequence[int]) -> LoadPiece:
        """The piece ``[lo, hi)`` of a logical Scan of a stored tensor (of the region it
        reads, when the scan is a slice)."""
        offset = scan.offset or (0,) * len(lo)
        grid = scan.stored_grid or scan.relation.grid
        return cls(store, scan.source, grid, tuple(int(a + o) for a, o in zip(lo, offset)),
                   tuple(int(b + o) for b, o in zip(hi, offset)), scan.relation.dtype)


@dataclass(frozen=True, eq=False)
class ConstChunk(_NoCombine):
    """A slice of an in-memory constant, taken when the task runs (so a constant whose
    storage is replaced between runs -- a weight being trained -- is read afresh).

    >>> c = torch.arange(4.0)
    >>> k = ConstChunk(c, (slice(2, 4),))
    >>> _ = c.set_(torch.ones(4))
    >>> k.run([], None).tolist()
    [1.0, 1.0]
    """

    value: torch.Tensor
    slices: tuple[slice, ...] | None = None
    inline = True  # a view, no work: the executor runs it in place of scheduling it
    replayable = True  # no effect beyond its result: a plan may replay it (exec.tape)

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        return self.value if self.slices is None else self.value[self.slices]

    def storage_key(self) -> int:
        """The address of the constant's storage: the same while it is written in place,
        another once it is replaced (a plan replayed by :mod:`tensorql.exec.tape` checks it
        instead of slicing the constant again)."""
        return self.value.data_ptr()


@dataclass(frozen=True, eq=False)
class MapChunk(_NoCombine):
    """Elementwise ``fn`` on one chunk."""

    fn: str
    scalar: float | None
    dtype: str
    memory_bound = True  # elementwise: its FLOPs count elements (see the executor)
    replayable = True  # no effect beyond its result: a plan may replay it (exec.tape)

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        return apply_map(self.fn, inputs[0], self.scalar).to(torch_dtype(self.dtype))

    def result_shape(self, inputs: Sequence[torch.Tensor]) -> torch.Size:
        """The shape ``run(inputs)`` has (its input's), known without running it."""
        return inputs[0].shape

    def bind(self, inputs: Sequence[torch.Tensor], out: torch.Tensor) -> tuple[Bound] | None:
        """``run`` of these very tensors into ``out`` as a bound call (see
        :mod:`tensorql.exec.tape`), or None."""
        if out.dtype != torch_dtype(self.dtype):
            return None
        call = bind_map(self.fn, inputs[0], self.scalar, out)
        return None if call is None else (call,)


@dataclass(frozen=True, eq=False)
class ReshapeChunk(_NoCombine):
    """One chunk of a reshape: an input chunk's elements in row-major order, in ``shape``
    (a view when the chunk is contiguous, as RekeyChunk hands back its input whole).

    >>> ReshapeChunk((3, 2)).run([torch.arange(6.0).reshape(2, 3)], None).tolist()
    [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    """

    shape: tuple[int, ...]
    replayable = True  # no effect beyond its result: a plan may replay it (exec.tape)

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        return inputs[0].reshape(self.shape)


@dataclass(frozen=True, eq=False)
class SoftmaxChunk(_NoCombine):
    """``softmax`` (``log_softmax`` with ``log``) of one chunk along ``dim`` (the chunk holds
    the whole dim), in ``dtype``.

    >>> SoftmaxChunk(1, False, "float32").run([torch.tensor([[0.0, 0.0]])], None).tolist()
    [[0.5, 0.5]]
    """

    dim: int
    log: bool
    dtype: str
    memory_bound = True  # elementwise: its FLOPs count elements (see the executor)
    replayable = True  # no effect beyond its result: a plan may replay it (exec.tape)

    @classmethod
    def of(cls, node: Softmax) -> SoftmaxChunk:
        """The kernel of a logical ``Softmax`` step."""
        rel = node.relation
        return cls(rel.labels.index(node.label), node.log, rel.dtype)

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        fn = torch.log_softmax if self.log else torch.softmax
        return fn(inputs[0], self.dim, dtype=torch_dtype(self.dtype))

    def bind(self, inputs: Sequence[torch.Tensor], out: torch.Tensor) -> tuple[Bound] | None:
        """``run`` of these very tensors into ``out`` as a bound call (see
        :mod:`tensorql.exec.tape`), or None.

        >>> x, out = torch.zeros(1, 2), torch.empty(1, 2)
        >>> (call,) = SoftmaxChunk(1, False, "float32").bind([x], out)
        >>> call().tolist()
        [[0.5, 0.5]]
        """
        dtype = torch_dtype(self.dtype)
        if out.dtype != dtype:
            return None
        fn = torch.log_softmax if self.log else torch.softmax
        return (functools.partial(fn, inputs[0], self.dim, dtype=dtype, out=out),)


@dataclass(frozen=True, eq=False)
class RekeyChunk(_NoCombine):
    """Assemble one chunk of a new grid from slices of the old grid's chunks.

    ``pieces[n]`` is ``(source slices, target slices)`` for input ``n``.
    """

    shape: tuple[int, ...]
    pieces: tuple[tuple[tuple[slice, ...], tuple[slice, ...]], ...]
    replayable = True  # no effect beyond its result: a plan may replay it (exec.tape)

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        if len(inputs) == 1 and tuple(inputs[0].shape) == self.shape:
            return inputs[0]
        out = torch.empty(self.shape, dtype=inputs[0].dtype, device=inputs[0].device)
        for chunk, (src, dst) in zip(inputs, self.pieces):
            out[dst] = chunk[src]
        return out


@dataclass(frozen=True, eq=False)
class ContractChunk:
    """The chunk einsum of a Join (+ Aggregate) step, accumulating across chunks with agg."""

    in_labels: tuple[tuple[str, ...], ...]
    out_labels: tuple[str, ...]
    join: str = JoinName.MUL
    agg: str = AggName.SUM
    dtype: str = "float32"
    max_temp_elems: int = 1 << 24

    @functools.cached_property
    def _in_common_dtype(self) -> bool:
        """Whether the operands meet in their common dtype rather than the result's (a
        comparison's bool result; a user's function, whose result dtype is its own)."""
        return join_record(self.join).dtype_rule in (BOOL, PROBE)

    @functools.cached_property
    def replayable(self) -> bool:
        """Whether its call has no effect beyond its result (a plan may replay it:
        :mod:`tensorql.exec.tape`): every join but an optimizer's update, which writes the
        weight and its moments in place."""
        return join_record(self.join).dtype_rule != UPDATE

    @functools.cached_property
    def _result_dtype(self) -> torch.dtype | None:
        """The dtype every operand is cast to (the result's), or None where the operands
        meet in another (their common one, a user's function's arguments, an update's
        scalars: :meth:`_cast` works it out)."""
        if self._in_common_dtype or join_record(self.join).dtype_rule == UPDATE:
            return None
        return torch_dtype(self.dtype)

    def _cast(self, inputs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        dtype = self._result_dtype
        if dtype is not None and all([x.dtype == dtype for x in inputs]):
            return inputs  # nothing to cast (a chain of products: every step)
        dtype = torch_dtype(self.dtype)
        if self._in_common_dtype:  # compared in the operands' common dtype
            dtype = functools.reduce(torch.promote_types, (x.dtype for x in inputs))
        if join_record(self.join).dtype_rule == UPDATE:  # its scalars (lr, step) as they are
            return [x if x.dtype == dtype or not labels else x.to(dtype)
                    for x, labels in zip(inputs, self.in_labels)]
        return [x if x.dtype == dtype else x.to(dtype) for x in inputs]

    @functools.cached_property
    def _broadcast(self) -> BroadcastJoin | None:
        """The join as a torch function over broadcast views, when no label is aggregated
        (an elementwise join, a mask added to scores, a norm's scale applied to rows): then
        the chunk einsum is that, called directly."""
        return BroadcastJoin.plan(self.in_labels, self.out_labels, self.join)

    def result_shape(self, inputs: Sequence[torch.Tensor]) -> torch.Size | None:
        """The shape ``run(inputs, None)`` has where it is known without running it (an
        elementwise join: its operands broadcast), else None."""
        join = self._broadcast
        return None if join is None else join.shape(inputs)

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        join = self._broadcast
        if join is not None and acc is None:
            out = join(self._cast(inputs))
            dtype = torch_dtype(self.dtype)
            return out if out.dtype == dtype else out.to(dtype)
        out = contract_into(acc, self._cast(inputs), self.in_labels, self.out_labels,
                            self.join, self.agg, max_temp_elems=self.max_temp_elems)
        if acc is None and self._in_common_dtype:
            dtype = torch_dtype(self.dtype)
            return out if out.dtype == dtype else out.to(dtype)
        return out

    def run_into(self, inputs: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Like ``run(inputs, None)`` but written into ``out`` (a tile of a dense result); an
        arithmetic join with no aggregated label straight into it (no result-sized temporary,
        e.g. an outer product)."""
        join = self._broadcast
        if join is not None:
            operands = self._cast(inputs)
            if join.writes_into(operands, out):
                return join(operands, out=out)
        return contract_to(out, self._cast(inputs), self.in_labels, self.out_labels,
                           self.join, self.agg, max_temp_elems=self.max_temp_elems)

    def bind(self, inputs: Sequence[torch.Tensor], out: torch.Tensor) -> tuple[Bound] | None:
        """``run_into(inputs, out)`` of these very tensors as one bound call, its path chosen
        once -- the join over broadcast views, or ``torch.mm`` on matrix views
        (:func:`~tensorql_kernels.chunk_einsum.bind_contract_to`) -- for a plan replayed
        over the same buffers (:mod:`tensorql.exec.tape`); None where the operands need a
        cast or the path has no such call.

        >>> k = ContractChunk(in_labels=(("i", "j"), ("j", "k")), out_labels=("i", "k"))
        >>> a, b, out = torch.ones(1, 2), torch.ones(2, 3), torch.empty(1, 3)
        >>> (call,) = k.bind([a, b], out)
        >>> _ = b.fill_(2.0); _ = call(); out.tolist()
        [[4.0, 4.0, 4.0]]
        """
        dtype = torch_dtype(self.dtype)
        if self._in_common_dtype or join_record(self.join).dtype_rule == UPDATE \
                or out.dtype != dtype or any(x.dtype != dtype for x in inputs):
            return None
        join = self._broadcast
        if join is not None:
            call = join.bind(inputs, out)
        else:
            call = bind_contract_to(out, inputs, self.in_labels, self.out_labels, self.join,
                                    self.agg)
        return None if call is None else (call,)

    def combine(self, acc: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        return combine(acc, partial, self.agg)


# Result dtypes whose sums over several tiles are folded in a wider dtype (rounded once).
WIDE_SUMS = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


@dataclass(frozen=True, eq=False)
class ContractSeries:
    """Several contributions to one output chunk as one task: ``kernel`` runs on each
    consecutive group of ``arity`` inputs (one tile of the contracted labels each), folding
    into one accumulator -- the products separate tasks would compute, with one scheduling
    round trip instead of one per tile. A sum in bfloat16 or float16 is folded in float32
    and rounded once at the end (:data:`WIDE_SUMS`): summed in its own dtype, every tile
    would round the running total again, an error growing with the number of tiles.

    >>> k = ContractSeries(ContractChunk((("i", "j"), ("j", "k")), ("i", "k")), arity=2)
    >>> k.run([torch.ones(2, 2)] * 4, None)[0, 0].item()
    4.0
    >>> k16 = ContractSeries(ContractChunk((("i",), ("i",)), (), dtype="bfloat16"), arity=2)
    >>> ones = torch.ones(1, dtype=torch.bfloat16)
    >>> k16.run([torch.tensor([256.0], dtype=torch.bfloat16), ones] + [ones, ones] * 2,
    ...         None).item()  # 256 + 1 + 1 is 258; 256 + 1 alone rounds back to 256
    258.0
    """

    kernel: ContractChunk
    arity: int

    def _groups(self, inputs: Sequence[torch.Tensor]) -> list[Sequence[torch.Tensor]]:
        return [inputs[i:i + self.arity] for i in range(0, len(inputs), self.arity)]

    @functools.cached_property
    def _wide(self) -> torch.dtype | None:
        """The dtype the series' sum is folded in, when wider than the result's."""
        if self.kernel.agg != AggName.SUM:
            return None
        return WIDE_SUMS.get(torch_dtype(self.kernel.dtype))

    def _wide_sum(self, groups: Sequence[Sequence[torch.Tensor]], acc: torch.Tensor | None,
                  wide: torch.dtype) -> torch.Tensor:
        """``acc`` plus every group's product, summed in ``wide`` from zero (so that no
        product is rounded to the result's dtype first), in the result's dtype."""
        if acc is not None:
            total = acc.to(wide)
        else:
            sizes: dict[str, int] = {}
            for x, labels in zip(groups[0], self.kernel.in_labels):
                for label, size in zip(labels, x.shape):
                    sizes[label] = max(size, sizes.get(label, 1))
            total = torch.zeros([sizes[label] for label in self.kernel.out_labels], dtype=wide,
                                device=groups[0][0].device)
        for group in groups:
            total = self.kernel.run(group, total)
        return total.to(torch_dtype(self.kernel.dtype))

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        groups = self._groups(inputs)
        wide = self._wide
        if wide is not None and len(groups) > 1:
            total = self._wide_sum(groups, acc, wide)
            return total if acc is None else acc.copy_(total)
        for group in groups:
            acc = self.kernel.run(group, acc)
        return acc

    def run_into(self, inputs: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Like ``run(inputs, None)`` but the first product is written into ``out``."""
        groups = self._groups(inputs)
        wide = self._wide
        if wide is not None and len(groups) > 1:
            return out.copy_(self._wide_sum(groups, None, wide))
        first, *rest = groups
        acc = self.kernel.run_into(first, out)
        for group in rest:
            acc = self.kernel.run(group, acc)
        return acc

    def combine(self, acc: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        return self.kernel.combine(acc, partial)


def coalesce(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat(parts, dim)``, without a copy when the parts are adjacent views of one
    tensor along ``dim`` (the tiles of a constant, sliced from it): then the view of the
    whole span.

    >>> x = torch.arange(12.0).reshape(3, 4)
    >>> whole = coalesce([x[:, 0:2], x[:, 2:4]], 1)
    >>> whole.data_ptr() == x.data_ptr(), torch.equal(whole, x)
    (True, True)
    >>> coalesce([torch.ones(1, 2), torch.zeros(1, 1)], 1).tolist()
    [[1.0, 1.0, 0.0]]
    """
    first = parts[0]
    base = first._base
    if base is not None and len(parts) > 1 and all(
            p._base is base and p.stride() == first.stride() and p.dim() == first.dim()
            for p in parts):
        offset = first.storage_offset()
        adjacent = True
        for p in parts:
            if p.storage_offset() != offset or any(
                    a != b for d, (a, b) in enumerate(zip(p.shape, first.shape)) if d != dim):
                adjacent = False
                break
            offset += p.shape[dim] * p.stride(dim)
        if adjacent:
            shape = list(first.shape)
            shape[dim] = sum(p.shape[dim] for p in parts)
            return first.as_strided(shape, first.stride(), first.storage_offset())
    return torch.cat(list(parts), dim)


@dataclass(frozen=True, eq=False)
class ContractWhole:
    """Every contribution to one output chunk as ONE product over the whole of the
    contracted label that the contributions tile: each operand's tiles along it are put
    together (:func:`coalesce`: a view when they are adjacent slices of one tensor, else one
    ``torch.cat`` on the operands' device) and ``kernel`` runs once -- one ``torch.mm`` per
    output chunk instead of one per tile of K. On a GPU that is one cuBLAS call, which
    accumulates in float32 inside and rounds a bfloat16 result once, at full occupancy
    (a series of K-tile products summed in float32 reached 0.81 of ``torch.matmul`` on an
    H100, one product over K 0.91). ``axes[p]``: the dim of operand ``p`` that the tiles
    run along (None: the operand has no such dim and is the same chunk in every group).
    The physical planner chooses it (:class:`~tensorql.physical.builder.ContributionSeries`)
    on devices where one call beats a series and the copies fit.

    >>> k = ContractWhole(ContractChunk((("i", "j"), ("j", "k")), ("i", "k")), 2, (1, 0))
    >>> a, b = torch.arange(8.0).reshape(2, 4), torch.arange(12.0).reshape(4, 3)
    >>> got = k.run([a[:, :2], b[:2], a[:, 2:], b[2:]], None)
    >>> torch.equal(got, a @ b)
    True
    """

    kernel: ContractChunk
    arity: int
    axes: tuple[int | None, ...]

    def operands(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The operands of the one product: each operand's tiles put together."""
        groups = [inputs[i:i + self.arity] for i in range(0, len(inputs), self.arity)]
        return [groups[0][p] if axis is None or len(groups) == 1
                else coalesce([g[p] for g in groups], axis)
                for p, axis in enumerate(self.axes)]

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        return self.kernel.run(self.operands(inputs), acc)

    def run_into(self, inputs: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        return self.kernel.run_into(self.operands(inputs), out)

    def combine(self, acc: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        return self.kernel.combine(acc, partial)


@dataclass(frozen=True, eq=False)
class ContractEpilogue(_NoCombine):
    """A contraction's one task per output chunk (``kernel``: its product or series) with
    elementwise map ``fn`` applied in place to the finished chunk -- an activation fused into
    the product that makes its input: no pass over the chunk in a task of its own, no second
    chunk (``relu(X @ W1)``: the product's tile is still in cache when it is clamped). Maps
    with no in-place form (:func:`~tensorql_kernels.elementwise.bind_map` answers None) and
    products handing back a view of an input are mapped into a new tensor instead.

    >>> k = ContractEpilogue(ContractChunk((("i", "j"), ("j", "k")), ("i", "k")), "relu", None,
    ...                      "float32")
    >>> k.run([torch.tensor([[1.0, -1.0]]), torch.tensor([[1.0], [2.0]])], None).tolist()
    [[0.0]]
    >>> out = torch.empty(1, 1)
    >>> k.run_into([torch.tensor([[3.0]]), torch.tensor([[2.0]])], out) is out, out.item()
    (True, 6.0)
    """

    kernel: ContractChunk | ContractSeries | ContractWhole
    fn: str
    scalar: float | None
    dtype: str

    def _finish(self, value: torch.Tensor, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        mine = value.untyped_storage().data_ptr()
        call = None if any(x.untyped_storage().data_ptr() == mine for x in inputs) \
            else bind_map(self.fn, value, self.scalar, value)
        if call is None:
            return apply_map(self.fn, value, self.scalar).to(torch_dtype(self.dtype))
        call()
        return value

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        return self._finish(self.kernel.run(inputs, acc), inputs)

    def run_into(self, inputs: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Like ``run(inputs, None)``, the product written into ``out`` (a tile of a dense
        result) when it can be."""
        value = self.kernel.run_into(inputs, out)
        done = self._finish(value, inputs)
        return done if done is value or value is not out else out.copy_(done)

    def bind(self, inputs: Sequence[torch.Tensor], out: torch.Tensor) -> tuple[Bound, ...] | None:
        """The product's bound calls into ``out`` and the map in place on it (see
        :mod:`tensorql.exec.tape`), or None."""
        bind = getattr(self.kernel, "bind", None)
        calls = None if bind is None else bind(inputs, out)
        finish = bind_map(self.fn, out, self.scalar, out)
        if calls is None or finish is None or out.dtype != torch_dtype(self.dtype):
            return None
        return (*calls, finish)


@dataclass(frozen=True)
class FusedArg:
    """One argument of a fused op: external input ``index`` (>= 0) or the result of op
    ``-index - 1``; ``dim`` is the dim sliced into row blocks (None: taken whole, a
    broadcast input without the blocked label)."""

    index: int
    dim: int | None


@dataclass(frozen=True)
class FusedOp:
    """A pointwise kernel (a map, or a join with no aggregation) inside a fused chain."""

    kernel: MapChunk | ContractChunk
    args: tuple[FusedArg, ...]


@dataclass(frozen=True, eq=False)
class FusedPointwise(_NoCombine):
    """A chain of pointwise kernels over one output chunk, evaluated block by block of rows
    (along output dim ``dim``) so that the intermediates stay in cache: one pass over memory
    instead of one per op, one task instead of one per op and chunk.

    >>> m = MapChunk("exp", None, "float32")
    >>> j = ContractChunk((("i", "j"), ("i", "j")), ("i", "j"), join="add")
    >>> k = FusedPointwise((FusedOp(m, (FusedArg(0, 0),)),
    ...                     FusedOp(j, (FusedArg(-1, 0), FusedArg(1, 0)))), dim=0,
    ...                    block_elems=2)
    >>> k.run([torch.zeros(3, 2), torch.ones(3, 2)], None).tolist()
    [[2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
    """

    ops: tuple[FusedOp, ...]
    dim: int | None
    block_elems: int = 1 << 21
    memory_bound = True  # elementwise: its FLOPs count elements (see the executor)

    @functools.cached_property
    def replayable(self) -> bool:
        """Whether every op of the chain may be replayed (see :class:`ContractChunk`)."""
        return all(getattr(op.kernel, "replayable", False) for op in self.ops)

    @functools.cached_property
    def _last_use(self) -> tuple[int, ...]:
        """For each op, the last op reading its result (its own index when none does)."""
        last = list(range(len(self.ops)))
        for k, op in enumerate(self.ops):
            for arg in op.args:
                if arg.index < 0:
                    last[-arg.index - 1] = k
        return tuple(last)

    def _eval(self, inputs: Sequence[torch.Tensor], lo: int, hi: int,
              whole: bool = False, dest: torch.Tensor | None = None,
              out_size: int | None = None) -> torch.Tensor:
        # a block's intermediates are dropped after their last reader (blocks of
        # ``block_elems``: 8 MiB in float32, a prefill's chunk whole -- smaller blocks cost
        # more in Python and fresh intermediates than the cache saved); ``whole``: the
        # block is every row, the inputs are read as they are (no views to make); ``dest``:
        # where the block's result goes (a block of the output) -- the last op writes it
        # there when its kernel can (no block-sized result to copy), and ``dest`` is returned;
        # ``out_size``: the first block, written into a new output of that many rows, returned
        results: list[torch.Tensor | None] = []
        last = self._last_use
        final = len(self.ops) - 1
        for k, op in enumerate(self.ops):
            args = []
            for arg in op.args:
                if arg.index < 0:
                    args.append(results[-arg.index - 1])
                elif whole or arg.dim is None or self.dim is None:
                    args.append(inputs[arg.index])
                else:
                    args.append(inputs[arg.index].narrow(arg.dim, lo, hi - lo))
            if k == final and dest is not None:
                return self._write(op.kernel, args, dest)
            if k == final and out_size is not None:
                return self._first_block(op.kernel, args, hi - lo, out_size)
            results.append(op.kernel.run(args, None))
            del args
            for arg in op.args:
                if arg.index < 0 and last[-arg.index - 1] == k:
                    results[-arg.index - 1] = None
        return results[-1]

    def _rows(self, inputs: Sequence[torch.Tensor]) -> tuple[int, int]:
        """The blocked dim's size and the rows of a block. Blocks are a CPU cache's business:
        on a GPU the chain runs over the whole chunk (a block there is only more launches,
        each too small to fill the device -- a LLaMA layer's rotary chain of 8M elements
        was 32 blocks of ~5 launches each)."""
        for op in self.ops:
            for arg in op.args:
                if arg.index >= 0 and arg.dim is not None:
                    x = inputs[arg.index]
                    n = x.shape[arg.dim]
                    if x.device.type != "cpu":
                        return n, n
                    return n, max(1, self.block_elems // max(1, x.numel() // max(1, n)))
        return 1, 1

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        n, rows = self._rows(inputs)
        if self.dim is None or rows >= n:
            return self._eval(inputs, 0, n, whole=True)
        out = self._eval(inputs, 0, rows, out_size=n)
        self._fill(out, inputs, rows, n, rows)
        return out

    def _first_block(self, kernel: MapChunk | ContractChunk, args: list[torch.Tensor],
                     rows: int, size: int) -> torch.Tensor:
        """The output (``size`` rows along the blocked dim), made for the first block's
        last op of ``args`` and that block (``rows`` rows) written into it."""
        shape = kernel.result_shape(args)
        if shape is None:  # made, then copied into an output like it
            first = kernel.run(args, None)
            out = first.new_empty(_with_size(first.shape, self.dim, size))
            out.narrow(self.dim, 0, rows).copy_(first)
            return out
        # on the operands' device (a 0-d host scalar among them is not where it runs)
        device = next((x.device for x in args if x.device.type != "cpu"), args[0].device)
        out = torch.empty(_with_size(shape, self.dim, size), dtype=torch_dtype(kernel.dtype),
                          device=device)
        self._write(kernel, args, out.narrow(self.dim, 0, rows))
        return out

    def bind(self, inputs: Sequence[torch.Tensor], out: torch.Tensor) -> tuple[Bound, ...] | None:
        """The chain of these very tensors into ``out`` as bound calls, one an op, each op's
        result a buffer of its own (made here by running the chain once) -- for a plan
        replayed over the same buffers (:mod:`tensorql.exec.tape`); None when the chunk is
        evaluated in several blocks of rows (their intermediates are the blocks').

        >>> m = MapChunk("relu", None, "float32")
        >>> j = ContractChunk((("i",), ("i",)), ("i",), join="add")
        >>> k = FusedPointwise((FusedOp(m, (FusedArg(0, 0),)),
        ...                     FusedOp(j, (FusedArg(-1, 0), FusedArg(1, 0)))), dim=0)
        >>> x, y, out = torch.tensor([-1.0, 2.0]), torch.ones(2), torch.empty(2)
        >>> calls = k.bind([x, y], out)
        >>> _ = x.mul_(-1.0); _ = [call() for call in calls]; out.tolist()
        [2.0, 1.0]
        """
        n, rows = self._rows(inputs)
        if self.dim is not None and rows < n:
            return None
        results: list[torch.Tensor] = []
        calls: list[Bound] = []
        last = len(self.ops) - 1
        for k, op in enumerate(self.ops):
            args = [results[-a.index - 1] if a.index < 0 else inputs[a.index] for a in op.args]
            target = out if k == last else op.kernel.run(args, None)
            ptr = target.untyped_storage().data_ptr()
            if k < last and any(x.untyped_storage().data_ptr() == ptr for x in args):
                results.append(target)  # a view of its input (a cast to its own dtype)
                continue
            bound = op.kernel.bind(args, target)
            calls.extend(bound if bound is not None else (_copy_call(op.kernel, args, target),))
            results.append(target)
        return tuple(calls)

    def run_into(self, inputs: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Like ``run(inputs, None)`` but written into ``out`` block by block."""
        n, rows = self._rows(inputs)
        if self.dim is None or out.dim() == 0:
            return out.copy_(self._eval(inputs, 0, n))
        self._fill(out, inputs, 0, n, rows)
        return out

    def _fill(self, out, inputs, start: int, n: int, rows: int) -> None:
        for lo in range(start, n, rows):
            hi = min(n, lo + rows)
            self._eval(inputs, lo, hi, dest=out.narrow(self.dim, lo, hi - lo))

    @staticmethod
    def _write(kernel: MapChunk | ContractChunk, args: list[torch.Tensor],
               dest: torch.Tensor) -> torch.Tensor:
        """``kernel`` of ``args`` written into ``dest``: straight there when the kernel binds
        to it (an arithmetic join, a map with an ``out=`` form, of ``dest``'s dtype and
        shape), else made and copied."""
        calls = kernel.bind(args, dest) if kernel.result_shape(args) == dest.shape else None
        if calls is None:
            return dest.copy_(kernel.run(args, None))
        for call in calls:
            call()
        return dest


def _with_size(shape: Sequence[int], dim: int, size: int) -> list[int]:
    """``shape`` with ``size`` at ``dim``."""
    return [size if d == dim else n for d, n in enumerate(shape)]


def _copy_call(kernel: MapChunk | ContractChunk, args: list[torch.Tensor],
               out: torch.Tensor) -> Bound:
    """``kernel.run(args)`` copied into ``out``, as a bound call."""
    return lambda: out.copy_(kernel.run(args, None))


@dataclass(frozen=True, eq=False)
class SliceChunk:
    """Cut ``slices`` out of one chunk (on the device holding it, before it is sent)."""

    slices: tuple[slice, ...]

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        return inputs[0][self.slices].clone(memory_format=torch.contiguous_format)

    def combine(self, acc: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a slice is cut once")


@dataclass(frozen=True, eq=False)
class FoldPartial:
    """Fold a partial aggregate (received from another device, or the part ``slices`` of a
    partial held here) into its output chunk."""

    agg: str
    kernel: ContractChunk
    slices: tuple[slice, ...] | None = None

    def _part(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        return inputs[0] if self.slices is None else inputs[0][self.slices]

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        if acc is None:
            return self._part(inputs).clone(memory_format=torch.contiguous_format)
        return self.kernel.combine(acc, self._part(inputs))

    def run_into(self, inputs: Sequence[torch.Tensor], dest: torch.Tensor) -> torch.Tensor:
        """The first contribution, copied straight into ``dest`` (a tile of a dense result)."""
        part = self._part(inputs)
        if part.shape != dest.shape or part.dtype != dest.dtype:
            return self.run(inputs, None)
        return dest.copy_(part)

    def combine(self, acc: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        return self.kernel.combine(acc, partial)

def pointwise_kernel(node: Pointwise, max_temp_elems: int = 1 << 24) -> FusedPointwise:
    """The kernel of a :class:`~tensorql.logical.plan.Pointwise` node: its ops in order,
    each outside input sliced into the row blocks of the node's ``row_dim`` where it has
    that label (a broadcast input without it is taken whole).

    >>> from tensorql.grid import ChunkGrid
    >>> from tensorql.logical.plan import PointwiseOp, Scan, TensorRelation
    >>> rel = TensorRelation(("i", "j"), ChunkGrid((3, 2), (3, 2)), "float32")
    >>> node = Pointwise(rel, sources=(Scan(rel, source="x"),), source_labels=(("i", "j"),),
    ...                  ops=(PointwiseOp("exp", (0,), rel), PointwiseOp("relu", (-1,), rel)))
    >>> pointwise_kernel(node).run([torch.zeros(3, 2)], None).tolist()
    [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    """
    dim = node.row_dim
    row = node.relation.labels[dim] if dim is not None else None
    ops = []
    for op in node.ops:
        args = tuple(FusedArg(a, None) if a < 0 else
                     FusedArg(a, node.source_labels[a].index(row)
                              if row in node.source_labels[a] else None)
                     for a in op.args)
        if op.is_map:
            kernel: MapChunk | ContractChunk = MapChunk(op.fn, op.scalar, op.relation.dtype)
        else:
            kernel = ContractChunk(in_labels=op.input_labels, out_labels=op.relation.labels,
                                   join=op.fn, dtype=op.relation.dtype,
                                   max_temp_elems=max_temp_elems)
        ops.append(FusedOp(kernel, args))
    return FusedPointwise(tuple(ops), dim)

