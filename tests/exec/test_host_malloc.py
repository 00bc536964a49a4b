"""The allocator tuning done when tensorql is imported: a query run again reuses the memory of
its chunk buffers instead of faulting fresh pages in (glibc's per-thread arenas unmap their
empty heaps; one arena keeps them). Each case runs in a fresh interpreter, so the tuning is
applied (or not) before any thread exists, as in a user's process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tensorql.exec.host_malloc import tune_malloc

_RUN_AGAIN = """
import resource
import numpy as np
import tensorql as tq

x = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
with tq.connect(devices="cpu", workers=2) as db:  # chunks in host memory
    a = db.from_numpy("a", x, tile=(256, 1024))  # 1 MiB chunks
    expr = (((a @ a).relu() * 0.01) @ a).exp().sum()
    for _ in range(3):
        expr.numpy()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        expr.numpy()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""


def _faults_per_run(tuning: str) -> float:
    env = dict(os.environ, TENSORQL_MALLOC_TUNING=tuning)
    done = subprocess.run([sys.executable, "-c", _RUN_AGAIN], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    return float(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not tune_malloc(), reason="the allocator is not glibc's")
def test_a_query_run_again_reuses_its_chunk_memory():
    # ~24 MiB of 1 MiB chunks a run: untuned, ~6,000 pages are faulted in every run
    # (measured 6,200); tuned, a few dozen
    untuned = _faults_per_run("0")
    tuned = _faults_per_run("1")
    assert untuned > 2000, untuned  # the workload does allocate what the test is about
    assert tuned < untuned / 6, (tuned, untuned)


def test_a_big_dense_result_on_huge_pages_is_right_and_outlives_its_tensor():
    """A result of HUGE_RESULT_BYTES or more is a mapping of its own (advised onto huge
    pages): its values are the product's, and a numpy array over it keeps it alive; a small
    one is an ordinary tensor."""
    import gc

    import numpy as np
    import torch

    import tensorql as tq
    from tensorql.exec.host_malloc import HUGE_RESULT_BYTES, empty_result

    rows, cols = 2048, HUGE_RESULT_BYTES // (4 * 2048)  # float32: exactly the threshold
    rng = np.random.default_rng(3)
    a = rng.standard_normal(rows).astype(np.float32)
    b = rng.standard_normal(cols).astype(np.float32)
    with tq.connect(devices="cpu") as db:  # a result in host memory
        out = tq.einsum("i,j->ij", db.constant(a), db.constant(b)).numpy()
    gc.collect()
    np.testing.assert_array_equal(out, np.outer(a, b))
    big = empty_result((rows, cols), torch.float32)
    big.fill_(1.0)
    assert big.is_contiguous() and float(big.sum()) == rows * cols
    assert empty_result((4, 4), torch.float64).dtype == torch.float64


_BIG_BUFFERS = """
import resource
import torch
import tensorql
tensorql.Database  # the API's modules loaded, as before a session (import tensorql loads few)
from tensorql.exec import host_malloc
from tensorql.exec.host_malloc import free_heap_bytes, heap_only, release_free_memory

def faults(fn):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

big = (64 << 20) // 4  # 64 MiB of float32: above the 32 MiB glibc could map on its own
with heap_only():  # as while a query runs
    torch.ones(big).sum()  # first use: its pages are faulted in once
    again = faults(lambda: torch.ones(big).sum())
    kept = free_heap_bytes() >= (48 << 20)
held = rss_kib()
released = release_free_memory(keep=0, every=0)
dropped = held - rss_kib()
# a long query's freed memory goes back when it ends (here: any query, beyond 16 MiB free)
host_malloc.RETAINED_FREE_BYTES, host_malloc.LONG_QUERY_S = 16 << 20, 0.0
with heap_only():
    torch.ones(big).sum()
    held = rss_kib()
print(again, kept, released, dropped, held - rss_kib())
"""


@pytest.mark.skipif(not tune_malloc(), reason="the allocator is not glibc's")
def test_big_buffers_are_reused_and_free_memory_can_be_given_back():
    """While a query runs (heap_only), a 64 MiB buffer freed and asked for again comes from
    the heap without faulting its pages in anew (glibc maps it afresh each time); the free
    memory the process keeps goes back to the system with release_free_memory, which a
    query calls when it ends."""
    env = dict(os.environ, TENSORQL_MALLOC_TUNING="1")
    done = subprocess.run([sys.executable, "-c", _BIG_BUFFERS], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    again, kept, released, dropped_kib, after_query_kib = done.stdout.split()
    assert int(again) < 2000, again  # 16,384 pages when mapped afresh
    assert kept == "True" and released == "True"
    assert int(dropped_kib) > 32 << 10, dropped_kib  # most of the 64 MiB left the process
    assert int(after_query_kib) > 32 << 10, after_query_kib  # and again at a query's end


def test_importing_tensorql_leaves_pyarrow_unloaded():
    """pyarrow loads its own allocator when imported, and with it loaded the heap tuning
    above no longer keeps big buffers in the heap (seen: 16,384 page faults for a buffer
    asked for again, as if mapped afresh): tensorql imports it only where Arrow is used."""
    done = subprocess.run([sys.executable, "-c", "import sys, tensorql; tensorql.Database; "
                           "tensorql.connect; print('pyarrow' in sys.modules)"],
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"
