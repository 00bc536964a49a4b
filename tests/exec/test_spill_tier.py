"""DuckDB as the spill tier: under a host budget smaller than a query's live intermediates the
results match numpy, the host tier holds at most its budget, EXPLAIN ANALYZE and RunStats give
the DuckDB tier's bytes, the process's peak RSS stays within the budget + 25 %, and nothing
spilled outlives the run -- nor a process killed with SIGKILL while it spills."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import duckdb
import numpy as np
import pytest

import tensorql as tq
from tensorql.storage.spill import SPILL_PREFIX, SpillSpace

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def _operands(n: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, k), dtype=np.float32),
            rng.standard_normal((k, n), dtype=np.float32),
            rng.standard_normal((n, k), dtype=np.float32))


def _reference(a, b, c):
    y = a.astype(np.float64) @ b
    return np.exp(y - y.max()) @ c


def _held(A, B, C):
    """``exp(Y - max(Y)) @ C`` for ``Y = A @ B``: no tile of the n x n intermediate ``Y`` can
    be used before all of it is made (its maximum comes first), so all of it is live at once,
    whatever the order -- the spill tier's case. (``(A @ B) @ C`` alone streams: each tile is
    used as soon as it is made, see test_a_chain_streams_under_a_small_budget; so does
    ``(Y / max(Y)) @ C``, rewritten as ``(Y @ C) / max(Y)``: see
    test_a_scalar_divisor_leaves_the_contraction_and_nothing_spills.)"""
    y = A @ B
    return (y - y.max()).exp() @ C


def _spill_tables(con) -> list[str]:
    return [r[0] for r in con.execute(
        "SELECT table_name FROM duckdb_tables() WHERE starts_with(table_name, ?)",
        [SPILL_PREFIX]).fetchall()]


def _store(db, a, b, c, tile: int):
    k = a.shape[1]
    return (db.from_numpy("A", a, tile=(tile, k)), db.from_numpy("B", b, tile=(k, tile)),
            db.from_numpy("C", c, tile=(tile, k)))


# A (n x k) @ B (k x n) is an n x n intermediate, all of it live at once in _held
SMALL = dict(n=3072, k=16, tile=256)
SMALL_LIMITS = dict(devices="cpu", workers=2, memory_limit="2MiB",
                    process_memory_limit="32MiB")


def test_results_match_numpy_with_the_duckdb_tier_used(tmp_path):
    a, b, c = _operands(SMALL["n"], SMALL["k"])
    with tq.connect(str(tmp_path / "w.duckdb"), **SMALL_LIMITS) as db:
        A, B, C = _store(db, a, b, c, SMALL["tile"])
        query = _held(A, B, C).compile()
        result = query.run(dense=True)
        stats = result.stats
        intermediate = SMALL["n"] ** 2 * 4
        assert stats.host_budget is not None and stats.host_budget < intermediate / 2
        np.testing.assert_allclose(result.dense().numpy(), _reference(a, b, c),
                                   rtol=1e-4, atol=1e-3)
        assert stats.spill_written_bytes > intermediate - stats.host_budget - 2 * MiB
        assert stats.spill_read_bytes > 0 and stats.spill_chunks > 0
        assert stats.spill_reads_ahead > 0  # the prefetcher read chunks back before their use
        assert stats.host_peak_bytes <= stats.host_budget
        planned = stats.program.host  # the memory plan accounts for the host and DuckDB tiers
        assert planned.budget == stats.host_budget and planned.peak_bytes > stats.host_budget
        assert 0.5 < planned.spill_bytes / stats.spill_written_bytes < 2
        assert "; DuckDB tier spill=" in query.explain(stage="memory")
        text = query.explain(analyze=True)
        assert "DuckDB tier: " in text and " spilled (" in text and " reloaded (" in text
        assert _spill_tables(db.connection) == []  # dropped with the run
        assert db.tensors() == ["A", "B", "C"]


def test_without_a_memory_limit_nothing_spills(tmp_path):
    a, b, c = _operands(512, 8)
    with tq.connect(str(tmp_path / "w.duckdb"), devices="cpu", workers=2,
                    process_memory_limit="32MiB") as db:
        A, B, C = _store(db, a, b, c, 128)
        result = _held(A, B, C).compile().run(dense=True)
        np.testing.assert_allclose(result.dense().numpy(), _reference(a, b, c),
                                   rtol=1e-4, atol=1e-3)
        assert getattr(result.stats, "spill_written_bytes", 0) == 0


def test_a_chain_streams_under_a_small_budget(tmp_path):
    """``(A @ B) @ C`` under the budget that makes ``_held`` spill: the memory-aware order
    uses each tile of ``A @ B`` while it is resident, so nothing goes to DuckDB."""
    a, b, c = _operands(SMALL["n"], SMALL["k"], seed=5)
    with tq.connect(str(tmp_path / "w.duckdb"), **SMALL_LIMITS) as db:
        A, B, C = _store(db, a, b, c, SMALL["tile"])
        result = ((A @ B) @ C).compile().run(dense=True)
        y = a.astype(np.float64) @ b
        np.testing.assert_allclose(result.dense().numpy(), y @ c, rtol=1e-4, atol=1e-3)
        stats = result.stats
        assert stats.spill_written_bytes == 0 and stats.peak_live_bytes <= 2 * MiB
        assert stats.host_peak_bytes <= stats.host_budget < SMALL["n"] ** 2 * 4 / 2


def test_a_scalar_divisor_leaves_the_contraction_and_nothing_spills(tmp_path):
    """``(Y / max(Y)) @ C`` under the budget that makes ``_held`` spill: the rule
    ``scalar_out_of_sum`` computes ``(Y @ C) / max(Y)``, so each tile of ``Y`` feeds the
    maximum and its partial product while resident and nothing goes to DuckDB."""
    a, b, c = _operands(SMALL["n"], SMALL["k"], seed=6)
    with tq.connect(str(tmp_path / "w.duckdb"), **SMALL_LIMITS) as db:
        A, B, C = _store(db, a, b, c, SMALL["tile"])
        y = A @ B
        query = ((y / y.max()) @ C).compile()
        assert "rewrite rules: scalar_out_of_sum" in query.explain()
        result = query.run(dense=True)
        y64 = a.astype(np.float64) @ b
        np.testing.assert_allclose(result.dense().numpy(), (y64 / y64.max()) @ c,
                                   rtol=1e-4, atol=1e-3)
        stats = result.stats
        assert stats.spill_written_bytes == 0 and stats.spill_chunks == 0
        assert stats.host_peak_bytes <= stats.host_budget < SMALL["n"] ** 2 * 4 / 2


def test_in_memory_session_spills_to_a_temporary_file_removed_at_close():
    a, b, c = _operands(SMALL["n"], SMALL["k"], seed=1)
    db = tq.connect(**SMALL_LIMITS)
    A, B, C = _store(db, a, b, c, 256)
    result = _held(A, B, C).compile().run(dense=True)
    np.testing.assert_allclose(result.dense().numpy(), _reference(a, b, c),
                               rtol=1e-4, atol=1e-3)
    assert result.stats.spill_written_bytes > 0
    path = db.spill_space.path
    assert path is not None and os.path.exists(path)
    assert os.path.dirname(path) == tempfile.gettempdir()
    con = db.spill_space.cursor()
    assert _spill_tables(con) == []
    con.close()
    db.close()
    assert not os.path.exists(path)


def test_stale_temporary_files_of_dead_processes_are_removed(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = tmp_path / f"tensorql-spill-{int(done.stdout)}-x"
    dead.mkdir()
    (dead / "duckdb_temp_storage-0.tmp").write_bytes(b"left by a killed process")
    mine = tmp_path / f"tensorql-spill-{os.getpid()}-y"
    mine.mkdir()
    space = SpillSpace(directory=str(tmp_path))
    pages = space.open_run("t")
    pages.write(np.ones(4, np.float32))
    assert not dead.exists() and mine.exists()
    assert space.path is not None and os.path.basename(space.path).startswith(
        f"tensorql-spill-{os.getpid()}-")
    pages.close()
    space.close()


RSS_CHILD = textwrap.dedent("""
    import sys, numpy as np
    import tensorql as tq

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    path, limited = sys.argv[1], sys.argv[2] == "1"
    kw = dict(memory_limit="16MiB", process_memory_limit="160MiB") if limited else {}
    with tq.connect(path, devices="cpu", workers=2, **kw) as db:
        A, B, C = db.tensor("A"), db.tensor("B"), db.tensor("C")
        for t in (A, B, C):  # warm up: DuckDB's scan state and torch's threads
            t[:8].numpy()
        y = A[:256, :] @ B[:, :256]
        ((y - y.max()).exp() @ C[:256, :]).numpy()
        y = A @ B
        q = ((y - y.max()).exp() @ C).compile()  # the intermediate is held whole: see _held
        open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM
        base = status("VmRSS")
        result = q.run(dense=True)
        growth = status("VmHWM") - base
        out = result.dense().numpy()
        spilled = getattr(result.stats, "spill_written_bytes", 0)
        np.save(sys.argv[3], out)
        print("GROWTH", growth, "SPILLED", spilled)
