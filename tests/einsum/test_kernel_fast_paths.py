"""The chunk kernel's fast paths -- a join with no aggregated label on broadcast views, a
row-wise dot of two same-labelled operands, a pair contracted as one matrix product -- give
numpy.einsum's results (and the general path's), for every join, with permuted and missing
labels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensorql_kernels.chunk_einsum import (
    BroadcastJoin,
    PairProduct,
    _rowwise_dot,
    chunk_einsum,
    contract_into,
    contract_to,
)

from tensorql.physical.kernels import ContractChunk

_NUMPY = {"mul": np.multiply, "add": np.add, "sub": np.subtract, "div": np.divide,
          "max": np.maximum, "min": np.minimum}


@pytest.mark.parametrize("join", sorted(_NUMPY))
@pytest.mark.parametrize("in_labels, out", [
    ((("b", "s", "d"), ("b", "s")), ("b", "s", "d")),  # a row scale
    ((("d",), ("b", "s", "d")), ("b", "s", "d")),  # a gain
    ((("b", "k", "s", "t"), ("s", "t")), ("b", "k", "s", "t")),  # a mask
    ((("i", "j"), ("j", "i")), ("j", "i")),  # a transposed operand
    ((("i", "j"), ()), ("i", "j")),  # a scalar
    ((("i",), ("j",), ("i", "j")), ("j", "i")),  # three operands
])
def test_broadcast_joins_match_numpy(join, in_labels, out):
    rng = np.random.default_rng(21)
    sizes = {"b": 2, "s": 3, "d": 4, "k": 2, "t": 5, "i": 3, "j": 4}
    arrays = [rng.uniform(0.5, 2.0, [sizes[lab] for lab in labels]).astype(np.float64)
              for labels in in_labels]
    kernel = BroadcastJoin.plan(in_labels, out, join)
    assert kernel is not None
    got = kernel([torch.from_numpy(a) for a in arrays]).numpy()
    letters = {lab: chr(97 + n) for n, lab in enumerate(sizes)}
    want = None
    for array, labels in zip(arrays, in_labels):
        view = np.einsum("".join(letters[lab] for lab in labels) + "->"
                         + "".join(letters[lab] for lab in out if lab in labels), array)
        view = view.reshape([sizes[lab] if lab in labels else 1 for lab in out])
        want = view if want is None else _NUMPY[join](want, view)
    np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), rtol=1e-12)
    chunk = ContractChunk(in_labels, out, join=join, dtype="float64")
    np.testing.assert_allclose(chunk.run([torch.from_numpy(a) for a in arrays], None).numpy(),
                               got, rtol=1e-12)


def test_aggregating_or_repeated_labels_take_the_general_path():
    assert BroadcastJoin.plan([("i", "j"), ("j", "k")], ("i", "k"), "mul") is None
    assert BroadcastJoin.plan([("i", "i"), ("i",)], ("i",), "mul") is None
    assert BroadcastJoin.plan([("i",), ("j",)], ("i", "j"), "where") is None


@pytest.mark.parametrize("shape, kept", [((2, 3, 4), 2), ((2, 3, 4), 1), ((5, 6), 0),
                                         ((8, 16, 32), 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rowwise_dots_match_numpy(shape, kept, dtype):
    rng = np.random.default_rng(22)
    a, b = (torch.from_numpy(rng.standard_normal(shape)).to(dtype) for _ in range(2))
    labels = tuple("abc"[:len(shape)])
    out = labels[:kept]
    got = chunk_einsum([a, b], [labels, labels], out)
    want = np.einsum(f"{''.join(labels)},{''.join(labels)}->{''.join(out)}", a.double().numpy(),
                     b.double().numpy())
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    np.testing.assert_allclose(got.double().numpy(), want, rtol=tol, atol=tol)
    assert _rowwise_dot([a, b], [labels, labels[::-1]], out) is None  # other orders: einsum


def _random_pair(rng: np.random.Generator):
    """Two operands' labels and an output: random groups of contracted and free labels,
    each operand's dims in a random order (so the groups interleave), the output in a random
    order of the free labels."""
    names = iter("abcdefghijklmnop")
    contracted = [next(names) for _ in range(rng.integers(0, 4))]
    free_a = [next(names) for _ in range(rng.integers(0, 4))]
    free_b = [next(names) for _ in range(rng.integers(0, 4))]
    la = list(rng.permutation(contracted + free_a))
    lb = list(rng.permutation(contracted + free_b))
    out = list(rng.permutation(free_a + free_b))
    if rng.integers(0, 3) == 0:  # the output as free(b) + free(a): the swapped product
        out = free_b + free_a
    sizes = {lab: int(rng.integers(1, 5)) for lab in contracted + free_a + free_b}
    return tuple(la), tuple(lb), tuple(out), sizes


@pytest.mark.parametrize("seed", range(40))
def test_pair_products_match_numpy(seed):
    rng = np.random.default_rng(seed)
    la, lb, out, sizes = _random_pair(rng)
    a = rng.standard_normal([sizes[lab] for lab in la])
    b = rng.standard_normal([sizes[lab] for lab in lb])
    want = np.einsum(f"{''.join(la)},{''.join(lb)}->{''.join(out)}", a, b)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    if seed % 2:  # an operand that is itself a permuted view (a previous product's layout)
        ta = ta.T.contiguous().T if ta.ndim == 2 else ta
    pair = PairProduct.plan(la, lb, out, tuple(ta.shape), tuple(tb.shape))
    assert pair is not None
    got = pair(ta, tb)
    assert got.shape == want.shape
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-10)
    # the chunk kernel takes this path and gives the same, owning its memory
    value = chunk_einsum([ta, tb], [la, lb], out)
    np.testing.assert_allclose(value.numpy(), want, rtol=1e-10, atol=1e-10)
    for x in (ta, tb):
        assert value.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


@pytest.mark.parametrize("la, lb, out", [
    (("b", "i"), ("b", "j"), ("b", "i", "j")),  # a label kept by both (a batch)
    (("i", "j"), ("j", "k"), ("k",)),  # a label summed out of one operand alone
    (("i", "i"), ("i", "j"), ("j",)),  # a repeated label
])
def test_other_contractions_are_not_pair_products(la, lb, out):
    sizes = {"b": 2, "i": 3, "j": 4, "k": 5}
    assert PairProduct.plan(la, lb, out, tuple(sizes[x] for x in la),
                            tuple(sizes[x] for x in lb)) is None
    rng = np.random.default_rng(3)
    a = rng.standard_normal([sizes[x] for x in la])
    b = rng.standard_normal([sizes[x] for x in lb])
    got = chunk_einsum([torch.from_numpy(a), torch.from_numpy(b)], [la, lb], out)
    want = np.einsum(f"{''.join(la)},{''.join(lb)}->{''.join(out)}", a, b)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("a_first", [True, False])
@pytest.mark.parametrize("b_first", [True, False])
@pytest.mark.parametrize("swap", [False, True])
def test_flat_products_match_numpy(a_first, b_first, swap):
    """``P + C`` or ``C + P`` against ``C + Q`` or ``Q + C`` (the flat-matmul views, planned
    once per labels and shapes), either operand first: a fresh product, one accumulated into
    and one written into a tile, as numpy gives them."""
    rng = np.random.default_rng(7)
    sizes = {"p": 2, "r": 3, "c": 4, "d": 2, "q": 5}
    p, c, q = ("p", "r"), ("c", "d"), ("q",)
    la = p + c if a_first else c + p
    lb = c + q if b_first else q + c
    a = rng.standard_normal([sizes[x] for x in la])
    b = rng.standard_normal([sizes[x] for x in lb])
    out = p + q
    ops, labs = ([b, a], [lb, la]) if swap else ([a, b], [la, lb])
    want = np.einsum(f"{''.join(la)},{''.join(lb)}->{''.join(out)}", a, b)
    tensors = [torch.from_numpy(x) for x in ops]
    np.testing.assert_allclose(contract_into(None, tensors, labs, out).numpy(), want,
                               rtol=1e-10, atol=1e-10)
    acc = torch.ones(want.shape, dtype=torch.float64)
    np.testing.assert_allclose(contract_into(acc, tensors, labs, out).numpy(), want + 1,
                               rtol=1e-10, atol=1e-10)
    big = torch.zeros(want.shape[0] + 1, *want.shape[1:], dtype=torch.float64)
    contract_to(big[1:], tensors, labs, out)
    np.testing.assert_allclose(big[1:].numpy(), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_summed_label_of_one_value_keeps_the_flat_product(where):
    """A label of extent 1 that one operand alone has and the product sums (LLaMA's keys
    read their half of the joint key/value weight: ``bsd,pked->bske`` with ``p`` one value
    wide) no longer sends the product to ``torch.einsum``'s pair route: it is the flat
    matrix product -- with the stored weight's packed copy where it has one -- and gives
    numpy's values, fresh, accumulated and written into a tile."""
    from tensorql_kernels import chunk_einsum as ce
    from tensorql_kernels import packed_weights

    rng = np.random.default_rng(11)
    weight_labels = {"first": ("p", "k", "e", "d"), "middle": ("k", "p", "e", "d"),
                     "last": ("k", "e", "d", "p")}[where]
    sizes = {"b": 1, "s": 32, "d": 64, "p": 1, "k": 4, "e": 16}
    x = rng.standard_normal([sizes[lab] for lab in "bsd"]).astype(np.float32)
    joint = rng.standard_normal([2 if lab == "p" else sizes[lab] for lab in weight_labels]
                                ).astype(np.float32)
    stored = torch.from_numpy(joint)
    packed_weights.mark_immutable(stored)
    half = stored.narrow(weight_labels.index("p"), 1, 1)  # one value of p: a view
    labels = [("b", "s", "d"), weight_labels]
    out = ("b", "s", "k", "e")
    assert ce.pair_route([torch.from_numpy(x), half], labels, out) is None
    assert ce._flat_matmul([torch.from_numpy(x), half], labels, out, "mul", "sum") is not None
    want = np.einsum(f"bsd,{''.join(weight_labels)}->bske", x, half.numpy())
    got = ce.contract_into(None, [torch.from_numpy(x), half], labels, out)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)
    acc = torch.ones(want.shape)
    ce.contract_into(acc, [torch.from_numpy(x), half], labels, out)
    np.testing.assert_allclose(acc.numpy(), want + 1, rtol=1e-4, atol=1e-4)
    tile = torch.zeros(2, *want.shape[1:])
    ce.contract_to(tile[1:], [torch.from_numpy(x), half], labels, out)
    np.testing.assert_allclose(tile[1:].numpy(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seed", range(6))
def test_pair_route_kept_gives_what_the_full_route_gives(seed):
    """contract_into's kept pair route (issue 31) against numpy, on random two-operand
    contractions of 1-4 labels each, called twice (the second call takes the kept route) and
    again on operands of other shapes, other dtypes and permuted (strided) views."""
    from tensorql_kernels import chunk_einsum as ce

    rng = np.random.default_rng(seed)
    letters = "abcdefg"
    for _ in range(25):
        la = tuple(rng.choice(list(letters), size=rng.integers(1, 5), replace=False))
        lb = tuple(rng.choice(list(letters), size=rng.integers(1, 5), replace=False))
        kept = [lab for lab in dict.fromkeys(la + lb) if (lab in la) != (lab in lb)]
        out = tuple(rng.permutation(kept)) if kept else ()
        sizes = {lab: int(rng.integers(1, 5)) for lab in letters}
        for dtype in (np.float32, np.float64):
            a = rng.standard_normal([sizes[lab] for lab in la]).astype(dtype)
            b = rng.standard_normal([sizes[lab] for lab in lb]).astype(dtype)
            eq = f"{''.join(la)},{''.join(lb)}->{''.join(out)}"
            want = np.einsum(eq, a, b)
            ta, tb = torch.from_numpy(a), torch.from_numpy(b)
            for _ in range(2):
                got = ce.contract_into(None, [ta, tb], [la, lb], out)
                np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)
                assert got.untyped_storage().data_ptr() not in (
                    ta.untyped_storage().data_ptr(), tb.untyped_storage().data_ptr())
            # a permuted view of the same shape: the route is the same, the values read right
            pa = torch.from_numpy(np.ascontiguousarray(a.T)).permute(*reversed(range(a.ndim)))
            got = ce.contract_into(None, [pa, tb], [la, lb], out)
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)
    # labels given as lists are not kept but still contracted
    x, y = torch.rand(2, 3, 4), torch.rand(4, 5, 2)
    got = ce.contract_into(None, [x, y], [["i", "j", "k"], ["k", "l", "i"]], ["j", "l"])
    torch.testing.assert_close(got, torch.einsum("ijk,kli->jl", x, y))


