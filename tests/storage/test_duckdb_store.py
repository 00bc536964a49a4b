"""The DuckDB chunk store: round trips, persistence, atomicity, concurrency, hostile names."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import tensorql as tq
from tensorql.grid import ChunkGrid
from tensorql.storage.chunk_store import TensorMeta

ALL_DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "bool"]


def _random(dtype: str, shape, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == "bool":
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.startswith("int"):
        return torch.randint(-2**30, 2**30, shape, generator=gen, dtype=getattr(torch, dtype))
    return torch.randn(shape, generator=gen).to(getattr(torch, dtype))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape, tile", [((7, 5), (3, 2)), ((4,), (4,)), ((), ()),
                                         ((3, 4, 5), (2, 4, 3))])
def test_round_trip_every_dtype_uneven_tiles(tmp_path, dtype, shape, tile):
    value = _random(dtype, shape)
    with tq.connect(str(tmp_path / "t.duckdb")) as db:
        db.from_torch("x", value, tile=tile or None)
        got = db.tensor("x").torch()
        meta = db.chunk_store.meta("x")
    assert got.dtype == value.dtype and tuple(got.shape) == tuple(shape)
    assert torch.equal(got, value)
    assert meta.grid.tile == tuple(min(t, n) for t, n in zip(tile, shape))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_element_view_matches(dtype):
    value = _random(dtype, (5, 3), seed=3)
    with tq.connect() as db:
        db.from_torch("x", value, tile=(2, 2))
        rows = db.chunk_store.connection.sql(
            'SELECT d0, d1, val FROM "x" ORDER BY d0, d1').fetchall()
    expected = value.float() if dtype in ("float16", "bfloat16") else value
    assert [(r[0], r[1]) for r in rows] == [(i, j) for i in range(5) for j in range(3)]
    np.testing.assert_array_equal(np.array([r[2] for r in rows]),
                                  expected.reshape(-1).numpy())


def test_chunk_view_and_count():
    with tq.connect() as db:
        db.from_numpy("A", np.ones((10, 6), dtype=np.float32), tile=(4, 4))
        con = db.chunk_store.connection
        assert con.sql('SELECT count(*) FROM "A"').fetchall()[0][0] == 60
        assert con.sql('SELECT count(*) FROM "A__chunks"').fetchall()[0][0] == 6
        assert con.sql('SELECT sum(val) FROM "A" WHERE d0 >= 8').fetchall()[0][0] == 12.0


def test_persistence_across_processes(tmp_path):
    path = str(tmp_path / "p.duckdb")
    a = np.arange(30, dtype=np.float64).reshape(5, 6)
    with tq.connect(path) as db:
        db.from_numpy("A", a, tile=(2, 4))
        db.store("B", db.tensor("A") * 2)
    code = textwrap.dedent(f"""
        import numpy as np, tensorql as tq
        with tq.connect({path!r}) as db:
            print(sorted(db.tensors()), float(db.tensor("B").numpy().sum()))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == f"['A', 'B'] {a.sum() * 2}"


def test_hostile_names_stored_and_found(tmp_path):
    names = ['we"ird', "semi;colon", "drop table x; --", "ünïcödé 张量", "a'b", "x y", "A__chunks2"]
    with tq.connect(str(tmp_path / "h.duckdb")) as db:
        for n, name in enumerate(names):
            db.from_numpy(name, np.full((2, 2), n, dtype=np.int32))
        assert db.tensors() == sorted(names)
        for n, name in enumerate(names):
            assert db.tensor(name).numpy().tolist() == [[n, n], [n, n]]
            con = db.chunk_store.connection
            quoted = '"' + name.replace('"', '""') + '"'
            assert con.sql(f"SELECT sum(val) FROM {quoted}").fetchall()[0][0] == 4 * n
        db.drop('we"ird')
        assert 'we"ird' not in db.tensors()


