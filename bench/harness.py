"""The method every bench in ``bench/`` measures with (issue 30).

Rules, stated once and recorded in every bench's JSON (``METHOD``):

* **Isolation** (``--isolate``, the default for published figures): each contender runs in a
  process of its own, a persistent worker started from a *factory* (``"module:function"``
  plus keyword arguments) that builds the contender's state and returns the callable to time.
  The worker never imports tensorql unless its factory does: importing tensorql retunes glibc's
  allocator for the whole process (``tensorql/__init__.py``, ``exec/host_malloc.py``), so a
  baseline in tensorql's process would run under non-default settings. ``--no-isolate`` runs
  every factory in the bench's own process (quicker; not for published figures).
* **Threads**: every contender gets the same explicit thread count: ``torch.set_num_threads``
  and ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` / ``OPENBLAS_NUM_THREADS`` in its environment
  (``thread_env``); a contender that runs its own pool (dask) caps BLAS at one thread per worker
  and takes the count as its number of workers.
* **Warm-up**: each contender's first ``warmup`` calls (default 1) are untimed for the median
  but the first one's time is kept as the **cold** figure (``first_s``): the plan, the caches,
  packed weights, the allocator's pools are all built on that call.
* **Settling**: isolated calls start 20 ms after the previous one ends (off the clock), so
  that the previous contender's OpenMP threads, which spin a while after a parallel region,
  have gone to sleep and do not take the next one's cores.
* **Repeats and order**: at least 7 timed calls of each contender (``MIN_REPEATS``), in rounds
  whose order is a seeded random permutation (``order="random"``) or A B B A (``"abba"``), so
  that a drifting host weighs on every contender alike; median, quartiles (IQR) and min-max
  are reported.
* **Record**: one JSON file per bench run (``Record``): the figures, every raw sample, the
  goals and correctness checks, commit, CPU model, core count, torch / MKL / oneDNN versions,
  transparent-huge-page mode, date, command line. ``bench/tables.py`` renders the docs' tables
  from those files only.

>>> import time
>>> timings = measure({"fast": lambda: None, "slow": lambda: time.sleep(0.002)}, repeats=3)
>>> timings["fast"].median < timings["slow"].median
True
>>> schedule(["a", "b"], 2, order="abba")
['a', 'b', 'b', 'a']
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
MIN_REPEATS = 7
ORDERS = ("random", "abba")
SCHEMA = 1
METHOD = ("each contender warmed up by its first call(s) (the first call's time kept as the "
          "cold figure), then timed repeats in rounds of seeded random (or ABBA) order; median, "
          "IQR and min-max of the repeats; equal explicit thread counts on every side")


# -- statistics and order ----------------------------------------------------------------------
def summarize(samples: Sequence[float]) -> dict:
    """Median, quartiles, IQR, min and max of ``samples`` (seconds).

    >>> s = summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    >>> s["median"], s["min"], s["max"], s["n"]
    (3.0, 1.0, 100.0, 5)
    >>> s["q1"], s["q3"], s["iqr"]
    (2.0, 4.0, 2.0)
    """
    xs = sorted(float(x) for x in samples)
    if not xs:
        raise ValueError("no samples to summarize")
    if len(xs) > 1:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        q1 = q3 = xs[0]
    return {"n": len(xs), "median": statistics.median(xs), "q1": q1, "q3": q3, "iqr": q3 - q1,
            "min": xs[0], "max": xs[-1]}


def schedule(names: Sequence[str], repeats: int, order: str = "random",
             seed: int = 0) -> list[str]:
    """The order in which ``repeats`` timed calls of each of ``names`` run: rounds of every name
    once, each round a seeded random permutation (``"random"``) or the names forwards then
    backwards (``"abba"``). Deterministic for a given seed.

    >>> schedule(["a", "b", "c"], 2, order="abba")
    ['a', 'b', 'c', 'c', 'b', 'a']
    >>> schedule(["a", "b"], 3, seed=1) == schedule(["a", "b"], 3, seed=1)
    True
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, not {order!r}")
    rng = random.Random(seed)
    out: list[str] = []
    for round_ in range(repeats):
        names_ = list(names)
        if order == "abba":
            out += names_ if round_ % 2 == 0 else names_[::-1]
        else:
            rng.shuffle(names_)
            out += names_
    return out


