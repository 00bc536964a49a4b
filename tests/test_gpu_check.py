"""``make gpu-check`` and the GPU benches it runs, on the CPU (issue 29, finding 10 and item 5).

The dry run (``DEV=cpu make gpu-check``) runs every step with CPU devices and smoke sizes; the
rest checks the benches' own logic: results are checked (a wrong or missing block fails),
a missed goal exits 1, the offload bench's bound is minimum traffic over measured bandwidth
and its baseline is double-buffered and reads each tile a bounded number of times.
"""

from __future__ import annotations

import argparse
import doctest
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402
import gpu_common  # noqa: E402
import gpu_matmul  # noqa: E402
import gpu_offload  # noqa: E402

from tensorql.exec.taskgraph import ChunkRef  # noqa: E402


def test_dev_cpu_make_gpu_check_is_a_dry_run_of_every_step(tmp_path):
    recipe = (ROOT / "Makefile").read_text().split("\ngpu-check:\n", 1)[1].splitlines()[0]
    assert recipe.strip() == "$(GPU_PY) bench/gpu_check.py --device $(or $(DEV),cuda)"
    # the target itself; where make is absent (a bare device image) the line it runs
    command = (["make", "-s", "gpu-check", "DEV=cpu", f"GPU_PY={sys.executable}"]
               if shutil.which("make") else [sys.executable, "bench/gpu_check.py", "--device",
                                             "cpu"])
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OUT": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "gpu-check (dry run, device cpu) passed" in done.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {s["name"]: s["status"] for s in report["steps"]}
    assert status == {"setup": "ok", "environment": "ok", "pytest -m gpu": "skipped",
                      "gpu_matmul": "ok", "gpu_offload": "ok", "gpu_probe": "ok",
                      "gpu_llama_layer": "ok", "gpu_profile": "ok", "cpu suite": "skipped"}
    assert report["ok"] and report["environment"]["torch"] == torch.__version__
    records = {s["name"]: s["record"] for s in report["steps"]}
    for bench in ("gpu_matmul", "gpu_llama_layer", "gpu_offload"):
        record = records[bench]
        assert record["smoke"] and record["ok"] and record["checks"]
        assert all(c["ok"] for c in record["checks"])
        env = record["environment"]
        assert {"commit", "gpu", "torch", "cuda", "date", "python"} <= set(env)
    assert records["gpu_matmul"]["figures"]["runtime_rel_error"] < 1e-5
    assert len(records["gpu_matmul"]["samples"]["runtime_s"]) >= 5
    assert all(row["ok"] for row in records["gpu_probe"])
    assert (tmp_path / "summary.txt").read_text().startswith("gpu-check (dry run")
    assert "===== gpu_offload =====" in (tmp_path / "gpu_check.log").read_text()
    assert len(list(tmp_path.iterdir())) <= 8  # what a device run's $OUT brings back


def test_a_wrong_result_fails_a_bench_and_a_missed_goal_fails_a_full_run(tmp_path):
    def record(smoke, err, ratio):
        r = gpu_common.Record("x", "cpu", smoke)
        gpu_common.check(r, "result", err, 1e-3)
        gpu_common.goal(r, "ratio", ratio, ">=", 0.95)
        return r

    assert gpu_common.finish(record(False, 1e-5, 0.97), None) == 0
    assert gpu_common.finish(record(False, 1e-5, 0.90), None) == 1  # goal missed
    assert gpu_common.finish(record(True, 1e-5, 0.10), None) == 0   # smoke: goal not applied
    assert gpu_common.finish(record(True, 0.5, 0.97), None) == 1    # wrong result
    assert gpu_common.finish(record(True, float("nan"), 0.97), str(tmp_path / "r.json")) == 1
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["ok"] is False and saved["environment"]["commit"]


