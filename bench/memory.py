"""Process memory of big results (issue 17): each case runs in its own subprocess, which
reports its baseline RSS (after set-up) and its peak RSS (``ru_maxrss``) so cases never
pollute each other.

Cases and goals:
  store  - ``db.store`` of a computed ``--store-gib`` result (outer product ``i,j->ij``, float32)
           in a database file with ``memory_limit=--limit``: peak RSS <= ``--store-peak-gib``.
  numpy  - ``.numpy()`` of a ``--numpy-gib`` result: peak <= baseline + 1.1 x the result.
  huge   - ``.numpy()`` of a ``--huge-gib`` result: a clean MemoryLimitError, no allocation
           (peak grows by < 64 MiB).

    .venv/bin/python bench/memory.py            # 6 GiB store, 2 GiB numpy, 40 GiB refusal
    .venv/bin/python bench/memory.py --tiny     # seconds: the smoke run of tests/test_benches.py

Exits 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20


def rss_bytes() -> int:
    """Current resident set size of this process (``/proc/self/status`` VmRSS)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def outer_shape(nbytes: int) -> tuple[int, int]:
    """A 2:1 float32 matrix shape of ``nbytes`` (rounded to multiples of 1024)."""
    cols = max(1024, int((nbytes / 4 / 2) ** 0.5) // 1024 * 1024)
    rows = max(1, nbytes // 4 // cols)
    return rows, cols


def child(case: str, nbytes: int, limit: str, tile: int, path: str) -> dict:
    import numpy as np

    import tensorql as tq

    rows, cols = outer_shape(nbytes)
    options = dict(memory_limit=limit) if case == "store" else {}
    db = tq.connect(path if case == "store" else None, **options)
    u = db.from_numpy("u", np.arange(rows, dtype=np.float32) % 7, tile=(min(tile, rows),))
    v = db.from_numpy("v", np.arange(cols, dtype=np.float32) % 5 + 1, tile=(min(tile, cols),))
    expr = tq.einsum("i,j->ij", u, v)
    expr.compile()
    baseline = rss_bytes()
    start = time.perf_counter()
    report: dict = dict(case=case, shape=[rows, cols], result_bytes=rows * cols * 4,
                        baseline=baseline)
    if case == "store":
        stored = db.store("C", expr)
        last = db.chunk_store.read_chunk("C", tuple(n - 1 for n in stored.node.grid.blocks))
        report["ok"] = bool(db.tensors() == ["C", "u", "v"]
                            and float(last[-1, -1]) == ((rows - 1) % 7) * ((cols - 1) % 5 + 1))
    elif case == "numpy":
        out = expr.numpy()
        report["ok"] = bool(out.shape == (rows, cols) and out[-1, -1] == ((rows - 1) % 7) *
                            ((cols - 1) % 5 + 1))
    else:
        try:
            expr.numpy()
            report["ok"] = False
        except tq.TensorQLError as err:
            report["ok"] = type(err).__name__ == "MemoryLimitError"
            report["error"] = str(err)[:200]
    report["seconds"] = time.perf_counter() - start
    report["peak"] = peak_rss_bytes()
    db.close()
    return report


def run_case(case: str, nbytes: int, limit: str, tile: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="tq-memory-") as tmp:
        done = subprocess.run(
            [sys.executable, __file__, "--child", case, "--bytes", str(nbytes), "--limit", limit,
             "--tile", str(tile), "--path", str(Path(tmp) / "bench.duckdb")],
            capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"case {case} crashed")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store-gib", type=float, default=6.0)
    parser.add_argument("--numpy-gib", type=float, default=2.0)
    parser.add_argument("--huge-gib", type=float, default=40.0)
    parser.add_argument("--limit", default="1GiB", help="memory_limit of the store case")
    parser.add_argument("--store-peak-gib", type=float, default=2.0)
    parser.add_argument("--tile", type=int, default=4096)
    parser.add_argument("--tiny", action="store_true", help="64 MiB / 32 MiB sizes, seconds")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.bytes, args.limit, args.tile, args.path)))
        return 0
    if args.tiny:
        args.store_gib, args.numpy_gib, args.limit, args.tile = 1 / 16, 1 / 32, "16MiB", 512
        args.store_peak_gib = 1.0
    store = run_case("store", int(args.store_gib * GIB), args.limit, args.tile)
    numpy = run_case("numpy", int(args.numpy_gib * GIB), args.limit, args.tile)
    huge = run_case("huge", int(args.huge_gib * GIB), args.limit, args.tile)
    print("| case | result | baseline RSS | peak RSS | peak - baseline | (peak - baseline) "
          "/ result | s | correct |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in (store, numpy, huge):
        grown = r["peak"] - r["baseline"]
        print(f"| {r['case']} | {r['result_bytes'] / GIB:.2f} GiB {r['shape']} | "
              f"{r['baseline'] / MIB:.0f} MiB | {r['peak'] / MIB:.0f} MiB | {grown / MIB:.0f} MiB"
              f" | {grown / r['result_bytes']:.3f} | {r['seconds']:.1f} | {r['ok']} |")
    if "error" in huge:
        print(f"huge: {huge['error']}...")
    goals = {
        f"store peak <= {args.store_peak_gib} GiB": store["peak"] <= args.store_peak_gib * GIB,
        "numpy peak <= baseline + 1.1 x result":
            numpy["peak"] <= numpy["baseline"] + 1.1 * numpy["result_bytes"],
        "huge: MemoryLimitError, < 64 MiB grown": huge["peak"] - huge["baseline"] < 64 * MIB,
        "results correct": store["ok"] and numpy["ok"] and huge["ok"],
    }
    print("goals: " + "; ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in goals.items()))
    return 0 if all(goals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
