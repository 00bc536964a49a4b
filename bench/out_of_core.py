"""Out-of-core bench: ``(A @ B) @ C`` chains whose intermediate is several times the host budget.

    python bench/out_of_core.py [--n 16384] [--k 1024] [--tile 2048] [--budget 384MiB]
                                [--workloads held,chain] [--threads N] [--repeat 3] [--smoke]
                                [--baseline-root DIR] [--spill-micro]

``A`` (n x k), ``B`` (k x n) and ``C`` (n x k) are stored in a DuckDB file; ``Y = A @ B`` is
an n x n intermediate: with the defaults the inputs and the intermediate are 1.2 GiB against a
384 MiB budget (>= 3x). Three workloads:

* ``spill`` -- ``exp(Y - max(Y)) @ C``: no tile of ``Y`` can be used before the maximum of
  all of it, so all of ``Y`` is live at once in any order: what does not fit goes to DuckDB
  (the spill tier) and comes back prefetched. The spill tier's case.
* ``held`` -- ``(Y / max(Y)) @ C``: the same wait for the maximum as written, but the rule
  ``scalar_out_of_sum`` computes ``(Y @ C) / max(Y)``: each tile of ``Y`` feeds the maximum
  and its partial product while resident, and nothing spills (before the rule, all of ``Y``
  went through DuckDB: 944 MiB at the defaults).
* ``chain`` -- ``(A @ B) @ C``: under a binding budget the memory plan orders tasks depth
  first, so each tile of ``Y`` is used by its partial product with ``C`` while resident and
  nothing spills (dask orders its tasks by the same rule and frees each block once used).

Contenders, each run in a process of its own, in alternating order, ``--repeat`` times:

* ``tq-budget`` -- tensorql with ``process_memory_limit=--budget`` and a device budget
  (``--memory-limit``) of 3/8 of it (1/8 serialised the kernels: one task's chunks filled it):
  chunks beyond the host tier's share go to DuckDB (the spill tier) and come back
  prefetched;
* ``tq-unlimited`` -- tensorql with no memory limit (everything in RAM);
* ``dask`` -- ``dask.array`` over ``np.memmap`` copies of the inputs, the threaded scheduler
  with as many workers as tensorql's threads (one BLAS thread each).

Each child warms up (reads a slice of every input and runs the chain on a corner of it: the
libraries' one-off allocations), resets its peak RSS (``/proc/self/clear_refs``), then runs
once; it reports the time, the growth of its peak RSS over that warmed-up baseline (the
figure the budget bounds; the absolute peak is printed too) and, for tensorql, the bytes of
each tier. Every result is checked against numpy on the memmaps (64 sampled rows in full,
and the whole result times a random vector; ``held``'s result times max(Y), ``spill``'s
against ``exp(Y - max(Y))`` made a block of rows at a time, from the memmaps in float64).

Goals, for each workload: ``tq-budget``'s peak RSS growth <= budget + 25 %, and its median
time <= 1.5x ``tq-unlimited``'s. Prints the figures with their spread (min..max) and writes a JSON
record (figures, samples, commit, CPU, cores, torch version, date) under ``.bench-out/``.
Exits 1 on a missed goal or a wrong result; ``--smoke`` (a small size, one repeat, for
tests/test_benches.py) checks the results only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _parse_bytes(text: str) -> int:
    sys.path.insert(0, str(ROOT))
    from tensorql.options import parse_bytes

    return int(parse_bytes(text))


# -- setup: the inputs, in a DuckDB file and as .npy files for the memmaps --------------------
def setup(work: Path, n: int, k: int, tile: int, seed: int = 0) -> None:
    import tensorql as tq

    rng = np.random.default_rng(seed)
    shapes = {"A": (n, k), "B": (k, n), "C": (n, k)}
    tiles = {"A": (tile, k), "B": (k, tile), "C": (tile, k)}
    with tq.connect(str(work / "inputs.duckdb"), devices="cpu") as db:
        for name, shape in shapes.items():
            mm = np.lib.format.open_memmap(work / f"{name}.npy", mode="w+", dtype=np.float32,
                                           shape=shape)
            for lo in range(0, shape[0], 1024):  # bounded memory
                hi = min(shape[0], lo + 1024)
                mm[lo:hi] = rng.standard_normal((hi - lo, shape[1]), dtype=np.float32)
            mm.flush()
            db.from_numpy(name, mm, tile=tiles[name])
            del mm


# -- a child: one contender, one run ----------------------------------------------------------
def child(kind: str, work: Path, tile: int, threads: int, budget: int, limit: int,
          workload: str = "held") -> dict:
    out = work / f"result-{kind}.npy"
    chain = WORKLOADS[workload]
    if kind == "dask":
        import dask
        import dask.array as da

        arrays = [np.load(work / f"{name}.npy", mmap_mode="r") for name in "ABC"]
        a, b, c = (da.from_array(arrays[0], chunks=(tile, -1)),
                   da.from_array(arrays[1], chunks=(-1, tile)),
                   da.from_array(arrays[2], chunks=(tile, -1)))
        with dask.config.set(scheduler="threads", num_workers=threads):
            chain(a[:tile], b[:, :tile], c[:tile]).compute()  # warm-up
            _reset_peak()
            base = _status("VmRSS")
            start = time.perf_counter()
            result = chain(a, b, c).compute()
            seconds = time.perf_counter() - start
        figures: dict = {}
    else:
        import tensorql as tq

        limits = (dict(memory_limit=limit, process_memory_limit=budget)
                  if kind == "tq-budget" else {})
        db = tq.connect(str(work / "inputs.duckdb"), devices="cpu", workers=threads,
                        read_only=False, **limits)
        A, B, C = db.tensor("A"), db.tensor("B"), db.tensor("C")
        chain(A[:tile, :], B[:, :tile], C[:tile, :]).numpy()  # warm-up
        query = chain(A, B, C).compile()
        _reset_peak()
        base = _status("VmRSS")
        start = time.perf_counter()
        run = query.run(dense=True)
        result = run.dense().numpy()
        seconds = time.perf_counter() - start
        stats = run.stats
        figures = {key: getattr(stats, key, None) for key in (
            "host_budget", "host_peak_bytes", "spill_written_bytes", "spill_read_bytes",
            "spill_chunks", "spill_reads_ahead", "spill_reads_on_demand")}
        figures["device_peak_bytes"] = stats.peak_live_bytes
        # where the time goes, from the run's own records (not the machine's load): seconds
        # of kernels (every task but the store's reads) against the run's wall time, i.e.
        # how many kernels ran at once on average, and for a budgeted run the share of its
        # time with at least one kernel running (the compute lane's busy union)
        scans = {step.id for step in query.physical.steps if not step.tasks
                 or all(not task.inputs for task in step.tasks)}
        figures["kernel_s"] = sum(st.busy_s for sid, st in stats.steps.items()
                                  if sid not in scans)
        figures["run_wall_s"] = stats.wall_s
        devices = getattr(stats, "devices", None)
        figures["kernel_busy_s"] = devices[0].busy_s if devices else None
        db.close()
    peak = _status("VmHWM")
    np.save(out, result)
    code = sys.modules["tensorql"].__file__ if "tensorql" in sys.modules else None
    return {"kind": kind, "code": code, "seconds": seconds, "growth": peak - base,
            "peak_rss": peak,
            "baseline_rss": base, **figures}


def held(a, b, c):
    """(Y / max(Y)) @ C for Y = A @ B: rewritten as (Y @ C) / max(Y), it streams.

    As written no tile of ``Y`` is usable before its maximum, which needs all of ``Y``; the
    rule ``scalar_out_of_sum`` moves the scalar past the product."""
    y = a @ b
    return (y / y.max()) @ c


def spill(a, b, c):
    """exp(Y - max(Y)) @ C for Y = A @ B: the intermediate is live whole in any order.

    No tile of ``Y`` is usable before its maximum, which needs all of ``Y``, and no rule
    moves a scalar out of ``exp``: the spill tier's case."""
    y = a @ b
    shifted = y - y.max()
    # tensorql's tensors have .exp(); dask's arrays take numpy's ufunc
    return (shifted.exp() if hasattr(shifted, "exp") else np.exp(shifted)) @ c


