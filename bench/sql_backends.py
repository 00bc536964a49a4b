"""SQL backends on DuckDB (issue 4): COO SQL vs the tiled plan on DuckDB vs the native executor.

(a) COO SQL in the style of "Efficient and Portable Einstein Summation in SQL": element tables
    ``(i, j, val)`` and ``SUM(A.val * B.val) ... GROUP BY`` (a chain nests one such query in
    another);
(b) tensorql's tiled tensor-relational plan on the DuckDB backend: joins on chunk keys and
    GROUP BY in DuckDB, Arrow UDF chunk kernels;
(c) the native executor on the same plan.

Both (b) and (c) read the stored tiles through the store's chunk cache, as a user's session
does by default: the first run loads each tile from DuckDB's pages, later runs of either find
it decoded. (b0) and (c0) are the same on a second session with no chunk cache
(``chunk_cache_bytes=0``), every run loading every tile from its pages.

(d) a strong SQL baseline: rows of the left operand and columns of the right as FLOAT[] lists
    and DuckDB's own ``list_dot_product`` over their cross product (a chain aggregates the
    first product's rows back into lists with ``list(val ORDER BY k)``).

The floors of (b) (issue 31), for the matmul at each tile: (e1) DuckDB joining the cached
tiles' handles as (b) does (a ``VALUES`` list of keys and handles a tensor) on the contracted
key and handing every pair's handles to an Arrow function that computes nothing, plus (k) the
same tile products called directly in torch (``mm`` then ``addmm_`` per output tile, tiles
already in memory, the output tiles shared out over the threads as (b) shares them). (b)
cannot beat (e1) + (k) while it pairs tiles in DuckDB and runs kernels in Python. Without a
cache, (b0) cannot beat (e) + (k): (e) reads the same stored tiles as (b0) reads them (each
chunk's pages, handed to (b)'s page loader once, which views them and returns a handle) and
joins the handles as (e1) does. The floor table prints them, and (e0), the hand-over used
before: every pair's bytes through the join into the Arrow function. The counts table gives
(b0)'s Arrow function calls and rows and the chunk bytes that crossed from DuckDB into Python
per query, which do not depend on the host's load, and those of (b) on a cached run.

Usage: ``python bench/sql_backends.py [--n 1024] [--chain-n 1024] [--tiles 512,256]
[--repeat 7]``

Method (``bench/harness.py``): every variant -- COO included -- gets one untimed warm-up call
(its time printed as the cold figure) and ``--repeat`` timed calls in seeded random order;
medians and IQRs are printed. All variants run on one DuckDB connection in one process (they
are all DuckDB or tensorql on DuckDB; DuckDB's threads are printed), the element and list
tables built before the clock. (b) and (c) run at every tile size given; the goals, (b) at
least 100x faster than (a) (issue 4) and (b) at most 2x the native executor (c) (issue 31),
are stated and checked at every tile given (512 and 256 by default); (b) against (d) is
printed beside it.

Every variant returns its result to Python (COO and list rows as Arrow, tiled results as
chunks) and is checked against torch; exits 1 on a wrong result, or on a missed goal unless
``--skip-coo`` (the smoke run).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys

import numpy as np
import pyarrow as pa
import torch
from harness import Record, add_arguments, measure, ratio_text

import tensorql as tq
from tensorql.backend.duckdb_sql import (
    ChunkArena,
    SQLPlan,
    _page_loader,
    pinned_scans,
    run_compiled,
)
from tensorql.exec.threads import run_shared
from tensorql.grid import ChunkGrid


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


def list_tables(db, names) -> None:
    """``<name>_rows`` (r, FLOAT[] row) and ``<name>_cols`` (c, FLOAT[] column) of each element
    table ``<name>_coo``."""
    con = db.connection
    for name in names:
        con.execute(f'CREATE OR REPLACE TABLE "{name}_rows" AS SELECT r, '
                    f'list(val ORDER BY c)::FLOAT[] AS v FROM "{name}_coo" GROUP BY r')
        con.execute(f'CREATE OR REPLACE TABLE "{name}_cols" AS SELECT c, '
                    f'list(val ORDER BY r)::FLOAT[] AS v FROM "{name}_coo" GROUP BY c')


def list_matmul(db):
    return db.connection.sql(
        'SELECT A.r AS i, B.c AS k, list_dot_product(A.v, B.v) AS val FROM "A_rows" A, '
        '"B_cols" B').to_arrow_table()


def list_chain(db):
    return db.connection.sql(
        'WITH T AS (SELECT A.r AS i, B.c AS k, list_dot_product(A.v, B.v) AS val '
        'FROM "X_rows" A, "Y_cols" B), '
        'TR AS (SELECT i, list(val ORDER BY k)::FLOAT[] AS v FROM T GROUP BY i) '
        'SELECT TR.i, C.c AS l, list_dot_product(TR.v, C.v) AS val FROM TR, "Z_cols" C'
    ).to_arrow_table()


def _page_scan(store, name: str) -> str:
    return (f"SELECT k0, k1, list(payload) AS payload, list(page) AS page FROM "
            f"{store.chunk_pages_sql(name)} GROUP BY k0, k1")


def floor_join(db, left: str, right: str, tile: int):
    """(e): the stored ``tile``-square tiles of ``left`` and ``right`` loaded as (b) loads them
    (``tq_floor_load_<tile>``: (b)'s own page loader, a view of each tile's pages and a handle
    back), the handles joined on the contracted key in DuckDB and each pair's handles handed to
    an Arrow function that looks the tiles up and returns 0."""
    store, con = db.chunk_store, db.connection
    store.sync_views()
    FLOOR["arena"] = ChunkArena()
    scans = [f"SELECT k0, k1, min(h) AS h FROM (SELECT k0, k1, tq_floor_load_{tile}(k0, k1, "
             f"page, payload) AS h FROM {store.chunk_pages_sql(name)}) GROUP BY k0, k1"
             for name in (left, right)]
    return con.sql(f"WITH x AS ({scans[0]}), y AS ({scans[1]}) SELECT sum(tq_floor(x.h, "
                   f"y.h)) FROM x JOIN y ON x.k1 = y.k0").fetchall()


def floor_cached_join(db, tiles: int):
    """(e1): the handles of ``tiles`` x ``tiles`` grids of two tensors' tiles, held in
    memory (``FLOOR["arena"]``, handles 1.. and -1..), given as ``VALUES`` lists as (b) gives
    its cached scans, joined on the contracted key and each pair's handles handed to an
    Arrow function that looks the tiles up and returns 0."""
    def values(sign):
        rows = ", ".join(f"({i}, {j}, {sign * (i * tiles + j + 1)})"
                         for i in range(tiles) for j in range(tiles))
        return (f'SELECT CAST(k0 AS INTEGER) AS k0, CAST(k1 AS INTEGER) AS k1, CAST(h AS '
                f'BIGINT) AS h FROM (VALUES {rows}) AS t(k0, k1, h)')
    return db.connection.sql(f"WITH x AS ({values(1)}), y AS ({values(-1)}) SELECT "
                             f"sum(tq_floor(x.h, y.h)) FROM x JOIN y ON x.k1 = y.k0").fetchall()


def floor_cached_join_in(db, arena: ChunkArena, tiles: int):
    """(e1) with its tiles in ``arena`` (as (b)'s cached tiles are in its run's arena)."""
    FLOOR["arena"] = arena
    return floor_cached_join(db, tiles)


def cached_floor_arena(a: torch.Tensor, b: torch.Tensor, tile: int) -> ChunkArena:
    """The arena (e1) looks its handles up in: ``a``'s tiles at 1.., ``b``'s at -1.."""
    nt = a.shape[0] // tile

    def tiles(x, sign):
        return {sign * (i * nt + j + 1): x[i * tile:(i + 1) * tile, j * tile:(j + 1) * tile]
                .contiguous() for i in range(nt) for j in range(nt)}
    return ChunkArena({**tiles(a, 1), **tiles(b, -1)})


def floor_pair_bytes(db, left: str, right: str):
    """(e0): the hand-over (b) used before: each pair's bytes (both tiles' pages) through the
    join into an Arrow function that returns 0."""
    store, con = db.chunk_store, db.connection
    store.sync_views()
    scans = [_page_scan(store, name) for name in (left, right)]
    return con.sql(f"WITH x AS ({scans[0]}), y AS ({scans[1]}) SELECT sum(tq_floor_bytes("
                   f"x.payload, x.page, y.payload, y.page)) FROM x JOIN y ON x.k1 = y.k0"
                   ).fetchall()


FLOOR: dict[str, ChunkArena] = {"arena": ChunkArena()}


def floor_load(tile: int):
    """The load of (e): (b)'s page loader for ``tile``-square fp32 tiles, into ``FLOOR``."""
    load = _page_loader("floor", ChunkGrid((1 << 20, 1 << 20), (tile, tile)), "float32")

    def call(k0, k1, page, payload):
        return load(FLOOR["arena"], k0, k1, page, payload)

    return call


