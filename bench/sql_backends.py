"""SQL backends on DuckDB (issue 4): COO SQL vs the tiled plan on DuckDB vs the native executor.

(a) COO SQL in the style of "Efficient and Portable Einstein Summation in SQL": element tables
    ``(i, j, val)`` and ``SUM(A.val * B.val) ... GROUP BY`` (a chain nests one such query in
    another);
(b) tensorql's tiled tensor-relational plan on the DuckDB backend: joins on chunk keys and
    GROUP BY in DuckDB, Arrow UDF chunk kernels;
(c) the native executor on the same plan.

Usage: ``python bench/sql_backends.py [--n 1024] [--chain-n 1024] [--tiles 512,256] [--repeat 5]``

(b) and (c) run at every tile size given; the goal, (b) at least 100x faster than (a), is
checked at the first (512 by default, the tile of the CPU benchmark; 256 is printed beside it)
and the command exits 1 if it is missed.

Every variant returns its result to Python (COO rows as Arrow, tiled results as chunks) and is
checked against torch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

import tensorql as tq
from tensorql.backend.duckdb_sql import run_compiled


def timed(fn, repeat: int, warmup: bool = True) -> tuple[float, object]:
    times, out = [], None
    if warmup:
        fn()
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def coo_tables(db, names, suffix: str = "") -> None:
    """Element tables ``<name>_coo`` from the stored tensors ``<name><suffix>``."""
    con = db.connection
    for name in names:
        con.execute(f'CREATE OR REPLACE TABLE "{name}_coo" AS '
                    f'SELECT d0 AS r, d1 AS c, val FROM "{name}{suffix}"')


def coo_matmul(db):
    return db.connection.sql(
        'SELECT A.r AS i, B.c AS k, SUM(A.val * B.val) AS val FROM "A_coo" A '
        'JOIN "B_coo" B ON A.c = B.r GROUP BY A.r, B.c').to_arrow_table()


def coo_chain(db):
    return db.connection.sql(
        'SELECT T.i, C.c AS l, SUM(T.val * C.val) AS val FROM ('
        'SELECT A.r AS i, B.c AS k, SUM(A.val * B.val) AS val FROM "X_coo" A '
        'JOIN "Y_coo" B ON A.c = B.r GROUP BY A.r, B.c) T '
        'JOIN "Z_coo" C ON T.k = C.r GROUP BY T.i, C.c').to_arrow_table()


def dense_of(table, n: int) -> np.ndarray:
    out = np.zeros((n, n), dtype=np.float64)
    cols = table.column_names
    out[table.column(cols[0]).to_numpy(), table.column(cols[1]).to_numpy()] = \
        table.column(cols[2]).to_numpy()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--chain-n", type=int, default=1024)
    ap.add_argument("--tiles", default="512,256",
                    help="tile sizes to run (b) and (c) at; the goal is checked at the first")
    ap.add_argument("--tile", type=int, help="one tile size (same as --tiles N)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--skip-coo", action="store_true", help="leave out (a) (a smoke run)")
    args = ap.parse_args()
    tiles = [args.tile] if args.tile else [int(t) for t in args.tiles.split(",")]
    torch.manual_seed(0)
    db = tq.connect(workers=2)
    n, m = args.n, args.chain_n
    mats = {"A": torch.randn(n, n), "B": torch.randn(n, n),
            "X": torch.randn(m, m), "Y": torch.randn(m, m), "Z": torch.randn(m, m)}
    for name, value in mats.items():
        for tile in tiles:
            db.from_torch(f"{name}_t{tile}", value, tile=(tile, tile))
    cases = [
        ("matmul fp32", f"{n}³", "ij,jk->ik", ("A", "B"), mats["A"] @ mats["B"], coo_matmul, n),
        ("3-matrix chain fp32", f"3 × {m}²", "ij,jk,kl->il", ("X", "Y", "Z"),
         mats["X"] @ mats["Y"] @ mats["Z"], coo_chain, m),
    ]
    rows = []
    for label, size, equation, names, expected, coo, dim in cases:
        tol = 1e-3 * float(expected.abs().max())
        t_coo = float("nan")
        if not args.skip_coo:
            coo_tables(db, names, suffix=f"_t{tiles[0]}")
            t_coo, table = timed(lambda f=coo: f(db), 1, warmup=False)
            assert np.allclose(dense_of(table, dim), expected.double().numpy(), atol=tol), \
                "COO result differs"
        for tile in tiles:
            expr = tq.einsum(equation, *(db.tensor(f"{x}_t{tile}") for x in names))
            compiled = expr.compile()
            t_native, res = timed(lambda c=compiled: c.run(dense=True).dense(), args.repeat)
            assert torch.allclose(res, expected, atol=tol), "native result differs"
            t_duck, res = timed(lambda c=compiled: run_compiled(c, db.connection).dense(),
                                args.repeat)
            assert torch.allclose(res, expected, atol=tol), "DuckDB backend result differs"
            rows.append((label, size, tile, t_coo, t_duck, t_native))
            print(f"{label} tile {tile}: COO SQL {t_coo:.2f} s, tiled on DuckDB {t_duck:.3f} s,"
                  f" native {t_native:.3f} s", flush=True)
    print()
    threads = db.connection.sql("SELECT current_setting('threads')").fetchall()[0][0]
    print(f"(b), (c): one warm-up, then median of {args.repeat}; (a): one run; "
          f"DuckDB threads = {threads}")
    print("| workload | size | tile | (a) COO SQL s | (b) tiled on DuckDB s | (c) native s "
          "| (a)/(b) | (b)/(c) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, size, tile, a, b, c in rows:
        print(f"| {label} | {size} | {tile} | {a:.2f} | {b:.3f} | {c:.3f} | **{a / b:.0f}** | "
              f"{b / c:.2f} |")
    if args.skip_coo:
        return 0
    ok = all(a / b >= 100 for _, _, tile, a, b, _ in rows if tile == tiles[0])
    print(f"goal: (b) >= 100x faster than (a) at tile {tiles[0]}:", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