def test_failed_store_changes_nothing():
    with tq.connect() as db:
        db.from_numpy("A", np.ones((4, 4)), tile=(2, 2))
        before = set(db.chunk_store.connection.sql("SHOW TABLES").fetchall())

        def chunks():
            yield (0, 0), np.ones((2, 2))
            raise RuntimeError("source failed midway")

        meta = TensorMeta("B", (4, 4), "float64", ChunkGrid((4, 4), (2, 2)))
        with pytest.raises(RuntimeError, match="midway"):
            db.chunk_store.put_tensor(meta, chunks())
        with pytest.raises(tq.StorageError, match="got 1 chunks"):
            db.chunk_store.put_tensor(meta, iter([((0, 0), np.ones((2, 2)))]))
        with pytest.raises(tq.ShapeError, match="expected"):
            db.chunk_store.put_tensor(meta, iter([((0, 0), np.ones((3, 2)))]))
        with pytest.raises(tq.StorageError, match="already exists"):
            db.from_numpy("A", np.zeros((4, 4)))
        assert db.tensors() == ["A"]
        assert set(db.chunk_store.connection.sql("SHOW TABLES").fetchall()) == before
        np.testing.assert_array_equal(db.tensor("A").numpy(), np.ones((4, 4)))


def test_replace_swaps_atomically():
    with tq.connect() as db:
        db.from_numpy("A", np.ones((4, 4)), tile=(2, 2))
        db.from_numpy("A", np.full((3, 5), 7.0), tile=(3, 2), replace=True)
        assert db.tensor("A").numpy().tolist() == np.full((3, 5), 7.0).tolist()


def test_memory_mapped_input_streams(tmp_path):
    path = tmp_path / "m.npy"
    a = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(300, 200))
    a[:] = np.arange(60000, dtype=np.float32).reshape(300, 200)
    a.flush()
    mm = np.load(path, mmap_mode="r")
    with tq.connect() as db:
        db.from_numpy("M", mm, tile=(64, 64))
        np.testing.assert_array_equal(db.tensor("M").numpy(), np.asarray(mm))


def test_read_only_and_missing():
    with tq.connect() as db:
        with pytest.raises(tq.UnknownTensorError):
            db.chunk_store.read_chunk("nope", (0,))
        with pytest.raises(tq.UnknownTensorError):
            db.drop("nope")