def floor_pairs(left, right):
    """Each pair's tiles looked up; nothing is computed."""
    FLOOR["arena"].get(left)
    FLOOR["arena"].get(right)
    return pa.array(np.zeros(len(left), np.int64))


def floor_udf(pages0, numbers0, pages1, numbers1):
    """The bytes have crossed into Arrow; nothing is computed."""
    return pa.array(np.zeros(len(pages0), np.int64))


def floor_kernels(a: torch.Tensor, b: torch.Tensor, tile: int, threads: int):
    """(k): the tile products of ``a @ b`` called directly (tiles made before the clock), one
    output tile a job, the jobs shared out over ``threads`` threads of one torch thread each
    as (b) shares them (``run_shared``)."""
    nt = a.shape[0] // tile
    at = [[a[i * tile:(i + 1) * tile, j * tile:(j + 1) * tile].contiguous() for j in range(nt)]
          for i in range(nt)]
    bt = [[b[i * tile:(i + 1) * tile, j * tile:(j + 1) * tile].contiguous() for j in range(nt)]
          for i in range(nt)]

    def output_tile(i, k):
        acc = torch.mm(at[i][0], bt[0][k])
        for j in range(1, nt):
            acc.addmm_(at[i][j], bt[j][k])
        return acc

    jobs = [functools.partial(output_tile, i, k) for i in range(nt) for k in range(nt)]
    return lambda: run_shared(jobs, threads)


