"""CPU einsum benchmark: tensorql against torch and dask, each in its own process.

    python bench/cpu_einsum.py [--threads 2] [--repeat 9] [--small] [--skip-dask]
                               [--devices 1,2] [--tiles 256,512,1024] [--big] [--auto-only]
                               [--no-isolate] [--order random|abba] [--json PATH]

Workloads (fp32; tensorql stores them with its automatic tile, as a user who passes no
``tile=`` gets -- 1536 x 1536 for the matmul, the MLP's operands whole; ``--tile N`` stores
them with N x N tiles instead; dask's chunks are the same tiles):
  * matmul      3072 x 3072 @ 3072 x 3072
  * mlp         relu(X[2048x1024] @ W1[1024x4096]) @ W2[4096x1024]

Each workload runs once per entry of ``--devices``: 1 is one CPU device (the tiled plan), 2 is
``tq.connect(devices=2)`` -- the optimizer partitions the query across two CPU devices and that
partitioning runs, copies between them included (the goal: no cost against one device).

Method (``bench/harness.py``): every contender is built by a factory below in a process of its
own (``--isolate``, the default: the torch and dask processes never import tensorql, whose
import retunes glibc's allocator), with ``--threads`` threads on every side: torch's intra-op
pool; tensorql's ``workers=threads, intra_op_threads=1``; dask's threaded scheduler with
``threads`` workers and BLAS capped at one thread each. Each contender's first call is its
warm-up and is printed as the **cold** figure; ``--repeat`` timed calls follow in seeded random
order; medians and IQRs are printed.

What each side may reuse: tensorql keeps a packed copy of each stored weight from its first
call on, with the host's packing (``kernels/packed_weights.py``: MKL's packed sgemm where
torch's BLAS is MKL on an Intel CPU, oneDNN's elsewhere; the JSON's ``env.packed_weights``
says which); torch's ``@`` (MKL sgemm) repacks its right operand per call. The ``tq nopack``
contender is tensorql with ``TENSORQL_PACKED_WEIGHTS=0``, and the cold column is the first
call (packing on the clock), so the reuse is visible, not hidden; ``torch packed`` gives torch
the same reuse (its right operands packed once by the same code), as a torch user who
prepacks would have it,
and ``torch compile`` is ``torch.compile`` with inductor's ``freezing`` under ``torch.no_grad``
(the weights folded into the graph as constants and prepacked by inductor), its compilation
in its first call and so in its cold figure.

Baselines: torch; dask in three forms, chunks of the tile: ``da.einsum`` (its default
``optimize=False``), ``da.einsum(optimize=True)`` and ``da.matmul`` (dask's BLAS path). The
dask goal is against the fastest of the three.

A ``devices=2`` row also times the floor of any two-device split on this machine: two torch
threads with one intra-op thread each, each computing its half (printed as floor/torch and
tq/floor): one two-thread matrix product shares packed panels between its threads, two
one-thread products cannot.

Automatic tiles: every workload is also stored with no ``tile=`` (``auto_tile``) and timed
against the same workload stored with each manual tile of ``--tiles`` (default 256, 512, 1024),
in the same process (tensorql against itself) in seeded random order; goal: auto / best manual
<= 1.1. ``--big`` adds an 8192^3 matmul to this table (manual tiles 1024 and 2048).

Goals: tensorql / the fastest torch form (plain, packed, compiled) <= 1.0 (warm medians; issue
31),
fastest dask/tensorql >= 5, auto/best <= 1.1.
Every result is checked against a float64 numpy reference (relative error < 1e-4). Exits 1
on a wrong result, or on a missed goal unless ``--small``.
"""

from __future__ import annotations

import argparse
import sys
import threading

import numpy as np
import torch
from harness import Contender, Record, add_arguments, measure, ratio_text, run_contenders

# tensorql / the fastest torch form, warm medians (issue 31: <= 1.0 in every run)
TORCH_GOAL = 1.0

SIZES = {"small": {"n": 768, "mlp": (512, 256, 1024)},
         "full": {"n": 3072, "mlp": (2048, 1024, 4096)}}


