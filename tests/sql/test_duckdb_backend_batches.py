"""The DuckDB backend's batched kernels (issue 31): each stored chunk crosses from DuckDB into
Python once (a scan loads it and hands its handle on), the join function folds every product
of one output chunk within a batch into one partial, and results stay those of numpy however
DuckDB splits the join's rows into batches."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

import tensorql as tq
from tensorql.backend import duckdb_sql
from tensorql.backend.duckdb_sql import ChunkArena, SQLPlan


def _plan_and_rows(db, a, b, tile):
    """The plan of ``A @ B`` and the join's rows (the keys of every tile pair)."""
    A = db.from_numpy("A", a, tile=(tile, tile))
    B = db.from_numpy("B", b, tile=(tile, tile))
    plan = SQLPlan.build(tq.einsum("ij,jk->ik", A, B).compile().logical, db.chunk_store)
    grid_a, grid_b = A.compile().logical.relation.grid, B.compile().logical.relation.grid
    rows = [(ka, kb) for ka in grid_a.keys() for kb in grid_b.keys() if ka[1] == kb[0]]
    return plan, rows, grid_a, grid_b


def _columns(rows, a, b, grid_a, grid_b, arena):
    """The partial function's columns for ``rows``: the keys of both tiles of each pair and
    the handles of the tiles, loaded into ``arena`` once each (as the scans load them)."""
    handles = {}
    for s, (x, grid) in enumerate(((a, grid_a), (b, grid_b))):
        for key in grid.keys():
            tile = torch.from_numpy(np.ascontiguousarray(x[grid.slices(key)]))
            handles[s, key] = arena.put([tile])[0].as_py()
    cols = [pa.array([r[s][d] for r in rows], pa.int32()) for s in (0, 1) for d in (0, 1)]
    cols += [pa.array([handles[s, r[s]] for r in rows], pa.int64()) for s in (0, 1)]
    return cols


