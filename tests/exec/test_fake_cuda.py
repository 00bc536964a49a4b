"""The CUDA device class's own code, run in CPU CI through the recording fake of
``tensorql.cuda_api`` (``tests/fake_cuda.py``; the ``fake_cuda`` fixture of conftest.py).

Device memory is the ``meta`` device: device chunks have no values, so copies back to the
host are NaN. A result that is all NaN therefore came through the device (a chunk computed
on the CPU by mistake would carry numbers), and the strict check of the fake fails any test
whose kernels mix devices, sync to the host, or read a transfer before it is known complete.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
import time

import numpy as np
import pytest
import torch
from fake_cuda import FakeCuda, FakeCudaViolation

import tensorql as tq
import tensorql.cuda_api as cuda_api
from tensorql.errors import ExecutionError
from tensorql.exec.devices.cuda import CUDA_LOOKAHEAD, CUDADevice
from tensorql.exec.hostpool import shared_pool
from tensorql.exec.runtime import Runtime
from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph
from tensorql.models import workloads


def ran_on_device(fake: FakeCuda, devices=(0,)) -> None:
    """The run's kernels and copies went through the fake CUDA: events, H2D and D2H copies,
    aten ops on the meta device of each of ``devices``, and no violation."""
    assert fake.violations == []
    assert fake.events_recorded > 0
    assert fake.copies["h2d"] > 0 and fake.copies["d2h"] > 0
    assert fake.ops_by_label.get("compute", 0) > 0
    for d in devices:
        assert fake.ops_by_device.get(d, 0) > 0, f"nothing ran on fake cuda:{d}"
    # no lane thread waited on the GPU: only the waiters did
    assert [s for s in fake.host_syncs if "-wait-" not in s[1]] == []


def all_nan(result) -> bool:
    return bool(np.isnan(np.asarray(result, dtype=np.float64)).all())


def evictions(text: str) -> int:
    return sum(int(n) for n in re.findall(r"evictions (\d+)", text))


# -- the public API on fake GPUs -----------------------------------------------------------
@pytest.mark.parametrize("devices", ["cuda", "auto"])
def test_mlp(fake_cuda, devices):
    with tq.connect(devices=devices) as db:
        assert db.options.device_set.names == ("cuda:0", "cuda:1")
        w = workloads.mlp(db, batch=16, d_model=32, d_ff=64)
        got = w.output.numpy()
    assert got.shape == (16, 32) and all_nan(got)
    ran_on_device(fake_cuda, devices=(0, 1))


@pytest.mark.parametrize("build", [lambda x: x % 3, lambda x: x // 2, lambda x: x ** x,
                                   lambda x: tq.einsum("ij,ij->ij", x, x, join="mod")],
                         ids=["mod", "floordiv", "pow", "mod-join"])
def test_integer_division_and_powers_read_nothing_back_on_the_device(fake_cuda, build):
    """Integer // % and tensor ** mask a divisor of 0 on the device without reading it back
    (on the CPU they look first): no host sync inside a kernel."""
    with tq.connect(devices="cuda:0") as db:
        x = db.from_numpy("x", np.arange(12, dtype=np.int32).reshape(3, 4))
        got = build(x).numpy()
    assert got.shape == (3, 4) and got.dtype == np.int32
    ran_on_device(fake_cuda)


def test_a_half_precision_series_sums_in_float32_through_the_device_product(monkeypatch):
    """A bf16 product whose K tiles are summed one by one (a ContractSeries: on a GPU when
    the whole-K copies do not fit) folds each into a float32 total with torch.mm's
    ``out_dtype`` on the device -- the CUDA branch of ``_mm_wide``, run on the fake's
    device memory (meta)."""
    import tensorql_kernels.chunk_einsum as chunk_einsum

    from tensorql.physical.kernels import ContractChunk, ContractSeries

    calls = []
    real = chunk_einsum._mm_wide

    def spy(left, right, dtype):
        out = real(left, right, dtype)
        calls.append((left.device.type, left.dtype, out.dtype))
        return out

    monkeypatch.setattr(chunk_einsum, "_mm_wide", spy)
    series = ContractSeries(ContractChunk((("i", "j"), ("j", "k")), ("i", "k"),
                                          dtype="bfloat16"), arity=2)
    tiles = [torch.empty(*shape, dtype=torch.bfloat16, device="meta")
             for _ in range(4) for shape in ((256, 128), (128, 64))]
    got = series.run(tiles, None)
    assert got.device.type == "meta" and got.dtype == torch.bfloat16
    assert got.shape == (256, 64)
    assert calls == [("meta", torch.bfloat16, torch.float32)] * 4


def test_attention(fake_cuda):
    with tq.connect(devices="cuda:0") as db:
        w = workloads.attention(db, batch=1, seq=16, d_model=32, heads=2, head_dim=16)
        got = w.output.numpy()
    assert got.shape == w.reference().shape and all_nan(got)
    ran_on_device(fake_cuda)


def test_llama_block(fake_cuda):
    with tq.connect(devices="cuda:0") as db:
        w = workloads.llama_block(db, batch=1, seq=8, d_model=32, heads=2, head_dim=16,
                                  d_ff=48)
        got = w.output.numpy()
    assert got.shape == w.reference().shape and all_nan(got)
    ran_on_device(fake_cuda)


@contextlib.contextmanager
def violations_raised(fake: FakeCuda):
    """Run a block whose violation fails the test body (the strict fake raises it, the run
    re-raises it as ExecutionError), not the fixture's teardown a second time."""
    try:
        yield
    finally:
        fake.violations.clear()