@dataclass
class Timing:
    """One contender's figures: timed samples (seconds), its cold first call, where it ran."""

    samples: list[float]
    first_s: float
    isolated: bool = False
    pid: int = 0
    tensorql_imported: bool | None = None
    threads: int | None = None
    peak_rss_bytes: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def summary(self) -> dict:
        return summarize(self.samples)

    def to_json(self) -> dict:
        return {**asdict(self), **{"summary": self.summary()}}

    def cpu_share(self) -> float | None:
        """The median of each timed call's process CPU time over its wall time (isolated
        runs: about the threads it kept busy; well below its thread count when the host
        took cores from it), or None when not recorded."""
        cpu = self.extra.get("cpu_s")
        if not cpu:
            return None
        return statistics.median(c / max(s, 1e-9) for c, s in zip(cpu, self.samples))

    def describe(self, scale: float = 1e3, unit: str = "ms") -> str:
        """``median [q1-q3] (min-max) unit, cold first``, e.g. for a log line."""
        s = self.summary()
        return (f"{s['median'] * scale:.3g} {unit} [IQR {s['q1'] * scale:.3g}-"
                f"{s['q3'] * scale:.3g}, range {s['min'] * scale:.3g}-{s['max'] * scale:.3g}]"
                f" cold {self.first_s * scale:.3g} {unit}")


@dataclass(frozen=True)
class Interval:
    """What a contender's call returns when only part of it is to be timed (e.g. decoding
    after an untimed prompt): the seconds it measured itself, and its result."""

    seconds: float
    value: object = None


def _call(fn: Callable[[], object]) -> tuple[float, object]:
    """Seconds of one call of ``fn`` (its own ``Interval`` if it returns one) and its result."""
    start = time.perf_counter()
    out = fn()
    took = time.perf_counter() - start
    if isinstance(out, Interval):
        return out.seconds, out.value
    return took, out


def _timed(fn: Callable[[], object]) -> float:
    return _call(fn)[0]


SMALL_VALUE = 64  # results of at most this many elements are kept for every call


def _small(out: object) -> list | None:
    """``out`` as a list when it is small (a loss, a few tokens), else None."""
    if out is None:
        return None
    try:
        arr = as_numpy(out)
    except (TypeError, ValueError):
        return None
    return arr.tolist() if arr.size <= SMALL_VALUE and arr.dtype.kind in "biuf" else None


def measure(contenders: Mapping[str, Callable[[], object]], repeats: int = MIN_REPEATS,
            warmup: int = 1, order: str = "random", seed: int = 0,
            firsts: Mapping[str, float] | None = None) -> dict[str, Timing]:
    """Time callables in this process by the rules above (no isolation). ``firsts``: the
    first calls' seconds where the caller made them (to keep their results)."""
    firsts = dict(firsts or {})
    values: dict[str, list] = {name: [] for name in contenders}
    for name, fn in contenders.items():
        if name not in firsts:
            firsts[name], out = _call(fn)
            values[name].append(_small(out))
        for _ in range(warmup - 1):
            values[name].append(_small(_call(fn)[1]))
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for name in schedule(list(contenders), repeats, order, seed):
        took, out = _call(contenders[name])
        samples[name].append(took)
        values[name].append(_small(out))
    return {name: Timing(samples[name], firsts[name], pid=os.getpid(),
                         tensorql_imported="tensorql" in sys.modules, threads=_torch_threads(),
                         peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                         * 1024, extra={"values": values[name]})
            for name in contenders}


def alternating_medians(fns: Sequence[Callable[[], object]], repeat: int) -> list[float]:
    """Median seconds of each of ``fns`` by ``measure`` (kept for the benches that use it).

    >>> fast, slow = alternating_medians([lambda: None, lambda: time.sleep(0.002)], repeat=3)
    >>> fast < slow
    True
    """
    timings = measure({str(i): fn for i, fn in enumerate(fns)}, repeats=repeat)
    return [timings[str(i)].median for i in range(len(fns))]