def test_the_matmul_check_catches_a_missing_or_wrong_block():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    exact = a @ b
    blocks = {ChunkRef(2, (i, j)): exact[i * 32:(i + 1) * 32, j * 32:(j + 1) * 32].clone()
              for i in range(2) for j in range(2)}
    assert gpu_matmul.blockwise_error(blocks, exact, 32) < 1e-12
    wrong = dict(blocks)
    wrong[ChunkRef(2, (1, 0))] = blocks[ChunkRef(2, (0, 1))]
    assert gpu_matmul.blockwise_error(wrong, exact, 32) > 0.1
    missing = {k: v for k, v in blocks.items() if k != ChunkRef(2, (1, 1))}
    assert gpu_matmul.blockwise_error(missing, exact, 32) == float("inf")
    nan = dict(blocks)
    nan[ChunkRef(2, (0, 0))] = torch.full((32, 32), float("nan"))
    assert gpu_matmul.blockwise_error(nan, exact, 32) == float("inf")


def test_the_offload_bound_is_minimum_traffic_over_measured_bandwidth():
    traffic = gpu_offload.min_traffic_bytes(32768, 32768, 32768, 2)
    assert traffic == 6 * 2**30  # A and B read once, C written once: bf16
    assert gpu_offload.lower_bound(0.05, traffic, 50e9) == pytest.approx(traffic / 50e9)
    assert gpu_offload.lower_bound(0.5, traffic, 50e9) == 0.5
    assert gpu_offload.copy_bandwidth(1 << 20, "cpu", to_device=True) > 0


def test_the_offload_baseline_is_double_buffered_under_the_budget():
    # 8 x 8 tiles of 32 x 32 fp32 (4 KiB), budget = working set / 3 = 64 tiles: the tile
    # counts of the default GPU run (32768^2 bf16 in 4096^2 tiles under 2 GiB)
    g = torch.Generator().manual_seed(0)
    n, tile = 256, 32
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)

    def tiles(x):
        return [[x[r:r + tile, c:c + tile].contiguous() for c in range(0, n, tile)]
                for r in range(0, n, tile)]

    out = [[torch.empty(tile, tile) for _ in range(8)] for _ in range(8)]
    tile_bytes = tile * tile * 4
    stats = gpu_offload.double_buffered(tiles(a), tiles(b), out, "cpu", 64 * tile_bytes)
    got = torch.cat([torch.cat(row, dim=1) for row in out], dim=0)
    torch.testing.assert_close(got, a @ b, rtol=1e-4, atol=1e-4)
    assert stats.rows_per_panel == 4 and stats.device_tiles <= 64
    # A once (64 tiles), B once per panel of 4 rows (2 x 64), C once (64): 8 GiB at full
    # size, where the old synchronous baseline copied 2 x 8^3 = 1024 tiles (32 GiB)
    assert stats.bytes_h2d == (64 + 2 * 64) * tile_bytes
    assert stats.bytes_d2h == 64 * tile_bytes


def test_a_step_that_fails_or_overruns_fails_gpu_check(tmp_path, monkeypatch):
    def boom(check, result):
        raise RuntimeError("no device")

    def slow(check, result):
        result.command = [sys.executable, "-c", "import time; time.sleep(60)"]
        rc, _, _ = check.run(result.command, 1.0)
        result.status = "TIMEOUT" if rc is None else "ok"

    def fine(check, result):
        result.status, result.key = "ok", "42"

    monkeypatch.setattr(gpu_check, "STEPS", (gpu_check.Step("boom", boom, 10),
                                             gpu_check.Step("slow", slow, 10),
                                             gpu_check.Step("fine", fine, 10)))
    monkeypatch.setenv("OUT", str(tmp_path))
    t0 = time.monotonic()
    assert gpu_check.main(["--device", "cpu"]) == 1
    assert time.monotonic() - t0 < 30  # the sleeping step was killed at its cap
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["status"] for s in report["steps"]] == ["FAIL", "TIMEOUT", "ok"]
    assert "RuntimeError: no device" in report["steps"][0]["key"]
    summary = (tmp_path / "summary.txt").read_text()
    assert "FAILED" in summary and "42" in summary