@pytest.mark.parametrize("optimizer", ["Adam", "AdamW"])
def test_adam_training_step(fake_cuda, optimizer):
    rng = np.random.default_rng(0)
    with violations_raised(fake_cuda), tq.connect(devices="cuda:0") as db:
        db.store_many({"X": rng.standard_normal((16, 8)).astype(np.float32),
                       "Y": rng.standard_normal((16, 4)).astype(np.float32),
                       "W": (rng.standard_normal((8, 4)) * 0.1).astype(np.float32)})
        err = db.tensor("X") @ db.tensor("W") - db.tensor("Y")
        opt = getattr(tq.optim, optimizer)(db, ["W"], lr=0.05, checkpoint_every=1000)
        loss = opt.step((err * err).mean())
        assert db.tensor("W").shape == (8, 4)
    assert np.isnan(loss)
    ran_on_device(fake_cuda)


def test_lora_step(fake_cuda):
    rng = np.random.default_rng(0)
    with violations_raised(fake_cuda), tq.connect(devices="cuda:0") as db:
        work = workloads.llama_block(db, batch=1, seq=8, d_model=16, heads=2, head_dim=8,
                                     d_ff=24, prefix="b_")
        db.store_many({"lora_a": rng.normal(size=(16, 2)) * 0.1,
                       "lora_b": np.zeros((2, 2, 8))})
        adapted = db.tensor("b_l0_wq") + tq.einsum("dr,rhe->dhe", db.tensor("lora_a"),
                                                   db.tensor("lora_b"))
        out = tq.substitute(work.output, {"b_l0_wq": adapted.astype("float32")})
        lora = tq.optim.Adam(db, ["lora_a", "lora_b"], lr=0.01, name="lora",
                             checkpoint_every=1000)
        loss = lora.step((out * out).mean())
    assert np.isnan(loss)
    ran_on_device(fake_cuda)


def test_partitioned_plan_on_two_devices(fake_cuda):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((64, 48)).astype(np.float32)
    b = rng.standard_normal((48, 32)).astype(np.float32)
    with tq.connect(devices=["cuda:0", "cuda:1"]) as db:
        A, B = db.from_numpy("A", a, tile=(16, 16)), db.from_numpy("B", b, tile=(16, 16))
        expr = (A @ B).relu() @ db.from_numpy("C", b.T.copy(), tile=(16, 16))
        text = expr.explain(analyze=True)
        got = expr.numpy()
    assert got.shape == (64, 48) and all_nan(got)
    assert "cuda:0" in text and "cuda:1" in text
    assert fake_cuda.copies["d2d"] > 0  # chunks sent between the devices
    ran_on_device(fake_cuda, devices=(0, 1))


@pytest.mark.parametrize("fake_cuda", [
    {"devices": 1},
    # kernels and copies that take time: many ops in flight, frees racing uses
    {"devices": 1, "event_seconds": {"compute": 0.002, "h2d": 0.001, "d2h": 0.001}},
], indirect=True, ids=["instant", "slow-gpu"])
def test_offload_under_a_memory_limit(fake_cuda):
    rng = np.random.default_rng(2)
    a = rng.standard_normal((128, 128)).astype(np.float32)
    with tq.connect(devices="cuda:0", memory_limit="64KiB") as db:
        A = db.from_numpy("A", a, tile=(32, 32))
        text = (A @ A).explain(analyze=True)
        got = (A @ A).numpy()
    assert got.shape == (128, 128) and all_nan(got)
    assert evictions(text) > 0
    ran_on_device(fake_cuda)


# -- the device class: events, streams, the strict check ---------------------------------
def _run_ops(dev: CUDADevice, n: int, fn) -> tuple[list, list[float]]:
    done: list = []
    launched: list[float] = []
    cond = threading.Condition()

    def post(c):
        with cond:
            done.append(c)
            cond.notify_all()

    def work():
        launched.append(time.perf_counter())
        return fn()

    dev.open(post)
    try:
        for i in range(n):
            dev.submit("compute", i, work)
        with cond:
            assert cond.wait_for(lambda: len(done) == n, timeout=30)
    finally:
        dev.close()
    return done, launched


@pytest.mark.parametrize("fake_cuda", [{"event_seconds": 0.2}], indirect=True)
def test_ops_stay_in_flight_without_a_host_sync_per_op(fake_cuda):
    """Finding 7: the launching thread records each op's end event and goes on; completions
    come from the waiters when the events complete. 8 ops of 200 ms of "GPU time" on 2 streams
    are all launched before the first completes, and no lane thread waits on the GPU."""
    dev = CUDADevice("cuda:0")
    x = torch.empty(8, 8, device=dev.torch_device)
    done, launched = _run_ops(dev, 8, lambda: x * 2)
    assert all(c.error is None and c.value.device.type == "meta" for c in done)
    first_done = min(c.ended for c in done)
    assert sum(1 for t in launched if t < first_done) == 8  # more than 2 in flight
    assert all(c.device_s is not None and c.device_s > 0 for c in done)
    syncs = [thread for _, thread, _ in fake_cuda.host_syncs]
    assert syncs and all("-wait-" in thread for thread in syncs)
    assert CUDA_LOOKAHEAD + dev.lanes["compute"] > 2  # the runtime's dispatch depth


@pytest.mark.parametrize("fake_cuda", [{"event_seconds": {"compute": 0.05}}], indirect=True)
def test_the_runtime_keeps_more_than_two_kernels_in_flight(fake_cuda):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((64, 64)).astype(np.float32)
    with tq.connect(devices="cuda:0") as db:
        A = db.from_numpy("A", a, tile=(16, 16))
        got = (A * 2.0 + 1.0).numpy()  # 16 independent chunk kernels
    assert all_nan(got)
    # each op records a start and an end event: more than 4 pending = more than 2 ops
    assert fake_cuda.max_pending_compute_events > 4
    ran_on_device(fake_cuda)