# -- threads -----------------------------------------------------------------------------------
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
               "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


def ratio_text(value: float, bound: float) -> str:
    """``value`` for a goal's text: two decimals, or as many more as it takes for the printed
    number to fall on the same side of ``bound`` as the value (a miss of a goal of 1.0 by
    0.0013 reads 1.001, where two decimals printed "1.00 <= 1.0" beside MISSED).

    >>> ratio_text(0.934, 0.9), ratio_text(1.0013, 1.0), ratio_text(0.9004, 0.9)
    ('0.93', '1.001', '0.9004')
    >>> ratio_text(0.8996, 0.9)  # met, and 0.90 <= 0.9 reads so
    '0.90'
    """
    for digits in range(2, 8):
        text = f"{value:.{digits}f}"
        if (float(text) <= bound) == (value <= bound):
            return text
    return repr(value)


def thread_env(threads: int) -> dict[str, str]:
    """Environment that caps every BLAS / OpenMP pool at ``threads``.

    >>> thread_env(2)["OMP_NUM_THREADS"]
    '2'
    """
    return {var: str(threads) for var in THREAD_VARS}


def _torch_threads() -> int | None:
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def set_threads(threads: int) -> None:
    """Cap this process's pools at ``threads``: torch's intra-op pool, and the BLAS libraries
    already loaded (``threadpoolctl``) -- for the in-process (``--no-isolate``) runs."""
    os.environ.update(thread_env(threads))
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:  # imported here: its default is the physical cores, not the CPUs
        torch.set_num_threads(threads)
    try:
        import threadpoolctl

        threadpoolctl.threadpool_limits(threads)
    except ImportError:  # optional: the environment variables still cap new pools
        pass


# -- isolated contenders -----------------------------------------------------------------------
@dataclass(frozen=True)
class Contender:
    """A contender built in its own process by ``factory`` (``"module:function"``, a module of
    ``bench/`` or any importable one) called with ``kwargs``; the function returns the callable
    to time (whose return value is the result checked against the others).

    ``env`` is added to the worker's environment (after the thread variables: a contender may
    cap its BLAS lower, e.g. dask's one thread per worker); ``threads`` sets
    ``torch.set_num_threads`` and the thread variables (None: the run's count)."""

    name: str
    factory: str
    kwargs: Mapping = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    threads: int | None = None

    def build(self) -> Callable[[], object]:
        """The timed callable, built in this process."""
        return load_factory(self.factory)(**dict(self.kwargs))


def load_factory(spec: str) -> Callable[..., Callable[[], object]]:
    """The function named by ``"module:function"`` (bench modules importable by name)."""
    module, _, function = spec.partition(":")
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    return getattr(importlib.import_module(module), function)


def probe_factory(import_tensorql: bool = False):
    """A contender that reports where it runs: each call returns ``[pid, tensorql imported,
    torch threads, OMP_NUM_THREADS]`` (the check that isolation and threads are what they say:
    tests/test_benches.py)."""
    if import_tensorql:
        import tensorql  # noqa: F401  (the side whose import retunes the allocator)

    def run() -> list[int]:
        return [os.getpid(), int("tensorql" in sys.modules), _torch_threads() or 0,
                int(os.environ.get("OMP_NUM_THREADS", "0"))]
    return run


def as_numpy(value: object):
    """A contender's result as a numpy array (torch tensors detached, lists stacked)."""
    import numpy as np

    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    elif hasattr(value, "numpy") and not isinstance(value, np.ndarray):
        value = value.numpy()
    return np.asarray(value)


class Worker:
    """One contender's persistent process, driven over a pipe (one JSON line per command)."""

    def __init__(self, contender: Contender, threads: int) -> None:
        self.contender = contender
        self.threads = contender.threads or threads
        env = dict(os.environ)
        env.update(thread_env(self.threads))
        env.update({k: str(v) for k, v in contender.env.items()})
        path = [str(BENCH_DIR), str(ROOT), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__)), "--worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     text=True, bufsize=1)
        self.info = self.call(op="setup", factory=contender.factory,
                              kwargs=dict(contender.kwargs), threads=self.threads)

    def call(self, **command) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"contender {self.contender.name!r} ({self.contender.factory}) "
                               f"died (exit {code}) during {command['op']!r}; its stderr is above")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"contender {self.contender.name!r} ({self.contender.factory}) "
                               f"failed in {command['op']!r}:\n{reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(op="exit")
            except (RuntimeError, BrokenPipeError, OSError):
                pass
            self.proc.wait(timeout=60)