def counts(db, compiled, matmul: bool) -> list:
    """(b0)'s Arrow function calls, rows and MiB loaded from DuckDB in one query, for a
    matmul the MiB the pair hand-over (e0) moves for the same join (each pair's two tiles),
    and the MiB (b) loads on a run after one that cached the tiles."""
    db.chunk_store.sync_views()
    plan = SQLPlan.build(compiled.logical, db.chunk_store)  # no versions: no cache
    arena = plan.arena()
    plan.run(db.connection, arena)
    with pinned_scans(compiled.logical, db.chunk_store) as versions:
        for _ in range(2):  # the first keeps the tiles in the cache, the second reads them
            cached = SQLPlan.build(compiled.logical, db.chunk_store, versions)
            cached_arena = cached.arena()
            cached.run(db.connection, cached_arena)
            cached.keep_loaded(cached_arena, db.chunk_store)
    pair_mib = float("nan")
    if matmul:  # ij,jk->ik: tile (i, j) of A meets tile (j, k) of B
        a, b = (s.relation.grid for s in compiled.logical.input.sources)
        pair_mib = 4 * sum(math.prod(a.chunk_shape(ka)) + math.prod(b.chunk_shape(kb))  # fp32
                           for ka in a.keys() for kb in b.keys() if ka[1] == kb[0]) / 2**20
    return [arena.calls, arena.rows, arena.loaded_bytes / 2**20, pair_mib,
            cached_arena.loaded_bytes / 2**20]


