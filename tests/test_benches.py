"""Every benchmark's smallest run still works (figures come from the full runs: docs/benchmarks.md).

A bench exits 1 when its goals are not met, which tiny sizes may well do; what must not happen
is a crash, so the test checks for a finished report and no traceback.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SMOKE_RUNS = {
    "cpu_einsum": (["--small", "--skip-dask", "--repeat", "1"], "goals: tq/torch"),
    "store_io": (["--mb", "4", "--tile", "256"], "goals (file store)"),
    "sql_backends": (["--skip-coo", "--n", "256", "--chain-n", "256", "--tile", "128",
                      "--repeat", "1"], "| matmul fp32 |"),
    "gpu_matmul": (["--device", "cpu", "--n", "512", "--tile", "128", "--repeat", "1"],
                   "max relative error"),
    "memory": (["--tiny"], "goals: store peak"),
    "out_of_core": (["--smoke"], "goals: tq-budget peak RSS growth"),
    "gpu_offload": (["--device", "cpu", "--n", "512", "--tile", "128"], "speed-up"),
    "llama": (["--tiny", "--repeat", "1", "--new", "2"], "goals:"),
    "networks": (["--tiny", "--repeat", "1", "--cotengra-time", "0.5"], "goals:"),
    "distributed": (["--tiny", "--ranks", "2", "--repeat", "1"], "goals at 2 ranks"),
    "train": (["--tiny", "--repeat", "1"], "goals:"),
}


@pytest.mark.parametrize("bench", sorted(SMOKE_RUNS))
def test_bench_smoke_run(bench):
    args, expected = SMOKE_RUNS[bench]
    done = subprocess.run([sys.executable, str(ROOT / "bench" / f"{bench}.py"), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode in (0, 1), done.stderr[-3000:]
    assert expected in done.stdout, done.stdout[-3000:]