SETTLE_S = 0.02  # pause before each isolated call, off the clock


def measure_isolated(contenders: Sequence[Contender], repeats: int = MIN_REPEATS,
                     warmup: int = 1, order: str = "random", seed: int = 0, threads: int = 2,
                     results: bool = True) -> tuple[dict[str, Timing], dict[str, object]]:
    """Time ``contenders`` each in its own persistent process; returns their timings and (with
    ``results``) each one's result as a numpy array, taken from its first (cold) call."""
    workers = {c.name: Worker(c, threads) for c in contenders}
    try:
        outputs: dict[str, object] = {}
        firsts: dict[str, float] = {}
        values: dict[str, list] = {name: [] for name in workers}
        with tempfile.TemporaryDirectory(prefix="tq-bench-") as tmp:
            for name, worker in workers.items():
                path = os.path.join(tmp, f"{len(outputs)}.npy") if results else None
                reply = worker.call(op="run", save=path)
                firsts[name] = reply["s"]
                values[name].append(reply.get("value"))
                if path is not None:
                    import numpy as np

                    outputs[name] = np.load(path, allow_pickle=False)
                for _ in range(warmup - 1):
                    values[name].append(worker.call(op="run").get("value"))
        samples: dict[str, list[float]] = {name: [] for name in workers}
        cpu: dict[str, list[float]] = {name: [] for name in workers}
        cpu_before = {name: worker.call(op="stats")["cpu_s"] for name, worker in workers.items()}
        for name in schedule(list(workers), repeats, order, seed):
            time.sleep(SETTLE_S)  # the last contender's pool threads stop spinning first
            reply = workers[name].call(op="run")
            samples[name].append(reply["s"])
            cpu[name].append(reply["cpu"])
            values[name].append(reply.get("value"))
        timings = {}
        for name, worker in workers.items():
            stats = worker.call(op="stats")
            # CPU the process used between its timed calls, while the others ran (threads
            # spinning or working in the background would take the others' cores)
            idle = stats["cpu_s"] - cpu_before[name] - sum(cpu[name])
            timings[name] = Timing(samples[name], firsts[name], isolated=True,
                                   pid=worker.info["pid"],
                                   tensorql_imported=stats["tensorql_imported"],
                                   threads=worker.info["threads"],
                                   peak_rss_bytes=stats["peak_rss_bytes"],
                                   extra={"values": values[name], "cpu_s": cpu[name],
                                          "idle_cpu_s": idle})
        return timings, outputs
    finally:
        for worker in workers.values():
            worker.close()


def run_contenders(contenders: Sequence[Contender], args: argparse.Namespace,
                   results: bool = True) -> tuple[dict[str, Timing], dict[str, object]]:
    """Time ``contenders`` as the bench's common options say: isolated or in this process
    (where a contender that needs an environment of its own is left out: the timings and
    outputs then lack it)."""
    if args.isolate:
        return measure_isolated(contenders, args.repeat, args.warmup, args.order, args.seed,
                                args.threads, results)
    set_threads(args.threads)
    for c in contenders:
        if c.env:  # an environment (e.g. TENSORQL_PACKED_WEIGHTS=0) is read at import
            print(f"note: contender {c.name!r} needs its own environment {dict(c.env)}: "
                  "left out of this --no-isolate run", file=sys.stderr)
    fns = {c.name: c.build() for c in contenders if not c.env}
    firsts, outputs = {}, {}
    for name, fn in fns.items():
        firsts[name], out = _call(fn)
        if results:
            outputs[name] = as_numpy(out)
    return measure(fns, args.repeat, args.warmup, args.order, args.seed, firsts), outputs