def arrays_for(workload: str, small: bool) -> dict[str, np.ndarray]:
    """The workload's operands (seeded: every process builds the same ones)."""
    size = SIZES["small" if small else "full"]
    rng = np.random.default_rng(0)

    def arr(*shape):
        return rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[0]))

    if workload == "matmul":
        return {"A": arr(size["n"], size["n"]), "B": arr(size["n"], size["n"])}
    b, d, h = size["mlp"]
    return {"X": arr(b, d), "W1": arr(d, h), "W2": arr(h, d)}


def reference(workload: str, x: dict) -> np.ndarray:
    """The float64 numpy result every contender is checked against."""
    x = {k: v.astype(np.float64) for k, v in x.items()}
    if workload == "matmul":
        return x["A"] @ x["B"]
    return np.maximum(x["X"] @ x["W1"], 0) @ x["W2"]


def build_expr(workload: str, t: dict):
    if workload == "matmul":
        return t["A"] @ t["B"]
    return (t["X"] @ t["W1"]).relu() @ t["W2"]


def torch_factory(workload: str, small: bool, packed: bool = False):
    """torch's side; ``packed``: the right operands packed once with the code and the rule
    of tensorql's packed weights (``kernels/packed_weights.py``: MKL's packed sgemm where
    torch's BLAS is MKL on an Intel CPU, oneDNN's elsewhere), as a torch user who prepacks
    would."""
    x = {k: torch.from_numpy(v) for k, v in arrays_for(workload, small).items()}
    mm = torch.mm
    if packed:
        from tensorql_kernels import packed_weights

        for k in ("B", "W1", "W2"):
            if k in x:
                packed_weights.mark_immutable(x[k])
        mm = packed_weights.matmul
    if workload == "matmul":
        return lambda: mm(x["A"], x["B"])
    return lambda: mm(torch.relu(mm(x["X"], x["W1"])), x["W2"])


class _Frozen(torch.nn.Module):
    """The workload as a module whose right operands are parameters (no gradient), so that
    inductor's freezing folds them into the graph as constants and prepacks them."""

    def __init__(self, workload: str, x: dict) -> None:
        super().__init__()
        self.workload = workload
        for k, v in x.items():
            if k in ("B", "W1", "W2"):
                self.register_parameter(k, torch.nn.Parameter(v, requires_grad=False))

    def forward(self, left: torch.Tensor) -> torch.Tensor:
        if self.workload == "matmul":
            return left @ self.B
        return torch.relu(left @ self.W1) @ self.W2


def torch_compile_factory(workload: str, small: bool):
    """torch as a user who compiles for inference would run it: ``torch.compile`` (inductor)
    with ``torch._inductor.config.freezing`` under ``torch.no_grad()`` -- the weights become
    constants of the graph and inductor prepacks them (``cpp.weight_prepack``: for MKL's
    packed sgemm where torch has MKL, else oneDNN).
    The compilation happens in the first call, so it is the contender's cold figure; inductor
    caches in a fresh directory of this process (no compiled code from an earlier run)."""
    import os
    import tempfile

    import torch._inductor.config as inductor_config

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="tq-bench-inductor-")
    inductor_config.freezing = True
    x = {k: torch.from_numpy(v) for k, v in arrays_for(workload, small).items()}
    module = _Frozen(workload, x).eval()
    compiled = torch.compile(module)
    left = x["A" if workload == "matmul" else "X"]

    def run() -> torch.Tensor:
        with torch.no_grad():
            return compiled(left)
    return run


def tq_factory(workload: str, small: bool, devices: int, threads: int, tile: int | None):
    """tensorql's side; ``tile`` None: the automatic tile (what a user passing none gets)."""
    import tensorql as tq

    db = tq.connect(workers=threads, intra_op_threads=1, devices=devices)
    stored = {k: db.from_numpy(k, v, tile=None if tile is None else (tile, tile))
              for k, v in arrays_for(workload, small).items()}
    expr = build_expr(workload, stored)
    return expr.numpy


def workload_tile(workload: str, small: bool, tile: int | None) -> int:
    """The square tile the workload's operands are stored with: ``tile``, or tensorql's
    automatic tile of the first operand (dask's chunks are the same)."""
    if tile is not None:
        return tile
    from tensorql.grid import auto_tile

    first = next(iter(arrays_for(workload, small).values()))
    return int(auto_tile(first.shape)[0])


