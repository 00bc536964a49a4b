"""CPU einsum benchmark: tensorql against torch and dask, measured in the same run.

    python bench/cpu_einsum.py [--threads 2] [--repeat 5] [--small] [--skip-dask]
                               [--devices 1,2] [--tiles 256,512,1024] [--big] [--auto-only]

Workloads (fp32, 512 tiles):
  * matmul      3072 x 3072 @ 3072 x 3072
  * mlp         relu(X[2048x1024] @ W1[1024x4096]) @ W2[4096x1024]

Each workload runs once per entry of ``--devices``: 1 is one CPU device (the tiled plan), 2 is
``tq.connect(devices=2)`` -- the optimizer partitions the query across two CPU devices and that
partitioning runs, copies between them included (the goal: no cost against one device).

Automatic tiles: every workload is also stored with no ``tile=`` (``auto_tile``) and timed
against the same workload stored with each manual tile of ``--tiles`` (default 256, 512, 1024),
round-robin in the same run; goal: auto / best manual <= 1.1. ``--big`` adds an 8192^3 matmul
to this table (manual tiles 1024 and 2048).

A ``devices=2`` row also times the floor of any two-device split on this machine: two torch
threads with one intra-op thread each, each computing its half (printed as floor/torch and
tq/floor): one two-thread matrix product shares packed panels between its threads, two
one-thread products cannot.

Baselines: torch (same thread count) and ``dask.array.einsum`` (same chunks, threaded scheduler
with the same number of workers; dask's default ``optimize=False``). A second dask column with
``optimize=True`` is printed for information. Goals: tensorql/torch <= 1.1 and
dask/tensorql >= 5. Prints one row per workload and exits non-zero if a goal is missed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import numpy as np
import torch

import tensorql as tq


def median_time(fn, repeat: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired_times(baseline, candidate, repeat: int) -> tuple[float, float, float]:
    """Alternate baseline and candidate runs; medians of each and of the per-pair ratios
    (pairing cancels slow drifts in machine load)."""
    baseline()
    candidate()
    base, cand = [], []
    for _ in range(repeat):
        for fn, times in ((baseline, base), (candidate, cand)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    ratios = [c / b for b, c in zip(base, cand)]
    return statistics.median(base), statistics.median(cand), statistics.median(ratios)


def workloads(small: bool):
    n = 768 if small else 3072
    b, d, h = (512, 256, 1024) if small else (2048, 1024, 4096)
    tile = 128 if small else 512
    rng = np.random.default_rng(0)

    def arr(*shape):
        return rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[0]))

    yield ("matmul", f"{n}^3", tile, {"A": arr(n, n), "B": arr(n, n)},
           lambda t: t["A"] @ t["B"],
           lambda x: torch.from_numpy(x["A"]) @ torch.from_numpy(x["B"]),
           lambda da, x, opt: da.einsum("ij,jk->ik", x["A"], x["B"], optimize=opt))
    yield ("mlp", f"{b}x{d}x{h}", tile, {"X": arr(b, d), "W1": arr(d, h), "W2": arr(h, d)},
           lambda t: (t["X"] @ t["W1"]).relu() @ t["W2"],
           lambda x: torch.relu(torch.from_numpy(x["X"]) @ torch.from_numpy(x["W1"]))
           @ torch.from_numpy(x["W2"]),
           lambda da, x, opt: da.einsum(
               "ij,jk->ik", da.maximum(da.einsum("ij,jk->ik", x["X"], x["W1"], optimize=opt),
                                       0), x["W2"], optimize=opt))


def two_thread_floor(name: str, x: dict) -> None:
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
        halves[0].add_(halves[1])
    torch.set_num_threads(previous)


def tile_sweep(arrays, build, tiles, repeat: int, threads: int) -> dict:
    """Median seconds of ``build`` over the arrays stored with each manual tile and with the
    automatic one, runs interleaved round-robin (rotating the order each round); keys are
    tiles and "auto"."""
    db = tq.connect(workers=threads)
    exprs = {}
    for tile in [*tiles, "auto"]:
        stored = {k: db.from_numpy(f"{k}_{tile}", v, tile=None if tile == "auto"
                                   else (tile, tile)) for k, v in arrays.items()}
        exprs[tile] = build(stored)
        exprs[tile].numpy()  # warm up
    auto_tile = db.tensor(f"{next(iter(arrays))}_auto").node.grid.tile
    times: dict = {tile: [] for tile in exprs}
    order = list(exprs)
    for round_ in range(repeat):  # the order rotates each round: no position is favoured
        for tile in order[round_ % len(order):] + order[:round_ % len(order)]:
            expr = exprs[tile]
            start = time.perf_counter()
            expr.numpy()
            times[tile].append(time.perf_counter() - start)
    db.close()
    out = {tile: statistics.median(ts) for tile, ts in times.items()}
    out["auto_tile"] = auto_tile
    return out


def auto_tile_rows(small: bool, big: bool, tiles, repeat: int, threads: int):
    """One row per workload: each manual tile's time, the automatic tile's, and the ratio."""
    cases = [(name, size, arrays, build) for name, size, _, arrays, build, _, _ in
             workloads(small)]
    if big:
        rng = np.random.default_rng(1)
        n = 8192
        a = rng.standard_normal((n, n), dtype=np.float32) / np.float32(np.sqrt(n))
        cases.append(("matmul", f"{n}^3", {"A": a, "B": a}, lambda t: t["A"] @ t["B"]))
    for name, size, arrays, build in cases:
        sweep_tiles = [1024, 2048] if size == "8192^3" else tiles
        sweep = tile_sweep(arrays, build, sweep_tiles, repeat, threads)
        best = min(sweep_tiles, key=lambda t: sweep[t])
        yield {"workload": name, "size": size, "manual": {t: sweep[t] for t in sweep_tiles},
               "best": best, "auto": sweep["auto"], "auto_tile": sweep["auto_tile"],
               "auto/best": sweep["auto"] / sweep[best]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--small", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--skip-dask", action="store_true")
    parser.add_argument("--tiles", default=None,
                        help="manual tiles the automatic one is compared with (comma-separated; "
                             "default 256,512,1024, or 64,128 with --small)")
    parser.add_argument("--big", action="store_true",
                        help="add an 8192^3 matmul to the automatic-tile table")
    parser.add_argument("--auto-only", action="store_true",
                        help="run only the automatic-tile table")
    parser.add_argument("--devices", default="1,2",
                        help="comma-separated device counts to run each workload on")
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.devices.split(",")]

    torch.set_num_threads(args.threads)
    rows = []
    ok = True
    for (name, size, tile, arrays, build, torch_fn, dask_fn), devices in (
            (w, d) for w in workloads(args.small) for d in counts if not args.auto_only):
        db = tq.connect(workers=args.threads, devices=devices)
        tensors = {k: db.from_numpy(k, v, tile=(tile, tile)) for k, v in arrays.items()}
        expr = build(tensors)
        expected = torch_fn(arrays).numpy()
        got = expr.numpy()
        err = float(np.abs(got - expected).max() / (np.abs(expected).max() + 1e-30))
        t_torch, t_tq, ratio = paired_times(lambda fn=torch_fn, x=arrays: fn(x),
                                            lambda e=expr: e.numpy(), args.repeat)
        row = {"workload": name, "size": size, "tile": tile, "devices": devices,
               "torch_s": t_torch,
               "tensorql_s": t_tq, "tq/torch": ratio, "rel_err": err}
        if devices == 2:
            _, t_floor, floor = paired_times(lambda fn=torch_fn, x=arrays: fn(x),
                                             lambda n=name, x=arrays: two_thread_floor(n, x),
                                             args.repeat)
            row.update({"floor_s": t_floor, "floor/torch": floor, "tq/floor": t_tq / t_floor})
            print(f"  {name} devices=2: two one-thread halves in plain torch take "
                  f"{t_floor:.3f} s ({floor:.2f}x torch); tensorql {t_tq / t_floor:.2f}x that",
                  file=sys.stderr)
        if not args.skip_dask and devices == 1:
            import dask
            import dask.array as da

            chunks = {k: da.from_array(v, chunks=(tile, tile)) for k, v in arrays.items()}
            with dask.config.set(scheduler="threads", num_workers=args.threads):
                def run_dask(optimize, fn=dask_fn, c=chunks):
                    return fn(da, c, optimize).compute()

                t_dask = median_time(lambda: run_dask(False), 1)
                t_dask_opt = median_time(lambda: run_dask(True), args.repeat)
            row.update({"dask_s": t_dask, "dask/tq": t_dask / t_tq,
                        "dask_opt_s": t_dask_opt, "dask_opt/tq": t_dask_opt / t_tq})
            ok &= row["dask/tq"] >= 5
            print(f"  {name} devices={devices}: tq/torch {ratio:.2f}, dask/tq "
                  f"{row['dask/tq']:.1f}", file=sys.stderr)
        ok &= row["tq/torch"] <= 1.1 and err < 1e-4
        rows.append(row)
        db.close()

    print(f"threads={args.threads} repeat={args.repeat} torch={torch.__version__} "
          f"tensorql={tq.__version__}")
    header = (f"{'workload':8} {'size':>15} {'tile':>5} {'dev':>3} {'torch s':>8} "
              f"{'tensorql s':>10} "
              f"{'tq/torch':>8} {'dask s':>8} {'dask/tq':>8} {'dask-opt s':>10} "
              f"{'dask-opt/tq':>11} {'rel err':>8} {'floor/torch':>11} {'tq/floor':>8}")
    print(header)
    for r in rows:
        dask_cols = (f"{r['dask_s']:8.3f} {r['dask/tq']:8.1f} {r['dask_opt_s']:10.3f} "
                     f"{r['dask_opt/tq']:11.2f}" if "dask_s" in r else f"{'-':>8} {'-':>8} "
                     f"{'-':>10} {'-':>11}")
        print(f"{r['workload']:8} {r['size']:>15} {r['tile']:5d} {r['devices']:3d} "
              f"{r['torch_s']:8.3f} "
              f"{r['tensorql_s']:10.3f} {r['tq/torch']:8.2f} {dask_cols} {r['rel_err']:8.1e} "
              + (f"{r['floor/torch']:11.2f} {r['tq/floor']:8.2f}" if "floor_s" in r
                 else f"{'-':>11} {'-':>8}"))
    tiles = [int(t) for t in args.tiles.split(",")] if args.tiles else \
        ([64, 128] if args.small else [256, 512, 1024])
    print("automatic tiles against the best manual tile (same run):")
    print(f"{'workload':8} {'size':>15} {'manual tiles: s':>40} {'auto tile':>12} "
          f"{'auto s':>8} {'auto/best':>9}")
    auto_ok = True
    for r in auto_tile_rows(args.small, args.big, tiles, args.repeat, args.threads):
        manual = ", ".join(f"{t}: {v:.3f}" for t, v in r["manual"].items())
        auto = "x".join(map(str, r["auto_tile"]))
        print(f"{r['workload']:8} {r['size']:>15} {manual:>40} {auto:>12} {r['auto']:8.3f} "
              f"{r['auto/best']:9.2f}")
        auto_ok &= r["auto/best"] <= 1.1
    print("goals: tq/torch <= 1.1, dask/tq >= 5:",
          "not run (--auto-only)" if args.auto_only else "met" if ok else "NOT met")
    print("goal: auto/best manual <= 1.1:", "met" if auto_ok else "NOT met")
    return 0 if ok and auto_ok else 1


if __name__ == "__main__":
    sys.exit(main())
