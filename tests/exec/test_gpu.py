"""The runtime on a CUDA device (skipped without one)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_offload_matmul_exact_and_within_limit():
    """Device memory stays within ``memory_limit`` -- chunks, cuBLAS workspaces and kernel
    temporaries together, as ``torch.cuda.max_memory_allocated`` measures it.

    The arithmetic: the memory plan keeps the chunks within the budget, ``limit - reserve``
    (checked by the runtime: ``dev.peak_bytes``). The reserve is ``2 * ws + limit // 16``
    (``CUDADevice.default_reserve``): cuBLAS keeps one workspace of ``ws`` bytes per (handle,
    stream) pair that ran a product -- the compute lane has one launching thread (one handle)
    and 2 streams, made once per process -- and the one kernel being launched at a time has
    temporaries of at most one 1 MiB output tile here (the partial product of a 512-tile
    contribution), well within ``limit // 16``. Before, the test gave no reserve and allowed
    16 MiB on top: on an H100 the peak was 80 MiB against a 16 MiB limit (2 workspaces of
    32 MiB)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from gpu_matmul import tiled_matmul_graph

    import tensorql.cuda_api as cuda_api
    from tensorql.exec.runtime import Runtime

    n, tile = 2048, 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    graph = tiled_matmul_graph(a, b, tile)
    ws = cuda_api.current().blas_workspace_bytes(torch.device("cuda", 0))
    limit = ((16 << 20) + 2 * ws) * 16 // 15  # leaves a chunk budget of about 16 MiB
    runtime = Runtime("cuda:0", limit, host_pool_bytes=64 << 20)
    budget = runtime.budgets()[0]
    assert budget == limit - 2 * ws - limit // 16 and budget >= 15 << 20
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = runtime.run(graph)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    out = torch.empty(n, n)
    for ref, chunk in result.outputs.items():
        i, j = ref.key
        out[i * tile:(i + 1) * tile, j * tile:(j + 1) * tile] = chunk
    torch.testing.assert_close(out, a @ b, rtol=1e-3, atol=1e-2)
    dev = result.stats.devices[0]
    assert dev.peak_bytes <= budget and dev.evictions > 0
    assert peak <= limit, (peak, limit, budget, ws)
    assert dev.overlap_s > 0


def test_kernels_stay_in_flight_without_a_host_wait_per_op():
    """The launching thread records each op's end event and goes on (finding 7): 8 kernels
    of ~50 ms of GPU time each: more than two are launched before the first completes (the
    launch of one takes microseconds; 50 ms leaves room for a host loaded by other tests)."""
    import threading
    import time

    from tensorql.exec.devices.cuda import CUDADevice

    dev = CUDADevice("cuda:0")
    done, launched = [], []
    cond = threading.Condition()

    def post(c):
        with cond:
            done.append(c)
            cond.notify_all()

    def work():
        launched.append(time.perf_counter())
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time at ~2 GHz
        return torch.ones(4, device="cuda:0")

    dev.open(post)
    try:
        for i in range(8):
            dev.submit("compute", i, work)
        with cond:
            assert cond.wait_for(lambda: len(done) == 8, timeout=60)
    finally:
        dev.close()
    assert all(c.error is None for c in done)
    assert sum(1 for t in launched if t < min(c.ended for c in done)) > 2


def test_repeated_runs_do_not_grow_device_memory(rng):
    """The device's streams are made once per process, so the cuBLAS workspaces (one per
    handle and stream) do not pile up query after query."""
    import numpy as np

    import tensorql as tq

    a = rng.standard_normal((1024, 1024)).astype(np.float32)
    allocated, reserved = [], []
    with tq.connect(devices="cuda:0") as db:
        A = db.from_numpy("A", a, tile=(512, 512))
        for _ in range(5):
            got = (A @ A).numpy()
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated())
            reserved.append(torch.cuda.memory_reserved())
    np.testing.assert_allclose(got, a @ a, rtol=1e-3, atol=1e-2)
    assert allocated[-1] == allocated[1], allocated
    assert reserved[-1] <= reserved[1] + (16 << 20), reserved


def test_a_source_resident_on_the_gpu_is_used_in_place():
    from tensorql.exec.devices.cuda import CUDADevice

    dev = CUDADevice("cuda:0")
    x = torch.randn(8, 8, device="cuda:0")
    assert dev.to_device(x) is x
    assert dev.to_device(x.cpu()).device == x.device


def test_api_on_cuda(rng):
    import numpy as np

    import tensorql as tq

    # 48 MiB of operands and result against a limit that, less the reserve of two cuBLAS
    # workspaces and a 16th, leaves about 9 MiB of chunks on an H100 (more on older GPUs)
    a = rng.standard_normal((2048, 2048)).astype(np.float32)
    with tq.connect(devices="cuda", memory_limit="80MiB") as db:
        A = db.from_numpy("A", a, tile=(256, 256))
        got = (A @ A).numpy()
    np.testing.assert_allclose(got, a.astype(np.float64) @ a, rtol=1e-3, atol=1e-2)
