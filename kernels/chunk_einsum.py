"""The one chunk kernel: an extended einsum over a few chunks, plus in-place accumulation.

Labels are strings (they may be longer than one character); the kernel maps them to letters
when it calls ``torch.einsum``. Results never alias the inputs, so a caller may accumulate
into them in place.

>>> import torch
>>> a, b = torch.ones(2, 3), torch.ones(3, 4)
>>> chunk_einsum([a, b], [("i", "j"), ("j", "k")], ("i", "k")).tolist()[0]
[3.0, 3.0, 3.0, 3.0]
>>> chunk_einsum([a, b], [("i", "j"), ("j", "k")], ("i", "k"), join=JoinName.ADD,
...              agg=AggName.MAX)[0, 0]
tensor(2.)
"""

from __future__ import annotations

import functools
import math
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tensorql_kernels.algebra import JOINS, AggName, JoinName, agg_of, is_update
from tensorql_kernels.optimizer_update import optimizer_update
from tensorql_kernels.packed_weights import MIN_ROWS as PACK_MIN_ROWS
from tensorql_kernels.packed_weights import matmul as packed_matmul
from tensorql_kernels.packed_weights import matmul_add as packed_matmul_add

Labels = Sequence[str]

_MUL, _SUM = JoinName.MUL, AggName.SUM