def dense_of(table, n: int) -> np.ndarray:
    out = np.zeros((n, n), dtype=np.float64)
    cols = table.column_names
    out[table.column(cols[0]).to_numpy(), table.column(cols[1]).to_numpy()] = \
        table.column(cols[2]).to_numpy()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--chain-n", type=int, default=1024)
    ap.add_argument("--tiles", default="512,256",
                    help="tile sizes to run (b) and (c) at; the goal is checked at each")
    ap.add_argument("--tile", type=int, help="one tile size (same as --tiles N)")
    ap.add_argument("--skip-coo", action="store_true", help="leave out (a) (a smoke run)")
    add_arguments(ap, isolate=None)
    args = ap.parse_args(argv)
    tiles = [args.tile] if args.tile else [int(t) for t in args.tiles.split(",")]
    record = Record("sql_backends", smoke=args.skip_coo, args=args, argv=argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    db = tq.connect(workers=args.threads, intra_op_threads=1)
    db.connection.execute(f"SET threads = {args.threads}")
    # (b0), (c0): a session with no chunk cache (its own in-memory database)
    db0 = tq.connect(workers=args.threads, intra_op_threads=1, chunk_cache_bytes=0)
    db0.connection.execute(f"SET threads = {args.threads}")
    n, m = args.n, args.chain_n
    mats = {"A": torch.randn(n, n), "B": torch.randn(n, n),
            "X": torch.randn(m, m), "Y": torch.randn(m, m), "Z": torch.randn(m, m)}
    for name, value in mats.items():
        for tile in tiles:
            db.from_torch(f"{name}_t{tile}", value, tile=(tile, tile))
            db0.from_torch(f"{name}_t{tile}", value, tile=(tile, tile))
    cases = [
        ("matmul fp32", f"{n}³", "ij,jk->ik", ("A", "B"), mats["A"] @ mats["B"], coo_matmul,
         list_matmul, n),
        ("3-matrix chain fp32", f"3 × {m}²", "ij,jk,kl->il", ("X", "Y", "Z"),
         mats["X"] @ mats["Y"] @ mats["Z"], coo_chain, list_chain, m),
    ]
    db.connection.create_function("tq_floor_bytes", floor_udf, ["BLOB[]", "INTEGER[]"] * 2,
                                  "BIGINT", type="arrow", side_effects=False)
    db.connection.create_function("tq_floor", floor_pairs, ["BIGINT", "BIGINT"], "BIGINT",
                                  type="arrow", side_effects=False)
    rows, floor_rows, count_rows = [], [], []
    for label, size, equation, names, expected, coo, lists, dim in cases:
        tol = 1e-3 * float(expected.abs().max())
        coo_tables(db, names, suffix=f"_t{tiles[0]}")
        list_tables(db, names)
        fns = {"(d) lists": lambda f=lists: f(db)}
        if not args.skip_coo:
            fns["(a) COO"] = lambda f=coo: f(db)
        for tile in tiles:
            expr = tq.einsum(equation, *(db.tensor(f"{x}_t{tile}") for x in names))
            compiled = expr.compile()
            fns[f"(c) native {tile}"] = lambda c=compiled: c.run(dense=True).dense()
            fns[f"(b) DuckDB {tile}"] = lambda c=compiled: run_compiled(
                c, db.connection, dense=True).dense()
            uncached = tq.einsum(equation, *(db0.tensor(f"{x}_t{tile}") for x in names)
                                 ).compile()
            fns[f"(c0) native {tile} no cache"] = lambda c=uncached: c.run(dense=True).dense()
            fns[f"(b0) DuckDB {tile} no cache"] = lambda c=uncached: run_compiled(
                c, db0.connection, dense=True).dense()
            count_rows.append([label, size, tile, *counts(db, compiled, len(names) == 2)])
            if len(names) == 2:
                db.connection.create_function(
                    f"tq_floor_load_{tile}", floor_load(tile), ["INTEGER"] * 3 + ["BLOB"],
                    "BIGINT", type="arrow", side_effects=False)
                fns[f"(e) join floor {tile}"] = lambda t=tile, x=names: floor_join(
                    db, f"{x[0]}_t{t}", f"{x[1]}_t{t}", t)
                fns[f"(e0) pair bytes {tile}"] = lambda t=tile, x=names: floor_pair_bytes(
                    db, f"{x[0]}_t{t}", f"{x[1]}_t{t}")
                fns[f"(e1) cached join floor {tile}"] = functools.partial(
                    floor_cached_join_in, db, cached_floor_arena(
                        mats[names[0]], mats[names[1]], tile), dim // tile)
                fns[f"(k) kernels {tile}"] = floor_kernels(mats[names[0]], mats[names[1]], tile,
                                                             args.threads)
        for who, fn in fns.items():  # correctness first, off the clock
            if who[:3] in ("(e)", "(e0", "(e1", "(k)"):
                continue
            got = fn()
            got = dense_of(got, dim) if hasattr(got, "column_names") else got.double().numpy()
            ok = bool(np.allclose(got, expected.double().numpy(), atol=tol))
            record.check(f"{label}: {who} result", ok)
        timings = measure(fns, args.repeat, args.warmup, args.order, args.seed)
        record.timings(label, timings)
        med = {who: t.median for who, t in timings.items()}
        for tile in tiles:
            a = med.get("(a) COO", float("nan"))
            b, c, d = med[f"(b) DuckDB {tile}"], med[f"(c) native {tile}"], med["(d) lists"]
            b0, c0 = med[f"(b0) DuckDB {tile} no cache"], med[f"(c0) native {tile} no cache"]
            rows.append([label, size, tile, a, timings.get("(a) COO") and
                         timings["(a) COO"].first_s, d, b, c, b0, c0, a / b, d / b, b / c,
                         b0 / c0])
            if not args.skip_coo:
                record.goal(f"{label} tile {tile}: (a)/(b) {a / b:.0f} >= 100", a / b >= 100)
            record.goal(f"{label} tile {tile}: (b)/(c) {ratio_text(b / c, 2)} <= 2 (issue 31)",
                        b / c <= 2)
            if f"(e) join floor {tile}" in med:
                e, k = med[f"(e) join floor {tile}"], med[f"(k) kernels {tile}"]
                e1 = med[f"(e1) cached join floor {tile}"]
                floor_rows.append([label, size, tile, e1, e, med[f"(e0) pair bytes {tile}"], k,
                                   e1 + k, b, c, b / (e1 + k), (e1 + k) / c, e + k, b0,
                                   b0 / (e + k)])
        print(f"  {label}: " + "; ".join(f"{k} {t.describe(1, 's')}"
                                         for k, t in timings.items()), flush=True)
    threads = db.connection.sql("SELECT current_setting('threads')").fetchall()[0][0]
    columns = ["workload", "size", "tile", "(a) COO SQL s", "(a) cold s", "(d) list SQL s",
               "(b) tiled on DuckDB s", "(c) native s", "(b0) no cache s", "(c0) no cache s",
               "(a)/(b)", "(d)/(b)", "(b)/(c)", "(b0)/(c0)"]
    record.table("main", columns, rows, note=f"One warm-up (cold figure) then medians of "
                 f"{args.repeat} for every variant; DuckDB threads = {threads}, tensorql "
                 f"workers = {args.threads}. (b) and (c) read the tiles through the session's "
                 f"chunk cache (the default); (b0) and (c0) on a session without one load "
                 f"every tile from DuckDB's pages every run.")
    record.table("floor", ["workload", "size", "tile", "(e1) DuckDB join of cached handles s",
                           "(e) join of loaded tiles s", "(e0) pairs' bytes s",
                           "(k) kernels directly s", "floor (e1)+(k) s", "(b) s", "(c) s",
                           "(b)/floor", "floor/(c)", "floor (e)+(k) s", "(b0) s",
                           "(b0)/floor"], floor_rows,
                 note="(e1): the cached tiles' handles as (b) gives them (a VALUES list of "
                 "keys and handles a tensor), joined on the contracted key in DuckDB and every "
                 "pair's handles handed to an Arrow function computing nothing; (e): the same "
                 "join over the stored tiles read as (b0) reads them (each tile's page rows "
                 "handed once to the page loader, a handle back); (e0): the hand-over before, "
                 "every pair's bytes through the join; (k): the same tile products in torch, "
                 "tiles in memory, shared over the threads as (b) shares them. (b) pays (e1) "
                 "and (k), (b0) pays (e) and (k); medians as above.")
    record.table("counts", ["workload", "size", "tile", "Arrow function calls", "rows",
                            "MiB from DuckDB into Python", "MiB of pairs' bytes (e0)",
                            "MiB into Python, cached run"],
                 count_rows, note="Per query of (b0), counted by its chunk arena (independent "
                 "of the host's load; rows: the loads' page rows, then the pairs' and any "
                 "folds' rows): every stored tile crosses once; (e0) would hand each "
                 "tile over once per pair it is in (2·g·S for a g×g grid of an S-byte "
                 "operand); a run of (b) after one that cached the tiles loads none.")
    from tables import render_table

    print(render_table(record.data, "main").rsplit("\n\n", 1)[0])
    print(render_table(record.data, "floor").rsplit("\n\n", 1)[0])
    print(render_table(record.data, "counts").rsplit("\n\n", 1)[0])
    return record.finish()


if __name__ == "__main__":
    sys.exit(main())
