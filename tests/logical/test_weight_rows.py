"""Rule ``whole_rows_for_wide_weights`` (issue 31): a product of activations cut into row
blocks with a stored weight many times their size, cut into many chunks along the output,
reads each weight chunk in one task (the activations whole along their rows) -- a prefill's
LM head: 24 tasks of 512 rows instead of 48 of 256 -- with the same result as torch; other
products keep their tiles."""

from __future__ import annotations

import numpy as np
import torch

import tensorql as tq
from tensorql.logical.rules.weight_rows import MIN_WEIGHT_CHUNKS, NAME


def _product_steps(expr):
    return [step for step in expr.compile().physical.steps
            if step.name.startswith("Aggregate sum")]


def _setup(weight_tile_rows):
    rng = np.random.default_rng(21)
    db = tq.connect()
    x = rng.standard_normal((1, 64, 16)).astype(np.float32)
    w = rng.standard_normal((1024, 16)).astype(np.float32)
    weight = db.from_numpy("w", w, tile=(weight_tile_rows, 16))
    return db, x, w, weight


def test_a_wide_weight_in_many_chunks_reads_each_chunk_once():
    db, x, w, weight = _setup(64)  # 16 chunks, 16x the activations' elements
    act = db.constant(x, tile=(1, 32, 16))  # two row blocks
    for rows in (act, act * 2.0):  # a constant's scan retiled; a computed one by a Rekey
        out = tq.einsum("bsd,vd->bsv", rows, weight)
        assert NAME in out.explain()
        (step,) = _product_steps(out)
        assert len(step.tasks) == 1024 // 64  # one task a weight chunk, not two
        factor = 1.0 if rows is act else 2.0
        torch.testing.assert_close(out.torch(), factor * torch.from_numpy(x) @
                                   torch.from_numpy(w).T, rtol=1e-5, atol=1e-5)


def test_a_weight_in_few_chunks_or_not_much_larger_keeps_the_row_blocks():
    db, x, w, weight = _setup(1024 // (MIN_WEIGHT_CHUNKS // 2))  # too few chunks
    out = tq.einsum("bsd,vd->bsv", db.constant(x, tile=(1, 32, 16)), weight)
    assert NAME not in out.explain()
    (step,) = _product_steps(out)
    assert len(step.tasks) == 2 * (MIN_WEIGHT_CHUNKS // 2)
    big = np.tile(x, (1, 16, 1))  # activations as large as the weight
    out = tq.einsum("bsd,vd->bsv", db.constant(big, tile=(1, 512, 16)),
                    db.from_numpy("w2", w, tile=(64, 16)))
    assert NAME not in out.explain()
    torch.testing.assert_close(out.torch(), torch.from_numpy(big) @ torch.from_numpy(w).T,
                               rtol=1e-5, atol=1e-5)


def test_a_product_read_by_a_later_step_is_given_back_on_its_old_tiles():
    """The rule retiles the product's output; a step reading it was planned on the old tiles
    and gets them back (a Rekey) -- before, its task read a chunk no task wrote."""
    a = np.arange(20, dtype=np.float64).reshape(4, 5, 1)
    b = np.array([[1.0, -2.0]])
    for devices in (1, 2):
        db = tq.connect(devices=devices)
        left = db.from_numpy("A", a, tile=(1, 4, 1))  # the wide, finely cut "weight"
        right = db.from_numpy("B", b, tile=(1, 1))  # the activations, cut along j
        product = left @ right
        assert NAME in product.explain()
        np.testing.assert_allclose(product.sum().numpy(), (a @ b).sum())
        np.testing.assert_allclose((product * 2.0).numpy(), 2 * (a @ b))