def _worker_main() -> int:
    """The worker's loop: the protocol goes over the original stdout; anything the contender
    prints goes to stderr."""
    sys.modules.setdefault("harness", sys.modules["__main__"])  # one Interval class
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    fn: Callable[[], object] | None = None
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "setup":
                threads = int(command["threads"])
                try:
                    import torch

                    torch.set_num_threads(threads)
                except ImportError:
                    pass
                fn = load_factory(command["factory"])(**command["kwargs"])
                reply = {"pid": os.getpid(), "threads": _torch_threads()}
            elif op == "run":
                assert fn is not None, "run before setup"
                cpu = time.process_time()
                took, out = _call(fn)
                reply = {"s": took, "value": _small(out), "cpu": time.process_time() - cpu}
                if command.get("save"):
                    import numpy as np

                    np.save(command["save"], as_numpy(out), allow_pickle=False)
                del out
            elif op == "stats":
                reply = {"tensorql_imported": "tensorql" in sys.modules,
                         "cpu_s": time.process_time(),
                         "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                         * 1024, "pid": os.getpid()}
            elif op == "exit":
                protocol.write(json.dumps({"bye": True}) + "\n")
                return 0
            else:
                reply = {"error": f"unknown command {op!r}"}
        except Exception:  # reported to the driver, which raises it with the contender's name
            import traceback

            reply = {"error": traceback.format_exc()}
        protocol.write(json.dumps(reply) + "\n")
    return 0


# -- the environment and the record ------------------------------------------------------------
def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def cpu_model() -> str:
    """``model name`` of /proc/cpuinfo (the platform's processor string elsewhere)."""
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def thp_mode() -> str | None:
    """The bracketed mode of /sys/kernel/mm/transparent_hugepage/enabled (e.g. ``madvise``)."""
    text = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    found = re.search(r"\[(\w+)\]", text or "")
    return found.group(1) if found else None


def torch_build() -> dict:
    """torch's version and the MKL / oneDNN versions of its build (``torch.__config__``)."""
    try:
        import torch
    except ImportError:
        return {}
    shown = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version ([\d.]+)", shown)
    onednn = re.search(r"MKL-DNN (v[^\s]+)", shown)
    try:  # whether tensorql packs stored weights on this host, and why (its default)
        from tensorql_kernels.packed_weights import RULE as packing
    except ImportError:
        packing = None
    return {"torch": torch.__version__, "mkl": mkl.group(1) if mkl else None,
            "onednn": onednn.group(1) if onednn else None, "packed_weights": packing}


def git_commit() -> dict:
    def git(*cmd: str) -> str:
        done = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    return {"commit": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def machine_info(argv: Sequence[str] | None = None) -> dict:
    """Where and how a run was made: the fields every bench JSON carries."""
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return {**git_commit(), "cpu_model": cpu_model(), "cores": os.cpu_count(),
            "cores_usable": len(affinity) if affinity is not None else os.cpu_count(),
            **torch_build(), "thp": thp_mode(), "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None
                                                            else argv)]),
            "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "thread_env": {k: v for k, v in os.environ.items()
                           if k in THREAD_VARS or k.startswith(("OMP_", "KMP_", "GOMP_",
                                                                "TENSORQL_"))}}


def add_arguments(parser: argparse.ArgumentParser, repeat: int | None = MIN_REPEATS,
                  threads: int = 2, isolate: bool | None = True) -> None:
    """The method's options, the same in every bench: ``repeat=None`` where nothing is
    repeated (memory.py), ``isolate=None`` where there is no peer process to isolate from
    (the option is then absent, and so is it from the record)."""
    group = parser.add_argument_group("method (bench/harness.py)")
    if repeat is not None:
        group.add_argument("--repeat", type=int, default=repeat,
                           help=f"timed calls of each contender (>= {MIN_REPEATS} for "
                                f"published figures; default {repeat})")
        group.add_argument("--warmup", type=int, default=1,
                           help="untimed first calls of each contender; the first one's time "
                                "is kept as the cold figure (default 1)")
        group.add_argument("--order", choices=ORDERS, default="random",
                           help="the order of each round of timed calls (default random)")
        group.add_argument("--seed", type=int, default=0, help="seed of the random order")
    group.add_argument("--threads", type=int, default=threads,
                       help=f"threads given to every contender alike (default {threads})")
    if isolate is not None:
        group.add_argument("--isolate", action=argparse.BooleanOptionalAction,
                           default=isolate,
                           help="each contender in its own process (default; --no-isolate "
                                "runs them in this one, not for published figures)")
    group.add_argument("--json", default=None,
                       help=f"where to write the run's record (default: {RESULTS_DIR.name}/"
                            "<bench>.json for a full run, none for a smoke run)")


