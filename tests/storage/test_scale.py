"""Scale: a tensor bigger than the writer may hold, streamed from a memory-mapped .npy.

Acceptance (issue 3): store and read back a 4 GiB tensor with peak RSS under 1.5 GiB during the
write. Marked slow (it writes ~8 GiB to disk); run it with ``make test-slow``.
``TENSORQL_SCALE_GIB`` changes the size (e.g. 0.25 for a quick try).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

GIB = 1 << 30
SIZE_GIB = float(os.environ.get("TENSORQL_SCALE_GIB", "4"))
RSS_LIMIT = int(1.5 * GIB)

# Peak RSS is VmHWM, the high-water mark of this process's own memory map. (ru_maxrss would
# not do: Linux carries it over from the forking parent, pytest, through exec.)
WRITER = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import tensorql as tq
    npy, db_path = sys.argv[1], sys.argv[2]
    source = np.load(npy, mmap_mode="r")
    start = time.perf_counter()
    def status(field):
        lines = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return int(lines[field].split()[0]) * 1024
    with tq.connect(db_path, devices="cpu") as db:  # host memory is what is measured
        before = status("VmRSS")  # the libraries' own: ~0.3 GiB with a CPU torch
        db.from_numpy("big", source, tile=(2048, 2048))
    seconds = time.perf_counter() - start
    print(json.dumps({"peak_rss": status("VmHWM"), "before_rss": before, "seconds": seconds}))
""")

READER = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import tensorql as tq
    from tensorql.storage.mapped import MappedPageReleaser
    npy, db_path = sys.argv[1], sys.argv[2]
    source = np.load(npy, mmap_mode="r")
    releaser = MappedPageReleaser.for_array(source)
    start = time.perf_counter()
    chunks = mismatched = 0
    with tq.connect(db_path, read_only=True, chunk_cache_bytes=1, devices="cpu") as db:
        meta = db.chunk_store.meta("big")
        for key, chunk in db.iter_chunks("big"):
            expected = source[meta.grid.slices(key)]
            if not np.array_equal(chunk.numpy(), expected):
                mismatched += 1
            releaser.consumed(expected.nbytes)
            chunks += 1
    print(json.dumps({"chunks": chunks, "mismatched": mismatched,
                      "seconds": time.perf_counter() - start, "expected": meta.grid.num_chunks}))
""")


def _run(script: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_store_and_read_back_4_gib_from_memory_mapped_npy(tmp_path):
    side = int((SIZE_GIB * GIB / 4) ** 0.5)
    npy = str(tmp_path / "big.npy")
    source = np.lib.format.open_memmap(npy, mode="w+", dtype=np.float32, shape=(side, side))
    rows = max(1, (64 << 20) // (side * 4))
    for r in range(0, side, rows):  # distinct values everywhere, written 64 MiB at a time
        block = np.arange(r * side, min(r + rows, side) * side, dtype=np.int64)
        source[r:r + rows] = (block % 1_000_003).astype(np.float32).reshape(-1, side)
    source.flush()
    del source

    wrote = _run(WRITER, npy, str(tmp_path / "big.duckdb"))
    print(f"\nwrite {SIZE_GIB:g} GiB: {wrote['seconds']:.1f} s, "
          f"peak RSS {wrote['peak_rss'] / 2**20:.0f} MiB")
    # issue 3's figure, for the CPU build of torch CI runs; a CUDA build maps ~0.4 GiB more of
    # libraries at import (1.9 GiB peak on an H100 machine), which no write can shed: there the
    # write's own growth is what is bounded, by the same 1.5 GiB less a CPU build's libraries
    assert wrote["peak_rss"] - wrote["before_rss"] < RSS_LIMIT - (256 << 20)
    if torch.version.cuda is None:
        assert wrote["peak_rss"] < RSS_LIMIT

    read = _run(READER, npy, str(tmp_path / "big.duckdb"))
    print(f"read back: {read['seconds']:.1f} s, {read['chunks']} chunks")
    assert read["chunks"] == read["expected"]
    assert read["mismatched"] == 0
