"""``make gpu-check``: every GPU check in one command that fits one 10-minute device run.

Steps, in order (each a subprocess with its own time cap, all within ``--budget`` seconds):

1. ``setup``: the carried wheels (``.whl``, made here by ``--prepare``) installed with
   ``pip --no-index`` into a temporary folder, only for the modules that are not importable
   (nothing is installed where all are), and ``kernels/`` made importable as
   ``tensorql_kernels`` for a checkout that is not pip-installed;
2. ``environment``: one line (GPU, driver, torch, CUDA, Python, commit);
3. ``pytest -m gpu``: the GPU tests (skipped in a dry run);
4. ``gpu_matmul``: chunked bf16 matmul 16384^3 vs ``torch.matmul`` (goal >= 0.95x);
5. ``gpu_offload``: working set 3x the memory_limit, wall <= 1.05x max(compute, PCIe);
6. ``gpu_probe``: the public API's paths on the GPU (fused chains, Adam, LoRA, device-resident
   inputs, workspace growth over 5 runs, ...);
7. ``gpu_llama_layer``: a LLaMA-7B-shaped layer's prefill, seq 4096, vs torch with SDPA;
8. ``gpu_profile``: where the matmul's and the offload's time goes (``bench/gpu_profile.py``:
   the runtime against floors of plain torch calls, lane busy time, the GPU's idle share),
   its lines in the log and in the JSON, so a missed goal comes with its reasons;
9. ``cpu suite``: the whole CPU test suite on the GPU machine (``pytest -n 14``), capped at
   ``--suite-timeout`` seconds and by what is left of the budget (skipped in a dry run: that
   suite is ``make test``).

It ends with a one-screen summary (each step ok / FAIL / skipped with its key figure) and exits
1 when a step failed or ran out of time. Written to ``$OUT`` when set, else ``--out``
(default ``.bench-out/gpu-check``): ``gpu_check.log`` (every step's output), ``gpu_check.json``
(the environment and every step, with the benches' JSON records and the probes' rows),
``summary.txt``, and ``suite_failures.txt`` (each CPU-suite failure's traceback, written as
the test ends: ``bench/failure_log.py``).

    python bench/gpu_check.py                # on the GPU machine (make gpu-check)
    python bench/gpu_check.py --device cpu   # dry run: CPU devices, smoke sizes (DEV=cpu)
    python bench/gpu_check.py --prepare      # here: download the cp312 wheels into .whl

>>> [s.name for s in STEPS][:3]
['setup', 'environment', 'pytest -m gpu']
>>> pytest_counts("== 3 failed, 1235 passed, 2 skipped in 161.73s ==")
{'failed': 3, 'passed': 1235, 'skipped': 2}
>>> pytest_counts("4 skipped, 1060 deselected in 12.05s")
{'skipped': 4, 'deselected': 1060}
>>> failed_tests("[gw4] [ 12%] FAILED tests/a.py::test_x[a] \\nFAILED tests/a.py::test_x[a] - E")
['tests/a.py::test_x[a]']
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
WHEEL_DIR = ROOT / ".whl"

# distribution -> module: what the device image lacks (its package list:
# /work/.library/device/KINDS.md); everything else tensorql and its tests need is there
WHEELS = {"duckdb": "duckdb", "sqlglot": "sqlglot", "cotengra": "cotengra",
          "cotengrust": "cotengrust", "autoray": "autoray", "cachetools": "cachetools",
          "dask": "dask", "partd": "partd", "locket": "locket",
          "einsum-benchmark": "einsum_benchmark", "pooch": "pooch",
          "platformdirs": "platformdirs"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


# ---- running steps -----------------------------------------------------------------------
@dataclass
class StepResult:
    name: str
    status: str = "not run"  # ok | FAIL | skipped | TIMEOUT | NOT RUN
    seconds: float = 0.0
    key: str = ""
    command: list[str] = field(default_factory=list)
    rc: int | None = None
    record: object = None

    @property
    def failed(self) -> bool:
        return self.status not in ("ok", "skipped")


class Check:
    """The state of one gpu-check run: options, paths, the log, results so far."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = args.device
        self.dry = args.device == "cpu"
        self.out = Path(os.environ.get("OUT") or args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.parts = Path(tempfile.mkdtemp(prefix="tensorql-gpu-check-"))
        self.log_path = self.out / "gpu_check.log"
        self.log = self.log_path.open("w", buffering=1)
        self.start = time.monotonic()
        self.results: list[StepResult] = []
        self.environment: dict = {}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.site = Path(tempfile.gettempdir()) / "tensorql-gpu-site"
        self.shim = Path(tempfile.gettempdir()) / "tensorql-gpu-shim"
        self._set_path([])

    def _set_path(self, extra: list[Path]) -> None:
        keep = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        self.env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *map(str, extra), *keep])

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.start)

    def run(self, command: list[str], cap: float) -> tuple[int | None, str, float]:
        """Run ``command`` (output to the log) for at most ``cap`` seconds and what is left
        of the budget; returns (exit status or None on time-out, its output, seconds)."""
        timeout = max(1.0, min(cap, self.left() - 5))
        self.log.write(f"$ {' '.join(command)}   # cap {timeout:.0f} s\n")
        self.log.flush()
        offset = self.log.tell()
        t0 = time.monotonic()
        proc = subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=self.log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the step and the workers it started
            proc.wait()
            rc = None
            self.log.write(f"\n[gpu-check] killed after {timeout:.0f} s\n")
        seconds = time.monotonic() - t0
        self.log.flush()
        with self.log_path.open() as f:
            f.seek(offset)
            output = f.read()
        return rc, output, seconds

    def python(self, *args: str) -> list[str]:
        return [self.args.python, *args]

    def write_json(self) -> None:
        data = {"device": self.device, "dry_run": self.dry, "environment": self.environment,
                "budget_s": self.args.budget, "elapsed_s": round(time.monotonic() - self.start, 1),
                "ok": not any(r.failed for r in self.results),
                "steps": [vars(r) for r in self.results]}
        (self.out / "gpu_check.json").write_text(json.dumps(data, indent=1, default=str))