class Record:
    """One bench run's figures, checks and goals; ``finish`` prints the verdict, writes the
    JSON and returns the exit status: 1 on a wrong result (always) or a missed goal (unless a
    smoke run, whose goals are printed but not gated).

    >>> r = Record("demo", smoke=True, argv=[])
    >>> r.check("sums agree", True); r.goal("fast enough", False)
    >>> r.finish(write=False)
    correct: sums agree: ok
    goal: fast enough: MISSED (smoke run: not gated)
    0
    >>> r.check("shape", False); r.finish(write=False)
    correct: sums agree: ok
    correct: shape: WRONG
    goal: fast enough: MISSED (smoke run: not gated)
    1
    """

    def __init__(self, bench: str, smoke: bool = False, args: argparse.Namespace | None = None,
                 argv: Sequence[str] | None = None) -> None:
        self.bench, self.smoke, self.args = bench, smoke, args
        self.data: dict = {"bench": bench, "schema": SCHEMA, "smoke": smoke,
                           "env": machine_info(argv), "method": self._method(args),
                           "checks": {}, "goals": {}, "timings": {}, "figures": {},
                           "tables": {}}

    @staticmethod
    def _method(args: argparse.Namespace | None) -> dict:
        out: dict = {"rule": METHOD}
        if args is not None:
            out.update({k: getattr(args, k) for k in ("repeat", "warmup", "order", "seed",
                                                       "threads", "isolate")
                        if hasattr(args, k)})
        return out

    def check(self, name: str, ok: bool, detail: object = None) -> None:
        """A correctness check: a False one makes the run exit 1, smoke or not."""
        self.data["checks"][name] = {"ok": bool(ok), "detail": detail}

    def goal(self, name: str, ok: bool, detail: object = None) -> None:
        """A performance goal: a False one makes a full run exit 1."""
        self.data["goals"][name] = {"ok": bool(ok), "detail": detail}

    def timings(self, key: str, timings: Mapping[str, Timing]) -> None:
        """Every contender's raw samples and summary, under ``key`` (a row of the bench)."""
        self.data["timings"][key] = {name: t.to_json() for name, t in timings.items()}

    def figure(self, key: str, value: object) -> None:
        self.data["figures"][key] = value

    def table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[object]],
              note: str = "") -> None:
        """A table for docs/benchmarks.md (``<!-- table:NAME -->``), cells as given."""
        self.data["tables"][name] = {"columns": list(columns),
                                     "rows": [list(r) for r in rows], "note": note}

    @property
    def correct(self) -> bool:
        return all(c["ok"] for c in self.data["checks"].values())

    def exit_code(self) -> int:
        goals_met = all(g["ok"] for g in self.data["goals"].values())
        return 0 if self.correct and (goals_met or self.smoke) else 1

    def path(self) -> Path | None:
        chosen = getattr(self.args, "json", None) if self.args is not None else None
        if chosen:
            return Path(chosen)
        return None if self.smoke else RESULTS_DIR / f"{self.bench}.json"

    def finish(self, write: bool = True) -> int:
        for name, c in self.data["checks"].items():
            print(f"correct: {name}: {'ok' if c['ok'] else 'WRONG'}")
        for name, g in self.data["goals"].items():
            print(f"goal: {name}: {'met' if g['ok'] else 'MISSED'}"
                  + (" (smoke run: not gated)" if self.smoke and not g["ok"] else ""))
        code = self.exit_code()
        self.data["exit"] = code
        target = self.path() if write else None
        if target is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(self.data, indent=1, default=_jsonable) + "\n")
            print(f"record: {target}")
        return code


def _jsonable(value: object) -> object:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        sys.exit(_worker_main())
    print(__doc__)