""")


def _child_growth(path: str, limited: bool, out: Path) -> tuple[int, int]:
    done = subprocess.run([sys.executable, "-c", RSS_CHILD, path, "1" if limited else "0",
                           str(out)], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    words = done.stdout.split()
    return int(words[words.index("GROWTH") + 1]), int(words[words.index("SPILLED") + 1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_peak_rss_within_the_budget_plus_a_quarter(tmp_path):
    n, k = 8192, 16
    a, b, c = _operands(n, k, seed=2)
    path = str(tmp_path / "big.duckdb")
    with tq.connect(path, devices="cpu") as db:
        _store(db, a, b, c, 512)
    budget = 160 * MiB
    growth, spilled = _child_growth(path, True, tmp_path / "limited.npy")
    np.testing.assert_allclose(np.load(tmp_path / "limited.npy"), _reference(a, b, c),
                               rtol=1e-4, atol=1e-3)
    assert spilled > n * n * 4 - budget  # the 256 MiB intermediate went through DuckDB
    assert growth <= budget * 1.25, f"peak RSS grew by {growth / MiB:.0f} MiB"
    free, _ = _child_growth(path, False, tmp_path / "free.npy")
    assert free > budget * 1.25  # unbounded, the same query needs more than that


KILL_CHILD = textwrap.dedent("""
    import logging, sys, numpy as np
    import tensorql as tq

    class Announce(logging.Handler):
        seen = 0
        def emit(self, record):
            if record.getMessage().startswith("spilled chunk"):
                Announce.seen += 1
                if Announce.seen == 3:
                    print("SPILLING", flush=True)

    log = logging.getLogger("tensorql")
    log.setLevel(logging.DEBUG)
    log.addHandler(Announce())
    with tq.connect(sys.argv[1], devices="cpu", workers=2, memory_limit="2MiB",
                    process_memory_limit="32MiB") as db:
        y = db.tensor("A") @ db.tensor("B")
        for _ in range(20):
            ((y - y.max()).exp() @ db.tensor("C")).numpy()  # held whole: see _held
