"""The chunk kernels on device memory, checked on the CPU: inputs on the ``meta`` device
stand in for a GPU's memory, and :class:`StrictDevices` (a torch dispatch mode) fails any op
whose tensors sit on two devices or that reads a device value back on the host -- the plain
meta device is lax (``torch.mm(meta, cpu)`` succeeds), CUDA is not. Each test here failed
before its fix (issue 29, findings 1, 2 and 9, and what a real H100 run of the suite hit)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import tensorql_kernels.chunk_einsum as chunk_kernels
import tensorql_kernels.optimizer_update as updates
import torch
from tensorql_kernels.algebra import AggName, JoinName, agg_of, fold_reduce
from tensorql_kernels.chunk_einsum import (
    blas_legal,
    blas_operand,
    chunk_einsum,
    contract_into,
    contract_to,
    exact_integer_path,
)
from tensorql_kernels.elementwise import _exp, apply_map
from tensorql_kernels.optimizer_update import optimizer_update
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import tensorql as tq
from tensorql.algebra import derivative_join, join_record, register_join
from tensorql.physical.kernels import (
    ContractChunk,
    ContractSeries,
    FusedArg,
    FusedOp,
    FusedPointwise,
    MapChunk,
)

META = torch.device("meta")
_HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}


class StrictDevices(TorchDispatchMode):
    """Fails an op mixing devices (as CUDA does, 0-d host scalars included) or reading a
    device tensor's value on the host (a stall of the host on the device); records the ops
    run, so a test can also say which kernels a path used."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise AssertionError(f"{func} mixes devices {sorted(map(str, devices))}")
        if func in _HOST_READS and tensors and tensors[0].device.type != "cpu":
            raise AssertionError(f"{func} reads a {tensors[0].device} value on the host")
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **kwargs)


def test_the_strict_mode_catches_what_plain_meta_lets_through():
    with StrictDevices(), pytest.raises(AssertionError, match="mixes devices"):
        torch.mm(torch.ones(2, 2, device=META), torch.ones(2, 2))
    with StrictDevices(), pytest.raises(AssertionError, match="on the host"):
        torch.ones(2).to(META).sum().item()


# -- finding 1: a fused pointwise chain over a large chunk ------------------------------------
def test_a_fused_chain_over_a_chunk_of_many_blocks_stays_on_its_device():
    """More than ``block_elems`` elements: the chain runs block by block into a result it
    allocates -- on the inputs' device, not the host's."""
    relu = MapChunk("relu", None, "float32")
    add = ContractChunk((("i", "j"), ("i", "j")), ("i", "j"), join=JoinName.ADD)
    chain = FusedPointwise((FusedOp(relu, (FusedArg(0, 0),)),
                            FusedOp(add, (FusedArg(-1, 0), FusedArg(1, 0)))), dim=0,
                           block_elems=1 << 17)
    x, y = (torch.empty(1024, 512, device=META) for _ in range(2))  # 2^19 > 2^17 elements
    with StrictDevices():
        out = chain.run([x, y], None)
    assert out.device == META and tuple(out.shape) == (1024, 512)
    # and the same blocks compute the right values on the CPU
    a, b = torch.randn(1024, 512, generator=torch.Generator().manual_seed(1)), torch.ones(1)
    torch.testing.assert_close(chain.run([a, b.expand(1024, 512)], None), a.relu() + 1)


# -- finding 2: Adam / AdamW (and so LoRA) on the chunk's device ------------------------------
def _scalars(step: float = 3.0) -> list[torch.Tensor]:
    # hyperparameters arrive as 0-d host tensors (the optimizer's per-step constants)
    return [torch.tensor(x, dtype=torch.float64) for x in (0.01, 0.9, 0.999, 1e-8, 0.01, step)]


