"""Re-binding a rewritten logical plan to another extent (tensorql.logical.rebind), and the
compiled group built from it (CompiledGroup.with_extent), against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq
from tensorql.grid import ChunkGrid
from tensorql.logical.plan import Map, Reshape, Scan, TensorRelation
from tensorql.logical.rebind import rebind_extent
from tensorql.pipeline import CompiledGroup


def _rel(shape, tile):
    return TensorRelation(tuple("abcd"[: len(shape)]), ChunkGrid(shape, tile), "float32")


def _attention_like(db, x, w):
    """softmax(x w (x w)^T + mask) x w: every pointwise, product and softmax kind."""
    h = tq.einsum("sd,df->sf", x, w)
    scores = tq.einsum("sf,tf->st", h, h).relu()
    return tq.einsum("st,tf->sf", scores.softmax(-1), h).exp()


@pytest.mark.parametrize("old,new,tile", [(8, 7, 4), (8, 5, 4), (6, 11, 6), (9, 3, 3)])
def test_a_group_with_a_new_extent_computes_what_torch_does(old, new, tile):
    rng = np.random.default_rng(old * 100 + new)
    db = tq.connect(workers=2)
    w = db.from_numpy("w", rng.normal(size=(5, 3)).astype(np.float32) * 0.3)
    x = db.constant(torch.from_numpy(rng.normal(size=(old, 5)).astype(np.float32)),
                    tile=(tile, 5))
    group = CompiledGroup.compile([_attention_like(db, x, w).node], db)
    value = torch.from_numpy(rng.normal(size=(new, 5)).astype(np.float32))
    other = group.with_extent(old, new, {id(x.node.value): value})
    assert other is not None and other.rewritten is not None
    h = value @ torch.from_numpy(db.tensor("w").numpy())
    want = torch.exp(torch.softmax(torch.relu(h @ h.T), -1) @ h)
    torch.testing.assert_close(other.run()[0], want, atol=1e-5, rtol=1e-5)
    blocks = {s.relation.grid.blocks for s in group.physical.steps}
    assert {s.relation.grid.blocks for s in other.physical.steps} == blocks


def test_refused_where_a_stored_tensor_has_the_extent():
    db = tq.connect()
    w = db.from_numpy("w", np.ones((4, 4), np.float32))
    x = db.constant(torch.ones(4, 4))
    group = CompiledGroup.compile([tq.einsum("sd,df->sf", x, w).node], db)
    assert group.with_extent(4, 6, {id(x.node.value): torch.ones(6, 4)}) is None


def test_refused_for_a_constant_not_given_or_given_in_another_shape():
    db = tq.connect()
    x, y = db.constant(torch.ones(5, 2)), db.constant(torch.ones(5, 2))
    group = CompiledGroup.compile([(x + y).node], db)
    assert group.with_extent(5, 3, {id(x.node.value): torch.ones(3, 2)}) is None
    assert group.with_extent(5, 3, {id(x.node.value): torch.ones(3, 2),
                                    id(y.node.value): torch.ones(2, 3)}) is None
    ok = group.with_extent(5, 3, {id(x.node.value): torch.ones(3, 2),
                                  id(y.node.value): torch.full((3, 2), 2.0)})
    assert ok.run()[0].tolist() == [[3.0, 3.0]] * 3


def test_refused_where_the_new_extent_has_fewer_chunks():
    x = torch.ones(8)
    scan = Scan(_rel((8,), (2,)), source="<constant>", constant=x)
    plan = Map(_rel((8,), (2,)), input=scan, fn="exp")
    assert rebind_extent((plan,), 8, 3, {id(x): torch.ones(3)}) is None  # 4 chunks of 3?
    (got,) = rebind_extent((plan,), 8, 7, {id(x): torch.ones(7)})
    assert got.relation.grid == ChunkGrid((7,), (2,))


def test_refused_for_a_reshape_of_the_extent_or_a_node_kind_it_does_not_know():
    x = torch.ones(8, 2)
    scan = Scan(_rel((8, 2), (8, 2)), source="<constant>", constant=x)
    reshape = Reshape(_rel((16,), (16,)), input=scan)
    assert rebind_extent((reshape,), 8, 4, {id(x): torch.ones(4, 2)}) is None

    class Unknown(Map):
        pass

    odd = Unknown(_rel((8, 2), (8, 2)), input=scan, fn="exp")
    assert rebind_extent((odd,), 8, 4, {id(x): torch.ones(4, 2)}) is None


def test_a_partitioned_group_keeps_no_plan_to_rebind():
    db = tq.connect(devices=2)
    w = db.from_numpy("w", np.ones((3, 64), np.float32))
    x = db.constant(torch.ones(256, 3))
    group = CompiledGroup.compile([tq.einsum("sd,df->sf", x, w).node], db)
    assert group.physical.partition is not None and group.rewritten is None
    assert group.with_extent(256, 200, {id(x.node.value): torch.ones(200, 3)}) is None