@pytest.mark.parametrize("split", [None, 7])
def test_partial_function_returns_one_sum_per_output_chunk_and_batch(split):
    rng = np.random.default_rng(31)
    a, b = rng.standard_normal((8, 12)), rng.standard_normal((12, 6))
    with tq.connect(backend="duckdb") as db:
        plan, rows, grid_a, grid_b = _plan_and_rows(db, a, b, 2)
        (partial,) = [u for u in plan.udfs if "partial" in u.name]
        assert partial.null_handling == "special"
        assert partial.params == ("INTEGER",) * 4 + ("BIGINT",) * 2  # keys, chunk handles
        assert partial.returns == "BIGINT"
        order = rng.permutation(len(rows))  # DuckDB's join emits rows in no set order
        rows = [rows[i] for i in order]
        batches = [rows] if split is None else [rows[:split], rows[split:]]
        arena = ChunkArena()
        total = np.zeros((8, 6))
        sums = 0
        for batch in batches:
            out = partial.fn(arena, *_columns(batch, a, b, grid_a, grid_b, arena))
            assert len(out) == len(batch)
            outputs = {(ka[0], kb[1]) for ka, kb in batch}
            assert len(out) - out.null_count == len(outputs)  # one partial per output chunk
            for r in range(len(batch)):
                if out[r].is_valid:
                    (chunk,) = arena.get([out[r].as_py()])
                    ka, kb = batch[r]
                    total[2 * ka[0]:2 * ka[0] + 2, 2 * kb[1]:2 * kb[1] + 2] += chunk.numpy()
                    sums += 1
        assert sums == 12 if split is None else sums >= 12
        np.testing.assert_allclose(total, a @ b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("threads", [1, 2])
def test_output_chunks_summed_over_several_batches_match_numpy(threads, monkeypatch):
    """2,500 tile pairs per output chunk: more than one DuckDB vector (2,048 rows), so each
    output chunk's products reach the partial function in several batches, and its partials
    are folded by the aggregate function."""
    folds = []
    combine = duckdb_sql.combine

    def counting(acc, part, agg):
        folds.append(agg)
        return combine(acc, part, agg)

    monkeypatch.setattr(duckdb_sql, "combine", counting)  # only the aggregate function folds
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((2, 2500)), rng.standard_normal((2500, 3))
    with tq.connect(backend="duckdb") as db:
        db.connection.execute(f"SET threads = {threads}")
        A = db.from_numpy("A", a, tile=(1, 1))
        B = db.from_numpy("B", b, tile=(1, 1))
        np.testing.assert_allclose((A @ B).numpy(), a @ b, rtol=1e-12, atol=1e-12)
        assert folds  # some of the 6 output chunks summed from several partials
        got = tq.einsum("ij,jk->ik", A, B, join="add", agg="max").numpy()
        np.testing.assert_allclose(got, (a[:, :, None] + b[None]).max(axis=1), rtol=1e-12)


def test_plan_sql_gathers_only_partials_that_are_not_null():
    with tq.connect(backend="duckdb") as db:
        A = db.from_numpy("A", np.ones((4, 4)), tile=(2, 2))
        plan = SQLPlan.build(tq.einsum("ij,jk->ik", A, A).compile().logical, db.chunk_store)
    assert 'FILTER (WHERE "partial" IS NOT NULL)' in plan.sql
    assert 'CASE WHEN len("parts") = 1 THEN "parts"[1]' in plan.sql  # a lone partial as is
    assert [(u.name.split("_")[1], u.null_handling) for u in plan.udfs] == \
        [("load", "default"), ("partial", "special"), ("agg", "default")]  # A loaded once


def test_only_steps_read_twice_are_materialized():
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((6, 8)), rng.standard_normal((8, 4))
    with tq.connect(backend="duckdb") as db:
        A, B = db.from_numpy("A", a, tile=(3, 4)), db.from_numpy("B", b, tile=(4, 2))
        x = tq.einsum("ij,jk->ik", A, B)
        chain = tq.einsum("ij,jk,kl->il", A, B, tq.einsum("ki->ik", x))
        squared = tq.einsum("ik,ik->ik", x, x)
        # the chain reads A and B twice (x and the chain's own join): their scans are
        # materialized, so each stored chunk is loaded once; squared reads x twice
        for expr, expected, materialized in ((chain, a @ b @ (a @ b).T, 2),
                                             (squared, (a @ b) ** 2, 1)):
            sql = SQLPlan.build(expr.compile().logical, db.chunk_store).sql
            assert sql.count("MATERIALIZED") == materialized
            np.testing.assert_allclose(expr.numpy(), expected, rtol=1e-12, atol=1e-12)


def test_stored_tiles_of_several_pages_read_as_pages_by_every_reader():
    """Tiles of 8 KiB (two 4 KiB pages) and ragged edge tiles: joins and Maps alike read the
    stored pages (no chunk view)."""
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((80, 72)), rng.standard_normal((72, 40))
    with tq.connect(backend="duckdb") as db:
        db.connection.execute("SET threads = 2")
        A = db.from_numpy("A", a, tile=(32, 32))
        B = db.from_numpy("B", b, tile=(32, 32))
        product = tq.einsum("ij,jk->ik", A, B)
        steps = dict(SQLPlan.build(product.compile().logical, db.chunk_store).steps)
        assert sorted(v for v in steps.values() if v.startswith("Scan")) == \
            ["Scan A (chunk pages)", "Scan B (chunk pages)"]
        np.testing.assert_allclose(product.numpy(), a @ b, rtol=1e-12, atol=1e-12)
        scaled = tq.einsum("ij,jk->ik", A * 2.0, B)
        steps = dict(SQLPlan.build(scaled.compile().logical, db.chunk_store).steps)
        assert sorted(v for v in steps.values() if v.startswith("Scan")) == \
            ["Scan A (chunk pages)", "Scan B (chunk pages)"]
        np.testing.assert_allclose(scaled.numpy(), 2 * a @ b, rtol=1e-12, atol=1e-12)


def test_chunk_pages_sql_names_the_page_rows_of_a_stored_tensor():
    with tq.connect() as db:
        db.from_numpy("A", np.arange(12.0).reshape(3, 4), tile=(2, 2))
        store = db.chunk_store
        store.sync_views()
        rows = db.connection.sql(f"SELECT k0, k1, page, octet_length(payload) FROM "
                                 f"{store.chunk_pages_sql('A')} ORDER BY k0, k1").fetchall()
        assert rows == [(0, 0, 0, 32), (0, 1, 0, 32), (1, 0, 0, 16), (1, 1, 0, 16)]
        assert store.chunk_pages_sql("missing") is None


@pytest.mark.parametrize("tile", [2, 4, 8])
def test_each_stored_chunk_crosses_into_python_once(tile):
    """However many pairs a tile joins into (g per tile on a g x g grid), its bytes are loaded
    from DuckDB once; only BIGINT handles go through the join and the GROUP BY."""
    rng = np.random.default_rng(tile)
    a, b = rng.standard_normal((8, 8)), rng.standard_normal((8, 8))
    with tq.connect(backend="duckdb") as db:
        db.connection.execute("SET threads = 2")
        A, B = db.from_numpy("A", a, tile=(tile, tile)), db.from_numpy("B", b, tile=(tile, tile))
        compiled = tq.einsum("ij,jk->ik", A, B).compile()
        plan = SQLPlan.build(compiled.logical, db.chunk_store)
        assert {u.returns for u in plan.udfs} == {"BIGINT"}  # no chunk bytes back to DuckDB
        assert "BLOB" not in {p for u in plan.udfs if "load" not in u.name for p in u.params}
        db.chunk_store.sync_views()
        arena = plan.arena()
        chunks, _ = plan.run(db.connection, arena)
        assert arena.loaded_bytes == a.nbytes + b.nbytes
        g = 8 // tile
        names = [u.name.split("_")[1] for u in plan.udfs]
        assert names == ["load", "load", "partial", "agg"]
        # one call per load and per batch of pairs (a batch holds up to 2,048 rows) and,
        # where partials of one output chunk came in several batches, of the aggregate
        assert arena.calls >= 3 and arena.rows >= 2 * g * g + g ** 3
        got = np.zeros((8, 8))
        for (i, k), chunk in chunks.items():
            got[i * tile:(i + 1) * tile, k * tile:(k + 1) * tile] = chunk.numpy()
        np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-12)


