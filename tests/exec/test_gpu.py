"""The runtime on a CUDA device (skipped without one)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_offload_matmul_exact_and_within_limit():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from gpu_matmul import tiled_matmul_graph

    from tensorql.exec.runtime import Runtime

    n, tile = 2048, 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    graph = tiled_matmul_graph(a, b, tile)
    limit = 3 * n * n * 4 // 3
    runtime = Runtime("cuda:0", limit, reserve_bytes=0, host_pool_bytes=64 << 20)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = runtime.run(graph)
    peak = torch.cuda.max_memory_allocated() - base
    out = torch.empty(n, n)
    for ref, chunk in result.outputs.items():
        i, j = ref.key
        out[i * tile:(i + 1) * tile, j * tile:(j + 1) * tile] = chunk
    torch.testing.assert_close(out, a @ b, rtol=1e-3, atol=1e-2)
    dev = result.stats.devices[0]
    assert dev.peak_bytes <= limit and dev.evictions > 0
    assert peak <= limit + (16 << 20)  # + cuBLAS workspace
    assert dev.overlap_s > 0


def test_api_on_cuda(rng):
    import numpy as np

    import tensorql as tq

    a = rng.standard_normal((256, 256)).astype(np.float32)
    with tq.connect(devices="cuda", memory_limit="1MiB") as db:
        A = db.from_numpy("A", a, tile=(64, 64))
        got = (A @ A).numpy()
    np.testing.assert_allclose(got, a @ a, rtol=1e-3, atol=1e-3)