def test_concurrent_chunk_reads_from_worker_threads(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((256, 256)).astype(np.float32)
    with tq.connect(str(tmp_path / "c.duckdb"), chunk_cache_bytes=0, workers=2) as db:
        A = db.from_numpy("A", a, tile=(32, 32))
        np.testing.assert_allclose((A @ A).numpy(), a @ a, rtol=1e-4, atol=1e-3)


WRITER = """
import sys, numpy as np, tensorql as tq
path = sys.argv[1]
with tq.connect(path) as db:
    for n in range(10_000):
        db.from_numpy(f"t{n:05d}", np.full((64, 256), n, dtype=np.float64), tile=(8, 256))
        print(n, flush=True)
"""


def _check_db(path):
    with tq.connect(path) as db:
        names = db.tensors()
        for name in names:
            n = int(name[1:])
            np.testing.assert_array_equal(db.tensor(name).numpy(), np.full((64, 256), n))
        return names


def test_kill_9_during_writes_loses_nothing_committed(tmp_path):
    path = str(tmp_path / "k.duckdb")
    proc = subprocess.Popen([sys.executable, "-c", WRITER, path], stdout=subprocess.PIPE,
                            text=True)
    committed = []
    while len(committed) < 5:
        line = proc.stdout.readline()
        assert line, "writer died early"
        committed.append(int(line))
    time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    names = _check_db(path)
    assert {f"t{n:05d}" for n in committed} <= set(names)  # committed survive, intact
    assert names == [f"t{n:05d}" for n in range(len(names))]  # no hole, no partial tensor


READER = """
import sys, time, numpy as np, tensorql as tq
path, seconds = sys.argv[1], float(sys.argv[2])
end, seen = time.time() + seconds, 0
while time.time() < end:
    with tq.connect(path, read_only=True) as db:
        for name in db.tensors():
            n = int(name[1:])
            assert (db.tensor(name).numpy() == n).all(), name
        seen = max(seen, len(db.tensors()))
    time.sleep(0.01)
print(seen)
"""

WRITER_RELEASING = """
import sys, numpy as np, tensorql as tq
path = sys.argv[1]
for n in range(1, 12):
    with tq.connect(path) as db:
        db.from_numpy(f"t{n:05d}", np.full((64, 256), n, dtype=np.float64), tile=(8, 256))
"""


def test_reader_process_during_writer_sees_only_committed(tmp_path):
    path = str(tmp_path / "r.duckdb")
    with tq.connect(path) as db:
        db.from_numpy("t00000", np.full((64, 256), 0.0), tile=(8, 256), replace=False)
    reader = subprocess.Popen([sys.executable, "-c", READER, path, "4"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    writer = subprocess.run([sys.executable, "-c", WRITER_RELEASING, path],
                            capture_output=True, text=True)
    out, err = reader.communicate(timeout=60)
    assert reader.returncode == 0, err
    assert writer.returncode == 0, writer.stderr
    assert int(out) >= 1
    assert len(_check_db(path)) == 12


def test_chunks_larger_than_a_record_batch_read_back_whole(tmp_path):
    # 6 MiB chunks span more than one 1024-page record batch of the scan
    data = torch.randn(3, 1536 * 1024)
    with tq.connect(str(tmp_path / "p.duckdb")) as db:
        db.from_torch("P", data, tile=(1, 1536 * 1024))
        db.chunk_store.batch_bytes = 1
        got = dict(db.iter_chunks("P"))
        assert sorted(got) == [(0, 0), (1, 0), (2, 0)]
        for (row, _), chunk in got.items():
            torch.testing.assert_close(chunk, data[row:row + 1], rtol=0, atol=0)
        pages = db.connection.sql("SELECT count(*) FROM tq_internal.tq_chunks_1").fetchall()[0][0]
        assert pages == 3 * 1536  # 4 KiB pages: 1536 per chunk


def test_pages_out_of_scan_order_are_reordered():
    from tensorql.storage.duckdb_store import DuckDBChunkStore
    from tensorql.storage.pages import encode_pages

    meta = TensorMeta("x", (2048,), "float32", ChunkGrid((2048,), (2048,)))
    values = np.arange(2048, dtype=np.float32)
    pages = encode_pages([values.view(np.uint8)])
    order = np.array([1, 0])
    chunk = DuckDBChunkStore._decode(meta, (0,), pages.page_numbers[order],
                                     pages.payload.take(order))
    np.testing.assert_array_equal(chunk.numpy(), values)


def test_one_chunk_is_paged_without_a_copy_and_stored_whole(tmp_path):
    """A chunk that is a write batch of its own (a big one) is paged as a view of its bytes,
    not concatenated into a copy first: one copy less of every big chunk a store writes."""
    from tensorql.storage.pages import encode_pages, join_pages

    values = np.arange(3000, dtype=np.float32)
    raw = values.view(np.uint8)
    pages = encode_pages([raw])
    data = np.frombuffer(pages.payload.buffers()[2], dtype=np.uint8)
    assert np.shares_memory(data, raw)
    np.testing.assert_array_equal(join_pages(pages.payload).view(np.float32), values)
    several = encode_pages([raw, raw[:8]])  # several chunks: concatenated once
    assert not np.shares_memory(np.frombuffer(several.payload.buffers()[2], np.uint8), raw)
    rng = np.random.default_rng(4)
    big = rng.standard_normal((3, 5000)).astype(np.float32)
    with tq.connect(str(tmp_path / "one.duckdb")) as db:
        db.chunk_store.batch_bytes = 1  # every chunk a batch of its own
        db.from_numpy("B", big, tile=(1, 5000))
    with tq.connect(str(tmp_path / "one.duckdb"), read_only=True) as db:
        np.testing.assert_array_equal(db.tensor("B").numpy(), big)


def test_database_written_before_paging_still_reads(tmp_path):
    import duckdb

    path = str(tmp_path / "old.duckdb")
    con = duckdb.connect(path)
    con.execute("CREATE SEQUENCE tensorql_chunk_table_seq START 2")
    con.execute("CREATE TABLE tensorql_catalog (name VARCHAR PRIMARY KEY, chunk_table VARCHAR "
                "NOT NULL, dtype VARCHAR NOT NULL, shape BIGINT[] NOT NULL, tile BIGINT[] NOT "
                "NULL, nbytes BIGINT NOT NULL, created TIMESTAMP NOT NULL DEFAULT "
                "current_timestamp)")
    con.execute("CREATE TABLE tq_chunks_1 (k0 INTEGER NOT NULL, payload BLOB NOT NULL)")
    for k in range(2):
        con.execute("INSERT INTO tq_chunks_1 VALUES (?, ?)",
                    [k, np.full(3, k + 1, np.float32).tobytes()])
    con.execute("INSERT INTO tensorql_catalog (name, chunk_table, dtype, shape, tile, nbytes) "
                "VALUES ('old', 'tq_chunks_1', 'float32', [6], [3], 24)")
    con.close()
    with tq.connect(path, read_only=True) as db:
        assert db.tensor("old").numpy().tolist() == [1, 1, 1, 2, 2, 2]
    with tq.connect(path) as db:  # a writer adds page_bytes and keeps both layouts readable
        db.from_numpy("new", np.arange(4, dtype=np.float32))
        assert db.tensor("old").numpy().tolist() == [1, 1, 1, 2, 2, 2]
        assert db.tensor("new").numpy().tolist() == [0, 1, 2, 3]


def _race_replace_with_reads(db, tile, reads):
    """Read ``w`` ``reads`` times while another thread stores it again and again; the reads'
    results (or errors)."""
    import threading

    db.from_numpy("w", np.zeros((32, 32)), tile=tile, replace=True)
    stop, results, errors = threading.Event(), [], []

    def writer():
        k = 0
        while not stop.is_set():
            k += 1
            db.from_numpy("w", np.full((32, 32), float(k)), tile=tile, replace=True)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(reads):
            try:
                results.append(db.tensor("w").numpy())
            except Exception as err:  # noqa: BLE001 - collected and asserted on below
                errors.append(err)
    finally:
        stop.set()
        thread.join()
    return results, errors


def test_a_read_racing_a_replace_sees_a_version_not_a_missing_table():
    with tq.connect() as db:
        results, errors = _race_replace_with_reads(db, (32, 32), 150)  # one chunk per version
        assert errors == []
        for values in results:
            assert len(np.unique(values)) == 1  # one whole version, old or new
        results, errors = _race_replace_with_reads(db, (8, 8), 60)  # 16 chunks per version
        assert errors == []


@pytest.mark.parametrize("first, second", [("base", "base__chunks"), ("x__chunks", "x"),
                                           ("Base", "BASE__CHUNKS")])
def test_a_tensor_name_never_shadows_another_tensors_chunk_view(first, second):
    with tq.connect() as db:
        db.from_numpy(first, np.arange(4.0), tile=(2,))
        with pytest.raises(tq.StorageError, match="chunk view"):
            db.from_numpy(second, np.arange(3.0))
        assert db.tensors() == [first]
        base = first.removesuffix("__chunks")
        if first == base:  # the chunk view of the stored tensor is still its chunks
            assert db.sql(f'SELECT count(*) FROM "{base}__chunks"').fetchall() == [(2,)]
        else:  # the stored tensor's element view is still its elements
            assert db.sql(f'SELECT count(*) FROM "{first}"').fetchall() == [(4,)]
    with tq.connect() as db, pytest.raises(tq.StorageError, match="chunk view"):
        db.store_many({"y": np.ones(2), "y__chunks": np.ones(2)})


@pytest.mark.parametrize("options", [dict(process_memory_limit="1MiB"),
                                     dict(store_memory_limit="100KiB")])
def test_a_duckdb_memory_figure_too_small_to_open_the_file_is_a_storage_error(
        tmp_path, options):
    """DuckDB's OutOfMemoryException opening the file reached the caller raw."""
    path = str(tmp_path / "small.duckdb")
    with pytest.raises(tq.StorageError, match="store_memory_limit"):
        tq.connect(path, **options)
    with tq.connect(path) as db:  # nothing half-made is left in the way
        db.from_numpy("a", np.arange(4.0))
        np.testing.assert_array_equal(db.tensor("a").numpy(), np.arange(4.0))


def test_a_huge_duckdb_memory_figure_opens_the_file(tmp_path):
    """A store_memory_limit past DuckDB's range was a raw ParserException."""
    path = str(tmp_path / "huge.duckdb")
    with tq.connect(path, store_memory_limit=2**70) as db:
        db.from_numpy("a", np.arange(4.0))
        np.testing.assert_array_equal(db.tensor("a").numpy(), np.arange(4.0))


def test_an_expression_built_before_close_does_not_run_after_it():
    """Its chunks were still in the cache: it ran on and answered after db.close()."""
    db = tq.connect()
    A = db.from_numpy("A", np.ones((4, 4)))
    product = A @ A
    np.testing.assert_array_equal(product.numpy(), np.full((4, 4), 4.0))
    db.close()
    with pytest.raises(tq.StorageError, match="the session is closed"):
        product.numpy()
