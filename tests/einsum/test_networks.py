"""Real tensor networks from the ``einsum_benchmark`` generators, checked against opt_einsum.

Matrix chains, lattices, trees, random connected networks, MPS and MERA instances (several
with more than 52 labels, named by unicode symbols as opt_einsum names them) run through
``tq.einsum`` on random float64 data and must match ``opt_einsum.contract``.
"""

from __future__ import annotations

import numpy as np
import opt_einsum
import pytest

import tensorql as tq

generators = pytest.importorskip("einsum_benchmark.generators")


def _labels(equation: str) -> set[str]:
    return set(equation.split("->")[0].replace(",", ""))


NETWORKS = {
    "matrix_chain": lambda: generators.structured.matrix_chain(
        num_matrices=60, min_dim=2, max_dim=6, seed=0),
    "lattice": lambda: generators.structured.lattice((3, 3, 3), d_min=2, d_max=3, seed=1),
    "tree": lambda: generators.structured.tree(n=60, d_min=2, d_max=4, n_outer=2, seed=1),
    "random_connected": lambda: generators.random.connected_network(
        30, regularity=2.5, number_of_output_indices=2, min_axis_size=2, max_axis_size=4,
        seed=2),
    "random_regular": lambda: generators.random.regular(16, 3, d_min=2, d_max=3, seed=4),
    "mps": lambda: generators.quantum_computing.matrix_product_state(
        n=30, phys_dim_min=2, phys_dim_max=4, bond_dim=4, seed=3),
    "mera": lambda: generators.language_model.p_first_and_last(
        mera_depth=1, axis_size_hidden=3, axis_size_observable=5),
}


@pytest.mark.parametrize("name", sorted(NETWORKS))
def test_network_matches_opt_einsum(name):
    equation, shapes, *_ = NETWORKS[name]()
    rng = np.random.default_rng(sum(map(ord, name)))
    arrays = [rng.uniform(0.5, 1.5, size=shape) for shape in shapes]
    expected = opt_einsum.contract(equation, *arrays)
    db = tq.connect()
    tensors = [db.from_numpy(f"t{n}", array) for n, array in enumerate(arrays)]
    got = tq.einsum(equation, *tensors).numpy()
    assert got.shape == np.shape(expected)
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=0)


def test_networks_cover_more_than_52_labels():
    wide = [name for name, make in NETWORKS.items() if len(_labels(make()[0])) > 52]
    assert {"matrix_chain", "tree", "mps", "lattice"} <= set(wide)
