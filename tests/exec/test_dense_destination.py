"""Dense runs compute result tiles straight into the dense output (no copy per tile)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensorql_kernels.chunk_einsum import contract_to

import tensorql as tq
from tensorql.exec.executor import Executor
from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph


@pytest.mark.parametrize("spec", ["ij,jk->ik", "ij,jk->ki", "ji,jk->ik", "ij,kj->ik"])
def test_contract_to_writes_a_strided_tile(spec):
    rng = np.random.default_rng(1)
    ins, out_labels = spec.split("->")
    la, lb = ins.split(",")
    size = {"i": 5, "j": 7, "k": 3}
    a = torch.from_numpy(rng.standard_normal([size[c] for c in la]).astype(np.float32))
    b = torch.from_numpy(rng.standard_normal([size[c] for c in lb]).astype(np.float32))
    big = torch.full((20, 20), -1.0)
    tile = big[2:2 + size[out_labels[0]], 4:4 + size[out_labels[1]]]
    got = contract_to(tile, [a, b], [tuple(la), tuple(lb)], tuple(out_labels))
    assert got.data_ptr() == tile.data_ptr()
    np.testing.assert_allclose(tile.numpy(), np.einsum(spec, a.numpy(), b.numpy()), rtol=1e-5)
    big[2:2 + tile.shape[0], 4:4 + tile.shape[1]] = -1.0
    assert (big == -1.0).all()  # nothing outside the tile was touched


def test_contract_to_other_semirings_and_dtypes():
    gen = torch.Generator().manual_seed(7)
    a, b = torch.randn(4, 6, generator=gen), torch.randn(6, 3, generator=gen)
    out = torch.empty(4, 3)
    contract_to(out, [a, b], [("i", "j"), ("j", "k")], ("i", "k"), join="add", agg="max")
    expected = (a[:, :, None] + b[None, :, :]).amax(dim=1)
    torch.testing.assert_close(out, expected)
    out64 = torch.empty(4, 3, dtype=torch.float64)
    contract_to(out64, [a, b], [("i", "j"), ("j", "k")], ("i", "k"))
    # the product is computed in float32 (the inputs' dtype) and written into a float64 tile:
    # compare with float32 tolerances against the exact float64 product
    torch.testing.assert_close(out64, a.double() @ b.double(), rtol=1.3e-6, atol=1e-5)


class _Add:
    """A kernel without ``run_into``: the executor copies its first result into the tile."""

    def __init__(self, value: float) -> None:
        self.value = value

    def run(self, inputs, acc):
        return torch.full((2, 2), self.value) if acc is None else acc.add_(self.value)

    def combine(self, acc, partial):
        return acc.add_(partial)


@pytest.mark.parametrize("mode", ["threads", "serial"])
def test_executor_writes_retained_chunks_into_destinations(mode):
    dense = torch.zeros(2, 4)
    tiles = {(0,): dense[:, :2], (1,): dense[:, 2:]}
    tasks = tuple(Task(n, (), ChunkRef(0, (n % 2,)), _Add(float(n + 1))) for n in range(6))
    graph = TaskGraph(tasks=tasks, retain=frozenset({0}))
    sunk = {}
    result = Executor(workers=2, mode=mode).run(graph, destination=lambda ref: tiles[ref.key],
                                     sink=lambda ref, chunk: sunk.setdefault(ref.key, chunk))
    assert dense[:, :2].eq(1 + 3 + 5).all() and dense[:, 2:].eq(2 + 4 + 6).all()
    for key, chunk in result.outputs.items():
        assert chunk.data_ptr() == tiles[key.key].data_ptr()
        assert sunk[key.key].data_ptr() == tiles[key.key].data_ptr()


@pytest.mark.parametrize("tile", [(64, 64), (48, 80), (200, 200)])
def test_dense_results_match_torch(tile):
    rng = np.random.default_rng(2)
    a = rng.standard_normal((150, 130)).astype(np.float32)
    b = rng.standard_normal((130, 170)).astype(np.float32)
    with tq.connect(workers=2) as db:
        ta = db.from_numpy("a", a, tile=tile)
        tb = db.from_numpy("b", b, tile=(tile[1], tile[0]))
        np.testing.assert_allclose((ta @ tb).numpy(), a @ b, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose((ta @ tb).T.numpy(), (a @ b).T, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose((ta @ tb).relu().numpy(), np.maximum(a @ b, 0),
                                   rtol=1e-4, atol=1e-4)
        # a stored tensor read back densely is a copy, never the cached chunk itself
        got = ta.torch()
        got.zero_()
        np.testing.assert_array_equal(ta.numpy(), a)


@pytest.mark.parametrize("spec", ["bsd,dhe->bshe", "bsd,vd->bsv", "bshe,hed->bsd",
                                  "dhe,bsd->bshe", "bsd,dv->bvs", "bsd,dv->bsv",
                                  "bsd,bsv->dv", "bsv,bsd->vd", "bsd,vbs->dv"])
def test_projections_run_as_one_flattened_product(spec):
    """Projections (one operand's trailing labels contracted with the other's leading or
    trailing ones) run as torch.mm on flattened views, into a fresh result, an accumulator
    and a strided tile of a larger result alike; other layouts fall back to the einsum."""
    from tensorql_kernels.chunk_einsum import contract_into

    rng = np.random.default_rng(2)
    ins, out = spec.split("->")
    la, lb = ins.split(",")
    size = {"b": 2, "s": 3, "d": 4, "h": 2, "e": 3, "v": 5}
    a = torch.from_numpy(rng.standard_normal([size[c] for c in la]))
    b = torch.from_numpy(rng.standard_normal([size[c] for c in lb]))
    b_view = torch.cat([b, b], dim=-1)[..., : b.shape[-1]]  # a strided view, as chunks are
    labels = [tuple(la), tuple(lb)]
    want = torch.einsum(spec, a, b)
    torch.testing.assert_close(contract_into(None, [a, b_view], labels, tuple(out)), want)
    acc = torch.ones_like(want)
    torch.testing.assert_close(contract_into(acc, [a, b_view], labels, tuple(out)), want + 1)
    big = torch.zeros(*(n + 2 for n in want.shape), dtype=want.dtype)
    tile = big[tuple(slice(1, 1 + n) for n in want.shape)]
    contract_to(tile, [a, b_view], labels, tuple(out))
    torch.testing.assert_close(tile, want)
    tile.zero_()
    assert (big == 0).all()  # nothing outside the tile was touched


def _largest_allocation(fn) -> int:
    """The largest CPU allocation (bytes) torch makes while ``fn`` runs (the profiler's memory
    events, which see every tensor torch allocates)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max([e.cpu_memory_usage for e in prof.events()] + [0])  # per call