""")


def test_kill_during_a_spilling_query_leaves_no_spilled_pages(tmp_path):
    a, b, c = _operands(4096, 16, seed=3)  # 64 MiB spilled a run: beyond DuckDB's memory
    path = str(tmp_path / "crash.duckdb")
    with tq.connect(path, devices="cpu") as db:
        _store(db, a, b, c, SMALL["tile"])
    child = subprocess.Popen([sys.executable, "-c", KILL_CHILD, path], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    on_disk: list[str] = []
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "SPILLING" not in line and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line and child.poll() is not None:
                break
        assert "SPILLING" in line, child.stderr.read()[-3000:]
        folder = glob.glob(path + f".spill-{child.pid}-*")
        assert len(folder) == 1 and os.path.isdir(folder[0])
        while not on_disk and time.monotonic() < deadline and child.poll() is None:
            on_disk = os.listdir(folder[0])  # DuckDB wrote spilled pages to its files
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert on_disk, "the process was killed before DuckDB wrote spilled pages to disk"
    assert os.path.isdir(folder[0])  # left behind by the killed process
    raw = duckdb.connect(path, read_only=True)  # none of it was ever in the session's file
    try:
        assert _spill_tables(raw) == []
    finally:
        raw.close()
    with tq.connect(path) as db:  # the next open removes the dead process's spill folder
        assert not os.path.exists(folder[0])
        assert glob.glob(path + ".spill-*") == []
        assert db.tensors() == ["A", "B", "C"]
        assert _spill_tables(db.connection) == []
        np.testing.assert_array_equal(db.tensor("A").numpy(), a)


def test_host_tier_spills_what_is_read_last_and_reads_it_back_in_plan_order():
    import torch

    from tensorql.exec.hostpool import HostTier
    from tensorql.exec.taskgraph import ChunkRef

    refs = [ChunkRef(1, (i,)) for i in range(20)]
    values = {ref: torch.full((256,), float(i)) for i, ref in enumerate(refs)}  # 1 KiB each
    order = [refs[i] for i in (7, 3, 19, 0, 12, 5, 8, 1, 15, 2, 18, 4, 9, 6, 11, 10, 17, 13,
                               16, 14)]
    loads = [(100 + k, ref) for k, ref in enumerate(order)]
    space = SpillSpace()
    tier = HostTier(spill=space, budget=4 * 1024, loads=loads)
    try:
        for ref in refs:
            tier.put(ref, values[ref].clone())
        assert tier.plain_bytes == 4 * 1024
        assert set(tier._data) == set(order[:4])  # Belady: the four read soonest stay
        assert tier.spill_written == 16 * 1024 and tier.spill_chunks == 16
        for op_id, ref in loads:
            got = tier.get(ref)
            torch.testing.assert_close(got, values[ref])
            tier.load_done(op_id)
            tier.drop(ref)
            assert tier.plain_bytes <= 4 * 1024
        assert tier.reads_ahead + tier.reads_on_demand >= 16
        assert tier.spill_read >= 16 * 1024
        assert tier.peak_plain_bytes <= 4 * 1024 and tier.over_budget == 0
        assert tier.plain_bytes == 0
    finally:
        tier.close()
        space.close()


def test_a_chunk_read_on_demand_is_not_read_again_by_the_prefetcher_for_the_same_use():
    """The prefetcher used to read a chunk back a second time when its load had already read
    it on demand and had not finished: a wasted DuckDB read, and plain bytes reserved for a
    chunk its owner may drop meanwhile (CI saw ``plain_bytes`` 1 KiB after every drop)."""
    import torch

    from tensorql.exec.hostpool import HostTier
    from tensorql.exec.taskgraph import ChunkRef

    a, b = ChunkRef(1, (0,)), ChunkRef(1, (1,))
    space = SpillSpace()
    tier = HostTier(spill=space, budget=1024, loads=[(1, a), (2, b)])
    try:
        tier.put(a, torch.zeros(256))
        tier.put(b, torch.ones(256))  # read last: spilled; no room to read it ahead
        assert tier.spill_chunks == 1 and tier.plain_bytes == 1024
        torch.testing.assert_close(tier.get(b), torch.ones(256))  # on demand: a holds the room
        assert tier.reads_on_demand == 1
        tier.drop(a)  # room now; b's load is still running
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline and tier.reads_ahead == 0:
            time.sleep(0.01)
        with tier._cond:
            assert tier.reads_ahead == 0 and not tier._reading
            assert tier._next_prefetch() is None
        tier.load_done(2)
        tier.drop(b)
        assert tier.plain_bytes == 0 and tier.spill_read == 1024
    finally:
        tier.close()
        space.close()


@pytest.mark.parametrize("devices", ["cpu", ["cpu:0", "cpu:1"]])
def test_stored_result_and_two_devices_under_the_host_budget(tmp_path, devices):
    a, b, c = _operands(SMALL["n"], SMALL["k"], seed=4)
    limits = {**SMALL_LIMITS, "devices": devices}
    with tq.connect(str(tmp_path / "w.duckdb"), **limits) as db:
        A, B, C = _store(db, a, b, c, SMALL["tile"])
        expr = _held(A, B, C)
        stats = expr.compile().run(dense=True).stats
        assert stats.spill_written_bytes > 0 and stats.host_peak_bytes <= stats.host_budget
        db.store("D", expr)  # streamed: each result chunk goes to the store as it completes
        np.testing.assert_allclose(db.tensor("D").numpy(), _reference(a, b, c),
                                   rtol=1e-4, atol=1e-3)
        assert db.tensors() == ["A", "B", "C", "D"]
        assert _spill_tables(db.connection) == []


def test_spill_pages_round_trip_exact_bytes_by_rowid_range():
    """Chunks of several pages, of every width, empty ones, written and read back in any
    order (and from another thread) come back bit for bit; rows that are not the chunk's
    are an error, never another chunk's bytes."""
    import threading

    import torch

    from tensorql.errors import StorageError

    gen = torch.Generator().manual_seed(7)
    chunks = [torch.randn(3000, generator=gen),                       # 3 pages of 4 KiB
              torch.randn(64, 33, generator=gen).to(torch.bfloat16),  # one page and a bit
              torch.randint(-2**40, 2**40, (1500,), generator=gen),   # int64, 3 pages
              torch.empty(0, dtype=torch.float32),                    # no bytes: one page
              torch.randn(1024, generator=gen).double()]              # exactly 2 pages
    space = SpillSpace()
    pages = space.open_run("t")
    pages.page_bytes = 4096  # several pages per chunk (4 MiB by default)
    try:
        ids = [pages.write(x) for x in chunks]
        assert pages.bytes_written == sum(x.nbytes for x in chunks)
        for k in (4, 0, 3, 2, 1, 0):
            got = pages.read(ids[k], tuple(chunks[k].shape), chunks[k].dtype)
            assert got.dtype == chunks[k].dtype and torch.equal(got, chunks[k])
        seen = {}
        thread = threading.Thread(target=lambda: seen.update(
            got=pages.read(ids[2], (1500,), torch.int64)))
        thread.start()
        thread.join()
        assert torch.equal(seen["got"], chunks[2])
        pages._rows[ids[1]] = pages._rows[ids[0]]  # rows of another chunk
        with pytest.raises(StorageError, match="not pages of chunk 1"):
            pages.read(ids[1], (64, 33), torch.bfloat16)
    finally:
        pages.close()
        space.close()


