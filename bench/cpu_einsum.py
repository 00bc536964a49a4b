"""CPU einsum benchmark: tensorql against torch and dask, measured in the same run.

    python bench/cpu_einsum.py [--threads 2] [--repeat 5] [--small] [--skip-dask]
                               [--devices 1,2]

Workloads (fp32, 512 tiles):
  * matmul      3072 x 3072 @ 3072 x 3072
  * mlp         relu(X[2048x1024] @ W1[1024x4096]) @ W2[4096x1024]

Each workload runs once per entry of ``--devices``: 1 is one CPU device (the tiled plan), 2 is
``tq.connect(devices=2)`` -- the optimizer partitions the query across two CPU devices and that
partitioning runs, copies between them included (the goal: no cost against one device).

Baselines: torch (same thread count) and ``dask.array.einsum`` (same chunks, threaded scheduler
with the same number of workers; dask's default ``optimize=False``). A second dask column with
``optimize=True`` is printed for information. Goals: tensorql/torch <= 1.1 and
dask/tensorql >= 5. Prints one row per workload and exits non-zero if a goal is missed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--small", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--skip-dask", action="store_true")
    parser.add_argument("--devices", default="1,2",
                        help="comma-separated device counts to run each workload on")
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.devices.split(",")]

    torch.set_num_threads(args.threads)
    rows = []
    ok = True
    for (name, size, tile, arrays, build, torch_fn, dask_fn), devices in (
            (w, d) for w in workloads(args.small) for d in counts):
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
              f"{'dask-opt/tq':>11} {'rel err':>8}")
    print(header)
    for r in rows:
        dask_cols = (f"{r['dask_s']:8.3f} {r['dask/tq']:8.1f} {r['dask_opt_s']:10.3f} "
                     f"{r['dask_opt/tq']:11.2f}" if "dask_s" in r else f"{'-':>8} {'-':>8} "
                     f"{'-':>10} {'-':>11}")
        print(f"{r['workload']:8} {r['size']:>15} {r['tile']:5d} {r['devices']:3d} "
              f"{r['torch_s']:8.3f} "
              f"{r['tensorql_s']:10.3f} {r['tq/torch']:8.2f} {dask_cols} {r['rel_err']:8.1e}")
    print("goals: tq/torch <= 1.1, dask/tq >= 5:", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
