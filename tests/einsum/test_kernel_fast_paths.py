"""The chunk kernel's fast paths -- a join with no aggregated label on broadcast views, a
row-wise dot of two same-labelled operands -- give numpy.einsum's results (and the general
path's), for every join, with permuted and missing labels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensorql_kernels.chunk_einsum import BroadcastJoin, _rowwise_dot, chunk_einsum

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