def test_host_tier_opens_its_spill_table_ahead_when_the_plan_spills():
    """With ``expect_spill`` the run's table exists before the first eviction (opened by a
    thread, overlapped with the run's first ops) and is gone after ``close``, spilled or not."""
    import torch

    from tensorql.exec.hostpool import HostTier
    from tensorql.exec.taskgraph import ChunkRef

    a, b = ChunkRef(0, (0,)), ChunkRef(0, (1,))
    space = SpillSpace()
    try:
        for spill in (False, True):
            tier = HostTier(spill=space, budget=64, loads=[(1, b), (2, a)], expect_spill=True)
            tier._opener.join()
            con = space.cursor()
            # before any put: the first chunk's table (a table per spilled chunk)
            assert _spill_tables(con) == [f"{tier._pages.table}_c0"]
            if spill:
                tier.put(a, torch.ones(16))
                tier.put(b, torch.zeros(16))
                assert tier.spill_chunks == 1 and float(tier.get(a).sum()) == 16.0
            tier.close()
            assert _spill_tables(con) == []
            con.close()
        lazy = HostTier(spill=space, budget=64, loads=[(1, a)])
        assert lazy._opener is None and lazy._pages is None  # no plan said it spills
        lazy.close()
    finally:
        space.close()


def test_a_chunk_larger_than_the_spill_databases_memory_round_trips():
    """A chunk of 1.5x the spill database's memory is written and read a quarter of that
    memory at a time: with one statement per chunk, a 16 MiB chunk read back from a 32 MiB
    database failed ("failed to pin block", bench/out_of_core.py at its full size)."""
    import torch

    gen = torch.Generator().manual_seed(11)
    chunk = torch.randn(12 << 20, generator=gen)  # 48 MiB
    space = SpillSpace(memory_bytes=32 << 20)
    pages = space.open_run("big")
    try:
        ident = pages.write(chunk)
        other = pages.write(chunk[: 1 << 20] * 2)  # a write between keeps rows apart
        assert pages._pages_per_statement() * pages.page_bytes <= 8 << 20
        got = pages.read(ident, tuple(chunk.shape), chunk.dtype)
        assert torch.equal(got, chunk)
        assert torch.equal(pages.read(other, (1 << 20,), torch.float32), chunk[: 1 << 20] * 2)
    finally:
        pages.close()
        space.close()


