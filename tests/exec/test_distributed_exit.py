"""A rank of tensorql's distributed mode ends cleanly: the process group tensorql joined is
destroyed by its exit handler while the interpreter is whole, so no gloo thread is left to
the interpreter's teardown, where one that needs the GIL is ended by ``pthread_exit`` and
aborts the process ("terminate called without an active exception", SIGABRT; 2 of 4 CI runs
of the distributed bench's smoke run on 2026-11-26). The ranks run tests/exec/exit_worker.py
as plain processes with the variables torchrun sets."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("exit_worker.py")
ROOT = Path(__file__).resolve().parents[2]

linux_only = pytest.mark.skipif(not Path("/proc/self/task").is_dir(),
                                reason="lists threads from /proc/self/task (Linux)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(world: int, mode: str, out: Path) -> list[subprocess.Popen]:
    port = _free_port()
    return [subprocess.Popen(
        [sys.executable, str(WORKER), str(out), mode], cwd=ROOT,
        env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                 WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                 OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(world)]


def _finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[tuple[int, str]]:
    errs = [p.communicate(timeout=timeout)[1] for p in procs]
    return [(p.returncode, err) for p, err in zip(procs, errs)]


@linux_only
def test_no_gloo_thread_outlives_the_exit_handler(tmp_path):
    """After tensorql's exit handler, no gloo worker or transport thread and no store server
    is left: the default group is freed (tensorql's own state refers to it weakly; it held
    it and the group was torn down inside Py_Finalize)."""
    done = _finish(_start(2, "query", tmp_path))
    for rank, (code, err) in enumerate(done):
        assert code == 0, f"rank {rank} exited {code}: {err[-3000:]}"
        assert json.loads((tmp_path / f"rank{rank}.json").read_text())["max_err"] < 1e-4
        left = json.loads((tmp_path / f"rank{rank}.exit.json").read_text())
        assert left == {"torch_threads": []}, f"rank {rank}"


def test_work_finishing_after_the_script_does_not_abort(tmp_path):
    """Rank 0's script ends with an all-reduce in flight whose future has a Python callback;
    its peer joins 1.5 s later. Destroying the group at exit waits for the work, which then
    finishes while the interpreter is whole (it aborted with SIGABRT when the group was
    torn down inside Py_Finalize)."""
    done = _finish(_start(2, "pending", tmp_path))
    for rank, (code, err) in enumerate(done):
        assert code == 0, f"rank {rank} exited {code}: {err[-3000:]}"
    assert json.loads((tmp_path / "rank1.json").read_text()) == {"sum": [2.0] * 4}


def test_a_finished_job_exits_0_every_time(tmp_path):
    """A minimal user script, 2 ranks, run again and again (2 pairs at a time, within a
    minute): every rank exits 0. The exit abort was a race, 2 of 4 CI runs of the smoke
    bench; this is the loop that counted it."""
    runs, parallel = 4, 2
    codes = []
    for first in range(0, runs, parallel):
        batch = []
        for k in range(first, first + parallel):
            (tmp_path / f"run{k}").mkdir()
            batch.append(_start(2, "query", tmp_path / f"run{k}"))
        for procs in batch:
            codes += _finish(procs)
    assert [code for code, _ in codes] == [0] * (2 * runs), \
        [err[-2000:] for code, err in codes if code != 0]