def test_the_check_catches_a_read_before_the_copy_is_known_complete(fake_cuda, monkeypatch):
    """Post completions without waiting on the events (what finding 7's fix must not do):
    a kernel then reads a chunk the H2D stream wrote before any event ordered it, and a
    chunk is freed while another stream's use of it may still run."""
    import tensorql.exec.devices.cuda as cuda_mod

    def wait_not(self, waits):
        while (item := waits.get()) is not None:
            item.post(cuda_mod.Completion(item.op_id, item.started, time.perf_counter(),
                                          item.value, item.error))
            item = None  # the lane outlives the run: no chunk kept alive until the next op

    monkeypatch.setattr(cuda_mod._Lane, "_wait", wait_not)
    fake_cuda.strict = False
    a = np.ones((32, 32), np.float32)
    with tq.connect(devices="cuda:0") as db:
        A = db.from_numpy("A", a, tile=(16, 16))
        (A @ A).numpy()
    assert any("before waiting on an event" in v for v in fake_cuda.violations)
    # and chunks were freed (their blocks free for the allocating stream) while kernels of
    # other streams still read them
    assert any("was freed while its use on stream" in v for v in fake_cuda.violations)
    fake_cuda.violations.clear()


class _Kernel:
    """A chunk kernel of a hand-built graph (``fn`` of its inputs)."""

    def __init__(self, fn):
        self.fn = fn

    def run(self, inputs, acc):
        return self.fn(*inputs)

    def combine(self, acc, partial):
        return acc.add_(partial)


def _graph(kernel) -> tuple[TaskGraph, ChunkRef]:
    a, c = ChunkRef(0, ()), ChunkRef(1, ())
    src = _Kernel(lambda: torch.ones(4, 4))
    return TaskGraph(tasks=(Task(0, (), a, src), Task(1, (a,), c, _Kernel(kernel), 1.0)),
                     retain=frozenset({1}), chunk_bytes={a: 64, c: 64}), c


@pytest.mark.parametrize("kernel, message", [
    (lambda x: x @ torch.ones(4, 4), "mixes device tensors with CPU tensors"),
    (lambda x: x * float(x.sum().item()), "host sync"),
    (lambda x: x.cpu() + 1, "copies device data to the host outside"),
])
def test_the_strict_check_fails_a_kernel_that_breaks_a_rule(fake_cuda, kernel, message):
    graph, _ = _graph(kernel)
    with pytest.raises(ExecutionError, match=message):
        Runtime("cuda:0").run(graph)
    assert any(message in v for v in fake_cuda.violations)
    fake_cuda.violations.clear()


def test_plain_meta_is_lax_the_strict_check_is_not(fake_cuda):
    assert torch.mm(torch.empty(2, 2, device="meta"), torch.ones(2, 2)).device.type == "meta"
    api = cuda_api.current()
    stream = api.stream(api.torch_device(0), label="compute")
    with pytest.raises(FakeCudaViolation), api.stream_context(stream):
        torch.mm(torch.empty(2, 2, device="meta"), torch.ones(2, 2))
    fake_cuda.violations.clear()


# -- finding 6: device-resident sources, one pinned pool -----------------------------------
def test_a_source_chunk_on_the_device_is_not_staged_through_the_host(fake_cuda):
    """A source whose chunk is already in device memory (a constant of a GPU tensor) is
    used where it is: before, it was copied into the pinned pool (a device-to-host copy on
    the H2D stream) and back."""
    resident = torch.empty(4, 4, device=cuda_api.current().torch_device(0))
    a, c = ChunkRef(0, ()), ChunkRef(1, ())
    graph = TaskGraph(tasks=(Task(0, (), a, _Kernel(lambda: resident)),
                             Task(1, (a,), c, _Kernel(lambda x: x * 2), 1.0)),
                      retain=frozenset({1}), chunk_bytes={a: 64, c: 64})
    result = Runtime("cuda:0").run(graph)
    assert all_nan(result.outputs[c])
    assert fake_cuda.copies == {"h2d": 0, "d2h": 1, "d2d": 0}
    assert fake_cuda.violations == []


def test_one_pinned_pool_serves_every_query(fake_cuda):
    a = np.ones((32, 32), np.float32)
    with tq.connect(devices="cuda:0") as db:
        A = db.from_numpy("A", a, tile=(16, 16))
        for _ in range(3):
            (A @ A).numpy()
    with tq.connect(devices="cuda:0") as db2:
        (db2.from_numpy("B", a) * 2.0).numpy()
    pool = shared_pool()
    assert fake_cuda.pinned_bytes == pool.capacity  # pinned once for the process
    assert pool.in_use == 0  # every run gave its slots back
    assert Runtime("cuda:0").pool() is pool


# -- finding 8: the reserve covers the cuBLAS workspaces -------------------------------------
@pytest.mark.parametrize("fake_cuda", [{"devices": 1, "blas_workspace": 256 << 10}],
                         indirect=True)
def test_device_memory_stays_within_the_limit_with_blas_workspaces(fake_cuda):
    """The fake allocates a cuBLAS-like workspace per (thread, stream) at the first matrix
    product there, as torch does. The default reserve keeps one per compute stream (plus a
    16th for temporaries) out of the chunk budget, so the device's measured peak -- chunks,
    workspaces, temporaries -- stays within memory_limit; with no reserve it did not."""
    rng = np.random.default_rng(4)
    a = rng.standard_normal((128, 128)).astype(np.float32)  # 64 KiB; 4 KiB tiles
    limit = 640 << 10
    dev = CUDADevice("cuda:0")
    reserve = dev.default_reserve(limit)
    assert reserve == 2 * (256 << 10) + limit // 16
    with tq.connect(devices="cuda:0", memory_limit=limit) as db:
        A = db.from_numpy("A", a, tile=(32, 32))
        B = db.from_numpy("B", a, tile=(32, 32))
        text = ((A @ B) @ A).explain(analyze=True)
    assert evictions(text) > 0
    assert fake_cuda.max_memory_allocated(torch.device("meta", 0)) <= limit
    ran_on_device(fake_cuda)


