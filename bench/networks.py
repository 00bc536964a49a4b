"""Real tensor networks (einsum_benchmark generators): tensorql vs opt_einsum + torch.

    python bench/networks.py [--tiny] [--repeat 3]

Each network (matrix chain, lattice, tree, random connected, MPS, MERA; 1e8-1e10 FLOPs at full
size) runs on the same random float32 operands, in the same run:

- tensorql: ``tq.einsum(equation, *stored).torch()`` from a fresh expression with an empty path
  cache (planning included; the operands are already in the store),
- opt_einsum: ``opt_einsum.contract(equation, *tensors, optimize="auto-hq", backend="torch")``
  (its path search included),

run in turn (opt_einsum, tensorql, opt_einsum, ...) and compared by their medians; and the
path tensorql chose is compared with cotengra's ``HyperOptimizer`` (fewest FLOPs, 128
trials, ``--cotengra-time`` seconds at most). Goals: geometric mean tq/opt_einsum <= 1.0, no
network above 1.3, chosen path FLOPs <= 1.05x cotengra's on each. Exits 1 on a miss (not with
``--tiny``).
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings

import einsum_benchmark.generators as gen
import numpy as np
import opt_einsum
import torch
from timing import alternating_medians  # bench/timing.py

import tensorql as tq
from tensorql.logical.lower import contraction_paths
from tensorql.logical.path import PATH_CACHE, describe_path

FULL = {
    "matrix_chain": lambda: gen.structured.matrix_chain(num_matrices=40, min_dim=64,
                                                        max_dim=512, seed=0),
    "lattice": lambda: gen.structured.lattice((3, 3, 3), d_min=3, d_max=5, seed=1),
    "tree": lambda: gen.structured.tree(n=80, d_min=6, d_max=16, n_outer=2, seed=1),
    "random_connected": lambda: gen.random.connected_network(
        40, regularity=3.0, number_of_output_indices=2, min_axis_size=2, max_axis_size=8,
        seed=2),
    "mps": lambda: gen.quantum_computing.matrix_product_state(
        n=60, phys_dim_min=4, phys_dim_max=16, bond_dim=64, seed=3),
    "mera": lambda: gen.language_model.p_first_and_last(
        mera_depth=2, axis_size_hidden=8, axis_size_observable=30),
}
TINY = {
    "matrix_chain": lambda: gen.structured.matrix_chain(num_matrices=8, min_dim=4, max_dim=16,
                                                        seed=0),
    "mps": lambda: gen.quantum_computing.matrix_product_state(
        n=8, phys_dim_min=2, phys_dim_max=4, bond_dim=4, seed=3),
}


def _cotengra_flops(inputs, output, sizes, max_time: float) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import cotengra

        opt = cotengra.HyperOptimizer(minimize="flops", max_repeats=128, max_time=max_time,
                                      parallel=False, progbar=False)
        tree = opt.search(inputs, output, sizes)
    return describe_path(tree.get_path(), inputs, output, sizes).flops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small networks (smoke run)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cotengra-time", type=float, default=10.0)
    args = parser.parse_args(argv)
    networks = TINY if args.tiny else FULL
    db = tq.connect()
    print(f"{torch.get_num_threads()} torch threads; float32; times are medians of "
          f"{args.repeat}")
    print("| network | tensors | labels | chosen FLOPs | cotengra FLOPs | ratio | "
          "opt_einsum auto-hq | tensorql | tq/opt_einsum |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratios, misses = [], []
    for name, make in networks.items():
        equation, shapes, *_ = make()
        lhs, rhs = equation.split("->")
        inputs = [tuple(part) for part in lhs.split(",")]
        output = tuple(rhs)
        sizes = {lab: int(n) for labels, shape in zip(inputs, shapes)
                 for lab, n in zip(labels, shape)}
        rng = np.random.default_rng(0)
        # mean-1 values over sqrt(size): each label's sum stays near 1, in float32 range
        arrays = [(rng.uniform(0.5, 1.5, size=s) / math.sqrt(math.prod(s))).astype(np.float32)
                  for s in shapes]
        tensors = [torch.from_numpy(a) for a in arrays]
        stored = [db.from_numpy(f"{name}_{n}", a, replace=True) for n, a in enumerate(arrays)]

        def ours(equation=equation, stored=stored):
            PATH_CACHE.clear()
            return tq.einsum(equation, *stored).torch()

        def theirs(equation=equation, tensors=tensors):
            return opt_einsum.contract(equation, *tensors, optimize="auto-hq", backend="torch")

        got, want = ours(), theirs()
        err = float((got - want).abs().max() / max(1e-30, float(want.abs().max())))
        t_theirs, t_ours = alternating_medians([theirs, ours], args.repeat)
        PATH_CACHE.clear()
        query = tq.einsum(equation, *stored)
        ((_, info),) = contraction_paths(query.node)
        ctg = _cotengra_flops(inputs, output, sizes, args.cotengra_time)
        ratio = t_ours / t_theirs
        ratios.append(ratio)
        if ratio > 1.3 or info.flops > 1.05 * ctg or err > 1e-3:
            misses.append(name)
        print(f"| {name} | {len(shapes)} | {len(sizes)} | {info.flops:.3g} | {ctg:.3g} | "
              f"{info.flops / ctg:.2f} | {t_theirs * 1e3:.1f} ms | {t_ours * 1e3:.1f} ms | "
              f"{ratio:.2f}x |  (rel. err {err:.1e})")
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    met = geo <= 1.0 and not misses
    print(f"geometric mean tq/opt_einsum: {geo:.2f}x (goal <= 1.0); misses: "
          f"{', '.join(misses) or 'none'}")
    print(f"goals: {'met' if met else 'MISSED'}")
    return 0 if met or args.tiny else 1


if __name__ == "__main__":
    sys.exit(main())