def test_in_memory_chunks_are_preset_handles_and_left_unchanged():
    """A constant operand (and a store without DuckDB) reaches the SQL as a registered table
    of fixed handles; its chunks are the kernels' inputs as they are, never written into."""
    from tensorql.storage.memory_store import MemoryChunkStore

    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((6, 4)), rng.standard_normal((4, 6))
    a_before = a.copy()
    for store in (None, MemoryChunkStore()):
        with tq.connect(backend="duckdb", store=store) as db:
            B = db.from_numpy("B", b, tile=(2, 3))
            A = db.constant(a, tile=(3, 2))
            expr = tq.einsum("ij,jk->ik", A, B, join="add", agg="max")
            plan = SQLPlan.build(expr.compile().logical, db.chunk_store)
            assert plan.constants and all(h < 0 for h in plan.constants)
            for table in plan.tables.values():
                assert table.schema.field("chunk").type == pa.int64()
            np.testing.assert_allclose(expr.numpy(), (a[:, :, None] + b[None]).max(axis=1),
                                       rtol=1e-12)
            np.testing.assert_allclose((A @ B).numpy(), a @ b, rtol=1e-12, atol=1e-12)
            np.testing.assert_array_equal(tq.einsum("ij->ji", A).numpy(), a.T)
    np.testing.assert_array_equal(a, a_before)


def test_chunk_view_scan_when_the_store_names_no_page_rows(monkeypatch):
    rng = np.random.default_rng(12)
    a, b = rng.standard_normal((5, 7)), rng.standard_normal((7, 3))
    with tq.connect(backend="duckdb") as db:
        A, B = db.from_numpy("A", a, tile=(2, 4)), db.from_numpy("B", b, tile=(4, 2))
        monkeypatch.setattr(db.chunk_store, "chunk_pages_sql", lambda name, version=None: None)
        expr = tq.einsum("ij,jk->ik", A, B)
        steps = dict(SQLPlan.build(expr.compile().logical, db.chunk_store).steps)
        assert sorted(v for v in steps.values() if v.startswith("Scan")) == \
            ["Scan A (chunk view)", "Scan B (chunk view)"]
        np.testing.assert_allclose(expr.numpy(), a @ b, rtol=1e-12, atol=1e-12)


def test_a_handle_of_another_run_is_an_execution_error():
    arena = ChunkArena()
    arena.put([torch.ones(1)])
    with pytest.raises(tq.ExecutionError, match="no chunk with handle 7"):
        arena.get(pa.array([7], pa.int64()))