@pytest.mark.parametrize("fake_cuda", [{"devices": 1, "blas_workspace": 256 << 10}],
                         indirect=True)
def test_streams_are_made_once_so_workspaces_do_not_grow_run_after_run(fake_cuda):
    a = np.ones((64, 64), np.float32)
    peaks = []
    with tq.connect(devices="cuda:0") as db:
        A = db.from_numpy("A", a, tile=(32, 32))
        for _ in range(4):
            (A @ A).numpy()
            peaks.append(len(fake_cuda._workspaces))
    assert peaks[0] >= 1 and peaks[-1] == peaks[0]


def _lane_threads():
    return {t for t in threading.enumerate() if t.name.startswith("tensorql-cuda:")}


@pytest.mark.parametrize("fake_cuda", [{"devices": 1}], indirect=True)
def test_a_devices_lanes_are_started_once_and_serve_every_run(fake_cuda):
    """The lanes' threads are made once per process, like the streams (a run used to start
    and join nine threads: ~13 ms a run on the loaded 2-core VM, 4-5 ms of fixed cost a run
    on the H100). Every run's completions still reach that run."""
    a = np.ones((64, 64), np.float32)
    seen = []
    with tq.connect(devices="cuda:0") as db:
        A = db.from_numpy("A", a, tile=(32, 32))
        for _ in range(4):
            assert all_nan((A @ A).numpy())
            seen.append(_lane_threads())
    assert seen[0] and all(threads == seen[0] for threads in seen)
    # compute (1 launcher + 2 stream waiters), h2d, d2h, d2h-peer (1 + 1 each)
    assert len(seen[0]) == 9
    ran_on_device(fake_cuda)


def test_the_lanes_of_an_interface_out_of_use_are_stopped():
    """A fake leaves no thread behind: ``cuda_api.use`` stops the lanes made for it."""
    from fake_cuda import FakeCuda

    before = _lane_threads()
    with cuda_api.use(FakeCuda(devices=1)):
        with tq.connect(devices="cuda:0") as db:
            (db.from_numpy("A", np.ones((8, 8), np.float32)) * 2.0).numpy()
        assert _lane_threads() - before
    assert _lane_threads() <= before


@pytest.mark.parametrize("fake_cuda", [{"devices": 1}], indirect=True)
def test_a_lane_keeps_no_chunk_of_a_finished_run_alive(fake_cuda):
    """The lanes outlive the run: after it, no device memory is held by their threads (the
    last op's closure or value used to stay referenced until the next op)."""
    import gc

    a = np.ones((64, 64), np.float32)
    with tq.connect(devices="cuda:0") as db:
        A = db.from_numpy("A", a, tile=(32, 32))
        (A @ A + 1.0).numpy()
        gc.collect()
        # what stays is the device's copies of the stored chunks (Options.device_cache)
        kept = _device_cache(fake_cuda).nbytes
        assert kept == a.nbytes
        assert fake_cuda.memory_allocated(fake_cuda.torch_device(0)) == kept


def _device_cache(fake, index: int = 0):
    return cuda_api.cache_of(fake)[("device cache", str(fake.torch_device(index)))]


def test_cuda_device_without_cuda_raises():
    class Absent(cuda_api.TorchCuda):
        def is_available(self):
            return False

    with cuda_api.use(Absent()), pytest.raises(ExecutionError, match="needs CUDA"):
        CUDADevice("cuda:0")


def test_a_dense_result_is_written_by_the_d2h_lane_into_its_tiles(fake_cuda):
    """Finding 6: result chunks of a dense result went D2H into pinned slots, then the
    coordinator cloned each and copied the clone into its tile (two host copies on the
    thread that schedules). Now the D2H lane copies each chunk into its tile: nothing of the
    result passes through the pinned pool, and the sink gets the tile itself."""
    from runtime_helpers import matmul_graph

    from tensorql.pipeline.run import DenseResults

    q, graph, _, _ = matmul_graph(n=64, tile=16)
    writer = DenseResults([q.physical.result_step])
    writer.tensors[0].zero_()
    sunk = []

    def sink(ref, chunk):
        sunk.append(chunk.data_ptr() == writer.destination(ref).data_ptr())
        writer.sink(ref, chunk)

    result = Runtime("cuda:0").run(graph, sink=sink, destination=writer.destination,
                                   keep_outputs=False)
    assert all_nan(writer.tensors[0])
    assert sunk and all(sunk)
    assert result.stats.pinned_bytes == 0
    assert all(v is None for v in result.outputs.values())  # none kept


def test_a_kernel_whose_output_is_not_on_the_device_is_an_error(fake_cuda):
    """A kernel that allocates its output without the inputs' device (finding 1's kind of
    bug) fails where it happens, naming the kernel, not at a later kernel or never (a
    result chunk computed on the CPU would just be copied out)."""
    graph, _ = _graph(lambda x: torch.zeros(tuple(x.shape)))
    with pytest.raises(ExecutionError, match="_Kernel returned a chunk on cpu"):
        Runtime("cuda:0").run(graph)