def dask_factory(workload: str, small: bool, threads: int, tile: int, form: str):
    """dask with ``threads`` workers (its BLAS capped at one thread each by the contender's
    environment); ``form``: einsum, einsum-opt or matmul."""
    import dask
    import dask.array as da

    dask.config.set(scheduler="threads", num_workers=threads)
    c = {k: da.from_array(v, chunks=(tile, tile))
         for k, v in arrays_for(workload, small).items()}

    def mm(a, b):
        if form == "matmul":
            return da.matmul(a, b)
        return da.einsum("ij,jk->ik", a, b, optimize=form == "einsum-opt")

    if workload == "matmul":
        return lambda: mm(c["A"], c["B"]).compute()
    return lambda: mm(da.maximum(mm(c["X"], c["W1"]), 0), c["W2"]).compute()


def floor_factory(workload: str, small: bool):
    x = arrays_for(workload, small)
    return lambda: two_thread_floor(workload, x)


def two_thread_floor(name: str, x: dict) -> torch.Tensor:
    """What any split over two one-thread devices can at best do: two torch threads (one
    intra-op thread each), each computing its half -- B's columns for a matmul, the Megatron
    split of the MLP (W1's columns and W2's rows, partial sums added)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    t = {k: torch.from_numpy(v) for k, v in x.items()}
    halves: list = [None, None]
    if name == "matmul":
        cut = t["B"].shape[1] // 2
        parts = [t["B"][:, :cut].contiguous(), t["B"][:, cut:].contiguous()]
        out = torch.empty(t["A"].shape[0], t["B"].shape[1])

        def work(i):
            torch.mm(t["A"], parts[i], out=out[:, i * cut:(i + 1) * cut])
    else:
        cut = t["W1"].shape[1] // 2
        w1 = [t["W1"][:, :cut].contiguous(), t["W1"][:, cut:].contiguous()]
        w2 = [t["W2"][:cut].contiguous(), t["W2"][cut:].contiguous()]

        def work(i):
            halves[i] = torch.relu(t["X"] @ w1[i]) @ w2[i]
    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if name != "matmul":
        out = halves[0].add_(halves[1])
    torch.set_num_threads(previous)
    return out


def tile_sweep(arrays, build, tiles, args) -> dict:
    """Timings of ``build`` over the arrays stored with each manual tile and with the
    automatic one, in this process, by the harness's rules; keys are tiles and "auto"."""
    import tensorql as tq

    db = tq.connect(workers=args.threads, intra_op_threads=1)
    exprs = {}
    for tile in [*tiles, "auto"]:
        stored = {k: db.from_numpy(f"{k}_{tile}", v, tile=None if tile == "auto"
                                   else (tile, tile)) for k, v in arrays.items()}
        exprs[str(tile)] = build(stored).numpy
    auto_tile = db.tensor(f"{next(iter(arrays))}_auto").node.grid.tile
    timings = measure(exprs, args.repeat, args.warmup, args.order, args.seed)
    db.close()
    return {"timings": timings, "auto_tile": list(auto_tile)}


def auto_tile_rows(args, tiles):
    """One row per workload: each manual tile's time, the automatic tile's, and the ratio."""
    cases = [(name, arrays_for(name, args.small), lambda t, n=name: build_expr(n, t))
             for name in ("matmul", "mlp")]
    sizes = {"matmul": f"{SIZES['small' if args.small else 'full']['n']}^3", "mlp": "x".join(
        map(str, SIZES["small" if args.small else "full"]["mlp"]))}
    if args.big:
        rng = np.random.default_rng(1)
        n = 8192
        a = rng.standard_normal((n, n), dtype=np.float32) / np.float32(np.sqrt(n))
        cases.append(("matmul-8192", {"A": a, "B": a}, lambda t: t["A"] @ t["B"]))
        sizes["matmul-8192"] = f"{n}^3"
    for name, arrays, build in cases:
        sweep_tiles = [1024, 2048] if name == "matmul-8192" else tiles
        sweep = tile_sweep(arrays, build, sweep_tiles, args)
        med = {k: t.median for k, t in sweep["timings"].items()}
        best = min(sweep_tiles, key=lambda t: med[str(t)])
        yield {"workload": name, "size": sizes[name], "manual": {t: med[str(t)]
                                                                 for t in sweep_tiles},
               "best": best, "auto": med["auto"], "auto_tile": sweep["auto_tile"],
               "auto/best": med["auto"] / med[str(best)], "timings": sweep["timings"]}