@pytest.mark.parametrize("join", [JoinName.ADAM, JoinName.ADAMW])
@pytest.mark.parametrize("slots", [(0.0, 1.0, 2.0), (1.0, 2.0)])
def test_adam_runs_on_the_weights_device_through_the_fused_kernel(join, slots, monkeypatch):
    calls = []
    real = updates._FUSED[join]

    def fused(params, grads, exp_avgs, exp_avg_sqs, maxes, steps, **hyper):
        calls.append({t.device for t in (*params, *grads, *exp_avgs, *exp_avg_sqs, *steps)})
        return real(params, grads, exp_avgs, exp_avg_sqs, maxes, steps, **hyper)

    monkeypatch.setitem(updates._FUSED, join, fused)
    g, w, m, v = (torch.empty(6, 5, device=META) for _ in range(4))
    # the slots and scalars are read on the host (0-d host tensors, as the optimizer makes
    # them); the weight, gradient and moments are device memory. The fused kernel checks
    # devices on CUDA only; the strict mode checks them here.
    with StrictDevices():
        out = optimizer_update(join, [g, w, m, v, torch.tensor(slots), *_scalars()])
    assert out.device == META and tuple(out.shape) == (len(slots), 6, 5)
    assert calls == [{META}]


def test_adam_through_scratch_blocks_stays_on_the_device():
    """A result block whose slots are not contiguous goes through a scratch block: on the
    device too."""
    g, w, m, v = (torch.empty(6, 5, device=META) for _ in range(4))
    big = torch.empty(3, 6, 9, device=META)
    with StrictDevices():
        optimizer_update(JoinName.ADAM, [g, w, m, v, torch.arange(3.0), *_scalars()],
                         big[:, :, 2:7])


def _carried(join: str) -> str:
    return updates.update_join(join == JoinName.ADAMW, 0.9, 0.999, 1e-8, 0.01)


@pytest.mark.parametrize("join", [JoinName.ADAM, JoinName.ADAMW])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [(0.0, 1.0, 2.0), (1.0, 2.0)])
def test_an_update_join_carrying_its_hyperparameters_reads_nothing_on_the_host(
        join, dtype, slots, monkeypatch):
    """The optimizers' join: everything on the device, lr and step too (as the runtime
    stages 0-d constants, in the weight's dtype). The strict mode fails any host read of a
    device value; the fused kernel gets lr and the step counter as float32 tensors on the
    weight's device (what the CUDA kernel reads; the fake's Meta kernel checks it too), and
    a chunk of part of the slots picks them on the device."""
    import fake_cuda  # noqa: F401  (the Meta kernel of the fused tensor-lr overload)

    calls = []
    real = updates._FUSED[join]

    def fused(params, grads, exp_avgs, exp_avg_sqs, maxes, steps, *, lr, **hyper):
        calls.append((lr.device, lr.dtype, steps[0].device, steps[0].dtype, hyper["beta2"],
                      hyper["weight_decay"]))
        return real(params, grads, exp_avgs, exp_avg_sqs, maxes, steps, lr=lr, **hyper)

    monkeypatch.setitem(updates._FUSED, join, fused)
    g, w, m, v = (torch.empty(6, 5, device=META, dtype=dtype) for _ in range(4))
    lr, step = (torch.tensor(x, dtype=dtype).to(META) for x in (0.01, 3.0))
    with StrictDevices() as mode:
        out = optimizer_update(_carried(join),
                               [g, w, m, v, torch.tensor(slots).to(META), lr, step])
    assert out.device == META and out.dtype == dtype and tuple(out.shape) == (len(slots), 6, 5)
    assert calls == [(META, torch.float32, META, torch.float32, 0.999, 0.01)]
    assert "_local_scalar_dense" not in mode.ops


