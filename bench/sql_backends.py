"""SQL backends on DuckDB (issue 4): COO SQL vs the tiled plan on DuckDB vs the native executor.

(a) COO SQL in the style of "Efficient and Portable Einstein Summation in SQL": element tables
    ``(i, j, val)`` and ``SUM(A.val * B.val) ... GROUP BY`` (a chain nests one such query in
    another);
(b) tensorql's tiled tensor-relational plan on the DuckDB backend: joins on chunk keys and
    GROUP BY in DuckDB, Arrow UDF chunk kernels;
(c) the native executor on the same plan.

Usage: ``python bench/sql_backends.py [--n 1024] [--chain-n 1024] [--tile 256] [--repeat 3]``

Every variant returns its result to Python (COO rows as Arrow, tiled results as chunks) and is
checked against torch.
"""

from __future__ import annotations

import argparse
import statistics
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


def coo_tables(db, names) -> None:
    con = db.connection
    for name in names:
        con.execute(f'CREATE OR REPLACE TABLE "{name}_coo" AS '
                    f'SELECT d0 AS r, d1 AS c, val FROM "{name}"')


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--chain-n", type=int, default=1024)
    ap.add_argument("--tile", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--skip-coo", action="store_true", help="leave out (a) (a smoke run)")
    args = ap.parse_args()
    torch.manual_seed(0)
    db = tq.connect(workers=2)
    n, m, t = args.n, args.chain_n, (args.tile, args.tile)
    mats = {"A": torch.randn(n, n), "B": torch.randn(n, n),
            "X": torch.randn(m, m), "Y": torch.randn(m, m), "Z": torch.randn(m, m)}
    for name, value in mats.items():
        db.from_torch(name, value, tile=t)
    rows = []
    cases = [
        ("matmul fp32", f"{n}³", tq.einsum("ij,jk->ik", db.tensor("A"), db.tensor("B")),
         mats["A"] @ mats["B"], coo_matmul, ("A", "B"), n),
        ("3-matrix chain fp32", f"3 × {m}²", tq.einsum("ij,jk,kl->il", db.tensor("X"),
                                                        db.tensor("Y"), db.tensor("Z")),
         mats["X"] @ mats["Y"] @ mats["Z"], coo_chain, ("X", "Y", "Z"), m),
    ]
    for label, size, expr, expected, coo, names, dim in cases:
        compiled = expr.compile()
        tol = 1e-3 * float(expected.abs().max())
        t_native, res = timed(lambda c=compiled: c.run(dense=True).dense(), args.repeat)
        assert torch.allclose(res, expected, atol=tol), "native result differs"
        t_duck, res = timed(lambda c=compiled: run_compiled(c, db.connection).dense(),
                            args.repeat)
        assert torch.allclose(res, expected, atol=tol), "DuckDB backend result differs"
        t_coo = float("nan")
        if not args.skip_coo:
            coo_tables(db, names)
            t_coo, table = timed(lambda f=coo: f(db), 1, warmup=False)
            assert np.allclose(dense_of(table, dim), expected.double().numpy(), atol=tol), \
                "COO result differs"
        rows.append((label, size, t_coo, t_duck, t_native))
        print(f"{label}: COO SQL {t_coo:.2f} s, tiled on DuckDB {t_duck:.3f} s, "
              f"native {t_native:.3f} s", flush=True)
    print()
    threads = db.connection.sql("SELECT current_setting('threads')").fetchall()[0][0]
    print(f"tile {args.tile}; (b), (c): one warm-up, then median of {args.repeat}; (a): one run; "
          f"DuckDB threads = {threads}")
    print("| workload | size | (a) COO SQL s | (b) tiled on DuckDB s | (c) native s "
          "| (a)/(b) | (b)/(c) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, size, a, b, c in rows:
        print(f"| {label} | {size} | {a:.2f} | {b:.3f} | {c:.3f} | **{a / b:.0f}** | "
              f"{b / c:.2f} |")


if __name__ == "__main__":
    main()