def streamed(a, b, c):
    """(A @ B) @ C: each tile of A @ B can be used as soon as it is made (it streams)."""
    return (a @ b) @ c


WORKLOADS = {"spill": spill, "held": held, "chain": streamed}

BASE = "tq-budget-base"  # tq-budget run from another checkout (--baseline-root)


def run_child(kind: str, work: Path, tile: int, threads: int, budget: int,
              limit: int, base_root: Path | None = None, workload: str = "held") -> dict:
    root, script = ROOT, __file__
    if kind == BASE:  # this script's child (its workloads), the other checkout's tensorql
        root, kind = base_root, "tq-budget"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / ".shim"),
                                                        os.environ.get("PYTHONPATH", "")])}
    if kind == "dask":  # dask's workers are the threads: one BLAS thread each
        env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    done = subprocess.run([sys.executable, script, "--child", kind, "--work", str(work),
                           "--tile", str(tile), "--threads", str(threads),
                           "--budget-bytes", str(budget), "--limit-bytes", str(limit),
                           "--workloads", workload],
                          capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{done.stderr[-4000:]}")
    sample = json.loads(done.stdout.strip().splitlines()[-1])
    code = sample.get("code")
    if code is not None and not Path(code).resolve().is_relative_to(Path(root).resolve()):
        raise RuntimeError(f"{kind} ran {code}, not the code of {root}")
    return sample


# -- the check: sampled rows in full, and the whole result against a random vector -----------
def reference_max(work: Path, rows: int = 1024) -> float:
    """max(A @ B) from the memmaps, a block of rows at a time (float64)."""
    a, b = (np.load(work / f"{name}.npy", mmap_mode="r") for name in "AB")
    b64 = np.asarray(b, np.float64)
    return float(max((np.asarray(a[lo:lo + rows], np.float64) @ b64).max()
                     for lo in range(0, a.shape[0], rows)))


def references(work: Path, workload: str, peak: float, seed: int = 1, block: int = 1024
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What ``check`` compares a workload's result with: sampled rows, a random vector ``x``,
    and the rows and the whole result times ``x`` as numpy computes them in float64
    (``held``'s as ``chain``'s: ``check`` scales its result by ``peak``, max(Y))."""
    a, b, c = (np.load(work / f"{name}.npy", mmap_mode="r") for name in "ABC")
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(a.shape[0], size=min(64, a.shape[0]), replace=False))
    x = rng.standard_normal(c.shape[1])
    b64 = np.asarray(b, np.float64)
    if workload == "spill":
        want_rows = np.exp(np.asarray(a[rows], np.float64) @ b64 - peak) @ c
        cx = np.asarray(c, np.float64) @ x
        want_vec = np.concatenate([np.exp(np.asarray(a[lo:lo + block], np.float64) @ b64
                                          - peak) @ cx for lo in range(0, a.shape[0], block)])
    else:
        want_rows = (np.asarray(a[rows], np.float64) @ b64) @ c
        want_vec = np.asarray(a, np.float64) @ (b64 @ (c @ x))
    return rows, x, want_rows, want_vec


def check(work: Path, kind: str, refs: tuple, scale: float = 1.0) -> float:
    """The largest error relative to the result's scale; ``scale`` multiplies the result
    first (``held``'s max(Y), so it compares against ``(A @ B) @ C``)."""
    rows, x, want_rows, want_vec = refs
    got = np.load(work / f"result-{kind}.npy", mmap_mode="r") * scale
    err_rows = np.abs(got[rows] - want_rows).max() / np.abs(want_rows).max()
    err_vec = np.abs(got @ x - want_vec).max() / np.abs(want_vec).max()
    return float(max(err_rows, err_vec))


# -- the spill tier alone: SpillPages write + read MiB/s, in a fresh process per checkout ------
SPILL_MICRO = """
import json, sys, time, torch
import tensorql
from tensorql.storage.spill import SpillSpace
assert tensorql.__file__.startswith(sys.argv[3]), tensorql.__file__  # that checkout's code
nbytes, total = int(sys.argv[1]), int(sys.argv[2])
gen = torch.Generator().manual_seed(0)
chunks = [torch.randn(nbytes // 4, generator=gen) for _ in range(4)]
out = []
for rep in range(2):  # the first pass pays the spill database's start: the second is the figure
    space = SpillSpace(memory_bytes=32 << 20)
    pages = space.open_run("micro")
    t, c = time.perf_counter(), time.process_time()
    ids = [pages.write(chunks[i % 4]) for i in range(total // nbytes)]
    w = (time.perf_counter() - t, time.process_time() - c)
    t, c = time.perf_counter(), time.process_time()
    discard = getattr(pages, "discard", None)  # as the host tier does at a last read
    for i in ids:
        got = pages.read(i, (nbytes // 4,), "float32")
        if discard is not None:
            discard(i)
    r = (time.perf_counter() - t, time.process_time() - c)
    assert torch.equal(got, chunks[ids[-1] % 4])
    pages.close(); space.close()
    out.append(dict(write=total / w[0], write_cpu=w[1] / total, read=total / r[0],
                    read_cpu=r[1] / total))
print(json.dumps(out[-1]))
"""


def spill_micro(roots: list[Path], repeat: int, nbytes: int = 4 * MiB,
                total: int = 256 * MiB) -> None:
    """Write and read ``total`` bytes of ``nbytes`` chunks through the DuckDB tier (a spill
    database of 32 MiB of memory, the rest in its temporary files) with each checkout's code,
    alternating; print MiB/s and CPU ms per MiB, median (min..max)."""
    samples: dict[Path, list[dict]] = {root: [] for root in roots}
    for r in range(repeat):
        for root in (roots if r % 2 == 0 else roots[::-1]):
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / ".shim")])}
            done = subprocess.run([sys.executable, "-c", SPILL_MICRO, str(nbytes), str(total),
                                   str(root)],
                                  capture_output=True, text=True, env=env, timeout=600,
                                  cwd=root, check=True)
            samples[root].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"DuckDB tier alone: {total // MiB} MiB in chunks of {nbytes // MiB} MiB, "
          f"{repeat} repeat(s)")
    for root, got in samples.items():
        print(f"  {root}: write {_spread([g['write'] / MiB for g in got])} MiB/s "
              f"({_spread([g['write_cpu'] * 1e3 * MiB for g in got])} CPU ms/MiB), read "
              f"{_spread([g['read'] / MiB for g in got])} MiB/s "
              f"({_spread([g['read_cpu'] * 1e3 * MiB for g in got])} CPU ms/MiB)")


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} ({min(values):.3g}..{max(values):.3g})"


