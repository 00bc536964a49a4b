"""Any number of labels, unicode labels (opt_einsum's symbols) and numpy's interleaved form."""

from __future__ import annotations

import numpy as np
import opt_einsum
import pytest

import tensorql as tq
from tensorql.errors import ParseError, TensorQLError


@pytest.fixture
def db():
    return tq.connect()


def test_unicode_labels_parse_and_run(db):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((4, 5))
    got = tq.einsum("aÀ,Àβ->aβ", db.from_numpy("a", a), db.from_numpy("b", b)).numpy()
    np.testing.assert_allclose(got, a @ b, rtol=1e-12)


def test_more_than_52_labels_chain(db):
    n = 70
    symbol = opt_einsum.get_symbol
    equation = ",".join(symbol(k) + symbol(k + 1) for k in range(n))
    equation += f"->{symbol(0)}{symbol(n)}"
    rng = np.random.default_rng(1)
    dims = [2 + k % 3 for k in range(n + 1)]
    arrays = [rng.uniform(0.2, 0.6, size=(dims[k], dims[k + 1])) for k in range(n)]
    tensors = [db.from_numpy(f"m{k}", x) for k, x in enumerate(arrays)]
    got = tq.einsum(equation, *tensors).numpy()
    np.testing.assert_allclose(got, opt_einsum.contract(equation, *arrays), rtol=1e-9)


def test_interleaved_form_matches_numpy(db):
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((4, 5))
    ta, tb = db.from_numpy("a", a), db.from_numpy("b", b)
    np.testing.assert_allclose(tq.einsum(ta, [0, 1], tb, [1, 2], [0, 2]).numpy(),
                               np.einsum(a, [0, 1], b, [1, 2], [0, 2]), rtol=1e-12)
    # implicit output: labels seen once, in order (numpy's rule)
    np.testing.assert_allclose(tq.einsum(ta, [0, 1], tb, [1, 2]).numpy(),
                               np.einsum(a, [0, 1], b, [1, 2]), rtol=1e-12)
    # ellipsis and numpy arrays as operands
    c = rng.standard_normal((2, 3, 4))
    np.testing.assert_allclose(tq.einsum(db.from_numpy("c", c), [..., 1], b, [1, 2],
                                         [..., 2]).numpy(),
                               np.einsum(c, [..., 1], b, [1, 2], [..., 2]), rtol=1e-12)


def test_interleaved_labels_beyond_52_and_strings(db):
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((2, 3)), rng.standard_normal((3, 2))
    ta, tb = db.from_numpy("a", a), db.from_numpy("b", b)
    np.testing.assert_allclose(tq.einsum(ta, [100, 200], tb, [200, 300], [100, 300]).numpy(),
                               a @ b, rtol=1e-12)
    np.testing.assert_allclose(tq.einsum(ta, ["x", "y"], tb, ["y", "z"], ["x", "z"]).numpy(),
                               a @ b, rtol=1e-12)
    got = tq.einsum(ta, [0, 1], tb, [1, 2], [0, 2], join="add", agg="max").numpy()
    np.testing.assert_allclose(got, (a[:, :, None] + b[None]).max(axis=1), rtol=1e-12)


def test_sql_einsum_accepts_unicode_labels(db):
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((4, 2))
    db.from_numpy("a", a)
    db.from_numpy("b", b)
    got = db.sql("SELECT * FROM EINSUM('ıÀ,Àκ->ıκ', a, b)").numpy()
    np.testing.assert_allclose(got, a @ b, rtol=1e-12)


@pytest.mark.parametrize("equation, bad", [("a-b->a", "-"), ("a\tb->ab", "\\t"),
                                           ("a.b->a", ".")])
def test_bad_characters_are_parse_errors_with_position(db, equation, bad):
    t = db.from_numpy("t", np.ones((2, 2)))
    with pytest.raises(ParseError) as err:
        tq.einsum(equation, t)
    assert "position" in str(err.value) or "^" in str(err.value)


def test_interleaved_bad_subscripts(db):
    t = db.from_numpy("t", np.ones((2, 2)))
    with pytest.raises(TensorQLError, match="sortable"):
        tq.einsum(t, [0, "x"], [0])
    with pytest.raises(ParseError, match="list of subscripts"):
        tq.einsum(t, "ab")


def test_parse_is_kept_per_equation_and_shapes_and_still_checks():
    """EinsumSpec.parse keeps the spec of an equation over shapes (issue 31): the same spec
    for equal shapes of any sequence type, another for other shapes, and a bad call still
    raises after a good one was kept."""
    import numpy as np
    import pytest

    from tensorql.einsum.spec import EinsumSpec
    from tensorql.errors import ShapeError

    spec = EinsumSpec.parse("ij,jk->ik", [(2, 3), (3, 4)])
    assert EinsumSpec.parse("ij,jk->ik", [np.array([2, 3]), [3, 4]]) is spec
    assert EinsumSpec.parse("ij,jk->ik", [(2, 3), (3, 5)]).output_shape == (2, 5)
    assert EinsumSpec.parse("ij,jk->ik", [(2, 3), (3, 4)], agg="max") is not spec
    with pytest.raises(ShapeError):
        EinsumSpec.parse("ij,jk->ik", [(2, 3), (4, 4)])
    with pytest.raises(ShapeError):
        EinsumSpec.parse("ij,jk->ik", [(2, 3)])


def test_more_than_five_operands_with_broadcast_or_ellipsis_labels():
    """Above five operands the path is refined by cotengra, which takes one-character labels
    only: a broadcast dim (``d@4``) or an ellipsis's dims reached it as such, a raw
    ValueError ("expected a string of length 1"), in a query and in its gradient."""
    rng = np.random.default_rng(0)
    db = tq.connect()
    shapes = [(2, 3), (3, 4), (4, 2), (2, 3), (3, 4), (1, 4)]  # the last broadcasts a
    arrays = [rng.uniform(-1, 1, s) for s in shapes]
    tensors = [db.from_numpy(f"T{i}", a) for i, a in enumerate(arrays)]
    equation = "ab,bc,ca,ab,bc,ac->"
    want = np.einsum(equation, *arrays[:5], np.broadcast_to(arrays[5], (2, 4)))
    np.testing.assert_allclose(tq.einsum(equation, *tensors).numpy(), want, rtol=1e-12)
    batched = [rng.uniform(-1, 1, (5, *s[:1], s[1])) for s in shapes[:5]] + \
        [rng.uniform(-1, 1, (5, 2, 4))]
    stored = [db.from_numpy(f"U{i}", b) for i, b in enumerate(batched)]
    equation = "...ab,...bc,...ca,...ab,...bc,...ac->..."
    np.testing.assert_allclose(tq.einsum(equation, *stored).numpy(),
                               np.einsum(equation, *batched), rtol=1e-12)
    five = [db.from_numpy(f"V{i}", a) for i, a in enumerate(arrays[:4] + arrays[5:])]
    loss = tq.einsum("ab,bc,ca,ab,ac->", *five)
    (grad,) = tq.grad(loss, [five[0]])
    torch = pytest.importorskip("torch")
    leaves = [torch.tensor(a, requires_grad=True) for a in arrays[:4] + arrays[5:]]
    torch.einsum("ab,bc,ca,ab,ac->", *leaves).backward()
    np.testing.assert_allclose(grad.numpy(), leaves[0].grad.numpy(), rtol=1e-10)