def _temporary_bytes(con) -> int:
    return int(con.execute("SELECT coalesce(sum(size), 0) FROM duckdb_temporary_files()")
               .fetchone()[0])


def test_a_discarded_chunk_leaves_duckdbs_memory_and_files_at_once():
    """Each spilled chunk is a table of its own, dropped by ``discard``: its blocks leave the
    spill database's temporary files at once. With one table per run, chunks read back stayed
    in DuckDB's buffer pool and were written to its files a second time when evicted."""
    import torch

    from tensorql.errors import StorageError

    gen = torch.Generator().manual_seed(13)
    chunks = [torch.randn(3 << 20, generator=gen) for _ in range(4)]  # 12 MiB each
    space = SpillSpace(memory_bytes=32 << 20)
    pages = space.open_run("discard")
    con = space.cursor()
    try:
        ids = [pages.write(x) for x in chunks]  # 48 MiB: more than DuckDB's 32 MiB of memory
        assert pages.live_chunks == 4 and len(_spill_tables(con)) == 4
        assert _temporary_bytes(con) > 0  # DuckDB wrote some of them to its files
        for ident, want in zip(ids, chunks):
            assert torch.equal(pages.read(ident, (3 << 20,), "float32"), want)
            pages.discard(ident)
        assert pages.chunks_discarded == 4 and pages.live_chunks == 0
        assert _spill_tables(con) == [] and _temporary_bytes(con) == 0
        pages.discard(ids[0])  # twice: ignored
        with pytest.raises(StorageError, match="no chunk 0"):
            pages.read(ids[0], (3 << 20,), "float32")
    finally:
        con.close()
        pages.close()
        space.close()