@pytest.mark.parametrize("join", [JoinName.ADAM, JoinName.ADAMW])
def test_the_update_in_torch_ops_reads_nothing_on_the_host(join, monkeypatch):
    """Where torch has no fused kernel, the same formula in 0-d tensor ops on the device."""
    monkeypatch.setitem(updates._FUSED, join, None)
    g, w, m, v = (torch.empty(6, 5, device=META) for _ in range(4))
    lr, step = (torch.tensor(x).to(META) for x in (0.01, 3.0))
    big = torch.empty(3, 6, 9, device=META)
    with StrictDevices() as mode:
        out = optimizer_update(_carried(join), [g, w, m, v, torch.arange(3.0).to(META), lr,
                                                step])
        optimizer_update(_carried(join), [g, w, m, v, torch.arange(3.0).to(META), lr, step],
                         big[:, :, 2:7])
    assert out.device == META and tuple(out.shape) == (3, 6, 5)
    assert not any(op.startswith("_fused_adam") for op in mode.ops)
    assert "addcdiv_" in mode.ops


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("join", [JoinName.ADAM, JoinName.ADAMW])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_update_on_cuda_matches_torch_optim_and_never_syncs(join, dtype):
    """On a GPU: the carried join's update, lr and step on the device, matches
    torch.optim's fused Adam (AdamW), with CUDA's sync debug mode raising on any sync."""
    gen = torch.Generator().manual_seed(3)
    g, w, m = (torch.randn(64, 48, generator=gen).to(dtype) for _ in range(3))
    v = torch.rand(64, 48, generator=gen).to(dtype)
    p = torch.nn.Parameter(w.cuda().clone())
    cls = torch.optim.AdamW if join == JoinName.ADAMW else torch.optim.Adam
    opt = cls([p], lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
    opt.state[p] = {"step": torch.tensor(2.0, device="cuda"), "exp_avg": m.cuda().clone(),
                    "exp_avg_sq": v.cuda().clone()}
    p.grad = g.cuda().clone()
    opt.step()
    operands = [x.cuda() for x in (g, w, m, v, torch.arange(3.0), torch.tensor(0.01),
                                   torch.tensor(3.0))]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = optimizer_update(_carried(join), operands)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for k, want in enumerate((p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])):
        torch.testing.assert_close(out[k], want)


# -- finding 9: low-precision sums, and no host read in exp ----------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_product_over_many_k_tiles_is_rounded_once(dtype):
    """64 K tiles of a bf16 (fp16) product: the sum is folded in float32 and rounded once --
    within two roundings of the exact result (one per tile product, one at the end), where
    folding in the result's dtype rounds the running total at every tile."""
    gen = torch.Generator().manual_seed(29)
    tiles, m, k, n = 64, 16, 8, 16
    a = torch.rand(m, k * tiles, generator=gen).to(dtype)
    b = torch.rand(k * tiles, n, generator=gen).to(dtype)
    exact = a.double() @ b.double()
    kernel = ContractSeries(ContractChunk((("i", "j"), ("j", "k")), ("i", "k"),
                                          dtype=str(dtype).removeprefix("torch.")), arity=2)
    inputs = []
    for t in range(tiles):
        inputs += [a[:, t * k:(t + 1) * k], b[t * k:(t + 1) * k]]
    unit = torch.finfo(dtype).eps / 2  # a rounding's relative error
    for got in (kernel.run(inputs, None), kernel.run_into(inputs, torch.empty(m, n, dtype=dtype))):
        assert got.dtype == dtype
        err = ((got.double() - exact).abs() / exact.abs()).max().item()
        assert err <= 2 * unit, err


def test_a_bf16_matmul_tiled_along_k_is_rounded_once_through_the_engine():
    """The same through a query: 32 K tiles of a bf16 product on one device run as one
    series task per output chunk; its error stays within two roundings (before: 0.0167,
    over four roundings, with the running total rounded at every tile)."""
    rng = np.random.default_rng(29)
    a = torch.tensor(rng.random((32, 1024)), dtype=torch.bfloat16)
    b = torch.tensor(rng.random((1024, 32)), dtype=torch.bfloat16)
    exact = a.double() @ b.double()
    with tq.connect(devices="cpu", workers=2) as db:
        got = (db.from_torch("A", a, tile=(32, 32)) @ db.from_torch("B", b, tile=(32, 32))).torch()
    assert got.dtype == torch.bfloat16
    assert ((got.double() - exact).abs() / exact).max().item() <= torch.finfo(torch.bfloat16).eps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_bf16_series_on_cuda_is_rounded_exactly_once():
    """On CUDA each tile's product joins the float32 sum unrounded (``mm(out_dtype=)``):
    one rounding in all, at the end."""
    gen = torch.Generator().manual_seed(29)
    a = torch.rand(64, 8 * 64, generator=gen).to(torch.bfloat16)
    b = torch.rand(8 * 64, 64, generator=gen).to(torch.bfloat16)
    exact = a.double() @ b.double()
    kernel = ContractSeries(ContractChunk((("i", "j"), ("j", "k")), ("i", "k"),
                                          dtype="bfloat16"), arity=2)
    inputs = []
    for t in range(64):
        inputs += [a[:, t * 8:(t + 1) * 8].cuda(), b[t * 8:(t + 1) * 8].cuda()]
    got = kernel.run(inputs, None).cpu().double()
    unit = torch.finfo(torch.bfloat16).eps / 2
    assert ((got - exact).abs() / exact.abs()).max().item() <= unit * (1 + 1e-3)