def test_page_loader_assembles_chunks_cut_by_batches_or_out_of_order():
    """A chunk whose pages come in pieces (a batch boundary, pages out of order) is copied
    together in the arena under one handle, and is not readable before its last page; a
    chunk whose pages come whole and in order is a view of the batch's Arrow buffer."""
    from tensorql.grid import ChunkGrid
    from tensorql.storage.pages import PAGE_BYTES

    per_page = PAGE_BYTES // 8
    grid = ChunkGrid((2, 3 * per_page), (1, 3 * per_page))  # chunks of 3 pages
    values = np.arange(2 * 3 * per_page, dtype=np.float64).reshape(2, -1)
    pages = [[values[r, p * per_page:(p + 1) * per_page].tobytes() for p in range(3)]
             for r in range(2)]

    def batch(rows):  # (chunk row, page)
        return [pa.array([r for r, _ in rows], pa.int32()), pa.array([0] * len(rows), pa.int32()),
                pa.array([p for _, p in rows], pa.int32()),
                pa.array([pages[r][p] for r, p in rows], pa.binary())]

    load = duckdb_sql._page_loader("t", grid, "float64")
    arena = ChunkArena()
    cols = batch([(0, 2), (0, 0), (1, 0), (1, 1), (1, 2)])
    first = load(arena, *cols).to_pylist()
    assert first[0] == first[1] and len(set(first)) == 2  # one handle a chunk
    (whole,) = arena.get([first[2]])
    np.testing.assert_array_equal(whole.numpy()[0], values[1])
    data = cols[-1].buffers()[2]  # a view of the batch's Arrow buffer, not a copy
    assert data.address <= whole.data_ptr() < data.address + data.size
    with pytest.raises(tq.ExecutionError, match="missing"):
        arena.get([first[0]])  # page 1 of chunk 0 has not come
    # only whole chunks would go into the store's cache after the run
    assert [(scan, key) for scan, key, _ in arena.loaded_chunks()] == [("t", (1, 0))]
    second = load(arena, *batch([(0, 1)])).to_pylist()
    assert second == first[:1]
    np.testing.assert_array_equal(arena.get([first[0]])[0].numpy()[0], values[0])
    assert arena.loaded_bytes == values.nbytes
    kept = {key: chunk.numpy()[0] for _, key, chunk in arena.loaded_chunks()}
    assert sorted(kept) == [(0, 0), (1, 0)]
    np.testing.assert_array_equal(kept[0, 0], values[0])


def test_tiles_cut_by_a_batch_boundary_match_numpy():
    """Tiles of six 4 KiB pages: 2,400 page rows, so DuckDB's 2,048-row batches cut a tile."""
    rng = np.random.default_rng(13)
    a, b = rng.standard_normal((960, 1280)), rng.standard_normal((1280, 96))
    with tq.connect(backend="duckdb") as db:
        db.connection.execute("SET threads = 2")
        A, B = db.from_numpy("A", a, tile=(48, 64)), db.from_numpy("B", b, tile=(64, 96))
        expr = tq.einsum("ij,jk->ik", A * 2.0, B)
        db.chunk_store.sync_views()
        plan = SQLPlan.build(expr.compile().logical, db.chunk_store)
        arena = plan.arena()
        chunks, _ = plan.run(db.connection, arena)
        assert arena.loaded_bytes == a.nbytes + b.nbytes
        assert 1 <= arena.assembled < 400  # the tiles cut by a boundary, the rest are views
        np.testing.assert_allclose(expr.numpy(), 2 * a @ b, rtol=1e-10, atol=1e-10)
        # the run above kept every tile, assembled ones too: this one reads none from DuckDB
        with duckdb_sql.pinned_scans(expr.compile().logical, db.chunk_store) as versions:
            plan = SQLPlan.build(expr.compile().logical, db.chunk_store, versions)
        assert "Scan A (cached chunks)" in dict(plan.steps).values()


@pytest.mark.parametrize("threads", [1, 2])
def test_dense_result_written_in_place_and_folded_partials_copied_in(threads):
    """With a dense result asked for, the root's first partial of each chunk is written into
    it; partials folded later (2,500 pairs a chunk: several batches) and roots that are not
    an aggregate are copied in; the result is numpy's either way."""
    from tensorql.backend.duckdb_sql import run_compiled

    rng = np.random.default_rng(17)
    with tq.connect(backend="duckdb") as db:
        db.connection.execute(f"SET threads = {threads}")
        a, b = rng.standard_normal((6, 8)), rng.standard_normal((8, 4))
        A, B = db.from_numpy("A", a, tile=(3, 4)), db.from_numpy("B", b, tile=(4, 2))
        result = run_compiled((A @ B).compile(), dense=True)
        dense = result.dense()
        np.testing.assert_allclose(dense.numpy(), a @ b, rtol=1e-12, atol=1e-12)
        for (i, k), chunk in result.chunks.items():  # every chunk a view of the result
            assert chunk.data_ptr() == dense[3 * i:3 * i + 3, 2 * k:2 * k + 2].data_ptr()
        scaled = run_compiled(((A @ B) * 2.0).compile(), dense=True).dense()
        np.testing.assert_allclose(scaled.numpy(), 2 * a @ b, rtol=1e-12, atol=1e-12)
        long_a, long_b = rng.standard_normal((2, 2500)), rng.standard_normal((2500, 3))
        LA, LB = db.from_numpy("LA", long_a, tile=(1, 1)), db.from_numpy("LB", long_b, tile=(1, 1))
        for join, agg, expected in (("mul", "sum", long_a @ long_b),
                                    ("add", "max", (long_a[:, :, None] + long_b[None]).max(1))):
            got = run_compiled(tq.einsum("ij,jk->ik", LA, LB, join=join, agg=agg).compile(),
                               dense=True).dense()
            np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12)