def _environment() -> dict:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = ""
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)
    except OSError:
        pass
    return {"commit": commit, "cpu": model, "cores": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def report(workload: str, kinds: list[str], samples: dict[str, list[dict]],
           errors: dict[str, float], budget: int, base_root: Path | None) -> dict:
    """Print one workload's table, tiers and goals; its record for the JSON."""
    print(f"-- {workload}: {WORKLOADS[workload].__doc__.splitlines()[0]}")
    print(f"{'contender':<13} {'time s, median (min..max)':<28} {'peak RSS growth MiB':<26} "
          f"{'abs peak MiB':>12}  max rel. error")
    for kind in kinds:
        times = [s["seconds"] for s in samples[kind]]
        growth = [s["growth"] / MiB for s in samples[kind]]
        peak = max(s["peak_rss"] for s in samples[kind]) / MiB
        print(f"{kind:<13} {_spread(times):<28} {_spread(growth):<26} {peak:>12.0f}  "
              f"{errors[kind]:.2e}")
    last = samples["tq-budget"][-1]
    print(f"tq-budget tiers: host memory peak {last['host_peak_bytes'] / MiB:.0f} MiB of "
          f"{(last['host_budget'] or 0) / MiB:.0f} MiB, DuckDB "
          f"{last['spill_written_bytes'] / MiB:.0f} MiB spilled in {last['spill_chunks']} "
          f"chunk(s), {last['spill_read_bytes'] / MiB:.0f} MiB reloaded "
          f"({last['spill_reads_ahead']} read(s) ahead of use, "
          f"{last['spill_reads_on_demand']} on demand)")
    for kind in ("tq-budget", "tq-unlimited"):
        runs = [s for s in samples.get(kind, ()) if s.get("kernel_s") and s.get("run_wall_s")]
        if runs:
            mean = [s["kernel_s"] / s["run_wall_s"] for s in runs]
            busy = [s["kernel_busy_s"] / s["run_wall_s"] for s in runs
                    if s.get("kernel_busy_s")]
            print(f"{kind} kernels: {_spread([s['kernel_s'] for s in runs])} s of kernel time, "
                  f"{_spread(mean)} running at once on average"
                  + (f", at least one running {_spread([100 * b for b in busy])} % of the "
                     "time" if busy else ""))
    median = {kind: statistics.median(s["seconds"] for s in samples[kind]) for kind in kinds}
    worst_growth = max(s["growth"] for s in samples["tq-budget"])
    ratio = median["tq-budget"] / median["tq-unlimited"]
    wrong = [kind for kind, err in errors.items() if not err < 1e-3]
    goals = {
        "peak RSS growth <= budget + 25%": worst_growth <= 1.25 * budget,
        "time <= 1.5x in-memory": ratio <= 1.5,
        "results match numpy": not wrong,
    }
    missed = [goal for goal, ok in goals.items() if not ok]
    versus_dask = (f"; {median['tq-budget'] / median['dask']:.2f}x dask's time"
                   if "dask" in median else "")
    if BASE in median:
        print(f"{BASE} ({base_root}): time {median[BASE] / median['tq-unlimited']:.2f}x the "
              f"in-memory run; tq-budget {median['tq-budget'] / median[BASE]:.2f}x its time")
    print(f"{workload} goals: tq-budget peak RSS growth {worst_growth / MiB:.0f} MiB vs budget "
          f"+ 25% {1.25 * budget / MiB:.0f} MiB; time {ratio:.2f}x the in-memory run (<= 1.5x)"
          f"{versus_dask} -> {'met' if not missed else 'MISSED: ' + ', '.join(missed)}")
    return {"samples": samples, "errors": errors, "median_seconds": median, "goals": goals,
            "wrong": wrong}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--tile", type=int, default=2048)
    parser.add_argument("--budget", default="384MiB", help="tensorql's process_memory_limit")
    parser.add_argument("--memory-limit", help="tensorql's device budget (default: 3/8 of "
                        "--budget)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--smoke", action="store_true",
                        help="a small size, one repeat: results checked, goals not")
    parser.add_argument("--skip-dask", action="store_true")
    parser.add_argument("--workloads", default="spill,held,chain",
                        help="comma-separated, of: spill (the intermediate live whole: the "
                        "spill tier's case), held (streams once its scalar divisor leaves "
                        "the product), chain (streams under the memory-aware order)")
    parser.add_argument("--baseline-root", help="another checkout (e.g. main's): its "
                        "tq-budget runs too, as tq-budget-base, alternating with the others")
    parser.add_argument("--work", help="folder for the inputs (default: a temporary one)")
    parser.add_argument("--spill-micro", action="store_true", help="only the DuckDB tier: "
                        "write + read MiB/s (and of --baseline-root's code), --repeat times")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--budget-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--limit-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, Path(args.work), args.tile, args.threads,
                               args.budget_bytes, args.limit_bytes, args.workloads)))
        return 0
    if args.spill_micro:
        spill_micro([ROOT] + ([Path(args.baseline_root).resolve()] if args.baseline_root
                              else []), args.repeat)
        return 0
    if args.smoke:
        args.n, args.k, args.tile, args.budget, args.repeat = 3072, 64, 512, "48MiB", 1
    budget = _parse_bytes(args.budget)
    limit = _parse_bytes(args.memory_limit) if args.memory_limit else budget * 3 // 8
    n, k = args.n, args.k
    total = (3 * n * k + n * n) * 4
    print(f"out-of-core (A @ B) @ C: A {n}x{k}, B {k}x{n}, C {n}x{k} float32, tile {args.tile}; "
          f"inputs + intermediate {total / MiB:.0f} MiB = {total / budget:.1f}x the budget of "
          f"{budget / MiB:.0f} MiB (device budget {limit / MiB:.0f} MiB); {args.threads} "
          f"thread(s), {args.repeat} repeat(s)")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="tq-ooc-",
                                                                   dir=ROOT / ".bench-out"
                                                                   if (ROOT / ".bench-out")
                                                                   .is_dir() else None))
    work.mkdir(parents=True, exist_ok=True)
    kinds = ["tq-budget", "tq-unlimited"] + ([] if args.skip_dask else ["dask"])
    base_root = Path(args.baseline_root).resolve() if args.baseline_root else None
    if base_root is not None:
        kinds.insert(1, BASE)
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}: expected some of {sorted(WORKLOADS)}")
    results: dict[str, dict] = {}
    try:
        setup(work, n, k, args.tile)
        peak = reference_max(work) if {"held", "spill"} & set(workloads) else 1.0
        scale = {"held": peak, "spill": 1.0, "chain": 1.0}
        for workload in workloads:
            refs = references(work, workload, peak)
            samples: dict[str, list[dict]] = {kind: [] for kind in kinds}
            errors: dict[str, float] = {}
            for r in range(args.repeat):
                for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                    sample = run_child(kind, work, args.tile, args.threads, budget, limit,
                                       base_root, workload)
                    result = "tq-budget" if kind == BASE else kind
                    errors[kind] = max(errors.get(kind, 0.0),
                                       check(work, result, refs, scale[workload]))
                    samples[kind].append(sample)
            results[workload] = report(workload, kinds, samples, errors, budget, base_root)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    goals = {f"{workload}: {goal}": ok for workload, got in results.items()
             for goal, ok in got["goals"].items()}
    wrong = [f"{workload}: {kind}" for workload, got in results.items()
             for kind in got["wrong"]]
    missed = [goal for goal, ok in goals.items() if not ok]
    print(f"goals: {'met' if not missed else 'MISSED: ' + '; '.join(missed)}")
    record = {"bench": "out_of_core", "args": vars(args), "budget_bytes": budget,
              "total_bytes": total, "workloads": results, "goals": goals, **_environment()}
    out_dir = ROOT / ".bench-out"
    out_dir.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"out_of_core-{'smoke-' if args.smoke else ''}{stamp}.json"
    path.write_text(json.dumps(record, indent=1, default=str))
    print(f"figures written to {path}")
    if wrong:
        print(f"WRONG RESULT: {', '.join(wrong)}")
        return 1
    if args.smoke:
        return 0
    return 0 if all(goals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