def test_exp_reads_no_device_value_on_the_host():
    x = torch.empty(64, 64, device=META)
    with StrictDevices():
        assert _exp(x).device == META
        assert apply_map("exp", x).device == META
        assert MapChunk("exp", None, "float32").run([x], None).device == META
    # and on the CPU the flush of subnormal results is as before, on every path
    cpu = torch.tensor([0.0, -1e9, -90.0, 1.0, -87.0])
    torch.testing.assert_close(_exp(cpu), torch.exp(cpu).masked_fill(cpu < -87.3365, 0.0))


# -- the H100 run: integer contractions have no BLAS on CUDA ---------------------------------
def test_integer_contractions_off_the_cpu_take_the_exact_path():
    ints = torch.ones(3, 4, dtype=torch.int64)
    assert not exact_integer_path([ints, ints])  # CPU: torch's integer bmm
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool):
        x = torch.ones(3, 4, dtype=dtype, device=META)
        assert exact_integer_path([x, x])
    assert not exact_integer_path([torch.ones(3, device=META)] * 2)
    a, b = torch.empty(3, 4, dtype=torch.int64, device=META), \
        torch.empty(4, 5, dtype=torch.int64, device=META)
    with StrictDevices() as mode:
        out = chunk_einsum([a, b], [("i", "j"), ("j", "k")], ("i", "k"))
        acc = contract_into(out, [a, b], [("i", "j"), ("j", "k")], ("i", "k"))
    assert out.device == META and out.dtype == torch.int64 and tuple(out.shape) == (3, 5)
    assert acc is out
    assert not {"bmm", "baddbmm", "mm", "addmm"} & set(mode.ops), mode.ops


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.int32, np.int64])
@pytest.mark.parametrize("max_temp", [1 << 24, 7])
def test_the_exact_integer_path_matches_numpy(dtype, max_temp, monkeypatch):
    """The path a GPU takes for integers, forced on the CPU: numpy's results, wrapped to the
    dtype as numpy wraps (products of small integers overflow them), sliced or not."""
    monkeypatch.setattr(chunk_kernels, "exact_integer_path", lambda operands: True)
    rng = np.random.default_rng(32)
    info = np.iinfo(dtype)
    a = rng.integers(info.min, info.max, size=(3, 5, 4), endpoint=True).astype(dtype)
    b = rng.integers(info.min, info.max, size=(4, 6), endpoint=True).astype(dtype)
    got = chunk_einsum([torch.from_numpy(a), torch.from_numpy(b)],
                       [("b", "i", "j"), ("j", "k")], ("i", "k"), max_temp_elems=max_temp)
    with np.errstate(over="ignore"):
        want = np.einsum("bij,jk->ik", a, b)
    assert got.dtype == torch.from_numpy(want).dtype
    np.testing.assert_array_equal(got.numpy(), want)


# -- the H100 run: a user's aggregation or join on device memory -----------------------------
def test_a_user_fold_starts_from_an_identity_on_the_operands_device():
    x = torch.empty(4, 6, device=META)
    for associative in (True, False):
        reduce = fold_reduce(lambda a, b: (a + b) / 2, 0.0, associative)
        with StrictDevices():
            assert reduce(x, [1]).device == META
            assert reduce(torch.empty(4, 0, device=META), [1]).device == META
    with StrictDevices():  # the built-in sum, for comparison
        assert agg_of(AggName.SUM).reduce(x, [1]).device == META


def test_a_user_joins_derivative_of_a_constant_is_on_the_operands_device():
    name = register_join("t_kern_dev_cmp", lambda a, b: (a > b).to(a.dtype))
    partial = join_record(derivative_join(name, 0))
    x = torch.ones(3, 4, device=META)
    with StrictDevices():
        assert partial.apply([x, x]).device == META