@dataclass(frozen=True)
class BroadcastJoin:
    """A join with no aggregated label -- every operand's labels are output labels, none
    repeated -- as the join's torch function folded over views of the operands broadcast to
    the output's dims: no einsum call, no expanded copy. Planned once per kernel
    (:meth:`plan`), applied to each chunk's operands.

    >>> j = BroadcastJoin.plan([("b", "d"), ("b",)], ("b", "d"), JoinName.MUL)
    >>> j([torch.ones(2, 3), torch.tensor([2.0, 3.0])]).tolist()
    [[2.0, 2.0, 2.0], [3.0, 3.0, 3.0]]
    >>> BroadcastJoin.plan([("i", "j"), ("j", "k")], ("i", "k"), _MUL) is None  # j aggregated
    True
    """

    fn: Callable[..., torch.Tensor]
    perms: tuple[tuple[int, ...] | None, ...]  # per operand: its dims in output order
    present: tuple[tuple[bool, ...], ...]  # per operand, per output dim: whether it has it

    @classmethod
    def plan(cls, in_labels: Sequence[Labels], out_labels: Labels,
             join: str) -> BroadcastJoin | None:
        """The broadcast form of the join, or None when a label is aggregated or repeated
        (or the join is not a binary function folded over the operands)."""
        record = JOINS.get(join)
        fn = None if record is None or record.nary else record.fn
        out = tuple(out_labels)
        if fn is None or len(in_labels) < 2 or len(set(out)) != len(out):
            return None
        covered: set[str] = set()
        perms, present = [], []
        for labels in in_labels:
            labels = tuple(labels)
            if len(set(labels)) != len(labels) or not set(labels) <= set(out):
                return None
            covered |= set(labels)
            order = sorted(range(len(labels)), key=lambda i: out.index(labels[i]))
            perms.append(None if order == list(range(len(labels))) else tuple(order))
            present.append(tuple(label in labels for label in out))
        if covered != set(out):
            return None
        return cls(fn, tuple(perms), tuple(present))

    def writes_into(self, operands: Sequence[torch.Tensor], out: torch.Tensor) -> bool:
        """Whether ``self(operands, out=out)`` writes the join straight into ``out`` (a tile of
        a dense result): an arithmetic join (:data:`OUT_JOINS`) of operands of ``out``'s
        dtype, so the values are those of ``self(operands)``."""
        return self.fn in OUT_JOINS and all(x.dtype == out.dtype for x in operands)

    def shape(self, operands: Sequence[torch.Tensor]) -> torch.Size:
        """The shape of the join of ``operands`` (their views broadcast), without making it.

        >>> j = BroadcastJoin.plan([("i",), ("j",)], ("i", "j"), JoinName.MUL)
        >>> tuple(j.shape([torch.ones(2), torch.ones(3)]))
        (2, 3)
        """
        return torch.broadcast_shapes(*(view.shape for view in self._views(operands)))

    def __call__(self, operands: Sequence[torch.Tensor],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """The join of ``operands``; with ``out`` (see :meth:`writes_into`) written into it
        and ``out`` returned, no temporary the size of the result.

        >>> j = BroadcastJoin.plan([("i",), ("j",)], ("i", "j"), JoinName.MUL)
        >>> tile = torch.zeros(4, 6)[1:3, 2:5]
        >>> j([torch.tensor([1.0, 2.0]), torch.ones(3)], out=tile).tolist()
        [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]
        """
        views = self._views(operands)
        if out is not None:
            self.fn(views[0], views[1], out=out)
            for view in views[2:]:
                self.fn(out, view, out=out)  # elementwise: each element reads only itself
            return out
        value = self.fn(views[0], views[1])
        for view in views[2:]:
            value = self.fn(value, view)
        return value


    def _views(self, operands: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each operand permuted to the output's label order, with size-1 dims where it
        lacks a label (so that the join broadcasts)."""
        views = []
        for x, perm, present in zip(operands, self.perms, self.present):
            if perm is not None:
                x = x.permute(perm)
            if not all(present):
                sizes = iter(x.shape)
                x = x.reshape([next(sizes) if has else 1 for has in present])
            views.append(x)
        return views

    def bind(self, operands: Sequence[torch.Tensor],
             out: torch.Tensor) -> Callable[[], torch.Tensor] | None:
        """A call writing the join of these very tensors into ``out`` each time it is made
        (their views worked out once), or None where :meth:`writes_into` says no.

        >>> j = BroadcastJoin.plan([("i", "j"), ("j",)], ("i", "j"), JoinName.ADD)
        >>> a, b, out = torch.ones(2, 3), torch.arange(3.0), torch.empty(2, 3)
        >>> call = j.bind([a, b], out)
        >>> _ = b.mul_(2.0); call()[1].tolist()
        [1.0, 3.0, 5.0]
        """
        if not self.writes_into(operands, out):
            return None
        views = self._views(operands)
        if not all(_same_storage(v, x) for v, x in zip(views, operands)):
            return None  # a reshape that copied: not a view to keep
        fn, first, second, rest = self.fn, views[0], views[1], tuple(views[2:])
        if not rest:
            return functools.partial(fn, first, second, out=out)

        def call() -> torch.Tensor:
            fn(first, second, out=out)
            for view in rest:
                fn(out, view, out=out)
            return out
        return call


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# the joins whose torch function writes into a given tensor (``out=``) with the values it
# returns when the operands have the output's dtype (no promotion: a division of integers is
# not one; the adjoints ``silu_grad`` and ``relu_grad`` write their one kernel's result into it)
OUT_JOINS = frozenset({torch.mul, torch.add, torch.sub, torch.maximum, torch.minimum,
                       JOINS[JoinName.SILU_GRAD].fn, JOINS[JoinName.RELU_GRAD].fn})


def diagonalize(x: torch.Tensor, labels: Labels) -> tuple[torch.Tensor, tuple[str, ...]]:
    """Take diagonals of repeated labels: ``(ii) -> (i)``. Returns a view and its labels."""
    labels = list(labels)
    while len(set(labels)) < len(labels):
        for a, label in enumerate(labels):
            b = labels.index(label, a + 1) if labels.count(label) > 1 else -1
            if b >= 0:
                x = x.diagonal(0, a, b)
                labels = [lab for k, lab in enumerate(labels) if k not in (a, b)] + [label]
                break
    return x, tuple(labels)


def _letters(label_sets: Sequence[Labels]) -> dict[str, str]:
    names: dict[str, str] = {}
    for labels in label_sets:
        for label in labels:
            if label not in names:
                if len(names) == len(string.ascii_letters):
                    raise ValueError("a chunk kernel supports at most 52 distinct labels")
                names[label] = string.ascii_letters[len(names)]
    return names


def _dense(x: torch.Tensor) -> bool:
    """Whether ``x`` covers its memory exactly once in some dim order (contiguous up to a
    permutation of its dims): then it is kept as is -- forcing a permuted result (a
    transposed product's) contiguous is a slow transposing copy, while elementwise kernels and
    in-place accumulation work on it directly.

    >>> x = torch.ones(2, 3)
    >>> _dense(x.T), _dense(x[:, :2]), _dense(torch.ones(3).expand(2, 3))
    (True, False, False)
    """
    if x.is_contiguous():
        return True
    expected = 1
    dims = sorted(((size, stride) for size, stride in zip(x.shape, x.stride()) if size != 1),
                  key=lambda dim: dim[1])
    for size, stride in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _owned(out: torch.Tensor, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``out`` as a tensor that shares no memory with ``inputs``."""
    ptr = out.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() == ptr for t in inputs):
        return out.clone(memory_format=torch.contiguous_format)
    return out


def reduce(x: torch.Tensor, dims: Sequence[int], agg: str) -> torch.Tensor:
    """Reduce ``dims`` of ``x`` with aggregation ``agg`` (any registered one)."""
    dims = list(dims)
    if not dims:
        return x
    return agg_of(agg).reduce(x, dims)


def combine(acc: torch.Tensor, partial: torch.Tensor, agg: str) -> torch.Tensor:
    """Fold ``partial`` into ``acc`` in place with ``agg``; returns ``acc``."""
    return agg_of(agg).combine(acc, partial)


def chunk_einsum(
    operands: Sequence[torch.Tensor],
    labels: Sequence[Labels],
    out_labels: Labels,
    join: str = _MUL,
    agg: str = _SUM,
    *,
    max_temp_elems: int = 1 << 24,
) -> torch.Tensor:
    """``out[o] = AGG_a JOIN(operands...)`` on whole chunks; never aliases an input.

    Non-multiplicative joins materialise the broadcast join; ``max_temp_elems`` bounds that
    temporary by slicing the largest aggregated label.
    """
    if is_update(join):  # an optimizer's update: one fused pass, no aggregation
        return optimizer_update(join, operands)
    pairs = [diagonalize(x, lab) for x, lab in zip(operands, labels)]
    xs = [p[0] for p in pairs]
    labs = [p[1] for p in pairs]
    out_labels = tuple(out_labels)
    if join == _MUL and agg == _SUM and exact_integer_path(xs):
        # no BLAS for integers here: the products and their sum in exact integer arithmetic,
        # wrapped to the operands' dtype as the BLAS path (and numpy) wrap
        dtype = functools.reduce(torch.promote_types, (x.dtype for x in xs))
        out = _broadcast_join_reduce(xs, labs, out_labels, join, agg, max_temp_elems)
        out = out if out.dtype == dtype else out.to(dtype)
    elif join == _MUL and agg == _SUM:
        dot = _rowwise_dot(xs, labs, out_labels)
        if dot is not None:
            return dot
        pair = PairProduct.for_operands(xs, labs, out_labels)
        if pair is not None:
            return pair(xs[0], xs[1])
        names = _letters([*labs, out_labels])
        eq = ",".join("".join(names[lab] for lab in lab_set) for lab_set in labs)
        eq += "->" + "".join(names[lab] for lab in out_labels)
        out = torch.einsum(eq, *xs)
    else:
        out = _broadcast_join_reduce(xs, labs, out_labels, join, agg, max_temp_elems)
    return _owned(out if _dense(out) else out.contiguous(), operands)


def memory_order(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...] | None:
    """The dims of a tensor of ``shape`` and ``strides`` from outermost to innermost in memory
    when it is dense but not contiguous (a permuted view of a contiguous tensor: a previous
    product's layout), else None (contiguous already, or not dense: read in label order).

    >>> x = torch.ones(2, 3, 4)
    >>> memory_order(x.shape, x.stride()) is None
    True
    >>> y = x.permute(2, 0, 1)
    >>> memory_order(y.shape, y.stride())
    (1, 2, 0)
    >>> memory_order((2, 3), (6, 1)) is None  # a slice's rows: not dense
    True
    """
    order = tuple(sorted(range(len(shape)), key=lambda d: (-strides[d], d)))
    if order == tuple(range(len(shape))):
        return None
    expected = 1
    for d in reversed(order):
        if shape[d] != 1:
            if strides[d] != expected:
                return None
            expected *= shape[d]
    return order


def _compose(order: tuple[int, ...] | None, perm: tuple[int, ...] | None
             ) -> tuple[int, ...] | None:
    """The one permute of a tensor that first puts its dims in memory ``order`` and then
    applies ``perm`` to them (None: neither)."""
    if order is None:
        return perm
    return order if perm is None else tuple(order[j] for j in perm)


# the stacked product (:class:`StackedProduct`) replaces a copy of the operand only where its
# matrices are wide enough for the batched BLAS call to run near a single product's speed: an
# MPS's 12 x (64 x 64 x 64) steps took 97 us against 112 us copied, 8 x (32 x 32 x 4) 16 us
# against 11 us (one thread, AMD EPYC)
STACK_MIN_COLS = 16
STACK_MIN_ROWS = 8


@dataclass(frozen=True)
class PairProduct:
    """A two-operand contraction (no label kept by both, none summed out of one alone) as
    one matrix product of the operands laid out as matrices -- opt_einsum's ``tensordot``
    form -- planned once per labels, shapes and memory layouts (:meth:`plan`, cached).

    Each operand's dims fall in two groups: the contracted ones and its own output (free)
    ones, taken in the order the operand lies in memory (an operand that is a permuted view
    -- a previous product laid out its own way -- is read through that view, not copied back
    into its labels' order). An operand whose groups already lie in two blocks is only viewed
    as a matrix (transposed when the contracted block leads); any other is copied once into
    the layout that keeps its innermost (unit-stride) dim innermost -- the copy then reads
    memory in order, where ``torch.einsum``'s own order for the copy can gather with a stride
    (an einsum_benchmark random network's products: 12.3 ms of ``torch.einsum`` against 6.9
    ms, one thread) -- unless :class:`StackedProduct` needs no copy at all. The contracted
    dims are ordered as in the larger operand, which is thus copied only if its own dims
    interleave the groups. The product is laid out as the output's labels ask when they read
    ``free(b) + free(a)`` (computed as ``b^T a^T``), else returned as a permuted view of it
    (dense: kept as is by the caller, and read as such by the next product).

    >>> a, b = torch.rand(2, 3, 4), torch.rand(4, 5, 2)
    >>> pair = PairProduct.plan(("i", "j", "k"), ("k", "l", "i"), ("j", "l"), a.shape, b.shape)
    >>> torch.allclose(pair(a, b), torch.einsum("ijk,kli->jl", a, b))
    True
    >>> PairProduct.plan(("b", "i"), ("b", "j"), ("b", "i", "j"), (2, 3), (2, 4)) is None
    True
    """

    perms: tuple[tuple[int, ...] | None, tuple[int, ...] | None]  # per operand, before reshape
    mats: tuple[tuple[int, int], tuple[int, int]]  # per operand, the 2-D shape reshaped to
    transposed: tuple[bool, bool]  # per operand: its matrix is read transposed
    swap: bool  # compute (b^T a^T): the product's rows are b's free dims
    shape: tuple[int, ...]  # the product viewed with its free dims
    out_perm: tuple[int, ...] | None  # the view's dims in output order

    @staticmethod
    def for_operands(xs: Sequence[torch.Tensor], labs: Sequence[Labels],
                     out_labels: Labels) -> PairProduct | StackedProduct | None:
        """The plan for these operands, or None when the contraction has another form (or
        the operands are not two of one floating dtype)."""
        if len(xs) != 2:
            return None
        a, b = xs
        if a.dtype != b.dtype or not a.is_floating_point():
            return None
        return PairProduct.plan(tuple(labs[0]), tuple(labs[1]), tuple(out_labels),
                                tuple(a.shape), tuple(b.shape), a.stride(), b.stride())

    @staticmethod
    @functools.lru_cache(maxsize=4096)
    def plan(la: tuple[str, ...], lb: tuple[str, ...], out: tuple[str, ...],
             shape_a: tuple[int, ...], shape_b: tuple[int, ...],
             strides_a: tuple[int, ...] | None = None,
             strides_b: tuple[int, ...] | None = None) -> PairProduct | StackedProduct | None:
        """The plan, or None (a label repeated, kept by both operands, or summed out of one
        alone; an output label neither has). ``strides_a`` / ``strides_b``: the operands'
        strides (None: contiguous)."""
        if len(set(la)) != len(la) or len(set(lb)) != len(lb) or len(set(out)) != len(out):
            return None
        both = set(la) & set(lb)
        if both & set(out) or set(out) != (set(la) | set(lb)) - both:
            return None
        sizes = dict(zip(la, shape_a)) | dict(zip(lb, shape_b))
        orders = (None if strides_a is None else memory_order(shape_a, strides_a),
                  None if strides_b is None else memory_order(shape_b, strides_b))
        # each operand's labels as its memory lays them out
        la, lb = (labels if order is None else tuple(labels[d] for d in order)
                  for labels, order in ((la, orders[0]), (lb, orders[1])))
        stacked = StackedProduct.plan(la, lb, out, sizes, orders)
        if stacked is not None:
            return stacked
        free_a = tuple(lab for lab in la if lab not in both)
        free_b = tuple(lab for lab in lb if lab not in both)
        larger = la if math.prod(shape_a) >= math.prod(shape_b) else lb
        contracted = tuple(lab for lab in larger if lab in both)
        perms, mats, transposed = [], [], []
        # a as (free_a, contracted), b as (contracted, free_b)
        for labels, order, rows, cols in ((la, orders[0], free_a, contracted),
                                          (lb, orders[1], contracted, free_b)):
            n_rows = math.prod(sizes[lab] for lab in rows)
            n_cols = math.prod(sizes[lab] for lab in cols)
            if labels == rows + cols:
                perm, mat, trans = None, (n_rows, n_cols), False
            elif labels == cols + rows:
                perm, mat, trans = None, (n_cols, n_rows), True
            elif labels[-1] in cols:  # a copy keeping the innermost dim innermost
                perm = tuple(labels.index(lab) for lab in rows + cols)
                mat, trans = (n_rows, n_cols), False
            else:
                perm = tuple(labels.index(lab) for lab in cols + rows)
                mat, trans = (n_cols, n_rows), True
            perms.append(_compose(order, perm)), mats.append(mat), transposed.append(trans)
        swap = out == free_b + free_a and out != free_a + free_b
        joint = free_b + free_a if swap else free_a + free_b
        out_perm = None if joint == out else tuple(joint.index(lab) for lab in out)
        return PairProduct((perms[0], perms[1]), (mats[0], mats[1]),
                           (transposed[0], transposed[1]), swap,
                           tuple(sizes[lab] for lab in joint), out_perm)

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        (pa, pb), (ma, mb), (ta, tb) = self.perms, self.mats, self.transposed
        left = (a if pa is None else a.permute(pa)).reshape(ma)
        right = (b if pb is None else b.permute(pb)).reshape(mb)
        left, right = (left.T if ta else left), (right.T if tb else right)
        out = torch.mm(right.T, left.T) if self.swap else torch.mm(left, right)
        out = out.view(self.shape)
        return out if self.out_perm is None else out.permute(self.out_perm)


@dataclass(frozen=True)
class StackedProduct:
    """A pair product where one operand ``x`` lies in memory as ``F1 + C + F2`` -- free dims
    on both sides of the contracted block, which :class:`PairProduct` would copy into a
    matrix -- and the other, ``y``, as a matrix over ``C`` (in the same order) and its free
    dims ``G``: ``out[f1] = y^T @ x[f1]`` for every ``f1``, one batched product (``bmm``
    with ``y`` broadcast, stride 0) laid out ``F1 + G + F2``, and no copy of either operand.
    An MPS step ``peh,ef->pfh`` is one: 12 blocks of 64 x 64 x 64, and the next step, which
    contracts ``p`` and ``f``, then finds them leading and reads the result as a matrix.

    >>> x, y = torch.rand(3, 16, 16), torch.rand(16, 8)
    >>> s = PairProduct.plan(("p", "e", "h"), ("e", "f"), ("p", "h", "f"), x.shape, y.shape)
    >>> type(s).__name__, torch.allclose(s(x, y), torch.einsum("peh,ef->phf", x, y))
    ('StackedProduct', True)
    """

    x_first: bool  # x is the first operand
    x_perm: tuple[int, ...] | None  # x's dims in memory order (None: contiguous)
    x_shape: tuple[int, int, int]  # (f1, c, f2)
    y_perm: tuple[int, ...] | None
    y_mat: tuple[int, int]  # y's matrix as it lies in memory
    y_contracted_first: bool  # y lies as C + G (read transposed), else G + C
    shape: tuple[int, ...]  # the product viewed with its dims F1 + G + F2
    out_perm: tuple[int, ...] | None  # the view's dims in output order

    @classmethod
    def plan(cls, la: tuple[str, ...], lb: tuple[str, ...], out: tuple[str, ...],
             sizes: dict[str, int], orders: tuple[tuple[int, ...] | None, ...]
             ) -> StackedProduct | None:
        """The stacked form of the pair product of operands whose labels are ``la`` and
        ``lb`` as they lie in memory (``orders``: how their dims were permuted to that), or
        None where one operand is not ``F1 + C + F2``, the other not a matrix over ``C`` and
        ``G``, or the blocks too narrow (:data:`STACK_MIN_COLS`, :data:`STACK_MIN_ROWS`)."""
        for x_first, lx, ly in ((True, la, lb), (False, lb, la)):
            shared = [i for i, lab in enumerate(lx) if lab in ly]
            if not shared or shared[0] == 0 or shared[-1] == len(lx) - 1 \
                    or shared[-1] - shared[0] + 1 != len(shared):
                continue  # x's contracted labels are not one block with free dims around it
            c = lx[shared[0]:shared[-1] + 1]
            f1, f2 = lx[:shared[0]], lx[shared[-1] + 1:]
            if ly[:len(c)] == c:
                g, contracted_first = ly[len(c):], True
            elif ly[len(ly) - len(c):] == c:
                g, contracted_first = ly[:len(ly) - len(c)], False
            else:
                continue
            n = {name: math.prod(sizes[lab] for lab in part)
                 for name, part in (("f1", f1), ("c", c), ("f2", f2), ("g", g))}
            if n["f2"] < STACK_MIN_COLS or n["g"] < STACK_MIN_ROWS or n["c"] < STACK_MIN_ROWS:
                continue
            joint = f1 + g + f2
            y_mat = (n["c"], n["g"]) if contracted_first else (n["g"], n["c"])
            return cls(x_first, orders[0 if x_first else 1], (n["f1"], n["c"], n["f2"]),
                       orders[1 if x_first else 0], y_mat, contracted_first,
                       tuple(sizes[lab] for lab in joint),
                       None if joint == out else tuple(joint.index(lab) for lab in out))
        return None

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        x, y = (a, b) if self.x_first else (b, a)
        x3 = (x if self.x_perm is None else x.permute(self.x_perm)).reshape(self.x_shape)
        ym = (y if self.y_perm is None else y.permute(self.y_perm)).reshape(self.y_mat)
        left = ym.T if self.y_contracted_first else ym  # (g, c)
        out = torch.bmm(left.expand(self.x_shape[0], *left.shape), x3).view(self.shape)
        return out if self.out_perm is None else out.permute(self.out_perm)


def exact_integer_path(operands: Sequence[torch.Tensor]) -> bool:
    """Whether a sum of products of ``operands`` must avoid ``torch.einsum``: integer (or
    bool) operands off the CPU, where torch has no integer matrix product (CUDA's ``bmm`` /
    ``baddbmm`` are floating only). Such a contraction multiplies and sums elementwise instead
    (:func:`_broadcast_join_reduce`, bounded by ``max_temp_elems``): exact, as integers must be.

    >>> x = torch.ones(2, 2, dtype=torch.int64)
    >>> exact_integer_path([x, x]), exact_integer_path([x.to("meta"), x.to("meta")])
    (False, True)
    >>> exact_integer_path([x.to("meta").float(), x.to("meta").float()])
    False
    """
    return any(not (x.dtype.is_floating_point or x.dtype.is_complex) for x in operands) \
        and any(x.device.type != "cpu" for x in operands)


def _rowwise_dot(xs, labs, out_labels) -> torch.Tensor | None:
    """Two operands with the same labels in the same order, summed over their trailing
    labels (a norm's mean square ``bsd,bsd->bs``): one ``torch.linalg.vecdot`` over the
    flattened trailing dims, where ``torch.einsum`` runs a batched product of 1-row matrices
    (8x256x512: 1.2 ms against 0.14 ms). None when the contraction has another form.

    >>> x = torch.arange(6.0).reshape(2, 3)
    >>> _rowwise_dot([x, x], [("i", "j"), ("i", "j")], ("i",)).tolist()
    [5.0, 50.0]
    """
    if len(xs) != 2 or tuple(labs[0]) != tuple(labs[1]) or xs[0].dtype != xs[1].dtype \
            or not xs[0].is_floating_point() or xs[0].shape != xs[1].shape:
        return None
    kept = len(out_labels)
    if tuple(labs[0][:kept]) != tuple(out_labels) or kept == len(labs[0]):
        return None
    rows = xs[0].shape[:kept]
    a, b = (x.reshape(*rows, -1) for x in xs)
    return torch.linalg.vecdot(a, b)


def _broadcast_join_reduce(xs, labs, out_labels, join, agg, max_temp_elems):
    sizes: dict[str, int] = {}
    for x, lab_set in zip(xs, labs):
        sizes.update(zip(lab_set, x.shape))
    aggregated = [lab for lab in sizes if lab not in out_labels]
    total = math.prod(sizes.values())
    if total > max_temp_elems and aggregated and agg_of(agg).associative:
        widest = max(aggregated, key=lambda lab: sizes[lab])
        if sizes[widest] > 1:
            step = max(1, sizes[widest] * max_temp_elems // total)
            result = None
            for start in range(0, sizes[widest], step):
                parts = [
                    x.narrow(lab_set.index(widest), start, min(step, sizes[widest] - start))
                    if widest in lab_set else x
                    for x, lab_set in zip(xs, labs)
                ]
                piece = _broadcast_join_reduce(parts, labs, out_labels, join, agg,
                                               max_temp_elems)
                result = piece if result is None else combine(result, piece, agg)
            return result
    joint = list(out_labels) + aggregated
    expanded = []
    for x, lab_set in zip(xs, labs):
        order = [lab_set.index(lab) for lab in joint if lab in lab_set]
        view = x.permute(order)
        shape = [sizes[lab] if lab in lab_set else 1 for lab in joint]
        expanded.append(view.reshape(shape))
    value = JOINS[join].apply(expanded)
    value = value.expand([sizes[lab] for lab in joint])
    return reduce(value, range(len(out_labels), len(joint)), agg)


def contract_into(
    acc: torch.Tensor | None,
    operands: Sequence[torch.Tensor],
    labels: Sequence[Labels],
    out_labels: Labels,
    join: str = _MUL,
    agg: str = _SUM,
    *,
    max_temp_elems: int = 1 << 24,
) -> torch.Tensor:
    """Compute the chunk einsum and fold it into ``acc`` (None: start a new accumulator).

    A matrix product accumulates straight into ``acc`` with ``addmm_`` (no temporary), or,
    against a stored weight with a packed copy, as the packed product added in row blocks
    (:func:`tensorql_kernels.packed_weights.matmul_add`); into a wider ``acc`` (float32 for
    bfloat16 operands) its product is added.
    """
    if acc is None and join == _MUL and agg == _SUM and len(operands) == 2:
        pair = pair_route(operands, labels, out_labels)
        if pair is not None:  # chunk_einsum's pair product, its route known
            out = pair(operands[0], operands[1])  # a product torch.mm made: no input's
            return out if _dense(out) else out.contiguous()
    mats = _matmul(operands, labels, out_labels, join, agg)
    if mats is not None:
        left, right = blas_operand(mats[0]), blas_operand(mats[1])
        if acc is None:  # a fresh product, laid out as the output wants it
            return _mm_transposed(left, right) if mats[2] else packed_matmul(left, right)
        target = acc.T if mats[2] else acc
        if target.dtype == left.dtype:
            _addmm_into(target, left, right)
        else:  # a wider accumulator: a low-precision sum folded in float32
            target.add_(_mm_wide(left, right, target.dtype))
        return acc
    flat = _flat_matmul(operands, labels, out_labels, join, agg)
    if flat is not None:
        left, right, shape = blas_operand(flat[0]), blas_operand(flat[1]), flat[2]
        if acc is None:
            return packed_matmul(left, right).view(shape)
        target = _as_2d(acc, left.shape[0], right.shape[1])
        if target is not None:
            if target.dtype == left.dtype:
                _addmm_into(target, left, right)
            else:
                target.add_(_mm_wide(left, right, target.dtype))
            return acc
    partial = chunk_einsum(operands, labels, out_labels, join, agg,
                           max_temp_elems=max_temp_elems)
    if acc is None:
        return partial
    return combine(acc, partial.to(acc.dtype), agg)


# pair_route's answers by (labels, output labels, shapes, strides, dtypes, device type)
_PAIR_ROUTES: dict[tuple, PairProduct | StackedProduct | None] = {}
PAIR_ROUTES_MAX = 4096


def pair_route(operands: Sequence[torch.Tensor], labels: Sequence[Labels],
               out_labels: Labels) -> PairProduct | StackedProduct | None:
    """The :class:`PairProduct` (or :class:`StackedProduct`) that a fresh sum of products of
    these two operands comes to through :func:`contract_into` (no plain or flattened matrix
    product, no diagonal, no integer path, no row-wise dot: :func:`chunk_einsum`'s pair
    product), or None for any other route. An operand of three or more dims that is a
    permuted view (a previous product's layout) goes to the pair product, which reads it as
    it lies, rather than to the flattened matrix product, which would copy it back into its
    labels' order. Decided once per labels, shapes, strides, dtypes and device type and kept:
    a chain of small products (a tensor network's 119 steps of 64x64x16 blocks) otherwise
    worked the route out again on every call, ~30 Python calls each.

    >>> a, b = torch.rand(2, 3, 4), torch.rand(4, 5, 2)
    >>> pair = pair_route([a, b], [("i", "j", "k"), ("k", "l", "i")], ("j", "l"))
    >>> torch.allclose(pair(a, b), torch.einsum("ijk,kli->jl", a, b))
    True
    >>> pair_route([a[0], b[:, :, 0]], [("j", "k"), ("k", "l")], ("j", "l")) is None  # mm
    True
    """
    a, b = operands
    try:
        key = (tuple(labels), tuple(out_labels), a.shape, b.shape, a.stride(), b.stride(),
               a.dtype, b.dtype, a.device.type)
        return _PAIR_ROUTES[key]
    except KeyError:
        pass
    except TypeError:  # labels given as lists: not kept
        return _pair_route(operands, labels, out_labels)
    if len(_PAIR_ROUTES) >= PAIR_ROUTES_MAX:
        _PAIR_ROUTES.clear()
    route = _PAIR_ROUTES[key] = _pair_route(operands, labels, out_labels)
    return route


def _pair_route(operands: Sequence[torch.Tensor], labels: Sequence[Labels],
                out_labels: Labels) -> PairProduct | StackedProduct | None:
    (a, b), (la, lb) = operands, (tuple(labels[0]), tuple(labels[1]))
    if a.dtype != b.dtype or not a.is_floating_point() or exact_integer_path(operands):
        return None
    if len(set(la)) != len(la) or len(set(lb)) != len(lb) or la == lb:
        return None  # diagonals first, or a row-wise dot
    if _matmul(operands, labels, out_labels, _MUL, _SUM) is not None:
        return None
    permuted = any(x.ndim > 2 and memory_order(x.shape, x.stride()) is not None
                   for x in (a, b))
    if not permuted and _flat_plan(la, lb, tuple(out_labels), tuple(a.shape),
                                   tuple(b.shape)) is not None:
        return None
    return PairProduct.for_operands(operands, (la, lb), tuple(out_labels))


def contract_to(
    out: torch.Tensor,
    operands: Sequence[torch.Tensor],
    labels: Sequence[Labels],
    out_labels: Labels,
    join: str = _MUL,
    agg: str = _SUM,
    *,
    max_temp_elems: int = 1 << 24,
) -> torch.Tensor:
    """Write the chunk einsum into ``out`` (overwriting it; ``out`` may be a strided view, e.g.
    a tile of a larger result) and return ``out``. A matrix product goes straight into it.

    >>> out = torch.zeros(4, 6)
    >>> a, b = torch.ones(2, 3), torch.ones(3, 2)
    >>> contract_to(out[:2, 2:4], [a, b], [("i", "j"), ("j", "k")], ("i", "k")).sum().item()
    12.0
    >>> out.sum().item()
    12.0
    """
    mats = _matmul(operands, labels, out_labels, join, agg)
    if mats is not None and mats[0].dtype == out.dtype:
        left, right = blas_operand(mats[0]), blas_operand(mats[1])
        if not blas_legal(out):  # into a scratch product, then copied
            return out.copy_(_mm_transposed(left, right) if mats[2] else torch.mm(left, right))
        if mats[2]:
            _mm_transposed(left, right, out=out)
        else:
            packed_matmul(left, right, out=out)
        return out
    if is_update(join):
        return optimizer_update(join, operands, out)
    flat = _flat_matmul(operands, labels, out_labels, join, agg)
    if flat is not None:
        left, right, shape = blas_operand(flat[0]), blas_operand(flat[1]), flat[2]
        target = _as_2d(out, left.shape[0], right.shape[1])
        if target is not None and target.dtype == left.dtype and blas_legal(target):
            packed_matmul(left, right, out=target)
            return out
        return out.copy_(packed_matmul(left, right).view(shape))
    value = chunk_einsum(operands, labels, out_labels, join, agg, max_temp_elems=max_temp_elems)
    return out.copy_(value)


def bind_contract_to(out: torch.Tensor, operands: Sequence[torch.Tensor],
                     labels: Sequence[Labels], out_labels: Labels, join: str = _MUL,
                     agg: str = _SUM) -> Callable[[], object] | None:
    """A call computing :func:`contract_to` of these very tensors into ``out`` each time it
    is made, the path chosen once (their views as matrices, the BLAS checks, the einsum
    equation): for a plan run again and again over the same buffers
    (``tensorql.exec.tape``). A sum of products only, of floating operands of ``out``'s
    dtype; None for any other (or where a view would be a copy).

    >>> a, b, out = torch.ones(1, 2, 3), torch.ones(4, 3), torch.empty(1, 2, 4)
    >>> call = bind_contract_to(out, [a, b], [("b", "s", "d"), ("v", "d")], ("b", "s", "v"))
    >>> _ = a.mul_(2.0); _ = call(); out[0, 0].tolist()
    [6.0, 6.0, 6.0, 6.0]
    """
    if join != _MUL or agg != _SUM or not out.is_floating_point() \
            or any(x.dtype != out.dtype for x in operands):
        return None
    mats = _matmul(operands, labels, out_labels, join, agg)
    if mats is not None:
        left, right, transposed = mats
        if transposed:  # as _mm_transposed: (right^T left^T), plain torch.mm
            return _bound_mm(right.T, left.T, out, packed=False)
        return _bound_mm(left, right, out, packed=True)
    flat = _flat_matmul(operands, labels, out_labels, join, agg)
    if flat is not None:
        left, right, _ = flat
        target = _as_2d(out, left.shape[0], right.shape[1])
        if target is None or not (_view_of_any(left, operands)
                                  and _view_of_any(right, operands)):
            return None  # a reshape that copied: not a view to keep
        return _bound_mm(left, right, target, packed=True)
    if any(len(set(lab)) != len(lab) for lab in labels):
        return None  # diagonals: left to contract_to
    dot = _rowwise_views(operands, labels, out_labels)
    if dot is not None:
        return functools.partial(torch.linalg.vecdot, dot[0], dot[1], out=out)
    if len(operands) == 2:
        bmm = _bound_bmm(out, operands[0], operands[1], tuple(labels[0]), tuple(labels[1]),
                         tuple(out_labels))
        if bmm is not None:
            return bmm
    if PairProduct.for_operands(operands, labels, out_labels) is not None:
        return None  # its layouts: left to contract_to
    names = _letters([*labels, out_labels])
    eq = ",".join("".join(names[lab] for lab in lab_set) for lab_set in labels)
    eq += "->" + "".join(names[lab] for lab in out_labels)
    xs = tuple(operands)
    return lambda: out.copy_(torch.einsum(eq, *xs))


def _view_of_any(view: torch.Tensor, operands: Sequence[torch.Tensor]) -> bool:
    """Whether ``view`` shares memory with one of ``operands`` (is a view, not a copy)."""
    return any(_same_storage(view, x) for x in operands)


def _bound_mm(left: torch.Tensor, right: torch.Tensor, target: torch.Tensor,
              packed: bool) -> Callable[[], object] | None:
    """``target = left @ right`` as one bound call (a packed weight's product where
    :func:`contract_to` would take it), or None when a matrix is not BLAS-legal as it is."""
    if not (blas_legal(left) and blas_legal(right) and blas_legal(target)):
        return None
    if packed and left.shape[0] >= PACK_MIN_ROWS:
        return functools.partial(packed_matmul, left, right, out=target)
    return functools.partial(torch.mm, left, right, out=target)


def _bound_bmm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, la: tuple[str, ...],
               lb: tuple[str, ...], lo: tuple[str, ...]) -> Callable[[], object] | None:
    """A two-operand sum of products as one ``torch.bmm`` on views of the operands and of
    ``out`` -- (batch, a's own, contracted) by (batch, contracted, b's own) into (batch, a's
    own, b's own), the batch and own labels in the output's order -- when all three are
    views (no copy: the strides allow); else None. What ``torch.einsum`` would do, worked
    out once: its per-call planning and any copy it makes of a strided operand are gone.

    >>> a, b, out = torch.ones(2, 3, 4), torch.ones(2, 5, 4), torch.empty(2, 3, 5)
    >>> call = _bound_bmm(out, a, b, ("h", "s", "e"), ("h", "t", "e"), ("h", "s", "t"))
    >>> _ = call(); out[1, 2].tolist()
    [4.0, 4.0, 4.0, 4.0, 4.0]
    """
    if len(set(la)) != len(la) or len(set(lb)) != len(lb) or len(set(lo)) != len(lo) \
            or set(lo) != (set(la) | set(lb)) - ((set(la) & set(lb)) - set(lo)):
        return None  # a label repeated, or summed out of one operand alone
    batch = tuple(lab for lab in lo if lab in la and lab in lb)
    own_a = tuple(lab for lab in lo if lab in la and lab not in lb)
    own_b = tuple(lab for lab in lo if lab in lb and lab not in la)
    summed = tuple(lab for lab in la if lab in lb and lab not in lo)
    sizes = dict(zip(la, a.shape)) | dict(zip(lb, b.shape))

    def view(x: torch.Tensor, labels: tuple[str, ...], *groups: tuple[str, ...]):
        order = [labels.index(lab) for group in groups for lab in group]
        shape = [math.prod(sizes[lab] for lab in group) for group in groups]
        v = x.permute(order).reshape(shape)
        return v if _same_storage(v, x) else None

    left = view(a, la, batch, own_a, summed)
    right = view(b, lb, batch, summed, own_b)
    target = view(out, lo, batch, own_a, own_b)
    if left is None or right is None or target is None:
        return None
    return functools.partial(torch.bmm, left, right, out=target)


def _rowwise_views(xs, labs, out_labels) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The two views :func:`_rowwise_dot` hands ``torch.linalg.vecdot``, when it applies
    and they are views (not copies)."""
    if len(xs) != 2 or tuple(labs[0]) != tuple(labs[1]) or xs[0].shape != xs[1].shape:
        return None
    kept = len(out_labels)
    if tuple(labs[0][:kept]) != tuple(out_labels) or kept == len(labs[0]):
        return None
    rows = xs[0].shape[:kept]
    a, b = (x.reshape(*rows, -1) for x in xs)
    if not (_same_storage(a, xs[0]) and _same_storage(b, xs[1])):
        return None
    return a, b


def blas_legal(t: torch.Tensor) -> bool:
    """Whether the 2-D ``t`` can be handed to a BLAS as it is: read the way torch reads it
    (row-major when torch calls it contiguous, column-major otherwise), one dim has unit
    stride and the other's stride -- the leading dimension -- is at least the extent of the
    first. CPU BLAS tolerates a short leading dimension on a dim of size 1 (torch patches it
    for cuBLAS's classic interface too); cuBLASLt rejects it (``CUBLAS_STATUS_INVALID_VALUE``)
    -- a (1, k) row of a column-major buffer, the transpose of an (n, 1) result.

    >>> x = torch.ones(4, 6)
    >>> blas_legal(x), blas_legal(x.T), blas_legal(x[:, 1:3]), blas_legal(x[::2, ::2])
    (True, True, True, False)
    >>> blas_legal(torch.ones(3, 1).T), blas_legal(torch.ones(3, 1))  # strides (1, 1)
    (False, True)
    """
    rows, cols = t.shape
    s0, s1 = t.stride()
    if rows > 1 and cols > 1:  # the common case: each reading is legal where torch takes it
        return (s1 == 1 and s0 >= cols) or (s0 == 1 and s1 >= rows)
    row_major = (s1 == 1 or cols == 1) and s0 >= max(1, cols)
    col_major = (s0 == 1 or rows == 1) and s1 >= max(1, rows)
    if _dense(t):  # torch reads it one way only (non-overlapping and dense)
        return row_major if t.is_contiguous() else col_major
    return row_major or col_major


def blas_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` when :func:`blas_legal`, else a row-major copy (only where a dim of size 1 or
    an odd stride makes it illegal: a copy of a row or a column, or one torch would make).

    >>> blas_operand(torch.ones(3, 1).T).stride()
    (3, 1)
    """
    return t if blas_legal(t) else t.clone(memory_format=torch.contiguous_format)


def _mm_transposed(left: torch.Tensor, right: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``(left @ right).T`` computed as ``right.T @ left.T`` (laid out as a transposed
    output wants it), the transposed operands made BLAS-legal too."""
    a, b = blas_operand(right.T), blas_operand(left.T)
    return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)


# Devices whose torch.mm returns a low-precision product in float32 (``out_dtype``): the
# tensor cores' float32 sums, unrounded ("meta": the device memory of the tests' FakeCuda,
# so CPU CI runs the CUDA branch; no real work runs on meta tensors)
_WIDE_MM_DEVICES = frozenset({"cuda", "meta"})


def _mm_wide(left: torch.Tensor, right: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``left @ right`` for an accumulator of the wider ``dtype``: on CUDA straight in
    ``dtype`` (float32 from bf16/fp16, no rounding to the operands' dtype); elsewhere in the
    operands' dtype (the CPU has no such product), rounded once, to be widened by the add."""
    if left.device.type in _WIDE_MM_DEVICES and dtype == torch.float32 \
            and left.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(left, right, out_dtype=dtype)
    return torch.mm(left, right)


def _addmm_into(target: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """``target += left @ right``: with a packed ``right`` where it has one (row blocks of
    oneDNN's product added), else in place when ``target``'s strides are BLAS-legal, else
    through a scratch product."""
    if packed_matmul_add(target, left, right):
        return
    if blas_legal(target):
        target.addmm_(left, right)
    else:
        target.add_(torch.mm(left, right))


def _matmul(operands, labels, out_labels, join, agg):
    """(left, right, output_transposed) when the chunk einsum is one plain 2-D matrix product
    of same-dtype floating matrices, else None."""
    if join != _MUL or agg != _SUM or len(operands) != 2:
        return None
    mats = _as_matmul(operands, labels, out_labels)
    if mats is None or mats[0].dtype != mats[1].dtype:
        return None
    return mats


def _flat_matmul(operands, labels, out_labels, join, agg):
    """(left, right, output shape) when the contraction is one matrix product of the
    operands flattened: one operand's labels are ``P + C`` or ``C + P`` and the other's
    ``C + Q`` or ``Q + C``, with the output ``P + Q`` -- a projection such as
    ``bsd,dhe->bshe`` or ``bsd,vd->bsv``, or a weight's gradient such as ``bsd,bsf->df``.
    ``torch.mm`` on the flattened views (transposed where ``C`` leads or trails) replaces
    ``torch.einsum``, whose own overhead (~10 us a call) dominated small products and whose
    permuting copies cost large ones ~20 %.

    >>> a, b = torch.ones(2, 3, 4), torch.ones(5, 4)
    >>> left, right, shape = _flat_matmul([a, b], [("b", "s", "d"), ("v", "d")],
    ...                                   ("b", "s", "v"), _MUL, _SUM)
    >>> tuple(left.shape), tuple(right.shape), shape
    ((6, 4), (4, 5), (2, 3, 5))
    >>> _flat_matmul([a, a], [("b", "s", "d"), ("b", "s", "e")], ("d", "e"), _MUL, _SUM)[2]
    (4, 4)
    """
    if join != _MUL or agg != _SUM or len(operands) != 2:
        return None
    a, b = operands
    if a.dtype != b.dtype or not a.is_floating_point():
        return None
    plan = _flat_plan(tuple(labels[0]), tuple(labels[1]), tuple(out_labels), tuple(a.shape),
                      tuple(b.shape))
    if plan is None:
        return None
    swapped, (m, k, n), (left_t, right_t), shape = plan
    x, y = (b, a) if swapped else (a, b)
    left = x.reshape(k, m).T if left_t else x.reshape(m, k)
    right = y.reshape(n, k).T if right_t else y.reshape(k, n)
    return left, right, shape


@functools.lru_cache(maxsize=4096)
def _flat_plan(la: tuple[str, ...], lb: tuple[str, ...], out: tuple[str, ...],
               shape_a: tuple[int, ...], shape_b: tuple[int, ...]):
    """How :func:`_flat_matmul` views the operands, decided once per labels and shapes:
    (operands swapped, (m, k, n), (left read transposed, right read transposed), output
    shape), or None. A label of extent 1 that one operand alone has and the output lacks
    (summed over one value: a slice of a stored tensor along a label the product sums, as
    LLaMA's keys and values each read one half of their joint weight) is left out: a
    flattened view never depends on it.

    >>> _flat_plan(("b", "s", "d"), ("p", "k", "d"), ("b", "s", "k"), (1, 4, 8), (1, 6, 8))
    (False, (4, 8, 6), (False, True), (1, 4, 6))
    """
    if len(set(la)) != len(la) or len(set(lb)) != len(lb) or len(set(out)) != len(out):
        return None
    la, shape_a = _without_summed_singletons(la, shape_a, lb, out)
    lb, shape_b = _without_summed_singletons(lb, shape_b, la, out)
    for swapped, (lx, sx), (ly, sy) in ((False, (la, shape_a), (lb, shape_b)),
                                        (True, (lb, shape_b), (la, shape_a))):
        shared = tuple(lab for lab in lx if lab in ly)
        p = tuple(lab for lab in lx if lab not in shared)
        q = tuple(lab for lab in ly if lab not in shared)
        if not shared or out != p + q:
            continue
        k = math.prod(sx[lx.index(lab)] for lab in shared)
        m = math.prod(sx[lx.index(lab)] for lab in p)
        n = math.prod(sy[ly.index(lab)] for lab in q)
        left_t = _matrix_layout(lx, p, shared)
        right_t = _matrix_layout(ly, shared, q)
        if left_t is None or right_t is None:
            continue
        shape = tuple(sx[lx.index(lab)] for lab in p) + tuple(sy[ly.index(lab)] for lab in q)
        return swapped, (m, k, n), (left_t, right_t), shape
    return None


def _without_summed_singletons(labels: tuple[str, ...], shape: tuple[int, ...],
                               other: tuple[str, ...], out: tuple[str, ...]
                               ) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``labels`` and ``shape`` without the labels of extent 1 that neither ``other`` nor
    ``out`` has (a sum over one value, which changes nothing).

    >>> _without_summed_singletons(("p", "k", "d"), (1, 6, 8), ("b", "d"), ("b", "k"))
    (('k', 'd'), (6, 8))
    """
    if 1 not in shape:
        return labels, shape
    keep = [n for n, lab in enumerate(labels)
            if shape[n] != 1 or lab in other or lab in out]
    return tuple(labels[n] for n in keep), tuple(shape[n] for n in keep)


def _matrix_layout(labels, row_labels, col_labels) -> bool | None:
    """False when ``labels`` read ``row_labels + col_labels`` (a flat view), True when they
    read ``col_labels + row_labels`` (a transposed flat view), None otherwise."""
    if labels == row_labels + col_labels:
        return False
    if labels == col_labels + row_labels:
        return True
    return None


def _as_2d(t: torch.Tensor, m: int, n: int) -> torch.Tensor | None:
    """``t`` viewed as an (m, n) matrix without a copy, or None where its strides forbid."""
    try:
        return t.view(m, n)
    except RuntimeError:
        return None


def _as_matmul(operands, labels, out_labels):
    """(left, right, output_transposed) when the contraction is one 2-D matrix product."""
    (a, b), (la, lb) = operands, labels
    if a.ndim != 2 or b.ndim != 2 or len(out_labels) != 2 or not a.is_floating_point():
        return None
    shared = set(la) & set(lb)
    if len(shared) != 1 or len(set(la)) != 2 or len(set(lb)) != 2:
        return None
    (c,) = shared
    x = la[1 - la.index(c)]
    y = lb[1 - lb.index(c)]
    if set(out_labels) != {x, y} or x == y:
        return None
    left = a if la == (x, c) or list(la) == [x, c] else a.T
    right = b if lb == (c, y) or list(lb) == [c, y] else b.T
    return left, right, tuple(out_labels) == (y, x)