def _wheel(directory: Path, name: str) -> Path:
    """A minimal pure-Python wheel of one module ``name`` (what pip --no-index installs)."""
    path = directory / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    files = {f"{name}.py": "VALUE = 7\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


def test_setup_installs_only_missing_modules_from_the_carried_wheels(tmp_path, monkeypatch):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _wheel(wheels, "tqgpucheck_absent")
    _wheel(wheels, "json")  # importable already: must not be installed over the stdlib
    monkeypatch.setattr(gpu_check, "WHEEL_DIR", wheels)
    monkeypatch.setattr(gpu_check, "WHEELS", {"tqgpucheck-absent": "tqgpucheck_absent",
                                              "json": "json"})
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    check = gpu_check.Check(argparse.Namespace(device="cpu", out=str(tmp_path), budget=120.0,
                                               python=sys.executable, caps={}))
    check.site = tmp_path / "site"
    result = gpu_check.StepResult("setup")
    gpu_check.step_setup(check, result)
    assert result.status == "ok", result.key
    assert result.record["installed"] == ["tqgpucheck_absent-1.0-py3-none-any.whl"]
    assert (tmp_path / "site" / "tqgpucheck_absent.py").is_file()
    assert not (tmp_path / "site" / "json.py").exists()
    probe = subprocess.run([sys.executable, "-c", "import tqgpucheck_absent as m; print(m.VALUE)"],
                           env=check.env, capture_output=True, text=True, cwd=tmp_path)
    assert probe.stdout.strip() == "7"


def test_wheel_file_names_map_to_their_modules():
    assert gpu_check._wheel_module("einsum_benchmark-0.1.8-py3-none-any.whl") == \
        "einsum_benchmark"
    assert gpu_check._wheel_module(
        "duckdb-2.0.1-cp312-abi3-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl") == "duckdb"
    assert gpu_check.pytest_counts("== 48 failed, 1235 passed, 3 skipped in 161.73s ==") == \
        {"failed": 48, "passed": 1235, "skipped": 3}


@pytest.mark.parametrize("module", [gpu_common, gpu_offload, gpu_check])
def test_bench_module_doctests(module):
    failures, tried = doctest.testmod(module)
    assert tried > 0 and failures == 0


def test_skip_leaves_steps_out_by_name(tmp_path):
    """``--skip`` (a rerun inside what is left of a lease) leaves the named steps out and
    says so in the summary; a name that is no step is refused before anything runs."""
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--device", "cpu", "--skip",
                           "gpu_profile,gpu_llama_layer,gpu_offload,gpu_matmul,gpu_probe"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OUT": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    status = {s["name"]: (s["status"], s["key"]) for s in
              json.loads((tmp_path / "gpu_check.json").read_text())["steps"]}
    assert status["gpu_profile"] == ("skipped", "--skip")
    assert status["gpu_matmul"] == ("skipped", "--skip")
    assert status["environment"][0] == "ok"
    bad = subprocess.run([sys.executable, "bench/gpu_check.py", "--device", "cpu", "--skip",
                          "gpu_matmull"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "OUT": str(tmp_path / "bad")})
    assert bad.returncode == 2 and "no step named 'gpu_matmull'" in bad.stderr


_FAILING_THEN_SLOW = """
import time

def test_fails_first():
    assert 6 * 7 == 41, "the reason the capped run must still give"

def test_then_runs_past_the_cap():
    time.sleep(120)
"""


@pytest.mark.parametrize("workers", [None, 2])
def test_a_suite_stopped_at_its_cap_has_written_why_its_failures_failed(tmp_path, workers):
    """gpu-check's CPU suite loads ``bench/failure_log.py``: each failure's report is in the
    file as soon as the test ends, so a suite killed at its cap (as on a device machine)
    still says why -- once, under xdist too (the controller writes, not the workers)."""
    if workers is not None:
        pytest.importorskip("xdist", reason="pytest-xdist (the device image has it)")
    (tmp_path / "test_capped.py").write_text(_FAILING_THEN_SLOW)
    log = tmp_path / "failures.txt"
    env = {**os.environ, "TENSORQL_FAILURE_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pytest", "-p", "failure_log", "-p", "no:cacheprovider",
               "-q", "--tb=short", "-c", os.devnull, "--rootdir", str(tmp_path),
               str(tmp_path / "test_capped.py")] + (["-n", str(workers)] if workers else [])
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "41" not in (
                log.read_text() if log.is_file() else ""):
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, 9)  # the cap: the slow test never ends, pytest never summarises
        proc.wait()
    text = log.read_text()
    assert text.count("===== FAILED") == 1, text
    assert "test_capped.py::test_fails_first (call)" in text
    assert "the reason the capped run must still give" in text and "6 * 7" in text