def contenders_for(workload: str, devices: int, args, tile: int) -> list[Contender]:
    common = dict(workload=workload, small=args.small)
    chunk = workload_tile(workload, args.small, tile)
    out = [Contender("torch", "cpu_einsum:torch_factory", common),
           Contender("torch packed", "cpu_einsum:torch_factory", dict(common, packed=True)),
           Contender("torch compile", "cpu_einsum:torch_compile_factory", common),
           Contender("tq", "cpu_einsum:tq_factory",
                     dict(common, devices=devices, threads=args.threads, tile=tile)),
           Contender("tq nopack", "cpu_einsum:tq_factory",
                     dict(common, devices=devices, threads=args.threads, tile=tile),
                     env={"TENSORQL_PACKED_WEIGHTS": "0"})]
    if devices == 2:
        out.append(Contender("floor", "cpu_einsum:floor_factory", common))
    if devices == 1 and not args.skip_dask:
        one = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        out += [Contender(f"dask {form}", "cpu_einsum:dask_factory",
                          dict(common, threads=args.threads, tile=chunk, form=form), env=one)
                for form in ("einsum", "einsum-opt", "matmul")]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--skip-dask", action="store_true")
    parser.add_argument("--tiles", default=None,
                        help="manual tiles the automatic one is compared with (comma-separated; "
                             "default 256,512,1024, or 64,128 with --small)")
    parser.add_argument("--big", action="store_true",
                        help="add an 8192^3 matmul to the automatic-tile table")
    parser.add_argument("--auto-only", action="store_true",
                        help="run only the automatic-tile table")
    parser.add_argument("--tile", type=int, default=None,
                        help="store the operands with N x N tiles (default: the automatic tile)")
    parser.add_argument("--devices", default="1,2",
                        help="comma-separated device counts to run each workload on")
    add_arguments(parser, repeat=9)
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.devices.split(",")]
    record = Record("cpu_einsum", smoke=args.small, args=args, argv=argv)
    torch.set_num_threads(args.threads)
    tile = args.tile
    sizes = {"matmul": f"{SIZES['small' if args.small else 'full']['n']}^3",
             "mlp": "x".join(map(str, SIZES["small" if args.small else "full"]["mlp"]))}

    rows = []
    for name, devices in ((w, d) for w in ("matmul", "mlp") for d in counts
                          if not args.auto_only):
        key = f"{name} devices={devices}"
        timings, outputs = run_contenders(contenders_for(name, devices, args, tile), args)
        want = reference(name, arrays_for(name, args.small))
        scale = float(np.abs(want).max()) + 1e-30
        for who, got in outputs.items():
            err = float(np.abs(got - want).max() / scale)
            record.check(f"{key}: {who} result (rel. err {err:.1e} < 1e-4)",
                         got.shape == want.shape and err < 1e-4, err)
        record.timings(key, timings)
        med = {who: t.median for who, t in timings.items()}
        dask = {who: m for who, m in med.items() if who.startswith("dask")}
        shown = workload_tile(name, args.small, tile)
        row = {"workload": name, "size": sizes[name],
               "tile": shown if tile is not None else f"auto ({shown})", "devices": devices,
               "torch": med["torch"], "tq": med["tq"], "tq_cold": timings["tq"].first_s,
               "tq_nopack": med.get("tq nopack"), "torch_cold": timings["torch"].first_s,
               "torch_packed": med["torch packed"], "torch_compile": med["torch compile"],
               "torch_compile_cold": timings["torch compile"].first_s,
               "tq/torch": med["tq"] / med["torch"],
               "nopack/torch": med["tq nopack"] / med["torch"] if "tq nopack" in med else None,
               "dask_best": min(dask.values()) if dask else None,
               "dask_best_form": min(dask, key=dask.get) if dask else None,
               "floor/torch": med["floor"] / med["torch"] if "floor" in med else None,
               "tq/floor": med["tq"] / med["floor"] if "floor" in med else None}
        row["dask/tq"] = row["dask_best"] / med["tq"] if dask else None
        forms = {who: m for who, m in med.items() if who.startswith("torch")}
        row["torch_best_form"] = min(forms, key=forms.get)
        row["tq/torch best"] = med["tq"] / forms[row["torch_best_form"]]
        rows.append(row)
        record.goal(f"{key}: tq / fastest torch ({row['torch_best_form']}) "
                    f"{ratio_text(row['tq/torch best'], TORCH_GOAL)} <= {TORCH_GOAL}",
                    row["tq/torch best"] <= TORCH_GOAL)
        if dask:
            record.goal(f"{key}: fastest dask ({row['dask_best_form']}) / tq "
                        f"{row['dask/tq']:.1f} >= 5", row["dask/tq"] >= 5)
        for who, t in timings.items():
            print(f"  {key} {who:16} {t.describe()}", file=sys.stderr, flush=True)

    print(f"threads={args.threads} repeat={args.repeat} order={args.order} "
          f"isolate={args.isolate} torch={torch.__version__}")
    columns = ["workload", "size", "tile", "devices", "torch ms", "torch packed ms",
               "torch compile ms", "torch compile cold ms", "tq ms", "tq cold ms",
               "tq nopack ms", "tq/torch", "tq/torch packed", "tq/torch compile",
               "tq/fastest torch", "nopack/torch", "fastest dask ms", "dask/tq", "floor/torch",
               "tq/floor"]
    table = [[r["workload"], r["size"], r["tile"], r["devices"], r["torch"] * 1e3,
              r["torch_packed"] * 1e3, r["torch_compile"] * 1e3, r["torch_compile_cold"] * 1e3,
              r["tq"] * 1e3, r["tq_cold"] * 1e3,
              None if r["tq_nopack"] is None else r["tq_nopack"] * 1e3,
              r["tq/torch"], r["tq"] / r["torch_packed"], r["tq"] / r["torch_compile"],
              f"{r['tq/torch best']:.2f} ({r['torch_best_form']})", r["nopack/torch"],
              None if r["dask_best"] is None else f"{r['dask_best'] * 1e3:.3g} "
              f"({r['dask_best_form']})", r["dask/tq"], r["floor/torch"], r["tq/floor"]]
             for r in rows]
    if rows:
        record.table("main", columns, table, note="Warm medians; cold = the first call "
                     "(planning, chunk decoding and weight packing on the clock; torch compile's "
                     "is its compilation); nopack = TENSORQL_PACKED_WEIGHTS=0; torch packed: "
                     "right operands packed once as tensorql packs them (the host's "
                     "packing); torch compile: "
                     "torch.compile with inductor freezing under no_grad. The goal is against "
                     "the fastest torch form.")
        _print_table(columns, table)
    tiles = [int(t) for t in args.tiles.split(",")] if args.tiles else \
        ([64, 128] if args.small else [256, 512, 1024])
    print("automatic tiles against the best manual tile (same process, tensorql alone):")
    auto_table = []
    for r in auto_tile_rows(args, tiles):
        record.timings(f"auto tile {r['workload']}", r.pop("timings"))
        manual = ", ".join(f"{t}: {v * 1e3:.3g}" for t, v in r["manual"].items())
        auto_table.append([r["workload"], r["size"], manual, "x".join(map(str, r["auto_tile"])),
                           r["auto"] * 1e3, r["auto/best"]])
        record.goal(f"auto tile {r['workload']}: auto/best "
                    f"{ratio_text(r['auto/best'], 1.1)} <= 1.1", r["auto/best"] <= 1.1)
    auto_columns = ["workload", "size", "manual tiles: ms", "auto tile", "auto ms", "auto/best"]
    record.table("auto_tiles", auto_columns, auto_table)
    _print_table(auto_columns, auto_table)
    record.figure("rows", rows)
    return record.finish()


def _print_table(columns, rows) -> None:
    from tables import cell

    print("| " + " | ".join(columns) + " |")
    print("| " + " | ".join("---" for _ in columns) + " |")
    for row in rows:
        print("| " + " | ".join(cell(v) for v in row) + " |")


if __name__ == "__main__":
    sys.exit(main())
