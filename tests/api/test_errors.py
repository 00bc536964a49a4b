"""Bad input gets a clear TensorQLError naming the problem and its place."""

from __future__ import annotations

import numpy as np
import pytest

import tensorql as tq


@pytest.fixture
def ab(db):
    return (db.from_numpy("A", np.ones((3, 4), dtype=np.float32)),
            db.from_numpy("B", np.ones((4, 5), dtype=np.float32)))


def test_output_label_not_in_inputs(ab):
    with pytest.raises(tq.ParseError) as err:
        tq.einsum("ij,jk->ix", *ab)
    assert "'x'" in str(err.value) and err.value.position == 8


def test_bad_character(ab):
    with pytest.raises(tq.ParseError) as err:
        tq.einsum("i-,jk->ik", *ab)  # digits and symbols are labels (as in opt_einsum)
    assert err.value.position == 1 and "'-'" in str(err.value)


def test_repeated_output_label(ab):
    with pytest.raises(tq.ParseError, match="appears twice"):
        tq.einsum("ij,jk->ii", *ab)


def test_size_mismatch_names_label_and_operands(ab):
    a, _ = ab
    with pytest.raises(tq.ShapeError) as err:
        tq.einsum("ij,ij->i", a, ab[1])
    message = str(err.value)
    assert "label 'i'" in message and "operand 0" in message and "operand 1" in message


def test_wrong_operand_count(ab):
    with pytest.raises(tq.ShapeError, match="names 2 operand"):
        tq.einsum("ij,jk->ik", ab[0])


def test_wrong_rank(ab):
    with pytest.raises(tq.ShapeError, match="operand 1 has 2 dim"):
        tq.einsum("ij,j->i", *ab)


@pytest.mark.parametrize("kwargs, word", [({"join": "xor"}, "join"), ({"agg": "mean"}, "agg")])
def test_unknown_join_or_agg(ab, kwargs, word):
    with pytest.raises(tq.UnknownOperatorError) as err:
        tq.einsum("ij,jk->ik", *ab, **kwargs)
    assert f"unknown {word}" in str(err.value) and "choose one of" in str(err.value)
    assert isinstance(err.value, tq.TensorQLError)


def test_unknown_tensor(db):
    db.from_numpy("known", np.ones(2))
    with pytest.raises(tq.UnknownTensorError) as err:
        db.tensor("missing")
    assert "'missing'" in str(err.value) and "'known'" in str(err.value)


def test_broadcast_error(db):
    a = db.from_numpy("a", np.ones((3, 4)))
    b = db.from_numpy("b", np.ones((3,)))
    with pytest.raises(tq.ShapeError, match="could not be broadcast"):
        a + b


def test_matmul_mismatch(ab):
    with pytest.raises(tq.ShapeError, match="inner sizes"):
        ab[1] @ ab[0]


def test_store_existing_name_changes_nothing(db, ab):
    with pytest.raises(tq.StorageError, match="already exists"):
        db.store("A", ab[0] * 2)
    np.testing.assert_array_equal(db.tensor("A").numpy(), np.ones((3, 4)))


def test_bad_tile(db):
    with pytest.raises(tq.ShapeError, match="tile"):
        db.from_numpy("t", np.ones((3, 3)), tile=(2,))
    assert "t" not in db.tensors()


def test_kernel_failure_names_step(db):
    a = db.from_numpy("a", np.ones((2, 2)))
    expr = a.relu()
    from tensorql.physical import kernels

    class Broken(kernels.MapChunk):
        def run(self, inputs, acc):
            raise RuntimeError("boom")

    plan = expr.compile()
    graph = plan.physical.task_graph()
    tasks = tuple(t if not isinstance(t.kernel, kernels.MapChunk) else
                  type(t)(t.id, t.inputs, t.output, Broken("relu", None, "float64"), t.priority)
                  for t in graph.tasks)
    from tensorql.exec.executor import Executor
    from tensorql.exec.taskgraph import TaskGraph

    with pytest.raises(tq.ExecutionError, match=r"Map relu failed on chunk \(0, 0\).*boom"):
        Executor(2, mode="threads").run(TaskGraph(tasks, graph.retain, graph.step_names))
    with pytest.raises(tq.ExecutionError, match=r"Map relu failed on chunk \(0, 0\).*boom"):
        Executor(2, mode="serial").run(TaskGraph(tasks, graph.retain, graph.step_names))


def test_options_errors():
    with pytest.raises(tq.OptionError, match="memory size"):
        tq.connect(memory_limit="lots")
    with pytest.raises(tq.OptionError, match="backend"):
        tq.connect(backend="spark")


