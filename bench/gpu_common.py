"""What the GPU benches share: device timing, the result check, goals, the JSON record.

Each GPU bench (``gpu_matmul.py``, ``gpu_offload.py``, ``gpu_llama_layer.py``) times its
contenders with :func:`median_seconds` (CUDA events on a GPU, warm-up first, median of the
samples), checks its result with :func:`relative_error` against an independent reference,
states its goals as :class:`Goal` records and ends with :func:`finish`, which prints the goals,
writes the JSON record (figures, samples, goals, commit, GPU, torch/CUDA versions, date) and
returns the exit status: 1 on a missed goal or a wrong result, 0 otherwise. ``--device cpu``
runs the same code at smoke sizes; its goals are reported but not applied (the result check
is).

>>> import torch
>>> relative_error(torch.ones(4), torch.ones(4) * 1.001) < 2e-3
True
>>> Goal("ratio", 0.97, ">=", 0.95).met, Goal("ratio", 1.2, "<=", 1.05).met
(True, False)
>>> median_seconds(lambda: None, "cpu", repeat=3)[0] >= 0.0
True
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def is_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def sync(device: str) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: str, repeat: int = 5,
                   warmup: int = 1, max_seconds: float | None = None
                   ) -> tuple[float, list[float]]:
    """The median and the samples of ``fn``'s time on ``device``: after ``warmup`` untimed
    calls, ``repeat`` timed ones (with ``max_seconds``, no new sample once that many seconds
    have gone, but at least 3). On CUDA each sample is a pair of events on the current
    stream around ``fn`` and a device-wide synchronize (so work ``fn`` put on other streams
    counts too); on the CPU the wall clock."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples: list[float] = []
    t0 = time.perf_counter()
    for _ in range(repeat):
        if (max_seconds is not None and len(samples) >= 3
                and time.perf_counter() - t0 > max_seconds):
            break
        if is_cuda(device):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            torch.cuda.synchronize(device)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples), samples


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``|got - ref| / |ref|`` (Frobenius, in float64 on ``ref``'s device): inf when ``got``
    has a non-finite value or another shape."""
    if tuple(got.shape) != tuple(ref.shape):
        return math.inf
    got = got.to(ref.device, torch.float64)
    ref = ref.to(torch.float64)
    if not bool(torch.isfinite(got).all()):
        return math.inf
    return float((got - ref).norm() / max(float(ref.norm()), 1e-30))


class SumOfSquares:
    """A relative error accumulated block by block (for results too large to hold twice).

    >>> import torch
    >>> acc = SumOfSquares()
    >>> acc.add(torch.ones(2, 2), torch.ones(2, 2)); acc.add(torch.zeros(2), torch.ones(2))
    >>> round(acc.value(), 4)  # sqrt(2 / 6)
    0.5774
    """

    def __init__(self) -> None:
        self.diff = 0.0
        self.ref = 0.0
        self.bad = False

    def add(self, got: torch.Tensor, ref: torch.Tensor) -> None:
        if tuple(got.shape) != tuple(ref.shape):
            self.bad = True
            return
        got = got.to(ref.device, torch.float64)
        ref = ref.to(torch.float64)
        if not bool(torch.isfinite(got).all()):
            self.bad = True
            return
        self.diff += float(((got - ref) ** 2).sum())
        self.ref += float((ref ** 2).sum())

    def value(self) -> float:
        return math.inf if self.bad else math.sqrt(self.diff / max(self.ref, 1e-300))


@dataclass(frozen=True)
class Goal:
    """One goal: ``value`` compared with ``target`` by ``op`` (``">="`` or ``"<="``)."""

    name: str
    value: float
    op: str
    target: float

    @property
    def met(self) -> bool:
        if not math.isfinite(self.value):
            return False
        return self.value >= self.target if self.op == ">=" else self.value <= self.target


@dataclass
class Record:
    """The JSON record of one bench run (see :func:`finish`)."""

    bench: str
    device: str
    smoke: bool
    config: dict = field(default_factory=dict)
    figures: dict = field(default_factory=dict)
    samples: dict = field(default_factory=dict)
    goals: list = field(default_factory=list)
    checks: list = field(default_factory=list)
    notes: list = field(default_factory=list)


def environment() -> dict:
    """Commit, GPU, driver, torch, CUDA, Python and the date, for every record."""
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit(), "python": platform.python_version(),
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "host": platform.node(), "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_count"] = torch.cuda.device_count()
        env["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
        env["driver"] = _nvidia_smi("driver_version")
    else:
        env["gpu"] = None
    return env


def _nvidia_smi(field_name: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field_name}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None


def commit() -> str:
    """The commit measured: ``$TENSORQL_COMMIT``, else ``git rev-parse HEAD`` (with ``-dirty``
    when the tree has changes), else the one ``gpu_check.py --prepare`` wrote beside the
    carried wheels, else ``"unknown"`` (a copy of the tree without ``.git``)."""
    if os.environ.get("TENSORQL_COMMIT"):
        return os.environ["TENSORQL_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=ROOT, timeout=20)
        if head.returncode == 0 and head.stdout.strip():
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, cwd=ROOT, timeout=20)
            return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    carried = ROOT / ".whl" / "COMMIT"
    if carried.is_file():
        return carried.read_text().strip() + " (written by gpu_check.py --prepare)"
    return "unknown"


def finish(record: Record, json_path: str | None) -> int:
    """Print the goals and checks, write ``record`` (with :func:`environment`) to
    ``json_path`` and return the exit status: 1 when a check failed, or a goal was missed on
    a full-size run; 0 otherwise."""
    wrong = [c for c in record.checks if not c["ok"]]
    missed = [g for g in record.goals if not g["met"]]
    for c in record.checks:
        print(f"check {c['name']}: {'ok' if c['ok'] else 'WRONG'} (relative error "
              f"{c['value']:.2e}, tolerance {c['tolerance']:.0e})")
    for g in record.goals:
        print(f"goal {g['name']}: {g['value']:.3f} {g['op']} {g['target']} "
              f"{'met' if g['met'] else 'MISSED'}")
    failed = bool(wrong) or (bool(missed) and not record.smoke)
    if record.smoke:
        print("smoke run: goals reported, not applied; result checks applied")
    print(f"result: {'FAIL' if failed else 'ok'}")
    if json_path:
        data = {**asdict(record), "environment": environment(), "ok": not failed}
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(data, indent=1, default=str))
        print(f"wrote {json_path}")
    return 1 if failed else 0


def guarded(record: Record, json_path: str | None, body: Callable[[], None]) -> int:
    """Run ``body`` (which fills ``record``) and :func:`finish`: an exception is printed,
    recorded as a failed check, and the figures measured before it are still written.

    >>> import contextlib, io
    >>> def broken():
    ...     raise RuntimeError("out of memory")
    >>> r = Record("x", "cpu", True)
    >>> with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    ...     status = guarded(r, None, broken)
    >>> status, r.checks[-1]["name"]
    (1, 'ran to the end (RuntimeError)')
    """
    try:
        body()
    except Exception as exc:  # noqa: BLE001 - reported, and the exit status says so
        traceback.print_exc()
        sys.stdout.flush()
        record.notes.append(f"stopped by {type(exc).__name__}: {exc}"[:2000])
        record.checks.append({"name": f"ran to the end ({type(exc).__name__})",
                              "value": math.inf, "tolerance": 0.0, "ok": False})
    return finish(record, json_path)


def check(record: Record, name: str, value: float, tolerance: float) -> None:
    """Add a result check (relative error ``value`` <= ``tolerance``)."""
    record.checks.append({"name": name, "value": value, "tolerance": tolerance,
                          "ok": math.isfinite(value) and value <= tolerance})


def goal(record: Record, name: str, value: float, op: str, target: float) -> None:
    """Add a goal (see :class:`Goal`)."""
    g = Goal(name, value, op, target)
    record.goals.append({**asdict(g), "met": g.met})


def cuda_unavailable(name: str) -> int:
    print(f"{name}: CUDA is not available on this machine; nothing measured. "
          "Run with --device cpu for a CPU smoke run.", file=sys.stderr)
    return 2
