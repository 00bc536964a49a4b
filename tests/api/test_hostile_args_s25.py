"""Hostile arguments to public functions, from fuzzing (session 25): each is a TensorQLError
naming the argument (they were raw numpy / torch / DuckDB / Python errors), nothing stored
changes, and the demo commands answer bad numbers with a usage line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq
from tensorql.cli import main


@pytest.fixture
def db():
    session = tq.connect()
    session.from_numpy("A", np.ones((2, 3)))
    return session


FLAGS = [np.ones(2), torch.ones(2), "yes"]


@pytest.mark.parametrize("flag", FLAGS, ids=["ndarray", "tensor", "str"])
@pytest.mark.parametrize("call", [
    lambda db, f: db.from_numpy("A", np.zeros((2, 3)), replace=f),
    lambda db, f: db.from_torch("A", torch.zeros(2, 3), replace=f),
    lambda db, f: tq.from_dlpack(db, "A", torch.zeros(2, 3), replace=f),
    lambda db, f: db.store("A", db.tensor("A") * 2, replace=f),
    lambda db, f: db.store_many({"A": db.tensor("A") * 2}, replace=f),
    lambda db, f: tq.connect(read_only=f),
    lambda db, f: tq.optim.SGD(db, ["A"], lr=0.1, momentum=0.9, nesterov=f),
    lambda db, f: tq.connect(device_cache=f) if not isinstance(f, str) else tq.connect(
        device_cache=np.ones(1)),
], ids=["from_numpy", "from_torch", "from_dlpack", "store", "store_many", "read_only",
        "nesterov", "device_cache"])
def test_a_yes_no_argument_that_is_not_one_is_an_option_error(db, call, flag):
    with pytest.raises(tq.OptionError):
        call(db, flag)
    np.testing.assert_array_equal(db.tensor("A").numpy(), np.ones((2, 3)))
    assert db.tensors() == ["A"]


def test_optimizer_explain_takes_a_flag_and_a_loss(db):
    opt = tq.optim.SGD(db, ["A"], lr=0.1)
    loss = (opt.params()["A"] ** 2).sum()
    with pytest.raises(tq.OptionError, match="analyze"):
        opt.explain(loss, analyze=np.ones(2))
    with pytest.raises(tq.ShapeError, match="loss"):
        opt.explain(None)
    assert "EXPLAIN" in opt.explain(loss)


@pytest.mark.parametrize("call, error", [
    (lambda db: db.from_numpy("N", np.ones(4), tile=np.array(2)), tq.ShapeError),
    (lambda db: db.tensor("a\ud800"), tq.UnknownTensorError),
    (lambda db: db.drop("a\ud800"), tq.UnknownTensorError),
    (lambda db: tq.optim.SGD(None, ["A"]), tq.OptionError),
    (lambda db: tq.optim.Adam("db", ["A"]), tq.OptionError),
    (lambda db: tq.connect(distributed_exchange=np.ones(2)), tq.OptionError),
    (lambda db: tq.EinsumSpec.parse("ij->i", None), tq.ShapeError),
    (lambda db: tq.EinsumSpec.parse("ij->i", [None]), tq.ShapeError),
    (lambda db: db.tensor("A").__array__("abc"), tq.DTypeError),
    (lambda db: db.tensor("A").__array__(torch.float32), tq.DTypeError),
    (lambda db: db.sql("SELECT 1 AS x").create(torch.ones(2)), tq.TensorQLError),
    (lambda db: db.sql("SELECT 1 AS x").to_table(""), tq.TensorQLError),
], ids=["tile-0d", "tensor-surrogate", "drop-surrogate", "sgd-none", "adam-str",
        "exchange", "spec-none", "spec-none-shape", "array-dtype", "array-torch-dtype",
        "create-tensor-name", "create-empty-name"])
def test_hostile_arguments_are_named_errors(db, call, error):
    with pytest.raises(error):
        call(db)
    assert db.tensors() == ["A"]


def test_a_result_whose_session_closed_says_so_and_keeps_its_rows():
    session = tq.connect()
    result = session.sql("SELECT * FROM range(3)")
    session.close()
    with pytest.raises(tq.StorageError, match="closed"):
        result.relation()
    assert result.fetchall() == [(0,), (1,), (2,)]


@pytest.mark.parametrize("argv", [["train-demo", "--steps", "0"], ["demo", "--batch", "-1"],
                                  ["demo", "--batch", "0"], ["demo", "--width", "0"],
                                  ["distributed-demo", "--ranks", "0"]])
def test_demo_commands_refuse_counts_below_one_with_a_usage_line(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "must be an integer >= 1" in err and "Traceback" not in err


def test_demo_on_a_file_that_is_no_database_is_one_line(tmp_path, capsys):
    bad = tmp_path / "not.duckdb"
    bad.write_text("hello")
    assert main(["demo", "--db", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot open tensor database") and "Traceback" not in err


@pytest.mark.parametrize("call, error", [
    (lambda C, p: tq.optimize(C, 2, cache=[]), tq.PlanError),
    (lambda C, p: tq.optimize(C, 2, sources_everywhere=[]), tq.OptionError),
    (lambda C, p: p.layout("x"), tq.PlanError),
    (lambda C, p: p.layout(2**70), tq.PlanError),
    (lambda C, p: p.chunk_layout(0, None), tq.PlanError),
    (lambda C, p: p.reads(None), tq.PlanError),
], ids=["cache", "sources_everywhere", "layout-str", "layout-huge", "chunk_layout", "reads"])
def test_partition_plan_arguments_are_checked(db, call, error):
    C = db.tensor("A") @ db.tensor("A").T
    plan = tq.optimize(C, devices=2)
    with pytest.raises(error):
        call(C, plan)
    assert len(plan.reads([plan.layout(k) for k in range(len(plan.ops))])) > 0