def test_a_batchs_output_chunks_are_summed_on_the_sessions_workers():
    """The partial function's output chunks (one series of tile products each) are shared
    out over the arena's threads -- the session's workers -- and sum as numpy does; a batch
    called while another batch's kernels run keeps to its own thread."""
    import threading

    rng = np.random.default_rng(41)
    a, b = rng.standard_normal((8, 12)), rng.standard_normal((12, 6))
    with tq.connect(backend="duckdb", workers=2) as db:
        plan, rows, grid_a, grid_b = _plan_and_rows(db, a, b, 2)
        (partial,) = [u for u in plan.udfs if "partial" in u.name]
        threads_seen = set()
        arena = ChunkArena(threads=2)
        share = arena.share

        def watching(jobs):
            gate = threading.Barrier(2, timeout=10)  # the first two pass it side by side

            def watched(i, job):
                def run():
                    if i < 2 and arena._sharing == 1:  # this batch alone: shared out
                        gate.wait()
                    threads_seen.add(threading.current_thread().name)
                    return job()
                return run
            return share([watched(i, job) for i, job in enumerate(jobs)])

        arena.share = watching
        out = partial.fn(arena, *_columns(rows, a, b, grid_a, grid_b, arena))
        assert len(threads_seen) == 2  # 12 output chunks over the caller and one helper
        total = np.zeros((8, 6))
        for r, (ka, kb) in enumerate(rows):
            if out[r].is_valid:
                (chunk,) = arena.get([out[r].as_py()])
                total[2 * ka[0]:2 * ka[0] + 2, 2 * kb[1]:2 * kb[1] + 2] += chunk.numpy()
        np.testing.assert_allclose(total, a @ b, rtol=1e-12, atol=1e-12)

        threads_seen.clear()
        arena._sharing = 1  # another batch's kernels run now: this one stays on its thread
        partial.fn(arena, *_columns(rows, a, b, grid_a, grid_b, arena))
        assert threads_seen == {threading.current_thread().name}
        # and the whole query through DuckDB, on two workers, a chain of two products
        A = db.tensor("A")
        B = db.tensor("B")
        c = rng.standard_normal((6, 12))
        C = db.from_numpy("C", c, tile=(2, 2))
        got = tq.einsum("ij,jk,kl->il", A, B, C).numpy()
        np.testing.assert_allclose(got, a @ b @ c, rtol=1e-12, atol=1e-12)


def test_a_chain_s_second_product_gets_all_its_pairs_in_one_call():
    """A product's result comes on in the order of its keys (one sorted source), so the join
    reading it hands all of its pairs to one call of the next product's function, whose
    products are then shared over the workers; a result split over DuckDB's threads made two
    calls at once, each on one thread, and two partials a chunk to fold."""
    rng = np.random.default_rng(35)
    x, y, z = (rng.standard_normal((64, 64)) for _ in range(3))
    with tq.connect(backend="duckdb", workers=2) as db:
        db.connection.execute("SET threads = 2")
        X, Y, Z = (db.from_numpy(n, v, tile=(16, 16)) for n, v in zip("XYZ", (x, y, z)))
        expr = tq.einsum("ij,jk,kl->il", X, Y, Z)
        np.testing.assert_allclose(expr.numpy(), x @ y @ z, rtol=1e-10, atol=1e-10)
        compiled = expr.compile()
        for _ in range(10):
            with duckdb_sql.pinned_scans(compiled.logical, db.chunk_store) as versions:
                plan = SQLPlan.build(compiled.logical, db.chunk_store, versions)
                arena = plan.arena(threads=2)
                chunks, _ = plan.run(db.connection, arena)
            assert arena.calls == 2  # one partial call a product, no fold, no load
            np.testing.assert_allclose(plan.dense_result(chunks, arena).numpy(), x @ y @ z,
                                       rtol=1e-10, atol=1e-10)