@dataclass(frozen=True)
class Step:
    """One step: ``run(check, result)`` fills ``result``; ``cap`` bounds its seconds."""

    name: str
    run: Callable[[Check, StepResult], None]
    cap: float


def pytest_counts(text: str) -> dict[str, int]:
    """The counts of pytest's last summary line in ``text`` (passed, failed, error, ...)."""
    words = r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?)"
    lines = [ln for ln in text.splitlines() if re.search(words + r".* in [\d.]+s", ln)]
    return {word: int(count) for count, word in re.findall(words, lines[-1])} if lines else {}


def failed_tests(text: str) -> list[str]:
    """The tests pytest reported failed or in error in ``text``: the ``-v`` lines of xdist
    workers as they end and the short summary's, each once."""
    return sorted({m.group(1) for m in re.finditer(r"(?:FAILED|ERROR) (\S+::\S+)", text)})


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


# ---- the steps ---------------------------------------------------------------------------
def _missing(check: Check, modules: list[str]) -> list[str]:
    code = ("import importlib.util, json, sys; print(json.dumps([m for m in sys.argv[1:] "
            "if importlib.util.find_spec(m) is None]))")
    done = subprocess.run(check.python("-c", code, *modules), env=check.env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    return json.loads(done.stdout) if done.returncode == 0 else list(modules)


def step_setup(check: Check, result: StepResult) -> None:
    extra: list[Path] = []
    if _missing(check, ["tensorql_kernels"]):  # a checkout that is not pip-installed
        check.shim.mkdir(parents=True, exist_ok=True)
        link = check.shim / "tensorql_kernels"
        if not link.exists():
            link.symlink_to(ROOT / "kernels", target_is_directory=True)
        extra.append(check.shim)
    check._set_path(extra + [check.site])
    missing = _missing(check, sorted(set(WHEELS.values())))
    installed: list[str] = []
    if missing:
        wheels = [w for w in sorted(WHEEL_DIR.glob("*.whl"))
                  if _wheel_module(w.name) in missing]
        if wheels:
            rc, out, _ = check.run(check.python(
                "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                "--no-cache-dir", "--upgrade", "--target", str(check.site),
                *map(str, wheels)), 120)
            result.command = ["pip install --no-index --target", str(check.site)]
            installed = [w.name for w in wheels] if rc == 0 else []
        missing = _missing(check, sorted(set(WHEELS.values())) + ["tensorql",
                                                                  "tensorql_kernels"])
    result.record = {"installed": installed, "missing": missing,
                     "pythonpath": check.env["PYTHONPATH"]}
    if missing:
        result.status = "FAIL"
        result.key = (f"not importable: {', '.join(missing)} (no wheel in .whl: run "
                      "`make gpu-wheels` here and carry .whl)")
        return
    # find_spec only finds: import each (a binary wheel of the wrong ABI fails here)
    modules = ["tensorql", "tensorql_kernels", *sorted(set(WHEELS.values()))]
    rc, out, _ = check.run(check.python("-c", "import importlib, sys\nfor m in sys.argv[1:]: "
                                        "importlib.import_module(m)", *modules), 120)
    if rc != 0:
        result.status, result.key = "FAIL", f"import failed: {_tail(out, 1)[:150]}"
    else:
        result.status = "ok"
        result.key = (f"installed {len(installed)} wheel(s) from .whl" if installed
                      else "every module importable; nothing installed")


def _wheel_module(filename: str) -> str:
    dist = filename.split("-")[0].lower().replace("_", "-")
    return WHEELS.get(dist, dist.replace("-", "_"))


def step_environment(check: Check, result: StepResult) -> None:
    code = ("import json, sys; sys.path.insert(0, 'bench'); from gpu_common import environment; "
            "print('ENV=' + json.dumps(environment()))")
    rc, out, _ = check.run(check.python("-c", code), 60)
    lines = [ln for ln in out.splitlines() if ln.startswith("ENV=")]
    if rc != 0 or not lines:
        result.status, result.key = "FAIL", _tail(out, 3)
        return
    env = json.loads(lines[-1][4:])
    check.environment = env
    result.record = env
    result.status = "ok"
    result.key = (f"GPU {env.get('gpu')} (driver {env.get('driver')}), torch {env['torch']}, "
                  f"CUDA {env['cuda']}, Python {env['python']}, commit {env['commit']}")
    if not check.dry and not env.get("gpu"):
        result.status, result.key = "FAIL", "no CUDA device visible to torch: " + result.key


def step_pytest_gpu(check: Check, result: StepResult) -> None:
    if check.dry:
        result.status, result.key = "skipped", "dry run: no CUDA device"
        return
    result.command = check.python("-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-q",
                                  "--tb=short", "tests")
    rc, out, _ = check.run(result.command, 150)
    _pytest_result(result, rc, out)


def _pytest_result(result: StepResult, rc: int | None, out: str) -> None:
    counts = pytest_counts(out)
    failed = failed_tests(out)
    result.rc = rc
    result.record = {"counts": counts, "failed": failed}
    summary = ", ".join(f"{v} {k}" for k, v in counts.items()) or "no summary line"
    if rc is None:
        result.status, result.key = "TIMEOUT", (f"stopped at its cap ({summary} so far)" + (
            f"; failed so far: {', '.join(failed)[:150]}" if failed else ""))
    elif rc == 0 and counts.get("passed"):
        result.status, result.key = "ok", summary
    else:
        result.status = "FAIL"
        result.key = summary + (f"; {len(failed)} failed, first: {failed[0][:90]}" if failed
                                else f" (exit {rc})")


def _bench(script: str, key: Callable[[dict], str]) -> Callable[[Check, StepResult], None]:
    def run(check: Check, result: StepResult) -> None:
        part = check.parts / f"{script}.json"
        result.command = check.python(f"bench/{script}.py", "--device", check.device,
                                      "--json", str(part))
        rc, out, _ = check.run(result.command, check.args.caps.get(script, 150))
        result.rc = rc
        record = json.loads(part.read_text()) if part.is_file() else None
        result.record = record
        if rc is None:
            result.status, result.key = "TIMEOUT", "stopped at its cap"
            return
        if record is None:
            result.status, result.key = "FAIL", f"exit {rc}, no record: {_tail(out, 1)[:100]}"
            return
        result.status = "ok" if rc == 0 else "FAIL"
        try:
            result.key = key(record)
        except (KeyError, TypeError, ValueError) as exc:  # a record without the figure
            result.key = f"exit {rc}; figure missing ({exc!r})"
    return run


def _matmul_key(r: dict) -> str:
    f = r["figures"]
    return (f"runtime/torch.matmul throughput {f['runtime_over_torch_throughput']:.3f} "
            f"(goal >= 0.95; {f['runtime_tflops']:.3g} vs {f['torch_tflops']:.3g} TFLOP/s), "
            f"rel err {f['runtime_rel_error']:.1e}")


def _llama_key(r: dict) -> str:
    f = r["figures"]
    return (f"tensorql {f['tensorql_ms']:.1f} ms vs torch SDPA {f['torch_sdpa_ms']:.1f} ms "
            f"({f['tensorql_over_torch_time']:.2f}x), logits rel err "
            f"{f['logits_rel_error']:.1e}")


def _offload_key(r: dict) -> str:
    f = r["figures"]
    return (f"wall/bound {f['runtime_over_bound']:.3f} (goal <= 1.05; bound "
            f"{f['lower_bound_ms']:.0f} ms at H2D {f['h2d_bandwidth_gbs']:.1f} GB/s), peak/limit "
            f"{f['runtime_peak_device_bytes'] / r['config']['memory_limit_bytes']:.2f}, "
            f"baseline/bound {f['baseline_over_bound']:.2f}")


def step_probe(check: Check, result: StepResult) -> None:
    part = check.parts / "gpu_probe.json"
    result.command = check.python("bench/gpu_probe.py", "--device", check.device, "--json",
                                  str(part))
    rc, out, _ = check.run(result.command, 150)
    result.rc = rc
    rows = json.loads(part.read_text()) if part.is_file() else None
    result.record = rows
    if rc is None:
        result.status, result.key = "TIMEOUT", "stopped at its cap"
    elif not rows:
        result.status, result.key = "FAIL", f"exit {rc}, no rows: {_tail(out, 1)[:100]}"
    else:
        bad = [r["probe"] for r in rows if not r["ok"]]
        result.status = "ok" if rc == 0 and not bad else "FAIL"
        result.key = f"{len(rows) - len(bad)}/{len(rows)} probes ok" + (
            f"; FAIL: {', '.join(bad)}" if bad else "")


def step_profile(check: Check, result: StepResult) -> None:
    result.command = check.python("bench/gpu_profile.py", "--device", check.device)
    rc, out, _ = check.run(result.command, 100)
    result.rc = rc
    lines = [ln for ln in out.splitlines() if ln.lstrip().startswith(("==", "tile", "compute"))]
    result.record = {"lines": lines}
    if rc is None:
        result.status, result.key = "TIMEOUT", f"stopped at its cap ({len(lines)} lines)"
    elif rc != 0:
        result.status, result.key = "FAIL", f"exit {rc}: {_tail(out, 1)[:120]}"
    else:
        result.status = "ok"
        result.key = f"{len(lines)} lines of figures (in the log and gpu_check.json)"


def step_suite(check: Check, result: StepResult) -> None:
    if check.dry or check.args.no_suite:
        result.status = "skipped"
        result.key = "dry run: the CPU suite is `make test`" if check.dry else "--no-suite"
        return
    # -m "not gpu": those ran in their own step (beside 14 busy workers a timing test of the
    # GPU's launch queue can starve); -v: each test's outcome as it ends, so a suite stopped at
    # its cap still names its failures
    # -p failure_log: each failure's traceback into suite_failures.txt as the test ends, so a
    # suite stopped at its cap says why as well as what (bench/failure_log.py)
    failures = check.out / "suite_failures.txt"
    failures.unlink(missing_ok=True)
    result.command = check.python("-m", "pytest", "-n", str(check.args.suite_workers), "-v",
                                  "-m", "not gpu", "--maxfail=100", "-p", "no:cacheprovider",
                                  "-p", "no:benchmark", "-p", "failure_log", "--tb=short")
    env = check.env
    check.env = {**env, "TENSORQL_FAILURE_LOG": str(failures),
                 "PYTHONPATH": env["PYTHONPATH"] + os.pathsep + str(BENCH)}
    try:
        rc, out, _ = check.run(result.command, check.args.suite_timeout)
    finally:
        check.env = env
    _pytest_result(result, rc, out)
    if failures.is_file():
        result.record["failure_log"] = str(failures)
        check.log.write(f"\n[gpu-check] failures as they ended ({failures}):\n"
                        f"{failures.read_text()}\n")


STEPS = (
    Step("setup", step_setup, 150),
    Step("environment", step_environment, 60),
    Step("pytest -m gpu", step_pytest_gpu, 150),
    Step("gpu_matmul", _bench("gpu_matmul", _matmul_key), 120),
    Step("gpu_offload", _bench("gpu_offload", _offload_key), 150),
    Step("gpu_probe", step_probe, 150),
    Step("gpu_llama_layer", _bench("gpu_llama_layer", _llama_key), 180),
    Step("gpu_profile", step_profile, 100),
    Step("cpu suite", step_suite, 600),
)


def summary(check: Check) -> str:
    failed = [r for r in check.results if r.failed]
    env = check.environment
    lines = [f"gpu-check {'(dry run, device cpu) ' if check.dry else ''}"
             f"{'FAILED' if failed else 'passed'} in {time.monotonic() - check.start:.0f} s "
             f"(budget {check.args.budget:.0f} s)",
             f"  GPU {env.get('gpu')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
             f"Python {env.get('python')}, commit {env.get('commit')}, {env.get('date')}"]
    for r in check.results:
        lines.append(f"  {r.status:<8} {r.name:<16} {r.seconds:6.1f} s  {r.key}"[:220])
    lines.append(f"  written: {check.out / 'gpu_check.json'}, {check.log_path}")
    return "\n".join(lines)


def run_all(args: argparse.Namespace) -> int:
    check = Check(args)
    print(f"[gpu-check] device {check.device}; output in {check.out}", flush=True)
    for step in STEPS:
        result = StepResult(step.name)
        check.results.append(result)
        if step.name in args.skip:
            result.status, result.key = "skipped", "--skip"
            continue
        if check.left() < 20:
            result.status, result.key = "NOT RUN", "out of time (--budget)"
            continue
        check.log.write(f"\n===== {step.name} =====\n")
        t0 = time.monotonic()
        try:
            step.run(check, result)
        except Exception as exc:  # noqa: BLE001 - one step's crash must not hide the rest
            result.status, result.key = "FAIL", f"{type(exc).__name__}: {exc}"[:200]
        result.seconds = round(time.monotonic() - t0, 1)
        print(f"[gpu-check] {result.status:<8} {step.name} ({result.seconds:.1f} s) "
              f"{result.key}", flush=True)
        if result.failed:
            with check.log_path.open() as f:
                section = f.read().rsplit(f"===== {step.name} =====", 1)[-1]
            print(_tail(section, 15), flush=True)
        check.write_json()
    shutil.rmtree(check.parts, ignore_errors=True)  # every record is in gpu_check.json
    text = summary(check)
    (check.out / "summary.txt").write_text(text + "\n")
    check.log.write("\n" + text + "\n")
    check.log.close()
    print("\n" + text, flush=True)
    return 1 if any(r.failed for r in check.results) else 0


# ---- preparing the carry (here, with the registry at hand) -------------------------------
def prepare(args: argparse.Namespace) -> int:
    """Download the cp312 manylinux wheels of :data:`WHEELS` missing from ``.whl`` (the
    versions installed here) and write ``.whl/COMMIT``."""
    WHEEL_DIR.mkdir(exist_ok=True)
    have = {_wheel_module(w.name) for w in WHEEL_DIR.glob("*.whl")}
    for dist, module in WHEELS.items():
        if module in have:
            continue
        version = importlib.metadata.version(dist)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp",
               *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(WHEEL_DIR),
               f"{dist}=={version}"]
        print(" ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode != 0:
            print(f"gpu-check --prepare: no cp312 wheel of {dist}=={version}", file=sys.stderr)
            return 1
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True)
    if head.returncode == 0:
        (WHEEL_DIR / "COMMIT").write_text(head.stdout.strip() + "\n")
    total = sum(w.stat().st_size for w in WHEEL_DIR.glob("*.whl"))
    print(f"{WHEEL_DIR}: {len(list(WHEEL_DIR.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB "
          "(carry it: run(..., carry=['.whl']))")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default=os.environ.get("DEV") or "cuda")
    p.add_argument("--out", default=str(ROOT / ".bench-out" / "gpu-check"),
                   help="where logs and JSON go when $OUT is not set")
    p.add_argument("--budget", type=float, default=500.0,
                   help="seconds for every step together (the suite gets what is left)")
    p.add_argument("--suite-timeout", type=float, default=280.0)
    p.add_argument("--suite-workers", type=int, default=14)
    p.add_argument("--no-suite", action="store_true")
    p.add_argument("--skip", type=lambda text: {n.strip() for n in text.split(",")},
                   default=set(), help="steps not to run, by name (e.g. 'gpu_profile'): a "
                   "rerun inside what is left of a lease")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--prepare", action="store_true",
                   help="download the wheels the device image lacks into .whl, then exit")
    args = p.parse_args(argv)
    unknown = sorted(args.skip - {s.name for s in STEPS})
    if unknown:
        p.error(f"--skip: no step named {', '.join(map(repr, unknown))}; the steps are "
                f"{', '.join(repr(s.name) for s in STEPS)}")
    args.caps = {s.name: s.cap for s in STEPS}
    return prepare(args) if args.prepare else run_all(args)


if __name__ == "__main__":
    sys.exit(main())
