"""Chunk store I/O: DuckDB store write/read throughput against np.save / np.load.

    python bench/store_io.py [--mb 256] [--tile 1024]

Measured in the same run, on the same float32 array: np.save + np.load of a .npy file in the
page cache (the baseline), and tensorql's DuckDB store in memory and in a database file
(write = from_numpy; read = every chunk back as torch tensors, cold chunk cache). Goals: read
>= 0.5x and write >= 0.25x numpy's throughput. Exits 1 if the file-backed store misses them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

import tensorql as tq


def _best(fn, repeat=3):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="array size in MiB")
    parser.add_argument("--tile", type=int, default=1024)
    args = parser.parse_args(argv)
    side = int((args.mb * 2**20 / 4) ** 0.5)
    array = np.random.default_rng(0).standard_normal((side, side), dtype=np.float32)
    mib = array.nbytes / 2**20
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        npy = os.path.join(tmp, "a.npy")
        t_np_w = _best(lambda: np.save(npy, array))
        t_np_r = _best(lambda: np.load(npy))
        rows.append(("numpy save/load", t_np_w, t_np_r))
        for label, path in (("duckdb :memory:", None),
                            ("duckdb file", os.path.join(tmp, "s.duckdb"))):
            db = tq.connect(path, chunk_cache_bytes=0)

            def write(db=db):
                db.from_numpy("a", array, tile=(args.tile, args.tile), replace=True)

            def read(db=db):
                for _ in db.iter_chunks("a"):
                    pass

            t_w = _best(write)
            t_r = _best(read)
            got = db.tensor("a").numpy()
            assert np.array_equal(got, array)
            db.close()
            rows.append((label, t_w, t_r))
    print(f"array {array.shape} float32 = {mib:.0f} MiB, tile {args.tile}")
    print(f"{'store':18} {'write MiB/s':>12} {'read MiB/s':>11} {'write/np':>9} {'read/np':>8}")
    ok = True
    for label, t_w, t_r in rows:
        w_ratio, r_ratio = t_np_w / t_w, t_np_r / t_r
        print(f"{label:18} {mib / t_w:12.0f} {mib / t_r:11.0f} {w_ratio:9.2f} {r_ratio:8.2f}")
        if label == "duckdb file":
            ok = w_ratio >= 0.25 and r_ratio >= 0.5
    print("goals (file store): write >= 0.25x, read >= 0.5x numpy:", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