def test_a_fused_chain_over_a_big_chunk(fake_cuda):
    with violations_raised(fake_cuda), tq.connect(devices="cuda:0") as db:
        A = db.from_numpy("A", np.ones((1024, 1024), np.float32), tile=(1024, 1024))
        got = ((A * 2.0 + 1.0).relu().exp() - 1.0).numpy()
    assert all_nan(got)
    ran_on_device(fake_cuda)


@pytest.mark.parametrize("fake_cuda", [{"devices": 1, "blas_workspace": 32 << 20}],
                         indirect=True)
def test_a_limit_below_the_reserve_says_so(fake_cuda):
    from tensorql.errors import PlanError

    a = np.ones((64, 64), np.float32)
    with tq.connect(devices="cuda:0", memory_limit="16MiB") as db:
        A = db.from_numpy("A", a, tile=(32, 32))
        with pytest.raises(PlanError, match=r"16\.0 MiB of cuda:0 leaves nothing for chunks: "
                                            r"65\.0 MiB of it is kept"):
            (A @ A).numpy()


# -- products over the whole contracted label (issue 29 item 7: one mm per output tile) ----
def _product_tasks(expr):
    """The tasks of ``expr``'s product step, by output chunk."""
    q = expr.compile()
    sid = q.physical.result_step.id
    return [t for t in q.physical.task_graph().tasks if t.output.step == sid]


def test_a_product_on_cuda_is_one_mm_per_output_tile_over_the_whole_k(fake_cuda):
    """On a CUDA device the planner runs each output tile's K tiles as ONE product (the
    operand tiles put together on the device): 2 x 2 output tiles of K in 4 tiles are 4 mm
    calls, not 16 products folded into accumulators."""
    from tensorql.physical.kernels import ContractWhole

    rng = np.random.default_rng(3)
    a = rng.standard_normal((64, 128)).astype(np.float32)
    b = rng.standard_normal((128, 64)).astype(np.float32)
    with tq.connect(devices="cuda:0") as db:
        A, B = db.from_numpy("A", a, tile=(32, 32)), db.from_numpy("B", b, tile=(32, 32))
        tasks = _product_tasks(A @ B)
        assert len(tasks) == 4 and {type(t.kernel) for t in tasks} == {ContractWhole}
        assert all(len(t.inputs) == 8 for t in tasks)  # 4 K tiles of each operand
        got = (A @ B).numpy()
    assert got.shape == (64, 64) and all_nan(got)
    assert fake_cuda.ops_by_name.get("mm", 0) + fake_cuda.ops_by_name.get("addmm", 0) == 4
    assert fake_cuda.ops_by_name.get("cat", 0) == 8  # each operand's K tiles, put together
    ran_on_device(fake_cuda)