@pytest.mark.parametrize(("in_labels", "out_labels", "join"), [
    ((("i",), ("j",)), ("i", "j"), "mul"),  # an outer product
    ((("j", "i"), ("i",)), ("i", "j"), "add"),  # a permuted operand, a row added
    ((("i",), ("j",), ("i", "j")), ("i", "j"), "mul"),  # three operands folded
    ((("i",), ("j",)), ("j", "i"), "max"),
])
def test_broadcast_joins_write_into_the_tile_with_no_temporary(in_labels, out_labels, join):
    """A join with no aggregated label (an outer product: bench/memory.py's result) is written
    straight into its tile of the dense result: no result-sized temporary, the values of
    ``run``."""
    from tensorql.physical.kernels import ContractChunk

    rng = np.random.default_rng(5)
    size = {"i": 96, "j": 160}
    arrays = [rng.standard_normal([size[c] for c in labels]).astype(np.float32)
              for labels in in_labels]
    kernel = ContractChunk(in_labels, out_labels, join=join)
    inputs = [torch.from_numpy(a) for a in arrays]
    big = torch.full((400, 400), -7.0)
    shape = [size[c] for c in out_labels]
    tile = big[3:3 + shape[0], 5:5 + shape[1]]
    largest = _largest_allocation(lambda: kernel.run_into(inputs, tile))
    assert largest < tile.numel() * 4 // 4, largest  # nothing near the tile's size: the
    # einsum-and-copy path allocated a tile-sized product
    spec = ",".join("".join(labels) for labels in in_labels) + "->" + "".join(out_labels)
    if join == "mul":
        want = np.einsum(spec, *arrays)
    else:
        fn = {"add": np.add, "max": np.maximum}[join]
        views = [np.einsum("".join(labels) + "->" + "".join(c for c in out_labels if c in labels),
                           a) for labels, a in zip(in_labels, arrays)]
        expand = [v.reshape([size[c] if c in labels else 1 for c in out_labels])
                  for labels, v in zip(in_labels, views)]
        want = fn(expand[0], expand[1])
    np.testing.assert_array_equal(tile.numpy(), want)
    np.testing.assert_array_equal(tile.numpy(), kernel.run(inputs, None).numpy())
    tile.fill_(-7.0)
    assert (big == -7.0).all()  # nothing outside the tile was touched


def test_an_outer_product_result_is_computed_in_place():
    """``.numpy()`` of an outer product: every tile written into the one result array."""
    db = tq.connect(devices="cpu")
    u_np = np.arange(300, dtype=np.float32) % 7
    v_np = np.arange(200, dtype=np.float32) % 5 + 1
    u = db.from_numpy("u", u_np, tile=(64,))
    v = db.from_numpy("v", v_np, tile=(64,))
    np.testing.assert_array_equal(tq.einsum("i,j->ij", u, v).numpy(), np.outer(u_np, v_np))
    np.testing.assert_array_equal(tq.einsum("i,j->ji", u, v).numpy(), np.outer(v_np, u_np))