def test_fewer_workers_get_more_torch_threads_each():
    from tensorql.options import Options, _default_workers

    cores = max(1, _default_workers())
    with tq.connect(workers=1) as db:  # derived from workers, not kept from the default
        assert db.options.intra_op_threads == cores
    assert Options(workers=2).with_(workers=1, intra_op_threads=3).intra_op_threads == 3


def test_an_expression_over_a_tensor_stored_again_reads_its_values_or_says_it_changed():
    """An expression keeps the layout its stored tensors had when it was built. Stored again
    with the same layout, it reads the new values; with another shape, dtype or tiling, its
    run is a StaleTensorError naming the tensor (not a kernel's shape error, not values cast
    behind the user's back) -- except on several devices, where a piece is read by its
    region and a new tiling of the same shape reads the right values."""
    with tq.connect() as db:
        x = db.from_numpy("sx", np.ones((8, 8), np.float32))
        doubled = x * 2.0
        db.from_numpy("sx", np.full((8, 8), 3.0, np.float32), replace=True)
        assert doubled.numpy()[0, 0] == 6.0
        for value, tile in ((np.full((8, 8), 3.0, np.float32), (4, 4)),
                            (np.full((4, 4), 3.0, np.float32), None),
                            (np.full((8, 8), 3.0, np.float64), None)):
            db.from_numpy("sx", value, replace=True, tile=tile)
            with pytest.raises(tq.StaleTensorError, match="'sx' changed since"):
                doubled.numpy()
            assert (db.tensor("sx") * 2.0).numpy()[0, 0] == 6.0  # built again: fine
    with tq.connect(devices=2) as db:
        x = db.from_numpy("sx", np.ones((8, 8), np.float32))
        doubled = x * 2.0
        db.from_numpy("sx", np.full((8, 8), 3.0, np.float32), replace=True, tile=(4, 4))
        np.testing.assert_array_equal(doubled.numpy(), np.full((8, 8), 6.0, np.float32))
        db.from_numpy("sx", np.full((4, 4), 3.0, np.float32), replace=True)
        with pytest.raises(tq.StaleTensorError, match="'sx' changed since"):
            doubled.numpy()


@pytest.mark.parametrize("devices", [1, 2])
def test_a_tensor_stored_again_with_fewer_dimensions_is_stale(devices):
    """Stored again with another number of dimensions (DROP/CREATE OR REPLACE TENSOR, or
    from_numpy), an expression over it raised the grid's ShapeError ("chunk key (0, 0) is
    outside grid blocks (1,)") on one device and, on two, read its regions through the new
    1-d grid (zip cut the region's dims): silently wrong values. Both are a StaleTensorError
    naming the tensor."""
    with tq.connect(devices=devices) as db:
        x = db.from_numpy("sx", np.arange(12.0).reshape(3, 4))
        doubled, total = x * 2.0, x.sum()
        db.sql("CREATE OR REPLACE TENSOR sx AS SELECT * FROM EINSUM('ij->j', sx)")
        for use in (doubled.numpy, total.item, x.numpy, lambda: np.add(x, 1)):
            with pytest.raises(tq.StaleTensorError, match="'sx' changed since"):
                use()
        np.testing.assert_array_equal(db.tensor("sx").numpy(), [12.0, 15.0, 18.0, 21.0])


@pytest.mark.parametrize("devices", [1, 2])
def test_a_tensor_stored_again_larger_with_the_same_tiles_is_stale(devices):
    """Stored again larger with the same tiling (3x4 -> 5x5 in 2x2 tiles), every old chunk
    key is still on the new grid: an index expression (a region), and on two devices any
    expression, read part of the new tensor in the old shape -- silently wrong. The pinned
    version's shape is checked against the plan's: a StaleTensorError naming the tensor."""
    with tq.connect(devices=devices) as db:
        x = db.from_numpy("gx", np.arange(12.0).reshape(3, 4), tile=(2, 2))
        row, doubled, total = x[0], x * 2.0, x.sum()
        np.testing.assert_array_equal(row.numpy(), [0.0, 1.0, 2.0, 3.0])
        bigger = np.arange(25.0).reshape(5, 5) + 100
        db.from_numpy("gx", bigger, tile=(2, 2), replace=True)
        for use in (row.numpy, doubled.numpy, total.item, x.numpy):
            with pytest.raises(tq.StaleTensorError, match="'gx' changed since.*5x5"):
                use()
        np.testing.assert_array_equal(db.tensor("gx")[0].numpy(), bigger[0])
        np.testing.assert_array_equal((db.tensor("gx") * 2.0).numpy(), bigger * 2)