# -- the H100 run: cuBLASLt rejects leading dimensions CPU BLAS lets through ----------------
def test_blas_legal_strides():
    x = torch.ones(4, 6)
    assert blas_legal(x) and blas_legal(x.T) and blas_legal(x[1:3]) and blas_legal(x[:, 2:5])
    assert blas_legal(x[:, 2:5].T)
    assert not blas_legal(x[::2, ::2])  # no unit stride
    assert not blas_legal(torch.ones(3, 1).T)  # (1, 3) with strides (1, 1): ld 1 < 3
    assert blas_legal(torch.ones(3, 1)) and blas_legal(torch.ones(1, 3))
    assert blas_legal(x[:, 2:3]) and blas_legal(x[1:2, :])  # a column and a row of a matrix
    assert blas_legal(torch.ones(1, 1).T)
    row = blas_operand(torch.ones(3, 1).T)
    assert blas_legal(row) and row.stride() == (3, 1)


def test_blas_legal_reads_every_small_view_as_torch_reads_it():
    """Against torch's own reading (``prepare_matrix_for_cublas``): a dense matrix is row-major
    when contiguous, else column-major; any other is whichever has a unit stride and a long
    enough leading dimension -- on every view of up to 4 x 4 with strides up to 6."""
    base = torch.zeros(400)
    for rows, cols, s0, s1 in itertools.product(range(1, 5), range(1, 5), range(7), range(7)):
        t = base.as_strided((rows, cols), (s0, s1))
        row = (s1 == 1 or cols == 1) and s0 >= max(1, cols)
        col = (s0 == 1 or rows == 1) and s1 >= max(1, rows)
        dense = sorted((st, sz) for sz, st in zip((rows, cols), (s0, s1)) if sz > 1) in (
            [], [(1, rows)], [(1, cols)], [(1, cols), (cols, rows)], [(1, rows), (rows, cols)])
        want = (row if t.is_contiguous() else col) if dense else (row or col)
        assert blas_legal(t) == want, (rows, cols, s0, s1)


@pytest.mark.parametrize("m,k,n", [(3, 1, 3), (1, 3, 3), (3, 3, 1), (1, 1, 3), (3, 1, 1),
                                   (6, 3, 1), (1, 3, 1)])
def test_products_into_accumulators_hand_blas_only_legal_matrices(m, k, n):
    """Tiny tiles (a 6 x 4 matrix tiled by 3 leaves tiles of 1) in every layout an operand,
    an accumulator or an output tile takes: every matrix reaching a BLAS call has legal
    strides, and the results are numpy's."""
    gen = torch.Generator().manual_seed(7)
    a64 = torch.randn(m, k, generator=gen, dtype=torch.float64)
    b64 = torch.randn(k, n, generator=gen, dtype=torch.float64)
    want = (a64 @ b64).numpy()
    layouts = [(a64, ("i", "j")), (a64.T.contiguous().T, ("i", "j")),
               (a64.T.contiguous(), ("j", "i")), (a64.T, ("j", "i"))]
    for a, la in layouts:
        for b, lb in ((b64, ("j", "k")), (b64.T.contiguous(), ("k", "j")), (b64.T, ("k", "j"))):
            for out_labels in (("i", "k"), ("k", "i")):
                expect = want if out_labels == ("i", "k") else want.T
                with _BlasSpy():
                    acc = contract_into(None, [a, b], [la, lb], out_labels)
                    for acc0 in (acc.clone(), acc.T.contiguous().T, acc.clone().T.contiguous().T):
                        got = contract_into(acc0, [a, b], [la, lb], out_labels)
                        np.testing.assert_allclose(got.numpy(), 2 * expect, rtol=1e-12)
                    big = torch.zeros(9, 9, dtype=torch.float64)
                    for tile in (big[1:1 + expect.shape[0], 2:2 + expect.shape[1]],
                                 big.T[1:1 + expect.shape[0], 2:2 + expect.shape[1]]):
                        got = contract_to(tile, [a, b], [la, lb], out_labels)
                        np.testing.assert_allclose(got.numpy(), expect, rtol=1e-12)


class _BlasSpy(TorchDispatchMode):
    """Fails a matrix product handed a 2-D tensor whose strides a BLAS may reject."""

    _BLAS = {"mm", "addmm", "addmm_", "bmm", "baddbmm"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in self._BLAS:
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.dim() == 2:
                    assert blas_legal(t), (func, tuple(t.shape), t.stride())
        return func(*args, **kwargs)
