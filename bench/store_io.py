"""Chunk store I/O: DuckDB store write/read throughput against np.save / np.load.

    python bench/store_io.py [--mb 256] [--tile 1024] [--repeat 7] [--smoke]

Measured in the same run, on the same float32 array: np.save + np.load of a .npy file in the
page cache (the baseline), and tensorql's DuckDB store in memory and in a database file
(write = from_numpy; read = every chunk back as torch tensors, cold chunk cache). Goals: read
>= 0.5x and write >= 0.25x numpy's throughput. Exits 1 if the file-backed store misses them.

Two "DuckDB floor" rows show what DuckDB itself does with the same bytes, with no tensorql code
and no key columns, in a database file with the store's settings: the bytes as one uncompressed
BLOB column of 4 KiB pages, and as one uncompressed FLOAT column (write = INSERT from Arrow +
CHECKPOINT; read = the column scanned to an Arrow table). No store built on DuckDB can beat them.

Method (``bench/harness.py``): each write and read is timed ``--repeat`` times (after one
untimed call, whose time is kept as the cold figure); medians and IQRs are printed. Every
store's read-back is compared with the array (exit 1 if it differs, smoke or not); the goals
are gated unless ``--smoke``. The rows run one after the other in one process: they are I/O
of the same bytes through the page cache, not contenders sharing a CPU-bound state.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import duckdb
import numpy as np
import pyarrow as pa
from harness import Record, Timing, add_arguments

import tensorql as tq
from tensorql.storage.duckdb_store import ROW_GROUP_ROWS
from tensorql.storage.pages import PAGE_BYTES

REPEAT = [7]


def _best(fn, repeat: int | None = None) -> Timing:
    """``fn``'s timing: one untimed (cold) call, then ``repeat`` timed ones."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeat or REPEAT[0]):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return Timing(times, first)


def duckdb_floor(array: np.ndarray, path: str, as_float: bool) -> tuple[Timing, Timing]:
    """(write s, read s) of DuckDB alone storing ``array``'s bytes in one column."""
    con = duckdb.connect()
    con.execute(f"ATTACH ? AS floor (ROW_GROUP_SIZE {ROW_GROUP_ROWS})", [path])
    con.execute("USE floor")
    con.execute("SET memory_limit = '1GiB'")
    if as_float:
        column, sql_type = pa.array(array.reshape(-1)), "FLOAT"
    else:
        raw = array.reshape(-1).view(np.uint8)
        offsets = np.arange(0, raw.size + PAGE_BYTES, PAGE_BYTES, dtype=np.int64)
        offsets[-1] = min(offsets[-1], raw.size)
        column = pa.Array.from_buffers(pa.large_binary(), len(offsets) - 1,
                                       [None, pa.py_buffer(offsets), pa.py_buffer(raw)])
        sql_type = "BLOB"
    con.register("source", pa.table({"v": column}))
    runs = [0]

    def write():
        runs[0] += 1
        con.execute(f"CREATE TABLE t{runs[0]} (v {sql_type} USING COMPRESSION uncompressed)")
        con.execute(f"INSERT INTO t{runs[0]} SELECT v FROM source")
        con.execute("CHECKPOINT")

    t_w = _best(write)
    t_r = _best(lambda: con.sql(f"SELECT v FROM t{runs[0]}").to_arrow_table())
    con.close()
    return t_w, t_r


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="array size in MiB")
    parser.add_argument("--tile", type=int, default=1024)
    parser.add_argument("--smoke", action="store_true", help="goals not gated (a smoke run)")
    add_arguments(parser, isolate=None)
    args = parser.parse_args(argv)
    REPEAT[0] = args.repeat
    record = Record("store_io", smoke=args.smoke, args=args, argv=argv)
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
            record.check(f"{label}: read back equal", bool(np.array_equal(got, array)))
            db.close()
            rows.append((label, t_w, t_r))
        for label, as_float in (("floor: BLOB pages", False), ("floor: FLOAT col", True)):
            rows.append((label, *duckdb_floor(array, os.path.join(tmp, f"{as_float}.duckdb"),
                                              as_float)))
    print(f"array {array.shape} float32 = {mib:.0f} MiB, tile {args.tile}")
    t_np_w, t_np_r = rows[0][1].median, rows[0][2].median
    table = []
    for label, t_w, t_r in rows:
        record.timings(label, {"write": t_w, "read": t_r})
        w_ratio, r_ratio = t_np_w / t_w.median, t_np_r / t_r.median
        table.append([label, mib / t_w.median, mib / t_r.median, w_ratio, r_ratio,
                      mib / t_w.first_s, mib / t_r.first_s])
        if label == "duckdb file":
            record.goal(f"file store write {w_ratio:.2f} >= 0.25x numpy", w_ratio >= 0.25)
            record.goal(f"file store read {r_ratio:.2f} >= 0.5x numpy", r_ratio >= 0.5)
    columns = ["store", "write MiB/s", "read MiB/s", "write/np", "read/np", "cold write MiB/s",
               "cold read MiB/s"]
    record.table("main", columns, table, note=f"{mib:.0f} MiB float32, tile {args.tile}; "
                 f"medians of {args.repeat} after one untimed call.")
    from tables import render_table

    print(render_table(record.data, "main").rsplit("\n\n", 1)[0])
    return record.finish()


if __name__ == "__main__":
    sys.exit(main())
