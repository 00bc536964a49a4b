"""Process memory of big results (issue 17): each case runs in its own subprocess, which
reports its baseline RSS (after set-up) and its peak RSS (``ru_maxrss``) so cases never
pollute each other.

Cases and goals:
  store  - ``db.store`` of a computed ``--store-gib`` result (outer product ``i,j->ij``, float32)
           in a database file with ``memory_limit=--limit``: peak RSS <= ``--store-peak-gib``.
  numpy  - ``.numpy()`` of a ``--numpy-gib`` result: peak <= baseline + 1.1 x the result.
  huge   - ``.numpy()`` of a ``--huge-gib`` result: a clean MemoryLimitError, no allocation
           (peak grows by < 64 MiB).
  matmul - ``.numpy()`` of ``A @ B`` (float32, a ``--numpy-gib`` result, inner size 256):
           peak <= baseline + 1.1 x the result, and
  numpy-matmul - the same product by numpy alone (``A @ B``, its own process, no tensorql
           import): the baseline any library pays for the result.

Every result is checked whole after its peak is read (row blocks against numpy, so the check
adds no more than one block): the outer products against ``np.outer``, the product against
numpy's. The figures go to a JSON record through ``bench/harness.py``.

    .venv/bin/python bench/memory.py            # 6 GiB store, 2 GiB numpy, 40 GiB refusal
    .venv/bin/python bench/memory.py --tiny     # seconds: the smoke run of tests/test_benches.py
    .venv/bin/python bench/memory.py --cases store,numpy   # some cases only (their goals)

The goals are issue 31's (on every host): the store at most 2 GiB, each dense result at most
1.1x itself over the baseline.

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

from harness import Record, add_arguments

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


CASES = ("store", "numpy", "huge", "matmul", "numpy-matmul")
INNER = 256  # the matmul cases' contracted size
BLOCK_ROWS = 1024


def matmul_operands(nbytes: int):
    import numpy as np

    rows, cols = outer_shape(nbytes)
    rng = np.random.default_rng(0)
    return (rng.standard_normal((rows, INNER), dtype=np.float32),
            rng.standard_normal((INNER, cols), dtype=np.float32))


def _whole_ok(out, rows: int, block) -> bool:
    """``out`` equals ``block(r0, r1)`` on every row block (float32 tolerance)."""
    import numpy as np

    for r0 in range(0, rows, BLOCK_ROWS):
        want = block(r0, min(rows, r0 + BLOCK_ROWS))
        if not np.allclose(out[r0:r0 + BLOCK_ROWS], want, rtol=1e-4, atol=1e-3):
            return False
    return True


def child(case: str, nbytes: int, limit: str, tile: int, path: str) -> dict:
    import numpy as np

    rows, cols = outer_shape(nbytes)
    if case == "numpy-matmul":  # the baseline: no tensorql in this process
        a, b = matmul_operands(nbytes)
        baseline = rss_bytes()
        start = time.perf_counter()
        out = a @ b
        report = dict(case=case, shape=[rows, cols], result_bytes=out.nbytes,
                      baseline=baseline, seconds=time.perf_counter() - start,
                      peak=peak_rss_bytes())
        report["ok"] = _whole_ok(out, rows, lambda r0, r1: a[r0:r1] @ b)
        return report

    import tensorql as tq

    u_np = np.arange(rows, dtype=np.float32) % 7
    v_np = np.arange(cols, dtype=np.float32) % 5 + 1
    # host memory is what this bench measures: its devices are the CPU's on any machine (a
    # GPU keeps back workspaces a small --limit cannot hold, and its memory is not RSS)
    options = dict(memory_limit=limit) if case == "store" else {}
    db = tq.connect(path if case == "store" else None, devices="cpu", **options)
    if case == "matmul":
        a, b = matmul_operands(nbytes)
        ta = db.from_numpy("a", a, tile=(min(tile, rows), INNER))
        tb = db.from_numpy("b", b, tile=(INNER, min(tile, cols)))
        expr = ta @ tb
    else:
        u = db.from_numpy("u", u_np, tile=(min(tile, rows),))
        v = db.from_numpy("v", v_np, tile=(min(tile, cols),))
        expr = tq.einsum("i,j->ij", u, v)
    expr.compile()
    baseline = rss_bytes()
    start = time.perf_counter()
    report: dict = dict(case=case, shape=[rows, cols], result_bytes=rows * cols * 4,
                        baseline=baseline)
    out = None
    if case == "store":
        stored = db.store("C", expr)
        report["ok"] = db.tensors() == ["C", "u", "v"]
    elif case in ("numpy", "matmul"):
        out = expr.numpy()
        report["ok"] = out.shape == (rows, cols)
    else:
        try:
            expr.numpy()
            report["ok"] = False
        except tq.TensorQLError as err:
            report["ok"] = type(err).__name__ == "MemoryLimitError"
            report["error"] = str(err)[:200]
    report["seconds"] = time.perf_counter() - start
    report["peak"] = peak_rss_bytes()
    # the whole result checked after the peak was read, one row block at a time
    if case == "store":
        out = db.tensor("C").numpy() if rows * cols * 4 <= (256 << 20) else None
        if out is None:  # too big to read back whole: every chunk of its last chunk row
            grid = stored.node.grid
            last = grid.blocks[0] - 1
            for j in range(grid.blocks[1]):
                chunk = db.chunk_store.read_chunk("C", (last, j)).numpy()
                c0 = j * grid.tile[1]
                r0 = last * grid.tile[0]
                want = np.outer(u_np[r0:r0 + chunk.shape[0]], v_np[c0:c0 + chunk.shape[1]])
                report["ok"] = report["ok"] and bool(np.array_equal(chunk, want))
    if out is not None and case in ("store", "numpy"):
        report["ok"] = bool(report["ok"]) and _whole_ok(
            out, rows, lambda r0, r1: np.outer(u_np[r0:r1], v_np))
    if out is not None and case == "matmul":
        report["ok"] = bool(report["ok"]) and _whole_ok(out, rows, lambda r0, r1: a[r0:r1] @ b)
    report["ok"] = bool(report["ok"])
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store-gib", type=float, default=6.0)
    parser.add_argument("--numpy-gib", type=float, default=2.0)
    parser.add_argument("--huge-gib", type=float, default=40.0)
    parser.add_argument("--limit", default="1GiB", help="memory_limit of the store case")
    parser.add_argument("--store-peak-gib", type=float, default=2.0)
    parser.add_argument("--tile", type=int, default=4096)
    parser.add_argument("--tiny", action="store_true", help="64 MiB / 32 MiB sizes, seconds")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated cases to run (default: all of {', '.join(CASES)})")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    add_arguments(parser, repeat=None, isolate=None)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.bytes, args.limit, args.tile, args.path)))
        return 0
    if args.tiny:
        args.store_gib, args.numpy_gib, args.limit, args.tile = 1 / 16, 1 / 32, "16MiB", 512
        args.store_peak_gib = 1.0
    record = Record("memory", smoke=args.tiny, args=args, argv=argv)
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(wanted) - set(CASES))
    if unknown or not wanted:
        parser.error(f"--cases: unknown {', '.join(unknown) or '(none given)'}; choose from "
                     f"{', '.join(CASES)}")
    sizes = dict(store=args.store_gib, numpy=args.numpy_gib, huge=args.huge_gib,
                 matmul=args.numpy_gib)
    sizes["numpy-matmul"] = args.numpy_gib
    runs = {case: run_case(case, int(sizes[case] * GIB), args.limit, args.tile)
            for case in CASES if case in wanted}
    columns = ["case", "result", "baseline RSS MiB", "peak RSS MiB", "peak - baseline MiB",
               "(peak - baseline) / result", "s", "correct"]
    rows = []
    for r in runs.values():
        grown = r["peak"] - r["baseline"]
        rows.append([r["case"], f"{r['result_bytes'] / GIB:.2f} GiB {r['shape']}",
                     r["baseline"] / MIB, r["peak"] / MIB, grown / MIB,
                     grown / r["result_bytes"], r["seconds"], r["ok"]])
        record.check(f"{r['case']}: result correct", r["ok"])
    record.table("main", columns, rows, note="Each case in its own process; peak = ru_maxrss; "
                 "the numpy-matmul row is numpy alone (no tensorql import).")
    from tables import render_table

    print(render_table(record.data, "main").rsplit("\n\n", 1)[0])
    if "error" in runs.get("huge", {}):
        print(f"huge: {runs['huge']['error']}...")
    if "store" in runs:
        store = runs["store"]
        record.goal(f"store peak <= {args.store_peak_gib} GiB",
                    store["peak"] <= args.store_peak_gib * GIB,
                    f"{store['peak'] / GIB:.2f} GiB")
    for case in ("numpy", "matmul"):
        if case in runs:
            r = runs[case]
            grown = (r["peak"] - r["baseline"]) / r["result_bytes"]
            record.goal(f"{case} peak <= baseline + 1.1 x result", grown <= 1.1,
                        f"{grown:.3f}x")
    if "huge" in runs:
        huge = runs["huge"]
        record.goal("huge: MemoryLimitError, < 64 MiB grown",
                    huge["peak"] - huge["baseline"] < 64 * MIB,
                    f"{(huge['peak'] - huge['baseline']) / MIB:.1f} MiB")
    record.figure("runs", runs)
    # some cases only: a record of its own (--json), never in place of the full one
    return record.finish(write=set(wanted) == set(CASES) or bool(args.json))


if __name__ == "__main__":
    sys.exit(main())