def test_whole_k_only_where_the_kernel_temporaries_hold_the_copies(fake_cuda):
    """Under a memory_limit whose share for kernel temporaries (1/16) is below an output
    tile's inputs, the product keeps its series of per-tile products (as on a CPU)."""
    from tensorql.physical.kernels import ContractChunk, ContractSeries, ContractWhole

    a = np.ones((64, 128), np.float32)
    with tq.connect(devices="cuda:0", memory_limit="256KiB") as db:
        A = db.from_numpy("A", a, tile=(32, 32))
        B = db.from_numpy("B", a.T.copy(), tile=(32, 32))
        kinds = {type(t.kernel) for t in _product_tasks(A @ B)}  # inputs 32 KiB > 16 KiB
    assert ContractWhole not in kinds and kinds <= {ContractChunk, ContractSeries}
    with tq.connect(devices="cuda:0", memory_limit="1MiB") as db:  # 64 KiB share: whole
        A = db.from_numpy("A", a, tile=(32, 32))
        B = db.from_numpy("B", a.T.copy(), tile=(32, 32))
        assert {type(t.kernel) for t in _product_tasks(A @ B)} == {ContractWhole}
    with tq.connect(devices="cpu") as db:  # a CPU's series keeps its accumulator in cache
        A = db.from_numpy("A", a, tile=(32, 32))
        B = db.from_numpy("B", a.T.copy(), tile=(32, 32))
        assert ContractWhole not in {type(t.kernel) for t in _product_tasks(A @ B)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_k_kernel_is_exact_against_torch_on_cpu_data(dtype):
    """The kernel the rule picks, on CPU data: the operands' K tiles put together (copied,
    or a view when they are slices of one tensor) and one product, equal to torch's product
    of the whole operands (integer values: every sum exact, in bfloat16 too)."""
    from tensorql.physical.builder import ContributionSeries, WholeK
    from tensorql.physical.kernels import ContractChunk, ContractWhole

    gen = torch.Generator().manual_seed(4)
    a = torch.randint(-3, 4, (48, 96), generator=gen).to(dtype)
    b = torch.randint(-3, 4, (96, 40), generator=gen).to(dtype)
    kernel = ContractChunk((("i", "k"), ("k", "j")), ("i", "j"), dtype=str(dtype)[6:])
    series = ContributionSeries(kernel, None, 1, WholeK.of(float("inf"), kernel,
                                                          {"i": 1, "k": 3, "j": 1}))
    for k in range(3):
        series.add((0, 0), None, [("a", k), ("b", k)], 0, 1)
    ((_, _, refs, task_kernel, _),) = list(series.tasks())
    assert isinstance(task_kernel, ContractWhole) and len(refs) == 6
    tiles = {("a", k): a[:, 32 * k:32 * (k + 1)] for k in range(3)}
    tiles |= {("b", k): b[32 * k:32 * (k + 1)] for k in range(3)}
    exact = a.double() @ b.double()
    views = task_kernel.run([tiles[r] for r in refs], None)  # slices of one tensor: no copy
    copies = task_kernel.run([tiles[r].clone() for r in refs], None)  # torch.cat
    out = torch.empty(48, 40, dtype=dtype)
    task_kernel.run_into([tiles[r].clone() for r in refs], out)
    for got in (views, copies, out):
        assert got.dtype == dtype and torch.equal(got.double(), exact)
    assert torch.equal(views, torch.mm(a, b))


# -- the fixed cost of a run (issue 29 item 7: ~4-5 ms a run on the H100) ------------------
def _one_product(tile: int = 64, whole_k: float | None = None):
    """bench/gpu_matmul.py's graph of one product whose inputs are device tensors (the
    fake's meta), with the runtime it runs on, results left on the device."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from gpu_matmul import tiled_matmul_graph

    a, b = torch.empty(64, 64, device="meta"), torch.empty(64, 64, device="meta")
    graph = tiled_matmul_graph(a, b, tile, whole_k)
    return graph, Runtime("cuda:0", None, workers=2, results_on_device=True)


def test_a_run_of_one_product_does_only_the_product_on_the_device(fake_cuda):
    """What a run of a one-product graph does on the host, counted with the fake (machine
    independent): its sources are slices of tensors already on the GPU, so their loads
    complete on the coordinator (no lane, no events, no thread hand-off, no bytes counted
    as copied); the product is the run's only op on a lane; its two CUDA events are made
    once and re-recorded by every later run; streams, lanes and the memory plan are made
    at the first run only."""
    graph, rt = _one_product()
    first = rt.run(graph)
    made = (fake_cuda.events_created, len(fake_cuda._streams))
    recorded = fake_cuda.events_recorded
    programs = dict(graph.programs)
    for _ in range(5):
        result = rt.run(graph)
    assert (fake_cuda.events_created, len(fake_cuda._streams)) == made
    assert made[0] == 2  # one pair, for the product
    assert fake_cuda.events_recorded - recorded == 5 * 2
    assert graph.programs.keys() == programs.keys()
    for res in (first, result):
        (dev,) = res.stats.devices
        assert dev.resident_loads == 2 and dev.bytes_h2d == 0 and dev.ops == 3
        assert list(res.outputs) == [ChunkRef(2, (0, 0))]
    assert fake_cuda.copies["h2d"] == 0 and fake_cuda.ops_by_name.get("mm") == 6
    assert fake_cuda.violations == []


def test_host_sources_still_go_through_the_copy_lane(fake_cuda):
    """A source in host memory is copied on the H2D lane (counted as copied), as before."""
    from tensorql.physical.kernels import ContractChunk

    src = torch.ones(8, 8)
    a, b, out = ChunkRef(0, (0,)), ChunkRef(1, (0,)), ChunkRef(2, (0,))
    kernel = ContractChunk((("i", "k"), ("k", "j")), ("i", "j"))
    graph = TaskGraph((Task(0, (), a, _Const(src)), Task(1, (), b, _Const(src)),
                       Task(2, (a, b), out, kernel)), retain=frozenset({2}),
                      chunk_bytes={a: src.nbytes, b: src.nbytes, out: src.nbytes})
    result = Runtime("cuda:0", None, results_on_device=True).run(graph)
    (dev,) = result.stats.devices
    assert dev.resident_loads == 0 and dev.bytes_h2d == 2 * src.nbytes
    assert fake_cuda.copies["h2d"] == 2


class _Const:
    """A source kernel returning a host tensor (not ``inline``)."""

    def __init__(self, value):
        self.value = value

    def run(self, inputs, acc):
        return self.value

    def combine(self, acc, partial):
        raise AssertionError


# -- stored tensors kept in device memory across queries (Options.device_cache) ------------
def _tiles(x: np.ndarray, rows: int, cols: int) -> list[np.ndarray]:
    return [np.ascontiguousarray(x[i:i + rows, j:j + cols])
            for i in range(0, x.shape[0], rows) for j in range(0, x.shape[1], cols)]


def _same_chunks(sent: list[torch.Tensor], x: np.ndarray, rows: int, cols: int) -> bool:
    """``sent`` (host data of H2D copies) is exactly the chunks of ``x``, in any order."""
    want = sorted(t.tobytes() for t in _tiles(x, rows, cols))
    return sorted(np.ascontiguousarray(s.numpy()).tobytes() for s in sent) == want


@pytest.mark.parametrize("fake_cuda", [{"devices": 1}], indirect=True)
def test_a_second_query_reads_the_stored_weights_from_device_memory(fake_cuda):
    """Query 1 copies the stored weights to the GPU (H2D); query 2, another expression
    reading them, copies only its other operand: the weights' loads find the device copies
    kept by query 1 (no H2D bytes for them). A store of new values is seen: query 3 copies
    the new chunks, exactly, and none of the old."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    x1 = rng.standard_normal((16, 64)).astype(np.float32)
    x2 = rng.standard_normal((16, 64)).astype(np.float32)
    w_new = (w + 1.0).astype(np.float32)
    fake_cuda.record_h2d = True
    with tq.connect(devices="cuda:0") as db:
        W = db.from_numpy("W", w, tile=(32, 32))
        X1, X2 = db.from_numpy("X1", x1, tile=(16, 32)), db.from_numpy("X2", x2, tile=(16, 32))
        assert all_nan((X1 @ W).numpy())
        first = fake_cuda.h2d_sources
        assert len(first) == 2 + 2  # W's 2 chunks and X1's 2
        assert _same_chunks([t for t in first if t.shape == (32, 32)], w, 32, 32)
        fake_cuda.h2d_sources = []
        text = (X2 @ W).relu().explain(analyze=True)
        assert _same_chunks(fake_cuda.h2d_sources, x2, 16, 32)  # X2's chunks only
        assert "H2D 4.0 KiB" in text  # X2: 2 chunks of 16 x 32 float32
        assert "found in device memory 8.0 KiB" in text  # W: 2 chunks of 32 x 32
        fake_cuda.h2d_sources.clear()
        db.from_numpy("W", w_new, tile=(32, 32), replace=True)
        assert all_nan((X2 @ db.tensor("W")).numpy())
        assert len(fake_cuda.h2d_sources) == 2  # the new W's chunks; X2's are kept
        assert _same_chunks(fake_cuda.h2d_sources, w_new, 32, 32)
        fake_cuda.h2d_sources.clear()
        assert all_nan((X2 @ db.tensor("W")).numpy())
        assert fake_cuda.h2d_sources == []  # everything it reads is on the device now
    ran_on_device(fake_cuda)


@pytest.mark.parametrize("fake_cuda", [{"devices": 1}], indirect=True)
def test_the_device_cache_stays_within_its_share_of_the_memory_limit(fake_cuda):
    """The kept copies are at most device_cache bytes, least recently used out first, and
    under memory_limit at most what the run's memory plan leaves of the budget (so the
    copies and the run's chunks fit the limit together); device_cache=0 keeps none."""
    a = np.ones((128, 128), np.float32)  # 16 chunks of 4 KiB
    with tq.connect(devices="cuda:0", device_cache="16KiB") as db:
        A = db.from_numpy("A", a, tile=(32, 32))
        assert all_nan((A @ A).numpy())
        cache = _device_cache(fake_cuda)
        assert cache.nbytes == 16 << 10 and cache.evictions > 0
    cache.clear()
    fake_cuda.reset_peak_memory_stats(fake_cuda.torch_device(0))
    limit = 160 << 10
    with tq.connect(devices="cuda:0", memory_limit=limit) as db:
        A = db.from_numpy("A", a[:64], tile=(32, 32))
        B = db.from_numpy("B", a[:, :64], tile=(32, 32))
        physical = (A @ B).compile().physical
        graph = physical.task_graph()
        for _ in range(2):
            with physical.pinned():  # as the pipeline runs it: one version of each tensor
                result = Runtime("cuda:0", limit, device_cache="auto").run(graph)
            (dev,) = result.stats.devices
            room = dev.budget - dev.planned_peak_bytes
            assert 0 < cache.nbytes <= min(limit // 4, room), (cache.nbytes, room)
        assert dev.resident_loads > 0  # the second run found copies the first one kept
        assert fake_cuda.max_memory_allocated(fake_cuda.torch_device(0)) <= limit
    cache.clear()
    with tq.connect(devices="cuda:0", device_cache=0) as db:
        A = db.from_numpy("A", a, tile=(32, 32))
        assert all_nan((A @ A).numpy())
        assert cache.nbytes == 0
    ran_on_device(fake_cuda)


def _whole_k_run(expression, seed, limit=None, direct=True):
    """``expression(A, B)`` over integer-valued 96x128 and 128x64 operands in 32x32 tiles,
    planned whole-K (forced on a CPU session) and run through the engine on real data: the
    operands, the result step's tasks and the dense result."""
    from dataclasses import replace

    from runtime_helpers import dense

    from tensorql.physical.builder import build

    rng = np.random.default_rng(seed)
    a = rng.integers(-4, 5, (96, 128)).astype(np.float64)
    b = rng.integers(-4, 5, (128, 64)).astype(np.float64)
    with tq.connect(devices="cpu") as db:
        A, B = db.from_numpy("A", a, tile=(32, 32)), db.from_numpy("B", b, tile=(32, 32))
        q = expression(A, B).compile()
        q = replace(q, physical=build(q.logical, None, db.chunk_store, whole_k=float("inf")))
        graph = q.physical.task_graph()
        product = [t for t in graph.tasks if t.output.step == q.physical.result_step.id]
        with q.physical.pinned():
            result = Runtime("cpu", limit, workers=2, direct=direct).run(graph)
    return a, b, product, dense(q, result.outputs).numpy()


@pytest.mark.parametrize("strategy", ["direct", "streams"])
def test_a_whole_k_plan_runs_exactly_on_cpu_data(strategy):
    """The whole-K plan: one task per output chunk, each reading every K tile of its
    operands, equal to numpy's product (integer values: every sum exact)."""
    from tensorql.physical.kernels import ContractWhole

    a, b, product, got = _whole_k_run(lambda A, B: A @ B, 6,
                                      None if strategy == "direct" else 1 << 20,
                                      direct=strategy == "direct")
    assert len(product) == 6 and all(isinstance(t.kernel, ContractWhole) for t in product)
    assert np.array_equal(got, a @ b)


def test_an_activation_over_a_whole_k_product_is_its_epilogue_and_exact():
    """relu(A @ B) with the whole-K plan: the relu folds into each output chunk's one product
    (ContractEpilogue over ContractWhole), and the result equals numpy's."""
    from tensorql.physical.kernels import ContractEpilogue, ContractWhole

    a, b, product, got = _whole_k_run(lambda A, B: (A @ B).relu(), 7)
    assert len(product) == 6 and all(
        isinstance(t.kernel, ContractEpilogue) and isinstance(t.kernel.kernel, ContractWhole)
        for t in product)
    assert np.array_equal(got, np.maximum(a @ b, 0))


# -- what a GPU's first run found (an H100, 2026-11-27): CPU-shaped plans on the GPU -------
def _compute_ops(fake: FakeCuda) -> int:
    return fake.ops_by_label.get("compute", 0)


@pytest.mark.parametrize("fake_cuda", [{"devices": 1}], indirect=True)
def test_a_fused_chain_on_the_gpu_is_one_launch_an_op_not_one_a_block(fake_cuda):
    """A fused pointwise chain runs in row blocks of 2^18 elements on the CPU (its
    intermediates stay in cache); on the GPU blocks are only more, smaller launches: a
    4-op chain over a 2^22-element chunk was 16 blocks x 4 ops there."""
    with violations_raised(fake_cuda), tq.connect(devices="cuda:0") as db:
        A = db.from_numpy("A", np.ones((2048, 2048), np.float32), tile=(2048, 2048))
        query = ((A * 2.0 + 1.0).relu().exp() - 1.0)
        before = _compute_ops(fake_cuda)
        got = query.numpy()
        ops = _compute_ops(fake_cuda) - before
    assert all_nan(got)
    assert ops <= 8, f"{ops} ops on the GPU for a chain of 4 pointwise ops over one chunk"
    ran_on_device(fake_cuda)


@pytest.mark.parametrize("fake_cuda", [{"devices": 1}], indirect=True)
def test_causal_attention_past_a_run_of_positions_does_not_read_the_mask_on_the_host(
        fake_cuda):
    """On the CPU a causal mask's layout (which keys each run of 64 query positions sees) is
    read on the host and attention is called per run over its keys; on a GPU that read is
    a sync inside a kernel (the strict fake raises it) and the calls too small to fill the
    device: one call over every key there."""
    with violations_raised(fake_cuda), tq.connect(devices="cuda:0") as db:
        w = workloads.llama_block(db, batch=1, seq=256, d_model=32, heads=2, head_dim=16,
                                  d_ff=48)
        got = w.output.numpy()
    assert got.shape == w.reference().shape and all_nan(got)
    ran_on_device(fake_cuda)


@pytest.mark.parametrize("fake_cuda", [{"devices": 1}], indirect=True)
def test_automatic_tiles_are_the_devices_choice(fake_cuda):
    """Automatic tiles aim at 2^22 elements on CPUs and 2^24 on GPUs (a LLaMA-7B layer's
    prefill planned at 2^20 on an H100 was 945 tasks, each a few launches too small for
    the device); under a memory_limit at most 1/128 of it, never below 2^20; a value given
    is kept, and ``with_`` re-derives only the automatic one."""
    from tensorql.options import Options

    assert Options(devices="cpu").tile_target_elems == 1 << 22
    gpu = Options(devices="cuda:0")
    assert gpu.tile_target_elems == 1 << 24
    assert gpu.with_(devices="cpu").tile_target_elems == 1 << 22
    assert Options(devices="cuda:0", memory_limit="1GiB").tile_target_elems == 1 << 21
    assert Options(devices="cuda:0", memory_limit="64MiB").tile_target_elems == 1 << 20
    assert Options(devices=["cpu:0", "cuda:0"]).tile_target_elems == 1 << 22
    assert Options(devices="cpu", memory_limit="1GiB").tile_target_elems == 1 << 21
    given = Options(devices="cuda:0", tile_target_elems=1 << 16)
    assert given.with_(devices="cpu").tile_target_elems == 1 << 16
    assert given.with_(workers=1).tile_target_elems == 1 << 16
    with tq.connect(devices="cuda:0") as db:
        x = db.constant(np.ones((4096, 4096), np.float32))
        assert x.node.grid.blocks == (1, 1)
    with tq.connect(devices="cpu") as db:
        x = db.constant(np.ones((4096, 4096), np.float32))
        assert math.prod(x.node.grid.blocks) >= 4


@pytest.mark.parametrize("fake_cuda", [{"devices": 1}], indirect=True)
def test_a_gpu_plan_does_not_follow_the_hosts_core_count(fake_cuda):
    """Planning splits a step into at least two tasks per lane: a CPU's workers, a GPU's
    compute streams. A 16-core H100 host planned a LLaMA layer's prefill for 16 lanes (3336
    tasks, attention in 32-row pieces) on a GPU that runs 2 kernels side by side."""
    from tensorql.models import Llama, LlamaShape

    shape = LlamaShape(vocab=64, d_model=256, d_ff=512, layers=1, heads=4, kv_heads=4,
                       head_dim=64)

    def tasks(workers: int) -> int:
        with tq.connect(devices="cuda:0", workers=workers) as db:
            assert db.options.task_lanes == 2
            model = Llama.random(db, shape, seed=0)
            text = model.prefill(1, 2048).query().explain()
        return int(re.search(r"(\d+) chunk tasks", text).group(1))

    assert tasks(16) == tasks(2)
    with tq.connect(devices="cpu", workers=4) as db:
        assert db.options.task_lanes == 4


def test_connect_checks_the_named_cuda_devices_are_on_the_machine(fake_cuda, tmp_path):
    """A session naming a GPU the machine lacks fails at connect (it used to fail at the
    first query), and nothing is created; planning for devices elsewhere still works."""
    import tensorql as tq

    with pytest.raises(tq.OptionError, match=r"'cuda:2' but this machine has 2 CUDA devices"):
        tq.connect(str(tmp_path / "x.duckdb"), devices=["cuda:0", "cuda:2"])
    assert not (tmp_path / "x.duckdb").exists()

    class Absent(cuda_api.TorchCuda):
        def is_available(self):
            return False

    with cuda_api.use(Absent()):
        with pytest.raises(tq.OptionError, match="'cuda:0' but no CUDA device is available"):
            tq.connect(devices="cpu:0, cuda:0")
        with tq.connect() as db:
            a = db.from_numpy("a", np.ones((4, 4), np.float32))
            assert tq.optimize(a @ a, devices=["cuda:0", "cuda:1"]).devices == 2
    with tq.connect(devices=["cuda:0", "cuda:1"]) as db:
        assert db.options.device_set.names == ("cuda:0", "cuda:1")