def test_pair_route_only_for_the_pair_product():
    """The kept route is the pair product's alone: a plain matrix product, a flattened one,
    a diagonal, a row-wise dot and integer operands keep their own routes (None)."""
    from tensorql_kernels.chunk_einsum import pair_route

    m, t = torch.rand(3, 4), torch.rand(2, 3, 4)
    assert pair_route([m, torch.rand(4, 5)], [("i", "j"), ("j", "k")], ("i", "k")) is None
    assert pair_route([t, torch.rand(5, 4)], [("b", "s", "d"), ("v", "d")],
                      ("b", "s", "v")) is None
    assert pair_route([torch.rand(3, 3), m], [("i", "i"), ("i", "j")], ("j",)) is None
    assert pair_route([t, t], [("b", "s", "d"), ("b", "s", "d")], ("b", "s")) is None
    ints = torch.ones(2, 3, 4, dtype=torch.int64)
    assert pair_route([ints, ints], [("i", "j", "k"), ("k", "l", "i")], ("j", "l")) is None
    assert pair_route([t, torch.rand(4, 5, 2)], [("i", "j", "k"), ("k", "l", "i")],
                      ("j", "l")) is not None


def _permuted_view(x: torch.Tensor, rng) -> torch.Tensor:
    """``x`` as a permuted view of a contiguous tensor laid out in a random dim order (a
    previous product's layout): same values, other strides."""
    order = [int(d) for d in rng.permutation(x.ndim)]
    inverse = [order.index(d) for d in range(x.ndim)]
    return x.permute(order).contiguous().permute(inverse)