def test_host_tier_discards_a_spilled_copy_at_its_last_read():
    """A chunk read back ahead of its last use, or dropped, has its DuckDB copy discarded
    during the run (not at its close), and every read returns the chunk's values."""
    import torch

    from tensorql.exec.hostpool import HostTier
    from tensorql.exec.taskgraph import ChunkRef

    refs = [ChunkRef(0, (i,)) for i in range(4)]
    values = [torch.full((256,), float(i)) for i in range(4)]  # 1 KiB each
    # plan order of host reads: chunk 3 twice, the others once
    loads = [(10, refs[3]), (11, refs[0]), (12, refs[3]), (13, refs[1]), (14, refs[2])]
    space = SpillSpace()
    tier = HostTier(spill=space, budget=1024, loads=loads, lookahead=1)
    try:
        for ref, value in zip(refs, values):
            tier.put(ref, value)
        assert tier.spill_chunks == 3  # the budget holds one chunk
        pages = tier._pages
        for op_id, ref in loads:
            assert torch.equal(tier.get(ref), values[ref.key[0]])
            tier.load_done(op_id)
            if op_id != 10:  # the runtime drops a host copy after its last load
                tier.drop(ref)
        with tier._cond:  # the prefetcher's last read has finished
            while tier._reading:
                tier._cond.wait()
        assert pages.live_chunks == 0  # every copy discarded by the run's end, not its close
        assert pages.chunks_discarded == pages.chunks_written >= 3
        assert tier.spill_read >= 3 * 1024
    finally:
        tier.close()
        space.close()


def test_concurrent_spill_writes_and_reads_stay_within_the_spill_databases_memory():
    """Two workers' writes beside the prefetcher's and a load's reads: the spill database
    (32 MiB of DuckDB memory) used to fail with "failed to pin block" (the out-of-core bench's
    budgeted run died so once its memory plan let two workers run); statements are now gated
    and moved an eighth of that memory at a time."""
    import threading

    import torch

    space = SpillSpace(memory_bytes=32 << 20)
    pages = space.open_run("concurrent")
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        try:
            for i in range(6):
                value = torch.rand((2048, 2048), generator=generator)  # 16 MiB
                ident = pages.write(value)
                assert torch.equal(pages.read(ident, (2048, 2048), torch.float32), value)
                if i % 2:
                    pages.discard(ident)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
    finally:
        pages.close()
        space.close()


def test_a_chunk_is_written_by_one_insert_into_its_own_table():
    """A chunk of many pages is one INSERT (its rows move whole into the empty table at the
    commit: batches into a table holding rows were copied a second time) and comes back bit
    for bit, read a bounded number of pages per SELECT."""
    import torch

    gen = torch.Generator().manual_seed(17)
    chunk = torch.randn(12 << 20, generator=gen)  # 48 MiB: 12 pages, 1.5x DuckDB's memory
    space = SpillSpace(memory_bytes=32 << 20)
    pages = space.open_run("one")
    try:
        ident = pages.write(chunk)
        assert pages.statements_run == 1
        assert torch.equal(pages.read(ident, tuple(chunk.shape), chunk.dtype), chunk)
        per = pages._pages_per_statement()
        assert pages.statements_run == 1 + -(-12 // per)
    finally:
        pages.close()
        space.close()