@pytest.mark.parametrize("seed", range(30))
def test_pair_products_read_permuted_operands_as_they_lie(seed):
    """Operands that are permuted views are planned by their memory order (issue 31): the
    pair product (or its stacked form) gives numpy's values, and an operand whose memory
    order already splits its labels into contracted and free blocks is not copied."""
    from tensorql_kernels import chunk_einsum as ce

    rng = np.random.default_rng(100 + seed)
    la, lb, out, sizes = _random_pair(rng)
    sizes = {lab: int(rng.choice([1, 3, 8, 17])) for lab in sizes}  # stacked forms too
    a = rng.standard_normal([sizes[lab] for lab in la]).astype(np.float32)
    b = rng.standard_normal([sizes[lab] for lab in lb]).astype(np.float32)
    want = np.einsum(f"{''.join(la)},{''.join(lb)}->{''.join(out)}", a, b)
    ta, tb = _permuted_view(torch.from_numpy(a), rng), _permuted_view(torch.from_numpy(b), rng)
    for got in (ce.PairProduct.for_operands([ta, tb], [la, lb], out)(ta, tb),
                ce.contract_into(None, [ta, tb], [la, lb], out),
                chunk_einsum([ta, tb], [la, lb], out)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)


def test_a_product_laid_out_for_the_next_reads_it_without_a_copy():
    """An MPS step ``peh,ef->phf`` (a site tensor against the environment) is one stacked
    product laid out ``p f h`` -- no copy of the site tensor -- and the next step, which sums
    ``p`` and ``f`` against the conjugate site ``pfi``, reads that layout as a matrix: the
    two steps copy nothing (torch's profiler counts no ``aten::copy_``)."""
    from tensorql_kernels import chunk_einsum as ce
    from torch.profiler import profile

    g = torch.Generator().manual_seed(5)
    site, env, conj = (torch.randn(12, 64, 64, generator=g), torch.randn(64, 64, generator=g),
                       torch.randn(12, 64, 64, generator=g))
    first = ce.PairProduct.for_operands([site, env], [("p", "e", "h"), ("e", "f")],
                                        ("p", "h", "f"))
    assert isinstance(first, ce.StackedProduct)
    with profile() as prof:
        mid = ce.contract_into(None, [site, env], [("p", "e", "h"), ("e", "f")],
                               ("p", "h", "f"))
        last = ce.contract_into(None, [conj, mid], [("p", "f", "i"), ("p", "h", "f")],
                                ("i", "h"))
    assert not [e for e in prof.events() if e.name == "aten::copy_"]
    want_mid = torch.einsum("peh,ef->phf", site, env)
    torch.testing.assert_close(mid, want_mid, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, torch.einsum("pfi,phf->ih", conj, want_mid),
                               rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("seed", range(12))
def test_stacked_products_match_numpy(seed):
    """One operand lying in memory as ``F1 + C + F2`` (its labels given in any order: a
    permuted view), the other as ``C + G`` or ``G + C``: the stacked product (one bmm, no
    copy), with numpy's values, either operand first, the output in any order."""
    from tensorql_kernels import chunk_einsum as ce

    rng = np.random.default_rng(200 + seed)
    names = iter("abcdefghij")
    f1, c, f2, g = ([next(names) for _ in range(rng.integers(1, 3))] for _ in range(4))
    sizes = {lab: int(rng.choice([4, 8, 16])) for lab in f1 + c + f2 + g}
    sizes[f2[0]] = sizes[c[0]] = sizes[g[0]] = 16  # wide enough to stack
    x_mem = f1 + c + f2
    y_mem = c + g if rng.integers(0, 2) else g + c
    x = torch.from_numpy(rng.standard_normal([sizes[lab] for lab in x_mem]))
    y = torch.from_numpy(rng.standard_normal([sizes[lab] for lab in y_mem]))
    order = [int(d) for d in rng.permutation(len(x_mem))]
    xv, lx = x.permute(order), tuple(x_mem[d] for d in order)  # labels in another order
    ly = tuple(y_mem)
    out = tuple(rng.permutation(f1 + f2 + g))
    ops, labs = ([xv, y], [lx, ly]) if seed % 2 else ([y, xv], [ly, lx])
    plan = ce.PairProduct.for_operands(ops, labs, out)
    assert isinstance(plan, ce.StackedProduct)
    eq = f"{''.join(labs[0])},{''.join(labs[1])}->{''.join(out)}"
    want = np.einsum(eq, ops[0].numpy(), ops[1].numpy())
    np.testing.assert_allclose(plan(*ops).numpy(), want, rtol=1e-10, atol=1e-10)
    got = ce.contract_into(None, ops, labs, out)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-10)
    for t in ops:
        assert got.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
